"""Tokens per forward and d3LLM's accuracy under parallelism (`tinymodels.aup`) on hand-made counts,
each value worked out by hand from the paper's formula; and the eval table's TPF and AUP columns."""

from __future__ import annotations

import math

import pytest

from tinymodels.aup import (
    accuracy_under_parallelism,
    counted_points,
    quality_weight,
    table_aup,
    tokens_per_forward,
)
from tinymodels.evaluate import ConfigReport, format_table, table_dicts


def test_tokens_per_forward_is_generated_tokens_over_forwards():
    assert tokens_per_forward(300, 120) == 2.5
    assert tokens_per_forward(0, 0) is None


def test_the_weight_is_one_at_the_best_accuracy_and_exponential_below_it():
    assert quality_weight(80.0, 80.0) == 1.0
    assert quality_weight(90.0, 80.0) == 1.0  # capped at 1
    assert quality_weight(60.0, 80.0) == pytest.approx(math.exp(-0.75))  # exp(-3 * (1 - 60/80))
    assert quality_weight(0.0, 0.0) == 1.0  # no accuracy anywhere: W multiplies only zeros


def test_one_point_is_its_rectangle():
    assert accuracy_under_parallelism([(1.0, 72.5)], best_accuracy=80.0) == 72.5


def test_two_points_add_the_weighted_trapezoid():
    # rho_1 y_1 + 1/2 (rho_2 - rho_1) (y_2 W(y_2) + y_1 W(y_1)), y_max 80: W(80) = 1, W(78) = exp(-3 * 2/80)
    expected = 1.0 * 80.0 + 0.5 * (5.0 - 1.0) * (78.0 * math.exp(-3 * 2 / 80) + 80.0)
    assert accuracy_under_parallelism([(5.0, 78.0), (1.0, 80.0)], best_accuracy=80.0) == pytest.approx(expected)


def test_the_ideal_curve_is_the_plain_area():
    """No accuracy lost: every weight is 1 and AUP is the area under the curve from rho = 0."""
    points = [(1.0, 70.0), (2.0, 70.0), (4.0, 70.0)]
    assert accuracy_under_parallelism(points, best_accuracy=70.0) == pytest.approx(4.0 * 70.0)


def test_points_more_than_five_below_the_least_parallel_one_drop_out():
    points = [(1.0, 80.0), (3.0, 76.0), (6.0, 74.9)]
    assert counted_points(points) == [(1.0, 80.0), (3.0, 76.0)]
    expected = 80.0 + 0.5 * 2.0 * (76.0 * math.exp(-3 * 4 / 80) + 80.0)
    assert accuracy_under_parallelism(points, best_accuracy=80.0) == pytest.approx(expected)


def test_tokens_per_forward_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        accuracy_under_parallelism([(0.0, 50.0)], best_accuracy=50.0)
    with pytest.raises(ValueError, match="at least one"):
        accuracy_under_parallelism([], best_accuracy=50.0)


def test_each_table_row_is_scored_against_the_first_with_the_tables_best_accuracy():
    rows = [(0.5, 90.0), (4.0, 88.0), (6.0, 80.0), (None, 95.0)]
    fixed, parallel, too_lossy, empty = table_aup(rows)
    assert fixed.aup == pytest.approx(0.5 * 90.0) and fixed.counted
    def w(y: float) -> float:  # y_max is the best accuracy of the table, the row without forwards included
        return math.exp(-3 * (1 - y / 95.0))

    assert parallel.aup == pytest.approx(45.0 + 0.5 * 3.5 * (88.0 * w(88.0) + 90.0 * w(90.0))) and parallel.counted
    assert too_lossy.aup == pytest.approx(fixed.aup) and not too_lossy.counted
    assert empty.aup is None


def _report(name: str, correct: int, nfe: int, generated: int) -> ConfigReport:
    return ConfigReport(name, {}, n=10, correct=correct, nfe=nfe, generated_tokens=generated, seconds=2.0)


def test_the_eval_table_prints_tpf_and_aup_beside_tokens_per_second():
    reports = [_report("fixed", 9, 1280, 300), _report("threshold", 9, 100, 300), _report("loose", 5, 50, 300)]
    rows = table_dicts(reports)
    assert [d["tokens_per_forward"] for d in rows] == [300 / 1280, 3.0, 6.0]
    assert rows[1]["aup"] == pytest.approx(300 / 1280 * 90 + 0.5 * (3.0 - 300 / 1280) * 180)
    assert [d["aup_counted"] for d in rows] == [True, True, False] and rows[2]["aup_baseline"] == "fixed"
    table = format_table(reports)
    header, _, *lines = table.splitlines()
    cells = [c.strip() for c in header.strip("|").split("|")]
    assert cells[cells.index("tok/s") - 2:cells.index("tok/s")] == ["TPF", "AUP"]
    threshold = [c.strip() for c in lines[1].strip("|").split("|")]
    assert threshold[cells.index("TPF")] == "3.00" and threshold[cells.index("AUP")] == f"{rows[1]['aup']:.1f}"
    assert [c.strip() for c in lines[2].strip("|").split("|")][cells.index("AUP")].endswith("†")
    assert "arXiv:2601.07568" in lines[-1] and "first row (fixed)" in lines[-1]
