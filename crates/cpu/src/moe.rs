//! The sparse MoE block: router, routed experts through the expert pool, gated shared expert.
//!
//! p = softmax(router h) in f32; the top-k experts per row, renormalised when `norm_topk_prob`;
//! routed = sum_e p_e down_e(silu(gate_e h) * up_e h); out = routed + sigmoid(shared_expert_gate h)
//! shared_expert(h). The experts of all rows of the step form one lease on the pool, ordered by
//! their largest weight so the most important misses are read first; resident experts are computed
//! while the misses are read. Each (row, expert) contribution is kept apart and summed in top-k
//! order at the end, so the result does not depend on which experts happened to be resident.

use std::time::Instant;

use anyhow::Result;
use cherenkov_engine::residency::{ExpertPool, HostSlots};
use cherenkov_engine::routing::{SkewedRouting, top_k};
use cherenkov_model::config::TextConfig;
use cherenkov_model::store::Store;

use crate::linear::Linear;
use crate::ops::{sigmoid, silu};
use crate::weights::Moe;

/// Top-k routing of `t` rows: per row, (expert, weight) in descending weight. With `skew` (synthetic
/// benchmarks only, see `cherenkov_engine::routing`) the skewed router chooses instead, and the
/// choice of each row is recorded for the next token's reuse bonus and noise.
pub fn route(
    store: &Store,
    c: &TextConfig,
    w: &Moe,
    h: &[f32],
    skew: Option<&SkewedRouting>,
) -> Vec<Vec<(usize, f32)>> {
    let e = c.num_experts;
    let t = h.len() / c.hidden_size;
    let mut logits = vec![0f32; t * e];
    w.gate.lin(store).forward(h, &mut logits);
    let k = c.num_experts_per_tok;
    logits
        .chunks_exact(e)
        .map(|l| match skew {
            Some(sk) => sk.route(w.expert_slot, l, k, c.norm_topk_prob),
            None => top_k(l, None, k, c.norm_topk_prob),
        })
        .collect()
}

/// The experts the router of `w` would pick for `h` (one row), without recording anything: the
/// lookahead's prediction for the next layer. With `skew` it sees only what a predictor may know
/// (`SkewedRouting::predict`: no noise of the token not yet routed).
pub fn predict(store: &Store, c: &TextConfig, w: &Moe, h: &[f32], skew: Option<&SkewedRouting>) -> Vec<usize> {
    let e = c.num_experts;
    let mut logits = vec![0f32; e];
    w.gate.lin(store).forward(&h[..c.hidden_size], &mut logits);
    let k = c.num_experts_per_tok;
    match skew {
        Some(sk) => sk.predict(w.expert_slot, &logits, k),
        None => top_k(&logits, None, k, false).into_iter().map(|x| x.0).collect(),
    }
}

/// One expert (or the shared expert) on the rows `x` (`[r, H]`).
fn mlp(gate: &Linear, up: &Linear, down: &Linear, x: &[f32]) -> Vec<f32> {
    let r = x.len() / gate.cols();
    let i = gate.rows();
    let mut g = vec![0f32; r * i];
    gate.forward(x, &mut g);
    let mut u = vec![0f32; r * i];
    up.forward(x, &mut u);
    for (a, b) in g.iter_mut().zip(&u) {
        *a = silu(*a) * b;
    }
    let mut out = vec![0f32; r * down.rows()];
    down.forward(&g, &mut out);
    out
}

/// `h` is `[t, H]`; returns `[t, H]`.
pub fn forward(
    store: &Store,
    c: &TextConfig,
    w: &Moe,
    pool: &ExpertPool<HostSlots>,
    h: &[f32],
    skew: Option<&SkewedRouting>,
    mut after_acquire: Option<&mut dyn FnMut(&[usize])>,
) -> Result<Vec<f32>> {
    let hid = c.hidden_size;
    let t = h.len() / hid;
    let k = c.num_experts_per_tok;
    let routes = route(store, c, w, h, skew);

    // Union of experts, most important (largest weight over the rows) first.
    let mut best: Vec<(usize, f32)> = Vec::new();
    for row in &routes {
        for &(e, p) in row {
            match best.iter_mut().find(|b| b.0 == e) {
                Some(b) => b.1 = b.1.max(p),
                None => best.push((e, p)),
            }
        }
    }
    best.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let experts: Vec<usize> = best.iter().map(|b| b.0).collect();

    let layout = &store.manifest.experts.layers[w.expert_slot];
    // contrib[(row * k + rank) * H ..] = p * expert(h[row])
    let mut contrib = vec![0f32; t * k * hid];
    // A long prefill can route to more experts than the pool holds: take them in pool-sized groups.
    for group in experts.chunks(pool.slot_count()) {
        let lease = pool.acquire(w.expert_slot, group)?;
        // The step's misses are queued: lookahead reads may go behind them now.
        if let Some(f) = after_acquire.take() {
            f(&experts);
        }
        let entries = lease.entries();
        // Statistics: host clocks around the expert loop and around waits for records not yet
        // loaded, so the pool can split expert compute from waiting (skipped in a no-stats build).
        let clock = cherenkov_engine::stats::ENABLED.then(Instant::now);
        let mut waited = std::time::Duration::ZERO;
        // Resident experts first, while the misses are read.
        let order =
            (0..entries.len()).filter(|&i| entries[i].hit).chain((0..entries.len()).filter(|&i| !entries[i].hit));
        for i in order {
            let rec = match clock {
                Some(_) if !lease.is_ready(i) => {
                    let t = Instant::now();
                    let rec = lease.bytes(i);
                    waited += t.elapsed();
                    rec?
                }
                _ => lease.bytes(i)?,
            };
            let entry = &entries[i];
            let gate = Linear::from_record(rec, &layout.gate_proj)?;
            let up = Linear::from_record(rec, &layout.up_proj)?;
            let down = Linear::from_record(rec, &layout.down_proj)?;
            let mut rows = Vec::new();
            let mut x = Vec::new();
            for (r, route) in routes.iter().enumerate() {
                if let Some(rank) = route.iter().position(|&(e, _)| e == entry.expert) {
                    rows.push((r, rank, route[rank].1));
                    x.extend_from_slice(&h[r * hid..(r + 1) * hid]);
                }
            }
            let y = mlp(&gate, &up, &down, &x);
            for (n, &(r, rank, p)) in rows.iter().enumerate() {
                let dst = &mut contrib[(r * k + rank) * hid..(r * k + rank + 1) * hid];
                for (d, &v) in dst.iter_mut().zip(&y[n * hid..(n + 1) * hid]) {
                    *d = p * v;
                }
            }
        }
        if let Some(t) = clock {
            pool.record_compute(w.expert_slot, t.elapsed().saturating_sub(waited).as_nanos() as u64);
        }
    }

    let shared = mlp(&w.shared_gate_proj.lin(store), &w.shared_up_proj.lin(store), &w.shared_down_proj.lin(store), h);
    let mut sg = vec![0f32; t];
    w.shared_expert_gate.lin(store).forward(h, &mut sg);
    let mut out = vec![0f32; t * hid];
    for r in 0..t {
        let o = &mut out[r * hid..(r + 1) * hid];
        for rank in 0..k {
            for (d, &v) in o.iter_mut().zip(&contrib[(r * k + rank) * hid..(r * k + rank + 1) * hid]) {
                *d += v;
            }
        }
        let g = sigmoid(sg[r]);
        for (d, &v) in o.iter_mut().zip(&shared[r * hid..(r + 1) * hid]) {
            *d += g * v;
        }
    }
    Ok(out)
}
