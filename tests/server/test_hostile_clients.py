"""What third-party clients and hostile inputs found, on a real server: a body cut short by its
client, a number JSON reads but Python will not convert, token ids past the tokenizer's vocabulary.
None of them may be a 500 or leave a traceback."""

from __future__ import annotations

import json
import signal
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlparse

import httpx
import pytest
from serverproc import MODEL, metric, running_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, object]]:
    with running_server("--log-level", "info") as (base, proc):
        yield base, proc


def _metrics(base: str) -> str:
    return httpx.get(f"{base}/metrics").text


def _wait_for(condition, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_body_cut_short_is_a_disconnect_and_a_huge_integer_is_a_400(server):
    base, _ = server
    url = urlparse(base)
    errors_before = metric(_metrics(base), "caidllm:request_errors_total")
    with socket.create_connection((url.hostname, url.port)) as sock:  # promises 200 bytes, sends 12, leaves
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 200\r\n\r\n{\"prompt\": \"")
    _wait_for(lambda: metric(_metrics(base), "caidllm:client_disconnects_total") == 1, "the disconnect counted")
    digits = "9" * 5000
    response = httpx.post(f"{base}/v1/completions", content=f'{{"prompt": "1+1", "max_tokens": {digits}}}',
                          headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_json" and "digits" in error["message"]
    text = _metrics(base)
    assert metric(text, 'caidllm:request_errors_total{model_name="llada-tiny",status="500"}') == 0
    assert metric(text, "caidllm:request_errors_total") == errors_before + 1  # the 400 only


def test_prompt_ids_beyond_the_tokenizer_vocabulary_are_refused(server):
    base, _ = server
    tokenizer_size = len(json.loads((MODEL / "tokenizer.json").read_text())["model"]["vocab"])
    embedding_rows = json.loads((MODEL / "config.json").read_text())["embedding_size"]
    assert tokenizer_size < embedding_rows  # the padding rows that no text encodes to
    ok = httpx.post(f"{base}/v1/completions", json={"prompt": [tokenizer_size - 1, 5], "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200, ok.text
    for body in ({"prompt": [5, tokenizer_size], "max_tokens": 4},
                 {"prompt": [5, embedding_rows - 1], "max_tokens": 0, "echo": True, "logprobs": 1}):
        response = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "prompt" and f"[0, {tokenizer_size})" in error["message"]
    detok = httpx.post(f"{base}/detokenize", json={"tokens": [tokenizer_size]}, timeout=30)
    assert detok.status_code == 400 and detok.json()["error"]["param"] == "tokens"


def test_no_traceback_in_the_log(server):
    _, proc = server
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    log = proc.stdout.read()
    assert "Traceback" not in log and "client disconnected" in log
