"""The model runner: turns a step's batch into forward passes over the slots' canvases and caches.

Each row takes part in exactly one forward per step:
- full (no cache, a block's first step, or a refresh every f steps): the whole canvas; its keys and
  values are written into the row's slot of the KV store;
- dual (Fast-dLLM's DualCache): only the row's block; prefix: the block and everything after it.
  Dream also feeds the position before the block, whose output predicts the block's first token.
  These write the fed positions into the rows' slots and attend over their caches: a view of the
  store when the rows hold consecutive slots, else each layer reads the rows out of it;
- block-diffusion rows (`engine.block_runner`): the block against the row's exact cache, SDAR's
  store pass, or without a cache the whole window [0, block end).
This is the one place for speed tricks (CUDA graphs: `engine.dual_graphs`); the decisions
(`engine.decoding.decide`) and the bookkeeping (`engine.scheduler`) never see a store.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch

from engine import block_runner
from engine.batch import Batch
from engine.dual_graphs import DualStepGraphs
from engine.models.kv_cache import CacheWrite, KVStore
from engine.models.transformer import DiffusionTransformer
from engine.request import (
    FORWARD_BLOCK,
    FORWARD_DUAL,
    FORWARD_FULL,
    FORWARD_PREFIX,
    FORWARD_STORE,
    FORWARD_WINDOW,
    Request,
)
from engine.slots import Slots


@dataclass
class ForwardOutput:
    """The forward passes' result for the step's rows, in row order."""

    logits: torch.Tensor  # [B, W, V] float32: the prediction for each block position
    block_tokens: torch.Tensor  # [B, W] the canvas at each row's block (past the block: what follows it)
    in_block: torch.Tensor  # [B, W] position inside the row's block
    positions: torch.Tensor  # [B, W] canvas index of each block position
    fed_tokens: list[int]  # tokens each row fed to the model this step


# Bound on the store views a runner keeps for reuse (cleared when reached).
_STORE_VIEWS = 256


@dataclass(frozen=True)
class _Rows:
    """A subset of a step's rows that runs one forward: its requests and their step fields."""

    requests: list[Request]
    slots: torch.Tensor
    block_start: torch.Tensor
    block_length: torch.Tensor
    length: torch.Tensor
    prompt_len: torch.Tensor
    cache_start: torch.Tensor
    slot_range: Optional[slice]

    @classmethod
    def of(cls, batch: Batch, index: Optional[list[int]] = None) -> _Rows:
        if index is None:
            return cls(batch.requests, batch.slots, batch.block_start, batch.block_length, batch.length,
                       batch.prompt_len, batch.cache_start, batch.slot_range)
        rows = torch.tensor(index).to(batch.slots.device, non_blocking=True)
        requests = [batch.requests[b] for b in index]
        first = requests[0].slot
        consecutive = all(r.slot == first + k for k, r in enumerate(requests))
        return cls(requests, batch.slots[rows], batch.block_start[rows], batch.block_length[rows],
                   batch.length[rows], batch.prompt_len[rows], batch.cache_start[rows],
                   slice(first, first + len(requests)) if consecutive else None)


class ModelRunner:
    def __init__(self, model: DiffusionTransformer, slots: Slots,
                 dual_graphs: Optional[DualStepGraphs] = None) -> None:
        self.model = model
        self.slots = slots
        # the dual-cache forward on static buffers, as CUDA graphs when capturing (engine.dual_graphs)
        self.dual_graphs = dual_graphs
        self.device = model.device
        self.shift = 1 if model.logits_shifted else 0
        self.mask_id = model.special.mask_id
        self._store_views: dict[tuple[int, int, int], KVStore] = {}
        self._views_of = slots.store

    @torch.no_grad()
    def run(self, batch: Batch) -> ForwardOutput:
        width = batch.width
        p = self.slots.positions[:width]
        positions = batch.block_start[:, None] + p
        in_block = p[None, :] < batch.block_length[:, None]
        block_tokens = self.slots.canvas[batch.slots[:, None], positions]
        by_kind: dict[tuple, list[int]] = {}
        for b, request in enumerate(batch.requests):
            by_kind.setdefault(block_runner.group(request) if request.block_causal else (request.forward_kind(),),
                               []).append(b)
        fed = [self._fed_tokens(r, r.forward_kind()) for r in batch.requests]
        if len(by_kind) == 1:
            [kind] = by_kind
            logits = self._prepare(kind, _Rows.of(batch), in_block, positions, width)()
        else:
            # Every kind's inputs are built first and the forwards then run back to back: host work
            # placed between two forwards would run with the caches the first has just flushed.
            prepared = []
            for kind, index in by_kind.items():
                rows = torch.tensor(index).to(self.device, non_blocking=True)
                prepared.append(self._prepare(kind, _Rows.of(batch, index), in_block[rows], positions[rows], width))
            order = [b for index in by_kind.values() for b in index]
            inverse = torch.tensor(sorted(range(len(order)), key=order.__getitem__)).to(self.device, non_blocking=True)
            logits = torch.cat([forward() for forward in prepared]).index_select(0, inverse)
        return ForwardOutput(logits.float(), block_tokens, in_block, positions, fed)

    def commit(self, batch: Batch, out: ForwardOutput, new_tokens: torch.Tensor) -> None:
        """Write each row's block back (positions past a row's block get their own value back)."""
        self.slots.canvas[batch.slots[:, None], out.positions] = new_tokens

    def _fed_tokens(self, request: Request, kind: str) -> int:
        if request.block_causal:
            return block_runner.fed_length(request)
        if kind == FORWARD_FULL:
            return request.length * (2 if request.params.cfg_scale > 0 else 1)
        if kind == FORWARD_DUAL:
            return request.block_length + self.shift
        return request.length - request.block_start + self.shift

    def _prepare(self, key: tuple, rows: _Rows, in_block: torch.Tensor, positions: torch.Tensor,
                 width: int) -> Callable[[], torch.Tensor]:
        """The rows' forward of kind `key[0]` with its inputs built: called, it runs and returns the logits."""
        kind = key[0]
        if kind in (FORWARD_BLOCK, FORWARD_STORE, FORWARD_WINDOW):
            return block_runner.prepare_block_forward(self.model, self.slots.canvas, self.slots.store, rows.requests,
                                                      rows.slots, rows.cache_start, width)
        if kind == FORWARD_FULL:
            return self._prepare_full(rows, in_block, positions, width)
        return self._prepare_cached(rows, in_block, width, through_end=kind == FORWARD_PREFIX)

    def _prepare_full(self, rows: _Rows, in_block: torch.Tensor, block_positions: torch.Tensor,
                      width: int) -> Callable[[], torch.Tensor]:
        """Every row's whole canvas; rows with a KV cache write its keys/values into their slot."""
        model, slots, requests = self.model, self.slots, rows.requests
        length = max(r.length for r in requests)
        # the store's key mask of a slot is its canvas's real positions (Slots.admit)
        ids, key_mask = slots.canvas[rows.slots, :length], slots.store.key_mask[rows.slots, :length]
        at = block_positions - self.shift
        if any(r.block_length < width for r in requests):
            at = torch.where(in_block, at, 0)  # past a narrower block: a position never read
        guided = [b for b, r in enumerate(requests) if r.params.cfg_scale > 0]
        if guided:  # LLaDA classifier-free guidance: the same canvas with the prompt masked
            index = torch.tensor(guided).to(self.device, non_blocking=True)
            in_prompt = slots.positions[None, :length] < rows.prompt_len[index, None]
            ids = torch.cat([ids, torch.where(in_prompt, self.mask_id, ids[index])])
            key_mask = torch.cat([key_mask, key_mask[index]])
            at = torch.cat([at, at[index]])
        positions = slots.positions[:length].expand(ids.shape[0], -1)
        cache = None
        if any(r.params.cache != "none" for r in requests):
            # a guided row has no cache (cfg needs cache "none"): its unconditional twin may write its slot too
            store_rows = torch.cat([rows.slots, rows.slots[index]]) if guided else rows.slots
            cache = CacheWrite(slots.store, positions, rows=store_rows, attend_to_cache=False)
        if not guided:
            return functools.partial(model, ids, attention_mask=key_mask, position_ids=positions, cache=cache,
                                     logits_at=at)
        n = len(requests)
        scale = torch.tensor([requests[b].params.cfg_scale for b in guided], dtype=model.dtype)
        scale = scale.to(self.device, non_blocking=True)[:, None, None]

        def guided_forward() -> torch.Tensor:
            logits = model(ids, attention_mask=key_mask, position_ids=positions, cache=cache, logits_at=at)
            conditional = logits[:n].clone()
            unconditional = logits[n:]
            conditional[index] = unconditional + (scale + 1) * (conditional[index] - unconditional)
            return conditional

        return guided_forward

    def _prepare_cached(self, rows: _Rows, in_block: torch.Tensor, width: int,
                        through_end: bool) -> Callable[[], torch.Tensor]:
        """Feed each row's block (dual) or block and everything after it (prefix); the other
        positions' keys/values come from the row's slot of the store."""
        requests, shift = rows.requests, self.shift
        query_length = max((r.length if through_end else r.block_start + r.block_length) - r.block_start + shift
                           for r in requests)
        # query j of a row is its block's position j (past its block: a position never read)
        queries = torch.where(in_block, self.slots.positions[None, :width], 0)
        if self.dual_graphs is not None and not through_end:
            # the store's last column is past every canvas: the static forward's scratch column
            ids, positions, write_index = self._cached_inputs(rows, query_length, self.slots.store.width - 1,
                                                              through_end)
            return functools.partial(self.dual_graphs.forward, self.slots.store, rows.slots,
                                     max(r.slot for r in requests), ids, positions, write_index, queries)
        # Attention spans the longest canvas of these rows, plus a scratch column past it that
        # query-only positions write to and no row attends (the store is wider: not read here).
        scratch = max(r.length for r in requests)
        ids, positions, write_index = self._cached_inputs(rows, query_length, scratch, through_end)
        # rows of consecutive slots are a slice of the store: attend over a view of it; otherwise each
        # layer reads the rows out of the store (a copy of those rows)
        if rows.slot_range is not None:
            cache = CacheWrite(self._store_view(rows.slot_range, scratch + 1), write_index)
        else:
            cache = CacheWrite(self._store_view(slice(0, self.slots.store.batch), scratch + 1), write_index,
                               rows=rows.slots)
        return functools.partial(self.model, ids, position_ids=positions, cache=cache, logits_at=queries)

    def _store_view(self, rows: slice, columns: int) -> KVStore:
        """The store's `rows` and first `columns` columns, as views made once per shape (a batch's
        cached forwards ask for the same view step after step; a view avoids a copy per layer)."""
        store = self.slots.store
        if self._views_of is not store or len(self._store_views) >= _STORE_VIEWS:
            self._store_views.clear()  # views of a store that has since grown, or too many kept
            self._views_of = store
        key = (rows.start, rows.stop, columns)
        view = self._store_views.get(key)
        if view is None:
            view = self._store_views[key] = KVStore(keys=[k[rows, :, :columns] for k in store.keys],
                                                    values=[v[rows, :, :columns] for v in store.values],
                                                    key_mask=store.key_mask[rows, :columns])
        return view

    def _cached_inputs(self, rows: _Rows, query_length: int, scratch: int,
                       through_end: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A cached forward's (ids, positions, write_index): query j of a row is canvas position
        block_start - shift + j while inside its span, else a mask that writes its key/value to
        column `scratch`, past every canvas of these rows."""
        shift = self.shift
        first = rows.block_start[:, None] - shift
        j = self.slots.positions[None, :query_length]
        source = first + j
        end = rows.length[:, None] if through_end else first + shift + rows.block_length[:, None]
        valid = source < end
        inside = source.clamp(max=self.slots.canvas.shape[1] - 1)
        ids = torch.where(valid, self.slots.canvas[rows.slots[:, None], inside], self.mask_id)
        positions = torch.where(valid, source, 0)
        # The extra position before the block (Dream) is only a query: its cached key/value stay
        # from the last full forward, as every other position outside the fed span.
        write_index = torch.where(valid & (j >= shift), source, scratch)
        return ids, positions, write_index
