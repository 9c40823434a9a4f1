"""How the likelihood estimator's spread falls with its sample count, and what that does to a
multiple-choice task, on the bundled models.

For each model and K in 1..64 samples per split: the estimate of log p(right worked answer | chat
prompt) for held-out additions (the sum lm-eval takes over the continuation's per-token logprobs,
S_c of engine.scoring), its mean and standard deviation over 100 seeds; and the accuracy on the lm-eval
multiple-choice items (bench/lm_eval/add_mc_n20_seed0.jsonl: the right answer against three with one
digit changed), mean over 5 seeds. For reference, the spread of one term of the estimator, from a
pool of 2,000 (sigma_1; K independent terms would give sigma_1 / sqrt(K), and the stratified mask
counts do no worse). The terms are heavy-tailed (a single masked token weighted by L / l, up to L),
so a spread measured over few seeds understates the small-K spread. Writes a table and a plot.

    python bench/score_variance.py --threads 2 > bench/results/score_variance_cpu.txt
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

import torch

from engine import Engine, EngineConfig
from engine.chat import chat_prompt_ids
from engine.scoring import sample_values, split_estimates

REPO = Path(__file__).resolve().parents[1]
ITEMS = REPO / "bench" / "lm_eval" / "add_mc_n20_seed0.jsonl"
SAMPLE_COUNTS = (1, 2, 4, 8, 16, 32, 64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--problems", type=int, default=5, help="additions whose estimate's spread is measured")
    parser.add_argument("--plot", default=str(REPO / "docs" / "figures" / "score_variance.png"))
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
