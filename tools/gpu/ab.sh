#!/usr/bin/env bash
# Alternating A/B rounds of `cherenkov bench --quick` on the GPU machine (carry the binaries as for
# tools/gpu/bench.sh), one case at a time, so that builds or settings are compared on one host:
#
#   tools/gpu/ab.sh [-r ROUNDS] [-c resident|pinned] [-l LAYERS] [-d P] NAME[:SETTINGS] ...
#
# Each variant is a name and, after a colon, space-separated VAR=value settings for its runs, for
# example `new` `old:BIN=.carry/cherenkov-base` `late:CHERENKOV_KERNEL_DEFINES=HC_NO_PRELOAD,EXPERT_DOWN_LATE`
# (kernel defines are separated by commas there). A first run of the first variant warms the store
# and is not counted; then ROUNDS (default 4) rounds of every variant in turn, the order reversed
# every second round (in session 25's pinned A/Bs the arm that ran first in a round won most of
# its rounds, so both arms should go first equally often: use an even ROUNDS). Prints each run's
# tok/s at LAYERS (default 16) and each variant's mean, and writes the runs under $OUT (default
# ab-out). Single runs spread by about 5% (benchmark/notes-cuda.md): read means over rounds, and a
# kernel timeline (tools/gpu/timeline_kernels.py) for a kernel's own change. With -d P (resident
# only) the runs also draft with the MTP head at the declared acceptance P (`bench --draft-accept`):
# each run then prints drafting's tok/s, plain decoding's and the verifying pass's host ms, and
# the means are drafting's, then plain decoding's.
set -euo pipefail
ROUNDS=4
CASE=resident
LAYERS=16
DRAFT=""
while getopts r:c:l:d: o; do
  case $o in
    r) ROUNDS=$OPTARG ;;
    c) CASE=$OPTARG ;;
    l) LAYERS=$OPTARG ;;
    d) DRAFT=$OPTARG ;;
    *) sed -n '2,18p' "$0"; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ $# -ge 1 ] || { sed -n '2,18p' "$0"; exit 2; }
case $CASE in
  resident) knobs="CHERENKOV_BENCH_RESIDENT_ONLY=1"; row="all experts resident" ;;
  pinned) knobs="CHERENKOV_BENCH_PINNED_ONLY=1 CHERENKOV_BENCH_NO_ANATOMY=1"; row="21G budget, page cache warm, expert file pinned" ;;
  *) echo "ab.sh: -c takes resident or pinned, not $CASE" >&2; exit 2 ;;
esac
[ -z "$DRAFT" ] || [ "$CASE" = resident ] || { echo "ab.sh: -d drafts with every expert resident: use -c resident" >&2; exit 2; }
OUTDIR=${OUT:-ab-out}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUTDIR"
: > "$OUTDIR/rates.txt"
: > "$OUTDIR/plain.txt"
run() { # name settings dir
  local dir=$3
  mkdir -p "$dir"
  # shellcheck disable=SC2086 # the settings are words on purpose
  if ! env $knobs $2 OUT="$dir" "$here/bench.sh" --quick --layers "$LAYERS" --tokens 128 --no-peer \
    ${DRAFT:+--draft-accept "$DRAFT"} > "$dir/log.txt" 2>&1; then
    echo "ab.sh: variant $1 failed; its log: $dir/log.txt" >&2
    tail -5 "$dir/log.txt" >&2
    return 1
  fi
  # The first row of the case: the rates' table (later tables have rows of the same name).
  local plain
  plain=$(grep -m1 "^| $row |" "$dir"/bench-*-quick.md | cut -d'|' -f3 | tr -d ' ' || true)
  if [ -z "$plain" ]; then
    echo "ab.sh: variant $1 wrote no row \"$row\"; its log: $dir/log.txt" >&2
    return 1
  fi
  if [ -z "$DRAFT" ]; then
    echo "$plain"
    return
  fi
  # Drafting: its row of the rates' table, and the pass's host ms from the log's per-pass line.
  local drafted pass
  # The report's sentence, not a table row: "<row>, drafting with the MTP head (acceptance P
  # declared): R tok/s at ...".
  drafted=$(grep -m1 -oE "^$row, drafting with the MTP head \(acceptance [0-9.]+ declared\): [0-9.]+ tok/s" \
    "$dir"/bench-*-quick.md | grep -oE '[0-9.]+ tok/s$' | cut -d' ' -f1 || true)
  if [ -z "$drafted" ]; then
    echo "ab.sh: variant $1 wrote no drafting rate; its report: $(ls "$dir"/bench-*-quick.md)" >&2
    return 1
  fi
  pass=$(grep -m1 -oE 'the verifying forward of two rows [0-9.]+' "$dir/log.txt" | grep -oE '[0-9.]+$' || true)
  echo "$drafted $plain ${pass:-?}"
}
first=$1
run "${first%%:*}" "$([ "${first#*:}" != "$first" ] && echo "${first#*:}")" "$OUTDIR/warm-up" > /dev/null
variants=("$@")
reversed=()
for ((i = ${#variants[@]} - 1; i >= 0; i--)); do reversed+=("${variants[$i]}"); done
for r in $(seq "$ROUNDS"); do
  order=("${variants[@]}")
  [ $((r % 2)) -eq 0 ] && order=("${reversed[@]}")
  for v in "${order[@]}"; do
    name=${v%%:*}
    settings=""
    [ "$name" != "$v" ] && settings=${v#*:}
    got=$(run "$name" "$settings" "$OUTDIR/$name-$r") || exit 1
    read -r tok plain pass <<< "$got"
    if [ -z "$DRAFT" ]; then
      echo "round $r  $name  $tok tok/s ($CASE, $LAYERS layers)"
    else
      echo "round $r  $name  drafting $tok tok/s, plain $plain, the pass $pass ms (P = $DRAFT, $LAYERS layers)"
      echo "$name $plain" >> "$OUTDIR/plain.txt"
    fi
    echo "$name $tok" >> "$OUTDIR/rates.txt"
  done
done
means() { # file label
  awk '{s[$1] += $2; n[$1]++; if (!($1 in o)) o[$1] = NR} END {for (k in s) printf "%d %s\n", o[k], k}' "$1" \
    | sort -n | while read -r _ name; do
      awk -v k="$name" -v l="$2" '$1 == k {s += $2; n++; v = v " " $2} END {printf "%-12s %smean %.1f over %d:%s\n", k, l, s / n, n, v}' "$1"
    done
}
if [ -z "$DRAFT" ]; then
  means "$OUTDIR/rates.txt" ""
else
  means "$OUTDIR/rates.txt" "drafting "
  means "$OUTDIR/plain.txt" "plain "
fi
