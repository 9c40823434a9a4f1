"""`cai-dllm serve -tp 2` on CPU (gloo, 2 ranks): the README's requests on the built-in models,
streaming, an abort mid-stream, likelihood scoring, SIGTERM with no process left; a worker killed or
hung fails /health and ends the server non-zero, with no process left. Processes are found through
/proc (the server's descendants), waits are bounded polls."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from serverproc import MODEL, REPO, metric, running_server

from engine import Engine, EngineConfig
from tinymodels.checker import is_correct

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds processes through /proc")]
ANSWER = "7+8+0=15;5+3+1=09;4+0+0=04;0+0+0=00;0+0+0=00;=000495"  # what llada-tiny answers (README)
CHAT = {"messages": [{"role": "user", "content": "00457+00038"}]}
SCORED = "00457+00038=000495"
# one token a step for thousands of steps: its first content delta comes within a block (32 steps),
# long before its end
LONG = {**CHAT, "max_tokens": 3968, "ignore_eos": True, "stream": True, "decoding": {"policy": "fixed", "steps": 3968}}


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _children(pid: int) -> dict[int, int]:
    """{pid: parent} of every process whose parent is `pid`."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # it exited while we looked
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            if parent == pid:
                found[int(entry.name)] = parent
    return found


def _descendants(pid: int) -> set[int]:
    found, frontier = set(), [pid]
    while frontier:
        children = set(_children(frontier.pop()))
        found |= children
        frontier.extend(children)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _workers(server: int) -> list[int]:
    """The server's tensor-parallel worker processes (multiprocessing's spawned interpreters)."""
    return [pid for pid in _descendants(server)
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def _running(base: str) -> float:
    return metric(httpx.get(f"{base}/metrics").text, "caidllm:num_requests_running")


def test_tp2_answers_the_readme_streams_aborts_scores_and_stops_with_no_process_left() -> None:
    with running_server("-tp", "2") as (base, proc):
        family = _descendants(proc.pid)
        [worker] = _workers(proc.pid)
        chat = httpx.post(f"{base}/v1/chat/completions", json={"model": "llada-tiny", **CHAT}, timeout=60)
        assert chat.json()["choices"][0]["message"]["content"] == ANSWER
        plain = httpx.post(f"{base}/v1/completions", json={"model": "llada-tiny",
                                                           "prompt": "sum a3 b5 c2 d1 e5 f3 g0"}, timeout=60)
        assert plain.json()["choices"][0]["text"] == "a3=003,b5=008,c2=010,d1=011,e5=016,f3=019,g0=019"
        with httpx.stream("POST", f"{base}/v1/chat/completions", json={**CHAT, "stream": True}, timeout=60) as r:
            chunks = [json.loads(line[len("data: "):]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == ANSWER
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=LONG, timeout=60) as r:
            next(line for line in r.iter_lines() if '"content"' in line)  # decoding: leave mid-stream
        _wait_for(lambda: _running(base) == 0, "the aborted row freed")
        scored = httpx.post(f"{base}/v1/completions", json={"prompt": SCORED, "max_tokens": 0, "echo": True,
                                                            "logprobs": 1, "seed": 3}, timeout=60).json()
        logprobs = scored["choices"][0]["logprobs"]["token_logprobs"]
        again = httpx.post(f"{base}/v1/chat/completions", json=CHAT, timeout=60)  # the ranks still in step
        assert again.json()["choices"][0]["message"]["content"] == ANSWER
        assert _alive(worker)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    _wait_for(lambda: not any(_alive(pid) for pid in family), "every process of the server gone", timeout=30)
    engine = Engine(EngineConfig(model=str(MODEL)))
    offline = engine.score(engine.tokenizer.encode(SCORED, add_special_tokens=False), seed=3)
    assert logprobs[0] is None and logprobs[1:] == pytest.approx(offline[1:], abs=1e-4)  # TP1's estimates


@pytest.mark.parametrize("model, stop", [("dream-tiny", signal.SIGTERM), ("sdar-tiny", signal.SIGKILL)],
                         ids=["dream-tiny-sigterm", "sdar-tiny-sigkill"])
def test_tp2_serves_the_other_built_in_models(model: str, stop: signal.Signals) -> None:
    """...and whether the server is stopped (SIGTERM) or killed (SIGKILL: its workers notice their
    parent is gone and exit), no process of it is left."""
    path = MODEL.parent / model
    if not (path / "model.safetensors").is_file():
        pytest.skip(f"{model} is not committed")
    with running_server("--model", str(path), "-tp", "2") as (base, proc):
        family = _descendants(proc.pid)
        assert _workers(proc.pid)
        answer = httpx.post(f"{base}/v1/chat/completions", json=CHAT, timeout=120).json()
        assert is_correct("00457+00038", answer["choices"][0]["message"]["content"]), answer
        proc.send_signal(stop)
        assert proc.wait(60) == (0 if stop == signal.SIGTERM else -signal.SIGKILL)
    _wait_for(lambda: not any(_alive(pid) for pid in family), "every process of the server gone", timeout=30)


def _fault_ends_the_server(hurt: Callable[[int], None], *flags: str, size: int = 2) -> str:
    """Serve at TP `size`, start a long stream, `hurt` the last worker: the stream ends with an error,
    /health fails saying why, the server exits non-zero and leaves no process. Returns its log."""
    with running_server("-tp", str(size), *flags) as (base, proc):
        family = _descendants(proc.pid)
        workers = _workers(proc.pid)
        assert len(workers) == size - 1
        worker = workers[-1]
        events: list[str] = []

        def stream() -> None:
            with httpx.stream("POST", f"{base}/v1/chat/completions", json=LONG, timeout=120) as r:
                events.extend(line for line in r.iter_lines() if line)

        client = threading.Thread(target=stream)
        client.start()
        _wait_for(lambda: any('"content"' in e for e in events), "the long request decoding")
        hurt(worker)
        health: list[httpx.Response] = []

        def failed() -> bool:
            try:
                health.append(httpx.get(f"{base}/health", timeout=2))
            except httpx.HTTPError:  # gone already: the exit below is what must hold then
                return proc.poll() is not None
            return health[-1].status_code == 503

        _wait_for(failed, "/health to fail", timeout=60)
        client.join(60)
        code = proc.wait(60)
        log = proc.stdout.read() if proc.stdout else ""
    assert code == 1, log
    answered = [r for r in health if r.status_code == 503]
    assert answered and answered[-1].json()["error"]["code"] == "engine_dead", [r.text for r in health]
    assert events[-1] == "data: [DONE]" and json.loads(events[-2][len("data: "):])["error"]["code"] == "engine_dead"
    _wait_for(lambda: not any(_alive(pid) for pid in family), "every process of the server gone", timeout=30)
    return log


def test_a_killed_worker_fails_health_and_ends_the_server_nonzero() -> None:
    log = _fault_ends_the_server(lambda pid: os.kill(pid, signal.SIGKILL))
    assert "error: the engine failed: tensor-parallel worker rank 1" in log and "exited with code -9" in log


def test_a_killed_worker_of_four_ranks_fails_health_and_ends_the_server_nonzero() -> None:
    log = _fault_ends_the_server(lambda pid: os.kill(pid, signal.SIGKILL), size=4)
    assert "error: the engine failed: tensor-parallel worker rank" in log and "exited with code -9" in log


def test_a_hung_worker_fails_health_and_ends_the_server_nonzero() -> None:
    log = _fault_ends_the_server(lambda pid: os.kill(pid, signal.SIGSTOP), "--distributed-timeout", "5")
    assert "error: the engine failed:" in log
    assert "has not answered" in log or "Timed out" in log or "timed out" in log, log


def test_generate_at_tp2_prints_tp1_tokens() -> None:
    command = [sys.executable, "-m", "server.cli", "generate", "--model", str(MODEL), "--chat", "--prompt",
               "00457+00038", "--json"]
    runs = [subprocess.run([*command, *extra], capture_output=True, text=True, timeout=300, cwd=REPO)
            for extra in ([], ["-tp", "2"])]
    assert all(run.returncode == 0 for run in runs), [run.stderr for run in runs]
    one, two = (json.loads(run.stdout) for run in runs)
    assert two["generated_ids"] == one["generated_ids"] and two["text"] == ANSWER


def test_the_flag_reaches_the_engine_config_on_every_command() -> None:
    from server.cli import build_parser
    from server.settings import load_settings, setting_names

    parser = build_parser()
    args = parser.parse_args(["serve", "-tp", "2", "--distributed-timeout", "30"])
    settings = load_settings({name: getattr(args, name, None) for name in setting_names()}, environ={})
    assert (settings.engine.tensor_parallel_size, settings.engine.distributed_timeout) == (2, 30.0)
    assert load_settings({}, environ={"CAI_DLLM_TENSOR_PARALLEL_SIZE": "4"}).engine.tensor_parallel_size == 4
    for command in (["generate", "--model", "m", "--prompt", "x"], ["eval", "--model", "m"],
                    ["score", "--model", "m", "--context", "c", "--continuation", "x"], ["calibrate", "--model", "m"]):
        assert parser.parse_args([*command, "--tensor-parallel-size", "2"]).tensor_parallel_size == 2
        assert parser.parse_args(command).tensor_parallel_size == 1
    with pytest.raises(ValueError, match="cuda_graphs is not available with tensor_parallel_size > 1"):
        EngineConfig(model="m", device="cuda", cuda_graphs=True, tensor_parallel_size=2)
