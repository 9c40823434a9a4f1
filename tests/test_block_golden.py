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
    if version in ("v21p", "v21log"):
        return "LLaDA2.1's token-editing decoder is not implemented in the engine yet"
    if run["settings"].get("eos_early_stop"):
        return ("eos_early_stop (an end inside an unfinished block ends the row) is not offered: the engine "
                "ends a block-diffusion row at an end token in a finished block")
    return None


def _params(run: dict) -> DecodeParams:
    settings = run["settings"]
    common: dict[str, Any] = {"gen_length": settings["gen_length"], "block_length": settings["block_length"],
                              "ignore_eos": not _stop_ids(run), "temperature": 0.0}
    blocks = settings["gen_length"] // settings["block_length"]
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
    steps = min(settings["steps"], settings["gen_length"] // settings.get("minimal_topk", 1))  # LLaDA2.0
    return DecodeParams(policy="block-dynamic", steps=steps * blocks, threshold=settings["threshold"], **common)


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
    gen_length tokens (the official decoders return the whole rounded canvas)."""
    if "generated_ids" in run:
        generated = _rows(run["generated_ids"])[row][:run["settings"]["gen_length"]]
    else:
        generated = run["returned_ids"][row]
    stops = set(_stop_ids(run))
    end = next((i for i, t in enumerate(generated) if t in stops), None)
    return generated if end is None else generated[:end + 1]


def _row_nfe(run: dict, row: int) -> int:
    """NFE of one row. Batch 1: the run's. A batch run of decoder B feeds every row until all rows'
    blocks are full: a row's own forwards are the prefill, the store passes and the denoising
    forwards that committed one of its tokens (each commits at least one while masks remain)."""
    if len(_rows(run["prompt_ids"])) == 1:
        return run["nfe"]
    kinds, commits = run["forward_kinds"], run["tokens_committed_per_forward"]
    return sum(1 for kind, c in zip(kinds, commits, strict=True) if kind != "denoise" or c[row] > 0)


@pytest.mark.parametrize("path", GOLDEN, ids=[p.stem for p in GOLDEN])
def test_golden_run_through_the_engine(path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    run = _load(path)
    reason = _skip_reason(run)
    if reason is not None:
        pytest.skip(reason)
    model = _model(_checkpoint(path, run), run["settings"]["mask_id"], tuple(_stop_ids(run)),
                   tmp_path_factory.getbasetemp())
    prompts = _rows(run["prompt_ids"])
    engine = Engine.from_model(model, max_batch=len(prompts))
    results = engine.generate(prompts, _params(run))
    for row, result in enumerate(results):
        assert result.generated_ids == _expected(run, row), f"row {row}"
        assert result.stats.nfe == _row_nfe(run, row), f"row {row}"
