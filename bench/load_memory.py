"""Peak host memory while loading a large random LLaDA-format checkpoint.

Writes a sharded bf16 checkpoint in the official LLaDA format (random weights) to --dir, then loads
it in fresh subprocesses, each measuring its resident-set peak (VmHWM, reset after imports) over the
load alone. Two loaders are compared: `engine.load_model` and the common naive path
(`safetensors.torch.load_file` per shard into a materialised model).

    python bench/load_memory.py --naive                      # 3.2 GiB checkpoint
    python bench/load_memory.py --layers 32 --d-model 4096 --mlp 12288   # LLaDA-8B shapes, 14.9 GiB
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures"


def write_checkpoint(root: Path, layers: int, d_model: int, mlp: int, vocab: int, shard_bytes: int,
                     config: Optional[dict] = None) -> int:
    """Random bf16 weights in the official LLaDA layout; `config` (a LLaDA config.json) is written as
    is, else the tiny fixture's is resized to the given shapes."""
    root.mkdir(parents=True, exist_ok=True)
    if config is None:
        config = json.loads((FIXTURES / "llada_tiny" / "config.json").read_text())
        config.update(d_model=d_model, n_layers=layers, n_heads=d_model // 128, n_kv_heads=d_model // 128,
                      mlp_hidden_size=mlp, vocab_size=vocab, embedding_size=vocab,
                      mask_token_id=vocab - 2, eos_token_id=vocab - 1, pad_token_id=vocab - 1)
    (root / "config.json").write_text(json.dumps(config, indent=2))
    shapes: dict[str, tuple[int, ...]] = {"model.transformer.wte.weight": (vocab, d_model)}
    for i in range(layers):
        p = f"model.transformer.blocks.{i}."
        shapes.update({p + "q_proj.weight": (d_model, d_model), p + "k_proj.weight": (d_model, d_model),
                       p + "v_proj.weight": (d_model, d_model), p + "attn_out.weight": (d_model, d_model),
                       p + "ff_proj.weight": (mlp, d_model), p + "up_proj.weight": (mlp, d_model),
                       p + "ff_out.weight": (d_model, mlp), p + "attn_norm.weight": (d_model,),
                       p + "ff_norm.weight": (d_model,)})
    shapes.update({"model.transformer.ln_f.weight": (d_model,), "model.transformer.ff_out.weight": (vocab, d_model)})

    gen = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_index, shard_size, total = 0, 0, 0

    def flush() -> None:
        nonlocal shard, shard_index, shard_size
        name = f"model-{shard_index:05d}.safetensors"
        save_file(shard, root / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        shard, shard_index, shard_size = {}, shard_index + 1, 0

    for name, shape in shapes.items():
        tensor = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        shard[name] = tensor
        shard_size += tensor.nbytes
        total += tensor.nbytes
        if shard_size >= shard_bytes:
            flush()
    if shard:
        flush()
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return total


_MEASURE = r"""
import sys, time, json
import torch
import engine
from safetensors.torch import load_file
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
path, mode = sys.argv[1], sys.argv[2]
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) after imports
base = status("VmRSS:")
t = time.perf_counter()
if mode == "engine":
    model = engine.load_model(path, dtype=torch.bfloat16)
else:
    from engine.loading.checkpoint import CheckpointFiles
    from engine.models.registry import model_class_for
    ckpt = CheckpointFiles.open(path)
    cls = model_class_for(ckpt.config)
    model = cls(cls.parse_config(ckpt.config), ckpt.special_tokens()).to(torch.bfloat16)
    state = {}
    for f in ckpt.weight_files():
        state.update(load_file(f))
    # the naive path: a full state dict beside the materialised model (names remapped)
    del state
seconds = time.perf_counter() - t
print(json.dumps({"mode": mode, "seconds": seconds, "baseline_rss": base, "peak_rss": status("VmHWM:"),
                  "final_rss": status("VmRSS:")}))
"""


def measure(path: Path, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(path), mode], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/cai-bench-ckpt"))
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--mlp", type=int, default=5504)
    parser.add_argument("--vocab", type=int, default=126464)
    parser.add_argument("--shard-gb", type=float, default=1.0)
    parser.add_argument("--naive", action="store_true", help="also measure the naive load_file path")
    args = parser.parse_args()

    t = time.perf_counter()
    size = write_checkpoint(args.dir, args.layers, args.d_model, args.mlp, args.vocab, int(args.shard_gb * 2**30))
    print(f"checkpoint: {args.dir}  {size / 2**30:.2f} GiB bf16 in "
          f"{len(list(args.dir.glob('*.safetensors')))} shards (written in {time.perf_counter() - t:.0f} s)")
    for mode in ["engine"] + (["naive"] if args.naive else []):
        r = measure(args.dir, mode)
        extra = r["peak_rss"] - r["baseline_rss"]
        print(f"{mode:7s} load {r['seconds']:6.1f} s  peak RSS over baseline {extra / 2**30:6.2f} GiB"
              f"  = {extra / size:.3f} x checkpoint size  (final RSS over baseline "
              f"{(r['final_rss'] - r['baseline_rss']) / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
