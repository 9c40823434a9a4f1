"""The prefix cache on the real server for the built-in DiffusionGemma-format model (on by default): chat
requests behind a repeated long system prompt report its whole canvases as
`usage.prompt_tokens_details.cached_tokens` and move vLLM's counters, and a seeded request's answer is
the same when its prompt was restored as when it was computed (a uniform-noise model samples: the
requests carry a `seed`). Waits are the server's own start-up polling."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from serverproc import REPO, metric, running_server

pytestmark = pytest.mark.slow
MODEL = REPO / "models" / "diffusiongemma-tiny"
SYSTEM = "Answer with the worked sum and nothing else. " * 3  # several canvases of the character tokenizer
QUESTIONS = ("00453+31982", "89420-08652")


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    if not (MODEL / "model.safetensors").is_file():
        pytest.skip("the built-in model is not in this tree")
    with running_server("--model", str(MODEL), "--max-batch", "2") as (base, _):
        yield base


def _ask(server: str, question: str) -> dict:
    body = {"model": MODEL.name, "seed": 3, "max_tokens": 64,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}
    reply = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_repeated_system_prompt_is_restored_with_the_same_answers(server) -> None:
    canvas = json.loads((MODEL / "config.json").read_text())["canvas_length"]
    before = httpx.get(f"{server}/metrics").text
    first = [_ask(server, q) for q in QUESTIONS]  # the second already finds the system prompt's canvases
    again = [_ask(server, q) for q in QUESTIONS]  # each finds its whole prompt's canvases
    cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in first + again]
    prompt_tokens = [r["usage"]["prompt_tokens"] for r in first + again]
    assert cached[0] == 0 and cached[1] > 0
    assert cached[2:] == [n // canvas * canvas for n in prompt_tokens[2:]]
    for a, b in zip(first, again, strict=True):
        assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    after = httpx.get(f"{server}/metrics").text
    moved = {name: metric(after, name) - metric(before, name)
             for name in ("caidllm:prefix_cache_queries_total", "caidllm:prefix_cache_hits_total")}
    assert moved == {"caidllm:prefix_cache_queries_total": sum(prompt_tokens),
                     "caidllm:prefix_cache_hits_total": sum(cached)}
    assert metric(after, "caidllm:prefix_cache_bytes") > 0
