"""Everything that reads a local Hugging Face checkpoint directory: config and file checks, weights
streamed from safetensors into a model built on the meta device, and the tokenizer."""

from engine.loading.tokenizer import encode_text, load_tokenizer
from engine.loading.weights import load_model

__all__ = ["encode_text", "load_model", "load_tokenizer"]
