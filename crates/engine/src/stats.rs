//! Cache, IO and compute counters of the expert pool, per MoE layer and per expert.
//!
//! [`PoolCounters`] is what the pool (and the backend computing with it) records into: relaxed
//! atomics, a few adds per acquire, per routed expert, per wait, per completed read and per forward
//! (never per byte), so recording costs nothing next to the work it describes
//! (`benchmark/notes-stats.md` measures it). [`PoolStats`] is a plain snapshot of the per-layer
//! counters: one [`LayerStats`] row per MoE layer (the store's expert slots: trunk layers in order,
//! then MTP layers) plus the totals; [`ExpertStats`] one expert's counters and residency;
//! [`ForwardStats`] where the backend's forward time went.
//!
//! Counting rules (each routed expert lands in exactly one of the first three):
//! - `hits`: resident and loaded when acquired; no IO, ready at once.
//! - `inflight`: already being loaded for an earlier request; joined that read, no second read.
//! - `misses`: not in the cache: a read was queued for it, or (the CUDA backend's
//!   `--cpu-experts`) the CPU computed it instead; `cpu_computed` counts the latter.
//! - `reads` / `read_errors`: reads completed by the IO threads, with their latency in
//!   `read_ns_sum`, `read_ns_max` and the histogram; `bytes_read` counts successful reads only.
//!
//! The same split is kept per expert (routed, hits, inflight, misses, reads, evictions, prefetched)
//! in one flat array of atomics, `layers x experts` rows.
//!
//! [`ENABLED`] is false only in a measurement build (the `no-stats` feature), which compiles every
//! `record_*` to nothing so that the cost of recording can be measured against it.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use serde::Serialize;

/// Whether statistics are recorded. False only in the measurement build (`--features
/// cherenkov-engine/no-stats`), where every counter stays 0 and backends skip their clocks.
pub const ENABLED: bool = !cfg!(feature = "no-stats");

/// Upper bounds (inclusive, microseconds) of the read-latency histogram buckets; one more bucket
/// after them holds everything slower. Inclusive like Prometheus' `le`, so bucket `i` of the
/// cumulative exposition is the sum of buckets `0..=i`.
pub const LATENCY_BUCKET_BOUNDS_US: [u64; 11] =
    [50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000];
/// Buckets of the read-latency histogram (the bounds above plus the overflow bucket).
pub const LATENCY_BUCKETS: usize = LATENCY_BUCKET_BOUNDS_US.len() + 1;

/// The histogram bucket of a read that took `ns` nanoseconds: the first bound `b` with
/// `ns <= b` microseconds.
pub fn latency_bucket(ns: u64) -> usize {
    LATENCY_BUCKET_BOUNDS_US.iter().position(|&b| ns <= b * 1_000).unwrap_or(LATENCY_BUCKET_BOUNDS_US.len())
}

/// A human label of bucket `i` (`<=50us`, `<=1ms`, `>100ms`).
pub fn latency_bucket_label(i: usize) -> String {
    let show = |us: u64| if us >= 1_000 { format!("{}ms", us as f64 / 1_000.0) } else { format!("{us}us") };
    match LATENCY_BUCKET_BOUNDS_US.get(i) {
        Some(&b) => format!("<={}", show(b)),
        None => format!(">{}", show(LATENCY_BUCKET_BOUNDS_US[LATENCY_BUCKET_BOUNDS_US.len() - 1])),
    }
}

#[derive(Default)]
struct LayerCounters {
    routed: AtomicU64,
    hits: AtomicU64,
    inflight: AtomicU64,
    misses: AtomicU64,
    reads: AtomicU64,
    read_errors: AtomicU64,
    bytes_read: AtomicU64,
    read_ns_sum: AtomicU64,
    read_ns_max: AtomicU64,
    wait_ns: AtomicU64,
    compute_ns: AtomicU64,
    evictions: AtomicU64,
    prefetched: AtomicU64,
    prefetch_unused: AtomicU64,
    lookahead_predicted: AtomicU64,
    lookahead_routed: AtomicU64,
    lookahead_correct: AtomicU64,
    cpu_computed: AtomicU64,
    latency: [AtomicU64; LATENCY_BUCKETS],
}

impl LayerCounters {
    fn snapshot(&self, resident: usize) -> LayerStats {
        LayerStats {
            routed: self.routed.load(Relaxed),
            hits: self.hits.load(Relaxed),
            inflight: self.inflight.load(Relaxed),
            misses: self.misses.load(Relaxed),
            reads: self.reads.load(Relaxed),
            read_errors: self.read_errors.load(Relaxed),
            bytes_read: self.bytes_read.load(Relaxed),
            read_ns_sum: self.read_ns_sum.load(Relaxed),
            read_ns_max: self.read_ns_max.load(Relaxed),
            wait_ns: self.wait_ns.load(Relaxed),
            compute_ns: self.compute_ns.load(Relaxed),
            evictions: self.evictions.load(Relaxed),
            prefetched: self.prefetched.load(Relaxed),
            prefetch_unused: self.prefetch_unused.load(Relaxed),
            lookahead_predicted: self.lookahead_predicted.load(Relaxed),
            lookahead_routed: self.lookahead_routed.load(Relaxed),
            lookahead_correct: self.lookahead_correct.load(Relaxed),
            cpu_computed: self.cpu_computed.load(Relaxed),
            resident,
            latency: std::array::from_fn(|i| self.latency[i].load(Relaxed)),
        }
    }

    fn reset(&self) {
        let all = [
            &self.routed,
            &self.hits,
            &self.inflight,
            &self.misses,
            &self.reads,
            &self.read_errors,
            &self.bytes_read,
            &self.read_ns_sum,
            &self.read_ns_max,
            &self.wait_ns,
            &self.compute_ns,
            &self.evictions,
            &self.prefetched,
            &self.prefetch_unused,
            &self.lookahead_predicted,
            &self.lookahead_routed,
            &self.lookahead_correct,
            &self.cpu_computed,
        ];
        for c in all.into_iter().chain(&self.latency) {
            c.store(0, Relaxed);
        }
    }
}

/// The counters of one expert (a row of [`PoolCounters`]' flat per-expert array).
#[derive(Default)]
struct ExpertCounters {
    routed: AtomicU64,
    hits: AtomicU64,
    inflight: AtomicU64,
    misses: AtomicU64,
    reads: AtomicU64,
    evictions: AtomicU64,
    prefetched: AtomicU64,
}

impl ExpertCounters {
    fn all(&self) -> [&AtomicU64; 7] {
        [&self.routed, &self.hits, &self.inflight, &self.misses, &self.reads, &self.evictions, &self.prefetched]
    }
}

/// How a routed expert was served by an acquire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Served {
    /// Resident and loaded.
    Hit,
    /// Joined a read already in flight.
    Inflight,
    /// A read was queued.
    Miss,
}

/// The backend's forwards (not per layer).
#[derive(Default)]
struct ForwardCounters {
    forwards: AtomicU64,
    tokens: AtomicU64,
    ns: AtomicU64,
}

/// The live counters of a pool: one row per MoE layer, one per (layer, expert), and the backend's
/// forwards. Layer or expert indices out of range are a caller bug and panic (the pool validates
/// requests before recording).
pub struct PoolCounters {
    layers: Vec<LayerCounters>,
    /// `layer * num_experts + expert`.
    experts: Vec<ExpertCounters>,
    num_experts: usize,
    forward: ForwardCounters,
}

impl PoolCounters {
    pub fn new(layers: usize, num_experts: usize) -> PoolCounters {
        PoolCounters {
            layers: (0..layers).map(|_| LayerCounters::default()).collect(),
            experts: (0..layers * num_experts).map(|_| ExpertCounters::default()).collect(),
            num_experts,
            forward: ForwardCounters::default(),
        }
    }

    pub fn layers(&self) -> usize {
        self.layers.len()
    }

    fn expert(&self, layer: usize, expert: usize) -> &ExpertCounters {
        assert!(expert < self.num_experts, "expert {expert} of a pool of {} experts per layer", self.num_experts);
        &self.experts[layer * self.num_experts + expert]
    }

    /// One acquire of `layer`: how its experts split into hits, joined reads and new reads.
    pub fn record_acquire(&self, layer: usize, hits: u64, inflight: u64, misses: u64) {
        if !ENABLED {
            return;
        }
        let c = &self.layers[layer];
        c.routed.fetch_add(hits + inflight + misses, Relaxed);
        c.hits.fetch_add(hits, Relaxed);
        c.inflight.fetch_add(inflight, Relaxed);
        c.misses.fetch_add(misses, Relaxed);
    }

    /// One routed expert of an acquire and how it was served (the per-expert side of
    /// [`PoolCounters::record_acquire`]).
    pub fn record_routed(&self, layer: usize, expert: usize, served: Served) {
        if !ENABLED {
            return;
        }
        let c = self.expert(layer, expert);
        c.routed.fetch_add(1, Relaxed);
        match served {
            Served::Hit => &c.hits,
            Served::Inflight => &c.inflight,
            Served::Miss => &c.misses,
        }
        .fetch_add(1, Relaxed);
    }

    /// Expert `expert` of `layer` was evicted to make room for another record.
    pub fn record_eviction(&self, layer: usize, expert: usize) {
        if !ENABLED {
            return;
        }
        self.layers[layer].evictions.fetch_add(1, Relaxed);
        self.expert(layer, expert).evictions.fetch_add(1, Relaxed);
    }

    /// A read of expert `expert` of `layer` finished after `ns` nanoseconds (`bytes` counted only
    /// when `ok`).
    pub fn record_read(&self, layer: usize, expert: usize, bytes: u64, ns: u64, ok: bool) {
        if !ENABLED {
            return;
        }
        let c = &self.layers[layer];
        if ok {
            c.reads.fetch_add(1, Relaxed);
            c.bytes_read.fetch_add(bytes, Relaxed);
            self.expert(layer, expert).reads.fetch_add(1, Relaxed);
        } else {
            c.read_errors.fetch_add(1, Relaxed);
        }
        c.read_ns_sum.fetch_add(ns, Relaxed);
        c.read_ns_max.fetch_max(ns, Relaxed);
        c.latency[latency_bucket(ns)].fetch_add(1, Relaxed);
    }

    /// `n` reads of `layer` were queued by a prefetch (lookahead).
    pub fn record_prefetch(&self, layer: usize, n: u64) {
        if !ENABLED {
            return;
        }
        self.layers[layer].prefetched.fetch_add(n, Relaxed);
    }

    /// A record of `layer` that a prefetch read was evicted before any step used it: its read was
    /// wasted.
    pub fn record_prefetch_unused(&self, layer: usize) {
        if !ENABLED {
            return;
        }
        self.layers[layer].prefetch_unused.fetch_add(1, Relaxed);
    }

    /// A prefetch (lookahead) queued a read of expert `expert` of `layer` (the per-expert side of
    /// [`PoolCounters::record_prefetch`]).
    pub fn record_expert_prefetch(&self, layer: usize, expert: usize) {
        if !ENABLED {
            return;
        }
        self.expert(layer, expert).prefetched.fetch_add(1, Relaxed);
    }

    /// Lookahead for `layer`: it predicted `predicted` experts; of the `routed` experts the step
    /// actually used, `correct` were among them.
    pub fn record_lookahead(&self, layer: usize, predicted: u64, routed: u64, correct: u64) {
        if !ENABLED {
            return;
        }
        let c = &self.layers[layer];
        c.lookahead_predicted.fetch_add(predicted, Relaxed);
        c.lookahead_routed.fetch_add(routed, Relaxed);
        c.lookahead_correct.fetch_add(correct, Relaxed);
    }

    /// Of the misses of `layer` just recorded, `n` were computed on the CPU instead of read.
    pub fn record_cpu_computed(&self, layer: usize, n: u64) {
        if !ENABLED {
            return;
        }
        self.layers[layer].cpu_computed.fetch_add(n, Relaxed);
    }

    /// A step blocked `ns` nanoseconds waiting for an expert of `layer` to arrive.
    pub fn record_wait(&self, layer: usize, ns: u64) {
        if !ENABLED {
            return;
        }
        self.layers[layer].wait_ns.fetch_add(ns, Relaxed);
    }

    /// A step spent `ns` nanoseconds computing routed experts of `layer` (waits excluded).
    pub fn record_compute(&self, layer: usize, ns: u64) {
        if !ENABLED {
            return;
        }
        self.layers[layer].compute_ns.fetch_add(ns, Relaxed);
    }

    /// The backend ran one forward of `tokens` tokens in `ns` nanoseconds.
    pub fn record_forward(&self, tokens: u64, ns: u64) {
        if !ENABLED {
            return;
        }
        self.forward.forwards.fetch_add(1, Relaxed);
        self.forward.tokens.fetch_add(tokens, Relaxed);
        self.forward.ns.fetch_add(ns, Relaxed);
    }

    /// Zeroes every counter (the resident gauges live in the pool and are not affected).
    pub fn reset(&self) {
        for c in &self.layers {
            c.reset();
        }
        for c in self.experts.iter().flat_map(|e| e.all()) {
            c.store(0, Relaxed);
        }
        for c in [&self.forward.forwards, &self.forward.tokens, &self.forward.ns] {
            c.store(0, Relaxed);
        }
    }

    /// A snapshot; `resident[l]` is the number of loaded records of layer `l` right now.
    pub fn snapshot(&self, resident: &[usize], gauges: SlotGauges) -> PoolStats {
        let layers: Vec<LayerStats> =
            self.layers.iter().enumerate().map(|(l, c)| c.snapshot(resident.get(l).copied().unwrap_or(0))).collect();
        let mut total = LayerStats::default();
        for s in &layers {
            total.accumulate(s);
        }
        PoolStats { layers, total, slots: gauges, info: Vec::new(), experts_per_layer: self.num_experts }
    }

    /// The counters of the experts of `layer`; `state[e]` is expert `e`'s residency right now and
    /// `record_bytes` the size of one record (for `bytes_read`).
    pub fn expert_snapshot(&self, layer: usize, state: &[Residency], record_bytes: u64) -> Vec<ExpertStats> {
        (0..self.num_experts)
            .map(|e| {
                let c = self.expert(layer, e);
                let reads = c.reads.load(Relaxed);
                ExpertStats {
                    expert: e,
                    state: state.get(e).copied().unwrap_or(Residency::Absent),
                    routed: c.routed.load(Relaxed),
                    hits: c.hits.load(Relaxed),
                    inflight: c.inflight.load(Relaxed),
                    misses: c.misses.load(Relaxed),
                    reads,
                    bytes_read: reads * record_bytes,
                    evictions: c.evictions.load(Relaxed),
                    prefetched: c.prefetched.load(Relaxed),
                }
            })
            .collect()
    }

    /// The forwards so far and how their time split (no lock; a few loads per layer).
    pub fn forward_stats(&self) -> ForwardStats {
        let (mut experts_ns, mut wait_ns) = (0, 0);
        for c in &self.layers {
            experts_ns += c.compute_ns.load(Relaxed);
            wait_ns += c.wait_ns.load(Relaxed);
        }
        ForwardStats {
            forwards: self.forward.forwards.load(Relaxed),
            tokens: self.forward.tokens.load(Relaxed),
            total_ns: self.forward.ns.load(Relaxed),
            experts_ns,
            wait_ns,
        }
    }
}

/// Where an expert's record is at the moment of a snapshot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Residency {
    /// Not in the pool.
    #[default]
    Absent,
    /// A slot is being filled (a miss or a prefetch).
    Loading,
    /// Loaded and usable.
    Resident,
}

/// One expert's counters and residency.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ExpertStats {
    pub expert: usize,
    pub state: Residency,
    /// Steps that routed to it (`hits + inflight + misses`).
    pub routed: u64,
    pub hits: u64,
    pub inflight: u64,
    pub misses: u64,
    /// Successful reads of its record (misses and prefetches).
    pub reads: u64,
    /// `reads` x the record size.
    pub bytes_read: u64,
    /// Times its record was evicted.
    pub evictions: u64,
    /// Reads of it queued by lookahead prefetches.
    pub prefetched: u64,
}

impl ExpertStats {
    pub fn hit_rate(&self) -> Option<f64> {
        (self.routed > 0).then(|| self.hits as f64 / self.routed as f64)
    }
}

/// Forwards of a backend and where their time went (host clocks). `experts_ns` and `wait_ns` are
/// the sums of the layers' `compute_ns` and `wait_ns`; the rest of a forward is `dense_ns`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ForwardStats {
    /// Calls of the backend's forward (a prefill chunk or one decode step each).
    pub forwards: u64,
    /// Tokens those forwards processed.
    pub tokens: u64,
    /// Wall time of the forwards, ns.
    pub total_ns: u64,
    /// Computing routed experts (waits excluded), ns.
    pub experts_ns: u64,
    /// Blocked on expert reads, ns.
    pub wait_ns: u64,
}

impl ForwardStats {
    /// Everything that is neither routed experts nor waiting: embeddings, attention and DeltaNet,
    /// PLE, hyper-connections, routers, shared experts, the head, and bookkeeping.
    pub fn dense_ns(&self) -> u64 {
        self.total_ns.saturating_sub(self.experts_ns + self.wait_ns)
    }

    /// `self - earlier`, counter by counter (what happened between two snapshots).
    pub fn since(&self, earlier: &ForwardStats) -> ForwardStats {
        ForwardStats {
            forwards: self.forwards.saturating_sub(earlier.forwards),
            tokens: self.tokens.saturating_sub(earlier.tokens),
            total_ns: self.total_ns.saturating_sub(earlier.total_ns),
            experts_ns: self.experts_ns.saturating_sub(earlier.experts_ns),
            wait_ns: self.wait_ns.saturating_sub(earlier.wait_ns),
        }
    }
}

/// A MoE layer as the store describes it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct LayerInfo {
    /// The tensor prefix: `layers.3`, `mtp.layers.0`.
    pub name: String,
    /// The precision of its expert records (`q4g64`; `gate_proj q4g64, up_proj q4g64, down_proj
    /// q8g64` when the matrices differ). Every record of a layer has the same layout, so a resident
    /// expert of the layer is held in this precision.
    pub precision: String,
}

/// How the pool's slots are used at the moment of a snapshot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SlotGauges {
    /// Slots in the pool.
    pub slots: usize,
    /// Bytes of one slot (one expert record).
    pub record_bytes: usize,
    /// Slots holding nothing.
    pub free: usize,
    /// Slots whose record is being read.
    pub loading: usize,
    /// Slots pinned by at least one live lease.
    pub pinned: usize,
    /// Acquires blocked until reads nobody holds any more finish and free their slots.
    pub blocked_acquires: usize,
}

/// The counters of one MoE layer (or their totals).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct LayerStats {
    /// Experts requested (`hits + inflight + misses`).
    pub routed: u64,
    /// Requested experts that were resident and loaded.
    pub hits: u64,
    /// Requested experts whose read was already in flight (joined, not read again).
    pub inflight: u64,
    /// Requested experts not in the cache: a read was queued, or the CPU computed them
    /// (`cpu_computed`).
    pub misses: u64,
    /// Reads completed successfully.
    pub reads: u64,
    /// Reads that failed (IO error or checksum mismatch).
    pub read_errors: u64,
    /// Bytes of successful reads.
    pub bytes_read: u64,
    /// Sum of read latencies (queueing excluded: from the start of the read to its end), ns.
    pub read_ns_sum: u64,
    /// Slowest read, ns.
    pub read_ns_max: u64,
    /// Time steps spent blocked on reads, ns: in `Lease::wait`, and in `acquire` when it waits for
    /// reads whose leases are gone to free their slots.
    pub wait_ns: u64,
    /// Time steps spent computing this layer's routed experts (waits excluded), ns, as the backend
    /// measures it with host clocks.
    pub compute_ns: u64,
    /// Records evicted to make room.
    pub evictions: u64,
    /// Reads queued by lookahead prefetches.
    pub prefetched: u64,
    /// Records a prefetch read that were evicted before any step used them (wasted reads; records
    /// still resident and unused at the snapshot are not counted).
    pub prefetch_unused: u64,
    /// Experts the lookahead predicted for this layer (at most top-k per prediction).
    pub lookahead_predicted: u64,
    /// Routed experts of steps that had a lookahead prediction.
    pub lookahead_routed: u64,
    /// Of those, the ones the lookahead predicted.
    pub lookahead_correct: u64,
    /// Misses computed on the CPU instead of read (the CUDA backend's `--cpu-experts`).
    pub cpu_computed: u64,
    /// Records resident (loaded) at the snapshot.
    pub resident: usize,
    /// Read-latency histogram, buckets as in [`LATENCY_BUCKET_BOUNDS_US`].
    pub latency: [u64; LATENCY_BUCKETS],
}

impl LayerStats {
    fn accumulate(&mut self, o: &LayerStats) {
        self.routed += o.routed;
        self.hits += o.hits;
        self.inflight += o.inflight;
        self.misses += o.misses;
        self.reads += o.reads;
        self.read_errors += o.read_errors;
        self.bytes_read += o.bytes_read;
        self.read_ns_sum += o.read_ns_sum;
        self.read_ns_max = self.read_ns_max.max(o.read_ns_max);
        self.wait_ns += o.wait_ns;
        self.compute_ns += o.compute_ns;
        self.evictions += o.evictions;
        self.prefetched += o.prefetched;
        self.prefetch_unused += o.prefetch_unused;
        self.lookahead_predicted += o.lookahead_predicted;
        self.lookahead_routed += o.lookahead_routed;
        self.lookahead_correct += o.lookahead_correct;
        self.cpu_computed += o.cpu_computed;
        self.resident += o.resident;
        for (a, b) in self.latency.iter_mut().zip(&o.latency) {
            *a += b;
        }
    }

    /// Share of routed experts that were resident (`hits / routed`); `None` when nothing was routed.
    pub fn hit_rate(&self) -> Option<f64> {
        (self.routed > 0).then(|| self.hits as f64 / self.routed as f64)
    }

    /// Share of the routed experts the lookahead predicted; `None` without lookahead.
    pub fn lookahead_accuracy(&self) -> Option<f64> {
        (self.lookahead_routed > 0).then(|| self.lookahead_correct as f64 / self.lookahead_routed as f64)
    }

    /// Share of the lookahead's predictions the step then used (`lookahead_correct /
    /// lookahead_predicted`); `None` without predictions.
    pub fn lookahead_precision(&self) -> Option<f64> {
        (self.lookahead_predicted > 0).then(|| self.lookahead_correct as f64 / self.lookahead_predicted as f64)
    }

    /// Share of routed experts that needed no new read (`(hits + inflight) / routed`).
    pub fn no_read_rate(&self) -> Option<f64> {
        (self.routed > 0).then(|| (self.hits + self.inflight) as f64 / self.routed as f64)
    }

    /// Mean latency of completed reads (successful or not), ns.
    pub fn mean_read_ns(&self) -> Option<f64> {
        let n = self.reads + self.read_errors;
        (n > 0).then(|| self.read_ns_sum as f64 / n as f64)
    }
}

/// A snapshot of a pool's counters: one row per MoE layer, their totals and the slot gauges.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PoolStats {
    /// Indexed by MoE layer (the store's expert slot).
    pub layers: Vec<LayerStats>,
    pub total: LayerStats,
    pub slots: SlotGauges,
    /// Name and precision per MoE layer (empty when the snapshot did not come from a pool).
    pub info: Vec<LayerInfo>,
    /// Experts per MoE layer (0 when the snapshot did not come from a pool).
    pub experts_per_layer: usize,
}

impl PoolStats {
    /// Hit rate over all layers.
    pub fn hit_rate(&self) -> Option<f64> {
        self.total.hit_rate()
    }
}

fn pct(x: Option<f64>) -> String {
    x.map_or_else(|| "-".to_string(), |v| format!("{:.1}%", v * 100.0))
}

fn ms(ns: u64) -> String {
    format!("{:.2}ms", ns as f64 / 1e6)
}

impl fmt::Display for PoolStats {
    /// A small table: one line per layer that saw traffic, then the totals, the read-latency
    /// histogram and the slot gauges.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{:>6} {:>8} {:>7} {:>8} {:>9} {:>10} {:>10} {:>10} {:>10} {:>9}",
            "layer", "routed", "hit", "misses", "errors", "read", "mean read", "max read", "waited", "resident"
        )?;
        let row = |f: &mut fmt::Formatter<'_>, name: &str, s: &LayerStats| {
            writeln!(
                f,
                "{:>6} {:>8} {:>7} {:>8} {:>9} {:>10} {:>10} {:>10} {:>10} {:>9}",
                name,
                s.routed,
                pct(s.hit_rate()),
                s.misses,
                s.read_errors,
                crate::residency::format_bytes(s.bytes_read),
                s.mean_read_ns().map_or_else(|| "-".to_string(), |n| ms(n as u64)),
                ms(s.read_ns_max),
                ms(s.wait_ns),
                s.resident
            )
        };
        for (l, s) in self.layers.iter().enumerate() {
            if s.routed > 0 || s.resident > 0 {
                row(f, &l.to_string(), s)?;
            }
        }
        row(f, "total", &self.total)?;
        let hist: Vec<String> = (0..LATENCY_BUCKETS)
            .filter(|&i| self.total.latency[i] > 0)
            .map(|i| format!("{} {}", latency_bucket_label(i), self.total.latency[i]))
            .collect();
        if !hist.is_empty() {
            writeln!(f, "read latency: {}", hist.join(", "))?;
        }
        let g = &self.slots;
        write!(
            f,
            "slots: {} x {} ({} free, {} loading, {} pinned), {} evictions",
            g.slots,
            crate::residency::format_bytes(g.record_bytes as u64),
            g.free,
            g.loading,
            g.pinned,
            self.total.evictions
        )
    }
}
