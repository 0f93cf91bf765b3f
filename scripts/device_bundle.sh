#!/usr/bin/env bash
# The offline vLLM bundle for the GPU machine, in pieces that fit one device call each.
#
# One device call carries the checkout (tracked files, and untracked ones git does not ignore)
# and the ignored paths it names, 64 MiB in all. The shared builder
# (../shared/gpu/build_vllm_bundle.sh) writes three parts of 40.5 MiB, so once the checkout
# passes about 23.5 MiB (the raw outputs under docs/ grow with every recorded run) a part no
# longer fits beside it. The pieces are the same bytes cut smaller, as few as fit: `split`
# measures what travels and cuts the fewest pieces whose largest, beside the checkout, the last
# call's small paths (.gpu/tools, .gpu/extra, .whl) and a margin for the records a session
# commits after it, stays within one call. The builder's checksum is checked after the pieces
# are joined, before anything unpacks.
#
# Here, in the checkout, after the shared builder:
#   bash scripts/device_bundle.sh prepare       # the rowcache wheel of HEAD, FP8 extras, pieces
#   bash scripts/device_bundle.sh split         # the pieces alone (no network, no wheel)
# There, one call per piece (.gpu/tools/PIECES lists them), each
# `mkdir -p /tmp/vp && cp .gpu/pieces/PIECE /tmp/vp/`, the last one carrying .gpu/tools and
# .gpu/extra too, then:
#   bash scripts/device_bundle.sh setup LOGDIR  # join, check, unpack to /tmp/site, install
#   bash scripts/device_bundle.sh join          # join, check, unpack only
#
# Settings (for tests, or to choose): BUNDLE_GPU (.gpu), BUNDLE_VP (/tmp/vp), BUNDLE_SITE
# (/tmp/site), BUNDLE_PIECES (how many pieces `split` cuts, 2 to 9: unset, the fewest that
# fit), BUNDLE_CALL_LIMIT (one call's bytes: 64 MiB), BUNDLE_MARGIN (bytes kept free: 1 MiB).
set -euo pipefail

GPU=${BUNDLE_GPU:-.gpu}
VP=${BUNDLE_VP:-/tmp/vp}
SITE=${BUNDLE_SITE:-/tmp/site}
COUNT=${BUNDLE_PIECES:-}
CALL_LIMIT=${BUNDLE_CALL_LIMIT:-67108864}
MARGIN=${BUNDLE_MARGIN:-1048576}
PARTS="core.tar.xz.partaa core.tar.xz.partab core.tar.xz.partac"
EXTRAS="compressed-tensors==0.17.0 loguru==0.7.3"

die() { echo "device_bundle: $*" >&2; exit 2; }

# Bytes of the regular files under the paths given that exist (none: 0).
bytes_under() {
  local path total=0 size
  for path in "$@"; do
    [ -e "$path" ] || continue
    while read -r size; do total=$((total + size)); done < <(find "$path" -type f -printf '%s\n')
  done
  echo "$total"
}

# What every call sends: the files git tracks and those it does not ignore, as they are now.
checkout_bytes() {
  git rev-parse --is-inside-work-tree > /dev/null 2>&1 \
    || die "not in a git checkout, so what a call carries cannot be measured: run split in the checkout, or set BUNDLE_PIECES"
  local total=0 size
  # From the top: `git ls-files` lists only the folder it runs in.
  while read -r size; do total=$((total + size)); done < <(
    cd "$(git rev-parse --show-toplevel)" \
      && { git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s -- 2> /dev/null || true; })
  echo "$total"
}

# The fewest pieces (2 to 9) of a bundle of $1 bytes whose largest fits the last call beside
# the checkout, its small paths and the margin; said on stderr, the count on stdout.
fewest_pieces() {
  local whole=$1 checkout small n largest
  # Checked by hand: a command substitution does not inherit `set -e`.
  checkout=$(checkout_bytes) || exit 2
  small=$(bytes_under "$GPU/tools" "$GPU/extra" .whl) || exit 2
  for n in 2 3 4 5 6 7 8 9; do
    largest=$((whole / n + whole % n))  # split -n gives the remainder to the last piece
    if [ $((checkout + largest + small + MARGIN)) -le "$CALL_LIMIT" ]; then
      echo "$n pieces: the checkout $checkout B + the largest piece $largest B + the last call's small paths $small B + margin $MARGIN B <= $CALL_LIMIT B" >&2
      echo "$n"
      return
    fi
  done
  die "even 9 pieces do not fit one call: the checkout $checkout B + the largest piece $largest B + small paths $small B + margin $MARGIN B > $CALL_LIMIT B (pack the raw outputs under docs/, or carry less)"
}

split_pieces() {
  local part
  for part in $PARTS; do
    [ -f "$GPU/parts/$part" ] || die "no $GPU/parts/$part: run bash ../shared/gpu/build_vllm_bundle.sh first"
  done
  [ -f "$GPU/tools/SHA256" ] || die "no $GPU/tools/SHA256 (the builder writes it beside the parts)"
  if [ -n "$COUNT" ]; then
    case "$COUNT" in *[!0-9]*) die "BUNDLE_PIECES must be a number from 2 to 9, not '$COUNT'" ;; esac
    [ "$COUNT" -ge 2 ] && [ "$COUNT" -le 9 ] || die "BUNDLE_PIECES must be from 2 to 9, not $COUNT"
  fi
  rm -rf "$GPU/pieces.new" && mkdir -p "$GPU/pieces.new"
  (cd "$GPU/parts" && cat $PARTS) > "$GPU/pieces.new/whole"
  if ! echo "$(cat "$GPU/tools/SHA256")  $GPU/pieces.new/whole" | sha256sum -c --quiet -; then
    rm -rf "$GPU/pieces.new"
    die "the parts in $GPU/parts do not match $GPU/tools/SHA256: build the bundle again"
  fi
  if [ -z "$COUNT" ]; then
    # In a subshell: its `die` leaves only the subshell, so the folder is removed here.
    COUNT=$(fewest_pieces "$(stat -c %s "$GPU/pieces.new/whole")") || { rm -rf "$GPU/pieces.new"; exit 2; }
  fi
  split -n "$COUNT" -d -a 1 "$GPU/pieces.new/whole" "$GPU/pieces.new/core.tar.xz.piece"
  rm "$GPU/pieces.new/whole"
  # The manifest travels in .gpu/tools with the last piece: names and sizes, so that `join`
  # names a piece that did not arrive.
  (cd "$GPU/pieces.new" && for p in core.tar.xz.piece*; do echo "$p $(stat -c %s "$p")"; done) \
    > "$GPU/tools/PIECES"
  rm -rf "$GPU/pieces" && mv "$GPU/pieces.new" "$GPU/pieces"
  echo "pieces in $GPU/pieces (manifest $GPU/tools/PIECES):"
  cat "$GPU/tools/PIECES"
}

join_pieces() {
  local manifest="$GPU/tools/PIECES" name size have missing="" names=() unpacked=yes
  [ -f "$manifest" ] || die "no $manifest: carry $GPU/tools (it holds the manifest) with the last piece"
  [ -f "$GPU/tools/SHA256" ] || die "no $GPU/tools/SHA256: carry $GPU/tools with the last piece"
  while read -r name size; do
    names+=("$VP/$name")
    if [ ! -f "$VP/$name" ]; then
      missing="$missing $name"
    else
      have=$(stat -c %s "$VP/$name")
      [ "$have" = "$size" ] || die "$VP/$name has $have bytes, the manifest says $size: copy it again"
    fi
  done < "$manifest"
  [ ${#names[@]} -gt 0 ] || die "$manifest lists no pieces: run split (or prepare) again"
  [ -z "$missing" ] || die "pieces missing in $VP:$missing (one device call each, see the header)"
  local whole="$VP/core.tar.xz"
  cat "${names[@]}" > "$whole"
  if ! echo "$(cat "$GPU/tools/SHA256")  $whole" | sha256sum -c --quiet -; then
    rm -f "$whole"
    die "the joined pieces do not match $GPU/tools/SHA256: copy the pieces again"
  fi
  # Unpacked beside, then moved: a failed unpack leaves the earlier site folder as it was.
  rm -rf "$SITE.new" && mkdir -p "$SITE.new"
  if command -v xz > /dev/null; then
    tar -C "$SITE.new" -xJf "$whole" || unpacked=no
  else  # the shared assembler's fallback where the machine has no xz
    python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" \
      "$whole" "$SITE.new" || unpacked=no
  fi
  rm -f "$whole"
  if [ "$unpacked" = no ]; then
    rm -rf "$SITE.new"
    die "unpacking the bundle into $SITE.new failed (above); $SITE is as it was"
  fi
  rm -rf "$SITE" && mv "$SITE.new" "$SITE"
  du -sh "$SITE"
}

case "${1:-}" in
split)
  split_pieces
  ;;
prepare)
  # The wheels first: the pieces are cut to fit beside them in the last call.
  PY=${PYTHON:-.venv/bin/python}
  # The wheel of HEAD (git archive), not of the working tree: ROWCACHE_COMMIT names what ran.
  src=$(mktemp -d) && built=$(mktemp -d)
  trap 'rm -rf "$src" "$built"' EXIT
  git archive HEAD | tar -x -C "$src"
  "$PY" -m pip wheel -q --no-deps -w "$built" "$src"
  rm -f "$GPU"/tools/rowcache-*.whl  # the old wheel goes only once the new one is built
  mv "$built"/rowcache-*.whl "$GPU/tools/"
  mkdir -p "$GPU/extra"
  # shellcheck disable=SC2086
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp -d "$GPU/extra" $EXTRAS
  echo "wheel: $(ls "$GPU"/tools/rowcache-*.whl) of $(git rev-parse --short=12 HEAD)"
  echo "extras: $(ls "$GPU/extra" | tr '\n' ' ')"
  split_pieces
  ;;
join)
  join_pieces
  ;;
setup)
  log=${2:-/tmp/setup}
  mkdir -p "$log"
  # The join in a process of its own: inside `if` or `||` a function would run without
  # `set -e`, and its `die` would end this script before the log is shown.
  if ! bash "$0" join > "$log/join.log" 2>&1; then
    cat "$log/join.log" >&2
    exit 3
  fi
  pip_failed() { tail -20 "$log/pip.log" >&2; echo "device_bundle: pip failed ($log/pip.log)" >&2; exit 3; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
    "$GPU"/tools/rowcache-*.whl > "$log/pip.log" 2>&1 || pip_failed
  rm -rf "$SITE-extra"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE-extra" \
    "$GPU"/extra/*.whl >> "$log/pip.log" 2>&1 || pip_failed
  # What the bundle lacks, only: `cp -n` exits 1 on a skipped file in some coreutils.
  for extra in "$SITE-extra"/*; do
    [ -e "$SITE/${extra##*/}" ] || cp -r "$extra" "$SITE/"
  done
  # vLLM is looked up, not imported (an import takes 20 s): the bundle's unpack put it there.
  python3 -c "import sys, importlib.util; sys.path.insert(0, '$SITE'); \
import rowcache, compressed_tensors, loguru; \
assert importlib.util.find_spec('vllm'), 'no vllm in $SITE'; print('setup ok', rowcache.__file__)" \
    || { echo "device_bundle: the set-up site $SITE does not import (above)" >&2; exit 3; }
  ;;
*)
  die "usage: bash scripts/device_bundle.sh split|prepare|join|setup [LOGDIR] (see its header)"
  ;;
esac
