"""The README's code and the docs' client examples, run as written, so they cannot drift.

Every ```bash and ```python block of README.md is run and what it prints checked, or skipped for a
reason listed here (a block in neither list fails the test); in docs/*.md, every block that talks to a local server
(`127.0.0.1:8000`) is run the same way. A server on the bundled model is started for them and the
blocks' `127.0.0.1:8000` point at it; `cai-dllm` is this checkout's command line. What the text
around a block says it prints is checked."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from serverproc import REPO, running_server

pytestmark = pytest.mark.slow
SUM = "7+8+0=15;5+3+1=09;4+0+0=04;0+0+0=00;0+0+0=00;=000495"
RUNNING = "a3=003,b5=008,c2=010,d1=011,e5=016,f3=019,g0=019"
# Blocks not run here, each with why: matched by a piece of their text.
SKIPPED = {
    "python3 -m venv .venv": "installs torch and the project: scripts/test.sh (CI) does exactly this",
    "bash scripts/test.sh": "it is the test suite itself",
    "docker compose": "needs docker; tests/operations/test_deploy_files.py validates the compose files",
    "--dataset prompts.jsonl": "needs the user's own prompts file; the load generator's tests run it",
    "lm_eval --model local-completions": "needs lm-evaluation-harness (the ops extra): "
                                         "tests/operations/test_lm_eval.py runs this task",
}
# What a block must print: a piece of its text -> strings its output holds.
EXPECTED = {
    "/v1/chat/completions": [SUM, RUNNING],
    "cai-dllm generate": [RUNNING, "=000068"],
    "cai-dllm eval": ["fixed+exit", "CAI full, gate on +exit", "| configuration"],
    "engine.add_request": ["stop 2 62", RUNNING, SUM, "log p(answer | question) ="],
    "from openai import OpenAI": [SUM, "'nfe'"],
}


def code_blocks(path: Path) -> list[tuple[str, int, str]]:
    """(language, line, text) of each fenced block."""
    text = path.read_text()
    return [(m.group(1), text[:m.start()].count("\n") + 1, m.group(2))
            for m in re.finditer(r"```(\w*)\n(.*?)```", text, re.S)]


def examples() -> list[tuple[str, str, str]]:
    """(id, language, code) of every block to run or skip."""
    found = [(f"README.md:{line}", lang, code) for lang, line, code in code_blocks(REPO / "README.md")
             if lang in ("bash", "python")]
    for doc in sorted((REPO / "docs").glob("*.md")):
        found += [(f"docs/{doc.name}:{line}", lang, code) for lang, line, code in code_blocks(doc)
                  if lang in ("bash", "python") and "127.0.0.1:8000" in code]
    return found


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with running_server() as (base, _):
        yield base


@pytest.fixture(scope="module")
def bin_dir(tmp_path_factory) -> Path:
    """A `cai-dllm` that runs this checkout's command line with this interpreter."""
    directory = tmp_path_factory.mktemp("bin")
    script = directory / "cai-dllm"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m server.cli "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return directory


def test_every_block_is_checked_or_says_why_not():
    """A block is skipped for a listed reason, or run with what it prints checked: a new block must
    be put in one list or the other."""
    for name, _, code in examples():
        skipped = any(piece in code for piece in SKIPPED)
        checked = any(piece in code for piece in EXPECTED)
        assert skipped != checked, f"{name}: add it to SKIPPED (with why) or EXPECTED (what it prints)"


@pytest.mark.parametrize("name,language,code", examples(), ids=[e[0] for e in examples()])
def test_example_runs_as_written(name, language, code, server, bin_dir):
    skip = next((why for piece, why in SKIPPED.items() if piece in code), None)
    if skip is not None:
        pytest.skip(skip)
    code = code.replace("http://127.0.0.1:8000", server)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    argv = ["bash", "-euo", "pipefail", "-c", code] if language == "bash" else [sys.executable, "-c", code]
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    for piece, wanted in EXPECTED.items():
        if piece in code:
            for text in wanted:
                assert text in done.stdout, f"{name}: {text!r} not in its output:\n{done.stdout[-3000:]}"


def test_the_cpu_install_line_is_the_dockerfiles():
    """README, scripts/test.sh and the Dockerfile's CPU image take torch from one index at one version."""
    dockerfile = (REPO / "Dockerfile").read_text()
    version = re.search(r"ARG TORCH_VERSION=(\S+)", dockerfile).group(1)
    index = re.search(r"--index-url (\S+) \"torch==\$\{TORCH_VERSION\}\"", dockerfile).group(1)
    readme = (REPO / "README.md").read_text()
    assert f"pip install torch=={version} --index-url {index}" in readme
    assert f"--index-url {index} torch=={version}" in (REPO / "scripts" / "test.sh").read_text()
