"""Calibration items and graders.

An item file is JSON Lines: one object a line with `answer` (a string) and either `prompt` (text
sent as is, as `/v1/completions` does) or `messages` (a chat, rendered with the model's template).
Without a file, the built-in task family's validation split is used: disjoint by construction from
the held-out split that `cai-dllm eval` reports on (tinymodels.tasks).

Graders, by name:
- `exact`: the response, stripped, equals the answer;
- `regex:PATTERN`: the first match of PATTERN in the response (its first group, if it has one)
  equals the answer;
- `MODULE:FUNCTION`: a Python callable `fn(response: str, item: dict) -> bool`, imported by path;
- `builtin`: the built-in family's checker (the default with the built-in items).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

Grader = Callable[[str, dict[str, Any]], bool]
BUILTIN = "builtin"


class CalibrationDataError(ValueError):
    """The items or the grader cannot be used; the message says where."""


@dataclass(frozen=True)
class Item:
    data: dict[str, Any]  # prompt|messages, answer, and whatever else the file holds

    @property
    def answer(self) -> str:
        return self.data["answer"]


def load_items(path: str | Path, n: Optional[int] = None) -> list[Item]:
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise CalibrationDataError(f"cannot read {path}: {err.strerror or err}") from None
    items = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as err:
            raise CalibrationDataError(f"{path}:{number}: not valid JSON: {err}") from None
        if not isinstance(data, dict) or not isinstance(data.get("answer"), str):
            raise CalibrationDataError(f"{path}:{number}: each line needs a string 'answer'")
        has_prompt, has_messages = isinstance(data.get("prompt"), str), isinstance(data.get("messages"), list)
        if has_prompt == has_messages:
            raise CalibrationDataError(f"{path}:{number}: each line needs exactly one of 'prompt' (text) "
                                       "and 'messages' (a chat)")
        items.append(Item(data))
        if n is not None and len(items) == n:
            break
    if not items:
        raise CalibrationDataError(f"{path} holds no items")
    return items


def builtin_items(n: int, seed: int = 0, mix: Optional[dict[str, float]] = None) -> list[Item]:
    """The built-in task family's validation split, as chat items (never the held-out split)."""
    from tinymodels.tasks import sample

    return [Item({"messages": [{"role": "user", "content": p.prompt}], "answer": p.answer, "problem": p.prompt})
            for p in sample(n, seed, split="validation", mix=mix)]


def data_sha256(items: Sequence[Item], grader: str) -> str:
    """A hash of what was calibrated on: the items (canonical JSON) and the grader's name."""
    digest = hashlib.sha256()
    for item in items:
        digest.update(json.dumps(item.data, sort_keys=True, separators=(",", ":")).encode())
        digest.update(b"\n")
    digest.update(grader.encode())
    return digest.hexdigest()


def _builtin(response: str, item: dict[str, Any]) -> bool:
    from tinymodels.checker import is_correct

    return is_correct(item["problem"], response)


def make_grader(spec: str) -> Grader:
    if spec == "exact":
        return lambda response, item: response.strip() == item["answer"].strip()
    if spec == BUILTIN:
        return _builtin
    if spec.startswith("regex:"):
        try:
            pattern = re.compile(spec.removeprefix("regex:"))
        except re.error as err:
            raise CalibrationDataError(f"grader {spec!r}: bad regular expression: {err}") from None

        def by_regex(response: str, item: dict[str, Any]) -> bool:
            match = pattern.search(response)
            if match is None:
                return False
            found = match.group(1) if pattern.groups else match.group(0)
            return found == item["answer"]

        return by_regex
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        raise CalibrationDataError(f"grader must be exact, regex:PATTERN or MODULE:FUNCTION, got {spec!r}")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as err:
        raise CalibrationDataError(f"grader {spec!r}: {err}") from None
    if not callable(function):
        raise CalibrationDataError(f"grader {spec!r} is not callable")
    return function
