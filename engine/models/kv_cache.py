"""Key/value storage the decoder hands to a forward pass.

A `KVStore` holds, per layer, keys and values of shape [B, kv_heads, width, head_dim] (post-RoPE,
so a stored key never needs its position again) and a key mask [B, width] (True = may be attended).
A forward pass given a store and a `write_index` [B, Lq] writes the keys/values of its Lq input
tokens into those columns, then lets its queries attend over all columns of the store. A full
forward writes every column; a block forward (Fast-dLLM's DualCache) rewrites only the block.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def batch(self) -> int:
        return self.key_mask.shape[0]

    @property
    def width(self) -> int:
        return self.key_mask.shape[1]


@dataclass
class CacheWrite:
    """Where the current forward's tokens go in `store`: column `write_index[b, i]` for token i."""

    store: KVStore
    write_index: torch.Tensor  # [B, Lq] long

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.store.keys[i], self.store.values[i]
