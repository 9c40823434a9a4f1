"""The real server in a subprocess on a free port, driven by real clients (openai, httpx)."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from serverproc import REPO, metric, running_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with running_server("--max-batch", "8") as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def test_models_version_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["llada-tiny"]
    card = httpx.get(f"{server}/v1/models").json()["data"][0]
    assert card["architecture"] == "llada" and card["energy_meter"] in ("none", "rapl", "nvml")
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server}/ready").status_code == 200
    assert httpx.get(f"{server}/version").json()["model"] == "llada-tiny"


def test_completion_with_decoding_summary(client):
    out = client.completions.create(model="llada-tiny", prompt="<|user|>00023+00045<|assistant|>", max_tokens=128)
    choice = out.choices[0]
    assert choice.text and choice.finish_reason in ("stop", "length")
    summary = choice.model_extra["decoding"]
    assert summary["nfe"] > 0 and summary["steps_saved"] == summary["fixed_step_budget"] - summary["steps"]
    # one token per character, and the end token when the answer ended at one (as vLLM counts)
    assert out.usage.completion_tokens == len(choice.text) + (choice.finish_reason == "stop")
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_chat_uses_the_checkpoint_template(client):
    out = client.chat.completions.create(model="llada-tiny", messages=[{"role": "user", "content": "00023+00045"}])
    raw = client.completions.create(model="llada-tiny", prompt="<|user|>00023+00045<|assistant|>", max_tokens=128)
    assert out.choices[0].message.content == raw.choices[0].text  # the template renders the same prompt
    assert out.usage.prompt_tokens == len("00023+00045") + 2  # one a character, one a role marker


def test_prompt_forms(client):
    ids = [99, *[ord(c) - 32 for c in "12+3"], 100]
    by_ids = client.completions.create(model="llada-tiny", prompt=ids, max_tokens=64)
    by_text = client.completions.create(model="llada-tiny", prompt="<|user|>12+3<|assistant|>", max_tokens=64)
    assert by_ids.choices[0].text == by_text.choices[0].text
    many = client.completions.create(model="llada-tiny", prompt=[ids, ids], max_tokens=64)
    assert [c.index for c in many.choices] == [0, 1]
    texts = client.completions.create(model="llada-tiny", max_tokens=32,
                                      prompt=["<|user|>1+1<|assistant|>", "<|user|>2+2<|assistant|>"])
    assert len(texts.choices) == 2


def test_streaming_matches_and_reports_usage(client):
    long_answer = "sum a2 b2 c5 d2 e6 f0 g3 h6 i2 j6 k9 l7 m3"  # 13 items: several blocks of text
    kwargs = dict(model="llada-tiny", messages=[{"role": "user", "content": long_answer}], max_tokens=128)
    full = client.chat.completions.create(**kwargs)
    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    pieces, finish, usage, chunks = [], None, None, 0
    for chunk in stream:
        chunks += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    assert chunks > 3  # text arrives as it becomes final, not in one piece


def test_n_samples(client):
    out = client.completions.create(model="llada-tiny", prompt="<|user|>sum a1 b2 c3<|assistant|>", max_tokens=64,
                                    n=3, temperature=1.0, seed=7)
    assert [c.index for c in out.choices] == [0, 1, 2]
    again = client.completions.create(model="llada-tiny", prompt="<|user|>sum a1 b2 c3<|assistant|>",
                                      max_tokens=64, n=3, temperature=1.0, seed=7)
    assert [c.text for c in out.choices] == [c.text for c in again.choices]


def test_stop_strings(client):
    prompt = "<|user|>00457+00038<|assistant|>"
    full = client.completions.create(model="llada-tiny", prompt=prompt, max_tokens=64).choices[0].text
    stop = full[3:5]  # a stop string that occurs in the output
    out = client.completions.create(model="llada-tiny", prompt=prompt, max_tokens=64, stop=[stop])
    assert out.choices[0].text == full[:full.find(stop)] and out.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="llada-tiny", prompt=prompt, max_tokens=64, stop=[stop], stream=True) if c.choices)
    assert streamed == full[:full.find(stop)]


def test_decoding_knobs_via_extra_body(client):
    fixed = client.completions.create(model="llada-tiny", prompt="<|user|>12+30<|assistant|>", max_tokens=64,
                                      extra_body={"decoding": {"policy": "fixed", "early_exit": False}})
    assert fixed.choices[0].model_extra["decoding"]["nfe"] == 64
    cai = client.completions.create(model="llada-tiny", prompt="<|user|>12+30<|assistant|>", max_tokens=64,
                                    extra_body={"decoding": {"policy": "cai", "cache": "dual", "gating": True}})
    assert cai.choices[0].model_extra["decoding"]["nfe"] < 64


@pytest.mark.parametrize("kwargs,status,param", [
    ({"logprobs": 50}, 400, "logprobs"),
    ({"presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"extra_body": {"decoding": {"score_samples": 0}}}, 400, "decoding.score_samples"),
    ({"extra_body": {"frobnicate": 1}}, 400, "frobnicate"),
    ({"extra_body": {"decoding": {"theta_s": 7}}}, 400, "decoding.theta_s"),
    ({"extra_body": {"decoding": {"policy": "magic"}}}, 400, "decoding.policy"),
    ({"extra_body": {"decoding": {"thresh": 0.5}}}, 400, "decoding.thresh"),
    ({"max_tokens": 100_000}, 400, "max_tokens"),
    ({"max_tokens": -3}, 400, "max_tokens"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"n": 1000}, 400, "n"),
    ({"model": "gpt-4"}, 404, "model"),
])
def test_errors_name_the_parameter(server, kwargs, status, param):
    body = {"model": "llada-tiny", "prompt": "hi", "max_tokens": 8}
    body.update({k: v for k, v in kwargs.items() if k != "extra_body"})
    body.update(kwargs.get("extra_body", {}))
    response = httpx.post(f"{server}/v1/completions", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]


def test_context_length_exceeded(server):
    response = httpx.post(f"{server}/v1/completions", json={"prompt": "x" * 5000, "max_tokens": 32}, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("content,status", [
    (b"{not json", 400), (b"\xff\xfe\x00", 400), (b"[1, 2]", 400), (b"x" * (2 << 20), 413),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),
])
def test_malformed_bodies(server, content, status):
    response = httpx.post(f"{server}/v1/completions", content=content, headers={"content-type": "application/json"},
                          timeout=30)
    assert response.status_code == status
    assert "error" in response.json()


def test_unknown_route_is_404_in_openai_shape(server):
    response = httpx.get(f"{server}/v1/nope")
    assert response.status_code == 404 and response.json()["error"]["message"]


def test_concurrent_requests_batch_and_match_alone(server, client):
    prompts = [f"<|user|>{a}+{b}<|assistant|>" for a, b in zip(range(10, 26), range(300, 316), strict=True)]
    knobs = [{"policy": "fixed"}, {"policy": "threshold", "threshold": 0.8}, {"policy": "cai"},
             {"policy": "cai", "gating": False}]

    async def one(async_client: openai.AsyncOpenAI, i: int) -> str:
        out = await async_client.completions.create(model="llada-tiny", prompt=prompts[i], max_tokens=64,
                                                    extra_body={"decoding": knobs[i % 4]})
        return out.choices[0].text

    async def all_at_once() -> list[str]:
        async_client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
        return await asyncio.gather(*(one(async_client, i) for i in range(16)))

    together = asyncio.run(all_at_once())
    alone = [client.completions.create(model="llada-tiny", prompt=prompts[i], max_tokens=64,
                                       extra_body={"decoding": knobs[i % 4]}).choices[0].text for i in range(16)]
    assert together == alone
    metrics = httpx.get(f"{server}/metrics").text
    eight = [line for line in metrics.splitlines() if line.startswith('caidllm:batch_size_bucket{le="8.0"')]
    seven = [line for line in metrics.splitlines() if line.startswith('caidllm:batch_size_bucket{le="7.0"')]
    assert float(eight[0].split()[-1]) > float(seven[0].split()[-1])  # some steps ran 8 rows


def test_metrics_move_and_agree_with_summaries(server, client):
    before = httpx.get(f"{server}/metrics").text
    # problems of the built-in task family, which the model answers (it gives "0+0" an empty answer)
    outs = [client.completions.create(model="llada-tiny", prompt=f"<|user|>0045{i}+00038<|assistant|>", max_tokens=64,
                                      extra_body={"decoding": {"policy": "cai", "early_exit": False}})
            for i in range(3)]
    after = httpx.get(f"{server}/metrics").text
    saved = sum(o.choices[0].model_extra["decoding"]["steps_saved"] for o in outs)
    assert metric(after, "caidllm:steps_saved_total") - metric(before, "caidllm:steps_saved_total") == saved
    for name in ("caidllm:prompt_tokens_total", "caidllm:generation_tokens_total", "caidllm:request_success_total",
                 "caidllm:e2e_request_latency_seconds_count", "caidllm:time_to_first_token_seconds_count",
                 "caidllm:request_queue_time_seconds_count", "caidllm:request_nfe_count",
                 "caidllm:tokens_committed_per_step_count", "caidllm:request_steps_saved_count",
                 "caidllm:batch_size_count", "caidllm:decode_steps_total"):
        assert metric(after, name) > metric(before, name), name
    for name in ("caidllm:num_requests_running", "caidllm:num_requests_waiting", "caidllm:forced_commits_total",
                 "caidllm:grinding_exits_total", "caidllm:request_errors_total"):
        assert name in after
    assert 'model_name="llada-tiny"' in after


def test_auth():
    with running_server("--api-key", "s3cret") as (base, _):
        assert httpx.post(f"{base}/v1/completions", json={"prompt": "hi"}).status_code == 401
        assert httpx.post(f"{base}/v1/completions", json={"prompt": "hi"},
                          headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 8},
                        headers={"Authorization": "Bearer s3cret"}, timeout=30)
        assert ok.status_code == 200
        assert httpx.get(f"{base}/health").status_code == 200 and httpx.get(f"{base}/metrics").status_code == 200


def _long_request(base: str, **extra) -> httpx.Response:
    body = {"prompt": "<|user|>1+1<|assistant|>", "max_tokens": 2048,
            "decoding": {"policy": "fixed", "early_exit": False, "block_length": 2048}, **extra}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=120)


def test_queue_full_is_429_with_retry_after():
    with running_server("--max-batch", "1", "--max-queue", "1") as (base, _):
        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=120) as c:
                body = {"prompt": "<|user|>1+1<|assistant|>", "max_tokens": 64,
                        "decoding": {"policy": "fixed", "early_exit": False, "block_length": 64}}
                return await asyncio.gather(*(c.post(f"{base}/v1/completions", json=body) for _ in range(4)))

        statuses = [r.status_code for r in asyncio.run(burst())]
        # 1 row + 1 waiting place: 4 simultaneous requests cannot all fit; each gets 200 or 429
        assert set(statuses) <= {200, 429} and 200 in statuses and 429 in statuses
        rejected = next(r for r in asyncio.run(burst()) if r.status_code == 429)
        assert rejected.headers["retry-after"] and rejected.json()["error"]["type"] == "rate_limit_error"


def test_timeout_frees_the_row():
    with running_server("--request-timeout", "1") as (base, _):
        response = _long_request(base)
        assert response.status_code == 504 and response.json()["error"]["code"] == "timeout"
        # the abort takes effect when the step in progress ends: poll, bounded
        deadline = time.monotonic() + 30
        while metric(httpx.get(f"{base}/metrics").text, "caidllm:num_requests_running") != 0:
            assert time.monotonic() < deadline, "the timed-out request still holds its row"
            time.sleep(0.05)


def test_client_disconnect_aborts_the_request(server):
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", f"{server}/v1/completions",
                      json={"prompt": "<|user|>1+1<|assistant|>", "max_tokens": 2048, "stream": True,
                            "decoding": {"policy": "fixed", "early_exit": False, "block_length": 64}}) as response:
            assert response.status_code == 200  # the stream is open and the request decoding
            deadline = time.monotonic() + 10
            while metric(httpx.get(f"{server}/metrics").text, "caidllm:num_requests_running") == 0:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if metric(httpx.get(f"{server}/metrics").text, "caidllm:num_requests_running") == 0:
            break
        time.sleep(0.1)
    assert metric(httpx.get(f"{server}/metrics").text, "caidllm:num_requests_running") == 0


def test_sigterm_drains_in_flight_requests():
    with running_server("--shutdown-timeout", "60") as (base, proc):
        async def scenario() -> tuple[httpx.Response, int]:
            async with httpx.AsyncClient(timeout=120) as c:
                body = {"prompt": "<|user|>1+1<|assistant|>", "max_tokens": 256,
                        "decoding": {"policy": "fixed", "early_exit": False}}
                in_flight = asyncio.create_task(c.post(f"{base}/v1/completions", json=body))
                deadline = time.monotonic() + 60  # bounded polling, not a sleep: the request is decoding
                while metric((await c.get(f"{base}/metrics")).text, "caidllm:num_requests_running") == 0:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
                proc.send_signal(signal.SIGTERM)
                while (await c.get(f"{base}/ready")).status_code == 200:  # until it drains
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
                try:
                    late = (await c.post(f"{base}/v1/completions", json={"prompt": "hi"})).status_code
                except httpx.HTTPError:
                    late = -1  # already closed
                return await in_flight, late

        finished, late = asyncio.run(scenario())
        assert finished.status_code == 200, finished.text
        assert finished.json()["choices"][0]["finish_reason"] in ("stop", "length")
        assert late == 503
        assert proc.wait(60) == 0


def test_bad_server_flags_fail_fast():
    run = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--default-decoding", '{"theta_s": 5}'],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "theta_s" in run.stderr
    assert json.loads('{"a": 1}')  # keep json imported for the bodies above
