"""Training-recipe sweep for the built-in models: many `TrainConfig`s side by side, each scored by
held-out exact match (fixed one-token-per-step decoder) at several step counts.

Meant for a lent GPU, where a run of thousands of steps takes minutes instead of the better part
of an hour: `train(..., device=...)` draws the same examples and masks on any device, so a recipe
that wins here is then trained for real on the CPU with `cai-dllm train`. Scoring uses the
held-out split with a seed the benchmark does not use (`--seed 1`; the benchmark draws seed 0).

    python -m tinymodels.train_sweep --device cuda --out /tmp/sweep --evals 3000,6000,9000 --n-eval 256

Output of the sweep that chose the built-in recipe: tinymodels/results/train_sweep_gpu.txt.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Any

BASE: dict[str, Any] = {"d_model": 160, "layers": 4, "heads": 4, "mlp_hidden": 448, "lr": 2e-3, "warmup": 150,
                        "batch_size": 32}
DEEP: dict[str, Any] = {"d_model": 128, "layers": 6, "heads": 4, "mlp_hidden": 384}
RUNS: dict[str, dict[str, Any]] = {
    "llada base": {"arch": "llada"},
    "llada lr4e-3": {"arch": "llada", "lr": 4e-3},
    "llada wd0.1": {"arch": "llada", "weight_decay": 0.1},
    "llada lr4e-3 wd0.1": {"arch": "llada", "lr": 4e-3, "weight_decay": 0.1},
    "llada deep lr3e-3": {"arch": "llada", **DEEP, "lr": 3e-3},
    "llada 8 heads": {"arch": "llada", "heads": 8},
    "llada prefix0.5": {"arch": "llada", "prefix_mask_share": 0.5},
    "llada lr4e-3 prefix0.5": {"arch": "llada", "lr": 4e-3, "prefix_mask_share": 0.5},
    "llada bs64 lr3e-3": {"arch": "llada", "batch_size": 64, "lr": 3e-3, "steps_scale": 0.5},
    "llada deep lr3e-3 prefix0.5": {"arch": "llada", **DEEP, "lr": 3e-3, "prefix_mask_share": 0.5},
    "dream base": {"arch": "dream"},
    "dream lr4e-3": {"arch": "dream", "lr": 4e-3},
    "dream prefix0.5": {"arch": "dream", "prefix_mask_share": 0.5},
    # second round: depth won the first; schedules sized to what 2 CPU threads do in ~44 minutes
    "llada d128L6 lr3e-3 wd0.1": {"arch": "llada", **DEEP, "lr": 3e-3, "weight_decay": 0.1, "steps": 8000},
    "llada d96L8 lr3e-3 wd0.1": {"arch": "llada", "d_model": 96, "layers": 8, "mlp_hidden": 288, "lr": 3e-3,
                                 "weight_decay": 0.1, "steps": 8000},
    "llada d128L8 lr3e-3 wd0.1": {"arch": "llada", **DEEP, "layers": 8, "lr": 3e-3, "weight_decay": 0.1,
                                  "steps": 6000},
    "dream d128L6 lr3e-3 wd0.1": {"arch": "dream", **DEEP, "lr": 3e-3, "weight_decay": 0.1, "steps": 8000},
    "dream d96L8 lr3e-3 wd0.1": {"arch": "dream", "d_model": 96, "layers": 8, "mlp_hidden": 288, "lr": 3e-3,
                                 "weight_decay": 0.1, "steps": 8000},
}
# DiffusionGemma-format recipes, each a whole cosine schedule of as many steps as 2 CPU threads run in
# about the other built-ins' training time (a step there takes 1.6-3 s: docs/models.md). A step is
# launch-bound on a GPU, and runs side by side time-share it: within a lease's minutes, run one or two
# of these at a time, not all.
DG: dict[str, Any] = {"arch": "diffusion_gemma", **DEEP, "mlp_hidden": 192, "lr": 3e-3, "steps": 3000}
RUNS.update({
    "dg lr3e-3": DG,
    "dg lr2e-3": {**DG, "lr": 2e-3},
    "dg lr5e-3": {**DG, "lr": 5e-3},
    "dg lr3e-3 wd0": {**DG, "weight_decay": 0.0},
    "dg lr3e-3 sc0.25": {**DG, "self_conditioning_share": 0.25},
    "dg lr3e-3 enc0.5": {**DG, "encoder_loss_weight": 0.5},
    "dg lr3e-3 4000": {**DG, "steps": 4000},
    "dg lr4e-3 bs48": {**DG, "lr": 4e-3, "batch_size": 48, "steps": 2000},
})


def run_one(name: str, overrides: dict[str, Any], args: argparse.Namespace, queue: Any) -> None:
    try:
        _run(name, overrides, args, queue)
    except BaseException as err:  # the parent waits for every run's "done"; report, never hang it
        queue.put({"run": name, "done": True, "error": repr(err)})
        raise
    queue.put({"run": name, "done": True})


def _run(name: str, overrides: dict[str, Any], args: argparse.Namespace, queue: Any) -> None:
    import torch

    from engine import Engine, EngineConfig
    from engine.models.registry import FAMILIES
    from tinymodels.evaluate import default_configs, evaluate, held_out_problems
    from tinymodels.train import TrainConfig, train

    torch.set_num_threads(1)
    overrides = dict(overrides)
    steps = overrides.pop("steps", int(args.steps * overrides.pop("steps_scale", 1.0)))
    config = TrainConfig(**{**BASE, **overrides, "steps": steps})
    scale = config.steps / args.steps  # the scoring points move with a run's own schedule
    out = Path(args.out) / name.replace(" ", "_")
    problems = held_out_problems(args.n_eval, args.seed, config.mix)
    # a uniform-noise model is scored under its official stopping rule (seeded), the others by the
    # fixed one-token-per-step decoder
    scorer = "dg-official" if FAMILIES[config.arch].mode == "uniform" else "fixed+exit"
    fixed = next(c for c in default_configs(config.arch) if c.name == scorer)
    started = time.perf_counter()
    for at in sorted({int(int(s) * scale) for s in args.evals.split(",")}):
        # max_minutes bounds the run's training time over its resumes (scoring not counted)
        log = train(config, out, resume=True, stop_at=at, progress=False, device=args.device,
                    max_minutes=args.max_minutes)
        engine = Engine(EngineConfig(model=str(out), device=args.device, max_batch=args.n_eval))
        report = evaluate(engine, problems, [fixed], batch_size=args.n_eval)[0].as_dict()
        loss = log["losses"][-1][1] if log["losses"] else float("nan")
        queue.put({"run": name, "step": log["step"], "train_seconds": log["seconds"],
                   "wall_seconds": time.perf_counter() - started, "loss": loss,
                   "accuracy": report["accuracy"], "by_kind": report["accuracy_by_kind"],
                   "config": {k: v for k, v in vars(config).items() if k != "mix"}})
        if log["step"] < at:  # out of time
            break


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=9000, help="the schedule length (cosine to its end)")
    parser.add_argument("--evals", default="3000,6000,9000", help="steps at which to score")
    parser.add_argument("--n-eval", type=int, default=256)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--runs", help="';'-separated subset of the run names")
    parser.add_argument("--json", help="write every scored point here (rewritten after each)")
    parser.add_argument("--max-minutes", type=float, help="each run stops training after this long, then scores")
    args = parser.parse_args()
    names = [n.strip() for n in args.runs.split(";")] if args.runs else list(RUNS)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=run_one, args=(n, RUNS[n], args, queue)) for n in names]
    for p in procs:
        p.start()
    points, done = [], 0
    while done < len(procs):
        item = queue.get()
        if item.get("done"):
            done += 1
            if "error" in item:
                print(f"{item['run']:30s} FAILED: {item['error']}", flush=True)
            continue
        points.append(item)
        if args.json:
            Path(args.json).write_text(json.dumps(points, indent=1) + "\n")
        kinds = " ".join(f"{k} {100 * v:.0f}" for k, v in item["by_kind"].items())
        print(f"{item['run']:30s} step {item['step']:5d} ({item['wall_seconds']:5.0f}s) loss {item['loss']:.3f} "
              f"exact {100 * item['accuracy']:5.1f}%  [{kinds}]", flush=True)
    for p in procs:
        p.join()
    print("\nfinal:")
    for name in names:
        mine = [p for p in points if p["run"] == name]
        if mine:
            print(f"{name:30s} " + "  ".join(f"{p['step']}:{100 * p['accuracy']:.1f}%" for p in mine))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
