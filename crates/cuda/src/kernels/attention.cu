// Gated attention over the KV cache with QSA token selection, one query token.

// Splits q_proj's output [heads, 2d] (query first, then gate) into q [heads, d] and gate [heads, d].
extern "C" __global__ void split_q_gate(const float* qg, float* q, float* gate, int heads, int d) {
    KSPAN;
    grid_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= heads * d) return;
    const int h = i / d, j = i - h * d;
    q[i] = qg[(size_t)h * 2 * d + j];
    gate[i] = qg[(size_t)h * 2 * d + d + j];
}

// Appends the step's key and value ([kv_heads * d] each) to the caches at the step's position
// (step[1]), and the QSA index key (`id` floats; none when ikeys is null).
extern "C" __global__ void kv_append(const float* k, const float* v, const float* ikey, float* kc, float* vc,
                                     float* ikeys, const int* step, int kvd, int id) {
    KSPAN;
    grid_enter();
    const int pos = step[1];
    const int n = max(kvd, ikeys ? id : 0);
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        if (i < kvd) {
            kc[(size_t)pos * kvd + i] = k[i];
            vc[(size_t)pos * kvd + i] = v[i];
        }
        if (ikeys && i < id) ikeys[(size_t)pos * id + i] = ikey[i];
    }
}

// When the step's token (position step[1]) completes a block of `ratio` tokens, mean-pools that
// block b of index keys [b*ratio, (b+1)*ratio) of `keys` ([tokens, d]), applies the zero-centred
// k_layernorm and RoPE at the block's first position, and writes blocks[b]; otherwise does nothing.
// One block of threads.
extern "C" __global__ void qsa_pool_block(const float* keys, float* blocks, const int* step, int ratio, int d,
                                          const float* w, float eps, const float* inv_freq, int rd) {
    KSPAN;
    grid_enter();
    if ((step[1] + 1) % ratio != 0) return;
    const int b = (step[1] + 1) / ratio - 1;
    extern __shared__ float pooled[];  // d floats
    __shared__ float scratch[32];
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        float acc = 0.0f;
        for (int t = b * ratio; t < (b + 1) * ratio; t++) acc += keys[(size_t)t * d + j];
        pooled[j] = acc / (float)ratio;
    }
    __syncthreads();
    float ss = 0.0f;
    for (int j = threadIdx.x; j < d; j += blockDim.x) ss += pooled[j] * pooled[j];
    ss = block_sum(ss, scratch);
    const float inv = rsqrtf(ss / (float)d + eps);
    float* out = blocks + (size_t)b * d;
    for (int j = threadIdx.x; j < d; j += blockDim.x) out[j] = pooled[j] * inv * (1.0f + w[j]);
    __syncthreads();
    rope_apply(out, inv_freq, rd, b * ratio);
}

// Block scores for one query: score[b] = sum over index heads of relu(q_h . k_b) / sqrt(d).
// One warp per block b.
extern "C" __global__ void qsa_scores(const float* q, const float* blocks, float* scores, int nblocks, int heads, int d) {
    KSPAN;
    grid_enter();
    const int b = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (b >= nblocks) return;
    const int lane = threadIdx.x & 31;
    const float* kb = blocks + (size_t)b * d;
    float total = 0.0f;
    for (int h = 0; h < heads; h++) {
        float acc = 0.0f;
        for (int j = lane; j < d; j += 32) acc += q[(size_t)h * d + j] * kb[j];
        acc = warp_sum(acc);
        total += fmaxf(acc, 0.0f);
    }
    if (lane == 0) scores[b] = total * rsqrtf((float)d);
}

// Everything between the attention's projections and `attend` in one launch (split_q_gate,
// norm_rope, kv_append and qsa_pool_block as one). Blocks, by blockIdx.x:
// - [0, heads): query head h of q_proj's output `qg` ([heads, 2d], query then gate): the query's
//   norm (q_norm) and RoPE into q, the gate into `gate`.
// - [heads, heads + kv_heads): the key's norm (k_norm) and RoPE into the K cache at the step's
//   position (step[1]).
// - the next `iheads`: QSA index query head's norm (iq_norm) and RoPE in place in `iq`
//   ([iheads, id], then the token's index key of id floats).
// - the last: the value into the V cache, the index key into `ikeys`, and when the token completes
//   a block of `ratio`, the block's pooled key (qsa_pool_block's math, after the append).
// Dynamic shared memory: max(d, id) floats.
extern "C" __global__ void attn_prep(const float* qg, float* q, float* gate, const float* k, const float* v, float* kc,
                                     float* vc, float* iq, float* ikeys, float* iblocks, const float* q_norm,
                                     const float* k_norm, const float* iq_norm, const float* ik_norm, int heads,
                                     int kv_heads, int d, int iheads, int id, int ratio, float eps,
                                     const float* inv_freq, int rd, const int* step) {
    KSPAN;
    grid_enter();
    extern __shared__ float sh[];
    __shared__ float scratch[32];
    const int pos = step[1];
    int b = blockIdx.x;
    if (b < heads) {
        const float* src = qg + (size_t)b * 2 * d;
        for (int j = threadIdx.x; j < d; j += blockDim.x) {
            sh[j] = src[j];
            gate[(size_t)b * d + j] = src[d + j];
        }
        __syncthreads();
        norm_rope_block(sh, q_norm, d, eps, inv_freq, rd, pos, scratch);
        for (int j = threadIdx.x; j < d; j += blockDim.x) q[(size_t)b * d + j] = sh[j];
        return;
    }
    b -= heads;
    if (b < kv_heads) {
        for (int j = threadIdx.x; j < d; j += blockDim.x) sh[j] = k[(size_t)b * d + j];
        __syncthreads();
        norm_rope_block(sh, k_norm, d, eps, inv_freq, rd, pos, scratch);
        float* dst = kc + ((size_t)pos * kv_heads + b) * d;
        for (int j = threadIdx.x; j < d; j += blockDim.x) dst[j] = sh[j];
        return;
    }
    b -= kv_heads;
    if (b < iheads) {
        float* h = iq + (size_t)b * id;
        for (int j = threadIdx.x; j < id; j += blockDim.x) sh[j] = h[j];
        __syncthreads();
        norm_rope_block(sh, iq_norm, id, eps, inv_freq, rd, pos, scratch);
        for (int j = threadIdx.x; j < id; j += blockDim.x) h[j] = sh[j];
        return;
    }
    const int kvd = kv_heads * d;
    for (int i = threadIdx.x; i < kvd; i += blockDim.x) vc[(size_t)pos * kvd + i] = v[i];
    if (iheads == 0) return;
    const float* ikey = iq + (size_t)iheads * id;
    for (int j = threadIdx.x; j < id; j += blockDim.x) ikeys[(size_t)pos * id + j] = ikey[j];
    if ((pos + 1) % ratio != 0) return;
    __syncthreads();  // the appended key is read back below
    const int blk = (pos + 1) / ratio - 1;
    for (int j = threadIdx.x; j < id; j += blockDim.x) {
        float acc = 0.0f;
        for (int t = blk * ratio; t < (blk + 1) * ratio; t++) acc += ikeys[(size_t)t * id + j];
        sh[j] = acc / (float)ratio;
    }
    __syncthreads();
    norm_rope_block(sh, ik_norm, id, eps, inv_freq, rd, blk * ratio, scratch);
    for (int j = threadIdx.x; j < id; j += blockDim.x) iblocks[(size_t)blk * id + j] = sh[j];
}

// Attention of one query per head over n cached tokens: the tokens idx[0..n) when idx is given,
// else 0..pos (n = pos + 1, pos = step[1]). k and v caches are [tokens, kv_heads, d], d <= 32 x
// ATTEND_R.
//
// Split over the tokens (flash decoding): the grid is (heads / G, splits), a block of G warps,
// warp w the query head blockIdx.x * G + w (the G heads of a block share a KV head, so their K and V
// rows are read once from L2 and then from L1). Each block takes a contiguous share of the tokens;
// each warp keeps an online softmax over it (the running max m, the sum l of exp(s - m), and
// sum exp(s - m) v with lane j holding dims j, j + 32, ...), four tokens at a time, and writes
// (acc, m, l) to `part` ([heads][splits][d + 2]). The last block of a head group to finish (the
// counter `count[blockIdx.x]`, reset by that block for the next launch) merges the splits in order:
// out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s, M = max m_s.
//
// Of the grid's gridDim.y splits only the first attend_splits(n) take tokens (the others return):
// a split's share costs a round trip to L2 per ATTEND_U tokens, the merge one per ATTEND_MERGE
// splits, so about sqrt(2 n) splits of sqrt(n / 2) tokens make the fewest in a row. At a 93-token
// context 32 splits of 3 tokens left the merging block 6 round trips and about 10 us after the
// others (session 22). `ATTEND_ALL_SPLITS` compiles the grid's splits always.
//
// With `gate` the merge writes out * sigmoid(gate) (the attention output gate, mul_sigmoid's
// expression, gate laid out as out), so the output projection stages a plain input instead of
// every one of its blocks computing the head's sigmoids again (6144 a block, 320 blocks: about 5 us
// of a 6 us staging in session 28). With `digits` too (d a multiple of 32), each merging warp also
// writes that output as the 4-bit tiled matvec stages it (mvd_put_chunk, as the GDN recurrence
// does): its lanes hold dims lane + 32 r of one head, whole 32-input chunks.
#define ATTEND_R 8
#define ATTEND_U 4
// Splits whose rows the merging warp loads at once (CHERENKOV_KERNEL_DEFINES=ATTEND_MERGE=1: one at a
// time, as before session 18).
#ifndef ATTEND_MERGE
#define ATTEND_MERGE 8
#endif
__device__ __forceinline__ int attend_splits(int n, int grid_splits) {
#ifdef ATTEND_ALL_SPLITS
    return grid_splits;
#else
    return max(1, min(grid_splits, (int)ceilf(sqrtf(2.0f * (float)n))));
#endif
}

// One warp's attention over tokens lo..hi of the cache (through `idx` where given) for query head
// h (KV head hk): acc = sum exp(s - m) v with lane j holding dims j, j + 32, ..., m the largest
// score and l = sum exp(s - m), four tokens at a time. No tokens: acc 0, m -inf, l 0.
__device__ __forceinline__ void attend_span(const float* __restrict__ q, const float* __restrict__ kc,
                                            const float* __restrict__ vc, const int* __restrict__ idx, int lo,
                                            int hi, int h, int hk, int kv_heads, int d, float scale,
                                            float (&acc)[ATTEND_R], float& m_out, float& l_out) {
    const int lane = threadIdx.x & 31;
    float qr[ATTEND_R];
#pragma unroll
    for (int r = 0; r < ATTEND_R; r++) {
        const int j = lane + 32 * r;
        qr[r] = j < d ? q[(size_t)h * d + j] * scale : 0.0f;
        acc[r] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    for (int i = lo; i < hi; i += ATTEND_U) {
        int t[ATTEND_U];
        float sc[ATTEND_U];
#ifndef ATTEND_V_LATE
        // The tokens' values are loaded with their keys (they do not depend on the scores), so the
        // four tokens cost one round trip to L2 instead of two (`ATTEND_V_LATE`: after the scores).
        float vv[ATTEND_U][ATTEND_R];
#endif
#pragma unroll
        for (int u = 0; u < ATTEND_U; u++) {
            t[u] = i + u < hi ? (idx ? idx[i + u] : i + u) : -1;
            const float* k = kc + ((size_t)max(t[u], 0) * kv_heads + hk) * d;
#ifndef ATTEND_V_LATE
            const float* v = vc + ((size_t)max(t[u], 0) * kv_heads + hk) * d;
#pragma unroll
            for (int r = 0; r < ATTEND_R; r++) {
                const int j = lane + 32 * r;
                vv[u][r] = j < d ? __ldg(v + j) : 0.0f;
            }
#endif
            float p = 0.0f;
#pragma unroll
            for (int r = 0; r < ATTEND_R; r++) {
                const int j = lane + 32 * r;
                if (j < d) p = fmaf(qr[r], __ldg(k + j), p);
            }
            sc[u] = p;
        }
        float mn = m;
#pragma unroll
        for (int u = 0; u < ATTEND_U; u++) {
            sc[u] = t[u] >= 0 ? warp_sum(sc[u]) : NEG_INF;
            mn = fmaxf(mn, sc[u]);
        }
        const float corr = expf(m - mn);
        l *= corr;
#pragma unroll
        for (int r = 0; r < ATTEND_R; r++) acc[r] *= corr;
#pragma unroll
        for (int u = 0; u < ATTEND_U; u++) {
            if (t[u] < 0) continue;
            const float p = expf(sc[u] - mn);
            l += p;
#ifdef ATTEND_V_LATE
            const float* v = vc + ((size_t)t[u] * kv_heads + hk) * d;
#endif
#pragma unroll
            for (int r = 0; r < ATTEND_R; r++) {
                const int j = lane + 32 * r;
#ifdef ATTEND_V_LATE
                if (j < d) acc[r] = fmaf(p, __ldg(v + j), acc[r]);
#else
                if (j < d) acc[r] = fmaf(p, vv[u][r], acc[r]);
#endif
            }
        }
        m = mn;
    }
    m_out = m;
    l_out = l;
}

extern "C" __global__ void attend(const float* __restrict__ q, const float* __restrict__ kc,
                                  const float* __restrict__ vc, const int* __restrict__ idx, int n,
                                  const int* step, float* part, int* count, float* out, int heads, int kv_heads,
                                  int d, float scale, const float* __restrict__ gate, u32* digits) {
    KSPAN;
    grid_enter();
    const int G = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int s = blockIdx.y;
    const int h = blockIdx.x * G + warp;
    const int hk = h / (heads / kv_heads);
    if (!idx) n = step[1] + 1;
    const int S = attend_splits(n, gridDim.y);
    if (s >= S) return;
    const int chunk = (n + S - 1) / S, lo = min(n, s * chunk), hi = min(n, lo + chunk);
    float acc[ATTEND_R], m, l;
    attend_span(q, kc, vc, idx, lo, hi, h, hk, kv_heads, d, scale, acc, m, l);
    float* mine = part + ((size_t)h * gridDim.y + s) * (d + 2);
#pragma unroll
    for (int r = 0; r < ATTEND_R; r++) {
        const int j = lane + 32 * r;
        if (j < d) mine[j] = acc[r];
    }
    if (lane == 0) {
        mine[d] = m;
        mine[d + 1] = l;
    }
    tl_mark();
    // The gate (written by attn_prep, which this launch waited for), requested before the count's
    // round trip: only the merging block uses it.
    float gv[ATTEND_R];
#pragma unroll
    for (int r = 0; r < ATTEND_R; r++) {
        const int j = lane + 32 * r;
        gv[r] = gate && j < d ? __ldcg(gate + (size_t)h * d + j) : 0.0f;
    }
    // The last block of the head group merges (the classic fence-and-count reduction).
    if (!last_block_of((unsigned*)count + blockIdx.x, (unsigned)S)) return;
    if (threadIdx.x == 0) count[blockIdx.x] = 0;
    const float* hp = part + (size_t)h * gridDim.y * (d + 2);
    // ATTEND_MERGE splits' rows are loaded at once, then added in split order: a loop that loads
    // one split's row and adds it before loading the next waits a round trip to L2 per split (32
    // in a row). The first batch is loaded with the splits' maxima and sums (lane s holds split
    // s's, S <= 32), in the same round trip.
    const float ms = lane < S ? __ldcg(hp + (size_t)lane * (d + 2) + d) : NEG_INF;
    const float ls = lane < S ? __ldcg(hp + (size_t)lane * (d + 2) + d + 1) : 0.0f;
    float a[ATTEND_MERGE][ATTEND_R];
    auto load_batch = [&](int k0) {
#pragma unroll
        for (int b = 0; b < ATTEND_MERGE; b++) {
            const float* row = hp + (size_t)(k0 + b) * (d + 2);
#pragma unroll
            for (int r = 0; r < ATTEND_R; r++) {
                const int j = lane + 32 * r;
                a[b][r] = k0 + b < S && j < d ? __ldcg(row + j) : 0.0f;
            }
        }
    };
    load_batch(0);
    const float M = warp_max(ms);
    const float ws = lane < S ? expf(ms - M) : 0.0f;
    const float L = warp_sum(ws * ls);
    float o[ATTEND_R];
#pragma unroll
    for (int r = 0; r < ATTEND_R; r++) o[r] = 0.0f;
    for (int k0 = 0; k0 < S; k0 += ATTEND_MERGE) {
        if (k0 > 0) load_batch(k0);
#pragma unroll
        for (int b = 0; b < ATTEND_MERGE; b++) {
            const float w = __shfl_sync(0xffffffffu, ws, (k0 + b) & 31);
            if (k0 + b >= S || w == 0.0f) continue;
#pragma unroll
            for (int r = 0; r < ATTEND_R; r++) {
                const int j = lane + 32 * r;
                if (j < d) o[r] = fmaf(w, a[b][r], o[r]);
            }
        }
    }
    tl_mark_at(6);  // the merge's loads in and added
    const float inv = 1.0f / L;
    float y[ATTEND_R];
#pragma unroll
    for (int r = 0; r < ATTEND_R; r++) {
        const int j = lane + 32 * r;
        y[r] = gate ? (o[r] * inv) * sigmoidf_(gv[r]) : o[r] * inv;
        if (j < d) out[(size_t)h * d + j] = y[r];
    }
    // (d is a multiple of 32 where digits is given: chunk h d / 32 + r is dims 32 r.. of head h.)
    if (digits) mvd_put_chunks<ATTEND_R>(digits, heads * d / 32, h * d / 32, y, d / 32);
}

// `attend` in thread block clusters (`attend_cl`), where a block holds 2 query heads of one KV
// head and a head's dims split into whole 32-dim slices over the cluster (head_dim = 32 ATTEND_CL): the splits'
// partial results stay in shared memory and are merged through the cluster's distributed shared
// memory, after a cluster barrier, instead of `attend`'s fence, count and second pass through L2
// by the last block (about 8 us of a 13 us launch at a short context, session 45).
//
// A cluster of ATTEND_CL blocks serves one pair of heads (clusters along x: blockIdx.x /
// ATTEND_CL is the pair, the cluster rank the block's place in it). A block's 8 warps are 4 a
// head (blocks of 256 threads: at 512 the splits' registers spill), so a head's tokens split 32
// ways over the cluster (split p = rank * 4 + warp % 4 takes tokens p chunk .. (p + 1) chunk),
// each warp as `attend`'s splits (attend_span). After the barrier, warp w < 2 of block r merges
// head w of the pair's dims 32 r .. 32 r + 31, lane l holding dim 32 r + l: it
// loads the 32 splits' maxima and sums (lane p split p's) and their values of its dim, and writes
// out = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p, gated and as o_proj's staged image as
// `attend`'s merge does. A second barrier keeps every block's partials until the others have read
// them.
#ifndef ATTEND_CL
#define ATTEND_CL 8
#endif
// (Clusters need compute capability 9.0: below it the kernel is empty and never launched.)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define ATTEND_CLUSTERS 1
#else
#define ATTEND_CLUSTERS 0
#endif
#if ATTEND_CLUSTERS
__device__ __forceinline__ void cluster_sync_all() {
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The float at `p` in this block's shared memory, read from the block of cluster rank `rank`.
__device__ __forceinline__ float cluster_load(const float* p, unsigned rank) {
    const unsigned local = (unsigned)__cvta_generic_to_shared(p);
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
}
#endif

extern "C" __global__ void __launch_bounds__(256) attend_cl(const float* __restrict__ q, const float* __restrict__ kc,
                                                            const float* __restrict__ vc, const int* __restrict__ idx,
                                                            int n, const int* step, float* out, int heads,
                                                            int kv_heads, int d, float scale,
                                                            const float* __restrict__ gate, u32* digits) {
    KSPAN;
#if ATTEND_CLUSTERS
    // Each warp's split: its dims' values, then its maximum and sum.
    __shared__ float part[8][32 * ATTEND_R + 2];
    grid_enter();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    unsigned rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    const int pair = blockIdx.x / ATTEND_CL;
    const int h = pair * 2 + warp / 4, hk = h / (heads / kv_heads);
    if (!idx) n = step[1] + 1;
    const int p = (int)rank * 4 + (warp & 3);
    const int chunk = (n + 31) / 32, lo = min(n, p * chunk), hi = min(n, lo + chunk);
    float acc[ATTEND_R], m, l;
    attend_span(q, kc, vc, idx, lo, hi, h, hk, kv_heads, d, scale, acc, m, l);
#pragma unroll
    for (int r = 0; r < ATTEND_R; r++) {
        const int j = lane + 32 * r;
        if (j < d) part[warp][j] = acc[r];
    }
    if (lane == 0) {
        part[warp][d] = m;
        part[warp][d + 1] = l;
    }
    tl_mark();
    const int hm = pair * 2 + warp, dim = 32 * (int)rank + lane;
    // The gate (written by attn_prep, which this launch waited for), requested before the barrier.
    const float gv = gate && warp < 2 ? __ldcg(gate + (size_t)hm * d + dim) : 0.0f;
    cluster_sync_all();
    if (warp < 2) {
        // Split p of head `warp` is warp 4 warp + p % 4 of the block of rank p / 4.
        const float* mine = part[4 * warp + (lane & 3)];
        const float mp = cluster_load(mine + d, lane >> 2);
        const float lp = cluster_load(mine + d + 1, lane >> 2);
        // The splits' values in two batches of 16 (all 32 at once spill at 512 threads).
        float a[16];
#pragma unroll
        for (int s = 0; s < 16; s++) a[s] = cluster_load(part[4 * warp + (s & 3)] + dim, s >> 2);
        const float M = warp_max(mp);
        const float wp = expf(mp - M);  // 0 for a split without tokens (m -inf); n >= 1 keeps M finite
        const float L = warp_sum(wp * lp);
        float o = 0.0f;
#pragma unroll
        for (int s = 0; s < 16; s++) o = fmaf(__shfl_sync(0xffffffffu, wp, s), a[s], o);
#pragma unroll
        for (int s = 0; s < 16; s++) a[s] = cluster_load(part[4 * warp + (s & 3)] + dim, (s + 16) >> 2);
#pragma unroll
        for (int s = 0; s < 16; s++) o = fmaf(__shfl_sync(0xffffffffu, wp, s + 16), a[s], o);
        const float y = gate ? (o * (1.0f / L)) * sigmoidf_(gv) : o * (1.0f / L);
        out[(size_t)hm * d + dim] = y;
        if (digits) mvd_put_chunk(digits, heads * d / 32, hm * d / 32 + (int)rank, y);
    }
    cluster_sync_all();
#endif
}
