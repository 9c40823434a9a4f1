"""The official decoders' golden runs (tests/fixtures/golden), reproduced by our engine.

Every golden file is either reproduced here or left out with the reason its settings give
(`_not_reproduced`), so a new fixture cannot be skipped silently. Names, sizes and settings come
from the files: the tests run unchanged on another fixture set of the same layout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import pytest
from conftest import FIXTURES, generate

from engine.decoding import DecodeParams


def _not_reproduced(name: str, settings: dict[str, Any]) -> Optional[str]:
    """Why the engine does not reproduce this run, read from its settings; None when it does."""
    if settings.get("alg") == "origin":
        return "alg='origin' commits at random from torch's global RNG; not a policy we serve"
    if name.startswith("fastdllm_dream") and settings.get("alg") == "confidence_threshold" \
            and "block_length" not in settings:
        return ("Fast-dLLM's batch-1 whole-canvas carry-over threshold (generation_utils.py) is not implemented; "
                "its block decoder is")
    return None


_CACHE = {"nocache": "none", "prefixcache": "prefix", "dualcache": "dual"}


def _params(name: str, settings: dict) -> tuple[dict, bool]:
    """DecodeParams fields for a golden run, and whether its prompts carry left padding to strip."""
    common = {"early_exit": False}
    if name.startswith("llada_generate"):
        common.update(policy="fixed", gen_length=settings["gen_length"], block_length=settings["block_length"],
                      steps=settings["steps"], cfg_scale=settings.get("cfg_scale", 0.0))
        # The HF modeling ignores attention_mask: its pads are ordinary tokens, as when we get no mask.
        return common, "v5975047" in name
    if name.startswith("fastdllm_dream"):
        cache = _CACHE[name.split("_")[2]]
        alg = settings["alg"]
        common.update(gen_length=settings["max_new_tokens"], steps=settings["steps"], cache=cache)
        if alg == "confidence_threshold":
            common.update(policy="threshold", threshold=settings["threshold"])
        else:
            common.update(policy=f"dream-{alg}")
        if "block_length" in settings:
            common.update(block_length=settings["block_length"], commit_first_at_block_start=True)
        return common, False
    if name.startswith("fastdllm"):
        cache = _CACHE[name.split("_")[1]]
        common.update(gen_length=settings["gen_length"], block_length=settings["block_length"],
                      steps=settings["steps"], cache=cache)
        if settings.get("threshold") is None:
            common.update(policy="fixed")
        else:
            common.update(policy="threshold", threshold=settings["threshold"])
        return common, False
    if name.startswith("dream_"):
        common.update(policy=f"dream-{settings['alg']}", gen_length=settings["max_new_tokens"],
                      steps=settings["steps"], eps=settings["eps"], top_p=settings.get("top_p"),
                      top_k=settings.get("top_k"))
        return common, isinstance(settings.get("attention_mask"), list)
    raise AssertionError(f"no mapping for golden run {name}")


def _golden_files(fixtures: Path) -> list[Path]:
    return sorted((fixtures / "golden").glob("*.json"))


def _settings(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())["settings"]


REPRODUCED = [p.stem for p in _golden_files(FIXTURES) if _not_reproduced(p.stem, _settings(p)) is None]


def test_every_golden_file_is_accounted_for(fixtures):
    """Each run maps to engine knobs or is left out with a reason; both families have runs reproduced."""
    files = _golden_files(fixtures)
    assert files
    for path in files:
        if _not_reproduced(path.stem, _settings(path)) is None:
            _params(path.stem, _settings(path))  # raises for a run no mapping covers
    assert any(n.startswith("llada_generate") for n in REPRODUCED)
    assert any(n.startswith(("dream", "fastdllm_dream")) for n in REPRODUCED)


@pytest.mark.parametrize("name", REPRODUCED)
def test_golden_run_reproduced(name, fixtures, llada_model, dream_model):
    golden = json.loads((fixtures / "golden" / f"{name}.json").read_text())
    settings = golden["settings"]
    fields, strip_pads = _params(name, settings)
    model = dream_model if name.startswith(("dream", "fastdllm_dream")) else llada_model
    prompts = golden["prompt_ids"]
    if strip_pads:
        mask = settings["attention_mask"]
        prompts = [[t for t, keep in zip(p, m, strict=True) if keep] for p, m in zip(prompts, mask, strict=True)]
    results = generate(model, prompts, DecodeParams(**fields))
    assert [r.generated_ids for r in results] == golden["generated_ids"]

    expected_nfe = golden.get("nfe", golden.get("nfe_counted"))
    # Fast-dLLM's cached loops check for completion after a forward, so a block filled by its first
    # forward costs one more forward that commits nothing; we skip that forward.
    idle = sum(1 for n in golden.get("tokens_committed_per_forward", []) if n == 0)
    for result in results:
        assert result.stats.nfe == expected_nfe - idle
    if idle:
        assert name.startswith(("fastdllm_prefixcache", "fastdllm_dualcache"))


THRESHOLD_RUNS = [p.stem for p in _golden_files(FIXTURES)
                  if p.stem.startswith("fastdllm_nocache") and _settings(p).get("threshold") is not None]


@pytest.mark.parametrize("name", THRESHOLD_RUNS)
def test_golden_per_step_commits_match_llada(name, fixtures, llada_model):
    """Fast-dLLM's no-cache threshold decoder: the tokens committed by every forward, not only the sum."""
    golden = json.loads((fixtures / "golden" / f"{name}.json").read_text())
    fields, _ = _params(name, golden["settings"])
    [result] = generate(llada_model, golden["prompt_ids"], DecodeParams(**fields))
    assert result.stats.tokens_per_step == golden["tokens_committed_per_forward"]
