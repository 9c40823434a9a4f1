"""Block-wise diffusion decoding: per-request parameters, the policies (fixed, threshold, CAI, Dream)
and the decide step that dispatches to them. The engine that runs them: `engine.engine.Engine`.

Names are imported on first use, as in `engine/__init__.py` (the parameters need no torch)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "generate": "engine.decoding.generate",
    "DecodeParamError": "engine.decoding.params",
    "DecodeParams": "engine.decoding.params",
    "GenerationRequest": "engine.decoding.types",
    "GenerationResult": "engine.decoding.types",
    "RequestStats": "engine.decoding.types",
}

__all__ = ["DecodeParamError", "DecodeParams", "GenerationRequest", "GenerationResult", "RequestStats", "generate"]
assert sorted(__all__) == sorted(_EXPORTS)

if TYPE_CHECKING:
    from engine.decoding.generate import generate
    from engine.decoding.params import DecodeParamError, DecodeParams
    from engine.decoding.types import GenerationRequest, GenerationResult, RequestStats


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine.decoding' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
