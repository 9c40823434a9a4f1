"""SDAR (`model_type: sdar`, `SDARForCausalLM`; TraDo uses the same architecture): Qwen3's dense
layout run as a block-diffusion model. q/k/v/o without bias, QK-norm over head_dim before RoPE,
an explicit head_dim, full-width RoPE, untied head, predictions in place (no shift).

The official runtime normalises with flash-attn's Triton RMSNorm, which scales by the weight in
float32 (`norm_scale_in_float32`). `block_size` in config.json is the training block; the official
decoders take their block length as an argument."""

from __future__ import annotations

from typing import Any

from engine.errors import CheckpointError
from engine.models.block_transformer import BlockDiffusionTransformer
from engine.models.config import ModelConfig

# SDARConfig's (Qwen3's) default for a config.json that omits the field.
_DEFAULT_RMS_NORM_EPS = 1e-6


class SDARModel(BlockDiffusionTransformer):
    architecture = "sdar"
    display_name = "SDAR"

    @classmethod
    def parse_config(cls, hf: dict[str, Any]) -> ModelConfig:
        refused = {"hidden_act": hf.get("hidden_act", "silu") != "silu",
                   "rope_scaling": hf.get("rope_scaling") is not None,
                   "use_sliding_window": bool(hf.get("use_sliding_window")),
                   "attention_bias": bool(hf.get("attention_bias"))}
        for key, bad in refused.items():
            if bad:
                raise CheckpointError(f"SDAR config field {key}={hf.get(key)!r} is not supported")
        try:
            heads = int(hf["num_attention_heads"])
            block_size = hf.get("block_size")
            return ModelConfig(
                architecture=cls.architecture,
                hidden_size=int(hf["hidden_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or heads),
                intermediate_size=int(hf["intermediate_size"]),
                vocab_size=int(hf["vocab_size"]),
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
        except KeyError as err:
            raise CheckpointError(f"SDAR config.json is missing the field {err.args[0]!r}") from None
        except (TypeError, ValueError) as err:
            raise CheckpointError(f"SDAR config.json is invalid: {err}") from None
