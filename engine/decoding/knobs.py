"""How a decoding knob is described, once: `knob(default, check, reads=..., modes=...)` on a
`DecodeParams` field gives its type (the annotation), its default, its check, the policies whose
decide function reads it and the decoding modes that have it. Everything else is generated from
the declarations: `DecodeParams`' validation, the server's JSON schema and CLI flags
(`field_types`, `field_words`), the slot tables' columns (`device_knobs`, `device_values`) and the
mode checks (`engine/mode.py`).

A knob some policy reads (`reads`) is a column of the slot tables: its value, a word knob's word as
its index in the words, a None as the declared `none`. `ANY_POLICY` marks what every row's sampler
reads. Imports no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from typing import Any, Optional, Union

ANY_POLICY = ("*",)  # read for every row (the sampler, the policy dispatch)


class DecodeParamError(ValueError):
    """A decode parameter has a bad value; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class Int:
    low: Optional[int] = None
    high: Optional[int] = None

    def __call__(self, name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise DecodeParamError(name, f"must be an integer, got {value!r}")
        if self.low is not None and value < self.low:
            raise DecodeParamError(name, f"must be >= {self.low}, got {value}")
        if self.high is not None and value > self.high:
            raise DecodeParamError(name, f"must be <= {self.high}, got {value}")


@dataclass(frozen=True)
class Float:
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False

    def __call__(self, name: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise DecodeParamError(name, f"must be a finite number, got {value!r}")
        low, high = self.low, self.high
        if low is not None and (value < low or (self.low_open and value == low)):
            raise DecodeParamError(name, f"must be {'>' if self.low_open else '>='} {low}, got {value}")
        if high is not None and (value > high or (self.high_open and value == high)):
            raise DecodeParamError(name, f"must be {'<' if self.high_open else '<='} {high}, got {value}")


@dataclass(frozen=True)
class Bool:
    def __call__(self, name: str, value: Any) -> None:
        if not isinstance(value, bool):
            raise DecodeParamError(name, f"must be true or false, got {value!r}")


@dataclass(frozen=True)
class Words:
    """One of a few words; `choices` may be a function (the policy names: the registry's)."""

    choices: Union[tuple[str, ...], Callable[[], tuple[str, ...]]]

    @property
    def words(self) -> tuple[str, ...]:
        return self.choices() if callable(self.choices) else self.choices

    def __call__(self, name: str, value: Any) -> None:
        if value not in self.words:
            raise DecodeParamError(name, f"must be one of {', '.join(self.words)}; got {value!r}")


Check = Union[Int, Float, Bool, Words]


def knob(default: Any, check: Check, *, reads: tuple[str, ...] = (), modes: Optional[tuple[str, ...]] = None,
         none: Any = None) -> Any:
    """A DecodeParams field: `check` runs on every value but None; `reads` names the policies whose
    decide function reads it (a slot-table column; `none` stands for None there); `modes` the
    decoding modes that have it (None: every mode; elsewhere a value other than the default is refused)."""
    return field(default=default, metadata={"check": check, "reads": reads, "modes": modes, "none": none})


_SCALARS = {"int": int, "float": float, "str": str, "bool": bool}


def field_types(params: type) -> dict[str, tuple[type, bool]]:
    """name -> (scalar type, may be None) for every knob, from the annotations."""
    out: dict[str, tuple[type, bool]] = {}
    for f in fields(params):
        text = str(f.type)
        out[f.name] = (_SCALARS[text.removeprefix("Optional[").removesuffix("]")], text.startswith("Optional["))
    return out


def field_words(params: type) -> dict[str, tuple[str, ...]]:
    """The word knobs and their words (the schema's enums)."""
    return {f.name: f.metadata["check"].words for f in fields(params) if isinstance(f.metadata["check"], Words)}


def check_fields(params: Any) -> None:
    """Every declared check of `params`' values."""
    for f in fields(params):
        value = getattr(params, f.name)
        if value is not None:
            f.metadata["check"](f.name, value)


def mode_knobs(params: type) -> list[Field]:
    """The knobs only some decoding modes have."""
    return [f for f in fields(params) if f.metadata["modes"] is not None]


# Integer knobs live in int64 tensors. Values past this mean the same as this one (a top_k above the
# vocabulary keeps every token, a step limit above any block's steps is never reached).
_INT_MAX = 2 ** 63 - 1


@dataclass(frozen=True)
class DeviceKnob:
    name: str
    kind: type  # float, int or bool: the table it is a column of
    words: Optional[tuple[str, ...]]
    none: Any


def device_knobs(params: type) -> list[DeviceKnob]:
    """The knobs some policy reads, in declaration order, with the table each is a column of."""
    types = field_types(params)
    out = []
    for f in fields(params):
        if f.metadata["reads"]:
            words = f.metadata["check"].words if isinstance(f.metadata["check"], Words) else None
            out.append(DeviceKnob(f.name, int if words else types[f.name][0], words, f.metadata["none"]))
    return out


def device_value(knob: DeviceKnob, value: Any) -> Any:
    """A knob's value as its column holds it."""
    if value is None:
        if knob.none is None:
            raise ValueError(f"{knob.name} is unresolved (None) where its column needs a value")
        value = knob.none
    if knob.words is not None:
        return knob.words.index(value)
    return min(value, _INT_MAX) if knob.kind is int else value
