"""`cai-dllm calibrate`: choose CAI's knobs for a model on validation items; write a decoding profile."""

from __future__ import annotations

import argparse
import json
from typing import Any

from server.cli.args import MIX_HELP, add_engine_flags, fail, float_list, task_mix


def add_parser(sub: Any) -> None:
    cal = sub.add_parser("calibrate", help="choose CAI's knobs for a model on validation items; write a "
                                           "decoding profile",
                         description="Searches gating, per-token budgets, the grinding cut and the thresholds "
                                     "coarse-to-fine (docs/cai.md, 'Calibration') and writes the chosen knobs "
                                     "as a decoding profile for `serve --decoding-profile`. Exit 1 when no "
                                     "candidate meets the objective (the closest is written).")
    cal.add_argument("--model", required=True, help="a checkpoint directory")
    cal.add_argument("--data", help="JSONL items: {prompt|messages, answer} a line (default: the built-in task "
                                    "family's validation split, never its held-out split)")
    cal.add_argument("--grader", help="exact, regex:PATTERN or MODULE:FUNCTION (default: exact; the built-in "
                                      "checker for the built-in items)")
    cal.add_argument("--n", type=int, default=300, help="items to use (the first N of the file)")
    cal.add_argument("--seed", type=int, default=0, help="which built-in validation problems")
    cal.add_argument("--mix", type=task_mix, help=MIX_HELP)
    cal.add_argument("--objective", choices=("nfe", "accuracy"), default="nfe",
                     help="nfe: fewest forward passes within --tolerance of the fixed decoder's accuracy; "
                          "accuracy: most accurate (within --budget)")
    cal.add_argument("--tolerance", type=float, default=0.01,
                     help="accuracy a candidate may lose against the fixed decoder (a share: 0.01 = 1 point)")
    cal.add_argument("--budget", type=float, help="most forward passes, as a share of the fixed decoder's "
                                                  "(default: no cap)")
    cal.add_argument("--gen-length", type=int, default=128, help="the generation canvas")
    cal.add_argument("--block-length", type=int, default=32, help="block length")
    cal.add_argument("--cache", choices=("none", "prefix", "dual"), default="dual", help="KV cache of the candidates")
    cal.add_argument("--theta-s-grid", type=float_list, help="theta_s values of the threshold stage (0.8,0.9,0.99)")
    cal.add_argument("--theta-e-grid", type=float_list, help="theta_e values of the threshold stage (0.5,0.7,0.9)")
    add_engine_flags(cal, ("max_batch",), max_batch="batch_size")
    add_engine_flags(cal, ("device", "dtype", "quantization", "quantize_head", "threads",
                           "tensor_parallel_size"))
    cal.add_argument("--name", default="calibrated", help="the profile's name (decoding.profile)")
    cal.add_argument("--out", default="calibrated.json", help="the profile file to write")
    cal.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from calibration.data import BUILTIN, CalibrationDataError, builtin_items, load_items, make_grader
    from engine import EngineConfig, start_engine
    from engine.decoding.profiles import save_profile
    from engine.errors import CheckpointError, DeviceError

    try:
        if args.data:
            items = load_items(args.data, args.n)
            grader_name = args.grader or "exact"
        else:
            from tinymodels.evaluate import model_mix

            items = builtin_items(args.n, args.seed, args.mix or model_mix(args.model))
            grader_name = args.grader or BUILTIN
        grader = make_grader(grader_name)
        engine = start_engine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                                           max_batch=args.batch_size, quantization=args.quantization,
                                           quantize_head=args.quantize_head, threads=args.threads,
                                           tensor_parallel_size=args.tensor_parallel_size))
    except (CalibrationDataError, CheckpointError, DeviceError, ValueError) as err:
        return fail(err)
    from calibration.run import calibrate
    from server.cli.progress import Progress
    from tinymodels.evaluate import dual_cache_refresh

    source = args.data or f"built-in validation split (seed {args.seed})"
    print(f"# calibrating {args.model} on {len(items)} items of {source}; objective {args.objective}, "
          f"tolerance {args.tolerance}" + (f", budget {args.budget}" if args.budget else ""), flush=True)
    # a bar per search stage (candidates x items), moved every engine step, with its own ETA
    progress = Progress(0, "items")

    def on_stage(stage: str, candidates: int) -> None:
        progress.restart(candidates * len(items), f"{stage} ({candidates} candidates) ")

    try:
        profile, result = calibrate(
            engine, items, grader, grader_name, args.name, objective=args.objective, tolerance=args.tolerance,
            budget=args.budget, gen_length=args.gen_length, block_length=args.block_length, cache=args.cache,
            refresh_interval=dual_cache_refresh(engine.architecture),
            theta_s_grid=args.theta_s_grid, theta_e_grid=args.theta_e_grid, on_stage=on_stage,
            on_progress=progress.at)
    except ValueError as err:
        progress.close()
        return fail(err)
    progress.close()
    ref, best = result.reference.measurement, result.best.measurement
    print(f"fixed decoder: {100 * ref.accuracy:.1f}% at {ref.nfe:.1f} forward passes an item")
    verdict = "" if result.feasible else " -- NO candidate met the objective; this is the closest"
    print(f"chosen:        {100 * best.accuracy:.1f}% at {best.nfe:.1f} forward passes an item "
          f"({len(result.trials) - 1} candidates tried){verdict}")
    print(f"decoding: {json.dumps(profile.decoding)}")
    save_profile(profile, args.out)
    print(f"profile {profile.name!r} written to {args.out} (serve it with --decoding-profile {args.out})")
    return 0 if result.feasible else 1
