#!/usr/bin/env bash
# The built-in-model benchmark for one model: the full `cai-dllm eval` table (every default
# configuration on N held-out problems, seed 0) and the paper's analyses (ANALYSES_N, default
# 200 problems, seed 1).
#   bench/run_benchmarks.sh MODEL_DIR DEVICE OUT_DIR [N]
#   e.g. bench/run_benchmarks.sh models/llada-tiny cuda /tmp/bench 1000
set -euo pipefail
model=$1
device=$2
out=$3
n=${4:-1000}
name=$(basename "$model")
batch=${BATCH:-250}
py=${PYTHON:-python3}
mkdir -p "$out"
"$py" -m server.cli eval --model "$model" --n "$n" --seed 0 --device "$device" --batch-size "$batch" \
    --json "$out/eval_$name.json" | tee "$out/eval_$name.txt"
"$py" bench/analyses.py --model "$model" --n "${ANALYSES_N:-200}" --seed 1 --device "$device" --batch-size 200 \
    --out "$out/figures" > "$out/analyses_$name.log"
