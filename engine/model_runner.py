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
Rows of one kind (and, for block-diffusion rows, one block size and fed length) share a forward.
This is the one place for speed tricks (CUDA graphs: `engine.dual_graphs`); the decisions
(`engine.decoding.decide`) and the bookkeeping (`engine.scheduler`) never see a store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine import block_runner
from engine.batch import Batch
from engine.dual_graphs import DualStepGraphs
from engine.models.kv_cache import CacheWrite
from engine.models.transformer import DiffusionTransformer
from engine.request import FORWARD_DUAL, FORWARD_FULL, FORWARD_PREFIX, Request
from engine.slots import Slots


@dataclass
class ForwardOutput:
    """The forward passes' result for the step's rows, in row order."""

    logits: torch.Tensor  # [B, W, V] float32: the prediction for each block position
    block_tokens: torch.Tensor  # [B, W] the canvas at each row's block (past the block: what follows it)
    in_block: torch.Tensor  # [B, W] position inside the row's block
    positions: torch.Tensor  # [B, W] canvas index of each block position
    fed_tokens: list[int]  # tokens each row fed to the model this step


def forward_group(request: Request) -> tuple:
    """Rows with the same key run one forward."""
    return block_runner.group(request) if request.block_causal else (request.forward_kind(),)


def fed_tokens(request: Request, shift: int) -> int:
    """Tokens the row feeds the model this step (`shift`: Dream's position before the block)."""
    if request.block_causal:
        return block_runner.fed_length(request)
    kind = request.forward_kind()
    if kind == FORWARD_FULL:
        return request.length * (2 if request.params.cfg_scale > 0 else 1)
    if kind == FORWARD_DUAL:
        return request.block_length + shift
    return request.length - request.block_start + shift


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

    @torch.no_grad()
    def run(self, batch: Batch) -> ForwardOutput:
        width = batch.width
        p = self.slots.positions[:width]
        positions = batch.block_start[:, None] + p
        in_block = p[None, :] < batch.block_length[:, None]
        block_tokens = self.slots.canvas[batch.slots[:, None], positions]
        groups: dict[tuple, list[int]] = {}
        for b, request in enumerate(batch.requests):
            groups.setdefault(forward_group(request), []).append(b)
        if len(groups) == 1:
            logits = self.forward(next(iter(groups))[0], batch, width)
        else:  # one forward per group, the logits put back in row order
            parts = [self.forward(key[0], batch.rows(index), width) for key, index in groups.items()]
            order = [b for index in groups.values() for b in index]
            inverse = torch.tensor(sorted(range(len(order)), key=order.__getitem__)).to(self.device, non_blocking=True)
            logits = torch.cat(parts).index_select(0, inverse)
        fed = [fed_tokens(r, self.shift) for r in batch.requests]
        return ForwardOutput(logits.float(), block_tokens, in_block, positions, fed)

    def commit(self, batch: Batch, out: ForwardOutput, new_tokens: torch.Tensor) -> None:
        """Write each row's block back (positions past a row's block get their own value back)."""
        self.slots.canvas[batch.slots[:, None], out.positions] = new_tokens

    def forward(self, kind: str, rows: Batch, width: int) -> torch.Tensor:
        """The rows' forward of `kind`: logits [R, width, V] at their block positions."""
        if rows.requests[0].block_causal:
            return block_runner.block_forward(self.model, self.slots, rows, width)
        if kind == FORWARD_FULL:
            return self._full(rows, width)
        return self._cached(rows, width, through_end=kind == FORWARD_PREFIX)

    def _full(self, rows: Batch, width: int) -> torch.Tensor:
        """Every row's whole canvas; rows with a KV cache write its keys/values into their slot."""
        model, slots, requests = self.model, self.slots, rows.requests
        length = max(r.length for r in requests)
        # the store's key mask of a slot is its canvas's real positions (Slots.admit)
        ids, key_mask = slots.canvas[rows.slots, :length], slots.store.key_mask[rows.slots, :length]
        p = slots.positions[:width]
        at = rows.block_start[:, None] + p - self.shift
        if any(r.block_length < width for r in requests):
            at = torch.where(p < rows.block_length[:, None], at, 0)  # past a narrower block: never read
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
        logits = model(ids, attention_mask=key_mask, position_ids=positions, cache=cache, logits_at=at)
        if not guided:
            return logits
        n = len(requests)
        scale = torch.tensor([requests[b].params.cfg_scale for b in guided], dtype=model.dtype)
        scale = scale.to(self.device, non_blocking=True)[:, None, None]
        conditional, unconditional = logits[:n].clone(), logits[n:]
        conditional[index] = unconditional + (scale + 1) * (conditional[index] - unconditional)
        return conditional

    def _cached(self, rows: Batch, width: int, through_end: bool) -> torch.Tensor:
        """Feed each row's block (dual) or block and everything after it (prefix); the other
        positions' keys/values come from the row's slot of the store."""
        requests, shift, store = rows.requests, self.shift, self.slots.store
        query_length = max((r.length if through_end else r.block_start + r.block_length) - r.block_start + shift
                           for r in requests)
        # query j of a row is its block's position j (past its block: a position never read)
        p = self.slots.positions[None, :width]
        queries = torch.where(p < rows.block_length[:, None], p, 0)
        if self.dual_graphs is not None and not through_end:
            # the store's last column is past every canvas: the static forward's scratch column
            ids, positions, write_index = self._cached_inputs(rows, query_length, store.width - 1, through_end)
            return self.dual_graphs.forward(store, rows.slots, max(r.slot for r in requests), ids, positions,
                                            write_index, queries)
        # Attention spans the longest canvas of these rows, plus a scratch column past it that
        # query-only positions write to and no row attends (the store is wider: not read here).
        scratch = max(r.length for r in requests)
        ids, positions, write_index = self._cached_inputs(rows, query_length, scratch, through_end)
        # rows of consecutive slots are a slice of the store: attend over a view of it; otherwise each
        # layer reads the rows out of the store (a copy of those rows)
        if rows.slot_range is not None:
            cache = CacheWrite(store.rows_view(rows.slot_range), write_index, width=scratch + 1)
        else:
            cache = CacheWrite(store, write_index, rows=rows.slots, width=scratch + 1)
        return self.model(ids, position_ids=positions, cache=cache, logits_at=queries)

    def _cached_inputs(self, rows: Batch, query_length: int, scratch: int,
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
