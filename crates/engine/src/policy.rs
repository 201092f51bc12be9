//! Cache policies on a routing trace, offline: what LRU, a frequency-aware policy (LRFU) and the
//! offline optimum (Belady's MIN) would hit with the same number of slots.
//!
//! A trace is the sequence of steps the pool served: per step one MoE layer and its experts, which
//! must all be resident together (a step's experts are pinned). All policies share those rules: an
//! expert of the current step is never evicted, and a hit is an expert already resident. Belady
//! evicts the resident expert whose next use is furthest away, which no online policy can beat, so
//! hit rates are reported as a fraction of its.

use std::collections::{BTreeSet, HashMap};

use serde::Serialize;

/// An expert of a MoE layer.
pub type Key = (u16, u16);

/// One step of the trace: a layer and its (deduplicated) experts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Step {
    pub layer: u16,
    pub experts: Vec<u16>,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub enum Policy {
    /// Least recently used.
    Lru,
    /// LRFU (Lee et al.): each expert's combined recency-frequency is the sum over its past uses of
    /// 2^(-lambda * age); the smallest is evicted. lambda = 1 is close to LRU, lambda -> 0 to LFU.
    Lrfu { lambda: f64 },
    /// Belady's MIN: the resident expert used furthest in the future goes (needs the future).
    Belady,
}

impl Policy {
    pub fn label(&self) -> String {
        match self {
            Policy::Lru => "LRU".into(),
            Policy::Lrfu { lambda } => format!("LRFU(lambda={lambda})"),
            Policy::Belady => "Belady (offline optimum)".into(),
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SimResult {
    pub requests: u64,
    pub hits: u64,
}

impl SimResult {
    pub fn hit_rate(&self) -> f64 {
        if self.requests == 0 { 0.0 } else { self.hits as f64 / self.requests as f64 }
    }
}

/// Replays `trace` on `slots` slots under `policy`. Steps larger than the cache count their excess
/// as misses (they could not all be resident).
pub fn simulate(trace: &[Step], slots: usize, policy: Policy) -> SimResult {
    let mut res = SimResult::default();
    // Next use of each (step index, key), for Belady.
    let next_use: Vec<Vec<usize>> = if let Policy::Belady = policy {
        let mut next: HashMap<Key, usize> = HashMap::new();
        let mut out = vec![Vec::new(); trace.len()];
        for (i, s) in trace.iter().enumerate().rev() {
            out[i] = s.experts.iter().map(|&e| next.get(&(s.layer, e)).copied().unwrap_or(usize::MAX)).collect();
            for &e in &s.experts {
                next.insert((s.layer, e), i);
            }
        }
        out
    } else {
        Vec::new()
    };
    // Eviction priority of every resident key: smallest goes first.
    let mut prio: HashMap<Key, f64> = HashMap::new();
    let mut order: BTreeSet<(OrdF64, Key)> = BTreeSet::new();
    let mut crf: HashMap<Key, (f64, u64)> = HashMap::new(); // LRFU: (value at last use, time of last use)
    for (t, s) in trace.iter().enumerate() {
        let now = t as u64;
        let step: Vec<Key> = s.experts.iter().map(|&e| (s.layer, e)).collect();
        for (j, k) in step.iter().enumerate() {
            res.requests += 1;
            let resident = prio.contains_key(k);
            if resident {
                res.hits += 1;
                order.remove(&(OrdF64(prio[k]), *k));
            } else if prio.len() >= slots {
                // Evict the lowest-priority key not in this step.
                let victim = order.iter().find(|(_, v)| !step.contains(v)).copied();
                match victim {
                    Some(v) => {
                        order.remove(&v);
                        prio.remove(&v.1);
                    }
                    None => continue, // every slot holds this step's experts: this one cannot stay
                }
            }
            let p = match policy {
                Policy::Lru => now as f64,
                Policy::Belady => {
                    let nu = next_use[t][j];
                    // Furthest next use = lowest priority.
                    if nu == usize::MAX { f64::NEG_INFINITY } else { -(nu as f64) }
                }
                Policy::Lrfu { lambda } => {
                    let (v, last) = crf.get(k).copied().unwrap_or((0.0, now));
                    let value = 1.0 + v * 2f64.powf(-lambda * (now - last) as f64);
                    crf.insert(*k, (value, now));
                    // Comparing 2^(-lambda (now - last)) * value across keys at any later time is the
                    // same as comparing log2(value) + lambda * last: time-invariant keys.
                    value.log2() + lambda * now as f64
                }
            };
            prio.insert(*k, p);
            order.insert((OrdF64(p), *k));
        }
    }
    res
}

/// A total order on f64 for the priority set.
#[derive(Clone, Copy, Debug, PartialEq)]
struct OrdF64(f64);
impl Eq for OrdF64 {}
impl PartialOrd for OrdF64 {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for OrdF64 {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&o.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn steps(v: &[&[u16]]) -> Vec<Step> {
        v.iter().map(|e| Step { layer: 0, experts: e.to_vec() }).collect()
    }

    #[test]
    fn lru_and_belady_on_a_classic_sequence() {
        // Single-expert steps: 1 2 3 1 4 1 2 with 2 slots.
        let t = steps(&[&[1], &[2], &[3], &[1], &[4], &[1], &[2]]);
        // LRU: miss miss miss miss miss hit miss -> 1 hit.
        assert_eq!(simulate(&t, 2, Policy::Lru).hits, 1);
        // MIN: 1 2 | 3 evicts 2 (next use 6, vs 1 at 3) | 1 hit | 4 evicts 3 | 1 hit | 2 miss -> 2 hits.
        assert_eq!(simulate(&t, 2, Policy::Belady).hits, 2);
    }

    #[test]
    fn frequency_keeps_a_popular_expert() {
        // Expert 1 is used every other step; a scan of others passes through one slot pair.
        let mut v: Vec<&[u16]> = Vec::new();
        let scan: Vec<[u16; 1]> = (10..40u16).map(|i| [i]).collect();
        for s in &scan {
            v.push(&[1]);
            v.push(s);
            v.push(&scan[0]);
        }
        let t = steps(&v);
        let lru = simulate(&t, 2, Policy::Lru).hit_rate();
        let lrfu = simulate(&t, 2, Policy::Lrfu { lambda: 0.01 }).hit_rate();
        let opt = simulate(&t, 2, Policy::Belady).hit_rate();
        assert!(lrfu > lru, "LRFU {lrfu} should beat LRU {lru} here");
        assert!(opt >= lrfu && opt >= lru);
    }

    #[test]
    fn step_experts_are_never_evicted() {
        // A step of 3 experts on 3 slots: all stay; the next step reuses them all.
        let t = steps(&[&[1, 2, 3], &[3, 2, 1]]);
        for p in [Policy::Lru, Policy::Lrfu { lambda: 0.5 }, Policy::Belady] {
            assert_eq!(simulate(&t, 3, p).hits, 3, "{}", p.label());
        }
    }
}
