"""Every Hugging Face weight-name rule, in one table.

Each rule maps a checkpoint tensor name (`{i}` = layer index, `{e}` = routed expert index) to one
of our parameters, or to a named row-range (`shard`) of a fused parameter (q|k|v, gate|up, the
stacked experts). A rule with `needs` applies only when that condition holds for the architecture;
`dense_mlp` and `moe` rules apply to those layers only.
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
    # "qkv_bias", "untied_head", "qk_norm", "dense_mlp", "moe" or "shared_expert"
    needs: Optional[str] = None


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

_SDAR_QK_NORM = {
    "self_attn.q_norm.weight": ("attn.q_norm.weight", None),
    "self_attn.k_norm.weight": ("attn.k_norm.weight", None),
}
_LLADA2_LAYER = {
    "attention.query_key_value.weight": ("attn.qkv_proj.weight", None),  # already q|k|v, head-major
    "attention.dense.weight": ("attn.o_proj.weight", None),
    "input_layernorm.weight": ("attn_norm.weight", None),
    "post_attention_layernorm.weight": ("mlp_norm.weight", None),
}
_LLADA2_QK_NORM = {
    "attention.query_layernorm.weight": ("attn.q_norm.weight", None),
    "attention.key_layernorm.weight": ("attn.k_norm.weight", None),
}
_LLADA2_DENSE_MLP = {
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", "gate"),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", "up"),
    "mlp.down_proj.weight": ("mlp.down_proj.weight", None),
}
_LLADA2_MOE = {
    "mlp.gate.weight": ("mlp.router.weight", None),
    "mlp.gate.expert_bias": ("mlp.router.expert_bias", None),
    "mlp.experts.{e}.gate_proj.weight": ("mlp.experts.gate_up_proj.weight", "{e}.gate"),
    "mlp.experts.{e}.up_proj.weight": ("mlp.experts.gate_up_proj.weight", "{e}.up"),
    "mlp.experts.{e}.down_proj.weight": ("mlp.experts.down_proj.weight", "{e}"),
}
_LLADA2_SHARED_EXPERT = {
    "mlp.shared_experts.gate_proj.weight": ("mlp.shared.gate_up_proj.weight", "gate"),
    "mlp.shared_experts.up_proj.weight": ("mlp.shared.gate_up_proj.weight", "up"),
    "mlp.shared_experts.down_proj.weight": ("mlp.shared.down_proj.weight", None),
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
    "sdar": [
        WeightRule("model.embed_tokens.weight", "embed.weight"),
        *_layer_rules("model.layers", _DREAM_LAYER),
        *_layer_rules("model.layers", _SDAR_QK_NORM, needs="qk_norm"),
        WeightRule("model.norm.weight", "norm.weight"),
        WeightRule("lm_head.weight", "lm_head.weight", needs="untied_head"),
    ],
    "llada2": [
        WeightRule("model.word_embeddings.weight", "embed.weight"),
        *_layer_rules("model.layers", _LLADA2_LAYER),
        WeightRule("model.layers.{i}.attention.query_key_value.bias", "layers.{i}.attn.qkv_proj.bias",
                   needs="qkv_bias"),
        *_layer_rules("model.layers", _LLADA2_QK_NORM, needs="qk_norm"),
        *_layer_rules("model.layers", _LLADA2_DENSE_MLP, needs="dense_mlp"),
        *_layer_rules("model.layers", _LLADA2_MOE, needs="moe"),
        *_layer_rules("model.layers", _LLADA2_SHARED_EXPERT, needs="shared_expert"),
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
    if rule.needs == "qk_norm":
        return config.qk_norm
    if rule.needs == "shared_expert":
        return config.moe is not None and config.moe.num_shared_experts > 0
    return True


def _layers(rule: WeightRule, config: ModelConfig) -> range:
    dense = config.num_layers if config.moe is None else config.moe.first_dense_layers
    if rule.needs == "dense_mlp":
        return range(dense)
    if rule.needs in ("moe", "shared_expert"):
        return range(dense, config.num_layers)
    return range(config.num_layers)


def expected_weights(config: ModelConfig) -> dict[str, tuple[str, Optional[str]]]:
    """Checkpoint name -> (our parameter name, shard or None) for every tensor the model needs."""
    table: dict[str, tuple[str, Optional[str]]] = {}
    for rule in WEIGHT_RULES[config.architecture]:
        if not _applies(rule, config):
            continue
        layers = _layers(rule, config) if "{i}" in rule.hf_name else [None]
        experts = range(config.moe.num_experts) if config.moe is not None and "{e}" in rule.hf_name else [None]
        for i in layers:
            for e in experts:
                shard = None if rule.shard is None else rule.shard.format(e=e)
                table[rule.hf_name.format(i=i, e=e)] = (rule.param.format(i=i), shard)
    return table
