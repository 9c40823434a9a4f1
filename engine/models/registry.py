"""From a checkpoint's `architectures` / `model_type` to the class that implements it."""

from __future__ import annotations

from typing import Any, Union

from engine.errors import CheckpointError
from engine.models.block_transformer import BlockDiffusionTransformer
from engine.models.diffusion_gemma import DiffusionGemmaModel
from engine.models.dream import DreamModel
from engine.models.llada import LLaDAModel
from engine.models.llada2 import LLaDA2Model
from engine.models.sdar import SDARModel
from engine.models.transformer import DiffusionTransformer

# Full-attention masked diffusion (LLaDA, Dream), block diffusion (SDAR, LLaDA2) or uniform-noise
# block diffusion (DiffusionGemma).
ModelClass = Union[type[DiffusionTransformer], type[BlockDiffusionTransformer], type[DiffusionGemmaModel]]

_BY_ARCHITECTURE: dict[str, ModelClass] = {
    "LLaDAModelLM": LLaDAModel,
    "DreamModel": DreamModel,
    "SDARForCausalLM": SDARModel,
    "LLaDA2MoeModelLM": LLaDA2Model,
    "DiffusionGemmaForBlockDiffusion": DiffusionGemmaModel,
}
_BY_MODEL_TYPE: dict[str, ModelClass] = {
    "llada": LLaDAModel,
    "dream": DreamModel,
    "sdar": SDARModel,
    "llada2_moe": LLaDA2Model,
    "diffusion_gemma": DiffusionGemmaModel,
}


def supported_architectures() -> list[str]:
    return sorted(_BY_ARCHITECTURE)


def model_class_for(hf_config: dict[str, Any]) -> ModelClass:
    for name in hf_config.get("architectures") or []:
        if name in _BY_ARCHITECTURE:
            return _BY_ARCHITECTURE[name]
    model_type = str(hf_config.get("model_type", "")).lower()
    if model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    raise CheckpointError(
        f"unknown architecture: architectures={hf_config.get('architectures')!r}, "
        f"model_type={hf_config.get('model_type')!r}; supported: {', '.join(supported_architectures())}")
