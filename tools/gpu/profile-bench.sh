#!/usr/bin/env bash
# Per-kernel GPU time of resident decode on the benchmark's store (the released shape at 4 layers),
# on the GPU machine: run tools/gpu/bench.sh first (it writes the store), carry the binary as for
# tools/gpu/check.sh. Nsight Compute times each kernel alone, clocks left as they are; the launches
# after the first $SKIP cover a few decode steps. Writes ncu-bench.csv, kernels-bench.txt (per
# kernel) and launches-bench.txt (every launch in order, with its grid) into
# $OUT (or ./profile-out). CACHE=none keeps the caches between kernels (ncu flushes them by default,
# which makes small kernels look slower than in a replayed step); the table then also gives each
# kernel's DRAM bytes and bandwidth.
set -euo pipefail
BIN=${BIN:-.carry/cherenkov}
OUTDIR=${OUT:-profile-out}
STORE=${STORE:-/tmp/cherenkov-bench-home/bench/flash-4L-512E-200003}
NCU=${NCU:-/usr/local/cuda/bin/ncu}
SKIP=${SKIP:-1500}
COUNT=${COUNT:-450}
mkdir -p "$OUTDIR"
for d in /usr/local/cuda/lib64 $(python3 -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13", "lib"))' 2>/dev/null || true); do
  [ -e "$d/libnvrtc.so.13" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export CHERENKOV_HOME=${CHERENKOV_HOME:-$(mktemp -d)}
RUN=("$BIN" run "$STORE" "Explain hash collisions." --backend cuda --temperature 0 --max-tokens 24)
CACHE=${CACHE:-all}
"$NCU" --clock-control none --cache-control "$CACHE" --metrics gpu__time_duration.sum,dram__bytes_read.sum \
  --csv --launch-skip "$SKIP" --launch-count "$COUNT" \
  "${RUN[@]}" >"$OUTDIR/ncu-bench.csv" 2>"$OUTDIR/ncu-bench.err"
python3 "$(dirname "$0")/kernel_times.py" "$OUTDIR/ncu-bench.csv" | tee "$OUTDIR/kernels-bench.txt"
python3 "$(dirname "$0")/kernel_times.py" "$OUTDIR/ncu-bench.csv" --launches >"$OUTDIR/launches-bench.txt"
