"""Calls the tensor-parallel tests make on every rank (`TensorParallelEngine.collective_rpc`): the
worker processes import this module by name (spawn passes them the test process's sys.path)."""

from __future__ import annotations

import itertools
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


def uniform_passes(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   canvases: list[torch.Tensor]) -> torch.Tensor:
    """A DiffusionGemma model's logits [len(canvases), B, L, vocab] through its passes, as a request
    takes them: the encoder over the (left-padded) prompt, the decoder over the first canvas, the
    next canvas self-conditioned on the previous one's soft embeddings, then each later canvas after
    the one before it is committed (encoded)."""
    batch, length = input_ids.shape
    width = length + sum(c.shape[1] for c in canvases) + max(c.shape[1] for c in canvases)
    with torch.no_grad():
        cache = model.new_cache(batch, width)
        model.encode(input_ids, cache, attention_mask=attention_mask)
        logits = [model.decode(canvases[0], cache)]
        if len(canvases) > 1:
            logits.append(model.decode(canvases[1], cache, self_conditioning=model.soft_embeddings(logits[0])))
        for previous, canvas in itertools.pairwise(canvases[1:]):
            model.encode(previous, cache)
            logits.append(model.decode(canvas, cache))
    return torch.stack(logits)


def uniform_forward(replica: Replica, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    canvases: list[torch.Tensor]) -> torch.Tensor:
    """`uniform_passes` on this rank's model (every rank must run it: its collectives need them all)."""
    return uniform_passes(replica.engine.model, input_ids, attention_mask, canvases)


def draw_states(replica: Replica) -> list[Any]:
    """The state of each slot's random stream (a uniform-noise row's generator; None: no row), as
    bytes: equal on every rank while the ranks draw alike."""
    draws = replica.engine.slots.draws
    return [None if d is None else bytes(d.generator.get_state().numpy()) for d in draws]
