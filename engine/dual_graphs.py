"""Fast-dLLM's dual-cache forward on static, slot-indexed buffers, captured as CUDA graphs.

On a GPU the dual-cache step of an 8B model at small batch takes a few milliseconds, so launching its
dozen kernels per layer one at a time from Python costs a visible share of it; a CUDA graph launches
the whole forward at once. A graph replays fixed shapes at fixed addresses, so this forward runs on
buffers indexed by slot rather than by the step's rows:

- row s of every input buffer is slot s; a graph covers slots [0, bucket), where bucket is the
  smallest capture size above the highest slot in the step (the scheduler hands out the lowest free
  slots, so this is about the number of running rows), and attends over the store's full width;
- a slot that does not take part (free, or running a full forward this step) is fed inputs that
  write only the store's last column, which no row ever attends (every canvas is shorter than the
  store: `ModelRunner.admit`), so its cache is untouched; its outputs are never read.

A graph is captured the first time its (bucket, query length, logits width) is needed, and every
graph is dropped when the store's tensors are reallocated (it grows when a longer request arrives). Without
capture (`capture=False`, any device) the same static forward runs eagerly: that is what the tests
check against the engine's ordinary cached forward on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.models.kv_cache import CacheWrite, KVStore
from engine.models.transformer import DiffusionTransformer
from engine.static_forward import batch_buckets


@dataclass
class _StaticForward:
    """One (bucket, query length, logits width)'s input and output buffers and its graph."""

    ids: torch.Tensor  # [bucket, Lq]
    positions: torch.Tensor  # [bucket, Lq]
    write_index: torch.Tensor  # [bucket, Lq]
    logits_at: torch.Tensor  # [bucket, W]
    logits: Optional[torch.Tensor] = None  # [bucket, W, V] the captured forward's output
    graph: Optional[torch.cuda.CUDAGraph] = None


class DualStepGraphs:
    def __init__(self, model: DiffusionTransformer, max_batch: int, capture: bool) -> None:
        if capture and model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the model is on {model.device}")
        self.model = model
        self.capture = capture
        self.buckets = batch_buckets(max_batch)
        self.mask_id = model.special.mask_id
        self._forwards: dict[tuple[int, int, int], _StaticForward] = {}
        self._keys: Optional[torch.Tensor] = None  # the store's first tensor when the graphs were made

    @property
    def captured(self) -> int:
        """Graphs captured so far (0 without capture)."""
        return sum(f.graph is not None for f in self._forwards.values())

    def forward(self, store: KVStore, slots: torch.Tensor, max_slot: int, ids: torch.Tensor,
                positions: torch.Tensor, write_index: torch.Tensor, logits_at: torch.Tensor) -> torch.Tensor:
        """Logits [B, W, V] of the step's rows, in the order of `slots`; the inputs are the rows'
        ([B, Lq], [B, W]) as the ordinary cached forward takes them, writes past a row's block
        aimed at the store's last column."""
        if store.keys[0] is not self._keys:  # captured graphs point into the store's old tensors
            self._forwards.clear()
            self._keys = store.keys[0]
        bucket = next(b for b in self.buckets if b > max_slot)
        key = (bucket, ids.shape[1], logits_at.shape[1])
        static = self._forwards.get(key)
        if static is None:
            static = self._forwards[key] = self._prepare(key, store)
        self._idle(static, store)
        static.ids[slots] = ids
        static.positions[slots] = positions
        static.write_index[slots] = write_index
        static.logits_at[slots] = logits_at
        if static.graph is None:
            return self._run(static, store)[slots]
        static.graph.replay()
        assert static.logits is not None
        return static.logits[slots]

    def _idle(self, static: _StaticForward, store: KVStore) -> None:
        """Every slot's inputs as a slot that takes no part: masks written to the scratch column."""
        static.ids.fill_(self.mask_id)
        static.positions.zero_()
        static.write_index.fill_(store.width - 1)
        static.logits_at.zero_()

    def _run(self, static: _StaticForward, store: KVStore) -> torch.Tensor:
        bucket = static.ids.shape[0]
        view = KVStore(keys=[k[:bucket] for k in store.keys], values=[v[:bucket] for v in store.values],
                       key_mask=store.key_mask[:bucket])
        return self.model(static.ids, position_ids=static.positions, cache=CacheWrite(view, static.write_index),
                          logits_at=static.logits_at)

    def _prepare(self, key: tuple[int, int, int], store: KVStore) -> _StaticForward:
        bucket, length, width = key
        device = store.key_mask.device
        static = _StaticForward(
            ids=torch.full((bucket, length), self.mask_id, dtype=torch.long, device=device),
            positions=torch.zeros(bucket, length, dtype=torch.long, device=device),
            write_index=torch.full((bucket, length), store.width - 1, dtype=torch.long, device=device),
            logits_at=torch.zeros(bucket, width, dtype=torch.long, device=device))
        if not self.capture:
            return static
        # Warm up on a side stream first (the allocator's and the kernels' first-call work stays out
        # of the graph), as PyTorch's capture recipe asks; idle inputs write only the scratch column.
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            self._run(static, store)
        torch.cuda.current_stream(device).wait_stream(stream)
        # Each graph keeps its own memory pool: replays of different buckets never share scratch memory.
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static.logits = self._run(static, store)
        static.graph = graph
        return static
