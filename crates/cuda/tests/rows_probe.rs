//! What does a 4-bit matvec cost for two or four input rows against one? The question behind
//! speculative decoding on the GPU: a verifying forward runs the drafted token through the trunk
//! with the token before it, and pays only if each weight chunk, loaded once, serves both rows for
//! little more than one row costs (ignored by default; needs a GPU):
//!
//!     cargo test --release -p cherenkov-cuda --test rows_probe --no-run   # prints the binary
//!     <binary> --ignored --nocapture        (on the GPU machine, with NVRTC on LD_LIBRARY_PATH)
//!
//! It times the engine's own kernels: `matvec_q4` (the tiled dp4a core, `MV_TILED | L`) for one
//! row, and `matvec_q4_x2`, `matvec_q4_x4` (the same core with NX staged inputs and NX sets of
//! sums: the weights loaded once, the staging and the dp4a products NX times) for two and four.
//! Each row of those equals `matvec_q4` on that row alone, bit for bit (asserted here, and
//! `gpu-check`'s rows check it too). Timings are graphs of 48 launches with PDL over copies of the
//! weights that pass four times the L2 (every launch reads memory), as in matvec_probe.rs, for
//! lanes a tile from 8 to 128 and several grids, and for the plans the engine would pick
//! (`weights::tile_plan`: 3 blocks a multiprocessor for one row, 2 for several,
//! `DevLinear::rows_plan`). With `CHERENKOV_KERNEL_DEFINES=MV_PROBE_NO_MATH` or
//! `MV_PROBE_NO_STAGE` (linear.cu's measurement variants: the products or the staging of x left
//! out, wrong results, so the checks are skipped) it says which part the extra rows cost.
//! (Session 44's version timed a copy of the core built in this file; session 48 gave the engine
//! the core over several rows and this probe now launches it.)

mod probe;

use cherenkov_cuda::gpu::Gpu;
use cherenkov_cuda::weights::{rows_staging_bytes, tile_plan, tiled_shmem};
use probe::{GS, Mat, time};

/// [`probe::engine_q4`] with blocks of 256 threads (a plan of fewer is launched with 256).
#[allow(clippy::too_many_arguments)]
fn engine(gpu: &Gpu, nx: usize, m: &Mat, i: usize, x: u64, y: u64, lanes: usize, blocks: usize) {
    probe::engine_q4(gpu, nx, m, i, x, y, lanes, blocks, 256);
}

/// Measurement variants asked for (`CHERENKOV_KERNEL_DEFINES`, which the engine's compiler reads).
fn variant() -> Option<String> {
    std::env::var("CHERENKOV_KERNEL_DEFINES").ok().filter(|d| !d.trim().is_empty())
}

#[test]
#[ignore = "a measurement on the GPU machine; see the file's header"]
fn rows_probe() {
    let gpu = Gpu::new().unwrap();
    gpu.bind().unwrap();
    const ROWS: [usize; 3] = [1, 2, 4];
    let x = gpu.zeros(4 * 6144 * 4, "probe x").unwrap();
    let xv: Vec<f32> =
        (0..4 * 6144).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0 + (i / 6144) as f32 * 0.01).collect();
    gpu.htod(x.ptr, &xv).unwrap();
    let y = gpu.zeros(4 * 16384 * 4, "probe y").unwrap();
    let y1 = gpu.zeros(16384 * 4, "probe y, one row").unwrap();
    println!(
        "# rows probe on {}: us per launch, graphs of {} launches with PDL, {} replays",
        gpu.info.name,
        probe::LAUNCHES,
        probe::REPLAYS
    );
    if let Some(v) = variant() {
        println!("(a measurement variant, {v}: results not checked)");
    }
    // The decoder's large 4-bit projections.
    let shapes = probe::ROW_SHAPES;
    for (name, rows, cols) in shapes {
        let m = Mat::new(&gpu, rows, cols);
        println!("\n## {name}: {} copies of {:.2} MB", m.copies.len(), m.bytes() as f64 / 1e6);
        let chunks = cols / 32;
        let lanes_all: Vec<usize> =
            [8usize, 16, 32, 64, 128].into_iter().filter(|&l| l <= chunks.next_power_of_two()).collect();
        // Correctness: each row of 2 and 4 equals the row alone through matvec_q4, bit for bit.
        if variant().is_none() {
            for &lanes in &lanes_all {
                let blocks = (rows / 4).div_ceil(256 / lanes);
                for r in 0..4 {
                    engine(&gpu, 1, &m, 0, x.ptr + (r * cols * 4) as u64, y1.ptr, lanes, blocks);
                    gpu.sync().unwrap();
                    let mut one = vec![0f32; rows];
                    gpu.dtoh(y1.ptr, &mut one).unwrap();
                    for nx in [2usize, 4].into_iter().filter(|&n| n > r) {
                        engine(&gpu, nx, &m, 0, x.ptr, y.ptr, lanes, blocks);
                        gpu.sync().unwrap();
                        let mut many = vec![0f32; nx * rows];
                        gpu.dtoh(y.ptr, &mut many).unwrap();
                        assert!(
                            many[r * rows..(r + 1) * rows].iter().zip(&one).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{name}: row {r} of {nx} with {lanes} lanes differs from the row alone"
                        );
                    }
                }
            }
        }
        let mut best = [f64::INFINITY; 3];
        for &lanes in &lanes_all {
            let needed = (rows / 4).div_ceil(256 / lanes);
            let mut blocks = vec![needed, needed.min(396), needed.min(264), needed.min(132)];
            blocks.dedup();
            for nb in blocks {
                let mut line = format!("lanes {lanes:3}, {nb:4} blocks:");
                for (k, &nx) in ROWS.iter().enumerate() {
                    let us = time(&gpu, |i| engine(&gpu, nx, &m, i, x.ptr, y.ptr, lanes, nb));
                    best[k] = best[k].min(us);
                    line += &format!("  {nx} row(s) {us:7.2} us");
                }
                println!("{line}");
            }
        }
        // The plans the engine picks: matvec_q4's for one row, DevLinear::rows_plan's for more.
        let mut planned = "engine's plans:".to_string();
        let mut one_row = 0.0;
        for (k, &nx) in ROWS.iter().enumerate() {
            let (min_blocks, shmem) =
                if nx == 1 { (3, tiled_shmem(4, GS, cols).unwrap()) } else { (2, nx * rows_staging_bytes(cols)) };
            let p = tile_plan(&gpu, rows.div_ceil(4), chunks, 1, min_blocks, shmem);
            // (The launches above use 256 threads a block; a plan of fewer is timed with 256.)
            let us = time(&gpu, |i| engine(&gpu, nx, &m, i, x.ptr, y.ptr, p.lanes, p.blocks));
            if k == 0 {
                one_row = us;
            }
            planned +=
                &format!("  {nx} row(s) {us:.2} us ({:.2}x; lanes {}, {} blocks)", us / one_row, p.lanes, p.blocks);
        }
        println!("{planned}");
        println!(
            "best: 1 row {:.2} us ({:.0} GB/s), 2 rows {:.2} us ({:.2}x), 4 rows {:.2} us ({:.2}x)",
            best[0],
            m.bytes() as f64 / (best[0] * 1e-6) / 1e9,
            best[1],
            best[1] / best[0],
            best[2],
            best[2] / best[0]
        );
    }
}
