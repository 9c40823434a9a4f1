#!/usr/bin/env bash
# The wheels the GPU check needs beyond the device image (docs/performance.md "GPU check"), into
# .gpu_wheels/ (ignored by git; the device tool carries it with `carry: [".gpu_wheels"]`).
#
# The image has torch 2.11 (CUDA 13), transformers, safetensors, tokenizers, numpy, jinja2, tqdm,
# triton and pytest, but not torchao (int8/fp8), bitsandbytes (int4) or nvidia-ml-py (the energy
# meter the offline phase reads). The first two are fetched at the versions pyproject.toml's `quant`
# extra pins, as Python 3.12 manylinux x86_64 wheels; nvidia-ml-py (pure Python) as the `gpu` extra
# asks. bitsandbytes'
# wheel (43 MB) holds a kernel library for every CUDA, ROCm and XPU release it supports; only the
# CUDA 13 ones (what torch 2.11+cu13x loads) and the CPU one are kept, repacked with a RECORD that
# lists what is left. fastapi, uvicorn and pydantic do not travel: the check runs no server.
#
# What travels is the working tree (tracked and untracked-not-ignored files) plus the carried paths,
# at most 64 MiB a call: this script adds up both and fails if they would not fit.
# Usage: bash bench/gpu_wheels.sh   (needs pip and PyPI; run it in the checkout the device tool sends)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
DEST=.gpu_wheels
LIMIT=$((64 * 1024 * 1024))
pin() { grep -o "\"$1==[^\"]*\"" pyproject.toml | tr -d '"'; }
TORCHAO="$(pin torchao)"
BITSANDBYTES="$(pin bitsandbytes)"
[ -n "$TORCHAO" ] && [ -n "$BITSANDBYTES" ] || { echo "no torchao/bitsandbytes pin in pyproject.toml" >&2; exit 1; }
NVML="$(grep -o '"nvidia-ml-py[^"]*"' pyproject.toml | tr -d '"')"

rm -rf "$DEST" && mkdir -p "$DEST"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$DEST" "$TORCHAO" "$BITSANDBYTES" "$NVML"

"$PYTHON" - "$DEST" <<'PY'
"""Repack bitsandbytes without the kernel libraries torch+cu13x never loads."""
import base64, hashlib, re, sys, zipfile
from pathlib import Path

[wheel] = Path(sys.argv[1]).glob("bitsandbytes-*.whl")
keep = re.compile(r"bitsandbytes/libbitsandbytes_(cpu|cuda13\d)\.so$")
slim = wheel.with_suffix(".slim")
with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
    names = [n for n in src.namelist() if not n.endswith(".so") or keep.search(n)]
    dropped = sorted(set(src.namelist()) - set(names))
    record = next(n for n in names if n.endswith(".dist-info/RECORD"))
    rows = []
    for name in names:
        if name == record:
            continue
        data = src.read(name)
        dst.writestr(src.getinfo(name), data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append(f"{name},sha256={digest},{len(data)}")
    dst.writestr(record, "\n".join(rows + [f"{record},,"]) + "\n")
slim.replace(wheel)
print(f"bitsandbytes: kept {sum(n.endswith('.so') for n in names)} kernel libraries, dropped {len(dropped)}: "
      + ", ".join(Path(n).name for n in dropped))
PY

tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
wheels=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
ls -l "$DEST"
echo "working tree $((tree / 1024)) KiB + wheels $((wheels / 1024)) KiB = $(((tree + wheels) / 1024)) KiB of $((LIMIT / 1024)) KiB"
if [ $((tree + wheels)) -gt "$LIMIT" ]; then
  echo "over the device tool's 64 MiB: it would refuse the call" >&2
  exit 1
fi
