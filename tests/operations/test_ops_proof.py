"""Proof under load, faults and hostile input, against the real server in a subprocess.

Each test prints its measured figures (`pytest -s` shows them; docs/operations.md quotes them)."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from pathlib import Path

import httpx
import pytest
from serverproc import metric, running_server

pytestmark = pytest.mark.slow
PROMPT = "<|user|>00012+00034<|assistant|>"
QUICK = {"policy": "threshold", "threshold": 0.9, "cache": "dual"}


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def report(name: str, figures: dict) -> None:
    print(f"\n[ops-proof] {name}: {json.dumps(figures)}")


async def _wait_idle(client: httpx.AsyncClient, timeout: float = 30) -> float:
    """Seconds until no request is running or waiting."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        page = (await client.get("/metrics")).text
        if metric(page, "caidllm:num_requests_running") == 0 and metric(page, "caidllm:num_requests_waiting") == 0:
            return time.monotonic() - start
        await asyncio.sleep(0.05)
    raise AssertionError("the server did not become idle")


def test_overload_every_request_gets_200_or_429_and_memory_returns():
    with running_server("--max-batch", "8", "--max-queue", "16") as (base, proc):
        body = {"prompt": PROMPT, "max_tokens": 32, "decoding": QUICK}

        async def wave(n: int, concurrency: int) -> list[httpx.Response]:
            gate = asyncio.Semaphore(concurrency)
            # idle connections expire on the client before the server's keep-alive (uvicorn's 5 s)
            # closes them: otherwise a request sent on a connection the server is closing at that
            # instant fails with a read error, a race of any keep-alive client, not an overload answer
            limits = httpx.Limits(max_connections=concurrency, keepalive_expiry=1.0)
            async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:
                async def one() -> httpx.Response:
                    async with gate:
                        return await client.post("/v1/completions", json=body)

                replies = await asyncio.gather(*(one() for _ in range(n)))
                await _wait_idle(client)
                return replies

        asyncio.run(wave(64, 64))  # warm-up at full width: allocator and caches at their working size
        baseline = rss_kib(proc.pid)
        started = time.monotonic()
        replies = asyncio.run(asyncio.wait_for(wave(500, 64), timeout=300))  # nothing may hang
        elapsed = time.monotonic() - started
        after = rss_kib(proc.pid)
        statuses = [r.status_code for r in replies]
        assert set(statuses) <= {200, 429}, set(statuses)
        assert 200 in statuses and 429 in statuses
        for r in replies:
            if r.status_code == 429:
                assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["type"] == "rate_limit_error"
            else:
                assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        growth = after - baseline
        assert growth < max(32 * 1024, baseline // 10), f"RSS grew {growth} KiB over a {baseline} KiB baseline"
        report("overload", {"requests": 500, "concurrency": 64, "max_queue": 16, "max_batch": 8,
                            "ok": statuses.count(200), "429": statuses.count(429), "seconds": round(elapsed, 1),
                            "rss_baseline_mib": round(baseline / 1024, 1), "rss_after_mib": round(after / 1024, 1)})
        assert httpx.get(f"{base}/health").status_code == 200


def test_hundred_clients_dropping_mid_stream_free_their_rows():
    with running_server("--max-batch", "8", "--max-queue", "128") as (base, _):
        body = {"prompt": PROMPT, "max_tokens": 512, "stream": True,
                "decoding": {"policy": "fixed", "early_exit": False, "block_length": 32}}
        rng = random.Random(0)

        async def scenario() -> dict:
            async with httpx.AsyncClient(base_url=base, timeout=60,
                                         limits=httpx.Limits(max_connections=None)) as client:
                async def dropper() -> None:
                    async with client.stream("POST", "/v1/completions", json=body) as reply:
                        assert reply.status_code == 200
                        await asyncio.sleep(rng.uniform(0.0, 1.0))
                    # leaving the block closes the connection mid-stream

                await asyncio.gather(*(dropper() for _ in range(100)))
                dropped_at = time.monotonic()
                steps_before = metric((await client.get("/metrics")).text, "caidllm:batch_size_count")
                idle_after = await _wait_idle(client)
                page = (await client.get("/metrics")).text
                steps_to_idle = metric(page, "caidllm:batch_size_count") - steps_before
                ok = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 32})
                assert ok.status_code == 200
                return {"clients": 100, "seconds_to_idle": round(idle_after, 3),
                        "engine_steps_after_last_drop": int(steps_to_idle),
                        "since_last_drop_s": round(time.monotonic() - dropped_at, 3)}

        figures = asyncio.run(scenario())
        # every row was freed by the step that followed its drop: at most one more step after the last one
        assert figures["engine_steps_after_last_drop"] <= 2, figures
        report("disconnects", figures)


def test_sigterm_under_load_finishes_in_flight_and_refuses_new():
    with running_server("--max-batch", "8", "--shutdown-timeout", "120") as (base, proc):
        body = {"prompt": PROMPT, "max_tokens": 128, "decoding": {"policy": "fixed", "early_exit": False}}

        async def scenario() -> tuple[list[httpx.Response], int]:
            async with httpx.AsyncClient(base_url=base, timeout=180) as client:
                in_flight = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(12)]
                while metric((await client.get("/metrics")).text, "caidllm:num_requests_running") < 8:
                    await asyncio.sleep(0.05)
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                try:
                    late = (await client.post("/v1/completions", json={"prompt": "hi"})).status_code
                except httpx.HTTPError:
                    late = -1
                return await asyncio.gather(*in_flight), late

        finished, late = asyncio.run(scenario())
        assert [r.status_code for r in finished] == [200] * 12  # running and waiting ones alike
        assert late == 503
        assert proc.wait(120) == 0
        report("sigterm", {"in_flight": 12, "finished_200": 12, "new_request_status": late, "exit_code": 0})


HOSTILE: list[tuple[str, dict, int]] = [
    ("oversized body", {"content": b'{"prompt": "' + b"a" * (2 << 20) + b'"}'}, 413),
    ("deeply nested JSON", {"content": b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"}, 400),
    ("invalid UTF-8", {"content": b'{"prompt": "\xff\xfe"}'}, 400),
    ("not JSON", {"content": b"prompt=hello"}, 400),
    ("JSON array body", {"json": ["hello"]}, 400),
    ("huge n", {"json": {"prompt": "hi", "n": 10**9}}, 400),
    ("huge max_tokens", {"json": {"prompt": "hi", "max_tokens": 10**12}}, 400),
    ("negative knob", {"json": {"prompt": "hi", "decoding": {"theta_s": -1}}}, 400),
    ("NaN knob", {"content": b'{"prompt": "hi", "decoding": {"threshold": NaN}}'}, 400),
    ("infinite temperature", {"content": b'{"prompt": "hi", "temperature": Infinity}'}, 400),
    ("wrong type", {"json": {"prompt": "hi", "max_tokens": "many"}}, 400),
    ("wrong knob type", {"json": {"prompt": "hi", "decoding": {"block_length": [32]}}}, 400),
    ("unknown knob", {"json": {"prompt": "hi", "decoding": {"warp_speed": 9}}}, 400),
    ("unknown model", {"json": {"prompt": "hi", "model": "gpt-17"}}, 404),
    ("token id out of vocabulary", {"json": {"prompt": [10**9]}}, 400),
    ("empty prompt list", {"json": {"prompt": []}}, 400),
]


def test_hostile_input_gets_clear_4xx_in_openai_shape():
    with running_server("--api-key", "k3y", "--max-n", "8") as (base, _):
        auth = {"Authorization": "Bearer k3y"}
        seen = {}
        with httpx.Client(base_url=base, timeout=60) as client:
            for name, request, status in HOSTILE:
                headers = dict(auth, **({"Content-Type": "application/json"} if "content" in request else {}))
                reply = client.post("/v1/completions", headers=headers, **request)
                seen[name] = reply.status_code
                assert reply.status_code == status, (name, reply.status_code, reply.text[:300])
                error = reply.json()["error"]
                assert error["message"] and error["type"] and set(error) == {"message", "type", "param", "code"}
            for name, headers in (("missing API key", {}), ("wrong API key", {"Authorization": "Bearer nope"}),
                                  ("malformed auth header", {"Authorization": "k3y"})):
                reply = client.post("/v1/completions", headers=headers, json={"prompt": "hi"})
                seen[name] = reply.status_code
                assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
            # still serving, and open routes stay open
            fine = client.post("/v1/completions", headers=auth, json={"prompt": "hi", "max_tokens": 8})
            assert fine.status_code == 200
            assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200
        report("hostile input", seen)
