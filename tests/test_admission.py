"""The admission-wait rule: how long a wait can pay, and the passive refill-time tracker."""

from __future__ import annotations

import math

import pytest

from server.admission import RefillTracker, admission_limit


def test_limit_is_the_freed_rows_share_of_a_step_within_the_cap():
    assert admission_limit(cap=0.005, step_seconds=0.026, active=7, freed=1) == pytest.approx(0.026 / 8)
    assert admission_limit(cap=0.005, step_seconds=0.026, active=6, freed=2) == 0.005
    assert admission_limit(cap=0.1, step_seconds=0.004, active=7, freed=1) == pytest.approx(0.0005)


@pytest.mark.parametrize("cap,active,freed", [(0.0, 7, 1), (0.005, 0, 1), (0.005, 7, 0)])
def test_no_wait_without_a_cap_active_rows_or_freed_rows(cap, active, freed):
    assert admission_limit(cap, 0.03, active, freed) == 0.0


def test_no_history_expects_an_immediate_refill():
    assert RefillTracker(horizon=0.01).expected_refill(now=0.0) == 0.0


def test_closed_loop_refills_are_timed_first_in_first_out():
    tracker = RefillTracker(horizon=0.01)
    for k in range(10):
        t = k * 0.03
        tracker.rows_freed(2, t)
        tracker.request_arrived(t + 0.002)
        tracker.request_arrived(t + 0.003)
    assert tracker.expected_refill(now=0.3) == pytest.approx(0.0025)


def test_rows_never_refilled_count_as_misses_after_the_horizon():
    tracker = RefillTracker(horizon=0.01)
    tracker.rows_freed(1, 0.0)
    tracker.request_arrived(0.002)
    for k in range(1, 4):
        tracker.rows_freed(1, k * 0.03)
    assert tracker.expected_refill(now=0.2) == math.inf
    tracker.request_arrived(0.2)  # an arrival with no freed row pending says nothing
    assert tracker.expected_refill(now=0.2) == math.inf


def test_the_window_forgets_an_old_load():
    tracker = RefillTracker(horizon=0.01, window=4)
    for k in range(4):
        tracker.rows_freed(1, k * 0.03)
    now = 0.2
    for k in range(4):
        tracker.rows_freed(1, now + k * 0.03)
        tracker.request_arrived(now + k * 0.03 + 0.001)
    assert tracker.expected_refill(now=0.4) == pytest.approx(0.001)
