"""cai-dllm engine: diffusion language models (LLaDA, Dream; SDAR, LLaDA2) and their decoding.

The engine knows nothing about HTTP. Entry points: `start_engine(config)` (the `Engine` a
configuration asks for: one device, or rank 0 of a tensor-parallel group), `Engine` (add_request /
step / abort / has_unfinished, and `generate` for offline batches), `load_model`, `load_tokenizer`.

Names are imported on first use (PEP 562), so that importing a light module of the package (the
settings, the decoding parameters) does not import torch: `cai-dllm --help` answers at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.lazy import lazy_getattr

_EXPORTS = {
    "EngineConfig": "engine.config",
    "DecodeParams": "engine.decoding.params",
    "GenerationResult": "engine.decoding.types",
    "Engine": "engine.engine",
    "start_engine": "engine.executor.start",
    "CheckpointError": "engine.errors",
    "DeviceError": "engine.errors",
    "RequestError": "engine.errors",
    "load_tokenizer": "engine.loading.tokenizer",
    "load_model": "engine.loading.weights",
    "DiffusionTransformer": "engine.models",
    "ModelConfig": "engine.models",
    "StepOutput": "engine.request",
    "SpecialTokens": "engine.special_tokens",
}

__all__ = ["CheckpointError", "DecodeParams", "DeviceError", "DiffusionTransformer", "Engine", "EngineConfig",
           "GenerationResult", "ModelConfig", "RequestError", "SpecialTokens", "StepOutput", "load_model",
           "load_tokenizer", "start_engine"]
assert sorted(__all__) == sorted(_EXPORTS)

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.decoding.params import DecodeParams
    from engine.decoding.types import GenerationResult
    from engine.engine import Engine
    from engine.errors import CheckpointError, DeviceError, RequestError
    from engine.executor.start import start_engine
    from engine.loading.tokenizer import load_tokenizer
    from engine.loading.weights import load_model
    from engine.models import DiffusionTransformer, ModelConfig
    from engine.request import StepOutput
    from engine.special_tokens import SpecialTokens


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
