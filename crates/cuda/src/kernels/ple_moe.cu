// PLE gating and its dilated convolution; MoE routing, the experts following the address table, and
// the combination of their outputs.

// PLE gate, one block per stream s: g = <kn_s, qn_s> / sqrt(H); g = sign(g) sqrt(max(|g|, 1e-6));
// gated_s = sigmoid(g) * value.
extern "C" __global__ void ple_gate(const float* kn, const float* qn, const float* value, float* gated, int H) {
    __shared__ float scratch[32];
    const int s = blockIdx.x;
    float acc = 0.0f;
    for (int j = threadIdx.x; j < H; j += blockDim.x) acc += kn[(size_t)s * H + j] * qn[(size_t)s * H + j];
    float g = block_sum(acc, scratch) * rsqrtf((float)H);
    g = (g == 0.0f) ? 0.0f : copysignf(sqrtf(fmaxf(fabsf(g), 1e-6f)), g);
    const float sg = sigmoidf_(g);
    for (int j = threadIdx.x; j < H; j += blockDim.x) gated[(size_t)s * H + j] = sg * value[j];
}

// PLE output, one thread per channel c of the W = hc*H streams: the causal depthwise conv with
// kernel K and dilation `dil` over [state (hist rows, oldest first), gn], then
// x += gated + silu(conv); the state shifts by one row.
extern "C" __global__ void ple_conv(const float* gn, const float* gated, float* state, const float* w, float* x, int W,
                                    int K, int dil) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= W) return;
    const int hist = (K - 1) * dil;
    const float* wk = w + (size_t)c * K;
    float acc = wk[K - 1] * gn[c];
    for (int k = 0; k < K - 1; k++) {
        const int row = hist - (K - 1 - k) * dil;
        acc += wk[k] * state[(size_t)row * W + c];
    }
    x[c] += gated[c] + siluf_(acc);
    for (int r = 0; r + 1 < hist; r++) state[(size_t)r * W + c] = state[(size_t)(r + 1) * W + c];
    if (hist > 0) state[(size_t)(hist - 1) * W + c] = gn[c];
}

// Router: softmax over E logits, top-k (ties to the lower id), renormalised when `norm`.
// One block; writes ids[k] and weights[k] in descending weight.
extern "C" __global__ void route_topk(const float* logits, int E, int k, int norm, int* ids, float* weights) {
    extern __shared__ float p[];  // E floats
    __shared__ float scratch[32];
    float m = NEG_INF;
    for (int e = threadIdx.x; e < E; e += blockDim.x) m = fmaxf(m, logits[e]);
    m = block_max(m, scratch);
    float sum = 0.0f;
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        p[e] = expf(logits[e] - m);
        sum += p[e];
    }
    sum = block_sum(sum, scratch);
    for (int e = threadIdx.x; e < E; e += blockDim.x) p[e] /= sum;
    __syncthreads();
    float total = 0.0f;
    for (int r = 0; r < k; r++) {
        if (threadIdx.x == 0) {
            float bv = -1.0f;
            int bi = 0;
            for (int e = 0; e < E; e++)
                if (p[e] > bv) {
                    bv = p[e];
                    bi = e;
                }
            ids[r] = bi;
            weights[r] = bv;
            total += bv;
            p[bi] = -2.0f;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0 && norm)
        for (int r = 0; r < k; r++) weights[r] /= total;
}

// Gate and up projections of the experts in the address table, entries [first, first + gridDim.y):
// act[e, i] = silu(gate_e x) * (up_e x). Offsets locate the parts inside a record; one warp per row.
// Row dot product with x staged in shared memory where the width allows it (2, 4, 8 bits).
template <int BITS>
__device__ __forceinline__ float row_dot(const u32* w, const u16* s, const u16* b, const float* xg, const float* sx, int cols,
                                         int gs) {
    if constexpr (BITS == 2 || BITS == 4 || BITS == 8) {
        return affine_row_dot_sx<BITS>(w, s, b, sx, cols, gs);
    } else {
        return affine_row_dot<BITS>(w, s, b, xg, cols, gs);
    }
}

template <int BITS>
__device__ void expert_gate_up(const u64* table, int first, const float* x, float* act, int I, int H, int gs, int rpb,
                               u64 g_w, u64 g_s, u64 g_b, u64 u_w, u64 u_s, u64 u_b) {
    extern __shared__ float sx[];
    if constexpr (BITS == 2 || BITS == 4 || BITS == 8) stage_x(x, sx, H);
    const int e = first + blockIdx.y;
    const u8* rec = (const u8*)(table[e] & ~TAG_MASK);
    const int wpr = H * BITS / 32, gpr = H / gs;
    const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int end = min(I, (int)(blockIdx.x + 1) * rpb);
    for (int row = blockIdx.x * rpb + warp; row < end; row += warps) {
        const float g = row_dot<BITS>((const u32*)(rec + g_w) + (size_t)row * wpr, (const u16*)(rec + g_s) + (size_t)row * gpr,
                                      (const u16*)(rec + g_b) + (size_t)row * gpr, x, sx, H, gs);
        const float u = row_dot<BITS>((const u32*)(rec + u_w) + (size_t)row * wpr, (const u16*)(rec + u_s) + (size_t)row * gpr,
                                      (const u16*)(rec + u_b) + (size_t)row * gpr, x, sx, H, gs);
        if ((threadIdx.x & 31) == 0) act[(size_t)e * I + row] = siluf_(g) * u;
    }
}

// Down projections: out[e, r] = down_e act[e]; entries [first, first + gridDim.y).
template <int BITS>
__device__ void expert_down(const u64* table, int first, const float* act, float* out, int I, int H, int gs, int rpb,
                            u64 d_w, u64 d_s, u64 d_b) {
    extern __shared__ float sx[];
    const int e = first + blockIdx.y;
    if constexpr (BITS == 2 || BITS == 4 || BITS == 8) stage_x(act + (size_t)e * I, sx, I);
    const u8* rec = (const u8*)(table[e] & ~TAG_MASK);
    const int wpr = I * BITS / 32, gpr = I / gs;
    const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int end = min(H, (int)(blockIdx.x + 1) * rpb);
    for (int row = blockIdx.x * rpb + warp; row < end; row += warps) {
        const float v = row_dot<BITS>((const u32*)(rec + d_w) + (size_t)row * wpr, (const u16*)(rec + d_s) + (size_t)row * gpr,
                                  (const u16*)(rec + d_b) + (size_t)row * gpr, act + (size_t)e * I, sx, I, gs);
        if ((threadIdx.x & 31) == 0) out[(size_t)e * H + row] = v;
    }
}

#define EXPERT_KERNELS(B)                                                                                             \
    extern "C" __global__ void expert_gate_up_q##B(const u64* table, int first, const float* x, float* act, int I,     \
                                                   int H, int gs, int rpb, u64 g_w, u64 g_s, u64 g_b, u64 u_w,         \
                                                   u64 u_s, u64 u_b) {                                                 \
        expert_gate_up<B>(table, first, x, act, I, H, gs, rpb, g_w, g_s, g_b, u_w, u_s, u_b);                         \
    }                                                                                                                  \
    extern "C" __global__ void expert_down_q##B(const u64* table, int first, const float* act, float* out, int I,     \
                                                int H, int gs, int rpb, u64 d_w, u64 d_s, u64 d_b) {                   \
        expert_down<B>(table, first, act, out, I, H, gs, rpb, d_w, d_s, d_b);                                         \
    }
EXPERT_KERNELS(2)
EXPERT_KERNELS(3)
EXPERT_KERNELS(4)
EXPERT_KERNELS(5)
EXPERT_KERNELS(6)
EXPERT_KERNELS(8)

// MoE output for one row: y[j] = sum over its top-k ranks r of w[r] * out[entry[r], j] (in rank order,
// like the CPU) + sigmoid(shared_gate) * shared[j].
extern "C" __global__ void moe_combine(const float* out, const int* entry, const float* w, int k, const float* shared,
                                       const float* shared_gate, float* y, int H) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= H) return;
    float acc = 0.0f;
    for (int r = 0; r < k; r++) acc += w[r] * out[(size_t)entry[r] * H + j];
    y[j] = acc + sigmoidf_(shared_gate[0]) * shared[j];
}

// Sampling support: the k largest logits (k <= 1024) of one row, in descending order (ties to the
// lower id), so the host draws from k candidates instead of copying the whole vocabulary back. One
// block; each round finds the largest remaining logit with a block reduction and masks it.
extern "C" __global__ void top_candidates(float* logits, int V, int k, int* ids, float* vals) {
    __shared__ float best_v[32];
    __shared__ int best_i[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int r = 0; r < k; r++) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
        for (int i = threadIdx.x; i < V; i += blockDim.x) {
            const float v = logits[i];
            if (v > bv || (v == bv && i < bi)) {
                bv = v;
                bi = i;
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) {
                bv = ov;
                bi = oi;
            }
        }
        if (lane == 0) {
            best_v[warp] = bv;
            best_i[warp] = bi;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            float v = best_v[0];
            int id = best_i[0];
            for (int w = 1; w < nw; w++)
                if (best_v[w] > v || (best_v[w] == v && best_i[w] < id)) {
                    v = best_v[w];
                    id = best_i[w];
                }
            ids[r] = id;
            vals[r] = v;
            if (id >= 0 && id < V) logits[id] = NEG_INF;
        }
        __syncthreads();
    }
}
