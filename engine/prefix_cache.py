"""Exact prefix caching across requests, for block-diffusion models (SDAR, LLaDA2) and uniform-noise
ones (DiffusionGemma).

Under block-causal attention, with blocks counted from a row's first token, the keys and values of
a whole block depend only on the tokens up to its end: two rows that share their first k blocks
(a system prompt, few-shot examples, a chat's earlier turns) share those blocks' keys and values
exactly. The cache keys a block by a hash chain over the token ids of every block up to and
including it (as vLLM hashes its blocks), seeded with the block size (the mask's grid), and holds
each layer's keys and values of the block on the device, under a byte budget with LRU eviction.

- `restore`, when a request is admitted: the longest cached chain of its prompt's whole blocks is
  copied into its slot's exact cache, and the row starts with those positions cached (its mode
  then feeds only the rest; a partial last block is always computed).
- `insert`, after a step: every whole block of a row's exact cache that is final (the prompt's
  whole blocks after the first forward, a finished generated block after the forward that wrote its
  clean tokens) goes in. A block being denoised is never inserted: a row's cache holds only final
  blocks (`Request.cached`).

DiffusionGemma's encoder is causal over the prompt and each committed canvas, so the same holds for
its blocks of `canvas_length` positions from position 0 (engine.uniform_mode); its cache
(`Gemma4Cache`) keeps full and sliding layers in different shapes and only a window of positions in
the sliding ones. Each store reads and writes its own blocks (`SlotStore`: `read_block`,
`write_prefix`); DiffusionGemma's flattens a block into one tensor and keeps each slot's last encoder
pass for the insert to read.
A whole prompt may be restored (its prefill then encodes nothing); a block whose sliding-layer keys
its cache no longer holds is not inserted (a canvas straddling two encoder passes when the window is
shorter than the canvas).

Copies are synchronous on the stepping thread (stream-ordered on a GPU), so eviction never touches
a block a request is still copying, and never a row's own cache (a slot's store is its own memory).
Every decision is a function of the sequence of requests and steps alone, so the ranks of a
tensor-parallel group, each caching its own heads under the same budget, decide alike.
"""

from __future__ import annotations

import array
import hashlib
import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import torch

from engine.models.kv_cache import SlotStore
from engine.request import Request

_BYTES_PER_GB = 1 << 30
DEFAULT_SHARE = 0.1  # of the device's memory, when no budget is given


def default_budget_gb(device: torch.device) -> float:
    """A tenth of the device's memory (a GPU's total, a host's physical memory): the same on every
    rank of a group of like devices. Filled lazily: only blocks actually cached take memory."""
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total * DEFAULT_SHARE / _BYTES_PER_GB


def block_hashes(ids: Sequence[int], block: int, parent: bytes) -> list[bytes]:
    """The chain hash of each whole block of `ids` (`block` tokens each), after `parent`'s."""
    hashes = []
    for start in range(0, len(ids) - block + 1, block):
        parent = hashlib.sha256(parent + array.array("q", ids[start:start + block]).tobytes()).digest()
        hashes.append(parent)
    return hashes


def chain_root(block: int) -> bytes:
    """The chain's seed: a block's keys and values depend on the block grid as well as its tokens."""
    return hashlib.sha256(f"block={block}".encode()).digest()


# ------------------------------------------------------------------ the cache


class PrefixCache:
    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # least recently used first
        self.bytes_held = 0
        self.queries = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0  # of them, served from the cache (vLLM's prefix_cache_hits)

    @staticmethod
    def applies(request: Request) -> bool:
        """Rows decoded against their exact cache (a window forward caches nothing)."""
        return request.params.cache == "exact"

    def restore(self, request: Request, store: SlotStore) -> int:
        """Copy the longest cached chain of the request's whole prompt blocks into its slot; the
        row's cache then holds them. Returns the tokens restored."""
        if not self.applies(request):
            return 0
        store.keep_passes()
        block = request.block_length
        hashes = block_hashes(request.prompt_ids[:request.origin], block, chain_root(block))
        found = []
        for digest in hashes:
            kv = self.blocks.get(digest)
            if kv is None:
                break
            found.append(kv)
        self.queries += request.prompt_len
        request.block_hashes = hashes[:len(found)]  # the chain of the blocks its cache holds, so far
        if not found:
            return 0
        self._touch(request.block_hashes)
        store.write_prefix(request.slot, found, block)
        restored = len(found) * block
        self.hits += restored
        request.cached = restored
        request.stats.cached_tokens = restored
        return restored

    def insert(self, requests: Iterable[Request], store: SlotStore) -> None:
        """Cache every final whole block of these rows' exact caches not cached yet (call after a
        step, before the next admission reuses a finished row's slot)."""
        for request in requests:
            if not self.applies(request):
                continue
            self._insert_row(request, store)
            store.drop_pass(request.slot)  # read: no longer held

    def _insert_row(self, request: Request, store: SlotStore) -> None:
        block, hashes = request.block_length, request.block_hashes
        known = len(hashes) * block
        if request.cached <= known:
            return
        ids = _tokens(request, known, request.cached)
        parent = hashes[-1] if hashes else chain_root(block)
        for i, digest in enumerate(block_hashes(ids, block, parent)):
            hashes.append(digest)
            if digest not in self.blocks:
                start = known + i * block
                kv = store.read_block(request.slot, start, start + block, request.cached)
                if kv is not None:
                    self._add(digest, kv)
        self._touch(hashes)

    def _touch(self, chain: Sequence[bytes]) -> None:
        """Mark a chain used, its first block last: eviction takes a chain's tail before its head
        (a block is reachable only through every block before it)."""
        for digest in reversed(chain):
            if digest in self.blocks:
                self.blocks.move_to_end(digest)

    def _add(self, digest: bytes, kv: torch.Tensor) -> None:
        size = kv.nelement() * kv.element_size()
        if size > self.budget_bytes:
            return
        while self.bytes_held + size > self.budget_bytes:
            _, evicted = self.blocks.popitem(last=False)
            self.bytes_held -= evicted.nelement() * evicted.element_size()
        self.blocks[digest] = kv
        self.bytes_held += size

    def clear(self) -> None:
        self.blocks.clear()
        self.bytes_held = 0


def _tokens(request: Request, start: int, end: int) -> list[int]:
    """The row's token ids at positions [start, end): the prompt before its first decoded block, its
    canvas (the prompt's tail, then the generation) from there."""
    origin = request.origin
    head = list(request.prompt_ids[start:min(end, origin)])
    return head + request.mirror.tokens[max(start, origin) - origin:end - origin]
