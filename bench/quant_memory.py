"""Host memory of a quantized load: LLaDA-8B at its real shapes, random weights, on CPU.

Writes (once; reused while its config matches) a sharded bf16 checkpoint in the official LLaDA
format with the real LLaDA-8B-Instruct config.json, then loads it with `engine.load_model(...,
quantization=MODE)` in a fresh process per mode. Each process imports everything first, resets its
peak RSS (VmHWM), loads, and reports the resident set after loading and its peak during loading,
both over the RSS before loading (the process's own baseline is printed beside them), then runs
one forward pass of 8 tokens to show the model computes. The bf16 figure is the parameter count
times two bytes: a bf16 load of this model does not fit the memory this benchmark may use.

    python bench/quant_memory.py                       # int8 and int4, head in bf16 and quantized
    python bench/quant_memory.py --modes int8 --no-head-variants
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_memory import FIXTURES, write_checkpoint

GB, GiB = 1e9, 2**30

_MEASURE = r"""
import json, sys, time
import torch
import bitsandbytes, torchao  # noqa: F401  (imported before the baseline, as a server would have)
import engine
from engine.loading.weights import load_model
from engine.quantization import check_quantization, quantized_model_bytes
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
path, mode, head = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
check_quantization(mode, torch.device("cpu"), torch.bfloat16)  # the probe's kernels, before the baseline
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM)
base = status("VmRSS:")
t = time.perf_counter()
model = load_model(path, dtype=torch.bfloat16, quantization=mode, quantize_head=head)
seconds = time.perf_counter() - t
after, peak = status("VmRSS:"), status("VmHWM:")
with torch.device("meta"):
    meta = type(model)(model.config, model.special)
expected = quantized_model_bytes(meta, mode, torch.bfloat16, head)
t = time.perf_counter()
with torch.no_grad():
    logits = model(torch.arange(8)[None] + 100)
forward = time.perf_counter() - t
print(json.dumps({"mode": mode, "head": head, "seconds": seconds, "baseline_rss": base, "after_rss": after,
                  "peak_rss": peak, "expected_bytes": expected, "forward_s": forward,
                  "finite": bool(torch.isfinite(logits).all())}))
"""


def ensure_checkpoint(root: Path, config: dict, shard_gb: float) -> None:
    existing = root / "config.json"
    if existing.is_file() and json.loads(existing.read_text()) == config \
            and (root / "model.safetensors.index.json").is_file():
        print(f"checkpoint: {root} (reused)")
        return
    t = time.perf_counter()
    size = write_checkpoint(root, config["n_layers"], config["d_model"], config["mlp_hidden_size"],
                            config["embedding_size"], int(shard_gb * GiB), config=config)
    print(f"checkpoint: {root}  {size / GB:.2f} GB bf16 written in {time.perf_counter() - t:.0f} s")


def measure(path: Path, mode: str, head: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(path), mode, "1" if head else "0"],
                         capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(f"{mode} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/cai-bench-llada-8b"))
    parser.add_argument("--config", type=Path, default=FIXTURES / "real" / "llada-8b-instruct" / "config.json")
    parser.add_argument("--modes", default="int8,int4")
    parser.add_argument("--no-head-variants", action="store_true", help="only the default (head in bf16)")
    parser.add_argument("--shard-gb", type=float, default=2.5)
    args = parser.parse_args()

    config = json.loads(args.config.read_text())
    ensure_checkpoint(args.dir, config, args.shard_gb)
    d, layers, mlp, vocab = config["d_model"], config["n_layers"], config["mlp_hidden_size"], config["embedding_size"]
    params = layers * (4 * d * d + 3 * d * mlp + 2 * d) + 2 * vocab * d + d
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch CPU; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"LLaDA-8B shapes from {args.config}: {params / 1e9:.3f} B parameters; bf16 weights "
          f"{2 * params / GB:.2f} GB = {2 * params / GiB:.2f} GiB (computed, not loaded)")
    print("resident = RSS after loading minus RSS before; peak = highest RSS during loading minus RSS before")
    print("| mode | head | expected weights | resident after load | peak during load | peak - resident "
          "| vs bf16 | load s | 8-token forward s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        for head in (False,) if args.no_head_variants else (False, True):
            r = measure(args.dir, mode, head)
            resident, peak = r["after_rss"] - r["baseline_rss"], r["peak_rss"] - r["baseline_rss"]
            assert r["finite"], f"{mode}: non-finite logits"
            print(f"| {mode} | {'quantized' if head else 'bf16'} | {r['expected_bytes'] / GB:.2f} GB "
                  f"| {resident / GB:.2f} GB ({resident / GiB:.2f} GiB) | {peak / GB:.2f} GB ({peak / GiB:.2f} GiB) "
                  f"| {(peak - resident) / GB:.2f} GB | {resident / (2 * params):.2f}x | {r['seconds']:.0f} "
                  f"| {r['forward_s']:.1f} |")
            print(f"  (process baseline before loading: {r['baseline_rss'] / GB:.2f} GB)", flush=True)


if __name__ == "__main__":
    main()
