"""Small Gemma4 pieces the shared layers do not have: the weightless RMSNorm, Gemma's GELU and
the per-layer-kind RoPE (default or proportional).

Numerics follow the official code: RMSNorm normalises in float32 and casts back (the weighted one is
`layers.Float32ScaleRMSNorm`, which also scales in float32); RoPE's cos/sin are float32, cast to the
activation dtype for the rotation (`layers.apply_rotary` with `in_float32=False`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.models.gemma4_config import AttentionKind
from engine.models.layers import RotaryEmbedding


def rms_norm_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x · (mean(x²) + eps)^(-1/2) over the last dim, in float32, cast back."""
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """`gelu_pytorch_tanh`, Gemma's activation."""
    return F.gelu(x, approximate="tanh")


class KindRotaryEmbedding(RotaryEmbedding):
    """Rotate-half RoPE over the whole head for one attention kind: the first `rotated_pairs`
    pairs (i, i + head_dim/2) at theta^(-2j/head_dim) / factor (the exponent divides by head_dim,
    not by the rotated width: proportional RoPE), the remaining pairs at frequency 0 (unrotated)."""

    def __init__(self, kind: AttentionKind) -> None:
        super().__init__(kind.head_dim, kind.rope_theta)
        self.rotated_pairs = kind.rotated_pairs
        self.factor = kind.rope_factor

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        cached = self._inv_freq.get(device)
        if cached is None:
            exponent = torch.arange(0, 2 * self.rotated_pairs, 2, device=device, dtype=torch.int64).float() / self.dim
            rotated = 1.0 / (self.theta ** exponent)
            still = torch.zeros(self.dim // 2 - self.rotated_pairs, device=device)
            cached = self._inv_freq[device] = torch.cat((rotated, still)) / self.factor
        return cached
