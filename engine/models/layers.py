"""Layers shared by every model family: RMSNorm, rotary embedding, attention block, SwiGLU MLP.

Projections that read the same input are fused (q|k|v and gate|up) so each is one matmul; the
loader fills the fused weights shard by shard through `shard_offsets`.

Inside a layer, submodules are run through their `forward`, not through `nn.Module.__call__`: its
hook dispatch costs a few microseconds a call, ten calls a layer, which is a visible share of a
small model's decoding step on a CPU. No hook is ever registered on these submodules; the model
itself is still called normally. A linear layer may be a quantized library module
(engine.quantization): its `forward` is the only interface layers rely on.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.attention import AttentionFn, sdpa_attention
from engine.models.config import ModelConfig

# Input positions whose outputs are wanted: the first K positions (an int K) or [B, K] indices.
Positions = Union[int, torch.Tensor]

# (keys, values, write_index, the store row of each input row, rows or None, attend to the cache): one
# layer's share of a CacheWrite
LayerCache = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor], bool]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # PyTorch's kernel for the formula below (float32 in and out; bit for bit on CPU, where the
            # parity and golden tests run)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Both official models normalise in float32 and cast back *before* scaling by the weight.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class FusedLinear(nn.Linear):
    """A linear layer whose output rows are the concatenation of named checkpoint tensors."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shards.items():
            self.shard_offsets[name] = (start, size)
            start += size


class RotaryEmbedding(nn.Module):
    """Rotate-half (NeoX) RoPE over the full head dimension, cos/sin always built in float32.

    The inverse frequencies are computed once per device and kept outside the module's buffers, so
    casting the model to bfloat16 never rounds them."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        cached = self._inv_freq.get(device)
        if cached is None:
            exponent = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.int64).float() / self.head_dim
            cached = self._inv_freq[device] = 1.0 / (self.theta ** exponent)
        return cached

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, L] -> cos, signed sin of shape [B, L, 1, head_dim] in float32 (heads
        broadcast). The sine's first half is negated, so that rotate-half is a plain swap of halves:
        rotate_half(x) * sin == swap_halves(x) * signed_sin, exactly (a sign flip does not round)."""
        freqs = position_ids.float()[..., None] * self.inv_freq(position_ids.device)
        sin = freqs.sin()
        angles = torch.cat((freqs, freqs), dim=-1)[:, :, None]
        return angles.cos(), torch.cat((-sin, sin), dim=-1)[:, :, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                 in_float32: bool) -> torch.Tensor:
    """RoPE on x [B, L, heads, head_dim] with `RotaryEmbedding`'s cos and signed sin."""
    if in_float32 and x.dtype != torch.float32:
        return apply_rotary(x.float(), cos, signed_sin, False).to(x.dtype)
    if not in_float32:
        cos, signed_sin = cos.to(x.dtype), signed_sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * signed_sin


def select_positions(x: torch.Tensor, at: Positions) -> torch.Tensor:
    """x [B, L, ...] at the positions `at` of each row: [B, K, ...]."""
    if isinstance(at, int):
        return x[:, :at]
    index = at.reshape(*at.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])
    return x.gather(1, index)


def write_kv(store: torch.Tensor, new: torch.Tensor, write_index: torch.Tensor,
             rows: Optional[torch.Tensor] = None) -> None:
    """store[rows[b], :, write_index[b, i]] = new[b, :, i] for store [S, heads, width, dim] and new
    [B, heads, L, dim] (rows[b] = b when None). Indexed assignment through a [S, width, heads, dim]
    view rather than scatter_ along the width: the same writes, but each fed position moves one
    contiguous heads x dim slab instead of a scatter_ that walks every element with its own index."""
    if rows is None:
        rows = torch.arange(new.shape[0], device=write_index.device)
    store.transpose(1, 2)[rows[:, None], write_index] = new.transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.rope_in_float32 = config.rope_in_float32
        self.qkv_proj = FusedLinear(config.hidden_size,
                                    {"q": config.q_size, "k": config.kv_size, "v": config.kv_size},
                                    bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=False)
        self.kernel: AttentionFn = sdpa_attention

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                key_mask: Optional[torch.Tensor],
                cache: Optional[LayerCache] = None, query_at: Optional[Positions] = None) -> torch.Tensor:
        """With `cache`, this forward's k/v are written into the cache (see `CacheWrite`) and, when
        it says so, the queries attend over the whole cache. With `query_at`, every position is a key
        and a value but only those positions are queries: the output is theirs alone."""
        batch, length, _ = x.shape
        q_width = self.num_heads * self.head_dim
        qkv = self.qkv_proj.forward(x)
        # RoPE on the queries and keys together: one rotation over their heads side by side
        qk = qkv[..., :q_width + self.num_kv_heads * self.head_dim].view(
            batch, length, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = apply_rotary(qk, cos, sin, self.rope_in_float32)
        q = qk[:, :, :self.num_heads]
        if query_at is not None:
            q = select_positions(q, query_at)
        q = q.transpose(1, 2)
        k = qk[:, :, self.num_heads:].transpose(1, 2)
        v = qkv[..., q_width + self.num_kv_heads * self.head_dim:].view(
            batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if cache is not None:
            cache_k, cache_v, write_index, write_rows, rows, attend_to_cache = cache
            write_kv(cache_k, k, write_index, write_rows)
            write_kv(cache_v, v, write_index, write_rows)
            if attend_to_cache:  # the cache rows of this forward's inputs
                k, v = (cache_k, cache_v) if rows is None else (cache_k[rows], cache_v[rows])
        out = self.kernel(q, k, v, key_mask)
        return self.o_proj.forward(out.transpose(1, 2).reshape(batch, q.shape[2], -1))


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = FusedLinear(hidden_size, {"gate": intermediate_size, "up": intermediate_size},
                                        bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward(x).split(self.intermediate_size, dim=-1)
        return self.down_proj.forward(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                key_mask: Optional[torch.Tensor],
                cache: Optional[LayerCache] = None, query_at: Optional[Positions] = None) -> torch.Tensor:
        """The layer's output at every position, or at `query_at` only (every position still
        writes its keys and values): what a last layer needs when only some logits are wanted."""
        attended = self.attn.forward(self.attn_norm.forward(x), cos, sin, key_mask, cache, query_at)
        x = (x if query_at is None else select_positions(x, query_at)) + attended
        return x + self.mlp.forward(self.mlp_norm.forward(x))
