"""`cai-dllm bench serve`: statistics on hand-built outcomes, and a real run against the server."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
from serverproc import REPO, running_server

from bench.load_generator import LoadRequest, RequestOutcome, file_workload, percentiles, summarise


def test_percentiles_interpolate_between_ranks():
    stats = percentiles([float(v) for v in range(1, 101)])
    assert stats["mean"] == 50.5 and stats["p50"] == pytest.approx(50.5) and stats["p99"] == pytest.approx(99.01)
    assert percentiles([]) == {}


def test_summary_counts_generated_tokens_of_successes_only():
    requests = [LoadRequest(prompt="a", answer="x"), LoadRequest(prompt="b", answer="y"), LoadRequest(prompt="c")]
    outcomes = [RequestOutcome(ok=True, status=200, ttft=0.1, latency=1.0, completion_tokens=10, text="x", nfe=5,
                               steps_saved=3, fixed_step_budget=8, joules=2.0),
                RequestOutcome(ok=True, status=200, ttft=0.2, latency=2.0, completion_tokens=30, text="z", nfe=15,
                               steps_saved=1, fixed_step_budget=8),
                RequestOutcome(ok=False, status=429, latency=0.01, completion_tokens=99)]
    report = summarise("http://x", "m", requests, outcomes, duration=4.0, concurrency=2, request_rate=None)
    assert report.completed == 2 and report.errors_by_status == {"429": 1}
    assert report.output_token_throughput == 10.0 and report.request_throughput == 0.5
    assert report.nfe_per_token == 0.5 and report.steps_saved_share == 0.25
    assert report.joules_per_token == 0.2  # only the metered request, over its own tokens
    assert report.accuracy == 0.5 and report.answered == 2


def test_file_workload_rejects_ambiguous_lines(tmp_path):
    good = tmp_path / "w.jsonl"
    good.write_text('{"prompt": "hi", "max_tokens": 32}\n\n{"messages": [{"role": "user", "content": "yo"}]}\n')
    assert [r.prompt for r in file_workload(good)] == ["hi", None]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi", "messages": []}\n')
    with pytest.raises(ValueError, match="exactly one"):
        file_workload(bad)


@pytest.mark.slow
def test_bench_serve_against_the_real_server(tmp_path):
    with running_server("--max-batch", "4") as (base, _):
        out = tmp_path / "load.json"
        run = subprocess.run([sys.executable, "-m", "server.cli", "bench", "serve", "--base-url", base,
                              "--num-requests", "12", "--concurrency", "4", "--decoding", '{"policy": "cai"}',
                              "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        assert "output token throughput" in run.stdout and "exact match" in run.stdout
        report = json.loads(out.read_text())
        assert report["completed"] == 12 and report["errors_by_status"] == {}
        assert report["ttft_s"]["p50"] <= report["e2e_latency_s"]["p50"]
        assert 0 < report["nfe_per_token"] and report["answered"] == 12
        assert all(o["text"] and o["completion_tokens"] > 0 for o in report["outcomes"])
        assert report["tokens_per_forward"] == pytest.approx(1 / report["nfe_per_token"])
        assert report["steps_per_block"] >= 1 and report["aup"] > 0 and "tokens per forward (TPF)" in run.stdout
        baseline, baseline_tpf = tmp_path / "baseline.json", report["tokens_per_forward"]
        baseline.write_text(out.read_text())
        refused = subprocess.run([sys.executable, "-m", "server.cli", "bench", "serve", "--base-url", base,
                                  "--num-requests", "3", "--concurrency", "2", "--decoding", '{"threshold": 7}',
                                  "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert refused.returncode == 1, refused.stderr
        report = json.loads(out.read_text())
        assert report["errors_by_status"] == {"400": 3}
        assert "threshold" in report["outcomes"][0]["error"]
        rate = subprocess.run([sys.executable, "-m", "server.cli", "bench", "serve", "--base-url", base,
                               "--num-requests", "6", "--request-rate", "20", "--max-tokens", "32",
                               "--aup-baseline", str(baseline)], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert rate.returncode == 0 and "request rate 20.0/s" in rate.stdout, rate.stderr
        assert f"from the baseline (TPF {baseline_tpf:.2f}" in rate.stdout


def test_bench_serve_says_when_the_server_cannot_be_reached():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once the socket is closed
    run = subprocess.run([sys.executable, "-m", "server.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
                          "--num-requests", "1", "--concurrency", "1"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and run.stderr.startswith("error: http://127.0.0.1:"), run.stderr
