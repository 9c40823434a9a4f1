"""Every golden decoding run of the official block-diffusion decoders (fixtures `block/*/golden`),
reproduced through the engine token for token and NFE for NFE.

Each run's checkpoint, prompts, block length, steps, threshold, strategy, mask and stop ids come
from its file; the stop ids reach the engine as the checkpoint's end ids (a temporary copy of the
checkpoint whose config says so), as a real checkpoint gives them. Runs the engine does not
reproduce by design are skipped with the reason (`_skip_reason`).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any, Optional

import pytest
from conftest import FIXTURES

from engine import DecodeParams, Engine, load_model
from engine.decoding.types import GenerationResult
from engine.models.block_transformer import BlockDiffusionTransformer

GOLDEN = sorted(FIXTURES.glob("block/*/golden/*.json"))


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _rows(prompt_ids: list) -> list[list[int]]:
    return prompt_ids if isinstance(prompt_ids[0], list) else [prompt_ids]


def _sdar_kwargs(run: dict) -> dict[str, Any]:
    return run["settings"]["call_kwargs"]


def _stop_ids(run: dict) -> list[int]:
    """The ids that end a row: SDAR's stopping criteria, LLaDA2's eos id."""
    if "call_kwargs" in run["settings"]:
        return list(_sdar_kwargs(run).get("stopping_criteria_idx") or [])
    return [run["settings"]["eos_id"]]


def _skip_reason(run: dict) -> Optional[str]:
    quirk = [f for f in run.get("flags") or [] if not f["effect"].startswith("none")]
    if quirk:
        return ("decoder A's overwrite quirk changes tokens in this run (its top-k also picks non-mask "
                f"positions and rewrites them: {quirk[0]['effect']}); the engine runs the guarded decoder, "
                "whose twin runs (hfbd3_*) it reproduces (docs/decoding.md)")
    version = run.get("code_version")
    if version == "v20p":
        return ("the unpatched LLaDA2.0 file samples at temperature 0 (torch.multinomial at temperature 1); "
                "the engine's temperature 0 is greedy, as the patched runs are")
    settings, prompts = run["settings"], _rows(run["prompt_ids"])
    if settings.get("eos_early_stop") and not _llada21(run) and any(
            settings["eos_id"] in p and r == p[:len(r)] for r, p in zip(run["returned_ids"], prompts, strict=True)):
        return ("LLaDA2.0's in-loop eos_early_stop looks for the first eos over the whole window: an eos id "
                "inside the prompt returns a cut prompt; the engine reads generated positions only "
                "(docs/decoding.md)")
    return None


def _llada21(run: dict) -> bool:
    """LLaDA2.1's decoder: the official file (v21p, its additive 0/1 mask) or the .log() variant (v21log)."""
    return run.get("code_version") in ("v21p", "v21log")


def _params(run: dict, cache: Optional[str] = None) -> DecodeParams:
    """The run's settings as engine knobs; `cache` None: the run's own mode (the exact cache, or no
    cache for LLaDA2.1's additive mask)."""
    settings = run["settings"]
    common: dict[str, Any] = {"gen_length": settings["gen_length"], "block_length": settings["block_length"],
                              "ignore_eos": not _stop_ids(run), "temperature": 0.0}
    # the engine's `steps` counts over the canvas's blocks; the official decoders' is per block
    blocks = -(-settings["gen_length"] // settings["block_length"])
    if "call_kwargs" in settings:  # SDAR's decoders A and B
        kwargs = _sdar_kwargs(run)
        if "remasking_strategy" in kwargs:
            policy = {"low_confidence_static": "block-static", "low_confidence_dynamic": "block-dynamic",
                      "sequential": "block-sequential"}[kwargs["remasking_strategy"]]
            threshold = kwargs.get("confidence_threshold")
        else:  # decoder B: a threshold below 1 selects its dynamic branch
            threshold = kwargs["threshold"]
            policy = "block-dynamic" if threshold < 1.0 else "block-static"
        extra = {"threshold": threshold} if policy == "block-dynamic" else {}
        return DecodeParams(policy=policy, steps=kwargs["denoising_steps"] * blocks, store_pass=True,
                            **extra, **common)
    if _llada21(run):  # steps is unused by LLaDA2.1's loop; its early stop is the engine's default block end
        official = run["code_version"] == "v21p"
        common["early_exit"] = bool(settings.get("eos_early_stop", False))
        return DecodeParams(policy="block-edit", threshold=settings["threshold"],
                            editing_threshold=settings["editing_threshold"],
                            max_post_steps=settings["max_post_steps"],
                            num_to_transfer=settings.get("num_to_transfer", 1),
                            block_attention="additive_01" if official else "block_causal", cache=cache, **common)
    steps = min(settings["steps"], settings["gen_length"] // settings.get("minimal_topk", 1))  # LLaDA2.0
    return DecodeParams(policy="block-dynamic", steps=steps * blocks, threshold=settings["threshold"],
                        eos_early_stop=bool(settings.get("eos_early_stop", False)), cache=cache, **common)


@cache
def _model(checkpoint: Path, mask_id: int, end_ids: tuple[int, ...], tmp: Path) -> BlockDiffusionTransformer:
    """The checkpoint, with `end_ids` (and the mask id) as its special ids."""
    dest = tmp / f"{checkpoint.name}-{'-'.join(map(str, end_ids)) or 'none'}"
    dest.mkdir(exist_ok=True)
    config = json.loads((checkpoint / "config.json").read_text())
    config["mask_token_id"] = mask_id
    generation = {"eos_token_id": list(end_ids) or config.get("eos_token_id", config.get("pad_token_id"))}
    if not end_ids and "eos_token_id" not in config:
        config["eos_token_id"] = config.get("pad_token_id")  # ignore_eos runs: any id, never read
    (dest / "config.json").write_text(json.dumps(config))
    (dest / "generation_config.json").write_text(json.dumps(generation))
    for weights in checkpoint.glob("*.safetensors"):
        if not (dest / weights.name).exists():
            (dest / weights.name).symlink_to(weights)
    return load_model(dest)


def _checkpoint(path: Path, run: dict) -> Path:
    family = path.parents[1]
    if "model" in run:
        return family / run["model"]
    [only] = [p.parent for p in sorted(family.glob("*/config.json"))]
    return only


def _expected(run: dict, row: int) -> list[int]:
    """The row's response as the engine returns it: up to and including its first stop id, at most
    gen_length tokens (the official decoders decode the whole rounded canvas). LLaDA2's decoders
    return either the generated tokens or (LLaDA2.0's in-loop eos_early_stop) `x[:, :eos_pos + 1]`,
    the prompt included: the response is read from the run's final window instead, which holds both."""
    gen_length = run["settings"]["gen_length"]
    prompt = _rows(run["prompt_ids"])[row]
    if "generated_ids" in run:
        generated = _rows(run["generated_ids"])[row]
    elif "trace_model_inputs_then_final" in run:
        final = _rows(run["trace_model_inputs_then_final"][-1])[row]
        generated = final[len(prompt):]
    else:
        generated = run["returned_ids"][row]
    generated = generated[:gen_length]
    stops = set(_stop_ids(run))
    end = next((i for i, t in enumerate(generated) if t in stops), None)
    expected = generated if end is None else generated[:end + 1]
    if "returned_ids" in run:  # what the official call returned: the response, after the prompt or not
        returned = run["returned_ids"][row]
        assert returned[-len(expected):] == expected or returned[len(prompt):][:gen_length] == expected
    return expected


def _row_nfe(run: dict, row: int) -> int:
    """NFE of one row. Batch 1: the run's. A batch run of decoder B feeds every row until all rows'
    blocks are full: a row's own forwards are the prefill, the store passes and the denoising
    forwards that committed one of its tokens (each commits at least one while masks remain)."""
    if isinstance(run["nfe"], list):
        return run["nfe"][row]
    if len(_rows(run["prompt_ids"])) == 1:
        return run["nfe"]
    kinds, commits = run["forward_kinds"], run["tokens_committed_per_forward"]
    return sum(1 for kind, c in zip(kinds, commits, strict=True) if kind != "denoise" or c[row] > 0)


def _through_end(result: GenerationResult) -> list[int]:
    """The response up to and including its first end token (with early_exit off the engine returns
    the whole response and marks the end; the official decoders cut after it)."""
    ids = result.generated_ids
    return ids if result.end_index is None else ids[:result.end_index + 1]


def _check(path: Path, run: dict, tmp: Path, cache: Optional[str] = None) -> None:
    model = _model(_checkpoint(path, run), run["settings"]["mask_id"], tuple(_stop_ids(run)), tmp)
    prompts = _rows(run["prompt_ids"])
    engine = Engine.from_model(model, max_batch=len(prompts))
    results = engine.generate(prompts, _params(run, cache))
    for row, result in enumerate(results):
        assert _through_end(result) == _expected(run, row), f"row {row}"
        assert result.stats.nfe == _row_nfe(run, row), f"row {row}"


@pytest.mark.parametrize("path", GOLDEN, ids=[p.stem for p in GOLDEN])
def test_golden_run_through_the_engine(path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    run = _load(path)
    reason = _skip_reason(run)
    if reason is not None:
        pytest.skip(reason)
    _check(path, run, tmp_path_factory.getbasetemp())


# The block-causal runs whose official decoder re-runs its window each step (LLaDA2.0, the LLaDA2.1
# .log() variant), replayed without the cache too: the engine's window forward, the same tokens and NFE.
NO_CACHE = [p for p in GOLDEN if p.parent.parent.name == "llada2" and _skip_reason(_load(p)) is None
            and _load(p).get("code_version") in ("v20g", "v21log")]


@pytest.mark.parametrize("path", NO_CACHE, ids=[p.stem for p in NO_CACHE])
def test_block_causal_golden_run_without_the_cache(path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    _check(path, _load(path), tmp_path_factory.getbasetemp(), cache="none")
