"""The block-diffusion transformer (SDAR, LLaDA2): the shared layers under a block-causal mask.
Predictions are in place (no logit shift).

Block-causal attention: the token at absolute position p sees the key at absolute position c iff
c // block_size <= p // block_size (bidirectional inside a block, causal across blocks). Blocks are
counted from position 0 of the row, the prompt's first token, as both official decoders do.

Two entry points, both returning raw logits [B, L, vocab]:
- `forward(input_ids, position_ids, block_size=..., mask=...)`: a full forward with no cache. With
  `mask="block_causal"` the token at position p sees every token of blocks <= p // block_size; with
  `mask="additive_01"` it runs LLaDA2.1's official `generate()` mask instead: the same 0/1 block
  matrix *added* to the scores, so every token also sees later blocks (at weight e⁻¹ relative to
  the allowed ones), and a finished block's keys/values change with the current block.
- `forward_cached(input_ids, cache, block_size=...)`: each row's tokens at absolute positions
  `cache.start[r] + arange(L)`, attending block-causally to themselves and to the row's cached
  columns [0, start[r]); their keys/values are written at those columns. The cache is exact (the
  same logits as the full block-causal forward) when it holds whole blocks only, i.e. every call
  starts at a multiple of the block size: a token's keys/values depend on its whole block, so a
  prompt that ends inside a block leaves that block's prompt tokens to the first decoded block, as
  the official decoders do. A block becomes part of the cache when the caller advances `start` past
  it after a forward over its final (clean) tokens; a denoising step leaves `start` alone, and its
  keys/values, which no earlier position ever sees, are overwritten by the next step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch

from engine.models.kv_cache import CacheWrite, KVStore
from engine.models.layers import Positions
from engine.models.moe import MOE_KERNELS, GroupedExperts, grouped_mm_available
from engine.models.transformer import DiffusionTransformer, check_input_ids

BlockMask = Literal["block_causal", "additive_01"]


def block_causal_mask(query_positions: torch.Tensor, key_positions: torch.Tensor,
                      block_size: int) -> torch.Tensor:
    """[B, 1, Lq, Lk] bool (True = may attend) from query positions [B, Lq] and key positions [B, Lk]
    (either may have batch 1)."""
    query_block = torch.div(query_positions, block_size, rounding_mode="floor")
    key_block = torch.div(key_positions, block_size, rounding_mode="floor")
    return (key_block[:, None, :] <= query_block[:, :, None])[:, None]


@dataclass
class BlockCache:
    """Where a `forward_cached` call reads and writes keys/values.

    `store` keys/values are [slots, kv_heads, width, head_dim], post-QK-norm and post-RoPE keys and
    raw values, one row per slot, column = absolute position in the slot's sequence. Input row r
    uses store row `rows[r]` (r when None); its cached length is `start[r]`. `width` (a host int,
    at least max(start) + L) bounds the columns attended over; None means the whole store."""

    store: KVStore
    start: torch.Tensor  # [R] long
    rows: Optional[torch.Tensor] = None  # [R] long
    width: Optional[int] = None


class BlockDiffusionTransformer(DiffusionTransformer):
    block_causal = True

    def set_moe_kernel(self, name: Optional[str]) -> None:
        """Force the experts' kernel ("plain" or "grouped_mm"); None picks per device."""
        if name is not None and name not in MOE_KERNELS:
            raise ValueError(f"unknown MoE kernel {name!r}; known: {', '.join(MOE_KERNELS)}")
        if name == "grouped_mm" and not grouped_mm_available():
            raise ValueError("this PyTorch has no torch.nn.functional.grouped_mm")
        for module in self.modules():
            if isinstance(module, GroupedExperts):
                module.kernel = name

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None, *,  # type: ignore[override]
                block_size: int, mask: BlockMask = "block_causal",
                logits_at: Optional[Positions] = None,
                hidden_states_out: Optional[list[torch.Tensor]] = None,
                attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Raw logits [B, L, vocab] (or at `logits_at`, see `select_positions`) of a full forward over
        tokens at `position_ids` [B|1, L] (default 0..L-1). `hidden_states_out`, when a list, gets
        every layer's input and the normed final state (Hugging Face's `output_hidden_states`).
        `attention_mask`, a bool [B|1, 1, L, L] (True = may attend), replaces the block mask: training
        feeds a noisy and a clean copy of a sequence side by side (tinymodels/block_objective.py)."""
        _check_block(input_ids, block_size)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool:
                raise ValueError(f"attention_mask must be bool, got {attention_mask.dtype}")
            return self.run_layers(input_ids, position_ids, attention_mask, None, logits_at, hidden_states_out)
        if mask not in ("block_causal", "additive_01"):
            raise ValueError(f"unknown block mask {mask!r}; known: block_causal, additive_01")
        allowed = block_causal_mask(position_ids, position_ids, block_size)
        attn_mask = allowed.to(self.dtype) if mask == "additive_01" else allowed
        return self.run_layers(input_ids, position_ids, attn_mask, None, logits_at, hidden_states_out)

    def forward_cached(self, input_ids: torch.Tensor, cache: BlockCache, *, block_size: int,
                       logits_at: Optional[Positions] = None) -> torch.Tensor:
        """Raw logits [R, L, vocab] of each row's L tokens at positions `cache.start[r] + arange(L)`
        against the row's exact cache (see the module docstring)."""
        _check_block(input_ids, block_size)
        length = input_ids.shape[1]
        width = cache.store.width if cache.width is None else cache.width
        device = input_ids.device
        position_ids = cache.start[:, None] + torch.arange(length, device=device)
        columns = torch.arange(width, device=device)
        written = columns[None, :] < (cache.start + length)[:, None]  # [R, width]
        attn_mask = block_causal_mask(position_ids, columns[None], block_size) & written[:, None, None, :]
        write = CacheWrite(cache.store, position_ids, cache.rows, width=width)
        return self.run_layers(input_ids, position_ids, attn_mask, write, logits_at, None)


def _check_block(input_ids: torch.Tensor, block_size: int) -> None:
    check_input_ids(input_ids)
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
