"""Block diffusion (SDAR, LLaDA2): causal across blocks, bidirectional inside a block. Each row
denoises its current block against its exact cache (`BlockDiffusionTransformer.forward_cached` over
the slot's row of the KV store), or, without a cache (`cache="none"`), by a full forward of its
window.

Geometry: blocks count from the prompt's first token, as both official decoders count them. A row's
first decoded block starts at the block boundary before the prompt's end and holds the prompt's tail
as fixed tokens; its canvas ends at the block boundary past prompt + gen_length, whatever
gen_length is (the official decoders round `prompt + gen_length` up on the block grid).

A row's cache holds its positions [0, cache_start), whole blocks only. A denoising forward feeds
the row's tokens from cache_start to its block's end: the clean tokens not cached yet (the prompt's
whole blocks at the first step, the finished block at a block's first step) ride along in front
of the block and their keys/values, exact because block-causal attention never lets them see the
block, are written as they go. SDAR's store pass (`DecodeParams.store_pass`) feeds only those
clean tokens, as the official decoder's extra forward does, and commits nothing.

A window forward feeds positions [0, block end) (the prompt, the finished blocks and the block) with
the row's attention mask, as LLaDA2's official `generate()` does at every step: the baseline of the
exact cache, and the only way to run LLaDA2.1's additive 0/1 mask, under which finished blocks
attend to the current block and so cannot be cached.

Every row that runs against its exact cache (a denoising step or a store pass, whatever its block
size and fed length) takes part in one forward, its fed tokens packed (engine/models/packing.py):
the rows hold slots [0, n) in row order (engine/scheduler.py), so the forward attends over a view of
the store's first rows, never a copy. Window rows share a forward by block size, fed length and mask.

On static buffers (`EngineConfig.static_forwards`: CUDA graphs, or torch.compile), the cached forward
runs over slots [0, bucket) on the padded grid of the step's longest feed (`engine.static_forward`),
when that is at most two blocks: a block's denoising steps feed the block, its first step the finished
block too. A longer feed (a prompt's first step) runs the ordinary, packed forward. Its attention
spans a power-of-two number of columns (one shape for every width up to it), masked to each row's.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engine.batch import Batch, RowPlan
from engine.decoding.params import DecodeParams
from engine.mode import DecodingMode, ForwardFn
from engine.models.block_transformer import BlockCache, BlockDiffusionTransformer
from engine.request import Geometry, Request
from engine.static_forward import Buffer, attended_columns

BLOCK, STORE, WINDOW = "block", "store", "window"
CACHED = "cached"  # the group of every row that runs against its exact cache


class BlockDiffusion(DecodingMode):
    name = "block"
    caches = ("exact", "none")
    prefix_caching = True
    model: BlockDiffusionTransformer

    @property
    def forwards(self) -> dict[str, ForwardFn]:
        return {BLOCK: self._cached, STORE: self._cached, WINDOW: self._window}

    def geometry(self, prompt_len: int, params: DecodeParams) -> Geometry:
        width = params.effective_block_length
        return Geometry(prompt_len // width * width, -(-(prompt_len + params.gen_length) // width) * width, width,
                        params.steps_per_block)

    def check_rules(self, params: DecodeParams) -> None:
        if params.store_pass and params.cache == "none":
            self.refuse("store_pass", "store_pass writes a finished block into the exact cache: it needs "
                                      "cache='exact'")

    def plan(self, request: Request) -> RowPlan:
        """The uncached clean tokens and the block (the block alone at a store pass; the whole window
        without a cache)."""
        p = request.params
        block_start, width = request.block_start, request.block_length
        if p.cache == "none":
            fed = block_start + width
            return RowPlan(WINDOW, fed, (WINDOW, width, fed, p.block_attention))
        if p.store_pass and request.cached < block_start:
            fed = block_start - request.cached
            return RowPlan(STORE, fed, (CACHED,), commits=False)
        fed = block_start + width - request.cached
        return RowPlan(BLOCK, fed, (CACHED,))

    def cached_after(self, request: Request, plan: RowPlan) -> int:
        """With the exact cache, any forward wrote every clean token before the block."""
        return request.cached if plan.kind == WINDOW else request.block_start

    def ends_inside_block(self, request: Request, end_committed: int) -> bool:
        """LLaDA2.0's in-loop eos_early_stop, at a step that committed an end token; a policy that
        edits may still change it (LLaDA2.1's check follows its block)."""
        return request.params.eos_early_stop and not request.policy.edits and end_committed > 0

    # ---------------------------------------------------------------------------------- forwards

    def _logits_at(self, block_length: int, length: int, rows: int, width: int) -> torch.Tensor:
        """[rows, width]: the fed index of each block position (the block is the last `block_length` fed
        tokens; past a narrower block, a position never read)."""
        p = self.slots.positions[:width]
        return torch.where(p < block_length, length - block_length + p, 0).expand(rows, -1)

    def _window(self, rows: Batch, width: int) -> torch.Tensor:
        """[0, block end) with the rows' mask; no cache is read or written."""
        requests, plan = rows.requests, rows.plans[0]
        block_length = requests[0].block_length
        at = self._logits_at(block_length, plan.fed, len(requests), width)
        return self.model(self.slots.canvas[rows.slots, :plan.fed], block_size=block_length,
                          mask=requests[0].params.block_attention, logits_at=at)

    def _cached(self, rows: Batch, width: int) -> torch.Tensor:
        """The rows' fed tokens against their exact caches, in one forward (packed where the rows feed
        different counts): logits [R, width, V] at their block positions (a store pass returns some
        logits there: no decision reads them)."""
        requests, canvas, positions = rows.requests, self.slots.canvas, self.slots.positions
        length = max(plan.fed for plan in rows.plans)
        # the device's count of each row's fed tokens: the clean tokens before its block, then its
        # block unless it is a store pass (RowPlan.commits)
        fed = rows.block_start - rows.cache_start + rows.commits * rows.block_length
        j = positions[None, :length]
        source = (rows.cache_start[:, None] + j).clamp(max=canvas.shape[1] - 1)
        ids = torch.where(j < fed[:, None], canvas[rows.slots[:, None], source], self.mask_id)
        p = positions[None, :width]
        block = rows.block_length[:, None]
        at = torch.where((p < block) & (rows.commits[:, None] > 0), fed[:, None] - block + p, 0)
        attended = max(r.cached + plan.fed for r, plan in zip(requests, rows.plans, strict=True))
        if self.static_forwards is not None and length <= 2 * rows.width:
            return self._static(rows, {"ids": ids, "start": rows.cache_start, "fed": fed, "block": rows.block_length,
                                       "at": at}, length, attended, width)
        # over the rows' span of slots (a view of the store); a window row inside it feeds nothing
        cache = BlockCache(self.slots.store.rows_view(rows.span), rows.spread(rows.cache_start, 0),
                           width=attended,
                           fed=rows.spread(fed, 0), scratch=rows.max_length,
                           fed_total=sum(plan.fed for plan in rows.plans))
        logits = self.model.forward_cached(rows.spread(ids, self.mask_id), cache,
                                           block_size=rows.spread(rows.block_length, 1), logits_at=rows.spread(at, 0))
        return rows.gather(logits)

    def _static(self, rows: Batch, inputs: Mapping[str, torch.Tensor], length: int, attended: int,
                width: int) -> torch.Tensor:
        """The cached forward on static buffers (`engine.static_forward`), keyed by (bucket, fed
        length, columns attended, logits width): the columns a power of two (within the store, short
        of its last column, the scratch column of idle slots and padding)."""
        assert self.static_forwards is not None
        store = self.slots.store
        columns = attended_columns(attended, store.width)
        key = (self.static_forwards.bucket(rows.requests[-1].slot), length, columns, width)
        return self.static_forwards.forward(key, lambda: self._buffers(length, width), store.keys[0], rows.slots,
                                            inputs)

    def _buffers(self, length: int, width: int) -> dict[str, Buffer]:
        """A new shape's inputs and the values of a slot that takes no part."""
        return {"ids": Buffer((length,), torch.long, self.mask_id), "start": Buffer((), torch.long, 0),
                "fed": Buffer((), torch.long, 0), "block": Buffer((), torch.long, 1),
                "at": Buffer((width,), torch.long, 0)}

    def _static_run(self, x: Mapping[str, torch.Tensor], key: tuple[int, int, int, int]) -> torch.Tensor:
        """Logits [bucket, width, V] of slots [0, bucket): an idle slot feeds nothing (its padding
        writes the store's last column, which no row attends)."""
        columns = key[2]
        store = self.slots.store
        # the whole store, whose first rows are the bucket's slots: a view of them would be copied
        # whole by a compiled forward's writes (engine.models.kv_cache.write_kv)
        cache = BlockCache(store, x["start"], width=columns, fed=x["fed"],
                           scratch=store.width - 1)
        return self.model.forward_cached(x["ids"], cache, block_size=x["block"], logits_at=x["at"])
