"""CPU stand-in for the two flash-attn names SDAR's official model calls at inference (see
../README.md): plain torch, not flash-attn."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
                    softmax_scale: Optional[float] = None, causal: bool = False, **unused: Any) -> torch.Tensor:
    """Attention over [batch, seq, heads, dim] tensors (flash-attn's layout), grouped-query heads
    allowed; returns [batch, seq, heads, dim]."""
    if dropout_p:
        raise NotImplementedError("the CPU stand-in has no dropout (inference only)")
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=causal, scale=softmax_scale, enable_gqa=True)
    return out.transpose(1, 2)


def flash_attn_varlen_func(*args: Any, **kwargs: Any) -> torch.Tensor:
    raise NotImplementedError("not on the official SDAR inference path; the CPU stand-in lacks it")
