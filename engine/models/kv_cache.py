"""Key/value storage the decoder hands to a forward pass.

A `KVStore` holds, per layer, keys and values of shape [B, kv_heads, width, head_dim] (post-RoPE,
so a stored key never needs its position again) and a key mask [B, width] (True = may be attended).
A forward pass given a store and a `write_index` [B, Lq] writes the keys/values of its Lq input
tokens into those columns, then lets its queries attend over all columns of the store. A full
forward writes every column; a block forward (Fast-dLLM's DualCache) rewrites only the block.

The engine keeps one store for all its slots: a full forward of some rows writes their keys and
values into those rows of the store (`rows`) and attends only to what it computed itself
(`attend_to_cache=False`), so no per-step store is ever allocated or copied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


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

    def grown(self, width: int) -> KVStore:
        """The same contents in a store `width` columns wide."""
        old = self.width
        bigger = KVStore.empty(len(self.keys), self.batch, self.keys[0].shape[1], width, self.keys[0].shape[3],
                               self.keys[0].dtype, self.keys[0].device)
        for new, cur in zip(bigger.keys + bigger.values, self.keys + self.values, strict=True):
            new[:, :, :old] = cur
        bigger.key_mask[:, :old] = self.key_mask
        return bigger

    @property
    def batch(self) -> int:
        return self.key_mask.shape[0]

    @property
    def width(self) -> int:
        return self.key_mask.shape[1]


@dataclass
class CacheWrite:
    """Where the current forward's tokens go in `store`: column `write_index[b, i]` of store row
    `rows[b]` (row b when `rows` is None) for token i of input row b. With `attend_to_cache`, the
    queries of row b attend over the columns of store row `rows[b]`; without, over this forward's
    own keys and values."""

    store: KVStore
    write_index: torch.Tensor  # [B, Lq] long
    rows: Optional[torch.Tensor] = None  # [B] long
    attend_to_cache: bool = True

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.store.keys[i], self.store.values[i]

    def write_rows(self) -> torch.Tensor:
        """[B] the store row of each input row (made once a forward, not once a layer)."""
        if self.rows is not None:
            return self.rows
        return torch.arange(self.write_index.shape[0], device=self.write_index.device)
