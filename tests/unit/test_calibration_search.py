"""The calibration search on a planted objective: a fake `measure` whose accuracy and forward passes
are known functions of the knobs, so the optimum is known in advance."""

from __future__ import annotations

import pytest

from calibration.search import SWITCHES, Measurement, search

REFERENCE = {"policy": "fixed", "block_length": 32, "early_exit": False}
BASE = {"block_length": 32, "cache": "dual"}


class Planted:
    """Accuracy falls as theta_s drops below 0.85 or theta_e below 0.6 and with grinding off;
    forward passes fall with both thresholds and with budgets on. The best candidate within 1 point
    of the fixed decoder (accuracy 0.9) is therefore gating off, budgets on, grinding on,
    theta_s 0.85, theta_e 0.6."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, candidates):
        self.calls.append(len(candidates))
        return [self.one(c) for c in candidates]

    @staticmethod
    def one(knobs) -> Measurement:
        if knobs["policy"] == "fixed":
            return Measurement(0.9, 128.0)
        accuracy = 0.9 - max(0.0, 0.85 - knobs["theta_s"]) - max(0.0, 0.6 - knobs["theta_e"])
        accuracy -= 0.0 if knobs["grinding"] else 0.05
        accuracy -= 0.002 if knobs["gating"] else 0.0
        nfe = 20 + 60 * knobs["theta_s"] + 20 * knobs["theta_e"] - (5 if knobs["budgets"] else 0)
        nfe += 3 if knobs["gating"] else 0
        return Measurement(round(accuracy, 6), nfe)


def test_search_finds_the_planted_optimum_in_batched_stages():
    measure = Planted()
    result = search(measure, REFERENCE, BASE, objective="nfe", tolerance=0.01)
    assert result.feasible
    best = result.best.knobs
    assert {k: best[k] for k in SWITCHES} == {"gating": False, "budgets": True, "grinding": True}
    assert (best["theta_s"], best["theta_e"]) == (0.85, 0.6)
    assert best["cache"] == "dual" and best["policy"] == "cai"
    assert result.reference.measurement == Measurement(0.9, 128.0)
    # one batched run a stage: structures, thresholds, then refinement rounds (at most 3)
    assert 3 <= len(measure.calls) <= 5
    assert len(result.trials) == sum(measure.calls)  # no candidate measured twice


def test_accuracy_objective_and_budget():
    result = search(Planted(), REFERENCE, BASE, objective="accuracy")
    assert result.best.measurement.accuracy == pytest.approx(0.9)
    assert result.best.knobs["gating"] is False  # the tie on accuracy goes to fewer forwards... and no gating cost
    capped = search(Planted(), REFERENCE, BASE, objective="accuracy", budget=0.6)
    assert capped.feasible and capped.best.measurement.nfe <= 0.6 * 128


def test_an_unreachable_objective_is_reported_not_hidden():
    result = search(Planted(), REFERENCE, BASE, objective="nfe", tolerance=0.0, budget=0.1)
    assert not result.feasible
    assert result.best.measurement.nfe > 0.1 * 128


@pytest.mark.parametrize(("kwargs", "says"), [({"objective": "speed"}, "objective"),
                                              ({"tolerance": -1}, "tolerance"), ({"budget": 0}, "budget")])
def test_bad_settings_are_refused(kwargs, says):
    with pytest.raises(ValueError, match=says):
        search(Planted(), REFERENCE, BASE, **kwargs)
