"""A forward on static buffers, one set per shape: what a CUDA graph replays and what
`torch.compile(fullgraph=True)` compiles once per shape.

A graph replays fixed shapes at fixed addresses, and a compiled forward is fastest on shapes it has
seen, so the forward runs on buffers indexed by slot rather than by the step's rows:

- row s of every input buffer is slot s; a shape covers slots [0, bucket), where bucket is the
  smallest batch bucket above the highest slot in the step (the scheduler hands out the lowest free
  slots, so this is about the number of running rows);
- every other input of the shape (tokens fed, the columns attended, the logits width) is part of its
  key, which the caller picks from host facts of the rows, so nothing in the forward reads a device
  value back or branches on one;
- a slot that takes no part (free, or running another forward this step) gets its buffers' idle
  values, which the caller chooses so that the slot writes only a scratch column no row attends;
  its outputs are never read.

How a shape runs (`HOW`): `eager` runs the static forward as is (what the tests compare with the
engine's ordinary forwards), `compile` through `torch.compile(fullgraph=True)` (no graph break: a
break would be a host round trip in the middle of the step), `graph` as a CUDA graph captured the
first time its key is needed. Every shape is dropped when the store's tensors are reallocated (it
grows when a longer request arrives): a captured graph points into the old ones.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from engine.errors import SettingError
from engine.models.moe import GroupedExperts

log = logging.getLogger("cai_dllm.engine")

HOW = ("eager", "compile", "graph")
# Batch sizes a shape is made for: small ones one by one (a server's usual load), then every
# multiple of this, as vLLM captures its graphs.
_BUCKET_STEP = 8
# torch.compile compiles each key once; a server meets a few dozen (buckets x fed lengths x widths)
_COMPILED_SHAPES = 256
ShapeFn = Callable[[Mapping[str, torch.Tensor]], torch.Tensor]


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, 16, 24, ... up to and always including max_batch."""
    small = [b for b in (1, 2, 4) if b < max_batch]
    large = list(range(_BUCKET_STEP, max_batch, _BUCKET_STEP))
    return (*small, *large, max_batch)


def attended_columns(longest: int, store_width: int) -> int:
    """The columns a static forward attends: the power of two at or above the longest span a row
    attends (one shape for every span up to it), within the store short of its last column (the
    scratch column that idle slots write)."""
    return min(1 << (longest - 1).bit_length(), store_width - 1)


def static_experts(model: nn.Module, how: Optional[str]) -> Optional[str]:
    """How a model's static forwards may run (`how`, or None: eagerly), given its experts. A CUDA
    graph runs them by torch's grouped GEMM (bfloat16, engine.models.moe): other experts keep their
    steps eager, as CUDA graphs are a default. A compiled forward runs any unquantized experts
    (`dense` where the grouped GEMM does not compile); quantized ones refuse the flag."""
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    if how == "graph" and not all(m.static for m in experts):
        return None
    if how == "compile" and not all(m.compiles for m in experts):
        raise SettingError("--torch-compile", f"{getattr(model, 'display_name', 'the model')}'s experts are "
                                              f"quantized, and a compiled forward cannot run them (one linear "
                                              f"pair per expert, read from the host); serve it without the flag")
    return how


@dataclass(frozen=True)
class Buffer:
    """One input of the static forward: its shape past the bucket's rows, dtype and idle value."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    idle: int


RunFn = Callable[[Mapping[str, torch.Tensor], Hashable], torch.Tensor]  # (buffers, key) -> outputs [bucket, ...]


@dataclass
class _Shape:
    inputs: dict[str, torch.Tensor]  # [bucket, ...] each
    idle: dict[str, int]
    run: ShapeFn  # the forward at this key (compiled, when compiling)
    output: Optional[torch.Tensor] = None  # the captured graph's
    graph: Optional[torch.cuda.CUDAGraph] = None


class StaticForwards:
    """A forward (`run`) on static buffers per key, run eagerly, compiled or as CUDA graphs (`how`)."""

    def __init__(self, run: RunFn, how: str, max_batch: int, device: torch.device) -> None:
        if how not in HOW:
            raise ValueError(f"how must be one of {', '.join(HOW)}; got {how!r}")
        if how == "graph" and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the model is on {device}")
        self.how = how
        self.device = device
        self.buckets = batch_buckets(max_batch)
        self._run = run
        if how == "compile":
            torch._dynamo.config.accumulated_recompile_limit = max(
                torch._dynamo.config.accumulated_recompile_limit, _COMPILED_SHAPES)
        self._shapes: dict[Hashable, _Shape] = {}
        self._owner: Optional[torch.Tensor] = None  # the store tensor the shapes were made over

    @property
    def made(self) -> int:
        """Shapes made so far (graphs captured, when capturing)."""
        return len(self._shapes)

    @property
    def keys(self) -> tuple[Hashable, ...]:
        """The keys of the shapes made (since the store last grew)."""
        return tuple(self._shapes)

    def bucket(self, max_slot: int) -> int:
        """The batch bucket of a step whose highest slot is `max_slot`."""
        return next(b for b in self.buckets if b > max_slot)

    def forward(self, key: Hashable, buffers: Callable[[], Mapping[str, Buffer]], owner: torch.Tensor,
                slots: torch.Tensor, rows: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The outputs of the rows at `slots` ([B] slot indices, below the key's bucket, its first
        element), whose inputs are `rows` (name -> [B, ...]), the other slots idle. `buffers` gives
        the key's inputs the first time it is met; `owner` is the store's first tensor (a new one
        drops every shape)."""
        if owner is not self._owner:
            self._shapes.clear()
            self._owner = owner
        shape = self._shapes.get(key)
        new = shape is None
        if shape is None:
            shape = self._shapes[key] = self._make(key, buffers())
        for name, tensor in shape.inputs.items():
            tensor.fill_(shape.idle[name])
        for name, value in rows.items():
            shape.inputs[name][slots] = value
        # a new shape is compiled on this step's inputs (idle ones alone need not be consistent with
        # the key: a key may count the tokens the rows feed), or captured (`_capture`)
        if new and self.how == "graph":
            began = time.perf_counter()
            self._capture(shape, key)
            log.info("static forward %s: captured in %.1f s", key, time.perf_counter() - began)
        if shape.graph is None:
            began = time.perf_counter()
            out = shape.run(shape.inputs)[slots]
            if new and self.how == "compile":
                log.info("static forward %s: compiled in %.1f s", key, time.perf_counter() - began)
            return out
        shape.graph.replay()
        assert shape.output is not None
        return shape.output[slots]

    def _make(self, key: Hashable, buffers: Mapping[str, Buffer]) -> _Shape:
        bucket = key[0] if isinstance(key, tuple) else key
        return _Shape(inputs={name: torch.full((bucket, *b.shape), b.idle, dtype=b.dtype, device=self.device)
                              for name, b in buffers.items()},
                      idle={name: b.idle for name, b in buffers.items()}, run=self._shape_run(key))

    def _shape_run(self, key: Hashable) -> ShapeFn:
        """The forward at `key`; compiled, a function of its own: dynamo keeps a function's compiled
        versions on its code object and tries their guards one after another on every call, so one
        function compiled for every key would pay, each call, for the guards of the shapes made
        before its own. Only its tensors' guards are kept: the function runs on its own buffers and
        the one store it was made over (a new store drops it), so the other guards (on the modules'
        attributes and the weights' identity) could never fail, and checking them on every call is
        host time the step waits for."""
        run = self._run

        def shape_run(x: Mapping[str, torch.Tensor]) -> torch.Tensor:
            return run(x, key)

        if self.how != "compile":
            return shape_run
        shape_run.__code__ = shape_run.__code__.replace(co_name=f"static_forward_{len(self._shapes)}")
        options = {"guard_filter_fn": torch.compiler.keep_tensor_guards_unsafe}
        if self.device.type == "cpu":
            # on CPU nothing replays the step, so the host code between kernels is paid every step:
            # inductor's wrapper in C++ rather than Python cuts it (a longer first compile)
            options["cpp_wrapper"] = True
        return torch.compile(shape_run, fullgraph=True, dynamic=False, options=options)

    def run_idle(self, key: Hashable) -> None:
        """Run the shape made for `key` on its idle inputs, which it keeps as they were: what a
        capture warms up on. An idle slot writes only a scratch column, so this changes nothing a
        row reads, even in a forward that advances the cache (the uniform mode's encoder pass)."""
        shape = self._shapes[key]
        held = {name: tensor.clone() for name, tensor in shape.inputs.items()}
        for name, tensor in shape.inputs.items():
            tensor.fill_(shape.idle[name])
        shape.run(shape.inputs)
        for name, tensor in shape.inputs.items():
            tensor.copy_(held[name])

    def _capture(self, shape: _Shape, key: Hashable) -> None:
        # Warm up on a side stream first (the allocator's and the kernels' first-call work stays out
        # of the graph), as PyTorch's capture recipe asks, on idle inputs (`run_idle`): the replay
        # then runs the step's forward once.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self.run_idle(key)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        # Each graph keeps its own memory pool: replays of different shapes never share scratch memory.
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            shape.output = shape.run(shape.inputs)
        shape.graph = graph
