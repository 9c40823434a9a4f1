#!/usr/bin/env bash
# Set up a virtual environment from scratch and run the linter and the whole test suite.
# torch is installed first, pinned, from the PyTorch CPU index as the Dockerfile and the README install
# it (PyPI's Linux wheel is the multi-GB CUDA build); a machine whose pip already finds that wheel
# locally (find-links) takes it from there, so one retry per package is enough for the index. The operations tests also drive Debian's prometheus, docker-compose and
# nginx: installed here when running as root with apt (as on CI); elsewhere those tests skip.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
   && ! { command -v prometheus && command -v docker-compose && command -v nginx; } >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus docker-compose \
    nginx-light >/dev/null
fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --retries 1 --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
"$VENV/bin/pip" install --quiet -e '.[dev,ops,quant]'
"$VENV/bin/ruff" check .
PATH="$PWD/$VENV/bin:$PATH" "$VENV/bin/python" -m pytest "$@"
