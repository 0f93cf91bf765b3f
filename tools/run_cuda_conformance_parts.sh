#!/usr/bin/env bash
# The whole GPU conformance run (tools/run_cuda_conformance.sh, default example counts) as
# parts in three lanes that run at once on one GPU, for a machine that allows at most one
# 10-minute call: the suite at its default counts alone outlasts that. Each part is one run of
# the script with ROWCACHE_PART and a -k expression into its own folder; a lane runs its parts
# one after another, each limited by what is left of the lane's time; then every part's files
# are copied into LOG_DIR/all and summarized there (the summary fails when a test of a step ran
# in no part, or a part is missing or was cut). Exit status: the summary's.
#
#   tools/run_cuda_conformance_parts.sh LOG_DIR [ARCHIVE.tar.gz]
#
# Environment: ROWCACHE_LANE_SECONDS (default 540) is each lane's time from the start; the
# rest as for tools/run_cuda_conformance.sh (ROWCACHE_COMMIT, PYTHON, the example counts).
#
# Lanes run concurrently, so each part runs beside another lane's GPU work: the correctness
# checks do not depend on timing, and the race fixtures decide each run as pass, fail or
# inconclusive (an inconclusive run is retried, then fails), so contention can cost retries,
# not verdicts. Measured on the H200 (2026-12-01, eight parts at once): the suite's lockstep
# machines took most of the time (a sanitized run of them 427 s beside the other seven), so
# the suite's rest has a lane of its own; the three lanes hold 4 to 7 minutes of work each.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 LOG_DIR [ARCHIVE.tar.gz]" >&2; exit 2; }
LOGS=$1
ARCHIVE=${2:-}
mkdir -p "$LOGS"
LOGS=$(cd "$LOGS" && pwd)
LANE_SECONDS=${ROWCACHE_LANE_SECONDS:-540}
START=$SECONDS

MACHINE=test_conformance_machine_on_the_real_cuda_provider
KILLS=test_cuda_machine_kills_gpu_mutant
# The three mutants the CUDA machine takes longest to kill run in parts of their own.
SLOW="staging_reuse_without_event or forward_reuse_event_on_copy"
# lane | part name | step | -k expression
PARTS=(
  "1|rest|suite|not $MACHINE"
  "1|machine|suite|$MACHINE"
  "2|rest|sanitizer|not $MACHINE"
  "2|machine|sanitizer|$MACHINE"
  "3|kills|mutants|$KILLS and not ($SLOW or host_sync_on_owner)"
  "3|fixtures|mutants|not $KILLS"
  "3|kills-host-sync|mutants|$KILLS and host_sync_on_owner"
  "3|kills-slow|mutants|$KILLS and ($SLOW)"
)

lane() {  # lane N: its parts in order, each limited by what is left of the lane's time
  local number=$1 entry lane_of part step expression left
  for entry in "${PARTS[@]}"; do
    IFS='|' read -r lane_of part step expression <<< "$entry"
    [ "$lane_of" = "$number" ] || continue
    left=$((LANE_SECONDS - (SECONDS - START)))
    if [ "$left" -lt 30 ]; then
      echo "== part $step.$part: not started ($left s left in lane $number)" \
        > "$LOGS/$step-$part.out"
      continue  # its files stay absent: the summary reports the step missing
    fi
    echo "== lane $number, part $step.$part ($left s): -k \"$expression\""
    ROWCACHE_STEPS=$step ROWCACHE_PART=$part ROWCACHE_PYTEST_K=$expression \
      ROWCACHE_STEP_TIMEOUT=$left \
      bash tools/run_cuda_conformance.sh "$LOGS/$step-$part" > "$LOGS/$step-$part.out" 2>&1
  done
}

pids=()
for number in 1 2 3; do
  lane "$number" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done

rm -rf "$LOGS/all"
mkdir -p "$LOGS/all"
for entry in "${PARTS[@]}"; do
  IFS='|' read -r _ part step _ <<< "$entry"
  if [ -d "$LOGS/$step-$part" ]; then cp -r "$LOGS/$step-$part"/. "$LOGS/all/"; fi
done
"${PYTHON:-python3}" tools/conformance_summary.py "$LOGS/all"
rc=$?
if [ -n "$ARCHIVE" ]; then
  tar czf "$ARCHIVE" -C "$(dirname "$LOGS")" "$(basename "$LOGS")"
fi
exit $rc
