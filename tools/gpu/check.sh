#!/usr/bin/env bash
# The CUDA backend's whole check, in one go on the GPU machine (nothing is compiled there).
#
# Build on the CPU machine and carry the binary:
#   cargo build --release && mkdir -p .carry && cp target/release/cherenkov .carry/
# then, on the GPU machine, from the repository root (the device tool: carry [".carry"]):
#   tools/gpu/check.sh
# It writes gpu-check.txt into $OUT (or ./gpu-check-out): every kernel against the CPU reference
# on fresh random inputs, the golden fixtures on CUDA, and `run --check` (CPU and CUDA side by side)
# on a synthetic model of the released shape whose experts do not all fit the expert cache.
set -euo pipefail
BIN=${BIN:-.carry/cherenkov}
OUTDIR=${OUT:-gpu-check-out}
mkdir -p "$OUTDIR"
# NVRTC: the CUDA toolkit's, or the one PyTorch's wheels bring.
for d in /usr/local/cuda/lib64 $(python3 -c 'import nvidia, os; print(os.path.join(nvidia.__path__[0], "cu13", "lib"))' 2>/dev/null || true); do
  [ -e "$d/libnvrtc.so.13" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export CHERENKOV_HOME=${CHERENKOV_HOME:-$(mktemp -d)}
SYN=${SYN:-/tmp/cherenkov-flash4}
{
  echo "# Cherenkov GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  echo "binary: $($BIN --version)"
  echo
  echo "## synthetic model of the released shape (4 layers, 32 experts top-10; random weights)"
  [ -e "$SYN/config.json" ] || $BIN synth "$SYN" --preset flash --layers 4 --experts 32 --vocab 32768 --ngram-base 100003
  $BIN prepare "$SYN" --name flash4
  STORE="$CHERENKOV_HOME/stores/flash4"
  echo
  echo "## kernels and golden fixtures"
  $BIN gpu-check --fixtures fixtures/golden --store "$STORE"
  echo
  echo "## run --check on the synthetic model, expert cache of 40 records (a quarter of its 160), expert file pinned"
  REC=$(python3 -c "import json; print(json.load(open('$STORE/manifest.json'))['experts']['record_bytes'])")
  $BIN run flash4 "Explain hash collisions." --backend cuda --check --expert-cache $((40 * REC)) --max-tokens 16 --temperature 0 --pin-experts on
  echo
  echo "## the same with the expert file not pinned (the CPU reads each missing record)"
  $BIN run flash4 "Explain hash collisions." --backend cuda --check --expert-cache $((40 * REC)) --max-tokens 16 --temperature 0 --pin-experts off
  echo
  echo "## misses computed on the CPU (--cpu-experts): every one (CHERENKOV_CPU_EXPERTS_ALL=1), as the rates choose, every one with the file not pinned"
  CHERENKOV_CPU_EXPERTS_ALL=1 $BIN run flash4 "Explain hash collisions." --backend cuda --check --expert-cache $((40 * REC)) --max-tokens 16 --temperature 0 --pin-experts on --cpu-experts 4
  $BIN run flash4 "Explain hash collisions." --backend cuda --check --expert-cache $((40 * REC)) --max-tokens 16 --temperature 0 --pin-experts on --cpu-experts auto
  CHERENKOV_CPU_EXPERTS_ALL=1 $BIN run flash4 "Explain hash collisions." --backend cuda --check --expert-cache $((40 * REC)) --max-tokens 16 --temperature 0 --pin-experts off --cpu-experts 4
  echo
  echo "## the deadline cut runs (--cut-weak: not reproducible, so only that it completes)"
  OUTTXT=$($BIN run flash4 "Explain hash collisions." --backend cuda --cut-weak 0.05 --expert-cache $((40 * REC)) --max-tokens 16 --temperature 0 2>/dev/null)
  echo "--cut-weak 0.05: ${#OUTTXT} characters generated"
  echo
  echo "## generated text, CPU vs CUDA (CUDA picks greedy and top-k candidates on the device)"
  for mode in "--temperature 0" "--temperature 0.8 --top-k 20 --seed 3"; do
    A=$($BIN run flash4 "Explain hash collisions." --backend cpu $mode --max-tokens 16 2>/dev/null)
    B=$($BIN run flash4 "Explain hash collisions." --backend cuda $mode --max-tokens 16 2>/dev/null)
    if [ "$A" = "$B" ]; then echo "$mode: identical"; else printf '%s: DIFFERENT\ncpu:  %q\ncuda: %q\n' "$mode" "$A" "$B"; fi
  done
  echo
  echo "## drafting with the MTP head (--draft 1): CUDA against the CPU's drafting and against plain decoding"
  for mode in "--temperature 0" "--temperature 0.8 --top-k 20 --seed 3"; do
    A=$($BIN run flash4 "Explain hash collisions." --backend cpu $mode --max-tokens 16 --draft 1 2>/dev/null)
    P=$($BIN run flash4 "Explain hash collisions." --backend cuda $mode --max-tokens 16 2>/dev/null)
    for cache in "" "--expert-cache $((40 * REC))"; do
      B=$($BIN run flash4 "Explain hash collisions." --backend cuda $mode --max-tokens 16 --draft 1 $cache 2>"$OUTDIR/draft.err")
      grep -h "MTP drafts" "$OUTDIR/draft.err" || true
      if [ "$A" = "$B" ] && [ "$B" = "$P" ]; then echo "$mode ${cache:-(every expert cached)}: identical"; else printf '%s %s: DIFFERENT\ncpu drafting:  %q\ncuda drafting: %q\ncuda plain:    %q\n' "$mode" "$cache" "$A" "$B" "$P"; fi
    done
  done
  echo
  echo "## the server, CPU vs CUDA (greedy and top-k from device candidates, logprobs, a prefix-cache restore)"
  for backend in cpu cuda; do
    PORT=$((18400 + RANDOM % 1000))
    $BIN serve --model flash4 --backend $backend --port $PORT --expert-cache $((40 * REC)) >"$OUTDIR/serve-$backend.log" 2>&1 &
    PID=$!
    python3 tools/gpu/server_check.py "http://127.0.0.1:$PORT/v1" >"$OUTDIR/server-$backend.txt" || echo "server check on $backend FAILED (see serve-$backend.log)"
    kill $PID; wait $PID 2>/dev/null || true
  done
  PORT=$((18400 + RANDOM % 1000))
  $BIN serve --model flash4 --backend cuda --draft 1 --port $PORT --expert-cache $((40 * REC)) >"$OUTDIR/serve-cuda-draft.log" 2>&1 &
  PID=$!
  python3 tools/gpu/server_check.py "http://127.0.0.1:$PORT/v1" >"$OUTDIR/server-cuda-draft.txt" || echo "server check on cuda --draft 1 FAILED (see serve-cuda-draft.log)"
  kill $PID; wait $PID 2>/dev/null || true
  cat "$OUTDIR/server-cuda.txt"
  if cmp -s "$OUTDIR/server-cpu.txt" "$OUTDIR/server-cuda.txt"; then echo "server: CPU and CUDA identical"; else echo "server: DIFFERENT"; diff "$OUTDIR/server-cpu.txt" "$OUTDIR/server-cuda.txt" || true; fi
  if cmp -s "$OUTDIR/server-cuda.txt" "$OUTDIR/server-cuda-draft.txt"; then echo "server: CUDA drafting identical to plain"; else echo "server: CUDA drafting DIFFERENT"; diff "$OUTDIR/server-cuda.txt" "$OUTDIR/server-cuda-draft.txt" || true; fi
} 2>&1 | tee "$OUTDIR/gpu-check.txt"
