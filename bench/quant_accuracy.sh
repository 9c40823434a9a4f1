#!/usr/bin/env bash
# Held-out accuracy of the built-in models with float, int8 and int4 weights: the fixed decoder and
# CAI on the same 1,000 problems (seed 0, chat prompts, batches of 250 as in docs/benchmarks.md).
# Accuracy is deterministic (greedy decoding); tok/s depends on the machine's load, which each output file's header records.
#   bash bench/quant_accuracy.sh                 # both models, all three modes
#   MODELS="llada-tiny" MODES="int8" N=200 CONFIGS="CAI full, gate on +exit" bash bench/quant_accuracy.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
N="${N:-1000}"
CONFIGS="${CONFIGS:-fixed+exit;CAI full, gate on +exit}"
for model in ${MODELS:-llada-tiny dream-tiny}; do
  for mode in ${MODES:-none int8 int4}; do
    out="bench/results/quant_eval_${model}_${mode}_cpu"
    { echo "# load average before: $(cut -d' ' -f1-3 /proc/loadavg); torch threads: ${OMP_NUM_THREADS:-default}"
      "$PY" -m server.cli eval --model "models/$model" --n "$N" --seed 0 --quantization "$mode" \
        --batch-size "${BATCH:-250}" \
        --configs "$CONFIGS" --json "$out.json"
      echo "# load average after: $(cut -d' ' -f1-3 /proc/loadavg)"; } > "$out.txt"
    cat "$out.txt"
  done
done
