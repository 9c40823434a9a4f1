#!/usr/bin/env bash
# Set up a virtual environment from scratch and run the linter and the test suite.
#   bash scripts/test.sh                          every tier (what CI runs)
#   bash scripts/test.sh --tier unit --tier parity   those tiers only (tests/unit, tests/parity)
#   bash scripts/test.sh --no-system-packages     never install Debian packages, even as root
#   bash scripts/test.sh --tier engine -k prefix  anything else is passed to pytest
# Tiers: unit, engine, parity, server, operations. torch is installed first, pinned, from the PyTorch
# CPU index as the Dockerfile and the README install it (PyPI's Linux wheel is the multi-GB CUDA
# build); a machine whose pip already finds that wheel locally (find-links) takes it from there, so
# one retry per package is enough for the index. Only the operations tier needs the `ops` extra
# (Ray Serve, schemathesis, lm-eval, hadolint) and Debian's prometheus, docker-compose and nginx:
# those are installed when that tier runs, as root with apt (as on CI); elsewhere its tests skip.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
TIERS=(unit engine parity server operations)
tiers=()
system_packages=1
pytest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --tier)
      [ $# -ge 2 ] || { echo "error: --tier needs a name (${TIERS[*]})" >&2; exit 2; }
      [[ " ${TIERS[*]} " == *" $2 "* ]] || { echo "error: unknown tier '$2' (${TIERS[*]})" >&2; exit 2; }
      tiers+=("$2"); shift 2 ;;
    --no-system-packages) system_packages=0; shift ;;
    *) pytest_args+=("$1"); shift ;;
  esac
done
operations=1
if [ ${#tiers[@]} -gt 0 ] && [[ " ${tiers[*]} " != *" operations "* ]]; then
  operations=0
fi
if [ "$operations" = 1 ] && [ "$system_packages" = 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
   && ! { command -v prometheus && command -v docker-compose && command -v nginx; } >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus docker-compose \
    nginx-light >/dev/null
fi
extras="dev,quant"
[ "$operations" = 1 ] && extras="dev,ops,quant"
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --retries 1 --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
"$VENV/bin/pip" install --quiet -e ".[$extras]"
"$VENV/bin/ruff" check .
paths=()
for tier in "${tiers[@]+"${tiers[@]}"}"; do
  paths+=("tests/$tier")
done
PATH="$PWD/$VENV/bin:$PATH" "$VENV/bin/python" -m pytest "${paths[@]+"${paths[@]}"}" "${pytest_args[@]+"${pytest_args[@]}"}"
