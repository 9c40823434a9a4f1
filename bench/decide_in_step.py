"""The decide step inside a running engine against the same call replayed on its own.

`bench/decide_step.py` times the decide step alone and `bench/step_phases.py` times it inside
`Engine.step`; the two differ by more than half. This runs a batch kept full by a queue (CAI + dual,
the bundled llada-tiny, as step_phases) and times, inside each step, `decide_step` and two of its
parts (`DecodeState.theta_block`, one gather, and `decide_tensors`, the tensor work); then it
replays the last full-batch step's call 300 times with no forward in between. The ratio is how much slower the
same host work runs right after a model forward on this machine (see bench/cold_after_forward.py).
A second table replays the call after other work instead: a forward, a 16 MB memory sweep, a 5 ms
sleep, a 5 ms pure-Python busy loop: which of them makes the host work after it slow says whether
it is the data caches (the sweep) or the machine's state after anything else ran (the sleep).
`--compile auto|static` swaps `decide_tensors` for `torch.compile` of it (automatic dynamic shapes,
or static shapes: one graph per batch size), the engine's `compile_decide` switch made either way.

    python bench/decide_in_step.py --threads 2
    python bench/decide_in_step.py --threads 2 --compile auto
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
from engine.decoding import decide

REPO = Path(__file__).resolve().parents[1]
BATCH = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--requests", type=int, default=80)
    parser.add_argument("--compile", choices=("off", "auto", "static"), default="off")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spent: dict[str, list[float]] = defaultdict(list)

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name].append(time.perf_counter() - start)
        return call

    tensors = decide.decide_tensors
    if args.compile != "off":
        tensors = torch.compile(tensors, dynamic=None if args.compile == "auto" else False)
    decide.decide_tensors = timed("decide_tensors", tensors)  # what decide_step calls, by module global
    decide.DecodeState.theta_block = timed("theta_block", decide.DecodeState.theta_block)  # type: ignore[method-assign]
    calls: list[tuple[Any, ...]] = []
    untimed_decide = engine_module.decide_step

    def remember(*a: Any) -> Any:
        if len(a[1].requests) == BATCH:  # a[1]: the step's rows; the replay is of a full batch's step
            calls[:] = [a]
        return untimed_decide(*a)

    engine_module.decide_step = timed("decide_step", remember)
    eng = Engine.from_model(load_model(REPO / "models" / "llada-tiny"), max_batch=BATCH)
    params = DecodeParams(policy="cai", gen_length=128, block_length=32, steps=128, cache="dual",
                          refresh_interval=16, early_exit=False)
    generator = torch.Generator().manual_seed(1)
    for _ in range(args.requests):
        eng.add_request(torch.randint(0, 40, (64,), generator=generator).tolist(), params)
    for _ in range(3):  # first-call allocations (compiled: the first graph)
        eng.step()
    spent.clear()
    while eng.has_unfinished():
        eng.step()
    in_step = {name: 1e6 * statistics.median(values) for name, values in spent.items()}
    steps = len(spent["decide_step"])
    spent.clear()
    for _ in range(300):
        engine_module.decide_step(*calls[0])
    alone = {name: 1e6 * statistics.median(values) for name, values in spent.items()}
    print(f"# {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, CPU; bundled "
          f"llada-tiny, CAI + dual, batch {BATCH} kept full by {args.requests} requests; decide_tensors compiled: "
          f"{args.compile}")
    print(f"# command: python bench/decide_in_step.py --threads {args.threads} --requests {args.requests} "
          f"--compile {args.compile}")
    model = eng.model
    canvas = torch.randint(0, 97, (5, 165))
    memory = torch.zeros(4 * 1024 * 1024)  # 16 MB, past this CPU's L2

    def forward() -> None:
        with torch.no_grad():
            model(canvas)

    def busy() -> None:
        start = time.perf_counter()
        while time.perf_counter() - start < 0.005:
            pass

    before = {"nothing": lambda: None, "a forward (5 x 165 tokens)": forward, "a 16 MB sweep": lambda: memory.add_(1.0),
              "a 5 ms sleep": lambda: time.sleep(0.005), "a 5 ms Python busy loop": busy}
    after: dict[str, float] = {}
    for name, work in before.items():
        spent.clear()
        for _ in range(60):
            work()
            engine_module.decide_step(*calls[0])
        after[name] = 1e6 * statistics.median(spent["decide_step"])
    print(f"{'part':16s} {'in a step (us)':>15s} {'replayed alone (us)':>20s} {'ratio':>6s}   medians; {steps} steps")
    for name in ("decide_step", "theta_block", "decide_tensors"):
        print(f"{name:16s} {in_step[name]:15.1f} {alone[name]:20.1f} {in_step[name] / alone[name]:6.2f}")
    print(f"{'decide_step replayed right after':36s} {'us':>8s}   medians of 60")
    for name, us in after.items():
        print(f"{name:36s} {us:8.1f}")


if __name__ == "__main__":
    main()
