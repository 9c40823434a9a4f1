"""The model families: from a checkpoint's `architectures` / `model_type` to the class that
implements it, and every fact the engine needs about a family, in one table.

A family's facts are read by everything that needs them (the engine's defaults and its decoding
mode, the server through the engine): a fifth family is a model file and one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from engine.errors import CheckpointError
from engine.models.diffusion_gemma import DiffusionGemmaModel
from engine.models.dream import DreamModel
from engine.models.llada import LLaDAModel
from engine.models.llada2 import LLaDA2Model
from engine.models.protocol import DiffusionModel
from engine.models.sdar import SDARModel

# Full-attention masked diffusion (LLaDA, Dream), block diffusion (SDAR, LLaDA2) or uniform-noise
# block diffusion (DiffusionGemma), behind one protocol.
ModelClass = type[DiffusionModel]

# The official block decoders' block (LLaDA2's `generate()`) where a checkpoint states none.
OFFICIAL_BLOCK = 32
# DiffusionGemma's canvas where config.json states none (DiffusionGemmaConfig's default; the model's
# `canvas_length` wins)
DG_CANVAS_LENGTH = 256


@dataclass(frozen=True)
class Family:
    model_class: ModelClass
    hf_architectures: tuple[str, ...]  # config.json `architectures` names
    model_types: tuple[str, ...]  # config.json `model_type` values
    # The decoding mode (engine/mode.py): "masked" diffusion (bidirectional attention over the whole
    # canvas), "block" diffusion (block-causal: causal across blocks, an exact cache of finished blocks)
    # or "uniform" noise (DiffusionGemma: no mask token, whole canvases resampled each step).
    mode: str
    default_cache: str  # the KV cache of a request that names none (when its mask and guidance allow one)
    gating: bool  # CAI's gating (budgets, grinding detector) when a request leaves it unset
    # The block of a request that names none, when the checkpoint states no trained block (SDAR's
    # `block_size` wins); None: the request's canvas decides (DecodeParams.effective_block_length).
    default_block: Optional[int] = None
    default_policy: str = "cai"  # the policy of a request that names none (engine/decoding/registry.py)


FAMILIES: dict[str, Family] = {  # by ModelConfig.architecture
    # CAI's gating is on by default for LLaDA and off for Dream (the paper); the block-diffusion families,
    # masked-diffusion models like LLaDA, take LLaDA's default
    "llada": Family(LLaDAModel, ("LLaDAModelLM",), ("llada",), mode="masked", default_cache="none", gating=True),
    "dream": Family(DreamModel, ("DreamModel",), ("dream",), mode="masked", default_cache="none", gating=False),
    "sdar": Family(SDARModel, ("SDARForCausalLM",), ("sdar",), mode="block", default_cache="exact", gating=True,
                   default_block=OFFICIAL_BLOCK),
    "llada2": Family(LLaDA2Model, ("LLaDA2MoeModelLM",), ("llada2_moe",), mode="block", default_cache="exact",
                     gating=True, default_block=OFFICIAL_BLOCK),
    "diffusion_gemma": Family(DiffusionGemmaModel, ("DiffusionGemmaForBlockDiffusion",), ("diffusion_gemma",),
                              mode="uniform", default_cache="exact", gating=False,
                              default_block=DG_CANVAS_LENGTH, default_policy="dg-official"),
}


def family_of(model: DiffusionModel) -> Family:
    return FAMILIES[model.config.architecture]


def supported_architectures() -> list[str]:
    return sorted(name for family in FAMILIES.values() for name in family.hf_architectures)


def model_class_for(hf_config: dict[str, Any]) -> ModelClass:
    by_architecture = {name: f for f in FAMILIES.values() for name in f.hf_architectures}
    by_model_type = {name: f for f in FAMILIES.values() for name in f.model_types}
    for name in hf_config.get("architectures") or []:
        if name in by_architecture:
            return by_architecture[name].model_class
    model_type = str(hf_config.get("model_type", "")).lower()
    if model_type in by_model_type:
        return by_model_type[model_type].model_class
    raise CheckpointError(
        f"unknown architecture: architectures={hf_config.get('architectures')!r}, "
        f"model_type={hf_config.get('model_type')!r}; supported: {', '.join(supported_architectures())}")
