//! The expert pool against a real packed store (the tiny-a MLX fixture: 4 MoE layers x 6 experts):
//! loaded bytes, exact LRU and LRFU order and counters, the same hits as the policy simulator,
//! pinning, refusals, corrupted records, reads joined while in flight, and several threads sharing
//! one pool.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use anyhow::Result;
use cherenkov_engine::policy::simulate;
use cherenkov_engine::residency::{
    Eviction, ExpertPool, HostSlots, Lease, LeaseEntry, RecordSource, SlotMemory, format_bytes, parse_size,
    slots_for_budget,
};
use cherenkov_engine::routing::{ModelLogits, Skew, synthetic_trace};
use cherenkov_model::checkpoint::Checkpoint;
use cherenkov_model::store::{Store, pack::pack};
use indicatif::ProgressBar;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures/golden/tiny-a/mlx4");

struct Fixture {
    _dir: tempfile::TempDir,
    store: Arc<Store>,
    /// `records[layer][expert]`, read straight from the store.
    records: Vec<Vec<Vec<u8>>>,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let ck = Checkpoint::open(Path::new(FIXTURE)).unwrap_or_else(|e| panic!("{FIXTURE}: {e:#}"));
    let out = dir.path().join("store");
    pack(&ck, &out, &ProgressBar::hidden()).unwrap();
    let store = Store::open(&out).unwrap();
    let records = all_records(&store);
    Fixture { _dir: dir, store: Arc::new(store), records }
}

fn all_records(store: &Store) -> Vec<Vec<Vec<u8>>> {
    let ef = &store.manifest.experts;
    (0..ef.layers.len())
        .map(|l| {
            (0..ef.num_experts)
                .map(|e| {
                    let mut buf = vec![0u8; store.record_bytes()];
                    store.read_expert(l, e, &mut buf).unwrap();
                    buf
                })
                .collect()
        })
        .collect()
}

fn host_pool(f: &Fixture, slots: usize, io_threads: usize) -> ExpertPool<HostSlots> {
    let memory = Arc::new(HostSlots::new(slots, f.store.record_bytes()).unwrap());
    ExpertPool::new(Arc::clone(&f.store), memory, io_threads).unwrap()
}

fn host_pool_evicting(f: &Fixture, slots: usize, io_threads: usize, eviction: Eviction) -> ExpertPool<HostSlots> {
    let memory = Arc::new(HostSlots::new(slots, f.store.record_bytes()).unwrap());
    ExpertPool::with_eviction(Arc::clone(&f.store), memory, io_threads, eviction).unwrap()
}

/// Every entry of the lease holds exactly the store's record.
fn check_bytes(f: &Fixture, lease: &Lease<'_, HostSlots>) {
    for (i, e) in lease.entries().iter().enumerate() {
        let got = lease.bytes(i).unwrap();
        assert!(got == f.records[lease.layer()][e.expert].as_slice(), "layer {} expert {}", lease.layer(), e.expert);
    }
}

/// (expert, slot, hit) of each entry.
fn shape(lease: &Lease<'_, impl SlotMemory>) -> Vec<(usize, usize, bool)> {
    lease.entries().iter().map(|e| (e.expert, e.slot, e.hit)).collect()
}

#[test]
fn fixture_has_distinct_records() {
    let f = fixture();
    let ef = &f.store.manifest.experts;
    assert_eq!((ef.layers.len(), ef.num_experts), (4, 6));
    let flat: Vec<&Vec<u8>> = f.records.iter().flatten().collect();
    for i in 0..flat.len() {
        for j in i + 1..flat.len() {
            assert_ne!(flat[i], flat[j], "records {i} and {j} are identical; byte checks would prove nothing");
        }
    }
}

#[test]
fn loaded_slots_hold_the_store_records() {
    let f = fixture();
    let pool = host_pool(&f, 24, 2);
    for layer in 0..4 {
        let experts: Vec<usize> = (0..6).rev().collect();
        let lease = pool.acquire(layer, &experts).unwrap();
        assert!(lease.entries().iter().all(|e| !e.hit));
        lease.wait_all().unwrap();
        check_bytes(&f, &lease);
    }
    // Everything is resident now: all hits, still the same bytes.
    for layer in 0..4 {
        assert_eq!(pool.resident(layer), vec![0, 1, 2, 3, 4, 5]);
        let lease = pool.acquire(layer, &[3, 1, 4]).unwrap();
        assert!(lease.entries().iter().all(|e| e.hit));
        assert!((0..3).all(|i| lease.is_ready(i)));
        check_bytes(&f, &lease);
    }
    let s = pool.stats();
    assert_eq!((s.total.routed, s.total.hits, s.total.misses, s.total.evictions), (36, 12, 24, 0));
    assert_eq!((s.total.reads, s.total.read_errors, s.total.bytes_read), (24, 0, 24 * f.store.record_bytes() as u64));
    assert_eq!(s.total.resident, 24);
    assert_eq!(s.hit_rate(), Some(12.0 / 36.0));
}

#[test]
fn lru_order_and_counters_on_a_scripted_sequence() {
    let f = fixture();
    let pool = host_pool_evicting(&f, 3, 1, Eviction::Lru);
    let step = |layer: usize, experts: &[usize], expect: &[(usize, usize, bool)]| {
        let lease = pool.acquire(layer, experts).unwrap();
        assert_eq!(shape(&lease), expect, "acquire({layer}, {experts:?})");
        lease.wait_all().unwrap();
        check_bytes(&f, &lease);
    };
    // Free slots are used in order 0, 1, 2.
    step(0, &[0, 1, 2], &[(0, 0, false), (1, 1, false), (2, 2, false)]);
    // Recency now (oldest first): L0e0, L0e2, L0e1.
    step(0, &[1], &[(1, 1, true)]);
    // L0e0 is the least recently used: evicted, its slot 0 reused.
    step(0, &[3], &[(3, 0, false)]);
    assert_eq!(pool.resident(0), vec![1, 2, 3]);
    // Then L0e2 (slot 2).
    step(1, &[0], &[(0, 2, false)]);
    assert_eq!((pool.resident(0), pool.resident(1)), (vec![1, 3], vec![0]));
    // L0e1 is the oldest, but it is part of this step: pinned before the miss picks a victim, so
    // the miss takes L0e3 (slot 0) instead.
    step(0, &[0, 1], &[(0, 0, false), (1, 1, true)]);
    // Recency: L1e0, L0e0, L0e1. The hit L1e0 is spared; the miss evicts L0e0 (slot 0).
    step(1, &[1, 0], &[(1, 0, false), (0, 2, true)]);
    assert_eq!((pool.resident(0), pool.resident(1)), (vec![1], vec![0, 1]));

    let s = pool.stats();
    let rb = f.store.record_bytes() as u64;
    let l0 = &s.layers[0];
    assert_eq!((l0.routed, l0.hits, l0.inflight, l0.misses), (7, 2, 0, 5));
    assert_eq!((l0.reads, l0.bytes_read, l0.evictions, l0.resident), (5, 5 * rb, 4, 1));
    let l1 = &s.layers[1];
    assert_eq!((l1.routed, l1.hits, l1.inflight, l1.misses), (3, 1, 0, 2));
    assert_eq!((l1.reads, l1.bytes_read, l1.evictions, l1.resident), (2, 2 * rb, 0, 2));
    assert_eq!(s.layers[2], Default::default());
    assert_eq!((s.total.routed, s.total.hits, s.total.misses, s.total.evictions), (10, 3, 7, 4));
    assert_eq!(s.total.latency.iter().sum::<u64>(), 7);
    assert!(s.total.read_ns_max <= s.total.read_ns_sum);
    assert_eq!(s.hit_rate(), Some(0.3));
    assert_eq!((s.slots.slots, s.slots.free, s.slots.loading, s.slots.pinned), (3, 0, 0, 0));

    pool.reset_stats();
    let s = pool.stats();
    assert_eq!((s.total.routed, s.total.reads, s.total.evictions, s.total.latency.iter().sum::<u64>()), (0, 0, 0, 0));
    assert_eq!(s.total.resident, 3, "resetting counters keeps what is resident");
    assert_eq!(s.hit_rate(), None);
}

#[test]
fn lrfu_keeps_a_frequent_expert_that_lru_evicts() {
    let f = fixture();
    assert_eq!(host_pool(&f, 2, 1).eviction(), Eviction::Adaptive, "the default");
    // One layer, so every acquire is a new token. Expert 0 is used three times, then expert 1
    // once, more recently; expert 2 needs a slot.
    let run = |eviction: Eviction| {
        let pool = host_pool_evicting(&f, 2, 1, eviction);
        for experts in [[0], [0], [0], [1]] {
            pool.acquire(0, &experts).unwrap().wait_all().unwrap();
        }
        let lease = pool.acquire(0, &[2]).unwrap();
        lease.wait_all().unwrap();
        check_bytes(&f, &lease);
        let victim_slot = shape(&lease);
        drop(lease);
        let resident = pool.resident(0);
        let again = pool.acquire(0, &[0]).unwrap().entries()[0].hit;
        (victim_slot, resident, again, pool.stats().layers[0].evictions)
    };
    // LRU: expert 0 is the least recently used (slot 0); coming back it misses.
    assert_eq!(run(Eviction::Lru), (vec![(2, 0, false)], vec![1, 2], false, 2));
    // LRFU: expert 0's three uses outweigh expert 1's one, a token more recent: expert 1 goes.
    assert_eq!(run(Eviction::Lrfu { lambda: 0.03 }), (vec![(2, 1, false)], vec![0, 2], true, 1));
    // A fast decay is LRU again.
    assert_eq!(run(Eviction::Lrfu { lambda: 4.0 }).1, vec![1, 2]);

    // A prefetched record ranks as if used once when queued: under LRFU the frequent expert
    // stays and the prefetch goes; under LRU the prefetch is the most recent and stays.
    let prefetch_then_miss = |eviction: Eviction| {
        let pool = host_pool_evicting(&f, 2, 1, eviction);
        for experts in [[0], [0], [0]] {
            pool.acquire(0, &experts).unwrap().wait_all().unwrap();
        }
        assert_eq!(pool.prefetch(0, &[1]), 1);
        // Until its read ends the prefetched slot is loading, hence not evictable.
        while pool.stats().slots.loading > 0 {
            std::thread::yield_now();
        }
        pool.acquire(1, &[3]).unwrap().wait_all().unwrap(); // same token: layer 1 > 0
        (pool.resident(0), pool.resident(1))
    };
    assert_eq!(prefetch_then_miss(Eviction::Lru), (vec![1], vec![3]));
    assert_eq!(prefetch_then_miss(Eviction::DEFAULT), (vec![0], vec![3]));

    let memory = Arc::new(HostSlots::new(2, f.store.record_bytes()).unwrap());
    let bad = ExpertPool::with_eviction(Arc::clone(&f.store), memory, 1, Eviction::Lrfu { lambda: f64::NAN });
    assert!(format!("{:#}", bad.map(|_| ()).unwrap_err()).contains("LRFU's decay rate"));
}

/// The pool and the offline simulator run the same policies: replaying a routing trace through
/// both gives the same hits, for LRU and for LRFU, and the two policies differ on it.
#[test]
fn the_pool_hits_what_the_simulator_predicts() {
    let f = fixture();
    let ef = &f.store.manifest.experts;
    let (layers, experts) = (ef.layers.len(), ef.num_experts);
    let skew = Skew { popularity: 0.8, ..Skew::default() };
    let trace = synthetic_trace(skew, ModelLogits::Constant { jitter: 0.05 }, layers, 300, experts, 2);
    let slots = 9;
    let mut hits = Vec::new();
    for eviction in [Eviction::Lru, Eviction::Lrfu { lambda: 0.03 }, Eviction::Lrfu { lambda: 0.3 }, Eviction::Adaptive]
    {
        let pool = host_pool_evicting(&f, slots, 1, eviction);
        for step in &trace {
            let want: Vec<usize> = step.experts.iter().map(|&e| e as usize).collect();
            pool.acquire(step.layer as usize, &want).unwrap().wait_all().unwrap();
        }
        let s = pool.stats();
        let sim = simulate(&trace, slots, eviction.policy());
        assert_eq!((s.total.routed, s.total.inflight), (sim.requests, 0));
        assert_eq!(s.total.hits, sim.hits, "{}", eviction.label());
        hits.push(sim.hits);
        let (lambda, switches) = pool.decay();
        match eviction {
            Eviction::Lru => assert_eq!((lambda, switches), (None, 0)),
            Eviction::Lrfu { lambda: l } => assert_eq!((lambda, switches), (Some(l), 0)),
            Eviction::Adaptive => {
                assert!(switches > 0, "adaptive LRFU never switched");
                assert!(cherenkov_engine::policy::ADAPTIVE_LAMBDAS.contains(&lambda.unwrap()));
            }
        }
    }
    assert!(hits[0] != hits[1] && hits[1] != hits[2], "the policies should differ on this trace: {hits:?}");
    // Adaptive LRFU starts as LRFU(0.03): hitting otherwise, it switched decays (and re-ranked the
    // pool's records) on the way, and the pool still hit what the simulator did.
    assert_ne!(hits[3], hits[1], "adaptive LRFU should switch decays on this trace: {hits:?}");
}

#[test]
fn leased_experts_are_never_evicted() {
    let f = fixture();
    let pool = host_pool(&f, 4, 2);
    let a = pool.acquire(0, &[0, 1, 2]).unwrap();
    a.wait_all().unwrap();
    // Churn the one unpinned slot through every other record while `a` is alive.
    for layer in 1..4 {
        for e in 0..6 {
            let l = pool.acquire(layer, &[e]).unwrap();
            l.wait_all().unwrap();
            check_bytes(&f, &l);
            assert_eq!(pool.resident(0), vec![0, 1, 2]);
        }
    }
    check_bytes(&f, &a);
    let s = pool.stats();
    assert_eq!(s.layers[0].evictions, 0);
    assert_eq!(s.total.evictions, 17);
    assert_eq!(s.slots.pinned, 3);

    // A second live lease takes the last slot; then nothing is left.
    let b = pool.acquire(1, &[5, 4]).map(|_| ()).unwrap_err();
    let msg = format!("{b:#}");
    assert!(msg.contains("expert cache is full") && msg.contains("3 are pinned by live leases"), "{msg}");
    let b = pool.acquire(3, &[5]).unwrap(); // L3e5 is resident, the last of the churn: a hit
    assert!(b.entries()[0].hit);
    let c = pool.acquire(2, &[0]).map(|_| ()).unwrap_err();
    assert!(format!("{c:#}").contains("4 are pinned by live leases"), "{c:#}");
    // Hits need no slot: they work even when every slot is pinned.
    let again = pool.acquire(0, &[2, 0]).unwrap();
    assert!(again.entries().iter().all(|e| e.hit));
    check_bytes(&f, &again);
    drop((again, b));
    // A refused request changed nothing; after the first lease goes, a full-size step fits.
    assert_eq!(pool.resident(0), vec![0, 1, 2]);
    drop(a);
    let d = pool.acquire(3, &[0, 1, 2, 3]).unwrap();
    d.wait_all().unwrap();
    check_bytes(&f, &d);
    assert!(pool.resident(0).is_empty());
}

#[test]
fn bad_requests_fail_clearly() {
    let f = fixture();
    let pool = host_pool(&f, 3, 1);
    let err = |r: Result<Lease<'_, HostSlots>>| format!("{:#}", r.map(|_| ()).unwrap_err());
    let rb = format_bytes(f.store.record_bytes() as u64);
    let big = err(pool.acquire(0, &[0, 1, 2, 3]));
    assert!(big.contains(&format!("expert cache of 3 slots (3 x {rb}) cannot hold the 4 experts")), "{big}");
    let need = format_bytes(4 * f.store.record_bytes() as u64);
    assert!(big.contains(&format!("use --expert-cache of at least {need}")), "{big}");
    assert!(err(pool.acquire(1, &[2, 0, 2])).contains("expert 2 appears twice"));
    assert!(err(pool.acquire(4, &[0])).contains("MoE layer 4 is outside the store (4 MoE layers)"));
    assert!(err(pool.acquire(0, &[6])).contains("expert 6 of MoE layer 0 is outside the store (6 experts per layer)"));
    // Refusals queued nothing.
    let s = pool.stats();
    assert_eq!((s.total.routed, s.slots.free), (0, 3));
    assert!(pool.acquire(0, &[]).unwrap().is_empty());

    let wrong = Arc::new(HostSlots::new(2, f.store.record_bytes() + 4096).unwrap());
    let e = ExpertPool::new(Arc::clone(&f.store), wrong, 1).map(|_| ()).unwrap_err();
    assert!(format!("{e:#}").contains("cannot hold this store's records"), "{e:#}");
    let ok = Arc::new(HostSlots::new(2, f.store.record_bytes()).unwrap());
    let e = ExpertPool::new(Arc::clone(&f.store), ok, 0).map(|_| ()).unwrap_err();
    assert!(format!("{e:#}").contains("at least one IO thread"), "{e:#}");
    let e = HostSlots::new(0, 4096).map(|_| ()).unwrap_err();
    assert!(format!("{e:#}").contains("at least one slot"), "{e:#}");
    let e = HostSlots::new(usize::MAX / 2, 4096).map(|_| ()).unwrap_err();
    assert!(format!("{e:#}").contains("does not fit in memory"), "{e:#}");
}

#[test]
fn host_slots_are_page_aligned() {
    let slots = HostSlots::new(3, 8192).unwrap();
    assert_eq!(slots.bytes(), 3 * 8192);
    for s in 0..3 {
        // SAFETY: nothing loads these slots.
        let bytes = unsafe { slots.slot(s) };
        assert_eq!(bytes.len(), 8192);
        assert_eq!(bytes.as_ptr() as usize % 4096, 0);
    }
    /// A record of sevens that remembers the lengths it was asked for and checked.
    struct Sevens(Mutex<Vec<usize>>);
    impl RecordSource for Sevens {
        fn read_range(&self, _offset: usize, buf: &mut [u8]) -> Result<()> {
            buf.fill(7);
            Ok(())
        }
        fn verify(&self, record: &[u8]) -> Result<()> {
            self.0.lock().unwrap().push(record.len());
            Ok(())
        }
    }
    let record = Sevens(Mutex::new(Vec::new()));
    slots.load(1, &record).unwrap();
    assert_eq!(*record.0.lock().unwrap(), vec![8192], "the whole slot was read and checked");
    // SAFETY: no load runs now.
    let (s0, s1, s2) = unsafe { (slots.slot(0), slots.slot(1), slots.slot(2)) };
    assert!(s0.iter().all(|&b| b == 0) && s1.iter().all(|&b| b == 7) && s2.iter().all(|&b| b == 0));
    assert!(slots.load(3, &record).is_err());
}

/// Copies a store directory and flips one byte inside record (layer, expert).
fn corrupted_copy(f: &Fixture, into: &Path, layer: usize, expert: usize) -> Store {
    std::fs::create_dir_all(into).unwrap();
    for entry in std::fs::read_dir(&f.store.dir).unwrap() {
        let entry = entry.unwrap();
        assert!(entry.file_type().unwrap().is_file(), "the store directory is flat");
        std::fs::copy(entry.path(), into.join(entry.file_name())).unwrap();
    }
    let ef = &f.store.manifest.experts;
    let path = into.join(&ef.file);
    let mut bytes = std::fs::read(&path).unwrap();
    let at = ef.record_index(layer, expert) as usize * f.store.record_bytes() + 100;
    bytes[at] ^= 0x5a;
    std::fs::write(&path, bytes).unwrap();
    Store::open(into).unwrap()
}

#[test]
fn a_corrupted_record_fails_its_wait_and_the_pool_keeps_working() {
    let f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let bad = Arc::new(corrupted_copy(&f, dir.path(), 1, 2));
    let memory = Arc::new(HostSlots::new(8, bad.record_bytes()).unwrap());
    let pool = ExpertPool::new(bad, memory, 2).unwrap();
    let name = &f.store.manifest.experts.layers[1].layer;

    let lease = pool.acquire(1, &[2, 3]).unwrap();
    let e = format!("{:#}", lease.wait(0).unwrap_err());
    assert!(e.contains(&format!("expert 2 of MoE layer 1 ({name}) failed to load")), "{e}");
    assert!(e.contains("corrupted expert record") && e.contains("checksum"), "{e}");
    assert!(!lease.is_ready(0));
    assert!(lease.bytes(0).is_err());
    lease.wait(1).unwrap();
    assert_eq!(lease.bytes(1).unwrap(), f.records[1][3].as_slice());
    assert!(format!("{:#}", lease.wait_all().unwrap_err()).contains("expert 2 of MoE layer 1"));
    // The failed slot was freed at once, although the lease still names it.
    assert_eq!(pool.resident(1), vec![3]);
    let s = pool.stats();
    assert_eq!(
        (s.layers[1].reads, s.layers[1].read_errors, s.layers[1].bytes_read),
        (1, 1, f.store.record_bytes() as u64)
    );
    assert_eq!((s.slots.free, s.slots.loading), (7, 0));

    // Other experts load while the failed lease is alive; its drop leaves the reused slot alone.
    let others = pool.acquire(1, &[0, 1, 4, 5]).unwrap();
    others.wait_all().unwrap();
    check_bytes(&f, &others);
    drop(lease);
    assert_eq!(pool.stats().slots.pinned, 4);
    drop(others);

    // The next acquire reads the record again (and fails again).
    let retry = pool.acquire(1, &[2]).unwrap();
    assert!(!retry.entries()[0].hit);
    assert!(retry.wait(0).is_err());
    drop(retry);
    let s = pool.stats();
    assert_eq!((s.layers[1].misses, s.layers[1].read_errors), (7, 2));
    assert_eq!(pool.resident(1), vec![0, 1, 3, 4, 5]);
    assert_eq!((s.slots.free, s.slots.pinned), (3, 0));
    // The same expert of other layers is fine.
    let l2 = pool.acquire(2, &[2]).unwrap();
    assert_eq!(l2.bytes(0).unwrap(), f.records[2][2].as_slice());
}

/// Host slots whose loads block until the test opens a gate, so in-flight states are deterministic.
struct GatedSlots {
    slots: HostSlots,
    open: Mutex<bool>,
    opened: Condvar,
    loads: AtomicUsize,
    /// Loads that reached the gate, and the slots loaded, in order.
    entered: AtomicUsize,
    order: Mutex<Vec<usize>>,
}

impl GatedSlots {
    fn new(slots: usize, record_bytes: usize) -> Arc<GatedSlots> {
        Arc::new(GatedSlots {
            slots: HostSlots::new(slots, record_bytes).unwrap(),
            open: Mutex::new(false),
            opened: Condvar::new(),
            loads: AtomicUsize::new(0),
            entered: AtomicUsize::new(0),
            order: Mutex::new(Vec::new()),
        })
    }
    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }
}

impl SlotMemory for GatedSlots {
    fn slot_count(&self) -> usize {
        self.slots.slot_count()
    }
    fn record_bytes(&self) -> usize {
        self.slots.record_bytes()
    }
    fn load(&self, slot: usize, record: &dyn RecordSource) -> Result<()> {
        self.entered.fetch_add(1, Ordering::SeqCst);
        let mut open = self.open.lock().unwrap();
        while !*open {
            open = self.opened.wait(open).unwrap();
        }
        drop(open);
        self.loads.fetch_add(1, Ordering::SeqCst);
        self.order.lock().unwrap().push(slot);
        self.slots.load(slot, record)
    }
}

#[test]
fn a_record_in_flight_is_read_once() {
    let f = fixture();
    let memory = GatedSlots::new(4, f.store.record_bytes());
    let pool = ExpertPool::new(Arc::clone(&f.store), Arc::clone(&memory), 2).unwrap();
    let a = pool.acquire(2, &[4]).unwrap();
    let b = pool.acquire(2, &[1, 4]).unwrap();
    assert_eq!(shape(&a), vec![(4, 0, false)]);
    assert_eq!(shape(&b), vec![(1, 1, false), (4, 0, false)]);
    assert!(!a.is_ready(0) && !b.is_ready(1));
    assert!(pool.resident(2).is_empty(), "loading records are not listed as resident");
    let s = pool.stats();
    assert_eq!((s.layers[2].routed, s.layers[2].hits, s.layers[2].inflight, s.layers[2].misses), (3, 0, 1, 2));
    assert_eq!((s.slots.loading, s.slots.pinned), (2, 2));

    // Both leases wait on the same read, from two threads.
    memory.open();
    std::thread::scope(|scope| {
        scope.spawn(|| a.wait(0).unwrap());
        b.wait_all().unwrap();
    });
    assert_eq!(memory.loads.load(Ordering::SeqCst), 2);
    for (lease, i) in [(&a, 0), (&b, 1), (&b, 0)] {
        let e = lease.entries()[i];
        // SAFETY: the entry is loaded and pinned by a live lease.
        let got = unsafe { memory.slots.slot(e.slot) };
        assert_eq!(got, f.records[2][e.expert].as_slice());
    }
    assert_eq!(pool.stats().layers[2].reads, 2);
}

#[test]
fn a_loading_slot_is_never_evicted() {
    let f = fixture();
    let memory = GatedSlots::new(2, f.store.record_bytes());
    // One IO thread: reads finish in queue order, so the LRU victim below is deterministic.
    let pool = ExpertPool::new(Arc::clone(&f.store), Arc::clone(&memory), 1).unwrap();

    // Loading and pinned by a live lease: a request that needs its slot is refused at once.
    let held = pool.acquire(0, &[0, 1]).unwrap();
    let e = format!("{:#}", pool.acquire(1, &[0]).map(|_| ()).unwrap_err());
    assert!(e.contains("expert cache is full") && e.contains("2 are pinned by live leases"), "{e}");
    // Dropped before its reads finished: unpinned but still loading. Not evictable either, but it
    // will free up on its own, so the next request waits for it instead of failing.
    drop(held);
    let s = pool.stats();
    assert_eq!((s.slots.loading, s.slots.pinned, s.slots.free), (2, 0, 0));
    std::thread::scope(|scope| {
        let waiter = scope.spawn(|| {
            let lease = pool.acquire(1, &[3]).unwrap();
            let entry = lease.entries()[0];
            lease.wait_all().unwrap();
            // SAFETY: the entry is loaded and pinned by the live lease.
            assert_eq!(unsafe { memory.slots.slot(entry.slot) }, f.records[1][3].as_slice());
            entry
        });
        while pool.stats().slots.blocked_acquires == 0 {
            assert!(!waiter.is_finished(), "acquire returned (or failed) while both slots were still loading");
            std::thread::yield_now();
        }
        assert_eq!(memory.loads.load(Ordering::SeqCst), 0);
        memory.open();
        // Expert 0 of layer 0 (slot 0) was the least recently used once both reads ended.
        assert_eq!(waiter.join().unwrap(), LeaseEntry { expert: 3, slot: 0, hit: false });
    });
    assert_eq!(memory.loads.load(Ordering::SeqCst), 3);
    assert_eq!((pool.resident(0), pool.resident(1)), (vec![1], vec![3]));
    let s = pool.stats();
    assert_eq!((s.layers[0].evictions, s.slots.blocked_acquires), (1, 0));
}

/// Random distinct experts of a random layer.
fn random_request(rng: &mut ChaCha8Rng, max: usize) -> (usize, Vec<usize>) {
    let layer = rng.random_range(0..4);
    let k = rng.random_range(1..=max);
    (layer, rand::seq::index::sample(rng, 6, k).into_vec())
}

/// Acquires every record once and waits, so no read is left in flight.
fn settle<M: SlotMemory>(pool: &ExpertPool<M>) {
    for layer in 0..4 {
        for chunk in [[0, 1, 2], [3, 4, 5]] {
            pool.acquire(layer, &chunk).unwrap().wait_all().unwrap();
        }
    }
}

#[test]
fn threads_share_one_pool() {
    let f = fixture();
    // 4 threads x at most 4 experts never exceed 16 slots: every acquire must succeed.
    let pool = host_pool(&f, 16, 2);
    std::thread::scope(|scope| {
        for t in 0..4u64 {
            let (pool, f) = (&pool, &f);
            scope.spawn(move || {
                let mut rng = ChaCha8Rng::seed_from_u64(t);
                for _ in 0..300 {
                    let (layer, experts) = random_request(&mut rng, 4);
                    let lease = pool.acquire(layer, &experts).unwrap();
                    match rng.random_range(0..4) {
                        0 => {} // dropped without waiting
                        1 => {
                            let i = rng.random_range(0..experts.len());
                            assert_eq!(lease.bytes(i).unwrap(), f.records[layer][experts[i]].as_slice());
                        }
                        _ => {
                            for i in (0..experts.len()).rev() {
                                lease.wait(i).unwrap();
                            }
                            check_bytes(f, &lease);
                        }
                    }
                }
            });
        }
    });
    settle(&pool);
    let s = pool.stats();
    assert_eq!(s.total.routed, s.total.hits + s.total.inflight + s.total.misses);
    assert_eq!(s.total.reads, s.total.misses);
    assert_eq!(s.total.read_errors, 0);
    assert!(s.total.evictions > 0, "the pool is smaller than the store: {s}");
    assert_eq!((s.total.resident, s.slots.free, s.slots.loading, s.slots.pinned), (16, 0, 0, 0));
    eprintln!("{s}");
}

#[test]
fn threads_competing_for_a_tiny_pool_get_errors_not_deadlocks() {
    let f = fixture();
    let pool = host_pool(&f, 4, 2);
    let refused = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for t in 0..3u64 {
            let (pool, f, refused) = (&pool, &f, &refused);
            scope.spawn(move || {
                let mut rng = ChaCha8Rng::seed_from_u64(100 + t);
                for _ in 0..300 {
                    let (layer, experts) = random_request(&mut rng, 3);
                    match pool.acquire(layer, &experts) {
                        Ok(lease) => {
                            lease.wait_all().unwrap();
                            check_bytes(f, &lease);
                        }
                        Err(e) => {
                            let msg = format!("{e:#}");
                            assert!(msg.contains("expert cache is full"), "{msg}");
                            refused.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            });
        }
    });
    let s = pool.stats();
    assert_eq!(s.total.routed, s.total.hits + s.total.inflight + s.total.misses);
    assert_eq!(s.total.reads, s.total.misses, "every lease waited, so every read has finished");
    assert_eq!((s.slots.loading, s.slots.pinned), (0, 0));
    // Alone again, a full-size request works.
    let lease = pool.acquire(3, &[5, 4, 3, 2]).unwrap();
    lease.wait_all().unwrap();
    check_bytes(&f, &lease);
    eprintln!("tiny pool: {} requests refused while others held the slots", refused.load(Ordering::Relaxed));
}

#[test]
fn sizes_parse_as_powers_of_1024() {
    let cases: [(&str, u64); 12] = [
        ("4096", 4096),
        ("4096B", 4096),
        ("512M", 512 << 20),
        ("512mb", 512 << 20),
        ("2G", 2 << 30),
        ("1.5GiB", 3 << 29),
        ("64k", 64 << 10),
        (" 3 KiB ", 3 << 10),
        ("1T", 1 << 40),
        (".5K", 512),
        ("1.0001K", 1024),
        ("0", 0),
    ];
    for (text, want) in cases {
        assert_eq!(parse_size(text).unwrap(), want, "{text:?}");
    }
    for bad in ["", "G", "12X", "1.5", "1..5G", "-1G", "1.2.3M", "99999999999T", "1 GB extra"] {
        let e = parse_size(bad).unwrap_err();
        assert!(format!("{e:#}").contains(&format!("{bad:?}")), "{bad:?}: {e:#}");
    }
    assert_eq!(slots_for_budget(parse_size("1M").unwrap(), 24 << 10), 42);
    assert_eq!(slots_for_budget(100, 4096), 0);
    assert_eq!(slots_for_budget(1 << 20, 0), 0);
    assert_eq!(format_bytes(512), "512 B");
    assert_eq!(format_bytes(24 << 10), "24 KiB");
    assert_eq!(format_bytes(3 << 29), "1.5 GiB");
}

#[test]
fn latency_buckets() {
    use cherenkov_engine::stats::{LATENCY_BUCKETS, latency_bucket, latency_bucket_label};
    assert_eq!(LATENCY_BUCKETS, 12);
    // Bounds are inclusive, like Prometheus' `le`.
    let cases = [
        (0, 0),
        (50_000, 0),
        (50_001, 1),
        (1_000_000, 4),
        (1_000_001, 5),
        (100_000_000, 10),
        (100_000_001, 11),
        (u64::MAX, 11),
    ];
    for (ns, bucket) in cases {
        assert_eq!(latency_bucket(ns), bucket, "{ns} ns");
    }
    assert_eq!(latency_bucket_label(0), "<=50us");
    assert_eq!(latency_bucket_label(5), "<=2.5ms");
    assert_eq!(latency_bucket_label(11), ">100ms");
}

#[test]
fn prefetch_queues_behind_misses_and_pins_nothing() {
    let f = fixture();
    let pool = host_pool(&f, 4, 1);
    // A step needs experts 0 and 1 of layer 0; the lookahead prefetches 2 and 3 of layer 1.
    let lease = pool.acquire(0, &[0, 1]).unwrap();
    assert_eq!(pool.prefetch(1, &[2, 3]), 2);
    // Already resident or loading: nothing more to read.
    assert_eq!(pool.prefetch(1, &[2, 3]), 0);
    lease.wait_all().unwrap();
    check_bytes(&f, &lease);
    drop(lease);
    // The next step finds the prefetched records (joined or loaded) and reads nothing new.
    let next = pool.acquire(1, &[2, 3]).unwrap();
    next.wait_all().unwrap();
    check_bytes(&f, &next);
    let st = pool.stats();
    assert_eq!(st.layers[1].misses, 0, "prefetched records were read again");
    assert_eq!(st.layers[1].prefetched, 2);
    assert_eq!(st.total.reads, 4);
    drop(next);
    // Prefetched records are not pinned: a step of 4 new experts can evict them all.
    let all = pool.acquire(2, &[0, 1, 2, 3]).unwrap();
    all.wait_all().unwrap();
    check_bytes(&f, &all);
    // With every slot pinned, a prefetch takes nothing.
    assert_eq!(pool.prefetch(3, &[0]), 0);
    drop(all);
    // The records prefetched for layer 1 were used before `all` evicted them: no read was wasted.
    assert_eq!(pool.stats().total.prefetch_unused, 0);
    // A prefetched record that no step uses before its eviction is a wasted read.
    assert_eq!(pool.prefetch(3, &[4]), 1);
    let evicting = pool.acquire(0, &[2, 3, 4, 5]).unwrap();
    evicting.wait_all().unwrap();
    check_bytes(&f, &evicting);
    let st = pool.stats();
    assert_eq!((st.layers[3].prefetch_unused, st.total.prefetch_unused), (1, 1));
    drop(evicting);
    // Lookahead accounting.
    pool.record_lookahead(1, &[2, 4], &[2, 3]);
    let st = pool.stats();
    assert_eq!((st.layers[1].lookahead_routed, st.layers[1].lookahead_correct), (2, 1));
    assert_eq!(st.layers[1].lookahead_accuracy(), Some(0.5));
}

#[test]
fn preload_all_makes_every_expert_resident_and_names_a_failed_read() {
    let f = fixture();
    let ef = &f.store.manifest.experts;
    let (layers, experts) = (ef.layers.len(), ef.num_experts);
    let too_small = host_pool(&f, layers * experts - 1, 2);
    let e = format!("{:#}", too_small.preload_all().unwrap_err());
    assert!(e.contains("cannot all be resident"), "{e}");

    let pool = host_pool(&f, layers * experts, 2);
    let slots = pool.preload_all().unwrap();
    assert_eq!((slots.len(), slots[0].len()), (layers, experts));
    let mut seen: Vec<usize> = slots.iter().flatten().copied().collect();
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(seen.len(), layers * experts, "every record has its own slot");
    for (l, row) in slots.iter().enumerate() {
        assert_eq!(pool.resident(l), (0..experts).collect::<Vec<_>>());
        // The slots it returned are where an acquire finds the records, and every request hits.
        let want: Vec<usize> = (0..experts).collect();
        let lease = pool.acquire(l, &want).unwrap();
        assert!(lease.entries().iter().all(|e| e.hit && e.slot == row[e.expert]));
        check_bytes(&f, &lease);
    }
    assert_eq!(pool.stats().layers.iter().map(|l| l.evictions).sum::<u64>(), 0);

    let dir = tempfile::tempdir().unwrap();
    let bad = Arc::new(corrupted_copy(&f, dir.path(), 1, 2));
    let memory = Arc::new(HostSlots::new(layers * experts, bad.record_bytes()).unwrap());
    let pool = ExpertPool::new(bad, memory, 2).unwrap();
    let e = format!("{:#}", pool.preload_all().unwrap_err());
    assert!(e.contains("expert 2 of MoE layer 1") && e.contains("checksum"), "{e}");
}

#[test]
fn demand_reads_go_ahead_of_queued_prefetches() {
    let f = fixture();
    let memory = GatedSlots::new(8, f.store.record_bytes());
    let pool = ExpertPool::new(Arc::clone(&f.store), memory.clone(), 1).unwrap();
    // The one IO thread takes the first prefetch and blocks at the gate; two stay queued.
    assert_eq!(pool.prefetch(0, &[1, 2, 3]), 3);
    while memory.entered.load(Ordering::SeqCst) == 0 {
        std::thread::yield_now();
    }
    // A miss goes ahead of the queued prefetches; a queued prefetch a step asks for is promoted
    // behind it.
    let miss = pool.acquire(0, &[5]).unwrap();
    let joined = pool.acquire(0, &[3]).unwrap();
    assert_eq!((miss.entries()[0].hit, joined.entries()[0].hit), (false, false));
    memory.open();
    miss.wait_all().unwrap();
    joined.wait_all().unwrap();
    let t = std::time::Instant::now();
    while memory.loads.load(Ordering::SeqCst) < 4 && t.elapsed().as_secs() < 30 {
        std::thread::yield_now();
    }
    let order = memory.order.lock().unwrap().clone();
    assert_eq!(order.len(), 4, "{order:?}");
    assert_eq!(&order[1..3], &[miss.entries()[0].slot, joined.entries()[0].slot], "{order:?}");
}

/// Slots filled the way the CUDA loader fills them from a pinned expert file: straight from the
/// bytes at the record's location in the store's expert file, never through the record's reads.
struct FileSlots {
    file: Vec<u8>,
    dir: std::path::PathBuf,
    slots: Mutex<Vec<Vec<u8>>>,
    record: usize,
}

impl SlotMemory for FileSlots {
    fn slot_count(&self) -> usize {
        self.slots.lock().unwrap().len()
    }
    fn record_bytes(&self) -> usize {
        self.record
    }
    fn load(&self, slot: usize, record: &dyn RecordSource) -> Result<()> {
        let (dir, at) = record.location().expect("a store record has a location");
        assert_eq!(dir, self.dir);
        let at = at as usize;
        self.slots.lock().unwrap()[slot] = self.file[at..at + self.record].to_vec();
        Ok(())
    }
}

#[test]
fn store_records_name_where_they_lie_in_the_expert_file() {
    let f = fixture();
    let ef = &f.store.manifest.experts;
    let record = f.store.record_bytes();
    let memory = Arc::new(FileSlots {
        file: std::fs::read(f.store.dir.join(&ef.file)).unwrap(),
        dir: f.store.dir.clone(),
        slots: Mutex::new(vec![Vec::new(); 4]),
        record,
    });
    let pool = ExpertPool::new(Arc::clone(&f.store), memory.clone(), 2).unwrap();
    for layer in 0..ef.layers.len() {
        for experts in [[0usize, 3], [5, 1]] {
            let lease = pool.acquire(layer, &experts).unwrap();
            lease.wait_all().unwrap();
            for e in lease.entries() {
                let got = memory.slots.lock().unwrap()[e.slot].clone();
                assert!(got == f.records[layer][e.expert], "layer {layer} expert {}", e.expert);
            }
        }
    }
}

/// Host slots whose loads on any thread but `free` block until the gate opens.
struct ThreadGated {
    inner: Arc<GatedSlots>,
    free: std::thread::ThreadId,
}

impl SlotMemory for ThreadGated {
    fn slot_count(&self) -> usize {
        self.inner.slot_count()
    }
    fn record_bytes(&self) -> usize {
        self.inner.record_bytes()
    }
    fn load(&self, slot: usize, record: &dyn RecordSource) -> Result<()> {
        if std::thread::current().id() == self.free {
            self.inner.loads.fetch_add(1, Ordering::SeqCst);
            return self.inner.slots.load(slot, record);
        }
        self.inner.load(slot, record)
    }
}

/// A pool of 8 gated slots over `f`'s store whose one IO thread has taken a prefetch (expert 4 of
/// `layer`) and blocks at the closed gate, where loads on any thread but this one wait: only this
/// thread can read. Bind all three (the gate's opener last, so it drops before the pool, whose
/// drop joins the thread).
fn pool_with_its_thread_blocked(f: &Fixture, layer: usize) -> (ExpertPool<ThreadGated>, Arc<GatedSlots>, OpenOnDrop) {
    let gated = GatedSlots::new(8, f.store.record_bytes());
    let memory = Arc::new(ThreadGated { inner: gated.clone(), free: std::thread::current().id() });
    let pool = ExpertPool::new(Arc::clone(&f.store), memory, 1).unwrap();
    let open = OpenOnDrop(gated.clone());
    assert_eq!(pool.prefetch(layer, &[4]), 1);
    while gated.entered.load(Ordering::SeqCst) == 0 {
        std::thread::yield_now();
    }
    (pool, gated, open)
}

#[test]
fn a_lease_counts_the_reads_in_flight_and_the_misses_it_queued() {
    let f = fixture();
    // Expert 4 of layer 3 is being read (the IO thread's prefetch, blocked at the gate).
    let (pool, _gated, _open) = pool_with_its_thread_blocked(&f, 3);
    let lease = pool.acquire_loading(3, &[4, 2, 5]).unwrap();
    assert_eq!((lease.inflight(), lease.misses()), (1, 2));
    drop(lease);
    // Read by this thread above: hits now.
    let again = pool.acquire_loading(3, &[2, 5]).unwrap();
    assert_eq!((again.inflight(), again.misses()), (0, 0));
}

#[test]
fn a_step_can_run_its_own_queued_reads() {
    let f = fixture();
    // The one IO thread takes a prefetch of expert 4 of layer 1 and blocks at the gate: only this
    // thread can read now.
    let (pool, gated, _open) = pool_with_its_thread_blocked(&f, 1);
    // Two misses are queued with no thread free to read them; the step reads them itself.
    let lease = pool.acquire(0, &[2, 5]).unwrap();
    assert!(!lease.is_ready(0) && !lease.is_ready(1));
    assert_eq!(pool.load_queued().unwrap(), 2);
    assert!(lease.is_ready(0) && lease.is_ready(1));
    for (i, e) in lease.entries().iter().enumerate() {
        lease.wait(i).unwrap();
        // SAFETY: the entry is loaded and pinned by the lease.
        let got = unsafe { gated.slots.slot(e.slot) };
        assert!(got == f.records[0][e.expert].as_slice(), "expert {}", e.expert);
    }
    // The prefetch is not a step's read: it stays with the IO thread.
    assert_eq!(pool.load_queued().unwrap(), 0);
    gated.open();
    drop(lease);
    let t = std::time::Instant::now();
    while pool.stats().total.bytes_read < 3 * f.store.record_bytes() as u64 && t.elapsed().as_secs() < 30 {
        std::thread::yield_now();
    }
    assert_eq!(gated.loads.load(Ordering::SeqCst), 3);
    let s = pool.stats();
    assert_eq!((s.total.misses, s.total.bytes_read), (2, 3 * f.store.record_bytes() as u64));
}

#[test]
fn a_caller_runs_the_prefetches_it_queued_without_waking_a_thread() {
    let f = fixture();
    // The one IO thread takes a prefetch of expert 4 of layer 3 and blocks at the gate: only this
    // thread can read now.
    let (pool, gated, _open) = pool_with_its_thread_blocked(&f, 3);
    assert_eq!(pool.prefetch_unwoken(1, &[2, 5]), 2);
    // Already loading: not queued twice.
    assert_eq!(pool.prefetch_unwoken(1, &[5]), 0);
    assert_eq!(pool.load_prefetches(), 2);
    assert_eq!(gated.loads.load(Ordering::SeqCst), 2);
    assert_eq!(pool.load_prefetches(), 0);
    // Both are resident: a step's request hits them.
    let lease = pool.acquire(1, &[5, 2]).unwrap();
    for (i, e) in lease.entries().iter().enumerate() {
        assert!(e.hit && lease.is_ready(i), "expert {}", e.expert);
        // SAFETY: the entry is loaded and pinned by the lease.
        let got = unsafe { gated.slots.slot(e.slot) };
        assert!(got == f.records[1][e.expert].as_slice(), "expert {}", e.expert);
    }
    gated.open();
    drop(lease);
}

/// Opens the gate when dropped, so a failed assertion does not leave an IO thread blocked at it
/// (the pool's drop joins its threads). Declare it after the pool: it drops first.
struct OpenOnDrop(Arc<GatedSlots>);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.open();
    }
}

#[test]
fn acquire_loading_reads_the_misses_on_the_calling_thread() {
    let f = fixture();
    // The one IO thread takes a prefetch of expert 4 of layer 3 and blocks at the gate: only this
    // thread can read now.
    let (pool, gated, _open) = pool_with_its_thread_blocked(&f, 3);
    for (layer, experts) in [(0, vec![1, 3, 5]), (2, vec![0, 1])] {
        let lease = pool.acquire_loading(layer, &experts).unwrap();
        for (i, e) in lease.entries().iter().enumerate() {
            assert!(lease.is_ready(i), "layer {layer} expert {}", e.expert);
            // SAFETY: the entry is loaded and pinned by the lease.
            let got = unsafe { gated.slots.slot(e.slot) };
            assert!(got == f.records[layer][e.expert].as_slice(), "layer {layer} expert {}", e.expert);
        }
    }
    assert_eq!(gated.entered.load(Ordering::SeqCst), 1, "the IO thread took a step's read");
    assert_eq!(pool.stats().total.misses, 5);
}

/// Host slots that log, per thread, the batch hooks and the loads between them; `end_batch` fails
/// on request.
struct Batching {
    slots: HostSlots,
    step: std::thread::ThreadId,
    log: Mutex<Vec<&'static str>>,
    loads: AtomicUsize,
    fail_end: std::sync::atomic::AtomicBool,
}

impl SlotMemory for Batching {
    fn slot_count(&self) -> usize {
        self.slots.slot_count()
    }
    fn record_bytes(&self) -> usize {
        self.slots.record_bytes()
    }
    fn load(&self, slot: usize, record: &dyn RecordSource) -> Result<()> {
        self.loads.fetch_add(1, Ordering::SeqCst);
        if std::thread::current().id() == self.step {
            self.log.lock().unwrap().push("load");
        }
        self.slots.load(slot, record)
    }
    fn begin_batch(&self) {
        self.log.lock().unwrap().push("begin");
    }
    fn end_batch(&self) -> Result<()> {
        self.log.lock().unwrap().push("end");
        anyhow::ensure!(!self.fail_end.load(Ordering::SeqCst), "the batch could not be queued");
        Ok(())
    }
}

#[test]
fn a_step_runs_its_own_reads_as_one_batch() {
    let f = fixture();
    let memory = Arc::new(Batching {
        slots: HostSlots::new(8, f.store.record_bytes()).unwrap(),
        step: std::thread::current().id(),
        log: Mutex::new(Vec::new()),
        loads: AtomicUsize::new(0),
        fail_end: false.into(),
    });
    let pool = ExpertPool::new(Arc::clone(&f.store), Arc::clone(&memory), 1).unwrap();
    let lease = pool.acquire_loading(0, &[1, 3]).unwrap();
    // Every read the step ran lies between the hooks (an IO thread may have taken one first).
    let log = memory.log.lock().unwrap().clone();
    assert_eq!((log.first(), log.last()), (Some(&"begin"), Some(&"end")), "{log:?}");
    assert!(log[1..log.len() - 1].iter().all(|&e| e == "load"), "{log:?}");
    for (i, e) in lease.entries().iter().enumerate() {
        lease.wait(i).unwrap();
        // SAFETY: the entry is loaded and pinned by the lease.
        assert!(unsafe { memory.slots.slot(e.slot) } == f.records[0][e.expert].as_slice());
    }
    assert_eq!(memory.loads.load(Ordering::SeqCst), 2);
    drop(lease);
    // A batch the memory cannot queue fails the acquire that ran it.
    memory.fail_end.store(true, Ordering::SeqCst);
    let e = pool.acquire_loading(1, &[2]).err().expect("the batch failed");
    assert!(format!("{e:#}").contains("could not be queued"), "{e:#}");
}

#[test]
fn recording_resident_hits_is_an_acquire_and_a_drop() {
    let f = fixture();
    // Two pools fed the same steps: one acquires and drops every step, the other records the
    // steps whose experts are all resident with `record_hits` and acquires the rest.
    for eviction in [Eviction::Lru, Eviction::Lrfu { lambda: 0.03 }, Eviction::Adaptive] {
        let (a, b) = (host_pool_evicting(&f, 7, 1, eviction), host_pool_evicting(&f, 7, 1, eviction));
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let (mut recorded, mut refused) = (0, 0);
        for _ in 0..400 {
            let layer = rng.random_range(0..4usize);
            let mut experts: Vec<usize> = (0..6).collect();
            // Mostly the popular experts 0-2, so many steps find everything resident.
            let n = rng.random_range(1..=3usize);
            experts.truncate(if rng.random_bool(0.8) { 3 } else { 6 });
            let mut want = Vec::new();
            while want.len() < n {
                let e = experts[rng.random_range(0..experts.len())];
                if !want.contains(&e) {
                    want.push(e);
                }
            }
            let la = a.acquire(layer, &want).unwrap();
            la.wait_all().unwrap();
            let shape_a = shape(&la);
            drop(la);
            if b.record_hits(layer, &want) {
                recorded += 1;
                assert!(shape_a.iter().all(|e| e.2), "recorded a step the other pool missed: {shape_a:?}");
            } else {
                refused += 1;
                let lb = b.acquire(layer, &want).unwrap();
                lb.wait_all().unwrap();
                assert_eq!(shape(&lb), shape_a, "{}", eviction.label());
            }
        }
        assert!(
            recorded > 50 && refused > 50,
            "both paths should be exercised: {recorded} recorded, {refused} acquired"
        );
        let (sa, sb) = (a.stats(), b.stats());
        assert_eq!(
            (sa.total.routed, sa.total.hits, sa.total.misses, sa.total.evictions),
            (sb.total.routed, sb.total.hits, sb.total.misses, sb.total.evictions),
            "{}",
            eviction.label()
        );
        assert_eq!(a.expert_stats(2), b.expert_stats(2));
        assert_eq!(a.decay(), b.decay());
    }
    // A cache that holds every record keeps no ranks up to date, and counts the same.
    let (a, b) = (host_pool(&f, 24, 1), host_pool(&f, 24, 1));
    for l in 0..4 {
        a.acquire(l, &[0, 1, 2, 3, 4, 5]).unwrap().wait_all().unwrap();
        b.acquire(l, &[0, 1, 2, 3, 4, 5]).unwrap().wait_all().unwrap();
    }
    for step in 0..40usize {
        let want = [step % 6, (step + 2) % 6];
        drop(a.acquire(step % 4, &want).unwrap());
        assert!(b.record_hits(step % 4, &want));
    }
    assert_eq!(a.stats().total.hits, b.stats().total.hits);
    assert_eq!(a.expert_stats(1), b.expert_stats(1));
    // A request an acquire would refuse is not recorded either.
    let pool = host_pool(&f, 7, 1);
    pool.acquire(0, &[1]).unwrap().wait_all().unwrap();
    assert!(!pool.record_hits(0, &[1, 1]));
    assert!(!pool.record_hits(9, &[1]));
    assert!(!pool.record_hits(0, &[1, 2]), "expert 2 is not resident");
    assert!(pool.record_hits(0, &[1]));
    assert_eq!(pool.stats().total.hits, 1);
}

/// Host slots that keep, per slot, the record a device could find there (a hit map's view): a
/// record enters when its load ends and leaves at `retire`. A load into a slot whose record was
/// not retired first, or a retire off the step's thread, is counted as a violation.
struct Retiring {
    slots: HostSlots,
    step: std::thread::ThreadId,
    held: Mutex<Vec<Option<u64>>>,
    retired: AtomicUsize,
    violations: Mutex<Vec<String>>,
}

impl SlotMemory for Retiring {
    fn slot_count(&self) -> usize {
        self.slots.slot_count()
    }
    fn record_bytes(&self) -> usize {
        self.slots.record_bytes()
    }
    fn load(&self, slot: usize, record: &dyn RecordSource) -> Result<()> {
        let at = record.location().map(|(_, at)| at);
        if let Some(old) = self.held.lock().unwrap()[slot] {
            self.violations.lock().unwrap().push(format!("slot {slot} reloaded while it still held record at {old}"));
        }
        self.slots.load(slot, record)?;
        self.held.lock().unwrap()[slot] = at;
        Ok(())
    }
    fn retire(&self, slot: usize) {
        if std::thread::current().id() != self.step {
            self.violations.lock().unwrap().push(format!("slot {slot} retired off the step's thread"));
        }
        self.retired.fetch_add(1, Ordering::SeqCst);
        self.held.lock().unwrap()[slot] = None;
    }
}

#[test]
fn a_slot_is_retired_on_the_deciding_thread_before_its_next_record_loads() {
    let f = fixture();
    let memory = Arc::new(Retiring {
        slots: HostSlots::new(5, f.store.record_bytes()).unwrap(),
        step: std::thread::current().id(),
        held: Mutex::new(vec![None; 5]),
        retired: AtomicUsize::new(0),
        violations: Mutex::new(Vec::new()),
    });
    // IO threads load the prefetches; the step's own misses load on this thread.
    let pool = ExpertPool::new(Arc::clone(&f.store), Arc::clone(&memory), 2).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for _ in 0..300 {
        let (layer, experts) = random_request(&mut rng, 3);
        let lease = pool.acquire_loading(layer, &experts).unwrap();
        lease.wait_all().unwrap();
        // Every entry's slot holds its record, as the memory sees it.
        for e in lease.entries() {
            let want = f.store.manifest.experts.record_index(layer, e.expert) * f.store.record_bytes() as u64;
            assert_eq!(memory.held.lock().unwrap()[e.slot], Some(want), "layer {layer} expert {}", e.expert);
        }
        let next = (layer + 1) % 4;
        pool.prefetch(next, &[rng.random_range(0..6usize)]);
        drop(lease);
    }
    settle(&pool);
    let violations = memory.violations.lock().unwrap().clone();
    assert!(violations.is_empty(), "{violations:?}");
    assert!(memory.retired.load(Ordering::SeqCst) > 100, "few slots were reused");
}
