// y = W x for packed weights, one warp per output row. Affine weights are read as stored (u32
// words, bf16 scales and biases) and decoded in registers; no weight is ever expanded in memory.

template <int BITS>
__device__ __forceinline__ void matvec_affine(const u32* __restrict__ W, const u16* __restrict__ S,
                                              const u16* __restrict__ B, const float* __restrict__ x,
                                              float* __restrict__ y, int rows, int cols, int gs) {
    const int row = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (row >= rows) return;
    const int wpr = cols * BITS / 32, gpr = cols / gs;
    const float v = affine_row_dot<BITS>(W + (size_t)row * wpr, S + (size_t)row * gpr, B + (size_t)row * gpr, x, cols, gs);
    if ((threadIdx.x & 31) == 0) y[row] = v;
}

// Kernels that stage x take `rpb`, the rows a block covers: staging costs one pass over x per block,
// so large matrices use many rows per block (the host picks enough blocks to fill the GPU, so small
// matrices keep one row per warp).

// 2-, 4- and 8-bit rows with x staged in shared memory (dynamic shared memory: cols floats).
template <int BITS>
__device__ __forceinline__ void matvec_affine_sx(const u32* __restrict__ W, const u16* __restrict__ S,
                                                 const u16* __restrict__ B, const float* __restrict__ x,
                                                 float* __restrict__ y, int rows, int cols, int gs, int rpb) {
    extern __shared__ float sx[];
    stage_x(x, sx, cols);
    const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int wpr = cols * BITS / 32, gpr = cols / gs;
    const int end = min(rows, (blockIdx.x + 1) * rpb);
    for (int row = blockIdx.x * rpb + warp; row < end; row += warps) {
        const float v =
            affine_row_dot_sx<BITS>(W + (size_t)row * wpr, S + (size_t)row * gpr, B + (size_t)row * gpr, sx, cols, gs);
        if ((threadIdx.x & 31) == 0) y[row] = v;
    }
}

#define MATVEC_AFFINE(B)                                                                                       \
    extern "C" __global__ void matvec_q##B(const u32* W, const u16* S, const u16* Bi, const float* x, float* y, \
                                           int rows, int cols, int gs, int rpb) {                              \
        matvec_affine<B>(W, S, Bi, x, y, rows, cols, gs);                                                      \
    }
#define MATVEC_AFFINE_SX(B)                                                                                    \
    extern "C" __global__ void matvec_q##B(const u32* W, const u16* S, const u16* Bi, const float* x, float* y, \
                                           int rows, int cols, int gs, int rpb) {                              \
        matvec_affine_sx<B>(W, S, Bi, x, y, rows, cols, gs, rpb);                                              \
    }
MATVEC_AFFINE_SX(2)
MATVEC_AFFINE(3)
MATVEC_AFFINE_SX(4)
MATVEC_AFFINE(5)
MATVEC_AFFINE(6)
MATVEC_AFFINE_SX(8)

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
extern "C" __global__ void matvec_float(const void* W, const float* x_global, float* y, int rows, int cols, int dtype,
                                        int rpb) {
    extern __shared__ float sx[];
    stage_x(x_global, sx, cols);
    const float* x = sx;
    const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int end = min(rows, (blockIdx.x + 1) * rpb);
    for (int row = blockIdx.x * rpb + warp; row < end; row += warps) matvec_float_row_impl(W, x, y, row, cols, dtype);
}

// Row `row` of an embedding table, dequantized, written `copies` times (the hyper-connection streams
// are initialised with copies of the embedding). dtype: -1 affine, else as matvec_float.
extern "C" __global__ void embed_row(const void* W, const u16* S, const u16* B, int row, float* out, int cols,
                                     int copies, int dtype, int bits, int gs) {
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
