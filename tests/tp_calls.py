"""Calls the tensor-parallel tests make on every rank (`TensorParallelEngine.collective_rpc`): the
worker processes import this module by name (spawn passes them the test process's sys.path)."""

from __future__ import annotations

from typing import Any

import torch

from engine.executor.calls import Replica


def forward(replica: Replica, args: tuple, kwargs: dict[str, Any]) -> torch.Tensor:
    """The rank's model on these inputs (every rank must run it: its collectives need them all)."""
    with torch.no_grad():
        return replica.engine.model(*args, **kwargs)


def shard_shapes(replica: Replica) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape on this rank."""
    return {name: tuple(p.shape) for name, p in replica.engine.model.named_parameters()}


def experts_quantized(replica: Replica) -> bool:
    """Whether every routed expert this rank holds is a quantized linear pair (no stacked float weight)."""
    from engine.models.moe import GroupedExperts

    stacked = [m for m in replica.engine.model.modules() if isinstance(m, GroupedExperts)]
    return bool(stacked) and all(m.gate_up_proj is None and m.quantized is not None for m in stacked)
