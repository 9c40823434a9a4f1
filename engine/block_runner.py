"""The block-diffusion forwards of the model runner: each row denoises its current block against
its exact cache (`BlockDiffusionTransformer.forward_cached` over the slot's row of the KV store).

A row's cache holds its positions [0, cache_start), whole blocks only. A denoising forward feeds
the row's tokens from cache_start to its block's end: the clean tokens not cached yet (the prompt's
whole blocks at the first step, the finished block at a block's first step) ride along in front
of the block and their keys/values, exact because block-causal attention never lets them see the
block, are written as they go. SDAR's store pass (`DecodeParams.store_pass`) feeds only those
clean tokens, as the official decoder's extra forward does, and its logits are never read.

Rows that share a forward share its block size and fed length: the runner groups them (`group`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.models.block_transformer import BlockCache, BlockDiffusionTransformer
from engine.models.kv_cache import KVStore
from engine.request import FORWARD_STORE, Request


def fed_length(request: Request) -> int:
    """Tokens the row feeds this step: its uncached clean tokens, and its block unless storing."""
    end = request.block_start + (0 if request.forward_kind() == FORWARD_STORE else request.block_length)
    return end - request.cached


def group(request: Request) -> tuple[str, int, int]:
    """Rows with the same key run one forward."""
    return request.forward_kind(), request.block_length, fed_length(request)


def prepare_block_forward(model: BlockDiffusionTransformer, canvas: torch.Tensor, store: KVStore,
                          requests: list[Request], slots: torch.Tensor, cache_start: torch.Tensor,
                          width: int) -> Callable[[], torch.Tensor]:
    """The rows' forward (one `group`), returning logits [R, width, V] at their block positions
    (a store pass returns some row's logits there: no decision reads them)."""
    kind, block_length, length = group(requests[0])
    positions = torch.arange(length, device=canvas.device)
    ids = canvas[slots[:, None], cache_start[:, None] + positions]
    cache = BlockCache(store, cache_start, rows=slots, width=max(r.cached for r in requests) + length)
    p = torch.arange(width, device=canvas.device)
    if kind == FORWARD_STORE:
        at = torch.zeros(len(requests), width, dtype=torch.long, device=canvas.device)
    else:  # the block is the last block_length fed tokens; past a narrower block: a position never read
        at = torch.where(p < block_length, length - block_length + p, 0).expand(len(requests), -1)

    def forward() -> torch.Tensor:
        return model.forward_cached(ids, cache, block_size=block_length, logits_at=at)

    return forward
