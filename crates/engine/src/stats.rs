//! Per-layer cache and IO counters of the expert pool.
//!
//! [`PoolCounters`] is what the pool records into: relaxed atomics, a few adds per acquire, per
//! wait and per completed read (never per byte), so recording costs nothing next to the work it
//! describes. [`PoolStats`] is a plain snapshot of them: one [`LayerStats`] row per MoE layer (the
//! store's expert slots: trunk layers in order, then MTP layers) plus the totals.
//!
//! Counting rules (each routed expert lands in exactly one of the first three):
//! - `hits`: resident and loaded when acquired; no IO, ready at once.
//! - `inflight`: already being loaded for an earlier request; joined that read, no second read.
//! - `misses`: a read was queued for it.
//! - `reads` / `read_errors`: reads completed by the IO threads, with their latency in
//!   `read_ns_sum`, `read_ns_max` and the histogram; `bytes_read` counts successful reads only.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use serde::Serialize;

/// Upper bounds (exclusive, microseconds) of the read-latency histogram buckets; one more bucket
/// after them holds everything slower.
pub const LATENCY_BUCKET_BOUNDS_US: [u64; 11] =
    [50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000];
/// Buckets of the read-latency histogram (the bounds above plus the overflow bucket).
pub const LATENCY_BUCKETS: usize = LATENCY_BUCKET_BOUNDS_US.len() + 1;

/// The histogram bucket of a read that took `ns` nanoseconds.
pub fn latency_bucket(ns: u64) -> usize {
    let us = ns / 1_000;
    LATENCY_BUCKET_BOUNDS_US.iter().position(|&b| us < b).unwrap_or(LATENCY_BUCKET_BOUNDS_US.len())
}

/// A human label of bucket `i` (`<50us`, `<1ms`, `>=100ms`).
pub fn latency_bucket_label(i: usize) -> String {
    let show = |us: u64| if us >= 1_000 { format!("{}ms", us as f64 / 1_000.0) } else { format!("{us}us") };
    match LATENCY_BUCKET_BOUNDS_US.get(i) {
        Some(&b) => format!("<{}", show(b)),
        None => format!(">={}", show(LATENCY_BUCKET_BOUNDS_US[LATENCY_BUCKET_BOUNDS_US.len() - 1])),
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
    evictions: AtomicU64,
    prefetched: AtomicU64,
    lookahead_routed: AtomicU64,
    lookahead_correct: AtomicU64,
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
            evictions: self.evictions.load(Relaxed),
            prefetched: self.prefetched.load(Relaxed),
            lookahead_routed: self.lookahead_routed.load(Relaxed),
            lookahead_correct: self.lookahead_correct.load(Relaxed),
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
            &self.evictions,
            &self.prefetched,
            &self.lookahead_routed,
            &self.lookahead_correct,
        ];
        for c in all.into_iter().chain(&self.latency) {
            c.store(0, Relaxed);
        }
    }
}

/// The live counters of a pool, one row per MoE layer. Layer indices out of range are a caller bug
/// and panic (the pool validates layers before recording).
pub struct PoolCounters {
    layers: Vec<LayerCounters>,
}

impl PoolCounters {
    pub fn new(layers: usize) -> PoolCounters {
        PoolCounters { layers: (0..layers).map(|_| LayerCounters::default()).collect() }
    }

    pub fn layers(&self) -> usize {
        self.layers.len()
    }

    /// One acquire of `layer`: how its experts split into hits, joined reads and new reads.
    pub fn record_acquire(&self, layer: usize, hits: u64, inflight: u64, misses: u64) {
        let c = &self.layers[layer];
        c.routed.fetch_add(hits + inflight + misses, Relaxed);
        c.hits.fetch_add(hits, Relaxed);
        c.inflight.fetch_add(inflight, Relaxed);
        c.misses.fetch_add(misses, Relaxed);
    }

    /// A record of `layer` was evicted to make room for another.
    pub fn record_eviction(&self, layer: usize) {
        self.layers[layer].evictions.fetch_add(1, Relaxed);
    }

    /// A read of one record of `layer` finished after `ns` nanoseconds (`bytes` counted only when `ok`).
    pub fn record_read(&self, layer: usize, bytes: u64, ns: u64, ok: bool) {
        let c = &self.layers[layer];
        if ok {
            c.reads.fetch_add(1, Relaxed);
            c.bytes_read.fetch_add(bytes, Relaxed);
        } else {
            c.read_errors.fetch_add(1, Relaxed);
        }
        c.read_ns_sum.fetch_add(ns, Relaxed);
        c.read_ns_max.fetch_max(ns, Relaxed);
        c.latency[latency_bucket(ns)].fetch_add(1, Relaxed);
    }

    /// `n` reads of `layer` were queued by a prefetch (lookahead).
    pub fn record_prefetch(&self, layer: usize, n: u64) {
        self.layers[layer].prefetched.fetch_add(n, Relaxed);
    }

    /// Lookahead for `layer`: of the `routed` experts the step actually used, `correct` were predicted.
    pub fn record_lookahead(&self, layer: usize, routed: u64, correct: u64) {
        let c = &self.layers[layer];
        c.lookahead_routed.fetch_add(routed, Relaxed);
        c.lookahead_correct.fetch_add(correct, Relaxed);
    }

    /// A step blocked `ns` nanoseconds waiting for an expert of `layer` to arrive.
    pub fn record_wait(&self, layer: usize, ns: u64) {
        self.layers[layer].wait_ns.fetch_add(ns, Relaxed);
    }

    /// Zeroes every counter (the resident gauges live in the pool and are not affected).
    pub fn reset(&self) {
        for c in &self.layers {
            c.reset();
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
        PoolStats { layers, total, slots: gauges }
    }
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
    /// Requested experts for which a read was queued.
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
    /// Records evicted to make room.
    pub evictions: u64,
    /// Reads queued by lookahead prefetches.
    pub prefetched: u64,
    /// Routed experts of steps that had a lookahead prediction.
    pub lookahead_routed: u64,
    /// Of those, the ones the lookahead predicted.
    pub lookahead_correct: u64,
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
        self.evictions += o.evictions;
        self.prefetched += o.prefetched;
        self.lookahead_routed += o.lookahead_routed;
        self.lookahead_correct += o.lookahead_correct;
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
