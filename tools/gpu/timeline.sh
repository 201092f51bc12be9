#!/usr/bin/env bash
# Kernel timelines (`CHERENKOV_TIMELINE`, docs/engine.md) of chosen steps on the GPU machine, one
# run a variant, each variant's launch tables summarised (carry the binaries as for
# tools/gpu/bench.sh):
#
#   tools/gpu/timeline.sh [-l LAYERS] [-s STEPS] [-d P] [-g REGEX] NAME[:SETTINGS] ...
#
# Variants are written as for tools/gpu/ab.sh (`new`, `old:BIN=.carry/cherenkov-base`,
# `late:CHERENKOV_KERNEL_DEFINES=GDN_ROWS_LATE`). Each runs `cherenkov bench --quick` resident at
# LAYERS (default 8) with the timeline on for STEPS (default 60,360, comma-separated); with -d P it
# drafts at the declared acceptance P (`bench --draft-accept`), and at 8 layers and P = 0.8 step 60
# is a plain step and step 360 a verifying pass. A first run of the first variant, not kept, comes
# before them: on a fresh machine it synthesises the bench's store and compiles the kernels with
# the timeline's marks, well over a minute (session 54's timeline ran past a 110 s limit for
# that). Writes $OUT/NAME-stepN.tsv (default OUT: timeline-out) and prints, per variant and step,
# `tools/gpu/timeline_kernels.py --split`'s table, or with -g only its lines matching REGEX (an
# extended regular expression) and the step's length.
set -euo pipefail
LAYERS=8
STEPS=60,360
DRAFT=""
GREP=""
while getopts l:s:d:g: o; do
  case $o in
    l) LAYERS=$OPTARG ;;
    s) STEPS=$OPTARG ;;
    d) DRAFT=$OPTARG ;;
    g) GREP=$OPTARG ;;
    *) sed -n '2,18p' "$0"; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ $# -ge 1 ] || { sed -n '2,18p' "$0"; exit 2; }
OUTDIR=${OUT:-timeline-out}
mkdir -p "$OUTDIR"
here=$(cd "$(dirname "$0")" && pwd)
run() { # settings dir: one bench with the timeline on, its tables under dir/tl-stepN.tsv
  local dir=$2
  rm -rf "$dir"
  mkdir -p "$dir"
  # shellcheck disable=SC2086 # the settings are words on purpose
  if ! env CHERENKOV_BENCH_RESIDENT_ONLY=1 CHERENKOV_TIMELINE="$dir/tl" CHERENKOV_TIMELINE_STEP="$STEPS" $1 \
    OUT="$dir" "$here/bench.sh" --quick --layers "$LAYERS" --tokens 128 --no-peer ${DRAFT:+--draft-accept "$DRAFT"} \
    > "$dir/log.txt" 2>&1; then
    echo "timeline.sh: the run with settings '$1' failed; its log: $dir/log.txt" >&2
    tail -5 "$dir/log.txt" >&2
    return 1
  fi
}
settings_of() { [ "${1%%:*}" != "$1" ] && echo "${1#*:}" || true; }
echo "warm-up: ${1%%:*} (the store and the kernels' compile)"
run "$(settings_of "$1")" "$OUTDIR/warm-up"
for v in "$@"; do
  name=${v%%:*}
  run "$(settings_of "$v")" "$OUTDIR/run-$name"
  for s in ${STEPS//,/ }; do
    table="$OUTDIR/run-$name/tl-step$s.tsv"
    if [ ! -e "$table" ]; then
      echo "timeline.sh: $name wrote no table for step $s (the run has fewer steps?): $OUTDIR/run-$name/log.txt" >&2
      exit 1
    fi
    cp "$table" "$OUTDIR/$name-step$s.tsv"
    echo "== $name, step $s ($OUTDIR/$name-step$s.tsv)"
    if [ -z "$GREP" ]; then
      python3 "$here/timeline_kernels.py" --split "$table"
    else
      python3 "$here/timeline_kernels.py" --split "$table" | grep -E "$GREP|^step" || true
    fi
  done
done
