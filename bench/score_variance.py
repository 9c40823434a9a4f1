"""Likelihood scoring (`echo` + `logprobs`, engine/scoring.py) on the bundled models: how the
estimator's spread falls with its sample count, and what scoring costs when the server runs it in
chunks between decode steps.

Spread (the default). For each model and K in 1..64 samples per split: the estimate of log p(right
worked answer | chat prompt) for held-out additions (the sum lm-eval takes over the continuation's
per-token logprobs, S_c of engine.scoring), its mean and standard deviation over 100 seeds; and the
accuracy on the lm-eval multiple-choice items (bench/lm_eval/add_mc_n20_seed0.jsonl: the right answer
against three with one digit changed), mean over 5 seeds. For reference, the spread of one term of
the estimator, from a pool of 2,000 (sigma_1; K independent terms would give sigma_1 / sqrt(K), and
the stratified mask counts do no worse). The terms are heavy-tailed (a single masked token weighted
by L / l, up to L), so a spread measured over few seeds understates the small-K spread. Writes a
table and a plot.

Chunks (`chunks`). The server runs a scoring request as forwards of at most `--score-chunk-tokens`
tokens between decode steps, so a decode step waits on at most one of them; `--max-score-tokens`
(the most tokens one request may feed the model) defaults to what the bundled model scores within
`--stall-timeout` on a 2-core CPU. This measures both on a prompt of `--prompt-len` tokens with
`--samples` samples per split (by default a 300-token prompt at the server's 16 samples: 1.43 M
tokens, above that limit), running `--chunks` chunks of each size rather than whole jobs; and,
beside them, the median step of a full batch of ordinary requests.

    python bench/score_variance.py --threads 2 > bench/results/score_variance_cpu.txt
    python bench/score_variance.py chunks --threads 1 > bench/results/score_variance_chunks_cpu.txt
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from engine import Engine, EngineConfig
from engine.chat import chat_prompt_ids
from engine.scoring import ScoringJob, sample_values, scoring_cost, split_estimates
from server.settings import ServerSettings
from tinymodels.evaluate import prompt_ids
from tinymodels.tasks import sample

REPO = Path(__file__).resolve().parents[1]
ITEMS = REPO / "bench" / "lm_eval" / "add_mc_n20_seed0.jsonl"
SAMPLE_COUNTS = (1, 2, 4, 8, 16, 32, 64)


def spread(argv: list[str]) -> None:
    """The estimate's spread over seeds and the multiple-choice accuracy, against K."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="chunks: python bench/score_variance.py chunks --help")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--problems", type=int, default=5, help="additions whose estimate's spread is measured")
    parser.add_argument("--plot", default=str(REPO / "docs" / "figures" / "score_variance.png"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    items = [json.loads(line) for line in ITEMS.read_text().splitlines()]
    print(f"# {platform.machine()}, {args.threads} threads, torch {torch.__version__}, CPU, float32")
    print(f"# command: python bench/score_variance.py --threads {args.threads} --seeds {args.seeds} "
          f"--problems {args.problems}")
    print(f"# spread: log p(right answer | prompt) over {args.seeds} seeds, mean of the per-problem std over "
          f"{args.problems} held-out additions; accuracy: {len(items)} four-way items, mean over 5 seeds")
    print(f"{'model':12s} {'K':>3s} {'estimate':>9s} {'std':>7s} {'sigma_1/sqrt(K)':>15s} {'accuracy':>8s}")
    curves: dict[str, tuple[float, list[float]]] = {}
    for name in ("llada-tiny", "dream-tiny"):
        engine = Engine(EngineConfig(model=str(REPO / "models" / name)))
        tokenizer = engine.tokenizer
        scored = []
        for item in items:
            context = chat_prompt_ids(tokenizer, [{"role": "user", "content": item["prompt"]}])
            choices = [context + tokenizer.encode(choice, add_special_tokens=False) for choice in item["choices"]]
            scored.append((context, choices, item["label"]))
        pooled = [float(sample_values(engine.model, choices[label], [len(context)], 2000, seed=10_000).std())
                  for context, choices, label in scored[:args.problems]]
        sigma_1 = statistics.fmean(pooled)
        curves[name] = (sigma_1, [])
        for k in SAMPLE_COUNTS:
            spreads, means = [], []
            for context, choices, label in scored[:args.problems]:
                values = [float(split_estimates(engine.model, choices[label], [len(context)], k, seed)[0])
                          for seed in range(args.seeds)]
                spreads.append(statistics.stdev(values))
                means.append(statistics.fmean(values))
            accuracy = []
            for seed in range(5):
                right = 0
                for context, choices, label in scored:
                    estimates = [float(split_estimates(engine.model, ids, [len(context)], k, seed)[0])
                                 for ids in choices]
                    right += max(range(len(estimates)), key=estimates.__getitem__) == label
                accuracy.append(right / len(scored))
            spread = statistics.fmean(spreads)
            curves[name][1].append(spread)
            print(f"{name:12s} {k:3d} {statistics.fmean(means):9.3f} {spread:7.3f} {sigma_1 / k ** 0.5:15.3f} "
                  f"{statistics.fmean(accuracy):8.2f}", flush=True)
    _plot(curves, Path(args.plot))


def _plot(curves: dict[str, tuple[float, list[float]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for name, (sigma_1, spread) in curves.items():
        line, = ax.plot(SAMPLE_COUNTS, spread, marker="o", label=f"{name} (over seeds)")
        ax.plot(SAMPLE_COUNTS, [sigma_1 / k ** 0.5 for k in SAMPLE_COUNTS], linestyle=":", color=line.get_color(),
                label=f"{name}: sigma_1 / sqrt(K)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("samples per split (K)")
    ax.set_ylabel("std of log p(answer | prompt), nats")
    ax.set_title("Monte-Carlo likelihood: spread vs samples per split")
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


def step_seconds(engine: Engine, steps: int) -> float:
    """Median step of a full batch of held-out problems at the server's default decoding."""
    problems = sample(engine.max_batch * 4, seed=0)
    for problem in problems:
        engine.add_request(prompt_ids(engine, problem, "chat"))
    times = []
    while engine.has_unfinished() and len(times) < steps:
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    engine.reset()
    return statistics.median(times[2:] or times)


def chunks(argv: list[str]) -> None:
    """The time of one scoring chunk per chunk size, beside a decode step, and the tokens a stall
    timeout's worth of chunks scores."""
    parser = argparse.ArgumentParser(prog="score_variance.py chunks", description=chunks.__doc__)
    parser.add_argument("--model", default=str(REPO / "models" / "llada-tiny"))
    parser.add_argument("--prompt-len", type=int, default=300)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--chunk-tokens", default="512,1024,2048,4096,8192")
    parser.add_argument("--chunks", type=int, default=24, help="chunks timed per size (after one warm-up)")
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed")
    parser.add_argument("--threads", type=int, help="torch threads (default: the engine's, EngineConfig.threads)")
    args = parser.parse_args(argv)
    engine = Engine(EngineConfig(model=args.model, threads=args.threads))
    stall = ServerSettings().stall_timeout
    text = ("0123456789+-=;" * args.prompt_len)[:args.prompt_len]
    ids = engine.tokenizer.encode(text, add_special_tokens=False)[:args.prompt_len]
    cost = scoring_cost(len(ids), args.samples)
    print(f"# {platform.machine()} CPU, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"model {args.model}; 1-minute load average {os.getloadavg()[0]:.1f} (other work on the machine included)")
    print(f"# command: python bench/score_variance.py chunks --prompt-len {args.prompt_len} --samples {args.samples} "
          f"--chunk-tokens {args.chunk_tokens} --chunks {args.chunks} --steps {args.steps}"
          + (f" --threads {args.threads}" if args.threads else ""))
    print(f"# a prompt of {len(ids)} tokens, {args.samples} samples per split: {cost} scoring tokens in all")
    print(f"decode step, batch {engine.max_batch} (default decoding): {1000 * step_seconds(engine, args.steps):.1f} ms")
    print(f"{'chunk tokens':>12} {'rows':>5} {'chunk ms (median)':>18} {'max ms':>7} {'tokens/s':>9} "
          f"{'tokens within ' + format(stall, 'g') + ' s':>20}")
    for chunk in (int(c) for c in args.chunk_tokens.split(",")):
        job = ScoringJob(engine.model, ids, args.samples, seed=0, chunk_tokens=chunk)
        job.advance()  # warm-up
        times, fed = [], 0
        for _ in range(args.chunks):
            if job.done:
                break
            started = time.perf_counter()
            fed += job.advance()
            times.append(time.perf_counter() - started)
        rate = fed / sum(times)
        rows = max(1, chunk // len(ids))
        print(f"{chunk:>12} {rows:>5} {1000 * statistics.median(times):>18.1f} {1000 * max(times):>7.1f} "
              f"{rate:>9.0f} {int(rate * stall):>20}", flush=True)


def main(argv: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["chunks"]:
        chunks(argv[1:])
    else:
        spread(argv)


if __name__ == "__main__":
    main()
