"""Bidirectional attention kernels, chosen in one place.

Masked diffusion models attend in both directions, so every kernel here runs non-causal. flash-attn
is used when it is installed, the tensors live on CUDA in fp16/bf16 and no key-padding mask is
needed; everything else goes through PyTorch's `scaled_dot_product_attention`, which handles the
padding mask and grouped KV heads itself.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F

# q: [B, Hq, Lq, D]; k, v: [B, Hkv, Lk, D]; key_mask: [B, 1, 1, Lk] bool (True = may attend) or None.
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   key_mask: Optional[torch.Tensor]) -> torch.Tensor:
    grouped = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, is_causal=False,
                                          enable_gqa=grouped)


def _flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     key_mask: Optional[torch.Tensor]) -> torch.Tensor:
    if key_mask is not None:
        # flash_attn_func has no padding mask; padded batches take the SDPA path.
        return sdpa_attention(q, k, v, key_mask)
    from flash_attn import flash_attn_func

    # flash-attn wants [B, L, H, D] and handles grouped KV heads natively.
    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=False)
    return out.transpose(1, 2)


def select_attention(device: torch.device, dtype: torch.dtype,
                     use_flash: Optional[bool] = None) -> tuple[str, AttentionFn]:
    """Return (backend name, kernel). `use_flash=None` means "when it can be used"."""
    flash_ok = device.type == "cuda" and dtype in _FLASH_DTYPES and flash_attn_available()
    if use_flash and not flash_ok:
        raise ValueError("flash-attn was requested but needs CUDA, fp16/bf16 and the flash_attn package")
    if flash_ok and use_flash is not False:
        return "flash_attn", _flash_attention
    return "sdpa", sdpa_attention
