// PLE gating and its dilated convolution; MoE routing, the experts following the address table, and
// the combination of their outputs.

// PLE gate with its three zero-centred norms, one block per stream s (launched with 1024 threads):
// kn = norm_key(key)_s, qn = norm_query(x)_s; g = <kn, qn> / sqrt(H); g = sign(g) sqrt(max(|g|,
// 1e-6)); gated_s = sigmoid(g) * value; gn_s = norm_conv(gated)_s, for ple_conv. The norms' weights
// span the hc * H row. Each norm is a scale of its input, so the sums are taken in one pass: <key,
// x> weighted, |key|^2, |x|^2 and |value|^2 (|gated_s|^2 = sigmoid(g)^2 |value|^2).
extern "C" __global__ void ple_gate(const float* key, const float* x, const float* value, const float* wk,
                                    const float* wq, const float* wc, float* gated, float* gn, int H, float eps) {
    KSPAN;
    grid_enter();
    __shared__ float scratch[32];
    const size_t o = (size_t)blockIdx.x * H;
    float kq = 0.0f, kk = 0.0f, qq = 0.0f, vv = 0.0f;
    for (int j = threadIdx.x; j < H; j += blockDim.x) {
        const float k = key[o + j], q = x[o + j], v = value[j];
        kq += k * (1.0f + wk[o + j]) * (q * (1.0f + wq[o + j]));
        kk += k * k;
        qq += q * q;
        vv += v * v;
    }
    kq = block_sum(kq, scratch);
    kk = block_sum(kk, scratch);
    qq = block_sum(qq, scratch);
    vv = block_sum(vv, scratch);
    const float inv_k = rsqrtf(kk / (float)H + eps), inv_q = rsqrtf(qq / (float)H + eps);
    float g = kq * inv_k * inv_q * rsqrtf((float)H);
    g = (g == 0.0f) ? 0.0f : copysignf(sqrtf(fmaxf(fabsf(g), 1e-6f)), g);
    const float sg = sigmoidf_(g);
    const float inv_g = rsqrtf(sg * sg * vv / (float)H + eps);
    for (int j = threadIdx.x; j < H; j += blockDim.x) {
        const float gv = sg * value[j];
        gated[o + j] = gv;
        gn[o + j] = gv * inv_g * (1.0f + wc[o + j]);
    }
}

// PLE output, one thread per channel c of the W = hc*H streams: the causal depthwise conv with
// kernel K and dilation `dil` over [state (hist rows, oldest first), gn], then
// x += gated + silu(conv); the state shifts by one row.
extern "C" __global__ void ple_conv(const float* gn, const float* gated, float* state, const float* w, float* x, int W,
                                    int K, int dil) {
    KSPAN;
    grid_enter();
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

// Router: top-k of v = logits + bias (bias may be null; see model_w below) by v, ties to the lower
// id; weights are the softmax of v at the chosen experts, renormalised over them when `norm`. One
// block, one thread per expert (E <= ROUTE_MAX_E, k <= ROUTE_MAX_K), three barriers (four with a bias) and no serial rounds:
// the softmax's sums go warp by warp through shared memory; every chosen key is at least the k-th
// largest of the warps' largest keys (k warps hold one that large), so the keys at or above it
// (usually a few more than k) are packed in shared memory and each finds its rank among them by
// comparing with the others. (Session 13's bitwise search for the k-th key took 32 block-wide
// counts and about 1 us more per launch: benchmark/notes-cuda.md, "Session 18".) Writes ids[k] and
// weights[k] in descending weight, the ids also to `ids_host` (mapped host memory, may be null).
// With `map` (one address-table entry per expert; may be null) it also writes the step's address
// table, in rank order, and with `rank_entry` rank_entry[r] = r: every chosen expert must be
// resident then. A streamed block's router reads the hit map there (0 for an expert not found)
// without `rank_entry`: the expert kernels skip its zero entries and the host writes the rest.
#define ROUTE_MAX_K 64
#define ROUTE_MAX_E 1024  // experts at most (one thread each; CudaModel checks it at load)

// Warp argmax of (v, i): largest v, ties to the lower i; every lane gets the result.
__device__ __forceinline__ void warp_argmax(float& bv, int& bi) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) {
            bv = ov;
            bi = oi;
        }
    }
}

// A key whose unsigned order is the order of the floats (-0 counts as +0).
__device__ __forceinline__ u32 route_key(float v) {
    const u32 u = __float_as_uint(v == 0.0f ? 0.0f : v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// With ks > 1 the logits are the router launch's column slices, left unsummed (matvec_many's
// `defer_first`): `parts` holds ks slices of E partial sums, which each thread adds up for its
// expert in slice order from 0, as that launch's last block would have, a batch of
// ROUTE_SUM_BATCH slices' loads in flight at a time (a define, so that a run may set it, e.g.
// `CHERENKOV_KERNEL_DEFINES=ROUTE_SUM_BATCH=8`). 16 (48 registers) took 5.07 us a launch against
// 5.97 at 8 (32 registers); 32 (80 registers) was faster still in the kernel but slower in tok/s
// (benchmark/notes-cuda.md, sessions 24 and 25).
//
// `after` (may be null): a flag to wait for before anything else (`flag_wait`).
// A second block (gridDim.x 2) ranks the lookahead's logits `a_logits` (the next block's router on
// this block's input, written whole by the router launch) with its own bias, width `a_k` and
// outputs, and nothing else: no slices, map, table, flags or wait. It runs beside the first, so the
// prediction costs no launch of its own between the routing and the found experts.
// `ready` (may be null; host memory mapped for the device): set to 1 once the chosen ids are in
// `ids_host`, so that the host, polling it, starts its turn without waiting for the launch's end
// and an event behind it. Every kernel queued before this one has finished by then (it waited).
#ifndef ROUTE_SUM_BATCH
#define ROUTE_SUM_BATCH 16
#endif
#define ROUTE_TOPK_ARGS                                                                                          \
    const float *logits, const float *bias, float model_w, int E, int k, int norm, int *ids, float *weights,      \
        int *ids_host, const u64 *map, u64 *table, int *rank_entry, const float *parts, int ks, unsigned *ready, \
        const unsigned *after
#define ROUTE_TOPK_PASS logits, bias, model_w, E, k, norm, ids, weights, ids_host, map, table, rank_entry, parts, ks, ready, after
__device__ __forceinline__ void route_topk_body(ROUTE_TOPK_ARGS);

extern "C" __global__ void route_topk(ROUTE_TOPK_ARGS, const float* a_logits, const float* a_bias, int a_k, int* a_ids,
                                      float* a_weights, int* a_ids_host) {
    KSPAN;
    if (blockIdx.x == 1) {
        logits = a_logits;
        bias = a_bias;
        k = a_k;
        ids = a_ids;
        weights = a_weights;
        ids_host = a_ids_host;
        map = nullptr;
        table = nullptr;
        rank_entry = nullptr;
        parts = nullptr;
        ks = 0;
        ready = nullptr;
        after = nullptr;
    }
    route_topk_body(ROUTE_TOPK_PASS);
}

// route_topk over a verifying pass's rows (blockIdx.z; row_ptr): each row's logits (or the router
// launch's slices), ids, weights, table and per-rank entries its own; the synthetic routers' bias
// rows `bias_rs` bytes apart (host memory, not the rows' allocation); the resident map shared. No
// lookahead, host ids, ready flag or wait (a replayed pass with every expert resident).
extern "C" __global__ void route_topk_rows(ROUTE_TOPK_ARGS, long long rs, long long bias_rs) {
    KSPAN;
    logits = row_ptr(logits, rs);
    bias = row_ptr(bias, bias_rs);
    ids = row_ptr(ids, rs);
    weights = row_ptr(weights, rs);
    table = row_ptr(table, rs);
    rank_entry = row_ptr(rank_entry, rs);
    parts = row_ptr(parts, rs);
    route_topk_body(ROUTE_TOPK_PASS);
}

__device__ __forceinline__ void route_topk_body(ROUTE_TOPK_ARGS) {
    // `after` (may be null): the previous block's turn done (the hit map and the slots the host
    // retires change only in a turn), before the map is read.
    if (after) {
        flag_wait(after);
    }
    // The synthetic routers' bias is written by the host before the step is queued, never by a
    // kernel (it may be host memory mapped for the device): read before waiting for the logits.
    const float b = bias && (int)threadIdx.x < E ? bias[threadIdx.x] : 0.0f;
    // So is the resident map (uploaded when the experts were made resident): each thread's entry is
    // loaded here, not after the ranking, where it was a round trip at the launch's tail
    // (`ROUTE_MAP_LATE`: there, as before session 20).
#ifdef ROUTE_MAP_LATE
    constexpr bool map_early = false;
#else
    constexpr bool map_early = true;
#endif
    const u64 mapped = map_early && map && (int)threadIdx.x < E ? map[threadIdx.x] : 0ull;
    grid_enter();
    __shared__ float2 r_stats[32];
    __shared__ float r_max[32], r_sum[32];
    __shared__ u32 r_wmax[32];
#ifdef ROUTE_PACK_PREFIX
    __shared__ int r_count[32];
#endif
    __shared__ int r_nc;
    __shared__ u32 cand_key[ROUTE_MAX_E];
    __shared__ int cand_id[ROUTE_MAX_E];
    __shared__ float chosen_p[ROUTE_MAX_K];
    const int e = threadIdx.x, lane = e & 31, warp = e >> 5, nw = blockDim.x >> 5;
    const bool valid = e < E;
    float l = 0.0f;
    if (valid && ks > 1) {
        for (int k0 = 0; k0 < ks; k0 += ROUTE_SUM_BATCH) {
            float v[ROUTE_SUM_BATCH];
#pragma unroll
            for (int i = 0; i < ROUTE_SUM_BATCH; i++) v[i] = k0 + i < ks ? __ldcg(parts + (size_t)(k0 + i) * E + e) : 0.0f;
#pragma unroll
            for (int i = 0; i < ROUTE_SUM_BATCH; i++) {
                if (k0 + i < ks) l += v[i];
            }
        }
    } else if (valid) {
        l = logits[e];
    }
    tl_mark();
    // With a bias (synthetic routers), the logits count as model_w times their standard score
    // (engine::routing); the mean drops out of softmax and top-k.
    float scale = 1.0f;
    if (bias) {
        float s1 = l, s2 = l * l;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            s1 += __shfl_xor_sync(0xffffffffu, s1, o);
            s2 += __shfl_xor_sync(0xffffffffu, s2, o);
        }
        if (lane == 0) r_stats[warp] = make_float2(s1, s2);
        __syncthreads();
        s1 = 0.0f;
        s2 = 0.0f;
        for (int w = 0; w < nw; w++) {
            s1 += r_stats[w].x;
            s2 += r_stats[w].y;
        }
        const float mean = s1 / (float)E, var = fmaxf(s2 / (float)E - mean * mean, 0.0f);
        scale = var > 0.0f ? model_w * rsqrtf(var) : 0.0f;
    }
    const float v = valid ? scale * l + b : NEG_INF;
    const u32 key = valid ? route_key(v) : 0u;
    float m = warp_max(v);
    const u32 wmax = __reduce_max_sync(0xffffffffu, key);
    if (lane == 0) {
        r_max[warp] = m;
        r_wmax[warp] = wmax;
    }
    if (e == 0) r_nc = 0;
    __syncthreads();
    tl_mark_at(1);  // the largest logit's barrier passed
    m = r_max[0];
    for (int w = 1; w < nw; w++) m = fmaxf(m, r_max[w]);
    const float s = warp_sum(valid ? expf(v - m) : 0.0f);
    if (lane == 0) r_sum[warp] = s;
    // A threshold every chosen key reaches: the k-th largest of the warps' largest keys (k warps
    // hold a key at least that large), or 1 (every expert) where k exceeds the warps. Lane i of
    // each warp ranks warp i's largest key among them (ties to the lower warp).
    u32 tau = 1u;
    if (k <= nw) {
        const u32 mine = lane < nw ? r_wmax[lane] : 0u;
        int rank = 0;
        for (int j = 0; j < nw; j++) {
            const u32 o = r_wmax[j];
            rank += o > mine || (o == mine && j < lane);
        }
        const u32 hit = __ballot_sync(0xffffffffu, lane < nw && rank == k - 1);
        tau = __shfl_sync(0xffffffffu, mine, __ffs(hit) - 1);
    }
    // The candidates (keys at or above the threshold, usually a few more than k) packed in
    // shared memory; each finds its rank among them (ties to the lower id), which is its rank among
    // all the keys, since every other key is below the threshold. A rank compares keys and ids, so
    // it does not depend on the order of the slots: each candidate takes the next one
    // (`ROUTE_PACK_PREFIX`: in id order, after a barrier for the warps' counts and their prefix,
    // one barrier more, as before session 22).
    const bool cand = valid && key >= tau;
#ifdef ROUTE_PACK_PREFIX
    const u32 cb = __ballot_sync(0xffffffffu, cand);
    if (lane == 0) r_count[warp] = __popc(cb);
    __syncthreads();
    tl_mark_at(2);  // the candidates counted
    float sum = 0.0f;
    int before = 0, nc = 0;
    for (int w = 0; w < nw; w++) {
        sum += r_sum[w];
        before += w < warp ? r_count[w] : 0;
        nc += r_count[w];
    }
    if (cand) {
        const int slot = before + __popc(cb & ((1u << lane) - 1u));
        cand_key[slot] = key;
        cand_id[slot] = e;
    }
#else
    if (cand) {
        const int slot = atomicAdd(&r_nc, 1);
        cand_key[slot] = key;
        cand_id[slot] = e;
    }
    tl_mark_at(2);  // thread 0's candidate placed, if it is one
#endif
    __syncthreads();
    tl_mark_at(3);  // the candidates packed
#ifndef ROUTE_PACK_PREFIX
    float sum = 0.0f;
    for (int w = 0; w < nw; w++) sum += r_sum[w];
    const int nc = r_nc;
#endif
    if (cand) {
        int rank = 0;
        for (int i = 0; i < nc; i++) {
            const u32 o = cand_key[i];
            rank += o > key || (o == key && cand_id[i] < e);
        }
        if (rank < k) {
            chosen_p[rank] = expf(v - m) / sum;
            ids[rank] = e;
            if (ids_host) {
                ids_host[rank] = e;
                // Before the barrier below, after which `ready` says the ids are there.
                if (ready) __threadfence_system();
            }
            if (map) {
                table[rank] = map_early ? mapped : map[e];
                if (rank_entry) rank_entry[rank] = rank;
            }
        }
    }
    tl_mark_at(4);  // thread 0 ranked (and wrote, if chosen)
    __syncthreads();
    if (ready && e == 0) *(volatile unsigned*)ready = 1u;
    if (e < k) {
        // Renormalised over the chosen experts, summed in rank order.
        float total = 1.0f;
        if (norm) {
            total = 0.0f;
            for (int r = 0; r < k; r++) total += chosen_p[r];
        }
        weights[e] = norm ? chosen_p[e] / total : chosen_p[e];
    }
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
    const int e = first + blockIdx.y;
    if (!table[e]) return;  // not found by the router in the hit map: the host's launch computes it
    if constexpr (BITS == 2 || BITS == 4 || BITS == 8) stage_x(x, sx, H);
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
    if (!table[e]) return;  // (as in expert_gate_up)
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

// The tiled gate/up kernel stages x before its wait: x (the MoE block's input) is written three
// launches earlier (hc_up_mix, then the router and route_topk), and the launch before this one has
// waited for it; only the weights depend on the router. `GATE_UP_STAGE_LATE`: after the wait.
#ifdef GATE_UP_STAGE_LATE
#define GATE_UP_STAGE_EARLY false
#else
#define GATE_UP_STAGE_EARLY true
#endif

// 2-, 4- and 8-bit experts through the tiled core of linear.cu when the host passes
// rpb = MV_TILED | L (launch_experts does whenever the records allow it: 16-byte aligned matrices,
// rows of whole chunks, groups of whole x-sum units): blockIdx.y is the entry, blockIdx.x of
// gridDim.x blocks share its tiles. gate_up tiles hold 2 rows of gate and the same 2 rows of up, so
// the thread that finishes a tile writes silu(gate) * up; down tiles are 4 rows of down over act[e].
template <int BITS>
__device__ __forceinline__ void expert_gate_up_tiled(const u64* table, int first, const float* x, float* act, int I,
                                                     int H, int gs, int L, u64 g_w, u64 g_s, u64 g_b, u64 u_w,
                                                     u64 u_s, u64 u_b) {
    typedef MvFmt<BITS> F;
    const int e = first + blockIdx.y;
    // (x is staged by the kernel before its wait: EXPERT_KERNELS_TILED.)
    const u8* rec = (const u8*)(table[e] & ~TAG_MASK);
    const int C = H / F::CPC, gpr = H / gs, gshift = __ffs(gs) - 1;
    const MvMat g{(const uint4*)(rec + g_w), (const u16*)(rec + g_s), (const u16*)(rec + g_b)};
    const MvMat u{(const uint4*)(rec + u_w), (const u16*)(rec + u_s), (const u16*)(rec + u_b)};
    float* y = act + (size_t)e * I;
    mv_core<BITS, MV_GATE_UP>(g, u, x, MV_IN_NONE, I, C, C, gpr, gshift, L, blockIdx.x, gridDim.x,
                              [&](int tile, const float* v) {
#pragma unroll
                                  for (int j = 0; j < 2; j++) {
                                      if (tile * 2 + j < I) y[tile * 2 + j] = siluf_(v[j]) * v[j + 2];
                                  }
                              },
                              nullptr, MvNoPre{}, GATE_UP_STAGE_EARLY);
}

// The shared expert's gate and up projections may ride along as the gate/up launch's last entry
// (`sh.gw` set: the grid has one entry more than the table's): its dense matrices (the routed
// experts' gate/up format), x the routed experts' x, its two rows of each tile written apart (the
// shared down projection, riding along in the down launch, applies silu(gate) * up while it
// stages). They need nothing the router writes, so those blocks never wait: they run beside the
// routing, and the router's launch carries only the router and the shared expert's gate. The grid
// still ends after its predecessor, as every other block of it waits.
struct SharedGateUp {
    const u32* gw;
    const u16* gs;
    const u16* gb;
    const u32* uw;
    const u16* us;
    const u16* ub;
    int group;
    float* gate;
    float* up;
};

template <int BITS>
__device__ __forceinline__ void shared_gate_up_tiled(const float* x, int I, int H, int L, const SharedGateUp sh) {
    typedef MvFmt<BITS> F;
    const int C = H / F::CPC, gpr = H / sh.group, gshift = __ffs(sh.group) - 1;
    const MvMat g{(const uint4*)sh.gw, sh.gs, sh.gb};
    const MvMat u{(const uint4*)sh.uw, sh.us, sh.ub};
    mv_core<BITS, MV_GATE_UP>(g, u, x, MV_IN_NONE, I, C, C, gpr, gshift, L, blockIdx.x, gridDim.x,
                              [&](int tile, const float* v) {
#pragma unroll
                                  for (int j = 0; j < 2; j++) {
                                      if (tile * 2 + j < I) {
                                          sh.gate[tile * 2 + j] = v[j];
                                          sh.up[tile * 2 + j] = v[j + 2];
                                      }
                                  }
                              },
                              nullptr, MvNoPre{}, true);
}

// The down projection requests its first weights before it waits for the gate/up kernel (mv_core's
// EARLY): its table entries were written before that kernel (by the router, or uploaded), its
// records are in place before the launch (resident, or the stream waited for their copies), and
// the launch before it has waited for all of that. `EXPERT_DOWN_LATE`: after the wait, as before
// session 18.
#ifdef EXPERT_DOWN_LATE
#define EXPERT_DOWN_EARLY false
#else
#define EXPERT_DOWN_EARLY true
#endif
//
// The shared expert's down projection may ride along as the launch's last entry (`sh.w` set: the
// grid has one entry more than the table's): its dense matrix (the routed experts' format), its
// input silu(gate) * up applied while staging (MV_IN_SILU_MUL, as the separate matvec did), its row
// written to sh.out. Every expert resident, that takes the side stream's launch and the
// combination's wait for it off the block's path.
struct SharedDown {
    const u32* w;
    const u16* s;
    const u16* b;
    int gs;
    const float* gate;  // the shared expert's gate projection (x of MV_IN_SILU_MUL)
    const float* up;    // its up projection (x2)
    float* out;
};

template <int BITS>
__device__ __forceinline__ void expert_down_tiled(const u64* table, int first, const float* act, float* out, int I,
                                                  int H, int gs, int L, u64 d_w, u64 d_s, u64 d_b,
                                                  const SharedDown sh, const unsigned* wait) {
    typedef MvFmt<BITS> F;
    // Behind a flag (a flagged step's read experts) the records may still be landing: the flag
    // first, before any weight is requested. Its relay also copies the block's entries (the table
    // read below) to the device, so the early weights' requests may still come before the wait for
    // the gate/up kernel. (A second instantiation of mv_core for the flagged launch made the 4-bit
    // kernel spill: session 31.)
    if constexpr (!EXPERT_DOWN_EARLY) grid_enter();
    flag_wait(wait);
    const bool shared = sh.w && blockIdx.y == gridDim.y - 1;
    const int e = first + blockIdx.y;
    const int dgs = shared ? sh.gs : gs;
    const int C = I / F::CPC, gpr = I / dgs, gshift = __ffs(dgs) - 1;
    MvMat d;
    if (shared) {
        d = MvMat{(const uint4*)sh.w, sh.s, sh.b};
    } else {
        // An entry the router did not find in the hit map (zero) is the host's launch's.
        if (!table[e]) return;
        const u8* rec = (const u8*)(table[e] & ~TAG_MASK);
        d = MvMat{(const uint4*)(rec + d_w), (const u16*)(rec + d_s), (const u16*)(rec + d_b)};
    }
    float* y = shared ? sh.out : out + (size_t)e * H;
    const float* x = shared ? sh.gate : act + (size_t)e * I;
    const MvIn in = shared ? MvIn{sh.up, 0.0f, MV_IN_SILU_MUL} : MV_IN_NONE;
    mv_core<BITS, MV_PLAIN, EXPERT_DOWN_EARLY>(d, d, x, in, H, C, C, gpr, gshift, L, blockIdx.x, gridDim.x,
                            [&](int tile, const float* v) {
#pragma unroll
                                for (int i = 0; i < MV_R; i++) {
                                    if (tile * MV_R + i < H) y[tile * MV_R + i] = v[i];
                                }
                            });
}

#define EXPERT_KERNELS(B)                                                                                             \
    /* (shg_*, shu_*, sh_*: the shared expert riding along, tiled kernels only; never set here.) */                 \
    extern "C" __global__ void expert_gate_up_q##B(const u64* table, int first, const float* x, float* act, int I,     \
                                                   int H, int gs, int rpb, u64 g_w, u64 g_s, u64 g_b, u64 u_w,         \
                                                   u64 u_s, u64 u_b, u64* stamp, const u32* shg_w, const u16* shg_s,   \
                                                   const u16* shg_b, const u32* shu_w, const u16* shu_s,               \
                                                   const u16* shu_b, int sh_gs, float* sh_gate, float* sh_up,          \
                                                   const unsigned* wait) { KSPAN;                                      \
        grid_enter();                                                                                                  \
        if (wait && stamp) stamp_first(stamp + 1); /* the wait's start, then its end */                                \
        flag_wait(wait);                                                                                               \
        stamp_first(stamp);                                                                                            \
        expert_gate_up<B>(table, first, x, act, I, H, gs, rpb, g_w, g_s, g_b, u_w, u_s, u_b);                         \
    }                                                                                                                  \
    /* (sh_*: the shared expert riding along, tiled kernels only; never set for these.) */                            \
    extern "C" __global__ void expert_down_q##B(const u64* table, int first, const float* act, float* out, int I,     \
                                                int H, int gs, int rpb, u64 d_w, u64 d_s, u64 d_b, const u32* sh_w,    \
                                                const u16* sh_s, const u16* sh_b, int sh_gs, const float* sh_gate,     \
                                                const float* sh_up, float* sh_out, const unsigned* wait) { KSPAN;      \
        grid_enter();                                                                                                  \
        flag_wait(wait);                                                                                               \
        expert_down<B>(table, first, act, out, I, H, gs, rpb, d_w, d_s, d_b);                                         \
    }
#define EXPERT_GATE_UP_ARGS                                                                                      \
    const u64 *table, int first, const float *x, float *act, int I, int H, int gs, int rpb, u64 g_w, u64 g_s,       \
        u64 g_b, u64 u_w, u64 u_s, u64 u_b, u64 *stamp, const u32 *shg_w, const u16 *shg_s, const u16 *shg_b,     \
        const u32 *shu_w, const u16 *shu_s, const u16 *shu_b, int sh_gs, float *sh_gate, float *sh_up,            \
        const unsigned *wait
#define EXPERT_GATE_UP_PASS                                                                                      \
    table, first, x, act, I, H, gs, rpb, g_w, g_s, g_b, u_w, u_s, u_b, stamp, shg_w, shg_s, shg_b, shu_w, shu_s,   \
        shu_b, sh_gs, sh_gate, sh_up, wait
#define EXPERT_DOWN_ARGS                                                                                         \
    const u64 *table, int first, const float *act, float *out, int I, int H, int gs, int rpb, u64 d_w, u64 d_s,    \
        u64 d_b, const u32 *sh_w, const u16 *sh_s, const u16 *sh_b, int sh_gs, const float *sh_gate,              \
        const float *sh_up, float *sh_out, const unsigned *wait
#define EXPERT_DOWN_PASS                                                                                         \
    table, first, act, out, I, H, gs, rpb, d_w, d_s, d_b, sh_w, sh_s, sh_b, sh_gs, sh_gate, sh_up, sh_out, wait

template <int B>
__device__ __forceinline__ void expert_gate_up_kernel(EXPERT_GATE_UP_ARGS) {
    if (GATE_UP_STAGE_EARLY && (rpb & MV_TILED)) mv_stage_all<B>(x, H);
    if (shg_w && blockIdx.y == gridDim.y - 1) {
        /* The shared expert riding along: no wait (see SharedGateUp). */
        grid_release();
        if (!GATE_UP_STAGE_EARLY) mv_stage_all<B>(x, H);
        shared_gate_up_tiled<B>(x, I, H, rpb & (MV_TILED - 1),
                                SharedGateUp{shg_w, shg_s, shg_b, shu_w, shu_s, shu_b, sh_gs, sh_gate, sh_up});
        return;
    }
    grid_enter();
    if (wait && stamp) stamp_first(stamp + 1); /* the wait's start, then its end */
    flag_wait(wait); /* a replayed step's read experts: their records landed, their table written */
    stamp_first(stamp);
    if (!table[first + blockIdx.y]) return; /* not in the hit map: the host's launch computes it */
    if (rpb & MV_TILED) {
        expert_gate_up_tiled<B>(table, first, x, act, I, H, gs, rpb & (MV_TILED - 1), g_w, g_s, g_b, u_w, u_s, u_b);
    } else {
        expert_gate_up<B>(table, first, x, act, I, H, gs, rpb, g_w, g_s, g_b, u_w, u_s, u_b);
    }
}

template <int B>
__device__ __forceinline__ void expert_down_kernel(EXPERT_DOWN_ARGS) {
    if (rpb & MV_TILED) {
        expert_down_tiled<B>(table, first, act, out, I, H, gs, rpb & (MV_TILED - 1), d_w, d_s, d_b,
                             SharedDown{sh_w, sh_s, sh_b, sh_gs, sh_gate, sh_up, sh_out}, wait);
    } else {
        grid_enter();
        flag_wait(wait);
        expert_down<B>(table, first, act, out, I, H, gs, rpb, d_w, d_s, d_b);
    }
}

// MINB as for matvec_q (blocks of 256 threads per multiprocessor; launch_experts knows it).
// The `_rows` kernels serve a verifying pass's rows (blockIdx.z; row_ptr): each row's table, input,
// activations and outputs its own, the shared expert's riding outputs too; no stamp or flag.
#define EXPERT_KERNELS_TILED(B, MINB)                                                                                 \
    extern "C" __global__ void __launch_bounds__(256, MINB) expert_gate_up_q##B(EXPERT_GATE_UP_ARGS) {               \
        KSPAN;                                                                                                        \
        expert_gate_up_kernel<B>(EXPERT_GATE_UP_PASS);                                                                \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(256, MINB) expert_down_q##B(EXPERT_DOWN_ARGS) {                     \
        KSPAN;                                                                                                        \
        expert_down_kernel<B>(EXPERT_DOWN_PASS);                                                                      \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(256, MINB) expert_gate_up_rows_q##B(EXPERT_GATE_UP_ARGS,            \
                                                                                      long long rs) {                 \
        KSPAN;                                                                                                        \
        table = row_ptr(table, rs);                                                                                   \
        x = row_ptr(x, rs);                                                                                           \
        act = row_ptr(act, rs);                                                                                       \
        sh_gate = row_ptr(sh_gate, rs);                                                                               \
        sh_up = row_ptr(sh_up, rs);                                                                                   \
        expert_gate_up_kernel<B>(EXPERT_GATE_UP_PASS);                                                                \
    }                                                                                                                 \
    extern "C" __global__ void __launch_bounds__(256, MINB) expert_down_rows_q##B(EXPERT_DOWN_ARGS, long long rs) {  \
        KSPAN;                                                                                                        \
        table = row_ptr(table, rs);                                                                                   \
        act = row_ptr(act, rs);                                                                                       \
        out = row_ptr(out, rs);                                                                                       \
        sh_gate = row_ptr(sh_gate, rs);                                                                               \
        sh_up = row_ptr(sh_up, rs);                                                                                   \
        sh_out = row_ptr(sh_out, rs);                                                                                 \
        expert_down_kernel<B>(EXPERT_DOWN_PASS);                                                                      \
    }
EXPERT_KERNELS_TILED(2, 2)
EXPERT_KERNELS(3)
EXPERT_KERNELS_TILED(4, 3)
EXPERT_KERNELS(5)
EXPERT_KERNELS(6)
EXPERT_KERNELS_TILED(8, 3)

// MoE output for one row: y[j] = sum over its top-k ranks r of w[r] * out[entry[r], j] (in rank order,
// like the CPU) + sigmoid(shared_gate) * shared[j]. With `x` (may be null) it also injects y into
// the hc residual streams, as hc_inject does: x[s*H+j] += 2 sigmoid(inj[s] / hc) * y[j]. With
// `stamp`, the time it started (the end of the expert kernels before it).
// Its loads go out together, a batch of ranks at a time, and the streams' before any store: a loop
// that loads each rank's entry, then its row, and each stream after the previous one's store,
// waits a round trip to L2 for each (about 25 in a row at top-10 and 4 streams).
// Only `out` and `shared` are written by the launch before this one (the down projections, the
// shared expert riding along there); the residual, the injection logits, the shared gate and the
// first batch's entries and weights are written earlier, so they are loaded before the wait
// (`COMBINE_LATE`: after it, as before session 19). COMBINE_BATCH ranks are loaded at a time (a
// define, for measurements: at top-10 a batch of 8 leaves a second round trip for the last two).
#ifndef COMBINE_BATCH
#define COMBINE_BATCH 8
#endif
#define MOE_COMBINE_ARGS                                                                                         \
    const float *out, const int *entry, const float *w, int k, const float *shared, const float *shared_gate,     \
        float *y, int H, float *x, const float *inj, int hc, u64 *stamp
__device__ __forceinline__ void moe_combine_body(MOE_COMBINE_ARGS);

extern "C" __global__ void moe_combine(MOE_COMBINE_ARGS) {
    KSPAN;
    moe_combine_body(out, entry, w, k, shared, shared_gate, y, H, x, inj, hc, stamp);
}

// moe_combine over a verifying pass's rows (blockIdx.z; row_ptr): every vector a row's own; no stamp.
extern "C" __global__ void moe_combine_rows(MOE_COMBINE_ARGS, long long rs) {
    KSPAN;
    moe_combine_body(row_ptr(out, rs), row_ptr(entry, rs), row_ptr(w, rs), k, row_ptr(shared, rs),
                     row_ptr(shared_gate, rs), row_ptr(y, rs), H, row_ptr(x, rs), row_ptr(inj, rs), hc, nullptr);
}

__device__ __forceinline__ void moe_combine_body(MOE_COMBINE_ARGS) {
#ifdef COMBINE_LATE
    grid_enter();
#endif
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    const bool in = j < H;
    const float sg = shared_gate[0];
    const bool streams = in && x && hc <= MV_HC_MAX;
    float c[MV_HC_MAX], xv[MV_HC_MAX];
#pragma unroll
    for (int s = 0; s < MV_HC_MAX; s++) {
        c[s] = streams && s < hc ? inj[s] : 0.0f;
        xv[s] = streams && s < hc ? x[(size_t)s * H + j] : 0.0f;
    }
    int e[COMBINE_BATCH];
    float wr[COMBINE_BATCH];
    auto batch = [&](int r0) {
#pragma unroll
        for (int i = 0; i < COMBINE_BATCH; i++) {
            e[i] = r0 + i < k ? entry[r0 + i] : 0;
            wr[i] = r0 + i < k ? w[r0 + i] : 0.0f;
        }
    };
    batch(0);
#ifndef COMBINE_LATE
    grid_enter();
#endif
    stamp_first(stamp);
    if (!in) return;
    const float sh = shared[j];
    float acc = 0.0f;
    for (int r0 = 0; r0 < k; r0 += COMBINE_BATCH) {
        if (r0 > 0) batch(r0);
        float o[COMBINE_BATCH];
#pragma unroll
        for (int i = 0; i < COMBINE_BATCH; i++) o[i] = r0 + i < k ? out[(size_t)e[i] * H + j] : 0.0f;
#pragma unroll
        for (int i = 0; i < COMBINE_BATCH; i++) {
            if (r0 + i < k) acc += wr[i] * o[i];
        }
    }
    const float v = acc + sigmoidf_(sg) * sh;
    y[j] = v;
    if (streams) {
#pragma unroll
        for (int s = 0; s < MV_HC_MAX; s++) {
            if (s < hc) x[(size_t)s * H + j] = xv[s] + 2.0f * sigmoidf_(c[s] / (float)hc) * v;
        }
    } else if (x) {
        for (int s = 0; s < hc; s++) x[(size_t)s * H + j] += 2.0f * sigmoidf_(inj[s] / (float)hc) * v;
    }
}

// Sampling support: the k largest logits (k <= 1024) of one row, in descending order (ties to the
// lower id), so the host draws from k candidates instead of copying the whole vocabulary back. One
// block; each round finds the largest remaining logit with a block reduction and masks it. The
// two launches below do it faster where their keys fit one block's shared memory (CudaModel's
// top_candidates); this one remains for larger k.
//
// `hids`, `hvals` (may be null; host memory mapped for the device): the same ids and values again,
// so the host reads them once the stream is done instead of copying them back after it.
extern "C" __global__ void top_candidates(float* logits, int V, int k, int* ids, float* vals, int* hids, float* hvals) {
    KSPAN;
    grid_enter();
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
        warp_argmax(bv, bi);
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
            if (hids) {
                hids[r] = id;
                hvals[r] = v;
            }
            if (id >= 0 && id < V) logits[id] = NEG_INF;
        }
        __syncthreads();
    }
}

// ---- The sampling candidates in two launches (top_candidates_part, then top_candidates_merge). ----
//
// A logit and its id as one 64-bit key whose unsigned order is the host's (`top_of`: total_cmp on
// the value, descending; the lower id first among equal values): the value's bits mapped to an
// unsigned order (negative values' bits flipped, positive values' sign set), then the id's complement.
// The key 0 is below every logit's, so it pads.
__device__ __forceinline__ u64 cand_key(float v, int i) {
    const u32 b = __float_as_uint(v);
    const u32 key = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ((u64)key << 32) | (u64)(~(u32)i);
}

__device__ __forceinline__ float cand_value(u64 x) {
    const u32 key = (u32)(x >> 32);
    return __uint_as_float((key & 0x80000000u) ? (key ^ 0x80000000u) : ~key);
}

// Sorts the n keys of s (a power of two, at most CAND_SEL, in shared memory) into descending order,
// by one warp.
#define CAND_SEL 256
__device__ void warp_sort_desc(u64* s, int n) {
    const int lane = threadIdx.x & 31;
    for (int size = 2; size <= n; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int t = lane; t < (n >> 1); t += 32) {
                const int i = 2 * t - (t & (stride - 1)), j = i + stride;
                const u64 a = s[i], b = s[j];
                if ((a < b) == ((i & size) == 0)) {
                    s[i] = b;
                    s[j] = a;
                }
            }
            __syncwarp();
        }
    }
}

// The k largest (k <= CAND_SEL) of the block's keys (E per thread; distinct, except the padding 0,
// and at least k of them not padding), in descending order into out[0..k) (shared, CAND_SEL keys), by
// the whole block (blockDim.x a multiple of 32, at least 256). The k-th largest key is found 8 bits
// at a time from the top (a shared histogram of the next byte of the keys that match so far; lanes
// with the same byte add once), then the keys at or above it are gathered and warp 0 sorts them.
// Once the byte's bin holds exactly the keys still needed (with distinct logits, after two or three
// of the eight bytes), the prefix so far is the threshold: every key at or above it is chosen.
// `hist`: 256 shared counters; `sel`: 3 shared words.
template <int E>
__device__ void block_top_keys(const u64 (&key)[E], int k, u64* out, u32* hist, u32* sel) {
    const int lane = threadIdx.x & 31;
    u64 prefix = 0, mask = 0;
    u32 need = (u32)k;
    for (int shift = 56; shift >= 0; shift -= 8) {
        if (threadIdx.x < 256) hist[threadIdx.x] = 0;
        __syncthreads();
#pragma unroll
        for (int e = 0; e < E; e++) {
            const bool in = (key[e] & mask) == prefix;
            const u32 d = (u32)(key[e] >> shift) & 0xFFu;
            const u32 peers = __match_any_sync(0xffffffffu, in ? d : 0x100u);
            if (in && __ffs(peers) - 1 == lane) atomicAdd(&hist[d], __popc(peers));
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            // Lane l holds bins 255 - 8l down to 248 - 8l: lower lanes hold the larger bytes.
            u32 c[8], sum = 0;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                c[j] = hist[255 - 8 * lane - j];
                sum += c[j];
            }
            u32 incl = sum;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const u32 v = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += v;
            }
            u32 above = incl - sum;
            if (above < need && need <= incl) {
                int j = 0;
                while (above + c[j] < need) above += c[j++];
                sel[0] = 255 - 8 * lane - j;
                sel[1] = above;
                sel[2] = c[j];
            }
        }
        __syncthreads();
        prefix |= (u64)sel[0] << shift;
        mask |= 0xFFull << shift;
        need -= sel[1];
        const bool whole_bin = sel[2] == need;
        __syncthreads();
        if (whole_bin) break;
    }
    // Exactly k keys are at or above prefix (the k-th largest key, or its leading bytes where the loop
    // stopped at a whole bin).
    if (threadIdx.x == 0) sel[2] = 0;
    __syncthreads();
#pragma unroll
    for (int e = 0; e < E; e++)
        if (key[e] >= prefix) out[atomicAdd(&sel[2], 1u)] = key[e];
    int n2 = 1;
    while (n2 < k) n2 <<= 1;
    for (int i = k + threadIdx.x; i < n2; i += blockDim.x) out[i] = 0ull;
    __syncthreads();
    if (threadIdx.x < 32) warp_sort_desc(out, n2);
    __syncthreads();
}

// (hids, hvals: a second copy in mapped host memory where not null, as top_candidates'.)
__device__ __forceinline__ void cand_write(const u64* keys, int k, int* ids, float* vals, int* hids, float* hvals) {
    for (int r = threadIdx.x; r < k; r += blockDim.x) {
        const int id = (int)~(u32)keys[r];
        const float v = cand_value(keys[r]);
        ids[r] = id;
        vals[r] = v;
        if (hids) {
            hids[r] = id;
            hvals[r] = v;
        }
    }
}

// Block b takes the logits [b * CAND_CHUNK, (b + 1) * CAND_CHUNK) below V (1024 threads, 4 each) and
// writes its kk = min(k, CAND_SEL) largest keys into part[b * kk ..] (0 where the chunk has fewer):
// every one of the k largest logits is among its chunk's. With one block, its k are the answer, as
// ids and values (and into hids, hvals where not null: cand_write).
#define CAND_CHUNK 4096
extern "C" __global__ void __launch_bounds__(1024)
    top_candidates_part(const float* logits, int V, int kk, u64* part, int* ids, float* vals, int* hids, float* hvals) {
    KSPAN;
    grid_enter();
    __shared__ u64 best[CAND_SEL];
    __shared__ u32 hist[256], sel[3];
    const int base = blockIdx.x * CAND_CHUNK;
    u64 key[CAND_CHUNK / 1024];
#pragma unroll
    for (int e = 0; e < CAND_CHUNK / 1024; e++) {
        const int i = base + e * 1024 + threadIdx.x;
        key[e] = i < V ? cand_key(logits[i], i) : 0ull;
    }
    const int kb = min(kk, V - base);
    block_top_keys(key, kb, best, hist, sel);
    if (gridDim.x == 1) {
        cand_write(best, kb, ids, vals, hids, hvals);
        return;
    }
    for (int r = threadIdx.x; r < kk; r += blockDim.x) part[(size_t)blockIdx.x * kk + r] = r < kb ? best[r] : 0ull;
}

// One block of 1024 threads: the k largest of the n <= CAND_KEYS keys in part, as ids and values.
#define CAND_KEYS 16384
extern "C" __global__ void __launch_bounds__(1024)
    top_candidates_merge(const u64* part, int n, int k, int* ids, float* vals, int* hids, float* hvals) {
    KSPAN;
    grid_enter();
    __shared__ u64 best[CAND_SEL];
    __shared__ u32 hist[256], sel[3];
    u64 key[CAND_KEYS / 1024];
#pragma unroll
    for (int e = 0; e < CAND_KEYS / 1024; e++) {
        const int i = e * 1024 + threadIdx.x;
        key[e] = i < n ? part[i] : 0ull;
    }
    block_top_keys(key, k, best, hist, sel);
    cand_write(best, k, ids, vals, hids, hvals);
}
