"""The CPU commands' thread count and OpenMP wait policy, alone and beside busy neighbours.

Each run is a real `cai-dllm` command in a subprocess (`score`, `eval`, `generate`; `serve` under the
closed-loop load of `bench/server_vs_offline.py threads`), timed from start to exit (model loading
included: what a user waits for). Settings: `--threads` (the default and each value asked for) x
OpenMP's wait policy (`passive`: waiting threads sleep at once; `openmp`: the OpenMP runtime's own
default, which spins a while first, as torch gets it when nothing sets the variable). A busy run
first starts `--busy` processes that spin for as long as the command runs, as a neighbour on shared
cores (or a container over its CPU quota) would. Runs alternate between the settings, round after
round, so a change in the machine's own load affects each alike; the 1-minute load average before
each run is printed. Every run's answer is checked against the first run of the same command
(`same`): the thread count and the wait policy change the time, never the result (eval's table,
score's numbers to 2 decimals, generate's texts).

    python bench/cli_threads.py --rounds 2 > bench/results/cli_threads_cpu.txt
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from bench.server_vs_offline import busy_neighbours, threads_run
from engine.cpus import available_cpus

REPO = Path(__file__).resolve().parents[1]
POLICIES = {"passive": "PASSIVE", "openmp": ""}  # "" leaves OpenMP's own default (server/cli/openmp.py)
RIGHT = "7+8+0=15;5+3+1=09;4+0+0=04;0+0+0=00;0+0+0=00;=000495"


def commands(model: str, eval_n: int) -> dict[str, list[str]]:
    """Each offline command as a user would type it (the README's), on the built-in model."""
    cli = [sys.executable, "-m", "server.cli"]
    wrong = [RIGHT.replace("=000495", f"=00049{d}") for d in (4, 6, 7)]
    return {
        "score": [*cli, "score", "--model", model, "--chat", "--context", "00457+00038", "--json",
                  *(arg for text in (RIGHT, *wrong) for arg in ("--continuation", text))],
        "eval": [*cli, "eval", "--model", model, "--n", str(eval_n), "--configs",
                 "fixed+exit;threshold 0.9 dual+exit;CAI full, gate on +exit"],
        "generate": [*cli, "generate", "--model", model, "--chat", "--json",
                     *(arg for p in ("00457+00038", "sum a3 b5 c2 d1 e5 f3 g0", "00023+00045", "91234-00567",
                                     "sum a1 b9 c4", "50000-49999", "00999+00001", "sum z9 y8 x7 w6")
                       for arg in ("--prompt", p))],
    }


def answer(command: str, stdout: str) -> str:
    """What must not change between settings: score's numbers, eval's table, generate's texts."""
    if command == "generate":
        return json.dumps([json.loads(line)["text"] for line in stdout.splitlines() if line.startswith("{")])
    if command == "eval":  # the table without its timing columns (tok/s)
        rows = [line.split("|") for line in stdout.splitlines() if line.startswith("|")]
        return json.dumps([r[:7] + r[8:] if len(r) > 8 else r for r in rows])
    # score: each continuation's log-likelihood to 2 decimals (the thread count changes the order of
    # floating-point sums, so the last digits may differ)
    return json.dumps([round(json.loads(line)["logprob"], 2) for line in stdout.splitlines() if line.startswith("{")])


def run_command(argv: list[str], threads: Optional[int], policy: str, busy: int) -> tuple[float, str]:
    env = {**os.environ, "OMP_WAIT_POLICY": POLICIES[policy]}
    flags = [] if threads is None else ["--threads", str(threads)]
    with busy_neighbours(busy):
        start = time.perf_counter()
        done = subprocess.run([*argv, *flags], cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
        seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stderr[-2000:]}")
    return seconds, done.stdout


def serve_run(threads: Optional[int], policy: str, busy: int, args: argparse.Namespace) -> tuple[float, str]:
    """Seconds for the closed-loop load on a running server, and its accuracy."""
    saved = os.environ.get("OMP_WAIT_POLICY")
    os.environ["OMP_WAIT_POLICY"] = POLICIES[policy]
    try:
        row = threads_run(threads, busy, argparse.Namespace(model=args.model, num_requests=args.num_requests,
                                                            concurrency=8, seed=0))
    finally:
        if saved is None:
            os.environ.pop("OMP_WAIT_POLICY")
        else:
            os.environ["OMP_WAIT_POLICY"] = saved
    return args.num_requests / row["req_s"], f"accuracy {row['accuracy']}, errors {row['errors']}"


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO / "models" / "llada-tiny"))
    parser.add_argument("--commands", default="score,eval,generate,serve", help="comma-separated")
    parser.add_argument("--threads", default="1", help="comma-separated --threads values run beside the default")
    parser.add_argument("--policies", default="passive,openmp", help=f"comma-separated, of {', '.join(POLICIES)}")
    parser.add_argument("--busy", type=int, default=available_cpus(),
                        help="spinning processes in the busy runs (default: the CPUs this process may use)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--eval-n", type=int, default=16, help="eval's --n")
    parser.add_argument("--num-requests", type=int, default=48, help="serve: requests of the closed-loop load")
    args = parser.parse_args(argv)
    settings = [(t, p) for t in [None, *(int(x) for x in args.threads.split(","))] for p in args.policies.split(",")]
    names = args.commands.split(",")
    argvs = commands(args.model, args.eval_n)
    print(f"# {platform.machine()} CPU, {os.cpu_count()} cores, {available_cpus()} usable by this process "
          f"(the default --threads); torch {torch.__version__}; model {args.model}")
    print(f"# command: python bench/cli_threads.py --commands {args.commands} --threads {args.threads} "
          f"--policies {args.policies} --busy {args.busy} --rounds {args.rounds} --eval-n {args.eval_n} "
          f"--num-requests {args.num_requests}")
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}; seconds = wall clock of the whole command (serve: of the load "
          f"on a ready server); load = the 1-minute load average before the run; busy = spinning processes")
    print(f"{'command':>8} {'threads':>7} {'policy':>7} {'busy':>4} {'round':>5} {'load':>5} {'seconds':>8} same",
          flush=True)
    rows, first = [], {}
    for round_ in range(args.rounds):
        for name in names:
            for busy in (0, args.busy):
                order = settings if round_ % 2 == 0 else settings[::-1]  # alternate who goes first
                for threads, policy in order:
                    load = os.getloadavg()[0]
                    if name == "serve":
                        seconds, out = serve_run(threads, policy, busy, args)
                    else:
                        seconds, stdout = run_command(argvs[name], threads, policy, busy)
                        out = answer(name, stdout)
                    same = first.setdefault(name, out) == out
                    rows.append((name, "default" if threads is None else str(threads), policy, busy, seconds))
                    print(f"{name:>8} {rows[-1][1]:>7} {policy:>7} {busy:>4} {round_:>5} {load:>5.1f} {seconds:>8.2f} "
                          f"{'yes' if same else 'NO'}{'' if name != 'serve' else '  ' + out}", flush=True)
    print("# medians over rounds, seconds (lower is better)")
    for name in names:
        for busy in (0, args.busy):
            cells = []
            for threads, policy in settings:
                label = "default" if threads is None else str(threads)
                times = [r[4] for r in rows if r[:4] == (name, label, policy, busy)]
                cells.append(f"threads {label}/{policy}: {statistics.median(times):.2f}")
            print(f"{name:>8}, busy {busy}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
