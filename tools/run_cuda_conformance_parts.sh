#!/usr/bin/env bash
# The whole GPU conformance run (tools/run_cuda_conformance.sh, default example counts) as
# parts that run at once on one GPU, for a machine that allows at most one 10-minute call: the
# suite at its default counts alone outlasts that. Each part is one run of the script with
# ROWCACHE_PART and a -k expression into its own folder; then every part's files are copied
# into LOG_DIR/all and summarized there (the summary fails when a test of a step ran in no
# part, or a part is missing). Exit status: the summary's.
#
#   tools/run_cuda_conformance_parts.sh LOG_DIR [ARCHIVE.tar.gz]
#
# Environment: ROWCACHE_STEP_TIMEOUT (default 540) limits each part; the rest as for
# tools/run_cuda_conformance.sh (ROWCACHE_COMMIT, PYTHON, the example counts).
#
# Parts run concurrently, so each runs beside the others' GPU work: the correctness checks do
# not depend on timing, and the race fixtures decide each run as pass, fail or inconclusive
# (an inconclusive run is retried, then fails), so contention can cost retries, not verdicts.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 LOG_DIR [ARCHIVE.tar.gz]" >&2; exit 2; }
LOGS=$1
ARCHIVE=${2:-}
mkdir -p "$LOGS"
LOGS=$(cd "$LOGS" && pwd)
export ROWCACHE_STEP_TIMEOUT=${ROWCACHE_STEP_TIMEOUT:-540}

MACHINE=test_conformance_machine_on_the_real_cuda_provider
KILLS=test_cuda_machine_kills_gpu_mutant
# The three mutants the CUDA machine takes longest to kill run in parts of their own.
SLOW="staging_reuse_without_event or forward_reuse_event_on_copy"
# part name | step | -k expression
PARTS=(
  "machine|suite|$MACHINE"
  "rest|suite|not $MACHINE"
  "fixtures|mutants|not $KILLS"
  "kills|mutants|$KILLS and not ($SLOW or host_sync_on_owner)"
  "kills-slow|mutants|$KILLS and ($SLOW)"
  "kills-host-sync|mutants|$KILLS and host_sync_on_owner"
  "machine|sanitizer|$MACHINE"
  "rest|sanitizer|not $MACHINE"
)
pids=()
for entry in "${PARTS[@]}"; do
  IFS='|' read -r part step expression <<< "$entry"
  folder="$LOGS/$step-$part"
  echo "== part $step.$part: -k \"$expression\""
  ROWCACHE_STEPS=$step ROWCACHE_PART=$part ROWCACHE_PYTEST_K=$expression \
    bash tools/run_cuda_conformance.sh "$folder" > "$LOGS/$step-$part.out" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done

rm -rf "$LOGS/all"
mkdir -p "$LOGS/all"
for entry in "${PARTS[@]}"; do
  IFS='|' read -r part step _ <<< "$entry"
  cp -r "$LOGS/$step-$part"/. "$LOGS/all/"
done
"${PYTHON:-python3}" tools/conformance_summary.py "$LOGS/all"
rc=$?
if [ -n "$ARCHIVE" ]; then
  tar czf "$ARCHIVE" -C "$(dirname "$LOGS")" "$(basename "$LOGS")"
fi
exit $rc
