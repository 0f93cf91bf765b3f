#!/usr/bin/env bash
# GPU conformance run (issue 6): the tests/cuda suite, the GPU mutants and the suite again under
# PyTorch's CUDA stream sanitizer, then one summary line. Exit status 0 only when every test
# passed, none was skipped, and every GPU mutant was detected.
#
#   tools/run_cuda_conformance.sh [LOG_DIR]        (default: out/cuda-conformance)
#   tools/run_cuda_conformance.sh --summary-only LOG_DIR
#
# The steps can run in separate calls (one GPU call each, into separate folders), be copied
# into one folder, and be summarized there on any machine (no torch or GPU needed):
#   ROWCACHE_STEPS=suite bash tools/run_cuda_conformance.sh A      (then mutants into B, ...)
#   cp A/* B/* C/* ALL/ && bash tools/run_cuda_conformance.sh --summary-only ALL
# A step absent from the folder is reported missing, and the run FAIL.
#
# Environment:
#   PYTHON                       a Python whose torch is a CUDA build (default: python3)
#   ROWCACHE_WHEELS              a folder of wheels to install pytest/hypothesis from, offline,
#                                when they are missing (else pip installs them from the index)
#   ROWCACHE_CUDA_EXAMPLES       hypothesis examples of the CUDA machine (default 200)
#   ROWCACHE_SANITIZER_EXAMPLES  the same, in the sanitizer pass (default 50)
#   ROWCACHE_LOCKSTEP_EXAMPLES   examples in each cell of the device planner's lockstep in the
#                                suite (default 200; empty: a share of ROWCACHE_CUDA_EXAMPLES,
#                                33 to 66 a cell; the sanitizer pass always takes its share)
#   ROWCACHE_STEP_TIMEOUT        seconds allowed for each of the three pytest runs (default 900)
#   ROWCACHE_COMMIT              the commit to report (default: git rev-parse HEAD)
#   ROWCACHE_PYTEST_ARGS         more pytest arguments for every step (e.g. -k to split a step)
#   ROWCACHE_PYTEST_K            a pytest -k expression for every step, passed as one argument
#                                (spaces and parentheses kept; ROWCACHE_PYTEST_ARGS is split on
#                                spaces)
#   ROWCACHE_PART                a name for this part of a split step (letters, digits, - and _):
#                                its files are <step>.<part>.xml/.rc/.log, and <step>.collected
#                                lists the whole step's tests, so the summary of the parts in one
#                                folder fails when a test ran in no part. Parts may run one after
#                                another or at once (separate LOG_DIRs, copied together after)
#   ROWCACHE_ARCHIVE             a .tar.gz path: the whole LOG_DIR packed there at the end
#   ROWCACHE_MUTANT_EXAMPLES     the CUDA machine's examples per length when it kills the host
#                                path's GPU mutants (default 200)
#   ROWCACHE_RACE_RUNS           runs of every device-path race fixture (default 5)
#   ROWCACHE_STEPS               the steps to run, of "suite mutants sanitizer summary" (default
#                                "suite mutants sanitizer", then the summary); "summary" alone
#                                only summarizes LOG_DIR (as --summary-only); a run of some
#                                steps without "summary" exits with their pytest status
#
# rowcache and model_check run from this checkout (PYTHONPATH): nothing is built or installed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
STEPS=${ROWCACHE_STEPS:-suite mutants sanitizer}
if [ "${1:-}" = "--summary-only" ]; then
  [ $# -eq 2 ] || { echo "usage: $0 --summary-only LOG_DIR" >&2; exit 2; }
  STEPS=summary
  shift
fi
RUN_SUMMARY=0
PYTEST_STEPS=()
for name in $STEPS; do
  case $name in
    suite|mutants|sanitizer) PYTEST_STEPS+=("$name") ;;
    summary) RUN_SUMMARY=1 ;;
    *) echo "cuda-conformance: unknown step '$name' in ROWCACHE_STEPS (known: suite mutants sanitizer summary)" >&2; exit 2 ;;
  esac
done
if [ -z "${ROWCACHE_STEPS:-}" ] && [ "$STEPS" != summary ]; then
  RUN_SUMMARY=1  # the default run: all three steps, then the summary
fi
PART=${ROWCACHE_PART:-}
if [ -n "$PART" ] && ! [[ $PART =~ ^[A-Za-z0-9_-]+$ ]]; then
  echo "cuda-conformance: ROWCACHE_PART='$PART' may hold only letters, digits, - and _" >&2; exit 2
fi
LOGS=${1:-out/cuda-conformance}
if [ ${#PYTEST_STEPS[@]} -eq 0 ]; then  # the summary alone: pure Python over LOG_DIR
  [ -d "$LOGS" ] || { echo "cuda-conformance: no folder $LOGS" >&2; exit 2; }
  exec "$PY" "$ROOT/tools/conformance_summary.py" "$LOGS"
fi
mkdir -p "$LOGS"
LOGS=$(cd "$LOGS" && pwd)
rm -f "$LOGS"/summary.txt "$LOGS"/fixtures.jsonl
stem_of() { echo "$1${PART:+.$PART}"; }  # a step's file stem: <step> or <step>.<part>
for name in "${PYTEST_STEPS[@]}"; do
  stem=$(stem_of "$name")
  rm -f "$LOGS/$stem".xml "$LOGS/$stem".log "$LOGS/$stem".rc "$LOGS/$stem".fixtures.jsonl \
    "$LOGS/environment.$stem.txt"
done
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
import os, platform, subprocess, sys
import hypothesis, pytest, torch
# The GPU the tests see: the first of CUDA_VISIBLE_DEVICES where it is set (nvidia-smi itself
# lists every GPU of the machine).
visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
only = ["-i", visible] if visible else []
try:
    smi = subprocess.run(
        ["nvidia-smi", *only, "--query-gpu=name,driver_version,memory.total",
         "--format=csv,noheader"],
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
try:
    import triton
    print(f"triton: {triton.__version__}")
except ImportError:
    print("triton: not installed")
print(f"python: {platform.python_version()}; pytest {pytest.__version__}; "
      f"hypothesis {hypothesis.__version__}")
PYEOF
cat "$LOGS/environment.txt"

# -- the three runs ----------------------------------------------------------------------
step() {  # step NAME [env assignments...] -- pytest arguments...
  local name=$1 stem
  stem=$(stem_of "$1")
  shift
  local assignments=()
  while [ "$1" != "--" ]; do assignments+=("$1"); shift; done
  shift
  local select=()
  if [ -n "${ROWCACHE_PYTEST_K:-}" ]; then select=(-k "$ROWCACHE_PYTEST_K"); fi
  echo "== $stem: ${assignments[*]} pytest tests/cuda $* ${select[*]} ${ROWCACHE_PYTEST_ARGS:-}"
  local collecting=""
  if [ -n "$PART" ]; then  # the whole step's tests, for the summary's check of the parts
    # In the background, beside the part's own run (it needs no GPU; a few seconds a part).
    ("$PY" -m pytest tests/cuda -p no:cacheprovider -q --collect-only "$@" 2>/dev/null \
      | grep '::' > "$LOGS/$name.collected") &
    collecting=$!
  fi
  # SIGINT first: pytest then ends the session and still writes the JUnit XML of the tests
  # it ran (a step cut by its limit keeps its partial record; its status stays non-zero).
  # tools/interruptible_pytest.py: SIGINT reaches pytest even where this script runs as a
  # background job, which starts its commands with SIGINT ignored.
  # shellcheck disable=SC2086  # ROWCACHE_PYTEST_ARGS is split on purpose
  env "${assignments[@]}" timeout --signal=INT --kill-after=30 "$STEP_TIMEOUT" "$PY" \
    "$ROOT/tools/interruptible_pytest.py" tests/cuda -p no:cacheprovider -q -rA --durations=25 \
    --junitxml="$LOGS/$stem.xml" "$@" "${select[@]}" ${ROWCACHE_PYTEST_ARGS:-} \
    > "$LOGS/$stem.log" 2>&1
  local rc=$?
  if [ -n "$collecting" ]; then wait "$collecting"; fi
  echo $rc > "$LOGS/$stem.rc"
  [ $rc -eq 0 ] || STEPS_RC=1
  cp "$LOGS/environment.txt" "$LOGS/environment.$stem.txt"
  if [ -f "$LOGS/fixtures.jsonl" ]; then mv "$LOGS/fixtures.jsonl" "$LOGS/$stem.fixtures.jsonl"; fi
  tail -n 1 "$LOGS/$stem.log"
}
STEPS_RC=0
for name in "${PYTEST_STEPS[@]}"; do
  case $name in
    suite) step suite "ROWCACHE_CUDA_EXAMPLES=${ROWCACHE_CUDA_EXAMPLES:-200}" \
      "ROWCACHE_LOCKSTEP_EXAMPLES=${ROWCACHE_LOCKSTEP_EXAMPLES-200}" -- -m "not gpu_mutant" ;;
    mutants) step mutants "ROWCACHE_CUDA_EXAMPLES=${ROWCACHE_CUDA_EXAMPLES:-200}" -- -m gpu_mutant ;;
    sanitizer) step sanitizer TORCH_CUDA_SANITIZER=1 ROWCACHE_LOCKSTEP_EXAMPLES= \
      "ROWCACHE_CUDA_EXAMPLES=${ROWCACHE_SANITIZER_EXAMPLES:-50}" -- -m "not gpu_mutant and not csan_subprocess" ;;
  esac
done

# One archive of the whole folder, for a caller that can take few files back.
pack() {
  if [ -n "${ROWCACHE_ARCHIVE:-}" ]; then
    tar czf "$ROWCACHE_ARCHIVE" -C "$(dirname "$LOGS")" "$(basename "$LOGS")"
  fi
}

# -- the summary -------------------------------------------------------------------------
if [ "$RUN_SUMMARY" = 1 ]; then
  "$PY" "$ROOT/tools/conformance_summary.py" "$LOGS"
  rc=$?
  pack
  exit $rc
fi
pack
echo "steps run: $STEPS (exit status: every step's pytest status; the summary, once every step's"
echo "files are in one folder: tools/run_cuda_conformance.sh --summary-only DIR)"
exit "$STEPS_RC"
