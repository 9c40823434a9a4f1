"""Tokens per forward (TPF) and accuracy under parallelism (AUP): the two figures the diffusion-LLM
field reports beside tokens/s, from counts a run measured.

TPF is generated tokens over forward passes, both summed over a configuration's requests (the
response up to and including its end token; forwards over canvas positions past it still count, as
in Fast-dLLM's and d3LLM's evaluation: `num_tokens / num_nfe`). It does not depend on the hardware.

AUP is d3LLM's score (Qian et al., "d3LLM: Ultra-Fast Diffusion LLM using Pseudo-Trajectory
Distillation", ICML 2026, arXiv:2601.07568, the AUP definition; reference code `get_aup` in
github.com/hao-ai-lab/d3LLM `AUP_leaderboard/aup_utils.py`). For parallelism-accuracy pairs
(rho_i, y_i) sorted by rho, accuracy in percent, the points with y_i >= y_1 - 5 count and

    AUP = rho_1 * y_1 + 1/2 * sum_{i>=2} (rho_i - rho_{i-1}) * (y_i * W(y_i) + y_{i-1} * W(y_{i-1})),
    W(y) = min(exp(-alpha * (1 - y / y_max)), 1),  alpha = 3,

y_max the best accuracy on the task (the leaderboard takes it over every method). An eval table
supplies the pairs as d3LLM's leaderboard does, a curve per method from its one-token-per-step
point to its parallel one: each row's AUP is over two points, the table's first row (its baseline:
`fixed`, `block-static` or `dg-official` in the default tables) and the row itself, y_max the best
accuracy in the table; the baseline's own AUP is rho_1 * y_1. A row more than 5 points below the
baseline drops out of its own curve (the paper keeps only points above y_1 - 5), so its AUP is the
baseline's: its parallelism earns nothing (d3LLM's script refuses such a curve with an assertion;
the eval table marks the row instead).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

AUP_ALPHA = 3.0  # the paper's penalty factor on accuracy below the best
AUP_WINDOW = 5.0  # accuracy points below y_1 that a point may lie and still count


def tokens_per_forward(generated_tokens: int, forwards: int) -> Optional[float]:
    """Generated tokens per forward pass; None when nothing ran a forward."""
    return generated_tokens / forwards if forwards > 0 else None


def quality_weight(accuracy: float, best_accuracy: float, alpha: float = AUP_ALPHA) -> float:
    """W(y) = min(exp(-alpha (1 - y / y_max)), 1): 1 at the best accuracy, falling off below it."""
    if best_accuracy <= 0:  # every accuracy is 0: W multiplies 0 whatever it is
        return 1.0
    return min(math.exp(-alpha * (1 - accuracy / best_accuracy)), 1.0)


def counted_points(points: Sequence[tuple[float, float]], window: float = AUP_WINDOW) -> list[tuple[float, float]]:
    """The pairs AUP counts, by tokens per forward: those at most `window` points below y_1, the
    accuracy at the lowest tokens per forward (the first listed among equals)."""
    ordered = sorted(points, key=lambda point: point[0])
    return [(rho, y) for rho, y in ordered if y >= ordered[0][1] - window]


def accuracy_under_parallelism(points: Sequence[tuple[float, float]], best_accuracy: float,
                               alpha: float = AUP_ALPHA, window: float = AUP_WINDOW) -> float:
    """AUP of (tokens per forward, accuracy in percent) pairs, y_max = `best_accuracy` (percent)."""
    if not points:
        raise ValueError("AUP needs at least one (tokens per forward, accuracy) pair")
    if any(rho <= 0 for rho, _ in points):
        raise ValueError(f"tokens per forward must be positive, got {[rho for rho, _ in points]}")
    kept = counted_points(points, window)
    rho_1, y_1 = kept[0]
    total = rho_1 * y_1
    for (rho_prev, y_prev), (rho, y) in itertools.pairwise(kept):
        total += 0.5 * (rho - rho_prev) * (y * quality_weight(y, best_accuracy, alpha)
                                           + y_prev * quality_weight(y_prev, best_accuracy, alpha))
    return total


@dataclass(frozen=True)
class RowAUP:
    """A table row's AUP against the table's baseline, and whether the row's point counted in it."""

    aup: Optional[float]
    counted: bool


def table_aup(rows: Sequence[tuple[Optional[float], float]]) -> list[RowAUP]:
    """Each row's AUP from (tokens per forward, accuracy in percent) rows, the first the baseline;
    None where a row (or the baseline) ran no forward."""
    if not rows:
        return []
    best = max(y for _, y in rows)
    base_rho, base_y = rows[0]
    result = []
    for index, (rho, y) in enumerate(rows):
        if base_rho is None or rho is None:
            result.append(RowAUP(None, False))
            continue
        points = [(base_rho, base_y)] if index == 0 else [(base_rho, base_y), (rho, y)]
        result.append(RowAUP(accuracy_under_parallelism(points, best), (rho, y) in counted_points(points)))
    return result
