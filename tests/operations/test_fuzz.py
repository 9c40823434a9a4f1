"""schemathesis against the server's own OpenAPI document, in two passes on one server:

1. every check but positive_data_acceptance, valid and invalid bodies (at least 1,000 cases across
   all endpoints): no 5xx, every response as documented, every invalid body refused;
2. schema-valid bodies only, with our check in tests/fuzz_hooks.py: each is answered, or refused with
   the code of one of the rules a schema cannot state (the context length, the rules between
   decoding knobs, n x prompts: server.serving_base.CROSS_FIELD_CODES). Model-dependent bounds (the
   model's name, token ids, max_tokens, n, logprobs) are in the document itself."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from ops_tools import require_tool
from serverproc import REPO, running_server

pytestmark = pytest.mark.slow
MIN_CASES = 1000
OPERATIONS = 11


def _schemathesis(schemathesis: str, base: str, report: Path, *options: str, env: dict[str, str]) -> dict:
    run = subprocess.run([schemathesis, "run", f"{base}/openapi.json", *options, "--seed", "20261123",
                          "--continue-on-failure", "--request-timeout", "60", "--report", "json",
                          "--report-json-path", str(report), "--no-color", "--output-sanitize", "false"],
                         cwd=report.parent, env=env, capture_output=True, text=True, timeout=1500)
    summary = json.loads(report.read_text())
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]
    assert not summary["failures"] and not summary["errors"], (summary["failures"], summary["errors"])
    operations = summary["operations"]
    assert operations["tested"] == operations["total"] == OPERATIONS, operations
    return summary


def test_schemathesis_finds_no_server_error_and_no_schema_disagreement(tmp_path):
    schemathesis = require_tool("schemathesis")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]),
           "SCHEMATHESIS_HOOKS": "fuzz_hooks"}
    # A short context keeps generated canvases small, so the cases run in minutes on a CPU.
    with running_server("--max-model-len", "96", "--max-n", "2", "--max-queue", "256",
                        "--default-decoding", '{"policy": "threshold", "block_length": 32}') as (base, proc):
        every = _schemathesis(schemathesis, base, tmp_path / "all.json", "--checks", "all", "--exclude-checks",
                              "positive_data_acceptance,accepted_unless_a_documented_rule_refuses", "--mode", "all",
                              "--max-examples", "400", env=env)
        valid = _schemathesis(schemathesis, base, tmp_path / "valid.json", "--checks",
                              "accepted_unless_a_documented_rule_refuses,not_a_server_error", "--mode", "positive",
                              "--max-examples", "200", env=env)
        assert proc.poll() is None, "the server died under fuzzing"
    cases = every["test_cases"]["generated"]
    assert cases >= MIN_CASES, f"only {cases} cases generated"
    print(f"\n[ops-proof] fuzzing: {cases} cases over {OPERATIONS} operations, then "
          f"{valid['test_cases']['generated']} schema-valid ones: 0 failures, 0 errors")
