// Norms, elementwise steps and the hyper-connection read/inject.

// Zero-centred RMSNorm: y = x / rms(x) * (1 + w) over groups of `group` elements; one block per
// group (launched with 1024 threads: one group is a few thousand elements, so each thread's loads
// are few and all in flight together). The weight has `wlen` elements and repeats (wlen == group
// for per-head norms, or the whole row for per-stream norms).
extern "C" __global__ void rmsnorm_zc(const float* x, const float* w, float* y, int group, int wlen, float eps) {
    KSPAN;
    grid_enter();
    __shared__ float scratch[32];
    const float* xg = x + (size_t)blockIdx.x * group;
    float* yg = y + (size_t)blockIdx.x * group;
    float ss = 0.0f;
#pragma unroll 4
    for (int j = threadIdx.x; j < group; j += blockDim.x) ss += xg[j] * xg[j];
    ss = block_sum(ss, scratch);
    const float inv = rsqrtf(ss / (float)group + eps);
    const int w0 = (int)(((size_t)blockIdx.x * group) % wlen);
    if (w0 + group <= wlen) {
        const float* wg = w + w0;
#pragma unroll 4
        for (int j = threadIdx.x; j < group; j += blockDim.x) yg[j] = xg[j] * inv * (1.0f + wg[j]);
    } else {
        for (int j = threadIdx.x; j < group; j += blockDim.x) yg[j] = xg[j] * inv * (1.0f + w[(w0 + j) % wlen]);
    }
}

// y = silu(x * scale), in place.
extern "C" __global__ void scale_silu(float* x, int n, float scale) {
    KSPAN;
    grid_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = siluf_(x[i] * scale);
}

// Hyper-connection input: out[j] = mean over streams s of sigmoid(mix[s*H+j]) * normed[s*H+j].
extern "C" __global__ void hc_mix(const float* mix, const float* normed, float* out, int hc, int H) {
    KSPAN;
    grid_enter();
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= H) return;
    float acc = 0.0f;
    for (int s = 0; s < hc; s++) acc += sigmoidf_(mix[s * H + j]) * normed[s * H + j];
    out[j] = acc / (float)hc;
}

// Injection: x[s*H+j] += 2 sigmoid(inj[s] / hc) * out[j].
extern "C" __global__ void hc_inject(float* x, const float* inj, const float* out, int hc, int H) {
    KSPAN;
    grid_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= hc * H) return;
    const int s = i / H, j = i - s * H;
    x[i] += 2.0f * sigmoidf_(inj[s] / (float)hc) * out[j];
}

// The MTP head's stem: x[s*H+j] += e[j] for every stream s (the embedding branch added to each
// stream's fc_hidden output).
extern "C" __global__ void add_streams(float* x, const float* e, int hc, int H) {
    KSPAN;
    grid_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= hc * H) return;
    x[i] += e[i % H];
}

// Copies spans[s] = (dst, src, bytes), three u64 each, one span per grid row (blockIdx.y): a
// verifying forward's record of the recurrent states in one launch instead of a copy per buffer.
// Addresses are 16-byte aligned and lengths whole f32s.
extern "C" __global__ void copy_spans(const unsigned long long* spans, int n) {
    KSPAN;
    grid_enter();
    const int s = blockIdx.y;
    if (s >= n) return;
    const unsigned long long* sp = spans + 3 * (size_t)s;
    const size_t bytes = sp[2];
    const size_t step = (size_t)gridDim.x * blockDim.x;
    const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    uint4* d4 = (uint4*)sp[0];
    const uint4* s4 = (const uint4*)sp[1];
    const size_t n16 = bytes / 16;
    for (size_t i = first; i < n16; i += step) d4[i] = s4[i];
    float* d1 = (float*)sp[0];
    const float* s1 = (const float*)sp[1];
    for (size_t i = n16 * 4 + first; i < bytes / 4; i += step) d1[i] = s1[i];
}

// y = silu(gate) * up, in place into gate.
extern "C" __global__ void silu_mul(float* gate, const float* up, int n) {
    KSPAN;
    grid_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) gate[i] = siluf_(gate[i]) * up[i];
}

// x[i] *= sigmoid(g[i]).
extern "C" __global__ void mul_sigmoid(float* x, const float* g, int n) {
    KSPAN;
    grid_enter();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= sigmoidf_(g[i]);
}

// RoPE (rotate-half on the first rd elements) of `heads` vectors of length d at position pos.
__device__ __forceinline__ void rope_apply(float* v, const float* inv_freq, int rd, int pos) {
    const int half = rd / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float f = (float)pos * inv_freq[i];
        const float c = cosf(f), s = sinf(f);
        const float a = v[i], b = v[i + half];
        v[i] = a * c - b * s;
        v[i + half] = b * c + a * s;
    }
}

// Zero-centred RMSNorm (weight w) and RoPE at `pos` of the d floats `h` (shared or global memory),
// by the whole block (also attn_prep's, in attention.cu).
__device__ __forceinline__ void norm_rope_block(float* h, const float* w, int d, float eps, const float* inv_freq,
                                                int rd, int pos, float* scratch) {
    float ss = 0.0f;
    for (int j = threadIdx.x; j < d; j += blockDim.x) ss += h[j] * h[j];
    ss = block_sum(ss, scratch);
    const float inv = rsqrtf(ss / (float)d + eps);
    for (int j = threadIdx.x; j < d; j += blockDim.x) h[j] = h[j] * inv * (1.0f + w[j]);
    __syncthreads();
    rope_apply(h, inv_freq, rd, pos);
    __syncthreads();
}

// Per head (one block each): norm_rope_block at the step's position (step[1]).
extern "C" __global__ void norm_rope(float* v, const float* w, int d, float eps, const float* inv_freq, int rd,
                                     const int* step) {
    KSPAN;
    grid_enter();
    __shared__ float scratch[32];
    norm_rope_block(v + (size_t)blockIdx.x * d, w, d, eps, inv_freq, rd, step[1], scratch);
}
