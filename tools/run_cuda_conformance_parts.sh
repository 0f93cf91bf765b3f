#!/usr/bin/env bash
# The whole GPU conformance run (tools/run_cuda_conformance.sh, default example counts) as
# parts, for a machine that allows at most one 10-minute call: the suite at its default counts
# alone outlasts that, and so does the whole run. Each part is one run of that script with
# ROWCACHE_PART and a -k expression into its own folder. One call runs the parts it names one
# after another, each limited by twice its estimate or what is left of the call's time, if less
# (a part whose estimate exceeds what is left is not started: it runs whole in a later call),
# and packs them into one archive; the archives of all calls are merged and summarized anywhere
# (no GPU needed), and the summary fails when a test of a step ran in no part, a part is missing
# or was cut, or the parts ran at different commits, GPUs or torches.
#
#   tools/run_cuda_conformance_parts.sh LOG_DIR ARCHIVE.tar.gz [PART ...]   (on the GPU)
#   tools/run_cuda_conformance_parts.sh --merge DEST ARCHIVE.tar.gz ...     (anywhere)
#   tools/run_cuda_conformance_parts.sh --list
#   tools/run_cuda_conformance_parts.sh --plan [PART ...]     (which parts each GPU would run)
#
# PART is one of --list's names (default: every part, in order). A call's exit status: the
# summary's when it ran every part, else 0 only when every part it ran passed. --merge unpacks
# the archives in order into DEST (a part in a later archive replaces the same part of an
# earlier one: a part run again), copies every part's files into DEST/all and exits with the
# summary's status.
#
# Environment: ROWCACHE_CALL_SECONDS (default 540) is the call's time from its start;
# ROWCACHE_PART_ESTIMATES (e.g. "suite.lockstep-nvfp4=300,suite.rest=60") replaces the
# estimates of the parts it names;
# ROWCACHE_GPUS (default: unset) the GPUs to spread the parts over, e.g. "0 1 2 3": one lane a
# GPU (CUDA_VISIBLE_DEVICES), each running its parts one after another, the parts dealt out
# longest first to the lane with the least work (the seconds in PARTS); the rest as for
# tools/run_cuda_conformance.sh (ROWCACHE_COMMIT, PYTHON, the example counts).
#
# On one GPU the parts run one at a time. Run at once they slow each other down far more than
# they gain: the lockstep machines wait on the GPU after every step, and processes sharing a GPU
# take turns on it. Measured on the H200 (2026-12-01, 21f3ea7, three lanes on one GPU): the
# suite's lockstep part ran 5 of its 8 cells in 525 s, where alone each cell takes 11 to 19 s.
set -uo pipefail
CALLER=$PWD
cd "$(dirname "$0")/.."
# A path as the caller meant it (this script runs from the repository's root).
from_caller() { case $1 in /*) echo "$1" ;; *) echo "$CALLER/$1" ;; esac; }

MACHINE=test_conformance_machine_on_the_real_cuda_provider
LOCKSTEP=test_device_planner_in_lockstep_inside_graphs
KILLS=test_cuda_machine_kills_gpu_mutant
# The three mutants the CUDA machine takes longest to kill run in parts of their own.
SLOW="staging_reuse_without_event or forward_reuse_event_on_copy"
# step.part | seconds (estimated, upper bounds; they decide which parts a call starts and deal
# the parts out to GPUs) | -k expression. From attempt G (one H200, 97c0a35, one part at a
# time, at the default counts: 200 examples a lockstep cell), each part's whole time in the call
# (its collection included) times about 1.4, rounded up to 5 s; measured: suite.rest 63,
# lockstep bf16 51, bf16_scaled 56, fp8_block 67, nvfp4 50, suite.machine 27,
# sanitizer.machine 46, sanitizer.rest 348, kills-slow 18, kills-host-sync 25, kills 53,
# fixtures 57 (docs/records/2026-12-02-conformance-g.md). lockstep mxfp4 (not yet measured) is
# estimated as nvfp4, its nearest geometry in size; lockstep compressed (one layout, not yet
# measured) as about half of bf16's two. The machine parts run a planes cell too since
# 2026-12-04 (a quarter of the examples, not yet measured): 15 and 20 s more. suite.rest,
# measured at 55 s in attempt K, gained the one-miss decode cases and the host planner's
# planes (not yet measured). On one GPU: 1,370 s in all, three calls (sanitizer.rest alone).
PARTS=(
  "suite.rest|90|not $MACHINE and not $LOCKSTEP"
  "suite.lockstep-bf16|75|$LOCKSTEP and bf16 and not bf16_scaled"
  "suite.lockstep-bf16_scaled|80|$LOCKSTEP and bf16_scaled"
  "suite.lockstep-fp8_block|95|$LOCKSTEP and fp8_block"
  "suite.lockstep-nvfp4|75|$LOCKSTEP and nvfp4"
  "suite.lockstep-mxfp4|75|$LOCKSTEP and mxfp4"
  "suite.lockstep-compressed|45|$LOCKSTEP and compressed"
  "suite.machine|60|$MACHINE"
  "sanitizer.machine|90|$MACHINE"
  "sanitizer.rest|450|not $MACHINE"
  "mutants.kills-slow|30|$KILLS and ($SLOW)"
  "mutants.kills-host-sync|40|$KILLS and host_sync_on_owner"
  "mutants.kills|80|$KILLS and not ($SLOW or host_sync_on_owner)"
  "mutants.fixtures|85|not $KILLS"
)
NAMES=()
for entry in "${PARTS[@]}"; do NAMES+=("${entry%%|*}"); done
field() { local rest=${1#*|}; if [ "$2" = seconds ]; then echo "${rest%%|*}"; else echo "${rest#*|}"; fi; }

usage() {
  echo "usage: $0 LOG_DIR ARCHIVE.tar.gz [PART ...] | --merge DEST ARCHIVE.tar.gz ... | --list |" \
    "--plan [PART ...]" >&2
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
    for entry in "${PARTS[@]}"; do echo "${entry%%|*}: -k \"$(field "$entry" k)\""; done
    exit 0 ;;
  --merge)
    [ $# -ge 3 ] || usage
    DEST=$(from_caller "$2")
    shift 2
    for archive in "$@"; do
      [ -f "$(from_caller "$archive")" ] || { echo "no archive $archive" >&2; exit 2; }
    done
    mkdir -p "$DEST"
    DEST=$(cd "$DEST" && pwd)
    call=0
    for archive in "$@"; do
      call=$((call + 1))
      unpacked="$DEST/calls/$call"
      rm -rf "$unpacked"
      mkdir -p "$unpacked"
      tar xzf "$(from_caller "$archive")" -C "$unpacked" \
        || { echo "cannot unpack $archive" >&2; exit 2; }
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

PLAN_ONLY=0
if [ "${1:-}" = --plan ]; then
  PLAN_ONLY=1
  shift
else
  [ $# -ge 2 ] || usage
  LOGS=$(from_caller "$1")
  ARCHIVE=${2:+$(from_caller "$2")}
  shift 2
fi
SELECTED=("$@")
[ ${#SELECTED[@]} -gt 0 ] || SELECTED=("${NAMES[@]}")
for name in "${SELECTED[@]}"; do
  [[ " ${NAMES[*]} " == *" $name "* ]] \
    || { echo "unknown part '$name'; known: ${NAMES[*]}" >&2; exit 2; }
done
# ROWCACHE_PART_ESTIMATES="name=seconds,...": estimates measured since (a part's examples
# changed, e.g. ROWCACHE_LOCKSTEP_EXAMPLES), in place of those in PARTS.
for given in ${ROWCACHE_PART_ESTIMATES:+${ROWCACHE_PART_ESTIMATES//,/ }}; do
  name=${given%%=*}
  seconds=${given#*=}
  [[ " ${NAMES[*]} " == *" $name "* && $given == *=* ]] \
    || { echo "ROWCACHE_PART_ESTIMATES: unknown part in '$given'; known: ${NAMES[*]}" >&2; exit 2; }
  [[ $seconds =~ ^[0-9]+$ ]] \
    || { echo "ROWCACHE_PART_ESTIMATES: '$seconds' is not whole seconds (in '$given')" >&2; exit 2; }
  for i in "${!PARTS[@]}"; do
    if [ "${PARTS[i]%%|*}" = "$name" ]; then
      PARTS[i]="$name|$seconds|$(field "${PARTS[i]}" k)"
    fi
  done
done
read -r -a GPUS <<< "${ROWCACHE_GPUS:-}"
for gpu in "${GPUS[@]}"; do
  [[ $gpu =~ ^[0-9]+$ ]] || { echo "ROWCACHE_GPUS: '$gpu' is not a GPU index" >&2; exit 2; }
done
LANES=${#GPUS[@]}
[ "$LANES" -gt 0 ] || LANES=1

# The selected parts dealt out to the lanes: longest first, each to the lane with least work.
declare -a LANE_PARTS LANE_WORK
for ((i = 0; i < LANES; i++)); do LANE_PARTS[i]=""; LANE_WORK[i]=0; done
while read -r _ name; do
  least=0
  for ((i = 1; i < LANES; i++)); do
    [ "${LANE_WORK[i]}" -lt "${LANE_WORK[least]}" ] && least=$i
  done
  LANE_PARTS[least]+=" $name"
  for entry in "${PARTS[@]}"; do
    [ "${entry%%|*}" = "$name" ] && LANE_WORK[least]=$((LANE_WORK[least] + $(field "$entry" seconds)))
  done
done < <(for entry in "${PARTS[@]}"; do
  name=${entry%%|*}
  [[ " ${SELECTED[*]} " == *" $name "* ]] && echo "$(field "$entry" seconds) $name"
done | sort -rn -s -k1,1)

if [ "$PLAN_ONLY" = 1 ]; then  # each lane's parts in the order it runs them
  for ((i = 0; i < LANES; i++)); do
    label="one GPU"
    [ ${#GPUS[@]} -eq 0 ] || label="GPU ${GPUS[i]}"
    order=""
    for entry in "${PARTS[@]}"; do
      [[ " ${LANE_PARTS[i]} " == *" ${entry%%|*} "* ]] && order+=" ${entry%%|*}"
    done
    echo "$label: about ${LANE_WORK[i]} s:$order"
  done
  exit 0
fi
mkdir -p "$LOGS"
LOGS=$(cd "$LOGS" && pwd)
CALL_SECONDS=${ROWCACHE_CALL_SECONDS:-540}
START=$SECONDS

lane() {  # lane N: its parts in PARTS order, each limited by twice its estimate or what is left
  # of the call's time, if less
  local number=$1 entry name expression step part folder left estimate limit rc=0 where=""
  local visible=()
  if [ ${#GPUS[@]} -gt 0 ]; then
    visible=(env "CUDA_VISIBLE_DEVICES=${GPUS[number]}")
    where=" on GPU ${GPUS[number]}"
  fi
  for entry in "${PARTS[@]}"; do
    name=${entry%%|*}
    [[ " ${LANE_PARTS[number]} " == *" $name "* ]] || continue
    expression=$(field "$entry" k)
    step=${name%%.*}
    part=${name#*.}
    folder="$LOGS/$step-$part"
    left=$((CALL_SECONDS - (SECONDS - START)))
    estimate=$(field "$entry" seconds)
    # A part started with less time left than it takes is cut and its time lost; a part not
    # started runs whole in a later call. The estimates are upper bounds (see PARTS).
    if [ "$left" -lt 30 ] || [ "$estimate" -gt "$left" ]; then
      echo "== part $name$where: not started (estimated $estimate s, $left s left in the call)" \
        | tee "$folder.out"
      rc=1
      continue  # its files stay absent: the summary reports the step missing
    fi
    # A part that runs past twice its estimate (an upper bound) is cut there, so that one part
    # gone wrong leaves the call's other parts their time.
    limit=$((2 * estimate))
    [ "$limit" -le "$left" ] || limit=$left
    echo "== part $name$where ($left s left, at most $limit s): -k \"$expression\""
    "${visible[@]}" env ROWCACHE_STEPS="$step" ROWCACHE_PART="$part" \
      ROWCACHE_PYTEST_K="$expression" ROWCACHE_STEP_TIMEOUT="$limit" \
      bash tools/run_cuda_conformance.sh "$folder" > "$folder.out" 2>&1 || rc=1
    tail -n 3 "$folder.out"
  done
  return $rc
}

pids=()
for ((i = 0; i < LANES; i++)); do
  lane "$i" &
  pids+=($!)
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done

if [ ${#SELECTED[@]} -eq ${#NAMES[@]} ]; then
  summarize "$LOGS"
  rc=$?
fi
if [ -n "$ARCHIVE" ]; then
  tar czf "$ARCHIVE" -C "$(dirname "$LOGS")" "$(basename "$LOGS")"
fi
exit $rc
