"""The prefix cache on the real server (a random SDAR checkpoint, on by default): a repeated prompt
reports its whole blocks as `usage.prompt_tokens_details.cached_tokens` (whole and streamed) and
moves vLLM's counters; a chat's second turn reuses the first turn's prompt and answer; a burst of
identical prompts, then idle, then more, keeps the server healthy with the answers of a server
without the cache; an aborted stream leaves nothing behind. Waits are bounded polling."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from blockcheckpoints import SDAR_BLOCK, Oracle
from serverproc import metric, running_server

pytestmark = pytest.mark.slow
MODEL = "sdar-random"
SYSTEM = "You answer in one word. " * 2  # a few blocks of the character tokenizer


@pytest.fixture(scope="module")
def server(sdar_dir) -> Iterator[str]:
    with running_server("--model", str(sdar_dir), "--max-batch", "4") as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def _tokens(server: str, prompt: str) -> int:
    return httpx.post(f"{server}/tokenize", json={"prompt": prompt}).json()["count"]


def test_a_repeated_prompt_reports_its_cached_blocks(server, client, sdar_dir):
    prompt = SYSTEM + "repeat"
    whole = _tokens(server, prompt) // SDAR_BLOCK * SDAR_BLOCK
    before = httpx.get(f"{server}/metrics").text
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, stream=True,
                                            stream_options={"include_usage": True}))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == whole > 0
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == whole
    expected = Oracle(sdar_dir, SDAR_BLOCK).answer(prompt, 16).text
    assert first.choices[0].text == second.choices[0].text == "".join(c.choices[0].text for c in chunks
                                                                      if c.choices) == expected
    after = httpx.get(f"{server}/metrics").text
    moved = {name: metric(after, name) - metric(before, name)
             for name in ("caidllm:prefix_cache_queries_total", "caidllm:prefix_cache_hits_total")}
    assert moved == {"caidllm:prefix_cache_queries_total": 3 * first.usage.prompt_tokens,
                     "caidllm:prefix_cache_hits_total": 2 * whole}
    assert metric(after, "caidllm:prefix_cache_bytes") > 0


def test_a_second_chat_turn_reuses_the_first_turn_and_its_answer(server, client):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]
    turn1 = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=24,
                                           extra_body={"ignore_eos": True})
    messages += [{"role": "assistant", "content": turn1.choices[0].message.content},
                 {"role": "user", "content": "and then?"}]
    turn2 = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=8)
    asked = turn1.usage.prompt_tokens // SDAR_BLOCK * SDAR_BLOCK
    assert turn2.usage.prompt_tokens_details.cached_tokens > asked  # the answer's blocks too


def test_a_burst_then_idle_then_more_keeps_the_server_healthy(server, sdar_dir):
    prompt = SYSTEM + "burst"
    expected = Oracle(sdar_dir, SDAR_BLOCK).answer(prompt, 16).text

    async def burst(count: int) -> list[str]:
        async_client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
        outs = await asyncio.gather(*(async_client.completions.create(model=MODEL, prompt=prompt, max_tokens=16)
                                      for _ in range(count)))
        return [out.choices[0].text for out in outs]

    for count in (8, 3):
        assert asyncio.run(burst(count)) == [expected] * count
        deadline = time.monotonic() + 30  # idle: nothing left running
        while metric(httpx.get(f"{server}/metrics").text, "caidllm:num_requests_running") > 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert httpx.get(f"{server}/health").status_code == 200
    many = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 16, "n": 4},
                      timeout=60).json()
    assert [c["text"] for c in many["choices"]] == [expected] * 4
    assert many["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_an_aborted_stream_leaves_the_cache_consistent(server, client, sdar_dir):
    prompt = SYSTEM + "leave early"
    with httpx.stream("POST", f"{server}/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                               "max_tokens": 64, "stream": True}) as response:
        next(response.iter_lines())  # the first chunk, then the client leaves
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16)
    assert out.choices[0].text == Oracle(sdar_dir, SDAR_BLOCK).answer(prompt, 16).text
    assert httpx.get(f"{server}/health").status_code == 200
