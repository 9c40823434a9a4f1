"""The host-time bar's row of `bench/step_time.py` (llada-tiny, batch 8, CAI + dual) run `--runs` times
in one interpreter, for comparing two engines run by run: this VM's phases move host timings by a
quarter within minutes, so only alternated runs of two trees say which is faster.

    git worktree add /tmp/other <commit>
    for i in 1 2 3; do PYTHONPATH=/tmp/other python bench/host_time_ab.py; python bench/host_time_ab.py; done
    for i in 1 2; do python bench/host_time_ab.py --count-reads; python bench/host_time_ab.py; done
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_time import REPO, load_model, measure

import engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--count-reads", action="store_true",
                        help="count host reads inside the timed steps, as step_time.py did before (what that costs)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(REPO / "models" / "llada-tiny")
    outside = [measure(model, 8, "dual", 48, count_reads_while_timed=args.count_reads)["outside_ms"]
               for _ in range(args.runs)]
    tree = Path(engine.__file__).resolve().parents[1]
    counted = " (reads counted while timed)" if args.count_reads else ""
    runs = " ".join(f"{v:.3f}" for v in outside)
    print(f"engine {tree}{counted}: outside ms {runs}; median {statistics.median(outside):.3f}", flush=True)


if __name__ == "__main__":
    main()
