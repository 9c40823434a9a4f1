"""A likelihood-scoring request of the largest size the server allows, on a real server: it runs in
chunks between decode steps, so an ordinary request sent meanwhile is answered at once, /health
stays 200 although the scoring takes longer than the stall timeout, its cost shows in /metrics, and
its numbers are Engine.score's."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch
from serverproc import MODEL, metric, running_server

from engine import Engine, EngineConfig
from engine.scoring import scoring_cost

pytestmark = pytest.mark.slow
STALL_TIMEOUT = 2.0
PROMPT = ("00457+00038=000495;" * 8)[:100]  # 100 tokens of the character tokenizer
SAMPLES = 16
COST = scoring_cost(len(PROMPT), SAMPLES)  # 158,400 tokens: several stall timeouts on a 2-core CPU
ORDINARY = {"messages": [{"role": "user", "content": "00457+00038"}], "max_tokens": 64}


def test_the_largest_scoring_request_does_not_hold_decoding_or_fail_health():
    # one thread: a shared CI machine's cores are not slowed tenfold by threads waiting on each other
    flags = ("--stall-timeout", str(STALL_TIMEOUT), "--max-score-tokens", str(COST), "--threads", "1")
    with running_server(*flags) as (base, _):
        scoring = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1, "seed": 3,
                   "decoding": {"score_samples": SAMPLES}}
        too_large = httpx.post(f"{base}/v1/completions", json={**scoring, "prompt": PROMPT + "0"}, timeout=30)
        assert too_large.status_code == 400 and too_large.json()["error"]["code"] == "scoring_too_large"
        answer: dict[str, object] = {}

        def score() -> None:
            started = time.monotonic()
            answer["response"] = httpx.post(f"{base}/v1/completions", json=scoring, timeout=600)
            answer["seconds"] = time.monotonic() - started

        client = threading.Thread(target=score)
        client.start()
        deadline = time.monotonic() + 60
        while metric(httpx.get(f"{base}/metrics").text, "caidllm:scoring_tokens_total") == 0:  # it has begun
            assert time.monotonic() < deadline, "the scoring request did not start"
            time.sleep(0.02)
        started = time.monotonic()
        ordinary = httpx.post(f"{base}/v1/chat/completions", json=ORDINARY, timeout=60)
        ordinary_seconds = time.monotonic() - started
        assert ordinary.status_code == 200 and ordinary.json()["choices"][0]["message"]["content"]
        healths = []
        while client.is_alive():
            healths.append(httpx.get(f"{base}/health", timeout=10).status_code)
            client.join(0.2)
        text = httpx.get(f"{base}/metrics").text

    response = answer["response"]
    assert response.status_code == 200, response.text
    assert answer["seconds"] > 1.5 * STALL_TIMEOUT  # long enough that a job run in one piece fails /health
    assert ordinary_seconds < 2.0, ordinary_seconds
    assert healths and set(healths) == {200}, healths
    assert metric(text, "caidllm:scoring_tokens_total") == COST
    chunks = metric(text, "caidllm:scoring_chunk_seconds_count")
    assert chunks > 1 and metric(text, "caidllm:scoring_chunk_seconds_sum") / chunks < STALL_TIMEOUT
    assert metric(text, "caidllm:num_scoring_requests") == 0
    values = response.json()["choices"][0]["logprobs"]["token_logprobs"]
    threads = torch.get_num_threads()
    try:  # the server's thread count: float sums split over other threads round differently
        engine = Engine(EngineConfig(model=str(MODEL), max_score_tokens=COST, threads=1))
        offline = engine.score(engine.tokenizer.encode(PROMPT, add_special_tokens=False), SAMPLES, seed=3)
    finally:
        torch.set_num_threads(threads)
    assert values == json.loads(json.dumps(offline))  # the offline numbers, exactly
