//! What the GPU probes beside this folder share (`cluster_probe`, `stage_probe`,
//! `dataflow_probe`, `matvec_probe`, `rows_probe`): compiling a probe's CUDA source with NVRTC,
//! loading its kernels, timing a captured graph, 4-bit matrices in copies that pass the L2.

// Each probe is its own test crate and uses some of these.
#![allow(dead_code)]

use std::ffi::{CString, c_void};

use cherenkov_cuda::gpu::{DevBuf, Gpu, Graph};
use cudarc::driver::result as cu;
use cudarc::driver::sys;

/// Device helpers every probe's source may call, compiled ahead of it: `dep_start()` (let the next
/// launch be scheduled, then wait for the previous one: programmatic dependent launch), and a
/// thread block cluster's rank, size and barrier halves.
const DEVICE: &str = r#"
__device__ __forceinline__ void dep_start() {
    asm volatile("griddepcontrol.launch_dependents;");
    asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ unsigned cluster_size() {
    unsigned n;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
    return n;
}
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
"#;

/// `source`, after [`DEVICE`], compiled to PTX for `arch` (C++17), or a panic with NVRTC's log.
pub fn ptx(source: &str, arch: &'static str) -> String {
    let opts =
        cudarc::nvrtc::CompileOptions { arch: Some(arch), options: vec!["--std=c++17".into()], ..Default::default() };
    cudarc::nvrtc::compile_ptx_with_opts(format!("{DEVICE}{source}"), opts).unwrap_or_else(|e| panic!("{e:?}")).to_src()
}

/// The PTX of `source` for sm_90, after checking that it defines every kernel in `kernels` (so
/// that a measurement does not fail on the GPU machine for a typo); None, said on stderr, where
/// NVRTC is not installed.
pub fn compiled(source: &str, kernels: &[&str]) -> Option<String> {
    if !cherenkov_cuda::compile::nvrtc_available() {
        eprintln!("skipped: NVRTC not found");
        return None;
    }
    let p = ptx(source, "sm_90");
    for k in kernels {
        assert!(p.contains(&format!(".entry {k}(")), "{k} is missing");
    }
    Some(p)
}

/// Compiles `source` for this GPU, binds its context to this thread, loads the module and returns
/// the functions named in `names`, in order.
pub fn load(gpu: &Gpu, source: &str, names: &[&str]) -> Vec<sys::CUfunction> {
    let (maj, min) = gpu.info.compute_capability;
    let arch = cherenkov_cuda::compile::arch_name(maj, min).unwrap();
    let image = CString::new(ptx(source, arch)).unwrap();
    gpu.bind().unwrap();
    // SAFETY: a NUL-terminated PTX image; every name is checked by the driver (an error, not UB).
    unsafe {
        let m = cu::module::load_data(image.as_ptr() as *const c_void).unwrap();
        names.iter().map(|k| cu::module::get_function(m, CString::new(*k).unwrap()).unwrap()).collect()
    }
}

/// Launches `f` (a `grid` of `block` threads, no dynamic shared memory) with programmatic
/// dependent launch and, where `cluster` > 1, in clusters of that many blocks.
///
/// # Safety
/// As `Gpu::launch_function_clustered`.
pub unsafe fn launch(
    gpu: &Gpu,
    f: sys::CUfunction,
    grid: u32,
    block: u32,
    cluster: u32,
    args: &[cherenkov_cuda::gpu::Arg],
) -> anyhow::Result<()> {
    // SAFETY: the caller's contract.
    unsafe { gpu.launch_function_clustered(f, "probe kernel", (grid, 1, 1), block, 0, args, true, cluster) }
}

/// Lets `f` be launched in clusters larger than 8 blocks (16 on the H200: non-portable sizes).
pub fn allow_large_clusters(f: sys::CUfunction) {
    // SAFETY: a plain attribute of a loaded kernel.
    unsafe {
        sys::cuFuncSetAttribute(f, sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
            .result()
            .unwrap();
    }
}

/// The median of 7 replays of `graph`, timed by events around each, in microseconds per `per`
/// (the graph's launches or reads).
pub fn median_us(gpu: &Gpu, graph: &Graph, per: usize) -> f64 {
    let mut t: Vec<f32> = (0..7)
        .map(|_| {
            let a = gpu.event(true).unwrap();
            let b = gpu.event(true).unwrap();
            gpu.record(&a).unwrap();
            gpu.replay(graph).unwrap();
            gpu.record(&b).unwrap();
            b.wait().unwrap();
            b.since(&a).unwrap()
        })
        .collect();
    t.sort_by(f32::total_cmp);
    t[3] as f64 * 1e3 / per as f64
}

/// The group size of the probes' 4-bit matrices.
pub const GS: usize = 64;
/// Launches per graph and replays timed ([`time`]).
pub const LAUNCHES: usize = 48;
pub const REPLAYS: usize = 10;
/// Bytes the weight copies of one matrix take together at least (the H200's L2 is 60 MiB).
pub const ROTATE_BYTES: usize = 240 << 20;

/// A 4-bit matrix (words, bf16 scales and biases) in `copies` copies, one allocation each.
pub struct Mat {
    pub rows: usize,
    pub cols: usize,
    pub copies: Vec<(DevBuf, DevBuf, DevBuf)>,
}

impl Mat {
    pub fn new(gpu: &Gpu, rows: usize, cols: usize) -> Mat {
        let words = rows * cols / 8;
        let groups = rows * cols / GS;
        let bytes = words * 4 + groups * 4;
        let n = ROTATE_BYTES.div_ceil(bytes).max(2);
        let mut seed = 0x2545_f491_4f6c_dd1du64 ^ (rows * cols) as u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let copies = (0..n)
            .map(|_| {
                let w: Vec<u32> = (0..words).map(|_| next() as u32).collect();
                // Scales about 1e-2, biases about -1e-1 (bf16), so sums stay finite.
                let s: Vec<u16> = (0..groups).map(|_| 0x3c20 + (next() & 0xf) as u16).collect();
                let b: Vec<u16> = (0..groups).map(|_| 0xbdc0 + (next() & 0xf) as u16).collect();
                let (dw, ds, db) = (
                    gpu.alloc(w.len() * 4, "probe words").unwrap(),
                    gpu.alloc(s.len() * 2, "probe scales").unwrap(),
                    gpu.alloc(b.len() * 2, "probe biases").unwrap(),
                );
                gpu.htod(dw.ptr, &w).unwrap();
                gpu.htod(ds.ptr, &s).unwrap();
                gpu.htod(db.ptr, &b).unwrap();
                (dw, ds, db)
            })
            .collect();
        Mat { rows, cols, copies }
    }

    pub fn bytes(&self) -> usize {
        self.rows * self.cols / 2 + self.rows * self.cols / GS * 4
    }

    pub fn copy(&self, i: usize) -> (u64, u64, u64) {
        let (w, s, b) = &self.copies[i % self.copies.len()];
        (w.ptr, s.ptr, b.ptr)
    }
}

/// Microseconds per launch of `queue(i)` (launch i of a graph of `LAUNCHES`), replayed from a graph.
pub fn time(gpu: &Gpu, mut queue: impl FnMut(usize)) -> f64 {
    let graph = gpu
        .capture(|| {
            for i in 0..LAUNCHES {
                queue(i);
            }
            Ok(())
        })
        .unwrap();
    gpu.replay(&graph).unwrap();
    gpu.sync().unwrap();
    let (start, end) = (gpu.event(true).unwrap(), gpu.event(true).unwrap());
    gpu.record(&start).unwrap();
    for _ in 0..REPLAYS {
        gpu.replay(&graph).unwrap();
    }
    gpu.record(&end).unwrap();
    end.wait().unwrap();
    end.since(&start).unwrap() as f64 * 1e3 / (LAUNCHES * REPLAYS) as f64
}

/// The decoder's 4-bit matrices the rows probes time (name, rows, cols): the GDN in_proj's qkv and
/// z, the out_proj (GDN and attention), the MTP head's fc_hidden, a routed expert's gate and up
/// (2 x 640 rows) and its down.
pub const ROW_SHAPES: [(&str, usize, usize); 5] = [
    ("GDN in_proj qkv+z 16384x2560", 16384, 2560),
    ("out_proj 2560x6144", 2560, 6144),
    ("fc_hidden 2560x2560", 2560, 2560),
    ("expert gate+up 1280x2560", 1280, 2560),
    ("expert down 2560x640", 2560, 640),
];

/// Queues the engine's tiled 4-bit matvec over copy `i` of `m`: `nx` input rows of x (`cols`
/// floats apart) into `nx` output rows of y (`rows` apart), with `lanes` lanes a tile over `blocks`
/// blocks of `threads`: `matvec_q4` (`MV_TILED | lanes`) for one row, `matvec_q4_x{nx}` for 2 or 4.
#[allow(clippy::too_many_arguments)]
pub fn engine_q4(gpu: &Gpu, nx: usize, m: &Mat, i: usize, x: u64, y: u64, lanes: usize, blocks: usize, threads: usize) {
    use cherenkov_cuda::gpu::Arg;
    use cherenkov_cuda::weights::{MV_TILED, rows_staging_bytes, tiled_shmem};
    let (w, s, b) = m.copy(i);
    let head = [
        Arg::Ptr(w),
        Arg::Ptr(s),
        Arg::Ptr(b),
        Arg::Ptr(x),
        Arg::Ptr(y),
        Arg::I32(m.rows as i32),
        Arg::I32(m.cols as i32),
        Arg::I32(GS as i32),
    ];
    let grid = (blocks as u32, 1, 1);
    let (name, shmem, tail) = if nx == 1 {
        let tail = vec![
            Arg::I32((MV_TILED | lanes) as i32),
            Arg::Ptr(0),
            Arg::F32(0.0),
            Arg::I32(0),
            Arg::Ptr(0),
            Arg::Ptr(0),
            Arg::I32(0),
        ];
        ("matvec_q4".to_string(), tiled_shmem(4, GS, m.cols).expect("a tiled shape"), tail)
    } else {
        let tail = vec![
            Arg::I32(lanes as i32),
            Arg::U64(m.cols as u64),
            Arg::U64(m.rows as u64),
            Arg::Ptr(0),
            Arg::Ptr(0),
            Arg::I32(0),
            Arg::U64(0),
            Arg::U64(0),
        ];
        (format!("matvec_q4_x{nx}"), nx * rows_staging_bytes(m.cols), tail)
    };
    gpu.launch(&name, grid, threads as u32, shmem as u32, &[&head[..], &tail[..]].concat()).unwrap();
}
