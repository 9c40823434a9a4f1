"""The `cai-dllm` command line."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cai-dllm", description="Convergence-aware inference server "
                                     "for masked diffusion language models (LLaDA, Dream).")
    sub = parser.add_subparsers(dest="command", required=True)
    inspect = sub.add_parser("inspect", help="describe a local checkpoint directory without loading it")
    inspect.add_argument("model_dir", help="local Hugging Face checkpoint directory")
    inspect.add_argument("--json", action="store_true", help="print the report as JSON")
    inspect.set_defaults(func=_inspect)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
