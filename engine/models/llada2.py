"""LLaDA2.0 / LLaDA2.1 (`model_type: llada2_moe`, `LLaDA2MoeModelLM`): a block-diffusion MoE.
Fused q|k|v projection (`query_key_value`, heads laid out q, then k, then v), QK-norm over head_dim
before RoPE, RoPE on the first head_dim * partial_rotary_factor dims only, the first
`first_k_dense_replace` layers dense and the rest LLaDA2's mixture of experts (see `moe.py`),
untied head, predictions in place (no shift). 2.0 and 2.1 share these weights and this math; they
differ in their decoders (2.1's block mask is additive 0/1: `BlockDiffusionTransformer.forward`).

The released configs name no block (the official `generate()` takes `block_length`, default 32, and
so does the engine: its family's default block). A config that states `block_size`, as SDAR's does,
names the block its checkpoint was trained with, and a request that names none decodes with it; the
official code ignores the key.

Config keys the official code never reads (`rotary_dim`, `score_function`, `router_dtype`,
`norm_topk_prob`, `moe_router_enable_expert_bias`, `norm_head`, `norm_softmax`, dropouts, sliding
window) are ignored here too; the router behaviour they name is the official hard-coded one."""

from __future__ import annotations

from typing import Any

from engine.models.block_transformer import BlockDiffusionTransformer
from engine.models.config import ModelConfig, MoeConfig
from engine.models.config_parsing import config_errors, hf_sizes, refuse_unsupported

# LLaDA2MoeConfig's class defaults, for a config.json that omits the key (as Hugging Face applies them).
_DEFAULTS = {"use_qk_norm": True, "use_bias": True, "use_qkv_bias": False, "rms_norm_eps": 1e-5,
             "partial_rotary_factor": 0.5, "num_shared_experts": 0, "first_k_dense_replace": 0,
             "tie_word_embeddings": False, "hidden_act": "silu", "rope_scaling": None}


class LLaDA2Model(BlockDiffusionTransformer):
    architecture = "llada2"
    display_name = "LLaDA2"

    @classmethod
    def parse_config(cls, hf: dict[str, Any]) -> ModelConfig:
        def get(key: str) -> Any:
            return hf[key] if key in hf else _DEFAULTS[key]

        refuse_unsupported("LLaDA2", {**_DEFAULTS, **hf}, {"hidden_act": get("hidden_act") != "silu",
                                                           "rope_scaling": get("rope_scaling") is not None,
                                                           "use_bias": bool(get("use_bias"))})
        with config_errors("LLaDA2"):
            moe = MoeConfig(
                num_experts=int(hf["num_experts"]),
                experts_per_token=int(hf["num_experts_per_tok"]),
                num_groups=int(hf["n_group"]),
                topk_group=int(hf["topk_group"]),
                expert_intermediate_size=int(hf["moe_intermediate_size"]),
                num_shared_experts=int(get("num_shared_experts") or 0),
                routed_scaling_factor=float(hf["routed_scaling_factor"]),
                first_dense_layers=int(get("first_k_dense_replace")),
            )
            return ModelConfig(
                architecture=cls.architecture,
                **hf_sizes(hf),
                rms_norm_eps=float(get("rms_norm_eps")),
                rope_theta=float(hf["rope_theta"]),
                qkv_bias=bool(get("use_qkv_bias")),
                tie_word_embeddings=bool(get("tie_word_embeddings")),
                rope_in_float32=False,
                logits_shifted=False,
                max_position_embeddings=int(hf["max_position_embeddings"]),
                explicit_head_dim=int(hf["head_dim"]) if hf.get("head_dim") else None,
                partial_rotary_factor=float(get("partial_rotary_factor")),
                qk_norm=bool(get("use_qk_norm")),
                moe=moe,
                block_size=int(hf["block_size"]) if hf.get("block_size") is not None else None,
            )
