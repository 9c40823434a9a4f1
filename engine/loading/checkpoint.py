"""A local Hugging Face checkpoint directory: its JSON files and where its weights are.

Nothing is downloaded and no code from the directory is ever run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from engine.bundled import bundled_names, model_dir
from engine.errors import CheckpointError
from engine.special_tokens import SpecialTokens, special_tokens_from_files

SINGLE_WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


def _read_json(path: Path, required: bool) -> Optional[dict[str, Any]]:
    if not path.is_file():
        if required:
            raise CheckpointError(f"{path} is missing")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


@dataclass(frozen=True)
class CheckpointFiles:
    path: Path
    config: dict[str, Any]
    generation_config: Optional[dict[str, Any]]
    tokenizer_config: Optional[dict[str, Any]]
    added_tokens: Optional[dict[str, int]]

    @classmethod
    def open(cls, path: Union[str, Path]) -> CheckpointFiles:
        root = model_dir(path)
        if not root.is_dir():
            names = ", ".join(bundled_names())
            raise CheckpointError(f"checkpoint directory {root} does not exist"
                                  + (f" (built-in models, by name: {names})" if names else ""))
        added = _read_json(root / "added_tokens.json", required=False)
        return cls(
            path=root,
            config=_read_json(root / "config.json", required=True) or {},
            generation_config=_read_json(root / "generation_config.json", required=False),
            tokenizer_config=_read_json(root / "tokenizer_config.json", required=False),
            added_tokens={k: int(v) for k, v in added.items()} if added else None,
        )

    def special_tokens(self, needs_mask: bool = True) -> SpecialTokens:
        return special_tokens_from_files(self.config, self.generation_config, self.tokenizer_config,
                                         self.added_tokens, needs_mask=needs_mask)

    @property
    def has_chat_template(self) -> bool:
        return bool((self.tokenizer_config or {}).get("chat_template")) or \
            (self.path / "chat_template.jinja").is_file()

    def weight_index(self) -> Optional[dict[str, str]]:
        """The sharded checkpoint's name -> shard file map, or None for a single file."""
        index = _read_json(self.path / WEIGHTS_INDEX, required=False)
        if index is None:
            return None
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{self.path / WEIGHTS_INDEX} has no weight_map")
        return weight_map

    def weight_files(self) -> list[Path]:
        """Every safetensors file of the checkpoint; raises if one is missing."""
        weight_map = self.weight_index()
        if weight_map is None:
            single = self.path / SINGLE_WEIGHTS
            if not single.is_file():
                raise CheckpointError(f"no weights in {self.path}: expected {SINGLE_WEIGHTS} or "
                                      f"{WEIGHTS_INDEX} (only safetensors checkpoints are supported)")
            return [single]
        files = [self.path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{WEIGHTS_INDEX} in {self.path} names shard file(s) that are "
                                  f"missing: {', '.join(missing)}")
        return files
