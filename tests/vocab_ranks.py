"""What each rank of `tests/engine/test_vocab_parallel.py` runs (spawned processes import this module
by name): the decide step's reductions on its shard of one set of logits, and the same functions of
engine/decoding/sampling.py on the whole logits, saved for the test to compare."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from engine.decoding import vocab_parallel as V
from engine.decoding.sampling import (
    CONF_MARGIN,
    CONF_NEG_ENTROPY,
    confidence,
    filter_min_p,
    filter_top_k_top_p,
    predict,
    token_logprobs,
)
from engine.models.parallel.group import TensorParallel, VocabShard, WireCount


def _shard(full: torch.Tensor, tp: TensorParallel) -> tuple[torch.Tensor, VocabShard]:
    start, real, padded = tp.padded_split(full.shape[-1])
    local = torch.full((*full.shape[:-1], padded), float("-inf"))
    local[..., :real] = full[..., start:start + real]
    return local, VocabShard(tp, start, real, full.shape[-1])


def _sampled(rows: list[int], seed: int, tau: float) -> list[tuple[int, torch.Generator, float]]:
    return [(row, torch.Generator().manual_seed(seed + row), tau) for row in rows]


def decide(case: dict[str, Any], tp: TensorParallel) -> dict[str, Any]:
    """Every reduction against its one-device counterpart, on random logits with the mask the best id
    at some positions."""
    batch, width, vocab, mask_id = case["batch"], case["width"], case["vocab"], case["mask_id"]
    full = torch.randn(batch, width, vocab, generator=torch.Generator().manual_seed(case["seed"])) * 3
    full[0, :, mask_id] += 20
    local, shard = _shard(full, tp)
    mask_rows = torch.arange(batch) % 2 == 1
    kinds = {CONF_NEG_ENTROPY: torch.arange(batch) == 1, CONF_MARGIN: torch.arange(batch) == 2}
    out: dict[str, Any] = {}
    for name, rows in (("greedy", None), ("editing", mask_rows)):
        before = WireCount.bytes
        got = V.predict_and_confidence(local, shard, _sampled(case["sampled"], case["seed"], 0.7), mask_id, rows, kinds)
        out[f"{name}_bytes"] = WireCount.bytes - before
        x0, unmasked = predict(full, _sampled(case["sampled"], case["seed"], 0.7), mask_id, mask_rows=rows)
        out[name] = (got, (x0, unmasked, confidence(full, x0, kinds)))
    top_k = torch.tensor([0, 3, 1, 7] * batch)[:batch]
    want = filter_top_k_top_p(full, top_k, torch.ones(batch), max_top_k=int(top_k.max()), any_top_p=False)
    got = V.filter_top_k(local, shard, top_k, int(top_k.max()))
    out["top_k"] = (got[..., :shard.real], want[..., shard.start:shard.start + shard.real])
    min_p = torch.tensor([0.0, 0.05, 0.3, 0.01] * batch)[:batch]
    out["min_p"] = (V.filter_min_p(local, shard, min_p)[..., :shard.real],
                    filter_min_p(full, min_p)[..., shard.start:shard.start + shard.real])
    tokens = torch.randint(vocab, (batch, width), generator=torch.Generator().manual_seed(1))
    out["logprobs"] = (V.token_logprobs(local, shard, tokens, 3), token_logprobs(full, tokens, 3))
    return out


def wire_bytes(case: dict[str, Any], tp: TensorParallel) -> dict[str, int]:
    """Bytes a rank receives for a greedy step's decide on its shard, and for gathering the logits."""
    batch, width, vocab = case["batch"], case["width"], case["vocab"]
    start, real, padded = tp.padded_split(vocab)
    local = torch.randn(batch, width, padded)
    shard = VocabShard(tp, start, real, vocab)
    before = WireCount.bytes
    V.predict_and_confidence(local, shard, [], case["mask_id"], None, {})
    reduced = WireCount.bytes - before
    before = WireCount.bytes
    shard.gather(local)
    return {"reduced": reduced, "gathered": WireCount.bytes - before}


def run(rank: int, size: int, port: int, path: str, job: str, case: dict[str, Any]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        torch.save(globals()[job](case, TensorParallel(rank, size)), Path(path) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()
