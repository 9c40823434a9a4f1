"""`Engine.generate`'s progress moves every step (a row counted by the share of its canvas committed),
so a long command's bar moves from its first seconds even when a batch's rows all finish together."""

from __future__ import annotations

import itertools
from pathlib import Path

from engine import DecodeParams, Engine, EngineConfig

MODEL = Path(__file__).resolve().parents[2] / "models" / "llada-tiny"


def test_progress_counts_each_row_by_its_canvas_committed():
    engine = Engine(EngineConfig(model=str(MODEL), threads=1))
    seen: list[float] = []
    params = DecodeParams(policy="fixed", gen_length=32, block_length=32, steps=32, early_exit=False)
    results = engine.generate(["00457+00038", "00023+00045"], params, on_progress=seen.append)
    assert len(seen) == results[0].stats.nfe == 32  # after every step
    assert seen[0] == 2 / 32  # one token a step of each row's 32
    assert all(a < b for a, b in itertools.pairwise(seen))
    assert seen[-1] == 2
