//! Skewed routers for synthetic models (benchmarks only).
//!
//! A model with random weights routes almost uniformly: every expert equally likely, consecutive
//! tokens sharing about k/E of their experts. Real MoE models do not: a few experts per layer are
//! popular, and consecutive tokens reuse a good share of the previous token's experts (published
//! traces of this family: about 71% page-cache hits with 17% of the experts cached; 8-34% of a
//! layer's experts shared by consecutive tokens). Measuring an expert cache on uniform routing
//! would understate every policy, so a synthetic model's routers can be skewed: the router's logits
//! get a per-layer popularity bias and a bonus for the experts the previous token used at that
//! layer, before softmax and top-k:
//!
//!   logit'_e = logit_e - popularity * ln(rank_e) + reuse * [e was routed by the previous token]
//!
//! where rank_e is expert e's place (1 = most popular) in a per-layer random permutation. The skew
//! is part of the synthetic router, so lookahead (the next layer's router applied early) sees it
//! too. It is off unless asked for (`--synthetic-routing`), and every result measured with it
//! records its parameters and the consecutive-token share it produced.

use std::collections::HashMap;
use std::sync::Mutex;

use anyhow::{Result, bail};
use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Skew {
    /// Logit penalty per unit of ln(popularity rank) (0: no popularity skew).
    pub popularity: f64,
    /// Logit bonus of the previous token's experts (0: no reuse).
    pub reuse: f64,
    pub seed: u64,
}

impl Skew {
    /// Parses `popularity=0.5,reuse=0.5[,seed=7]` (those values are the defaults: on 512 experts top-10
    /// they give about 25% consecutive-token sharing and 67% LRU hits with 17% of the experts cached,
    /// close to the published traces).
    pub fn parse(s: &str) -> Result<Skew> {
        let mut k = Skew { popularity: 0.5, reuse: 0.5, seed: 1 };
        for part in s.split(',').map(|p| p.trim()).filter(|p| !p.is_empty()) {
            let Some((name, value)) = part.split_once('=') else {
                bail!("--synthetic-routing: {part:?} is not name=value")
            };
            let v: f64 =
                value.parse().map_err(|_| anyhow::anyhow!("--synthetic-routing: {name}={value} is not a number"))?;
            match name {
                "popularity" if (0.0..=10.0).contains(&v) => k.popularity = v,
                "reuse" if (0.0..=20.0).contains(&v) => k.reuse = v,
                "seed" if v >= 0.0 => k.seed = v as u64,
                "popularity" | "reuse" | "seed" => {
                    bail!("--synthetic-routing: {name}={value} is out of range (popularity 0..10, reuse 0..20)")
                }
                other => bail!("--synthetic-routing: unknown parameter {other:?} (popularity, reuse, seed)"),
            }
        }
        Ok(k)
    }

    pub fn label(&self) -> String {
        format!("popularity={},reuse={},seed={}", self.popularity, self.reuse, self.seed)
    }
}

#[derive(Default)]
struct State {
    /// Per MoE layer: the popularity bias and the previous token's experts.
    layers: HashMap<usize, (Vec<f32>, Vec<usize>)>,
    /// Consecutive-token sharing observed so far: shared experts, and experts of tokens that had a
    /// predecessor.
    shared: u64,
    counted: u64,
}

pub struct SkewedRouting {
    pub skew: Skew,
    state: Mutex<State>,
}

fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl SkewedRouting {
    pub fn new(skew: Skew) -> SkewedRouting {
        SkewedRouting { skew, state: Mutex::new(State::default()) }
    }

    fn popularity(&self, layer: usize, num_experts: usize) -> Vec<f32> {
        let mut seed = self.skew.seed ^ (layer as u64 + 1).wrapping_mul(0xA24B_AED4_963E_E407);
        let mut perm: Vec<usize> = (0..num_experts).collect();
        for i in (1..num_experts).rev() {
            let j = (splitmix(&mut seed) % (i as u64 + 1)) as usize;
            perm.swap(i, j);
        }
        let mut bias = vec![0f32; num_experts];
        for (rank, &e) in perm.iter().enumerate() {
            bias[e] = -(self.skew.popularity * ((rank + 1) as f64).ln()) as f32;
        }
        bias
    }

    /// The bias to add to `layer`'s router logits for the next token.
    pub fn bias(&self, layer: usize, num_experts: usize) -> Vec<f32> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let entry = st.layers.entry(layer).or_insert_with(|| (self.popularity(layer, num_experts), Vec::new()));
        let mut b = entry.0.clone();
        for &e in &entry.1 {
            b[e] += self.skew.reuse as f32;
        }
        b
    }

    /// Records the experts a token was routed to at `layer` (its successor's reuse bonus).
    pub fn observe(&self, layer: usize, chosen: &[usize], num_experts: usize) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let State { layers, shared, counted } = &mut *st;
        let entry = layers.entry(layer).or_insert_with(|| (self.popularity(layer, num_experts), Vec::new()));
        if !entry.1.is_empty() {
            *shared += chosen.iter().filter(|e| entry.1.contains(e)).count() as u64;
            *counted += chosen.len() as u64;
        }
        entry.1 = chosen.to_vec();
    }

    /// The share of a token's experts that the previous token also used at the same layer.
    pub fn consecutive_share(&self) -> Option<f64> {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        (st.counted > 0).then(|| st.shared as f64 / st.counted as f64)
    }
}

/// Softmax over `logits + bias`, top-k (ties to the lower id), renormalised when `norm`: the
/// router's choice, in descending weight.
pub fn top_k(logits: &[f32], bias: Option<&[f32]>, k: usize, norm: bool) -> Vec<(usize, f32)> {
    let mut p: Vec<f32> = match bias {
        Some(b) => logits.iter().zip(b).map(|(l, b)| l + b).collect(),
        None => logits.to_vec(),
    };
    let m = p.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut s = 0f64;
    for v in p.iter_mut() {
        *v = (*v - m).exp();
        s += *v as f64;
    }
    let inv = (1.0 / s) as f32;
    p.iter_mut().for_each(|v| *v *= inv);
    let mut idx: Vec<usize> = (0..p.len()).collect();
    idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    let top: Vec<(usize, f32)> = idx[..k.min(p.len())].iter().map(|&i| (i, p[i])).collect();
    if norm {
        let t: f32 = top.iter().map(|x| x.1).sum();
        top.into_iter().map(|(i, v)| (i, v / t)).collect()
    } else {
        top
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn popularity_and_reuse_show_on_random_logits() {
        let (e, k, steps) = (512, 10, 1500);
        let mut x = 42u64;
        let mut normal = || {
            let u = ((splitmix(&mut x) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
            let v = ((splitmix(&mut x) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
            ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
        };
        let run = |skew: Skew, normal: &mut dyn FnMut() -> f32| {
            let r = SkewedRouting::new(skew);
            let mut counts = vec![0usize; e];
            for _ in 0..steps {
                let logits: Vec<f32> = (0..e).map(|_| normal()).collect();
                let chosen: Vec<usize> = top_k(&logits, Some(&r.bias(0, e)), k, true).iter().map(|x| x.0).collect();
                r.observe(0, &chosen, e);
                for c in chosen {
                    counts[c] += 1;
                }
            }
            counts.sort_unstable_by(|a, b| b.cmp(a));
            let top = counts[..e / 6].iter().sum::<usize>() as f64 / (steps * k) as f64;
            (top, r.consecutive_share().unwrap())
        };
        let (top, share) = run(Skew { popularity: 0.5, reuse: 0.5, seed: 3 }, &mut normal);
        assert!(top > 0.45, "the top sixth of experts take {top} of the routing");
        assert!(share > 0.1 && share < 0.4, "consecutive share {share}");
        let (utop, ushare) = run(Skew { popularity: 0.0, reuse: 0.0, seed: 3 }, &mut normal);
        assert!(utop < 0.3 && ushare < 0.06, "uniform: top {utop}, share {ushare}");
    }

    #[test]
    fn parse_checks_ranges() {
        assert_eq!(Skew::parse("popularity=1.5,reuse=1").unwrap().popularity, 1.5);
        assert!(Skew::parse("reuse=-1").is_err());
        assert!(Skew::parse("foo=1").is_err());
    }
}
