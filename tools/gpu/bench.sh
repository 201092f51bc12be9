#!/usr/bin/env bash
# Decode benchmark on the GPU machine (nothing is compiled there): carry the binary as for
# tools/gpu/check.sh, then run from the repository root. Writes bench-<date>.{md,json} into $OUT
# (or ./bench-out). Arguments go to `cherenkov bench` (default: 4 layers of the released shape),
# after `--make-room`: the GPU machine's disk (64 GB) holds one 32-layer store, so the stores of
# other depths that ab.sh and timeline.sh left there are deleted, the oldest first, where a new
# one would not fit (each deletion is printed; a store is rewritten when asked for again).
set -euo pipefail
BIN=${BIN:-.carry/cherenkov}
OUTDIR=${OUT:-bench-out}
mkdir -p "$OUTDIR"
for d in /usr/local/cuda/lib64 $(python3 -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13", "lib"))' 2>/dev/null || true); do
  [ -e "$d/libnvrtc.so.13" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export CHERENKOV_HOME=${CHERENKOV_HOME:-/tmp/cherenkov-bench-home}
"$BIN" bench --make-room --out "$OUTDIR" "$@" 2>&1 | tee "$OUTDIR/bench-log.txt"
