//! What the expert pool costs the host per MoE block: the time of an acquire (the hits pinned, the
//! misses given slots and their loads run by the calling thread, as the CUDA backend does with a
//! pinned expert file) and of dropping the lease, on a synthetic store of the released model's
//! expert count (512 experts top-10) with tiny records, routed by the calibrated synthetic routers.
//! The loads do nothing here, so this is the bookkeeping alone: the part of a streamed block's
//! host turn that lies between its router and its copies. Ignored by default (a measurement):
//!
//!     cargo test --release -p cherenkov-engine --test pool_host_cost -- --ignored --nocapture

use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use cherenkov_engine::residency::{Eviction, ExpertPool, RecordSource, SlotMemory};
use cherenkov_engine::routing::{ModelLogits, Skew, synthetic_trace};
use cherenkov_model::store::Store;
use cherenkov_model::synth::{SynthShape, write_store};
use indicatif::ProgressBar;

/// Slots whose loads do nothing (the bookkeeping's cost alone).
struct NoLoad {
    slots: usize,
    record: usize,
}

impl SlotMemory for NoLoad {
    fn slot_count(&self) -> usize {
        self.slots
    }
    fn record_bytes(&self) -> usize {
        self.record
    }
    fn load(&self, _: usize, _: &dyn RecordSource) -> Result<()> {
        Ok(())
    }
}

#[test]
#[ignore = "a measurement; see the file's header"]
fn pool_host_cost() {
    let layers = 16;
    let shape = SynthShape {
        num_hidden_layers: layers,
        num_experts: 512,
        num_experts_per_tok: 10,
        moe_intermediate_size: 32,
        full_attention_interval: 4,
        ple_layer_ids: vec![],
        mtp_layers: 0,
        ..SynthShape::tiny()
    };
    let dir = tempfile::tempdir().unwrap();
    write_store(&shape, &Default::default(), &dir.path().join("s"), &ProgressBar::hidden()).unwrap();
    let store = Arc::new(Store::open(&dir.path().join("s")).unwrap());
    let record = store.record_bytes();
    let tokens = 400;
    let trace = synthetic_trace(Skew::default(), ModelLogits::Constant { jitter: 0.05 }, layers, tokens, 512, 10);
    println!("# {layers} MoE layers of 512 experts top-10, {tokens} tokens; host us per block (median, p90)");
    for (what, slots) in [("27% cached", layers * 512 * 27 / 100), ("every expert cached", layers * 512)] {
        for eviction in [Eviction::Lrfu { lambda: 0.03 }, Eviction::Adaptive] {
            let memory = Arc::new(NoLoad { slots, record });
            let pool = ExpertPool::with_eviction(Arc::clone(&store), memory, 1, eviction).unwrap();
            let (mut acquire, mut ghosts, mut drop_ns) = (Vec::new(), Vec::new(), Vec::new());
            for step in &trace {
                let want: Vec<usize> = step.experts.iter().map(|&e| e as usize).collect();
                let t = Instant::now();
                let lease = pool.acquire_loading(step.layer as usize, &want).unwrap();
                acquire.push(t.elapsed().as_nanos() as f64 / 1e3);
                // As the CUDA backend does once the block's copies and resident experts are queued.
                let t = Instant::now();
                pool.replay_ghosts();
                ghosts.push(t.elapsed().as_nanos() as f64 / 1e3);
                let t = Instant::now();
                drop(lease);
                drop_ns.push(t.elapsed().as_nanos() as f64 / 1e3);
            }
            // Where every expert fits: the accounting of a step the device ran from resident experts
            // (the CUDA backend's replayed steps), as one call.
            let mut record = Vec::new();
            if slots == layers * 512 {
                for step in &trace {
                    let want: Vec<usize> = step.experts.iter().map(|&e| e as usize).collect();
                    let t = Instant::now();
                    assert!(pool.record_hits(step.layer as usize, &want));
                    record.push(t.elapsed().as_nanos() as f64 / 1e3);
                }
            }
            // The first tokens fill the cache; count the rest.
            let stat = |v: &mut Vec<f64>| {
                let mut v = v.split_off(v.len() / 4);
                v.sort_by(f64::total_cmp);
                (v[v.len() / 2], v[v.len() * 9 / 10])
            };
            let mean = ghosts.iter().sum::<f64>() / ghosts.len() as f64;
            let (a, g, d) = (stat(&mut acquire), stat(&mut ghosts), stat(&mut drop_ns));
            println!(
                "{what:20} {:17} acquire {:5.2} ({:5.2})  ghosts {:5.2} ({:5.2}, mean {mean:5.2})  drop {:4.2} ({:4.2})  hit rate {:.1}%",
                eviction.label(),
                a.0,
                a.1,
                g.0,
                g.1,
                d.0,
                d.1,
                100.0 * pool.stats().hit_rate().unwrap_or(0.0)
            );
            if !record.is_empty() {
                let r = stat(&mut record);
                println!("{what:20} {:17} record_hits {:5.2} ({:5.2})", eviction.label(), r.0, r.1);
            }
        }
    }
}
