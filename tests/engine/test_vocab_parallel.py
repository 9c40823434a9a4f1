"""The decide step on vocabulary-parallel logits (engine/decoding/vocab_parallel.py), on gloo ranks:
every reduction gives what the one-device function gives on the whole logits (tokens exactly,
confidences and log-probabilities to rounding), and a step's decide moves a few numbers per position
where gathering the logits moves the whole vocabulary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from conftest import FIXTURES
from serverproc import free_port
from vocab_ranks import run


def _on_ranks(size: int, job: str, case: dict[str, Any], tmp_path: Path) -> list[Any]:
    mp.spawn(run, args=(size, free_port(), str(tmp_path), job, case), nprocs=size)
    return [torch.load(tmp_path / f"{rank}.pt") for rank in range(size)]


def test_every_reduction_equals_the_whole_vocabularys(tmp_path: Path) -> None:
    # 3 ranks on a vocabulary of 37: the last shard holds padding; the mask id on the first shard
    case = {"batch": 4, "width": 6, "vocab": 37, "mask_id": 2, "seed": 5, "sampled": [1, 2]}
    ranks = _on_ranks(3, "decide", case, tmp_path)
    for name in ("greedy", "editing"):
        for got in ranks:  # every rank decides alike
            (x0, unmasked, conf), (want_x0, want_unmasked, want_conf) = got[name]
            assert torch.equal(x0, want_x0) and torch.equal(unmasked, want_unmasked), name
            torch.testing.assert_close(conf, want_conf, rtol=1e-5, atol=1e-6)
    assert (ranks[0]["greedy"][1][0][0] != case["mask_id"]).all()  # the mask, best there, is never predicted
    for rank in ranks:
        for name in ("top_k", "min_p"):
            got, want = rank[name]
            assert torch.equal(got, want), name
        (chosen, top, ids), (want_chosen, want_top, want_ids) = rank["logprobs"]
        torch.testing.assert_close(chosen, want_chosen, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(top, want_top, rtol=1e-5, atol=1e-5)
        assert torch.equal(ids, want_ids)


def test_a_step_moves_a_few_numbers_per_position_not_the_vocabulary(tmp_path: Path) -> None:
    """LLaDA2's vocabulary (its released config), 8 rows of a 32-token block, TP 2: at least 50x fewer
    bytes than the full-logit gather (a few KB against 80 MB received by each rank)."""
    real = FIXTURES / "real" / "llada2.0-mini"
    vocab = json.loads((real / "dfactory_llada2_mini_config.json").read_text())["vocab_size"]
    mask_id = json.loads((real / "generate_defaults.json").read_text())["llada2.0_generate_defaults"]["mask_id"]
    case = {"batch": 8, "width": 32, "vocab": vocab, "mask_id": mask_id}
    for moved in _on_ranks(2, "wire_bytes", case, tmp_path):
        assert moved["gathered"] == 8 * 32 * -(-vocab // 2) * 4
        assert moved["reduced"] * 50 <= moved["gathered"], moved
