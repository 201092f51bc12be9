//! What could one persistent kernel per step reach? A measurement for the design of the next
//! decode kernels (ignored by default; needs a GPU):
//!
//!     cargo test --release -p cherenkov-cuda --test persistent_probe --no-run   # prints the binary
//!     <binary> --ignored --nocapture        (on the GPU machine, with NVRTC on LD_LIBRARY_PATH)
//!
//! A decoder layer is a chain of dependent matrix-vector products, each too small to reach the
//! device bandwidth on its own (launch, staging the input, the ramp and the tail cost more than
//! the bytes). The probe runs one layer-like chain (the byte sizes of the released shape's stages,
//! 8-bit weights of 2560 columns, so bytes = rows x 2560) four times with distinct weights (no L2
//! reuse), several ways:
//!
//! - one launch per stage (today's structure), with and without PDL, and with PDL replayed from a
//!   CUDA graph (as resident decode steps run);
//! - one persistent kernel: every block resident, a software grid barrier between stages;
//! - the same, each warp prefetching its rows of the next stage into L2 before the barrier;
//! - `chain_pipe`: each warp streams its rows through a ring of `CHERENKOV_PROBE_NBUF` (default 4)
//!   row buffers in shared memory with `cp.async`, requesting a stage's first rows before its
//!   input is ready, per stage and persistent;
//! - `chain_tma`: one thread a block streams the block's rows of every stage with bulk copies (the
//!   tensor memory accelerator, `cp.async.bulk`) into a ring of `CHERENKOV_PROBE_TMA_SLOTS`
//!   (default 4) slots of 16 rows, ahead of the 16 consumer warps and across their grid
//!   barriers; per stage with PDL (the producer starts before the wait), persistent, and two
//!   ceilings: without the grid barriers, and without the arithmetic;
//! - `chain_tma` persistent with flag barriers instead of grid barriers (a counter that only grows,
//!   a release add and acquire polls from one thread a block): the cheapest wait a dataflow
//!   kernel's all-to-all stages could use.
//!
//! It prints microseconds per layer and the bytes' effective bandwidth for each, and marks a
//! variant whose outputs differ from the per-stage launches'. Then the floor every variant
//! stands on, with no bytes at all: what one software grid barrier costs, and one dependent launch
//! of an empty kernel (with and without PDL, from the host and replayed from a CUDA graph), and
//! one flag barrier. A layer has about 13 dependent stages, so 13 times
//! that floor is time no weight streaming can hide unless the next stage's weights move during it. Results:
//! `benchmark/results/persistent-probe-2026-11-30.txt`, `persistent-probe-ring-2026-11-30.txt`,
//! `persistent-probe-tma-2026-12-02-s34.txt` and `persistent-probe-flags-2026-12-03-s45.txt` (a flag
//! barrier costs 0.95 us idle and about 2.1 us a stage under the ring's streaming, against about
//! 1.0 us for a launch boundary in a graph: persistent loses by 7 us a layer).

use std::ffi::{CString, c_void};

use cherenkov_cuda::gpu::{Arg, Gpu};
use cudarc::driver::result as cu;
use cudarc::driver::sys;

const SOURCE: &str = r#"
// The sync floor: n grid barriers in a row, nothing else (one block per SM or two).
extern "C" __global__ void __launch_bounds__(512) barriers(unsigned* bar, int n);

// A dependent launch with no work: waits for its predecessor, lets its successor be scheduled.
extern "C" __global__ void empty_stage() {
    asm volatile("griddepcontrol.launch_dependents;");
    asm volatile("griddepcontrol.wait;" ::: "memory");
}

// One block's arrival at a software grid barrier (one thread of the block calls it): the last
// block to arrive resets the count and opens the next generation; the others wait for it.
__device__ void grid_arrive(unsigned* count, volatile unsigned* gen, unsigned nblocks) {
    unsigned g = *gen;
    __threadfence();
    if (atomicAdd(count, 1u) == nblocks - 1) {
        *count = 0;
        __threadfence();
        atomicAdd((unsigned*)gen, 1u);
    } else {
        while (*gen == g) { }
    }
    __threadfence();
}

extern "C" __device__ void grid_barrier(unsigned* count, volatile unsigned* gen, unsigned nblocks) {
    __syncthreads();
    if (threadIdx.x == 0) grid_arrive(count, gen, nblocks);
    __syncthreads();
}

// A lane's 16 codes of a row times their 16 inputs of x staged transposed (xv[t * 160]), added to
// acc in order.
__device__ __forceinline__ float dot16(uint4 q, const float* xv, float acc) {
    const signed char* b = (const signed char*)&q;
#pragma unroll
    for (int t = 0; t < 16; t++) acc += (float)b[t] * xv[t * 160];
    return acc;
}

// The same with x's 8-bit codes in the weights' byte order: four dp4a.
__device__ __forceinline__ int dot16_codes(uint4 q, uint4 v, int acc) {
    acc = __dp4a((int)q.x, (int)v.x, acc);
    acc = __dp4a((int)q.y, (int)v.y, acc);
    acc = __dp4a((int)q.z, (int)v.z, acc);
    return __dp4a((int)q.w, (int)v.w, acc);
}

// The sum over a warp's lanes (every lane gets it).
template <class T> __device__ __forceinline__ T warp_total(T v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

extern "C" __global__ void __launch_bounds__(512) barriers(unsigned* bar, int n) {
    for (int i = 0; i < n; i++) grid_barrier(bar, bar + 1, gridDim.x);
}

// A flag barrier, the cheapest all-to-all wait a dataflow kernel could use between two stages
// whose every consumer needs every producer: one thread a block adds 1 to a counter that only
// grows (a release add that returns nothing) and polls it (acquire loads) until it reaches
// `target`, the arrivals of every block so far. No reset and no second word, so one round trip
// to L2 fewer than `grid_arrive`; the counter's base comes from the host (the arrivals of
// earlier launches).
__device__ __forceinline__ void flag_arrive_wait(unsigned* cnt, unsigned target) {
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(cnt) : "memory");
    unsigned v;
    do {
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(cnt) : "memory");
    } while ((int)(v - target) < 0);
}

// The flag barrier's floor: n of them in a row, nothing else.
extern "C" __global__ void __launch_bounds__(512) flag_barriers(unsigned* cnt, int n, unsigned base) {
    for (int i = 0; i < n; i++) {
        __syncthreads();
        if (threadIdx.x == 0) flag_arrive_wait(cnt, base + (unsigned)(i + 1) * gridDim.x);
        __syncthreads();
    }
}

// rows x 2560 int8 weights per stage, stage s at w + off[s] (bytes); x -> y alternate in xs.
// first..last: the stages this launch runs; barrier between them when persistent.
extern "C" __global__ void __launch_bounds__(512) chain(
    const signed char* __restrict__ w, const long long* __restrict__ off, const int* __restrict__ rows,
    int first, int last, float* xs, int dim, unsigned* bar, int prefetch)
{
    extern __shared__ float xsh[];
    // As every engine kernel: the next launch may be scheduled now, and waits for this one's end.
    asm volatile("griddepcontrol.launch_dependents;");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int gwarp = blockIdx.x * nwarps + warp, allwarps = gridDim.x * nwarps;
    for (int s = first; s <= last; s++) {
        const float* x = xs + (s & 1) * dim;
        float* y = xs + ((s + 1) & 1) * dim;
        // Transposed (xsh[t * 160 + c] = x[16 c + t]) so the lanes, each owning chunk c of 16
        // weights, read consecutive banks; __ldcg: not from L1, other SMs wrote x.
        for (int i = threadIdx.x; i < 2560; i += blockDim.x) xsh[(i & 15) * 160 + (i >> 4)] = __ldcg(x + i);
        __syncthreads();
        const int R = rows[s];
        const uint4* ws = (const uint4*)(w + off[s]);
        // ROWS rows per warp at a time: all their loads are issued before any arithmetic.
        for (int r0 = gwarp * ROWS; r0 < R; r0 += allwarps * ROWS) {
            uint4 q[ROWS][5];
#pragma unroll
            for (int k = 0; k < ROWS; k++) {
                const uint4* row = ws + (long long)min(r0 + k, R - 1) * 160;
#pragma unroll
                for (int j = 0; j < 5; j++) q[k][j] = __ldg(row + lane + 32 * j);
            }
#pragma unroll
            for (int k = 0; k < ROWS; k++) {
                float acc = 0.f;
#pragma unroll
                for (int j = 0; j < 5; j++) acc = dot16(q[k][j], xsh + lane + 32 * j, acc);
                acc = warp_total(acc);
                if (lane == 0 && r0 + k < R) y[r0 + k] = acc * (1.f / 4096.f);
            }
        }
        if (s < last) {
            if (prefetch) {
                const int R2 = rows[s + 1];
                const signed char* wn = w + off[s + 1];
                for (int r = gwarp; r < R2; r += allwarps) {
                    // 2560 bytes = 20 lines of 128 B.
                    if (lane < 20) asm volatile("prefetch.global.L2 [%0];" :: "l"(wn + (long long)r * 2560 + lane * 128));
                }
            }
            grid_barrier(bar, bar + 1, gridDim.x);
        }
    }
}

// The same chain, each warp streaming its rows into a ring of NBUF row buffers in shared memory
// with cp.async (16 bytes a lane, one commit group a row), so NBUF - 1 rows per warp are in flight
// without holding registers. The first rows of a stage are requested before its inputs are ready
// (weights do not depend on x): at the start before griddepcontrol.wait, and for the next stage
// before the grid barrier.
#ifndef NBUF
#define NBUF 4
#endif
__device__ __forceinline__ void cp16(void* smem, const void* gmem) {
    unsigned sa = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(sa), "l"(gmem) : "memory");
}

extern "C" __global__ void __launch_bounds__(512) chain_pipe(
    const signed char* __restrict__ w, const long long* __restrict__ off, const int* __restrict__ rows,
    int first, int last, float* xs, int dim, unsigned* bar, int prefetch)
{
    extern __shared__ float xsh[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int gwarp = blockIdx.x * nwarps + warp, allwarps = gridDim.x * nwarps;
    unsigned char* ring = (unsigned char*)(xsh + 2560) + warp * NBUF * 2560;
    // Row i of stage s for this warp into ring slot i % NBUF; one group per call, empty past the end.
    auto issue = [&](int s, int i) {
        const int r = gwarp + i * allwarps;
        if (r < rows[s]) {
            const uint4* row = (const uint4*)(w + off[s]) + (long long)r * 160;
            uint4* dst = (uint4*)(ring + (i % NBUF) * 2560);
#pragma unroll
            for (int j = 0; j < 5; j++) cp16(dst + lane + 32 * j, row + lane + 32 * j);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    for (int i = 0; i < NBUF - 1; i++) issue(first, i);
    asm volatile("griddepcontrol.launch_dependents;");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    for (int s = first; s <= last; s++) {
        const float* x = xs + (s & 1) * dim;
        float* y = xs + ((s + 1) & 1) * dim;
        for (int i = threadIdx.x; i < 2560; i += blockDim.x) xsh[(i & 15) * 160 + (i >> 4)] = __ldcg(x + i);
        __syncthreads();
        const int R = rows[s];
        const int cnt = gwarp < R ? (R - gwarp + allwarps - 1) / allwarps : 0;
        for (int i = 0; i < cnt; i++) {
            issue(s, i + NBUF - 1);
            // All but the newest NBUF - 1 groups are complete: row i is in its slot.
            asm volatile("cp.async.wait_group %0;" :: "n"(NBUF - 1) : "memory");
            __syncwarp();
            const uint4* buf = (const uint4*)(ring + (i % NBUF) * 2560);
            float acc = 0.f;
#pragma unroll
            for (int j = 0; j < 5; j++) acc = dot16(buf[lane + 32 * j], xsh + lane + 32 * j, acc);
            acc = warp_total(acc);
            if (lane == 0) y[gwarp + i * allwarps] = acc * (1.f / 4096.f);
            __syncwarp();  // the slot is reused NBUF - 1 rows later
        }
        if (s < last) {
            for (int i = 0; i < NBUF - 1; i++) issue(s + 1, i);
            grid_barrier(bar, bar + 1, gridDim.x);
        } else {
            __syncthreads();  // x staging of a following launch must not race this block's reads
        }
    }
}

// The same chain with the weights streamed by the tensor memory accelerator (`chain_tma`): one
// producer thread a block requests each chunk of up to TMA_ROWS contiguous rows with one bulk copy
// (`cp.async.bulk`) into a ring of TMA_SLOTS slots in shared memory, completing on the slot's
// mbarrier; TMA_ROWS consumer warps (one row each) wait on that barrier, compute as `chain` does,
// and release the slot. Weights do not depend on x, so the producer runs ahead across stages and
// grid barriers, bounded only by the ring: bytes keep arriving while the consumers wait for a
// stage's input. Blocks own contiguous row ranges of each stage (rows R b / G to R (b + 1) / G).
// mode bit 0: grid barriers between stages (without them, the streaming ceiling: the outputs
// then differ); bit 3: flag barriers instead (`flag_arrive_wait`, the mode's bits from 4 on
// holding the counter's base); bit 1: no arithmetic, the consumers only wait for each slot and release it (the
// bulk copies' own rate); bit 2: integer arithmetic, x staged as 8-bit codes in the weights' byte
// order and each 16 bytes of a row taken by four dp4a, so the products cost about what the
// engine's 8-bit rows do rather than a conversion a byte. The codes are x 256, rounded and clamped:
// at x 64 they all round to zero within the first layer (so every output compared equal), at 256
// nearly all stay nonzero and none saturate through the 44 stages (a numpy emulation).
// With PDL (one launch per stage) the producer starts before griddepcontrol.wait, the consumers
// after it.
#ifndef TMA_SLOTS
#define TMA_SLOTS 4
#endif
#define TMA_ROWS 16
// Two blocks a multiprocessor where two rings fit (the next launch's producer can then start while
// the current launch runs), one otherwise.
#define TMA_MIN_BLOCKS (TMA_SLOTS <= 2 ? 2 : 1)
__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(unsigned long long* b, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(smem_u32(b)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(unsigned long long* b, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_u32(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(smem_u32(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* b, unsigned parity) {
    asm volatile(
        "{\n"
        ".reg .pred P1;\n"
        "LAB_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
        "@P1 bra.uni DONE;\n"
        "bra.uni LAB_WAIT;\n"
        "DONE:\n"
        "}\n" :: "r"(smem_u32(b)), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, unsigned long long* b) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(b)) : "memory");
}
// Only the consumers' threads (named barrier 1): the producer warp never joins.
__device__ __forceinline__ void consumers_sync() {
    asm volatile("bar.sync 1, %0;" :: "n"(TMA_ROWS * 32) : "memory");
}
__device__ void consumers_grid_barrier(unsigned* count, volatile unsigned* gen, unsigned nblocks) {
    consumers_sync();
    if (threadIdx.x == 0) grid_arrive(count, gen, nblocks);
    consumers_sync();
}

extern "C" __global__ void __launch_bounds__(TMA_ROWS * 32 + 32, TMA_MIN_BLOCKS) chain_tma(
    const signed char* __restrict__ w, const long long* __restrict__ off, const int* __restrict__ rows,
    int first, int last, float* xs, int dim, unsigned* bar, int mode)
{
    extern __shared__ __align__(128) unsigned char tsm[];
    const bool barriers = mode & 1, math = !(mode & 2), ints = mode & 4, flags = mode & 8;
    // With flag barriers (bit 3) the counter's arrivals before this launch, in the upper bits.
    const unsigned base = (unsigned)mode >> 4;
    unsigned char* ring = tsm;
    float* xsh = (float*)(tsm + TMA_SLOTS * TMA_ROWS * 2560);
    unsigned long long* full = (unsigned long long*)(xsh + 2560);
    unsigned long long* empty = full + TMA_SLOTS;
    signed char* xq = (signed char*)xsh;  // the 8-bit codes of x (mode bit 2) reuse x's space
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long G = gridDim.x, b = blockIdx.x;
    if (threadIdx.x == 0) {
        for (int i = 0; i < TMA_SLOTS; i++) {
            mbar_init(full + i, 1);
            mbar_init(empty + i, TMA_ROWS);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    asm volatile("griddepcontrol.launch_dependents;");
    if (warp == TMA_ROWS) {
        if (lane == 0) {
            int k = 0;
            for (int s = first; s <= last; s++) {
                const int R = rows[s];
                const int r0 = (int)(R * b / G), r1 = (int)(R * (b + 1) / G);
                for (int r = r0; r < r1; r += TMA_ROWS, k++) {
                    const int slot = k % TMA_SLOTS;
                    const int n = min(TMA_ROWS, r1 - r);
                    if (k >= TMA_SLOTS) mbar_wait(empty + slot, ((k / TMA_SLOTS) - 1) & 1);
                    mbar_expect_tx(full + slot, n * 2560);
                    bulk_copy(ring + slot * TMA_ROWS * 2560, w + off[s] + (long long)r * 2560, n * 2560, full + slot);
                }
            }
        }
        return;
    }
    asm volatile("griddepcontrol.wait;" ::: "memory");
    int k = 0;
    for (int s = first; s <= last; s++) {
        const float* x = xs + (s & 1) * dim;
        float* y = xs + ((s + 1) & 1) * dim;
        if (ints) {
            for (int i = threadIdx.x; i < 2560; i += TMA_ROWS * 32)
                xq[i] = (signed char)max(-127, min(127, __float2int_rn(__ldcg(x + i) * 256.f)));
        } else {
            for (int i = threadIdx.x; i < 2560; i += TMA_ROWS * 32) xsh[(i & 15) * 160 + (i >> 4)] = __ldcg(x + i);
        }
        consumers_sync();
        const int R = rows[s];
        const int r0 = (int)(R * b / G), r1 = (int)(R * (b + 1) / G);
        for (int r = r0; r < r1; r += TMA_ROWS, k++) {
            const int slot = k % TMA_SLOTS;
            mbar_wait(full + slot, (k / TMA_SLOTS) & 1);
            if (math && ints && warp < r1 - r) {
                const uint4* buf = (const uint4*)(ring + (slot * TMA_ROWS + warp) * 2560);
                const uint4* xv = (const uint4*)xq;
                int acc = 0;
#pragma unroll
                for (int j = 0; j < 5; j++) acc = dot16_codes(buf[lane + 32 * j], xv[lane + 32 * j], acc);
                acc = warp_total(acc);
                if (lane == 0) y[r + warp] = (float)acc * (1.f / 262144.f);
            } else if (math && warp < r1 - r) {
                const uint4* buf = (const uint4*)(ring + (slot * TMA_ROWS + warp) * 2560);
                float acc = 0.f;
#pragma unroll
                for (int j = 0; j < 5; j++) acc = dot16(buf[lane + 32 * j], xsh + lane + 32 * j, acc);
                acc = warp_total(acc);
                if (lane == 0) y[r + warp] = acc * (1.f / 4096.f);
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(empty + slot);
        }
        if (s < last && flags) {
            consumers_sync();
            if (threadIdx.x == 0) flag_arrive_wait(bar + 2, base + (unsigned)(s - first + 1) * gridDim.x);
            consumers_sync();
        } else if (s < last && barriers) {
            consumers_grid_barrier(bar, bar + 1, gridDim.x);
        } else {
            consumers_sync();
        }  // every warp is done with xsh before it is staged again
    }
}

// `chain_tma`'s integer arithmetic (its mode bit 2) with register loads, as the engine's tiled
// kernels load: a warp per row, each lane 5 x 16 bytes, the next row requested before this row's
// products, and a warp's first row requested before the wait (the engine's EARLY) or, when
// persistent, before the grid barrier. Same sums, so the same outputs as `chain_tma`'s.
__device__ __forceinline__ void ld_row(const signed char* __restrict__ w, long long off, int r, int lane, uint4* q) {
    const uint4* row = (const uint4*)(w + off) + (long long)r * 160;
#pragma unroll
    for (int j = 0; j < 5; j++) q[j] = __ldg(row + lane + 32 * j);
}
extern "C" __global__ void __launch_bounds__(512) chain_ints(
    const signed char* __restrict__ w, const long long* __restrict__ off, const int* __restrict__ rows,
    int first, int last, float* xs, int dim, unsigned* bar, int unused)
{
    extern __shared__ float xsh[];
    signed char* xq = (signed char*)xsh;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int gwarp = blockIdx.x * nwarps + warp, allwarps = gridDim.x * nwarps;
    asm volatile("griddepcontrol.launch_dependents;");
    uint4 q[5];
    if (gwarp < rows[first]) ld_row(w, off[first], gwarp, lane, q);
    asm volatile("griddepcontrol.wait;" ::: "memory");
    for (int s = first; s <= last; s++) {
        const float* x = xs + (s & 1) * dim;
        float* y = xs + ((s + 1) & 1) * dim;
        for (int i = threadIdx.x; i < 2560; i += blockDim.x)
            xq[i] = (signed char)max(-127, min(127, __float2int_rn(__ldcg(x + i) * 256.f)));
        __syncthreads();
        const int R = rows[s];
        const uint4* xv = (const uint4*)xq;
        for (int r = gwarp; r < R; r += allwarps) {
            uint4 qn[5];
            if (r + allwarps < R) ld_row(w, off[s], r + allwarps, lane, qn);
            int acc = 0;
#pragma unroll
            for (int j = 0; j < 5; j++) acc = dot16_codes(q[j], xv[lane + 32 * j], acc);
            acc = warp_total(acc);
            if (lane == 0) y[r] = (float)acc * (1.f / 262144.f);
#pragma unroll
            for (int j = 0; j < 5; j++) q[j] = qn[j];
        }
        if (s < last) {
            if (gwarp < rows[s + 1]) ld_row(w, off[s + 1], gwarp, lane, q);
            grid_barrier(bar, bar + 1, gridDim.x);
        }
    }
}
"#;

/// One layer's stages (rows of 2560 bytes): the hyper-connection read, the GDN input projections,
/// the output projection, the MoE read, router and shared expert, ten experts' gate/up, their down
/// projections, and small latency stages (norms, top-k) as 64-row stages.
const LAYER: [i32; 11] = [720, 64, 9216, 64, 2560, 720, 64, 1664, 64, 6400, 3200];

/// Row buffers per warp of `chain_pipe` (CHERENKOV_PROBE_NBUF, default 4).
fn nbuf() -> usize {
    std::env::var("CHERENKOV_PROBE_NBUF").ok().and_then(|v| v.parse().ok()).unwrap_or(4)
}

/// Slots of 16 rows in `chain_tma`'s ring (CHERENKOV_PROBE_TMA_SLOTS, default 4).
fn tma_slots() -> usize {
    std::env::var("CHERENKOV_PROBE_TMA_SLOTS").ok().and_then(|v| v.parse().ok()).unwrap_or(4)
}

fn ptx(arch: &'static str) -> String {
    // Rows each warp loads before computing (CHERENKOV_PROBE_ROWS, default 1).
    let rows = std::env::var("CHERENKOV_PROBE_ROWS").unwrap_or_else(|_| "1".into());
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(arch),
        options: vec![
            "--std=c++17".into(),
            format!("-DROWS={rows}"),
            format!("-DNBUF={}", nbuf()),
            format!("-DTMA_SLOTS={}", tma_slots()),
        ],
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts).unwrap_or_else(|e| panic!("{e:?}")).to_src()
}

/// The probe's kernel compiles (so the measurement does not fail on the GPU machine for a typo).
#[test]
fn probe_kernel_compiles() {
    if !cherenkov_cuda::compile::nvrtc_available() {
        eprintln!("skipped: NVRTC not found");
        return;
    }
    let p = ptx("sm_90");
    assert!(p.contains(".entry chain(") && p.contains(".entry chain_pipe(") && p.contains(".entry chain_tma("));
    assert!(p.contains(".entry chain_ints("));
    assert!(p.contains(".entry barriers(") && p.contains(".entry empty_stage("));
    assert!(p.contains(".entry flag_barriers(") && p.contains("red.release.gpu.global.add.u32"));
}

#[test]
#[ignore = "a measurement on the GPU machine; see the file's header"]
fn persistent_probe() {
    let gpu = Gpu::new().unwrap();
    let layers = 4;
    let rows: Vec<i32> = (0..layers).flat_map(|_| LAYER).collect();
    let mut off = Vec::new();
    let mut total = 0i64;
    for &r in &rows {
        off.push(total);
        total += r as i64 * 2560;
    }
    let (maj, min) = gpu.info.compute_capability;
    let arch = cherenkov_cuda::compile::arch_name(maj, min).unwrap();
    let cptx = CString::new(ptx(arch)).unwrap();
    gpu.bind().unwrap();
    // SAFETY: a NUL-terminated PTX image; the function names exist in it.
    let (f, fp, ft, fi, fb, fe, ff) = unsafe {
        let m = cu::module::load_data(cptx.as_ptr() as *const c_void).unwrap();
        let get = |name: &str| cu::module::get_function(m, CString::new(name).unwrap()).unwrap();
        (
            get("chain"),
            get("chain_pipe"),
            get("chain_tma"),
            get("chain_ints"),
            get("barriers"),
            get("empty_stage"),
            get("flag_barriers"),
        )
    };
    // The flag barriers' counter (word 2 of `bar`) only grows: the arrivals so far, which each
    // launch that waits on it takes as its base.
    let arrivals = std::cell::Cell::new(0u32);
    let w = gpu.alloc(total as usize, "weights").unwrap();
    // Random-ish bytes (the values do not matter, the bytes do).
    let fill: Vec<u8> = (0..total as usize).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    gpu.htod(w.ptr, &fill).unwrap();
    let offs = gpu.alloc(off.len() * 8, "offsets").unwrap();
    gpu.htod(offs.ptr, &off).unwrap();
    let rws = gpu.alloc(rows.len() * 4, "rows").unwrap();
    gpu.htod(rws.ptr, &rows).unwrap();
    let dim = 16384usize;
    let xs = gpu.zeros(2 * dim * 4, "x").unwrap();
    gpu.htod(xs.ptr, &vec![0.01f32; dim]).unwrap();
    let bar = gpu.zeros(64, "barrier").unwrap();
    let threads = 512u32;
    let shmem = 2560 * 4;
    let mut per_sm = 0i32;
    // SAFETY: f is a loaded kernel.
    unsafe {
        sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut per_sm, f, threads as i32, shmem as usize)
            .result()
            .unwrap();
    }
    let mut sms = 0i32;
    // SAFETY: plain attribute query of device 0.
    unsafe {
        sys::cuDeviceGetAttribute(&mut sms, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 0)
            .result()
            .unwrap();
    }
    println!(
        "# persistent probe: {layers} layers of {} stages, {:.1} MB per layer, {sms} SMs, {per_sm} blocks of {threads} per SM fit",
        LAYER.len(),
        total as f64 / layers as f64 / 1e6
    );
    // Every kernel of the chain takes the same parameters; its last is `chain`'s prefetch flag,
    // `chain_tma`'s mode (unused by `chain_pipe` and `chain_ints`). Blocks of 512 threads but for
    // `chain_tma`'s.
    let launch_sized =
        |k: sys::CUfunction, block: u32, smem: u32, pdl: bool, grid: u32, first: i32, last: i32, prefetch: i32| {
            let args = [
                Arg::Ptr(w.ptr),
                Arg::Ptr(offs.ptr),
                Arg::Ptr(rws.ptr),
                Arg::I32(first),
                Arg::I32(last),
                Arg::Ptr(xs.ptr),
                Arg::I32(dim as i32),
                Arg::Ptr(bar.ptr),
                Arg::I32(prefetch),
            ];
            // SAFETY: the arguments match the chain kernels' parameters; each waits for its
            // predecessor before it reads x; the grid is co-resident when persistent (at most the
            // blocks per SM that fit).
            unsafe { gpu.launch_function(k, "a chain kernel", (grid, 1, 1), block, smem, &args, pdl) }.unwrap();
        };
    let launch_kernel = |k: sys::CUfunction, smem: u32, pdl: bool, grid: u32, first: i32, last: i32, prefetch: i32| {
        launch_sized(k, threads, smem, pdl, grid, first, last, prefetch)
    };
    let launch_with = |pdl: bool, grid: u32, first: i32, last: i32, prefetch: i32| {
        launch_kernel(f, shmem, pdl, grid, first, last, prefetch)
    };
    let launch = |grid: u32, first: i32, last: i32, prefetch: i32| launch_with(false, grid, first, last, prefetch);
    let n = rows.len() as i32;
    // The median of 7 timed runs, in microseconds.
    let median_us = |run: &dyn Fn()| {
        let mut v: Vec<f32> = (0..7)
            .map(|_| {
                let a = gpu.event(true).unwrap();
                let b = gpu.event(true).unwrap();
                gpu.record(&a).unwrap();
                run();
                gpu.record(&b).unwrap();
                b.wait().unwrap();
                b.since(&a).unwrap()
            })
            .collect();
        v.sort_by(f32::total_cmp);
        v[3] as f64 * 1e3
    };
    let time = |run: &dyn Fn()| median_us(run) / layers as f64;
    let report = |what: &str, us: f64| {
        println!("{what:64} {us:8.1} us/layer  {:7.0} GB/s", total as f64 / layers as f64 / us / 1e3);
    };
    // Every variant must compute the same chain: the last stage's outputs from the same start,
    // bit for bit (the same arithmetic per row), else its time means nothing.
    let last_rows = rows[rows.len() - 1] as usize;
    let outputs = |run: &dyn Fn()| -> Vec<u32> {
        gpu.htod(xs.ptr, &vec![0.01f32; 2 * dim]).unwrap();
        run();
        gpu.sync().unwrap();
        let mut y = vec![0f32; last_rows];
        gpu.dtoh(xs.ptr + ((n as usize) & 1) as u64 * dim as u64 * 4, &mut y).unwrap();
        y.iter().map(|v| v.to_bits()).collect()
    };
    let want = outputs(&|| (0..n).for_each(|s| launch(sms as u32, s, s, 0)));
    let measure = |what: String, run: &dyn Fn()| {
        let same = outputs(run) == want;
        report(&format!("{what}{}", if same { "" } else { " [OUTPUTS DIFFER]" }), time(run));
    };
    for resident in 1..=per_sm.min(2) {
        let grid = (sms * resident) as u32;
        measure(format!("one launch per stage, grid {grid}"), &|| (0..n).for_each(|s| launch(grid, s, s, 0)));
        measure(format!("one launch per stage with PDL, grid {grid}"), &|| {
            (0..n).for_each(|s| launch_with(true, grid, s, s, 0))
        });
        // The same launches replayed from a CUDA graph, as resident decode steps run.
        let graph = gpu
            .capture(|| {
                (0..n).for_each(|s| launch_with(true, grid, s, s, 0));
                Ok(())
            })
            .unwrap();
        measure(format!("one launch per stage with PDL, in a CUDA graph, grid {grid}"), &|| {
            gpu.replay(&graph).unwrap()
        });
        measure(format!("persistent, grid {grid}"), &|| launch(grid, 0, n - 1, 0));
        measure(format!("persistent + L2 prefetch of the next stage, grid {grid}"), &|| launch(grid, 0, n - 1, 1));
    }
    // The cp.async ring: x plus NBUF row buffers per warp in shared memory.
    let shmem_pipe = (2560 * 4 + (threads as usize / 32) * nbuf() * 2560) as u32;
    // A kernel's dynamic shared memory allowed up to `smem` bytes, and the blocks of `threads` that
    // then fit on a multiprocessor.
    let fit = |k: sys::CUfunction, threads: u32, smem: u32| -> i32 {
        let mut per_sm = 0i32;
        // SAFETY: k is a loaded kernel; the limits asked are within Hopper's 227 KiB per block.
        unsafe {
            sys::cuFuncSetAttribute(
                k,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .result()
            .unwrap();
            sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut per_sm, k, threads as i32, smem as usize)
                .result()
                .unwrap();
        }
        per_sm
    };
    let per_sm_pipe = fit(fp, threads, shmem_pipe);
    println!(
        "# cp.async ring of {} rows per warp: {shmem_pipe} bytes of shared memory, {per_sm_pipe} blocks per SM fit",
        nbuf()
    );
    let pipe = |pdl: bool, grid: u32, first: i32, last: i32| launch_kernel(fp, shmem_pipe, pdl, grid, first, last, 0);
    for resident in 1..=per_sm_pipe.min(2) {
        let grid = (sms * resident) as u32;
        measure(format!("ring: one launch per stage, grid {grid}"), &|| (0..n).for_each(|s| pipe(false, grid, s, s)));
        measure(format!("ring: one launch per stage with PDL, grid {grid}"), &|| {
            (0..n).for_each(|s| pipe(true, grid, s, s))
        });
        measure(format!("ring: persistent, grid {grid}"), &|| pipe(false, grid, 0, n - 1));
    }
    // The TMA ring: TMA_SLOTS slots of 16 rows, x, and two mbarriers a slot; 16 consumer warps
    // and one producer warp a block.
    let tma_threads = 16 * 32 + 32;
    let shmem_tma = (tma_slots() * 16 * 2560 + 2560 * 4 + tma_slots() * 16) as u32;
    let per_sm_tma = fit(ft, tma_threads, shmem_tma);
    println!(
        "# TMA ring of {} slots of 16 rows: {shmem_tma} bytes of shared memory, {per_sm_tma} blocks of {tma_threads} per SM fit",
        tma_slots()
    );
    let tma = |pdl: bool, grid: u32, first: i32, last: i32, mode: i32| {
        launch_sized(ft, tma_threads, shmem_tma, pdl, grid, first, last, mode)
    };
    // The integer arithmetic (mode bit 2) against its own outputs from one launch per stage.
    let want_ints = outputs(&|| (0..n).for_each(|s| tma(false, sms as u32, s, s, 5)));
    // A comparison of outputs says something only if they are not all zero.
    for (what, v) in [("float", &want), ("dp4a", &want_ints)] {
        let nonzero = v.iter().filter(|&&b| f32::from_bits(b) != 0.0).count();
        println!("# the {what} chain's reference outputs: {nonzero} of {} nonzero", v.len());
    }
    let measure_ints = |what: String, run: &dyn Fn()| {
        let same = outputs(run) == want_ints;
        report(&format!("{what}{}", if same { "" } else { " [OUTPUTS DIFFER]" }), time(run));
    };
    // The same sums with register loads (`chain_ints`, 512 threads, x's codes in shared memory).
    let per_sm_ints = fit(fi, threads, 2560);
    println!("# register loads with dp4a: {per_sm_ints} blocks of {threads} per SM fit");
    for resident in 1..=per_sm_ints.min(2) {
        let grid = (sms * resident) as u32;
        let graph = gpu
            .capture(|| {
                (0..n).for_each(|s| launch_kernel(fi, 2560, true, grid, s, s, 0));
                Ok(())
            })
            .unwrap();
        measure_ints(format!("registers, dp4a: one launch per stage with PDL, in a CUDA graph, grid {grid}"), &|| {
            gpu.replay(&graph).unwrap()
        });
        measure_ints(format!("registers, dp4a: persistent, grid {grid}"), &|| {
            launch_kernel(fi, 2560, false, grid, 0, n - 1, 0)
        });
    }
    for resident in 1..=per_sm_tma.min(2) {
        let grid = (sms * resident) as u32;
        for (mode, what) in [(5, "dp4a"), (7, "no arithmetic")] {
            let graph = gpu
                .capture(|| {
                    (0..n).for_each(|s| tma(true, grid, s, s, mode));
                    Ok(())
                })
                .unwrap();
            measure_ints(format!("tma, {what}: one launch per stage with PDL, in a CUDA graph, grid {grid}"), &|| {
                gpu.replay(&graph).unwrap()
            });
        }
        measure_ints(format!("tma, dp4a: persistent, grid {grid}"), &|| tma(false, grid, 0, n - 1, 5));
        // The flag barriers: the base in the mode's upper bits, then n - 1 arrivals of each block.
        let flagged = |math: i32| {
            let base = arrivals.get();
            arrivals.set(base + (n as u32 - 1) * grid);
            tma(false, grid, 0, n - 1, math | 8 | ((base as i32) << 4));
        };
        measure_ints(format!("tma, dp4a: persistent, flag barriers, grid {grid}"), &|| flagged(4));
        measure(format!("tma: persistent, flag barriers, grid {grid}"), &|| flagged(0));
        measure(format!("tma: persistent, flag barriers, no arithmetic, grid {grid}"), &|| flagged(2));
        measure_ints(format!("tma, dp4a: persistent, no grid barriers (the ceiling), grid {grid}"), &|| {
            tma(false, grid, 0, n - 1, 4)
        });
        measure(format!("tma: one launch per stage with PDL, grid {grid}"), &|| {
            (0..n).for_each(|s| tma(true, grid, s, s, 1))
        });
        let graph = gpu
            .capture(|| {
                (0..n).for_each(|s| tma(true, grid, s, s, 1));
                Ok(())
            })
            .unwrap();
        measure(format!("tma: one launch per stage with PDL, in a CUDA graph, grid {grid}"), &|| {
            gpu.replay(&graph).unwrap()
        });
        measure(format!("tma: persistent, grid {grid}"), &|| tma(false, grid, 0, n - 1, 1));
        measure(format!("tma: persistent, no grid barriers (the streaming ceiling), grid {grid}"), &|| {
            tma(false, grid, 0, n - 1, 0)
        });
        measure(format!("tma: persistent, no grid barriers, no arithmetic (the copies alone), grid {grid}"), &|| {
            tma(false, grid, 0, n - 1, 2)
        });
        measure(format!("tma: persistent, grid barriers, no arithmetic, grid {grid}"), &|| {
            tma(false, grid, 0, n - 1, 3)
        });
    }
    let big = (rows.iter().map(|&r| r as u32).max().unwrap() * 32).div_ceil(threads);
    measure(format!("one launch per stage, grid {big} (a warp per row)"), &|| {
        (0..n).for_each(|s| launch(big, s, s, 0))
    });
    // The sync floor: grid barriers alone, and dependent launches of an empty kernel.
    let reps = 1000;
    let per = |run: &dyn Fn()| median_us(run) / reps as f64;
    for resident in 1..=per_sm.min(2) {
        let grid = (sms * resident) as u32;
        let us = per(&|| {
            // SAFETY: `barriers` takes (unsigned*, int); its grid is co-resident (at most the
            // blocks per SM that fit); the counter words start at zero and end at zero.
            unsafe {
                gpu.launch_function(
                    fb,
                    "barriers",
                    (grid, 1, 1),
                    threads,
                    0,
                    &[Arg::Ptr(bar.ptr), Arg::I32(reps)],
                    false,
                )
            }
            .unwrap()
        });
        println!("{:64} {us:8.2} us", format!("one grid barrier, grid {grid} x {threads}"));
        let us = per(&|| {
            let base = arrivals.get();
            arrivals.set(base + reps as u32 * grid);
            // SAFETY: `flag_barriers` takes (unsigned*, int, unsigned: passed as its bits); its grid is co-resident;
            // the counter holds `base` arrivals.
            unsafe {
                gpu.launch_function(
                    ff,
                    "flag_barriers",
                    (grid, 1, 1),
                    threads,
                    0,
                    &[Arg::Ptr(bar.ptr + 8), Arg::I32(reps), Arg::I32(base as i32)],
                    false,
                )
            }
            .unwrap()
        });
        println!("{:64} {us:8.2} us", format!("one flag barrier, grid {grid} x {threads}"));
        for pdl in [false, true] {
            let us = per(&|| {
                for _ in 0..reps {
                    // SAFETY: `empty_stage` takes nothing and waits for its predecessor.
                    unsafe { gpu.launch_function(fe, "empty_stage", (grid, 1, 1), threads, 0, &[], pdl) }.unwrap();
                }
            });
            let what =
                format!("one dependent empty launch{}, grid {grid} x {threads}", if pdl { " with PDL" } else { "" });
            println!("{what:64} {us:8.2} us");
            // The same launches captured into a CUDA graph and replayed (how decode steps run when
            // every expert is resident): the floor without the host's launch calls.
            let graph = gpu
                .capture(|| {
                    for _ in 0..reps {
                        // SAFETY: as above.
                        unsafe { gpu.launch_function(fe, "empty_stage", (grid, 1, 1), threads, 0, &[], pdl) }?;
                    }
                    Ok(())
                })
                .unwrap();
            let us = per(&|| gpu.replay(&graph).unwrap());
            let what = format!(
                "one dependent empty launch{} in a CUDA graph, grid {grid} x {threads}",
                if pdl { " with PDL" } else { "" }
            );
            println!("{what:64} {us:8.2} us");
        }
    }
    let bw = cherenkov_cuda::gpu::measure_bandwidth(&gpu, 1 << 30).unwrap();
    println!("device copy bandwidth (read + write): {:.0} GB/s", bw.device / 1e9);
}
