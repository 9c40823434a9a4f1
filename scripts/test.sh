#!/usr/bin/env bash
# Set up a virtual environment from scratch and run the linter and the whole test suite.
# torch is installed first, pinned, so the CPU build on this machine's disk is used instead of a
# multi-GB CUDA download.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet torch==2.13.0
"$VENV/bin/pip" install --quiet -e '.[dev]'
"$VENV/bin/ruff" check .
"$VENV/bin/python" -m pytest "$@"
