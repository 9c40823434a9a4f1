"""Host memory of loading a large random LLaDA-format checkpoint: float, quantized, and naive.

Writes (once; reused while its config matches) a sharded bf16 checkpoint in the official LLaDA
format, by default at LLaDA-8B-Instruct's real shapes (its released config.json), then loads it in
a fresh process per mode. Each process imports everything first, resets its peak RSS (VmHWM),
loads, and reports the resident set after loading and its peak during loading, both over the RSS
before loading (the process's own baseline is printed beside them); a loaded model then runs one
8-token forward to show it computes, after which the resident set is read again (bitsandbytes'
CPU kernel repacks NF4 weights on their first forward). Modes:
- `bf16`: `engine.load_model` in bf16;
- `naive`: the common path the loader is measured against, a materialised model plus
  `safetensors.torch.load_file` of each shard (a whole state dict beside the model);
- `int8`, `int4`: `engine.load_model(..., quantization=MODE)`, quantizing layer by layer while
  loading, with the output head in bf16 and, unless `--no-head-variants`, quantized too.
The bf16 figure of the 8B model is its parameter count times two bytes (`vs bf16`): a bf16 load of
it needs more memory than this benchmark may use on a 24 GB machine.

    python bench/load_memory.py                                  # LLaDA-8B shapes: int8 and int4
    python bench/load_memory.py --modes bf16,naive --layers 24 --d-model 2048 --mlp 5504
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

FIXTURES = Path(os.environ.get("CAI_DLLM_FIXTURES", Path(__file__).resolve().parents[1] / "tests" / "fixtures"))
GB, GiB = 1e9, 2**30
MODES = ("bf16", "naive", "int8", "int4")


def resized_config(layers: int, d_model: int, mlp: int, vocab: int) -> dict:
    """The tiny LLaDA fixture's config.json at these sizes (heads of 128)."""
    config = json.loads((FIXTURES / "llada_tiny" / "config.json").read_text())
    config.update(d_model=d_model, n_layers=layers, n_heads=d_model // 128, n_kv_heads=d_model // 128,
                  mlp_hidden_size=mlp, vocab_size=vocab, embedding_size=vocab,
                  mask_token_id=vocab - 2, eos_token_id=vocab - 1, pad_token_id=vocab - 1)
    return config


def write_checkpoint(root: Path, config: dict, shard_bytes: int) -> int:
    """Random bf16 weights in the official LLaDA layout for `config` (a LLaDA config.json)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config, indent=2))
    d, mlp, vocab = config["d_model"], config["mlp_hidden_size"], config["embedding_size"]
    shapes: dict[str, tuple[int, ...]] = {"model.transformer.wte.weight": (vocab, d)}
    for i in range(config["n_layers"]):
        p = f"model.transformer.blocks.{i}."
        shapes.update({p + "q_proj.weight": (d, d), p + "k_proj.weight": (d, d), p + "v_proj.weight": (d, d),
                       p + "attn_out.weight": (d, d), p + "ff_proj.weight": (mlp, d),
                       p + "up_proj.weight": (mlp, d), p + "ff_out.weight": (d, mlp),
                       p + "attn_norm.weight": (d,), p + "ff_norm.weight": (d,)})
    shapes.update({"model.transformer.ln_f.weight": (d,), "model.transformer.ff_out.weight": (vocab, d)})
    gen = torch.Generator().manual_seed(0)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    index, size, total = 0, 0, 0
    for name, shape in shapes.items():
        shard[name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        size += shard[name].nbytes
        total += shard[name].nbytes
        if size >= shard_bytes or name == "model.transformer.ff_out.weight":
            file = f"model-{index:05d}.safetensors"
            save_file(shard, root / file, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
            shard, index, size = {}, index + 1, 0
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return total


def ensure_checkpoint(root: Path, config: dict, shard_gb: float) -> None:
    existing = root / "config.json"
    if existing.is_file() and json.loads(existing.read_text()) == config \
            and (root / "model.safetensors.index.json").is_file():
        print(f"checkpoint: {root} (reused)")
        return
    t = time.perf_counter()
    size = write_checkpoint(root, config, int(shard_gb * GiB))
    print(f"checkpoint: {root}  {size / GB:.2f} GB bf16 written in {time.perf_counter() - t:.0f} s")


_MEASURE = r"""
import json, sys, time
import torch
import bitsandbytes, torchao  # noqa: F401  (imported before the baseline, as a server would have)
from safetensors.torch import load_file
from engine.loading.checkpoint import CheckpointFiles
from engine.loading.weights import load_model
from engine.models.registry import model_class_for
from engine.quantization import check_quantization, quantized_model_bytes
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
path, mode, head = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
quantization = mode if mode in ("int8", "int4") else "none"
check_quantization(quantization, torch.device("cpu"), torch.bfloat16)  # the probe's kernels, before the baseline
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM)
base = status("VmRSS:")
t = time.perf_counter()
if mode == "naive":
    ckpt = CheckpointFiles.open(path)
    cls = model_class_for(ckpt.config)
    model = cls(cls.parse_config(ckpt.config), ckpt.special_tokens()).to(torch.bfloat16)
    state = {}
    for f in ckpt.weight_files():
        state.update(load_file(f))
    del state
else:
    model = load_model(path, dtype=torch.bfloat16, quantization=quantization, quantize_head=head)
seconds = time.perf_counter() - t
after, peak = status("VmRSS:"), status("VmHWM:")
with torch.device("meta"):
    meta = type(model)(model.config, model.special)
expected = quantized_model_bytes(meta, quantization, torch.bfloat16, head, device_type="cpu")
forward, finite = None, True
if mode != "naive":
    t = time.perf_counter()
    with torch.no_grad():
        logits = model(torch.arange(8)[None] + 100)
    forward, finite = time.perf_counter() - t, bool(torch.isfinite(logits).all())
print(json.dumps({"seconds": seconds, "baseline_rss": base, "after_rss": after, "peak_rss": peak,
                  "expected_bytes": expected, "forward_s": forward, "finite": finite,
                  "after_forward_rss": status("VmRSS:")}))
"""


def measure(path: Path, mode: str, head: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(path), mode, "1" if head else "0"],
                         capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(f"{mode} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def parameter_count(config: dict) -> int:
    d, layers, mlp, vocab = config["d_model"], config["n_layers"], config["mlp_hidden_size"], config["embedding_size"]
    return layers * (4 * d * d + 3 * d * mlp + 2 * d) + 2 * vocab * d + d


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=None,
                        help="checkpoint dir (default /tmp/cai-bench-llada-8b, with --layers /tmp/cai-bench-ckpt)")
    parser.add_argument("--config", type=Path, default=FIXTURES / "real" / "llada-8b-instruct" / "config.json",
                        help="the LLaDA config.json whose shapes are written (unless --layers is given)")
    parser.add_argument("--layers", type=int, help="resize the tiny fixture's config instead (with --d-model, --mlp)")
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--mlp", type=int, default=5504)
    parser.add_argument("--vocab", type=int, default=126464)
    parser.add_argument("--modes", default="int8,int4", help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--no-head-variants", action="store_true", help="quantized modes: the head in bf16 only")
    parser.add_argument("--shard-gb", type=float, default=2.5)
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown modes {sorted(unknown)}; known: {', '.join(MODES)}")

    if args.layers:
        config = resized_config(args.layers, args.d_model, args.mlp, args.vocab)
        source = f"{args.layers} layers x {args.d_model}, MLP {args.mlp}, vocab {args.vocab}"
    else:
        config, source = json.loads(args.config.read_text()), str(args.config)
    root = args.dir or Path("/tmp/cai-bench-ckpt" if args.layers else "/tmp/cai-bench-llada-8b")
    ensure_checkpoint(root, config, args.shard_gb)
    params = parameter_count(config)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch CPU; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"shapes from {source}: {params / 1e9:.3f} B parameters; bf16 weights {2 * params / GB:.2f} GB "
          f"= {2 * params / GiB:.2f} GiB (computed)")
    print("resident = RSS after loading minus RSS before; peak = highest RSS during loading minus RSS before")
    print("| mode | head | expected weights | resident after load | peak during load | peak - resident "
          "| vs bf16 | load s | 8-token forward s | resident after the forward |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode in modes:
        quantized = mode in ("int8", "int4")
        for head in (False,) if args.no_head_variants or not quantized else (False, True):
            r = measure(root, mode, head)
            resident, peak = r["after_rss"] - r["baseline_rss"], r["peak_rss"] - r["baseline_rss"]
            if not r["finite"]:
                raise SystemExit(f"{mode}: non-finite logits")
            forward = "-" if r["forward_s"] is None else f"{r['forward_s']:.1f}"
            ran = r["after_forward_rss"] - r["baseline_rss"]
            after_forward = "-" if r["forward_s"] is None else f"{ran / GB:.2f} GB"
            print(f"| {mode} | {'quantized' if head else 'bf16'} | {r['expected_bytes'] / GB:.2f} GB "
                  f"| {resident / GB:.2f} GB ({resident / GiB:.2f} GiB) | {peak / GB:.2f} GB ({peak / GiB:.2f} GiB) "
                  f"| {(peak - resident) / GB:.2f} GB | {resident / (2 * params):.2f}x | {r['seconds']:.0f} "
                  f"| {forward} | {after_forward} |")
            print(f"  (process baseline before loading: {r['baseline_rss'] / GB:.2f} GB)", flush=True)


if __name__ == "__main__":
    main()
