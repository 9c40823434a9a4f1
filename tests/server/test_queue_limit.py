"""--max-queue on a real server: it bounds the requests that wait for a row, not those the next step
admits into free rows, and a request's choices are admitted or refused together."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serverproc import metric, running_server

pytestmark = pytest.mark.slow
SHORT = {"prompt": "<|user|>00457+00038<|assistant|>", "max_tokens": 8}
# keeps its rows for many steps (one token a step over the whole canvas), whatever the model answers
LONG = {"prompt": "<|user|>00457+00038<|assistant|>", "max_tokens": 512, "ignore_eos": True,
        "decoding": {"policy": "fixed", "steps": 512}}


def test_n_choices_that_fit_the_free_rows_are_not_queued():
    with running_server("--max-queue", "4") as (base, _):  # 8 rows, all free
        response = httpx.post(f"{base}/v1/completions", json={**SHORT, "n": 5}, timeout=60)
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"]) == 5


def test_bursts_into_free_rows_are_taken_and_a_full_queue_still_refuses():
    with running_server("--max-batch", "4", "--max-queue", "1") as (base, _):
        with ThreadPoolExecutor(2) as pool:
            for _ in range(10):
                burst = [pool.submit(httpx.post, f"{base}/v1/completions", json=SHORT, timeout=60) for _ in range(2)]
                assert [f.result().status_code for f in burst] == [200, 200]

        clients: list[threading.Thread] = []

        def hold(n: int) -> None:  # whole requests that keep their rows; ended with the server
            thread = threading.Thread(target=lambda: _post_quietly(base, {**LONG, "n": n}), daemon=True)
            thread.start()
            clients.append(thread)

        hold(4)  # every row taken
        deadline = time.monotonic() + 60
        while metric(httpx.get(f"{base}/metrics").text, "caidllm:num_requests_running") < 4:
            assert time.monotonic() < deadline, "the four rows were not taken"
            time.sleep(0.05)
        refused = httpx.post(f"{base}/v1/completions", json={**SHORT, "n": 2}, timeout=60)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
        assert refused.headers["Retry-After"].isdigit()
        hold(1)  # the one request the queue may hold
        while metric(httpx.get(f"{base}/metrics").text, "caidllm:num_requests_waiting") < 1:
            assert time.monotonic() < deadline, "the fifth request did not queue"
            time.sleep(0.05)
        assert httpx.post(f"{base}/v1/completions", json=SHORT, timeout=60).status_code == 429


def _post_quietly(base: str, body: dict) -> None:
    try:
        httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    except httpx.HTTPError:  # the server is stopped under it at the end of the test
        pass
