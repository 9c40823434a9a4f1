"""Host cost of the decide step alone: `StepRows.build` + `decide_step` + the step's one read.

The step-time benchmark (`bench/step_time.py`) times whole engine steps, whose model forward is
90 % of the time and varies ±15 % on a shared machine, so a change of a tenth of a millisecond in
the decide step is lost in it. Here the rows, their slots and the logits are fixed and only the
decide step runs, many times, so what it costs is measured alone: milliseconds per step (median of
7 rounds of 500) and the tensor operations it issues per step (counted, so independent of the
machine). Rows sit at different blocks and steps, as in a running batch.

    python bench/decide_step.py --threads 2
    PYTHONPATH=/path/to/other/tree python bench/decide_step.py --threads 2   # another tree's engine
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

import engine
from engine import DecodeParams, Engine, load_model
from engine.decoding.decide import DecodeState, StepRows, decide_step

REPO = Path(__file__).resolve().parents[1]

CONFIGS = {
    "cai (gate on)": DecodeParams(policy="cai", gating=True),
    "cai (gate off)": DecodeParams(policy="cai", gating=False),
    "threshold 0.9": DecodeParams(policy="threshold", threshold=0.9),
    "fixed": DecodeParams(policy="fixed"),
}


class _OpCounter(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += 1
        return func(*args, **(kwargs or {}))


def measure(model: torch.nn.Module, params: DecodeParams, batch: int, rounds: int, per_round: int) -> tuple[float, int]:
    """(median ms per decide step, tensor operations per step) for `batch` rows of `params`."""
    eng = Engine.from_model(model, max_batch=batch)
    params = DecodeParams(**{**params.__dict__, "gen_length": 128, "block_length": 32, "steps": 128})
    for i in range(batch):
        eng.add_request([1 + i, 2, 3], params)
    _, admitted = eng.scheduler.schedule()
    state = DecodeState(batch, model.device)
    for request in admitted:
        request.admit(request.slot, model.device)
        state.admit(request)
    for k, request in enumerate(eng.scheduler.running):  # rows at different blocks and steps
        request.block, request.step = k % request.num_blocks, k % 3
    mask_id = model.special.mask_id
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, 32, model.config.vocab_size, generator=generator) * 3
    blocks = torch.where(torch.rand(batch, 32, generator=generator) < 0.3, 5, mask_id)
    in_block = torch.ones(batch, 32, dtype=torch.bool)
    end_ids = torch.tensor(model.special.end_ids)
    rows_of_step = eng.scheduler.running

    def one_step() -> None:
        rows = StepRows.build(rows_of_step, model.device)
        _, summary = decide_step(state, rows, logits, blocks, in_block, mask_id, end_ids)
        summary.tolist()

    one_step()
    counter = _OpCounter()
    with counter:
        one_step()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(per_round):
            one_step()
        times.append(1000 * (time.perf_counter() - start) / per_round)
    return statistics.median(times), counter.count


def _tree() -> str:
    root = Path(engine.__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "?"
    return f"{root} at {commit}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--per-round", type=int, default=500)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(REPO / "models" / "llada-tiny")
    print(f"# {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, CPU; engine: "
          f"{_tree()}; bundled llada-tiny, block 32 (W = 32), median of {args.rounds} rounds of {args.per_round}")
    print(f"{'policy':16s} {'batch':>5s} {'ms/step':>8s} {'tensor ops/step':>16s}")
    for name, params in CONFIGS.items():
        for batch in (1, 8):
            ms, ops = measure(model, params, batch, args.rounds, args.per_round)
            print(f"{name:16s} {batch:5d} {ms:8.3f} {ops:16d}", flush=True)


if __name__ == "__main__":
    main()
