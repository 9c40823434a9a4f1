"""A check that a forward attending to the engine's KV store reads it in place: what
`CacheWrite.write_and_read` hands the attention kernel must share the store's memory (a gather of
rows by index would be a copy of every attended key and value, once a layer)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from engine import Engine
from engine.models.kv_cache import CacheWrite


@contextmanager
def cache_reads_in_place(engine: Engine) -> Iterator[list[int]]:
    """Inside the block, fail any cached read that is not a view of `engine`'s store; the list's one
    element counts the reads checked (a test asserts some were)."""
    original = CacheWrite.write_and_read
    checked = [0]

    def read_in_place(self, layer, k, v):  # type: ignore[no-untyped-def]
        keys, values = original(self, layer, k, v)
        if self.attend_to_cache:
            store = engine.slots.store
            assert keys.untyped_storage().data_ptr() == store.keys[layer].untyped_storage().data_ptr(), \
                "the keys attended over are a copy, not a view of the KV store"
            assert values.untyped_storage().data_ptr() == store.values[layer].untyped_storage().data_ptr(), \
                "the values attended over are a copy, not a view of the KV store"
            checked[0] += 1
        return keys, values

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CacheWrite, "write_and_read", read_in_place)
        yield checked
