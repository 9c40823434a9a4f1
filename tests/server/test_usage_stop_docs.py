"""Smaller contract points on the real server (bundled llada-tiny): usage counts a prompt once however
many choices it has (as vLLM and OpenAI); a stream ended by a stop string (or max_tokens) closes with
the decoding summary of the steps its choice took; /docs works without internet (its scripts are
served here, from the installed fastapi-offline package); `cai-dllm --version`."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
from serverproc import REPO, metric, running_server

from server.version import package_version

pytestmark = pytest.mark.slow
PROMPT = "00457+00038"
ANSWER = "7+8+0=15;5+3+1=09;4+0+0=04;0+0+0=00;0+0+0=00;=000495"


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with running_server("--threads", "1") as (base, _):
        yield base


def post(server: str, route: str, body: dict) -> dict:
    response = httpx.post(f"{server}{route}", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_usage_counts_each_prompt_once_with_n_choices(server):
    before = metric(httpx.get(f"{server}/metrics").text, "caidllm:prompt_tokens_total")
    one = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 64, "n": 3})
    assert len(one["choices"]) == 3
    assert one["usage"]["prompt_tokens"] == len(PROMPT)  # the character tokenizer: a token a character
    assert one["usage"]["completion_tokens"] == 3 * (len(ANSWER) + 1)  # each choice's answer and end token
    two = post(server, "/v1/completions", {"prompt": [PROMPT, "00023+00045"], "max_tokens": 64, "n": 2})
    assert two["usage"]["prompt_tokens"] == 2 * len(PROMPT)
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "n": 2})
    assert chat["usage"]["prompt_tokens"] == len(PROMPT) + 2  # two role markers
    after = metric(httpx.get(f"{server}/metrics").text, "caidllm:prompt_tokens_total")
    assert after - before == len(PROMPT) + 2 * len(PROMPT) + len(PROMPT) + 2


def stream(server: str, route: str, body: dict) -> list[dict]:
    import json

    with httpx.stream("POST", f"{server}{route}", json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200
        data = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"prompt": PROMPT, "stop": ["=09"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}], "stop": ["=09"]}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 40}),  # a canvas of 64: cut in its second block
])
def test_a_stream_ended_by_the_output_path_closes_with_its_decoding_summary(server, route, body):
    decoding = {"policy": "fixed", "early_exit": False, "block_length": 32}
    events = stream(server, route, {**body, "decoding": decoding})
    last = events[-1]["choices"][0]
    assert last["finish_reason"] == ("stop" if "stop" in body else "length")
    summary = last["decoding"]
    # the steps it took until the stop: one token a step, so fewer than the whole canvas's, and the
    # budget is the canvas's (the steps not taken are saved)
    assert 0 < summary["nfe"] == summary["steps"] < summary["fixed_step_budget"]
    assert summary["steps_saved"] == summary["fixed_step_budget"] - summary["steps"]
    assert all(e["choices"][0].get("decoding") is None for e in events[:-1] if e["choices"])


def test_docs_pages_load_their_assets_from_this_server(server):
    for page in ("/docs", "/redoc"):
        html = httpx.get(f"{server}{page}").text
        urls = re.findall(r"""(?:src|href)=["']([^"']+)["']""", html) + re.findall(r"url: ['\"]([^'\"]+)", html)
        assert urls and not [u for u in urls if u.startswith(("http:", "https:", "//"))], urls
        for url in urls:
            response = httpx.get(f"{server}{url}")
            assert response.status_code == 200 and response.content, url
    spec = httpx.get(f"{server}/openapi.json").json()
    assert spec["info"]["version"] == package_version()


def test_version_flag():
    done = subprocess.run([sys.executable, "-m", "server.cli", "--version"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == f"cai-dllm {package_version()}"
