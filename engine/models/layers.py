"""Layers shared by every model family: RMSNorm, rotary embedding, attention, SwiGLU MLP.

Projections that read the same input are fused (q|k|v and gate|up) so each is one matmul; the
loader fills the fused weights shard by shard through `shard_offsets`. The families differ only in
what `ModelConfig` switches on: QK-norm and partial RoPE (SDAR, LLaDA2), where RMSNorm scales in
float32, and the attention mask their model builds (bidirectional, or block-causal).

Inside a layer, submodules are run through their `forward`, not through `nn.Module.__call__`: its
hook dispatch costs a few microseconds a call, ten calls a layer, which is a visible share of a
small model's decoding step on a CPU. No hook is ever registered on these submodules; the model
itself is still called normally. A linear layer may be a quantized library module
(engine.quantization): its `forward` is the only interface layers rely on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.attention import AttentionFn, sdpa_attention
from engine.models.config import ModelConfig
from engine.models.kv_cache import CacheWrite
from engine.models.parallel.group import SINGLE, TensorParallel

# Input positions whose outputs are wanted: the first K positions (an int K) or [B, K] indices.
Positions = Union[int, torch.Tensor]


def normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, unscaled, in x's dtype: the formula's operations in
    its order (bit for bit what `F.rms_norm` gives on CPU), the temporaries updated in place. A
    small model's step on a CPU is bound by the number of tensor operations, not their size."""
    scale = (x * x).mean(-1, keepdim=True)
    return x * scale.add_(eps).rsqrt_()


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return normalized(x, self.eps).mul_(self.weight)
        # LLaDA, Dream and LLaDA2 normalise in float32 and cast back *before* scaling by the weight.
        return self.weight * normalized(x.float(), self.eps).to(x.dtype)


class Float32ScaleRMSNorm(RMSNorm):
    """RMSNorm that multiplies by its weight in float32 and casts once (SDAR's Triton `rms_norm_fn`);
    the shared RMSNorm casts first. The same numbers in float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return super().forward(x)
        return (self.weight.float() * normalized(x.float(), self.eps)).to(x.dtype)


def make_norm(size: int, config: ModelConfig) -> RMSNorm:
    cls = Float32ScaleRMSNorm if config.norm_scale_in_float32 else RMSNorm
    return cls(size, config.rms_norm_eps)


class FusedLinear(nn.Linear):
    """A linear layer whose output rows are the concatenation of named checkpoint tensors (on a
    tensor-parallel rank, of this rank's rows of each: `engine.models.parallel.sharding`)."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shards.items():
            self.shard_offsets[name] = (start, size)
            start += size


class RotaryEmbedding(nn.Module):
    """Rotate-half (NeoX) RoPE over the first `dim` dims of each head, cos/sin always built in float32.

    The inverse frequencies are computed once per device and kept outside the module's buffers, so
    casting the model to bfloat16 never rounds them."""

    def __init__(self, dim: int, theta: float) -> None:
        super().__init__()
        self.dim = dim
        self.theta = theta
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        cached = self._inv_freq.get(device)
        if cached is None:
            exponent = torch.arange(0, self.dim, 2, device=device, dtype=torch.int64).float() / self.dim
            cached = self._inv_freq[device] = 1.0 / (self.theta ** exponent)
        return cached

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, L] -> cos, signed sin of shape [B, L, 1, dim] in float32 (heads
        broadcast). The sine's first half is negated, so that rotate-half is a plain swap of halves:
        rotate_half(x) * sin == swap_halves(x) * signed_sin, exactly (a sign flip does not round)."""
        freqs = position_ids.float()[..., None] * self.inv_freq(position_ids.device)
        sin = freqs.sin()
        angles = torch.cat((freqs, freqs), dim=-1)[:, :, None]
        return angles.cos(), torch.cat((-sin, sin), dim=-1)[:, :, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                 in_float32: bool) -> torch.Tensor:
    """RoPE on x [B, L, heads, dim] with `RotaryEmbedding`'s cos and signed sin."""
    if in_float32 and x.dtype != torch.float32:
        return apply_rotary(x.float(), cos, signed_sin, False).to(x.dtype)
    if not in_float32:
        cos, signed_sin = cos.to(x.dtype), signed_sin.to(x.dtype)
    # the halves swapped (rotate-half up to the sign the sine carries): one roll, the same copy as
    # chunking and concatenating in the other order
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def select_positions(x: torch.Tensor, at: Positions) -> torch.Tensor:
    """x [B, L, ...] at the positions `at` of each row: [B, K, ...]."""
    if isinstance(at, int):
        return x[:, :at]
    index = at.reshape(*at.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])
    return x.gather(1, index)


class Attention(nn.Module):
    """Self-attention over this rank's heads (all of them on one device): the q|k|v projection is
    column-parallel (each rank computes its heads' rows), the output projection row-parallel (each
    rank multiplies its heads' columns), and one all-reduce sums the ranks' outputs."""

    def __init__(self, config: ModelConfig, index: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.index = index  # the layer's keys and values in a KV store
        self.tp = tp
        self.num_heads = config.num_heads // tp.size
        kv_start, self.num_kv_heads = tp.kv_split(config.num_kv_heads)
        self.head_dim = config.head_dim
        self.rotary_dim = config.rotary_dim
        self.rope_in_float32 = config.rope_in_float32
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = FusedLinear(config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size},
                                    bias=config.qkv_bias)
        self.qkv_proj.tp_split = "out"
        # where this rank's K and V rows start in the checkpoint's, of how many (replicated KV heads)
        kv_rows = (kv_start * self.head_dim, config.num_kv_heads * self.head_dim)
        self.qkv_proj.tp_sources = {"k": kv_rows, "v": kv_rows}
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.o_proj.tp_split = "in"
        self.q_norm = make_norm(config.head_dim, config) if config.qk_norm else None
        self.k_norm = make_norm(config.head_dim, config) if config.qk_norm else None
        self.kernel: AttentionFn = sdpa_attention

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Optional[torch.Tensor],
                cache: Optional[CacheWrite] = None, query_at: Optional[Positions] = None) -> torch.Tensor:
        """`mask` [B|1, 1, Lq|1, Lk]: bool (True = may attend), float (added to the scores) or None.
        Keys are this forward's tokens, or with `cache` the cache's (`CacheWrite.write_and_read`).
        With `query_at`, every position is a key and a value but only those positions are queries:
        the output is theirs alone."""
        batch, length, _ = x.shape
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj.forward(x).view(batch, length, heads + 2 * kv_heads, self.head_dim)
        qk, v = qkv[:, :, :heads + kv_heads], qkv[:, :, heads + kv_heads:]
        if self.q_norm is not None and self.k_norm is not None:
            qk = self._qk_normed(qk, heads, kv_heads)
        # RoPE on the queries and keys together: one rotation over their heads side by side
        if self.rotary_dim == self.head_dim:
            qk = apply_rotary(qk, cos, sin, self.rope_in_float32)
        else:  # partial RoPE: the last dims pass through
            rotated = apply_rotary(qk[..., :self.rotary_dim], cos, sin, self.rope_in_float32)
            qk = torch.cat((rotated, qk[..., self.rotary_dim:]), dim=-1)
        q = qk[:, :, :heads] if query_at is None else select_positions(qk[:, :, :heads], query_at)
        packed = cache.packed if cache is not None else None
        if packed is not None:  # packed tokens: the queries on their rows' padded grid (engine/models/packing.py)
            q = packed.pad(q)
        q, k, v = q.transpose(1, 2), qk[:, :, heads:].transpose(1, 2), v.transpose(1, 2)
        if cache is not None:
            k, v = cache.write_and_read(self.index, k, v)
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(q.dtype)  # SDPA wants an additive mask in the query dtype
        out = self.kernel(q, k, v, mask).transpose(1, 2)
        if packed is not None:
            out = packed.pack(out)
        return self.tp.all_reduce(self.o_proj.forward(out.reshape(batch, out.shape[1], -1)))

    def _qk_normed(self, qk: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
        """QK-norm of the queries' and keys' heads side by side [B, L, heads + kv_heads, dim]."""
        q_norm, k_norm = self.q_norm, self.k_norm
        assert q_norm is not None and k_norm is not None
        q_weight, k_weight = q_norm.weight, k_norm.weight
        if qk.dtype == torch.float32 and q_weight.dtype == k_weight.dtype == torch.float32 and q_norm.eps == k_norm.eps:
            # one normalisation over every head, each head then scaled by its norm's weight: the
            # same numbers as the two norms (the weight multiplies last either way), half the operations
            weight = torch.cat((q_weight.expand(heads, -1), k_weight.expand(kv_heads, -1)))
            return normalized(qk, q_norm.eps).mul_(weight)
        return torch.cat((q_norm.forward(qk[:, :, :heads]), k_norm.forward(qk[:, :, heads:])), dim=2)


class SwiGLU(nn.Module):
    """The gated MLP over this rank's share of the intermediate width: gate|up column-parallel,
    down row-parallel, one all-reduce (`partial` leaves it to a caller that sums more first).
    `activation` gates it: SiLU (SwiGLU), or tanh-GELU (Gemma4's GeGLU, `gemma4_layers.GeluMlp`)."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TensorParallel = SINGLE,
                 activation: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> None:
        super().__init__()
        self.tp = tp
        self.activation = activation
        self.intermediate_size = intermediate_size // tp.size
        self.gate_up_proj = FusedLinear(hidden_size, {"gate": self.intermediate_size, "up": self.intermediate_size},
                                        bias=False)
        self.gate_up_proj.tp_split = "out"
        self.down_proj = nn.Linear(self.intermediate_size, hidden_size, bias=False)
        self.down_proj.tp_split = "in"

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's term of the output (the output itself on one device)."""
        gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)
        return self.down_proj.forward(self.activation(gate) * up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.partial(x))
