//! What does a 4-bit matvec cost for two or three input rows against one? The question behind
//! speculative decoding on the GPU: a verifying forward runs the drafted token through the trunk
//! with the token before it, and pays only if each weight chunk, loaded once, serves both rows for
//! little more than one row costs (ignored by default; needs a GPU):
//!
//!     cargo test --release -p cherenkov-cuda --test rows_probe --no-run   # prints the binary
//!     <binary> --ignored --nocapture        (on the GPU machine, with NVRTC on LD_LIBRARY_PATH)
//!
//! `rows_mv<NX>` is the engine's tiled dp4a core (linear.cu's mv_core: MV_PLAIN tiles of 4 rows, L
//! lanes a tile, each step's chunk loaded before the previous step's arithmetic, x staged as
//! digits) with NX staged inputs and NX sets of sums: the weights are loaded once, the staging and
//! the dp4a products happen NX times. It is built here from linear.cu's own helpers (mv_load,
//! mvd_stage, mvd_step), so it is that core's arithmetic, not a model of it; the engine does not
//! launch it. Each row's output is checked bit for bit against NX = 1 on that row alone, and NX = 1
//! against the engine's `matvec_q4`. Timings are graphs of 48 launches with PDL over copies of the
//! weights that pass four times the L2 (every launch reads memory), as in matvec_probe.rs. With
//! `CHERENKOV_KERNEL_DEFINES=MV_PROBE_NO_MATH` or `MV_PROBE_NO_STAGE` (linear.cu's measurement
//! variants: the products or the staging of x left out, wrong results, so the checks are skipped)
//! it says which part the extra rows cost.

mod probe;

use std::ffi::{CString, c_void};

use cherenkov_cuda::gpu::{Arg, Gpu};
use cudarc::driver::result as cu;
use probe::{GS, LAUNCHES, Mat, REPLAYS, time};

const PROBE: &str = r#"
template <int NX>
__device__ __forceinline__ void rows_mv_core(const u32* __restrict__ W, const u16* __restrict__ S,
                                             const u16* __restrict__ B, const float* __restrict__ x, float* y,
                                             int rows, int cols, int gs, int L) {
    typedef MvFmt<4> F;
    extern __shared__ float4 mv_smem[];
    const int C = cols / F::CPC, gpr = cols / gs, gshift = __ffs(gs) - 1;
    const MvMat a{(const uint4*)W, S, B};
    const int chunks = cols >> 5;
    const int X4 = chunks * MVD_CHUNK + ((chunks + 1) >> 1);  // float4s of one staged input
    const int lshift = __ffs(L) - 1;
    const int nit = (C + L - 1) >> lshift;
    const int ntiles = (rows + MV_R - 1) / MV_R;
    const int t = threadIdx.x;
    const int unit = blockIdx.x * (blockDim.x >> 5) + (t >> 5), nunits = gridDim.x * (blockDim.x >> 5);
    const int tpu = 32 >> lshift, tin = t & 31;
    const int sub = tin >> lshift, lt = tin & (L - 1);
    int pass = unit, it = 0;
    bool more = pass * tpu < ntiles;
    uint4 wc[MV_R];
    u32 sbc[MV_R * F::NSUB];
    {
        const int tile = pass * tpu + sub, c = lt;
        mv_load<4, MV_PLAIN>(a, a, tile, c, more && tile < ntiles && c < C, rows, C, gpr, gshift, wc, sbc);
    }
    grid_enter();
#pragma unroll
    for (int r = 0; r < NX; r++) mvd_stage(x + (size_t)r * cols, MV_IN_NONE, mv_smem + r * X4, cols, nullptr);
    float tot[NX][MV_R];
#pragma unroll
    for (int r = 0; r < NX; r++)
#pragma unroll
        for (int i = 0; i < MV_R; i++) tot[r][i] = 0.0f;
    while (more) {
        const int tile = pass * tpu + sub, c = (it << lshift) + lt;
        int pass2 = pass, it2 = it + 1;
        if (it2 == nit) {
            it2 = 0;
            pass2 += nunits;
        }
        const bool more2 = pass2 * tpu < ntiles;
        uint4 wn[MV_R];
        u32 sbn[MV_R * F::NSUB];
        {
            const int tile2 = pass2 * tpu + sub, c2 = (it2 << lshift) + lt;
            mv_load<4, MV_PLAIN>(a, a, tile2, c2, more2 && tile2 < ntiles && c2 < C, rows, C, gpr, gshift, wn, sbn);
        }
        if (tile < ntiles && c < C) {
#pragma unroll
            for (int r = 0; r < NX; r++) mvd_step(wc, sbc, mv_smem + r * X4, chunks, c, tot[r]);
        }
        if (it == nit - 1) {
#pragma unroll
            for (int r = 0; r < NX; r++) {
#pragma unroll
                for (int i = 0; i < MV_R; i++) {
                    for (int o = L >> 1; o > 0; o >>= 1) tot[r][i] += __shfl_xor_sync(0xffffffffu, tot[r][i], o);
                }
                if (lt == 0 && tile < ntiles) {
#pragma unroll
                    for (int i = 0; i < MV_R; i++) {
                        if (tile * MV_R + i < rows) y[(size_t)r * rows + tile * MV_R + i] = tot[r][i];
                    }
                }
#pragma unroll
                for (int i = 0; i < MV_R; i++) tot[r][i] = 0.0f;
            }
        }
#pragma unroll
        for (int i = 0; i < MV_R; i++) wc[i] = wn[i];
#pragma unroll
        for (int i = 0; i < MV_R * F::NSUB; i++) sbc[i] = sbn[i];
        pass = pass2;
        it = it2;
        more = more2;
    }
}

#define ROWS_MV(NX, MINB)                                                                                      \
    extern "C" __global__ void __launch_bounds__(256, MINB)                                                   \
        rows_mv##NX(const u32* W, const u16* S, const u16* B, const float* x, float* y, int rows, int cols,    \
                    int gs, int L) {                                                                           \
        rows_mv_core<NX>(W, S, B, x, y, rows, cols, gs, L);                                                    \
    }
ROWS_MV(1, 3)
ROWS_MV(2, 2)
ROWS_MV(3, 2)
"#;

/// linear.cu's `MV_TILED`.
const MV_TILED: i32 = 0x10000;

/// Measurement variants asked for (`CHERENKOV_KERNEL_DEFINES`, which the engine's compiler reads).
fn variant() -> Option<String> {
    std::env::var("CHERENKOV_KERNEL_DEFINES").ok().filter(|d| !d.trim().is_empty())
}

fn ptx(arch: &'static str) -> String {
    cherenkov_cuda::compile::compile_with_extra(arch, PROBE).unwrap_or_else(|e| panic!("{e:#}"))
}

/// The probe's kernels compile with the engine's source (so the measurement does not fail on the
/// GPU machine for a typo).
#[test]
fn rows_probe_kernels_compile() {
    if !cherenkov_cuda::compile::nvrtc_available() {
        eprintln!("skipped: NVRTC not found");
        return;
    }
    let p = ptx("sm_90");
    for k in ["rows_mv1", "rows_mv2", "rows_mv3"] {
        assert!(p.contains(&format!(".entry {k}(")), "{k}");
    }
    // With ptxas (CHERENKOV_PTXAS, as tests/compile.rs): a spill would make the timings wrong.
    let Some(ptxas) = std::env::var_os("CHERENKOV_PTXAS").map(std::path::PathBuf::from).filter(|p| p.is_file()) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (src, out) = (dir.path().join("probe.ptx"), dir.path().join("probe.cubin"));
    std::fs::write(&src, p).unwrap();
    let run = std::process::Command::new(&ptxas)
        .args(["-arch=sm_90", "-v", "-e", "rows_mv1", "-e", "rows_mv2", "-e", "rows_mv3", "-o"])
        .arg(&out)
        .arg(&src)
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "ptxas failed:\n{report}");
    let mut kernel = String::new();
    let mut reported = 0;
    for line in report.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            kernel = rest.split('\'').next().unwrap_or("?").to_string();
        } else if kernel.starts_with("rows_mv") && (line.contains("spill stores") || line.contains("registers")) {
            eprintln!("{kernel}: {}", line.trim());
            if line.contains("spill stores") {
                assert!(line.contains(" 0 bytes spill stores"), "{kernel} spills: {line}");
                reported += 1;
            }
        }
    }
    assert_eq!(reported, 3, "ptxas's report:\n{report}");
}

/// Shared memory of one staged input (weights.rs's `tiled_shmem` for 4 bits).
fn shmem(cols: usize) -> usize {
    let chunks = cols / 32;
    (chunks * 7 + chunks.div_ceil(2)) * 16
}

#[test]
#[ignore = "a measurement on the GPU machine; see the file's header"]
fn rows_probe() {
    let gpu = Gpu::new().unwrap();
    let (maj, min) = gpu.info.compute_capability;
    let arch = cherenkov_cuda::compile::arch_name(maj, min).unwrap();
    let cptx = CString::new(ptx(arch)).unwrap();
    gpu.bind().unwrap();
    // SAFETY: a NUL-terminated PTX image holding the probe's kernels.
    let module = unsafe { cu::module::load_data(cptx.as_ptr() as *const c_void).unwrap() };
    let f = |name: &str| {
        // SAFETY: the module is loaded and holds `name`.
        let func = unsafe { cu::module::get_function(module, CString::new(name).unwrap()).unwrap() };
        // Up to three staged inputs of 6144 columns: above the default 48 KiB.
        // SAFETY: setting an attribute of a loaded function.
        unsafe {
            cu::function::set_function_attribute(
                func,
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                3 * shmem(6144) as i32,
            )
            .unwrap()
        };
        func
    };
    let kernels = [f("rows_mv1"), f("rows_mv2"), f("rows_mv3")];
    let x = gpu.zeros(3 * 6144 * 4, "probe x").unwrap();
    let xv: Vec<f32> =
        (0..3 * 6144).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0 + (i / 6144) as f32 * 0.01).collect();
    gpu.htod(x.ptr, &xv).unwrap();
    let y = gpu.zeros(3 * 16384 * 4, "probe y").unwrap();
    let y1 = gpu.zeros(16384 * 4, "probe y, one row").unwrap();
    println!(
        "# rows probe on {}: us per launch, graphs of {LAUNCHES} launches with PDL, {REPLAYS} replays",
        gpu.info.name
    );

    let launch = |nx: usize, m: &Mat, i: usize, xp: u64, yp: u64, lanes: usize, blocks: usize| {
        let (w, s, b) = m.copy(i);
        let args = [
            Arg::Ptr(w),
            Arg::Ptr(s),
            Arg::Ptr(b),
            Arg::Ptr(xp),
            Arg::Ptr(yp),
            Arg::I32(m.rows as i32),
            Arg::I32(m.cols as i32),
            Arg::I32(GS as i32),
            Arg::I32(lanes as i32),
        ];
        let smem = (nx * shmem(m.cols)) as u32;
        // SAFETY: rows_mvNX(W, S, B, x, y, rows, cols, gs, L) over a copy of m, x holding nx rows.
        unsafe { gpu.launch_function(kernels[nx - 1], "rows_mv", (blocks as u32, 1, 1), 256, smem, &args, true) }
            .unwrap();
    };

    // The decoder's large 4-bit projections (rows x cols): the GDN in_proj's qkv and z, the
    // out_proj (GDN and attention), a routed expert's gate and up (2 x 640 rows) and its down.
    let shapes = [
        ("GDN in_proj qkv+z 16384x2560", 16384usize, 2560usize),
        ("out_proj 2560x6144", 2560, 6144),
        ("expert gate+up 1280x2560", 1280, 2560),
        ("expert down 2560x640", 2560, 640),
    ];
    for (name, rows, cols) in shapes {
        let m = Mat::new(&gpu, rows, cols);
        println!("\n## {name}: {} copies of {:.2} MB", m.copies.len(), m.bytes() as f64 / 1e6);
        // Correctness: each row of NX = 2, 3 equals NX = 1 on that row alone, bit for bit; NX = 1
        // equals the engine's matvec_q4.
        let (lanes0, blocks0) = (16usize, (rows / 4).div_ceil(256 / 16));
        let checked = if variant().is_none() { 3 } else { 0 };
        if let Some(v) = variant() {
            println!("(a measurement variant, {v}: results not checked)");
        }
        for r in 0..checked {
            launch(1, &m, 0, x.ptr + (r * cols * 4) as u64, y1.ptr, lanes0, blocks0);
            gpu.sync().unwrap();
            let mut one = vec![0f32; rows];
            gpu.dtoh(y1.ptr, &mut one).unwrap();
            for nx in (r + 1).max(2)..=3 {
                launch(nx, &m, 0, x.ptr, y.ptr, lanes0, blocks0);
                gpu.sync().unwrap();
                let mut many = vec![0f32; nx * rows];
                gpu.dtoh(y.ptr, &mut many).unwrap();
                assert!(
                    many[r * rows..(r + 1) * rows].iter().zip(&one).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{name}: row {r} of {nx} differs from the row alone"
                );
            }
            if r == 0 {
                let (w, s, b) = m.copy(0);
                let args = [
                    Arg::Ptr(w),
                    Arg::Ptr(s),
                    Arg::Ptr(b),
                    Arg::Ptr(x.ptr),
                    Arg::Ptr(y.ptr),
                    Arg::I32(rows as i32),
                    Arg::I32(cols as i32),
                    Arg::I32(GS as i32),
                    Arg::I32(MV_TILED | lanes0 as i32),
                    Arg::Ptr(0),
                    Arg::F32(0.0),
                    Arg::I32(0),
                    Arg::Ptr(0),
                    Arg::Ptr(0),
                    Arg::I32(0),
                ];
                gpu.launch("matvec_q4", (blocks0 as u32, 1, 1), 256, shmem(cols) as u32, &args).unwrap();
                gpu.sync().unwrap();
                let mut engine = vec![0f32; rows];
                gpu.dtoh(y.ptr, &mut engine).unwrap();
                let worst = engine.iter().zip(&one).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                let scale = engine.iter().fold(0f32, |m, v| m.max(v.abs()));
                assert!(worst <= 1e-5 * scale.max(1.0), "{name}: rows_mv1 against matvec_q4: {worst} (scale {scale})");
            }
        }
        let chunks = cols / 32;
        let mut best = [f64::INFINITY; 3];
        for lanes in [8usize, 16, 32] {
            if lanes > chunks.next_power_of_two() {
                continue;
            }
            let needed = (rows / 4).div_ceil(256 / lanes);
            let mut blocks = vec![needed, needed.min(396), needed.min(264), needed.min(132)];
            blocks.dedup();
            for nb in blocks {
                let mut line = format!("lanes {lanes:2}, {nb:4} blocks:");
                for nx in 1..=3 {
                    let us = time(&gpu, |i| launch(nx, &m, i, x.ptr, y.ptr, lanes, nb));
                    best[nx - 1] = best[nx - 1].min(us);
                    line += &format!("  {nx} row(s) {us:7.2} us");
                }
                println!("{line}");
            }
        }
        println!(
            "best: 1 row {:.2} us ({:.0} GB/s), 2 rows {:.2} us ({:.2}x), 3 rows {:.2} us ({:.2}x)",
            best[0],
            m.bytes() as f64 / (best[0] * 1e-6) / 1e9,
            best[1],
            best[1] / best[0],
            best[2],
            best[2] / best[0]
        );
    }
}
