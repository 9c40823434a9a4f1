"""Offline generated tokens/s of this tree against a baseline tree (an older main in a git worktree),
measured in the same run: the same held-out problems, decoding and threads, runs alternated.

A shared or virtual machine has slow phases (the same matmul loop taking much longer, in CPU time
too, for tens of seconds at a time) that hit either tree at random, so the ratio is given two ways:
of the medians, and of the best runs (each engine's speed when the machine is in its fast state, as
`timeit` takes the minimum).

Each run is a fresh interpreter with PYTHONPATH set to its tree, so each tree decodes with its own
engine; the worker below imports what both layouts have (`engine.Engine`, `engine.chat`, and the
task family from `tinymodels` or, in older trees, `engine.builtin`). Generated tokens are the
response tokens (before the end token); accuracy is exact match, the same grader as `cai-dllm eval`.
"forward" is the median share of a run's time spent inside `model.forward` (and a block-diffusion
model's `forward_cached`; the rest is the host's): what the host side of an engine can win at most.

    git worktree add /tmp/main-old <commit>
    python bench/offline_vs_baseline.py --baseline /tmp/main-old --n 256 --repeats 3 \
        > bench/results/offline_vs_baseline_cpu.txt

A configuration decodes `--model` unless it names its own built-in model (`MODELS`): the block
policy runs on `models/sdar-tiny`, with its trained block, the uniform-noise one on
`models/diffusiongemma-tiny`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CONFIGS = {
    "cai dual": {"policy": "cai", "gen_length": 128, "block_length": 32, "steps": 128, "cache": "dual",
                 "refresh_interval": 16},
    "cai": {"policy": "cai", "gen_length": 128, "block_length": 32, "steps": 128},
    "threshold 0.9 dual": {"policy": "threshold", "threshold": 0.9, "gen_length": 128, "block_length": 32,
                           "steps": 128, "cache": "dual", "refresh_interval": 16},
    "block-dynamic 0.9 sdar": {"policy": "block-dynamic", "threshold": 0.9, "gen_length": 128, "steps": 128},
    # each request seeded: a uniform-noise model samples
    "dg-official diffusiongemma": {"policy": "dg-official", "gen_length": 128, "seed": 0},
}
MODELS = {"block-dynamic 0.9 sdar": REPO / "models" / "sdar-tiny",  # configurations not on --model
          "dg-official diffusiongemma": REPO / "models" / "diffusiongemma-tiny"}


def worker(model: str, n: int, batch: int, threads: int, config: str) -> None:
    import time

    import torch

    torch.set_num_threads(threads)
    from engine import DecodeParams, Engine, EngineConfig
    from engine.chat import chat_prompt_ids

    try:
        from tinymodels.evaluate import held_out_problems
        from tinymodels.tasks import answer_of
    except ImportError:  # a tree from before the task family left the engine package
        from engine.builtin.evaluate import held_out_problems
        from engine.builtin.tasks import answer_of

    engine = Engine(EngineConfig(model=model, max_batch=batch))
    problems = held_out_problems(n, 0)
    prompts = [chat_prompt_ids(engine.tokenizer, [{"role": "user", "content": p.prompt}]) for p in problems]
    params = DecodeParams(**CONFIGS[config])
    engine.generate(prompts[:batch], params)  # warm-up
    in_forward = [0.0]

    def timed(forward):  # type: ignore[no-untyped-def]
        def timed_forward(*args, **kwargs):  # type: ignore[no-untyped-def]
            begun = time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                in_forward[0] += time.perf_counter() - begun
        return timed_forward

    # instance attributes: what the engine calls, timed (a block-diffusion model's cached forward, a
    # uniform-noise model's encoder and decoder passes)
    for name in ("forward", "forward_cached", "encode", "decode"):
        if hasattr(engine.model, name):
            setattr(engine.model, name, timed(getattr(engine.model, name)))
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    correct = sum(answer_of(p.kind, r.text or "") == p.answer for p, r in zip(problems, results, strict=True))
    print(json.dumps({"seconds": seconds, "forward_seconds": in_forward[0],
                      "tokens": sum(len(r.response_ids) for r in results),
                      "nfe": sum(r.stats.nfe for r in results), "correct": correct,
                      "texts": [r.text for r in results]}))


def run(tree: Path, args: argparse.Namespace, config: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    model = str(MODELS.get(config, args.model))
    out = subprocess.run([sys.executable, __file__, "--worker", "--model", model, "--n", str(args.n),
                          "--batch", str(args.batch), "--threads", str(args.threads), "--config", config],
                         cwd=tree, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, help="the tree to compare with (a git worktree)")
    parser.add_argument("--model", default=str(REPO / "models" / "llada-tiny"))
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--configs", default=";".join(CONFIGS), help="';'-separated names of CONFIGS")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.model, args.n, args.batch, args.threads, args.config)
        return
    if args.baseline is None:
        parser.error("--baseline is required")
    baseline_commit = subprocess.run(["git", "-C", str(args.baseline), "rev-parse", "--short", "HEAD"],
                                     capture_output=True, text=True).stdout.strip()
    this_commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                 capture_output=True, text=True).stdout.strip()
    print(f"# {platform.machine()}, {args.threads} threads, CPU, float32; {args.n} held-out problems of "
          f"{Path(args.model).name} (sdar-tiny where a configuration says so), batch {args.batch}; runs "
          f"alternated, {args.repeats} each")
    print(f"# this tree: {this_commit} (+ uncommitted changes if any); baseline: {baseline_commit}")
    print(f"# command: python bench/offline_vs_baseline.py --baseline {args.baseline} --n {args.n} "
          f"--batch {args.batch} --threads {args.threads} --repeats {args.repeats} --configs '{args.configs}'")
    print(f"{'configuration':20s} {'tree':9s} {'tok/s runs':32s} {'median':>8s} {'best':>6s} {'accuracy':>9s} "
          f"{'NFE':>6s} {'forward':>8s}")
    for config in args.configs.split(";"):
        rates: dict[str, list[float]] = {"baseline": [], "this": []}
        shares: dict[str, list[float]] = {"baseline": [], "this": []}  # of each run's time, in model.forward
        last: dict[str, dict] = {}
        for _ in range(args.repeats):
            for name, tree in (("baseline", args.baseline), ("this", REPO)):
                out = run(tree, args, config)
                rates[name].append(out["tokens"] / out["seconds"])
                shares[name].append(out["forward_seconds"] / out["seconds"])
                last[name] = out
        for name in ("baseline", "this"):
            runs = " ".join(f"{r:.0f}" for r in rates[name])
            print(f"{config:20s} {name:9s} {runs:32s} {statistics.median(rates[name]):8.0f} {max(rates[name]):6.0f} "
                  f"{100 * last[name]['correct'] / args.n:8.1f}% {last[name]['nfe']:6d} "
                  f"{100 * statistics.median(shares[name]):7.1f}%")
        same = sum(a == b for a, b in zip(last["baseline"]["texts"], last["this"]["texts"], strict=True))
        ratio = statistics.median(rates["this"]) / statistics.median(rates["baseline"])
        best = max(rates["this"]) / max(rates["baseline"])
        print(f"{config:20s} this/baseline = {ratio:.2f}x of the medians, {best:.2f}x of the best runs; "
              f"identical texts {same}/{args.n}", flush=True)


if __name__ == "__main__":
    main()
