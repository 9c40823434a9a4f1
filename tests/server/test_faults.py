"""Faults on a real server process: clients that leave, SIGTERM with work in flight, a model that
does not load, a port that cannot be had, Ctrl-C in `cai-dllm eval`. Waits are events or bounded
polling, never fixed sleeps."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from serverproc import MODEL, REPO, free_port, metric, running_server

pytestmark = pytest.mark.slow
# a request that keeps its row for many steps (one token a step over the whole canvas), whatever the
# model answers; the chat stream's first chunk (the role) is sent before any decoding
LONG = {"prompt": "<|user|>00457+00038<|assistant|>", "max_tokens": 512, "ignore_eos": True,
        "decoding": {"policy": "fixed", "steps": 512}}
LONG_CHAT = {**{k: v for k, v in LONG.items() if k != "prompt"},
             "messages": [{"role": "user", "content": "00457+00038"}]}


def _wait_for(condition, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _running(base: str) -> float:
    return metric(httpx.get(f"{base}/metrics").text, "caidllm:num_requests_running")


def test_clients_that_leave_are_disconnects_not_errors():
    with running_server("--log-level", "info") as (base, proc):
        with pytest.raises(httpx.ReadTimeout):  # a whole response's client gives up
            httpx.post(f"{base}/v1/completions", json=LONG, timeout=1.0)
        with httpx.stream("POST", f"{base}/v1/chat/completions", json={**LONG_CHAT, "stream": True},
                          timeout=60) as r:
            next(line for line in r.iter_lines() if line)  # a stream's client reads a chunk and leaves
        _wait_for(lambda: metric(httpx.get(f"{base}/metrics").text, "caidllm:client_disconnects_total") == 2,
                  "two disconnects counted")
        _wait_for(lambda: _running(base) == 0, "the rows freed")
        text = httpx.get(f"{base}/metrics").text
        assert metric(text, "caidllm:request_errors_total") == 0
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        log = proc.stdout.read()
    assert "Traceback" not in log and log.count("client disconnected") == 2


def test_sigterm_past_the_shutdown_timeout_answers_every_request_in_flight():
    with running_server("--shutdown-timeout", "1") as (base, proc):
        answers: dict[str, object] = {}

        def whole() -> None:
            r = httpx.post(f"{base}/v1/completions", json=LONG, timeout=60)
            answers["whole"] = (r.status_code, r.json())

        def stream() -> None:
            with httpx.stream("POST", f"{base}/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
                answers["stream"] = [line for line in r.iter_lines() if line]

        clients = [threading.Thread(target=whole), threading.Thread(target=stream)]
        for client in clients:
            client.start()
        _wait_for(lambda: _running(base) == 2, "both requests decoding")
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for client in clients:
            client.join(60)
        code = proc.wait(60)
        took = time.monotonic() - sent
    assert code == 0 and took < 1 + 15, took  # the timeout, then a few seconds to answer and close
    status, body = answers["whole"]
    assert status == 503 and body["error"]["code"] == "shutting_down"
    events = answers["stream"]
    assert events[-1] == "data: [DONE]" and json.loads(events[-2][len("data: "):])["error"]["code"] == "shutting_down"


def _serve(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server.cli", "serve", *flags], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_a_model_that_fails_to_load_ends_the_process_with_the_reason():
    out = _serve("--model", "/no/such/model", "--port", str(free_port()))
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[-1].startswith("error: the model failed to load: CheckpointError: "
                                                          "checkpoint directory /no/such/model does not exist")
    assert "loading /no/such/model on cpu" in out.stderr


def test_a_setting_the_model_refuses_is_named_not_called_a_failed_load():
    out = _serve("--model", "dream-tiny", "--enable-prefix-caching", "--port", str(free_port()))
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the setting --enable-prefix-caching: ") and "failed to load" not in last


def test_a_port_that_cannot_be_had_is_one_line():
    out = _serve("--port", "99999")
    assert out.returncode == 2 and out.stderr == "error: port must be an integer from 0 to 65535, got 99999\n"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _serve("--port", str(port))
    assert out.returncode == 1 and out.stderr == f"error: cannot listen on 127.0.0.1:{port}: Address already in use\n"


def test_start_up_says_loading_and_ready():
    with running_server("--log-level", "info") as (_, proc):
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        log = proc.stdout.read()
    assert f"loading {MODEL} on cpu (float32), quantization none" in log and "ready in " in log


def test_ctrl_c_in_eval_is_a_line_not_a_traceback():
    # SIGINT at its default in the child: a test run started in the background of a non-interactive
    # shell ignores it, and a process that inherits an ignored SIGINT rightly keeps ignoring it.
    # faulthandler on: a process that outlives its Ctrl-C is sent SIGABRT and prints where its threads are
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "eval", "--model", str(MODEL), "--n", "400"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONFAULTHANDLER": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen: list[bytes] = []

    def read() -> None:  # the bar redraws with carriage returns, not lines: read what comes
        while chunk := os.read(proc.stderr.fileno(), 4096):
            seen.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    _wait_for(lambda: b"problem" in b"".join(seen), "the progress bar", timeout=120)
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        proc.wait(30)
        reader.join(10)
        pytest.fail("eval still ran 60 s after Ctrl-C; its threads:\n" + b"".join(seen).decode()[-6000:])
    reader.join(10)
    errors = b"".join(seen).decode()
    assert code == 130 and "interrupted" in errors and "Traceback" not in errors
