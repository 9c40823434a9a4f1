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
from typing import Literal, Optional, Union

import torch

from engine.models.kv_cache import CacheWrite, KVStore
from engine.models.layers import Positions
from engine.models.moe import MOE_KERNELS, GroupedExperts, grouped_mm_available
from engine.models.packing import PackedTokens
from engine.models.transformer import DiffusionTransformer, check_input_ids

BlockMask = Literal["block_causal", "additive_01"]


BlockSize = Union[int, torch.Tensor]  # one block size, or each row's ([B] long; [B, 1] for the mask)


def block_causal_mask(query_positions: torch.Tensor, key_positions: torch.Tensor,
                      block_size: BlockSize) -> torch.Tensor:
    """[B, 1, Lq, Lk] bool (True = may attend) from query positions [B, Lq] and key positions [B, Lk]
    (either may have batch 1), under one block size or each row's ([B, 1])."""
    query_block = torch.div(query_positions, block_size, rounding_mode="floor")
    key_block = torch.div(key_positions, block_size, rounding_mode="floor")
    return (key_block[:, None, :] <= query_block[:, :, None])[:, None]


@dataclass
class BlockCache:
    """Where a `forward_cached` call reads and writes keys/values.

    `store` keys/values are [R, kv_heads, width, head_dim], post-QK-norm and post-RoPE keys and raw
    values, column = absolute position in the row's sequence; input row r reads and writes store
    row r in place (the engine hands a view of the rows' slots, `KVStore.rows_view`, or the whole
    store when they are its first slots). Row r's cached
    length is `start[r]`. `width` (a host int, at least max(start + fed)) bounds the columns
    attended over; None means the whole store.

    Rows may feed different numbers of tokens in one forward: row r's first `fed[r]` inputs are its
    tokens, the rest padding whose keys/values go to column `scratch` (one no row attends, past
    `width`) and whose outputs are never read. A row with fed 0 takes no part."""

    store: KVStore
    start: torch.Tensor  # [R] long
    width: Optional[int] = None
    fed: Optional[torch.Tensor] = None  # [R] long; None: every input of every row
    scratch: Optional[int] = None  # needed with `fed`
    # the sum of `fed`, known on the host: the forward then packs the fed tokens (engine/models/packing.py)
    fed_total: Optional[int] = None


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

    def forward_cached(self, input_ids: torch.Tensor, cache: BlockCache, *, block_size: BlockSize,
                       logits_at: Optional[Positions] = None) -> torch.Tensor:
        """Raw logits [R, L, vocab] of each row's tokens at positions `cache.start[r] + arange(L)`
        against the row's exact cache (see the module docstring), under one block size or each
        row's ([R] long)."""
        _check_block(input_ids, block_size)
        length = input_ids.shape[1]
        width = cache.store.width if cache.width is None else cache.width
        device = input_ids.device
        j = torch.arange(length, device=device)[None]
        start = cache.start[:, None]
        if cache.fed is None:
            position_ids, end = start + j, cache.start + length
            write_index = position_ids
        else:
            if cache.scratch is None:
                raise ValueError("a BlockCache with `fed` needs a `scratch` column")
            fed = cache.fed[:, None]
            # padding sits at its row's last fed position (a valid query, never read); a row that
            # feeds nothing attends to column 0 alone, so that no query's scores are all masked
            position_ids = start + torch.minimum(j, (fed - 1).clamp(min=0))
            write_index = torch.where(j < fed, start + j, cache.scratch)
            end = (cache.start + cache.fed).clamp(min=1)
        columns = torch.arange(width, device=device)
        written = columns[None, :] < end[:, None]  # [R, width]
        sizes = block_size if isinstance(block_size, int) else block_size[:, None]
        attn_mask = block_causal_mask(position_ids, columns[None], sizes) & written[:, None, None, :]
        packed = None
        if cache.fed is not None and cache.fed_total is not None:
            packed = PackedTokens.where_padded(cache.fed, cache.fed_total, length)
        write = CacheWrite(cache.store, write_index, width=width, packed=packed)
        return self.run_layers(input_ids, position_ids, attn_mask, write, logits_at, None)


def _check_block(input_ids: torch.Tensor, block_size: BlockSize) -> None:
    check_input_ids(input_ids)
    if isinstance(block_size, int) and block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
