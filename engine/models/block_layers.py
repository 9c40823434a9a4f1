"""The layers of the block-diffusion families (SDAR, LLaDA2) on the shared ones: attention with
QK-norm, partial RoPE and a block-causal mask over an optional exact K/V cache, and a decoder layer
whose MLP is dense SwiGLU or LLaDA2's mixture of experts.

Block-causal attention: the token at absolute position p sees the key at absolute position c iff
c // block_size <= p // block_size (bidirectional inside a block, causal across blocks). Blocks are
counted from position 0 of the row, the prompt's first token, as both official decoders do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from engine.models.attention import AttentionFn, sdpa_attention
from engine.models.config import ModelConfig
from engine.models.layers import FusedLinear, RMSNorm, SwiGLU, apply_rotary, write_kv
from engine.models.moe import SparseMoe


class Float32ScaleRMSNorm(RMSNorm):
    """RMSNorm that multiplies by its weight in float32 and casts once (SDAR's Triton `rms_norm_fn`);
    the shared RMSNorm casts first. The same numbers in float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return super().forward(x)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


def make_norm(size: int, config: ModelConfig) -> RMSNorm:
    cls = Float32ScaleRMSNorm if config.norm_scale_in_float32 else RMSNorm
    return cls(size, config.rms_norm_eps)


def block_causal_mask(query_positions: torch.Tensor, key_positions: torch.Tensor,
                      block_size: int) -> torch.Tensor:
    """[B, 1, Lq, Lk] bool (True = may attend) from query positions [B, Lq] and key positions [B, Lk]
    (either may have batch 1)."""
    query_block = torch.div(query_positions, block_size, rounding_mode="floor")
    key_block = torch.div(key_positions, block_size, rounding_mode="floor")
    return (key_block[:, None, :] <= query_block[:, :, None])[:, None]


@dataclass
class LayerCache:
    """One layer's share of a `BlockCache` for one forward: write this forward's keys/values at
    columns `write_index` [R, Lq] of store rows `rows` [R], then attend over the first `width`
    columns of those rows."""

    keys: torch.Tensor  # [S, kv_heads, store width, head_dim]
    values: torch.Tensor
    write_index: torch.Tensor
    rows: torch.Tensor
    width: int
    rows_are_store: bool  # rows is arange(S): read the store in place instead of gathering rows


class BlockAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.rotary_dim = config.rotary_dim
        self.rope_in_float32 = config.rope_in_float32
        self.qkv_proj = FusedLinear(config.hidden_size,
                                    {"q": config.q_size, "k": config.kv_size, "v": config.kv_size},
                                    bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=False)
        self.q_norm = make_norm(config.head_dim, config) if config.qk_norm else None
        self.k_norm = make_norm(config.head_dim, config) if config.qk_norm else None
        self.kernel: AttentionFn = sdpa_attention

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                cache: Optional[LayerCache] = None) -> torch.Tensor:
        """`mask` [B|1, 1, Lq, Lk]: bool (True = may attend) or float (added to the scores). Keys are
        this forward's tokens, or with `cache` the cache's first `cache.width` columns after this
        forward's keys/values were written into them."""
        batch, length, _ = x.shape
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj.forward(x).view(
            batch, length, heads + 2 * kv_heads, self.head_dim)
        q, k, v = qkv.split((heads, kv_heads, kv_heads), dim=2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm.forward(q), self.k_norm.forward(k)
        qk = torch.cat((q, k), dim=2)  # one rotation over the query and key heads side by side
        if self.rotary_dim == self.head_dim:
            qk = apply_rotary(qk, cos, sin, self.rope_in_float32)
        else:
            rotated = apply_rotary(qk[..., :self.rotary_dim], cos, sin, self.rope_in_float32)
            qk = torch.cat((rotated, qk[..., self.rotary_dim:]), dim=-1)
        q = qk[:, :, :heads].transpose(1, 2)
        k = qk[:, :, heads:].transpose(1, 2)
        v = v.transpose(1, 2)
        if cache is not None:
            write_kv(cache.keys, k, cache.write_index, cache.rows)
            write_kv(cache.values, v, cache.write_index, cache.rows)
            if cache.rows_are_store:
                k, v = cache.keys[:, :, :cache.width], cache.values[:, :, :cache.width]
            else:
                k, v = cache.keys[cache.rows, :, :cache.width], cache.values[cache.rows, :, :cache.width]
        if mask.dtype != torch.bool:
            mask = mask.to(q.dtype)  # SDPA wants an additive mask in the query dtype
        out = self.kernel(q, k, v, mask)
        return self.o_proj.forward(out.transpose(1, 2).reshape(batch, length, -1))


class BlockDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.attn_norm = make_norm(config.hidden_size, config)
        self.attn = BlockAttention(config)
        self.mlp_norm = make_norm(config.hidden_size, config)
        moe = config.moe
        self.mlp: nn.Module = (SparseMoe(config.hidden_size, moe) if moe is not None and index >= moe.first_dense_layers
                               else SwiGLU(config.hidden_size, config.intermediate_size))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                cache: Optional[LayerCache] = None) -> torch.Tensor:
        x = x + self.attn.forward(self.attn_norm.forward(x), cos, sin, mask, cache)
        return x + self.mlp.forward(self.mlp_norm.forward(x))
