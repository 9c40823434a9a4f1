"""Calls rank 0 makes on every rank at once (`TensorParallelEngine.collective_rpc`, vLLM's idea): a
function named `module:function`, run by each rank on its `Replica` with the same arguments, in the
same order relative to the steps. A call whose work runs a forward must be made on every rank, or
the collectives inside it wait for the ranks that were not asked."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.engine import Engine
from engine.scoring import ScoringJob


@dataclass
class Replica:
    """One rank's engine and what calls keep between them."""

    engine: Engine
    rank: int
    scoring: dict[int, ScoringJob] = field(default_factory=dict)


def advance_scoring(replica: Replica, key: int, prompt_ids: list[int], samples: int, seed: int,
                    chunk_tokens: int) -> None:
    """A worker's forward of scoring job `key`, which rank 0 runs at the same time: the job is drawn
    from the same seed on every rank, so its chunks are the same forwards. Jobs run one at a time
    (server/scoring_jobs.py), so a new key drops any job rank 0 abandoned."""
    job = replica.scoring.get(key)
    if job is None:
        job = ScoringJob(replica.engine.model, prompt_ids, samples, seed, chunk_tokens=chunk_tokens)
        replica.scoring = {key: job}
    job.advance()
    if job.done:
        del replica.scoring[key]


def state_digest(replica: Replica) -> str:
    """A hash of what this rank's steps decided: its scheduler's rows and slots, the canvases (every
    committed token), the device tensors of the decode tables (knobs, CAI state) and the prefix
    cache's blocks. Equal on every rank while they are in step."""
    engine = replica.engine
    digest = hashlib.sha256()
    scheduler = engine.scheduler
    digest.update(repr(([(r.request_id, r.slot) for r in scheduler.running],
                        [r.request_id for r in scheduler.waiting])).encode())
    digest.update(engine.slots.canvas.cpu().numpy().tobytes())
    slots = engine.slots
    tables = {**{f"knobs.{kind.__name__}": table for kind, table in slots.knobs.items()},
              **{f"state.{name}": value for name, value in slots.state.items()}}
    for name, value in sorted(tables.items()):
        digest.update(name.encode() + value.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    if engine.prefix_cache is not None:  # the blocks cached, in LRU order: each rank's decisions alike
        digest.update(b"".join(engine.prefix_cache.blocks))
    return digest.hexdigest()


def call_result(replica: Replica, value: Any) -> Any:
    """`value` back from every rank (a test of the call path itself)."""
    return value
