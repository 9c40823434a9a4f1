"""The model runner: builds a step's inputs, assembles KV stores and runs the forward passes.

Rows' canvases and KV caches live in slot-indexed buffers on the device (one canvas buffer, one
`KVStore` whose row s is slot s's cache), so a step gathers its block tokens and its inputs with a
few batched index operations whatever the number of rows, and never allocates or copies a cache.
Each row takes part in exactly one forward per step:
- full (no cache, a block's first step, or a refresh every f steps): the whole canvas; its keys and
  values are written into the row's slot of the store;
- dual (Fast-dLLM's DualCache): only the row's block; prefix: the block and everything after it;
  Dream also feeds the position before the block, whose output predicts the block's first token.
  it writes the fed positions into the rows' slots and attends over their caches: a view of the
  store when the rows are its first slots in order, else each layer reads the rows out of it.
This is the one place for speed tricks; the decisions (engine.decoding.decide) and the bookkeeping
(engine.scheduler) never see a store.
"""

from __future__ import annotations

import array
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from engine.decoding.decide import STEP_FIELDS, StepRows
from engine.dual_graphs import DualStepGraphs
from engine.models.kv_cache import CacheWrite, KVStore
from engine.models.transformer import DiffusionTransformer
from engine.request import FORWARD_DUAL, FORWARD_FULL, FORWARD_PREFIX, Request, slot_slice


@dataclass
class StepInputs:
    """The forward passes' result for the step's rows, in row order."""

    logits: torch.Tensor  # [B, W, V] float32: the prediction for each block position
    block_tokens: torch.Tensor  # [B, W] the canvas at each row's block (past the block: what follows it)
    in_block: torch.Tensor  # [B, W] position inside the row's block
    positions: torch.Tensor  # [B, W] canvas index of each block position
    fed_tokens: list[int]  # tokens each row fed to the model this step


# Bound on the index tensors and store views a runner keeps for reuse (cleared when reached).
_ROW_INDEX_CACHE = 256


class ModelRunner:
    def __init__(self, model: DiffusionTransformer, max_batch: int,
                 dual_graphs: Optional[DualStepGraphs] = None) -> None:
        self.model = model
        # the dual-cache forward on static buffers, as CUDA graphs when capturing (engine.dual_graphs)
        self.dual_graphs = dual_graphs
        self.device = model.device
        self.shift = 1 if model.logits_shifted else 0
        self.mask_id = model.special.mask_id
        self.pad_id = model.special.pad_id
        self.max_batch = max_batch
        self.canvas = torch.full((max_batch, 1), self.pad_id, dtype=torch.long, device=self.device)
        self._arange = torch.arange(2, device=self.device)
        self._row_indices: dict[tuple[int, ...], torch.Tensor] = {}
        self._store_views: dict[tuple[Optional[int], Optional[int], int], KVStore] = {}
        config = model.config
        self.store = KVStore.empty(config.num_layers, max_batch, config.num_kv_heads, 2, config.head_dim,
                                   model.dtype, self.device)
        self.store.key_mask[:, 0] = True  # a free slot's dummy row still attends to something
        self._views_of = self.store

    # ------------------------------------------------------------------------------ slots

    def admit(self, request: Request, running: Sequence[Request]) -> None:
        """Write the request's prompt and masks into its slot's canvas row. The buffer is as wide as
        the longest canvas plus the widest block, so no row's block window runs past it."""
        needed = max(r.length for r in running) + max(r.block_length for r in running)
        if needed > self.canvas.shape[1]:
            grown = torch.full((self.canvas.shape[0], needed), self.pad_id, dtype=torch.long, device=self.device)
            grown[:, :self.canvas.shape[1]] = self.canvas
            self.canvas = grown
            self._arange = torch.arange(needed + 1, device=self.device)
        if needed + 1 > self.store.width:
            self.store = self.store.grown(needed + 1)
        prompt = torch.frombuffer(array.array("q", request.prompt_ids), dtype=torch.long)
        self.canvas[request.slot, :request.prompt_len] = prompt.to(self.device, non_blocking=True)
        self.canvas[request.slot, request.prompt_len:request.length] = self.mask_id
        self.store.key_mask[request.slot] = self._arange[:self.store.width] < request.length

    # ------------------------------------------------------------------------------ one step

    @torch.no_grad()
    def run(self, rows: StepRows) -> StepInputs:
        requests = rows.requests
        width = rows.width
        p = self._arange[:width]
        positions = rows.column("block_start")[:, None] + p
        in_block = p[None, :] < rows.column("block_length")[:, None]
        block_tokens = self._canvas_at(rows.slot_rows, rows.fields, positions)

        by_kind: dict[str, list[int]] = {}
        fed = []
        for b, request in enumerate(requests):
            kind = request.forward_kind()
            by_kind.setdefault(kind, []).append(b)
            fed.append(self._fed_tokens(request, kind))
        if len(by_kind) == 1:
            [(kind, indices)] = by_kind.items()
            logits = self._prepare(kind, requests, rows.slot_rows, rows.fields, in_block, positions, width)()
        else:
            # Every kind's inputs are built first and the forwards then run back to back: host work
            # placed between two forwards would run with the caches the first has just flushed.
            prepared = []
            for kind, indices in by_kind.items():
                index = self._row_index(tuple(indices))
                subset = [requests[b] for b in indices]
                # what a forward reads only for blocks narrower than the step's, or at a block start
                sub_in_block = in_block[index] if any(r.block_length < width for r in subset) else None
                sub_positions = positions[index] if kind == FORWARD_FULL else None
                prepared.append(self._prepare(kind, subset, slot_slice(subset), rows.fields[index], sub_in_block,
                                              sub_positions, width))
            # back in row order after: row b's logits are at its place in the kinds' concatenation
            order = [b for indices in by_kind.values() for b in indices]
            inverse = self._row_index(tuple(sorted(range(len(order)), key=order.__getitem__)))
            parts = [forward() for forward in prepared]
            logits = torch.cat(parts).index_select(0, inverse)
        return StepInputs(logits.float(), block_tokens, in_block, positions, fed)

    def commit(self, rows: StepRows, inputs: StepInputs, new_tokens: torch.Tensor) -> None:
        """Write each row's block back (positions past a row's block get their own value back)."""
        in_order = rows.slot_rows
        if in_order is not None:
            self.canvas[in_order].scatter_(1, inputs.positions, new_tokens)
        else:
            self.canvas[rows.column("slot")[:, None], inputs.positions] = new_tokens

    def _canvas_at(self, in_order: Optional[slice], fields: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        """[B, K] the canvas of each row at `columns` [B, K]: a gather from a slice of the buffer
        when the rows hold consecutive slots in order (`in_order`), else an index by slot."""
        if in_order is not None:
            return self.canvas[in_order].gather(1, columns)
        return self.canvas[fields[:, STEP_FIELDS.index("slot"), None], columns]

    def _row_index(self, indices: tuple[int, ...]) -> torch.Tensor:
        """The rows `indices` of a step as a device tensor, made once per distinct set (a batch's
        rows split into the same few sets step after step)."""
        index = self._row_indices.get(indices)
        if index is None:
            if len(self._row_indices) >= _ROW_INDEX_CACHE:
                self._row_indices.clear()
            index = self._row_indices[indices] = torch.tensor(indices, dtype=torch.long).to(self.device)
        return index

    # ------------------------------------------------------------------------------ forwards

    def _fed_tokens(self, request: Request, kind: str) -> int:
        if kind == FORWARD_FULL:
            return request.length * (2 if request.params.cfg_scale > 0 else 1)
        if kind == FORWARD_DUAL:
            return request.block_length + self.shift
        return request.length - request.block_start + self.shift

    def _prepare(self, kind: str, requests: Sequence[Request], in_order: Optional[slice], fields: torch.Tensor,
                 in_block: Optional[torch.Tensor], positions: Optional[torch.Tensor],
                 width: int) -> Callable[[], torch.Tensor]:
        """The rows' forward of `kind` with its inputs built: called, it runs and returns the logits.
        `in_order`: the rows' slots as a slice when consecutive (`slot_slice`); `in_block` may be None
        when every row's block is `width` wide; `positions` (the block's canvas positions) is read by
        a full forward alone."""
        if kind == FORWARD_FULL:
            assert positions is not None
            return self._prepare_full(requests, in_order, fields, in_block, positions, width)
        return self._prepare_cached(requests, in_order, fields, in_block, width, through_end=kind == FORWARD_PREFIX)

    def _prepare_full(self, requests: Sequence[Request], in_order: Optional[slice], fields: torch.Tensor,
                      in_block: Optional[torch.Tensor], block_positions: torch.Tensor,
                      width: int) -> Callable[[], torch.Tensor]:
        """Every row's whole canvas; rows with a KV cache write its keys/values into their slot."""
        model = self.model
        length = max(r.length for r in requests)
        slots = fields[:, STEP_FIELDS.index("slot")]
        # the store's key mask of a slot is its canvas's real positions (ModelRunner.admit)
        if in_order is not None:
            ids, key_mask = self.canvas[in_order, :length], self.store.key_mask[in_order, :length]
        else:
            ids, key_mask = self.canvas[slots, :length], self.store.key_mask[slots, :length]
        at = block_positions - self.shift if self.shift else block_positions
        if in_block is not None and any(r.block_length < width for r in requests):
            at = torch.where(in_block, at, 0)  # past a narrower block: a position never read
        guided = [b for b, r in enumerate(requests) if r.params.cfg_scale > 0]
        if guided:  # LLaDA classifier-free guidance: the same canvas with the prompt masked
            index = torch.tensor(guided, dtype=torch.long).to(self.device, non_blocking=True)
            in_prompt = self._arange[None, :length] < fields[index, STEP_FIELDS.index("prompt_len"), None]
            ids = torch.cat([ids, torch.where(in_prompt, self.mask_id, ids[index])])
            key_mask = torch.cat([key_mask, key_mask[index]])
            at = torch.cat([at, at[index]])
        positions = self._arange[:length].expand(ids.shape[0], -1)
        cache = None
        if any(r.params.cache != "none" for r in requests):
            # a guided row has no cache (cfg needs cache "none"): its unconditional twin may write its slot too
            rows = torch.cat([slots, slots[index]]) if guided else slots
            cache = CacheWrite(self.store, positions, rows=rows, attend_to_cache=False)
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

    def _prepare_cached(self, requests: Sequence[Request], in_order: Optional[slice], fields: torch.Tensor,
                        in_block: Optional[torch.Tensor], width: int, through_end: bool) -> Callable[[], torch.Tensor]:
        """Feed each row's block (dual) or block and everything after it (prefix); the other
        positions' keys/values come from the row's slot of the store."""
        shift = self.shift
        spans = [(r.length if through_end else r.block_start + r.block_length) - r.block_start + shift
                 for r in requests]  # the positions each row feeds
        query_length = max(spans)
        every_query_fed = all(span == query_length for span in spans)  # blocks of one length: the usual batch
        if self.dual_graphs is not None and not through_end:
            # the store's last column is past every canvas: the static forward's scratch column
            ids, positions, write_index = self._cached_inputs(in_order, fields, query_length, self.store.width - 1,
                                                              through_end, every_query_fed)
            return functools.partial(self.dual_graphs.forward, self.store, fields[:, STEP_FIELDS.index("slot")],
                                     max(r.slot for r in requests), ids, positions, write_index,
                                     self._block_queries(in_block, width, len(requests)))
        # Attention spans the longest canvas of these rows, plus a scratch column past it that
        # query-only positions write to and no row attends (the store is wider: not read here).
        scratch = max(r.length for r in requests)
        ids, positions, write_index = self._cached_inputs(in_order, fields, query_length, scratch, through_end,
                                                          every_query_fed)
        store = self._store_view(in_order, scratch + 1)
        # rows of consecutive slots in order are a slice of the store: attend over a view of it; otherwise
        # each layer reads the rows out of the store (a copy of those rows)
        slots = None if in_order is not None else fields[:, STEP_FIELDS.index("slot")]
        cache = CacheWrite(store, write_index, rows=slots)
        # query j of a row is its block's position j (past its block: a position never read), so the
        # logits are the first `width` queries' as they stand, a slice rather than a gather, unless
        # these rows' blocks are all narrower than the step's widest
        at = width if query_length >= width else self._block_queries(in_block, width, len(requests))
        return functools.partial(self.model, ids, position_ids=positions, cache=cache, logits_at=at)

    def _store_view(self, rows: Optional[slice], columns: int) -> KVStore:
        """The store's `rows` (every row: None) and first `columns` columns, as views made once per
        shape: a batch's cached forwards ask for the same view step after step."""
        if self._views_of is not self.store or len(self._store_views) >= _ROW_INDEX_CACHE:
            self._store_views.clear()  # views of a store that has since grown, or too many kept
            self._views_of = self.store
        key = (None, None, columns) if rows is None else (rows.start, rows.stop, columns)
        view = self._store_views.get(key)
        if view is None:
            r = slice(None) if rows is None else rows
            view = self._store_views[key] = KVStore(keys=[k[r, :, :columns] for k in self.store.keys],
                                                    values=[v[r, :, :columns] for v in self.store.values],
                                                    key_mask=self.store.key_mask[r, :columns])
        return view

    def _block_queries(self, in_block: Optional[torch.Tensor], width: int, rows: int) -> torch.Tensor:
        """[rows, width] the query index of each block position in a cached forward (0 past a row's
        block: a position never read; `in_block` None: every block is `width` wide)."""
        if in_block is None:
            return self._arange[None, :width].expand(rows, -1)
        return torch.where(in_block, self._arange[None, :width], 0)

    def _cached_inputs(self, in_order: Optional[slice], fields: torch.Tensor, query_length: int, scratch: int,
                       through_end: bool, every_query_fed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A cached forward's (ids, positions, write_index) for rows `fields`: query j of a
        row is canvas position block_start - shift + j while inside its span, else a mask that
        writes its key/value to column `scratch`, past every canvas of these rows."""
        shift = self.shift
        first = fields[:, STEP_FIELDS.index("block_start"), None] - shift
        j = self._arange[None, :query_length]
        source = first + j
        if every_query_fed:
            ids = self._canvas_at(in_order, fields, source)
            positions = source
            valid = None
        else:
            if through_end:
                end = fields[:, STEP_FIELDS.index("length"), None]
            else:
                end = first + shift + fields[:, STEP_FIELDS.index("block_length"), None]
            valid = source < end
            inside = source.clamp(max=self.canvas.shape[1] - 1)
            ids = torch.where(valid, self._canvas_at(in_order, fields, inside), self.mask_id)
            positions = torch.where(valid, source, 0)
        # The extra position before the block (Dream) is only a query: its cached key/value stay
        # from the last full forward, as every other position outside the fed span.
        if valid is None and not shift:
            write_index = source
        else:
            written = j >= shift if valid is None else valid & (j >= shift)
            write_index = torch.where(written, source, scratch)
        return ids, positions, write_index

