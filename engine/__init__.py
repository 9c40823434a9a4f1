"""cai-dllm engine: masked diffusion language models (LLaDA, Dream) and their decoding.

The engine knows nothing about HTTP. Entry points: `Engine` (add_request / step / abort /
has_unfinished, and `generate` for offline batches), `load_model`, `load_tokenizer`.
"""

from engine.config import EngineConfig
from engine.decoding import DecodeParams, GenerationRequest, GenerationResult, generate
from engine.engine import Engine
from engine.errors import CheckpointError, DeviceError, RequestError
from engine.loading.tokenizer import load_tokenizer
from engine.loading.weights import load_model
from engine.models import DiffusionTransformer, ModelConfig
from engine.request import StepOutput
from engine.special_tokens import SpecialTokens

__all__ = ["CheckpointError", "DecodeParams", "DeviceError", "DiffusionTransformer", "Engine", "EngineConfig",
           "GenerationRequest", "GenerationResult", "ModelConfig", "RequestError", "SpecialTokens", "StepOutput",
           "generate", "load_model", "load_tokenizer"]
