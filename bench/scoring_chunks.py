"""Likelihood scoring in chunks: what one chunk costs next to a decode step, and how many scoring
tokens finish within the server's stall timeout.

The server runs a scoring request (`echo` + `logprobs`) as forwards of at most
`--score-chunk-tokens` tokens between decode steps, so a decode step waits on at most one of them;
`--max-score-tokens` (the most tokens one request may feed the model) defaults to what the bundled
model scores within `--stall-timeout` on a 2-core CPU. This measures both on a prompt of `--prompt-len`
tokens with `--samples` samples per split (the defaults are the request the issue reported: a
300-character prompt at the default 16 samples, 1.43 M tokens), running `--chunks` chunks of each
size rather than whole jobs; and, beside them, the median step of a full batch of ordinary requests.

    python bench/scoring_chunks.py --threads 1
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine import Engine, EngineConfig  # noqa: E402
from engine.scoring import ScoringJob, scoring_cost  # noqa: E402
from server.settings import ServerSettings  # noqa: E402
from tinymodels.evaluate import prompt_ids  # noqa: E402
from tinymodels.tasks import sample  # noqa: E402


def step_seconds(engine: Engine, steps: int) -> float:
    """Median step of a full batch of held-out problems at the server's default decoding."""
    problems = sample(engine.max_batch * 4, seed=0)
    for problem in problems:
        engine.add_request(prompt_ids(engine, problem, "chat"))
    times = []
    while engine.has_unfinished() and len(times) < steps:
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    engine.reset()
    return statistics.median(times[2:] or times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(REPO / "models" / "llada-tiny"))
    parser.add_argument("--prompt-len", type=int, default=300)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--chunk-tokens", default="512,1024,2048,4096,8192")
    parser.add_argument("--chunks", type=int, default=24, help="chunks timed per size (after one warm-up)")
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed")
    parser.add_argument("--threads", type=int, help="torch threads (default: the engine's, EngineConfig.threads)")
    args = parser.parse_args()
    engine = Engine(EngineConfig(model=args.model, threads=args.threads))
    stall = ServerSettings().stall_timeout
    text = ("0123456789+-=;" * args.prompt_len)[:args.prompt_len]
    ids = engine.tokenizer.encode(text, add_special_tokens=False)[:args.prompt_len]
    cost = scoring_cost(len(ids), args.samples)
    print(f"# {platform.machine()} CPU, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"model {args.model}; 1-minute load average {os.getloadavg()[0]:.1f} (other work on the machine included)")
    print(f"# command: python bench/scoring_chunks.py --prompt-len {args.prompt_len} --samples {args.samples} "
          f"--chunk-tokens {args.chunk_tokens} --chunks {args.chunks} --steps {args.steps}"
          + (f" --threads {args.threads}" if args.threads else ""))
    print(f"# a prompt of {len(ids)} tokens, {args.samples} samples per split: {cost} scoring tokens in all")
    print(f"decode step, batch {engine.max_batch} (default decoding): {1000 * step_seconds(engine, args.steps):.1f} ms")
    print(f"{'chunk tokens':>12} {'rows':>5} {'chunk ms (median)':>18} {'max ms':>7} {'tokens/s':>9} "
          f"{'tokens within ' + format(stall, 'g') + ' s':>20}")
    for chunk in (int(c) for c in args.chunk_tokens.split(",")):
        job = ScoringJob(engine.model, ids, args.samples, seed=0, chunk_tokens=chunk)
        job.advance()  # warm-up
        times, fed = [], 0
        for _ in range(args.chunks):
            if job.done:
                break
            started = time.perf_counter()
            fed += job.advance()
            times.append(time.perf_counter() - started)
        rate = fed / sum(times)
        rows = max(1, chunk // len(ids))
        print(f"{chunk:>12} {rows:>5} {1000 * statistics.median(times):>18.1f} {1000 * max(times):>7.1f} "
              f"{rate:>9.0f} {int(rate * stall):>20}", flush=True)


if __name__ == "__main__":
    main()
