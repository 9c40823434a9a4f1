"""Block-wise diffusion decoding: per-request parameters, the policies (fixed, threshold, CAI, Dream)
and the decide step that dispatches to them. The engine that runs them: `engine.engine.Engine`."""

from engine.decoding.generate import generate
from engine.decoding.params import DecodeParamError, DecodeParams
from engine.decoding.types import GenerationRequest, GenerationResult, RequestStats

__all__ = ["DecodeParamError", "DecodeParams", "GenerationRequest", "GenerationResult", "RequestStats", "generate"]
