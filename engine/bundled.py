"""The built-in models shipped in the repository's `models/` folder, found by name from any working
directory: `--model llada-tiny` or `models/llada-tiny` is that folder when no such directory exists
where the command runs (a directory that does exist always wins, as a local path does in vLLM)."""

from __future__ import annotations

from pathlib import Path
from typing import Union

BUNDLED_DIR = Path(__file__).resolve().parents[1] / "models"


def bundled_names() -> list[str]:
    """The built-in models' names (their folders), sorted; none where the package ships without them."""
    if not BUNDLED_DIR.is_dir():
        return []
    return sorted(p.name for p in BUNDLED_DIR.iterdir() if (p / "config.json").is_file())


def model_dir(name_or_path: Union[str, Path]) -> Path:
    """The checkpoint directory a `--model` value names: the path itself where it is a directory, else
    the built-in model of that name (`llada-tiny` or `models/llada-tiny`), else the path unchanged
    (the caller reports it missing)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    parts = path.parts
    if len(parts) == 1 or (len(parts) == 2 and parts[0] == BUNDLED_DIR.name):
        candidate = BUNDLED_DIR / parts[-1]
        if (candidate / "config.json").is_file():
            return candidate
    return path
