"""Block-wise diffusion decoding: per-request parameters, the policies (fixed, threshold, CAI, Dream)
and the decide step that dispatches to them. The engine that runs them: `engine.engine.Engine`.

Names are imported on first use, as in `engine/__init__.py` (the parameters need no torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lazy import lazy_getattr

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


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
