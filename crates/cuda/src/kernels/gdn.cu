// Gated DeltaNet, one token: causal conv, q/k normalisation, the delta-rule recurrence with the
// f32 state kept on the device, and the gated output norm. transformers' state layout: per value
// head S[key_dim][value_dim].

// Causal depthwise conv over [state (K-1 rows, oldest first), x] with silu; shifts the state.
// One thread per channel.
extern "C" __global__ void gdn_conv(const float* x, float* state, const float* w, float* out, int C, int K) {
    KSPAN;
    grid_enter();
    const int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= C) return;
    const float* wk = w + (size_t)ch * K;
    float acc = 0.0f;
    for (int k = 0; k < K - 1; k++) acc += wk[k] * state[(size_t)k * C + ch];
    acc += wk[K - 1] * x[ch];
    for (int k = 0; k + 1 < K - 1; k++) state[(size_t)k * C + ch] = state[(size_t)(k + 1) * C + ch];
    if (K > 1) state[(size_t)(K - 2) * C + ch] = x[ch];
    out[ch] = siluf_(acc);
}

// Stages q and k of value head hv's key head into shared memory (sh[0..dk) and sh[dk..2 dk)),
// L2-normalised there (q also scaled by dk^-1/2; every value head of a key head does this for
// itself, which is cheaper than a launch), and returns the head's v. `qkv` is the conv output
// [q (nk*dk) | k (nk*dk) | v].
__device__ __forceinline__ const float* gdn_stage_qk(const float* qkv, float* sh, int hv, int nk, int nv, int dk, int dv) {
    __shared__ float scratch[64];
    const int hk = hv / (nv / nk);
    const float* q = qkv + (size_t)hk * dk;
    const float* k = qkv + (size_t)(nk + hk) * dk;
    float sq = 0.0f, sk = 0.0f;
    for (int i = threadIdx.x; i < dk; i += blockDim.x) {
        const float a = q[i], b = k[i];
        sh[i] = a;
        sh[dk + i] = b;
        sq += a * a;
        sk += b * b;
    }
    // Both norms' sums over one set of barriers (block_sum_n: each block_sum's, bit for bit).
    float sums[2] = {sq, sk};
    block_sum_n<2>(sums, scratch);
    const float iq = rsqrtf(sums[0] + 1e-6f) * rsqrtf((float)dk), ik = rsqrtf(sums[1] + 1e-6f);
    for (int i = threadIdx.x; i < dk; i += blockDim.x) {
        sh[i] *= iq;
        sh[dk + i] *= ik;
    }
    __syncthreads();
    return qkv + (size_t)2 * nk * dk + (size_t)hv * dv;
}

// gdn_stage_qk for R rows whose every value of q and k is already held by a thread (dk <= blockDim):
// thread i below dk holds row t's q[i] and k[i] in qi[t] and ki[t], staged at sh + 2 t dk. Each row's
// arithmetic is gdn_stage_qk's, in the same order; the rows' 2 R sums share one set of barriers.
template <int R>
__device__ __forceinline__ void gdn_stage_qk_held(const float (&qi)[R], const float (&ki)[R], float* sh, int dk) {
    __shared__ float scratch[64 * R];
    const int i = threadIdx.x;
    float sums[2 * R];
#pragma unroll
    for (int t = 0; t < R; t++) {
        sums[2 * t] = 0.0f, sums[2 * t + 1] = 0.0f;
        if (i < dk) {
            sh[2 * t * dk + i] = qi[t];
            sh[2 * t * dk + dk + i] = ki[t];
            sums[2 * t] += qi[t] * qi[t];
            sums[2 * t + 1] += ki[t] * ki[t];
        }
    }
    block_sum_n<2 * R>(sums, scratch);
#pragma unroll
    for (int t = 0; t < R; t++) {
        const float iq = rsqrtf(sums[2 * t] + 1e-6f) * rsqrtf((float)dk), ik = rsqrtf(sums[2 * t + 1] + 1e-6f);
        if (i < dk) {
            sh[2 * t * dk + i] *= iq;
            sh[2 * t * dk + dk + i] *= ik;
        }
    }
    __syncthreads();
}

// Gated RMSNorm of value head hv's output, in place, by the whole block (after a __syncthreads that
// makes the head's outputs visible): o = w * (o / rms(o)) * act(z); act 0 = sigmoid, 1 = silu.
__device__ __forceinline__ void gdn_gated_norm(float* o, const float* z, const float* w, int hv, int dv, float eps,
                                               int act) {
    __shared__ float nscratch[32];
    float* h = o + (size_t)hv * dv;
    const float* zh = z + (size_t)hv * dv;
    float ss = 0.0f;
    for (int j = threadIdx.x; j < dv; j += blockDim.x) ss += h[j] * h[j];
    ss = block_sum(ss, nscratch);
    const float inv = rsqrtf(ss / (float)dv + eps);
    for (int j = threadIdx.x; j < dv; j += blockDim.x) {
        const float gate = act == 0 ? sigmoidf_(zh[j]) : siluf_(zh[j]);
        h[j] = w[j] * (h[j] * inv) * gate;
    }
}

// The recurrence for one token; one block per value head, one thread per value lane (blockDim = dv).
//   S *= exp(g); delta = beta (v - S^T k); S += k delta^T; y = S^T q
// with beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias); then the gated output norm of the
// head (gdn_gated_norm), so `out` holds norm(y) * act(z). (`digits` is gdn_recurrent_split's; here
// it is not read.)
extern "C" __global__ void gdn_recurrent(const float* qkv, const float* a, const float* b, const float* A_log,
                                         const float* dt_bias, float* S, float* out, int nk, int nv, int dk, int dv,
                                         const float* z, const float* norm_w, float eps, int act, u32* digits) {
    KSPAN;
    grid_enter();
    extern __shared__ float sh[];  // q then k of this head's key head: 2 * dk floats
    const int hv = blockIdx.x;
    const float* v = gdn_stage_qk(qkv, sh, hv, nk, nv, dk, dv);
    const float* sq = sh;
    const float* sk = sh + dk;
    const float beta = sigmoidf_(b[hv]);
    const float g = -expf(A_log[hv]) * softplusf_(a[hv] + dt_bias[hv]);
    const float decay = expf(g);
    float* s = S + (size_t)hv * dk * dv;
    for (int j = threadIdx.x; j < dv; j += blockDim.x) {
        float kv = 0.0f;
        for (int i = 0; i < dk; i++) {
            const float x = s[(size_t)i * dv + j] * decay;
            s[(size_t)i * dv + j] = x;
            kv += x * sk[i];
        }
        const float delta = (v[j] - kv) * beta;
        float y = 0.0f;
        for (int i = 0; i < dk; i++) {
            const float x = s[(size_t)i * dv + j] + sk[i] * delta;
            s[(size_t)i * dv + j] = x;
            y += x * sq[i];
        }
        out[(size_t)hv * dv + j] = y;
    }
    __syncthreads();
    gdn_gated_norm(out, z, norm_w, hv, dv, eps, act);
}

// gdn_recurrent with each column of S split over GDN_SPLIT threads that keep their rows in registers:
// S is read once and written once (the one-thread-per-column kernel read it twice and wrote it twice,
// from 4 warps per head). blockDim = dv * GDN_SPLIT, thread (j, r) = (tid % dv, tid / dv) holds rows
// r * rows .. (r + 1) * rows of column j, rows = dk / GDN_SPLIT <= GDN_MAX_ROWS. Shared memory: q, k
// (2 * dk floats), then the partial sums (GDN_SPLIT * dv floats). With `digits` (dv a multiple of 32),
// the head's warps also write `out` as the out_proj's 4-bit core stages it (mvd_put_chunk), so that
// its blocks copy that image instead of converting `out` each (MV_IN_DIGITS).
#define GDN_SPLIT 4
#define GDN_MAX_ROWS 32
extern "C" __global__ void __launch_bounds__(512) gdn_recurrent_split(const float* qkv, const float* a, const float* b, const float* A_log,
                                               const float* dt_bias, float* S, float* out, int nk, int nv, int dk, int dv,
                                               const float* z, const float* norm_w, float eps, int act, u32* digits) {
    KSPAN;
    extern __shared__ float sh[];
    const int hv = blockIdx.x;
    const int j = threadIdx.x % dv, r = threadIdx.x / dv;
    const int rows = dk / GDN_SPLIT, i0 = r * rows;
    float* s = S + (size_t)hv * dk * dv + (size_t)i0 * dv + j;
    // The state (written only by this kernel, a step earlier: the launch before this one has waited
    // for everything before it) and the weights are read before waiting, so their loads overlap the
    // input projection this launch waits for.
    float col[GDN_MAX_ROWS];
#pragma unroll
    for (int t = 0; t < GDN_MAX_ROWS; t++) {
        if (t < rows) col[t] = s[(size_t)t * dv];
    }
    const float a_log = A_log[hv], dt = dt_bias[hv];
#ifndef GDN_TAIL_LATE
    // The norm weight too; and once waited, the input projection's outputs this thread needs (its
    // value, the head's a and b, its gate z) are requested before the staging's reductions, so no
    // load waits behind a barrier. The gated norm then takes y from the threads that hold it
    // instead of reading `out` back (`GDN_TAIL_LATE`: loads where used, the norm over `out`, as
    // before session 19). The same arithmetic in the same order either way.
    const float wj = norm_w[j];
    grid_enter();
    const float* vrow = qkv + (size_t)2 * nk * dk + (size_t)hv * dv;
    const float vj = vrow[j], bh = b[hv], ah = a[hv], zj = z[(size_t)hv * dv + j];
    gdn_stage_qk(qkv, sh, hv, nk, nv, dk, dv);
#else
    grid_enter();
    const float* v = gdn_stage_qk(qkv, sh, hv, nk, nv, dk, dv);
    const float vj = v[j], bh = b[hv], ah = a[hv];
#endif
    const float* sq = sh;
    const float* sk = sh + dk;
    float* part = sh + 2 * dk;
    const float beta = sigmoidf_(bh);
    const float decay = expf(-expf(a_log) * softplusf_(ah + dt));
    float kv = 0.0f;
#pragma unroll
    for (int t = 0; t < GDN_MAX_ROWS; t++) {
        if (t < rows) {
            col[t] *= decay;
            kv += col[t] * sk[i0 + t];
        }
    }
    part[r * dv + j] = kv;
    __syncthreads();
    kv = 0.0f;
    for (int p = 0; p < GDN_SPLIT; p++) kv += part[p * dv + j];
    const float delta = (vj - kv) * beta;
    float y = 0.0f;
#pragma unroll
    for (int t = 0; t < GDN_MAX_ROWS; t++) {
        if (t < rows) {
            const float x = col[t] + sk[i0 + t] * delta;
            s[(size_t)t * dv] = x;
            y += x * sq[i0 + t];
        }
    }
    __syncthreads();
    part[r * dv + j] = y;
    __syncthreads();
#ifndef GDN_TAIL_LATE
    // Threads r == 0 (threadIdx.x < dv) hold the head's outputs: gdn_gated_norm's sum of squares
    // over the same threads in the same order, and its expression.
    if (r == 0) {
        y = 0.0f;
        for (int p = 0; p < GDN_SPLIT; p++) y += part[p * dv + j];
    }
    __shared__ float nscratch[32];
    const float ss = block_sum(r == 0 ? y * y : 0.0f, nscratch);
    if (r == 0) {
        const float inv = rsqrtf(ss / (float)dv + eps);
        const float gate = act == 0 ? sigmoidf_(zj) : siluf_(zj);
        const float o = wj * (y * inv) * gate;
        out[(size_t)hv * dv + j] = o;
        if (digits) mvd_put_chunk(digits, nv * dv / 32, (hv * dv + j) / 32, o);
    }
#else
    if (r == 0) {
        y = 0.0f;
        for (int p = 0; p < GDN_SPLIT; p++) y += part[p * dv + j];
        out[(size_t)hv * dv + j] = y;
    }
    __syncthreads();
    gdn_gated_norm(out, z, norm_w, hv, dv, eps, act);
    __syncthreads();
    if (digits && threadIdx.x < dv) mvd_put_chunk(digits, nv * dv / 32, (hv * dv + j) / 32, out[(size_t)hv * dv + j]);
#endif
}

// gdn_recurrent_split over `nrows` tokens in one launch (a verifying pass's rows: rows.rs). Row t's
// inputs are at qkv + t * qkv_stride, a and b + t * ab_stride, z + t * z_stride; its outputs at
// out + t * z_stride and, with `digits`, digits + t * digits_stride words. The state
// stays in registers from row to row: after each row but the last it is written to
// S_mid + t * nv * dk * dv (what a commit of t + 1 rows restores), after the last to S. Each row's
// arithmetic is gdn_recurrent_split's, in the same order, so each row equals one launch of it.
// Every row's inputs are written by the launch before this one, so the first GDN_ROWS_AHEAD rows'
// are all requested once it has waited, before the first row's work: a later row no longer waits
// a chain of round trips after the row before it (`GDN_ROWS_LATE`: each row's when it starts, as
// before session 52). Those rows' q and k are also normalised together before the first row's
// work (their sums over one set of barriers), and their outputs' gated norms wait for the last of
// them and share one set too: of a row's barrier chain only the state's own steps stay in line
// (session 54). Only where dk <= blockDim (each thread holds at most one of q's and k's values);
// rows past GDN_ROWS_AHEAD load, stage and norm theirs when they start. Shared memory: q and k of
// GDN_ROWS_AHEAD rows (2 dk floats each), then the partial sums (GDN_SPLIT dv floats): the host's
// `gdn_rows_shared`.
#define GDN_ROWS_AHEAD 2
extern "C" __global__ void __launch_bounds__(512) gdn_recurrent_rows(const float* qkv, const float* a, const float* b,
                                               const float* A_log, const float* dt_bias, float* S, float* S_mid,
                                               float* out, int nk, int nv, int dk, int dv, const float* z,
                                               const float* norm_w, float eps, int act, u32* digits, int nrows,
                                               int qkv_stride, int ab_stride, int z_stride, int digits_stride) {
    KSPAN;
    extern __shared__ float sh[];
    __shared__ float nscratch[32 * GDN_ROWS_AHEAD];
    const int hv = blockIdx.x;
    const int j = threadIdx.x % dv, r = threadIdx.x / dv;
    const int rows = dk / GDN_SPLIT, i0 = r * rows;
    const size_t at = (size_t)hv * dk * dv + (size_t)i0 * dv + j;
    const size_t state = (size_t)nv * dk * dv;
    float col[GDN_MAX_ROWS];
#pragma unroll
    for (int t = 0; t < GDN_MAX_ROWS; t++) {
        if (t < rows) col[t] = S[at + (size_t)t * dv];
    }
    const float a_log = A_log[hv], dt = dt_bias[hv];
    const float wj = norm_w[j];
    grid_enter();
    float* part = sh + 2 * dk * GDN_ROWS_AHEAD;
    // Row t's inputs: this thread's value, the head's b and a, its gate, and (threads below dk) its
    // q and k values.
    const auto load = [&](int row, float& vj, float& bh, float& ah, float& zj, float& qi, float& ki) {
        const float* x = qkv + (size_t)row * qkv_stride;
        vj = x[(size_t)2 * nk * dk + (size_t)hv * dv + j];
        bh = b[(size_t)row * ab_stride + hv];
        ah = a[(size_t)row * ab_stride + hv];
        zj = z[(size_t)row * z_stride + (size_t)hv * dv + j];
        const int hk = hv / (nv / nk), i = threadIdx.x;
        qi = i < dk ? x[(size_t)hk * dk + i] : 0.0f;
        ki = i < dk ? x[(size_t)(nk + hk) * dk + i] : 0.0f;
    };
    // A row's output: the gated norm of its y (threads r == 0) given its sum of squares.
    const auto put = [&](int row, float y, float zj, float ss) {
        const float inv = rsqrtf(ss / (float)dv + eps);
        const float gate = act == 0 ? sigmoidf_(zj) : siluf_(zj);
        const float o = wj * (y * inv) * gate;
        out[(size_t)row * z_stride + (size_t)hv * dv + j] = o;
        if (digits) mvd_put_chunk(digits + (size_t)row * digits_stride, nv * dv / 32, (hv * dv + j) / 32, o);
    };
#ifdef GDN_ROWS_LATE
    constexpr bool ahead = false;
#else
    const bool ahead = dk <= (int)blockDim.x;
#endif
    // The rows held ahead, and their outputs until the last of them (threads r == 0).
    const int held_rows = ahead ? min(nrows, GDN_ROWS_AHEAD) : 0;
    float in[GDN_ROWS_AHEAD][6];
    float yh[GDN_ROWS_AHEAD], zh[GDN_ROWS_AHEAD];
#pragma unroll
    for (int t = 0; t < GDN_ROWS_AHEAD; t++) {
        yh[t] = 0.0f, zh[t] = 0.0f;
        for (int k = 0; k < 6; k++) in[t][k] = 0.0f;
        if (t < held_rows) load(t, in[t][0], in[t][1], in[t][2], in[t][3], in[t][4], in[t][5]);
    }
    if (held_rows > 0) {
        float qs[GDN_ROWS_AHEAD], ks[GDN_ROWS_AHEAD];
#pragma unroll
        for (int t = 0; t < GDN_ROWS_AHEAD; t++) qs[t] = in[t][4], ks[t] = in[t][5];
        gdn_stage_qk_held<GDN_ROWS_AHEAD>(qs, ks, sh, dk);
    }
#pragma unroll 1
    for (int row = 0; row < nrows; row++) {
        const float* x = qkv + (size_t)row * qkv_stride;
        float vj = 0.0f, bh = 0.0f, ah = 0.0f, zj = 0.0f, qi, ki;
        // (Each row's values out of the registers by a constant index: a runtime one would put
        // `in` in local memory.)
        const bool held = row < held_rows;
#pragma unroll
        for (int t = 0; t < GDN_ROWS_AHEAD; t++) {
            if (held && row == t) vj = in[t][0], bh = in[t][1], ah = in[t][2], zj = in[t][3];
        }
        if (!held) load(row, vj, bh, ah, zj, qi, ki);
        // The previous row's reads of q, k and the partial sums are done.
        __syncthreads();
        // A held row's q and k were staged at its slot; a later row stages its own at the first.
        const float* sq = held ? sh + 2 * dk * row : sh;
        if (!held) gdn_stage_qk(x, sh, hv, nk, nv, dk, dv);
        const float* sk = sq + dk;
        const float beta = sigmoidf_(bh);
        const float decay = expf(-expf(a_log) * softplusf_(ah + dt));
        float kv = 0.0f;
#pragma unroll
        for (int t = 0; t < GDN_MAX_ROWS; t++) {
            if (t < rows) {
                col[t] *= decay;
                kv += col[t] * sk[i0 + t];
            }
        }
        part[r * dv + j] = kv;
        __syncthreads();
        kv = 0.0f;
        for (int p = 0; p < GDN_SPLIT; p++) kv += part[p * dv + j];
        const float delta = (vj - kv) * beta;
        float y = 0.0f;
#pragma unroll
        for (int t = 0; t < GDN_MAX_ROWS; t++) {
            if (t < rows) {
                col[t] = col[t] + sk[i0 + t] * delta;
                y += col[t] * sq[i0 + t];
            }
        }
        if (row + 1 < nrows) {
#pragma unroll
            for (int t = 0; t < GDN_MAX_ROWS; t++) {
                if (t < rows) S_mid[(size_t)row * state + at + (size_t)t * dv] = col[t];
            }
        }
        __syncthreads();
        part[r * dv + j] = y;
        __syncthreads();
        if (r == 0) {
            y = 0.0f;
            for (int p = 0; p < GDN_SPLIT; p++) y += part[p * dv + j];
        }
        if (held) {
            // Kept until the last held row: then their norms' sums together (block_sum_n, each
            // block_sum's), and their outputs.
#pragma unroll
            for (int t = 0; t < GDN_ROWS_AHEAD; t++) {
                if (row == t) yh[t] = y, zh[t] = zj;
            }
            if (row + 1 == held_rows) {
                float ss[GDN_ROWS_AHEAD];
#pragma unroll
                for (int t = 0; t < GDN_ROWS_AHEAD; t++) ss[t] = r == 0 && t < held_rows ? yh[t] * yh[t] : 0.0f;
                block_sum_n<GDN_ROWS_AHEAD>(ss, nscratch);
                if (r == 0) {
#pragma unroll
                    for (int t = 0; t < GDN_ROWS_AHEAD; t++) {
                        if (t < held_rows) put(t, yh[t], zh[t], ss[t]);
                    }
                }
            }
        } else {
            const float ss = block_sum(r == 0 ? y * y : 0.0f, nscratch);
            if (r == 0) put(row, y, zj, ss);
        }
    }
#pragma unroll
    for (int t = 0; t < GDN_MAX_ROWS; t++) {
        if (t < rows) S[at + (size_t)t * dv] = col[t];
    }
}
