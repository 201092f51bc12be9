// y = W x for packed weights, one warp per output row. Affine weights are read as stored (u32
// words, bf16 scales and biases) and decoded in registers; no weight is ever expanded in memory.

// ---- Input transforms, applied where x is read or staged (MatvecInput in weights.rs). ----
//
// Every matvec kernel takes (x2, xs, op) next to x and multiplies W by in(x) instead of x:
// MV_IN_PLAIN: x; MV_IN_SILU_SCALED: silu(x * xs) (the hyper-connection read's silu(W_down n / hc),
// the expression of scale_silu in ops.cu); MV_IN_SILU_MUL: silu(x) * x2 (the shared expert's
// silu(gate) * up, the expression of silu_mul); MV_IN_MUL_SIGMOID: x * sigmoid(x2) (the attention
// output gate, the expression of mul_sigmoid); MV_IN_ONE_PLUS: x * (1 + x2) (a zero-centred norm's
// weight, when the norm's scale is folded into the matvec: matvec_many's MvNorm). The tiled
// kernels' per-unit sums are sums of in(x). MV_IN_DIGITS: x, whose producer also wrote it as the
// 4-bit integer path stages it (x2: that image, mvd_put_chunk), so that the tiled 4-bit core copies
// the image instead of converting x in every block; every other kernel and path reads x as plain.
#define MV_IN_PLAIN 0
#define MV_IN_SILU_SCALED 1
#define MV_IN_SILU_MUL 2
#define MV_IN_MUL_SIGMOID 3
#define MV_IN_ONE_PLUS 4
#define MV_IN_DIGITS 5

struct MvIn {
    const float* x2;  // MV_IN_SILU_MUL, MV_IN_MUL_SIGMOID: the second input (indexed like x); MV_IN_DIGITS: the image
    float s;          // MV_IN_SILU_SCALED: the scale
    int op;
};

#define MV_IN_NONE (MvIn{nullptr, 0.0f, MV_IN_PLAIN})

// in(x) for one element (v = x[j], v2 = x2[j], read only for MV_IN_SILU_MUL).
__device__ __forceinline__ float mv_in(float v, float v2, const MvIn& in) {
    return in.op == MV_IN_SILU_SCALED ? siluf_(v * in.s)
           : in.op == MV_IN_SILU_MUL   ? siluf_(v) * v2
           : in.op == MV_IN_MUL_SIGMOID ? v * sigmoidf_(v2)
           : in.op == MV_IN_ONE_PLUS    ? v * (1.0f + v2)
                                        : v;
}

__device__ __forceinline__ bool mv_in_two(const MvIn& in) {
    return in.op == MV_IN_SILU_MUL || in.op == MV_IN_MUL_SIGMOID || in.op == MV_IN_ONE_PLUS;
}

__device__ __forceinline__ float mv_in_at(const float* __restrict__ x, const MvIn& in, int j) {
    return mv_in(x[j], mv_in_two(in) ? in.x2[j] : 0.0f, in);
}

// The transform of a column slice starting at input j0.
__device__ __forceinline__ MvIn mv_in_offset(MvIn in, size_t j0) {
    if (mv_in_two(in)) in.x2 += j0;
    return in;
}

// Stages in(x) (n floats) into shared memory `sx` (all threads of the block take part).
__device__ __forceinline__ void stage_x_in(const float* __restrict__ x, const MvIn& in, float* sx, int n) {
    if (in.op == MV_IN_PLAIN) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) sx[i] = x[i];
    } else {
        for (int i = threadIdx.x; i < n; i += blockDim.x) sx[i] = mv_in_at(x, in, i);
    }
    __syncthreads();
}

// ---- Outputs: where a matvec_q* row goes. ----
//
// y[row] = v, or with `xres` (the hyper-connection residual: hc streams of `rows` floats) v injected
// into every stream instead, as hc_inject (ops.cu) does: xres[s * rows + row] += 2 sigmoid(inj[s] /
// hc) v. Every matvec_q* kernel ends with (xres, inj, hc); DevLinear::matvec_inject passes them.
struct MvOut {
    float* y;
    float* xres;
    const float* inj;
    int hc;
};

__device__ __forceinline__ void mv_out(const MvOut& o, int row, int rows, float v) {
    if (o.xres) {
        for (int s = 0; s < o.hc; s++) o.xres[(size_t)s * rows + row] += 2.0f * sigmoidf_(o.inj[s] / (float)o.hc) * v;
    } else {
        o.y[row] = v;
    }
}

// Streams an injection loads at once (mv_out_rows); more streams take mv_out's loop.
#define MV_HC_MAX 4

// mv_out for the N rows row0.. (values v; rows past `rows` skipped). Injecting, every load (the
// streams' logits, then each stream's rows) is issued before any store: as far as the compiler
// knows, inj and xres may overlap, so mv_out's loop waits a round trip to L2 for each stream of each
// row after the previous store (16 in a row for a tile of 4 rows, while the block waits at its
// barrier). Same arithmetic as mv_out.
template <int N>
__device__ __forceinline__ void mv_out_rows(const MvOut& o, int row0, int rows, const float* v) {
    if (!o.xres || o.hc > MV_HC_MAX) {
#pragma unroll
        for (int i = 0; i < N; i++) {
            if (row0 + i < rows) mv_out(o, row0 + i, rows, v[i]);
        }
        return;
    }
    float c[MV_HC_MAX], xv[MV_HC_MAX][N];
#pragma unroll
    for (int s = 0; s < MV_HC_MAX; s++) c[s] = s < o.hc ? o.inj[s] : 0.0f;
#pragma unroll
    for (int s = 0; s < MV_HC_MAX; s++) {
#pragma unroll
        for (int i = 0; i < N; i++) xv[s][i] = s < o.hc && row0 + i < rows ? o.xres[(size_t)s * rows + row0 + i] : 0.0f;
    }
#pragma unroll
    for (int s = 0; s < MV_HC_MAX; s++) {
        const float g = 2.0f * sigmoidf_(c[s] / (float)o.hc);
#pragma unroll
        for (int i = 0; i < N; i++) {
            if (s < o.hc && row0 + i < rows) o.xres[(size_t)s * rows + row0 + i] = xv[s][i] + g * v[i];
        }
    }
}

template <int BITS>
__device__ __forceinline__ void matvec_affine(const u32* __restrict__ W, const u16* __restrict__ S,
                                              const u16* __restrict__ B, const float* __restrict__ x,
                                              const MvOut y, int rows, int cols, int gs) {
    const int row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (row >= rows) return;
    const int wpr = cols * BITS / 32, gpr = cols / gs;
    const float v = affine_row_dot<BITS>(W + (size_t)row * wpr, S + (size_t)row * gpr, B + (size_t)row * gpr, x, cols, gs);
    if ((threadIdx.x & 31) == 0) mv_out(y, row, rows, v);
}

// Any width with a transformed input: in(x) is staged once per block (`rpb` rows per block), padded
// by one float per 32 (x[j] at j + j / 32) so that the lanes of a warp, each reading its own chunk
// of 32 inputs, hit distinct banks (dynamic shared memory: cols + cols / 32 floats). Otherwise
// affine_row_dot (common.cuh).
template <int BITS>
__device__ __forceinline__ void matvec_affine_in(const u32* __restrict__ W, const u16* __restrict__ S,
                                                 const u16* __restrict__ B, const float* __restrict__ x,
                                                 const MvIn in, const MvOut y, int rows, int cols, int gs,
                                                 int rpb) {
    extern __shared__ float mv_sxp[];
    for (int i = threadIdx.x; i < cols; i += blockDim.x) mv_sxp[i + (i >> 5)] = mv_in_at(x, in, i);
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int wpr = cols * BITS / 32, gpr = cols / gs, chunks = cols >> 5;
    const int end = min(rows, (blockIdx.x + 1) * rpb);
    for (int row = blockIdx.x * rpb + warp; row < end; row += warps) {
        const u32* words = W + (size_t)row * wpr;
        const u16* scales = S + (size_t)row * gpr;
        const u16* biases = B + (size_t)row * gpr;
        float acc = 0.0f;
        for (int c = lane; c < chunks; c += 32) {
            float q[32];
            unpack32<BITS>(words + c * BITS, q);
            const float* xc = mv_sxp + c * 33;
            float sq = 0.0f, sxs = 0.0f;
#pragma unroll
            for (int k = 0; k < 32; k++) {
                const float xv = xc[k];
                sq += q[k] * xv;
                sxs += xv;
            }
            const int g = (c * 32) / gs;
            acc += bf16f(scales[g]) * sq + bf16f(biases[g]) * sxs;
        }
        acc = warp_sum(acc);
        if (lane == 0) mv_out(y, row, rows, acc);
    }
}

// Kernels that stage x take `rpb`, the rows a block covers: staging costs one pass over x per block,
// so large matrices use many rows per block (the host picks enough blocks to fill the GPU, so small
// matrices keep one row per warp).

// 2-, 4- and 8-bit rows with x staged in shared memory (dynamic shared memory: cols floats).
template <int BITS>
__device__ __forceinline__ void matvec_affine_sx(const u32* __restrict__ W, const u16* __restrict__ S,
                                                 const u16* __restrict__ B, const float* __restrict__ x,
                                                 const MvIn in, const MvOut y, int rows, int cols, int gs,
                                                 int rpb) {
    extern __shared__ float sx[];
    stage_x_in(x, in, sx, cols);
    const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int wpr = cols * BITS / 32, gpr = cols / gs;
    const int end = min(rows, (blockIdx.x + 1) * rpb);
    for (int row = blockIdx.x * rpb + warp; row < end; row += warps) {
        const float v =
            affine_row_dot_sx<BITS>(W + (size_t)row * wpr, S + (size_t)row * gpr, B + (size_t)row * gpr, sx, cols, gs);
        if ((threadIdx.x & 31) == 0) mv_out(y, row, rows, v);
    }
}

// ---- Tiled affine matvec (2-, 4- and 8-bit rows): the decode path. ----
//
// A tile is MV_R = 4 consecutive rows; L lanes (a power of two, 1..256, chosen by the host and
// passed in `rpb` as MV_TILED | L) share a tile's columns: lane lt of the tile takes the 16-byte
// chunks lt, lt + L, lt + 2L, ... of each of the 4 rows (one uint4 load per row per chunk: 64 bytes
// per lane per step, and the next step's 64 bytes are loaded before this step's arithmetic). The x
// values of a chunk are read from shared memory once and serve the 4 rows. Tiles of L <= 32 lanes
// live inside one warp (32 / L tiles per warp, reduced with shuffles); tiles of L > 32 lanes span
// L / 32 warps of one block (reduced through shared memory). Warps (L <= 32) or blocks (L > 32)
// loop over tiles with a grid stride, so the host may launch fewer blocks than tiles (one pass of
// x staging per block serves many tiles).
//
// x is staged swizzled: float4 slot m of chunk c is stored at slot m ^ h(c), so the lanes of a
// quarter-warp, which read the same logical slot of 8 consecutive chunks, hit 8 distinct bank
// quads (unswizzled, the chunk stride of 128 bytes put all 8 on the same banks). Next to x the block
// keeps sum(x) over each unit of min(32, codes per chunk) codes, which a unit never straddles a
// group of, so a unit contributes scale * sum(q x) + bias * sum(x) with sum(x) computed once per
// block instead of once per row.
//
// Codes become floats without int-to-float conversions (16 per clock per multiprocessor on Hopper,
// an eighth of the FMA rate): for 2 and 4 bits the code is moved into the top mantissa bits of a
// float whose exponent is that of 0.5 (one shift and mask per byte-lane group, then one byte
// permute per code), giving 0.5 + q / 2^(BITS+1) exactly; the unit's sum of those times x is
// 0.5 sum(x) + sum(q x) / 2^(BITS+1), so sum(q x) = 2^(BITS+1) acc - 2^BITS sum(x). For 8 bits the
// code goes into the low byte of 2^23 (exactly 2^23 + q) and 2^23 is subtracted (exact).
// 4-bit rows take integer dot products instead (MV_DP4A, below mv_stage): x is staged as digits.

#define MV_TILED 0x10000
#define MV_R 4

template <int BITS>
struct MvFmt {
    static constexpr int CPC = 128 / BITS;             // codes per 16-byte chunk
    static constexpr int SLOTS = CPC / 4;              // float4 slots of x per chunk
    static constexpr int UNIT = CPC < 32 ? CPC : 32;   // codes per x sum (never straddles a group)
    static constexpr int NSUB = CPC / UNIT;            // units per chunk
    static constexpr int WPU = 4 / NSUB;               // u32 words per unit
    static constexpr int SPW = 8 / BITS;               // float4 slots of x per word
};

// Physical float4 slot of logical slot m of chunk c (see above).
template <int SLOTS>
__device__ __forceinline__ int mv_slot(int c, int m) {
    if constexpr (SLOTS >= 8) {
        return c * SLOTS + (m ^ (c & 7));
    } else {
        return c * SLOTS + (m ^ ((c / (8 / SLOTS)) & (SLOTS - 1)));
    }
}

// Streamed 16-byte weight load: read once, so it does not displace x or the scales in L1.
__device__ __forceinline__ uint4 mv_ld_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ u32 mv_word(const uint4& v, int k) { return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w; }

__device__ __forceinline__ float mv_f4(const float4& v, int k) { return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w; }

// acc + sum over the word's codes of f(q) * x, x being the word's 32/BITS floats (SPW float4s).
// f(q) = 0.5 + q / 2^(BITS+1) for 2 and 4 bits, q for 8 bits.
template <int BITS>
__device__ __forceinline__ float mv_word_dot(u32 w, const float4* xs, float acc) {
    if constexpr (BITS == 8) {
        // Byte k -> low byte of 0x4B000000 (= 2^23 + q).
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const float f = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440 | k)) - 8388608.0f;
            acc = fmaf(f, mv_f4(xs[0], k), acc);
        }
    } else {
        constexpr int K = 8 / BITS;              // codes per byte
        constexpr int POS = 7 - BITS;            // the code's bit position in byte 2 of the float
        constexpr u32 MASK = (((1u << BITS) - 1u) << POS) * 0x01010101u;
#pragma unroll
        for (int s = 0; s < K; s++) {
            // Code s of every byte at bits POS.. of that byte.
            const int sh = POS - s * BITS;
            const u32 v = (sh >= 0 ? (w << sh) : (w >> -sh)) & MASK;
#pragma unroll
            for (int j = 0; j < 4; j++) {
                // Byte j of v into byte 2, 0x3F into byte 3: 0.5 * (1 + q / 2^BITS).
                const float f = __uint_as_float(__byte_perm(v, 0x3F000000u, 0x7044 | (j << 8)));
                // Code index within the word: j * K + s.
                const int n = j * K + s;
                acc = fmaf(f, mv_f4(xs[n >> 2], n & 3), acc);
            }
        }
    }
    return acc;
}

// Float4 i of x (16-byte aligned or not).
__device__ __forceinline__ float4 mv_ld4(const float* __restrict__ x, int i, bool aligned) {
    if (aligned) return __ldg((const float4*)x + i);
    return make_float4(__ldg(x + 4 * i), __ldg(x + 4 * i + 1), __ldg(x + 4 * i + 2), __ldg(x + 4 * i + 3));
}

// The staging's loader of x: float4 i of x (mv_ld4). A caller whose x is computed as it is loaded
// passes its own (hc_up_mix: a read's slices added up, MvLdSlices).
struct MvLdX {
    __device__ float4 operator()(const float* __restrict__ x, int i, bool aligned) const { return mv_ld4(x, i, aligned); }
};

// One staging pass's raw inputs for thread slot i < n4: float4 i of x (by ld) and, where the
// transform takes a second input, of in.x2; zeros past n4.
template <class Ld>
__device__ __forceinline__ void mv_fetch(const float* __restrict__ x, const MvIn& in, int i, int n4, bool aligned,
                                         bool aligned2, const Ld& ld, float4& v, float4& v2) {
    v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    v2 = v;
    if (i < n4) {
        v = ld(x, i, aligned);
        if (mv_in_two(in)) v2 = mv_ld4(in.x2, i, aligned2);
    }
}

// mv_stage fetches the next pass's inputs before it transforms and stores this pass's, so that a
// pass's work overlaps the next pass's round trip to L2 instead of following it
// (`CHERENKOV_KERNEL_DEFINES=MV_STAGE_SERIAL` fetches each pass at its start, as before session
// 27). On the H200 it took the hyper-connection reads' down projection from 1.86 to 1.41 us from
// its wait to its input staged (session 27).
#ifdef MV_STAGE_SERIAL
#define MV_STAGE_AHEAD 0
#else
#define MV_STAGE_AHEAD 1
#endif

// Stages in(x) swizzled into sx4 and the unit sums of in(x) into ssum (all threads of the block
// take part; blockDim.x is a multiple of 32). With `ssq`, thread 0 also writes there the sum of the
// squares of x itself (before the transform).
template <int BITS, class Ld = MvLdX>
__device__ __forceinline__ void mv_stage(const float* __restrict__ x, const MvIn& in, float4* sx4, float* ssum,
                                         int cols, float* ssq, Ld ld = Ld{}) {
    __shared__ float mv_sq[32];
    float sq = 0.0f;
    typedef MvFmt<BITS> F;
#ifdef MV_PROBE_NO_STAGE
    // Measurement variant (tests/matvec_probe.rs, through CHERENKOV_KERNEL_DEFINES; never defined
    // in the engine): x is not staged, so the results are wrong and the time is the rest's.
    __syncthreads();
    if (ssq && threadIdx.x == 0) *ssq = 0.0f;
    return;
#endif
    constexpr int G = F::UNIT / 4;  // float4 slots per unit: 4 or 8
    const int n4 = cols >> 2;
    const bool aligned = (((size_t)x) & 15) == 0;
    const bool aligned2 = (((size_t)in.x2) & 15) == 0;
    float4 nv, nv2;  // the next pass's inputs (MV_STAGE_AHEAD)
    if (MV_STAGE_AHEAD) mv_fetch(x, in, threadIdx.x, n4, aligned, aligned2, ld, nv, nv2);
#pragma unroll 4
    for (int base = 0; base < n4; base += blockDim.x) {
        const int i = base + threadIdx.x;
        float4 v, v2;
        if (MV_STAGE_AHEAD) {
            v = nv;
            v2 = nv2;
            mv_fetch(x, in, i + blockDim.x, n4, aligned, aligned2, ld, nv, nv2);
        } else {
            mv_fetch(x, in, i, n4, aligned, aligned2, ld, v, v2);
        }
        if (i < n4) {
            sq += (v.x * v.x + v.y * v.y) + (v.z * v.z + v.w * v.w);
            if (in.op != MV_IN_PLAIN)
                v = make_float4(mv_in(v.x, v2.x, in), mv_in(v.y, v2.y, in), mv_in(v.z, v2.z, in), mv_in(v.w, v2.w, in));
        }
        float s = (v.x + v.y) + (v.z + v.w);
#pragma unroll
        for (int o = 1; o < G; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (i < n4) {
            sx4[mv_slot<F::SLOTS>(i / F::SLOTS, i % F::SLOTS)] = v;
            if ((i & (G - 1)) == 0) ssum[i / G] = s;
        }
        if (base == 0) tl_mark_at(7);  // thread 0's first pass loaded and stored
    }
    tl_mark_at(8);  // thread 0's passes done, before the block's barrier
    if (ssq) {
        sq = block_sum(sq, mv_sq);  // ends with __syncthreads
        if (threadIdx.x == 0) *ssq = sq;
    } else {
        __syncthreads();
    }
}

// ---- 4-bit rows by integer dot products (MV_DP4A; `CHERENKOV_KERNEL_DEFINES=MV_NO_DP4A` leaves it out). ----
//
// The float core above spends about 2.5 instructions per 4-bit code, most on the integer pipe
// (benchmark/notes-cuda.md, "Session 12"). Here the products are exact integer dot products of
// four bytes (dp4a), with the weights' loads, tiles and epilogue unchanged:
//
// - A word's codes as bytes: w & 0x0F0F0F0F holds its codes 0, 2, 4, 6, (w >> 4) & 0x0F0F0F0F its
//   codes 1, 3, 5, 7 (three instructions per 8 codes).
// - in(x) is staged per unit of 32 inputs (a chunk) as a signed fixed-point number, x = xs q with
//   xs = max|x| / MVD_QMAX over the unit, q split into three balanced base-256 digits
//   q = 65536 d2 + 256 d1 + d0, each a signed byte: the rounding of x is at most xs / 2, 2^-23 of
//   the unit's largest input. Per word of codes the block stages six words of digits: for each digit,
//   those of the inputs 0, 2, 4, 6 and those of 1, 3, 5, 7.
// - Per row and unit the three digit sums are exact (|sum| <= 32 * 15 * 128), so the unit's
//   sum(q x) = xs (65536 D2 + (256 D1 + D0)) has one rounding, where the float core has 32.
//
// Shared memory: per chunk 6 words of digits for each of its 4 words of codes (96 bytes, padded
// to 112 so the 16-byte loads of 8 lanes on consecutive chunks hit distinct bank quads), then per
// chunk (xs, sum(x)).
#ifndef MV_NO_DP4A
#define MV_DP4A 1
#else
#define MV_DP4A 0
#endif
#define MVD_QMAX 4161536.0f  // 2^22 - 2^15: |q| < 2^22, and d2 = floor((q + 32896) / 65536) <= 64
#define MVD_CHUNK 7          // uint4 slots per chunk of staged digits

__device__ __forceinline__ const float2* mvd_meta(const float4* sm, int chunks) {
    return (const float2*)(sm + chunks * MVD_CHUNK);
}

__device__ __forceinline__ int mvd_dp4a(u32 a, u32 b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// Stages in(x) (cols inputs, a multiple of 32) as digits and per-chunk (xs, sum) (all threads of
// the block take part; blockDim.x is a multiple of 32). With `ssq`, thread 0 also writes there the
// sum of the squares of x itself (before the transform). GT = 16 (the tensor-core core of
// tests/mma_probe.rs) scales x a group of 64 inputs instead of a chunk of 32: each chunk's (xs, sum)
// is then its group's, and cols a multiple of 64.
template <class Ld = MvLdX, int GT = 8>
__device__ __forceinline__ void mvd_stage(const float* __restrict__ x, const MvIn& in, float4* sm, int cols,
                                          float* ssq, Ld ld = Ld{}) {
    __shared__ float mvd_sq[32];
    float sq = 0.0f;
    const int n4 = cols >> 2, chunks = cols >> 5;
    u16* dig = (u16*)sm;
    float2* meta = (float2*)mvd_meta(sm, chunks);
#ifdef MV_PROBE_NO_STAGE
    // The measurement variant of mv_stage: nothing staged, wrong results.
    __syncthreads();
    if (ssq && threadIdx.x == 0) *ssq = 0.0f;
    return;
#endif
    const bool aligned = (((size_t)x) & 15) == 0;
    const bool aligned2 = (((size_t)in.x2) & 15) == 0;
    // Each pass fetched at its start: fetching the next pass ahead (as mv_stage) made the 4-bit
    // launches' staging longer on the H200 (session 27: the out_proj's 3.71 us against 3.49, the
    // GDN in_proj's 2.24 against 1.86); with 2-5 blocks a multiprocessor converting the same
    // input, the conversion's instructions, not the passes' round trips, set its time.
#pragma unroll 4
    for (int base = 0; base < n4; base += blockDim.x) {
        const int i = base + threadIdx.x;
        float4 v, v2;
        mv_fetch(x, in, i, n4, aligned, aligned2, ld, v, v2);
        if (i < n4) {
            sq += (v.x * v.x + v.y * v.y) + (v.z * v.z + v.w * v.w);
            if (in.op != MV_IN_PLAIN)
                v = make_float4(mv_in(v.x, v2.x, in), mv_in(v.y, v2.y, in), mv_in(v.z, v2.z, in), mv_in(v.w, v2.w, in));
        }
        // A chunk's 32 inputs are 8 consecutive threads' float4s (a group's 64, GT = 16: 16).
        float s = (v.x + v.y) + (v.z + v.w);
        float mx = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
#pragma unroll
        for (int o = 1; o < GT; o <<= 1) {
            s += __shfl_xor_sync(0xffffffffu, s, o);
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        }
        if (i < n4) {
            const float inv = mx > 0.0f ? MVD_QMAX / mx : 0.0f;
            // q = rint(v inv), |q| < 2^22, from the float v inv + 1.5 2^23 (whose low mantissa bits
            // are q + 2^22). Its balanced digits as bytes: d0 = q mod 256, d1 = floor((q + 128) /
            // 256) mod 256, d2 = floor((q + 32896) / 65536).
            const int qx = __float_as_int(fmaf(v.x, inv, 12582912.0f)) - 0x4B400000;
            const int qy = __float_as_int(fmaf(v.y, inv, 12582912.0f)) - 0x4B400000;
            const int qz = __float_as_int(fmaf(v.z, inv, 12582912.0f)) - 0x4B400000;
            const int qw = __float_as_int(fmaf(v.w, inv, 12582912.0f)) - 0x4B400000;
            // This float4 is half h of word k of chunk c: inputs 0..3 or 4..7 of the word. Its
            // inputs 0 and 2 are bytes 2h, 2h + 1 of the even words, 1 and 3 of the odd words.
            const int c = i >> 3, k = (i >> 1) & 3, h = i & 1;
            u16* w = dig + (c * MVD_CHUNK * 16 + k * 24) / 2 + h;
            const int e0 = qx, e1 = qz, o0 = qy, o1 = qw;
            w[0] = (u16)__byte_perm(e0, e1, 0x0040);
            w[2] = (u16)__byte_perm(o0, o1, 0x0040);
            w[4] = (u16)__byte_perm((e0 + 128) >> 8, (e1 + 128) >> 8, 0x0040);
            w[6] = (u16)__byte_perm((o0 + 128) >> 8, (o1 + 128) >> 8, 0x0040);
            w[8] = (u16)__byte_perm((e0 + 32896) >> 16, (e1 + 32896) >> 16, 0x0040);
            w[10] = (u16)__byte_perm((o0 + 32896) >> 16, (o1 + 32896) >> 16, 0x0040);
            if ((i & 7) == 0) meta[c] = make_float2(mx / MVD_QMAX, s);
        }
        if (base == 0) tl_mark_at(7);  // thread 0's first pass loaded, converted and stored
    }
    tl_mark_at(8);  // thread 0's passes done, before the block's barrier
    if (ssq) {
        sq = block_sum(sq, mvd_sq);  // ends with __syncthreads
        if (threadIdx.x == 0) *ssq = sq;
    } else {
        __syncthreads();
    }
}

// The staged image of x written by x's producer instead (MV_IN_DIGITS), in global memory as in
// shared memory: chunks * MVD_CHUNK uint4 of digits, then a float2 (xs, sum) per chunk. A warp
// whose lane l holds input 32 c + l of x (`v`) writes chunk c: the digits and (xs, sum) of
// mvd_stage bit for bit (the same expressions; the sum adds the same pairs in the same order:
// ((x + y) + (z + w)) over 4 lanes, then lanes xor 4, 8, 16 as mvd_stage's threads xor 1, 2, 4).
// Word L < 24 of the chunk is digit d = (L % 6) / 2 of the even (L % 2 == 0) or odd inputs of word
// k = L / 6, byte p from lane 8 k + 2 p + L % 2; lanes 24..27 zero the chunk's padding.
//
// mvd_put_chunks writes N chunks c0 .. c0 + N - 1 at once (lane l holding input 32 (c0 + i) + l
// in v[i]), their shuffles interleaved, and stores the first n (warp-uniform); each chunk's
// expressions are mvd_put_chunk's. A warp writing 8 chunks one after another waits 8 chains of
// about 20 dependent shuffles (attend's merge, session 28).
template <int N>
__device__ __forceinline__ void mvd_put_chunks(u32* __restrict__ img, int chunks, int c0, const float (&v)[N], int n) {
    const int lane = threadIdx.x & 31;
    float s[N], mx[N];
#pragma unroll
    for (int i = 0; i < N; i++) s[i] = v[i] + __shfl_xor_sync(0xffffffffu, v[i], 1);
#pragma unroll
    for (int i = 0; i < N; i++) {
        s[i] += __shfl_xor_sync(0xffffffffu, s[i], 2);
        mx[i] = fabsf(v[i]);
    }
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {
#pragma unroll
        for (int i = 0; i < N; i++) mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], o));
    }
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
#pragma unroll
        for (int i = 0; i < N; i++) {
            s[i] += __shfl_xor_sync(0xffffffffu, s[i], o);
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], o));
        }
    }
    const int k = lane / 6, m = lane % 6, d = m >> 1, par = m & 1;
    const int src = lane < 24 ? 8 * k + par : 0;  // lanes >= 24 write no digits
    u32 pack[N], word[N];
#pragma unroll
    for (int i = 0; i < N; i++) {
        const float inv = mx[i] > 0.0f ? MVD_QMAX / mx[i] : 0.0f;
        const int q = __float_as_int(fmaf(v[i], inv, 12582912.0f)) - 0x4B400000;
        // Byte d of `pack`: digit d of this lane's input.
        pack[i] = (u32)(q & 0xff) | ((u32)(((q + 128) >> 8) & 0xff) << 8) | ((u32)(((q + 32896) >> 16) & 0xff) << 16);
        word[i] = 0;
    }
#pragma unroll
    for (int p = 0; p < 4; p++) {
#pragma unroll
        for (int i = 0; i < N; i++) word[i] |= ((__shfl_sync(0xffffffffu, pack[i], src + 2 * p) >> (8 * d)) & 0xffu) << (8 * p);
    }
#pragma unroll
    for (int i = 0; i < N; i++) {
        if (i >= n) break;
        const int c = c0 + i;
        u32* w = img + (size_t)c * MVD_CHUNK * 4;
        if (lane < 24) w[lane] = word[i];
        else if (lane < 4 * MVD_CHUNK) w[lane] = 0;
        if (lane == 0) ((float2*)(img + (size_t)chunks * MVD_CHUNK * 4))[c] = make_float2(mx[i] / MVD_QMAX, s[i]);
    }
}

__device__ __forceinline__ void mvd_put_chunk(u32* __restrict__ img, int chunks, int c, float v) {
    const float a[1] = {v};
    mvd_put_chunks<1>(img, chunks, c, a, 1);
}

// x's staged image (n inputs, a multiple of 32): what a producer that holds its outputs as whole
// warps writes, for the GPU check, which compares the tiled 4-bit matvec from this image with the
// same matvec staging x. per = 1: a chunk a warp with mvd_put_chunk (the GDN recurrence); per = 8:
// 8 chunks a warp with mvd_put_chunks (attend's merge), the last warp's fewer where n ends.
extern "C" __global__ void mvd_image(const float* __restrict__ x, u32* img, int n, int per) {
    KSPAN;
    grid_enter();
    const int chunks = n / 32, w = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (per == 1) {
        if (w < chunks) mvd_put_chunk(img, chunks, w, x[32 * w + lane]);
        return;
    }
    const int c0 = 8 * w;
    if (c0 >= chunks) return;
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = c0 + i < chunks ? x[32 * (c0 + i) + lane] : 0.0f;
    mvd_put_chunks<8>(img, chunks, c0, v, min(8, chunks - c0));
}

// Copies x's staged image `img` (MV_IN_DIGITS: chunks of 32 inputs) into shared memory as mvd_stage
// would stage x, four 16-byte loads a thread in flight before their stores (all threads of the
// block take part).
__device__ __forceinline__ void mvd_copy(const uint4* __restrict__ img, uint4* sm, int chunks) {
    const int nd = chunks * MVD_CHUNK, nq = nd + (chunks >> 1);  // the digits, then pairs of (xs, sum)
    for (int base = threadIdx.x; base < nq; base += 4 * blockDim.x) {
        uint4 r[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int i = base + u * blockDim.x;
            if (i < nq) r[u] = __ldcg(img + i);
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int i = base + u * blockDim.x;
            if (i < nq) sm[i] = r[u];
        }
        if (base == threadIdx.x) tl_mark_at(7);  // thread 0's first four loads stored
    }
    if ((chunks & 1) && threadIdx.x == 0)
        ((float2*)(sm + nd))[chunks - 1] = __ldcg((const float2*)(img + nd) + chunks - 1);
    tl_mark_at(8);
    __syncthreads();
}

// acc_d + the word's 8 codes times the digit d of their inputs, for d = 0, 1, 2 (`e`, `o`: the
// staged digit words of the even and odd inputs, digit-major).
__device__ __forceinline__ void mvd_word(u32 w, u32 e0, u32 o0, u32 e1, u32 o1, u32 e2, u32 o2, int& a0, int& a1,
                                         int& a2) {
    const u32 lo = w & 0x0F0F0F0Fu, hi = (w >> 4) & 0x0F0F0F0Fu;
    a0 = mvd_dp4a(hi, o0, mvd_dp4a(lo, e0, a0));
    a1 = mvd_dp4a(hi, o1, mvd_dp4a(lo, e1, a1));
    a2 = mvd_dp4a(hi, o2, mvd_dp4a(lo, e2, a2));
}

// One chunk of the dp4a core: chunk c of a tile's MV_R rows (their words `wc` and packed scale and
// bias `sbc`, scale in the low half) against x's staged digits and (xs, sum) (`sx4`, `chunks`
// chunks), added to `tot`: a row's three digit sums, then the unit's epilogue.
__device__ __forceinline__ void mvd_step(const uint4 (&wc)[MV_R], const u32* sbc, const float4* sx4, int chunks, int c,
                                         float (&tot)[MV_R]) {
    const uint4* xq = (const uint4*)(sx4 + c * MVD_CHUNK);
    int a0[MV_R], a1[MV_R], a2[MV_R];
#pragma unroll
    for (int i = 0; i < MV_R; i++) a0[i] = a1[i] = a2[i] = 0;
#pragma unroll
    for (int k = 0; k < 4; k += 2) {
        const uint4 p = xq[3 * (k >> 1)], q = xq[3 * (k >> 1) + 1], r = xq[3 * (k >> 1) + 2];
#pragma unroll
        for (int i = 0; i < MV_R; i++) {
#ifdef MV_PROBE_NO_MATH
            // The measurement variant (as in the float core): one add per word.
            a0[i] += (int)(mv_word(wc[i], k) ^ p.x) + (int)(mv_word(wc[i], k + 1) ^ r.w);
#else
            mvd_word(mv_word(wc[i], k), p.x, p.y, p.z, p.w, q.x, q.y, a0[i], a1[i], a2[i]);
            mvd_word(mv_word(wc[i], k + 1), q.z, q.w, r.x, r.y, r.z, r.w, a0[i], a1[i], a2[i]);
#endif
        }
    }
    const float2 mt = mvd_meta(sx4, chunks)[c];
#pragma unroll
    for (int i = 0; i < MV_R; i++) {
        const u32 sb = sbc[i];
        const float scale = __uint_as_float(sb << 16), bias = __uint_as_float(sb & 0xffff0000u);
        const float sq = fmaf((float)a2[i], 65536.0f, (float)(a1[i] * 256 + a0[i]));
        tot[i] = fmaf(scale * mt.x, sq, fmaf(bias, mt.y, tot[i]));
    }
}

// Tile layouts of the tiled core. MV_PLAIN: tile t is rows 4t..4t+3 of matrix `a`. MV_GATE_UP:
// tile t is rows 2t, 2t+1 of `a` (gate) and the same rows of `b` (up), so the thread that finishes
// a tile holds both projections of its rows (the expert kernels write silu(gate) * up directly).
// MV_STREAMS: tile t is row t of each of the 4 consecutive row blocks of `rows` rows (the
// hyper-connection up projection: stream s's mix of column t is row s * rows + t), so the thread
// that finishes a tile holds every stream's value of its column.
#define MV_PLAIN 0
#define MV_GATE_UP 1
#define MV_STREAMS 2

// A matrix (or a column slice of one) as the tiled core reads it: the slice's first 16-byte chunk
// and first group of row 0; rows are C chunks and gpr groups apart.
struct MvMat {
    const uint4* w;
    const u16* s;
    const u16* b;
};

// The type of the tiled core's load offsets: 32 bits, except for the gate/up pair, where 64-bit
// offsets cost no more instructions and 32-bit ones spill 4 bytes (ptxas, sm_90).
template <bool WIDE> struct MvOff { typedef u32 T; };
template <> struct MvOff<true> { typedef size_t T; };

// One step's loads: the chunk `c` of the tile's 4 rows (clamped to the last row) and the scale and
// bias of each of its units (packed: scale in the low half, bias in the high half).
template <int BITS, int MODE>
__device__ __forceinline__ void mv_load(const MvMat& a, const MvMat& bm, int tile, int c, bool active, int rows,
                                        int C, int gpr, int gshift, uint4* w, u32* sb) {
    typedef MvFmt<BITS> F;
    if (active) {
#pragma unroll
        for (int i = 0; i < MV_R; i++) {
            const MvMat& m = (MODE == MV_GATE_UP && i >= 2) ? bm : a;
            const int r = MODE == MV_GATE_UP ? tile * 2 + (i & 1) : MODE == MV_STREAMS ? tile : tile * MV_R + i;
            // 32-bit offsets: the host gives the tiled core only matrices whose chunks and groups
            // number below 2^32 (weights.rs: offsets_fit_u32). 64-bit ones cost a step about 18
            // more instructions (benchmark/notes-cuda.md, "Session 23").
            typedef typename MvOff<MODE == MV_GATE_UP>::T Off;
            const Off row = (MODE == MV_STREAMS ? (Off)i * rows : (Off)0) + (Off)min(r, rows - 1);
            w[i] = mv_ld_stream(m.w + (row * (Off)C + (Off)c));
#pragma unroll
            for (int p = 0; p < F::NSUB; p++) {
                const Off g = row * (Off)gpr + ((Off)(c * F::CPC + p * F::UNIT) >> gshift);
                sb[i * F::NSUB + p] = (u32)__ldg(m.s + g) | ((u32)__ldg(m.b + g) << 16);
            }
        }
    }
}

#ifdef MV_L2_PASS
// A step's weights (with their scales and biases) requested into L2 only: no registers held, nothing
// waits for them (the MV_L2_PASS measurement variant of mv_core).
template <int BITS, int MODE>
__device__ __forceinline__ void mv_prefetch(const MvMat& a, const MvMat& bm, int tile, int c, int rows, int C,
                                            int gpr, int gshift) {
    typedef MvFmt<BITS> F;
#pragma unroll
    for (int i = 0; i < MV_R; i++) {
        const MvMat& m = (MODE == MV_GATE_UP && i >= 2) ? bm : a;
        const int r = MODE == MV_GATE_UP ? tile * 2 + (i & 1) : MODE == MV_STREAMS ? tile : tile * MV_R + i;
        const size_t row = (MODE == MV_STREAMS ? (size_t)i * rows : 0) + (size_t)min(r, rows - 1);
        asm volatile("prefetch.global.L2 [%0];" ::"l"(m.w + row * C + c));
        const size_t g = row * gpr + ((c * F::CPC) >> gshift);
        asm volatile("prefetch.global.L2 [%0];" ::"l"(m.s + g));
        asm volatile("prefetch.global.L2 [%0];" ::"l"(m.b + g));
    }
}
#endif

// The tiled core: the tiles of one matrix (or gate/up pair) over the Cs chunks of a column slice,
// x being that slice's inputs (transformed by `in`, whose x2 is offset like x). `blk` of `nblk`
// blocks share the tiles (grid stride). Each finished tile calls emit(tile, v) once, from one
// thread, with the tile's 4 sums.
// EARLY: the caller has not waited for the previous kernel (grid_enter) yet; the core requests the
// first step's weights first and then waits, so with programmatic dependent launch a block that is
// scheduled before the previous kernel ends has its first weights in flight meanwhile. Only for
// weights no earlier work writes (the dense matrices, uploaded at load; not expert slots).
// Stages x (cols inputs, plain) as mv_core would for a whole row with INT = true, so that a caller
// can do it before it waits and pass `staged` to mv_core.
template <int BITS>
__device__ __forceinline__ void mv_stage_all(const float* __restrict__ x, int cols) {
    extern __shared__ float4 mv_smem[];
    if constexpr (BITS == 4 && MV_DP4A) {
        mvd_stage(x, MV_IN_NONE, mv_smem, cols, nullptr);
    } else {
        mv_stage<BITS>(x, MV_IN_NONE, mv_smem, (float*)mv_smem + cols, cols, nullptr);
    }
}

// PRE: called once, before the wait where EARLY, with the first tile this thread will hand to emit
// (-1 if none), so a caller may load what its emit reads and no earlier kernel writes.
struct MvNoPre {
    __device__ void operator()(int) const {}
};

// LD: the staging's loader of x (MvLdX).
// NX: input rows. Above 1 (4-bit rows by dp4a, whole rows, plain inputs, no ssq, not staged by the
// caller), x holds NX rows `xstride` floats apart, each staged as digits in turn
// (mvd_rows_float4s(cols) float4s a row), and the weights each step loads serve every row: each
// finished tile calls emit(tile, v, r) once per row r. A row's sums are those of NX = 1 on that
// row alone, bit for bit (the same products in the same order).
__host__ __device__ constexpr int mvd_rows_float4s(int cols) {
    return (cols >> 5) * MVD_CHUNK + (((cols >> 5) + 1) >> 1);
}

template <int NX, class Emit>
__device__ __forceinline__ void mv_emit(Emit& emit, int tile, const float* v, int r) {
    if constexpr (NX == 1) {
        emit(tile, v);
    } else {
        emit(tile, v, r);
    }
}

template <int BITS, int MODE, bool EARLY = false, bool INT = true, int NX = 1, class Emit, class Pre = MvNoPre,
          class Ld = MvLdX>
__device__ __forceinline__ void mv_core(const MvMat a, const MvMat bm, const float* __restrict__ x, const MvIn in,
                                        int rows, int C, int Cs, int gpr, int gshift, int L, int blk, int nblk,
                                        Emit emit, float* ssq = nullptr, Pre pre = Pre{}, bool staged = false,
                                        Ld ld = Ld{}, long long xstride = 0) {
    typedef MvFmt<BITS> F;
    extern __shared__ float4 mv_smem[];
    __shared__ float red[32][MV_R];
    const int cols = Cs * F::CPC;                 // inputs of the slice
    float4* sx4 = mv_smem;
    float* ssum = (float*)mv_smem + cols;
    static_assert(NX == 1 || (BITS == 4 && MV_DP4A && INT), "several input rows only by the 4-bit dp4a core");
    const int X4 = mvd_rows_float4s(cols);        // float4s of one staged row (NX > 1)

    const int lshift = __ffs(L) - 1;              // L is a power of two
    const int nit = (Cs + L - 1) >> lshift;       // steps per tile
    const int ntiles = MODE == MV_GATE_UP ? (rows + 1) / 2 : MODE == MV_STREAMS ? rows : (rows + MV_R - 1) / MV_R;
    const int t = threadIdx.x;
    // A unit is a warp (L <= 32) or the block (L > 32); it covers `tpu` tiles per pass.
    int unit, nunits, tpu, tin;
    if (L <= 32) {
        unit = blk * (blockDim.x >> 5) + (t >> 5);
        nunits = nblk * (blockDim.x >> 5);
        tpu = 32 >> lshift;
        tin = t & 31;
    } else {
        unit = blk;
        nunits = nblk;
        tpu = blockDim.x >> lshift;
        tin = t;
    }
    const int sub = tin >> lshift, lt = tin & (L - 1);

    // The first step's weights are requested before x is staged, so both latencies overlap.
    int pass = unit, it = 0;
    bool more = pass * tpu < ntiles;
    uint4 wc[MV_R];
    u32 sbc[MV_R * F::NSUB];
    {
        const int tile = pass * tpu + sub, c = lt;
        mv_load<BITS, MODE>(a, bm, tile, c, more && tile < ntiles && c < Cs, rows, C, gpr, gshift, wc, sbc);
#ifdef MV_L2_PASS
        // Measurement variant (CHERENKOV_KERNEL_DEFINES=MV_L2_PASS): where one pass covers every
        // tile, the pass's later steps are requested into L2 at once, so the memory streams the
        // launch's bytes from its start instead of two steps per lane at a time. Session 8 measured
        // it on the float core (no gain; arithmetic held the kernels then); with the dp4a core the
        // loads' issue holds them (benchmark/notes-cuda.md, "Session 13"), so it is worth measuring
        // again. Session 35 did (the timeline at 32 layers): the GDN in_proj took 19.7 us a launch
        // against 16.6, and a step 0.18 ms more: a prefetch a lane and step issues far more
        // instructions than the loads it precedes. matvec_many_ahead's bulk copies are its
        // successor (mv_ahead_q4).
        if (more && nunits * tpu >= ntiles && tile < ntiles) {
            for (int it2 = 1; it2 < nit; it2++) {
                const int c2 = (it2 << lshift) + lt;
                if (c2 < Cs) mv_prefetch<BITS, MODE>(a, bm, tile, c2, rows, C, gpr, gshift);
            }
        }
#endif
    }
    {
        int first = L <= 32 ? (lt == 0 ? unit * tpu + sub : -1) : (t < tpu ? unit * tpu + t : -1);
        pre(first < ntiles ? first : -1);
    }
    if constexpr (EARLY) grid_enter();
    constexpr bool DP4A = BITS == 4 && MV_DP4A && INT;
    if constexpr (NX > 1) {
#pragma unroll
        for (int r = 0; r < NX; r++) mvd_stage(x + r * xstride, in, sx4 + r * X4, cols, nullptr, ld);
    } else if (staged) {
        // The caller staged x already (mv_stage_all), before it waited.
    } else if constexpr (DP4A) {
        if (in.op == MV_IN_DIGITS && !ssq && Cs == C) {  // (a column slice converts its x)
            mvd_copy((const uint4*)in.x2, (uint4*)sx4, cols >> 5);
        } else {
            mvd_stage(x, in, sx4, cols, ssq, ld);
        }
    } else {
        mv_stage<BITS>(x, in, sx4, ssum, cols, ssq, ld);
    }
    tl_mark();

    float tot[NX][MV_R];
#pragma unroll
    for (int r = 0; r < NX; r++)
#pragma unroll
        for (int i = 0; i < MV_R; i++) tot[r][i] = 0.0f;
    while (more) {
        const int tile = pass * tpu + sub, c = (it << lshift) + lt;
        // Request the next step before computing this one.
        int pass2 = pass, it2 = it + 1;
        if (it2 == nit) {
            it2 = 0;
            pass2 += nunits;
        }
        const bool more2 = pass2 * tpu < ntiles;
        uint4 wn[MV_R];
        u32 sbn[MV_R * F::NSUB];
        {
            const int tile2 = pass2 * tpu + sub, c2 = (it2 << lshift) + lt;
            mv_load<BITS, MODE>(a, bm, tile2, c2, more2 && tile2 < ntiles && c2 < Cs, rows, C, gpr, gshift, wn, sbn);
        }
        if (DP4A && tile < ntiles && c < Cs) {
#pragma unroll
            for (int r = 0; r < NX; r++) mvd_step(wc, sbc, sx4 + r * X4, cols >> 5, c, tot[r]);
        } else if (!DP4A && tile < ntiles && c < Cs) {
#pragma unroll
            for (int p = 0; p < F::NSUB; p++) {
                float acc[MV_R];
#pragma unroll
                for (int i = 0; i < MV_R; i++) acc[i] = 0.0f;
#pragma unroll
                for (int k = 0; k < F::WPU; k++) {
                    const int wi = p * F::WPU + k;  // word within the chunk
                    float4 xs[F::SPW];
#pragma unroll
                    for (int m = 0; m < F::SPW; m++) xs[m] = sx4[mv_slot<F::SLOTS>(c, wi * F::SPW + m)];
#ifdef MV_PROBE_NO_MATH
                    // Measurement variant (as MV_PROBE_NO_STAGE): one add per word instead of the
                    // dequantisation and the products; the results are wrong.
#pragma unroll
                    for (int i = 0; i < MV_R; i++) acc[i] += __uint_as_float(mv_word(wc[i], wi) & 0x3fffffffu) * xs[0].x;
#else
#pragma unroll
                    for (int i = 0; i < MV_R; i++) acc[i] = mv_word_dot<BITS>(mv_word(wc[i], wi), xs, acc[i]);
#endif
                }
                const float xsum = ssum[c * F::NSUB + p];
#pragma unroll
                for (int i = 0; i < MV_R; i++) {
                    const u32 sb = sbc[i * F::NSUB + p];
                    const float scale = __uint_as_float(sb << 16), bias = __uint_as_float(sb & 0xffff0000u);
                    if constexpr (BITS == 8) {
                        tot[0][i] = fmaf(scale, acc[i], fmaf(bias, xsum, tot[0][i]));
                    } else {
                        // sum(q x) = 2^(BITS+1) acc - 2^BITS xsum.
                        const float sq = fmaf((float)(2 << BITS), acc[i], -(float)(1 << BITS) * xsum);
                        tot[0][i] = fmaf(scale, sq, fmaf(bias, xsum, tot[0][i]));
                    }
                }
            }
        }
        if (it == nit - 1) {
            // The tile is done: reduce over its L lanes and hand its sums over. (Marks 1 and 2:
            // thread 0's first tile's products done; its sums handed over.)
            tl_mark_at(1);
#pragma unroll
            for (int r = 0; r < NX; r++) {
                if (L <= 32) {
#pragma unroll
                    for (int i = 0; i < MV_R; i++) {
                        for (int o = L >> 1; o > 0; o >>= 1) tot[r][i] += __shfl_xor_sync(0xffffffffu, tot[r][i], o);
                    }
                    if (lt == 0 && tile < ntiles) mv_emit<NX>(emit, tile, tot[r], r);
                } else {
#pragma unroll
                    for (int i = 0; i < MV_R; i++) tot[r][i] = warp_sum(tot[r][i]);
                    if ((t & 31) == 0) {
#pragma unroll
                        for (int i = 0; i < MV_R; i++) red[t >> 5][i] = tot[r][i];
                    }
                    __syncthreads();
                    if (t < tpu) {
                        const int wpt = L >> 5, tl = pass * tpu + t;
                        float v[MV_R];
#pragma unroll
                        for (int i = 0; i < MV_R; i++) {
                            v[i] = 0.0f;
                            for (int k = 0; k < wpt; k++) v[i] += red[t * wpt + k][i];
                        }
                        if (tl < ntiles) mv_emit<NX>(emit, tl, v, r);
                    }
                    __syncthreads();
                }
#pragma unroll
                for (int i = 0; i < MV_R; i++) tot[r][i] = 0.0f;
            }
            tl_mark_at(2);
        }
#pragma unroll
        for (int i = 0; i < MV_R; i++) wc[i] = wn[i];
#pragma unroll
        for (int i = 0; i < MV_R * F::NSUB; i++) sbc[i] = sbn[i];
        pass = pass2;
        it = it2;
        more = more2;
    }
}

// ---- Weights ahead: a block's whole share of a 4-bit matrix copied into shared memory before the wait. ----
//
// In a launch whose blocks each cover their tiles in one pass (MV_PLAIN, whole rows, L <= 32
// lanes a tile, 4-bit rows by dp4a), each warp's rows are contiguous in memory: tpu tiles of
// MV_R rows, C chunks a row, and gpr scales and biases a row. Lane 0 of each warp asks the tensor
// memory accelerator for them with three bulk copies (`cp.async.bulk`: the rows' chunks, scales and
// biases), completing on the warp's mbarrier, before the block waits for the previous kernel:
// the weights do not depend on it, so they stream while it runs or ends, and no register holds
// them. After the wait the block stages x as mv_core does, each warp waits for its own barrier and
// computes its tiles from shared memory, with mv_core's arithmetic in mv_core's order (the outputs
// are bit for bit mv_core's). The host sets a part's bit of `ahead_parts` only where this applies
// and asks for the shared memory (weights.rs: ahead_bytes). Off by default
// (`CHERENKOV_MANY_AHEAD=1`): on the H200 it was no faster (benchmark/notes-cuda.md, "Session 35").
//
// Dynamic shared memory: x's staging (mv_core's, mva_x_bytes), then the block's rows' chunks
// (MV_R tpu warps rows of C uint4), their scales, their biases (gpr u16 a row each; gpr a multiple
// of 8 keeps every copy's size and place 16-byte aligned), then an mbarrier a warp. Hopper and
// later only (bulk copies and these mbarrier operations are sm_90's); elsewhere the kernel takes
// mv_core, and the host never sets `ahead` there.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define MV_AHEAD 1
#else
#define MV_AHEAD 0
#endif
#if MV_AHEAD
__device__ __forceinline__ unsigned mva_smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ int mva_x_bytes(int cols) { return (cols * 4 + (cols >> 5) * 4 + 127) & ~127; }

__device__ __forceinline__ void mva_copy(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     mva_smem(dst)),
                 "l"(src), "r"(bytes), "r"(mva_smem(bar))
                 : "memory");
}

__device__ __forceinline__ void mva_wait(unsigned long long* bar) {
    asm volatile(
        "{\n"
        ".reg .pred P1;\n"
        "MVA_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], 0;\n"
        "@P1 bra.uni MVA_DONE;\n"
        "bra.uni MVA_WAIT;\n"
        "MVA_DONE:\n"
        "}\n" ::"r"(mva_smem(bar))
        : "memory");
}

// The tiles of matrix `a` (rows x C chunks, whole rows) of block `blk`, each handed to emit(tile,
// v) as mv_core<4, MV_PLAIN, true> would; waits for the previous kernel itself (grid_enter).
template <class Emit>
__device__ __forceinline__ void mv_ahead_q4(const MvMat a, const float* __restrict__ x, const MvIn in, int rows, int C,
                                            int gpr, int gshift, int L, int blk, Emit emit) {
    extern __shared__ float4 mv_smem[];
    const int cols = C * 32;
    const int lshift = __ffs(L) - 1, nit = (C + L - 1) >> lshift;
    const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int tpu = 32 >> lshift, sub = lane >> lshift, lt = lane & (L - 1);
    const int ntiles = (rows + MV_R - 1) / MV_R;
    const int rpb = warps * tpu * MV_R;                  // rows a block holds
    const int r0 = blk * rpb;                            // the block's first row
    const int w0 = r0 + warp * tpu * MV_R;               // the warp's first row
    const int wn = max(0, min(rows, w0 + tpu * MV_R) - w0);  // and its rows
    uint4* sw = (uint4*)((unsigned char*)mv_smem + mva_x_bytes(cols));
    u16* ss = (u16*)(sw + (size_t)rpb * C);
    u16* sbi = ss + (size_t)rpb * gpr;
    unsigned long long* bar = (unsigned long long*)(sbi + (size_t)rpb * gpr);
    if (threadIdx.x < warps) {
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(mva_smem(bar + threadIdx.x)) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (lane == 0 && wn > 0) {
        const int l0 = w0 - r0;
        const unsigned wb = (unsigned)wn * C * 16, sb = (unsigned)wn * gpr * 2;
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(mva_smem(bar + warp)), "r"(wb + 2 * sb)
                     : "memory");
        mva_copy(sw + (size_t)l0 * C, a.w + (size_t)w0 * C, wb, bar + warp);
        mva_copy(ss + (size_t)l0 * gpr, a.s + (size_t)w0 * gpr, sb, bar + warp);
        mva_copy(sbi + (size_t)l0 * gpr, a.b + (size_t)w0 * gpr, sb, bar + warp);
    }
    grid_enter();
    if (in.op == MV_IN_DIGITS) {
        mvd_copy((const uint4*)in.x2, (uint4*)mv_smem, cols >> 5);
    } else {
        mvd_stage(x, in, mv_smem, cols, nullptr);
    }
    tl_mark();
    if (wn == 0) return;
    mva_wait(bar + warp);
    const int tile = (blk * warps + warp) * tpu + sub;
    float tot[MV_R];
#pragma unroll
    for (int i = 0; i < MV_R; i++) tot[i] = 0.0f;
#pragma unroll 1
    for (int it = 0; it < nit; it++) {
        const int c = (it << lshift) + lt;
        if (tile < ntiles && c < C) {
            const int g = (c * 32) >> gshift;
            uint4 wc[MV_R];
            u32 sbc[MV_R];
#pragma unroll
            for (int i = 0; i < MV_R; i++) {
                const int r = min(tile * MV_R + i, rows - 1) - r0;
                wc[i] = sw[r * C + c];
                sbc[i] = (u32)ss[r * gpr + g] | ((u32)sbi[r * gpr + g] << 16);
            }
            mvd_step(wc, sbc, mv_smem, cols >> 5, c, tot);
        }
    }
    tl_mark_at(1);
#pragma unroll
    for (int i = 0; i < MV_R; i++) {
        for (int o = L >> 1; o > 0; o >>= 1) tot[i] += __shfl_xor_sync(0xffffffffu, tot[i], o);
    }
    if (lt == 0 && tile < ntiles) emit(tile, tot);
}
#endif

// Waits for the previous kernel itself, after requesting its first weights (mv_core's EARLY).
template <int BITS>
__device__ __forceinline__ void matvec_tiled(const u32* __restrict__ W, const u16* __restrict__ S,
                                             const u16* __restrict__ B, const float* __restrict__ x,
                                             const MvIn in, const MvOut y, int rows, int cols, int gs, int L) {
    typedef MvFmt<BITS> F;
    const int C = cols / F::CPC, gpr = cols / gs, gshift = __ffs(gs) - 1;
    const MvMat a{(const uint4*)W, S, B};
    mv_core<BITS, MV_PLAIN, true>(a, a, x, in, rows, C, C, gpr, gshift, L, blockIdx.x, gridDim.x,
                            [&](int tile, const float* v) { mv_out_rows<MV_R>(y, tile * MV_R, rows, v); });
}

// ---- Several matrices of one input in one launch, columns optionally split across blocks. ----
//
// Part p (blockIdx.y; up to MV_PARTS parts of `cols` inputs, each of its own format) is the matrix
// (W_p, S_p, B_p) of r_p rows into y_p, run by the tiled core with l_p lanes per tile and n_p blocks
// per column slice, over k_p column slices (blockIdx.x = slice * n_p + block; blocks beyond k_p n_p
// leave at once). With k_p = 1 the tiles write y_p directly. With k_p > 1 each slice stages only its
// columns of x and writes its sums into the scratch (slice-major, r_p floats per slice); the last
// block of the part to finish (a counter per part at the head of the scratch, reset by that block)
// adds the slices up in slice order, so the result does not depend on which block ran when.
//
// With a norm (MvNorm, group > 0: the hyper-connection read's zero-centred RMSNorm folded into its
// projections), x is the raw residual and the transform is MV_IN_ONE_PLUS (x (1 + w)); every slice
// lies inside one group of `group` inputs (the host splits so), the slice's first block writes the
// slice's sum of x^2 into the scratch, and the last block scales each slice's partial sums by its
// group's 1 / rms = rsqrt(sum x^2 / group + eps) as it adds them up: W (x / rms (1 + w)) without
// the normalised vector. Part 0's last block also writes the groups' 1 / rms to `inv` (may be null).
#define MV_PARTS 4
#define MV_SCRATCH_HEAD 64       // floats before the partial sums (the counters)
#define MV_PART_FLOATS 16384     // partial sums per part (r_p k_p at most)
#define MV_MAX_SLICES 32         // column slices per part at most (the sums of squares after the partial sums)
#define MV_SUM_BATCH 4           // slices' partial sums the last block loads at once

struct MvNorm {
    int group;
    float eps;
    float* inv;
};

// The Gated DeltaNet's causal depthwise conv folded into part 0's output (`k` > 0; that part's
// rows are the conv's channels and its slices 1): once a block's tiles are written, the block
// replaces each of their rows v by y[ch] = silu(sum_j w[ch][j] state[j][ch] + w[ch][k-1] v) and
// shifts the channel's history (the expression of gdn_conv in gdn.cu), so the conv needs no launch
// of its own.
struct MvConv {
    float* state;
    const float* w;
    int k;
};

// Kernel widths whose history mv_conv loads at once (the released shape's is 4); wider ones loop.
#define MV_CONV_MAX 4

__device__ __forceinline__ float mv_conv(const MvConv& cv, int ch, int C, float v) {
    const float* wk = cv.w + (size_t)ch * cv.k;
    if (cv.k <= MV_CONV_MAX) {
        // Every load before any store (state and w may overlap as far as the compiler knows, so
        // the loop below waits a round trip for each load after each store); the same sums.
        float st[MV_CONV_MAX], wv[MV_CONV_MAX];
        const float wl = wk[cv.k - 1];
#pragma unroll
        for (int j = 0; j < MV_CONV_MAX; j++) {
            wv[j] = j < cv.k - 1 ? wk[j] : 0.0f;
            st[j] = j < cv.k - 1 ? cv.state[(size_t)j * C + ch] : 0.0f;
        }
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < MV_CONV_MAX - 1; j++) {
            if (j < cv.k - 1) acc += wv[j] * st[j];
        }
        acc += wl * v;
#pragma unroll
        for (int j = 0; j < MV_CONV_MAX - 1; j++) {
            if (j + 1 < cv.k - 1) cv.state[(size_t)j * C + ch] = st[j + 1];
        }
        if (cv.k > 1) cv.state[(size_t)(cv.k - 2) * C + ch] = v;
        return siluf_(acc);
    }
    float acc = 0.0f;
    for (int j = 0; j < cv.k - 1; j++) acc += wk[j] * cv.state[(size_t)j * C + ch];
    acc += wk[cv.k - 1] * v;
    for (int j = 0; j + 1 < cv.k - 1; j++) cv.state[(size_t)j * C + ch] = cv.state[(size_t)(j + 1) * C + ch];
    if (cv.k > 1) cv.state[(size_t)(cv.k - 2) * C + ch] = v;
    return siluf_(acc);
}

// The conv over the rows of block `blk`'s tiles (see matvec_many_part).
__device__ __noinline__ void mv_conv_rows(const MvConv cv, float* y, int rows, int blk, int nb, int L) {
    const int TB = blockDim.x / L, ntiles = (rows + MV_R - 1) / MV_R;
    for (int t0 = blk * TB; t0 < ntiles; t0 += nb * TB) {
        const int end = min(rows, (t0 + TB) * MV_R);
        for (int r = t0 * MV_R + threadIdx.x; r < end; r += blockDim.x) y[r] = mv_conv(cv, r, rows, y[r]);
    }
}

// mv_conv_rows over two rows of the same channels (a verifying pass's: row 1's conv follows row
// 0's): each channel's thread runs row 0's conv, copies the state after it to `mid` (the record a
// commit of one row restores; same layout as the state), then runs row 1's.
__device__ __noinline__ void mv_conv_rows_x2(const MvConv cv, float* y0, float* y1, float* mid, int rows, int blk,
                                             int nb, int L) {
    const int TB = blockDim.x / L, ntiles = (rows + MV_R - 1) / MV_R;
    for (int t0 = blk * TB; t0 < ntiles; t0 += nb * TB) {
        const int end = min(rows, (t0 + TB) * MV_R);
        for (int r = t0 * MV_R + threadIdx.x; r < end; r += blockDim.x) {
            y0[r] = mv_conv(cv, r, rows, y0[r]);
            for (int j = 0; j + 1 < cv.k; j++) mid[(size_t)j * rows + r] = cv.state[(size_t)j * rows + r];
            y1[r] = mv_conv(cv, r, rows, y1[r]);
        }
    }
}

template <int BITS, bool NORM, bool AHEAD = false, bool FLAT = false>
__device__ __forceinline__ void matvec_many_part(const float* __restrict__ x, const MvIn in, int cols, int gs,
                                                 float* scratch,
                                                 const u32* W, const u16* S, const u16* B, float* y, int rows, int L,
                                                 int nb, int ks, const MvNorm nrm, const MvConv cv, bool defer,
                                                 bool ahead, int flat_p, int flat_bx) {
    typedef MvFmt<BITS> F;
    // The part and its block: from a flat grid (matvec_many_ahead's, matvec_many_48_rows'), else
    // (blockIdx.y, .x), read here again (taking the caller's kept them in registers: matvec_many_rows
    // spilled 48 bytes that way).
    const int p = AHEAD || FLAT ? flat_p : (int)blockIdx.y, bx = AHEAD || FLAT ? flat_bx : (int)blockIdx.x;
    if (bx >= nb * ks) {
        // A block beyond the part's own (the grid is as wide as the widest part) reads and writes
        // nothing, so it leaves at once, before the wait: its slot is free for the blocks behind
        // it while the previous kernel still runs (the GDN in_proj's grid of 640 has 382 such
        // blocks, and 396 blocks fit the GPU at once), and it counts as released (an exited block
        // does for griddepcontrol.launch_dependents). `MV_IDLE_WAIT` (a measurement define): wait
        // and release first, as before session 41.
#ifdef MV_IDLE_WAIT
        grid_enter();
#endif
        return;
    }
    // (An unsigned division, as before the flat grid: a signed one cost matvec_many_48 20 bytes of
    // spills.)
    const int slice = (unsigned)bx / nb, blk = bx - slice * nb;
    const int C = cols / F::CPC, Cs = C / ks, c0 = slice * Cs, gpr = cols / gs, gshift = __ffs(gs) - 1;
    const int g0 = (c0 * F::CPC) >> gshift;
    const MvMat a{(const uint4*)W + c0, S + g0, B + g0};
    float* part = scratch + MV_SCRATCH_HEAD + (size_t)p * MV_PART_FLOATS;
    float* dst = ks == 1 ? y : part + (size_t)slice * rows;
    const size_t j0 = (size_t)c0 * F::CPC;
    float* ssq_all = scratch + MV_SCRATCH_HEAD + (size_t)MV_PARTS * MV_PART_FLOATS + (size_t)p * MV_MAX_SLICES;
    float* ssq = (NORM && nrm.group > 0 && blk == 0) ? ssq_all + slice : nullptr;
    // The norm-folded launch (the hyper-connection reads: a few hundred rows over the 4 streams'
    // inputs, in column slices of few steps) keeps the float core: its blocks stage far more inputs than they have steps to amortise the
    // digits over, and it was 1-3% faster per resident step (benchmark/notes-cuda.md, "Session
    // 13"). `MV_INT_NORM` gives it the dp4a core too.
#ifdef MV_INT_NORM
    constexpr bool INT = true;
#else
    constexpr bool INT = !NORM;
#endif
    const auto emit = [&](int tile, const float* v) {
#pragma unroll
        for (int i = 0; i < MV_R; i++) {
            if (tile * MV_R + i < rows) dst[tile * MV_R + i] = v[i];
        }
    };
    // The weights ahead (mv_ahead_q4) where the host set the part's bit: whole rows (ks == 1).
    bool done = false;
#if MV_AHEAD
    if constexpr (AHEAD && BITS == 4 && MV_DP4A && !NORM) {
        if (ahead) {
            mv_ahead_q4(a, x, in, rows, C, gpr, gshift, L, blk, emit);
            done = true;
        }
    }
#endif
    if (!done) mv_core<BITS, MV_PLAIN, true, INT>(a, a, x + j0, mv_in_offset(in, j0), rows, C, Cs, gpr, gshift, L, blk, nb, emit, ssq);
    if (p == 0 && cv.k > 0 && ks == 1) {
        // The block's tiles are TB = blockDim / L consecutive ones per pass of the grid (mv_core's
        // units): once their sums are written (visible to the block after the barrier), the conv
        // runs over their rows in place, after the main loop so that it costs that loop no
        // registers.
        __syncthreads();
        mv_conv_rows(cv, y, rows, bx, nb, L);
    }
    if (ks > 1 && !defer) {
        unsigned* counter = (unsigned*)scratch + p;
        if (last_block_of(counter, (unsigned)(nb * ks))) {
            __shared__ float mv_scale[MV_MAX_SLICES];
            if (NORM && nrm.group > 0) {
                // Slice k's group and that group's 1 / rms (its slices' sums in slice order). Each
                // slice's sum of squares is loaded by one thread, all in flight together (L2 only,
                // as the other blocks wrote them), then added up from shared memory
                // (`MV_SUM_SERIAL`: each thread loads its group's one after another, as before
                // session 24).
                const int width = Cs * F::CPC, per = nrm.group / width;
#ifndef MV_SUM_SERIAL
                __shared__ float mv_ssq[MV_MAX_SLICES];
                if ((int)threadIdx.x < ks) mv_ssq[threadIdx.x] = __ldcg(ssq_all + threadIdx.x);
                __syncthreads();
                const float* vq = mv_ssq;
#else
                const volatile float* vq = ssq_all;
#endif
                if ((int)threadIdx.x < ks) {
                    const int k = threadIdx.x, g0s = (k / per) * per;
                    float sq = 0.0f;
                    for (int i = 0; i < per; i++) sq += vq[g0s + i];
                    const float inv = rsqrtf(sq / (float)nrm.group + nrm.eps);
                    mv_scale[k] = inv;
                    if (p == 0 && nrm.inv && k == g0s) nrm.inv[k / per] = inv;
                }
                __syncthreads();
            }
            // In matvec_many (NORM: the kernel that folds norms), where every row's every slice has a
            // thread (the hyper-connection read's injection logits: 4 rows in 16 slices), each
            // thread loads one partial sum, all in flight together, into the staging's shared
            // memory (free now, and at least the slice's inputs: rows ks <= cols of the slice), and
            // thread r adds its row's up in slice order from there: one round trip to L2 where the
            // loop below takes one per MV_SUM_BATCH slices. (In matvec_many_48 the same costs 24
            // bytes more of spills.)
            // Otherwise a row's slices are loaded MV_SUM_BATCH at a time, all in flight together (L2
            // only, as the other blocks wrote them), then added in slice order.
#ifndef MV_SUM_SERIAL
            if (NORM && rows * ks <= (int)blockDim.x && rows * ks <= Cs * F::CPC) {
                extern __shared__ float4 mv_smem[];
                float* sums = (float*)mv_smem;
                if ((int)threadIdx.x < rows * ks) sums[threadIdx.x] = __ldcg(part + threadIdx.x);
                __syncthreads();
                tl_mark_at(6);  // the slices' sums in
                if ((int)threadIdx.x < rows) {
                    const int r = threadIdx.x;
                    float s = 0.0f;
                    for (int k = 0; k < ks; k++) s += (NORM && nrm.group > 0) ? mv_scale[k] * sums[k * rows + r] : sums[k * rows + r];
                    y[r] = s;
                }
                if (threadIdx.x == 0) *counter = 0u;
                return;
            }
#endif
            for (int r = threadIdx.x; r < rows; r += blockDim.x) {
                float s = 0.0f;
                for (int k0 = 0; k0 < ks; k0 += MV_SUM_BATCH) {
                    float v[MV_SUM_BATCH];
#pragma unroll
                    for (int i = 0; i < MV_SUM_BATCH; i++) v[i] = k0 + i < ks ? __ldcg(part + (size_t)(k0 + i) * rows + r) : 0.0f;
                    if (NORM && nrm.group > 0) {
#pragma unroll
                        for (int i = 0; i < MV_SUM_BATCH; i++) {
                            if (k0 + i < ks) s += mv_scale[k0 + i] * v[i];
                        }
                    } else {
#pragma unroll
                        for (int i = 0; i < MV_SUM_BATCH; i++) {
                            if (k0 + i < ks) s += v[i];
                        }
                    }
                }
                y[r] = s;
            }
            if (threadIdx.x == 0) *counter = 0u;
        }
    }
}

// One kernel for every part format: part p's bits b_p (2, 4 or 8) and group size g_p pick its
// instantiation of the tiled core, so matrices of different formats that read one input (the router
// at 8 bits and the shared expert at 4) share a launch. At least 2 blocks of 256 threads per
// multiprocessor (the register budget of the widest instantiation); DevLinear's planning knows it.
#define MV_PART_ARGS(i)                                                                                       \
    const u32 *W##i, const u16 *S##i, const u16 *Bi##i, float *y##i, int r##i, int l##i, int n##i, int k##i, \
        int b##i, int g##i
#define MV_SEL(v) (p == 0 ? v##0 : p == 1 ? v##1 : p == 2 ? v##2 : v##3)
// Part p and its block bx of a flat grid, the parts' n_p k_p blocks one after another (blockIdx.y
// unused): matvec_many_ahead's, matvec_many_x2's and matvec_many_48_rows'. Past the last part: p
// MV_PARTS - 1 with bx beyond its blocks, which the kernels send away at once.
#define MV_FLAT_PART                                          \
    int p = 0, bx = blockIdx.x;                               \
    while (p < MV_PARTS - 1 && bx >= MV_SEL(n) * MV_SEL(k)) { \
        bx -= MV_SEL(n) * MV_SEL(k);                          \
        p++;                                                  \
    }
// (x2, xs, op): the input transform (MV_IN_*), applied to every part's x.
// (norm_group, norm_eps, norm_inv): the folded norm (MvNorm; norm_group 0: none).
// (conv_state, conv_w, conv_k): the conv folded into part 0 (MvConv; conv_k 0: none).
// defer_parts: a mask of the parts (bit p: part p) whose column slices are left unsummed in the
// scratch for a later kernel, which adds them up itself (the router's: route_topk; the
// hyper-connection read's down projection and injection logits: hc_up_mix), so no block waits for
// the others to sum them.
// ahead_parts: a mask of the 4-bit parts whose blocks copy their weights into shared memory before
// they wait (mv_ahead_q4; the host checks that it applies and asks for the shared memory).
#define MATVEC_MANY_ARGS                                                                                      \
    const float *x, const float *x2, float xs, int op, int cols, float *scratch, MV_PART_ARGS(0), MV_PART_ARGS(1), \
        MV_PART_ARGS(2), MV_PART_ARGS(3), int norm_group, float norm_eps, float *norm_inv, float *conv_state,      \
        const float *conv_w, int conv_k, int defer_parts, int ahead_parts
#define MATVEC_MANY_PART(B, NORM, AHEAD) MATVEC_MANY_PART_Y(B, NORM, AHEAD, MV_SEL(y))
// (Y: the block's part's output.)
#define MATVEC_MANY_PART_Y(B, NORM, AHEAD, Y) MATVEC_MANY_PART_YF(B, NORM, AHEAD, Y, false)
// (FLAT: the caller found p and bx in a flat grid.)
#define MATVEC_MANY_PART_YF(B, NORM, AHEAD, Y, FLAT)                                                          \
    matvec_many_part<B, NORM, AHEAD, FLAT>(x, MvIn{x2, xs, op}, cols, MV_SEL(g), scratch, MV_SEL(W), MV_SEL(S), MV_SEL(Bi), \
                        Y, MV_SEL(r), MV_SEL(l), MV_SEL(n), MV_SEL(k),                               \
                        MvNorm{norm_group, norm_eps, norm_inv}, MvConv{conv_state, conv_w, conv_k},          \
                        NORM ? ((defer_parts >> p) & 1) != 0 : p == 0 && defer_parts != 0,                 \
                        ((ahead_parts >> p) & 1) != 0, p, bx)
// (matvec_many_part waits for the previous kernel: mv_core's EARLY.)
// matvec_many's body (without KSPAN: each kernel opens its own).
__device__ __forceinline__ void matvec_many_body(MATVEC_MANY_ARGS) {
    const int p = blockIdx.y, bx = blockIdx.x;
    switch (MV_SEL(b)) {
        case 2:
            MATVEC_MANY_PART(2, true, false);
            break;
        case 4:
            MATVEC_MANY_PART(4, true, false);
            break;
        default:
            MATVEC_MANY_PART(8, true, false);
            break;
    }
}
#define MATVEC_MANY_PASS                                                                                      \
    x, x2, xs, op, cols, scratch, W0, S0, Bi0, y0, r0, l0, n0, k0, b0, g0, W1, S1, Bi1, y1, r1, l1, n1, k1, b1, g1, \
        W2, S2, Bi2, y2, r2, l2, n2, k2, b2, g2, W3, S3, Bi3, y3, r3, l3, n3, k3, b3, g3, norm_group, norm_eps,  \
        norm_inv, conv_state, conv_w, conv_k, defer_parts, ahead_parts

extern "C" __global__ void __launch_bounds__(256, 2) matvec_many(MATVEC_MANY_ARGS) {
    KSPAN;
    matvec_many_body(MATVEC_MANY_PASS);
}

// matvec_many over a verifying pass's rows (blockIdx.z; row_ptr): every vector a row's own but the
// weights, the norm weight (x2 of MV_IN_ONE_PLUS) and the conv's weights; no conv folded (its state
// is the rows' one, updated row after row), so conv_state must be null.
extern "C" __global__ void __launch_bounds__(256, 2) matvec_many_rows(MATVEC_MANY_ARGS, long long rs) {
    KSPAN;
    x = row_ptr(x, rs);
    if (op != MV_IN_ONE_PLUS) x2 = row_ptr(x2, rs);
    scratch = row_ptr(scratch, rs);
    y0 = row_ptr(y0, rs);
    y1 = row_ptr(y1, rs);
    y2 = row_ptr(y2, rs);
    y3 = row_ptr(y3, rs);
    norm_inv = row_ptr(norm_inv, rs);
    matvec_many_body(MATVEC_MANY_PASS);
}

// matvec_many for parts of 4 and 8 bits only and no folded norm (its norm arguments are ignored):
// without the 2-bit instantiation and the norm the kernel fits the register budget of 3 blocks of
// 256 threads per multiprocessor (DevLinear's planning knows it).
extern "C" __global__ void __launch_bounds__(256, 3) matvec_many_48(MATVEC_MANY_ARGS) {
    KSPAN;
    const int p = blockIdx.y, bx = blockIdx.x;
    if (MV_SEL(b) == 4) {
        MATVEC_MANY_PART(4, false, false);
    } else {
        MATVEC_MANY_PART(8, false, false);
    }
}

// matvec_many_48 over a verifying pass's rows (blockIdx.z; row_ptr), as matvec_many_rows, with
// matvec_many_48's plans (3 blocks a multiprocessor) and sums, bit for bit: the router launch of a
// pass's MoE blocks. Two blocks a multiprocessor: at three the row pointers spilled 108 bytes, with
// every part's output moved up front or only this block's.
//
// Its grid is flat, each row's parts' n_p k_p blocks one after another (blockIdx.y unused), as
// matvec_many_ahead's: in a grid as wide as the widest part for every part, the blocks that leave at
// once took the free places ahead of the second row's working blocks, which passed their wait
// 2.3-2.7 us after the first row's (session 56's timeline; 0.2 us for the step's router).
// (matvec_many_rows keeps the two-dimensional grid: with this search it spilled 76 bytes, and its
// working blocks waited about 1 us at most.)
extern "C" __global__ void __launch_bounds__(256, 2) matvec_many_48_rows(MATVEC_MANY_ARGS, long long rs) {
    KSPAN;
    MV_FLAT_PART;
    x = row_ptr(x, rs);
    if (op != MV_IN_ONE_PLUS) x2 = row_ptr(x2, rs);
    scratch = row_ptr(scratch, rs);
    if (MV_SEL(b) == 4) {
        MATVEC_MANY_PART_YF(4, false, false, row_ptr(MV_SEL(y), rs), true);
    } else {
        MATVEC_MANY_PART_YF(8, false, false, row_ptr(MV_SEL(y), rs), true);
    }
}

// matvec_many_48 over a verifying pass's two input rows in each block (mv_core's NX = 2): row 1 of x
// at x + xstride floats, of part p's output at y_p + ystride floats. Every part 4-bit and whole
// (one column slice: k_p 1), no norm, no deferred or ahead parts (the host checks); each row's sums
// are matvec_many_48's on that row with the same plan, bit for bit. With the conv folded into part 0
// (its state the rows' one), row 0's conv runs first and the state after it is written to
// `conv_mid` (mv_conv_rows_x2). Two blocks a multiprocessor: at three (matvec_many_48's) the two
// rows' sums spill.
//
// Its grid is flat, the parts' n_p blocks one after another (blockIdx.y unused), as
// matvec_many_ahead's: a grid as wide as the widest part for every part (matvec_many_48's) holds
// hundreds of blocks that leave at once, and at two blocks a multiprocessor they took the free
// places one after another ahead of the small parts' working blocks, which then passed their wait
// 13-15 us after the first (session 56's timeline of the GDN input projections over both rows,
// against about 2 us at matvec_many_48's three). Which block computes a tile does not change its
// sums.
extern "C" __global__ void __launch_bounds__(256, 2)
    matvec_many_x2(MATVEC_MANY_ARGS, long long xstride, long long ystride, float* conv_mid) {
    KSPAN;
    MV_FLAT_PART;  // (every part one slice: k_p 1)
    const int nb = MV_SEL(n);
    if (bx >= nb) return;
    typedef MvFmt<4> F;
    const int rows = MV_SEL(r), L = MV_SEL(l), gs = MV_SEL(g);
    const int C = cols / F::CPC, gpr = cols / gs, gshift = __ffs(gs) - 1;
    const MvMat a{(const uint4*)MV_SEL(W), MV_SEL(S), MV_SEL(Bi)};
    float* y = MV_SEL(y);
    const auto put = [&](int tile, const float* v, int r) {
#pragma unroll
        for (int i = 0; i < MV_R; i++) {
            if (tile * MV_R + i < rows) y[r * ystride + tile * MV_R + i] = v[i];
        }
    };
#if MV_DP4A
    mv_core<4, MV_PLAIN, true, true, 2>(a, a, x, MvIn{x2, xs, op}, rows, C, C, gpr, gshift, L, bx, nb, put, nullptr,
                                        MvNoPre{}, false, MvLdX{}, xstride);
#else
    // Without dp4a (the MV_NO_DP4A measurement variant) the float core takes the rows one pass each.
    grid_enter();
    for (int r = 0; r < 2; r++) {
        mv_core<4, MV_PLAIN>(a, a, x + r * xstride, MvIn{x2, xs, op}, rows, C, C, gpr, gshift, L, bx, nb,
                             [&](int tile, const float* v) { put(tile, v, r); });
        __syncthreads();
    }
#endif
    if (p == 0 && conv_k > 0) {
        __syncthreads();
        mv_conv_rows_x2(MvConv{conv_state, conv_w, conv_k}, y, y + ystride, conv_mid, rows, bx, nb, L);
    }
}

// matvec_many_48 whose 4-bit parts of bit p set in ahead_parts take their weights ahead
// (mv_ahead_q4): a block's share of the weights then fills about 100 KB of shared memory, so no
// more than 2 blocks fit a multiprocessor and the kernel takes their register budget. Its grid is
// flat, the parts' n_p k_p blocks one after another (blockIdx.y unused): with 2 blocks a
// multiprocessor, a grid with idle blocks (matvec_many_48's, as wide as the widest part for every
// part) left the last parts' blocks waiting for slots until the first blocks had ended.
extern "C" __global__ void __launch_bounds__(256, 2) matvec_many_ahead(MATVEC_MANY_ARGS) {
    KSPAN;
    MV_FLAT_PART;
    if (MV_SEL(b) == 4) {
        MATVEC_MANY_PART(4, false, true);
    } else {
        MATVEC_MANY_PART(8, false, true);
    }
}

// The hyper-connection read's up projection and mix in one launch (4 streams): the tiled core in
// MV_STREAMS tiles over W_up [4 H, r] and in(x) (the transform: silu(low / hc)), and each finished
// tile t writes out[t] = mean over streams s of sigmoid(mix_s[t]) * normed[s H + t], the
// expression of hc_mix (ops.cu), without storing the mix. With `inv` (the streams' 1 / rms, from a
// matvec_many with the norm folded in) normed is not stored either: normed[i] = xr[i] inv[s]
// (1 + w[i]), the expression of rmsnorm_zc (ops.cu), from the residual xr and the norm weight w.
//
// With `parts` the read's down projection left its sum to this kernel (matvec_many's defer_parts,
// with the folded norm, one column slice a stream): x is loaded as that sum (MvLdSlices) and the
// streams' 1 / rms are computed while loading, into `hc_inv` (shared), in place of `inv`.
//
// With `ij_out` the read's injection logits were left unsummed too (their ij_slices column slices of
// MV_R rows, ij_slices / MV_R a stream, and the slices' sums of squares): the grid's last block adds
// them up into ij_out, as matvec_many_part's last block would have, while the others compute the
// tiles. That block takes one round trip and a few sums, far less than a tile's block, so the sum
// leaves the read's launch without lengthening this one (session 25 had this kernel's last block
// add them after its tiles, on the path to the next launch, and lost).
__device__ __noinline__ void hc_inject_sum(const float* ij_parts, const float* ij_ssq, int ks, float* ij_out, int H,
                                           float eps) {
    __shared__ float sums[MV_MAX_SLICES * MV_R], sq_s[MV_MAX_SLICES], scale[MV_MAX_SLICES];
    const int t = threadIdx.x, per = ks / MV_R;
    if (t < ks) sq_s[t] = __ldcg(ij_ssq + t);
    if (t < ks * MV_R) sums[t] = __ldcg(ij_parts + t);
    __syncthreads();
    if (t < ks) {
        const int g0s = (t / per) * per;
        float sq = 0.0f;
        for (int i = 0; i < per; i++) sq += sq_s[g0s + i];
        scale[t] = rsqrtf(sq / (float)H + eps);
    }
    __syncthreads();
    if (t < MV_R) {
        float s = 0.0f;
        for (int k = 0; k < ks; k++) s += scale[k] * sums[k * MV_R + t];
        ij_out[t] = s;
    }
}

struct MvLdSlices {
    const float* ssq;  // the slices' sums of squares; null: x as it is (mv_ld4)
    float eps;
    int H;
    int cols;
    float* inv;  // where the thread that loads float4 0 keeps the streams' 1 / rms
    // Float4 i of sum over slices s of (1 / rms_s) parts[s cols ..]: each slice scaled by its
    // stream's 1 / rms = rsqrt(ssq_s / H + eps) and added in slice order from 0, the expressions
    // and order of matvec_many_part's last block; every load of it in flight together.
    __device__ float4 operator()(const float* __restrict__ x, int i, bool aligned) const {
        if (!ssq) return mv_ld4(x, i, aligned);
        float q[MV_R];
        float4 v[MV_R];
#pragma unroll
        for (int s = 0; s < MV_R; s++) {
            q[s] = __ldcg(ssq + s);
            v[s] = __ldcg((const float4*)(x + (size_t)s * cols) + i);
        }
        float4 r = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int s = 0; s < MV_R; s++) {
            const float scale = rsqrtf(q[s] / (float)H + eps);
            if (i == 0) inv[s] = scale;
            r.x += scale * v[s].x;
            r.y += scale * v[s].y;
            r.z += scale * v[s].z;
            r.w += scale * v[s].w;
        }
        return r;
    }
};

template <int BITS>
__device__ __forceinline__ void hc_up_mix_impl(const u32* W, const u16* S, const u16* B, const float* x, const MvIn in,
                                               const float* normed, const float* xr, const float* w,
                                               const float* inv, float* out, int H, int cols, int gs, int L,
                                               const float* parts, const float* ssq, float eps, float* hc_inv,
                                               int nblk) {
    typedef MvFmt<BITS> F;
    if (parts) {
        x = parts;
        inv = hc_inv;
    }
    const int C = cols / F::CPC, gpr = cols / gs, gshift = __ffs(gs) - 1;
    const MvMat a{(const uint4*)W, S, B};
    // (`MV_FLOAT_STREAMS`: the float core here, a measurement variant.)
#ifdef MV_FLOAT_STREAMS
    constexpr bool INT = false;
#else
    constexpr bool INT = true;
#endif
    // The residual (written two launches earlier: the launch before this one has waited for it) and
    // the norm weight of the thread's first tile are loaded before the wait (`HC_NO_PRELOAD`: in
    // the epilogue, as before session 18).
    float pxr[MV_R], pw[MV_R];
    int pt = -1;
    auto pre = [&](int t) {
#ifndef HC_NO_PRELOAD
        if (inv && t >= 0) {
            pt = t;
#pragma unroll
            for (int s = 0; s < MV_R; s++) {
                pxr[s] = xr[(size_t)s * H + t];
                pw[s] = w[(size_t)s * H + t];
            }
        }
#endif
    };
    mv_core<BITS, MV_STREAMS, true, INT>(a, a, x, in, H, C, C, gpr, gshift, L, blockIdx.x, nblk,
                              [&](int t, const float* v) {
                                  const bool held = t == pt;
                                  float acc = 0.0f;
#pragma unroll
                                  for (int s = 0; s < MV_R; s++) {
                                      const size_t i = (size_t)s * H + t;
                                      const float n = inv ? (held ? pxr[s] : xr[i]) * inv[s] * (1.0f + (held ? pw[s] : w[i]))
                                                          : normed[i];
                                      acc += sigmoidf_(v[s]) * n;
                                  }
                                  out[t] = acc / (float)MV_R;
                              },
                              nullptr, pre, false, MvLdSlices{parts ? ssq : nullptr, eps, H, cols, hc_inv});
}

#define HC_UP_MIX_ARGS                                                                                      \
    const u32 *W, const u16 *S, const u16 *B, const float *x, const float *x2, float xs, int op,              \
        const float *normed, float *out, int H, int cols, int gs, int bits, int L, const float *xr,            \
        const float *w, const float *inv, const float *parts, const float *ssq, float eps,                   \
        const float *ij_parts, const float *ij_ssq, int ij_slices, float *ij_out
// (Without KSPAN: each kernel opens its own, so the timeline names the kernel, not this body.)
__device__ __forceinline__ void hc_up_mix_body(HC_UP_MIX_ARGS) {
    // (The streams' 1 / rms where the read's sum was deferred: MvLdSlices.)
    __shared__ float hc_inv[MV_R];
#ifdef HC_EARLY_RELEASE
    // Measurement variant (CHERENKOV_KERNEL_DEFINES=HC_EARLY_RELEASE): the next kernel (the mixer's
    // input projection) may be scheduled as soon as this launch's blocks all run, before they wait
    // for the read's down projection, so its weights taken ahead (matvec_many_ahead) start a
    // kernel earlier. Its own wait still waits for this launch, which waits for the one before.
    grid_release();
#endif
    // The injection logits' sum: the grid's last block (one more than the tiles' blocks).
    int nblk = gridDim.x;
    if (ij_out) {
        nblk--;
        if ((int)blockIdx.x == nblk) {
            grid_enter();
            hc_inject_sum(ij_parts, ij_ssq, ij_slices, ij_out, H, eps);
            return;
        }
    }
    // (hc_up_mix_impl waits for the previous kernel: mv_core's EARLY.)
    const MvIn in{x2, xs, op};
    switch (bits) {
        case 2:
            hc_up_mix_impl<2>(W, S, B, x, in, normed, xr, w, inv, out, H, cols, gs, L, parts, ssq, eps, hc_inv, nblk);
            break;
        case 4:
            hc_up_mix_impl<4>(W, S, B, x, in, normed, xr, w, inv, out, H, cols, gs, L, parts, ssq, eps, hc_inv, nblk);
            break;
        default:
            hc_up_mix_impl<8>(W, S, B, x, in, normed, xr, w, inv, out, H, cols, gs, L, parts, ssq, eps, hc_inv, nblk);
            break;
    }
}

extern "C" __global__ void __launch_bounds__(256, 2) hc_up_mix(HC_UP_MIX_ARGS) {
    KSPAN;
    hc_up_mix_body(W, S, B, x, x2, xs, op, normed, out, H, cols, gs, bits, L, xr, w, inv, parts, ssq, eps, ij_parts,
                   ij_ssq, ij_slices, ij_out);
}

// hc_up_mix over a verifying pass's rows (blockIdx.z; row_ptr): every vector a row's own but the
// weights, the norm weight w and x2 where it is one (MV_IN_ONE_PLUS).
extern "C" __global__ void __launch_bounds__(256, 2) hc_up_mix_rows(HC_UP_MIX_ARGS, long long rs) {
    KSPAN;
    hc_up_mix_body(W, S, B, row_ptr(x, rs), op == MV_IN_ONE_PLUS ? x2 : row_ptr(x2, rs), xs, op, row_ptr(normed, rs), row_ptr(out, rs), H, cols,
                   gs, bits, L, row_ptr(xr, rs), w, row_ptr(inv, rs), row_ptr(parts, rs), row_ptr(ssq, rs), eps,
                   row_ptr(ij_parts, rs), row_ptr(ij_ssq, rs), ij_slices, row_ptr(ij_out, rs));
}

// Every matvec_q* kernel ends with (x2, xs, op): the input transform (MV_IN_*), then (xres, inj,
// hc): the output (MvOut).
// 3, 5 and 6 bits: one warp per row reading x from global memory (rpb unused) when op is
// MV_IN_PLAIN, else matvec_affine_in with rpb rows per block.
#define MATVEC_AFFINE(B)                                                                                       \
    extern "C" __global__ void matvec_q##B(const u32* W, const u16* S, const u16* Bi, const float* x, float* y, \
                                           int rows, int cols, int gs, int rpb, const float* x2, float xs,      \
                                           int op, float* xres, const float* inj, int hc) { KSPAN;             \
        grid_enter();                                                                                          \
        const MvOut out{y, xres, inj, hc};                                                                     \
        if (op == MV_IN_PLAIN) {                                                                               \
            matvec_affine<B>(W, S, Bi, x, out, rows, cols, gs);                                                \
        } else {                                                                                               \
            matvec_affine_in<B>(W, S, Bi, x, MvIn{x2, xs, op}, out, rows, cols, gs, rpb);                      \
        }                                                                                                      \
    }
// rpb = MV_TILED | L: the tiled kernel with L lanes per tile (DevLinear::matvec picks it whenever it
// applies); otherwise rpb is rows per block of the one-warp-per-row kernel (fallback for rows that
// are not whole 16-byte chunks or x too wide for staging with its sums).
// MINB: blocks of 256 threads each multiprocessor must hold (the register budget: 80 registers at 3,
// which the 4- and 8-bit kernels fit without spilling; 2-bit needs more). DevLinear::matvec knows it.
#define MATVEC_AFFINE_TILED(B, MINB)                                                                           \
    extern "C" __global__ void __launch_bounds__(256, MINB)                                                   \
        matvec_q##B(const u32* W, const u16* S, const u16* Bi, const float* x, float* y, int rows, int cols,   \
                    int gs, int rpb, const float* x2, float xs, int op, float* xres, const float* inj, int hc) { KSPAN; \
        const MvIn in{x2, xs, op};                                                                             \
        const MvOut out{y, xres, inj, hc};                                                                     \
        if (rpb & MV_TILED) {                                                                                  \
            matvec_tiled<B>(W, S, Bi, x, in, out, rows, cols, gs, rpb & (MV_TILED - 1));                       \
        } else {                                                                                               \
            grid_enter();                                                                                      \
            matvec_affine_sx<B>(W, S, Bi, x, in, out, rows, cols, gs, rpb);                                    \
        }                                                                                                      \
    }
// NX input rows through one 4-bit matrix in one launch (mv_core's NX): row r of x at x + r
// xstride, its output at y + r ystride, or injected into the residual xres + r resstride with the
// logits inj + r injstride (MvOut). The weights each step loads serve every row, so a row costs
// its staging and products, not its loads. L lanes a tile; 2 blocks of 256 threads a
// multiprocessor (the rows' sums take registers); the host gives NX rows of staged digits
// (mvd_rows_float4s each). Each row's result is matvec_q4's on that row, bit for bit.
template <int NX>
__device__ __forceinline__ void matvec_q4_rows(const u32* W, const u16* S, const u16* Bi, const float* x, float* y,
                                               int rows, int cols, int gs, int L, long long xstride,
                                               long long ystride, float* xres, const float* inj, int hc,
                                               long long resstride, long long injstride) {
    typedef MvFmt<4> F;
    const int C = cols / F::CPC, gpr = cols / gs, gshift = __ffs(gs) - 1;
    const MvMat a{(const uint4*)W, S, Bi};
    auto out_of = [&](int r) {
        return MvOut{y ? y + r * ystride : nullptr, xres ? xres + r * resstride : nullptr,
                     inj ? inj + r * injstride : nullptr, hc};
    };
#if MV_DP4A
    mv_core<4, MV_PLAIN, true, true, NX>(
        a, a, x, MV_IN_NONE, rows, C, C, gpr, gshift, L, blockIdx.x, gridDim.x,
        [&](int tile, const float* v, int r) { mv_out_rows<MV_R>(out_of(r), tile * MV_R, rows, v); }, nullptr,
        MvNoPre{}, false, MvLdX{}, xstride);
#else
    // Without dp4a (the MV_NO_DP4A measurement variant) the float core takes the rows one pass each.
    grid_enter();
    for (int r = 0; r < NX; r++) {
        const MvOut o = out_of(r);
        mv_core<4, MV_PLAIN>(a, a, x + r * xstride, MV_IN_NONE, rows, C, C, gpr, gshift, L, blockIdx.x, gridDim.x,
                             [&](int tile, const float* v) { mv_out_rows<MV_R>(o, tile * MV_R, rows, v); });
        __syncthreads();
    }
#endif
}
#define MATVEC_Q4_ROWS(NX)                                                                                     \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                      \
        matvec_q4_x##NX(const u32* W, const u16* S, const u16* Bi, const float* x, float* y, int rows, int cols, \
                        int gs, int L, long long xstride, long long ystride, float* xres, const float* inj, int hc, \
                        long long resstride, long long injstride) {                                             \
        KSPAN;                                                                                                 \
        matvec_q4_rows<NX>(W, S, Bi, x, y, rows, cols, gs, L, xstride, ystride, xres, inj, hc, resstride,      \
                           injstride);                                                                         \
    }
MATVEC_Q4_ROWS(2)
MATVEC_Q4_ROWS(4)

MATVEC_AFFINE_TILED(2, 2)
MATVEC_AFFINE(3)
MATVEC_AFFINE_TILED(4, 3)
MATVEC_AFFINE(5)
MATVEC_AFFINE(6)
MATVEC_AFFINE_TILED(8, 3)

__device__ __forceinline__ void matvec_float_row_impl(const void* W, const float* x, float* y, int row, int cols, int dtype) {
    const int lane = threadIdx.x & 31;
    float acc = 0.0f;
    if (dtype == 0) {
        const u16* w = (const u16*)W + (size_t)row * cols;
        for (int j = lane; j < cols; j += 32) acc += bf16f(w[j]) * x[j];
    } else if (dtype == 1) {
        const u16* w = (const u16*)W + (size_t)row * cols;
        for (int j = lane; j < cols; j += 32) acc += f16f(w[j]) * x[j];
    } else {
        const float* w = (const float*)W + (size_t)row * cols;
        for (int j = lane; j < cols; j += 32) acc += w[j] * x[j];
    }
    acc = warp_sum(acc);
    if (lane == 0) y[row] = acc;
}

// Floating weights (narrow linears, unquantized checkpoints): dtype 0 = bf16, 1 = f16, 2 = f32.
// (x2, xs, op): the input transform (MV_IN_*), applied while x is staged.
extern "C" __global__ void matvec_float(const void* W, const float* x_global, float* y, int rows, int cols, int dtype,
                                        int rpb, const float* x2, float xs, int op) {
    KSPAN;
    grid_enter();
    extern __shared__ float sx[];
    stage_x_in(x_global, MvIn{x2, xs, op}, sx, cols);
    const float* x = sx;
    const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int end = min(rows, (blockIdx.x + 1) * rpb);
    for (int row = blockIdx.x * rpb + warp; row < end; row += warps) matvec_float_row_impl(W, x, y, row, cols, dtype);
}

// Row step[0] (the step's token) of an embedding table, dequantized, written `copies` times (the
// hyper-connection streams are initialised with copies of the embedding). dtype: -1 affine, else as
// matvec_float.
extern "C" __global__ void embed_row(const void* W, const u16* S, const u16* B, const int* step, float* out, int cols,
                                     int copies, int dtype, int bits, int gs) {
    KSPAN;
    grid_enter();
    const int row = step[0];
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < cols; j += gridDim.x * blockDim.x) {
        float v;
        if (dtype < 0) {
            const int wpr = cols * bits / 32, gpr = cols / gs;
            const u32* w = (const u32*)W + (size_t)row * wpr;
            const int g = j / gs;
            v = bf16f(S[(size_t)row * gpr + g]) * (float)get_code(w, j, bits) + bf16f(B[(size_t)row * gpr + g]);
        } else if (dtype == 0) {
            v = bf16f(((const u16*)W)[(size_t)row * cols + j]);
        } else if (dtype == 1) {
            v = f16f(((const u16*)W)[(size_t)row * cols + j]);
        } else {
            v = ((const float*)W)[(size_t)row * cols + j];
        }
        for (int c = 0; c < copies; c++) out[(size_t)c * cols + j] = v;
    }
}
