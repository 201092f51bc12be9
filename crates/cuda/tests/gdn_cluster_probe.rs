//! Can a Gated DeltaNet layer's input projection and its recurrence be one launch, a thread block
//! cluster per key head? A measurement for the resident chain (ignored by default; needs a GPU):
//!
//!     cargo test --release -p cherenkov-cuda --test gdn_cluster_probe --no-run   # prints the binary
//!     <binary> --ignored --nocapture        (on the GPU machine, with NVRTC on LD_LIBRARY_PATH)
//!
//! In the engine the GDN in_proj (`matvec_many_48`, about 16.5 us added a launch on the H200) and
//! the recurrence (`gdn_recurrent_split`, about 5.5 us) are two launches only because the
//! in_proj's rows are planned as one matrix (`benchmark/notes-cuda.md`, "Session 36", item 3 of
//! its list). By key head everything the recurrence needs is local: each of the 16 key heads needs
//! its q and k (256 rows), its 3 value heads' v and z (768 rows) and their a and b (6 rows), 1030
//! rows of the 2560 inputs.
//!
//! The probe chains LAYERS such layers in a CUDA graph with programmatic dependent launch, as the
//! engine's steps run, each layer with its own weights (so none finds another's in L2) and its own
//! state. The weights are 8-bit rows of 1280 inputs, the bytes of the released 4-bit rows of 2560
//! less their scales (21.1 MB a layer). The arithmetic is the model's in shape (the causal conv of
//! width 4 and silu on q, k and v; q and k L2-normalised; the decay and beta from a and b; the
//! delta rule on a 128 x 128 state per value head; the output normalised per value head and gated
//! by silu(z)), not its checkpoint's numbers. The variants:
//!
//! - two launches a layer: the projection (a warp per row, 4 rows in flight, 264 blocks), then the
//!   recurrence (a block per value head, four threads a state column, each holding a quarter of
//!   the column in registers, loaded before the launch's wait);
//! - the projection's launch alone: what the recurrence's launch adds;
//! - one launch a layer: 128 blocks in clusters of 8, a cluster per key head (and its projection
//!   alone, the recurrence skipped: what the recurrence adds inside the launch); then the same
//!   with clusters of 16 blocks (256 blocks, a non-portable size). With 8, each block makes an
//!   eighth of its head's 1030 rows into its shared memory; after the cluster barrier six blocks
//!   each gather q, k and half a value head's v, z, a and b through distributed shared memory and
//!   run that half's 64 state columns (four threads a column, their state loaded before the
//!   launch's wait, so that it arrives during the projection); the halves' sums of squares for the
//!   output norm cross between partner blocks after a second barrier.
//!
//! The one-launch variant's outputs must be bit for bit the two launches' (the same arithmetic per
//! row and per column, the same reduction order), else its time is not reported as comparable. It
//! prints microseconds per layer.
//!
//! Its first version, with a thread per state column reading its column after the wait, ran once
//! on an H200 (session 39, `benchmark/results/gdn-cluster-probe-2026-12-03-s39.txt`): two launches
//! 59.2 us a layer, the projection alone 28.3, one launch in clusters 56.5, outputs identical. Both
//! kernels were far slower than the engine's (16.5 and 5.5 us), so that answered nothing about the
//! fold. This version, with the recurrence split four ways and its state loaded before the wait,
//! ran in session 40 (`gdn-cluster-probe-2026-12-03-s40.txt`): two launches 34.55 us a layer, the
//! projection alone 28.93, one clustered launch 51.38 and its projection alone 48.78. The
//! recurrence adds 5.6 us as a launch of its own and 2.6 inside the clustered one, so the fold is
//! worth about 3 us a layer, and only if the projection kept the whole GPU: on the clusters' 128
//! blocks it took 48.8 us against 28.9 on 264. The probe then also ran the clustered launch with
//! clusters of 16 (256 blocks): 48.86 us a layer, its projection alone 45.05, still 16 us slower
//! than the separate projection's 29.08, so the fold does not pay in this form
//! (`benchmark/notes-cuda.md`, "Session 40").

mod probe;

use cherenkov_cuda::gpu::{Arg, Gpu};
use probe::launch;

/// Inputs a row (8-bit: the bytes of 2560 4-bit inputs), key heads, value heads per key head, head
/// width, rows per key head (q, k, 3 v, 3 z, 3 a, 3 b), layers chained in one graph.
const XN: usize = 1280;
const KH: usize = 16;
const VPK: usize = 3;
const D: usize = 128;
const ROWS_KH: usize = 2 * D + 2 * VPK * D + 2 * VPK;
const LAYERS: usize = 12;
/// Channels through the conv (q, k and v rows of a key head).
const CONV_KH: usize = 2 * D + VPK * D;
/// A layer's outputs: every value head's D values.
const YN: usize = KH * VPK * D;

const SOURCE: &str = r#"
#define XN 1280
#define DCH (XN / 16)          // 16-byte chunks of a row
#define KH 16
#define VPK 3
#define D 128
#define ROWS_KH (2 * D + 2 * VPK * D + 2 * VPK)
#define CONV_KH (2 * D + VPK * D)
#define CL 8                   // blocks of a cluster (a key head)
#define ROWS_PB ((ROWS_KH + CL - 1) / CL)
#define RIF 4                  // rows in flight a warp

// x (XN floats) into shared memory, transposed (xsh[t * DCH + c] = x[16 c + t]) so that lane c's
// 16 weights meet consecutive banks.
__device__ __forceinline__ void stage_x(const float* x, float* xsh) {
    for (int i = threadIdx.x; i < XN; i += blockDim.x) xsh[(i & 15) * DCH + (i >> 4)] = __ldcg(x + i);
    __syncthreads();
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float silu(float v) { return v / (1.f + expf(-v)); }

// The dot products of rows r[0..n) (n <= RIF, global row indices) with the staged x, a warp,
// their loads issued together; lane 0 gets the sums / 4096.
__device__ __forceinline__ void rows_dot(const signed char* __restrict__ w, const int* r, int n, const float* xsh,
                                         float* out) {
    const int lane = threadIdx.x & 31;
    uint4 q[RIF][3];
#pragma unroll
    for (int k = 0; k < RIF; k++) {
        const uint4* row = (const uint4*)(w + (long long)r[k] * XN);
#pragma unroll
        for (int j = 0; j < 3; j++) {
            const int c = lane + 32 * j;
            q[k][j] = k < n && c < DCH ? __ldg(row + c) : make_uint4(0, 0, 0, 0);
        }
    }
#pragma unroll
    for (int k = 0; k < RIF; k++) {
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < 3; j++) {
            const int c = lane + 32 * j;
            if (c < DCH) {
                const signed char* b = (const signed char*)&q[k][j];
                const float* xv = xsh + c;
#pragma unroll
                for (int t = 0; t < 16; t++) acc += (float)b[t] * xv[t * DCH];
            }
        }
        out[k] = warp_sum(acc) * (1.f / 4096.f);
    }
}

// Row `rr` of key head `kh` (global row g) after its dot product v: through the causal conv of
// width 4 and silu where it is a q, k or v row (its history of 3 in `cs`, updated), else as is.
__device__ __forceinline__ float finish_row(int kh, int rr, float v, const float* cw, float* cs) {
    if (rr >= CONV_KH) return v;
    const int ch = kh * CONV_KH + rr;
    const float* w = cw + ch * 4;
    float* h = cs + ch * 3;
    const float h0 = h[0], h1 = h[1], h2 = h[2];
    const float c = w[0] * h0 + w[1] * h1 + w[2] * h2 + w[3] * v;
    h[0] = h1;
    h[1] = h2;
    h[2] = v;
    return silu(c);
}

// Sum of squares of v[0..D) by threads 0..D-1 (4 warps), in a fixed order; every thread of the
// block calls it (two barriers). `red` holds 4 floats.
__device__ __forceinline__ float sumsq_d(const float* v, float* red) {
    const int t = threadIdx.x;
    const float s = warp_sum(t < D ? v[t] * v[t] : 0.f);
    if ((t & 31) == 0 && t < D) red[t >> 5] = s;
    __syncthreads();
    const float r = red[0] + red[1] + red[2] + red[3];
    __syncthreads();
    return r;
}

// A state column's part: column j of a value head's state (S: D x D, row-major), rows
// p * PR .. (p + 1) * PR, held in registers from before the launch's wait (the state is the
// layer's own, written a token earlier).
#define PARTS 4
#define PR (D / PARTS)
__device__ __forceinline__ void load_part(const float* S, int j, int p, float (&s)[PR]) {
#pragma unroll
    for (int i = 0; i < PR; i++) s[i] = S[(p * PR + i) * D + j];
}

// The delta rule on the block's columns, PARTS threads a column (thread t: column t % cols, part
// t / cols): decay g, the key kn and beta, then the output against the query qn; the parts' sums
// through `sh` (PARTS x cols floats) added in part order. Every thread calls it; returns o of
// column t % cols. Writes the state back.
__device__ __forceinline__ float recur_part(float* S, int j, int p, int cols, float (&s)[PR], const float* qn,
                                            const float* kn, float v, float g, float beta, float* sh) {
    const int jl = threadIdx.x % cols;
    float kv = 0.f;
#pragma unroll
    for (int i = 0; i < PR; i++) kv += s[i] * kn[p * PR + i];
    sh[p * cols + jl] = kv;
    __syncthreads();
    float kt = 0.f;
#pragma unroll
    for (int q = 0; q < PARTS; q++) kt += sh[q * cols + jl];
    kt *= g;
    const float delta = (v - kt) * beta;
    __syncthreads();
    float o = 0.f;
#pragma unroll
    for (int i = 0; i < PR; i++) {
        s[i] = s[i] * g + kn[p * PR + i] * delta;
        S[(p * PR + i) * D + j] = s[i];
        o += s[i] * qn[p * PR + i];
    }
    sh[p * cols + jl] = o;
    __syncthreads();
    float ot = 0.f;
#pragma unroll
    for (int q = 0; q < PARTS; q++) ot += sh[q * cols + jl];
    __syncthreads();
    return ot;
}

// q and k (qk[0..D), qk[D..2D)) normalised in place (q also by 1 / sqrt(D)); every thread calls it.
__device__ __forceinline__ void norm_qk(float* qk, float* red) {
    const float sq = sumsq_d(qk, red), sk = sumsq_d(qk + D, red);
    const float iq = rsqrtf(sq + 1e-6f) * rsqrtf((float)D), ik = rsqrtf(sk + 1e-6f);
    const int t = threadIdx.x;
    if (t < D) {
        qk[t] *= iq;
        qk[D + t] *= ik;
    }
    __syncthreads();
}

__device__ __forceinline__ float decay_of(float a) { return expf(-log1pf(expf(a))); }
__device__ __forceinline__ float beta_of(float b) { return 1.f / (1.f + expf(-b)); }

// ---- Two launches a layer ----

// The projection: warp gw takes rows gw, gw + nw, ... in groups of RIF; writes every row finished.
extern "C" __global__ void __launch_bounds__(256) gdn_proj(const signed char* __restrict__ w, const float* x,
                                                           const float* cw, float* cs, float* rows) {
    __shared__ float xsh[XN];
    dep_start();
    stage_x(x, xsh);
    const int nw = gridDim.x * (blockDim.x >> 5), gw = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int total = KH * ROWS_KH;
    for (int base = gw; base < total; base += nw * RIF) {
        int r[RIF], n = 0;
#pragma unroll
        for (int k = 0; k < RIF; k++) {
            r[k] = base + k * nw;
            if (r[k] < total) n = k + 1;
        }
        float v[RIF];
        rows_dot(w, r, n, xsh, v);
        if ((threadIdx.x & 31) == 0) {
            for (int k = 0; k < n; k++) rows[r[k]] = finish_row(r[k] / ROWS_KH, r[k] % ROWS_KH, v[k], cw, cs);
        }
    }
}

// The recurrence: a block of PARTS x 128 threads per value head (a column's parts in threads t,
// t + 128, ...); the state's parts loaded before the wait; the two halves' sums of squares (warps
// 0-1 and 2-3) added in order, as the clusters' partner blocks do.
extern "C" __global__ void __launch_bounds__(PARTS * D) gdn_recur(const float* rows, float* state, float* y) {
    __shared__ float qk[2 * D];
    __shared__ float red[4];
    __shared__ float pw[4];
    __shared__ float sh[PARTS * D];
    const int vh = blockIdx.x, kh = vh / VPK, vl = vh % VPK, t = threadIdx.x, j = t % D, p = t / D;
    float* S = state + (size_t)vh * D * D;
    float s[PR];
    load_part(S, j, p, s);
    dep_start();
    const float* hr = rows + kh * ROWS_KH;
    for (int i = t; i < 2 * D; i += blockDim.x) qk[i] = __ldcg(hr + i);
    const float v = __ldcg(hr + 2 * D + vl * D + j), z = __ldcg(hr + 2 * D + VPK * D + vl * D + j);
    const float g = decay_of(__ldcg(hr + 2 * D + 2 * VPK * D + vl));
    const float beta = beta_of(__ldcg(hr + 2 * D + 2 * VPK * D + VPK + vl));
    __syncthreads();
    norm_qk(qk, red);
    const float o = recur_part(S, j, p, D, s, qk, qk + D, v, g, beta, sh);
    const float ss = warp_sum(o * o);
    if (t < D && (t & 31) == 0) pw[t >> 5] = ss;
    __syncthreads();
    const float total = (pw[0] + pw[1]) + (pw[2] + pw[3]);
    if (t < D) y[vh * D + t] = o * rsqrtf(total / (float)D + 1e-6f) * silu(z);
}

// ---- One launch a layer, a cluster of CL blocks per key head ----

// A float of block `rank`'s shared memory at the address of `p` in this block's.
__device__ __forceinline__ float ld_cluster(const float* p, unsigned rank) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p), b;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(b) : "r"(a), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(b) : "memory");
    return v;
}

// Row rr of the key head: in block rr / ROWS_PB's `part`, at rr % ROWS_PB.
__device__ __forceinline__ float head_row(const float* part, int rr) { return ld_cluster(part + rr % ROWS_PB, rr / ROWS_PB); }

extern "C" __global__ void __launch_bounds__(256) gdn_fused(const signed char* __restrict__ w, const float* x,
                                                            const float* cw, float* cs, float* state, float* y,
                                                            int recur) {
    __shared__ float xsh[XN];
    __shared__ float part[ROWS_PB];
    __shared__ float qk[2 * D];
    __shared__ float red[4];
    __shared__ float pw[2];
    __shared__ float sh[PARTS * 64];
    const unsigned k = cluster_rank();
    const int kh = blockIdx.x / CL, t = threadIdx.x, warp = t >> 5, nwarps = blockDim.x >> 5;
    // Six blocks run half a value head each (columns half * 64 ...; PARTS threads a column, 256
    // threads); the last two only keep their shared memory alive for the others' gathers. Their
    // state's parts are loaded before the wait. (`recur` 0: none runs, the projection's time.)
    const bool runs = recur && k < 2 * VPK;
    const int vl = k >> 1, half = k & 1, vh = kh * VPK + vl, jc = half * 64 + t % 64, p = t / 64;
    float* S = state + (size_t)vh * D * D;
    float s[PR];
    if (runs) load_part(S, jc, p, s);
    dep_start();
    stage_x(x, xsh);
    const int lo = k * ROWS_PB, hi = min(ROWS_KH, lo + ROWS_PB), mine = hi - lo;
    // The block's rows: warp w takes rows lo + w, lo + w + nwarps, ... in groups of RIF.
    for (int base = warp; base < mine; base += nwarps * RIF) {
        int r[RIF], n = 0;
#pragma unroll
        for (int j = 0; j < RIF; j++) {
            r[j] = kh * ROWS_KH + lo + base + j * nwarps;
            if (base + j * nwarps < mine) n = j + 1;
        }
        float v[RIF];
        rows_dot(w, r, n, xsh, v);
        if ((t & 31) == 0) {
            for (int j = 0; j < n; j++) part[base + j * nwarps] = finish_row(kh, lo + base + j * nwarps, v[j], cw, cs);
        }
    }
    cluster_arrive();
    cluster_wait();
    float o = 0.f, z = 0.f;
    if (runs) {
        for (int i = t; i < 2 * D; i += blockDim.x) qk[i] = head_row(part, i);
    }
    float v = 0.f, g = 0.f, beta = 0.f;
    if (runs) {
        v = head_row(part, 2 * D + vl * D + jc);
        z = head_row(part, 2 * D + VPK * D + vl * D + jc);
        g = decay_of(head_row(part, 2 * D + 2 * VPK * D + vl));
        beta = beta_of(head_row(part, 2 * D + 2 * VPK * D + VPK + vl));
    }
    __syncthreads();
    norm_qk(qk, red);
    // (Every thread takes part: the parts' barriers.)
    if (runs) {
        o = recur_part(S, jc, p, 64, s, qk, qk + D, v, g, beta, sh);
    }
    const float ss = warp_sum(t < 64 ? o * o : 0.f);
    if (t < 64 && (t & 31) == 0) pw[t >> 5] = ss;
    // Every block has read what it gathers and written its half's sum: the partners exchange them.
    cluster_arrive();
    cluster_wait();
    if (runs && t < 64) {
        const float mine_s = pw[0] + pw[1], other = ld_cluster(pw, k ^ 1) + ld_cluster(pw + 1, k ^ 1);
        const float total = half == 0 ? mine_s + other : other + mine_s;
        y[vh * D + half * 64 + t] = o * rsqrtf(total / (float)D + 1e-6f) * silu(z);
    }
    // No block leaves while its partner may still read its sums.
    cluster_arrive();
    cluster_wait();
}
"#;

const KERNELS: [&str; 3] = ["gdn_proj", "gdn_recur", "gdn_fused"];

/// The source with clusters of `cl` blocks a key head instead of 8 (16: the largest the H200
/// schedules, a non-portable size, so that the projection keeps 256 blocks).
fn source_with_clusters_of(cl: usize) -> String {
    let s = SOURCE.replacen("#define CL 8 ", &format!("#define CL {cl} "), 1);
    assert!(cl == 8 || s != SOURCE, "the source's cluster size was not replaced");
    s
}

/// The probe's kernels compile (so the measurement does not fail on the GPU machine for a typo),
/// with clusters of 8 and of 16.
#[test]
fn probe_kernels_compile() {
    for cl in [8, 16] {
        let Some(p) = probe::compiled(&source_with_clusters_of(cl), &KERNELS) else { return };
        assert!(p.contains("barrier.cluster.arrive") && p.contains("mapa.shared::cluster"));
    }
}

#[test]
#[ignore = "a measurement on the GPU machine; see the file's header"]
fn gdn_cluster_probe() {
    let gpu = Gpu::new().unwrap();
    let f = probe::load(&gpu, SOURCE, &KERNELS);
    let (fproj, frec, ffused) = (f[0], f[1], f[2]);
    let ffused16 = probe::load(&gpu, &source_with_clusters_of(16), &["gdn_fused"])[0];
    probe::allow_large_clusters(ffused16);
    // Small pseudo-random values: int8 weights, conv weights near 1/4, states near 0.
    let hash = |i: usize, seed: usize| ((i + seed).wrapping_mul(2654435761) >> 13) as u32;
    let rows = KH * ROWS_KH;
    let wbytes: Vec<u8> = (0..LAYERS * rows * XN).map(|i| hash(i, 1) as u8).collect();
    let w = gpu.alloc(wbytes.len(), "weights").unwrap();
    gpu.htod(w.ptr, &wbytes).unwrap();
    let cw_host: Vec<f32> =
        (0..LAYERS * KH * CONV_KH * 4).map(|i| 0.25 + (hash(i, 3) % 100) as f32 * 0.001 - 0.05).collect();
    let cw = gpu.alloc(cw_host.len() * 4, "conv weights").unwrap();
    gpu.htod(cw.ptr, &cw_host).unwrap();
    let cs0: Vec<f32> = (0..LAYERS * KH * CONV_KH * 3).map(|i| (hash(i, 5) % 200) as f32 * 0.01 - 1.0).collect();
    let cs = gpu.alloc(cs0.len() * 4, "conv state").unwrap();
    let st0: Vec<f32> = (0..LAYERS * KH * VPK * D * D).map(|i| (hash(i, 7) % 200) as f32 * 0.0005 - 0.05).collect();
    let st = gpu.alloc(st0.len() * 4, "recurrent state").unwrap();
    // Outputs: LAYERS + 1 vectors of YN floats (vector 0's first XN the first input), the rows.
    let ys = gpu.zeros((LAYERS + 1) * YN * 4, "outputs").unwrap();
    let proj = gpu.zeros(rows * 4, "projected rows").unwrap();
    let x0: Vec<f32> = (0..XN).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.02).collect();
    let y = |i: usize| ys.ptr + (i * YN * 4) as u64;
    let w_at = |i: usize| w.ptr + (i * rows * XN) as u64;
    let cw_at = |i: usize| cw.ptr + (i * KH * CONV_KH * 4 * 4) as u64;
    let cs_at = |i: usize| cs.ptr + (i * KH * CONV_KH * 3 * 4) as u64;
    let st_at = |i: usize| st.ptr + (i * KH * VPK * D * D * 4) as u64;
    println!(
        "# GDN cluster probe: {LAYERS} layers of {rows} rows x {XN} (8-bit, {:.2} MB) and {} states of {D} x {D} ({:.2} MB)",
        (rows * XN) as f64 / 1e6,
        KH * VPK,
        (KH * VPK * D * D * 4) as f64 / 1e6
    );
    let gpu = &gpu;
    let two = |recur: bool| {
        move || -> anyhow::Result<()> {
            for i in 0..LAYERS {
                // SAFETY: the kernels' parameters (weights, input, conv weights and state, rows;
                // rows, state, output) and their dep_start().
                unsafe {
                    launch(
                        gpu,
                        fproj,
                        264,
                        256,
                        1,
                        &[
                            Arg::Ptr(w_at(i)),
                            Arg::Ptr(y(i)),
                            Arg::Ptr(cw_at(i)),
                            Arg::Ptr(cs_at(i)),
                            Arg::Ptr(proj.ptr),
                        ],
                    )?;
                    if recur {
                        launch(
                            gpu,
                            frec,
                            (KH * VPK) as u32,
                            (4 * D) as u32,
                            1,
                            &[Arg::Ptr(proj.ptr), Arg::Ptr(st_at(i)), Arg::Ptr(y(i + 1))],
                        )?;
                    }
                }
            }
            Ok(())
        }
    };
    // The clustered launch compiled for clusters of `cl` blocks (`f`).
    let fused = |f: cudarc::driver::sys::CUfunction, cl: usize, recur: bool| {
        move || -> anyhow::Result<()> {
            for i in 0..LAYERS {
                // SAFETY: as above; KH clusters of `cl` blocks, the size `f` was compiled for.
                unsafe {
                    launch(
                        gpu,
                        f,
                        (KH * cl) as u32,
                        256,
                        cl as u32,
                        &[
                            Arg::Ptr(w_at(i)),
                            Arg::Ptr(y(i)),
                            Arg::Ptr(cw_at(i)),
                            Arg::Ptr(cs_at(i)),
                            Arg::Ptr(st_at(i)),
                            Arg::Ptr(y(i + 1)),
                            Arg::I32(i32::from(recur)),
                        ],
                    )?;
                }
            }
            Ok(())
        }
    };
    let median_us = |graph: &cherenkov_cuda::gpu::Graph| probe::median_us(gpu, graph, LAYERS);
    // One replay from the initial states; the last layer's output bits.
    let outputs = |graph: &cherenkov_cuda::gpu::Graph| -> Vec<u32> {
        gpu.htod(cs.ptr, &cs0).unwrap();
        gpu.htod(st.ptr, &st0).unwrap();
        gpu.htod(ys.ptr, &vec![0f32; (LAYERS + 1) * YN]).unwrap();
        gpu.htod(ys.ptr, &x0).unwrap();
        gpu.replay(graph).unwrap();
        gpu.sync().unwrap();
        let mut out = vec![0f32; YN];
        gpu.dtoh(y(LAYERS), &mut out).unwrap();
        out.iter().map(|v| v.to_bits()).collect()
    };
    let g_two = gpu.capture(two(true)).unwrap();
    let want = outputs(&g_two);
    let finite = want.iter().all(|&b| f32::from_bits(b).is_finite());
    let nonzero = want.iter().filter(|&&b| f32::from_bits(b) != 0.0).count();
    println!("# last layer's outputs: {nonzero} of {YN} nonzero, all finite: {finite}");
    assert!(nonzero > YN / 2 && finite, "the chain's outputs are degenerate: the probe measures nothing");
    println!("{:64} {:8.2} us/layer", "two launches a layer (264 + 48 blocks), PDL, graph", median_us(&g_two));
    let g_proj = gpu.capture(two(false)).unwrap();
    println!("{:64} {:8.2} us/layer", "the projection's launch alone (264 blocks)", median_us(&g_proj));
    for (f, cl) in [(ffused, 8), (ffused16, 16)] {
        match gpu.capture(fused(f, cl, true)) {
            Ok(g) => {
                let got = outputs(&g);
                let differ = got.iter().zip(&want).filter(|(a, b)| a != b).count();
                let us = median_us(&g);
                let what = format!("one launch a layer, {} blocks in clusters of {cl}", KH * cl);
                if differ == 0 {
                    println!("{what:64} {us:8.2} us/layer");
                } else {
                    let worst = got
                        .iter()
                        .zip(&want)
                        .map(|(a, b)| (f32::from_bits(*a) - f32::from_bits(*b)).abs())
                        .fold(0f32, f32::max);
                    println!("{what:64} {us:8.2} us/layer  [{differ} OUTPUTS DIFFER, worst {worst:.3e}]");
                }
            }
            Err(e) => println!("one launch a layer, clusters of {cl}: not run: {e:#}"),
        }
        match gpu.capture(fused(f, cl, false)) {
            Ok(g) => {
                println!("{:64} {:8.2} us/layer", "its projection alone (no block runs the recurrence)", median_us(&g))
            }
            Err(e) => println!("the projection alone in clusters of {cl}: not run: {e:#}"),
        }
    }
}
