"""cai-dllm engine: masked diffusion language models (LLaDA, Dream) and their decoding.

The engine knows nothing about HTTP. Entry points: `load_model` and `load_tokenizer`.
"""

from engine.errors import CheckpointError, DeviceError
from engine.loader import load_model
from engine.models import DiffusionTransformer, ModelConfig
from engine.special_tokens import SpecialTokens
from engine.tokenizer import load_tokenizer

__all__ = ["CheckpointError", "DeviceError", "DiffusionTransformer", "ModelConfig", "SpecialTokens",
           "load_model", "load_tokenizer"]
