// Gated attention over the KV cache with QSA token selection, one query token.

// Splits q_proj's output [heads, 2d] (query first, then gate) into q [heads, d] and gate [heads, d].
extern "C" __global__ void split_q_gate(const float* qg, float* q, float* gate, int heads, int d) {
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

// Attention of one query per head (one block per query head) over n cached tokens: the tokens
// idx[0..n) when idx is given, else 0..pos (n = pos + 1, pos = step[1]). k and v caches are
// [tokens, kv_heads, d]; `scores` is scratch of n floats per head.
extern "C" __global__ void attend(const float* q, const float* kc, const float* vc, const int* idx, int n,
                                  const int* step, float* scores, float* out, int heads, int kv_heads, int d,
                                  float scale) {
    grid_enter();
    __shared__ float scratch[32];
    if (!idx) n = step[1] + 1;
    const int h = blockIdx.x;
    const int hk = h / (heads / kv_heads);
    const float* qh = q + (size_t)h * d;
    float* sc = scores + (size_t)h * n;
    float m = NEG_INF;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int t = idx ? idx[i] : i;
        const float* k = kc + ((size_t)t * kv_heads + hk) * d;
        float acc = 0.0f;
        for (int j = 0; j < d; j++) acc += qh[j] * k[j];
        acc *= scale;
        sc[i] = acc;
        m = fmaxf(m, acc);
    }
    m = block_max(m, scratch);
    float sum = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float e = expf(sc[i] - m);
        sc[i] = e;
        sum += e;
    }
    sum = block_sum(sum, scratch);
    const float inv = 1.0f / sum;
    __syncthreads();
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        float acc = 0.0f;
        for (int i = 0; i < n; i++) {
            const int t = idx ? idx[i] : i;
            acc += sc[i] * vc[((size_t)t * kv_heads + hk) * d + j];
        }
        out[(size_t)h * d + j] = acc * inv;
    }
}
