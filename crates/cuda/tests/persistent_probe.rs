//! What could one persistent kernel per step reach? A measurement for the design of the next
//! decode kernels (ignored by default; needs a GPU):
//!
//!     cargo test --release -p cherenkov-cuda --test persistent_probe --no-run   # prints the binary
//!     <binary> --ignored --nocapture        (on the GPU machine, with NVRTC on LD_LIBRARY_PATH)
//!
//! A decoder layer is a chain of dependent matrix-vector products, each too small to reach the
//! device bandwidth on its own (launch, staging the input, the ramp and the tail cost more than
//! the bytes). The probe runs one layer-like chain (the byte sizes of the released shape's stages,
//! 8-bit weights of 2560 columns, so bytes = rows x 2560) four times with distinct weights (no L2
//! reuse), three ways:
//!
//! - one launch per stage (today's structure, without PDL);
//! - one persistent kernel: every block resident, a software grid barrier between stages;
//! - the same, each warp prefetching its rows of the next stage into L2 before the barrier.
//!
//! It prints microseconds per layer and the bytes' effective bandwidth for each.

use std::ffi::{CString, c_void};

use cherenkov_cuda::gpu::{Arg, Gpu};
use cudarc::driver::result as cu;
use cudarc::driver::sys;

const SOURCE: &str = r#"
extern "C" __device__ void grid_barrier(unsigned* count, volatile unsigned* gen, unsigned nblocks) {
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned g = *gen;
        __threadfence();
        if (atomicAdd(count, 1u) == nblocks - 1) {
            *count = 0;
            __threadfence();
            atomicAdd((unsigned*)gen, 1u);
        } else {
            while (*gen == g) { }
        }
        __threadfence();
    }
    __syncthreads();
}

// rows x 2560 int8 weights per stage, stage s at w + off[s] (bytes); x -> y alternate in xs.
// first..last: the stages this launch runs; barrier between them when persistent.
extern "C" __global__ void __launch_bounds__(512) chain(
    const signed char* __restrict__ w, const long long* __restrict__ off, const int* __restrict__ rows,
    int first, int last, float* xs, int dim, unsigned* bar, int prefetch)
{
    extern __shared__ float xsh[];
    // As every engine kernel: the next launch may be scheduled now, and waits for this one's end.
    asm volatile("griddepcontrol.launch_dependents;");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int gwarp = blockIdx.x * nwarps + warp, allwarps = gridDim.x * nwarps;
    for (int s = first; s <= last; s++) {
        const float* x = xs + (s & 1) * dim;
        float* y = xs + ((s + 1) & 1) * dim;
        // Transposed (xsh[t * 160 + c] = x[16 c + t]) so the lanes, each owning chunk c of 16
        // weights, read consecutive banks; __ldcg: not from L1, other SMs wrote x.
        for (int i = threadIdx.x; i < 2560; i += blockDim.x) xsh[(i & 15) * 160 + (i >> 4)] = __ldcg(x + i);
        __syncthreads();
        const int R = rows[s];
        const uint4* ws = (const uint4*)(w + off[s]);
        // ROWS rows per warp at a time: all their loads are issued before any arithmetic.
        for (int r0 = gwarp * ROWS; r0 < R; r0 += allwarps * ROWS) {
            uint4 q[ROWS][5];
#pragma unroll
            for (int k = 0; k < ROWS; k++) {
                const uint4* row = ws + (long long)min(r0 + k, R - 1) * 160;
#pragma unroll
                for (int j = 0; j < 5; j++) q[k][j] = __ldg(row + lane + 32 * j);
            }
#pragma unroll
            for (int k = 0; k < ROWS; k++) {
                float acc = 0.f;
#pragma unroll
                for (int j = 0; j < 5; j++) {
                    const signed char* b = (const signed char*)&q[k][j];
                    const float* xv = xsh + lane + 32 * j;
#pragma unroll
                    for (int t = 0; t < 16; t++) acc += (float)b[t] * xv[t * 160];
                }
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
                if (lane == 0 && r0 + k < R) y[r0 + k] = acc * (1.f / 4096.f);
            }
        }
        if (s < last) {
            if (prefetch) {
                const int R2 = rows[s + 1];
                const signed char* wn = w + off[s + 1];
                for (int r = gwarp; r < R2; r += allwarps) {
                    // 2560 bytes = 20 lines of 128 B.
                    if (lane < 20) asm volatile("prefetch.global.L2 [%0];" :: "l"(wn + (long long)r * 2560 + lane * 128));
                }
            }
            grid_barrier(bar, bar + 1, gridDim.x);
        }
    }
}
"#;

/// One layer's stages (rows of 2560 bytes): the hyper-connection read, the GDN input projections,
/// the output projection, the MoE read, router and shared expert, ten experts' gate/up, their down
/// projections, and small latency stages (norms, top-k) as 64-row stages.
const LAYER: [i32; 11] = [720, 64, 9216, 64, 2560, 720, 64, 1664, 64, 6400, 3200];

fn ptx(arch: &'static str) -> String {
    // Rows each warp loads before computing (CHERENKOV_PROBE_ROWS, default 1).
    let rows = std::env::var("CHERENKOV_PROBE_ROWS").unwrap_or_else(|_| "1".into());
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(arch),
        options: vec!["--std=c++17".into(), format!("-DROWS={rows}")],
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts).unwrap_or_else(|e| panic!("{e:?}")).to_src()
}

/// The probe's kernel compiles (so the measurement does not fail on the GPU machine for a typo).
#[test]
fn probe_kernel_compiles() {
    if !cherenkov_cuda::compile::nvrtc_available() {
        eprintln!("skipped: NVRTC not found");
        return;
    }
    assert!(ptx("sm_90").contains(".entry chain("));
}

#[test]
#[ignore = "a measurement on the GPU machine; see the file's header"]
fn persistent_probe() {
    let gpu = Gpu::new().unwrap();
    let layers = 4;
    let rows: Vec<i32> = (0..layers).flat_map(|_| LAYER).collect();
    let mut off = Vec::new();
    let mut total = 0i64;
    for &r in &rows {
        off.push(total);
        total += r as i64 * 2560;
    }
    let (maj, min) = gpu.info.compute_capability;
    let arch = cherenkov_cuda::compile::arch_name(maj, min).unwrap();
    let cptx = CString::new(ptx(arch)).unwrap();
    gpu.bind().unwrap();
    // SAFETY: a NUL-terminated PTX image; the function name exists in it.
    let f = unsafe {
        let m = cu::module::load_data(cptx.as_ptr() as *const c_void).unwrap();
        cu::module::get_function(m, CString::new("chain").unwrap()).unwrap()
    };
    let w = gpu.alloc(total as usize, "weights").unwrap();
    // Random-ish bytes (the values do not matter, the bytes do).
    let fill: Vec<u8> = (0..total as usize).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
    gpu.htod(w.ptr, &fill).unwrap();
    let offs = gpu.alloc(off.len() * 8, "offsets").unwrap();
    gpu.htod(offs.ptr, &off).unwrap();
    let rws = gpu.alloc(rows.len() * 4, "rows").unwrap();
    gpu.htod(rws.ptr, &rows).unwrap();
    let dim = 16384usize;
    let xs = gpu.zeros(2 * dim * 4, "x").unwrap();
    gpu.htod(xs.ptr, &vec![0.01f32; dim]).unwrap();
    let bar = gpu.zeros(64, "barrier").unwrap();
    let threads = 512u32;
    let shmem = 2560 * 4;
    let mut per_sm = 0i32;
    // SAFETY: f is a loaded kernel.
    unsafe {
        sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut per_sm, f, threads as i32, shmem as usize)
            .result()
            .unwrap();
    }
    let mut sms = 0i32;
    // SAFETY: plain attribute query of device 0.
    unsafe {
        sys::cuDeviceGetAttribute(&mut sms, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, 0)
            .result()
            .unwrap();
    }
    println!(
        "# persistent probe: {layers} layers of {} stages, {:.1} MB per layer, {sms} SMs, {per_sm} blocks of {threads} per SM fit",
        LAYER.len(),
        total as f64 / layers as f64 / 1e6
    );
    let launch_with = |pdl: bool, grid: u32, first: i32, last: i32, prefetch: i32| {
        let args = [
            Arg::Ptr(w.ptr),
            Arg::Ptr(offs.ptr),
            Arg::Ptr(rws.ptr),
            Arg::I32(first),
            Arg::I32(last),
            Arg::Ptr(xs.ptr),
            Arg::I32(dim as i32),
            Arg::Ptr(bar.ptr),
            Arg::I32(prefetch),
        ];
        // SAFETY: the arguments match `chain`'s parameters, which waits for its predecessor at its
        // start; the grid is co-resident when persistent (at most the blocks per SM that fit).
        unsafe { gpu.launch_function(f, "chain", (grid, 1, 1), threads, shmem, &args, pdl) }.unwrap();
    };
    let launch = |grid: u32, first: i32, last: i32, prefetch: i32| launch_with(false, grid, first, last, prefetch);
    let n = rows.len() as i32;
    let time = |run: &dyn Fn()| {
        let mut v: Vec<f32> = (0..7)
            .map(|_| {
                let a = gpu.event(true).unwrap();
                let b = gpu.event(true).unwrap();
                gpu.record(&a).unwrap();
                run();
                gpu.record(&b).unwrap();
                b.wait().unwrap();
                b.since(&a).unwrap()
            })
            .collect();
        v.sort_by(f32::total_cmp);
        v[3] as f64 * 1e3 / layers as f64
    };
    let report = |what: &str, us: f64| {
        println!("{what:64} {us:8.1} us/layer  {:7.0} GB/s", total as f64 / layers as f64 / us / 1e3);
    };
    // Every variant must compute the same chain: the last stage's outputs from the same start,
    // bit for bit (the same arithmetic per row), else its time means nothing.
    let last_rows = rows[rows.len() - 1] as usize;
    let outputs = |run: &dyn Fn()| -> Vec<u32> {
        gpu.htod(xs.ptr, &vec![0.01f32; 2 * dim]).unwrap();
        run();
        gpu.sync().unwrap();
        let mut y = vec![0f32; last_rows];
        gpu.dtoh(xs.ptr + ((n as usize) & 1) as u64 * dim as u64 * 4, &mut y).unwrap();
        y.iter().map(|v| v.to_bits()).collect()
    };
    let want = outputs(&|| (0..n).for_each(|s| launch(sms as u32, s, s, 0)));
    let measure = |what: String, run: &dyn Fn()| {
        let same = outputs(run) == want;
        report(&format!("{what}{}", if same { "" } else { " [OUTPUTS DIFFER]" }), time(run));
    };
    for resident in 1..=per_sm.min(2) {
        let grid = (sms * resident) as u32;
        measure(format!("one launch per stage, grid {grid}"), &|| (0..n).for_each(|s| launch(grid, s, s, 0)));
        measure(format!("one launch per stage with PDL, grid {grid}"), &|| {
            (0..n).for_each(|s| launch_with(true, grid, s, s, 0))
        });
        measure(format!("persistent, grid {grid}"), &|| launch(grid, 0, n - 1, 0));
        measure(format!("persistent + L2 prefetch of the next stage, grid {grid}"), &|| launch(grid, 0, n - 1, 1));
    }
    let big = (rows.iter().map(|&r| r as u32).max().unwrap() * 32).div_ceil(threads);
    measure(format!("one launch per stage, grid {big} (a warp per row)"), &|| {
        (0..n).for_each(|s| launch(big, s, s, 0))
    });
    let bw = cherenkov_cuda::gpu::measure_bandwidth(&gpu, 1 << 30).unwrap();
    println!("device copy bandwidth (read + write): {:.0} GB/s", bw.device / 1e9);
}
