"""`cai-dllm inspect` run as a user runs it: the installed console script, in a subprocess."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def _cli() -> list[str]:
    script = shutil.which("cai-dllm", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-m", "server.cli"]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*_cli(), *args], capture_output=True, text=True, timeout=120)


def test_inspect_tiny_checkpoint(fixtures):
    out = _run("inspect", str(fixtures / "llada_tiny"))
    assert out.returncode == 0, out.stderr
    assert "LLaDA" in out.stdout and "float32" in out.stdout and "'mask': 250" in out.stdout


def test_inspect_json_on_real_metadata(fixtures):
    out = _run("inspect", "--json", str(fixtures / "real" / "dream-v0-instruct-7b"))
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["architecture"] == "Dream"
    assert report["parameters"] == 7_615_616_512
    assert report["special_ids"] == {"mask": 151666, "eos": [151643], "eot": 151645, "pad": 151643,
                                     "bos": 151643}
    assert report["chat_template"] is True
    assert report["dtype"] == "bfloat16"
    assert report["weights"]["status"].startswith("not loadable")  # the index has no shard files here


@pytest.mark.parametrize("target", ["missing-dir", "file"])
def test_inspect_bad_path_is_a_clear_error(tmp_path, target):
    path = tmp_path / "x"
    if target == "file":
        path.write_text("")
    out = _run("inspect", str(path))
    assert out.returncode == 2
    assert "error:" in out.stderr and "Traceback" not in out.stderr
