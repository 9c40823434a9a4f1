"""Slot-indexed device state, in one owner: every running request holds one slot, and row s of each
buffer here is slot s's. The canvas (prompt and generation of each slot), the KV store (each slot's
cache), the knob tables and the row state are written once when a request is admitted, grow by
one rule, are read by a step with a few batched index operations whatever the number of rows, and
written back once a step (`write_back`).

The knob tables' columns are generated from `DecodeParams`' declarations: every knob some policy
reads (`engine/decoding/knobs.py`), one table per dtype. The row state is what the decoding mode's
policies declare (`Policy.state`: CAI's Box 2 s_i and Box 7 counter) and the mode's own
(`DecodingMode.row_state`), by name (`engine/decoding/row_state.py`); nothing here knows whose.
"""

from __future__ import annotations

import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from engine.batch import Batch
from engine.decoding.knobs import device_knobs, device_value
from engine.decoding.params import DecodeParams
from engine.decoding.row_state import BLOCK_WIDE, RowState
from engine.host_copy import to_device
from engine.models.kv_cache import SlotStore
from engine.models.protocol import DiffusionModel
from engine.request import Request

_KNOBS = device_knobs(DecodeParams)
_TABLES = {kind: [k for k in _KNOBS if k.kind is kind] for kind in (float, int, bool)}
_DTYPES = {float: torch.float32, int: torch.long, bool: torch.bool}


@dataclass(frozen=True)
class RowTables:
    """The tables at a step's rows (gathered copies)."""

    knobs: Mapping[str, torch.Tensor]  # [B] each declared device knob, by name
    state: Mapping[str, torch.Tensor]  # [B, ...] each read row state, by name (a block-wide one [B, W])


class Slots:
    def __init__(self, model: DiffusionModel, max_batch: int, row_state: Mapping[str, RowState]) -> None:
        self.device = model.device
        self.pad_id = model.special.pad_id
        self.canvas = torch.full((max_batch, 1), self.pad_id, dtype=torch.long, device=self.device)
        self.store: SlotStore = model.new_cache(max_batch, 2)
        self.positions = torch.arange(2, device=self.device)  # 0, 1, ... as wide as the store
        self.knobs = {kind: torch.zeros(max_batch, len(knobs), dtype=_DTYPES[kind], device=self.device)
                      for kind, knobs in _TABLES.items()}
        self.row_state = dict(row_state)
        # a block-wide dimension starts 1 wide and grows with the blocks (_grow); past a row's block: never read
        self.state = {name: torch.zeros(max_batch, *(1 if d == BLOCK_WIDE else d for d in spec.shape),
                                        dtype=spec.dtype, device=self.device)
                      for name, spec in self.row_state.items()}

    def admit(self, request: Request, running: Sequence[Request], blank: int) -> None:
        """Write the request's prompt, its generation positions (`blank`), key mask and knobs into its slot."""
        self._grow(running)
        slot, device = request.slot, self.device
        prompt = torch.frombuffer(array.array("q", request.prompt_ids), dtype=torch.long)
        self.canvas[slot, :request.prompt_len] = to_device(prompt, device)
        self.canvas[slot, request.prompt_len:request.length] = blank
        self.store.admit(request.slot, request.length)
        params = request.params
        for kind, knobs in _TABLES.items():  # one host-to-device copy per table, once
            values = [device_value(k, getattr(params, k.name)) for k in knobs]
            self.knobs[kind][slot] = to_device(torch.tensor(values, dtype=_DTYPES[kind]), device)
        for state in self.state.values():
            state[slot].zero_()  # a kernel: assigning a Python 0 copies it from pageable memory, which waits

    def _grow(self, running: Sequence[Request]) -> None:
        """The one growth rule: the canvas is as wide as the longest canvas plus the widest block (no
        row's block window runs past it) and the store, when it must grow, to the power of two at or
        above that plus one column (a scratch column no row attends): a store that grows by doubling
        reallocates rarely, and every static forward shape made over it (engine.static_forward) lives
        until then; block-wide row state as wide as the widest block."""
        needed = max(r.length for r in running) + max(r.block_length for r in running)
        if needed > self.canvas.shape[1]:
            grown = torch.full((self.canvas.shape[0], needed), self.pad_id, dtype=torch.long, device=self.device)
            grown[:, :self.canvas.shape[1]] = self.canvas
            self.canvas = grown
        if needed + 1 > self.store.width:
            self.store.reserve((1 << (needed - 1).bit_length()) + 1)
            self.positions = torch.arange(self.store.width, device=self.device)
        block_width = max(r.block_length for r in running)
        for name, spec in self.row_state.items():
            state = self.state[name]
            if spec.block_wide and block_width > state.shape[1]:
                grown = state.new_zeros(state.shape[0], block_width, *state.shape[2:])
                grown[:, :state.shape[1]] = state
                self.state[name] = grown

    def move(self, src: int, dst: int) -> None:
        """Slot `dst` takes over slot `src`'s request: its canvas, cache, knobs and row state (the
        scheduler keeps the running rows in slots [0, n): engine/scheduler.py)."""
        self.canvas[dst] = self.canvas[src]
        self.store.move_row(src, dst)
        for table in self.knobs.values():
            table[dst] = table[src]
        for state in self.state.values():
            state[dst] = state[src]

    def rows(self, batch: Batch) -> RowTables:
        """The knobs and row state of the step's rows."""
        slots = batch.slots
        knobs: dict[str, torch.Tensor] = {}
        for kind, table in self.knobs.items():
            knobs.update(zip((k.name for k in _TABLES[kind]), table[slots].unbind(1), strict=True))
        state = {name: self.state[name][slots, :batch.width] if spec.block_wide else self.state[name][slots]
                 for name, spec in self.row_state.items() if spec.read}
        return RowTables(knobs, state)

    def write_back(self, batch: Batch, positions: torch.Tensor, tokens: torch.Tensor,
                   state: Mapping[str, torch.Tensor]) -> None:
        """The step's one write into the slots: each row's block back into its canvas (`positions`,
        [B, W] canvas indices; past a row's block, what was read there), and the row state the step
        decided, by name."""
        self.canvas[batch.slots[:, None], positions] = tokens
        for name, value in state.items():
            if self.row_state[name].block_wide:
                self.state[name][batch.slots, :value.shape[1]] = value
            else:
                self.state[name][batch.slots] = value
