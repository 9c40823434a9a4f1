"""CPU speed of quantized weights against float, next to accuracy, measured in one run.

Two models, each in float32 and in every --modes entry:
- the built-in model: generated tokens/s of `Engine.generate` over held-out problems (the fixed
  decoder and CAI), at batch 1 and 8, with the accuracy on those same problems;
- a mid-size random LLaDA (LLaDA-8B's shapes at 1/8 of the width: d_model 512, MLP 1536, 32 layers,
  the real vocabulary): the time of one no-cache denoising forward over a 64-token canvas at batch 1
  and 8, with the top-1 agreement of its logits with the float model's as the accuracy column
  (random weights have no task accuracy).

    python bench/quant_speed.py                              # both, none/int8/int4
    python bench/quant_speed.py --threads 1 --problems 16    # on a busy machine
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine import Engine, EngineConfig
from engine.models.config import ModelConfig
from engine.models.llada import LLaDAModel
from engine.quantization import quantize_linears
from engine.special_tokens import SpecialTokens
from tinymodels.checker import is_correct
from tinymodels.evaluate import default_configs, held_out_problems, prompt_ids

BUILTIN = Path(__file__).resolve().parents[1] / "models" / "llada-tiny"
CONFIG_NAMES = ("fixed+exit", "CAI full, gate on +exit")


def builtin_rows(modes: list[str], problems_n: int) -> None:
    problems = held_out_problems(problems_n, seed=0)
    print(f"\n## built-in {BUILTIN.name}: {problems_n} held-out problems (seed 0, chat prompts), generated tokens only")
    print("| mode | configuration | batch | accuracy | tokens | seconds | tok/s | vs float |")
    print("|---|---|---|---|---|---|---|---|")
    baseline: dict[tuple[str, int], float] = {}
    for mode in modes:
        engine = Engine(EngineConfig(model=str(BUILTIN), quantization=mode, max_batch=8))
        configs = {c.name: c.params for c in default_configs(engine.architecture)}
        prompts = [prompt_ids(engine, p, "chat") for p in problems]
        for name in CONFIG_NAMES:
            params = engine.default_params().with_overrides(**configs[name])
            for batch in (1, 8):
                engine.generate(prompts[:batch], params)  # warm-up: first-call allocations
                began = time.perf_counter()
                results = []
                for start in range(0, len(prompts), batch):
                    results += engine.generate(prompts[start:start + batch], params)
                seconds = time.perf_counter() - began
                tokens = sum(len(r.generated_ids) for r in results)
                correct = sum(is_correct(p.prompt, r.text) for p, r in zip(problems, results, strict=True))
                rate = tokens / seconds
                baseline.setdefault((name, batch), rate)
                print(f"| {mode} | {name} | {batch} | {correct}/{len(problems)} | {tokens} | {seconds:.1f} "
                      f"| {rate:.0f} | {rate / baseline[(name, batch)]:.2f}x |", flush=True)


def midsize_rows(modes: list[str], repeats: int, canvas: int) -> None:
    config = ModelConfig(architecture="llada", hidden_size=512, num_layers=32, num_heads=4, num_kv_heads=4,
                         intermediate_size=1536, vocab_size=126464, rms_norm_eps=1e-5, rope_theta=500000.0,
                         qkv_bias=False, tie_word_embeddings=False, rope_in_float32=True, logits_shifted=False,
                         max_position_embeddings=4096)
    torch.manual_seed(0)
    float_model = LLaDAModel(config, SpecialTokens(mask_id=126336, eos_ids=(126081,), pad_id=126081))
    with torch.no_grad():
        for param in float_model.parameters():
            if param.dim() == 2:
                param.normal_(0, 0.02)
    float_model.requires_grad_(False).eval()
    body = sum(p.numel() for p in float_model.layers.parameters()) / 1e6
    print(f"\n## mid-size random LLaDA: d_model 512, MLP 1536, 32 layers, vocab 126464 ({body:.0f} M parameters "
          f"in the layers), float32 activations; one no-cache forward over a {canvas}-token canvas, median of "
          f"{repeats}; accuracy = top-1 agreement of the logits with float's")
    print("| mode | batch | ms/forward | vs float | top-1 agreement |")
    print("|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(1)
    inputs = {b: torch.randint(0, 126000, (b, canvas), generator=gen) for b in (1, 8)}
    reference: dict[int, torch.Tensor] = {}
    base_ms: dict[int, float] = {}
    for mode in modes:
        model = float_model if mode == "none" else copy.deepcopy(float_model)
        quantize_linears(model.layers, mode)
        for batch, ids in inputs.items():
            times = []
            with torch.no_grad():
                logits = model(ids)
                for _ in range(repeats):
                    began = time.perf_counter()
                    model(ids)
                    times.append(time.perf_counter() - began)
            ms = statistics.median(times) * 1e3
            top1 = logits.argmax(-1)
            reference.setdefault(batch, top1)
            base_ms.setdefault(batch, ms)
            agree = (top1 == reference[batch]).float().mean().item()
            print(f"| {mode} | {batch} | {ms:.0f} | {base_ms[batch] / ms:.2f}x | {agree:.3f} |", flush=True)
        if model is not float_model:
            del model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="none,int8,int4", help="'none' first: the baseline of each table")
    parser.add_argument("--problems", type=int, default=32, help="held-out problems for the built-in model")
    parser.add_argument("--repeats", type=int, default=5, help="timed forwards of the mid-size model")
    parser.add_argument("--canvas", type=int, default=64, help="tokens per row of the mid-size forward")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--only", choices=("builtin", "midsize"), help="run one of the two tables")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = args.modes.split(",")
    print(f"# CPU {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} "
          f"torch threads, torch {torch.__version__}; load average before: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.only != "midsize":
        builtin_rows(modes, args.problems)
    if args.only != "builtin":
        midsize_rows(modes, args.repeats, args.canvas)
    print(f"\n# load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
