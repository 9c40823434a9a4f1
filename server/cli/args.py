"""What the commands share: the parser class, flag helpers and argument types."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def fail(message: object) -> int:
    """A one-line error on stderr and the exit code of a usage or input error."""
    print(f"error: {message}", file=sys.stderr)
    return 2


def add_decode_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per DecodeParams field (the same names as the API's `decoding` object), from the knobs'
    declarations (their defaults are read there: no DecodeParams is built, so no policy is imported)."""
    from dataclasses import fields

    from engine.decoding.params import DecodeParams, field_types

    defaults = {f.name: f.default for f in fields(DecodeParams)}
    group = parser.add_argument_group("decoding (see docs/cai.md)")
    for name, (kind, _optional) in field_types().items():
        flag = "--" + name.replace("_", "-")
        default = defaults[name]
        if kind is bool:
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                               help=f"default: {default if default is not None else 'from the model'}")
        else:
            group.add_argument(flag, dest=name, type=kind, default=None, help=f"default: {default}")


def decode_overrides(args: argparse.Namespace) -> dict[str, Any]:
    from engine.decoding.params import field_types

    return {name: getattr(args, name) for name in field_types() if getattr(args, name) is not None}


class DefaultsFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless it says it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.required or action.default in (None, argparse.SUPPRESS):
            return text
        if action.default is False and action.nargs == 0:
            return f"{text} (default: off)"
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """The command line's parsers (its subcommands' too: argparse makes them of the same class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)


def json_list(raw: str) -> list[str]:
    value = json.loads(raw)
    if not isinstance(value, list):
        raise argparse.ArgumentTypeError("must be a JSON list")
    return value


def engine_flag_options() -> dict[str, dict[str, Any]]:
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
                              "help": "quantize the output head too (kept in --dtype otherwise)"},
            "threads": {"type": int, "metavar": "N", "help": "torch CPU threads (intra-op pool); see "
                                                             "docs/operations.md, 'CPU threads'"},
            "tensor_parallel_size": {"type": int,
                                     "help": "split the model across this many processes, one a GPU with --device "
                                             "cuda (docs/operations.md, 'Several GPUs')"}}


# short spellings vLLM users type
ENGINE_FLAG_ALIASES = {"tensor_parallel_size": ("-tp",)}


def threads_default() -> str:
    """What --threads is when not given, in words (every command's, serve's included)."""
    from engine.cpus import default_threads

    return (f"the CPUs this process may use, by affinity, cgroup quota and OMP_NUM_THREADS: "
            f"{default_threads()} here")


def add_engine_flags(parser: argparse.ArgumentParser, names: tuple[str, ...], **dests: str) -> None:
    """Offline commands: `--<name>` with the engine's default (from `server.settings`, as `serve`'s).
    `dests` renames a flag: {setting name: flag name}."""
    from server.settings import setting_default

    options = engine_flag_options()
    for name in names:
        flag = dests.get(name, name)
        extra = dict(options[name])
        extra["help"] += f" (default: {threads_default()})" if name == "threads" else " (default: %(default)s)"
        parser.add_argument("--" + flag.replace("_", "-"), *ENGINE_FLAG_ALIASES.get(name, ()), dest=flag,
                            default=setting_default(name), **extra)


def add_setting(parser: Any, name: str, *aliases: str, unset: str = "", **options: Any) -> None:
    """A `serve` flag: None when not given, so that CAI_DLLM_<NAME> applies; the help shows the value
    the setting takes when neither gives one (`unset` words it when that value is empty)."""
    from server.settings import setting_default

    default = setting_default(name)
    shown = unset if unset and default in (None, {}, []) else str(default).replace("%", "%%")  # help is %-formatted
    options["help"] = f"{options.get('help', '')} (default: {shown})".lstrip()
    parser.add_argument("--" + name.replace("_", "-"), *aliases, dest=name, default=None, **options)


MIX_HELP = ("built-in task kinds and their weights, KIND=WEIGHT,... (default: the mix the model was trained "
             "on, from its training_log.json; tinymodels.tasks.DEFAULT_MIX without one)")


def task_mix(raw: str) -> dict[str, float]:
    from tinymodels.tasks import parse_mix

    try:
        return parse_mix(raw)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def float_list(raw: str) -> list[float]:
    try:
        values = [float(x) for x in raw.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated numbers, got {raw!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("needs at least one number")
    return values


def exit_now(code: int) -> None:
    """Exit without waiting on the model-loading thread: torch's threads still running at interpreter
    shutdown abort the process (exit 134) instead of letting it end with `code`."""
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
