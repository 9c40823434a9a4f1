"""Count the places Python reads a tensor's value back to the host.

On a GPU each such read (`.tolist()`, `.item()`, `bool(t)`, `int(t)`, ...) waits for the stream to
drain, so the engine allows one per step. This wraps every Tensor method that turns device values
into Python values and counts calls while it is active: the test of that rule and the step
benchmark use it. It counts calls, whatever the device, so it works on the CPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

READ_METHODS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")


@dataclass
class HostReads:
    count: int = 0
    by_method: dict[str, int] = field(default_factory=dict)


@contextmanager
def count_host_reads() -> Iterator[HostReads]:
    """Count tensor-to-Python reads made inside the block (not thread-safe: for tests and benchmarks)."""
    reads = HostReads()
    originals = {name: getattr(torch.Tensor, name) for name in READ_METHODS}

    def wrap(name: str, original: Any) -> Any:
        def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            reads.count += 1
            reads.by_method[name] = reads.by_method.get(name, 0) + 1
            return original(self, *args, **kwargs)
        return counted

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
