"""Slot-indexed device state, in one owner: every running request holds one slot, and row s of each
buffer here is slot s's. The canvas (prompt and generation of each slot), the KV store (each slot's
cache) and the decoding tables (knobs, CAI state) are written once when a request is
admitted, grow by one rule, and are read by a step with a few batched index operations whatever
the number of rows.
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import torch

from engine.decoding.state import DecodeTables
from engine.models.kv_cache import KVStore
from engine.models.transformer import DiffusionTransformer
from engine.request import Request


class Slots:
    def __init__(self, model: DiffusionTransformer, max_batch: int) -> None:
        self.device = model.device
        self.mask_id = model.special.mask_id
        self.pad_id = model.special.pad_id
        self.canvas = torch.full((max_batch, 1), self.pad_id, dtype=torch.long, device=self.device)
        config = model.config
        self.store = KVStore.empty(config.num_layers, max_batch, model.kv_heads, 2, config.head_dim,
                                   model.dtype, self.device)
        self.store.key_mask[:, 0] = True  # a free slot's dummy row still attends to something
        self.tables = DecodeTables(max_batch, self.device)
        self.positions = torch.arange(2, device=self.device)  # 0, 1, ... as wide as the store

    def admit(self, request: Request, running: Sequence[Request]) -> None:
        """Write the request's prompt, masks, key mask and knobs into its slot."""
        self._grow(running)
        prompt = torch.frombuffer(array.array("q", request.prompt_ids), dtype=torch.long)
        self.canvas[request.slot, :request.prompt_len] = prompt.to(self.device, non_blocking=True)
        self.canvas[request.slot, request.prompt_len:request.length] = self.mask_id
        self.store.key_mask[request.slot] = self.positions < request.length
        self.tables.write(request)

    def _grow(self, running: Sequence[Request]) -> None:
        """The one growth rule: the canvas is as wide as the longest canvas plus the widest block (no
        row's block window runs past it) and the store one column wider (a scratch column no row
        attends); CAI's row state as wide as the widest block."""
        needed = max(r.length for r in running) + max(r.block_length for r in running)
        if needed > self.canvas.shape[1]:
            grown = torch.full((self.canvas.shape[0], needed), self.pad_id, dtype=torch.long, device=self.device)
            grown[:, :self.canvas.shape[1]] = self.canvas
            self.canvas = grown
        if needed + 1 > self.store.width:
            self.store = self.store.grown(needed + 1)
            self.positions = torch.arange(self.store.width, device=self.device)
        self.tables.grow(max(r.block_length for r in running))
