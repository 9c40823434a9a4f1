"""--quantization at TP2 (CPU, gloo): its own module, because a process holds one tensor-parallel
engine at a time and tests/engine/test_tensor_parallel.py keeps one per fixture family alive."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fixture_checkpoints import block_fixture
from test_tensor_parallel import SIZE, Family, _forward_cases, skip_unless_splittable

from engine import EngineConfig, load_model, start_engine
from engine.errors import TensorParallelError


def test_quantized_experts_at_tp2_track_the_float_model(tmp_path: Path) -> None:
    """--quantization int8 at TP2 on the fixtures' MoE model: every rank's routed experts quantized,
    the logits as far from the float model's as TP1's int8 logits are. (A row-parallel layer's rows are
    quantized per rank, over that rank's columns: not TP1's scales, so not TP1's int8 numbers.)"""
    pytest.importorskip("torchao", reason="int8 needs torchao (pip install 'cai-dllm[quant]')")
    checkpoint = block_fixture("llada2", tmp_path)
    skip_unless_splittable("llada2", checkpoint)
    engine = start_engine(EngineConfig(model=str(checkpoint), tensor_parallel_size=SIZE, quantization="int8"))
    try:
        assert engine.collective_rpc("tp_calls:experts_quantized", results=True) == [True] * SIZE
        [(args, kwargs)] = _forward_cases(Family("llada2", checkpoint, None, None))[:1]
        with torch.no_grad():
            want = load_model(checkpoint)(*args, **kwargs)
            one_rank = load_model(checkpoint, quantization="int8")(*args, **kwargs)
        [got] = engine.collective_rpc("tp_calls:forward", args, kwargs)
    finally:
        engine.close()

    def error(logits: torch.Tensor) -> float:
        return ((logits - want).norm() / want.norm()).item()

    assert 0 < error(got) < 1.2 * error(one_rank)  # ~0.142 both on the fixture (its routing flips a few experts)
    assert ((got - one_rank).norm() / one_rank.norm()).item() < 0.02  # ~0.008: the per-rank scales


def test_a_second_tensor_parallel_engine_in_one_process_is_refused(tmp_path: Path) -> None:
    checkpoint = block_fixture("llada2", tmp_path)
    skip_unless_splittable("llada2", checkpoint)
    engine = start_engine(EngineConfig(model=str(checkpoint), tensor_parallel_size=SIZE))
    try:
        with pytest.raises(TensorParallelError, match="already holds a tensor-parallel engine"):
            start_engine(EngineConfig(model=str(checkpoint), tensor_parallel_size=SIZE))
        assert engine.collective_rpc("engine.executor.calls:call_result", 7, results=True) == [7] * SIZE
    finally:
        engine.close()
