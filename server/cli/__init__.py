"""The `cai-dllm` command line: one module per command, each with `add_parser(sub)` and `run(args)`."""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from server.cli import bench, calibrate, generate, inspect, score, serve, train
from server.cli import eval as eval_command
from server.cli.args import Parser
from server.cli.openmp import configure_openmp

COMMANDS = (inspect, generate, score, eval_command, serve, bench, calibrate, train)


def build_parser() -> argparse.ArgumentParser:
    from server.version import package_version

    parser = Parser(prog="cai-dllm", description="Convergence-aware inference server for diffusion language "
                                                 "models (LLaDA, Dream, SDAR, LLaDA2, DiffusionGemma).")
    parser.add_argument("--version", action="version", version=f"cai-dllm {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    configure_openmp()  # before anything imports torch (server/cli/openmp.py)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "generate" and not (args.prompt or args.prompt_ids):
        parser.error("generate needs --prompt or --prompt-ids")
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C: a line, not a traceback (the shell's exit code for SIGINT)
        print("\ninterrupted", file=sys.stderr)
        return 130
