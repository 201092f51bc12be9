//! How long does the CPU take to compute one routed expert for one token? A measurement for the
//! issue's "cold experts on the CPU" (ignored by default):
//!
//!     cargo test --release -p cherenkov-cpu --test expert_probe -- --ignored --nocapture
//!
//! With `CHERENKOV_PROBE_STORE=<store dir>` it takes records of the store's first MoE layer;
//! without, 16 random 4-bit experts of the released shape (intermediate 640, hidden 2560, groups
//! of 64). It times, per expert (median over several passes over the records, so they come from
//! memory, not the caches): the CPU backend's batch kernels (rayon over rows, all cores); the
//! single-token kernels of `cherenkov_cpu::expert` on one thread (4-bit rows by `cherenkov_cpu::q4`:
//! AVX-512 VNNI where the CPU has it, `CHERENKOV_CPU_NO_VNNI=1` for the float kernel); and `ExpertTeam`s of 4, 8 and
//! `CHERENKOV_PROBE_THREADS` threads (default: every core but two) with one and two experts per
//! job, as the GPU backend submits them, and with one record over and over (cached).

use std::time::{Duration, Instant};

use cherenkov_cpu::expert::ExpertMatrices;
use cherenkov_cpu::linear::Linear;
use cherenkov_cpu::ops::silu;
use cherenkov_cpu::team::{ExpertTeam, JobExpert};
use cherenkov_model::quant::{Affine, quantize_matrix, u16s_to_le_bytes, u32s_to_le_bytes};
use cherenkov_model::store::{ExpertLayout, Precision, RecordMatrix, Span, Store};

fn median(mut t: Vec<f64>) -> (f64, f64) {
    t.sort_by(f64::total_cmp);
    (t[t.len() / 2], t[0])
}

/// Random records of the released expert shape, and their layout.
fn random_records(n: usize) -> (Vec<Vec<u8>>, ExpertLayout) {
    let (i, h, fmt) = (640, 2560, Affine::new(4, 64));
    let mut at = 0u64;
    let mut span = |len: usize| {
        let s = Span { offset: at, len: len as u64 };
        at += len as u64;
        s
    };
    let mut matrix = |rows: usize, cols: usize| RecordMatrix {
        shape: [rows, cols],
        precision: Precision::Affine { bits: 4, group_size: 64 },
        data: span(rows * fmt.words_per_row(cols) * 4),
        scales: Some(span(rows * fmt.groups_per_row(cols) * 2)),
        biases: Some(span(rows * fmt.groups_per_row(cols) * 2)),
    };
    let layout = ExpertLayout {
        layer: "layers.0".into(),
        gate_proj: matrix(i, h),
        up_proj: matrix(i, h),
        down_proj: matrix(h, i),
    };
    let mut seed = 1u64;
    let records = (0..n)
        .map(|_| {
            let mut rec = Vec::new();
            for m in [&layout.gate_proj, &layout.up_proj, &layout.down_proj] {
                let bf: Vec<u16> = (0..m.shape[0] * m.shape[1])
                    .map(|_| {
                        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        cherenkov_model::dtype::f32_to_bf16(((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.1)
                    })
                    .collect();
                let q = quantize_matrix(&bf, m.shape[0], m.shape[1], fmt);
                rec.extend(u32s_to_le_bytes(&q.words));
                rec.extend(u16s_to_le_bytes(&q.scales));
                rec.extend(u16s_to_le_bytes(&q.biases));
            }
            rec
        })
        .collect();
    (records, layout)
}

#[test]
#[ignore = "a measurement: run by hand"]
fn cpu_expert_probe() {
    let (records, layout) = match std::env::var("CHERENKOV_PROBE_STORE") {
        Ok(dir) => {
            let store = Store::open(std::path::Path::new(&dir)).unwrap();
            let layout = store.manifest.experts.layers[0].clone();
            let n = store.manifest.experts.num_experts.min(32);
            let records = (0..n)
                .map(|e| {
                    let mut b = vec![0u8; store.record_bytes()];
                    store.read_expert(0, e, &mut b).unwrap();
                    b
                })
                .collect();
            (records, layout)
        }
        Err(_) => random_records(16),
    };
    let n = records.len();
    let bytes = records[0].len();
    let mats: Vec<ExpertMatrices> = records.iter().map(|r| ExpertMatrices::from_record(r, &layout).unwrap()).collect();
    let h = mats[0].hidden();
    let x: Vec<f32> = (0..h).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
    let ms = |t: Instant| t.elapsed().as_secs_f64() * 1e3;

    // The CPU backend's batch kernels.
    let mut times = Vec::new();
    for rep in 0..(4 * n) {
        let rec = &records[rep % n];
        let t = Instant::now();
        let gate = Linear::from_record(rec, &layout.gate_proj).unwrap();
        let up = Linear::from_record(rec, &layout.up_proj).unwrap();
        let down = Linear::from_record(rec, &layout.down_proj).unwrap();
        let (mut g, mut u) = (vec![0f32; gate.rows()], vec![0f32; up.rows()]);
        gate.forward(&x, &mut g);
        up.forward(&x, &mut u);
        for (a, b) in g.iter_mut().zip(&u) {
            *a = silu(*a) * b;
        }
        let mut y = vec![0f32; down.rows()];
        down.forward(&g, &mut y);
        std::hint::black_box(&y);
        if rep >= n {
            times.push(ms(t));
        }
    }
    let (m, b) = median(times);
    println!(
        "batch kernels ({} rayon threads): median {m:.3} ms, best {b:.3} ms per expert of {bytes} bytes ({n} records)",
        rayon::current_num_threads()
    );

    // Single-token kernels, one thread.
    let mut times = Vec::new();
    for rep in 0..(2 * n) {
        let t = Instant::now();
        std::hint::black_box(mats[rep % n].forward(&x));
        if rep >= n {
            times.push(ms(t));
        }
    }
    let (m, b) = median(times);
    let kernel = cherenkov_cpu::q4::kernel_name();
    println!("single-token kernels ({kernel}), one thread: median {m:.3} ms, best {b:.3} ms per expert");

    // Teams of several sizes, one and two experts per job, on records in turn (from memory) and on
    // one record again and again (from the caches): what the threads' sync costs beside the bytes.
    let all = std::env::var("CHERENKOV_PROBE_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |p| p.get()).saturating_sub(2).max(1));
    let mut sizes = vec![all];
    sizes.extend([4, 8].into_iter().filter(|&t| t < all));
    for threads in sizes {
        let team = ExpertTeam::new(threads, Duration::from_millis(2)).unwrap();
        for (per_job, same) in [(1usize, false), (2, false), (1, true)] {
            let mut times = Vec::new();
            for rep in 0..(8 * n) {
                let pick = |j: usize| if same { 0 } else { (rep * per_job + j) % n };
                let jobs: Vec<JobExpert> = (0..per_job).map(|j| JobExpert { matrices: mats[pick(j)], x: &x }).collect();
                let t = Instant::now();
                let mut job = team.submit(&jobs);
                std::hint::black_box(job.wait().unwrap());
                if rep >= 2 * n {
                    times.push(ms(t) / per_job as f64);
                }
                // About a streamed layer's pace between jobs, keeping the team warm as the GPU
                // backend does.
                let until = Instant::now() + Duration::from_micros(250);
                team.keep_warm();
                while Instant::now() < until {
                    std::hint::spin_loop();
                }
            }
            let (m, b) = median(times);
            println!(
                "team of {threads} threads (+ the submitter), {per_job} per job{}: median {m:.3} ms, best {b:.3} ms per expert",
                if same { ", one record (cached)" } else { "" }
            );
        }
    }
}
