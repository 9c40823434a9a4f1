#!/usr/bin/env bash
# The admission wait under open-loop load: Poisson arrivals (`cai-dllm bench serve --request-rate`)
# against the built-in model served with the wait off (0) and at its default cap (5 ms), two seeds.
# Where arrivals do not follow freed rows the wait should stand aside: same latency, same throughput.
#
#   bash bench/admission_open_loop.sh > bench/results/admission_open_loop_cpu.txt
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
DECODING='{"policy":"cai","cache":"dual","refresh_interval":16,"block_length":32}'
for seed in 1 2; do
  for wait in 0 5; do
    port=$((8800 + wait))
    $PY -m server.cli serve --port $port --log-level warning --admission-wait-ms $wait &
    pid=$!
    until curl -sf http://127.0.0.1:$port/ready >/dev/null; do sleep 0.3; done
    for rate in 20 40; do
      echo "\$ cai-dllm bench serve --base-url http://127.0.0.1:$port --request-rate $rate --num-requests 256 --seed $seed --decoding '$DECODING'   # server --admission-wait-ms $wait"
      $PY -m server.cli bench serve --base-url http://127.0.0.1:$port --request-rate $rate --num-requests 256 \
        --seed $seed --decoding "$DECODING" 2>/dev/null
    done
    kill $pid
    wait $pid 2>/dev/null
  done
done
