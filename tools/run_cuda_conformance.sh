#!/usr/bin/env bash
# GPU conformance run (issue 6): the tests/cuda suite, the GPU mutants and the suite again under
# PyTorch's CUDA stream sanitizer, then one summary line. Exit status 0 only when every test
# passed, none was skipped, and every GPU mutant was detected.
#
#   tools/run_cuda_conformance.sh [LOG_DIR]        (default: out/cuda-conformance)
#
# Environment:
#   PYTHON                       a Python whose torch is a CUDA build (default: python3)
#   ROWCACHE_WHEELS              a folder of wheels to install pytest/hypothesis from, offline,
#                                when they are missing (else pip installs them from the index)
#   ROWCACHE_CUDA_EXAMPLES       hypothesis examples of the CUDA machine (default 200)
#   ROWCACHE_SANITIZER_EXAMPLES  the same, in the sanitizer pass (default 50)
#   ROWCACHE_STEP_TIMEOUT        seconds allowed for each of the three pytest runs (default 900)
#   ROWCACHE_COMMIT              the commit to report (default: git rev-parse HEAD)
#
# rowcache and model_check run from this checkout (PYTHONPATH): nothing is built or installed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
LOGS=${1:-out/cuda-conformance}
mkdir -p "$LOGS"
LOGS=$(cd "$LOGS" && pwd)
rm -f "$LOGS"/*.xml "$LOGS"/*.log "$LOGS"/*.rc "$LOGS"/fixtures.jsonl "$LOGS"/summary.txt
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export ROWCACHE_CONFORMANCE_LOGS="$LOGS"
export PYTHONUNBUFFERED=1
STEP_TIMEOUT=${ROWCACHE_STEP_TIMEOUT:-900}

fail() { echo "cuda-conformance: FAILED: $*" | tee "$LOGS/summary.txt"; exit 2; }

# -- what the suite needs ----------------------------------------------------------------
"$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
  || fail "$PY has no CUDA-capable torch (set PYTHON to one whose torch.cuda.is_available())"
if ! "$PY" -c 'import pytest, hypothesis' 2>/dev/null; then
  if [ -n "${ROWCACHE_WHEELS:-}" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$LOGS/site" \
      "$ROWCACHE_WHEELS"/*.whl || fail "could not install the wheels in $ROWCACHE_WHEELS"
    export PYTHONPATH="$PYTHONPATH:$LOGS/site"
  else
    "$PY" -m pip install -q "pytest>=8" "hypothesis>=6.100" || fail "pip install pytest hypothesis"
  fi
fi
"$PY" -c 'import pytest, hypothesis' || fail "pytest and hypothesis are not importable"

COMMIT=${ROWCACHE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
"$PY" - "$COMMIT" > "$LOGS/environment.txt" <<'PYEOF'
import platform, subprocess, sys
import hypothesis, pytest, torch
try:
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
except Exception:  # no nvidia-smi: fall back to torch
    try:
        smi = f"{torch.cuda.get_device_name()}, unknown driver"
    except Exception as error:
        smi = f"no GPU ({type(error).__name__}), unknown driver"
print(f"commit: {sys.argv[1]}")
print(f"gpu: {smi}")
print(f"torch: {torch.__version__} (CUDA {torch.version.cuda})")
print(f"python: {platform.python_version()}; pytest {pytest.__version__}; "
      f"hypothesis {hypothesis.__version__}")
PYEOF
cat "$LOGS/environment.txt"

# -- the three runs ----------------------------------------------------------------------
step() {  # step NAME [env assignments...] -- pytest arguments...
  local name=$1
  shift
  local assignments=()
  while [ "$1" != "--" ]; do assignments+=("$1"); shift; done
  shift
  echo "== $name: pytest tests/cuda $*"
  env "${assignments[@]}" timeout "$STEP_TIMEOUT" "$PY" -m pytest tests/cuda -p no:cacheprovider \
    -q -rA --junitxml="$LOGS/$name.xml" "$@" > "$LOGS/$name.log" 2>&1
  echo $? > "$LOGS/$name.rc"
  tail -n 1 "$LOGS/$name.log"
}
step suite "ROWCACHE_CUDA_EXAMPLES=${ROWCACHE_CUDA_EXAMPLES:-200}" -- -m "not gpu_mutant"
step mutants "ROWCACHE_CUDA_EXAMPLES=${ROWCACHE_CUDA_EXAMPLES:-200}" -- -m gpu_mutant
step sanitizer TORCH_CUDA_SANITIZER=1 \
  "ROWCACHE_CUDA_EXAMPLES=${ROWCACHE_SANITIZER_EXAMPLES:-50}" -- -m "not gpu_mutant and not csan_subprocess"

# -- the summary -------------------------------------------------------------------------
"$PY" - "$LOGS" <<'PYEOF'
import json, sys, xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

logs = Path(sys.argv[1])
env = dict(line.split(": ", 1) for line in (logs / "environment.txt").read_text().splitlines())


def counts(name):
    rc = int((logs / f"{name}.rc").read_text().strip() or 1)
    path = logs / f"{name}.xml"
    if not path.exists():
        return {"passed": 0, "failed": 0, "skipped": 0, "rc": rc, "cases": {}}
    cases = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        key = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            cases[key] = "failed"
        elif case.find("skipped") is not None:
            cases[key] = "skipped"
        else:
            cases[key] = "passed"
    c = {k: sum(v == k for v in cases.values()) for k in ("passed", "failed", "skipped")}
    return {**c, "rc": rc, "cases": cases}


suite, mutants, sanitizer = counts("suite"), counts("mutants"), counts("sanitizer")
detected = sorted(
    k.split("[", 1)[1].rstrip("]")
    for k, v in mutants["cases"].items()
    if "test_gpu_mutant_is_detected[" in k and v == "passed"
)
all_race = sorted(
    k.split("[", 1)[1].rstrip("]")
    for k in mutants["cases"]
    if "test_gpu_mutant_is_detected[" in k
)

device_mutants = sorted(k for k in mutants["cases"] if "test_device_mutant" in k)
device_detected = [k for k in device_mutants if mutants["cases"][k] == "passed"]

SHORT = {"wrong_read": "R", "wrong_map": "M", "host_block": "H"}
matrix = defaultdict(dict)
fixtures = []
path = logs / "fixtures.jsonl"
if path.exists():
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row["fixture"] not in fixtures:
            fixtures.append(row["fixture"])
        kinds = sorted({SHORT[f[0]] for f in row["findings"]})
        cell = "inconclusive" if row.get("inconclusive") else "".join(kinds) or "-"
        matrix[row["provider"]][row["fixture"]] = cell

out = []
def text(c):
    return f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped"
out.append(f"commit {env.get('commit')}; GPU {env.get('gpu')}; torch {env.get('torch')}")
out.append(f"suite:     {text(suite)}")
out.append(f"mutants:   {text(mutants)}; race-fixture detection {len(detected)}/{len(all_race)}; "
           f"device-path mutants detected {len(device_detected)}/{len(device_mutants)}")
out.append(f"sanitizer: {text(sanitizer)} (TORCH_CUDA_SANITIZER=1)")
if matrix:
    width = max(len(p) for p in matrix)
    out.append("")
    out.append("race fixtures: findings per provider (R wrong read, M wrong map, H host block,")
    out.append("- none, ? inconclusive); columns:")
    for number, fixture in enumerate(fixtures, 1):
        out.append(f"  F{number} {fixture}")
    out.append(" " * width + " | " + " | ".join(f"F{n:<2}" for n in range(1, len(fixtures) + 1)))
    for provider, row in matrix.items():
        cells = [row.get(f, " ").replace("inconclusive", "?").ljust(3) for f in fixtures]
        out.append(provider.ljust(width) + " | " + " | ".join(cells))
ok = (
    all(c["rc"] == 0 and c["failed"] == 0 and c["skipped"] == 0 for c in (suite, mutants, sanitizer))
    and suite["passed"] > 0 and sanitizer["passed"] > 0 and all_race and detected == all_race
    and device_mutants and device_detected == device_mutants
)
gpu = env.get("gpu", "?").split(",")
line = (
    f"cuda-conformance: {'PASS' if ok else 'FAIL'} | suite {text(suite)} | GPU mutants "
    f"{len(detected)}/{len(all_race)} detected, device path {len(device_detected)}/"
    f"{len(device_mutants)} ({text(mutants)}) | sanitizer "
    f"{'clean' if sanitizer['rc'] == 0 and sanitizer['failed'] == 0 else 'NOT clean'} "
    f"({text(sanitizer)}) | {gpu[0].strip()}, driver {gpu[1].strip() if len(gpu) > 1 else '?'}, "
    f"torch {env.get('torch', '?').split()[0]} | commit {env.get('commit', '?')[:12]}"
)
out.append("")
out.append(line)
(logs / "summary.txt").write_text("\n".join(out) + "\n")
print("\n".join(out))
sys.exit(0 if ok else 1)
PYEOF
