"""The official decoders' golden runs (tests/fixtures/golden), reproduced by our engine.

Every golden file is either reproduced here or listed in NOT_REPRODUCED with the reason, so a new
fixture cannot be skipped silently.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import FIXTURES, generate

from engine.decoding import DecodeParams

NOT_REPRODUCED = {
    "dream_origin_steps16_seed0": "alg='origin' commits at random from torch's global RNG; not a policy we serve",
    "dream_origin_steps32_seed0": "alg='origin' commits at random from torch's global RNG; not a policy we serve",
    "fastdllm_dream_nocache_confthr0p9_steps4": "Fast-dLLM's batch-1 whole-canvas carry-over threshold "
                                                "(generation_utils.py) is not implemented; its block decoder is",
    "fastdllm_dream_nocache_confthr0p5_steps4": "as above",
}

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


def _golden_names() -> list[str]:
    return [p.stem for p in _golden_files(FIXTURES)]


def test_every_golden_file_is_accounted_for(fixtures):
    names = {p.stem for p in _golden_files(fixtures)}
    assert len(names) == 41
    assert set(NOT_REPRODUCED) <= names


@pytest.mark.parametrize("name", [n for n in _golden_names() if n not in NOT_REPRODUCED])
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


def test_golden_per_step_commits_match_llada(fixtures, llada_model):
    golden = json.loads((fixtures / "golden" / "fastdllm_nocache_thr0p7.json").read_text())
    settings = golden["settings"]
    [result] = generate(llada_model, golden["prompt_ids"],
                        DecodeParams(policy="threshold", threshold=0.7, gen_length=32, block_length=8,
                                     steps=settings["steps"], early_exit=False))
    assert result.stats.tokens_per_step == golden["tokens_committed_per_forward"]
