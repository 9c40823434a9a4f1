"""How slow host work runs right after a forward on this machine: the first small operation after a
model forward (and a pure-Python loop after a large matmul) against the same work a moment later.

This is why the engine builds every forward's inputs of a step before running its forwards
(`ModelRunner.run`): host work placed between two forwards runs on the caches the first has flushed.
Medians of `--repeats` pairs; threads as given.

    python bench/cold_after_forward.py --threads 2
    python bench/cold_after_forward.py --threads 1
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine import load_model

REPO = Path(__file__).resolve().parents[1]


def after(heavy: Callable[[], object], light: Callable[[], object], repeats: int) -> tuple[float, float]:
    """(median us of `light` right after `heavy`, median us of `light` run again at once)."""
    cold, warm = [], []
    for _ in range(repeats):
        heavy()
        start = time.perf_counter()
        light()
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        light()
        warm.append(time.perf_counter() - start)
    return 1e6 * statistics.median(cold), 1e6 * statistics.median(warm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(REPO / "models" / "llada-tiny")
    ids = torch.randint(0, 100, (8, 192), generator=torch.Generator().manual_seed(0))
    rows, block = torch.arange(8), torch.arange(32)
    big, weight, out = torch.randn(8, 192, 1024), torch.randn(1024, 1024), torch.empty(8, 192, 1024)

    def forward() -> None:
        with torch.no_grad():
            model(ids)

    def small_op() -> None:
        _ = rows[:, None] + block

    def python_loop() -> None:
        total = 0
        for k in range(200):
            total += k

    def matmul() -> None:
        torch.matmul(big, weight.t(), out=out)

    print(f"# {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, CPU; medians of "
          f"{args.repeats}")
    print(f"# command: python bench/cold_after_forward.py --threads {args.threads} --repeats {args.repeats}")
    print(f"{'what':52s} {'right after us':>14s} {'again us':>9s}")
    for label, heavy, light in (("[8,1] + [32] after a batch-8 llada-tiny forward (192 tok)", forward, small_op),
                                ("[8,1] + [32] after a [1536,1024] x [1024,1024] matmul", matmul, small_op),
                                ("200-step Python loop after that matmul", matmul, python_loop)):
        cold, warm = after(heavy, light, args.repeats)
        print(f"{label:52s} {cold:14.1f} {warm:9.1f}", flush=True)


if __name__ == "__main__":
    main()
