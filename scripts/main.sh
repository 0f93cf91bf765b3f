#!/usr/bin/env bash
# The main job: model-check the transition table (every search and machine column; "--complete"
# adds the z3 columns, as scripts/test.sh runs it), then run the provider demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh check
.venv/bin/python -m model_check "$@"
.venv/bin/python -m rowcache.demo
