"""Every Hugging Face weight-name rule, in one table.

Each rule maps a checkpoint tensor name (`{i}` = layer index) to one of our parameters, or to a
named row-range (`shard`) of a fused parameter (q|k|v, gate|up). A rule with `needs` applies only
when that condition holds for the architecture.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from engine.models.config import ModelConfig


@dataclass(frozen=True)
class WeightRule:
    hf_name: str
    param: str
    shard: Optional[str] = None
    needs: Optional[str] = None  # "qkv_bias" or "untied_head"


def _layer_rules(prefix: str, names: dict[str, tuple[str, Optional[str]]],
                 needs: Optional[str] = None) -> list[WeightRule]:
    return [WeightRule(f"{prefix}.{{i}}.{hf}", f"layers.{{i}}.{param}", shard, needs)
            for hf, (param, shard) in names.items()]


_LLADA_LAYER = {
    "q_proj.weight": ("attn.qkv_proj.weight", "q"),
    "k_proj.weight": ("attn.qkv_proj.weight", "k"),
    "v_proj.weight": ("attn.qkv_proj.weight", "v"),
    "attn_out.weight": ("attn.o_proj.weight", None),
    "ff_proj.weight": ("mlp.gate_up_proj.weight", "gate"),  # ff_proj is the SiLU-gated branch
    "up_proj.weight": ("mlp.gate_up_proj.weight", "up"),
    "ff_out.weight": ("mlp.down_proj.weight", None),
    "attn_norm.weight": ("attn_norm.weight", None),
    "ff_norm.weight": ("mlp_norm.weight", None),
}
_LLADA_QKV_BIAS = {
    "q_proj.bias": ("attn.qkv_proj.bias", "q"),
    "k_proj.bias": ("attn.qkv_proj.bias", "k"),
    "v_proj.bias": ("attn.qkv_proj.bias", "v"),
}
_DREAM_LAYER = {
    "self_attn.q_proj.weight": ("attn.qkv_proj.weight", "q"),
    "self_attn.k_proj.weight": ("attn.qkv_proj.weight", "k"),
    "self_attn.v_proj.weight": ("attn.qkv_proj.weight", "v"),
    "self_attn.o_proj.weight": ("attn.o_proj.weight", None),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", "gate"),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", "up"),
    "mlp.down_proj.weight": ("mlp.down_proj.weight", None),
    "input_layernorm.weight": ("attn_norm.weight", None),
    "post_attention_layernorm.weight": ("mlp_norm.weight", None),
}
_DREAM_QKV_BIAS = {
    "self_attn.q_proj.bias": ("attn.qkv_proj.bias", "q"),
    "self_attn.k_proj.bias": ("attn.qkv_proj.bias", "k"),
    "self_attn.v_proj.bias": ("attn.qkv_proj.bias", "v"),
}

WEIGHT_RULES: dict[str, list[WeightRule]] = {
    "llada": [
        WeightRule("model.transformer.wte.weight", "embed.weight"),
        *_layer_rules("model.transformer.blocks", _LLADA_LAYER),
        *_layer_rules("model.transformer.blocks", _LLADA_QKV_BIAS, needs="qkv_bias"),
        WeightRule("model.transformer.ln_f.weight", "norm.weight"),
        WeightRule("model.transformer.ff_out.weight", "lm_head.weight", needs="untied_head"),
    ],
    "dream": [
        WeightRule("model.embed_tokens.weight", "embed.weight"),
        *_layer_rules("model.layers", _DREAM_LAYER),
        *_layer_rules("model.layers", _DREAM_QKV_BIAS, needs="qkv_bias"),
        WeightRule("model.norm.weight", "norm.weight"),
        WeightRule("lm_head.weight", "lm_head.weight", needs="untied_head"),
    ],
}

# Buffers some exporters save that carry no learned state (recomputed from the config).
IGNORED_WEIGHTS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def _applies(rule: WeightRule, config: ModelConfig) -> bool:
    if rule.needs == "qkv_bias":
        return config.qkv_bias
    if rule.needs == "untied_head":
        return not config.tie_word_embeddings
    return True


def expected_weights(config: ModelConfig) -> dict[str, tuple[str, Optional[str]]]:
    """Checkpoint name -> (our parameter name, shard or None) for every tensor the model needs."""
    table: dict[str, tuple[str, Optional[str]]] = {}
    for rule in WEIGHT_RULES[config.architecture]:
        if not _applies(rule, config):
            continue
        indices = range(config.num_layers) if "{i}" in rule.hf_name else [None]
        for i in indices:
            table[rule.hf_name.format(i=i)] = (rule.param.format(i=i), rule.shard)
    return table
