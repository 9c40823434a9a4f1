"""Decoding profiles: named sets of decoding knobs chosen for a model, in a JSON file.

`cai-dllm calibrate` writes one (its knobs, the validation figures that chose them, the data's
hash); `cai-dllm serve --decoding-profile FILE` loads it, as the default of every request or by
name (`decoding: {"profile": NAME}`). The profile `paper` is always there: the paper's defaults
(DecodeParams' own values), so a request can ask for them on a server whose default is calibrated.

A profile holds the decoding policy, not the request: the canvas (`gen_length`, set by max_tokens),
the seed and logprobs stay the request's own, and a file that sets them is refused.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.decoding.params import DecodeParamError, DecodeParams

PAPER_PROFILE = "paper"
FORMAT_VERSION = 1
# the request's own: the canvas is max_tokens', a seed and logprobs are what one caller asked for
REQUEST_ONLY_KNOBS = ("gen_length", "seed", "logprobs")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class ProfileError(ValueError):
    """A profile file cannot be used; the message says which file and why."""


@dataclass(frozen=True)
class DecodingProfile:
    name: str
    decoding: dict[str, Any]  # knobs over DecodeParams' defaults
    model: str = ""  # what it was calibrated for (informational)
    validation: dict[str, Any] = field(default_factory=dict)  # the figures that chose it
    source: str = ""  # the file it came from ("" when built in)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ProfileError(f"profile name must be 1-64 letters, digits, '_', '.', '-', got {self.name!r}")
        if not isinstance(self.decoding, dict):
            raise ProfileError(f"profile {self.name!r}: decoding must be a JSON object")
        taken = [k for k in REQUEST_ONLY_KNOBS if k in self.decoding]
        if taken:
            raise ProfileError(f"profile {self.name!r}: {taken[0]} belongs to the request, not a profile")
        try:
            DecodeParams.from_dict(self.decoding)
        except (DecodeParamError, TypeError) as err:
            raise ProfileError(f"profile {self.name!r}: {err}") from None

    def as_json(self) -> dict[str, Any]:
        return {"format": FORMAT_VERSION, "name": self.name, "model": self.model, "decoding": self.decoding,
                "validation": self.validation}


def load_profile(path: str | Path) -> DecodingProfile:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ProfileError(f"cannot read decoding profile {path}: {err.strerror or err}") from None
    except json.JSONDecodeError as err:
        raise ProfileError(f"decoding profile {path} is not valid JSON: {err}") from None
    if not isinstance(data, dict) or "name" not in data or "decoding" not in data:
        raise ProfileError(f"decoding profile {path} must be a JSON object with 'name' and 'decoding'")
    if data.get("format", FORMAT_VERSION) != FORMAT_VERSION:
        raise ProfileError(f"decoding profile {path} has format {data.get('format')!r}; "
                           f"this server reads format {FORMAT_VERSION}")
    try:
        return DecodingProfile(name=data["name"], decoding=data["decoding"], model=str(data.get("model", "")),
                               validation=dict(data.get("validation") or {}), source=str(path))
    except ProfileError as err:
        raise ProfileError(f"{path}: {err}") from None


def save_profile(profile: DecodingProfile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile.as_json(), indent=1) + "\n", encoding="utf-8")


def paper_profile() -> DecodingProfile:
    return DecodingProfile(PAPER_PROFILE, {"policy": "cai"}, validation={"note": "the paper's defaults"})


def profile_table(profiles: Iterable[DecodingProfile]) -> dict[str, DecodingProfile]:
    """Name -> profile, the built-in `paper` first; two profiles of one name are refused."""
    table = {PAPER_PROFILE: paper_profile()}
    for profile in profiles:
        if profile.name in table:
            where = table[profile.name].source or "built in"
            raise ProfileError(f"two decoding profiles are named {profile.name!r} ({where}, {profile.source})")
        table[profile.name] = profile
    return table
