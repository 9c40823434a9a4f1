"""The coarse-to-fine search over CAI's knobs, independent of any model: it asks a `measure`
function for the accuracy and forward passes of a list of candidates (one batched run a stage) and
keeps the best by an explicit objective.

Stages (each one call to `measure`):
1. the reference (the fixed decoder, every step) and the 8 structures of CAI (gating, per-token
   budgets, grinding cut: each on or off) at the paper's thresholds;
2. a threshold grid (theta_s x theta_e, theta_e <= theta_s) on the two best structures;
3. refinement around the best: theta_s / theta_e moved by 0.05 and 0.1, and each switch flipped;
   repeated from the new best (at most `refine_rounds` times) until the best stays the best.

Objectives:
- `nfe`: the fewest forward passes a problem among candidates whose accuracy is within
  `tolerance` of the reference's (the paper's trade-off, made explicit);
- `accuracy`: the highest accuracy, fewer forward passes breaking ties.
`budget` (a share of the reference's forward passes) rules out candidates above it under either.
When no candidate qualifies, the result says so (`feasible` is False) and holds the candidate
closest to qualifying rather than pretending one did.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

OBJECTIVES = ("nfe", "accuracy")
SWITCHES = ("gating", "budgets", "grinding")
DEFAULT_THETA_S = (0.8, 0.9, 0.99)
DEFAULT_THETA_E = (0.5, 0.7, 0.9)
REFINE_STEPS = (-0.1, -0.05, 0.05, 0.1)
PAPER_THETA_S, PAPER_THETA_E = 0.9, 0.7
_THETA_MAX = 0.999  # a threshold of 1 would never be met: every token would wait for its forced commit
_THETA_MIN = 0.05


@dataclass(frozen=True)
class Measurement:
    accuracy: float  # share of items answered correctly
    nfe: float  # forward passes per item


@dataclass(frozen=True)
class Trial:
    knobs: dict[str, Any]
    measurement: Measurement
    stage: str

    def as_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "decoding": self.knobs, "accuracy": self.measurement.accuracy,
                "nfe_per_item": self.measurement.nfe}


@dataclass
class SearchResult:
    reference: Trial
    best: Trial
    feasible: bool  # whether `best` meets the objective's constraints
    trials: list[Trial] = field(default_factory=list)


Measure = Callable[[Sequence[dict[str, Any]]], list[Measurement]]


def _key(knobs: dict[str, Any]) -> tuple:
    return tuple(sorted(knobs.items()))


class _Ranking:
    """Orders trials by the objective: qualifying ones first, then by the objective's figure."""

    def __init__(self, objective: str, reference: Measurement, tolerance: float, budget: Optional[float]) -> None:
        if objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
        if tolerance < 0:
            raise ValueError(f"tolerance must be >= 0, got {tolerance}")
        if budget is not None and budget <= 0:
            raise ValueError(f"budget must be > 0 (a share of the fixed decoder's forward passes), got {budget}")
        self.objective, self.reference, self.tolerance, self.budget = objective, reference, tolerance, budget

    def within_budget(self, m: Measurement) -> bool:
        return self.budget is None or m.nfe <= self.budget * self.reference.nfe + 1e-9

    def qualifies(self, m: Measurement) -> bool:
        if not self.within_budget(m):
            return False
        if self.objective == "nfe":
            return m.accuracy >= self.reference.accuracy - self.tolerance - 1e-12
        return True

    def key(self, trial: Trial) -> tuple:
        m = trial.measurement
        if self.objective == "nfe":
            # among the unqualified: the smallest accuracy shortfall, then fewer forwards
            shortfall = max(0.0, self.reference.accuracy - self.tolerance - m.accuracy)
            return (not self.qualifies(m), shortfall if not self.qualifies(m) else 0.0, m.nfe, -m.accuracy)
        over = 0.0 if self.within_budget(m) else m.nfe - (self.budget or 0) * self.reference.nfe
        return (not self.qualifies(m), over, -m.accuracy, m.nfe)


def structures(base: dict[str, Any]) -> list[dict[str, Any]]:
    """The 8 on/off combinations of CAI's switches at the paper's thresholds."""
    out = []
    for bits in range(2 ** len(SWITCHES)):
        switches = {name: bool(bits >> i & 1) for i, name in enumerate(SWITCHES)}
        out.append({**base, "policy": "cai", **switches, "theta_s": PAPER_THETA_S, "theta_e": PAPER_THETA_E})
    return out


def _thresholds(knobs: dict[str, Any], theta_s: float, theta_e: float) -> Optional[dict[str, Any]]:
    theta_s, theta_e = round(theta_s, 3), round(theta_e, 3)
    if not (_THETA_MIN <= theta_e <= theta_s <= _THETA_MAX):
        return None
    return {**knobs, "theta_s": theta_s, "theta_e": theta_e}


def search(measure: Measure, reference: dict[str, Any], base: dict[str, Any], objective: str = "nfe",
           tolerance: float = 0.01, budget: Optional[float] = None,
           theta_s_grid: Sequence[float] = DEFAULT_THETA_S, theta_e_grid: Sequence[float] = DEFAULT_THETA_E,
           refine_rounds: int = 3, on_stage: Optional[Callable[[str, int], None]] = None) -> SearchResult:
    """Run the three stages; `base` holds the knobs every CAI candidate shares (cache, blocks, ...);
    `on_stage(name, candidates)` before each stage runs (a progress report)."""
    seen: dict[tuple, Trial] = {}

    def run(stage: str, candidates: list[dict[str, Any]]) -> list[Trial]:
        fresh = []
        for c in candidates:
            if _key(c) not in seen and all(_key(c) != _key(f) for f in fresh):
                fresh.append(c)
        if fresh:
            if on_stage is not None:
                on_stage(stage, len(fresh))
            for knobs, m in zip(fresh, measure(fresh), strict=True):
                seen[_key(knobs)] = Trial(knobs, m, stage)
        return [seen[_key(c)] for c in candidates]

    first = run("structures", [reference, *structures(base)])
    ref_trial, structure_trials = first[0], first[1:]
    ranking = _Ranking(objective, ref_trial.measurement, tolerance, budget)
    structure_trials.sort(key=ranking.key)

    grid = []
    for trial in structure_trials[:2]:
        for theta_s in theta_s_grid:
            for theta_e in theta_e_grid:
                candidate = _thresholds(trial.knobs, theta_s, theta_e)
                if candidate is not None:
                    grid.append(candidate)
    run("thresholds", grid)

    def leader() -> Trial:
        return min((t for k, t in seen.items() if k != _key(reference)), key=ranking.key)

    best = leader()
    for round_ in range(1, refine_rounds + 1):  # hill-climb from the best until it stays the best
        refine = []
        for step in REFINE_STEPS:
            for candidate in (_thresholds(best.knobs, best.knobs["theta_s"] + step, best.knobs["theta_e"]),
                              _thresholds(best.knobs, best.knobs["theta_s"], best.knobs["theta_e"] + step)):
                if candidate is not None:
                    refine.append(candidate)
        for name in SWITCHES:
            refine.append({**best.knobs, name: not best.knobs[name]})
        run(f"refine {round_}", refine)
        if leader() is best:
            break
        best = leader()

    candidates = [t for k, t in seen.items() if k != _key(reference)]
    best = min(candidates, key=ranking.key)
    return SearchResult(reference=ref_trial, best=best, feasible=ranking.qualifies(best.measurement),
                        trials=list(seen.values()))
