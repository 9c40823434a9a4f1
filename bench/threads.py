"""The server's CPU thread count under load, with and without another process busy on the same cores.

Starts `cai-dllm serve` once per run (the default `--threads`, and each `--threads N` asked for),
sends the same closed-loop load with the built-in load generator (`cai-dllm bench serve`'s
`run_load`: streamed chat requests of held-out built-in problems) and reports request throughput,
end-to-end latency and exact-match accuracy. A "busy" run first starts `--busy` processes that spin
on the CPU for as long as the load runs, as a neighbour on shared cores (or a container over its
CPU quota) would. Runs alternate between the thread settings, round after round, so a change in the
machine's own load affects each alike; the 1-minute load average before each run is printed, since
other work on the machine is part of what is measured.

    python bench/threads.py --rounds 2 --num-requests 48 --concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from serverproc import running_server  # noqa: E402

from bench.load_generator import builtin_workload, run_load  # noqa: E402
from engine.cpus import available_cpus  # noqa: E402


def _spin() -> None:
    while True:
        pass


@contextmanager
def busy_neighbours(count: int) -> Iterator[None]:
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


def one_run(threads: Optional[int], busy: int, args: argparse.Namespace) -> dict:
    flags = [] if threads is None else ["--threads", str(threads)]
    workload = builtin_workload(args.num_requests, args.seed)
    with running_server(*flags, "--model", args.model) as (base, _):
        asyncio.run(run_load(base, workload, args.concurrency, concurrency=args.concurrency, progress=False))
        load = os.getloadavg()[0]
        with busy_neighbours(busy):
            report = asyncio.run(run_load(base, workload, args.num_requests, concurrency=args.concurrency,
                                          progress=False))
    return {"threads": "default" if threads is None else str(threads), "busy": busy, "load": load,
            "req_s": report.request_throughput, "tok_s": report.output_token_throughput,
            "p50": report.e2e_latency_s.get("p50", float("nan")), "p90": report.e2e_latency_s.get("p90", float("nan")),
            "accuracy": report.accuracy, "answered": report.answered, "completed": report.completed,
            "errors": sum(report.errors_by_status.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(REPO / "models" / "llada-tiny"))
    parser.add_argument("--threads", default="1", help="comma-separated --threads values run beside the default")
    parser.add_argument("--busy", type=int, default=available_cpus(),
                        help="spinning processes in the busy runs (default: the CPUs this process may use)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import torch

    settings: list[Optional[int]] = [None, *(int(t) for t in args.threads.split(","))]
    print(f"# {platform.machine()} CPU, {os.cpu_count()} cores, {available_cpus()} usable by this process "
          f"(default --threads); torch {torch.__version__}; model {args.model}")
    print(f"# command: python bench/threads.py --threads {args.threads} --busy {args.busy} --rounds {args.rounds} "
          f"--num-requests {args.num_requests} --concurrency {args.concurrency} --seed {args.seed}")
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}; load = the machine's 1-minute load average before the run "
          f"(other work included); busy = spinning processes during the run")
    print(f"{'threads':>8} {'busy':>4} {'round':>5} {'load':>5} {'req/s':>7} {'tok/s':>7} {'p50 s':>7} "
          f"{'p90 s':>7} {'accuracy':>9} {'errors':>6}", flush=True)
    rows = []
    for round_ in range(args.rounds):
        for busy in (0, args.busy):
            order = settings if round_ % 2 == 0 else settings[::-1]  # alternate who goes first
            for threads in order:
                row = one_run(threads, busy, args)
                rows.append(row)
                accuracy = "n/a" if row["accuracy"] is None else f"{100 * row['accuracy']:.1f} %"
                print(f"{row['threads']:>8} {busy:>4} {round_:>5} {row['load']:>5.1f} {row['req_s']:>7.2f} "
                      f"{row['tok_s']:>7.1f} {row['p50']:>7.3f} {row['p90']:>7.3f} {accuracy:>9} {row['errors']:>6}",
                      flush=True)
    print("# medians over rounds")
    for busy in (0, args.busy):
        for threads in settings:
            name = "default" if threads is None else str(threads)
            mine = [r for r in rows if r["threads"] == name and r["busy"] == busy]
            acc = [r["accuracy"] for r in mine if r["accuracy"] is not None]
            accuracy = f"{100 * statistics.median(acc):.1f} %" if acc else "n/a"
            print(f"threads {name:>7}, busy {busy}: {statistics.median(r['req_s'] for r in mine):.2f} req/s, "
                  f"p50 {statistics.median(r['p50'] for r in mine):.3f} s, "
                  f"p90 {statistics.median(r['p90'] for r in mine):.3f} s, accuracy {accuracy}")


if __name__ == "__main__":
    main()
