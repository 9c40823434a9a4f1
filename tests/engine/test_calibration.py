"""`cai-dllm calibrate`: items and graders, the built-in items (never the held-out split), and a
small run end to end whose profile a server then serves."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from serverproc import REPO

import tinymodels.tasks as tasks
from calibration.data import CalibrationDataError, builtin_items, data_sha256, load_items, make_grader
from engine.decoding.profiles import load_profile, profile_table

MODEL = REPO / "models" / "llada-tiny"


def test_items_file_and_its_errors(tmp_path):
    path = tmp_path / "items.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"messages": [{"role": "user", "content": "hi"}], '
                    '"answer": "x"}\n')
    items = load_items(path)
    assert [i.answer for i in items] == ["2", "x"] and len(load_items(path, n=1)) == 1
    for bad, says in [('{"prompt": "a"}', "string 'answer'"), ("nope", "not valid JSON"),
                      ('{"prompt": "a", "messages": [], "answer": "b"}', "exactly one of"), ("", "no items")]:
        path.write_text(bad + "\n")
        with pytest.raises(CalibrationDataError, match=says):
            load_items(path)


def test_graders():
    item = {"answer": "42", "problem": "00040+00002"}
    assert make_grader("exact")(" 42\n", item) and not make_grader("exact")("41", item)
    assert make_grader(r"regex:=(\d+)$")("x=42", item) and not make_grader(r"regex:=(\d+)$")("x=43", item)
    assert make_grader(r"regex:\d+")("so 42", item)
    assert make_grader("grader_example:last_value")("a=42", item)
    assert make_grader("builtin")("0+2+0=02;=000042", item)
    for spec in ("regex:(", "no_such_module:f", "grader_example:missing", "justaword"):
        with pytest.raises(CalibrationDataError):
            make_grader(spec)


def test_builtin_items_come_from_the_validation_split_only(monkeypatch):
    asked: list[str] = []
    real = tasks.problems

    def spy(seed, split, mix=None):
        asked.append(split)
        return real(seed, split, mix)

    monkeypatch.setattr(tasks, "problems", spy)
    items = builtin_items(200, seed=3)
    assert asked and set(asked) == {"validation"}
    stream = real(0, "eval")
    held_out = {next(stream).prompt for _ in range(3000)}
    assert not {i.data["problem"] for i in items} & held_out
    assert all(tasks.split_of(*_kind_and_key(i.data["problem"])) == "validation" for i in items)
    assert data_sha256(items, "builtin") == data_sha256(builtin_items(200, seed=3), "builtin")
    assert data_sha256(items, "builtin") != data_sha256(items[:-1], "builtin")


def _kind_and_key(prompt: str) -> tuple[str, str]:
    if prompt.startswith("sum "):
        return "running", "".join(term[1] for term in prompt.split()[1:])
    sign = "+" if "+" in prompt else "-"
    a, b = prompt.split(sign)
    return ("add" if sign == "+" else "sub"), f"{int(a)}{sign}{int(b)}"


@pytest.mark.slow
def test_calibrate_end_to_end_writes_a_profile_the_server_loads(tmp_path):
    out = tmp_path / "profile.json"
    cmd = [sys.executable, "-m", "server.cli", "calibrate", "--model", str(MODEL), "--n", "6", "--tolerance", "1",
           "--theta-s-grid", "0.9", "--theta-e-grid", "0.7", "--batch-size", "32", "--name", "mine",
           "--out", str(out)]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "PYTHONPATH": str(REPO / "tests")})
    assert run.returncode == 0, run.stderr
    assert "fixed decoder:" in run.stdout and "chosen:" in run.stdout
    profile = load_profile(out)
    assert profile.name == "mine" and profile.decoding["policy"] == "cai"
    validation = profile.validation
    assert validation["items"] == 6 and validation["grader"] == "builtin" and validation["feasible"]
    assert validation["data_sha256"] == data_sha256(builtin_items(6), "builtin")
    assert validation["reference"]["decoding"]["policy"] == "fixed"
    assert len(validation["trials"]) >= 9
    assert "mine" in profile_table([profile])


def test_calibrate_refuses_bad_input_in_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": 3}\n')
    for extra, says in [(["--data", str(bad)], "needs a string 'answer'"),
                        (["--grader", "regex:("], "bad regular expression")]:
        run = subprocess.run([sys.executable, "-m", "server.cli", "calibrate", "--model", str(MODEL), *extra],
                             cwd=REPO, capture_output=True, text=True, timeout=300)
        assert run.returncode == 2 and says in run.stderr and len(run.stderr.strip().splitlines()) == 1
