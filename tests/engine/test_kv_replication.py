"""Tensor parallelism past a model's KV heads (gloo on CPU): at a size that is a multiple of the KV
heads, each KV head is replicated over size / kv ranks (`TensorParallel.kv_split`), each rank loading
only its head's rows of the checkpoint's K and V. The fixture families with fewer KV heads than ranks
give TP1's logits and tokens, every decoding policy and seeded sampling alike; a size that neither divides nor is a
multiple of the KV heads is refused naming both rules.

The size is twice the fixture's KV heads (4 on the shared set); a fixture set whose heads that size
cannot share is skipped, saying why.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import FIXTURES
from fixture_checkpoints import block_fixture
from safetensors.torch import load_file

from engine import DecodeParams, Engine, EngineConfig, load_model, start_engine
from engine.decoding.registry import BLOCK, MASKED, POLICIES
from engine.errors import TensorParallelError
from engine.models.parallel.group import TensorParallel
from engine.models.parallel.sharding import check_divisible
from engine.models.registry import model_class_for

LOGITS_TOLERANCE = 1e-5


def _checkpoint(name: str, tmp: Path) -> Path:
    return FIXTURES / "dream_tiny" if name == "dream" else block_fixture(name, tmp)


def _prompts(name: str) -> list[list[int]]:
    """Two prompts of the family's golden runs."""
    runs = sorted(FIXTURES.glob("golden/dream_*.json")) if name == "dream" else \
        sorted((FIXTURES / "block" / name / "golden").glob("*.json"))
    prompts: list[list[int]] = []
    for path in runs:
        ids = json.loads(path.read_text())["prompt_ids"]
        for prompt in ids if isinstance(ids[0], list) else [ids]:
            if prompt not in prompts:
                prompts.append(prompt)
    return prompts[:2]


def test_kv_split_replicates_each_head_over_size_over_kv_ranks() -> None:
    assert [TensorParallel(rank, 4).kv_split(8) for rank in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [TensorParallel(rank, 8).kv_split(4) for rank in range(8)] == [(r // 2, 1) for r in range(8)]
    assert [TensorParallel(rank, 4).kv_split(1) for rank in range(4)] == [(0, 1)] * 4


def test_a_size_neither_dividing_nor_a_multiple_of_the_kv_heads_is_refused_naming_both_rules() -> None:
    hf = json.loads((FIXTURES / "dream_tiny" / "config.json").read_text())
    config = replace(model_class_for(hf).parse_config(hf), hidden_size=96, intermediate_size=96)
    check_divisible(replace(config, num_heads=12, num_kv_heads=4), 4)  # divides the KV heads
    check_divisible(replace(config, num_heads=16, num_kv_heads=2), 8)  # a multiple of them
    with pytest.raises(TensorParallelError) as err:
        check_divisible(replace(config, num_heads=12, num_kv_heads=4), 6)
    assert "does not divide the model's 4 KV heads" in str(err.value)
    assert "divides or is a multiple of its 4 KV heads" in str(err.value)


@pytest.fixture(scope="module", params=["dream", "sdar", "llada2"])
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    name = request.param
    checkpoint = _checkpoint(name, tmp_path_factory.mktemp(name))
    hf = json.loads((checkpoint / "config.json").read_text())
    config = model_class_for(hf).parse_config(hf)
    size = 2 * config.num_kv_heads
    try:
        check_divisible(config, size)
    except TensorParallelError as err:
        pytest.skip(f"this fixture set's {name} model cannot be split {size} ways: {err}")
    engine = start_engine(EngineConfig(model=str(checkpoint), tensor_parallel_size=size, max_batch=4))
    yield name, checkpoint, engine
    engine.close()


def test_logits_past_the_kv_heads_equal_tp1(family: Any) -> None:
    name, checkpoint, engine = family
    if name == "dream":
        data = load_file(FIXTURES / "dream_forward.safetensors")
        args, kwargs = (data["input_ids"],), {}
    else:
        data = load_file(sorted((FIXTURES / "block" / name).glob("*_forward.safetensors"))[0])
        mask = data["attention_mask"] if "attention_mask" in data else data["attention_mask_block"][:, 0]
        allowed = (mask[0, 0] == 1) if "attention_mask" in data else (mask[0, 0] == 0)
        args, kwargs = (data["input_ids"], data["position_ids"]), {"block_size": int(allowed.sum())}
    with torch.no_grad():
        want = load_model(checkpoint)(*args, **kwargs)
    [got] = engine.collective_rpc("tp_calls:forward", args, kwargs)
    assert (got - want).abs().max().item() <= LOGITS_TOLERANCE * max(1.0, want.std().item())


def test_tokens_past_the_kv_heads_equal_tp1(family: Any) -> None:
    """Every decoding policy of the family's mode in one batch (logprobs and top-k on some: each rank
    decides on its vocabulary shard, engine/decoding/vocab_parallel.py), then seeded sampling: TP1's
    tokens."""
    name, checkpoint, engine = family
    prompts = _prompts(name)
    mode = BLOCK if name in ("sdar", "llada2") else MASKED
    policies = [policy for policy, p in POLICIES.items() if mode in p.modes]
    every = [DecodeParams(policy=policy, gen_length=16, threshold=0.5, logprobs=2 if i % 2 else None,
                          top_k=3 if i % 3 == 1 else 0, ignore_eos=True) for i, policy in enumerate(policies)]
    reference = Engine(EngineConfig(model=str(checkpoint), max_batch=4))
    batch = [prompts[i % len(prompts)] for i in range(len(policies))]
    want = reference.generate(batch, every)
    got = engine.generate(batch, every)
    for mine, theirs, p in zip(got, want, every, strict=True):
        assert mine.generated_ids == theirs.generated_ids, (name, p.policy)
        if p.logprobs:
            assert [t.token_id for t in mine.logprobs] == [t.token_id for t in theirs.logprobs], (name, p.policy)
    sampled = DecodeParams(gen_length=16, temperature=0.8, seed=7)
    want_ids = [r.generated_ids for r in reference.generate(prompts, sampled)]
    assert [r.generated_ids for r in engine.generate(prompts, sampled)] == want_ids, name
