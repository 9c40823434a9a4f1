"""The server under 1 and 8 concurrent clients against the offline engine, on the same requests;
and (`threads`) the server's CPU thread count under load, alone and beside a busy neighbour.

Server vs offline (the default). The same held-out chat prompts and decoding knobs go (a) through
`engine.generate` with max_batch 8 in this process, (b) through a `cai-dllm serve` subprocess from
1 client at a time and (c) from 8 concurrent clients. Reported: generated tokens/s (completion tokens
only, wall clock), the server/offline ratio at concurrency 8, and the speed-up of 8 clients over 1.
Every request is checked to give the same text through the server as offline (temperature 0). Also
reported: engine steps, mean rows per step (offline: counted around the engine's step; server: from
/metrics), the mean time a server request waited for a row, and its HTTP overhead (the client's
latency minus the server's own end-to-end latency: the response, the client and the next request),
which together say where the server's time goes.

Threads (`threads`). Starts `cai-dllm serve` once per run (the default `--threads`, and each
`--threads N` asked for), sends the same closed-loop load with the built-in load generator
(`cai-dllm bench serve`'s `run_load`: streamed chat requests of held-out built-in problems) and
reports request throughput, end-to-end latency and exact-match accuracy. A "busy" run first starts
`--busy` processes that spin on the CPU for as long as the load runs, as a neighbour on shared cores
(or a container over its CPU quota) would. Runs alternate between the thread settings, round after
round, so a change in the machine's own load affects each alike; the 1-minute load average before
each run is printed, since other work on the machine is part of what is measured.

    python bench/server_vs_offline.py --n 256 --repeats 5 > bench/results/server_vs_offline_cpu.txt
    python bench/server_vs_offline.py threads --threads 1 --rounds 2 --num-requests 48 --concurrency 8 \
        > bench/results/server_vs_offline_threads_cpu.txt
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import aiohttp
import httpx
import torch

from bench.load_generator import builtin_workload, run_load
from engine import Engine, EngineConfig
from engine.chat import chat_prompt_ids
from engine.cpus import available_cpus
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


@contextmanager
def serving(model: str, *flags: str) -> Iterator[str]:
    """A `cai-dllm serve` subprocess on a free port; yields its base URL once /ready answers."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--model", model, "--port", str(port),
                               "--log-level", "warning", *flags], cwd=REPO, env=dict(os.environ))
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, server)
        yield base
    finally:
        server.terminate()
        server.wait(60)


def compare(argv: list[str]) -> None:
    """Offline against the server at 1 and 8 clients, on the same requests."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="threads: python bench/server_vs_offline.py threads --help")
    parser.add_argument("--model", default=str(REPO / "models" / "llada-tiny"))
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5, help="alternating offline / 8-client runs")
    parser.add_argument("--client", choices=("aiohttp", "httpx"), default="aiohttp",
                        help="the load generator's HTTP client")
    args = parser.parse_args(argv)
    engine = Engine(EngineConfig(model=args.model, max_batch=8, device=args.device))
    decoding = {"policy": "cai", "cache": "dual", "refresh_interval": dual_cache_refresh(engine.architecture),
                "block_length": 32}
    problems = held_out_problems(args.n, args.seed)
    messages = [[{"role": "user", "content": p.prompt}] for p in problems]
    prompts = [chat_prompt_ids(engine.tokenizer, m) for m in messages]
    params = engine.default_params(DecodeParams(gen_length=args.max_tokens, steps=args.max_tokens, **decoding))
    engine.generate(prompts[:8], params)  # warm-up

    offline_runs: list[Run] = []
    server_runs: dict[int, list[Run]] = {1: [], 8: []}
    with serving(args.model, "--max-batch", "8", "--device", args.device) as base:
        bodies = [{"model": Path(args.model).name, "messages": m, "max_tokens": args.max_tokens,
                   "decoding": decoding} for m in messages]
        asyncio.run(run_clients(base, bodies[:8], 8, args.client))  # warm-up
        # Offline and 8-client runs alternate, so a slow spell of this shared machine hits both.
        for _ in range(args.repeats):
            offline, run = run_offline(engine, prompts, params)
            offline_runs.append(run)
            server_runs[8].append(run_server(base, bodies, 8, offline, args.client))
        server_runs[1].append(run_server(base, bodies, 1, offline, args.client))

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
    # counted as the server's usage.completion_tokens (vLLM's): the end token the model generated too
    tokens = sum(len(r.response_ids) + (r.finish_reason == "stop") for r in results)
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


def _spin() -> None:
    while True:
        pass


@contextmanager
def busy_neighbours(count: int) -> Iterator[None]:
    """`count` processes spinning on the CPU for as long as the block runs."""
    procs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(count)]
    for proc in procs:
        proc.start()
    try:
        yield
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.join()


def threads_run(threads: Optional[int], busy: int, args: argparse.Namespace) -> dict:
    """One server at `threads` (None: its default) under the closed-loop load, beside `busy` spinners."""
    flags = [] if threads is None else ["--threads", str(threads)]
    workload = builtin_workload(args.num_requests, args.seed)
    with serving(args.model, *flags) as base:
        asyncio.run(run_load(base, workload, args.concurrency, concurrency=args.concurrency, progress=False))
        load = os.getloadavg()[0]
        with busy_neighbours(busy):
            report = asyncio.run(run_load(base, workload, args.num_requests, concurrency=args.concurrency,
                                          progress=False))
    return {"threads": "default" if threads is None else str(threads), "busy": busy, "load": load,
            "req_s": report.request_throughput, "tok_s": report.output_token_throughput,
            "p50": report.e2e_latency_s.get("p50", float("nan")), "p90": report.e2e_latency_s.get("p90", float("nan")),
            "accuracy": report.accuracy, "errors": sum(report.errors_by_status.values())}


def threads(argv: list[str]) -> None:
    """Request throughput, latency and accuracy of the server at each --threads, alone and beside busy
    neighbours, runs alternated."""
    parser = argparse.ArgumentParser(prog="server_vs_offline.py threads", description=threads.__doc__)
    parser.add_argument("--model", default=str(REPO / "models" / "llada-tiny"))
    parser.add_argument("--threads", default="1", help="comma-separated --threads values run beside the default")
    parser.add_argument("--busy", type=int, default=available_cpus(),
                        help="spinning processes in the busy runs (default: the CPUs this process may use)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    settings: list[Optional[int]] = [None, *(int(t) for t in args.threads.split(","))]
    print(f"# {platform.machine()} CPU, {os.cpu_count()} cores, {available_cpus()} usable by this process "
          f"(default --threads); torch {torch.__version__}; model {args.model}")
    print(f"# command: python bench/server_vs_offline.py threads --threads {args.threads} --busy {args.busy} "
          f"--rounds {args.rounds} --num-requests {args.num_requests} --concurrency {args.concurrency} "
          f"--seed {args.seed}")
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}; load = the machine's 1-minute load average before the run "
          f"(other work included); busy = spinning processes during the run")
    print(f"{'threads':>8} {'busy':>4} {'round':>5} {'load':>5} {'req/s':>7} {'tok/s':>7} {'p50 s':>7} "
          f"{'p90 s':>7} {'accuracy':>9} {'errors':>6}", flush=True)
    rows = []
    for round_ in range(args.rounds):
        for busy in (0, args.busy):
            order = settings if round_ % 2 == 0 else settings[::-1]  # alternate who goes first
            for setting in order:
                row = threads_run(setting, busy, args)
                rows.append(row)
                accuracy = "n/a" if row["accuracy"] is None else f"{100 * row['accuracy']:.1f} %"
                print(f"{row['threads']:>8} {busy:>4} {round_:>5} {row['load']:>5.1f} {row['req_s']:>7.2f} "
                      f"{row['tok_s']:>7.1f} {row['p50']:>7.3f} {row['p90']:>7.3f} {accuracy:>9} {row['errors']:>6}",
                      flush=True)
    print("# medians over rounds")
    for busy in (0, args.busy):
        for setting in settings:
            name = "default" if setting is None else str(setting)
            mine = [r for r in rows if r["threads"] == name and r["busy"] == busy]
            acc = [r["accuracy"] for r in mine if r["accuracy"] is not None]
            accuracy = f"{100 * statistics.median(acc):.1f} %" if acc else "n/a"
            print(f"threads {name:>7}, busy {busy}: {statistics.median(r['req_s'] for r in mine):.2f} req/s, "
                  f"p50 {statistics.median(r['p50'] for r in mine):.3f} s, "
                  f"p90 {statistics.median(r['p90'] for r in mine):.3f} s, accuracy {accuracy}")


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["threads"]:
        threads(argv[1:])
    else:
        compare(argv)


if __name__ == "__main__":
    main()
