//! How long does the CPU take to compute one routed expert for one token? A measurement for the
//! issue's "cold experts on the CPU" (ignored by default):
//!
//!     CHERENKOV_PROBE_STORE=<store dir> cargo test --release -p cherenkov-cpu --test expert_probe -- --ignored --nocapture
//!
//! It times gate, up, silu(gate) * up and down of records of the store's first MoE layer with the
//! CPU backend's kernels (rayon over rows, all cores), each record first read into memory, and
//! prints the median per expert beside the bytes it reads.

use cherenkov_cpu::linear::Linear;
use cherenkov_cpu::ops::silu;
use cherenkov_model::store::Store;

#[test]
#[ignore = "a measurement: needs CHERENKOV_PROBE_STORE"]
fn cpu_expert_probe() {
    let dir = std::env::var("CHERENKOV_PROBE_STORE").expect("CHERENKOV_PROBE_STORE=<store dir>");
    let store = Store::open(std::path::Path::new(&dir)).unwrap();
    let c = store.config().clone();
    let layout = &store.manifest.experts.layers[0];
    let n = store.manifest.experts.num_experts.min(32);
    let records: Vec<Vec<u8>> = (0..n)
        .map(|e| {
            let mut b = vec![0u8; store.record_bytes()];
            store.read_expert(0, e, &mut b).unwrap();
            b
        })
        .collect();
    let x: Vec<f32> = (0..c.hidden_size).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
    let mut times = Vec::new();
    for rep in 0..(4 * n) {
        let rec = &records[rep % n];
        let t = std::time::Instant::now();
        let gate = Linear::from_record(rec, &layout.gate_proj).unwrap();
        let up = Linear::from_record(rec, &layout.up_proj).unwrap();
        let down = Linear::from_record(rec, &layout.down_proj).unwrap();
        let mut g = vec![0f32; gate.rows()];
        let mut u = vec![0f32; up.rows()];
        gate.forward(&x, &mut g);
        up.forward(&x, &mut u);
        for (a, b) in g.iter_mut().zip(&u) {
            *a = silu(*a) * b;
        }
        let mut y = vec![0f32; down.rows()];
        down.forward(&g, &mut y);
        std::hint::black_box(&y);
        if rep >= n {
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    times.sort_by(f64::total_cmp);
    println!(
        "CPU expert (one token, {} threads): median {:.3} ms, best {:.3} ms per expert of {} bytes ({} records)",
        rayon::current_num_threads(),
        times[times.len() / 2],
        times[0],
        store.record_bytes(),
        n
    );
}
