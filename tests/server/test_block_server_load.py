"""A block-diffusion model (SDAR) under load on the real server: concurrent requests of different
block lengths batched and answered as alone, /metrics counters moving with what was served, a
client that leaves mid-stream costing nobody else their answer; and a random LLaDA2 MoE checkpoint
served too. Waits are bounded polling, never fixed sleeps."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
from blockcheckpoints import SDAR_BLOCK, Oracle
from serverproc import metric, running_server

pytestmark = pytest.mark.slow
MODEL = "sdar-random"
PROMPTS = ["hello", "sum a1 b2", "abc", "x", "1+1", "Once upon", "what is up", "00457+00038"]
KNOBS = [{"block_length": 4}, {"block_length": 8, "policy": "block-dynamic", "threshold": 0.5},
         {"block_length": 16, "policy": "block-static"}, {"policy": "cai", "store_pass": True}]


@pytest.fixture(scope="module")
def server(sdar_dir) -> Iterator[str]:
    with running_server("--model", str(sdar_dir), "--max-batch", "8") as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _metric(base: str, name: str) -> float:
    return metric(httpx.get(f"{base}/metrics").text, name)


def test_concurrent_block_lengths_batch_and_match_alone(server, client, sdar_dir):
    oracle = Oracle(sdar_dir, SDAR_BLOCK)

    async def one(async_client: openai.AsyncOpenAI, i: int) -> str:
        out = await async_client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=32,
                                                    extra_body={"decoding": KNOBS[i % len(KNOBS)]})
        return out.choices[0].text

    async def all_at_once() -> list[str]:
        async_client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
        return await asyncio.gather(*(one(async_client, i) for i in range(len(PROMPTS))))

    before = httpx.get(f"{server}/metrics").text
    together = asyncio.run(all_at_once())
    alone = [oracle.answer(p, 32, **KNOBS[i % len(KNOBS)]).text for i, p in enumerate(PROMPTS)]
    assert together == alone
    after = httpx.get(f"{server}/metrics").text

    def bucket(text: str, le: str) -> float:
        line = next(x for x in text.splitlines() if x.startswith(f'caidllm:batch_size_bucket{{le="{le}"'))
        return float(line.split()[-1])

    # some steps ran more than one row, rows of different block lengths among them
    ran_one = bucket(after, "1.0") - bucket(before, "1.0")
    ran_any = bucket(after, "+Inf") - bucket(before, "+Inf")
    assert ran_any > ran_one


def test_metrics_move_with_what_was_served(server, client):
    before = httpx.get(f"{server}/metrics").text
    outs = [client.completions.create(model=MODEL, prompt=p, max_tokens=20, extra_body={"decoding": {"policy": "cai"}})
            for p in PROMPTS[:3]]
    after = httpx.get(f"{server}/metrics").text

    def moved(name: str) -> float:
        return metric(after, name) - metric(before, name)

    assert moved("caidllm:request_success_total") == 3
    assert moved("caidllm:generation_tokens_total") == sum(o.usage.completion_tokens for o in outs)
    assert moved("caidllm:prompt_tokens_total") == sum(o.usage.prompt_tokens for o in outs)
    assert moved("caidllm:request_nfe_sum") == sum(o.choices[0].model_extra["decoding"]["nfe"] for o in outs)
    assert moved("caidllm:steps_saved_total") == sum(o.choices[0].model_extra["decoding"]["steps_saved"]
                                                      for o in outs)
    for name in ("caidllm:e2e_request_latency_seconds_count", "caidllm:time_to_first_token_seconds_count",
                 "caidllm:decode_steps_total", "caidllm:batch_size_count"):
        assert moved(name) > 0, name
    assert 'model_name="sdar-random"' in after and metric(after, "caidllm:request_errors_total") == 0


def test_a_client_leaving_mid_stream_loses_no_other_request(server, sdar_dir):
    oracle = Oracle(sdar_dir, SDAR_BLOCK)
    staying_knobs = {"policy": "block-static", "steps": 128}  # one token a step: it is still decoding when ...
    want = oracle.answer("abc", 128, ignore_eos=True, **staying_knobs)
    disconnects = _metric(server, "caidllm:client_disconnects_total")
    # one token a step over many blocks: the row decodes far longer than the test takes
    leaving = {"prompt": "hello", "max_tokens": 512, "ignore_eos": True, "stream": True,
               "decoding": {"policy": "block-static", "steps": 512}}
    answers: dict[str, httpx.Response] = {}

    def staying() -> None:
        answers["staying"] = httpx.post(f"{server}/v1/completions", timeout=120, json={
            "prompt": "abc", "max_tokens": 128, "ignore_eos": True, "decoding": staying_knobs})

    with httpx.stream("POST", f"{server}/v1/completions", json=leaving, timeout=60) as response:
        first = next(line for line in response.iter_lines() if line.startswith("data: "))
        assert '"text"' in first  # decoding and streaming
        other = threading.Thread(target=staying)
        other.start()
        _wait_for(lambda: _metric(server, "caidllm:num_requests_running") == 2 or "staying" in answers,
                  "both requests decoding")
    # ... the other client leaves: closing the stream mid-way
    other.join(120)
    _wait_for(lambda: _metric(server, "caidllm:client_disconnects_total") == disconnects + 1, "the disconnect")
    _wait_for(lambda: _metric(server, "caidllm:num_requests_running") == 0, "the rows freed")
    assert answers["staying"].status_code == 200
    assert answers["staying"].json()["choices"][0]["text"] == want.text
    assert _metric(server, "caidllm:request_errors_total") == 0


def test_llada2_moe_checkpoint_serves(llada2_dir):
    oracle = Oracle(llada2_dir, 32)  # LLaDA2's config names no block: the official decoders' 32
    with running_server("--model", str(llada2_dir)) as (base, _):
        card = httpx.get(f"{base}/v1/models").json()["data"][0]
        assert card["id"] == "llada2-random" and card["architecture"] == "llada2"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        for prompt in ("hello", "sum a1 b2"):
            want = oracle.answer(prompt, 20)
            out = client.completions.create(model="llada2-random", prompt=prompt, max_tokens=20)
            assert (out.choices[0].text, out.choices[0].finish_reason) == (want.text, want.finish_reason)
            assert out.usage.completion_tokens == len(want.ids)
        chunks = list(client.chat.completions.create(model="llada2-random", max_tokens=20, stream=True,
                                                     messages=[{"role": "user", "content": "hello"}]))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == oracle.answer("<|user|>hello<|assistant|>", 20).text
        refused = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "echo": True, "logprobs": 1,
                                                               "max_tokens": 0})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "scoring_unsupported"
