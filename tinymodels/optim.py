"""Optimizers for training the built-in models.

`muon` orthogonalises the momentum update of every hidden weight matrix (Newton-Schulz) and leaves
the embedding, the output head, norms and biases to AdamW, as Muon's authors do: those are not
linear maps between hidden states, where the orthogonalised update is what helps. The update is
scaled to AdamW's RMS (Moonshot's rule), so AdamW's learning rate and weight decay carry over.

Our own Muon rather than torch.optim.Muon: that one orthogonalises in bfloat16, which a CPU
without bfloat16 arithmetic emulates, so on the CPUs the built-in models train on it is slower than
orthogonalising in float32.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Union

import torch

from tinymodels.train_config import OPTIMIZERS

_BETAS = (0.9, 0.95)


# Quintic Newton-Schulz coefficients from Keller Jordan's Muon: they push every singular value
# into roughly [0.7, 1.2] in five iterations, which is orthogonal enough for an update direction.
_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
_NS_STEPS = 5
_MOMENTUM = 0.95
_RMS_MATCH = 0.2  # Moonshot: an orthogonal update scaled by 0.2*sqrt(max dim) has AdamW's RMS


def orthogonalise(matrix: torch.Tensor, steps: int = _NS_STEPS) -> torch.Tensor:
    """The nearest semi-orthogonal matrix to `matrix`, approximately (UV^T of its SVD)."""
    a, b, c = _NS_COEFFICIENTS
    x = matrix / (matrix.norm() + 1e-7)
    tall = x.shape[0] > x.shape[1]
    if tall:  # iterate on the smaller Gram matrix
        x = x.T
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


class Muon(torch.optim.Optimizer):
    """SGD with Nesterov momentum whose update is orthogonalised; for 2-D weights only."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float, weight_decay: float,
                 momentum: float = _MOMENTUM) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "momentum": momentum})
        for group in self.param_groups:
            for param in group["params"]:
                if param.dim() != 2:
                    raise ValueError(f"Muon updates 2-D weights only, got shape {tuple(param.shape)}")

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            lr, decay, momentum = group["lr"], group["weight_decay"], group["momentum"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                buffer = self.state[param].setdefault("momentum_buffer", torch.zeros_like(param))
                buffer.mul_(momentum).add_(param.grad)
                update = orthogonalise(param.grad.add(buffer, alpha=momentum))
                param.mul_(1 - lr * decay)
                param.add_(update, alpha=-lr * _RMS_MATCH * math.sqrt(max(param.shape)))


class OptimizerGroup:
    """Several optimizers stepped as one: one list of param groups (so a learning-rate schedule
    sets them all), one state dict (so a resumed run restores them all)."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [optimizer.state_dict() for optimizer in self.optimizers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        states = state["optimizers"]
        if len(states) != len(self.optimizers):
            raise ValueError(f"state holds {len(states)} optimizers, this run has {len(self.optimizers)}")
        for optimizer, part in zip(self.optimizers, states, strict=True):
            optimizer.load_state_dict(part)


Optimizer = Union[torch.optim.Optimizer, OptimizerGroup]


def is_hidden_matrix(name: str, param: torch.Tensor) -> bool:
    return param.dim() == 2 and name.startswith("layers.")


def matrix_decay_adamw(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over the trained parameters with decoupled weight decay on the matrices only (a decayed
    RMSNorm weight is pulled towards 0, not the identity): the MoE recipes' optimizer (DiffusionGemma,
    LLaDA2, whose stacked experts Muon does not take and whose router biases are not trained)."""
    trained = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in trained if p.dim() > 1], "weight_decay": weight_decay},
              {"params": [p for p in trained if p.dim() <= 1], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=_BETAS)


def build_optimizer(model: torch.nn.Module, kind: str, lr: float, weight_decay: float) -> Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, betas=_BETAS, weight_decay=weight_decay)
    if kind != "muon":
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {kind!r}")
    hidden = [p for n, p in model.named_parameters() if is_hidden_matrix(n, p)]
    rest = [p for n, p in model.named_parameters() if not is_hidden_matrix(n, p)]
    return OptimizerGroup(
        Muon(hidden, lr=lr, weight_decay=weight_decay),
        torch.optim.AdamW(rest, lr=lr, betas=_BETAS, weight_decay=weight_decay))
