"""Step time of `Engine.step`, the host time outside the model forward, and host reads per step.

For each model (the bundled llada-tiny and dream-tiny, the tiny fixture and a ~100M-parameter random
LLaDA), batch
size and cache mode, the engine decodes CAI (prompt 64 tokens, 128 generated in blocks of 32, no
early exit) and we time every `engine.step()` and every model forward inside it, after a warm-up
block. "Outside" = step time minus forward time: input building, sampling, the policies, commits,
cache bookkeeping and the step's one device-to-host transfer, the controller overhead the paper puts
below 2 %. Medians over the timed steps; "reads" is the most tensor-to-host reads in any one step,
counted in a second, untimed pass over the same steps, so that the counter (it patches `torch.Tensor`
around each step) is not part of what is timed.
"cached ms" is the median step time over the steps in which all `batch` rows ran and none ran a full
forward (with a cache, every row fed only its block, or its block and what follows): CAI starts blocks
every step or two, so most steps mix in a block start's full forward, and this column is the cached
step on its own ("n" of the timed steps were such steps; "-" without a cache or when none was).
"full-batch outside" is the median outside-the-forward time over the steps in which all `batch` rows ran
("n" of them): the requests start together and finish at different steps, so the "outside ms" median
also counts steps with fewer rows. Rows marked "fixed" decode with LLaDA's fixed schedule instead (one
token a step, so a block is one full step and 31 cached ones): the cached step of a running batch, as a
server pays it for most of a block.

    python bench/step_time.py --steps 48 --threads 2 > bench/results/step_time_cpu.txt
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

from engine import DecodeParams, Engine, load_model
from engine.host_reads import count_host_reads
from engine.model_runner import ModelRunner
from engine.models.llada import LLaDAModel
from engine.special_tokens import SpecialTokens

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"


def random_llada(d_model: int, layers: int, heads: int, mlp: int, vocab: int) -> LLaDAModel:
    hf = {"d_model": d_model, "n_layers": layers, "n_heads": heads, "n_kv_heads": heads, "mlp_hidden_size": mlp,
          "vocab_size": vocab, "embedding_size": vocab, "block_type": "llama", "activation_type": "silu",
          "layer_norm_type": "rms", "rope": True, "rope_theta": 500000.0, "max_sequence_length": 4096}
    special = SpecialTokens(mask_id=vocab - 2, eos_ids=(vocab - 1,), pad_id=vocab - 1)
    torch.manual_seed(0)
    return LLaDAModel(LLaDAModel.parse_config(hf), special, hf).eval().requires_grad_(False)


class FullForwardCounter:
    """Counts the model runner's full forwards (a block start, a refresh, or no cache)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.count = 0
        self._full = runner.forwards["full"]
        runner.forwards["full"] = self

    def __call__(self, *args, **kwargs):
        self.count += 1
        return self._full(*args, **kwargs)


class ForwardTimer:
    def __init__(self, model: torch.nn.Module) -> None:
        self.total = 0.0
        self._forward = model.forward
        self._model = model
        model.forward = self  # type: ignore[method-assign]

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        out = self._forward(*args, **kwargs)
        if out.is_cuda:
            torch.cuda.synchronize()
        self.total += time.perf_counter() - start
        return out

    def restore(self) -> None:
        del self._model.forward


def _engine(model: torch.nn.Module, batch: int, cache: str, policy: str) -> Engine:
    """An engine with `batch` requests waiting (the same random prompts every call)."""
    engine = Engine.from_model(model, max_batch=batch)
    gen = torch.Generator().manual_seed(1)
    vocab = min(model.special.mask_id, model.config.vocab_size) - 8
    params = DecodeParams(policy=policy, gen_length=128, block_length=32, steps=128, cache=cache, early_exit=False,
                          refresh_interval=16 if cache != "none" else 0)
    for _ in range(batch):
        engine.add_request(torch.randint(0, vocab, (64,), generator=gen).tolist(), params)
    return engine


def most_reads(model: torch.nn.Module, batch: int, cache: str, steps: int, policy: str = "cai") -> int:
    """The most host reads in any one of the steps `measure` times, counted in a pass of their own:
    the counter patches `torch.Tensor`'s methods around every step, which is no part of the engine,
    so it stays out of the timed pass."""
    engine = _engine(model, batch, cache, policy)
    reads, done = 0, 0
    while engine.has_unfinished() and done < steps + 2:
        with count_host_reads() as counted:
            engine.step()
        reads = max(reads, counted.count)
        done += 1
    return reads


def measure(model: torch.nn.Module, batch: int, cache: str, steps: int, policy: str = "cai") -> dict:
    """Medians over `steps` timed steps."""
    engine = _engine(model, batch, cache, policy)
    timer = ForwardTimer(model)
    full = FullForwardCounter(engine.runner)
    step_ms, outside_ms, cached_ms, full_batch_outside_ms = [], [], [], []
    warm = 0
    try:
        while engine.has_unfinished() and len(step_ms) < steps:
            timer.total = 0.0
            full.count = 0
            start = time.perf_counter()
            outputs = engine.step()
            took = time.perf_counter() - start
            if warm < 2:  # first-call allocations and the first block start
                warm += 1
                continue
            step_ms.append(1000 * took)
            outside_ms.append(1000 * (took - timer.total))
            if full.count == 0 and len(outputs) == batch:
                cached_ms.append(1000 * took)
            if len(outputs) == batch:
                full_batch_outside_ms.append(1000 * (took - timer.total))
    finally:
        timer.restore()
    return {"step_ms": statistics.median(step_ms), "outside_ms": statistics.median(outside_ms),
            "forward_ms": statistics.median(s - o for s, o in zip(step_ms, outside_ms, strict=True)),
            "steps": len(step_ms),
            "cached_ms": statistics.median(cached_ms) if cached_ms else None, "cached_steps": len(cached_ms),
            "full_batch_outside_ms": statistics.median(full_batch_outside_ms) if full_batch_outside_ms else None,
            "full_batch_steps": len(full_batch_outside_ms)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--skip-large", action="store_true", help="leave out the 100M random model")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = {"bundled llada-tiny": load_model(REPO / "models" / "llada-tiny"),
              "bundled dream-tiny": load_model(REPO / "models" / "dream-tiny"),
              "fixture llada_tiny": load_model(FIXTURES / "llada_tiny")}
    if not args.skip_large:
        models["random LLaDA 100M (d768 L12)"] = random_llada(768, 12, 12, 2048, 16384)
    print(f"# {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, float32, CPU; "
          f"CAI (rows marked fixed: one token a step), prompt 64 + 128 generated, block 32, refresh 16, "
          f"medians of {args.steps} steps after 2 warm-up")
    flags = " --skip-large" if args.skip_large else ""
    print(f"# command: python bench/step_time.py --steps {args.steps} --threads {args.threads}{flags}")
    print(f"{'model':30s} {'batch':>5s} {'cache':>6s} {'step ms':>8s} {'forward ms':>10s} {'outside ms':>10s} "
          f"{'outside %':>9s} {'reads/step':>10s} {'cached ms':>9s} {'n':>3s} {'full-batch outside':>18s} {'n':>3s}")
    for name, model in models.items():
        params = sum(p.numel() for p in model.parameters())
        rows = [("cai", batch, cache) for batch in (1, 8) for cache in ("none", "prefix", "dual")]
        rows += [("fixed", batch, cache) for batch in (1, 8) for cache in ("prefix", "dual")]
        for policy, batch, cache in rows:
            r = measure(model, batch, cache, args.steps, policy)
            r["reads"] = most_reads(model, batch, cache, args.steps, policy)
            cached = "-" if r["cached_ms"] is None else f"{r['cached_ms']:.2f}"
            full_batch = "-" if r["full_batch_outside_ms"] is None else f"{r['full_batch_outside_ms']:.2f}"
            label = name if policy == "cai" else f"{name} fixed"
            print(f"{label:30s} {batch:5d} {cache:>6s} {r['step_ms']:8.2f} {r['forward_ms']:10.2f} "
                  f"{r['outside_ms']:10.2f} {100 * r['outside_ms'] / r['step_ms']:8.1f}% {r['reads']:10d} "
                  f"{cached:>9s} {r['cached_steps']:3d} {full_batch:>18s} {r['full_batch_steps']:3d}", flush=True)
        print(f"# {name}: {params / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
