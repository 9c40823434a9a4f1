"""A block-diffusion model (SDAR) served by the real server, driven by real clients (openai, raw
httpx for SSE), under the contract the LLaDA and Dream tests hold the server to: completions and
chat, whole and streamed, n > 1, stop strings, max_tokens off the block, usage as vLLM counts it,
logprobs, the block knobs, the knobs the block mode refuses, the info routes.

The checkpoint is random (tests/blockcheckpoints.py); every answer is compared with
`Engine.generate` on the same directory in this process (`Oracle`)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from blockcheckpoints import SDAR_BLOCK, Oracle
from serverproc import running_server

pytestmark = pytest.mark.slow
MODEL = "sdar-random"
STOP_PROMPT = "sum a1 b2"  # the random model ends its answer with the end token, inside max_tokens
LENGTH_PROMPT = "hello"  # ... and runs this one to max_tokens
MAX_TOKENS = 20  # not a multiple of the block: a canvas of 24, the last 4 tokens dropped


@pytest.fixture(scope="module")
def server(sdar_dir) -> Iterator[str]:
    with running_server("--model", str(sdar_dir), "--max-batch", "4") as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def oracle(sdar_dir) -> Oracle:
    return Oracle(sdar_dir, SDAR_BLOCK)


def sse_events(server: str, route: str, body: dict) -> list[dict]:
    """Every `data:` event of a streamed response, read raw; asserts the stream ends with [DONE]."""
    with httpx.stream("POST", f"{server}{route}", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        data = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_models_health_tokenize(server, client, sdar_dir):
    assert [m.id for m in client.models.list().data] == [MODEL]
    card = httpx.get(f"{server}/v1/models").json()["data"][0]
    assert card["architecture"] == "sdar" and card["max_model_len"] == 4096
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server}/version").json()["model"] == MODEL
    tokens = httpx.post(f"{server}/tokenize", json={"prompt": STOP_PROMPT, "return_token_strs": True}).json()
    assert tokens["token_strs"] == list(STOP_PROMPT) and tokens["max_model_len"] == 4096
    chat = httpx.post(f"{server}/tokenize", json={"messages": [{"role": "user", "content": "ab"}]}).json()
    assert chat["count"] == 4  # two role markers around two characters
    assert httpx.post(f"{server}/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": STOP_PROMPT}


def test_completions_match_the_engine_with_vllm_usage(client, oracle):
    stop, length = oracle.answer(STOP_PROMPT, MAX_TOKENS), oracle.answer(LENGTH_PROMPT, MAX_TOKENS)
    assert stop.finish_reason == "stop" and len(stop.ids) > 2 and length.finish_reason == "length"
    for prompt, want in ((STOP_PROMPT, stop), (LENGTH_PROMPT, length)):
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS)
        choice = out.choices[0]
        assert (choice.text, choice.finish_reason) == (want.text, want.finish_reason)
        # the text's tokens and the end token when it stopped there, as vLLM counts them
        assert out.usage.completion_tokens == len(want.ids) == len(want.text) + (want.finish_reason == "stop")
        assert out.usage.prompt_tokens == len(prompt)
        assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
        assert choice.model_extra["decoding"]["nfe"] > 0
    # the checkpoint's trained block is the default, whatever max_tokens is
    for max_tokens in (5, 12, 40):
        default = client.completions.create(model=MODEL, prompt=LENGTH_PROMPT, max_tokens=max_tokens)
        assert default.choices[0].text == oracle.answer(LENGTH_PROMPT, max_tokens).text
        assert len(default.choices[0].text) == max_tokens


def test_completion_stream_raw_sse(server, oracle):
    for prompt in (STOP_PROMPT, LENGTH_PROMPT):
        want = oracle.answer(prompt, MAX_TOKENS)
        events = sse_events(server, "/v1/completions", {"prompt": prompt, "max_tokens": MAX_TOKENS,
                                                        "stream_options": {"include_usage": True}})
        with_choices = [e for e in events if e["choices"]]
        assert "".join(e["choices"][0]["text"] for e in with_choices) == want.text
        assert with_choices[-1]["choices"][0]["finish_reason"] == want.finish_reason
        assert all(e["choices"][0]["finish_reason"] is None for e in with_choices[:-1])
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == len(want.ids)
    # text arrives block by block as it becomes final, not in one piece at the end
    long = sse_events(server, "/v1/completions", {"prompt": LENGTH_PROMPT, "max_tokens": 40})
    assert len([e for e in long if e["choices"][0]["text"]]) >= 40 // SDAR_BLOCK


def test_chat_whole_and_streamed(server, client, oracle):
    messages = [{"role": "user", "content": STOP_PROMPT}]
    want = oracle.answer(f"<|user|>{STOP_PROMPT}<|assistant|>", MAX_TOKENS)
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=MAX_TOKENS)
    assert whole.choices[0].message.content == want.text and whole.choices[0].finish_reason == want.finish_reason
    assert whole.usage.completion_tokens == len(want.ids) and whole.usage.prompt_tokens == len(STOP_PROMPT) + 2
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, stream=True,
                                            stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == want.text and finish == want.finish_reason
    assert usage is not None and usage.completion_tokens == len(want.ids)
    events = sse_events(server, "/v1/chat/completions", {"messages": messages, "max_tokens": MAX_TOKENS})
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == want.text


def test_n_samples_and_several_prompts(client, oracle):
    kwargs = dict(model=MODEL, prompt=LENGTH_PROMPT, max_tokens=16, n=3, temperature=1.0, seed=7)
    out = client.completions.create(**kwargs)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in client.completions.create(**kwargs).choices] == [c.text for c in out.choices]
    assert len({c.text for c in out.choices}) > 1  # n samples (seed, seed + 1, ...), not n copies
    assert out.usage.completion_tokens == sum(len(c.text) + (c.finish_reason == "stop") for c in out.choices)
    both = client.completions.create(model=MODEL, prompt=[STOP_PROMPT, LENGTH_PROMPT], max_tokens=MAX_TOKENS, n=2)
    assert [c.text for c in both.choices] == [oracle.answer(STOP_PROMPT, MAX_TOKENS).text] * 2 + \
        [oracle.answer(LENGTH_PROMPT, MAX_TOKENS).text] * 2


def test_stop_strings(client, oracle):
    full = oracle.answer(LENGTH_PROMPT, MAX_TOKENS).text
    stop = full[5:7]
    out = client.completions.create(model=MODEL, prompt=LENGTH_PROMPT, max_tokens=MAX_TOKENS, stop=[stop])
    assert out.choices[0].text == full[:full.find(stop)] and out.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model=MODEL, prompt=LENGTH_PROMPT, max_tokens=MAX_TOKENS, stop=stop,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == full[:full.find(stop)]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs_whole_and_streamed(client, oracle):
    want = oracle.answer(STOP_PROMPT, MAX_TOKENS)
    whole = client.completions.create(model=MODEL, prompt=STOP_PROMPT, max_tokens=MAX_TOKENS, logprobs=3).choices[0]
    lp = whole.logprobs
    # the text's tokens, then the end token that ended it (as vLLM reports it; not in the text)
    assert "".join(lp.tokens[:-1]) == whole.text == want.text and lp.tokens[-1] == "<|end|>"
    assert lp.text_offset == list(range(len(want.text) + 1))
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and top[token] == value and max(top.values()) == value and len(top) <= 4  # greedy
    tokens, values = [], []
    for chunk in client.completions.create(model=MODEL, prompt=STOP_PROMPT, max_tokens=MAX_TOKENS, logprobs=3,
                                           stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            values += chunk.choices[0].logprobs.token_logprobs
    assert tokens == lp.tokens and values == lp.token_logprobs


def test_chat_logprobs(client, oracle):
    messages = [{"role": "user", "content": LENGTH_PROMPT}]
    want = oracle.answer(f"<|user|>{LENGTH_PROMPT}<|assistant|>", MAX_TOKENS)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, logprobs=True,
                                         top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == len(want.ids)
    assert "".join(e.token for e in content[:len(want.text)]) == want.text
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob == e.logprob for e in content)


@pytest.mark.parametrize("knobs", [
    {"policy": "block-static"}, {"policy": "block-dynamic", "threshold": 0.5}, {"policy": "block-sequential"},
    {"policy": "cai"}, {"policy": "cai", "block_length": 4}, {"policy": "block-dynamic", "block_length": 16},
    {"policy": "block-static", "block_length": 8, "steps": 12},
])
def test_block_knobs_decode_as_the_engine(client, oracle, knobs):
    out = client.completions.create(model=MODEL, prompt=LENGTH_PROMPT, max_tokens=MAX_TOKENS,
                                    extra_body={"decoding": knobs})
    assert out.choices[0].text == oracle.answer(LENGTH_PROMPT, MAX_TOKENS, **knobs).text


def test_store_pass_costs_one_forward_a_block_and_changes_no_token(client):
    def run(store_pass: bool):
        return client.completions.create(model=MODEL, prompt=LENGTH_PROMPT, max_tokens=MAX_TOKENS, extra_body={
            "ignore_eos": True, "decoding": {"store_pass": store_pass}}).choices[0]

    riding, storing = run(False), run(True)
    assert storing.text == riding.text
    prompt, canvas = len(LENGTH_PROMPT), -(-MAX_TOKENS // SDAR_BLOCK) * SDAR_BLOCK
    blocks = -(-(prompt + canvas) // SDAR_BLOCK) - prompt // SDAR_BLOCK  # the row's decoded blocks
    # one store pass per decoded block, and one prefill of the prompt's whole blocks when it has any
    assert storing.model_extra["decoding"]["nfe"] == riding.model_extra["decoding"]["nfe"] + blocks + (
        prompt >= SDAR_BLOCK)


@pytest.mark.parametrize("extra,param,code", [
    ({"echo": True, "logprobs": 1, "max_tokens": 0}, "echo", "scoring_unsupported"),
    ({"echo": True, "logprobs": 1, "max_tokens": 4}, "echo", "scoring_unsupported"),
    ({"decoding": {"policy": "dream-entropy"}}, "decoding.policy", "invalid_decoding"),
    ({"decoding": {"policy": "dream-origin"}}, "decoding.policy", "invalid_decoding"),
    ({"decoding": {"cache": "dual"}}, "decoding.cache", "invalid_decoding"),
    ({"decoding": {"cache": "prefix"}}, "decoding.cache", "invalid_decoding"),
    ({"decoding": {"refresh_interval": 2}}, "decoding.refresh_interval", "invalid_decoding"),
    ({"decoding": {"cfg_scale": 1.0}}, "decoding.cfg_scale", "invalid_decoding"),
    ({"decoding": {"commit_first_at_block_start": True}}, "decoding.commit_first_at_block_start",
     "invalid_decoding"),
    ({"decoding": {"block_length": 0}}, "decoding.block_length", "invalid_decoding"),
    ({"decoding": {"block_length": 4096}}, "decoding.block_length", "context_length_exceeded"),
    ({"decoding": {"block_length": "eight"}}, "decoding.block_length", None),
])
def test_what_the_block_mode_refuses_names_the_field(server, extra, param, code):
    body = {"model": MODEL, "prompt": LENGTH_PROMPT, "max_tokens": 16, **extra}
    response = httpx.post(f"{server}/v1/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
    assert code is None or error["code"] == code
    chat = httpx.post(f"{server}/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 16, **{k: v for k, v in extra.items()
                                                                             if k == "decoding"}})
    if "decoding" in extra:
        assert chat.status_code == 400 and chat.json()["error"]["param"] == param
