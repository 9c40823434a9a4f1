"""What a Gemma4 text backbone needs beyond `ModelConfig` (DiffusionGemma's backbone), parsed from
the checkpoint's `text_config`.

Two kinds of attention layer: sliding layers (`head_dim`, `num_key_value_heads`, default RoPE over
the whole head, their own `v_proj`) and full layers (their head dim and KV heads from
`per_layer_config`, as transformers >= 5.23 saves them, or from the constructor keys
`global_head_dim` / `num_global_key_value_heads` older files carry; proportional RoPE; no `v_proj`:
the values are the raw key projection, "k_eq_v"). Every layer has a dense gated-GELU MLP beside a
routed mixture of experts. The config class forces the last layer to full attention; so do we.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

from engine.errors import CheckpointError

SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)

# DiffusionGemmaTextConfig's defaults for keys a config.json may omit (transformers 5.23).
DEFAULT_GLOBAL_HEAD_DIM = 512
DEFAULT_FINAL_LOGIT_SOFTCAPPING = 30.0
DEFAULT_SLIDING_WINDOW = 512
_DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                 FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
_SLIDING_PATTERN = 6  # the config class's default layer pattern: five sliding layers, then one full


@dataclass(frozen=True)
class AttentionKind:
    """One layer type's attention. RoPE rotates the pairs (i, i + head_dim/2) at the frequencies
    theta^(-2j/head_dim) / rope_factor for j < rotated_pairs and leaves the other pairs unrotated
    (proportional RoPE; the default RoPE rotates every pair)."""

    head_dim: int
    num_kv_heads: int
    rope_theta: float
    rotated_pairs: int
    rope_factor: float
    window: Optional[int]  # sliding: a query sees the keys less than `window` positions back
    values_from_keys: bool  # k_eq_v: no v_proj, values are the raw k_proj output

    def __post_init__(self) -> None:
        if self.head_dim <= 0 or self.head_dim % 2 or self.num_kv_heads <= 0:
            raise ValueError(f"head_dim {self.head_dim} must be positive and even, KV heads positive")
        if not 0 <= self.rotated_pairs <= self.head_dim // 2:
            raise ValueError(f"{self.rotated_pairs} rotated RoPE pairs do not fit head_dim {self.head_dim}")


@dataclass(frozen=True)
class Gemma4Spec:
    layer_types: tuple[str, ...]
    sliding: AttentionKind
    full: AttentionKind
    num_experts: int
    experts_per_token: int
    expert_intermediate_size: int
    final_logit_softcapping: Optional[float]
    canvas_length: int  # DiffusionGemma: the decoder's canvas (its block)

    def __post_init__(self) -> None:
        if not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"top_k_experts {self.experts_per_token} must be in [1, num_experts={self.num_experts}]")
        if self.sliding.window is None or self.sliding.window < 2:
            raise ValueError(f"sliding_window must be at least 2, got {self.sliding.window}")
        if self.canvas_length <= 0:
            raise ValueError(f"canvas_length must be positive, got {self.canvas_length}")

    def attention(self, layer: int) -> AttentionKind:
        return self.sliding if self.layer_types[layer] == SLIDING else self.full

    def layers_of(self, kind: str) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == kind]

    @property
    def retained(self) -> int:
        """Positions a sliding layer's cache keeps (the official DynamicCache keeps window - 1)."""
        assert self.sliding.window is not None
        return self.sliding.window - 1


def layer_types_of(text: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    types = text.get("layer_types")
    if types is None:
        types = [SLIDING if (i + 1) % _SLIDING_PATTERN else FULL for i in range(num_layers)]
    types = list(types)
    if len(types) != num_layers:
        raise CheckpointError(f"DiffusionGemma config lists {len(types)} layer_types for {num_layers} layers")
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise CheckpointError(f"DiffusionGemma config layer_types {unknown} are not supported "
                              f"(supported: {', '.join(LAYER_TYPES)})")
    types[-1] = FULL  # as the config class does
    return tuple(types)


def _full_layer_shape(text: Mapping[str, Any], full_layers: list[int]) -> tuple[int, int]:
    """(head_dim, KV heads) of the full layers, one value for all of them (RoPE is per layer type)."""
    per_layer = text.get("per_layer_config")
    if per_layer is None:
        kv_heads = text.get("num_global_key_value_heads") or text["num_key_value_heads"]
        return int(text.get("global_head_dim") or DEFAULT_GLOBAL_HEAD_DIM), int(kv_heads)
    shapes = set()
    for layer in full_layers:
        override = per_layer.get(str(layer), per_layer.get(layer, {})) or {}
        shapes.add((int(override.get("head_dim", text["head_dim"])),
                    int(override.get("num_key_value_heads", text["num_key_value_heads"]))))
    extra = sorted(set(map(str, per_layer)) - set(map(str, full_layers)))
    if extra:
        raise CheckpointError(f"DiffusionGemma config per_layer_config overrides sliding layer(s) {extra}: "
                              "not supported")
    if len(shapes) != 1:
        raise CheckpointError(f"DiffusionGemma config per_layer_config gives the full layers different "
                              f"shapes {sorted(shapes)}: not supported")
    return shapes.pop()


def _rope(text: Mapping[str, Any], kind: str, head_dim: int) -> tuple[float, int, float]:
    """(theta, rotated pairs, factor) of one layer type's RoPE."""
    params = dict((text.get("rope_parameters") or _DEFAULT_ROPE)[kind])
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise CheckpointError(f"DiffusionGemma config: partial_rotary_factor with rope_type default ({kind})")
        return float(params["rope_theta"]), head_dim // 2, 1.0
    if rope_type == "proportional":
        pairs = int(float(params.get("partial_rotary_factor", 1.0)) * head_dim // 2)
        return float(params["rope_theta"]), pairs, float(params.get("factor", 1.0))
    raise CheckpointError(f"DiffusionGemma config rope_type {rope_type!r} ({kind}) is not supported "
                          "(supported: default, proportional)")


def parse_gemma4_spec(text: Mapping[str, Any], canvas_length: int) -> Gemma4Spec:
    """The spec from a `text_config` (KeyError/TypeError/ValueError on a missing or bad field)."""
    num_layers = int(text["num_hidden_layers"])
    layer_types = layer_types_of(text, num_layers)
    full_head_dim, full_kv_heads = _full_layer_shape(text, [i for i, t in enumerate(layer_types) if t == FULL])
    sliding_head_dim = int(text["head_dim"])
    theta, pairs, factor = _rope(text, SLIDING, sliding_head_dim)
    sliding = AttentionKind(sliding_head_dim, int(text["num_key_value_heads"]), theta, pairs, factor,
                            window=int(text.get("sliding_window", DEFAULT_SLIDING_WINDOW)), values_from_keys=False)
    theta, pairs, factor = _rope(text, FULL, full_head_dim)
    full = AttentionKind(full_head_dim, full_kv_heads, theta, pairs, factor, window=None, values_from_keys=True)
    softcap = text.get("final_logit_softcapping", DEFAULT_FINAL_LOGIT_SOFTCAPPING)
    return Gemma4Spec(layer_types=layer_types, sliding=sliding, full=full,
                      num_experts=int(text["num_experts"]), experts_per_token=int(text["top_k_experts"]),
                      expert_intermediate_size=int(text["moe_intermediate_size"]),
                      final_logit_softcapping=None if softcap is None else float(softcap),
                      canvas_length=int(canvas_length))
