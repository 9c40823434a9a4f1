"""schemathesis against the server's own OpenAPI document: at least 1,000 generated cases across all
endpoints (valid and invalid bodies), no 5xx, every response matching the documented schema."""

from __future__ import annotations

import json
import subprocess

import pytest
from ops_tools import require_tool
from serverproc import running_server

pytestmark = pytest.mark.slow
MIN_CASES = 1000


def test_schemathesis_finds_no_server_error_and_no_schema_violation(tmp_path):
    schemathesis = require_tool("schemathesis")
    # A short context keeps generated canvases small, so a thousand cases run in minutes on a CPU.
    # positive_data_acceptance is left out: a schema-valid body may still ask for more than the context
    # holds (prompt + max_tokens), which is a 400 `context_length_exceeded` by design, as with OpenAI;
    # the context check itself is tested in test_server_e2e/test_server_app.
    with running_server("--max-model-len", "96", "--max-n", "2", "--max-queue", "256",
                        "--default-decoding", '{"policy": "threshold", "block_length": 32}') as (base, proc):
        report = tmp_path / "report.json"
        run = subprocess.run([schemathesis, "run", f"{base}/openapi.json", "--checks", "all",
                              "--exclude-checks", "positive_data_acceptance", "--mode", "all",
                              "--max-examples", "400", "--seed", "20261122", "--continue-on-failure",
                              "--request-timeout", "60", "--report", "json", "--report-json-path", str(report),
                              "--no-color"], cwd=tmp_path, capture_output=True, text=True, timeout=1500)
        output = run.stdout + run.stderr
        assert proc.poll() is None, "the server died under fuzzing"
    summary = json.loads(report.read_text())
    assert run.returncode == 0, output[-6000:]
    cases = summary["test_cases"]["generated"]
    assert not summary["failures"] and not summary["errors"], (summary["failures"], summary["errors"])
    assert cases >= MIN_CASES, f"only {cases} cases generated"
    operations = summary["operations"]
    assert operations["tested"] == operations["total"] == 7, operations
    print(f"\n[ops-proof] fuzzing: {cases} cases over {operations['tested']} operations, 0 failures, 0 errors")
