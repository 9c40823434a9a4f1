"""The block-diffusion fixture checkpoints (fixtures `block/*`) as the loader takes them: their
config.json names no mask id (the official decoders take it as an argument), so a test loads a
copy whose config carries the special ids its golden runs were decoded with."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from conftest import FIXTURES


def with_special_ids(checkpoint: Path, dest: Path, mask_id: int, end_ids: Sequence[int]) -> Path:
    """A copy of `checkpoint` at `dest` (weights linked) whose mask and end ids are these."""
    dest.mkdir(parents=True, exist_ok=True)
    config = json.loads((checkpoint / "config.json").read_text())
    config["mask_token_id"] = mask_id
    generation = {"eos_token_id": list(end_ids) or config.get("eos_token_id", config.get("pad_token_id"))}
    if not end_ids and "eos_token_id" not in config:
        config["eos_token_id"] = config.get("pad_token_id")  # runs that ignore end ids: any id, never read
    (dest / "config.json").write_text(json.dumps(config))
    (dest / "generation_config.json").write_text(json.dumps(generation))
    for weights in checkpoint.glob("*.safetensors"):
        if not (dest / weights.name).exists():
            (dest / weights.name).symlink_to(weights)
    return dest


def block_fixture(family: str, dest_root: Path, model: Optional[str] = None) -> Path:
    """The `family` fixture checkpoint (`model` names one of several) with the mask id and end id of
    its first golden run."""
    root = FIXTURES / "block" / family
    run = json.loads(sorted((root / "golden").glob("*.json"))[0].read_text())
    checkpoint = root / model if model else next(p.parent for p in sorted(root.glob("*/config.json")))
    settings = run["settings"]
    end = settings.get("eos_id", settings.get("pad_id"))
    return with_special_ids(checkpoint, dest_root / f"{family}-{checkpoint.name}", settings["mask_id"],
                            [end] if end is not None else [])
