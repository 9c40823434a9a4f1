"""Masked diffusion (LLaDA, Dream): bidirectional attention over the whole canvas, which is the
prompt followed by `gen_length` masks cut into blocks from the prompt's end.

Each row takes part in exactly one forward per step:
- full (no cache, a block's first step, or a refresh every f steps): the whole canvas; its keys and
  values are written into the row's slot of the KV store;
- dual (Fast-dLLM's DualCache): only the row's block; prefix: the block and everything after it.
  Dream also feeds the position before the block, whose output predicts the block's first token.
  These write the fed positions into the rows' slots and attend over their caches in place: the
  forward runs over the rows' span of slots, a view of the store (engine/batch.py, `Batch.spread`).
Rows of one kind share a forward.

On static buffers (`EngineConfig.static_forwards`: CUDA graphs, or torch.compile), the dual and prefix
forwards run over slots [0, bucket) (`engine.static_forward`): a slot that takes no part feeds masks
that write only the store's last column, which no row attends (every canvas is shorter than the
store); attention spans a power-of-two number of columns (one shape for every canvas up to it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch

from engine.batch import Batch, RowPlan
from engine.decoding.params import DecodeParams
from engine.host_copy import to_device
from engine.mode import DecodingMode, ForwardFn
from engine.models.kv_cache import CacheWrite
from engine.models.packing import PackedTokens
from engine.models.transformer import DiffusionTransformer
from engine.request import Geometry, Request
from engine.slots import Slots
from engine.static_forward import Buffer, attended_columns

FULL, DUAL, PREFIX = "full", "dual", "prefix"


class MaskedDiffusion(DecodingMode):
    name = "masked"
    caches = ("none", "prefix", "dual")
    scores_likelihood = True

    def __init__(self, model: DiffusionTransformer, slots: Slots, static: Optional[str] = None) -> None:
        super().__init__(model, slots, static)
        self.shift = 1 if model.logits_shifted else 0  # Dream: output i-1 predicts token i

    @property
    def forwards(self) -> dict[str, ForwardFn]:
        return {FULL: self._full, DUAL: self._dual, PREFIX: self._prefix}

    def geometry(self, prompt_len: int, params: DecodeParams) -> Geometry:
        return Geometry(prompt_len, prompt_len + params.gen_length, params.effective_block_length,
                        params.steps_per_block)

    def check_rules(self, params: DecodeParams) -> None:
        if params.gen_length % params.effective_block_length:
            self.refuse("block_length", f"block_length must divide gen_length ({params.gen_length}), got "
                                        f"{params.effective_block_length}")

    def plan(self, request: Request) -> RowPlan:
        p = request.params
        if p.cache == "none" or request.step == 0 or (p.refresh_interval and request.step % p.refresh_interval == 0):
            return RowPlan(FULL, request.length * (2 if p.cfg_scale > 0 else 1), (FULL,))
        if p.cache == "dual":
            return RowPlan(DUAL, request.block_length + self.shift, (DUAL,))
        return RowPlan(PREFIX, request.length - request.block_start + self.shift, (PREFIX,))

    def ends_inside_block(self, request: Request, end_committed: int) -> bool:
        """Early exit: nothing before the end token can change."""
        return request.params.stops_at_end

    # ---------------------------------------------------------------------------------- forwards

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
            index = to_device(torch.tensor(guided), slots.device)
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
        scale = to_device(scale, slots.device)[:, None, None]
        conditional, unconditional = logits[:n].clone(), logits[n:]
        conditional[index] = unconditional + (scale + 1) * (conditional[index] - unconditional)
        return conditional

    def _dual(self, rows: Batch, width: int) -> torch.Tensor:
        return self._cached(rows, width, through_end=False)

    def _prefix(self, rows: Batch, width: int) -> torch.Tensor:
        return self._cached(rows, width, through_end=True)

    def _cached(self, rows: Batch, width: int, through_end: bool) -> torch.Tensor:
        """Feed each row's block (dual) or block and everything after it (prefix); the other
        positions' keys/values come from the row's slot of the store."""
        requests, shift, store = rows.requests, self.shift, self.slots.store
        query_length = max((r.length if through_end else r.block_start + r.block_length) - r.block_start + shift
                           for r in requests)
        # query j of a row is its block's position j (past its block: a position never read)
        p = self.slots.positions[None, :width]
        queries = torch.where(p < rows.block_length[:, None], p, 0)
        if self.static_forwards is not None:
            return self._static(rows, query_length, queries, through_end)
        # Attention spans the step's longest canvas; query-only positions write to the column past
        # it, which no row attends (the store is wider: not read here). The forward runs over the
        # rows' span of slots, a view of the store; a slot in it that runs another forward this step
        # feeds nothing (its row of the padded grid is masks that write only that scratch column).
        scratch = rows.max_length
        ids, positions, write_index = self._cached_inputs(rows, query_length, scratch, through_end)
        # packed (engine/models/packing.py) when rows feed different counts or the span holds others
        end = rows.length if through_end else rows.block_start + rows.block_length
        packed = PackedTokens.where_padded(rows.spread(end - rows.block_start + shift, 0),
                                           sum(plan.fed for plan in rows.plans), query_length)
        cache = CacheWrite(store.rows_view(rows.span), rows.spread(write_index, scratch), width=scratch + 1,
                           packed=packed)
        logits = self.model(rows.spread(ids, self.mask_id), position_ids=rows.spread(positions, 0), cache=cache,
                            logits_at=rows.spread(queries, 0))
        return rows.gather(logits)

    def _static(self, rows: Batch, query_length: int, queries: torch.Tensor, through_end: bool) -> torch.Tensor:
        """The cached forward on static buffers, keyed by (bucket, query length, columns attended,
        logits width): the columns a power of two, within the store short of its last column (the
        scratch column of idle slots). The inputs say what is fed: a dual and a prefix step of one
        key share its shape."""
        assert self.static_forwards is not None
        store = self.slots.store
        ids, positions, write_index = self._cached_inputs(rows, query_length, store.width - 1, through_end)
        longest = max(r.length for r in rows.requests)
        columns = attended_columns(longest, store.width)
        key = (self.static_forwards.bucket(rows.requests[-1].slot), query_length, columns, queries.shape[1])
        inputs = {"ids": ids, "positions": positions, "write_index": write_index, "at": queries}
        return self.static_forwards.forward(key, lambda: self._buffers(query_length, queries.shape[1]),
                                            store.keys[0], rows.slots, inputs)

    def _buffers(self, query_length: int, width: int) -> dict[str, Buffer]:
        """A new shape's inputs and the values of a slot that takes no part (masks written to the
        scratch column)."""
        scratch = self.slots.store.width - 1
        return {"ids": Buffer((query_length,), torch.long, self.mask_id),
                "positions": Buffer((query_length,), torch.long, 0),
                "write_index": Buffer((query_length,), torch.long, scratch), "at": Buffer((width,), torch.long, 0)}

    def _static_run(self, x: Mapping[str, torch.Tensor], key: tuple[int, int, int, int]) -> torch.Tensor:
        """Logits [bucket, width, V] of slots [0, bucket)."""
        # the whole store, whose first rows are the bucket's slots (not a view of them: write_kv)
        cache = CacheWrite(self.slots.store, x["write_index"], width=key[2])
        return self.model(x["ids"], position_ids=x["positions"], cache=cache, logits_at=x["at"])

    def _cached_inputs(self, rows: Batch, query_length: int, scratch: int,
                       through_end: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A cached forward's (ids, positions, write_index): query j of a row is canvas position
        block_start - shift + j while inside its span, else a mask that writes its key/value to
        column `scratch`, past every canvas of these rows."""
        shift, slots = self.shift, self.slots
        first = rows.block_start[:, None] - shift
        j = slots.positions[None, :query_length]
        source = first + j
        end = rows.length[:, None] if through_end else first + shift + rows.block_length[:, None]
        valid = source < end
        inside = source.clamp(max=slots.canvas.shape[1] - 1)
        ids = torch.where(valid, slots.canvas[rows.slots[:, None], inside], self.mask_id)
        positions = torch.where(valid, source, 0)
        # The extra position before the block (Dream) is only a query: its cached key/value stay
        # from the last full forward, as every other position outside the fed span.
        write_index = torch.where(valid & (j >= shift), source, scratch)
        return ids, positions, write_index
