#!/usr/bin/env bash
# The whole GPU conformance run (tools/run_cuda_conformance.sh, default example counts) as
# parts, for a machine that allows at most one 10-minute call: the suite at its default counts
# alone outlasts that, and so does the whole run. Each part is one run of that script with
# ROWCACHE_PART and a -k expression into its own folder. One call runs the parts it names one
# after another, each limited by what is left of the call's time, and packs them into one
# archive; the archives of all calls are merged and summarized anywhere (no GPU needed), and
# the summary fails when a test of a step ran in no part, a part is missing or was cut, or the
# parts ran at different commits, GPUs or torches.
#
#   tools/run_cuda_conformance_parts.sh LOG_DIR ARCHIVE.tar.gz [PART ...]   (on the GPU)
#   tools/run_cuda_conformance_parts.sh --merge DEST ARCHIVE.tar.gz ...     (anywhere)
#   tools/run_cuda_conformance_parts.sh --list
#
# PART is one of --list's names (default: every part, in order). A call's exit status: the
# summary's when it ran every part, else 0 only when every part it ran passed. --merge unpacks
# the archives in order into DEST (a part in a later archive replaces the same part of an
# earlier one: a part run again), copies every part's files into DEST/all and exits with the
# summary's status.
#
# Environment: ROWCACHE_CALL_SECONDS (default 540) is the call's time from its start; the
# rest as for tools/run_cuda_conformance.sh (ROWCACHE_COMMIT, PYTHON, the example counts).
#
# Parts run one at a time. Run at once they slow each other down far more than they gain: the
# lockstep machines wait on the GPU after every step, and processes sharing a GPU take turns
# on it. Measured on the H200 (2026-12-01, 21f3ea7, three lanes at once): the suite's lockstep
# part ran 5 of its 8 cells in 525 s, where alone each cell takes 11 to 19 s.
set -uo pipefail
cd "$(dirname "$0")/.."

MACHINE=test_conformance_machine_on_the_real_cuda_provider
KILLS=test_cuda_machine_kills_gpu_mutant
# The three mutants the CUDA machine takes longest to kill run in parts of their own.
SLOW="staging_reuse_without_event or forward_reuse_event_on_copy"
# step.part | -k expression
PARTS=(
  "suite.rest|not $MACHINE"
  "suite.machine|$MACHINE"
  "sanitizer.machine|$MACHINE"
  "sanitizer.rest|not $MACHINE"
  "mutants.kills-slow|$KILLS and ($SLOW)"
  "mutants.kills-host-sync|$KILLS and host_sync_on_owner"
  "mutants.kills|$KILLS and not ($SLOW or host_sync_on_owner)"
  "mutants.fixtures|not $KILLS"
)
NAMES=()
for entry in "${PARTS[@]}"; do NAMES+=("${entry%%|*}"); done

usage() {
  echo "usage: $0 LOG_DIR ARCHIVE.tar.gz [PART ...] | --merge DEST ARCHIVE.tar.gz ... | --list" >&2
  exit 2
}

# Every part's files (folders <step>-<part>) of LOG_DIR copied into LOG_DIR/all, summarized.
summarize() {
  local logs=$1 name
  rm -rf "$logs/all"
  mkdir -p "$logs/all"
  for name in "${NAMES[@]}"; do
    if [ -d "$logs/${name/./-}" ]; then cp -r "$logs/${name/./-}"/. "$logs/all/"; fi
  done
  "${PYTHON:-python3}" tools/conformance_summary.py "$logs/all"
}

case ${1:-} in
  --list)
    for entry in "${PARTS[@]}"; do echo "${entry%%|*}: -k \"${entry#*|}\""; done
    exit 0 ;;
  --merge)
    [ $# -ge 3 ] || usage
    DEST=$2
    shift 2
    mkdir -p "$DEST"
    DEST=$(cd "$DEST" && pwd)
    call=0
    for archive in "$@"; do
      call=$((call + 1))
      unpacked="$DEST/calls/$call"
      rm -rf "$unpacked"
      mkdir -p "$unpacked"
      tar xzf "$archive" -C "$unpacked" || { echo "cannot unpack $archive" >&2; exit 2; }
      # the archive holds one LOG_DIR; its part folders replace those of earlier calls
      for folder in "$unpacked"/*/*-*/; do
        [ -d "$folder" ] || continue
        base=$(basename "$folder")
        [ "$base" = all ] && continue
        rm -rf "${DEST:?}/$base"
        cp -r "$folder" "$DEST/$base"
        cp "$unpacked"/*/"$base.out" "$DEST/" 2>/dev/null || true
      done
    done
    summarize "$DEST"
    exit $? ;;
esac

[ $# -ge 2 ] || usage
LOGS=$1
ARCHIVE=$2
shift 2
SELECTED=("$@")
[ ${#SELECTED[@]} -gt 0 ] || SELECTED=("${NAMES[@]}")
for name in "${SELECTED[@]}"; do
  [[ " ${NAMES[*]} " == *" $name "* ]] \
    || { echo "unknown part '$name'; known: ${NAMES[*]}" >&2; exit 2; }
done
mkdir -p "$LOGS"
LOGS=$(cd "$LOGS" && pwd)
CALL_SECONDS=${ROWCACHE_CALL_SECONDS:-540}
START=$SECONDS

rc=0
for entry in "${PARTS[@]}"; do
  name=${entry%%|*}
  expression=${entry#*|}
  [[ " ${SELECTED[*]} " == *" $name "* ]] || continue
  step=${name%%.*}
  part=${name#*.}
  folder="$LOGS/$step-$part"
  left=$((CALL_SECONDS - (SECONDS - START)))
  if [ "$left" -lt 30 ]; then
    echo "== part $name: not started ($left s left in the call)" | tee "$folder.out"
    rc=1
    continue  # its files stay absent: the summary reports the step missing
  fi
  echo "== part $name ($left s): -k \"$expression\""
  ROWCACHE_STEPS=$step ROWCACHE_PART=$part ROWCACHE_PYTEST_K=$expression \
    ROWCACHE_STEP_TIMEOUT=$left \
    bash tools/run_cuda_conformance.sh "$folder" > "$folder.out" 2>&1 || rc=1
  tail -n 3 "$folder.out"
done

if [ ${#SELECTED[@]} -eq ${#NAMES[@]} ]; then
  summarize "$LOGS"
  rc=$?
fi
if [ -n "$ARCHIVE" ]; then
  tar czf "$ARCHIVE" -C "$(dirname "$LOGS")" "$(basename "$LOGS")"
fi
exit $rc
