//! Does a tensor-core core beat the engine's tiled dp4a core for 4-bit rows, and make extra input
//! rows nearly free? `rows_probe` found that the tiled core pays 1.25x a launch for a second row on
//! the GDN in_proj and 1.6-1.7x on the layer's other 4-bit matrices, so a verifying pass over two
//! rows would cost about 1.5x a step. This probe times two versions of an `mma.m16n8k32` (u8 x s8)
//! core over 1, 2 and 4 input rows, on the rows probes' shapes and two stand-ins for the engine's
//! expert table launches, beside the engine's `matvec_q4`, `matvec_q4_x2` and `_x4` (ignored by
//! default; needs a GPU):
//!
//!     cargo test --release -p cherenkov-cuda --test mma_probe --no-run   # prints the binary
//!     <binary> --ignored --nocapture        (on the GPU machine, with NVRTC on LD_LIBRARY_PATH)
//!
//! The core: a tile is 16 rows; S warps share a tile (8 / S tiles a block of 256 threads), each
//! taking every S-th quad (4 chunks of 32 inputs, two groups of 64) with P quads' loads in flight,
//! the first P requested before the wait (`mma_sp_rows_core`). x is staged as digits with one
//! scale a group (the engine's `mvd_stage<.., 16>`); a group's two chunks sum as integers in the
//! mma's accumulator (B column n is digit n / 2 of input row n % 2, a second mma for rows 2 and 3);
//! a reduce-scatter over the four lanes of a group weighs the digits, and the group's scale and
//! bias are applied once. The tile's warps meet in shared memory where S > 1.
//! - v5 reads the weights and the scales and biases in fragment order (`mma_relayout`,
//!   `mma_relayout_sb`: a lane's words of a quad are one uint4 a row, its row's two (scale, bias)
//!   pairs one 8-byte load).
//! - v6 reads them as stored: a group's 32 bytes a row are read by the group's four lanes, 8 each,
//!   and the mma's k slots follow that order (B reads the matching digits), so the engine's records
//!   could be used as they are (the engine version of this core is
//!   `benchmark/branches/s49-experts-mma.patch`).
//!
//! The sweep runs S in {1, 2, 4, 8} and P in {2, 4, 8} for both and prints every setting and the
//! best. Every kernel is checked against the engine to 1e-5 of the output's scale (its sums go in
//! another order and x's scale is a group's, so not bit for bit); a "WRONG" line fails the test.
//! Versions 1-4 (a block a tile, scales loaded as stored, x scaled a chunk) were measured in
//! session 49 and dropped: `benchmark/notes-cuda.md`, "Session 49", and
//! `benchmark/results/mma-probe-2026-12-04-s4{8,9}*.txt`. After those runs v5 and v6 were
//! restructured to share one loop and to stage with the engine's function; their PTX differs from
//! the measured build's in a handful of address and staging instructions, and that form has not
//! run on a GPU yet.

mod probe;

use cherenkov_cuda::gpu::{Arg, Gpu};
use cherenkov_cuda::weights::{rows_staging_bytes, tile_plan, tiled_shmem};
use probe::{GS, Mat, time};

const PROBE: &str = r#"
// Fragment order: for tile T (16 rows), quad Q (chunks 4Q..4Q+3), lane (g, t): F[2 id] is word t
// of those 4 chunks of row 16T + g, F[2 id + 1] of row 16T + g + 8 (id = (T NQ + Q) 32 + lane).
extern "C" __global__ void mma_relayout(const u32* __restrict__ W, uint4* F, int rows, int C) {
    const int NQ = C >> 2;
    const size_t id = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= (size_t)(rows >> 4) * NQ * 32) return;
    const int lane = id & 31, g = lane >> 2, t = lane & 3;
    const size_t tq = id >> 5;
    const int Q = tq % NQ, T = tq / NQ;
    for (int h = 0; h < 2; h++) {
        const u32* w = W + ((size_t)T * 16 + g + 8 * h) * C * 4 + (size_t)Q * 16 + t;
        F[id * 2 + h] = make_uint4(w[0], w[4], w[8], w[12]);
    }
}

// One m16n8k32 step of versions 5 and 6: word w0 of row g and w1 of row g + 8 (8 codes each, as
// unsigned bytes: the even codes at k 4t.., the odd at 16 + 4t..) against B (b0, b1), summed into d.
__device__ __forceinline__ void mma_codes(int (&d)[4], u32 w0, u32 w1, u32 b0, u32 b1) {
    const u32 a0 = w0 & 0x0F0F0F0Fu, a2 = (w0 >> 4) & 0x0F0F0F0Fu;
    const u32 a1 = w1 & 0x0F0F0F0Fu, a3 = (w1 >> 4) & 0x0F0F0F0Fu;
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The reduce-scatter of the digit sums d (weighed by wdig, 256^t) over a group's four lanes: lane
// t ends with the total of row g (t < 2) or g + 8, input row t % 2 (of the mma's pair).
__device__ __forceinline__ float mma_lane_sum(const int (&d)[4], float wdig, int t) {
    float v[4];
#pragma unroll
    for (int k = 0; k < 4; k++) v[k] = (float)d[k] * wdig;
    const bool hi = t & 2;
    const int jj = t & 1;
    const float keep0 = hi ? v[2] : v[0], keep1 = hi ? v[3] : v[1];
    const float give0 = hi ? v[0] : v[2], give1 = hi ? v[1] : v[3];
    const float u0 = keep0 + __shfl_xor_sync(0xffffffffu, give0, 2);
    const float u1 = keep1 + __shfl_xor_sync(0xffffffffu, give1, 2);
    return (jj ? u1 : u0) + __shfl_xor_sync(0xffffffffu, jj ? u0 : u1, 1);
}

// Version 5's quad: a group's two chunks summed as integers in the mma's accumulator and the
// epilogue (the lanes' reduce-scatter, the group's scale and bias) once a group, over x staged with
// one scale a group; the weights and scales in fragment order.
template <int NX>
__device__ __forceinline__ void mma5_quad(const uint4 fa, const uint4 fb, const u32 (&sb)[4], int q, int C, int X4,
                                          int g, int t, float (&tot)[(NX + 1) / 2]) {
    extern __shared__ float4 mv_smem[];
    constexpr int MM = (NX + 1) / 2;
    const int dg = g >> 1, jj = t & 1;
    const float wdig = t == 0 ? 1.0f : t == 1 ? 256.0f : t == 2 ? 65536.0f : 0.0f;
    constexpr int CH = 2;  // the chunks of a group of 64
#pragma unroll
    for (int j0 = 0; j0 < 4; j0 += CH) {
        const float scale = __uint_as_float(sb[j0] << 16), bias = __uint_as_float(sb[j0] & 0xffff0000u);
#pragma unroll
        for (int m = 0; m < MM; m++) {
            const int rr = 2 * m + (g & 1);
            int d[4] = {0, 0, 0, 0};
#pragma unroll
            for (int j = j0; j < j0 + CH; j++) {
                const int c = 4 * q + j;
                u32 b0 = 0, b1 = 0;
                if (dg < 3 && rr < NX) {
                    const u32* base = (const u32*)(mv_smem + rr * X4 + c * MVD_CHUNK) + 12 * (t >> 1) + 6 * (t & 1);
                    b0 = base[2 * dg];
                    b1 = base[2 * dg + 1];
                }
                mma_codes(d, mv_word(fa, j), mv_word(fb, j), b0, b1);
            }
            const float sq = mma_lane_sum(d, wdig, t);
            const int r = 2 * m + jj;
            if (r < NX) {
                const float2 mt = mvd_meta(mv_smem + r * X4, C)[4 * q + j0];
                tot[m] = fmaf(scale * mt.x, sq, fmaf(bias, mt.y, tot[m]));
            }
        }
    }
}

// The scales and biases in fragment order (version 5; groups of 64 inputs): a tile's quad
// holds its 16 rows' two (scale, bias) pairs, 128 bytes, so a lane loads its row's pairs with one
// 8-byte load instead of eight 2-byte loads spread over 16 rows.
extern "C" __global__ void mma_relayout_sb(const u16* __restrict__ S, const u16* __restrict__ B, u32* SB, int rows,
                                           int C) {
    const int NQ = C >> 2, gpr = C >> 1;
    const size_t id = (size_t)blockIdx.x * blockDim.x + threadIdx.x;  // (T, Q, o, h)
    if (id >= (size_t)(rows >> 4) * NQ * 32) return;
    const int h = id & 1, o = (id >> 1) & 15;
    const size_t tq = id >> 5;
    const int Q = tq % NQ, T = tq / NQ;
    const size_t gi = ((size_t)T * 16 + o) * gpr + 2 * Q + h;
    SB[id] = (u32)S[gi] | ((u32)B[gi] << 16);
}

// The loop versions 5 and 6 share: S warps a tile (8 / S tiles a block of 8 warps), P quads of
// weights in flight a warp (the first P requested before the wait), x staged with one scale a
// group of 64 inputs (mvd_stage<.., 16>), and the tile's warps' sums met in shared memory where
// S > 1. `Ld` locates a tile's quads and takes one (`Stage` its registers: load(q, st) and
// quad<NX>(st, q, C, X4, g, t, tot)).
template <int NX, int S, int P, class Ld>
__device__ __forceinline__ void mma_sp_rows_core(const Ld& ld, const float* __restrict__ x, float* y, int rows,
                                                 int cols, int T, bool live) {
    extern __shared__ float4 mv_smem[];
    __shared__ float red[8][16][NX];
    constexpr int MM = (NX + 1) / 2;
    const int C = cols >> 5, NQ = C >> 2;
    const int X4 = mvd_rows_float4s(cols);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int tpb = nw / S, sub = warp % S;
    const int orow = g + 8 * (t >> 1), jj = t & 1;
    const size_t grow = (size_t)T * 16 + orow;
    typename Ld::Stage st[P];
#pragma unroll
    for (int p = 0; p < P; p++) ld.load(sub + p * S, st[p]);
    grid_enter();
#pragma unroll
    for (int r = 0; r < NX; r++) mvd_stage<MvLdX, 16>(x + (size_t)r * cols, MV_IN_NONE, mv_smem + r * X4, cols, nullptr);
    float tot[MM];
#pragma unroll
    for (int m = 0; m < MM; m++) tot[m] = 0.0f;
    if (live) {
        for (int q = sub; q < NQ; q += P * S) {
#pragma unroll
            for (int p = 0; p < P; p++) {
                const int qq = q + p * S;
                if (qq < NQ) ld.template quad<NX>(st[p], qq, C, X4, g, t, tot);
                ld.load(qq + P * S, st[p]);
            }
        }
    }
    if constexpr (S == 1) {
#pragma unroll
        for (int m = 0; m < MM; m++) {
            const int r = 2 * m + jj;
            if (live && r < NX && grow < (size_t)rows) y[(size_t)r * rows + grow] = tot[m];
        }
    } else {
#pragma unroll
        for (int m = 0; m < MM; m++) {
            const int r = 2 * m + jj;
            if (r < NX) red[warp][orow][r] = tot[m];
        }
        __syncthreads();
        for (int i = threadIdx.x; i < tpb * 16 * NX; i += blockDim.x) {
            const int tl = i / (16 * NX), rem = i % (16 * NX), o = rem & 15, r = rem >> 4;
            float v = 0.0f;
            for (int s = 0; s < S; s++) v += red[tl * S + s][o][r];
            const size_t row = ((size_t)blockIdx.x * tpb + tl) * 16 + o;
            if (row < (size_t)rows) y[(size_t)r * rows + row] = v;
        }
    }
}

// Version 5's quads: weights and scales in fragment order (mma_relayout, mma_relayout_sb).
struct FragLd {
    struct Stage {
        uint4 a, b;
        u32 sb[4];
    };
    const uint4* F;
    const uint2* SB;
    size_t tq0;  // T * NQ
    int NQ, lane, orow;
    bool live;
    __device__ __forceinline__ void load(int q, Stage& st) const {
        if (live && q < NQ) {
            const uint4* p = F + ((tq0 + q) * 32 + lane) * 2;
            st.a = p[0];
            st.b = p[1];
            const uint2 v = __ldg(SB + (tq0 + q) * 16 + orow);
            st.sb[0] = st.sb[1] = v.x;
            st.sb[2] = st.sb[3] = v.y;
        }
    }
    template <int NX>
    __device__ __forceinline__ void quad(const Stage& st, int q, int C, int X4, int g, int t,
                                         float (&tot)[(NX + 1) / 2]) const {
        mma5_quad<NX>(st.a, st.b, st.sb, q, C, X4, g, t, tot);
    }
};

template <int NX, int S, int P>
__device__ __forceinline__ void mma5_rows_core(const uint4* __restrict__ F, const u16* __restrict__ SB,
                                               const float* __restrict__ x, float* y, int rows, int cols) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, t = lane & 3;
    const int T = blockIdx.x * ((blockDim.x >> 5) / S) + warp / S, NQ = cols >> 7;
    const bool live = T * 16 < rows;
    const FragLd ld{F, (const uint2*)SB, (size_t)T * NQ, NQ, lane, (lane >> 2) + 8 * (t >> 1), live};
    mma_sp_rows_core<NX, S, P>(ld, x, y, rows, cols, T, live);
}

// (Sc is the relaid image mma_relayout_sb wrote; B is unused.)
#define MMA5_ROWS(NX, S, P)                                                                                    \
    extern "C" __global__ void __launch_bounds__(256) mma5_rows##NX##_s##S##_p##P(                             \
        const uint4* F, const u16* Sc, const u16* B, const float* x, float* y, int rows, int cols, int gs) {  \
        mma5_rows_core<NX, S, P>(F, Sc, x, y, rows, cols);                                                     \
    }
#define MMA5_ROWS_P(NX, P) MMA5_ROWS(NX, 1, P) MMA5_ROWS(NX, 2, P) MMA5_ROWS(NX, 4, P) MMA5_ROWS(NX, 8, P)
#define MMA5_ROWS_NX(NX) MMA5_ROWS_P(NX, 2) MMA5_ROWS_P(NX, 4) MMA5_ROWS_P(NX, 8)
MMA5_ROWS_NX(1)
MMA5_ROWS_NX(2)
MMA5_ROWS_NX(4)

// Version 6: v5's arithmetic over the weights and scales as stored (row-major 4-bit rows, scales
// and biases row-major a group), no relayout. The mma's k slots need not follow the inputs'
// order, only agree between A and B: for group h of a quad, lane (g, t) loads the 8 bytes at 8t of
// rows g and g + 8 (words 2t and 2t + 1 of the group's 8: 32 contiguous bytes a row across the
// four lanes), the first mma takes words 2t, the second words 2t + 1, and B reads the digits of
// those words from mvd_stage's layout. Both mmas stay inside the group, so v5's per-group epilogue
// holds. A lane's row's scales and biases for the quad's two groups are one u32 each.
template <int NX>
__device__ __forceinline__ void mma6_quad(const uint2 (&ra)[2], const uint2 (&rb)[2], u32 sc, u32 bi, int q, int C,
                                          int X4, int g, int t, float (&tot)[(NX + 1) / 2]) {
    extern __shared__ float4 mv_smem[];
    constexpr int MM = (NX + 1) / 2;
    const int dg = g >> 1, jj = t & 1;
    const float wdig = t == 0 ? 1.0f : t == 1 ? 256.0f : t == 2 ? 65536.0f : 0.0f;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int grp = 2 * q + h;
        const float scale = __uint_as_float((h ? sc >> 16 : sc & 0xffffu) << 16);
        const float bias = __uint_as_float((h ? bi >> 16 : bi & 0xffffu) << 16);
#pragma unroll
        for (int m = 0; m < MM; m++) {
            const int rr = 2 * m + (g & 1);
            int d[4] = {0, 0, 0, 0};
#pragma unroll
            for (int k = 0; k < 2; k++) {
                u32 b0 = 0, b1 = 0;
                if (dg < 3 && rr < NX) {
                    // This lane's B slots are those of group word 2t + k (chunk 2 grp + (2t + k) / 4).
                    const int wd = 2 * t + k;
                    const u32* base = (const u32*)(mv_smem + rr * X4 + (2 * grp + (wd >> 2)) * MVD_CHUNK) + 6 * (wd & 3);
                    b0 = base[2 * dg];
                    b1 = base[2 * dg + 1];
                }
                mma_codes(d, k ? ra[h].y : ra[h].x, k ? rb[h].y : rb[h].x, b0, b1);
            }
            const float sq = mma_lane_sum(d, wdig, t);
            const int r = 2 * m + jj;
            if (r < NX) {
                const float2 mt = mvd_meta(mv_smem + r * X4, C)[2 * grp];
                tot[m] = fmaf(scale * mt.x, sq, fmaf(bias, mt.y, tot[m]));
            }
        }
    }
}

// Version 6's quads: weights, scales and biases as stored.
struct StoredLd {
    struct Stage {
        uint2 a[2], b[2];
        u32 sc, bi;
    };
    const u32* ra_row;  // row g's first word for this lane (8 bytes at 8t of each group)
    const u32* rb_row;  // row g + 8's
    const u32* sc_row;  // this lane's row's scales, two groups a u32
    const u32* bi_row;
    int NQ;
    bool live;
    __device__ __forceinline__ void load(int q, Stage& st) const {
        if (live && q < NQ) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                st.a[h] = __ldg((const uint2*)(ra_row + (2 * q + h) * 8));
                st.b[h] = __ldg((const uint2*)(rb_row + (2 * q + h) * 8));
            }
            st.sc = __ldg(sc_row + q);
            st.bi = __ldg(bi_row + q);
        }
    }
    template <int NX>
    __device__ __forceinline__ void quad(const Stage& st, int q, int C, int X4, int g, int t,
                                         float (&tot)[(NX + 1) / 2]) const {
        mma6_quad<NX>(st.a, st.b, st.sc, st.bi, q, C, X4, g, t, tot);
    }
};

template <int NX, int S, int P>
__device__ __forceinline__ void mma6_rows_core(const u32* __restrict__ W, const u16* __restrict__ Sc,
                                               const u16* __restrict__ B, const float* __restrict__ x, float* y,
                                               int rows, int cols, int gs) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int T = blockIdx.x * ((blockDim.x >> 5) / S) + warp / S;
    const bool live = T * 16 < rows;
    const int C = cols >> 5, gpr = cols / gs;
    const size_t grow = (size_t)T * 16 + g + 8 * (t >> 1), wpr = (size_t)C * 4;
    const u32* ra_row = W + ((size_t)T * 16 + g) * wpr + 2 * t;
    const StoredLd ld{ra_row, ra_row + 8 * wpr, (const u32*)(Sc + grow * gpr), (const u32*)(B + grow * gpr),
                      C >> 2, live};
    mma_sp_rows_core<NX, S, P>(ld, x, y, rows, cols, T, live);
}

#define MMA6_ROWS(NX, S, P)                                                                                    \
    extern "C" __global__ void __launch_bounds__(256) mma6_rows##NX##_s##S##_p##P(                             \
        const u32* W, const u16* Sc, const u16* B, const float* x, float* y, int rows, int cols, int gs) {    \
        mma6_rows_core<NX, S, P>(W, Sc, B, x, y, rows, cols, gs);                                              \
    }
#define MMA6_ROWS_P(NX, P) MMA6_ROWS(NX, 1, P) MMA6_ROWS(NX, 2, P) MMA6_ROWS(NX, 4, P) MMA6_ROWS(NX, 8, P)
#define MMA6_ROWS_NX(NX) MMA6_ROWS_P(NX, 2) MMA6_ROWS_P(NX, 4) MMA6_ROWS_P(NX, 8)
MMA6_ROWS_NX(1)
MMA6_ROWS_NX(2)
MMA6_ROWS_NX(4)
"#;

/// A kernel of the sweep: version `v` (5: weights and scales in fragment order, 6: as stored), NX
/// input rows, S warps a tile, P quads in flight a warp.
#[derive(Clone, Copy)]
struct SweepKernel {
    nx: usize,
    s: usize,
    p: usize,
    v: usize,
}

impl SweepKernel {
    fn name(&self) -> String {
        format!("mma{}_rows{}_s{}_p{}", self.v, self.nx, self.s, self.p)
    }
}

/// Every version-5 kernel the probe compiles (MMA5_ROWS_NX), then every version-6 kernel.
const SWEEP: [SweepKernel; 72] = {
    let mut v = [SweepKernel { nx: 1, s: 1, p: 2, v: 5 }; 72];
    let (nxs, ss, ps) = ([1, 2, 4], [1, 2, 4, 8], [2, 4, 8]);
    let mut i = 0;
    while i < 72 {
        let j = i % 36;
        v[i] = SweepKernel { nx: nxs[j / 12], s: ss[j % 4], p: ps[(j / 4) % 3], v: if i < 36 { 5 } else { 6 } };
        i += 1;
    }
    v
};

/// The probe's kernels by name: the two relayouts, then [`SWEEP`] in order.
fn kernel_names() -> Vec<String> {
    let mut names = vec!["mma_relayout".to_string(), "mma_relayout_sb".to_string()];
    names.extend(SWEEP.iter().map(|k| k.name()));
    names
}

fn ptx(arch: &'static str) -> String {
    cherenkov_cuda::compile::compile_with_extra(arch, PROBE).unwrap_or_else(|e| panic!("{e:#}"))
}

/// The probe's kernels compile with the engine's source, and without spills where ptxas is given
/// (`CHERENKOV_PTXAS`, as tests/compile.rs), so the measurement does not fail on the GPU machine.
#[test]
fn mma_probe_kernels_compile() {
    if !cherenkov_cuda::compile::nvrtc_available() {
        eprintln!("skipped: NVRTC not found");
        return;
    }
    let p = ptx("sm_90");
    let names = kernel_names();
    for k in &names {
        assert!(p.contains(&format!(".entry {k}(")), "{k}");
    }
    let Some(ptxas) = std::env::var_os("CHERENKOV_PTXAS").map(std::path::PathBuf::from).filter(|p| p.is_file()) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (src, out) = (dir.path().join("probe.ptx"), dir.path().join("probe.cubin"));
    std::fs::write(&src, p).unwrap();
    let mut cmd = std::process::Command::new(&ptxas);
    cmd.args(["-arch=sm_90", "-v"]);
    for k in &names[2..] {
        cmd.args(["-e", k]);
    }
    let run = cmd.arg("-o").arg(&out).arg(&src).output().unwrap();
    let report = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "ptxas failed:\n{report}");
    let mut kernel = String::new();
    let mut reported = 0;
    for line in report.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            kernel = rest.split('\'').next().unwrap_or("?").to_string();
        } else if kernel.starts_with("mma") && (line.contains("spill stores") || line.contains("registers")) {
            eprintln!("{kernel}: {}", line.trim());
            if line.contains("spill stores") {
                // The settings are a sweep: a few bytes of spill are reported, not fatal.
                let bytes =
                    line.split(" bytes spill stores").next().and_then(|s| s.rsplit(' ').next()?.parse::<u32>().ok());
                assert!(bytes <= Some(16), "{kernel} spills: {line}");
                reported += 1;
            }
        }
    }
    assert_eq!(reported, SWEEP.len(), "ptxas's report:\n{report}");
}

#[test]
#[ignore = "a measurement on the GPU machine; see the file's header"]
fn mma_probe() {
    let gpu = Gpu::new().unwrap();
    let (maj, min) = gpu.info.compute_capability;
    let arch = cherenkov_cuda::compile::arch_name(maj, min).unwrap();
    let image = std::ffi::CString::new(ptx(arch)).unwrap();
    gpu.bind().unwrap();
    // SAFETY: a NUL-terminated PTX image holding the engine's kernels and the probe's.
    let module =
        unsafe { cudarc::driver::result::module::load_data(image.as_ptr() as *const std::ffi::c_void).unwrap() };
    let funcs: Vec<_> = kernel_names()
        .iter()
        // SAFETY: the module is loaded and holds each name.
        .map(|k| unsafe {
            cudarc::driver::result::module::get_function(module, std::ffi::CString::new(k.as_str()).unwrap()).unwrap()
        })
        .collect();
    let (relayout, relayout_sb, sweep_funcs) = (funcs[0], funcs[1], &funcs[2..]);
    // The probe's own module: its kernels' dynamic shared memory above 48 KiB (4 staged rows).
    for f in sweep_funcs {
        // SAFETY: setting an attribute of a loaded function.
        unsafe {
            cudarc::driver::result::function::set_function_attribute(
                *f,
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                (4 * rows_staging_bytes(6144)) as i32,
            )
            .unwrap()
        };
    }
    let x = gpu.zeros(4 * 6144 * 4, "probe x").unwrap();
    let xv: Vec<f32> =
        (0..4 * 6144).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0 + (i / 6144) as f32 * 0.01).collect();
    gpu.htod(x.ptr, &xv).unwrap();
    let y = gpu.zeros(4 * 28160 * 4, "probe y").unwrap();
    let y1 = gpu.zeros(4 * 28160 * 4, "probe y, engine").unwrap();
    println!(
        "# mma probe on {}: us per launch, graphs of {} launches with PDL, {} replays",
        gpu.info.name,
        probe::LAUNCHES,
        probe::REPLAYS
    );
    // The rows probes' shapes, then two stand-ins for the engine's expert launches over a table of
    // 11 experts (10 routed and the shared one): their gate/up rows share x, so the launch is one
    // matrix of 11 x 1280 rows; their downs are 11 matrices over their own x, stood in for by one
    // of 11 x 2560 rows over one x.
    let shapes: Vec<(&str, usize, usize)> = probe::ROW_SHAPES
        .into_iter()
        .chain([("11 experts' gate+up 14080x2560", 14080, 2560), ("11 experts' down 28160x640", 28160, 640)])
        .collect();
    assert!(shapes.iter().all(|s| s.1 <= 28160), "y holds 4 rows of at most 28160");
    assert_eq!(GS, 64, "the probe's kernels take groups of 64 inputs");
    let mut failures = 0;
    for (name, rows, cols) in shapes {
        let m = Mat::new(&gpu, rows, cols);
        let chunks = cols / 32;
        // Each copy's weights (mma_relayout, as many bytes) and scales and biases (mma_relayout_sb,
        // a u32 a row and group) in fragment order, for version 5.
        let n = (rows / 16) * (chunks / 4) * 32;
        let relaid = |f, bytes, what, args: &dyn Fn(usize, u64) -> Vec<Arg>| -> Vec<_> {
            (0..m.copies.len())
                .map(|i| {
                    let out = gpu.alloc(bytes, what).unwrap();
                    // SAFETY: the relayout over copy i into `out`, sized for its writes.
                    unsafe { probe::launch(&gpu, f, n.div_ceil(256) as u32, 256, 1, &args(i, out.ptr)).unwrap() };
                    out
                })
                .collect()
        };
        let dims = [Arg::I32(rows as i32), Arg::I32(chunks as i32)];
        let frag = relaid(relayout, rows * cols / 2, "probe fragments", &|i, out| {
            [vec![Arg::Ptr(m.copy(i).0), Arg::Ptr(out)], dims.to_vec()].concat()
        });
        let sbfrag = relaid(relayout_sb, n * 4, "probe scale fragments", &|i, out| {
            let (_, s, b) = m.copy(i);
            [vec![Arg::Ptr(s), Arg::Ptr(b), Arg::Ptr(out)], dims.to_vec()].concat()
        });
        gpu.sync().unwrap();
        println!("\n## {name}: {} copies of {:.2} MB", m.copies.len(), m.bytes() as f64 / 1e6);
        // Sweep kernel k over copy i into yp, blocks of 256 threads.
        let sweep = |k: usize, i: usize, yp: u64| {
            let v = SWEEP[k];
            let (w, s, b) = m.copy(i);
            // Version 6 reads the copy as stored, version 5 its fragment-order images.
            let (w, s) = if v.v == 6 { (w, s) } else { (frag[i % frag.len()].ptr, sbfrag[i % sbfrag.len()].ptr) };
            let args = [
                Arg::Ptr(w),
                Arg::Ptr(s),
                Arg::Ptr(b),
                Arg::Ptr(x.ptr),
                Arg::Ptr(yp),
                Arg::I32(rows as i32),
                Arg::I32(cols as i32),
                Arg::I32(GS as i32),
            ];
            let grid = (rows / 16).div_ceil(8 / v.s) as u32;
            let smem = (v.nx * rows_staging_bytes(cols)) as u32;
            // SAFETY: mma{5,6}_rowsNX_sS_pP(W or F, S or SB, B, x, y, rows, cols, gs) over copy i.
            unsafe { gpu.launch_function(sweep_funcs[k], "mma_rows", (grid, 1, 1), 256, smem, &args, true) }.unwrap();
        };
        // The engine's kernels with its plans: matvec_q4 (one row at a time) and matvec_q4_x{nx}.
        let engine = |nx: usize, i: usize, yp: u64| {
            let (min_blocks, shmem) =
                if nx == 1 { (3, tiled_shmem(4, GS, cols).unwrap()) } else { (2, nx * rows_staging_bytes(cols)) };
            let p = tile_plan(&gpu, rows / 4, chunks, 1, min_blocks, shmem);
            probe::engine_q4(&gpu, nx, &m, i, x.ptr, yp, p.lanes, p.blocks, p.threads);
        };
        // Correctness: each row of every sweep kernel against the engine's matvec_q4 on that row.
        for (k, v) in SWEEP.iter().enumerate() {
            let nx = v.nx;
            sweep(k, 0, y.ptr);
            engine(nx, 0, y1.ptr);
            gpu.sync().unwrap();
            let (mut a, mut b) = (vec![0f32; nx * rows], vec![0f32; nx * rows]);
            gpu.dtoh(y.ptr, &mut a).unwrap();
            gpu.dtoh(y1.ptr, &mut b).unwrap();
            let worst = a.iter().zip(&b).fold(0f32, |w, (p, q)| w.max((p - q).abs()));
            let scale = b.iter().fold(0f32, |w, v| w.max(v.abs()));
            // Said and counted, not asserted at once: one run on the GPU machine reports every shape.
            if worst > 1e-5 * scale.max(1.0) {
                println!(
                    "WRONG: {} against the engine: {worst} (scale {scale}); first rows {:?} against {:?}",
                    v.name(),
                    &a[..4],
                    &b[..4]
                );
                failures += 1;
            }
        }
        // Every setting's time, and the best for each version and number of rows.
        let mut best: [(f64, String); 6] = std::array::from_fn(|_| (f64::MAX, String::new()));
        let mut all = String::new();
        for (k, v) in SWEEP.iter().enumerate() {
            let us = time(&gpu, |i| sweep(k, i, y.ptr));
            let slot = match v.nx {
                1 => 0,
                2 => 1,
                _ => 2,
            } + if v.v == 6 { 3 } else { 0 };
            let label = format!("v{} s{} p{} 256t", v.v, v.s, v.p);
            all += &format!(" {}r {label} {us:.2};", v.nx);
            if us < best[slot].0 {
                best[slot] = (us, label);
            }
        }
        println!("v5/v6 all:{all}");
        for (v, b) in [(5, &best[..3]), (6, &best[3..])] {
            println!(
                "v{v} best: 1 row {:.2} us ({}), 2 rows {:.2} us ({}), 4 rows {:.2} us ({})",
                b[0].0, b[0].1, b[1].0, b[1].1, b[2].0, b[2].1
            );
        }
        let engine_us = [1usize, 2, 4].map(|nx| time(&gpu, |i| engine(nx, i, y1.ptr)));
        println!(
            "engine: 1 row {:.2} us, 2 rows {:.2} us ({:.2}x), 4 rows {:.2} us ({:.2}x); one row {:.0} GB/s",
            engine_us[0],
            engine_us[1],
            engine_us[1] / engine_us[0],
            engine_us[2],
            engine_us[2] / engine_us[0],
            m.bytes() as f64 / (engine_us[0] * 1e-6) / 1e9
        );
    }
    assert_eq!(failures, 0, "the mma core disagreed with the engine (above)");
}
