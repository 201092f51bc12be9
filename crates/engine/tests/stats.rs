//! The per-expert counters, residency, layer names and precisions, and the forward time split of
//! the expert pool, on a real packed store (tiny-a MLX: 4 MoE layers x 6 experts).

use std::path::Path;
use std::sync::Arc;

use cherenkov_engine::residency::{ExpertPool, HostSlots};
use cherenkov_engine::stats::{ForwardStats, Residency};
use cherenkov_model::checkpoint::Checkpoint;
use cherenkov_model::store::{Store, pack::pack};
use indicatif::ProgressBar;

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures/golden/tiny-a/mlx4");

fn pool(slots: usize) -> (tempfile::TempDir, ExpertPool<HostSlots>) {
    let dir = tempfile::tempdir().unwrap();
    let ck = Checkpoint::open(Path::new(FIXTURE)).unwrap();
    pack(&ck, &dir.path().join("store"), &ProgressBar::hidden()).unwrap();
    let store = Arc::new(Store::open(&dir.path().join("store")).unwrap());
    let memory = Arc::new(HostSlots::new(slots, store.record_bytes()).unwrap());
    let pool = ExpertPool::new(store, memory, 1).unwrap();
    (dir, pool)
}

#[test]
fn per_expert_counters_sum_to_the_layers() {
    let (_dir, pool) = pool(3);
    let rb = pool.record_bytes() as u64;
    // Misses, a hit, evictions, a prefetch that a later step joins or hits.
    for (layer, experts) in [(0, vec![0, 1, 2]), (0, vec![1]), (0, vec![3]), (1, vec![0]), (0, vec![0, 1])] {
        let lease = pool.acquire(layer, &experts).unwrap();
        lease.wait_all().unwrap();
    }
    assert_eq!(pool.prefetch(1, &[4]), 1);
    let lease = pool.acquire(1, &[4]).unwrap();
    lease.wait_all().unwrap();
    drop(lease);

    let s = pool.stats();
    assert_eq!(s.experts_per_layer, 6);
    assert_eq!(s.info.len(), 4);
    assert_eq!((s.info[0].name.as_str(), s.info[0].precision.as_str()), ("layers.0", "q4g64"));
    assert_eq!(s.info[3].name, "mtp.layers.0");
    for (l, layer) in s.layers.iter().enumerate() {
        let e = pool.expert_stats(l).unwrap();
        assert_eq!(e.len(), 6);
        let sum = |f: fn(&cherenkov_engine::stats::ExpertStats) -> u64| e.iter().map(f).sum::<u64>();
        assert_eq!(sum(|x| x.routed), layer.routed, "layer {l}");
        assert_eq!(sum(|x| x.hits), layer.hits);
        assert_eq!(sum(|x| x.inflight), layer.inflight);
        assert_eq!(sum(|x| x.misses), layer.misses);
        assert_eq!(sum(|x| x.reads), layer.reads);
        assert_eq!(sum(|x| x.bytes_read), layer.reads * rb);
        assert_eq!(sum(|x| x.evictions), layer.evictions);
        assert_eq!(sum(|x| x.prefetched), layer.prefetched);
        let resident: Vec<usize> = e.iter().filter(|x| x.state == Residency::Resident).map(|x| x.expert).collect();
        assert_eq!(resident, pool.resident(l), "layer {l}");
        assert!(e.iter().all(|x| x.expert < 6));
    }
    // Layer 0: e0 read twice (evicted in between), e1 routed three times and hit once.
    let e0 = pool.expert_stats(0).unwrap();
    assert_eq!((e0[0].routed, e0[0].misses, e0[0].reads, e0[0].evictions), (2, 2, 2, 1));
    assert_eq!((e0[1].routed, e0[1].hits), (3, 2));
    assert_eq!(e0[1].hit_rate(), Some(2.0 / 3.0));
    let e1 = pool.expert_stats(1).unwrap();
    assert_eq!(e1[4].prefetched, 1);
    assert_eq!(e1[4].routed, e1[4].hits + e1[4].inflight, "the step found the prefetched read");
    assert!(pool.expert_stats(4).is_none());

    pool.reset_stats();
    assert!(pool.expert_stats(0).unwrap().iter().all(|x| x.routed == 0 && x.evictions == 0));
}

#[test]
fn lookahead_predictions_and_the_forward_split() {
    let (_dir, pool) = pool(6);
    pool.record_lookahead(1, &[2, 4, 5], &[2, 3]);
    let l1 = &pool.stats().layers[1];
    assert_eq!((l1.lookahead_predicted, l1.lookahead_routed, l1.lookahead_correct), (3, 2, 1));
    assert_eq!((l1.lookahead_accuracy(), l1.lookahead_precision()), (Some(0.5), Some(1.0 / 3.0)));

    assert_eq!(pool.forward_stats(), ForwardStats::default());
    pool.record_forward(5, 1_000);
    pool.record_forward(1, 500);
    pool.record_compute(0, 300);
    pool.record_compute(2, 200);
    pool.record_compute(9, 1_000_000); // outside the store: ignored
    let f = pool.forward_stats();
    assert_eq!((f.forwards, f.tokens, f.total_ns, f.experts_ns, f.wait_ns), (2, 6, 1_500, 500, 0));
    assert_eq!(f.dense_ns(), 1_000);
    assert_eq!(pool.stats().layers[2].compute_ns, 200);
    let later = ForwardStats { forwards: 3, tokens: 7, total_ns: 2_000, experts_ns: 600, wait_ns: 100 };
    let d = later.since(&f);
    assert_eq!((d.forwards, d.tokens, d.total_ns, d.experts_ns, d.wait_ns, d.dense_ns()), (1, 1, 500, 100, 100, 300));
}

/// `absent` says what an acquire would miss now; experts computed on the CPU count as misses
/// (and `cpu_computed`), per layer and per expert, without touching the cache.
#[test]
fn absent_experts_and_cpu_computed_misses() {
    let (_dir, pool) = pool(3);
    let lease = pool.acquire(0, &[0, 1]).unwrap();
    // Loading (not yet waited for) counts as present: an acquire would join that read.
    assert_eq!(pool.absent(0, &[0, 1, 2]), vec![false, false, true]);
    lease.wait_all().unwrap();
    drop(lease);
    assert_eq!(pool.absent(0, &[2, 1, 0]), vec![true, false, false]);
    assert_eq!(pool.absent(1, &[0]), vec![true]);
    pool.record_cpu_computed(0, &[2, 3]);
    // Nothing was loaded for them.
    assert_eq!(pool.absent(0, &[2, 3]), vec![true, true]);
    assert_eq!(pool.resident(0), vec![0, 1]);
    let s = pool.stats();
    let l0 = &s.layers[0];
    assert_eq!((l0.routed, l0.hits, l0.misses, l0.cpu_computed, l0.reads), (4, 0, 4, 2, 2));
    assert_eq!(s.total.cpu_computed, 2);
    let e = pool.expert_stats(0).unwrap();
    assert_eq!((e[2].routed, e[2].misses, e[2].reads), (1, 1, 0));
    assert_eq!((e[3].routed, e[3].misses), (1, 1));
    // Out-of-range layers and empty lists are ignored.
    pool.record_cpu_computed(99, &[0]);
    pool.record_cpu_computed(1, &[]);
    assert_eq!(pool.stats().layers[1].routed, 0);
}
