#!/usr/bin/env bash
# The main job: model-check the transition table, then run the provider demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/python -m model_check
.venv/bin/python -m rowcache.demo
