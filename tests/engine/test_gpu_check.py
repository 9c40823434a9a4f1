"""bench/gpu_check.sh's CPU dry run: the check a lent GPU runs first, on tiny shapes with
--device cpu (the CUDA tests check the CPU against itself), so that it cannot rot between loans:
every phase runs, the output is what the device tool brings back, the summary fits a screen."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = {"gpu_check.log", "results.json", "summary.txt", "cuda_tests.xml", "gpu_step.txt", "gpu_check_offline.txt"}
# the device tool brings back at most 8 files from $OUT, each named in letters, digits, '.', '_' and '-'
TOOL_FILES, TOOL_NAME = 8, re.compile(r"^[A-Za-z0-9._-]+$")
SCREEN_LINES = 60


@pytest.mark.slow
def test_the_gpu_check_runs_every_phase_on_cpu(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable}
    run = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), str(out), "--device", "cpu"], env=env,
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    written = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert written == FILES
    assert len(written) <= TOOL_FILES and all(TOOL_NAME.match(name) for name in written)

    results = json.loads((out / "results.json").read_text())
    assert results["verdict"] == "every phase passed"
    phases = results["phases"]
    tests = phases["tests"]["tests"]
    functions = {t["id"].split("::")[-1].split("[")[0] for t in tests}
    assert {"test_float32_on_the_device_answers_as_on_the_cpu", "test_one_host_read_per_step_on_the_device",
            "test_a_quantized_model_answers_on_the_device_as_on_the_cpu",
            "test_cuda_graphs_give_the_tokens_eager_steps_give"} <= functions
    assert all(t["outcome"] in ("passed", "skipped") for t in tests), [t for t in tests if t["outcome"] != "passed"]
    assert all(t["message"] for t in tests if t["outcome"] == "skipped"), "a skip says why"
    assert any(t["outcome"] == "passed" and t["properties"] for t in tests), "tests record what they measured"

    step = phases["step"]["table"]
    assert {row["model"] for row in step} == {"llada", "sdar", "llada2", "dg"}
    assert all(row["step_ms"] > 0 and row["floor_ms"] > 0 for row in step)
    offline = phases["offline"]["rows"]
    assert [(row["batch"], row["graphs"]) for row in offline] == [(1, False), (2, False)]
    assert all(row["generated_tokens"] == 16 * row["batch"] and row["tokens_per_s"] > 0 for row in offline)

    summary = (out / "summary.txt").read_text()
    assert run.stdout.rstrip().endswith(summary.rstrip()), "the summary is printed last"
    assert len(summary.splitlines()) <= SCREEN_LINES
    assert summary.rstrip().endswith("verdict: every phase passed")


def _load_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


HUNG_PHASE = """
import signal, subprocess, sys, time
signal.signal(signal.SIGINT, lambda *_: (print(": interrupted, report written", flush=True), sys.exit(2)))
print("started", flush=True)
sys.stdout.write("half a line")
sys.stdout.flush()
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stderr=subprocess.DEVNULL)
time.sleep(60)
"""


def test_a_phase_past_its_budget_is_stopped_and_keeps_its_output(tmp_path):
    """A hung phase costs its budget, not the lease: it is interrupted (with what it started), so that
    pytest can still write its report, and says so; a line it never finished does not hold it up."""
    check = _load_check().Check(tmp_path, "cpu", total_budget_s=60)
    result, text = check.run("offline", [sys.executable, "-c", HUNG_PHASE], {}, budget_s=10)
    assert result.status.startswith("timed out after") and result.seconds < 40
    assert text.startswith("started\nhalf a line") and ": interrupted, report written\n" in text
    check.log.close()
    assert "timed out" in (tmp_path / "gpu_check.log").read_text()
