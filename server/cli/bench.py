"""`cai-dllm bench serve`: load a running server and report throughput, latency percentiles, and the
diffusion decoding (NFE, tokens per forward, steps per block, AUP)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from server.cli.args import fail


def add_parser(sub: Any) -> None:
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
    bs.add_argument("--aup-baseline", metavar="REPORT",
                    help="an earlier --json report of the same workload (e.g. one token per step: "
                         "'{\"policy\": \"fixed\"}'), the first point of AUP's curve; without it AUP is over this "
                         "run alone")
    bs.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import json
    from dataclasses import asdict

    import aiohttp

    from bench.load_generator import builtin_workload, file_workload, format_report, run_load

    if args.concurrency is None and args.request_rate is None:
        args.concurrency = 8
    try:
        decoding = json.loads(args.decoding) if args.decoding else None
        if decoding is not None and not isinstance(decoding, dict):
            raise ValueError("--decoding must be a JSON object")
        workload = (builtin_workload(args.num_requests, args.seed) if args.dataset == "builtin"
                    else file_workload(Path(args.dataset)))
        baseline = _aup_baseline(Path(args.aup_baseline)) if args.aup_baseline else None
    except (ValueError, OSError) as err:
        return fail(err)
    try:
        report = asyncio.run(run_load(args.base_url, workload, args.num_requests, concurrency=args.concurrency,
                                      request_rate=args.request_rate, decoding=decoding, model=args.model,
                                      max_tokens=args.max_tokens, api_key=args.api_key, seed=args.seed,
                                      aup_baseline=baseline))
    except (OSError, aiohttp.ClientError) as err:  # the server is unreachable, or /v1/models refused us
        return fail(f"{args.base_url}: {err}")
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=1) + "\n")
    return 0 if report.completed else 1


def _aup_baseline(path: Path) -> dict[str, float]:
    """The baseline point of an earlier report: its tokens per forward and exact-match accuracy."""
    import json

    report = json.loads(path.read_text())
    fields = ("tokens_per_forward", "accuracy")
    point = {name: report.get(name) for name in fields} if isinstance(report, dict) else dict.fromkeys(fields)
    if not all(isinstance(value, (int, float)) for value in point.values()) or point["tokens_per_forward"] <= 0:
        raise ValueError(f"--aup-baseline {path}: the report has no tokens_per_forward and graded accuracy "
                         f"(a `bench serve --json` report of a graded workload, e.g. --dataset builtin)")
    return point
