"""What a tensor-parallel step's decide moves between ranks, at the released models' vocabularies:
gathering the logits whole (what every step did before engine/decoding/vocab_parallel.py) against
reducing each rank's shard to a few numbers per position, with the bytes each rank receives
(`WireCount`), the decide's time and whether both give the same tokens.

Each rank holds its shard of random logits [batch, block, vocab / N] (float32, as the decide step
gets them), decides greedily with the Box 1 confidence (`sampling.predict` + `sampling.confidence`
on the gathered logits; `vocab_parallel.predict_and_confidence` on the shard), `--repeats` times
after a warm-up; the table gives rank 0's median. The ranks are gloo processes on this host, so the
times are loopback copies and this CPU's arithmetic (NCCL over NVLink or PCIe moves bytes at other
rates); the bytes are what any transport carries. Vocabulary sizes are read from the released
configs in tests/fixtures/real/ (DiffusionGemma holds its whole vocabulary on every rank: nothing to
reduce).

    python bench/logit_reduction.py > bench/results/logit_reduction_cpu.txt
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.decoding import vocab_parallel as V
from engine.decoding.sampling import confidence, predict
from engine.models.parallel.group import TensorParallel, VocabShard, WireCount

REAL = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "real"
# model -> (its config, the file that names its mask id: LLaDA2's is in its generate() defaults)
CONFIGS = {"LLaDA-8B": ("llada-8b-instruct/config.json",) * 2,
           "Dream-7B": ("dream-v0-instruct-7b/config.json",) * 2,
           "SDAR-8B": ("sdar-8b-chat/config.json",) * 2,
           "LLaDA2.0-mini": ("llada2.0-mini/dfactory_llada2_mini_config.json", "llada2.0-mini/generate_defaults.json")}


def _vocabulary(config: str, special: str) -> tuple[int, int]:
    """(vocabulary size, mask id) of a released model."""
    ids = json.loads((REAL / special).read_text())
    mask = ids["mask_token_id"] if "mask_token_id" in ids else ids["llada2.0_generate_defaults"]["mask_id"]
    return json.loads((REAL / config).read_text())["vocab_size"], mask


def _timed(run: Any, repeats: int) -> tuple[float, int, Any]:
    """(median ms, bytes received per call, the last result) of `run()` after one warm-up call."""
    run()
    times, moved = [], 0
    for _ in range(repeats):
        dist.barrier()
        before, started = WireCount.bytes, time.perf_counter()
        result = run()
        times.append((time.perf_counter() - started) * 1e3)
        moved = WireCount.bytes - before
    return statistics.median(times), moved, result


def _rank(rank: int, size: int, port: int, out: str, vocab: int, mask_id: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        tp = TensorParallel(rank, size)
        start, real, padded = tp.padded_split(vocab)
        local = torch.randn(args.batch, args.block, padded, generator=torch.Generator().manual_seed(rank)) * 4
        local[..., real:] = float("-inf")
        shard = VocabShard(tp, start, real, vocab)

        def gathered() -> torch.Tensor:
            logits = shard.gather(local)
            x0, _ = predict(logits, [], mask_id)
            return torch.stack((x0.double(), confidence(logits, x0, {}).double()))

        def reduced() -> torch.Tensor:
            x0, _, conf = V.predict_and_confidence(local, shard, [], mask_id, None, {})
            return torch.stack((x0.double(), conf.double()))

        rows = {name: _timed(run, args.repeats) for name, run in (("gather", gathered), ("reduce", reduced))}
        if rank == 0:
            same = torch.equal(rows["gather"][2][0], rows["reduce"][2][0])
            drift = (rows["gather"][2][1] - rows["reduce"][2][1]).abs().max().item()
            torch.save({"rows": {k: v[:2] for k, v in rows.items()}, "same": same, "drift": drift}, out)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--block", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"# {platform.machine()}, {os.cpu_count()} cores, gloo on loopback; commit {commit}; batch {args.batch} x "
          f"block {args.block}, float32 logits, greedy + Box 1 confidence; median of {args.repeats} after a warm-up")
    print(f"# command: python bench/logit_reduction.py --sizes {' '.join(map(str, args.sizes))} --batch "
          f"{args.batch} --block {args.block} --repeats {args.repeats}")
    print(f"{'model':<14} {'vocab':>7} {'tp':>3} {'gather_bytes':>13} {'reduce_bytes':>13} {'fewer':>7} "
          f"{'gather_ms':>10} {'reduce_ms':>10} {'tokens':>9} {'conf_drift':>10}")
    for model, files in CONFIGS.items():
        vocab, mask_id = _vocabulary(*files)
        for size in args.sizes:
            with tempfile.TemporaryDirectory() as tmp:
                out = str(Path(tmp) / "rank0.pt")
                mp.spawn(_rank, args=(size, _free_port(), out, vocab, mask_id, args), nprocs=size)
                result = torch.load(out)
            (g_ms, g_bytes), (r_ms, r_bytes) = result["rows"]["gather"], result["rows"]["reduce"]
            print(f"{model:<14} {vocab:>7} {size:>3} {g_bytes:>13,} {r_bytes:>13,} {g_bytes / r_bytes:>6.0f}x "
                  f"{g_ms:>10.1f} {r_ms:>10.1f} {'same' if result['same'] else 'DIFFER':>9} {result['drift']:>10.1e}",
                  flush=True)


if __name__ == "__main__":
    main()
