"""DiffusionGemma's key/value cache: the committed positions of every slot, per layer kind.

Layout (one row per slot, as the engine's KV store holds its slots):
- a full-attention layer keeps every position: keys/values [slots, kv_heads_full, width, head_dim_full],
  column = absolute position;
- a sliding layer keeps only the last `sliding_window - 1` positions (what the official
  DynamicCache retains, and all its decoder ever sees): a ring [slots, kv_heads_sliding, window - 1,
  head_dim_sliding], position p at column p % (window - 1);
- `attendable` [slots, width] marks the positions that hold a real token (False: a left pad or a
  position never written) and `length` [slots] counts the positions written. Which position a ring
  column holds follows from `length`, so nothing else is stored.
Keys are post-`k_norm` and post-RoPE, values post-`v_norm`: a stored key never needs its position
again. Buffers start zeroed, so every key a masked score can meet is finite.

A pass (`CachePass`) serves one forward over L tokens per row at positions length + 0..L-1:
- encoder pass (prompt prefill or commit pass): causal, sliding layers also windowed (a query sees
  keys less than `sliding_window` positions back, ring included). It writes its keys and values
  (full layers: at their positions; sliding layers: the last window - 1 into the ring, after
  attending over the old ring and the new keys) and `end_encoder` advances `length`;
- decoder pass (a canvas): bidirectional; full layers see every attendable cached position and the
  canvas, sliding layers exactly the ring's positions and the canvas, whatever the query's position.
  The canvas's full-layer keys go to the scratch columns length..length+L-1, beyond `length`: the
  cache's contents are unchanged (the commit pass rewrites those columns with the committed canvas).
So `width` must be at least max(length) + L for every pass.

Prefix caching (engine.prefix_cache) copies whole blocks of positions out of a slot and back into
another: `read_block` (every layer's keys and values of a block, flattened) and `write_prefix`. A
sliding layer's ring no longer holds a block its encoder pass has written past, so a cache told to
(`keep_passes`) keeps each slot's last encoder pass's sliding keys and values (views of the pass's
tensors) until the step's insert has read them (`drop_pass`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from engine.models.gemma4_config import SLIDING, Gemma4Spec
from engine.models.kv_cache import write_kv


@dataclass
class Gemma4Cache:
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    attendable: torch.Tensor  # [slots, width] bool
    length: torch.Tensor  # [slots] long
    sliding: tuple[bool, ...]
    window: int
    # slot -> sliding layer -> its last encoder pass's (keys, values) [kv_heads, L, head_dim]; None: not kept
    passes: Optional[dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]] = field(default=None)

    @classmethod
    def empty(cls, spec: Gemma4Spec, slots: int, width: int, dtype: torch.dtype,
              device: torch.device) -> Gemma4Cache:
        keys, values = [], []
        for layer_type in spec.layer_types:
            kind = spec.sliding if layer_type == SLIDING else spec.full
            columns = spec.retained if layer_type == SLIDING else width
            keys.append(torch.zeros(slots, kind.num_kv_heads, columns, kind.head_dim, dtype=dtype, device=device))
            values.append(torch.zeros_like(keys[-1]))
        assert spec.sliding.window is not None
        return cls(keys, values, attendable=torch.zeros(slots, width, dtype=torch.bool, device=device),
                   length=torch.zeros(slots, dtype=torch.long, device=device),
                   sliding=tuple(t == SLIDING for t in spec.layer_types), window=spec.sliding.window)

    @property
    def width(self) -> int:
        return self.attendable.shape[1]

    @property
    def retained(self) -> int:
        return self.window - 1

    @property
    def slots(self) -> int:
        return self.attendable.shape[0]

    def reserve(self, width: int) -> None:
        """Widen the full layers (and `attendable`) to `width` columns, keeping their contents."""
        old = self.width
        if width <= old:
            return
        for tensors in (self.keys, self.values):
            for i, is_sliding in enumerate(self.sliding):
                if not is_sliding:
                    cur = tensors[i]
                    tensors[i] = torch.zeros(*cur.shape[:2], width, cur.shape[3], dtype=cur.dtype, device=cur.device)
                    tensors[i][:, :, :old] = cur
        grown = torch.zeros(self.slots, width, dtype=torch.bool, device=self.attendable.device)
        grown[:, :old] = self.attendable
        self.attendable = grown

    def move_row(self, src: int, dst: int) -> None:
        """Slot `dst` takes slot `src`'s whole cache (a slot compacted at a release: engine.slots)."""
        for store in self.keys + self.values:
            store[dst] = store[src]
        self.attendable[dst] = self.attendable[src]
        self.length[dst] = self.length[src]
        if self.passes is not None:
            self.passes.pop(dst, None)
            self.passes.pop(src, None)

    def admit(self, slot: int, length: int = 0) -> None:
        """Empty this slot for a new request (its canvas length is moot: the encoder passes say what
        may be attended). Zeroed by kernels: assigning a Python value would copy it from the host and
        wait for the stream on a GPU."""
        self.length[slot].zero_()
        self.attendable[slot].zero_()
        self.drop_pass(slot)

    def drop_pass(self, slot: int) -> None:
        """Stop holding the slot's kept pass (read by the step's insert, or the slot emptied)."""
        if self.passes is not None:
            self.passes.pop(slot, None)

    def keep_passes(self) -> None:
        """Keep each slot's last encoder pass's sliding keys and values from now on (module docstring)."""
        if self.passes is None:
            self.passes = {}

    def read_block(self, slot: int, start: int, end: int, cached: int) -> Optional[torch.Tensor]:
        """A copy of every layer's keys and values of `slot` at positions [start, end), flattened in
        layer order, keys then values, each [kv_heads, end - start, head_dim]; the slot holds [0, cached).
        None when a sliding layer has them neither in its ring nor in the slot's kept pass."""
        parts = []
        for layer, sliding in enumerate(self.sliding):
            if sliding:
                held = self._sliding_block(slot, layer, start, end, cached)
                if held is None:
                    return None
                keys, values = held
            else:
                keys, values = self.keys[layer][slot, :, start:end], self.values[layer][slot, :, start:end]
            parts += [keys.reshape(-1), values.reshape(-1)]
        return torch.cat(parts)

    def _sliding_block(self, slot: int, layer: int, start: int, end: int,
                       cached: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        kept = (self.passes or {}).get(slot, {}).get(layer)
        if kept is not None and start >= cached - kept[0].shape[1]:
            first = cached - kept[0].shape[1]
            return kept[0][:, start - first:end - first], kept[1][:, start - first:end - first]
        if start >= cached - self.retained:
            columns = torch.arange(start, end, device=self.length.device) % self.retained
            return self.keys[layer][slot][:, columns], self.values[layer][slot][:, columns]
        return None

    def write_prefix(self, slot: int, blocks: Sequence[torch.Tensor], block: int) -> None:
        """Make `slot` (just reset) hold positions [0, n) from consecutive blocks of `block` positions
        (each as `read_block` gives it): the full layers every position, a sliding layer's ring the last
        `window - 1`."""
        n = len(blocks) * block
        flat = torch.stack(list(blocks))  # [blocks, size]
        offset = 0
        for layer, sliding in enumerate(self.sliding):
            _, kv_heads, _, head_dim = self.keys[layer].shape
            size = kv_heads * block * head_dim
            for store in (self.keys[layer], self.values[layer]):
                part = flat[:, offset:offset + size].view(len(blocks), kv_heads, block, head_dim)
                part = part.transpose(0, 1).reshape(kv_heads, n, head_dim)
                offset += size
                if sliding:
                    kept = min(n, self.retained)
                    columns = torch.arange(n - kept, n, device=self.length.device) % self.retained
                    store[slot][:, columns] = part[:, n - kept:]
                else:
                    store[slot, :, :n] = part
        self.attendable[slot, :n] = True
        self.length[slot].fill_(n)

    def ring_positions(self, length: torch.Tensor) -> torch.Tensor:
        """[B, window-1]: the position each ring column holds for rows of these lengths, -1 if none."""
        columns = torch.arange(self.retained, device=length.device)
        last = length[:, None] - 1
        held = last - torch.remainder(last - columns, self.retained)
        return held.masked_fill(held < 0, -1)


def _never_empty(mask: torch.Tensor) -> torch.Tensor:
    """A query with no attendable key (a left pad: the official code gets a zero attention output
    for it; an idle slot of a static forward, engine.static_forward) attends to every key instead,
    so that its output stays finite whatever the kernel; no real query ever attends to a pad, so its
    value does not matter."""
    return mask | ~mask.any(dim=-1, keepdim=True)


class CachePass:
    """One forward's view of the cache: positions, masks and every layer's K/V reads and writes (see
    the module docstring). `rows` [B]: the slot of each input row (None: slots 0..B-1, read as views);
    `attendable_new` [B, L]: which new tokens of an encoder pass are real (None: all; a decoder's
    canvas is always real); `width`: the full-layer columns attended over (None: all of them);
    `slot_ids`: `rows` as host ints, for a cache that keeps its passes (prefix caching); `count`
    [B] long: how many of an encoder pass's tokens each row encodes, its first ones (None: all): a
    static pass (engine.static_forward) pads its rows' tokens, and its idle slots encode none; a
    token past its row's count writes only the store's last column, which no row attends, and
    leaves the ring, key mask and length as they were."""

    def __init__(self, cache: Gemma4Cache, batch: int, length: int, *, encoder: bool,
                 rows: Optional[torch.Tensor] = None, attendable_new: Optional[torch.Tensor] = None,
                 width: Optional[int] = None, slot_ids: Optional[Sequence[int]] = None,
                 count: Optional[torch.Tensor] = None) -> None:
        device = cache.attendable.device
        self.cache, self.encoder, self.batch, self.length = cache, encoder, batch, length
        self.slot_ids = slot_ids if slot_ids is not None or rows is not None else range(batch)
        self.first_rows = rows is None
        self.rows = torch.arange(batch, device=device) if rows is None else rows
        self.width = cache.width if width is None else width
        start = cache.length[self.rows]
        steps = torch.arange(length, device=device)
        self.positions = start[:, None] + steps  # [B, L]
        self.write_at = self.positions  # each token's full-layer column
        self.end = start + (length if count is None else count)  # the row's length after an encoder pass
        ring = cache.ring_positions(start)  # [B, window-1]
        if encoder:
            new_ok = (torch.ones(batch, length, dtype=torch.bool, device=device) if attendable_new is None
                      else attendable_new.bool())
            if count is not None:
                encodes = steps < count[:, None]
                new_ok = new_ok & encodes
                self.write_at = torch.where(encodes, self.positions, cache.attendable.shape[1] - 1)
                new_ok_at = torch.where(encodes, new_ok, cache.attendable[self.rows[:, None], self.write_at])
                cache.attendable[self.rows[:, None], self.write_at] = new_ok_at
            else:
                cache.attendable[self.rows[:, None], self.positions] = new_ok
            # after the pass, each ring column holds the latest position below the row's new length:
            # this pass's token there, or what it holds already
            self.ring_token = cache.ring_positions(self.end) - start[:, None]  # [B, window-1]
        elif attendable_new is not None or count is not None:
            raise ValueError("a decoder pass's canvas is always attendable, and every row of it decodes")
        attendable = cache.attendable[self.rows, :self.width]
        # (a row's ring holds positions below its length, inside `width`; the clamp keeps the read of
        # an idle slot of a static forward, whose length may lie past it, in bounds)
        ring_ok = (ring >= 0) & attendable.gather(1, ring.clamp(0, self.width - 1))
        columns = torch.arange(self.width, device=device)
        if encoder:
            full = (columns <= self.positions[..., None]) & attendable[:, None, :]  # causal over positions
            ring_seen = ring_ok[:, None, :] & (ring[:, None, :] > self.positions[..., None] - cache.window)
            behind = steps[:, None] - steps[None, :]  # query minus key, inside the new tokens
            new_seen = ((behind >= 0) & (behind < cache.window))[None] & new_ok[:, None, :]
            self.full_mask = _never_empty(full)[:, None]
            self.sliding_mask = _never_empty(torch.cat((ring_seen, new_seen), dim=-1))[:, None]
        else:
            cached = attendable & (columns < start[:, None])
            canvas = (columns >= start[:, None]) & (columns < start[:, None] + length)
            self.full_mask = _never_empty(cached | canvas)[:, None, None, :]
            canvas_ok = torch.ones(batch, length, dtype=torch.bool, device=device)
            self.sliding_mask = torch.cat((ring_ok, canvas_ok), dim=-1)[:, None, None, :]

    def _read(self, store: torch.Tensor, columns: Optional[int]) -> torch.Tensor:
        if self.first_rows:
            return store[:self.batch, :, :columns]
        return store[self.rows, :, :columns]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store this pass's keys/values [B, kv_heads, L, head_dim] of `layer` (an encoder pass's
        last layer needs nothing else: its attention output is never used)."""
        cache = self.cache
        if cache.sliding[layer]:
            written = (self.ring_token >= 0)[:, None, :, None]
            at = self.ring_token.clamp(0, self.length - 1)[:, None, :, None]
            for store, new in ((cache.keys[layer], k), (cache.values[layer], v)):
                ring = torch.where(written, new.gather(2, at.expand(-1, new.shape[1], -1, new.shape[3])),
                                   self._read(store, None))
                store.index_copy_(0, self.rows, ring)
            if cache.passes is not None and self.slot_ids is not None:
                for b, slot in enumerate(self.slot_ids):
                    cache.passes.setdefault(slot, {})[layer] = (k[b], v[b])
        else:
            write_kv(cache.keys[layer], k, self.write_at, self.rows)
            write_kv(cache.values[layer], v, self.write_at, self.rows)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention (scale 1.0) of q [B, heads, L, head_dim] over this layer's keys, after this
        pass's k, v [B, kv_heads, L, head_dim] are written where they belong."""
        cache = self.cache
        if cache.sliding[layer]:
            # the old ring and the new keys; the ring is overwritten only after this copy
            keys = torch.cat((self._read(cache.keys[layer], None), k), dim=2)
            values = torch.cat((self._read(cache.values[layer], None), v), dim=2)
            if self.encoder:
                self.write(layer, k, v)
            mask = self.sliding_mask
        else:
            self.write(layer, k, v)  # an encoder's positions, or a decoder's scratch columns
            keys = self._read(cache.keys[layer], self.width)
            values = self._read(cache.values[layer], self.width)
            mask = self.full_mask
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=1.0,
                                              enable_gqa=q.shape[1] != keys.shape[1])

    def end_encoder(self) -> None:
        """The encoder pass's tokens are now cached."""
        self.cache.length[self.rows] = self.end
