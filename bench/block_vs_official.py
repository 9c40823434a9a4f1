"""The engine's block decoders beside the official SDAR decoders, on the same checkpoint and prompts.

Held-out chat problems (seed 0, as bench/block_table.py picks them) on `models/sdar-tiny`, block 8,
128 new tokens, greedy, stop at the checkpoint's end ids:
- batch 1: the official `generate.py` decoder (static low-confidence; dynamic, threshold 0.9)
  against the engine's `block-static` and `block-dynamic`;
- batch 8: the official evaluation decoder (`huggingface_bd3.py`, static and dynamic 0.9) against
  the same at batch 8, and the engine's CAI against the official dynamic decoder. The official
  batch decoder ignores the attention mask, so a call only holds prompts of equal length: the
  header says how many calls it took and how many rows a call held.
The official code is imported at run time from `--official-dir` (a checkout of JetAstra/SDAR) by
bench/sdar_official/worker.py, in the interpreter `--official-python` (a scratch venv with the
versions its model code needs: bench/sdar_official/README.md); the engine runs in this interpreter.
Each run is a fresh process that loads its model, decodes one prompt untimed, then times decoding
all the prompts; runs alternate official/ours (the order swapped every round). Printed per row:
tokens identical (each response up to and including its end token, at most 128 tokens), exact-match
accuracy of both sides, forwards a request (each side's own count: every `model.forward` call of a
call the request was in, for the official side; the engine's NFE for ours), model calls in all,
the median seconds of the rounds, the ratio of the medians and the median of each round's ratio
(official / ours: above 1, ours is faster).

    python bench/block_vs_official.py --official-dir /tmp/sdar-official \\
        --official-python /tmp/sdar-venv/bin/python --n 100 --rounds 3 --threads 2 \\
        > bench/results/block_vs_official_cpu.txt
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "bench" / "sdar_official" / "worker.py"
GEN_LENGTH = 128


@dataclass(frozen=True)
class Official:
    decoder: str  # "generate" (decoder A, batch 1) or "bd3" (decoder B, the evaluation decoder)
    threshold: Optional[float]  # dynamic decoding's threshold; None: static
    batch: int


@dataclass(frozen=True)
class Comparison:
    name: str
    official: Official
    ours: tuple[tuple[str, Any], ...]  # the engine's decoding knobs
    batch: int


COMPARISONS = [
    Comparison("static", Official("generate", None, 1), (("policy", "block-static"),), 1),
    Comparison("dynamic 0.9", Official("generate", 0.9, 1), (("policy", "block-dynamic"), ("threshold", 0.9)), 1),
    Comparison("static", Official("bd3", None, 8), (("policy", "block-static"),), 8),
    Comparison("dynamic 0.9", Official("bd3", 0.9, 8), (("policy", "block-dynamic"), ("threshold", 0.9)), 8),
    Comparison("CAI vs official dynamic 0.9", Official("bd3", 0.9, 8), (("policy", "cai"), ("gating", True)), 8),
]


def plan(comparisons: list[Comparison], rounds: int) -> list[tuple[int, str, Any]]:
    """(round, side, run) in the order to run them: each official run once a round however many
    comparisons share it, each comparison's two sides next to each other, ours first on odd rounds."""
    order: list[tuple[int, str, Any]] = []
    for round_ in range(rounds):
        done: set[Official] = set()
        for comparison in comparisons:
            pair = [] if comparison.official in done else [("official", comparison.official)]
            done.add(comparison.official)
            pair.append(("ours", comparison))
            order += [(round_, side, run) for side, run in (pair[::-1] if round_ % 2 else pair)]
    return order


def ratio_of_medians(official_seconds: list[float], our_seconds: list[float]) -> float:
    """Median official time over median time of ours: above 1, ours is faster."""
    return statistics.median(official_seconds) / statistics.median(our_seconds)


def median_of_round_ratios(official_seconds: list[float], our_seconds: list[float]) -> float:
    """The median over rounds of official / ours within the round: the two runs of a round are back
    to back, so a machine whose speed drifts during the benchmark moves this less than the medians."""
    return statistics.median(o / u for o, u in zip(official_seconds, our_seconds, strict=True))


def identical(official: list[list[int]], ours: list[list[int]]) -> int:
    return sum(a == b for a, b in zip(official, ours, strict=True))


def our_worker(job: dict, comparison_index: int, threads: int) -> dict:
    import time

    import torch

    from engine import DecodeParams, load_model
    from engine.engine import Engine
    from engine.loading.tokenizer import load_tokenizer

    torch.set_num_threads(threads)
    comparison = COMPARISONS[comparison_index]
    model = load_model(job["model"])
    engine = Engine.from_model(model, load_tokenizer(job["model"]), comparison.batch)
    blocks = -(-job["gen_length"] // job["block_length"])  # the engine's steps count over the canvas's blocks
    params = engine.default_params(DecodeParams.from_dict({
        "gen_length": job["gen_length"], "block_length": job["block_length"], "temperature": 0.0,
        "steps": job["block_length"] * blocks, **dict(comparison.ours)}))
    calls = [0]
    for name in ("forward", "forward_cached"):  # instance attributes: what the engine calls, counted
        method = getattr(model, name)

        def counted(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
            calls[0] += 1
            return _method(*args, **kwargs)

        setattr(model, name, counted)
    prompts = job["prompts"]
    engine.generate(prompts[:1], params)  # first-call allocations are not timed
    calls[0] = 0
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    outputs = [r.generated_ids if r.end_index is None else r.generated_ids[:r.end_index + 1] for r in results]
    return {"seconds": seconds, "outputs": outputs, "forwards": [r.stats.nfe for r in results],
            "model_calls": calls[0]}


def run_official(args: argparse.Namespace, job_path: Path, official: Official) -> dict:
    command = [args.official_python, str(WORKER), "--official-dir", str(args.official_dir), "--job", str(job_path),
               "--decoder", official.decoder, "--batch", str(official.batch), "--threads", str(args.threads)]
    if official.threshold is not None:
        command += ["--threshold", str(official.threshold)]
    return _last_json(subprocess.run(command, capture_output=True, text=True))


def run_ours(args: argparse.Namespace, job_path: Path, comparison: Comparison) -> dict:
    command = [sys.executable, __file__, "--worker", str(COMPARISONS.index(comparison)), "--job", str(job_path),
               "--threads", str(args.threads)]
    return _last_json(subprocess.run(command, capture_output=True, text=True, cwd=REPO,
                                     env={**os.environ, "PYTHONPATH": str(REPO)}))


def _last_json(done: subprocess.CompletedProcess) -> dict:
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(done.args)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--official-dir", type=Path, help="a checkout of JetAstra/SDAR")
    parser.add_argument("--official-python", help="the interpreter of the official side's scratch venv")
    parser.add_argument("--model", default=str(REPO / "models" / "sdar-tiny"))
    parser.add_argument("--n", type=int, default=100, help="held-out problems (seed 0)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each side")
    parser.add_argument("--batches", default="1,8", help="which comparisons to run, by batch")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--job", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is None:
        if args.official_dir is None or args.official_python is None:
            parser.error("--official-dir and --official-python are required")
        if not (args.official_dir / "generate.py").is_file():
            parser.error(f"--official-dir {args.official_dir}: no generate.py (a checkout of JetAstra/SDAR?)")
        if args.rounds < 1 or args.n < 1:
            parser.error("--rounds and --n must be at least 1")
    return args


def make_job(args: argparse.Namespace) -> tuple[dict, list]:
    """Prompts as bench/block_table.py picks them; block length the checkpoint's trained block."""
    from engine import load_model
    from engine.engine import Engine
    from engine.loading.tokenizer import load_tokenizer
    from tinymodels.evaluate import held_out_problems, model_mix, prompt_ids

    engine = Engine.from_model(load_model(args.model), load_tokenizer(args.model), 1)
    problems = held_out_problems(args.n, 0, model_mix(args.model))
    block = json.loads((Path(args.model) / "config.json").read_text())["block_size"]
    job = {"model": str(Path(args.model).resolve()), "gen_length": GEN_LENGTH, "block_length": block,
           "prompts": [prompt_ids(engine, p, "chat") for p in problems]}
    return job, problems


def main() -> None:
    args = parse_args()
    if args.worker is not None:
        print(json.dumps(our_worker(json.loads(args.job.read_text()), args.worker, args.threads)))
        return
    import torch

    from engine.loading.tokenizer import load_tokenizer
    from tinymodels.checker import is_correct

    batches = {int(b) for b in args.batches.split(",")}
    comparisons = [c for c in COMPARISONS if c.batch in batches]
    job, problems = make_job(args)
    tokenizer = load_tokenizer(args.model)
    seconds: dict[Any, list[float]] = {}
    last: dict[Any, dict] = {}
    unstable: list[str] = []  # runs whose tokens changed between rounds (the last round's are compared)
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    with tempfile.TemporaryDirectory() as tmp:
        job_path = Path(tmp) / "job.json"
        job_path.write_text(json.dumps(job))
        for round_, side, run in plan(comparisons, args.rounds):
            out = (run_official if side == "official" else run_ours)(args, job_path, run)
            seconds.setdefault(run, []).append(out["seconds"])
            if run in last and last[run]["outputs"] != out["outputs"]:
                unstable.append(f"{side} {run}")
            last[run] = out
            print(f"#   round {round_ + 1}: {side} {run}: {out['seconds']:.2f} s", file=sys.stderr, flush=True)

    def accuracy(outputs: list[list[int]]) -> int:
        return sum(is_correct(p.prompt, tokenizer.decode(o, skip_special_tokens=True))
                   for p, o in zip(problems, outputs, strict=True))

    official_any = next(last[c.official] for c in comparisons)
    versions = official_any["versions"]
    print(f"# {platform.machine()} CPU, {args.threads} threads a side, float32; ours: torch {torch.__version__}; "
          f"official: torch {versions['torch']}, transformers {versions['transformers']}, flash-attn's two calls "
          f"by the plain-torch stand-in (bench/sdar_official); load average before {load_before}, "
          f"after {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"# official code from {args.official_dir}: " + ", ".join(
        f"{path} sha256 {digest[:12]}" for path, digest in official_any["sha256"].items()))
    print(f"# {args.n} held-out problems (seed 0, chat prompts) of {Path(args.model).name}, block "
          f"{job['block_length']}, {GEN_LENGTH} new tokens, greedy, stop at the end ids; {args.rounds} rounds, "
          f"official and ours alternated")
    for official in dict.fromkeys(c.official for c in comparisons if c.official.decoder == "bd3"):
        out = last[official]
        print(f"# official batch decoder (huggingface_bd3.py, threshold {official.threshold or 1.0}) batches "
              f"equal-length prompts only: {out['decode_calls']} calls for {args.n} prompts "
              f"({args.n / out['decode_calls']:.1f} rows a call, at most {official.batch}); rows cut short by "
              f"another row's stop: {out['cut_short']}")
    print(f"# command: python bench/block_vs_official.py --official-dir {args.official_dir} --official-python "
          f"{args.official_python} --n {args.n} --rounds {args.rounds} --threads {args.threads} "
          f"--batches {args.batches}")
    if unstable:
        print(f"# WARNING: tokens changed between rounds in {'; '.join(unstable)}")
    print()
    print("| batch | decoder | identical tokens | accuracy official / ours | forwards a request official / ours "
          "| model calls official / ours | seconds official (median) | seconds ours (median) | official / ours "
          "| official / ours by round (median) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c in comparisons:
        official, ours = last[c.official], last[c]
        print(f"| {c.batch} | {c.name} | {identical(official['outputs'], ours['outputs'])}/{args.n} "
              f"| {accuracy(official['outputs'])} / {accuracy(ours['outputs'])} "
              f"| {statistics.mean(official['forwards']):.1f} / {statistics.mean(ours['forwards']):.1f} "
              f"| {official['model_calls']} / {ours['model_calls']} "
              f"| {statistics.median(seconds[c.official]):.2f} | {statistics.median(seconds[c]):.2f} "
              f"| {ratio_of_medians(seconds[c.official], seconds[c]):.2f}x "
              f"| {median_of_round_ratios(seconds[c.official], seconds[c]):.2f}x |")
    print()
    print("Rounds (seconds): " + "; ".join(
        f"batch {c.batch} {c.name}: official {' '.join(f'{s:.2f}' for s in seconds[c.official])}, "
        f"ours {' '.join(f'{s:.2f}' for s in seconds[c])}" for c in comparisons))


if __name__ == "__main__":
    main()
