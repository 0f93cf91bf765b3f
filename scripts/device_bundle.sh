#!/usr/bin/env bash
# The offline vLLM bundle for the GPU machine, in pieces that fit one device call each.
#
# One device call carries the tracked checkout and the ignored paths it names, 64 MiB in all.
# The shared builder (../shared/gpu/build_vllm_bundle.sh) writes three parts of 40.5 MiB, so
# once the checkout's tracked files pass about 23.5 MiB (the raw outputs under docs/ grow with
# every recorded run) a part no longer fits beside it. The pieces are the same bytes cut
# smaller; the builder's checksum is checked after they are joined, before anything unpacks.
#
# Here, in the checkout, after the shared builder:
#   bash scripts/device_bundle.sh prepare       # pieces, the rowcache wheel of HEAD, FP8 extras
#   bash scripts/device_bundle.sh split         # the pieces alone (no network, no wheel)
# There, one call per piece, each `mkdir -p /tmp/vp && cp .gpu/pieces/PIECE /tmp/vp/`, the last
# one carrying .gpu/tools and .gpu/extra too, then:
#   bash scripts/device_bundle.sh setup LOGDIR  # join, check, unpack to /tmp/site, install
#   bash scripts/device_bundle.sh join          # join, check, unpack only
#
# Paths (for tests): BUNDLE_GPU (.gpu), BUNDLE_VP (/tmp/vp), BUNDLE_SITE (/tmp/site),
# BUNDLE_PIECES (how many pieces `split` cuts: 5).
set -euo pipefail

GPU=${BUNDLE_GPU:-.gpu}
VP=${BUNDLE_VP:-/tmp/vp}
SITE=${BUNDLE_SITE:-/tmp/site}
COUNT=${BUNDLE_PIECES:-5}
PARTS="core.tar.xz.partaa core.tar.xz.partab core.tar.xz.partac"
EXTRAS="compressed-tensors==0.17.0 loguru==0.7.3"

die() { echo "device_bundle: $*" >&2; exit 2; }

split_pieces() {
  local part
  for part in $PARTS; do
    [ -f "$GPU/parts/$part" ] || die "no $GPU/parts/$part: run bash ../shared/gpu/build_vllm_bundle.sh first"
  done
  [ -f "$GPU/tools/SHA256" ] || die "no $GPU/tools/SHA256 (the builder writes it beside the parts)"
  case "$COUNT" in '' | *[!0-9]*) die "BUNDLE_PIECES must be a number from 2 to 9, not '$COUNT'" ;; esac
  [ "$COUNT" -ge 2 ] && [ "$COUNT" -le 9 ] || die "BUNDLE_PIECES must be from 2 to 9, not $COUNT"
  rm -rf "$GPU/pieces.new" && mkdir -p "$GPU/pieces.new"
  (cd "$GPU/parts" && cat $PARTS) > "$GPU/pieces.new/whole"
  if ! echo "$(cat "$GPU/tools/SHA256")  $GPU/pieces.new/whole" | sha256sum -c --quiet -; then
    rm -rf "$GPU/pieces.new"
    die "the parts in $GPU/parts do not match $GPU/tools/SHA256: build the bundle again"
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
  split_pieces
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
