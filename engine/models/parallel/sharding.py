"""What a tensor-parallel group may split, and which slice of each checkpoint tensor a rank loads.

A layer marks each linear layer it shards with `tp_split` (engine.models.layers, moe, transformer,
gemma4_layers):

| tp_split | layers | the rank holds |
|---|---|---|
| "out" | q|k|v, gate|up (dense MLP, shared expert) | its share of each fused part's output rows (k, v: *) |
| "in" | attention output, down (dense MLP, shared expert) | its share of the input columns |
| "vocab" | embedding, output head | rows [start, start + real) of the vocabulary, padded |
| "experts" | the routed experts' weights (a tensor each, or stacked) | its experts, whole (none of the others') |
| (none) | norms, router, expert bias; DiffusionGemma's embedding and tied head | everything (replicated) |

* past the KV heads' count (a size that is a multiple of them), each rank loads the rows of the one
KV head its query heads read (`TensorParallel.kv_split`; the layer's `tp_sources`).

`source_slices` turns one checkpoint tensor into the reads of this rank: (rows, columns) of the
tensor and the rows of the parameter they fill. At size 1 every read is the whole tensor, as the
loader read it before tensor parallelism existed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch import nn

from engine.errors import TensorParallelError
from engine.models.config import ModelConfig
from engine.models.parallel.group import TensorParallel

Span = tuple[int, int]  # (start, count)


def kv_head_counts(config: ModelConfig) -> dict[str, int]:
    """The model's KV head counts by what a user would call them: one, or DiffusionGemma's sliding
    and full layers' each (the full layers have fewer: the tiny format has one)."""
    gemma = config.gemma
    if gemma is None:
        return {"KV heads": config.num_kv_heads}
    return {"sliding-layer KV heads": gemma.sliding.num_kv_heads, "full-layer KV heads": gemma.full.num_kv_heads}


def divisible_sizes(config: ModelConfig, size: int = 1) -> dict[str, int]:
    """Every count a tensor-parallel `size` must divide, by what a user would call it (KV heads
    only where the size is not a multiple of them: then each is replicated, `TensorParallel.kv_split`)."""
    sizes = {"attention heads": config.num_heads}
    sizes.update((what, count) for what, count in kv_head_counts(config).items() if size % count)
    return {**sizes, **_split_sizes(config)}


def _split_sizes(config: ModelConfig) -> dict[str, int]:
    """The counts other than the heads that a size must divide: MLP widths and routed experts."""
    sizes = {}
    moe = config.moe
    if moe is None or moe.first_dense_layers > 0:  # DiffusionGemma: its dense and self-conditioning MLPs
        sizes["MLP intermediate size"] = config.intermediate_size
    if moe is not None:
        sizes["routed experts"] = moe.num_experts
        if moe.num_shared_experts:
            sizes["shared expert intermediate size"] = moe.expert_intermediate_size * moe.num_shared_experts
    if config.gemma is not None:
        sizes["routed experts"] = config.gemma.num_experts
    return sizes


def check_divisible(config: ModelConfig, size: int) -> None:
    """TensorParallelError, naming both numbers and both rules, unless `size` ranks can split this
    model evenly. The vocabulary need not divide: its last shard is padded
    (`TensorParallel.padded_split`), or it is whole on every rank (DiffusionGemma)."""
    if size < 1:
        raise TensorParallelError(f"--tensor-parallel-size must be at least 1, got {size}")
    for what, count in divisible_sizes(config, size).items():
        if count % size:
            listing = ", ".join(f"{n} {name}" for name, n in {"attention heads": config.num_heads,
                                                                **_split_sizes(config)}.items())
            kv = " and its ".join(f"{n} {name}" for name, n in kv_head_counts(config).items())
            raise TensorParallelError(f"--tensor-parallel-size {size} does not divide the model's {count} {what}; "
                                      f"use a size that divides every one of {listing}, and divides or is a "
                                      f"multiple of its {kv} (each KV head then replicated)")


@dataclass(frozen=True)
class SliceRead:
    """Rows and columns of a checkpoint tensor (None: all of them) and the parameter rows they fill."""

    rows: Optional[Span]
    columns: Optional[Span]
    dest_rows: Optional[Span]  # None: the whole parameter


def source_slices(module: nn.Module, param_shape: tuple[int, ...], shard: Optional[str], vocab_size: int,
                  tp: TensorParallel) -> tuple[tuple[int, ...], list[SliceRead]]:
    """(the checkpoint tensor's expected shape, this rank's reads of it) for the tensor that fills
    `shard` of `module`'s parameter (its whole parameter when `shard` is None). No reads: the
    tensor belongs to another rank (a routed expert it does not hold)."""
    split = getattr(module, "tp_split", None)
    offsets: dict[str, Span] = getattr(module, "shard_offsets", {})
    tail = param_shape[1:]
    if split == "experts" and not offsets:  # stacked [experts, ...] (Gemma4): this rank's experts' rows
        first, local, total = module.first, module.local, module.num_experts
        return (total, *tail), [SliceRead(None if local == total else (first, local), None, None)]
    if split == "experts":
        if shard not in offsets:  # another rank's expert: the same shape as one of ours
            return (next(iter(offsets.values()))[1], *tail), []
        start, count = offsets[shard]
        return (count, *tail), [SliceRead(None, None, (start, count))]
    if split == "out":
        # a tensor may fill one fused part (`shard`) or, already fused in the checkpoint (LLaDA2's
        # query_key_value), every part in order: each part's rows are split across the ranks
        # (replicated KV heads: the part says where this rank's rows start, of how many: `tp_sources`)
        parts = [shard] if shard is not None else list(offsets) or [None]
        reads, source = [], 0
        for part in parts:
            dest = offsets[part] if part is not None else (0, param_shape[0])
            local = dest[1]
            start, total = getattr(module, "tp_sources", {}).get(part, (tp.rank * local, local * tp.size))
            reads.append(SliceRead((source + start, local), None, dest))
            source += total
        return (source, *tail), reads
    if split == "in":
        columns = param_shape[1]
        return (param_shape[0], columns * tp.size), [SliceRead(None, (tp.rank * columns, columns), None)]
    if split == "vocab":
        start, real, _ = tp.padded_split(vocab_size)
        return (vocab_size, *tail), [SliceRead((start, real), None, (0, real))]
    dest = offsets[shard] if shard is not None else None
    return ((dest[1], *tail) if dest is not None else param_shape), [SliceRead(None, None, dest)]
