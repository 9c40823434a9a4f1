"""One rank's place in the tensor-parallel group and the collectives its layers call.

Layers hold a `TensorParallel` (their rank, the group's size): what they build is their share of
the weights, and their forward ends with one of these collectives. At size 1 every collective is
the identity and nothing touches `torch.distributed`, so a single-device model runs exactly the
code it ran before tensor parallelism existed. A model can be built for any rank on the meta
device without a process group (the memory table, `bench/tp_memory.py`): only a forward needs one.

The group is `torch.distributed`'s default (world) group, initialised by `engine.executor.launch`
(gloo on CPU, NCCL on CUDA) with a timeout, so a collective whose peer hung raises instead of
waiting forever.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


class WireCount:
    """Bytes each rank received from its peers in this process's collectives, for tests and benchmarks:
    an all-gather's peers' parts, an all-reduce's peers' tensors (what a naive exchange moves; NCCL's
    ring moves about twice as much as the tensor whatever the size)."""

    bytes = 0

    @classmethod
    def add(cls, x: torch.Tensor, size: int) -> None:
        cls.bytes += (size - 1) * x.numel() * x.element_size()


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is not a rank of a group of {self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` (in place), identical on every rank."""
        if self.size > 1:
            WireCount.add(x, self.size)
            dist.all_reduce(x)
        return x

    def all_gather_stack(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x`, stacked in rank order: [size, *x.shape]."""
        if self.size == 1:
            return x[None]
        WireCount.add(x, self.size)
        out = x.new_empty(self.size, x.numel())
        dist.all_gather_single(out, x.reshape(1, -1))
        return out.view(self.size, *x.shape)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` [..., n] side by side along the last dimension, rank order: [..., size * n]."""
        if self.size == 1:
            return x
        return torch.cat(tuple(self.all_gather_stack(x)), dim=-1)

    def split(self, total: int) -> tuple[int, int]:
        """(start, count) of this rank's even share of `total` items (heads, rows, experts); the
        caller has checked that size divides total (`engine.models.parallel.sharding.check_divisible`)."""
        count = total // self.size
        return self.rank * count, count

    def kv_split(self, kv_heads: int) -> tuple[int, int]:
        """(start, count) of this rank's KV heads: an even share where the size divides them, else
        (a size that is a multiple of them: `sharding.check_divisible`) the one head its query heads
        read, each head replicated over size / kv_heads ranks, as vLLM and SGLang do."""
        if kv_heads % self.size == 0:
            return self.split(kv_heads)
        return self.rank * kv_heads // self.size, 1

    def padded_split(self, total: int) -> tuple[int, int, int]:
        """(start, real, padded) of this rank's share of `total` rows when size need not divide it:
        every rank holds `padded` = ceil(total / size) rows, of which the first `real` exist (the
        vocabulary: the last rank's shard is padded so that every rank gathers the same width)."""
        padded = -(-total // self.size)
        start = min(total, self.rank * padded)
        return start, min(total, start + padded) - start, padded


SINGLE = TensorParallel()


@dataclass(frozen=True)
class VocabShard:
    """A rank's columns of vocabulary-parallel logits: ids [start, start + real) of `vocab_size`, then
    padding up to the width every rank holds (engine/decoding/vocab_parallel.py decides on them)."""

    tp: TensorParallel
    start: int
    real: int
    vocab_size: int

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """The whole vocabulary's logits [..., vocab_size] from every rank's shard."""
        return self.tp.all_gather_last(local)[..., :self.vocab_size]
