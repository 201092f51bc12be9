//! How long does every block of a launch take to stage its input vector, and does loading it once
//! per thread block cluster help? A measurement for the design of the next decode kernels
//! (ignored by default; needs a GPU):
//!
//!     cargo test --release -p cherenkov-cuda --test stage_probe --no-run   # prints the binary
//!     <binary> --ignored --nocapture        (on the GPU machine, with NVRTC on LD_LIBRARY_PATH)
//!
//! Every tiled matvec of a decode step starts by staging its whole input vector (the previous
//! launch's output) into each block's shared memory. The out_proj's 320 blocks each stage 24 KB:
//! 7.7 MB read from L2 for 8.8 MB of weights, and its blocks reach the end of staging 3.4 us after
//! their wait (`benchmark/notes-cuda.md`, "Session 26"). The probe asks how that time grows with
//! the vector (N floats) and the blocks (G), and whether a cluster of C blocks fetching the vector
//! once cuts it:
//!
//! - `slice`: each block loads only the few elements it writes (the floor: a dependent launch, one
//!   round trip to L2, the writes);
//! - `full`: each block loads all N floats with 16-byte loads (`ld.global.cg`), a loop of a load
//!   and a store; `unroll4`: the same loop unrolled 4 times, as the engine's `mv_stage`; `batch`:
//!   every load of a thread issued before its first store; `full+w` and `batch+w`: the same with
//!   64 bytes of weights a thread requested from memory before the wait, as the engine's tiled
//!   matvecs do (5.2 MB for 320 blocks), to see whether the staging waits behind them;
//! - `dsmem C`: block k of a cluster loads the k-th C-th, then after the cluster barrier copies
//!   the others' parts from their shared memory (`ld.shared::cluster.v4`);
//! - `multicast C`: block k asks the tensor memory accelerator for the k-th C-th, delivered to all
//!   C blocks at once (`cp.async.bulk ... .multicast::cluster`), and waits on its mbarrier for
//!   all N floats.
//!
//! The launches form a chain of `CHAIN` in a CUDA graph with programmatic dependent launch, as the
//! engine's steps run: launch i reads vector i and writes vector i + 1, each block its part
//! (element j = x[(7 j + 1) mod N] / 2 + 1, read from the staged copy), so each launch depends on
//! the whole of the one before. Every variant's last vector must equal `full`'s bit for bit, else
//! its time is marked. It prints microseconds per launch.
//!
//! Its answer on an H200 (session 26, `benchmark/results/stage-probe-2026-12-01-s26.txt`; the
//! columns run in more than one of three calls, each on a fresh machine, agreed within 0.1 us): a
//! dependent launch with one round trip is 0.9-1.2 us. For the out_proj's shape (N 6144, G 320)
//! `full` is 2.96, `unroll4` 3.06 (the unrolled loop still waits a round trip a pass in its
//! SASS), `batch` 1.90, clusters of 16 multicasting 2.30; gathering from the cluster's shared
//! memory is slower than every block loading all of it (6.3 at clusters of 4). With 5.2 MB of
//! weights requested before the wait, `full+w` 3.59 and `batch+w` 3.07.

mod probe;

use cherenkov_cuda::gpu::{Arg, Gpu};
use cudarc::driver::sys;

/// Launches chained in one graph.
const CHAIN: usize = 32;
/// Vector lengths: an expert's down input (640), the hidden size (2560), the GDN output (6144),
/// the four hyper-connection streams (10240).
const NS: [usize; 4] = [640, 2560, 6144, 10240];
/// Grids: the read's up projection (160), the out_proj (320), the in_proj (640).
const GS: [u32; 3] = [160, 320, 640];

const SOURCE: &str = r#"
// The chain's step: block b writes its part of the next vector from the staged one.
__device__ __forceinline__ void write_part(const float* xs, float* y, int n) {
    const int part = (n + gridDim.x - 1) / gridDim.x;
    const int j = blockIdx.x * part + threadIdx.x;
    if ((int)threadIdx.x < part && j < n) y[j] = xs[(7 * j + 1) % n] * 0.5f + 1.0f;
}

extern "C" __global__ void __launch_bounds__(256) stage_slice(const float* x, float* y, int n) {
    dep_start();
    const int part = (n + gridDim.x - 1) / gridDim.x;
    const int j = blockIdx.x * part + threadIdx.x;
    if ((int)threadIdx.x < part && j < n) y[j] = __ldcg(x + (7 * j + 1) % n) * 0.5f + 1.0f;
}

// x's n floats into shared s4, a 16-byte load and its store at a time.
__device__ __forceinline__ void stage_serial(const float* x, float4* s4, int n) {
    const float4* x4 = (const float4*)x;
    for (int i = threadIdx.x; i < n / 4; i += blockDim.x) s4[i] = __ldcg(x4 + i);
}

// The same with every load of the thread issued before the first store (up to BATCH float4s a
// thread: N <= 4 * 256 * BATCH): one round trip to L2 a block.
#define BATCH 10
__device__ __forceinline__ void stage_batched(const float* x, float4* s4, int n) {
    const float4* x4 = (const float4*)x;
    float4 r[BATCH];
#pragma unroll
    for (int u = 0; u < BATCH; u++) {
        const int i = threadIdx.x + u * blockDim.x;
        if (i < n / 4) r[u] = __ldcg(x4 + i);
    }
#pragma unroll
    for (int u = 0; u < BATCH; u++) {
        const int i = threadIdx.x + u * blockDim.x;
        if (i < n / 4) s4[i] = r[u];
    }
}

extern "C" __global__ void __launch_bounds__(256) stage_full(const float* x, float* y, int n) {
    extern __shared__ __align__(16) float xs[];
    dep_start();
    stage_serial(x, (float4*)xs, n);
    __syncthreads();
    write_part(xs, y, n);
}

// As `stage_full` with the loop unrolled 4 times, as the engine's `mv_stage` is: up to 4 loads a
// thread in flight at once.
extern "C" __global__ void __launch_bounds__(256) stage_unroll4(const float* x, float* y, int n) {
    extern __shared__ __align__(16) float xs[];
    dep_start();
    const float4* x4 = (const float4*)x;
    float4* s4 = (float4*)xs;
#pragma unroll 4
    for (int i = threadIdx.x; i < n / 4; i += blockDim.x) s4[i] = __ldcg(x4 + i);
    __syncthreads();
    write_part(xs, y, n);
}

extern "C" __global__ void __launch_bounds__(256) stage_batch(const float* x, float* y, int n) {
    extern __shared__ __align__(16) float xs[];
    dep_start();
    stage_batched(x, (float4*)xs, n);
    __syncthreads();
    write_part(xs, y, n);
}

// `full` (batch = 0) or `batch` (1) with every thread's first weights in flight at the wait, as the
// engine's tiled matvecs request theirs before it: 64 bytes a thread from `w` (this launch's own
// weights, so from memory, not L2), consumed after the staging.
extern "C" __global__ void __launch_bounds__(256) stage_w(const float* x, float* y, int n, const uint4* w, int batch) {
    extern __shared__ __align__(16) float xs[];
    asm volatile("griddepcontrol.launch_dependents;");
    const uint4* wp = w + ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    // Volatile loads (`ld.volatile`), so that neither compiler moves them past the wait: ptxas
    // moves `ld.global.nc` past it here, and past a barrier (the engine's are before it in its SASS).
    uint4 a[4];
#pragma unroll
    for (int k = 0; k < 4; k++)
        asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(a[k].x), "=r"(a[k].y), "=r"(a[k].z), "=r"(a[k].w)
                     : "l"(wp + k));
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (batch) {
        stage_batched(x, (float4*)xs, n);
    } else {
        stage_serial(x, (float4*)xs, n);
    }
    __syncthreads();
    // The weights are zeros: never true, but the loads must complete.
    unsigned acc = 0;
#pragma unroll
    for (int k = 0; k < 4; k++) acc ^= a[k].x ^ a[k].y ^ a[k].z ^ a[k].w;
    if (acc == 0x12345678u) y[0] = 0.0f;
    write_part(xs, y, n);
}


extern "C" __global__ void __launch_bounds__(256) stage_dsmem(const float* x, float* y, int n) {
    extern __shared__ __align__(16) float xs[];
    const unsigned k = cluster_rank(), c = cluster_size();
    const int q = n / 4 / c;  // float4s a block loads
    dep_start();
    const float4* x4 = (const float4*)x;
    float4* s4 = (float4*)xs;
    for (int i = threadIdx.x; i < q; i += blockDim.x) s4[k * q + i] = __ldcg(x4 + k * q + i);
    cluster_arrive();
    cluster_wait();
    const unsigned base = (unsigned)__cvta_generic_to_shared(xs);
    for (int i = threadIdx.x; i < n / 4; i += blockDim.x) {
        const unsigned owner = i / q;
        if (owner == k) continue;
        unsigned a;
        float4 v;
        asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(base + 16u * i), "r"(owner));
        asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                     : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(a) : "memory");
        s4[i] = v;
    }
    // Keep this block's shared memory until the cluster has read it.
    cluster_arrive();
    __syncthreads();
    write_part(xs, y, n);
    cluster_wait();
}

extern "C" __global__ void __launch_bounds__(256) stage_multicast(const float* x, float* y, int n) {
    extern __shared__ __align__(16) float xs[];
    __shared__ __align__(8) unsigned long long bar;
    const unsigned k = cluster_rank(), c = cluster_size();
    const unsigned bytes = (unsigned)n * 4u / c;  // a block's share, a multiple of 16
    const unsigned sbar = (unsigned)__cvta_generic_to_shared(&bar);
    const unsigned sxs = (unsigned)__cvta_generic_to_shared(xs);
    // Before the wait (it depends on nothing): the mbarrier, seen by the whole cluster before any
    // block's copy can land in this block's shared memory.
    if (threadIdx.x == 0) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(sbar) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    cluster_arrive();
    cluster_wait();
    dep_start();
    if (threadIdx.x == 0) {
        asm volatile("{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1; }" ::"r"(sbar),
                     "r"((unsigned)n * 4u)
                     : "memory");
        asm volatile("fence.proxy.async.global;" ::: "memory");
        const unsigned short mask = (unsigned short)((1u << c) - 1u);
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], %4;"
            ::"r"(sxs + k * bytes), "l"(x + (size_t)k * (bytes / 4)), "r"(bytes), "r"(sbar), "h"(mask)
            : "memory");
    }
    unsigned done = 0;
    while (!done) {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, p; }"
            : "=r"(done) : "r"(sbar) : "memory");
    }
    // No block leaves while a copy it asked for may still be landing in the others.
    cluster_arrive();
    write_part(xs, y, n);
    cluster_wait();
}
"#;

const KERNELS: [&str; 7] =
    ["stage_slice", "stage_full", "stage_unroll4", "stage_batch", "stage_dsmem", "stage_multicast", "stage_w"];

/// The probe's kernels compile (so the measurement does not fail on the GPU machine for a typo).
#[test]
fn probe_kernels_compile() {
    let Some(p) = probe::compiled(SOURCE, &KERNELS) else { return };
    assert!(p.contains(".multicast::cluster") && p.contains("mbarrier.try_wait.parity"));
}

#[test]
#[ignore = "a measurement on the GPU machine; see the file's header"]
fn stage_probe() {
    let gpu = Gpu::new().unwrap();
    let f = probe::load(&gpu, SOURCE, &KERNELS);
    let (fslice, ffull, fun4, fbatch, fds, fmc, fw) = (f[0], f[1], f[2], f[3], f[4], f[5], f[6]);
    // 16-block clusters are non-portable.
    probe::allow_large_clusters(fds);
    probe::allow_large_clusters(fmc);
    let nmax = *NS.iter().max().unwrap();
    let vs = gpu.zeros((CHAIN + 1) * nmax * 4, "vectors").unwrap();
    let v = |i: usize, n: usize| vs.ptr + (i * n * 4) as u64;
    // Every launch's first weights, 64 bytes a thread (zeros).
    let gmax = *GS.iter().max().unwrap() as usize;
    let ws = gpu.zeros(CHAIN * gmax * 256 * 64, "weights").unwrap();
    let w_at = |i: usize, g: u32| ws.ptr + (i * g as usize * 256 * 64) as u64;
    let gpu = &gpu;
    let chain = |k: sys::CUfunction, n: usize, g: u32, c: u32, shmem: u32| {
        move || -> anyhow::Result<()> {
            for i in 0..CHAIN {
                // SAFETY: the kernels take (x, y, n) with x and y vectors of n floats, n * 4 bytes
                // of dynamic shared memory where they stage, and wait for their predecessor.
                unsafe {
                    gpu.launch_function_clustered(
                        k,
                        "stage probe kernel",
                        (g, 1, 1),
                        256,
                        shmem,
                        &[Arg::Ptr(v(i, n)), Arg::Ptr(v(i + 1, n)), Arg::I32(n as i32)],
                        true,
                        c,
                    )?;
                }
            }
            Ok(())
        }
    };
    let chain_w = |n: usize, g: u32, batch: i32, shmem: u32| {
        move || -> anyhow::Result<()> {
            for i in 0..CHAIN {
                // SAFETY: as `chain`, with `stage_w`'s (x, y, n, w, batch): w holds g * 256 * 64
                // bytes from w_at(i, g).
                unsafe {
                    gpu.launch_function_clustered(
                        fw,
                        "stage probe kernel",
                        (g, 1, 1),
                        256,
                        shmem,
                        &[
                            Arg::Ptr(v(i, n)),
                            Arg::Ptr(v(i + 1, n)),
                            Arg::I32(n as i32),
                            Arg::Ptr(w_at(i, g)),
                            Arg::I32(batch),
                        ],
                        true,
                        1,
                    )?;
                }
            }
            Ok(())
        }
    };
    let median_us = |graph: &cherenkov_cuda::gpu::Graph| probe::median_us(gpu, graph, CHAIN);
    let last = |graph: &cherenkov_cuda::gpu::Graph, n: usize| -> Vec<u32> {
        let x0: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.01).collect();
        gpu.htod(vs.ptr, &vec![0f32; (CHAIN + 1) * nmax]).unwrap();
        gpu.htod(v(0, n), &x0).unwrap();
        gpu.replay(graph).unwrap();
        gpu.sync().unwrap();
        let mut out = vec![0f32; n];
        gpu.dtoh(v(CHAIN, n), &mut out).unwrap();
        out.iter().map(|x| x.to_bits()).collect()
    };
    println!("# stage probe: {CHAIN} dependent launches in a graph with PDL, 256 threads a block; us per launch");
    println!(
        "{:>6} {:>5} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}",
        "N",
        "G",
        "slice",
        "full",
        "unroll4",
        "batch",
        "full+w",
        "batch+w",
        "dsmem4",
        "dsmem8",
        "mcast2",
        "mcast4",
        "mcast8",
        "mcast16"
    );
    for n in NS {
        for g in GS {
            let shm = (n * 4) as u32;
            let gs = gpu.capture(chain(fslice, n, g, 1, 0)).unwrap();
            let gf = gpu.capture(chain(ffull, n, g, 1, shm)).unwrap();
            let want = last(&gf, n);
            assert!(want.iter().any(|&b| b != 0), "the chain's outputs are all zero: the probe measures nothing");
            let mut row = format!("{n:>6} {g:>5}");
            let mut cell = |graph: anyhow::Result<cherenkov_cuda::gpu::Graph>| match graph {
                Ok(graph) => {
                    let same = last(&graph, n) == want;
                    row += &format!(" {:>7.2}{}", median_us(&graph), if same { " " } else { "!" });
                }
                Err(_) => row += &format!(" {:>8}", "-"),
            };
            cell(Ok(gs));
            cell(Ok(gf));
            cell(gpu.capture(chain(fun4, n, g, 1, shm)));
            cell(gpu.capture(chain(fbatch, n, g, 1, shm)));
            cell(gpu.capture(chain_w(n, g, 0, shm)));
            cell(gpu.capture(chain_w(n, g, 1, shm)));
            for c in [4u32, 8] {
                cell(gpu.capture(chain(fds, n, g, c, shm)));
            }
            for c in [2u32, 4, 8, 16] {
                cell(gpu.capture(chain(fmc, n, g, c, shm)));
            }
            println!("{row}");
        }
    }
    println!("(! : the last vector differs from `full`'s, the time is not comparable; - : not launched)");
}
