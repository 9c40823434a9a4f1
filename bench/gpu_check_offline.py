"""The offline engine at LLaDA-8B's shape on one GPU: batch 1 against batch 8, CUDA graphs off and on.

The model has LLaDA-8B-Instruct's released architecture with random weights made on the device
(bench/random_models.py, as bench/gpu_step.py builds it), decoded with the fixed policy (one token a
step, no early exit, dual cache): the tokens are meaningless, the time of the steps is not. Each
configuration decodes `batch` requests of random prompts to the end through the loop
`Engine.generate` runs (add_request, then step until done), `--warmups` times untimed (kernel
selection, cuBLAS handles, the graphs' capture) and once timed: generated tokens only over the wall
time of that run; each step's time is read on the host after the step's one device-to-host read,
which waits for the device. A batch's graph and eager runs decode the same prompts and their tokens
are compared: random weights make near-ties common, so in bfloat16 a few differing tokens can be
rounding (the count is reported; tests/engine/test_cuda_models.py judges graphs on real models).
`J_per_req` is the device's energy counter over the timed run (the server's meter: NVML on a GPU,
RAPL on a CPU where readable, "-" where there is none) per request: the whole device's, so anything
else running on it counts too.

    python bench/gpu_check_offline.py               # one H100/H200: LLaDA-8B shape, bf16, batch 1 and 8
    python bench/gpu_check_offline.py --shapes tiny --device cpu --dtype float32 --prompt-len 16 \\
        --gen-len 16 --block 8 --batches 1 2 --warmups 0          # the same code on CPU
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from engine import DecodeParams, Engine
from server.energy import open_meter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_step import REAL_DIR, build_random_model, free_model, model_spec, random_prompts
from roofline import sync


@dataclass(frozen=True)
class OfflineRow:
    model: str
    batch: int
    graphs: bool
    generated_tokens: int
    steps: int
    wall_s: float
    tokens_per_s: float
    median_step_ms: float
    max_step_ms: float
    captured_graphs: int
    tokens_differing_from_eager: Optional[int]  # None for the eager run itself
    joules_per_request: Optional[float]  # the device's energy counter over the timed run / its requests


@dataclass(frozen=True)
class _Run:
    tokens: list[tuple[int, ...]]
    step_s: list[float]
    wall_s: float


def _decode(engine: Engine, prompts: Sequence[tuple[int, ...]], params: DecodeParams) -> _Run:
    order = [engine.add_request(prompt, params) for prompt in prompts]
    results: dict[str, tuple[int, ...]] = {}
    step_s = []
    device = engine.model.device
    sync(device)
    start = time.perf_counter()
    while engine.has_unfinished():
        before = time.perf_counter()
        outputs = engine.step()
        step_s.append(time.perf_counter() - before)
        for output in outputs:
            if output.result is not None:
                results[output.request_id] = tuple(output.result.generated_ids)
    sync(device)
    return _Run([results[request_id] for request_id in order], step_s, time.perf_counter() - start)


def _captured(engine: Engine) -> int:
    static = getattr(engine.mode, "static_forwards", None)
    return 0 if static is None or static.how != "graph" else static.made


def run_batch(model: Any, name: str, prompts: list[tuple[int, ...]], params: DecodeParams, graph_modes: list[bool],
              warmups: int) -> list[OfflineRow]:
    rows: list[OfflineRow] = []
    meter = open_meter(str(model.device))  # the server's meter of this device (`--energy-meter auto`)
    eager: Optional[list[tuple[int, ...]]] = None
    for graphs in graph_modes:
        engine = Engine.from_model(model, max_batch=len(prompts), cuda_graphs=graphs)
        for _ in range(warmups):
            _decode(engine, prompts, params)
        before = meter.read_joules()
        run = _decode(engine, prompts, params)
        after = meter.read_joules()
        joules = None if before is None or after is None else (after - before) / len(prompts)
        if not graphs:
            eager = run.tokens
        differing = None if not graphs or eager is None else sum(
            a != b for ours, theirs in zip(run.tokens, eager, strict=True) for a, b in zip(ours, theirs, strict=True))
        generated = sum(len(tokens) for tokens in run.tokens)
        rows.append(OfflineRow(name, len(prompts), graphs, generated, len(run.step_s), run.wall_s,
                               generated / run.wall_s, 1e3 * statistics.median(run.step_s),
                               1e3 * max(run.step_s), _captured(engine), differing, joules))
        del engine
        free_model()
    return rows


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("llada", "dream"), default="llada")
    parser.add_argument("--shapes", choices=("real", "tiny"), default="real")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--gen-len", type=int, default=256)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--graphs", nargs="+", choices=("off", "on"), default=None,
                        help="CUDA graphs for the dual-cache step (EngineConfig.cuda_graphs); default: off and on "
                             "on CUDA, off elsewhere")
    parser.add_argument("--warmups", type=int, default=1, help="untimed runs of each configuration first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--real-dir", type=Path, default=REAL_DIR, help="folder with the released configs")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    on_cuda = torch.device(args.device).type == "cuda"
    if on_cuda and not torch.cuda.is_available():
        parser.error("no CUDA device here; on CPU run e.g. --shapes tiny --device cpu --dtype float32")
    args.graphs = args.graphs or (["off", "on"] if on_cuda else ["off"])
    if "on" in args.graphs and not on_cuda:
        parser.error("--graphs on needs --device cuda")
    if args.gen_len % args.block:
        parser.error(f"--block {args.block} must divide --gen-len {args.gen_len}")
    return args


_HEADER = ("model", "batch", "graphs", "gen_tok", "steps", "wall_s", "tok_per_s", "step_ms_med", "step_ms_max",
           "captured", "tok_vs_eager", "J_per_req")


def format_row(row: OfflineRow) -> str:
    differing = "-" if row.tokens_differing_from_eager is None else \
        f"{row.tokens_differing_from_eager}/{row.generated_tokens}"
    cells = (row.model, row.batch, "on" if row.graphs else "off", row.generated_tokens, row.steps,
             f"{row.wall_s:.2f}", f"{row.tokens_per_s:.1f}", f"{row.median_step_ms:.2f}", f"{row.max_step_ms:.2f}",
             row.captured_graphs, differing,
             "-" if row.joules_per_request is None else f"{row.joules_per_request:.2f}")
    return " ".join(str(c).rjust(max(len(h), 6)) for c, h in zip(cells, _HEADER, strict=True))


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    shown = list(sys.argv[1:] if argv is None else argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    spec = model_spec(args.model, args.shapes, args.real_dir)
    start = time.perf_counter()
    model = build_random_model(spec, device, dtype, args.seed)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    params = DecodeParams(policy="fixed", gen_length=args.gen_len, block_length=args.block, steps=args.gen_len,
                          cache="dual", refresh_interval=0, early_exit=False)
    print(f"# command: python bench/gpu_check_offline.py {shlex.join(shown)}".rstrip())
    print(f"# device: {device_name}; torch {torch.__version__}; dtype {args.dtype}; {model.display_name} "
          f"{args.shapes} shapes, {sum(p.numel() for p in model.parameters()) / 1e9:.3f}B parameters, random "
          f"weights built in {time.perf_counter() - start:.1f} s")
    print(f"# fixed policy (1 token a step, no early exit), dual cache, prompt {args.prompt_len} + gen {args.gen_len}, "
          f"block {args.block}; {args.warmups} untimed run(s) then one timed run per row; tok_vs_eager = generated "
          "tokens that differ from the eager run of the same prompts")
    print(" ".join(h.rjust(max(len(h), 6)) for h in _HEADER), flush=True)
    rows: list[OfflineRow] = []
    for batch in args.batches:
        prompts = random_prompts(batch, args.prompt_len, spec.token_limit, args.seed + batch)
        for row in run_batch(model, args.model, prompts, params, [g == "on" for g in args.graphs], args.warmups):
            print(format_row(row), flush=True)
            rows.append(row)
    if args.json is not None:
        args.json.write_text(json.dumps({"device": device_name, "torch": torch.__version__, "dtype": args.dtype,
                                         "shapes": args.shapes, "rows": [asdict(r) for r in rows]}, indent=1))


if __name__ == "__main__":
    main()
