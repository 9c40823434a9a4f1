"""`cai-dllm eval`: compare decoding configurations on held-out built-in task problems."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from server.cli.args import MIX_HELP, add_engine_flags, fail, task_mix

if TYPE_CHECKING:  # torch-free at import: `--help` answers at once
    from tinymodels.evaluate import EvalConfig


def add_parser(sub: Any) -> None:
    ev = sub.add_parser("eval", help="compare decoding configurations on held-out built-in task problems")
    ev.add_argument("--model", required=True, help="a built-in model directory (models/llada-tiny, ...)")
    ev.add_argument("--n", type=int, default=50, help="held-out problems")
    ev.add_argument("--seed", type=int, default=0, help="which held-out problems are drawn")
    ev.add_argument("--prompt-form", default="chat", choices=("chat", "plain"),
                    help="chat: the chat template (as /v1/chat/completions); plain: the bare problem text "
                         "(as /v1/completions)")
    add_engine_flags(ev, ("max_batch",), max_batch="batch_size")
    ev.add_argument("--configs", help="';'-separated: configuration names, JSON objects of decoding knobs, or "
                                      "profile:FILE (a decoding profile, e.g. from `cai-dllm calibrate`); the first "
                                      "is the baseline every row's AUP is measured from")
    ev.add_argument("--gen-length", type=int, default=128, help="generation canvas of every configuration")
    ev.add_argument("--block-length", type=int, help="block length of every configuration (default: 32; a "
                                                     "block-diffusion model's trained block)")
    add_engine_flags(ev, ("device", "dtype", "quantization", "quantize_head", "threads",
                           "tensor_parallel_size"))
    ev.add_argument("--mix", type=task_mix, help=MIX_HELP)
    ev.add_argument("--json", help="also write the full report to this file")
    ev.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine import EngineConfig, start_engine
    from engine.errors import CheckpointError, DeviceError
    from tinymodels.evaluate import (
        default_configs,
        evaluate,
        format_kind_table,
        format_table,
        hardware,
        held_out_problems,
        model_mix,
        table_dicts,
    )
    from tinymodels.tasks import format_mix

    try:
        engine = start_engine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                                           max_batch=args.batch_size, quantization=args.quantization,
                                           quantize_head=args.quantize_head, threads=args.threads,
                                           tensor_parallel_size=args.tensor_parallel_size))
    except (CheckpointError, DeviceError, ValueError) as err:
        return fail(err)
    from engine.decoding import DecodeParams

    block_length = args.block_length or engine.default_params(DecodeParams(gen_length=args.gen_length)).block_length
    configs = default_configs(engine.architecture, args.gen_length, block_length)
    if args.configs:
        try:
            configs = _chosen_configs(args.configs, configs, args.gen_length)
        except ValueError as err:
            return fail(err)
    from server.cli.progress import Progress

    mix = args.mix or model_mix(args.model)
    problems = held_out_problems(args.n, args.seed, mix)
    print(f"# {args.n} held-out problems (seed {args.seed}, {args.prompt_form} prompts, mix {format_mix(mix)}) on "
          f"{hardware()}, model {args.model}, quantization {args.quantization}"
          f"{' (head too)' if args.quantize_head else ''}", flush=True)
    # a bar per configuration, moved every step, with its rate and ETA (configurations differ in cost
    # by up to 100x: one ETA over all of them would be the first one's guess); each result above it
    progress = Progress(len(problems), "problems", f"{configs[0].name} [1/{len(configs)}] ")
    running = [0]

    def on_progress(index: int, done: float) -> None:
        if index != running[0]:
            running[0] = index
            progress.restart(len(problems), f"{configs[index].name} [{index + 1}/{len(configs)}] ")
        progress.at(done)

    reports = evaluate(engine, problems, configs, batch_size=args.batch_size, on_progress=on_progress,
                       prompt_form=args.prompt_form,
                       progress=lambda r: progress.write(f"  {r.name}: {100 * r.correct / max(1, r.n):.1f}% in "
                                                         f"{r.seconds:.1f}s"))
    progress.close()
    print(format_table(reports))
    print()
    print(format_kind_table(reports))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "n": args.n, "seed": args.seed, "prompt_form": args.prompt_form,
                       "mix": mix, "quantization": args.quantization, "quantize_head": args.quantize_head,
                       "hardware": hardware(),
                       "batch_size": args.batch_size, "configs": table_dicts(reports)}, f, indent=1)
    return 0


def _chosen_configs(spec: str, known: list[EvalConfig], gen_length: int) -> list[EvalConfig]:
    """`--configs`: names of the default rows, JSON objects of knobs, or profile:FILE (a decoding
    profile, e.g. one `cai-dllm calibrate` wrote); the last two on the --gen-length canvas unless they
    set their own."""
    from engine.decoding.profiles import ProfileError, load_profile
    from tinymodels.evaluate import EvalConfig

    by_name = {c.name: c for c in known}
    chosen = []
    for entry in filter(None, (c.strip() for c in spec.split(";"))):
        if entry in by_name:
            chosen.append(by_name[entry])
        elif entry.startswith("profile:"):
            try:
                profile = load_profile(entry.removeprefix("profile:"))
            except ProfileError as err:
                raise ValueError(str(err)) from None
            chosen.append(EvalConfig(f"profile {profile.name}", {"gen_length": gen_length, **profile.decoding}))
        elif entry.startswith("{"):
            try:
                knobs = json.loads(entry)
            except json.JSONDecodeError as err:
                raise ValueError(f"configuration {entry!r} is not valid JSON: {err}") from None
            chosen.append(EvalConfig(entry, {"gen_length": gen_length, **knobs}))
        else:
            raise ValueError(f"unknown configuration {entry!r}; known: {'; '.join(by_name)}, a JSON object of "
                             f"knobs, or profile:FILE")
    return chosen
