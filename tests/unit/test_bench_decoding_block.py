"""`cai-dllm bench serve`'s diffusion-decoding block on hand-built outcomes: tokens per forward,
tokens per step and steps per block from the responses' own counts, AUP with and without a
baseline report."""

from __future__ import annotations

import json
import math
from typing import Optional

import pytest

from bench.load_generator import LoadReport, LoadRequest, RequestOutcome, format_report, summarise
from server.cli.bench import _aup_baseline


def _run(baseline: Optional[dict[str, float]] = None) -> LoadReport:
    requests = [LoadRequest(prompt="a", answer="x"), LoadRequest(prompt="b", answer="y"), LoadRequest(prompt="c")]
    outcomes = [RequestOutcome(ok=True, status=200, latency=1.0, completion_tokens=24, text="x", nfe=8, steps=6,
                               blocks=2),
                RequestOutcome(ok=True, status=200, latency=1.0, completion_tokens=36, text="z", nfe=12, steps=10,
                               blocks=3),
                RequestOutcome(ok=False, status=400, latency=0.01, completion_tokens=99, nfe=99, steps=99, blocks=1)]
    return summarise("http://x", "m", requests, outcomes, duration=2.0, concurrency=2, request_rate=None,
                     aup_baseline=baseline)


def test_the_block_counts_only_completed_requests():
    report = _run()
    assert report.tokens_per_forward == 60 / 20 and report.nfe_per_token == 20 / 60
    assert report.tokens_per_step == 60 / 16 and report.steps_per_block == 16 / 5
    assert report.accuracy == 0.5
    assert report.aup == pytest.approx(3.0 * 50.0)  # one point: rho_1 y_1
    text = format_report(report)
    assert "tokens per forward (TPF) 3.00" in text and "steps per block/canvas   3.20" in text
    assert "AUP                      150.0" in text and "this run alone" in text


def test_a_baseline_report_is_the_first_point_of_the_curve():
    report = _run({"tokens_per_forward": 1.0, "accuracy": 0.52})
    weight = math.exp(-3 * (1 - 50.0 / 52.0))  # y_max: the better of the two runs
    assert report.aup == pytest.approx(1.0 * 52.0 + 0.5 * (3.0 - 1.0) * (50.0 * weight + 52.0))
    assert "from the baseline (TPF 1.00, 52.0 %) to this run)" in format_report(report)
    worse = _run({"tokens_per_forward": 1.0, "accuracy": 0.60})
    assert worse.aup == pytest.approx(60.0) and "only the baseline's point counts" in format_report(worse)


def test_no_graded_answers_no_aup():
    requests = [LoadRequest(prompt="a")]
    outcomes = [RequestOutcome(ok=True, status=200, latency=1.0, completion_tokens=5, text="x", nfe=5, steps=5,
                               blocks=1)]
    report = summarise("http://x", "m", requests, outcomes, duration=1.0, concurrency=1, request_rate=None)
    assert report.tokens_per_forward == 1.0 and report.aup is None
    assert "AUP                      n/a" in format_report(report)


def test_the_baseline_must_be_a_graded_report(tmp_path):
    good = tmp_path / "base.json"
    good.write_text(json.dumps({"tokens_per_forward": 0.9, "accuracy": 0.8, "model": "m"}))
    assert _aup_baseline(good) == {"tokens_per_forward": 0.9, "accuracy": 0.8}
    for body in ({"tokens_per_forward": 0.9, "accuracy": None}, {"accuracy": 0.8}, [1, 2]):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(body))
        with pytest.raises(ValueError, match="no tokens_per_forward and graded accuracy"):
            _aup_baseline(bad)
