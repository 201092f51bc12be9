//! What recording statistics costs per decode token, from the cost of each recording operation:
//! the pool's counters (per routed expert, per read, per layer), the host clocks the backends take,
//! and the server's step log. Not a test: it measures (`benchmark/notes-stats.md`).
//!
//! ```sh
//! cargo run --release -p cherenkov-server --example stats_cost -- [--layers 48] [--experts 512] [--top-k 10]
//! ```
//!
//! Per decode token a backend records, per MoE layer: one acquire (the layer's split), one
//! `record_routed` per routed expert, one lookahead score, one compute time (two clock reads), and
//! per miss a read (and usually an eviction); per forward two clock reads and `record_forward`.
//! The server adds two `forward_stats` snapshots and one `StepLog::record` per step.

use std::hint::black_box;
use std::time::{Duration, Instant};

use cherenkov_engine::stats::{PoolCounters, Served};
use cherenkov_server::stats::{StepKind, StepLog};

fn per_op(n: u64, f: impl FnMut(u64)) -> f64 {
    let mut f = f;
    // Warm up, then the best of five runs (the least disturbed by other work on the machine).
    for i in 0..n / 10 {
        f(i);
    }
    (0..5)
        .map(|_| {
            let t = Instant::now();
            for i in 0..n {
                f(i);
            }
            t.elapsed().as_nanos() as f64 / n as f64
        })
        .fold(f64::INFINITY, f64::min)
}

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map_or(default, |v| v.parse().expect(name))
}

fn main() {
    let (layers, experts, top_k) = (arg("--layers", 48), arg("--experts", 512), arg("--top-k", 10));
    let c = PoolCounters::new(layers + 1, experts);
    let n = 2_000_000;
    let routed =
        per_op(n, |i| c.record_routed((i % layers as u64) as usize, (i * 7 % experts as u64) as usize, Served::Hit));
    let acquire = per_op(n, |i| c.record_acquire((i % layers as u64) as usize, 7, 1, 2));
    let read = per_op(n, |i| {
        c.record_read(
            (i % layers as u64) as usize,
            (i * 7 % experts as u64) as usize,
            1 << 20,
            300_000 + i % 1000,
            true,
        )
    });
    let evict = per_op(n, |i| c.record_eviction((i % layers as u64) as usize, (i * 7 % experts as u64) as usize));
    let compute = per_op(n, |i| c.record_compute((i % layers as u64) as usize, 1000 + i % 7));
    let lookahead = per_op(n, |i| c.record_lookahead((i % layers as u64) as usize, 10, 10, 7));
    let clock = per_op(n, |_| {
        black_box(Instant::now());
    });
    let forward = per_op(n, |i| c.record_forward(1, 1000 + i % 7));
    let snapshot = per_op(200_000, |_| {
        black_box(c.forward_stats());
    });
    let log = StepLog::new();
    let step = per_op(1_000_000, |i| log.record(StepKind::Decode, 1, Duration::from_micros(900 + i % 10), None));

    println!("one operation (ns, best of 5 runs):");
    for (what, ns) in [
        ("record_routed (per routed expert)", routed),
        ("record_acquire (per layer)", acquire),
        ("record_read (per read)", read),
        ("record_eviction", evict),
        ("record_compute (per layer)", compute),
        ("record_lookahead (per layer)", lookahead),
        ("Instant::now", clock),
        ("record_forward (per forward)", forward),
        ("forward_stats snapshot (server, twice per step)", snapshot),
        ("StepLog::record (server, per step)", step),
    ] {
        println!("  {what:<50} {ns:>8.1}");
    }
    // Per decode token: every routed expert resident (the common case), and every one a miss that
    // evicts (the most recording there can be). The CPU backend's two clock reads per layer are
    // counted; the CUDA backend times its layers anyway and records those times.
    let server = 2.0 * snapshot + step + 2.0 * clock;
    for (case, per_expert) in
        [("every expert a hit", routed), ("every expert a miss and an eviction", routed + read + evict)]
    {
        let per_layer = acquire + top_k as f64 * per_expert + compute + lookahead + 2.0 * clock;
        let engine = layers as f64 * per_layer + 2.0 * clock + forward;
        println!(
            "per decode token ({layers} MoE layers, top-{top_k}, {case}): engine {:.1} us, server {:.1} us, \
             together {:.1} us",
            engine / 1e3,
            server / 1e3,
            (engine + server) / 1e3
        );
    }
}
