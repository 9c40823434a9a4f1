"""The `cai-dllm` command line."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # torch-free at import: `--help` answers at once
    from tinymodels.evaluate import EvalConfig


def _inspect(args: argparse.Namespace) -> int:
    from engine.errors import CheckpointError
    from engine.inspect import describe_checkpoint, format_report

    try:
        report = describe_checkpoint(args.model_dir)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _add_decode_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per DecodeParams field (the same names as the API's `decoding` object)."""
    from engine.decoding.params import DecodeParams, field_types

    defaults = DecodeParams()
    group = parser.add_argument_group("decoding (see docs/cai.md)")
    for name, (kind, _optional) in field_types().items():
        flag = "--" + name.replace("_", "-")
        default = getattr(defaults, name)
        if kind is bool:
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                               help=f"default: {default if default is not None else 'from the model'}")
        else:
            group.add_argument(flag, dest=name, type=kind, default=None, help=f"default: {default}")


def _decode_overrides(args: argparse.Namespace) -> dict[str, Any]:
    from engine.decoding.params import field_types

    return {name: getattr(args, name) for name in field_types() if getattr(args, name) is not None}


class _DefaultsFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless it says it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.required or action.default in (None, argparse.SUPPRESS):
            return text
        if action.default is False and action.nargs == 0:
            return f"{text} (default: off)"
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """The command line's parsers (its subcommands' too: argparse makes them of the same class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kwargs)


def _json_list(raw: str) -> list[str]:
    value = json.loads(raw)
    if not isinstance(value, list):
        raise argparse.ArgumentTypeError("must be a JSON list")
    return value


def _shown(value: Any) -> str:
    return str(value).replace("%", "%%")  # help strings are %-formatted


def _engine_flag_options() -> dict[str, dict[str, Any]]:
    """The EngineConfig flags every command that loads a model shares (but for their defaults)."""
    from engine.config import QUANTIZATION_MODES
    from engine.dtype_names import CANONICAL_DTYPES, DTYPE_ALIASES

    aliases = [name for name in DTYPE_ALIASES if name not in CANONICAL_DTYPES]
    return {"device": {"help": "cpu, cuda or cuda:N"},
            "dtype": {"type": str.lower, "choices": tuple(DTYPE_ALIASES),
                      "metavar": "{" + ",".join(CANONICAL_DTYPES) + "}",
                      "help": f"weights and activations; aliases: {', '.join(aliases)}"},
            "max_batch": {"type": int, "help": "rows decoded together per step"},
            "quantization": {"choices": QUANTIZATION_MODES,
                             "help": "weight-only quantization of the transformer layers' linear layers, "
                                     "applied while loading: int8 (torchao), int4 (bitsandbytes NF4), "
                                     "fp8 (torchao; CUDA, compute capability 8.9+); see docs/operations.md"},
            "quantize_head": {"action": argparse.BooleanOptionalAction,
                              "help": "quantize the output head too (kept in --dtype otherwise)"}}


def _add_engine_flags(parser: argparse.ArgumentParser, names: tuple[str, ...], **dests: str) -> None:
    """Offline commands: `--<name>` with the engine's default (from `server.settings`, as `serve`'s).
    `dests` renames a flag: {setting name: flag name}."""
    from server.settings import setting_default

    options = _engine_flag_options()
    for name in names:
        flag = dests.get(name, name)
        extra = dict(options[name])
        extra["help"] += " (default: %(default)s)"
        parser.add_argument("--" + flag.replace("_", "-"), dest=flag, default=setting_default(name), **extra)


def _add_setting(parser: Any, name: str, *aliases: str, unset: str = "", **options: Any) -> None:
    """A `serve` flag: None when not given, so that CAI_DLLM_<NAME> applies; the help shows the value
    the setting takes when neither gives one (`unset` words it when that value is empty)."""
    from server.settings import setting_default

    default = setting_default(name)
    shown = unset if unset and default in (None, {}, []) else _shown(default)
    options["help"] = f"{options.get('help', '')} (default: {shown})".lstrip()
    parser.add_argument("--" + name.replace("_", "-"), *aliases, dest=name, default=None, **options)


def _generate(args: argparse.Namespace) -> int:
    from engine import CheckpointError, DeviceError, RequestError, load_model, load_tokenizer
    from engine.chat import chat_prompt_ids
    from engine.decoding import DecodeParamError, DecodeParams, generate

    try:
        params = DecodeParams.from_dict(_decode_overrides(args))
        model = load_model(args.model, device=args.device, dtype=args.dtype, quantization=args.quantization,
                           quantize_head=args.quantize_head)
        tokenizer = None
        try:
            tokenizer = load_tokenizer(args.model)
        except CheckpointError:
            if args.prompt:
                raise
        prompts: list[list[int]] = []
        for text in args.prompt or []:
            if args.chat:
                prompts.append(chat_prompt_ids(tokenizer, [{"role": "user", "content": text}]))
            else:
                prompts.append(list(tokenizer.encode(text, add_special_tokens=False)))
        for ids in args.prompt_ids or []:
            prompts.append([int(t) for t in ids.split(",") if t.strip()])
        results = generate(model, prompts, params, max_batch=args.max_batch, tokenizer=tokenizer)
    except (CheckpointError, DeviceError, DecodeParamError, RequestError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for result in results:
        record = {"request_id": result.request_id, "prompt_ids": list(result.prompt_ids),
                  "generated_ids": result.generated_ids, "text": result.text,
                  "finish_reason": result.finish_reason, "nfe": result.stats.nfe,
                  "steps_per_block": result.stats.steps_per_block, **result.stats.as_dict()}
        if args.json:
            print(json.dumps(record))
        else:
            shown = result.text if result.text is not None else result.generated_ids
            print(f"{shown}\n  [{result.finish_reason}; NFE {result.stats.nfe}; steps saved "
                  f"{result.stats.steps_saved} of {result.stats.fixed_step_budget}]")
    return 0


def _score(args: argparse.Namespace) -> int:
    from engine import CheckpointError, DeviceError, Engine, EngineConfig, RequestError
    from engine.chat import chat_prompt_ids
    from engine.loading.tokenizer import encode_text

    try:
        engine = Engine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                                     quantization=args.quantization, quantize_head=args.quantize_head))
        if engine.tokenizer is None:
            raise CheckpointError("scoring text needs a checkpoint with a tokenizer")
        context = (chat_prompt_ids(engine.tokenizer, [{"role": "user", "content": args.context}]) if args.chat
                   else encode_text(engine.tokenizer, args.context))
        rows = []
        for text in args.continuation:
            ids = [*context, *encode_text(engine.tokenizer, text)]
            values = engine.score(ids, args.samples, args.seed)[len(context):]
            rows.append({"continuation": text, "logprob": sum(v for v in values if v is not None),
                         "tokens": len(values), "token_logprobs": values})
    except (CheckpointError, DeviceError, RequestError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    best = max(range(len(rows)), key=lambda i: rows[i]["logprob"])
    for i, row in enumerate(rows):
        if args.json:
            print(json.dumps(row))
        else:
            mark = "  <- most likely" if len(rows) > 1 and i == best else ""
            print(f"{row['logprob']:10.3f}  ({row['tokens']} tokens)  {row['continuation']!r}{mark}")
    return 0


def _train(args: argparse.Namespace) -> int:
    from dataclasses import fields
    from pathlib import Path

    import torch

    from tinymodels.train import TrainConfig, train

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.snapshot:
        from tinymodels.train import snapshot

        try:
            log = snapshot(Path(args.out), Path(args.snapshot))
        except FileNotFoundError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(f"snapshot of step {log['step']} written to {args.snapshot}")
        return 0
    # flags left out keep TrainConfig's defaults, the built-in recipe (one place for them)
    config = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)
                            if getattr(args, f.name, None) is not None})
    log = train(config, Path(args.out), resume=args.resume, max_minutes=args.max_minutes, device=args.device)
    last = log["losses"][-1][1] if log["losses"] else float("nan")
    print(f"trained {log['step']} steps in {log['seconds'] / 60:.1f} min; final loss {last:.4f}; saved to {args.out}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from engine import Engine, EngineConfig
    from engine.errors import CheckpointError, DeviceError
    from tinymodels.evaluate import (
        default_configs,
        evaluate,
        format_kind_table,
        format_table,
        hardware,
        held_out_problems,
        model_mix,
    )
    from tinymodels.tasks import format_mix

    try:
        engine = Engine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                                     max_batch=args.batch_size, quantization=args.quantization,
                                     quantize_head=args.quantize_head))
    except (CheckpointError, DeviceError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    configs = default_configs(engine.architecture, args.gen_length, args.block_length)
    if args.configs:
        try:
            configs = _chosen_configs(args.configs, configs, args.gen_length)
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    from tqdm import tqdm

    mix = args.mix or model_mix(args.model)
    problems = held_out_problems(args.n, args.seed, mix)
    print(f"# {args.n} held-out problems (seed {args.seed}, {args.prompt_form} prompts, mix {format_mix(mix)}) on "
          f"{hardware()}, model {args.model}, quantization {args.quantization}"
          f"{' (head too)' if args.quantize_head else ''}", flush=True)
    # one bar over configurations x problems, with its rate and ETA; each configuration's line above it
    with tqdm(total=len(configs) * len(problems), unit="problem", file=sys.stderr, dynamic_ncols=True) as bar:
        reports = evaluate(engine, problems, configs, batch_size=args.batch_size, on_problem=lambda: bar.update(),
                           prompt_form=args.prompt_form,
                           progress=lambda r: bar.write(f"  {r.name}: {100 * r.correct / max(1, r.n):.1f}% in "
                                                        f"{r.seconds:.1f}s", file=sys.stderr))
    print(format_table(reports))
    print()
    print(format_kind_table(reports))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "n": args.n, "seed": args.seed, "prompt_form": args.prompt_form,
                       "mix": mix, "quantization": args.quantization, "quantize_head": args.quantize_head,
                       "hardware": hardware(),
                       "batch_size": args.batch_size, "configs": [r.as_dict() for r in reports]}, f, indent=1)
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


def _calibrate(args: argparse.Namespace) -> int:
    from calibration.data import BUILTIN, CalibrationDataError, builtin_items, load_items, make_grader
    from engine import Engine, EngineConfig
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
        engine = Engine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                                     max_batch=args.batch_size, quantization=args.quantization,
                                     quantize_head=args.quantize_head))
    except (CalibrationDataError, CheckpointError, DeviceError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from tqdm import tqdm

    from calibration.run import calibrate
    from tinymodels.evaluate import dual_cache_refresh

    source = args.data or f"built-in validation split (seed {args.seed})"
    print(f"# calibrating {args.model} on {len(items)} items of {source}; objective {args.objective}, "
          f"tolerance {args.tolerance}" + (f", budget {args.budget}" if args.budget else ""), flush=True)
    bar = tqdm(total=0, unit="item", file=sys.stderr, dynamic_ncols=True)

    def on_stage(stage: str, candidates: int) -> None:
        bar.total += candidates * len(items)
        bar.set_description(f"{stage} ({candidates} candidates)")
        bar.refresh()

    try:
        profile, result = calibrate(
            engine, items, grader, grader_name, args.name, objective=args.objective, tolerance=args.tolerance,
            budget=args.budget, gen_length=args.gen_length, block_length=args.block_length, cache=args.cache,
            refresh_interval=dual_cache_refresh(engine.architecture),
            theta_s_grid=args.theta_s_grid, theta_e_grid=args.theta_e_grid, on_stage=on_stage,
            on_item=lambda: bar.update())
    except ValueError as err:
        bar.close()
        print(f"error: {err}", file=sys.stderr)
        return 2
    bar.close()
    ref, best = result.reference.measurement, result.best.measurement
    print(f"fixed decoder: {100 * ref.accuracy:.1f}% at {ref.nfe:.1f} forward passes an item")
    verdict = "" if result.feasible else " -- NO candidate met the objective; this is the closest"
    print(f"chosen:        {100 * best.accuracy:.1f}% at {best.nfe:.1f} forward passes an item "
          f"({len(result.trials) - 1} candidates tried){verdict}")
    print(f"decoding: {json.dumps(profile.decoding)}")
    save_profile(profile, args.out)
    print(f"profile {profile.name!r} written to {args.out} (serve it with --decoding-profile {args.out})")
    return 0 if result.feasible else 1


_MIX_HELP = ("built-in task kinds and their weights, KIND=WEIGHT,... (default: the mix the model was trained "
             "on, from its training_log.json; tinymodels.tasks.DEFAULT_MIX without one)")


def _task_mix(raw: str) -> dict[str, float]:
    from tinymodels.tasks import parse_mix

    try:
        return parse_mix(raw)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _float_list(raw: str) -> list[float]:
    try:
        values = [float(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated numbers, got {raw!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("needs at least one number")
    return values


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    import uvicorn

    from server.app import create_app, drain
    from server.settings import load_settings, setting_names

    flags = {name: getattr(args, name, None) for name in setting_names()}  # a few are variables only
    try:
        settings = load_settings(flags)
        from engine.decoding import DecodeParams

        DecodeParams.from_dict(settings.default_decoding)
        from engine.decoding.profiles import load_profile, profile_table

        profile_table(load_profile(path) for path in settings.decoding_profiles)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    taken = _port_refusal(settings.host, settings.port)
    if taken is not None:  # before loading anything: a one-line error, not a model load and a traceback
        print(f"error: cannot listen on {settings.host}:{settings.port}: {taken}", file=sys.stderr)
        return 1
    load_failure: list[str] = []

    def end_on_load_failure(reason: str) -> None:  # a server that cannot serve should not look alive
        load_failure.append(reason)
        server.should_exit = True

    app = create_app(settings, on_load_failure=end_on_load_failure)

    class DrainingServer(uvicorn.Server):
        """On SIGTERM/SIGINT: answer 503 to new work, finish what is in flight (up to
        --shutdown-timeout), then exit 0."""

        def handle_exit(self, sig: int, frame: Any) -> None:  # type: ignore[override]
            if getattr(self, "_draining", False):
                return super().handle_exit(sig, frame)
            self._draining = True

            async def finish() -> None:
                await drain(app, settings.shutdown_timeout)
                self.should_exit = True

            asyncio.get_event_loop().call_soon_threadsafe(lambda: asyncio.ensure_future(finish()))

    # drain() has waited the shutdown timeout and answered what was left: uvicorn only closes sockets
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=_CLOSE_SECONDS)
    server = DrainingServer(config)
    try:
        server.run()
    except SystemExit:  # uvicorn could not bind after all (it has logged why)
        _exit_now(1)
    if load_failure:
        print(f"error: the model failed to load: {load_failure[0]}", file=sys.stderr)
        _exit_now(1)
    return 0


_CLOSE_SECONDS = 5  # after the drain, for uvicorn to close the connections


def _port_refusal(host: str, port: int) -> Optional[str]:
    """Why (host, port) cannot be listened on, or None."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(address)
    except OSError as err:
        return err.strerror or str(err)
    return None


def _exit_now(code: int) -> None:
    """Exit without waiting on the model-loading thread: torch's threads still running at interpreter
    shutdown abort the process (exit 134) instead of letting it end with `code`."""
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _bench_serve(args: argparse.Namespace) -> int:
    import asyncio
    import json
    from dataclasses import asdict
    from pathlib import Path

    import aiohttp

    from server.load_generator import builtin_workload, file_workload, format_report, run_load

    try:
        decoding = json.loads(args.decoding) if args.decoding else None
        if decoding is not None and not isinstance(decoding, dict):
            raise ValueError("--decoding must be a JSON object")
        workload = (builtin_workload(args.num_requests, args.seed) if args.dataset == "builtin"
                    else file_workload(Path(args.dataset)))
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        report = asyncio.run(run_load(args.base_url, workload, args.num_requests, concurrency=args.concurrency,
                                      request_rate=args.request_rate, decoding=decoding, model=args.model,
                                      max_tokens=args.max_tokens, api_key=args.api_key, seed=args.seed))
    except (OSError, aiohttp.ClientError) as err:  # the server is unreachable, or /v1/models refused us
        print(f"error: {args.base_url}: {err}", file=sys.stderr)
        return 2
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=1) + "\n")
    return 0 if report.completed else 1


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="cai-dllm", description="Convergence-aware inference server "
                                     "for masked diffusion language models (LLaDA, Dream).")
    sub = parser.add_subparsers(dest="command", required=True)

    inspect = sub.add_parser("inspect", help="describe a local checkpoint directory without loading it")
    inspect.add_argument("model_dir", help="local Hugging Face checkpoint directory")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.set_defaults(func=_inspect)

    gen = sub.add_parser("generate", help="decode prompts offline (a batch when several are given)")
    gen.add_argument("--model", required=True, help="local Hugging Face checkpoint directory")
    gen.add_argument("--prompt", action="append", help="prompt text (repeat for a batch)")
    gen.add_argument("--prompt-ids", action="append", help="comma-separated prompt token ids (repeatable)")
    gen.add_argument("--chat", action="store_true", help="wrap each --prompt as a user turn of the chat template")
    _add_engine_flags(gen, ("device", "dtype", "max_batch", "quantization", "quantize_head"))
    gen.add_argument("--json", action="store_true", help="print one JSON object per request")
    _add_decode_flags(gen)
    gen.set_defaults(func=_generate)

    sc = sub.add_parser("score", help="log-likelihood of continuations after a context (LLaDA's Monte-Carlo "
                                      "estimator, as the server's echo + logprobs)")
    sc.add_argument("--model", required=True, help="local Hugging Face checkpoint directory")
    sc.add_argument("--context", required=True, help="the text the continuations follow")
    sc.add_argument("--continuation", action="append", required=True, help="a continuation to score (repeatable)")
    sc.add_argument("--chat", action="store_true", help="wrap --context as a user turn of the chat template")
    sc.add_argument("--samples", type=int, default=None, help="samples per split (default: the decoding default)")
    sc.add_argument("--seed", type=int, default=0, help="seeds the masks: the same seed, the same numbers")
    _add_engine_flags(sc, ("device", "dtype", "quantization", "quantize_head"))
    sc.add_argument("--json", action="store_true", help="print one JSON object per continuation")
    sc.set_defaults(func=_score)

    ev = sub.add_parser("eval", help="compare decoding configurations on held-out built-in task problems")
    ev.add_argument("--model", required=True, help="a built-in model directory (models/llada-tiny, ...)")
    ev.add_argument("--n", type=int, default=200, help="held-out problems")
    ev.add_argument("--seed", type=int, default=0, help="which held-out problems are drawn")
    ev.add_argument("--prompt-form", default="chat", choices=("chat", "plain"),
                    help="chat: the chat template (as /v1/chat/completions); plain: the bare problem text "
                         "(as /v1/completions)")
    _add_engine_flags(ev, ("max_batch",), max_batch="batch_size")
    ev.add_argument("--configs", help="';'-separated: configuration names, JSON objects of decoding knobs, or "
                                      "profile:FILE (a decoding profile, e.g. from `cai-dllm calibrate`)")
    ev.add_argument("--gen-length", type=int, default=128, help="generation canvas of every configuration")
    ev.add_argument("--block-length", type=int, default=32, help="block length of every configuration")
    _add_engine_flags(ev, ("device", "dtype", "quantization", "quantize_head"))
    ev.add_argument("--mix", type=_task_mix, help=_MIX_HELP)
    ev.add_argument("--json", help="also write the full report to this file")
    ev.set_defaults(func=_eval)

    from server.settings import LOG_LEVELS

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (default: the bundled llada-tiny on CPU)",
                           description="Every option can also be set as CAI_DLLM_<OPTION> in the environment.")
    engine = serve.add_argument_group("engine")
    _add_setting(engine, "model", help="local checkpoint directory")
    options = _engine_flag_options()
    _add_setting(engine, "device", **options["device"])
    _add_setting(engine, "dtype", **options["dtype"])
    _add_setting(engine, "max_batch", "--max-num-seqs", **options["max_batch"])
    _add_setting(engine, "quantization", "-q", **options["quantization"])
    _add_setting(engine, "quantize_head", **options["quantize_head"])
    _add_setting(engine, "max_model_len", type=int, help="prompt + canvas limit", unset="the model's context")
    _add_setting(engine, "use_flash_attn", action=argparse.BooleanOptionalAction,
                 help="FlashAttention kernels", unset="when installed and usable")
    _add_setting(engine, "max_logprobs", type=int, help="most top logprobs a request may ask for per token")
    _add_setting(engine, "max_score_tokens", type=int,
                 help="most tokens one likelihood-scoring request (echo + logprobs) may feed the model")
    _add_setting(engine, "compile_decide", action=argparse.BooleanOptionalAction,
                 help="compile the decide step (torch.compile): less host time a step, seconds of compiling "
                      "per new batch shape at the start")
    _add_setting(engine, "cuda_graphs", action=argparse.BooleanOptionalAction,
                 help="run the dual-cache step as CUDA graphs, one per batch bucket (CUDA only)")
    sv = serve.add_argument_group("server")
    _add_setting(sv, "served_model_name", help="the model id clients send", unset="the directory name")
    _add_setting(sv, "host", help="address to listen on")
    _add_setting(sv, "port", type=int, help="port to listen on")
    _add_setting(sv, "max_queue", type=int, help="requests waiting for a row before 429")
    _add_setting(sv, "max_n", type=int, help="completions per request, n x prompts")
    _add_setting(sv, "api_key", help="require 'Authorization: Bearer KEY' on /v1 routes", unset="no key")
    _add_setting(sv, "default_decoding", help="JSON object of default decoding knobs, e.g. "
                 "'{\"cache\": \"dual\"}'", unset="the model's defaults")
    _add_setting(sv, "request_timeout", type=float, help="seconds")
    _add_setting(sv, "shutdown_timeout", type=float, help="seconds to finish in-flight work on SIGTERM")
    _add_setting(sv, "stall_timeout", type=float, help="/health fails after this many seconds without progress")
    _add_setting(sv, "admission_wait_ms", type=float,
                 help="after a step frees rows, hold the next step at most this long for the requests "
                      "that will fill them, when recent refills came that soon (0: never wait)")
    _add_setting(sv, "log_level", choices=LOG_LEVELS, help="uvicorn's log level")
    _add_setting(sv, "allowed_origins", type=_json_list,
                 help='JSON list of origins allowed to call the API from a browser (CORS), e.g. \'["*"]\'',
                 unset="none: CORS off")
    _add_setting(sv, "decoding_profiles", "--decoding-profile", action="append", metavar="FILE",
                 help="a decoding profile file (cai-dllm calibrate writes one); the first is every request's "
                      "default, any can be named by a request as decoding.profile; repeat for several",
                 unset="none: the paper's defaults")
    _add_setting(sv, "chat_template", help="a Jinja chat template file (or the template itself) used instead of "
                                           "the checkpoint's", unset="the checkpoint's")
    serve.set_defaults(func=_serve)

    bench = sub.add_parser("bench", help="benchmarks against a running server").add_subparsers(
        dest="bench_command", required=True)
    bs = bench.add_parser("serve", help="load generator: throughput, TTFT/latency percentiles, NFE, steps saved")
    bs.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    load = bs.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, help="requests in flight at once (closed loop; default 8)")
    load.add_argument("--request-rate", type=float,
                      help="requests per second, Poisson arrivals (open loop; default: closed loop)")
    bs.add_argument("--num-requests", type=int, default=100, help="requests to send in all")
    bs.add_argument("--dataset", default="builtin", help="'builtin' (held-out task problems) or a JSONL file")
    bs.add_argument("--decoding", help="JSON object of decoding knobs sent with every request")
    bs.add_argument("--model", help="model id (default: the first of /v1/models)")
    bs.add_argument("--max-tokens", type=int, help="max_tokens of every request (default: the server's)")
    bs.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' (default: none)")
    bs.add_argument("--seed", type=int, default=0, help="which problems, in which order")
    bs.add_argument("--json", help="also write the full report, every request included, to this file")
    bs.set_defaults(func=_bench_serve)

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
    cal.add_argument("--mix", type=_task_mix, help=_MIX_HELP)
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
    cal.add_argument("--theta-s-grid", type=_float_list, help="theta_s values of the threshold stage (0.8,0.9,0.99)")
    cal.add_argument("--theta-e-grid", type=_float_list, help="theta_e values of the threshold stage (0.5,0.7,0.9)")
    _add_engine_flags(cal, ("max_batch",), max_batch="batch_size")
    _add_engine_flags(cal, ("device", "dtype", "quantization", "quantize_head"))
    cal.add_argument("--name", default="calibrated", help="the profile's name (decoding.profile)")
    cal.add_argument("--out", default="calibrated.json", help="the profile file to write")
    cal.set_defaults(func=_calibrate)

    tr = sub.add_parser("train", help="train a built-in tiny model on the task family",
                        description="Flags left out take the built-in recipe: the defaults of "
                                    "tinymodels.train_config.TrainConfig (docs/models.md).")
    from tinymodels.tasks import format_mix
    from tinymodels.train_config import OPTIMIZERS, TrainConfig

    recipe = TrainConfig()
    train_flags: dict[str, tuple[type, str]] = {
        "arch": (str, "checkpoint format"), "d_model": (int, "hidden size"), "layers": (int, "decoder layers"),
        "heads": (int, "attention heads"), "mlp_hidden": (int, "MLP hidden size"),
        "rope_theta": (float, "RoPE base (the 8B models' bases are for head dims of 128)"),
        "batch_size": (int, "examples a step"), "steps": (int, "optimizer steps"), "lr": (float, "peak learning rate"),
        "warmup": (int, "warm-up steps"), "weight_decay": (float, "decoupled weight decay"),
        "optimizer": (str, "muon: Muon on the hidden weight matrices, AdamW on the rest"),
        "seed": (int, "examples, masks and initial weights"),
        "micro_batches": (int, "length-sorted groups per step, each its own canvas"),
        "full_canvas_share": (float, "share of groups given a full canvas"),
        "long_canvas": (int, "a full canvas is drawn from gen_length to this many tokens"),
        "max_extra_fill": (int, "most end tokens after the longest response"),
        "prefix_mask_share": (float, "share of examples masked only after a random cut in the canvas"),
        "plain_prompt_share": (float, "share of examples prompted with the bare problem text, not the chat template"),
        "init_from": (str, "start from this checkpoint's weights (same shapes) instead of random ones"),
    }
    choices = {"arch": ("llada", "dream"), "optimizer": OPTIMIZERS}
    tr.add_argument("--out", required=True, help="the checkpoint directory to write")
    for name, (kind, text) in train_flags.items():
        tr.add_argument("--" + name.replace("_", "-"), type=kind, default=getattr(recipe, name), help=text,
                        choices=choices.get(name))
    tr.add_argument("--mix", type=_task_mix, help=f"task kinds and their weights, KIND=WEIGHT,... "
                                                  f"(default: {format_mix(recipe.mix)})")
    tr.add_argument("--device", default="cpu", help="where the arithmetic runs (examples and masks are the same)")
    tr.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    tr.add_argument("--max-minutes", type=float, help="stop (and save) after this long (default: no limit)")
    tr.add_argument("--resume", action="store_true", help="continue from OUT/train_state.pt")
    tr.add_argument("--snapshot", metavar="DEST",
                    help="only write the model of OUT's last saved training state to DEST (a mid-run look)")
    tr.set_defaults(func=_train)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _dispatch(parser, args)
    except KeyboardInterrupt:  # Ctrl-C: a line, not a traceback (the shell's exit code for SIGINT)
        print("\ninterrupted", file=sys.stderr)
        return 130


def _dispatch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.command == "generate" and not (args.prompt or args.prompt_ids):
        parser.error("generate needs --prompt or --prompt-ids")
    if args.command == "bench" and args.concurrency is None and args.request_rate is None:
        args.concurrency = 8
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
