"""Models of a released architecture with random weights created directly on the device (no
checkpoint, no CPU copy), for the step benchmarks (bench/gpu_step.py, bench/block_step.py)."""

from __future__ import annotations

import zlib
from typing import Any

import torch

from engine.models.attention import select_attention
from engine.models.layers import RMSNorm, RotaryEmbedding
from engine.models.parallel.group import SINGLE, TensorParallel
from engine.models.parallel.sharding import check_divisible
from engine.models.registry import model_class_for
from engine.models.transformer import DiffusionTransformer
from engine.special_tokens import SpecialTokens

INIT_STD = 0.02
# parameters the constructors set to one besides the norms' scales (Gemma4: the layer scalars, the
# router's input and per-expert scales): a random value would only rescale activations or routes
UNIT_PARAMS = ("encoder_scalar", "decoder_scalar", "router.scale", "router.per_expert_scale")


def build_random(hf_config: dict[str, Any], special: SpecialTokens, device: torch.device, dtype: torch.dtype,
                 seed: int = 0, tp: TensorParallel = SINGLE) -> Any:
    """The model of `hf_config` with N(0, 0.02) weights (norm scales 1), allocated once on `device`
    (no init pass by the constructors: an 8B model takes seconds); with `tp`, that rank's share,
    each parameter drawn from a generator seeded by its name, so that the parameters every rank
    holds whole (norms, the router) are the same on every rank."""
    cls = model_class_for(hf_config)
    config = cls.parse_config(hf_config)
    check_divisible(config, tp.size)
    with torch.device("meta"):
        model = cls(config, special, hf_config, tp)
    model = model.to(dtype=dtype).to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty gives the head its own storage; tie it again as the loader does
        model.lm_head.weight = model.embed.weight
    _reinit_buffers(model, device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
        for name, param in model.named_parameters():
            if id(param) in norm_weights or name.endswith(UNIT_PARAMS):
                param.fill_(1.0)
            elif name.endswith("expert_bias"):
                param.zero_()  # LLaDA2's router bias: zero, so that the router's choice is the scores'
            else:
                if tp.size > 1:
                    generator.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                param.normal_(0.0, INIT_STD, generator=generator)
    model.requires_grad_(False).eval()
    model.set_attention_kernel(*select_attention(device, dtype, use_flash=False))
    return model


def _reinit_buffers(model: Any, device: torch.device) -> None:
    """to_empty leaves buffers uninitialised. The rotary module is rebuilt on the device (today it
    holds no buffer, but a cos/sin cache would be computed by its constructor; DiffusionGemma's
    per-kind rotaries compute their frequencies on first use); any other buffer is refused rather
    than timed with garbage in it."""
    rotary = getattr(model, "rotary", None)
    if rotary is not None:
        with torch.device(device):
            model.rotary = RotaryEmbedding(rotary.dim, rotary.theta)
    others = [name for name, _ in model.named_buffers() if not name.startswith("rotary.")]
    if others:
        raise RuntimeError(f"buffers this benchmark does not know how to initialise: {others}")


def build_random_rank(tp: TensorParallel, device: str, hf_config: dict[str, Any], special: SpecialTokens,
                      dtype: torch.dtype, seed: int = 0) -> DiffusionTransformer:
    """`build_random` as a tensor-parallel engine's model factory calls it on each rank."""
    return build_random(hf_config, special, torch.device(device), dtype, seed, tp)
