"""`cai-dllm inspect`: describe a local checkpoint directory without loading its weights."""

from __future__ import annotations

import argparse
import json
from typing import Any

from server.cli.args import fail


def add_parser(sub: Any) -> None:
    inspect = sub.add_parser("inspect", help="describe a local checkpoint directory without loading it")
    inspect.add_argument("model_dir", help="local Hugging Face checkpoint directory")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.errors import CheckpointError
    from engine.inspect import describe_checkpoint, format_report

    try:
        report = describe_checkpoint(args.model_dir)
    except CheckpointError as err:
        return fail(err)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
