"""Block-wise diffusion decoding: policies (fixed, threshold, CAI, Dream), KV caches, batched runner."""

from engine.decoding.generate import generate
from engine.decoding.params import DecodeParamError, DecodeParams
from engine.decoding.runner import BlockDiffusionRunner, RequestError
from engine.decoding.types import GenerationRequest, GenerationResult, RequestStats

__all__ = ["BlockDiffusionRunner", "DecodeParamError", "DecodeParams", "GenerationRequest", "GenerationResult",
           "RequestError", "RequestStats", "generate"]
