"""cai-dllm engine: masked diffusion language models (LLaDA, Dream) and their decoding.

The engine knows nothing about HTTP. Entry points: `load_model`, `load_tokenizer`, `generate`
(offline batches) and `Engine` (all three, from one `EngineConfig`).
"""

from engine.config import EngineConfig
from engine.decoding import DecodeParams, GenerationRequest, GenerationResult, generate
from engine.engine import Engine
from engine.errors import CheckpointError, DeviceError
from engine.loader import load_model
from engine.models import DiffusionTransformer, ModelConfig
from engine.special_tokens import SpecialTokens
from engine.tokenizer import load_tokenizer

__all__ = ["CheckpointError", "DecodeParams", "DeviceError", "DiffusionTransformer", "Engine", "EngineConfig",
           "GenerationRequest", "GenerationResult", "ModelConfig", "SpecialTokens", "generate", "load_model",
           "load_tokenizer"]
