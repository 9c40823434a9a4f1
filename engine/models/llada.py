"""LLaDA (`model_type: llada`, `LLaDAModelLM`): the LLaMA-style block of the official OLMo-derived
code: no biases (unless `include_qkv_bias`), SiLU gate on `ff_proj`, RoPE in full precision,
untied head `ff_out`, no embedding or logit scaling, predictions in place (no shift)."""

from __future__ import annotations

from typing import Any

from engine.errors import CheckpointError
from engine.models.config import ModelConfig
from engine.models.config_parsing import config_errors
from engine.models.transformer import DiffusionTransformer

# Config values this implementation computes; anything else would silently compute another model.
_REQUIRED = {
    "block_type": ("llama",),
    "activation_type": ("silu",),
    "layer_norm_type": ("rms",),
    "layer_norm_with_affine": (True, None),
    "bias_for_layer_norm": (False, None),
    "include_bias": (False, None),
    "alibi": (False, None),
    "rope": (True,),
    "attention_layer_norm": (False, None),
    "input_emb_norm": (False, None),
    "scale_logits": (False, None),
}


class LLaDAModel(DiffusionTransformer):
    architecture = "llada"
    display_name = "LLaDA"

    @classmethod
    def parse_config(cls, hf: dict[str, Any]) -> ModelConfig:
        for key, allowed in _REQUIRED.items():
            if hf.get(key) not in allowed:
                raise CheckpointError(f"LLaDA config field {key}={hf.get(key)!r} is not supported "
                                      f"(supported: {', '.join(map(repr, allowed))})")
        with config_errors("LLaDA"):
            d_model, n_heads = int(hf["d_model"]), int(hf["n_heads"])
            n_kv_heads = hf.get("n_kv_heads")
            if n_kv_heads is None:
                n_kv_heads = 1 if hf.get("multi_query_attention") else n_heads
            mlp_hidden = hf.get("mlp_hidden_size") or int(hf.get("mlp_ratio", 4)) * d_model
            return ModelConfig(
                architecture=cls.architecture,
                hidden_size=d_model,
                num_layers=int(hf["n_layers"]),
                num_heads=n_heads,
                num_kv_heads=int(n_kv_heads),
                intermediate_size=int(mlp_hidden),
                vocab_size=int(hf.get("embedding_size") or hf["vocab_size"]),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
                rope_theta=float(hf.get("rope_theta", 10000.0)),
                qkv_bias=bool(hf.get("include_qkv_bias", False)),
                tie_word_embeddings=bool(hf.get("weight_tying", False)),
                rope_in_float32=bool(hf.get("rope_full_precision", True)),
                logits_shifted=False,
                max_position_embeddings=int(hf.get("max_sequence_length", 4096)),
            )
