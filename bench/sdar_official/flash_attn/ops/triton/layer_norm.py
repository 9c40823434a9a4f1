"""CPU stand-in for flash-attn's Triton `rms_norm_fn` (see ../../../README.md): plain torch."""

from __future__ import annotations

from typing import Any, Optional

import torch


def rms_norm_fn(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, eps: float = 1e-6,
                **unused: Any) -> torch.Tensor:
    """x / rms(x) * weight (+ bias), computed in float32 and cast back once, as the kernel does."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    if bias is not None:
        normed = normed + bias.float()
    return normed.to(x.dtype)
