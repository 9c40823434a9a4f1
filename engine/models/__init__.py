"""Model families and the pieces they share."""

from engine.models.config import ModelConfig
from engine.models.registry import model_class_for, supported_architectures
from engine.models.transformer import DiffusionTransformer

__all__ = ["DiffusionTransformer", "ModelConfig", "model_class_for", "supported_architectures"]
