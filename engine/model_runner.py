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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from engine.decoding.decide import STEP_FIELDS, StepRows
from engine.dual_graphs import DualStepGraphs
from engine.models.kv_cache import CacheWrite, KVStore
from engine.models.transformer import DiffusionTransformer
from engine.request import FORWARD_DUAL, FORWARD_FULL, FORWARD_PREFIX, Request


@dataclass
class StepInputs:
    """The forward passes' result for the step's rows, in row order."""

    logits: torch.Tensor  # [B, W, V] float32: the prediction for each block position
    block_tokens: torch.Tensor  # [B, W] the canvas at each row's block (past the block: what follows it)
    in_block: torch.Tensor  # [B, W] position inside the row's block
    positions: torch.Tensor  # [B, W] canvas index of each block position
    fed_tokens: list[int]  # tokens each row fed to the model this step


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
        config = model.config
        self.store = KVStore.empty(config.num_layers, max_batch, config.num_kv_heads, 2, config.head_dim,
                                   model.dtype, self.device)
        self.store.key_mask[:, 0] = True  # a free slot's dummy row still attends to something

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
        row = torch.tensor([*request.prompt_ids, *([self.mask_id] * request.gen_length)], dtype=torch.long)
        self.canvas[request.slot, :request.length] = row.to(self.device, non_blocking=True)
        self.store.key_mask[request.slot] = self._arange[:self.store.width] < request.length

    # ------------------------------------------------------------------------------ one step

    @torch.no_grad()
    def run(self, rows: StepRows) -> StepInputs:
        requests = rows.requests
        width = rows.width
        slots = rows.column("slot")
        p = self._arange[:width]
        positions = rows.column("block_start")[:, None] + p
        in_block = p[None, :] < rows.column("block_length")[:, None]
        block_tokens = self.canvas[slots[:, None], positions]

        by_kind: dict[str, list[int]] = {}
        for b, request in enumerate(requests):
            by_kind.setdefault(request.forward_kind(), []).append(b)
        fed = [0] * len(requests)
        if len(by_kind) == 1:
            [(kind, indices)] = by_kind.items()
            logits = self._forward(kind, requests, rows.fields, in_block, width)
        else:
            parts, order = [], []
            for kind, indices in by_kind.items():
                index = torch.tensor(indices, dtype=torch.long).to(self.device, non_blocking=True)
                parts.append(self._forward(kind, [requests[b] for b in indices], rows.fields[index],
                                           in_block[index], width))
                order.extend(indices)
            inverse = torch.tensor(sorted(range(len(order)), key=order.__getitem__), dtype=torch.long)
            logits = torch.cat(parts)[inverse.to(self.device, non_blocking=True)]
        for kind, indices in by_kind.items():
            for b in indices:
                fed[b] = self._fed_tokens(requests[b], kind)
        return StepInputs(logits.float(), block_tokens, in_block, positions, fed)

    def commit(self, rows: StepRows, inputs: StepInputs, new_tokens: torch.Tensor) -> None:
        """Write each row's block back (positions past a row's block get their own value back)."""
        self.canvas[rows.column("slot")[:, None], inputs.positions] = new_tokens

    # ------------------------------------------------------------------------------ forwards

    def _fed_tokens(self, request: Request, kind: str) -> int:
        if kind == FORWARD_FULL:
            return request.length * (2 if request.params.cfg_scale > 0 else 1)
        if kind == FORWARD_DUAL:
            return request.block_length + self.shift
        return request.length - request.block_start + self.shift

    def _forward(self, kind: str, requests: Sequence[Request], fields: torch.Tensor, in_block: torch.Tensor,
                 width: int) -> torch.Tensor:
        if kind == FORWARD_FULL:
            return self._forward_full(requests, fields, in_block, width)
        return self._forward_cached(requests, fields, in_block, width, through_end=kind == FORWARD_PREFIX)

    def _forward_full(self, requests: Sequence[Request], fields: torch.Tensor, in_block: torch.Tensor,
                      width: int) -> torch.Tensor:
        """Every row's whole canvas; rows with a KV cache write its keys/values into their slot."""
        model = self.model
        length = max(r.length for r in requests)
        slots = fields[:, STEP_FIELDS.index("slot")]
        ids = self.canvas[slots, :length]
        key_mask = self._arange[None, :length] < fields[:, STEP_FIELDS.index("length"), None]
        at = fields[:, STEP_FIELDS.index("block_start"), None] - self.shift + self._arange[None, :width]
        at = torch.where(in_block, at, 0)
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
        logits = model(ids, attention_mask=key_mask, position_ids=positions, cache=cache, logits_at=at)
        if guided:
            n = len(requests)
            conditional = logits[:n].clone()
            scale = torch.tensor([requests[b].params.cfg_scale for b in guided], dtype=logits.dtype)
            scale = scale.to(self.device, non_blocking=True)[:, None, None]
            unconditional = logits[n:]
            conditional[index] = unconditional + (scale + 1) * (conditional[index] - unconditional)
            logits = conditional
        return logits

    def _forward_cached(self, requests: Sequence[Request], fields: torch.Tensor, in_block: torch.Tensor,
                        width: int, through_end: bool) -> torch.Tensor:
        """Feed each row's block (dual) or block and everything after it (prefix); the other
        positions' keys/values come from the row's slot of the store."""
        shift = self.shift
        query_length = max((r.length if through_end else r.block_start + r.block_length) - r.block_start + shift
                           for r in requests)
        if self.dual_graphs is not None and not through_end:
            # the store's last column is past every canvas: the static forward's scratch column
            ids, positions, write_index = self._cached_inputs(fields, query_length, self.store.width - 1,
                                                              through_end)
            return self.dual_graphs.forward(self.store, fields[:, STEP_FIELDS.index("slot")],
                                            max(r.slot for r in requests), ids, positions, write_index,
                                            self._block_queries(in_block, width))
        # Attention spans the longest canvas of these rows, plus a scratch column past it that
        # query-only positions write to and no row attends (the store is wider: not read here).
        scratch = max(r.length for r in requests)
        ids, positions, write_index = self._cached_inputs(fields, query_length, scratch, through_end)
        span = max(r.slot for r in requests) + 1
        in_slot_order = span == len(requests) and all(r.slot == b for b, r in enumerate(requests))
        rows = slice(None, span) if in_slot_order else slice(None)
        store = KVStore(keys=[k[rows, :, :scratch + 1] for k in self.store.keys],
                        values=[v[rows, :, :scratch + 1] for v in self.store.values],
                        key_mask=self.store.key_mask[rows, :scratch + 1])
        # in slot order the rows are the store's first rows: attend over a view of them; otherwise
        # each layer reads the rows out of the store (a copy of those rows)
        cache = CacheWrite(store, write_index, rows=None if in_slot_order else fields[:, STEP_FIELDS.index("slot")])
        # query j of a row is its block's position j (past its block: a position never read), so the
        # logits are the first `width` queries' as they stand, a slice rather than a gather, unless
        # these rows' blocks are all narrower than the step's widest
        at = width if query_length >= width else self._block_queries(in_block, width)
        return self.model(ids, position_ids=positions, cache=cache, logits_at=at)

    def _block_queries(self, in_block: torch.Tensor, width: int) -> torch.Tensor:
        """[B, width] the query index of each block position in a cached forward (0 past a row's
        block: a position never read)."""
        return torch.where(in_block, self._arange[None, :width], 0)

    def _cached_inputs(self, fields: torch.Tensor, query_length: int, scratch: int,
                       through_end: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A cached forward's (ids, positions, write_index) for rows `fields`: query j of a
        row is canvas position block_start - shift + j while inside its span, else a mask that
        writes its key/value to column `scratch`, past every canvas of these rows."""
        shift = self.shift
        first = fields[:, STEP_FIELDS.index("block_start"), None] - shift
        if through_end:
            end = fields[:, STEP_FIELDS.index("length"), None]
        else:
            end = first + shift + fields[:, STEP_FIELDS.index("block_length"), None]
        j = self._arange[None, :query_length]
        source = first + j
        valid = source < end
        slots = fields[:, STEP_FIELDS.index("slot")]
        ids = torch.where(valid, self.canvas[slots[:, None], source.clamp(max=self.canvas.shape[1] - 1)],
                          self.mask_id)
        positions = torch.where(valid, source, 0)
        # The extra position before the block (Dream) is only a query: its cached key/value stay
        # from the last full forward, as every other position outside the fed span.
        write_index = torch.where(valid & (j >= shift), source, scratch)
        return ids, positions, write_index
