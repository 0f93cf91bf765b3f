#!/usr/bin/env bash
# Creates .venv and installs rowcache with its development tools (or, with the argument
# "check", only what the main job needs: the model check's solvers). Idempotent.
# torch is pinned to the CPU build first: an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
EXTRA=${1:-dev}
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==${ROWCACHE_TORCH:-2.13.0}"
.venv/bin/python -m pip install -q -e ".[$EXTRA]"
