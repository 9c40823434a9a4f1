"""Offline generated tokens/s of a cached step three ways, in one run: the ordinary (packed) forward,
the static forward run eagerly, and the static forward compiled with torch.compile(fullgraph=True)
(`EngineConfig.torch_compile`, engine/static_forward.py): the block-diffusion cached step
(sdar-tiny, the default), the masked dual-cache step (`--model models/llada-tiny --policies
'threshold 0.9 dual'`) or the uniform-noise decoder pass (`--model models/diffusiongemma-tiny
--policies dg-official`).

The same held-out chat problems, decoding and threads for each; runs alternated between the three
engines, so a slow phase of a shared machine hits each at random; ratios of the medians against the
ordinary forward. The compiled engine's first runs compile every shape they meet (batch bucket x
tokens fed x columns attended), until a run meets no new one (the second compiles again the shapes
first met before the store last grew): their time is printed as the warm-up cost and left out of
the ratio. Generated tokens are the response
tokens (before the end token); accuracy is exact match, `cai-dllm eval`'s grader; "identical"
counts the texts equal to the ordinary forward's. DiffusionGemma samples every step, so a rounding
difference of the static or compiled pass (more columns summed, other batch shapes) can change a
draw, and with it a text.

    python bench/static_step.py --n 64 --batch 8 --repeats 3 > bench/results/static_step_cpu.txt
    python bench/static_step.py --model models/llada-tiny --policies 'threshold 0.9 dual' 'cai dual' \
        --n 64 --batch 8 --repeats 3 > bench/results/static_step_llada_cpu.txt
    python bench/static_step.py --model models/diffusiongemma-tiny --policies dg-official \
        --n 64 --batch 8 --repeats 3 > bench/results/static_step_dg_cpu.txt
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine import DecodeParams, Engine, load_model  # noqa: E402
from engine.chat import chat_prompt_ids  # noqa: E402
from engine.loading.tokenizer import load_tokenizer  # noqa: E402
from engine.static_forward import StaticForwards  # noqa: E402
from tinymodels.evaluate import held_out_problems  # noqa: E402
from tinymodels.tasks import answer_of  # noqa: E402

POLICIES = {"block-static": DecodeParams(policy="block-static"),
            "block-dynamic 0.9": DecodeParams(policy="block-dynamic", threshold=0.9),
            "cai": DecodeParams(policy="cai"),
            # bench/offline_vs_baseline.py's masked dual-cache configurations
            "threshold 0.9 dual": DecodeParams(policy="threshold", threshold=0.9, gen_length=128, block_length=32,
                                               steps=128, cache="dual", refresh_interval=16),
            "cai dual": DecodeParams(policy="cai", gen_length=128, block_length=32, steps=128, cache="dual",
                                     refresh_interval=16),
            # DiffusionGemma's passes (--model models/diffusiongemma-tiny), seeded: the uniform-noise mode
            # samples even at temperature 0, and a seed makes every run's texts the same
            "dg-official": DecodeParams(policy="dg-official", seed=0)}
ENGINES = ("ordinary", "static", "compiled")
WARM_UP_RUNS = 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO / "models" / "sdar-tiny"))
    parser.add_argument("--n", type=int, default=64, help="held-out problems")
    parser.add_argument("--seed", type=int, default=7, help="the held-out problems' seed")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--policies", nargs="+", choices=tuple(POLICIES),
                        default=["block-static", "block-dynamic 0.9", "cai"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model), load_tokenizer(args.model)
    problems = held_out_problems(args.n, args.seed)
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": p.prompt}]) for p in problems]
    print(f"# {platform.machine()}, {args.threads} threads, CPU, {model.dtype}; {Path(args.model).name}, "
          f"{args.n} held-out chat problems (seed {args.seed}), batch {args.batch}; runs alternated, "
          f"{args.repeats} each; torch {torch.__version__}")
    model_dir = Path(args.model).resolve()
    shown = model_dir.relative_to(REPO) if model_dir.is_relative_to(REPO) else model_dir
    print(f"# command: python bench/static_step.py --model {shown} --n {args.n} --seed {args.seed} "
          f"--batch {args.batch} --repeats {args.repeats} --threads {args.threads} "
          f"--policies {' '.join(repr(p) for p in args.policies)}")
    print(f"{'policy':18} {'forward':9} {'tok/s runs':24} {'median':>7} {'x ordinary':>10} {'accuracy':>8} "
          f"{'identical':>9}")
    for name in args.policies:
        params = POLICIES[name]
        engines = {"ordinary": Engine.from_model(model, tokenizer, max_batch=args.batch),
                   "static": Engine.from_model(model, tokenizer, max_batch=args.batch),
                   "compiled": Engine.from_model(model, tokenizer, max_batch=args.batch, torch_compile=True)}
        # the static forward run eagerly: the compiled engine's, without the compile
        mode = engines["static"].mode
        mode.static_forwards = StaticForwards(mode._static_run, "eager", args.batch, model.device)
        torch._dynamo.reset()
        began = time.perf_counter()
        # until a run meets no new shape (at most WARM_UP_RUNS): a shape first met before the store
        # last grew is compiled again over the grown store
        static = engines["compiled"].mode.static_forwards
        for warm_up_runs in range(1, WARM_UP_RUNS + 1):
            made = static.keys
            engines["compiled"].generate(prompts, params)
            if warm_up_runs > 1 and static.keys == made:
                break
        warm_up = time.perf_counter() - began
        rates: dict[str, list[float]] = {e: [] for e in ENGINES}
        texts: dict[str, list[str]] = {}
        for _ in range(args.repeats):
            for label, engine in engines.items():
                began = time.perf_counter()
                results = engine.generate(prompts, params)
                elapsed = time.perf_counter() - began
                tokens = sum(len(r.response_ids) for r in results)
                rates[label].append(tokens / elapsed)
                texts[label] = [r.text or "" for r in results]
        base = statistics.median(rates["ordinary"])
        for label in ENGINES:
            median = statistics.median(rates[label])
            correct = sum(answer_of(p.kind, t) == p.answer for p, t in zip(problems, texts[label], strict=True))
            same = sum(a == b for a, b in zip(texts[label], texts["ordinary"], strict=True))
            runs = " ".join(f"{r:.0f}" for r in rates[label])
            print(f"{name:18} {label:9} {runs:24} {median:7.0f} {median / base:9.2f}x {100 * correct / args.n:7.1f}% "
                  f"{same:>5}/{args.n}")
        print(f"{name:18} compiled: {warm_up_runs} warm-up runs {warm_up:.0f} s ({static.made} "
              f"shapes compiled)")


if __name__ == "__main__":
    main()
