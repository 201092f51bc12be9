// Shared helpers for Cherenkov's CUDA kernels. Compiled at run time by NVRTC, without any header:
// the types and conversions below are spelled out so no CUDA include path is needed.

typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

// Address-table entries carry the record's precision in their top bits (bit 63: Q3 record,
// bit 62: Q2 record); kernels mask them off before dereferencing.
#define TAG_MASK (3ull << 62)
#define NEG_INF __int_as_float(0xff800000)

// ---- Programmatic dependent launch (compute capability 9.0 and newer; Gpu::launch in gpu.rs). ----
//
// Kernels are launched so that the next kernel in the stream may be scheduled while this one runs.
// Every kernel calls grid_wait() before it touches memory that earlier work writes, and before any
// return (a grid that could finish before its predecessor would let its successor, which waits only
// for it, read too early); then grid_release() lets the next kernel's blocks be scheduled into the
// room this grid leaves. Older GPUs launch normally and the instructions compile to nothing. The
// dense tiled matvecs request their first weights before waiting (mv_core's EARLY in linear.cu):
// dense weights are written once at load, never by earlier kernels, and a block scheduled while the
// previous kernel ends has them in flight meanwhile.
__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// ---- The kernel timeline (compiled with -DTIMELINE: `CHERENKOV_TIMELINE`, Timeline in gpu.rs). ----
//
// Every kernel opens with KSPAN. With TIMELINE defined, and while the host has switched recording on
// (tl_on), thread 0 of every block appends one record when it leaves the kernel: the kernel's name
// (FNV-1a of it), the block, the grid's size, the multiprocessor, and four clock readings (ns):
// thread 0's start, its return from grid_wait (the predecessor done), its first pass through
// tl_mark() (0 if none: a point inside the kernel's work, such as the end of a matvec's staging),
// its end. Thread 0 stands for its block: it starts first and, in most kernels, writes the block's
// result last. Without TIMELINE KSPAN is empty, tl_mark() does nothing and nothing here is compiled.
#ifdef TIMELINE
struct TlRec {
    u32 name, block, blocks, smid;
    u64 start, waited, end, marked;
};
__device__ TlRec* tl_buf;
__device__ u32 tl_cap;
__device__ u32 tl_n;
__device__ u32 tl_on;
__shared__ u64 tl_start;
__shared__ u64 tl_waited;
__shared__ u64 tl_marked;

struct TlSpan {
    const char* name;
    __device__ explicit TlSpan(const char* n) : name(n) {
        if (threadIdx.x == 0) {
            tl_start = global_ns();
            tl_waited = 0;
            tl_marked = 0;
        }
    }
    __device__ ~TlSpan() {
        if (threadIdx.x != 0 || *(volatile u32*)&tl_on == 0) return;
        const u64 end = global_ns();
        u32 h = 2166136261u;
        for (const char* p = name; *p; p++) h = (h ^ (u32)(u8)*p) * 16777619u;
        const u32 i = atomicAdd(&tl_n, 1u);
        if (i >= tl_cap) return;
        u32 smid;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        TlRec r;
        r.name = h;
        r.block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
        r.blocks = gridDim.x * gridDim.y * gridDim.z;
        r.smid = smid;
        r.start = tl_start;
        r.waited = tl_waited;
        r.end = end;
        r.marked = tl_marked;
        tl_buf[i] = r;
    }
};
#define KSPAN TlSpan tl_span_(__func__)
#else
#define KSPAN
#endif

__device__ __forceinline__ void grid_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#ifdef TIMELINE
    if (threadIdx.x == 0 && tl_waited == 0) tl_waited = global_ns();
#endif
}

// The timeline's mark: thread 0's first pass here (see TlRec). A kernel may have further places
// for it, numbered: `tl_mark_at(n)` marks where the kernels are compiled with TL_MARK_AT=n
// (`CHERENKOV_KERNEL_DEFINES=TL_MARK_AT=n` with `CHERENKOV_TIMELINE`, to split a kernel's time at
// another point; 0, the default, is tl_mark()'s place).
#ifndef TL_MARK_AT
#define TL_MARK_AT 0
#endif
__device__ __forceinline__ void tl_mark_at(int at) {
#ifdef TIMELINE
    if (at == TL_MARK_AT && threadIdx.x == 0 && tl_marked == 0) tl_marked = global_ns();
#endif
}

__device__ __forceinline__ void tl_mark() { tl_mark_at(0); }

// The fence and count of a last-block reduction: every block of a group calls this after writing
// its share, and it returns true in the one block that arrives last (`counter` reaches n; the caller
// resets it for the next launch), which may then load every block's share from L2 (ld.cg). Every
// thread fences before the block's barrier and again once its block is known to be last. (Thread 0
// alone fencing, after the barrier, as the cooperative groups' grid barrier does, measured no
// different in session 26.) Timeline mark 5: the last block past it (`TL_MARK_AT=5`).
__device__ __forceinline__ bool last_block_of(unsigned* counter, unsigned n) {
    __shared__ int lb_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) lb_last = atomicAdd(counter, 1u) == n - 1;
    __syncthreads();
    if (!lb_last) return false;
    __threadfence();
    tl_mark_at(5);
    return true;
}

__device__ __forceinline__ void grid_release() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Writes the GPU's global clock (ns) to `at` from the grid's first thread, if `at` is set: a
// timestamp taken inside a kernel, where a CUDA event between two kernels would cost the second
// its early launch (the MoE blocks' expert timing: moe() in model.rs).
__device__ __forceinline__ void stamp_first(u64* at) {
    if (at && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *at = global_ns();
}

// The usual kernel entry: wait for the previous kernel's results, then let the next one be scheduled.
__device__ __forceinline__ void grid_enter() {
    grid_wait();
    grid_release();
}

// Waits, if `relay` is set, until its flag is nonzero: thread 0 polls with acquire loads, then the
// block's barrier. A streamed step replayed whole (CudaModel's flagged step) holds a block's read
// experts and its router so: the copy stream sets the flag once their records landed, or the host
// once its turn is done.
//
// `relay` points at a flag's relay in device memory, 32 bytes: the u32 `seen` (zeroed before the
// waiting kernels are queued), a u32 count of 8-byte words, then the address of the flag itself (a
// u32 in host memory mapped for the device that the host or a stream write sets), and the words'
// source (host memory) and destination (device memory). Only the grid's first block reads the flag
// over the bus; its first warp then copies the words (the rows the host wrote before setting the
// flag: the kernels behind it read them from device memory, not each over the bus) and sets
// `seen`, which every other block polls in device memory. (Every block polling the host's word, each
// read a round trip over PCIe, flooded the bus the expert copies use: session 31 measured a flagged
// step ten times slower.) Blocks start in order of their index, so the first is running while any
// other waits.
__device__ __forceinline__ void flag_wait(const unsigned* relay) {
    if (!relay) return;
    unsigned v;
    if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {
        if (threadIdx.x < 32) {
            const unsigned long long* r = reinterpret_cast<const unsigned long long*>(relay);
            if (threadIdx.x == 0) {
                const unsigned* flag = reinterpret_cast<const unsigned*>(r[1]);
                for (;;) {
                    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
                    if (v) break;
                    __nanosleep(64);
                }
            }
            __syncwarp();
            const unsigned words = relay[1];
            const unsigned long long* src = reinterpret_cast<const unsigned long long*>(r[2]);
            unsigned long long* dst = reinterpret_cast<unsigned long long*>(r[3]);
            for (unsigned i = threadIdx.x; i < words; i += 32) {
                unsigned long long w;
                asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(w) : "l"(src + i) : "memory");
                dst[i] = w;
            }
            __threadfence();
            __syncwarp();
            if (threadIdx.x == 0) asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(relay), "r"(1u) : "memory");
        }
    } else if (threadIdx.x == 0) {
        for (;;) {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(relay) : "memory");
            if (v) break;
            __nanosleep(256);
        }
    }
    __syncthreads();
}

__device__ __forceinline__ float bf16f(u16 b) { return __uint_as_float(((u32)b) << 16); }

__device__ __forceinline__ float f16f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float siluf_(float x) { return x * sigmoidf_(x); }
__device__ __forceinline__ float softplusf_(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024). `scratch` holds 32 floats.
__device__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int nw = (blockDim.x + 31) >> 5;
    v = (threadIdx.x < nw) ? scratch[threadIdx.x] : 0.0f;
    if (warp == 0) v = warp_sum(v);
    if (threadIdx.x == 0) scratch[0] = v;
    __syncthreads();
    const float r = scratch[0];
    __syncthreads();
    return r;
}

// block_sum of N values at once: each value's sum is block_sum's, in the same order (its warps'
// sums, then warp 0's sum of those), over one set of barriers for all N. `scratch` holds 32 N
// floats.
template <int N>
__device__ __forceinline__ void block_sum_n(float (&v)[N], float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int k = 0; k < N; k++) v[k] = warp_sum(v[k]);
    __syncthreads();
    if (lane == 0) {
#pragma unroll
        for (int k = 0; k < N; k++) scratch[k * 32 + warp] = v[k];
    }
    __syncthreads();
    const int nw = (blockDim.x + 31) >> 5;
#pragma unroll
    for (int k = 0; k < N; k++) {
        float x = (threadIdx.x < nw) ? scratch[k * 32 + threadIdx.x] : 0.0f;
        if (warp == 0) x = warp_sum(x);
        v[k] = x;
    }
    if (threadIdx.x == 0) {
#pragma unroll
        for (int k = 0; k < N; k++) scratch[k * 32] = v[k];
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < N; k++) v[k] = scratch[k * 32];
    __syncthreads();
}

// Code j of a packed affine row (LSB-first bit stream of u32 words), any width.
__device__ __forceinline__ u32 get_code(const u32* w, int j, int bits) {
    const int bit = j * bits, wi = bit >> 5, sh = bit & 31;
    u32 v = w[wi] >> sh;
    if (sh + bits > 32) v |= w[wi + 1] << (32 - sh);
    return v & ((1u << bits) - 1u);
}

// The 32 codes held by BITS consecutive words (a chunk; a group of 32, 64 or 128 codes is 1, 2 or 4
// chunks, so a chunk never straddles a group).
template <int BITS>
__device__ __forceinline__ void unpack32(const u32* __restrict__ w, float* q) {
    u32 r[BITS];
#pragma unroll
    for (int i = 0; i < BITS; i++) r[i] = w[i];
#pragma unroll
    for (int k = 0; k < 32; k++) {
        const int bit = k * BITS, wi = bit >> 5, sh = bit & 31;
        u32 v = r[wi] >> sh;
        if (sh + BITS > 32) v |= r[wi + 1] << (32 - sh);
        q[k] = (float)(v & ((1u << BITS) - 1u));
    }
}

// Warp-cooperative dot product of affine row (words/scales/biases) with x (cols floats).
// Per chunk of 32 codes: scale * sum(q x) + bias * sum(x). The result is in every lane.
template <int BITS>
__device__ __forceinline__ float affine_row_dot(const u32* __restrict__ words, const u16* __restrict__ scales,
                                                const u16* __restrict__ biases, const float* __restrict__ x, int cols,
                                                int gs) {
    const int lane = threadIdx.x & 31;
    const int chunks = cols >> 5;
    float acc = 0.0f;
    for (int c = lane; c < chunks; c += 32) {
        float q[32];
        unpack32<BITS>(words + c * BITS, q);
        const float* xc = x + c * 32;
        float sq = 0.0f, sx = 0.0f;
#pragma unroll
        for (int k = 0; k < 32; k++) {
            const float xv = xc[k];
            sq += q[k] * xv;
            sx += xv;
        }
        const int g = (c * 32) / gs;
        acc += bf16f(scales[g]) * sq + bf16f(biases[g]) * sx;
    }
    return warp_sum(acc);
}

// Stages x (n floats) into shared memory `sx` (all threads of the block take part).
__device__ __forceinline__ void stage_x(const float* __restrict__ x, float* sx, int n) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) sx[i] = x[i];
    __syncthreads();
}

// Warp-cooperative dot product of an affine row whose codes fill whole words (2, 4 or 8 bits) with x
// staged in shared memory. Lane i takes words i, i+32, ...: consecutive lanes read consecutive words
// (coalesced) and a word's x are contiguous. (Staging x word-major instead, so that the lanes'
// loads hit distinct banks, measured 30% slower for the 4-bit matvec on the H200, for reasons not
// established: benchmark/notes-cuda.md.) Per word: scale * sum(q x) + bias * sum(x).
template <int BITS>
__device__ __forceinline__ float affine_row_dot_sx(const u32* __restrict__ words, const u16* __restrict__ scales,
                                                   const u16* __restrict__ biases, const float* sx, int cols, int gs) {
    constexpr int PER = 32 / BITS;  // codes per word
    const int lane = threadIdx.x & 31;
    const int nwords = cols / PER;
    float acc = 0.0f;
#pragma unroll 4
    for (int w = lane; w < nwords; w += 32) {
        const u32 word = words[w];
        const float* xw = sx + w * PER;
        float sq = 0.0f, sxs = 0.0f;
#pragma unroll
        for (int k = 0; k < PER; k++) {
            const float xv = xw[k];
            sq += (float)((word >> (k * BITS)) & ((1u << BITS) - 1u)) * xv;
            sxs += xv;
        }
        const int g = (w * PER) / gs;
        acc += bf16f(scales[g]) * sq + bf16f(biases[g]) * sxs;
    }
    return warp_sum(acc);
}

// A verifying pass's launches over several rows (`*_rows` kernels; rows.rs): blockIdx.z is the
// row, and row r's vectors lie r * rs bytes past row 0's. The pointer for this block's row (null
// stays null).
template <class T>
__device__ __forceinline__ T* row_ptr(T* p, long long rs) {
    return p ? (T*)((char*)p + (long long)blockIdx.z * rs) : p;
}
