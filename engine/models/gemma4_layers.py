"""The Gemma4 text layer as DiffusionGemma runs it (one set of weights for encoder and decoder).

Residual stream h:
  h = h + post_attention_norm(attention(input_norm(h)))
  m1 = post_feedforward_norm_1(mlp(pre_feedforward_norm(h)))             dense gated-GELU MLP
  m2 = post_feedforward_norm_2(experts(pre_feedforward_norm_2(h), router(h)))   the router reads raw h
  h = (h + post_feedforward_norm(m1 + m2)) · layer_scalar                 the whole stream is scaled
with the encoder's `layer_scalar` in encoder passes and the decoder's in decoder passes.

Attention: q = RoPE(q_norm(q_proj x)), k = RoPE(k_norm(k_proj x)), v = v_norm(v_proj x) on sliding
layers and v_norm(k_proj x) on full layers ("k_eq_v": the raw key projection, before k_norm and
RoPE); v_norm is a weightless RMSNorm over head_dim; scaling 1.0; query head h reads KV head
h // (heads / kv_heads). The keys and values go through a `CachePass` (gemma4_cache.py).

As in engine.models.layers, submodules are run through `forward`, not `__call__` (no hooks), and a
linear layer may be a quantized module whose `forward` is all that is used.

Tensor parallelism (Megatron's layout, as the shared layers do it): a rank holds its share of the
query heads and its KV heads (an even share, or past their count the one head its queries read,
replicated: `TensorParallel.kv_split`; the sliding and full layers' counts apply each to its own
layers), the dense MLP's gate|up rows and down columns, and its contiguous share of the routed
experts (the router stays whole: every rank routes alike). Two all-reduces a layer: the attention
output, then the dense MLP's and the experts' partial outputs together (each has its own norm
after the sum, so they are reduced side by side in one collective).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.config import ModelConfig
from engine.models.gemma4_cache import CachePass
from engine.models.gemma4_config import AttentionKind
from engine.models.gemma4_moe import Gemma4Router
from engine.models.gemma4_ops import gelu_tanh, rms_norm_unweighted
from engine.models.layers import Float32ScaleRMSNorm, FusedLinear, SwiGLU, apply_rotary
from engine.models.moe import GroupedExperts
from engine.models.parallel.group import SINGLE, TensorParallel

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, signed sin [B, L, 1, head_dim] float32


class Gemma4Attention(nn.Module):
    def __init__(self, config: ModelConfig, kind: AttentionKind, index: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.index = index
        self.tp = tp
        self.num_heads = config.num_heads // tp.size
        kv_start, self.num_kv_heads = tp.kv_split(kind.num_kv_heads)
        self.head_dim = kind.head_dim
        self.values_from_keys = kind.values_from_keys
        self.eps = config.rms_norm_eps
        q_size, kv_size = self.num_heads * kind.head_dim, self.num_kv_heads * kind.head_dim
        shards = {"q": q_size, "k": kv_size} if kind.values_from_keys else {"q": q_size, "k": kv_size, "v": kv_size}
        self.qkv_proj = FusedLinear(config.hidden_size, shards, bias=False)
        self.qkv_proj.tp_split = "out"
        # where this rank's K (and V) rows start in the checkpoint's, of how many (replicated KV heads)
        kv_rows = (kv_start * kind.head_dim, kind.num_kv_heads * kind.head_dim)
        self.qkv_proj.tp_sources = {part: kv_rows for part in shards if part != "q"}
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.o_proj.tp_split = "in"
        self.q_norm = Float32ScaleRMSNorm(kind.head_dim, config.rms_norm_eps)
        self.k_norm = Float32ScaleRMSNorm(kind.head_dim, config.rms_norm_eps)

    def project(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, heads, L, d], k and v [B, kv_heads, L, d]."""
        batch, length, _ = x.shape
        heads, kv_heads = self.num_heads, self.num_kv_heads
        parts = self.qkv_proj.forward(x).view(batch, length, -1, self.head_dim)
        q, k = parts[:, :, :heads], parts[:, :, heads:heads + kv_heads]
        v = k if self.values_from_keys else parts[:, :, heads + kv_heads:]
        cos, sin = rope
        q = apply_rotary(self.q_norm.forward(q), cos, sin, in_float32=False)
        k = apply_rotary(self.k_norm.forward(k), cos, sin, in_float32=False)
        v = rms_norm_unweighted(v, self.eps)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x: torch.Tensor, rope: Rope, cache: CachePass) -> torch.Tensor:
        q, k, v = self.project(x, rope)
        out = cache.attend(self.index, q, k, v)
        return self.tp.all_reduce(self.o_proj.forward(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)))


class GeluMlp(SwiGLU):
    """down(gelu_tanh(gate x) · up x), gate|up fused into one matmul: the shared gated MLP with
    Gemma's activation (on a tensor-parallel rank, its share of the intermediate width)."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__(hidden_size, intermediate_size, tp, activation=gelu_tanh)


class Gemma4Layer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        gemma = config.gemma
        assert gemma is not None
        self.tp = tp
        hidden, eps = config.hidden_size, config.rms_norm_eps

        def norm() -> Float32ScaleRMSNorm:
            return Float32ScaleRMSNorm(hidden, eps)

        self.input_norm, self.post_attention_norm = norm(), norm()
        self.attn = Gemma4Attention(config, gemma.attention(index), index, tp)
        self.pre_feedforward_norm, self.post_feedforward_norm_1 = norm(), norm()
        self.mlp = GeluMlp(hidden, config.intermediate_size, tp)
        self.pre_feedforward_norm_2, self.post_feedforward_norm_2 = norm(), norm()
        self.router = Gemma4Router(hidden, gemma.num_experts, gemma.experts_per_token, eps)
        first, count = tp.split(gemma.num_experts)
        self.experts = GroupedExperts(hidden, gemma.expert_intermediate_size, gemma.num_experts, first, count,
                                      activation=gelu_tanh, stacked=True)
        self.post_feedforward_norm = norm()
        self.encoder_scalar = nn.Parameter(torch.ones(1))
        self.decoder_scalar = nn.Parameter(torch.ones(1))

    def forward(self, h: torch.Tensor, rope: Rope, cache: CachePass) -> torch.Tensor:
        h = h + self.post_attention_norm.forward(self.attn.forward(self.input_norm.forward(h), rope, cache))
        dense = self.mlp.partial(self.pre_feedforward_norm.forward(h))
        flat = h.reshape(-1, h.shape[-1])
        expert_ids, weights = self.router.forward(flat)
        routed = self.experts.forward(self.pre_feedforward_norm_2.forward(flat), expert_ids, weights).view_as(h)
        if self.tp.size > 1:  # one collective for both terms (module docstring)
            dense, routed = self.tp.all_reduce(torch.stack((dense, routed))).unbind()
        dense = self.post_feedforward_norm_1.forward(dense)
        routed = self.post_feedforward_norm_2.forward(routed)
        h = h + self.post_feedforward_norm.forward(dense + routed)
        return h * (self.encoder_scalar if cache.encoder else self.decoder_scalar)

    def write_only(self, h: torch.Tensor, rope: Rope, cache: CachePass) -> None:
        """Only this layer's keys and values: an encoder pass whose output nobody reads."""
        _, k, v = self.attn.project(self.input_norm.forward(h), rope)
        cache.write(self.attn.index, k, v)
