"""Slot-indexed device state, in one owner: every running request holds one slot, and row s of each
buffer here is slot s's. The canvas (prompt and generation of each slot), the KV store (each slot's
cache), the knob tables and the policies' row state are written once when a request is admitted,
grow by one rule, are read by a step with a few batched index operations whatever the number of
rows, and written back once a step (`write_back`).

The knob tables' columns are generated from `DecodeParams`' declarations: every knob some policy
reads (`engine/decoding/knobs.py`), one table per dtype. The policies' row state is CAI's, which
lives from step to step (Box 2's s_i, Box 7's counter).
"""

from __future__ import annotations

import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from engine.batch import Batch
from engine.decoding.knobs import device_knobs, device_value
from engine.decoding.params import DecodeParams
from engine.host_copy import to_device
from engine.models.kv_cache import KVStore
from engine.models.transformer import DiffusionTransformer
from engine.request import Request

_KNOBS = device_knobs(DecodeParams)
_TABLES = {kind: [k for k in _KNOBS if k.kind is kind] for kind in (float, int, bool)}
_DTYPES = {float: torch.float32, int: torch.long, bool: torch.bool}


@dataclass(frozen=True)
class RowTables:
    """The tables at a step's rows (gathered copies)."""

    knobs: Mapping[str, torch.Tensor]  # [B] each declared device knob, by name
    first_conf: torch.Tensor  # [B, W] Box 2's s_i as stored so far
    low_yield: torch.Tensor  # [B] Box 7's counter


class Slots:
    def __init__(self, model: DiffusionTransformer, max_batch: int) -> None:
        self.device = model.device
        self.pad_id = model.special.pad_id
        self.canvas = torch.full((max_batch, 1), self.pad_id, dtype=torch.long, device=self.device)
        self.store = self._new_store(model, max_batch)
        self.positions = torch.arange(2, device=self.device)  # 0, 1, ... as wide as the store
        self.knobs = {kind: torch.zeros(max_batch, len(knobs), dtype=_DTYPES[kind], device=self.device)
                      for kind, knobs in _TABLES.items()}
        self.first_conf = torch.zeros(max_batch, 1, device=self.device)  # past a row's block: never read
        self.low_yield = torch.zeros(max_batch, dtype=torch.long, device=self.device)

    def _new_store(self, model: DiffusionTransformer, max_batch: int) -> KVStore:
        config = model.config
        store = KVStore.empty(config.num_layers, max_batch, model.kv_heads, 2, config.head_dim, model.dtype,
                              self.device)
        store.key_mask[:, 0] = True  # a free slot's dummy row still attends to something
        return store

    def _admit_store(self, request: Request) -> None:
        self.store.key_mask[request.slot] = self.positions < request.length

    def _grow_store(self, width: int) -> None:
        self.store = self.store.grown(width)

    def admit(self, request: Request, running: Sequence[Request], blank: int) -> None:
        """Write the request's prompt, its generation positions (`blank`), key mask and knobs into its slot."""
        self._grow(running)
        slot, device = request.slot, self.device
        prompt = torch.frombuffer(array.array("q", request.prompt_ids), dtype=torch.long)
        self.canvas[slot, :request.prompt_len] = to_device(prompt, device)
        self.canvas[slot, request.prompt_len:request.length] = blank
        self._admit_store(request)
        params = request.params
        for kind, knobs in _TABLES.items():  # one host-to-device copy per table, once
            values = [device_value(k, getattr(params, k.name)) for k in knobs]
            self.knobs[kind][slot] = to_device(torch.tensor(values, dtype=_DTYPES[kind]), device)
        self.low_yield[slot].zero_()  # a kernel: assigning a Python 0 copies it from pageable memory, which waits

    def _grow(self, running: Sequence[Request]) -> None:
        """The one growth rule: the canvas is as wide as the longest canvas plus the widest block (no
        row's block window runs past it) and the store one column wider (a scratch column no row
        attends); the policies' row state as wide as the widest block."""
        needed = max(r.length for r in running) + max(r.block_length for r in running)
        if needed > self.canvas.shape[1]:
            grown = torch.full((self.canvas.shape[0], needed), self.pad_id, dtype=torch.long, device=self.device)
            grown[:, :self.canvas.shape[1]] = self.canvas
            self.canvas = grown
        if needed + 1 > self.store.width:
            self._grow_store(needed + 1)
            self.positions = torch.arange(self.store.width, device=self.device)
        block_width = max(r.block_length for r in running)
        if block_width > self.first_conf.shape[1]:
            grown = torch.zeros(self.first_conf.shape[0], block_width, device=self.device)
            grown[:, :self.first_conf.shape[1]] = self.first_conf
            self.first_conf = grown

    def move(self, src: int, dst: int) -> None:
        """Slot `dst` takes over slot `src`'s request: its canvas, cache, knobs and row state (the
        scheduler keeps the running rows in slots [0, n): engine/scheduler.py)."""
        self.canvas[dst] = self.canvas[src]
        self.store.move_row(src, dst)
        for table in self.knobs.values():
            table[dst] = table[src]
        self.first_conf[dst] = self.first_conf[src]
        self.low_yield[dst] = self.low_yield[src]

    def rows(self, batch: Batch) -> RowTables:
        """The knobs and row state of the step's rows."""
        slots = batch.slots
        knobs: dict[str, torch.Tensor] = {}
        for kind, table in self.knobs.items():
            knobs.update(zip((k.name for k in _TABLES[kind]), table[slots].unbind(1), strict=True))
        return RowTables(knobs, self.first_conf[slots, :batch.width], self.low_yield[slots])

    def write_back(self, batch: Batch, positions: torch.Tensor, tokens: torch.Tensor,
                   first_conf: Optional[torch.Tensor], low_yield: Optional[torch.Tensor]) -> None:
        """The step's one write into the slots: each row's block back into its canvas (`positions`,
        [B, W] canvas indices; past a row's block, what was read there), and the policies' row state
        when some policy of the step keeps one."""
        self.canvas[batch.slots[:, None], positions] = tokens
        if first_conf is not None and low_yield is not None:
            self.first_conf[batch.slots, :batch.width] = first_conf
            self.low_yield[batch.slots] = low_yield
