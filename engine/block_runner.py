"""The block-diffusion forwards of the model runner: each row denoises its current block against
its exact cache (`BlockDiffusionTransformer.forward_cached` over the slot's row of the KV store),
or, without a cache (`cache="none"`), by a full forward of its window.

A row's cache holds its positions [0, cache_start), whole blocks only. A denoising forward feeds
the row's tokens from cache_start to its block's end: the clean tokens not cached yet (the prompt's
whole blocks at the first step, the finished block at a block's first step) ride along in front
of the block and their keys/values, exact because block-causal attention never lets them see the
block, are written as they go. SDAR's store pass (`DecodeParams.store_pass`) feeds only those
clean tokens, as the official decoder's extra forward does, and its logits are never read.

A window forward feeds positions [0, block end) (the prompt, the finished blocks and the block) with
the row's attention mask, as LLaDA2's official `generate()` does at every step: the baseline of the
exact cache, and the only way to run LLaDA2.1's additive 0/1 mask, under which finished blocks
attend to the current block and so cannot be cached.

Rows that share a forward share its block size, fed length (and mask): the runner groups them (`group`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.models.block_transformer import BlockCache, BlockDiffusionTransformer
from engine.request import FORWARD_STORE, FORWARD_WINDOW, Request

if TYPE_CHECKING:
    from engine.batch import Batch
    from engine.slots import Slots


def fed_length(request: Request) -> int:
    """Tokens the row feeds this step: its uncached clean tokens, and its block unless storing (its
    whole window without a cache)."""
    kind = request.forward_kind()
    end = request.block_start + (0 if kind == FORWARD_STORE else request.block_length)
    return end if kind == FORWARD_WINDOW else end - request.cached


def group(request: Request) -> tuple:
    """Rows with the same key run one forward."""
    kind = request.forward_kind()
    if kind == FORWARD_WINDOW:
        return kind, request.block_length, fed_length(request), request.params.block_attention
    return kind, request.block_length, fed_length(request)


def _block_logits_at(block_length: int, length: int, rows: int, width: int, device: torch.device) -> torch.Tensor:
    """[rows, width]: the fed index of each block position (the block is the last `block_length` fed
    tokens; past a narrower block, a position never read)."""
    p = torch.arange(width, device=device)
    return torch.where(p < block_length, length - block_length + p, 0).expand(rows, -1)


def block_forward(model: BlockDiffusionTransformer, slots: Slots, rows: Batch, width: int) -> torch.Tensor:
    """The rows' forward (one `group`): logits [R, width, V] at their block positions (a store pass
    returns some row's logits there: no decision reads them)."""
    requests = rows.requests
    kind, block_length, length = group(requests[0])[:3]
    canvas = slots.canvas
    at = _block_logits_at(block_length, length, len(requests), width, canvas.device)
    if kind == FORWARD_WINDOW:  # [0, block end) with the row's mask; no cache is read or written
        return model(canvas[rows.slots, :length], block_size=block_length, mask=requests[0].params.block_attention,
                     logits_at=at)
    positions = torch.arange(length, device=canvas.device)
    ids = canvas[rows.slots[:, None], rows.cache_start[:, None] + positions]
    cache = BlockCache(slots.store, rows.cache_start, rows=rows.slots, width=max(r.cached for r in requests) + length)
    if kind == FORWARD_STORE:
        at = torch.zeros(len(requests), width, dtype=torch.long, device=canvas.device)
    return model.forward_cached(ids, cache, block_size=block_length, logits_at=at)
