//! Cache policies on a routing trace, offline: what LRU, a frequency-aware policy (LRFU) and the
//! offline optimum (Belady's MIN) would hit with the same number of slots.
//!
//! A trace is the sequence of steps the pool served: per step one MoE layer and its experts, which
//! must all be resident together (a step's experts are pinned). All policies share those rules: an
//! expert of the current step is never evicted, and a hit is an expert already resident. Belady
//! evicts the resident expert whose next use is furthest away, which no online policy can beat, so
//! hit rates are reported as a fraction of its.
//!
//! The online policies are replayed exactly as the pool ([`crate::residency`]) runs them: every
//! expert of a step is stamped with a tick in request order (the LRU key, and the tie-break of the
//! others), and LRFU's clock counts tokens: a step whose layer is not above the previous step's
//! starts a new token. So a trace replayed here and through a pool with the same eviction gives
//! the same hits (`crates/engine/tests/residency.rs` checks it).

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
    /// 2^(-lambda * age in tokens); the smallest is evicted. A large lambda is LRU, lambda = 0 LFU.
    Lrfu { lambda: f64 },
    /// Adaptive LRFU ([`Adaptive`]): LRFU whose decay is, every [`ADAPTIVE_WINDOW`] tokens, the one
    /// of [`ADAPTIVE_LAMBDAS`] whose own cache would have hit most lately.
    Adaptive,
    /// Belady's MIN: the resident expert used furthest in the future goes (needs the future).
    Belady,
}

impl Policy {
    pub fn label(&self) -> String {
        match self {
            Policy::Lru => "LRU".into(),
            Policy::Lrfu { lambda } => format!("LRFU(lambda={lambda})"),
            Policy::Adaptive => "adaptive LRFU".into(),
            Policy::Belady => "Belady (offline optimum)".into(),
        }
    }
}

/// LRFU's state of one expert: its combined recency-frequency value (CRF) at its last use, and
/// that use's time in tokens. It outlives the expert's residency, as in LRFU's paper.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Crf {
    value: f64,
    at: u64,
}

impl Crf {
    /// The CRF this expert would have if used at `now`: 1 + its value decayed since its last use.
    fn after_use(&self, now: u64, lambda: f64) -> f64 {
        1.0 + self.value * 2f64.powf(-lambda * now.saturating_sub(self.at) as f64)
    }

    /// Records a use at `now` (tokens) and returns the expert's eviction priority (smaller goes
    /// first).
    pub fn touch(&mut self, now: u64, lambda: f64) -> f64 {
        *self = Crf { value: self.after_use(now, lambda), at: now };
        Crf::priority(self.value, now, lambda)
    }

    /// The priority a use at `now` would give, without recording the use (a prefetched record
    /// ranks as if used now, but is not counted as a use until a step asks for it).
    pub fn peek(&self, now: u64, lambda: f64) -> f64 {
        Crf::priority(self.after_use(now, lambda), now, lambda)
    }

    /// Comparing value * 2^(-lambda (t - at)) across experts at any later time t is comparing
    /// log2(value) + lambda * at: a key that does not change while the expert is not used.
    fn priority(value: f64, at: u64, lambda: f64) -> f64 {
        value.log2() + lambda * at as f64
    }

    /// The eviction priority of the expert's last use (as [`Crf::touch`] returned it), under
    /// `lambda`: what a cache re-ranks its records by when its decay changes.
    pub fn last_priority(&self, lambda: f64) -> f64 {
        Crf::priority(self.value, self.at, lambda)
    }
}

/// The decays adaptive LRFU chooses among (per token: half-lives of about 7, 33, 100 and 330
/// tokens). On the synthetic traces of `benchmark/notes-policy.md` the slowest is best while
/// popularity stays put and 0.03-0.1 once it drifts.
pub const ADAPTIVE_LAMBDAS: [f64; 4] = [0.1, 0.03, 0.01, 0.003];
/// Tokens between two choices of adaptive LRFU's decay.
pub const ADAPTIVE_WINDOW: u64 = 16;
/// What each window keeps of a candidate's hits so far (the rest is forgotten).
pub const ADAPTIVE_KEEP: f64 = 0.9;
/// The decay adaptive LRFU starts with (its index: 0.03, the best fixed one under drift).
pub const ADAPTIVE_START: usize = 1;
/// Adaptive LRFU's ghost caches replay one MoE layer in this many (layers 0, 4, 8, ...) with as
/// large a share of the slots: the choice of decay at a quarter of the host time.
pub const ADAPTIVE_SAMPLE: usize = 4;

/// Adaptive LRFU's choice of decay. A ghost cache per candidate of [`ADAPTIVE_LAMBDAS`] (keys and
/// ranks only) replays the steps of one MoE layer in [`ADAPTIVE_SAMPLE`], with that share of the
/// real cache's slots, under its own decay and counts its hits; every [`ADAPTIVE_WINDOW`] tokens the candidate with the most hits (older windows'
/// hits weighed down by [`ADAPTIVE_KEEP`] per window) becomes the decay the real cache ranks by.
/// The real cache keeps each expert's LRFU value under every candidate, so switching re-ranks its
/// records with their own histories. The simulator and the pool ([`crate::residency`]) share this
/// type, so they choose alike.
#[derive(Clone, Debug)]
pub struct Adaptive {
    ghosts: Vec<Ghost>,
    hits: Vec<f64>,
    current: usize,
}

impl Adaptive {
    /// For a cache of `slots` slots over `layers` MoE layers.
    pub fn new(slots: usize, layers: usize) -> Adaptive {
        let sampled = layers.max(1).div_ceil(ADAPTIVE_SAMPLE);
        let slots = (slots * sampled).div_ceil(layers.max(1)).max(1);
        Adaptive {
            ghosts: ADAPTIVE_LAMBDAS.iter().map(|&lambda| Ghost::new(lambda, slots)).collect(),
            hits: vec![0.0; ADAPTIVE_LAMBDAS.len()],
            current: ADAPTIVE_START,
        }
    }

    /// The index of the decay in use (into [`ADAPTIVE_LAMBDAS`]).
    pub fn current(&self) -> usize {
        self.current
    }

    /// Token `token` begins: at a window's end, the best candidate becomes current. Returns the new
    /// index when it changed (the cache must then re-rank its records).
    pub fn new_token(&mut self, token: u64) -> Option<usize> {
        if token == 0 || !token.is_multiple_of(ADAPTIVE_WINDOW) {
            return None;
        }
        let best = (0..self.hits.len()).fold(self.current, |b, i| if self.hits[i] > self.hits[b] { i } else { b });
        self.hits.iter_mut().for_each(|h| *h *= ADAPTIVE_KEEP);
        (best != self.current).then(|| {
            self.current = best;
            best
        })
    }

    /// Replays one step (a layer's experts, at token `token`) in every ghost cache, if its layer
    /// is one of the sampled.
    pub fn observe(&mut self, step: &[Key], token: u64) {
        if step.first().is_none_or(|k| !(k.0 as usize).is_multiple_of(ADAPTIVE_SAMPLE)) {
            return;
        }
        for (g, h) in self.ghosts.iter_mut().zip(self.hits.iter_mut()) {
            *h += g.step(step, token) as f64;
        }
    }
}

/// One candidate's ghost cache for [`Adaptive`]: LRFU with a fixed decay over keys alone.
#[derive(Clone, Debug)]
struct Ghost {
    lambda: f64,
    slots: usize,
    tick: u64,
    rank: HashMap<Key, (OrdF64, u64)>,
    order: BTreeSet<(OrdF64, u64, Key)>,
    crf: HashMap<Key, Crf>,
}

impl Ghost {
    fn new(lambda: f64, slots: usize) -> Ghost {
        Ghost { lambda, slots, tick: 0, rank: HashMap::new(), order: BTreeSet::new(), crf: HashMap::new() }
    }

    /// One step under the simulator's rules; returns its hits.
    fn step(&mut self, step: &[Key], token: u64) -> u64 {
        let mut hits = 0;
        for k in step {
            self.tick += 1;
            if let Some(&(p, tk)) = self.rank.get(k) {
                hits += 1;
                self.order.remove(&(p, tk, *k));
            } else if self.rank.len() >= self.slots {
                match self.order.iter().find(|(_, _, v)| !step.contains(v)).copied() {
                    Some(v) => {
                        self.order.remove(&v);
                        self.rank.remove(&v.2);
                    }
                    None => continue,
                }
            }
            let p = self.crf.entry(*k).or_default().touch(token, self.lambda);
            self.rank.insert(*k, (OrdF64(p), self.tick));
            self.order.insert((OrdF64(p), self.tick, *k));
        }
        hits
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
    simulate_from(trace, 0, slots, policy)
}

/// [`simulate`], counting only the requests of steps `counted_from..`: the steps before fill the
/// cache as they filled the real one (a benchmark's prompt and warm-up tokens), so a policy is
/// not charged for misses its measured counterpart never had.
pub fn simulate_from(trace: &[Step], counted_from: usize, slots: usize, policy: Policy) -> SimResult {
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
    // Eviction rank of every resident key: (priority, tick); the smallest goes first.
    let mut rank: HashMap<Key, (OrdF64, u64)> = HashMap::new();
    let mut order: BTreeSet<(OrdF64, u64, Key)> = BTreeSet::new();
    let mut crf: HashMap<Key, Crf> = HashMap::new();
    // Adaptive LRFU: its choice, and every key's value under each candidate decay.
    let layers = trace.iter().map(|s| s.layer as usize + 1).max().unwrap_or(1);
    let mut adaptive = Adaptive::new(slots, layers);
    let mut crfs: HashMap<Key, [Crf; ADAPTIVE_LAMBDAS.len()]> = HashMap::new();
    let (mut tick, mut token, mut last_layer) = (0u64, 0u64, None);
    for (t, s) in trace.iter().enumerate() {
        if last_layer.is_some_and(|l| s.layer <= l) {
            token += 1;
            if let (Policy::Adaptive, Some(now)) = (policy, adaptive.new_token(token)) {
                // Re-rank every resident key by its own history under the new decay.
                order.clear();
                for (k, r) in rank.iter_mut() {
                    r.0 = OrdF64(crfs[k][now].last_priority(ADAPTIVE_LAMBDAS[now]));
                    order.insert((r.0, r.1, *k));
                }
            }
        }
        last_layer = Some(s.layer);
        let step: Vec<Key> = s.experts.iter().map(|&e| (s.layer, e)).collect();
        if let Policy::Adaptive = policy {
            adaptive.observe(&step, token);
        }
        let counted = t >= counted_from;
        for (j, k) in step.iter().enumerate() {
            res.requests += counted as u64;
            tick += 1;
            if let Some(&(p, tk)) = rank.get(k) {
                res.hits += counted as u64;
                order.remove(&(p, tk, *k));
            } else if rank.len() >= slots {
                // Evict the lowest-ranked key not in this step.
                match order.iter().find(|(_, _, v)| !step.contains(v)).copied() {
                    Some(v) => {
                        order.remove(&v);
                        rank.remove(&v.2);
                    }
                    None => continue, // every slot holds this step's experts: this one cannot stay
                }
            }
            let p = match policy {
                Policy::Lru => 0.0,
                Policy::Belady => {
                    let nu = next_use[t][j];
                    // Furthest next use = lowest priority.
                    if nu == usize::MAX { f64::NEG_INFINITY } else { -(nu as f64) }
                }
                Policy::Lrfu { lambda } => crf.entry(*k).or_default().touch(token, lambda),
                Policy::Adaptive => {
                    let c = crfs.entry(*k).or_default();
                    let now = adaptive.current();
                    let mut p = 0.0;
                    for (i, x) in c.iter_mut().enumerate() {
                        let q = x.touch(token, ADAPTIVE_LAMBDAS[i]);
                        if i == now {
                            p = q;
                        }
                    }
                    p
                }
            };
            rank.insert(*k, (OrdF64(p), tick));
            order.insert((OrdF64(p), tick, *k));
        }
    }
    res
}

/// The share of a step's experts that the previous step of the same layer also used (the
/// consecutive-token share, on a decode trace); `None` when no layer has two steps.
pub fn consecutive_share(trace: &[Step]) -> Option<f64> {
    let mut previous: HashMap<u16, &[u16]> = HashMap::new();
    let (mut shared, mut counted) = (0u64, 0u64);
    for s in trace {
        if let Some(p) = previous.insert(s.layer, &s.experts) {
            shared += s.experts.iter().filter(|e| p.contains(e)).count() as u64;
            counted += s.experts.len() as u64;
        }
    }
    (counted > 0).then(|| shared as f64 / counted as f64)
}

/// A total order on f64 for the priority set.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct OrdF64(pub(crate) f64);
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
    fn counting_from_a_step_replays_the_steps_before_without_counting_them() {
        let t = steps(&[&[1], &[2], &[3], &[1], &[4], &[1], &[2]]);
        // LRU from step 3: 1 miss, 4 miss, 1 hit, 2 miss (the first three steps only fill).
        let r = simulate_from(&t, 3, 2, Policy::Lru);
        assert_eq!((r.requests, r.hits), (4, 1));
        // Steps 1 2 fill two slots; from step 2 on: 2 hits of 2.
        let t = steps(&[&[1], &[2], &[1], &[2]]);
        let r = simulate_from(&t, 2, 2, Policy::Belady);
        assert_eq!((r.requests, r.hits), (2, 2));
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

    /// The policy study of `benchmark/notes-policy.md`: LRU, LRFU and Belady on traces of the
    /// calibrated synthetic routers. Run with
    /// `cargo test -p cherenkov-engine --release --lib -- --ignored --nocapture policy_study`.
    #[test]
    #[ignore]
    fn policy_study() {
        use crate::routing::{ModelLogits, Skew, synthetic_trace};
        let (layers, experts, k, tokens) = (8, 512, 10, 2000);
        let skew = Skew::default();
        let random_net = ModelLogits::Constant { jitter: 0.05 };
        // A topic change every 250 tokens: each segment reshuffles which experts are popular.
        let drift: Vec<Step> = (0..8)
            .flat_map(|i| synthetic_trace(Skew { seed: 100 + i, ..skew }, random_net, layers, tokens / 8, experts, k))
            .collect();
        let traces = [
            ("random network (constant model logits)", synthetic_trace(skew, random_net, layers, tokens, experts, k)),
            ("random per-token model logits", synthetic_trace(skew, ModelLogits::Random, layers, tokens, experts, k)),
            ("random network, popularity reshuffled every 250 tokens", drift),
            (
                "random network, recency-heavy skew (popularity=0.35,reuse=1)",
                synthetic_trace(Skew { popularity: 0.35, reuse: 1.0, ..skew }, random_net, layers, tokens, experts, k),
            ),
        ];
        let lambdas = [1.0, 0.1, 0.05, 0.03, 0.02, 0.01, 0.003, 0.0];
        println!("skew {}, {layers} MoE layers x {tokens} tokens, {experts} experts top-{k}\n", skew.label());
        for (name, trace) in &traces {
            let share = consecutive_share(trace).unwrap();
            println!("### {name}: consecutive-token share {:.1}%\n", 100.0 * share);
            let mut head = "| policy |".to_string();
            let mut rule = "| --- |".to_string();
            let fracs = [0.10, 0.17, 0.27];
            let slots: Vec<usize> = fracs.iter().map(|f| (f * (layers * experts) as f64) as usize).collect();
            for (f, s) in fracs.iter().zip(&slots) {
                head += &format!(" {:.0}% cached ({s} slots) |", 100.0 * f);
                rule += " --- |";
            }
            println!("{head}\n{rule}");
            let opt: Vec<f64> = slots.iter().map(|&s| simulate(trace, s, Policy::Belady).hit_rate()).collect();
            let mut policies = vec![Policy::Lru];
            policies.extend(lambdas.iter().map(|&lambda| Policy::Lrfu { lambda }));
            policies.extend([Policy::Adaptive, Policy::Belady]);
            for p in policies {
                let mut line = format!("| {} |", p.label());
                for (i, &s) in slots.iter().enumerate() {
                    let h = simulate(trace, s, p).hit_rate();
                    line += &format!(" {:.1}% ({:.1}% of Belady) |", 100.0 * h, 100.0 * h / opt[i]);
                }
                println!("{line}");
            }
            println!();
        }

        // What a lookahead can predict on the random network: the model's logits, popularity, reuse
        // and its estimate of the noise of the token it predicts for (`foresight`).
        let r = crate::routing::SkewedRouting::new(skew);
        let base: Vec<Vec<f32>> = (0..layers).map(|l| crate::routing::normals(l as u64, experts)).collect();
        let (mut correct, mut total) = (0usize, 0usize);
        for _ in 0..tokens {
            for (l, logits) in base.iter().enumerate() {
                let guess = r.predict(l, logits, k);
                let chosen = r.route(l, logits, k, true);
                correct += chosen.iter().filter(|c| guess.contains(&c.0)).count();
                total += k;
            }
        }
        println!(
            "Lookahead on the random network (a constant logit vector per layer): {:.1}% of the routed experts predicted.",
            100.0 * correct as f64 / total as f64
        );
    }

    #[test]
    fn adaptive_lrfu_moves_to_the_decay_whose_ghost_hits_most() {
        use crate::routing::{ModelLogits, Skew, synthetic_trace};
        // Stationary popularity: the slowest decay hits most, and adaptive LRFU (starting at 0.03)
        // moves to it and ends up hitting more than LRFU(0.03).
        let trace = synthetic_trace(Skew::default(), ModelLogits::Constant { jitter: 0.05 }, 4, 600, 128, 8);
        let slots = 4 * 128 / 5;
        let mut a = Adaptive::new(slots, 4);
        let (mut token, mut last) = (0u64, None);
        for s in &trace {
            if last.is_some_and(|l| s.layer <= l) {
                token += 1;
                a.new_token(token);
            }
            last = Some(s.layer);
            let step: Vec<Key> = s.experts.iter().map(|&e| (s.layer, e)).collect();
            a.observe(&step, token);
        }
        assert_eq!(ADAPTIVE_LAMBDAS[a.current()], 0.003);
        let fixed = simulate(&trace, slots, Policy::Lrfu { lambda: 0.03 }).hit_rate();
        let adaptive = simulate(&trace, slots, Policy::Adaptive).hit_rate();
        assert!(adaptive > fixed, "adaptive {adaptive} vs LRFU(0.03) {fixed}");
        // Choices come only at a window's end.
        let mut b = Adaptive::new(4, 1);
        b.hits = vec![0.0, 0.0, 0.0, 5.0];
        assert_eq!(b.new_token(ADAPTIVE_WINDOW - 1), None);
        assert_eq!(b.new_token(ADAPTIVE_WINDOW), Some(3));
        assert_eq!(b.hits[3], 5.0 * ADAPTIVE_KEEP);
    }

    #[test]
    fn consecutive_share_compares_each_layer_with_its_previous_step() {
        let t = vec![
            Step { layer: 0, experts: vec![1, 2] },
            Step { layer: 1, experts: vec![1] },
            Step { layer: 0, experts: vec![2, 3] },
            Step { layer: 1, experts: vec![5] },
        ];
        assert_eq!(consecutive_share(&t), Some(1.0 / 3.0));
        assert_eq!(consecutive_share(&t[..2]), None);
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
