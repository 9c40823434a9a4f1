"""The server under 1 and 8 concurrent clients against the offline engine, on the same requests.

The same held-out chat prompts and decoding knobs go (a) through `engine.generate` with
max_batch 8 in this process, (b) through a `cai-dllm serve` subprocess from 1 client at a time and
(c) from 8 concurrent clients. Reported: generated tokens/s (completion tokens only, wall clock),
the server/offline ratio at concurrency 8, and the speed-up of 8 clients over 1. Every request is
checked to give the same text through the server as offline (temperature 0). Also reported: engine
steps, mean rows per step (offline: counted around the engine's step; server: from /metrics), the
mean time a server request waited for a row, and its HTTP overhead (the client's latency minus the
server's own end-to-end latency: the response, the client and the next request), which together
say where the server's time goes.

    python bench/server_vs_offline.py --model models/llada-tiny --n 64
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import aiohttp
import httpx
import torch

from engine import Engine, EngineConfig
from engine.chat import chat_prompt_ids
from engine.decoding import DecodeParams
from tinymodels.evaluate import dual_cache_refresh, hardware, held_out_problems

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run_clients(base: str, bodies: list[dict], concurrency: int,
                      client: str = "aiohttp") -> tuple[float, list[dict], float]:
    """Wall seconds, the responses, and the summed client-side latency of the requests.

    Each of `concurrency` clients sends its next request as soon as it has a response (closed loop).
    aiohttp is the default client, as in vLLM's serving benchmark: httpx's async client costs more
    CPU per round trip, CPU the clients take from the server they measure on a small machine, and a
    delay during which the client's row waits for its next request.
    """
    url = f"{base}/v1/chat/completions"
    pending = iter(enumerate(bodies))
    results: list[dict] = [{} for _ in bodies]
    latencies: list[float] = []

    async def closed_loop(post) -> None:
        for index, body in pending:
            sent = time.perf_counter()
            results[index] = await post(body)
            latencies.append(time.perf_counter() - sent)

    start = time.perf_counter()
    if client == "aiohttp":
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency),
                                         timeout=aiohttp.ClientTimeout(total=600)) as session:
            async def post(body: dict) -> dict:
                async with session.post(url, json=body) as response:
                    response.raise_for_status()
                    return await response.json()

            await asyncio.gather(*(closed_loop(post) for _ in range(concurrency)))
    else:
        async with httpx.AsyncClient(timeout=600) as session:
            async def post(body: dict) -> dict:
                response = await session.post(url, json=body)
                response.raise_for_status()
                return response.json()

            await asyncio.gather(*(closed_loop(post) for _ in range(concurrency)))
    return time.perf_counter() - start, results, sum(latencies)


def metric_sum(metrics_text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in metrics_text.splitlines() if line.startswith(name + "{"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO / "models" / "llada-tiny"))
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5, help="alternating offline / 8-client runs")
    parser.add_argument("--client", choices=("aiohttp", "httpx"), default="aiohttp",
                        help="the load generator's HTTP client")
    args = parser.parse_args()
    engine = Engine(EngineConfig(model=args.model, max_batch=8, device=args.device))
    decoding = {"policy": "cai", "cache": "dual", "refresh_interval": dual_cache_refresh(engine.architecture),
                "block_length": 32}
    problems = held_out_problems(args.n, args.seed)
    messages = [[{"role": "user", "content": p.prompt}] for p in problems]
    prompts = [chat_prompt_ids(engine.tokenizer, m) for m in messages]
    params = engine.default_params(DecodeParams(gen_length=args.max_tokens, steps=args.max_tokens, **decoding))
    engine.generate(prompts[:8], params)  # warm-up

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--model", args.model, "--port", str(port),
                               "--max-batch", "8", "--device", args.device, "--log-level", "warning"],
                              cwd=REPO, env=dict(os.environ))
    base = f"http://127.0.0.1:{port}"
    offline_runs: list[Run] = []
    server_runs: dict[int, list[Run]] = {1: [], 8: []}
    try:
        wait_ready(base, server)
        bodies = [{"model": Path(args.model).name, "messages": m, "max_tokens": args.max_tokens,
                   "decoding": decoding} for m in messages]
        asyncio.run(run_clients(base, bodies[:8], 8, args.client))  # warm-up
        # Offline and 8-client runs alternate, so a slow spell of this shared machine hits both.
        for _ in range(args.repeats):
            offline, run = run_offline(engine, prompts, params)
            offline_runs.append(run)
            server_runs[8].append(run_server(base, bodies, 8, offline, args.client))
        server_runs[1].append(run_server(base, bodies, 1, offline, args.client))
    finally:
        server.terminate()
        server.wait(60)

    print(f"# {args.n} held-out chat requests, max_tokens {args.max_tokens}, decoding {decoding}, "
          f"client {args.client}; "
          f"median of {args.repeats} alternating offline / 8-client runs")
    print(f"# {hardware()}, torch {torch.__version__}, model {args.model}")
    print(f"{'setting':24s} {'seconds':>8s} {'gen tokens':>10s} {'tokens/s':>9s} {'same text':>9s} {'steps':>6s} "
          f"{'rows/step':>9s} {'queue ms':>8s} {'http ms':>7s}")
    named = [("offline (max_batch 8)", offline_runs)] + [(f"server, {c} client(s)", r) for c, r in server_runs.items()]
    for name, runs in named:
        run = median_run(runs)
        same = f"{run.same:>4d}/{args.n}" if run.same is not None else "-"
        queue = f"{run.queue_ms:8.1f}" if run.queue_ms is not None else "-"
        http = f"{run.http_ms:7.1f}" if run.http_ms is not None else "-"
        print(f"{name:24s} {run.seconds:8.2f} {run.tokens:10d} {run.tokens_per_s:9.1f} {same:>9s} {run.steps:6d} "
              f"{run.rows_per_step:9.2f} {queue:>8s} {http:>7s}")
    ratios = [s.tokens_per_s / o.tokens_per_s for s, o in zip(server_runs[8], offline_runs, strict=True)]
    print(f"server(8) / offline throughput, run by run: {' '.join(f'{r:.3f}' for r in ratios)}; "
          f"median {statistics.median(ratios):.3f}")
    print(f"server(8) / offline rows per step: "
          f"{median_run(server_runs[8]).rows_per_step / median_run(offline_runs).rows_per_step:.3f}")
    print(f"server 8 clients / 1 client throughput: "
          f"{median_run(server_runs[8]).tokens_per_s / server_runs[1][0].tokens_per_s:.2f}x")


@dataclass
class Run:
    seconds: float
    tokens: int
    steps: int
    rows_per_step: float
    same: Optional[int] = None
    queue_ms: Optional[float] = None
    http_ms: Optional[float] = None  # client latency minus the server's own end-to-end latency

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def median_run(runs: list[Run]) -> Run:
    return sorted(runs, key=lambda r: r.tokens_per_s)[len(runs) // 2]


def wait_ready(base: str, server: subprocess.Popen) -> None:
    while True:
        try:
            if httpx.get(f"{base}/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if server.poll() is not None:
            raise RuntimeError("server exited")
        time.sleep(0.2)


def run_offline(engine: Engine, prompts: list[list[int]], params: DecodeParams) -> tuple[list, Run]:
    """`engine.generate` on every prompt, counting the rows of each engine step on the side."""
    step_rows: list[int] = []
    unobserved_step = engine.step

    def observed_step() -> list:
        outputs = unobserved_step()
        step_rows.append(len(outputs))
        return outputs

    engine.step = observed_step  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        results = engine.generate(prompts, params)
        seconds = time.perf_counter() - start
    finally:
        del engine.step
    tokens = sum(len(r.response_ids) for r in results)
    return results, Run(seconds, tokens, len(step_rows), sum(step_rows) / len(step_rows))


def run_server(base: str, bodies: list[dict], concurrency: int, offline: list, client: str) -> Run:
    watched = ("caidllm:batch_size_sum", "caidllm:batch_size_count", "caidllm:request_queue_time_seconds_sum",
               "caidllm:e2e_request_latency_seconds_sum")
    before = httpx.get(f"{base}/metrics").text
    seconds, results, client_latency = asyncio.run(run_clients(base, bodies, concurrency, client))
    after = httpx.get(f"{base}/metrics").text
    rows_sum, steps, queued, server_latency = (metric_sum(after, w) - metric_sum(before, w) for w in watched)
    tokens = sum(r["usage"]["completion_tokens"] for r in results)
    same = sum(r["choices"][0]["message"]["content"] == o.text for r, o in zip(results, offline, strict=True))
    return Run(seconds, tokens, int(steps), rows_sum / steps, same, 1000 * queued / len(results),
               1000 * (client_latency - server_latency) / len(results))


if __name__ == "__main__":
    main()
