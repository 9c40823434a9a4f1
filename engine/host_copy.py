"""Host-to-device copies that never block the host.

A non-blocking copy from pageable host memory is not asynchronous on CUDA: the driver stages it
through its own pinned buffer and may wait for the stream first, so every admission's knob rows and
every step's row fields would stall the host until the GPU drained (the H200 check found up to nine
such waits a step). Staging the values in pinned memory from torch's caching host allocator makes
the copy truly asynchronous; the allocator keeps the block until the copy has run, so it is safe to
drop the host tensor at once. On the CPU the copy is the tensor itself.
"""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a CPU tensor) on `device`, copied without waiting on the device."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
