"""The built-in block-diffusion model beside llada-tiny, and what its exact cache buys.

On the same held-out problems (chat prompts), for each model and decoder at batch 1 and batch 8:
exact-match accuracy, forwards (NFE) per request and generated tokens per second (wall clock of
`Engine.generate` over all the problems, after one warm-up request; generated tokens only: the
response up to and including its end token). Decoders: each family's own (LLaDA's fixed
one-token-a-step decoder; SDAR's static and dynamic low-confidence decoders) and CAI (with the dual
cache on LLaDA, its best setting; per block on SDAR).
The SDAR rows run twice, with the exact cache of finished blocks and with none (every step
re-runs the prompt and the finished blocks, as LLaDA2.0's own `generate()` does); the last table
sets each pair side by side: the speed-up and whether the tokens are identical.

    python bench/block_table.py --threads 2 > bench/results/block_table_cpu.txt
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine import load_model
from engine.decoding import DecodeParams
from engine.engine import Engine
from engine.loading.tokenizer import load_tokenizer
from tinymodels.checker import is_correct
from tinymodels.evaluate import held_out_problems, model_mix, prompt_ids

MODELS = Path(__file__).resolve().parents[1] / "models"
GEN_LENGTH = 128
# (name, decoding knobs); SDAR rows decode with the model's trained block (the engine's default).
LLADA_ROWS = [
    ("fixed (LLaDA's decoder)", {"policy": "fixed", "block_length": 32, "steps": GEN_LENGTH}),
    ("CAI, dual cache", {"policy": "cai", "block_length": 32, "steps": GEN_LENGTH, "cache": "dual",
                         "refresh_interval": 16, "gating": True}),
]
SDAR_ROWS = [
    ("block-static (SDAR's static decoder)", {"policy": "block-static", "steps": GEN_LENGTH}),
    ("block-dynamic 0.9 (SDAR's dynamic decoder)", {"policy": "block-dynamic", "threshold": 0.9,
                                                    "steps": GEN_LENGTH}),
    ("CAI per block", {"policy": "cai", "steps": GEN_LENGTH, "gating": True}),
]


@dataclass
class Row:
    model: str
    name: str
    cache: str
    batch: int
    correct: int
    n: int
    nfe: float
    tokens: int
    seconds: float
    outputs: list[list[int]]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def run(engine: Engine, model: str, name: str, knobs: dict[str, Any], batch: int, problems: list,
        prompts: list[list[int]]) -> Row:
    params = engine.default_params(DecodeParams.from_dict({"gen_length": GEN_LENGTH, **knobs}))
    runner = Engine.from_model(engine.model, engine.tokenizer, batch)
    runner.generate(prompts[:1], params)  # first-call allocations are not timed
    start = time.perf_counter()
    results = runner.generate(prompts, params)
    seconds = time.perf_counter() - start
    outputs = [r.response_ids if r.end_index is None else r.generated_ids[:r.end_index + 1] for r in results]
    correct = sum(is_correct(p.prompt, r.text or "") for p, r in zip(problems, results, strict=True))
    return Row(model, name, str(params.cache), batch, correct,
               len(problems), sum(r.stats.nfe for r in results) / len(results), sum(map(len, outputs)),
               seconds, outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=100, help="held-out problems (seed 0)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--block-model", default=str(MODELS / "sdar-tiny"))
    parser.add_argument("--llada-model", default=str(MODELS / "llada-tiny"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"# {platform.machine()} CPU, {args.threads} threads, torch {torch.__version__}, float32; "
          f"load average before {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"# {args.n} held-out problems (seed 0, chat prompts), max_tokens {GEN_LENGTH}")
    rows: list[Row] = []
    plans = [(args.llada_model, LLADA_ROWS, (None,)), (args.block_model, SDAR_ROWS, ("exact", "none"))]
    for path, table, caches in plans:
        model = load_model(path)
        engine = Engine.from_model(model, load_tokenizer(path), max(batches))
        problems = held_out_problems(args.n, 0, model_mix(path))
        prompts = [prompt_ids(engine, p, "chat") for p in problems]
        for name, knobs in table:
            for cache in caches:
                row_knobs = knobs if cache is None else {**knobs, "cache": cache}
                for batch in batches:
                    rows.append(run(engine, Path(path).name, name, row_knobs, batch, problems, prompts))
                    r = rows[-1]
                    print(f"#   done: {r.model} {r.name} cache {r.cache} batch {batch}: {r.seconds:.1f} s", flush=True)
    print(f"# load average after {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print()
    print("| model | decoder | cache | batch | accuracy | NFE/req | tok/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.model} | {r.name} | {r.cache} | {r.batch} | {100 * r.correct / r.n:.1f}% ({r.correct}/{r.n}) "
              f"| {r.nfe:.1f} | {r.tokens_per_s:.0f} |")
    print()
    print("| block model decoder | batch | exact cache tok/s | no cache tok/s | speed-up | identical tokens |")
    print("|---|---|---|---|---|---|")
    for exact in rows:
        if exact.cache != "exact":
            continue
        [none] = [r for r in rows if r.model == exact.model and r.name == exact.name and r.cache == "none"
                  and r.batch == exact.batch]
        same = sum(a == b for a, b in zip(exact.outputs, none.outputs, strict=True))
        print(f"| {exact.name} | {exact.batch} | {exact.tokens_per_s:.0f} | {none.tokens_per_s:.0f} "
              f"| {exact.tokens_per_s / none.tokens_per_s:.2f}x | {same}/{exact.n} |")


if __name__ == "__main__":
    main()
