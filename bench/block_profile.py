"""Where a block-diffusion step's time goes: forward compute, KV/mask preparation, copies and host work.

Each configuration decodes the same prompts with `Engine.generate` at batch 1 and at batch 8 and
times, per step (milliseconds, median over the runs of the mean per step of a run), by wrapping
what the step calls:

- `step`: `Engine.step`, all of it;
- `forward`: the model's forward passes (`forward_cached`, `forward`), all of them;
- `attention`: the attention kernel inside them (part of the forward's compute);
- `kv write`: writing the fed tokens' keys/values into the store (`write_kv`, every layer);
- `kv read`: what `CacheWrite.write_and_read` does past the write: handing the attention the columns
  it reads (a view costs nothing; a gather of rows is a copy of every attended key and value);
- `mask`: building the block-causal mask and the key mask;
- `compute`: forward - kv write - kv read - mask;
- `decide`: the decoding policies' tensor work (`DecodingMode.decide`);
- `host`: step - forward - decide: building the batch, the one host read, the scheduler.

Models: `sdar-tiny` (models/sdar-tiny, held-out chat problems, block-dynamic 0.9, 128 new tokens)
and `sdar-mid`, a random SDAR-shaped model large enough that compute dominates (sdar-tiny's layout
and vocabulary, wider and deeper; random prompts, block-static, one token a step, end tokens
ignored). On a GPU each timer synchronises the device, so the split is exact and the total a
little slower than an untimed step.

    python bench/block_profile.py --threads 2 > bench/results/block_profile_cpu.txt
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from random_models import build_random

import engine.mode as mode_module
import engine.models.block_transformer as block_module
import engine.models.kv_cache as kv_module
from engine.chat import chat_prompt_ids
from engine.decoding import DecodeParams
from engine.engine import Engine
from engine.loading.checkpoint import CheckpointFiles
from engine.loading.tokenizer import load_tokenizer
from engine.loading.weights import load_model
from engine.models.transformer import DiffusionTransformer
from tinymodels.evaluate import held_out_problems, model_mix

MODELS = Path(__file__).resolve().parents[1] / "models"
MID_SHAPES = {"hidden_size": 1024, "num_hidden_layers": 12, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 64, "intermediate_size": 2816}
PARTS = ("step", "forward", "attention", "kv write", "kv read", "mask", "compute", "decide", "host")


@dataclass(frozen=True)
class Setup:
    name: str
    model: DiffusionTransformer
    tokenizer: Any
    prompts: list[list[int]]
    params: DecodeParams


def tiny_setup(n: int, gen_length: int) -> Setup:
    folder = MODELS / "sdar-tiny"
    tokenizer = load_tokenizer(str(folder))
    model = load_model(str(folder))
    prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": p.prompt}], mask_id=model.special.mask_id)
               for p in held_out_problems(n, 0, model_mix(str(folder)))]
    params = DecodeParams(policy="block-dynamic", threshold=0.9, gen_length=gen_length, steps=gen_length)
    return Setup("sdar-tiny", model, tokenizer, prompts, params)


def mid_setup(n: int, gen_length: int, prompt_len: int, device: torch.device) -> Setup:
    checkpoint = CheckpointFiles.open(MODELS / "sdar-tiny")
    hf, special = {**checkpoint.config, **MID_SHAPES}, checkpoint.special_tokens()
    limit = min(special.mask_id, special.pad_id, *special.eos_ids)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, limit, (prompt_len + i % 7,), generator=generator).tolist() for i in range(n)]
    model = build_random(hf, special, device, torch.float32)
    params = DecodeParams(policy="block-static", gen_length=gen_length, steps=gen_length, ignore_eos=True)
    return Setup("sdar-mid", model, None, prompts, params)


class Timers:
    """Wall seconds inside each wrapped callable, summed (synchronising a GPU around each)."""

    def __init__(self, device: torch.device) -> None:
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.sync()
            begun = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sync()
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - begun
                self.calls[name] = self.calls.get(name, 0) + 1
        return timed

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def instrument_modules(timers: Timers) -> None:
    """Wrap, once, what a step calls from the modules the engine reads them from."""
    kv_module.write_kv = timers.wrap("kv write", kv_module.write_kv)
    kv_module.CacheWrite.write_and_read = timers.wrap("kv write+read", kv_module.CacheWrite.write_and_read)
    kv_module.CacheWrite.key_mask = timers.wrap("mask", kv_module.CacheWrite.key_mask)
    block_module.block_causal_mask = timers.wrap("mask", block_module.block_causal_mask)
    mode_module.DecodingMode.decide = timers.wrap("decide", mode_module.DecodingMode.decide)  # the block mode's


def instrument_model(model: DiffusionTransformer, timers: Timers) -> None:
    """Wrap, once per model, its forwards and attention kernels (instance attributes)."""
    model.forward_cached = timers.wrap("forward", model.forward_cached)  # type: ignore[method-assign]
    model.forward = timers.wrap("forward", model.forward)  # type: ignore[method-assign]
    for layer in model.layers:
        layer.attn.kernel = timers.wrap("attention", layer.attn.kernel)


def split(timers: Timers) -> dict[str, float]:
    """Milliseconds per step of each part (`PARTS`)."""
    s = timers.seconds
    steps = max(timers.calls.get("step", 0), 1)
    parts = {name: s.get(name, 0.0) for name in ("step", "forward", "attention", "kv write", "mask", "decide")}
    parts["kv read"] = s.get("kv write+read", 0.0) - parts["kv write"]
    parts["compute"] = parts["forward"] - s.get("kv write+read", 0.0) - parts["mask"]
    parts["host"] = parts["step"] - parts["forward"] - parts["decide"]
    return {name: 1000 * parts[name] / steps for name in PARTS}


def profile(setup: Setup, batch: int, runs: int, timers: Timers) -> tuple[dict[str, float], float, int]:
    """Median ms per step of each part over `runs` runs, forwards per step, steps per run."""
    engine = Engine.from_model(setup.model, setup.tokenizer, max_batch=batch)
    engine.step = timers.wrap("step", engine.step)  # type: ignore[method-assign]
    engine.generate(setup.prompts[:batch], setup.params)  # warm-up
    per_run, forwards, steps = [], [], []
    for _ in range(runs):
        timers.reset()
        engine.generate(setup.prompts, setup.params)
        per_run.append(split(timers))
        steps.append(timers.calls["step"])
        forwards.append(timers.calls["forward"] / timers.calls["step"])
    medians = {name: statistics.median(run[name] for run in per_run) for name in PARTS}
    return medians, statistics.median(forwards), int(statistics.median(steps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["sdar-tiny", "sdar-mid"], choices=["sdar-tiny", "sdar-mid"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--n", type=int, default=16, help="prompts per run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--gen-length", type=int, default=128)
    parser.add_argument("--mid-gen-length", type=int, default=32)
    parser.add_argument("--mid-prompt", type=int, default=120, help="sdar-mid's shortest prompt (random ids)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"# bench/block_profile.py {' '.join(f'{k}={v}' for k, v in vars(args).items())}")
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, device {device}")
    print("# ms per step (median of runs); compute = forward - kv write - kv read - mask; "
          "host = step - forward - decide")
    print(f"{'model':10} {'batch':>5} {'steps':>6} {'fwd/step':>8} " + " ".join(f"{p:>10}" for p in PARTS))
    timers = Timers(device)
    instrument_modules(timers)
    for name in args.models:
        setup = (tiny_setup(args.n, args.gen_length) if name == "sdar-tiny"
                 else mid_setup(args.n, args.mid_gen_length, args.mid_prompt, device))
        setup.model.to(device)
        instrument_model(setup.model, timers)
        for batch in args.batches:
            parts, forwards, steps = profile(setup, batch, args.runs, timers)
            print(f"{name:10} {batch:>5} {steps:>6} {forwards:>8.2f} " + " ".join(f"{parts[p]:>10.3f}" for p in PARTS),
                  flush=True)


if __name__ == "__main__":
    main()
