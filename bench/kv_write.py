"""Writing a block's keys/values into the KV store: `scatter_` along the width against indexed
assignment through a [B, width, heads, dim] view (`engine.models.layers.write_kv`, what the models use).

Both write the same columns (checked); the shapes are the built-in `llada-tiny` at batch 8 and
LLaDA-8B's (32 heads of 128) at batch 8, a 32-token block into a ~160 / ~600-column store.

    python bench/kv_write.py > bench/results/kv_write_cpu.txt
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from engine.models.layers import write_kv
from tinymodels.evaluate import hardware

SHAPES = {"llada-tiny": (8, 4, 160, 32), "LLaDA-8B": (8, 32, 600, 128)}  # batch, heads, width, head dim
BLOCK = 32


def scatter_write(cache: torch.Tensor, k: torch.Tensor, write_index: torch.Tensor) -> None:
    heads, dim = cache.shape[1], cache.shape[3]
    cache.scatter_(2, write_index[:, None, :, None].expand(-1, heads, -1, dim), k)


def time_write(write: Callable[..., None], cache: torch.Tensor, k: torch.Tensor, index: torch.Tensor,
               repeats: int) -> float:
    for _ in range(10):
        write(cache, k, index)
    if cache.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        write(cache, k, index)
    if cache.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=500)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = hardware() if args.device == "cpu" else torch.cuda.get_device_name()
    print(f"# {device}, torch {torch.__version__}, fp32, a {BLOCK}-token block, one layer's keys")
    print(f"{'shape':12s} {'scatter_ us':>12s} {'indexed us':>11s} {'speed-up':>9s}")
    generator = torch.Generator().manual_seed(0)
    for name, (batch, heads, width, dim) in SHAPES.items():
        starts = torch.randint(0, width - BLOCK, (batch,), generator=generator)
        index = (starts[:, None] + torch.arange(BLOCK)[None]).to(args.device)
        k = torch.randn(batch, heads, BLOCK, dim, generator=generator).to(args.device)
        a = torch.zeros(batch, heads, width, dim, device=args.device)
        b = torch.zeros_like(a)
        scatter_write(a, k, index)
        write_kv(b, k, index)
        assert torch.equal(a, b), "the two writes differ"
        slow = time_write(scatter_write, a, k, index, args.repeats)
        fast = time_write(write_kv, b, k, index, args.repeats)
        print(f"{name:12s} {1e6 * slow:12.1f} {1e6 * fast:11.1f} {slow / fast:8.1f}x")


if __name__ == "__main__":
    main()
