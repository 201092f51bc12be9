//! Can a consumer start on the columns whose producers are done, instead of waiting for the whole
//! producer grid? A measurement for the design of the next decode kernels (ignored by default;
//! needs a GPU):
//!
//!     cargo test --release -p cherenkov-cuda --test dataflow_probe --no-run   # prints the binary
//!     <binary> --ignored --nocapture        (on the GPU machine, with NVRTC on LD_LIBRARY_PATH)
//!
//! In a resident decode step the time around each launch's products (staging, handovers, tails,
//! the gap to the next launch) is more than half of a GDN layer (`benchmark/notes-cuda.md`,
//! "Session 26"). The probe takes one producer-consumer pair of the GDN layer's shape:
//!
//! - the producer `p_head`: 48 blocks, one a head of 128 outputs, each reading its head's 64 KB of
//!   state (3.1 MB in all, as the GDN recurrence) against the previous consumer's output;
//! - the consumer: the out_proj's shape, 2560 rows of 6144 columns (8-bit weights, 15.7 MB), a warp
//!   a row, every weight of the row requested before anything waits (all of it fits the registers
//!   at this grid, so the wait itself is what differs between the two ways):
//!   - `c_wait`: `griddepcontrol.wait`, then the input, head by head;
//!   - `c_flags`: no wait; each lane polls the ready flags of the 12 heads its columns lie in
//!     (relaxed loads, all at once, then a fence), which the producer's blocks set (release
//!     stores) once their head is written, then goes on as `c_wait`.
//!
//! Every row spans all 48 heads, so a warp still needs the whole producer: what differs is how
//! soon a consumer learns that its input is there. `griddepcontrol.wait` returns once every
//! producer block has exited and its writes are flushed; a flag, once its block's writes are
//! fenced. The gap between two launches in the engine's timeline is 0.5-1.0 us; this is the part
//! of it a flag could take. Consumers that need only some producers (the experts' down projection
//! by expert) would gain more, and are not measured here.
//!
//! `PAIRS` pairs are chained in a CUDA graph with programmatic dependent launch (each producer
//! reads the previous consumer's output after its own `griddepcontrol.wait`), every pair with its
//! own weights and state, so nothing is found in L2. Both ways add in the same order, so their last
//! outputs must agree bit for bit. It prints microseconds per pair.
//!
//! Measured on the H200 (session 27, `benchmark/results/ab-2026-12-01-s27.txt`, call 1): 63.95 us
//! a pair waiting for the grid, 180.65 polling the flags, outputs identical. Polling as written
//! is three times slower: every lane of 2560 warps polls 12 flags, and the consumers spin on the
//! multiprocessors the producers need. The pair itself is slow either way (the producer's 128
//! dependent loads a thread are latency-bound), so the probe does not yet measure what a flag
//! could save against the engine's 0.5-1.0 us gaps; a next version would poll from one thread a
//! block and give the producer a faster shape.

mod probe;

use cherenkov_cuda::gpu::{Arg, Gpu};
use cudarc::driver::sys;

/// Pairs chained in one graph.
const PAIRS: usize = 16;
/// The producer's heads and head size, the consumer's rows and columns.
const HEADS: usize = 48;
const HEAD: usize = 128;
const COLS: usize = HEADS * HEAD;
const ROWS: usize = 2560;

const SOURCE: &str = r#"
#define HEADS 48
#define HEAD 128
#define COLS (HEADS * HEAD)
#define ROWS 2560
#define NQ (COLS / 512)  // 16-byte pieces of a row a lane holds

// Flags to zero before the first pair (one per head and pair).
extern "C" __global__ void reset_flags(unsigned* flags, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) flags[i] = 0;
    asm volatile("griddepcontrol.launch_dependents;");
}

// Head h: out[h HEAD + t] = 0.01 sum_k state[h][k][t] xin[(h HEAD + k) mod ROWS] + xin[t]; then
// its flag, released after the block's writes.
extern "C" __global__ void __launch_bounds__(HEAD) p_head(const float* __restrict__ state, const float* xin,
                                                          float* out, unsigned* flags) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    // After the wait, so that no consumer starts (and polls) before the flags were reset.
    asm volatile("griddepcontrol.launch_dependents;");
    const int h = blockIdx.x, t = threadIdx.x;
    const float* st = state + (size_t)h * HEAD * HEAD;
    float s = 0.f;
#pragma unroll 8
    for (int k = 0; k < HEAD; k++) s += __ldg(st + k * HEAD + t) * __ldcg(xin + (h * HEAD + k) % ROWS);
    out[h * HEAD + t] = s * 0.01f + __ldcg(xin + t);
    __syncthreads();
    if (t == 0) {
        __threadfence();
        asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(flags + h), "r"(1u) : "memory");
    }
}

// A row's weights, requested at once: lane l's piece j holds columns 512 j + 16 l .. + 16, which
// lie in head 4 j + l / 8. Volatile loads, so that no compiler moves them past the wait.
__device__ __forceinline__ void load_row(const signed char* __restrict__ w, int r, uint4* q) {
    const int lane = threadIdx.x & 31;
    const uint4* row = (const uint4*)(w + (size_t)r * COLS);
#pragma unroll
    for (int j = 0; j < NQ; j++)
        asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(q[j].x), "=r"(q[j].y), "=r"(q[j].z), "=r"(q[j].w)
                     : "l"(row + 32 * j + lane));
}

__device__ __forceinline__ float piece(const uint4& q, const float* x, int c0) {
    const signed char* b = (const signed char*)&q;
    const float4* x4 = (const float4*)(x + c0);
    float acc = 0.f;
#pragma unroll
    for (int u = 0; u < 4; u++) {
        const float4 v = __ldcg(x4 + u);
        acc += (float)b[4 * u] * v.x + (float)b[4 * u + 1] * v.y + (float)b[4 * u + 2] * v.z + (float)b[4 * u + 3] * v.w;
    }
    return acc;
}

// Row r of y from the row's weights q and the input x, its pieces added in order.
__device__ __forceinline__ void finish_row(const uint4* q, const float* x, float* y, int r) {
    const int lane = threadIdx.x & 31;
    float p[NQ];
#pragma unroll
    for (int j = 0; j < NQ; j++) p[j] = piece(q[j], x, 512 * j + 16 * lane);
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < NQ; j++) acc += p[j];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) y[r] = acc * (1.f / 4096.f);
}

// (`flags` unused: the two consumers take the same parameters.)
extern "C" __global__ void __launch_bounds__(256, 3) c_wait(const signed char* __restrict__ w, const float* x, float* y,
                                                         const unsigned* flags) {
    asm volatile("griddepcontrol.launch_dependents;");
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    uint4 q[NQ];
    load_row(w, r, q);
    asm volatile("griddepcontrol.wait;" ::: "memory");
    finish_row(q, x, y, r);
}

extern "C" __global__ void __launch_bounds__(256, 3) c_flags(const signed char* __restrict__ w, const float* x, float* y,
                                                          const unsigned* flags) {
    asm volatile("griddepcontrol.launch_dependents;");
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    uint4 q[NQ];
    load_row(w, r, q);
    // Poll the lane's NQ flags at once (relaxed loads) until all are set, then one fence (which
    // makes the relaxed reads that saw the releases acquire them), then as c_wait after its wait.
    for (;;) {
        unsigned all = 1;
#pragma unroll
        for (int j = 0; j < NQ; j++) {
            unsigned f;
            asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(f) : "l"(flags + 4 * j + lane / 8) : "memory");
            all &= f;
        }
        if (all) break;
        __nanosleep(32);
    }
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
    finish_row(q, x, y, r);
}
"#;

const KERNELS: [&str; 4] = ["reset_flags", "p_head", "c_wait", "c_flags"];

/// The probe's kernels compile (so the measurement does not fail on the GPU machine for a typo).
#[test]
fn probe_kernels_compile() {
    let Some(p) = probe::compiled(SOURCE, &KERNELS) else { return };
    assert!(p.contains("ld.relaxed.gpu") && p.contains("st.release.gpu"));
}

#[test]
#[ignore = "a measurement on the GPU machine; see the file's header"]
fn dataflow_probe() {
    let gpu = Gpu::new().unwrap();
    let f: Vec<sys::CUfunction> = probe::load(&gpu, SOURCE, &KERNELS);
    let (freset, fp, fwait, fflags) = (f[0], f[1], f[2], f[3]);
    let bytes = |n: usize, seed: usize| -> Vec<u8> {
        (0..n).map(|i| ((i + seed).wrapping_mul(2654435761) >> 13) as u8).collect()
    };
    let wsz = ROWS * COLS;
    let w = gpu.alloc(PAIRS * wsz, "weights").unwrap();
    gpu.htod(w.ptr, &bytes(PAIRS * wsz, 3)).unwrap();
    let ssz = HEADS * HEAD * HEAD;
    let state: Vec<f32> = (0..PAIRS * ssz).map(|i| ((i * 29 % 97) as f32 - 48.0) * 0.001).collect();
    let st = gpu.alloc(state.len() * 4, "state").unwrap();
    gpu.htod(st.ptr, &state).unwrap();
    let ys = gpu.zeros((PAIRS + 1) * ROWS * 4, "consumer outputs").unwrap();
    let outs = gpu.zeros(PAIRS * COLS * 4, "producer outputs").unwrap();
    let flags = gpu.zeros(PAIRS * HEADS * 4, "flags").unwrap();
    let y = |i: usize| ys.ptr + (i * ROWS * 4) as u64;
    let out = |i: usize| outs.ptr + (i * COLS * 4) as u64;
    let flag = |i: usize| flags.ptr + (i * HEADS * 4) as u64;
    let gpu = &gpu;
    let chain = |consumer: sys::CUfunction| {
        move || -> anyhow::Result<()> {
            // SAFETY: each kernel's parameters as declared in SOURCE, over the buffers above (PAIRS
            // slices of each); every kernel but the first waits for its predecessor or, for
            // `c_flags`, for its producer's flags, which `reset_flags` zeroed first.
            unsafe {
                gpu.launch_function_clustered(
                    freset,
                    "reset_flags",
                    (1, 1, 1),
                    256,
                    0,
                    &[Arg::Ptr(flags.ptr), Arg::I32((PAIRS * HEADS) as i32)],
                    true,
                    1,
                )?;
                for i in 0..PAIRS {
                    gpu.launch_function_clustered(
                        fp,
                        "p_head",
                        (HEADS as u32, 1, 1),
                        HEAD as u32,
                        0,
                        &[Arg::Ptr(st.ptr + (i * ssz * 4) as u64), Arg::Ptr(y(i)), Arg::Ptr(out(i)), Arg::Ptr(flag(i))],
                        true,
                        1,
                    )?;
                    gpu.launch_function_clustered(
                        consumer,
                        "consumer",
                        ((ROWS / 8) as u32, 1, 1),
                        256,
                        0,
                        &[Arg::Ptr(w.ptr + (i * wsz) as u64), Arg::Ptr(out(i)), Arg::Ptr(y(i + 1)), Arg::Ptr(flag(i))],
                        true,
                        1,
                    )?;
                }
            }
            Ok(())
        }
    };
    let median_us = |graph: &cherenkov_cuda::gpu::Graph| probe::median_us(gpu, graph, PAIRS);
    let last = |graph: &cherenkov_cuda::gpu::Graph| -> Vec<u32> {
        let x0: Vec<f32> = (0..ROWS).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.01).collect();
        gpu.htod(ys.ptr, &vec![0f32; (PAIRS + 1) * ROWS]).unwrap();
        gpu.htod(y(0), &x0).unwrap();
        gpu.replay(graph).unwrap();
        gpu.sync().unwrap();
        let mut v = vec![0f32; ROWS];
        gpu.dtoh(y(PAIRS), &mut v).unwrap();
        v.iter().map(|x| x.to_bits()).collect()
    };
    println!(
        "# dataflow probe: {PAIRS} pairs of a producer ({HEADS} heads of {HEAD}, {:.1} MB of state) and a consumer \
         ({ROWS} x {COLS} 8-bit, {:.1} MB) in a graph with PDL",
        (ssz * 4) as f64 / 1e6,
        wsz as f64 / 1e6
    );
    let gw = gpu.capture(chain(fwait)).unwrap();
    let want = last(&gw);
    assert!(want.iter().any(|&b| b != 0), "the chain's outputs are all zero: the probe measures nothing");
    println!("{:60} {:8.2} us/pair", "consumer waits for the producer grid (griddepcontrol.wait)", median_us(&gw));
    let gf = gpu.capture(chain(fflags)).unwrap();
    let same = last(&gf) == want;
    println!(
        "{:60} {:8.2} us/pair{}",
        "consumer polls a ready flag per head",
        median_us(&gf),
        if same { "" } else { "  [OUTPUTS DIFFER]" }
    );
}
