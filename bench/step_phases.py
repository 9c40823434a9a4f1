"""Where the host time of `Engine.step` goes, part by part, in a running batch.

`bench/step_time.py` gives the whole step and its forward; this splits what is outside the forward
into the engine's parts by timing the calls `Engine.step` makes (wrapped, not copied, so it times the
engine as it is): admission (`ModelRunner.admit`, `DecodeState.admit`), `StepRows.build`,
`ModelRunner.run` less its forwards (building the forwards' inputs), the decide step
(`decide_step`), the commit and the step's one read, and the scheduler's postprocess. Medians and
means over the steps of a run of `--requests` requests (CAI, or `--policy`; the bundled llada-tiny,
chat-free random prompts of 64 tokens, 128 generated in blocks of 32), `--batch` rows at a time.
With `--policy fixed` (one token a step) most steps are dual-cache steps of the whole batch.

    python bench/step_phases.py --threads 2
    python bench/step_phases.py --threads 2 --compile-decide
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import engine.engine as engine_module
from engine import DecodeParams, Engine, load_model
from engine.decoding.decide import StepRows

REPO = Path(__file__).resolve().parents[1]


class PhaseClock:
    """Seconds spent in each wrapped call during the current step."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[name] += time.perf_counter() - start
        return timed


def run(batch: int, requests: int, compile_decide: bool, policy: str) -> tuple[dict[str, tuple[float, float]], int]:
    model = load_model(REPO / "models" / "llada-tiny")
    eng = Engine.from_model(model, max_batch=batch, compile_decide=compile_decide)
    params = DecodeParams(policy=policy, gen_length=128, block_length=32, steps=128, cache="dual",
                          refresh_interval=16, early_exit=False)
    generator = torch.Generator().manual_seed(1)
    for _ in range(requests):
        eng.add_request(torch.randint(0, 40, (64,), generator=generator).tolist(), params)
    clock = PhaseClock()
    model.forward = clock.wrap("forward", model.forward)  # type: ignore[method-assign]
    eng.runner.run = clock.wrap("run", eng.runner.run)  # type: ignore[method-assign]
    eng.runner.admit = clock.wrap("admit", eng.runner.admit)  # type: ignore[method-assign]
    eng.runner.commit = clock.wrap("commit", eng.runner.commit)  # type: ignore[method-assign]
    eng.decode_state.admit = clock.wrap("admit", eng.decode_state.admit)  # type: ignore[method-assign]
    eng.scheduler.postprocess = clock.wrap("postprocess", eng.scheduler.postprocess)  # type: ignore[method-assign]
    original_decide, original_build = engine_module.decide_step, StepRows.__dict__["build"]
    engine_module.decide_step = clock.wrap("decide", original_decide)
    StepRows.build = clock.wrap("build", StepRows.build)  # type: ignore[method-assign]
    per_step: dict[str, list[float]] = defaultdict(list)
    try:
        warm = 3  # first-call allocations (and, compiled, the compilation)
        while eng.has_unfinished():
            clock.spent.clear()
            start = time.perf_counter()
            eng.step()
            took = time.perf_counter() - start
            if warm:
                warm -= 1
                continue
            spent = dict(clock.spent)
            per_step["step"].append(took)
            per_step["outside the forward"].append(took - spent.get("forward", 0.0))
            per_step["forward"].append(spent.get("forward", 0.0))
            per_step["admission"].append(spent.get("admit", 0.0))
            per_step["StepRows.build"].append(spent.get("build", 0.0))
            per_step["run less its forwards"].append(spent.get("run", 0.0) - spent.get("forward", 0.0))
            per_step["decide step"].append(spent.get("decide", 0.0))
            per_step["commit"].append(spent.get("commit", 0.0))
            per_step["postprocess"].append(spent.get("postprocess", 0.0))
            accounted = sum(spent.get(k, 0.0) for k in ("admit", "build", "run", "decide", "commit", "postprocess"))
            per_step["the rest (schedule, the read)"].append(took - accounted)
    finally:
        engine_module.decide_step = original_decide
        StepRows.build = original_build  # type: ignore[method-assign]
    steps = len(per_step["step"])
    return {name: (1000 * statistics.median(values), 1000 * statistics.mean(values))
            for name, values in per_step.items()}, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--requests", type=int, default=80)
    parser.add_argument("--compile-decide", action="store_true", help="EngineConfig.compile_decide")
    parser.add_argument("--policy", default="cai", help="fixed: one token a step, so most steps are dual-cache steps")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    medians, steps = run(args.batch, args.requests, args.compile_decide, args.policy)
    flags = " --compile-decide" if args.compile_decide else ""
    flags += f" --policy {args.policy}" if args.policy != "cai" else ""
    print(f"# {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, CPU; bundled "
          f"llada-tiny, {args.policy} + dual, batch {args.batch}, {args.requests} requests, {steps} steps after 3 "
          f"warm-up")
    print(f"# command: python bench/step_phases.py --threads {args.threads} --batch {args.batch} "
          f"--requests {args.requests}{flags}")
    print(f"{'part':32s} {'median ms':>9s} {'mean ms':>8s}")
    for name, (median, mean) in medians.items():
        print(f"{name:32s} {median:9.3f} {mean:8.3f}")


if __name__ == "__main__":
    main()
