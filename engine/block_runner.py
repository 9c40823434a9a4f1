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

from collections.abc import Callable

import torch

from engine.models.block_transformer import BlockCache, BlockDiffusionTransformer
from engine.models.kv_cache import KVStore
from engine.request import FORWARD_STORE, FORWARD_WINDOW, Request


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


def prepare_block_forward(model: BlockDiffusionTransformer, canvas: torch.Tensor, store: KVStore,
                          requests: list[Request], slots: torch.Tensor, cache_start: torch.Tensor,
                          width: int) -> Callable[[], torch.Tensor]:
    """The rows' forward (one `group`), returning logits [R, width, V] at their block positions
    (a store pass returns some row's logits there: no decision reads them)."""
    kind, block_length, length = group(requests[0])[:3]
    if kind == FORWARD_WINDOW:
        return _prepare_window_forward(model, canvas, requests, slots, width)
    positions = torch.arange(length, device=canvas.device)
    ids = canvas[slots[:, None], cache_start[:, None] + positions]
    cache = BlockCache(store, cache_start, rows=slots, width=max(r.cached for r in requests) + length)
    if kind == FORWARD_STORE:
        at = torch.zeros(len(requests), width, dtype=torch.long, device=canvas.device)
    else:
        at = _block_logits_at(block_length, length, len(requests), width, canvas.device)

    def forward() -> torch.Tensor:
        return model.forward_cached(ids, cache, block_size=block_length, logits_at=at)

    return forward


def _prepare_window_forward(model: BlockDiffusionTransformer, canvas: torch.Tensor, requests: list[Request],
                            slots: torch.Tensor, width: int) -> Callable[[], torch.Tensor]:
    """The rows' windows [0, block end) through the full forward with their mask; no cache is read
    or written."""
    _, block_length, length, mask = group(requests[0])
    ids = canvas[slots, :length]
    at = _block_logits_at(block_length, length, len(requests), width, canvas.device)

    def forward() -> torch.Tensor:
        return model(ids, block_size=block_length, mask=mask, logits_at=at)

    return forward
