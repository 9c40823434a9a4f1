"""Key/value storage the decoder hands to a forward pass.

A `KVStore` holds, per layer, keys and values of shape [B, kv_heads, width, head_dim] (post-RoPE,
so a stored key never needs its position again) and a key mask [B, width] (True = may be attended).
A forward pass given a store and a `write_index` [B, Lq] writes the keys/values of its Lq input
tokens into those columns, then lets its queries attend over the store's columns (`CacheWrite`). A
full forward writes every column; a block forward (Fast-dLLM's DualCache) rewrites only the block;
a block-diffusion model's forward writes the tokens it feeds after its exact cache.

The engine keeps one store for all its slots, and a forward never copies it: a forward that attends
over the store is handed a view of consecutive rows (`rows_view`; the scheduler keeps the running
rows in slots [0, n), engine/scheduler.py), or the whole store when its rows are the first slots (a
compiled forward: `write_kv`), and attention reads those rows in place. A full forward
of some rows writes their keys and values into those rows of the store (`rows`, any slots: a write,
not a read) and attends only to what it computed itself (`attend_to_cache=False`).

Moving keys/values between slots or into one (a slot compacted at a release, a cached prefix) goes
through `write_columns`: "these keys/values go into slot s at positions [a, b)".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from engine.models.packing import PackedTokens


class SlotStore(Protocol):
    """What the engine's slots (engine/slots.py) and the prefix cache (engine/prefix_cache.py) ask of
    a model's cache, whatever its layout (`KVStore`; DiffusionGemma's `Gemma4Cache`, whose sliding
    layers keep a ring, so it keeps each slot's last encoder pass for the prefix cache's insert while
    asked to): one row per slot, made by the model's `new_cache(slots, width)`."""

    @property
    def width(self) -> int: ...

    def reserve(self, width: int) -> None:
        """At least `width` positions per slot, contents kept."""

    def admit(self, slot: int, length: int) -> None:
        """Empty `slot` for a new request whose canvas ends at `length`."""

    def move_row(self, src: int, dst: int) -> None:
        """Slot `dst` takes slot `src`'s whole cache (a slot compacted at a release)."""

    def read_block(self, slot: int, start: int, end: int, cached: int) -> Optional[torch.Tensor]:
        """A copy of `slot`'s keys and values at positions [start, end) (None: no longer held)."""

    def write_prefix(self, slot: int, blocks: Sequence[torch.Tensor], block: int) -> None:
        """Make `slot` hold positions [0, len(blocks) x block) from cached blocks."""

    def keep_passes(self) -> None:
        """Keep what a step's prefix-cache insert must read and a forward may overwrite."""

    def drop_pass(self, slot: int) -> None:
        """The slot's kept pass has been read."""


@dataclass
class KVStore:
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    key_mask: torch.Tensor  # [B, width] bool

    @classmethod
    def empty(cls, num_layers: int, batch: int, kv_heads: int, width: int, head_dim: int,
              dtype: torch.dtype, device: torch.device) -> KVStore:
        shape = (batch, kv_heads, width, head_dim)
        return cls(keys=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
                   values=[torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)],
                   key_mask=torch.zeros(batch, width, dtype=torch.bool, device=device))

    def reserve(self, width: int) -> None:
        """At least `width` columns, contents kept (the store widens as longer canvases arrive)."""
        old = self.width
        if width <= old:
            return
        for tensors in (self.keys, self.values):
            for i, cur in enumerate(tensors):
                tensors[i] = cur.new_zeros(*cur.shape[:2], width, cur.shape[3])
                tensors[i][:, :, :old] = cur
        mask = self.key_mask.new_zeros(self.batch, width)
        mask[:, :old] = self.key_mask
        self.key_mask = mask

    def admit(self, slot: int, length: int) -> None:
        """A new request in `slot`: it may attend to its canvas's columns [0, length)."""
        self.key_mask[slot].zero_()
        self.key_mask[slot, :length].fill_(True)

    def rows_view(self, rows: slice) -> KVStore:
        """A store of these rows that shares this one's memory."""
        return KVStore(keys=[k[rows] for k in self.keys], values=[v[rows] for v in self.values],
                       key_mask=self.key_mask[rows])

    def write_columns(self, slot: int, start: int, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Copy per-layer keys/values [kv_heads, n, head_dim] into slot `slot` at positions [start,
        start + n). The key mask is the caller's to set (it says which columns a row may attend)."""
        n = keys[0].shape[1]
        for store, new in zip(self.keys + self.values, keys + values, strict=True):
            store[slot, :, start:start + n] = new

    def move_row(self, src: int, dst: int) -> None:
        """Slot `dst` takes slot `src`'s whole cache and key mask (a slot compacted at a release)."""
        self.write_columns(dst, 0, [k[src] for k in self.keys], [v[src] for v in self.values])
        self.key_mask[dst] = self.key_mask[src]

    # ------------------------------------------- the prefix cache's protocol (engine.prefix_cache)

    def read_block(self, slot: int, start: int, end: int, cached: int) -> Optional[torch.Tensor]:
        """A copy of `slot`'s keys and values at columns [start, end): [layers, 2, kv_heads, end - start,
        head_dim]. Every column stays where it was written, so `cached` (what the slot holds) is moot."""
        return torch.stack([torch.stack((keys[slot, :, start:end], values[slot, :, start:end]))
                            for keys, values in zip(self.keys, self.values, strict=True)])

    def write_prefix(self, slot: int, blocks: Sequence[torch.Tensor], block: int) -> None:
        """Copy cached blocks (each as `read_block` gives it) into `slot`'s columns [0, len(blocks) x block)."""
        kv = blocks[0] if len(blocks) == 1 else torch.cat(list(blocks), dim=3)
        n = kv.shape[3]
        for layer, (keys, values) in enumerate(zip(self.keys, self.values, strict=True)):
            keys[slot, :, :n] = kv[layer, 0]
            values[slot, :, :n] = kv[layer, 1]

    def keep_passes(self) -> None:
        """Nothing to keep: no column is overwritten while its slot's request runs (a ring is)."""

    def drop_pass(self, slot: int) -> None:
        """Nothing kept (`keep_passes`)."""

    @property
    def batch(self) -> int:
        return self.key_mask.shape[0]

    @property
    def width(self) -> int:
        return self.key_mask.shape[1]


def write_kv(store: torch.Tensor, new: torch.Tensor, write_index: torch.Tensor, rows: torch.Tensor) -> None:
    """store[rows[b], :, write_index[b, i]] = new[b, :, i] for store [S, heads, width, dim] and new
    [B, heads, L, dim] (`rows` [B], or [B, L]: a store row per token, for packed tokens). Indexed
    assignment through a [S, width, heads, dim] view rather than scatter_ along the width: the same
    writes, but each fed position moves one contiguous heads x dim slab instead of a scatter_ that
    walks every element with its own index. Under torch.compile, the same writes index the store
    itself: inductor writes a graph input's `index_put_` in place, but an `index_put_` through a view
    of it becomes a copy of the viewed slots, written into and copied back (twice a layer per store
    tensor)."""
    row = rows if rows.dim() == 2 else rows[:, None]
    if torch.compiler.is_compiling():
        heads = torch.arange(store.shape[1], device=store.device)
        store.index_put_((row[:, None, :], heads[None, :, None], write_index[:, None, :]), new)
    else:
        store.transpose(1, 2)[row, write_index] = new.transpose(1, 2)


@dataclass
class CacheWrite:
    """Where the current forward's tokens go in `store`: column `write_index[b, i]` of store row
    `rows[b]` (row b when `rows` is None) for token i of input row b. With `attend_to_cache`, the
    queries of row b attend over the first `width` columns (all when None) of store row b, read in
    place: a forward that attends is given a store whose row b is its input row b (a `rows_view`),
    never a gather of rows, which would copy every attended key and value once a layer.

    With `packed`, the forward's tokens are packed (engine/models/packing.py): `write_index` is still
    given on the padded [B, Lq] grid and packed here, and token t writes store row `packed.row[t]`."""

    store: KVStore
    write_index: torch.Tensor  # [B, Lq] long
    rows: Optional[torch.Tensor] = None  # [B] long; only for a forward that does not attend to the store
    attend_to_cache: bool = True
    width: Optional[int] = None
    packed: Optional[PackedTokens] = None

    def __post_init__(self) -> None:
        if self.attend_to_cache and self.rows is not None:
            raise ValueError("a forward that attends to the store reads a view of its rows (KVStore.rows_view), "
                             "not rows gathered by index")
        self.batch = self.write_index.shape[0]  # input rows (before packing)
        # the store row of each input row (of each packed token), made once a forward rather than once a layer
        if self.packed is not None:
            if self.rows is not None or not self.attend_to_cache:
                raise ValueError("packed tokens attend to a view of their rows (KVStore.rows_view)")
            self.write_rows = self.packed.row[None]
            self.write_index = self.packed.pack(self.write_index)
        else:
            self.write_rows = self.rows if self.rows is not None else torch.arange(
                self.batch, device=self.write_index.device)

    def write_and_read(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this forward's keys/values [B, kv_heads, Lq, dim] of layer `layer`; return what its
        queries attend over."""
        keys, values = self.store.keys[layer], self.store.values[layer]
        write_kv(keys, k, self.write_index, self.write_rows)
        write_kv(values, v, self.write_index, self.write_rows)
        if not self.attend_to_cache:
            return k, v
        return keys[:self.batch, :, :self.width], values[:self.batch, :, :self.width]  # views

    def key_mask(self) -> torch.Tensor:
        """[B, width] the store's key mask at the rows and columns attended over."""
        return self.store.key_mask[:self.batch, :self.width]
