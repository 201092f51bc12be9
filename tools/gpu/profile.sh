#!/usr/bin/env bash
# Per-kernel GPU time of CUDA decode, on the GPU machine (carry the binary as for tools/gpu/check.sh;
# run check.sh first: it makes the synthetic model at $SYN). Nsight Compute times each kernel alone
# (caches flushed, clocks locked to base), so the figures are pessimistic for small kernels but rank
# them; 1500 launches after the first 3000 cover about ten decode steps of the 4-layer model.
# Writes ncu.csv and kernels.txt into $OUT (or ./profile-out).
set -euo pipefail
BIN=${BIN:-.carry/cherenkov}
OUTDIR=${OUT:-profile-out}
SYN=${SYN:-/tmp/cherenkov-flash4}
NCU=${NCU:-/usr/local/cuda/bin/ncu}
mkdir -p "$OUTDIR"
for d in /usr/local/cuda/lib64 $(python3 -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13", "lib"))' 2>/dev/null || true); do
  [ -e "$d/libnvrtc.so.13" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export CHERENKOV_HOME=${CHERENKOV_HOME:-$(mktemp -d)}
RUN=("$BIN" run "$SYN" "Explain hash collisions." --backend cuda --temperature 0 --max-tokens 64)
"${RUN[@]}" 2>&1 >/dev/null | tail -3 | tee "$OUTDIR/run.txt"
"$NCU" --metrics gpu__time_duration.sum --csv --launch-skip 3000 --launch-count 1500 "${RUN[@]}" \
  >"$OUTDIR/ncu.csv" 2>"$OUTDIR/ncu.err"
python3 "$(dirname "$0")/kernel_times.py" "$OUTDIR/ncu.csv" | tee "$OUTDIR/kernels.txt"
