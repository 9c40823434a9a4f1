"""Every Hugging Face weight-name rule, in one table.

Each rule maps a checkpoint tensor name (`{i}` = layer index, `{e}` = routed expert index) to one
of our parameters, or to a named row-range (`shard`) of a fused parameter (q|k|v, gate|up, the
stacked experts). A rule with `needs` applies only when that condition holds for the architecture;
`dense_mlp`, `moe` and `sliding_attention` rules apply to those layers only. `SKIPPED_WEIGHTS` names
the tensors a family's checkpoint holds that the engine recognises and does not load.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from engine.models.config import ModelConfig
from engine.models.gemma4_config import SLIDING


@dataclass(frozen=True)
class WeightRule:
    hf_name: str
    param: str
    shard: Optional[str] = None
    # "qkv_bias", "untied_head", "qk_norm", "dense_mlp", "moe", "shared_expert" or "sliding_attention"
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
# DiffusionGemma stores the decoder's copy of every weight its encoder shares, and the encoder's
# own `layer_scalar` (gemma4_layers.py names the norms after their place in the layer).
_DIFFUSION_GEMMA_LAYER = {
    "input_layernorm.weight": ("input_norm.weight", None),
    "post_attention_layernorm.weight": ("post_attention_norm.weight", None),
    "pre_feedforward_layernorm.weight": ("pre_feedforward_norm.weight", None),
    "post_feedforward_layernorm_1.weight": ("post_feedforward_norm_1.weight", None),
    "pre_feedforward_layernorm_2.weight": ("pre_feedforward_norm_2.weight", None),
    "post_feedforward_layernorm_2.weight": ("post_feedforward_norm_2.weight", None),
    "post_feedforward_layernorm.weight": ("post_feedforward_norm.weight", None),
    "self_attn.q_proj.weight": ("attn.qkv_proj.weight", "q"),
    "self_attn.k_proj.weight": ("attn.qkv_proj.weight", "k"),
    "self_attn.o_proj.weight": ("attn.o_proj.weight", None),
    "self_attn.q_norm.weight": ("attn.q_norm.weight", None),
    "self_attn.k_norm.weight": ("attn.k_norm.weight", None),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", "gate"),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", "up"),
    "mlp.down_proj.weight": ("mlp.down_proj.weight", None),
    "router.proj.weight": ("router.proj.weight", None),
    "router.scale": ("router.scale", None),
    "router.per_expert_scale": ("router.per_expert_scale", None),
    "experts.gate_up_proj": ("experts.gate_up_proj", None),  # [experts, 2·I, hidden], gate rows first
    "experts.down_proj": ("experts.down_proj", None),
    "layer_scalar": ("decoder_scalar", None),
}
_DIFFUSION_GEMMA_SELF_CONDITIONING = {
    "model.decoder.self_conditioning.pre_norm.weight": ("self_conditioning.pre_norm.weight", None),
    "model.decoder.self_conditioning.gate_proj.weight": ("self_conditioning.mlp.gate_up_proj.weight", "gate"),
    "model.decoder.self_conditioning.up_proj.weight": ("self_conditioning.mlp.gate_up_proj.weight", "up"),
    "model.decoder.self_conditioning.down_proj.weight": ("self_conditioning.mlp.down_proj.weight", None),
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
    "diffusion_gemma": [
        WeightRule("model.decoder.embed_tokens.weight", "embed.weight"),  # also the encoder's and the head
        *_layer_rules("model.decoder.layers", _DIFFUSION_GEMMA_LAYER),
        WeightRule("model.decoder.layers.{i}.self_attn.v_proj.weight", "layers.{i}.attn.qkv_proj.weight", "v",
                   needs="sliding_attention"),  # full layers take their values from k_proj
        WeightRule("model.encoder.language_model.layers.{i}.layer_scalar", "layers.{i}.encoder_scalar"),
        WeightRule("model.decoder.norm.weight", "norm.weight"),  # also the encoder's final norm
        *(WeightRule(hf, param, shard) for hf, (param, shard) in _DIFFUSION_GEMMA_SELF_CONDITIONING.items()),
    ],
}

# Buffers some exporters save that carry no learned state (recomputed from the config).
IGNORED_WEIGHTS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
# Tensors a family's checkpoint holds that the engine does not run: DiffusionGemma's vision tower
# (image inputs are refused before they reach the model).
SKIPPED_WEIGHTS: dict[str, re.Pattern[str]] = {
    "diffusion_gemma": re.compile(r"^model\.encoder\.(vision_tower|embed_vision)\."),
}


def ignored_weight(name: str, config: ModelConfig) -> bool:
    """A checkpoint tensor that is recognised and not loaded."""
    skipped = SKIPPED_WEIGHTS.get(config.architecture)
    return bool(IGNORED_WEIGHTS.search(name)) or (skipped is not None and bool(skipped.search(name)))


def _applies(rule: WeightRule, config: ModelConfig) -> bool:
    if rule.needs == "qkv_bias":
        return config.qkv_bias
    if rule.needs == "untied_head":
        return not config.tie_word_embeddings
    if rule.needs == "qk_norm":
        return config.qk_norm
    if rule.needs == "shared_expert":
        return config.moe is not None and config.moe.num_shared_experts > 0
    if rule.needs == "sliding_attention":
        return config.gemma is not None
    return True


def _layers(rule: WeightRule, config: ModelConfig) -> Sequence[int]:
    dense = config.num_layers if config.moe is None else config.moe.first_dense_layers
    if rule.needs == "dense_mlp":
        return range(dense)
    if rule.needs in ("moe", "shared_expert"):
        return range(dense, config.num_layers)
    if rule.needs == "sliding_attention" and config.gemma is not None:
        return config.gemma.layers_of(SLIDING)
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
