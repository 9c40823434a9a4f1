#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py, docs/performance.md "GPU check") on a lent device: installs the
# wheels carried in .gpu_wheels/ (made by bench/gpu_wheels.sh) into a scratch folder, then runs the
# check. Usage: bash bench/gpu_check.sh OUTDIR [bench/gpu_check.py options, e.g. --phases step]
set -uo pipefail
OUT="${1:?usage: bash bench/gpu_check.sh OUTDIR [gpu_check.py options]}"
shift
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"  # before the cd below: OUTDIR may be relative
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
SITE="$(mktemp -d)"
WHEELS_LOG="$(mktemp)"
trap 'rm -rf "$SITE" "$WHEELS_LOG"' EXIT
if compgen -G ".gpu_wheels/*.whl" >/dev/null; then
  # --no-index: the device reaches no package index; --no-deps: each wheel's needs are on the image
  # or carried beside it (bench/gpu_wheels.sh)
  ls .gpu_wheels/*.whl >"$WHEELS_LOG"
  if "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      .gpu_wheels/*.whl >>"$WHEELS_LOG" 2>&1; then
    echo "installed into $SITE" >>"$WHEELS_LOG"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "pip install failed: the check runs without these wheels" >>"$WHEELS_LOG"
  fi
else
  echo "no .gpu_wheels/*.whl here (bench/gpu_wheels.sh makes them): torchao and bitsandbytes only if installed" \
    >"$WHEELS_LOG"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PYTHON" bench/gpu_check.py "$OUT" --wheels-log "$WHEELS_LOG" "$@"
