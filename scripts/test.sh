#!/usr/bin/env bash
# Everything CI checks: lint, types, the complete model check, the mutant kill matrix, then the
# test suite on every core.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
PY=.venv/bin/python
$PY -m ruff check rowcache model_check tests tools
$PY -m mypy
$PY -m model_check.codegen --check
$PY -m model_check --complete
$PY -m model_check mutants
$PY -m pytest -q -p no:cacheprovider -n auto --dist worksteal
