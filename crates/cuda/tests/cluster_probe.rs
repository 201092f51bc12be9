//! Can a thread block cluster take a grid-wide dependency off a chain of launches? A measurement
//! for the design of the next decode kernels (ignored by default; needs a GPU):
//!
//!     cargo test --release -p cherenkov-cuda --test cluster_probe --no-run   # prints the binary
//!     <binary> --ignored --nocapture        (on the GPU machine, with NVRTC on LD_LIBRARY_PATH)
//!
//! About half of a resident layer's time is in launches that move a few KB or a few hundred KB.
//! Each costs a dependent launch, a staging and a tail. That is the hyper-connection read's down
//! and up projections, the router and its top-k, and the combination
//! (`benchmark/notes-cuda.md`, "Session 25"). They are separate launches because each one needs
//! the whole output of the one before it.
//!
//! Where that output is small, a cluster of C blocks can make the whole of it by itself. Its blocks
//! split the small projection, exchange the results through distributed shared memory after a
//! cluster barrier, and go on with their share of the next stage. The grid needs no barrier and
//! the second launch goes. The price: every cluster reads the small projection's weights, the
//! first from memory and the others from L2.
//!
//! The probe runs the read's shape: down (320 rows, 1.64 MB of 8-bit weights, the bytes of the
//! released 4-bit 320 x 10240 matrix less its scales), silu, then up (10240 rows of 320). It
//! chains READS reads, each read's input the first 5120 outputs of the one before, in a CUDA
//! graph with programmatic
//! dependent launch, as the engine's decode steps run. The variants:
//!
//! - two launches a read: down on 40 blocks (a warp a row), then up on 160;
//! - one launch a read: 160 blocks in clusters of C (4, 8 and 16, where 16 can be scheduled).
//!   Each cluster makes all 320 down rows, a block's share in its shared memory, then gathers them
//!   after the cluster barrier;
//! - one launch a read without clusters, every block making all 320 down rows itself: the
//!   contrast, what the redundancy costs without the split.
//!
//! Each variant's last outputs must be bit for bit the two launches' (the same arithmetic a row),
//! else its time is not reported as comparable. It prints microseconds per read, then the floors:
//! one cluster barrier, and one dependent empty launch in a graph with PDL.
//!
//! Its answer on an H200 (session 26, `benchmark/results/cluster-probe-2026-12-01-s26.txt`): two
//! launches 19.1 us a read; one launch in clusters of 4, 8, 16: 54.1, 32.2, 23.2 us; every block
//! making all the rows 128.7 us; a cluster barrier 0.2 us, a dependent empty launch 0.49 us. The
//! boundary between two launches is cheap; a block's share of the redone projection is not.

mod probe;

use cherenkov_cuda::gpu::{Arg, Gpu};
use probe::launch;

/// The read's shape: the down projection's inputs (8-bit, so its bytes are the released 4-bit
/// matrix's), its rows (the rank) and the up projection's rows (4 streams of 2560).
const DIN: usize = 5120;
const RANK: usize = 320;
const UP: usize = 10240;
/// Reads chained in one graph.
const READS: usize = 16;

const SOURCE: &str = r#"
#define DIN 5120
#define DCH (DIN / 16)  // 16-byte chunks of a down row
#define RANK 320
#define UP 10240

// x (DIN floats) into shared memory, transposed as in persistent_probe (xsh[t * DCH + c] =
// x[16 c + t]) so that lane c's 16 weights meet consecutive banks.
__device__ __forceinline__ void stage_x(const float* x, float* xsh) {
    for (int i = threadIdx.x; i < DIN; i += blockDim.x) xsh[(i & 15) * DCH + (i >> 4)] = __ldcg(x + i);
    __syncthreads();
}

// Down row r (DIN int8 weights, one warp): the dot product with the staged x, / 4096.
__device__ __forceinline__ float down_row(const signed char* __restrict__ wd, int r, const float* xsh) {
    const int lane = threadIdx.x & 31;
    const uint4* row = (const uint4*)(wd + (long long)r * DIN);
    uint4 q[DCH / 32];
#pragma unroll
    for (int j = 0; j < DCH / 32; j++) q[j] = __ldg(row + lane + 32 * j);
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < DCH / 32; j++) {
        const signed char* b = (const signed char*)&q[j];
        const float* xv = xsh + lane + 32 * j;
#pragma unroll
        for (int t = 0; t < 16; t++) acc += (float)b[t] * xv[t * DCH];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    return acc * (1.f / 4096.f);
}

__device__ __forceinline__ float silu(float v) { return v / (1.f + expf(-v)); }

// The up projection's rows of this block's warps (8 a warp, their loads first): row i is RANK
// int8 weights, lanes 0-19 one uint4 each, against s (RANK floats of silu(down)) in shared memory.
__device__ __forceinline__ void up_rows(const signed char* __restrict__ wu, const float* s, float* y) {
    const int lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    const int gw = blockIdx.x * nwarps + (threadIdx.x >> 5);
    const int per = UP / (gridDim.x * nwarps);
    uint4 q[8];
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const int r = gw * per + k;
        q[k] = k < per && lane < 20 ? __ldg((const uint4*)(wu + (long long)r * RANK) + lane) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const signed char* b = (const signed char*)&q[k];
        float acc = 0.f;
        if (lane < 20) {
#pragma unroll
            for (int t = 0; t < 16; t++) acc += (float)b[t] * s[lane * 16 + t];
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0 && k < per) y[gw * per + k] = acc * (1.f / 4096.f);
    }
}

// Two launches a read. Down: a warp a row (RANK warps).
extern "C" __global__ void __launch_bounds__(256) read_down(const signed char* __restrict__ wd, const float* x, float* d) {
    __shared__ float xsh[DIN];
    dep_start();
    stage_x(x, xsh);
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const float v = down_row(wd, r, xsh);
    if ((threadIdx.x & 31) == 0) d[r] = v;
}

// Up: silu(d) staged, then the block's rows.
extern "C" __global__ void __launch_bounds__(256) read_up(const signed char* __restrict__ wu, const float* d, float* y) {
    __shared__ float s[RANK];
    dep_start();
    for (int i = threadIdx.x; i < RANK; i += blockDim.x) s[i] = silu(__ldcg(d + i));
    __syncthreads();
    up_rows(wu, s, y);
}

// A float of block `rank`'s shared memory at the address of `p` in this block's.
__device__ __forceinline__ float ld_cluster(const float* p, unsigned rank) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p), b;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(b) : "r"(a), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(b) : "memory");
    return v;
}

// One launch a read, in clusters: the cluster's blocks make RANK / C down rows each (a warp a row,
// in turn) into `dl`, then after the cluster barrier every block gathers all RANK rows, applies
// silu, and makes its up rows. Block rank k's shared `dl` holds rows [k RANK / C, (k + 1) RANK / C).
// The second barrier (arrive after the gather, wait at the end) keeps each block's shared memory
// alive until the cluster has read it.
extern "C" __global__ void __launch_bounds__(256) read_cluster(const signed char* __restrict__ wd,
                                                                const signed char* __restrict__ wu,
                                                                const float* x, float* y) {
    __shared__ float xsh[DIN];
    __shared__ float dl[RANK];
    __shared__ float s[RANK];
    dep_start();
    stage_x(x, xsh);
    const unsigned k = cluster_rank(), C = cluster_size();
    const int share = RANK / C, nwarps = blockDim.x >> 5, warp = threadIdx.x >> 5;
    for (int i = warp; i < share; i += nwarps) {
        const int r = k * share + i;
        const float v = down_row(wd, r, xsh);
        if ((threadIdx.x & 31) == 0) dl[r] = v;
    }
    cluster_arrive();
    cluster_wait();
    for (int i = threadIdx.x; i < RANK; i += blockDim.x) s[i] = silu(ld_cluster(dl + i, i / share));
    cluster_arrive();
    __syncthreads();
    up_rows(wu, s, y);
    cluster_wait();
}

// One launch a read without clusters: every block makes all RANK down rows itself (each reads the
// whole down matrix, from L2 after the first), the contrast that shows what the clusters' split
// saves.
extern "C" __global__ void __launch_bounds__(256) read_redundant(const signed char* __restrict__ wd,
                                                                  const signed char* __restrict__ wu,
                                                                  const float* x, float* y) {
    __shared__ float xsh[DIN];
    __shared__ float s[RANK];
    dep_start();
    stage_x(x, xsh);
    for (int r = threadIdx.x >> 5; r < RANK; r += blockDim.x >> 5) {
        const float v = down_row(wd, r, xsh);
        if ((threadIdx.x & 31) == 0) s[r] = silu(v);
    }
    __syncthreads();
    up_rows(wu, s, y);
}

// The floors: n cluster barriers in a row; a dependent empty launch.
extern "C" __global__ void cluster_barriers(int n) {
    dep_start();
    for (int i = 0; i < n; i++) {
        cluster_arrive();
        cluster_wait();
    }
}
extern "C" __global__ void empty_stage() { dep_start(); }
"#;

const KERNELS: [&str; 6] =
    ["read_down", "read_up", "read_cluster", "read_redundant", "cluster_barriers", "empty_stage"];

/// The probe's kernels compile (so the measurement does not fail on the GPU machine for a typo).
#[test]
fn probe_kernels_compile() {
    let Some(p) = probe::compiled(SOURCE, &KERNELS) else { return };
    assert!(p.contains("barrier.cluster.arrive") && p.contains("mapa.shared::cluster"));
}

#[test]
#[ignore = "a measurement on the GPU machine; see the file's header"]
fn cluster_probe() {
    let gpu = Gpu::new().unwrap();
    let f = probe::load(&gpu, SOURCE, &KERNELS);
    let (fdown, fup, fcl, fred, fbar, fempty) = (f[0], f[1], f[2], f[3], f[4], f[5]);
    // 16-block clusters are non-portable.
    probe::allow_large_clusters(fcl);
    probe::allow_large_clusters(fbar);
    // Distinct weights for every read (no read finds another's in L2), random-ish bytes.
    let bytes = |n: usize, seed: usize| -> Vec<u8> {
        (0..n).map(|i| ((i + seed).wrapping_mul(2654435761) >> 13) as u8).collect()
    };
    let wd = gpu.alloc(READS * RANK * DIN, "down weights").unwrap();
    gpu.htod(wd.ptr, &bytes(READS * RANK * DIN, 1)).unwrap();
    let wu = gpu.alloc(READS * UP * RANK, "up weights").unwrap();
    gpu.htod(wu.ptr, &bytes(READS * UP * RANK, 7)).unwrap();
    // Outputs: READS + 1 vectors of UP floats (vector 0 the first input), and the down rows.
    let ys = gpu.zeros((READS + 1) * UP * 4, "outputs").unwrap();
    let d = gpu.zeros(RANK * 4, "down rows").unwrap();
    let x0: Vec<f32> = (0..UP).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.002).collect();
    let y = |i: usize| ys.ptr + (i * UP * 4) as u64;
    let wd_at = |i: usize| wd.ptr + (i * RANK * DIN) as u64;
    let wu_at = |i: usize| wu.ptr + (i * UP * RANK) as u64;
    println!(
        "# cluster probe: {READS} reads of down {RANK} x {DIN} (8-bit, {:.2} MB) and up {UP} x {RANK} ({:.2} MB)",
        (RANK * DIN) as f64 / 1e6,
        (UP * RANK) as f64 / 1e6
    );
    let two = || -> anyhow::Result<()> {
        for i in 0..READS {
            // SAFETY: the kernels' parameters (weights, input, output) and their dep_start().
            unsafe {
                launch(&gpu, fdown, (RANK / 8) as u32, 256, 1, &[Arg::Ptr(wd_at(i)), Arg::Ptr(y(i)), Arg::Ptr(d.ptr)])?;
                launch(&gpu, fup, 160, 256, 1, &[Arg::Ptr(wu_at(i)), Arg::Ptr(d.ptr), Arg::Ptr(y(i + 1))])?;
            }
        }
        Ok(())
    };
    let gpu = &gpu;
    let clustered = |c: u32| {
        move || -> anyhow::Result<()> {
            for i in 0..READS {
                // SAFETY: as above; 160 blocks in clusters of c, c divides 160 and RANK.
                unsafe {
                    launch(
                        gpu,
                        fcl,
                        160,
                        256,
                        c,
                        &[Arg::Ptr(wd_at(i)), Arg::Ptr(wu_at(i)), Arg::Ptr(y(i)), Arg::Ptr(y(i + 1))],
                    )?;
                }
            }
            Ok(())
        }
    };
    let median_us = |graph: &cherenkov_cuda::gpu::Graph, per: usize| probe::median_us(gpu, graph, per);
    let outputs = |graph: &cherenkov_cuda::gpu::Graph| -> Vec<u32> {
        gpu.htod(ys.ptr, &vec![0f32; (READS + 1) * UP]).unwrap();
        gpu.htod(ys.ptr, &x0).unwrap();
        gpu.replay(graph).unwrap();
        gpu.sync().unwrap();
        let mut out = vec![0f32; UP];
        gpu.dtoh(y(READS), &mut out).unwrap();
        out.iter().map(|v| v.to_bits()).collect()
    };
    let g_two = gpu.capture(two).unwrap();
    let want = outputs(&g_two);
    assert!(want.iter().any(|&b| b != 0), "the chain's outputs are all zero: the probe measures nothing");
    println!("{:56} {:8.2} us/read", "two launches a read (40 + 160 blocks), PDL, graph", median_us(&g_two, READS));
    for c in [4u32, 8, 16] {
        let what = format!("one launch a read, 160 blocks in clusters of {c}");
        match gpu.capture(clustered(c)) {
            Ok(g) => {
                let same = outputs(&g) == want;
                let us = median_us(&g, READS);
                println!("{what:56} {us:8.2} us/read{}", if same { "" } else { "  [OUTPUTS DIFFER]" });
            }
            Err(e) => println!("{what:56} not run: {e:#}"),
        }
    }
    let redundant = || -> anyhow::Result<()> {
        for i in 0..READS {
            // SAFETY: as above.
            unsafe {
                launch(
                    gpu,
                    fred,
                    160,
                    256,
                    1,
                    &[Arg::Ptr(wd_at(i)), Arg::Ptr(wu_at(i)), Arg::Ptr(y(i)), Arg::Ptr(y(i + 1))],
                )?;
            }
        }
        Ok(())
    };
    let g = gpu.capture(redundant).unwrap();
    let same = outputs(&g) == want;
    println!(
        "{:56} {:8.2} us/read{}",
        "one launch a read, 160 blocks each making all down rows",
        median_us(&g, READS),
        if same { "" } else { "  [OUTPUTS DIFFER]" }
    );
    // The floors.
    let reps = 1000usize;
    for c in [4u32, 8, 16] {
        let g = gpu.capture(|| {
            // SAFETY: `cluster_barriers` takes (int) and waits for its predecessor.
            unsafe { launch(gpu, fbar, 160, 256, c, &[Arg::I32(reps as i32)]) }
        });
        match g {
            Ok(g) => println!("{:56} {:8.3} us", format!("one cluster barrier, clusters of {c}"), median_us(&g, reps)),
            Err(e) => println!("one cluster barrier, clusters of {c}: not run: {e:#}"),
        }
    }
    let g = gpu
        .capture(|| {
            for _ in 0..reps {
                // SAFETY: `empty_stage` takes nothing and waits for its predecessor.
                unsafe { launch(gpu, fempty, 160, 256, 1, &[]) }?;
            }
            Ok(())
        })
        .unwrap();
    println!("{:56} {:8.3} us", "one dependent empty launch, PDL, graph, 160 blocks", median_us(&g, reps));
}
