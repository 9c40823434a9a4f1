"""Block-wise diffusion decoding: per-request parameters (`params`), the policies (fixed, threshold,
CAI, Dream's, the block decoders: `policies`, `sampling`), the decide step that dispatches to them
(`decide`), their per-slot tables (`state`) and what a request's result carries (`types`). The
engine that runs them: `engine.engine.Engine`. Importing the package imports no torch."""

from engine.decoding.params import DecodeParamError, DecodeParams
from engine.decoding.types import GenerationResult, RequestStats

__all__ = ["DecodeParamError", "DecodeParams", "GenerationResult", "RequestStats"]
