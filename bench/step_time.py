"""Step time of the batched runner, and the share of it spent outside the model forward.

For each model (the tiny fixture and a ~100M-parameter random LLaDA), batch size and cache mode,
the runner decodes `--steps` steps of CAI (prompt 64 tokens, 128 generated in blocks of 32) and we
time every `runner.step()` and every model forward inside it. "Outside" = step time minus forward
time: sampling, the policy, commits, cache bookkeeping, the per-step sync — the controller overhead
the paper puts below 2 %.

    python bench/step_time.py --steps 12 > bench/results/step_time_cpu.txt
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

from engine import load_model
from engine.decoding import BlockDiffusionRunner, DecodeParams, GenerationRequest
from engine.models.llada import LLaDAModel
from engine.special_tokens import SpecialTokens

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures"


def random_llada(d_model: int, layers: int, heads: int, mlp: int, vocab: int) -> LLaDAModel:
    hf = {"d_model": d_model, "n_layers": layers, "n_heads": heads, "n_kv_heads": heads, "mlp_hidden_size": mlp,
          "vocab_size": vocab, "embedding_size": vocab, "block_type": "llama", "activation_type": "silu",
          "layer_norm_type": "rms", "rope": True, "rope_theta": 500000.0, "max_sequence_length": 4096}
    special = SpecialTokens(mask_id=vocab - 2, eos_ids=(vocab - 1,), pad_id=vocab - 1)
    torch.manual_seed(0)
    model = LLaDAModel(LLaDAModel.parse_config(hf), special, hf).eval().requires_grad_(False)
    return model


class ForwardTimer:
    def __init__(self, model: torch.nn.Module) -> None:
        self.total = 0.0
        self.calls = 0
        self._forward = model.forward
        model.forward = self  # type: ignore[method-assign]

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        out = self._forward(*args, **kwargs)
        if out.is_cuda:
            torch.cuda.synchronize()
        self.total += time.perf_counter() - start
        self.calls += 1
        return out


def measure(model, batch: int, cache: str, steps: int) -> dict:
    timer = ForwardTimer(model)
    runner = BlockDiffusionRunner(model, max_batch=batch)
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size - 8
    params = DecodeParams(policy="cai", gen_length=128, block_length=32, steps=128, cache=cache, early_exit=False,
                          refresh_interval=16 if cache != "none" else 0)
    for i in range(batch):
        runner.add(GenerationRequest(tuple(torch.randint(0, vocab, (64,), generator=gen).tolist()), params, f"r{i}"))
    runner.step()  # warm-up (allocations, first block start)
    timer.total, timer.calls = 0.0, 0
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        runner.step()
        times.append(time.perf_counter() - start)
    model.forward = timer._forward  # type: ignore[method-assign]
    total = sum(times)
    return {"step_ms": 1000 * statistics.mean(times), "forward_ms": 1000 * timer.total / steps,
            "outside": (total - timer.total) / total, "forwards_per_step": timer.calls / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = {
        "fixture llada_tiny (0.1M)": load_model(FIXTURES / "llada_tiny"),
        "random LLaDA 100M (d768 L12)": random_llada(768, 12, 12, 2048, 16384),
    }
    print(f"# {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}, float32, CPU; CAI, prompt 64 + 128 generated, block 32, {args.steps} timed steps")
    print(f"{'model':30s} {'batch':>5s} {'cache':>6s} {'step ms':>9s} {'forward ms':>11s} {'outside %':>10s}")
    for name, model in models.items():
        params = sum(p.numel() for p in model.parameters())
        for batch in (1, 8):
            for cache in ("none", "prefix", "dual"):
                r = measure(model, batch, cache, args.steps)
                print(f"{name:30s} {batch:5d} {cache:>6s} {r['step_ms']:9.2f} {r['forward_ms']:11.2f} "
                      f"{100 * r['outside']:9.1f}%", flush=True)
        print(f"# {name}: {params / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
