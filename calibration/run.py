"""`cai-dllm calibrate`'s work: decode the items with every candidate of a search stage in one
batched run, grade them, and write the chosen knobs as a decoding profile."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

from calibration.data import Grader, Item, data_sha256
from calibration.search import Measure, Measurement, SearchResult, search
from engine.chat import chat_prompt_ids
from engine.decoding import DecodeParams
from engine.decoding.profiles import DecodingProfile
from engine.engine import Engine
from engine.user_text import encode_prompt_text


def prompt_ids(engine: Engine, item: Item) -> list[int]:
    if "messages" in item.data:
        return chat_prompt_ids(engine.tokenizer, item.data["messages"], mask_id=engine.model.special.mask_id)
    return encode_prompt_text(engine.tokenizer, item.data["prompt"], engine.model.special.mask_id)


def make_measure(engine: Engine, items: Sequence[Item], grader: Grader, gen_length: int,
                 on_progress: Optional[Callable[[float], None]] = None) -> Measure:
    """A `measure` for the search: every candidate x every item in one `Engine.generate` call, so
    rows of different candidates share the batch; `on_progress(done)` after each step, `done` the
    (candidate, item) decodes of this call finished, one under way counted by its canvas committed."""
    if engine.tokenizer is None:
        raise ValueError("calibration needs the checkpoint's tokenizer")
    prompts = [prompt_ids(engine, item) for item in items]

    def measure(candidates: Sequence[dict[str, Any]]) -> list[Measurement]:
        params = [engine.default_params(DecodeParams.from_dict({**knobs, "gen_length": gen_length}))
                  for knobs in candidates]
        results = engine.generate([p for _ in candidates for p in prompts],
                                  [p for p in params for _ in prompts],
                                  on_progress=on_progress)
        out = []
        for c in range(len(candidates)):
            chunk = results[c * len(items):(c + 1) * len(items)]
            correct = sum(grader(r.text or "", item.data) for r, item in zip(chunk, items, strict=True))
            out.append(Measurement(correct / len(items), sum(r.stats.nfe for r in chunk) / len(items)))
        return out

    return measure


def reference_knobs(block_length: int) -> dict[str, Any]:
    """The fixed decoder: one token a step, every step of the canvas (no early exit)."""
    return {"policy": "fixed", "block_length": block_length, "early_exit": False}


def calibrate(engine: Engine, items: Sequence[Item], grader: Grader, grader_name: str, name: str,
              objective: str = "nfe", tolerance: float = 0.01, budget: Optional[float] = None,
              gen_length: int = 128, block_length: int = 32, cache: str = "dual", refresh_interval: int = 0,
              theta_s_grid: Optional[Sequence[float]] = None, theta_e_grid: Optional[Sequence[float]] = None,
              on_stage: Optional[Callable[[str, int], None]] = None,
              on_progress: Optional[Callable[[float], None]] = None) -> tuple[DecodingProfile, SearchResult]:
    # no `steps`: it follows the canvas (one a position), so the profile fits any max_tokens
    base: dict[str, Any] = {"block_length": block_length, "cache": cache}
    if cache == "dual" and refresh_interval:
        base["refresh_interval"] = refresh_interval
    grids = {k: v for k, v in (("theta_s_grid", theta_s_grid), ("theta_e_grid", theta_e_grid)) if v}
    result = search(make_measure(engine, items, grader, gen_length, on_progress), reference_knobs(block_length),
                    base, objective=objective, tolerance=tolerance, budget=budget, on_stage=on_stage, **grids)
    best, ref = result.best.measurement, result.reference.measurement
    validation = {
        "items": len(items), "data_sha256": data_sha256(items, grader_name), "grader": grader_name,
        "gen_length": gen_length, "objective": objective, "tolerance": tolerance, "budget": budget,
        "feasible": result.feasible, "accuracy": best.accuracy, "nfe_per_item": best.nfe,
        "reference": {"decoding": result.reference.knobs, "accuracy": ref.accuracy, "nfe_per_item": ref.nfe},
        "trials": [t.as_dict() for t in result.trials],
    }
    profile = DecodingProfile(name, dict(result.best.knobs), model=engine.config.model, validation=validation)
    return profile, result
