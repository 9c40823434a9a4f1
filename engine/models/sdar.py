"""SDAR (`model_type: sdar`, `SDARForCausalLM`; TraDo uses the same architecture): Qwen3's dense
layout run as a block-diffusion model. q/k/v/o without bias, QK-norm over head_dim before RoPE,
an explicit head_dim, full-width RoPE, untied head, predictions in place (no shift).

The official runtime normalises with flash-attn's Triton RMSNorm, which scales by the weight in
float32 (`norm_scale_in_float32`). `block_size` in config.json is the training block; the official
decoders take their block length as an argument."""

from __future__ import annotations

from typing import Any

from engine.models.block_transformer import BlockDiffusionTransformer
from engine.models.config import ModelConfig
from engine.models.config_parsing import config_errors, hf_sizes, refuse_unsupported

# SDARConfig's (Qwen3's) default for a config.json that omits the field.
_DEFAULT_RMS_NORM_EPS = 1e-6


class SDARModel(BlockDiffusionTransformer):
    architecture = "sdar"
    display_name = "SDAR"

    @classmethod
    def parse_config(cls, hf: dict[str, Any]) -> ModelConfig:
        refuse_unsupported("SDAR", hf, {"hidden_act": hf.get("hidden_act", "silu") != "silu",
                                        "rope_scaling": hf.get("rope_scaling") is not None,
                                        "use_sliding_window": bool(hf.get("use_sliding_window")),
                                        "attention_bias": bool(hf.get("attention_bias"))})
        with config_errors("SDAR"):
            block_size = hf.get("block_size")
            return ModelConfig(
                architecture=cls.architecture,
                **hf_sizes(hf),
                rms_norm_eps=float(hf.get("rms_norm_eps", _DEFAULT_RMS_NORM_EPS)),
                rope_theta=float(hf["rope_theta"]),
                qkv_bias=False,
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                rope_in_float32=False,
                logits_shifted=False,
                max_position_embeddings=int(hf["max_position_embeddings"]),
                explicit_head_dim=int(hf["head_dim"]) if hf.get("head_dim") else None,
                qk_norm=True,
                norm_scale_in_float32=True,
                block_size=int(block_size) if block_size is not None else None,
            )
