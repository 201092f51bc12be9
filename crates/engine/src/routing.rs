//! Skewed routers for synthetic models (benchmarks only).
//!
//! A model with random weights does not route like a trained one. Its hidden states barely change
//! from token to token, so its router logits are nearly the same vector every token: left alone it
//! would send consecutive tokens to mostly the same experts (72% shared per layer on the released
//! shape), where published traces of this family show 8-34% shared and about 71% page-cache hits
//! with 17% of the experts cached. Measuring an expert cache on such routing flatters every policy
//! and cannot tell them apart. So a synthetic model's routers replace the model's routing signal
//! with a controlled one: before softmax and top-k, the logits of the token now being routed at
//! MoE layer `l` become
//!
//!   logit'_e = model * z_e - popularity * ln(rank_e) + reuse * [e was routed by the previous token]
//!              + noise * n_e
//!
//! - z_e is the model's own router logit, standardised per token (mean 0, population standard
//!   deviation 1 over the experts; 0 when all logits are equal), so the model's scale does not
//!   matter and `model` says how much of it is kept (for a random network it is a near-constant
//!   vector: a second, fixed popularity). Softmax and top-k ignore a common shift, so a backend
//!   routing on the device gets the same choice from `logit_e * model / sd + bias_e`;
//! - rank_e is expert e's place (1 = most popular) in a per-layer random permutation: a static
//!   popularity skew;
//! - the reuse bonus goes to the experts the previous token routed to at this layer;
//! - n_e is fresh standard-normal noise, drawn deterministically from the seed, the layer and the
//!   number of tokens routed at that layer so far: the token-to-token variation a trained router's
//!   logits have and a random network's lack.
//!
//! Only the first three terms are known before the token is routed. A lookahead (the next layer's
//! router applied early to the current hidden state) sees the noise only as far as the hidden
//! state already carries it. In a trained model the residual stream changes little from one layer
//! to the next, so the next layer's router on the current hidden state ranks most of the experts
//! it will pick; here that is modelled by `foresight` (rho, from 0 to 1): the predictor reads
//! m_e = rho * n_e + sqrt(1 - rho^2) * f_e, a reading of the token's noise correlated rho with it
//! (f_e: independent standard-normal noise of its own), and adds its best estimate of the noise,
//! rho * m_e, to the terms it knows. rho = 0 hides the noise entirely (the predictor knows
//! popularity and reuse alone); rho = 1 sees it all. The routing itself does not depend on
//! `foresight`: the same seed routes the same experts whatever it is, so it changes what a
//! lookahead can gain and nothing else. The bias comes in two parts: [`SkewedRouting::bias`]
//! (everything the router adds) and [`SkewedRouting::predict_bias`] (what a predictor sees).
//! [`SkewedRouting::route`] and [`SkewedRouting::predict`] apply them to a row of raw router
//! logits.
//!
//! The default `foresight=0.96` makes the lookahead right about 80% of the time on the routers
//! alone (`foresight_sets_lookahead_accuracy` below checks the range): published cross-layer
//! predictors (the next layer's gate on the previous layer's activations) reach about 80% on
//! Qwen3-30B-A3B (arXiv 2511.10676, which reports its own same-layer predictor at 94.7% and about
//! 15 points above the cross-layer FATE) and about 97% on Qwen1.5-MoE and DeepSeekMoE (FATE, arXiv
//! 2502.12224); the default takes the lower figure. `foresight=0` is the routers of the earlier
//! benchmark results, whose lookahead was right 36-37% of the time.
//!
//! The routing defaults (`popularity=0.55,reuse=0.25,noise=1,model=0.2`) were chosen on traces of the
//! routers alone (`synthetic_trace`; 512 experts top-10, 8 layers x 2000 tokens): on a random
//! network's constant logit vector 24% of a layer's experts are shared by consecutive tokens and LRU
//! hits 71% with 17% of the experts cached; on fresh random logits per token 22% and 68%
//! (`benchmark/notes-policy.md`; the tests below check the ranges). The skew is off unless asked
//! for (`--synthetic-routing`), and every result measured with it records its parameters and the
//! consecutive-token share it produced.

use std::collections::HashMap;
use std::sync::Mutex;

use anyhow::{Result, bail};
use serde::Serialize;

use crate::policy::Step;

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Skew {
    /// Logit penalty per unit of ln(popularity rank) (0: no popularity skew).
    pub popularity: f64,
    /// Logit bonus of the previous token's experts (0: no reuse).
    pub reuse: f64,
    /// Standard deviation of the per-token noise (0: none).
    pub noise: f64,
    /// Weight of the model's own router logits, standardised per token (0: ignore the model).
    pub model: f64,
    /// Correlation between a token's noise and the reading of it a lookahead sees (0: none).
    pub foresight: f64,
    pub seed: u64,
}

impl Default for Skew {
    /// The calibrated skew (see the module docs).
    fn default() -> Skew {
        Skew { popularity: 0.55, reuse: 0.25, noise: 1.0, model: 0.2, foresight: 0.96, seed: 1 }
    }
}

/// Name, allowed range and help of each real-valued parameter.
const PARAMETERS: [(&str, f64, f64); 5] = [
    ("popularity", 0.0, 10.0),
    ("reuse", 0.0, 20.0),
    ("noise", 0.0, 20.0),
    ("model", 0.0, 10.0),
    ("foresight", 0.0, 1.0),
];

impl Skew {
    /// Parses `name=value,...` with names `popularity`, `reuse`, `noise`, `model`, `foresight` and
    /// `seed`; a parameter not given keeps its default ([`Skew::default`]); an empty string is the
    /// default.
    pub fn parse(s: &str) -> Result<Skew> {
        let mut k = Skew::default();
        let names = "popularity, reuse, noise, model, foresight, seed";
        for part in s.split(',').map(|p| p.trim()).filter(|p| !p.is_empty()) {
            let Some((name, value)) = part.split_once('=') else {
                bail!("--synthetic-routing: {part:?} is not name=value (names: {names})")
            };
            let (name, value) = (name.trim(), value.trim());
            if name == "seed" {
                k.seed = value.parse().map_err(|_| {
                    anyhow::anyhow!("--synthetic-routing: seed={value} is not a whole number from 0 to {}", u64::MAX)
                })?;
                continue;
            }
            let Some(&(_, lo, hi)) = PARAMETERS.iter().find(|p| p.0 == name) else {
                bail!("--synthetic-routing: unknown parameter {name:?} (names: {names})")
            };
            let v: f64 =
                value.parse().map_err(|_| anyhow::anyhow!("--synthetic-routing: {name}={value} is not a number"))?;
            if !(lo..=hi).contains(&v) {
                bail!("--synthetic-routing: {name}={value} is out of range ({name} goes from {lo} to {hi})");
            }
            match name {
                "popularity" => k.popularity = v,
                "reuse" => k.reuse = v,
                "noise" => k.noise = v,
                "model" => k.model = v,
                _ => k.foresight = v,
            }
        }
        Ok(k)
    }

    /// Every parameter, in the syntax `parse` reads.
    pub fn label(&self) -> String {
        format!(
            "popularity={},reuse={},noise={},model={},foresight={},seed={}",
            self.popularity, self.reuse, self.noise, self.model, self.foresight, self.seed
        )
    }
}

struct Layer {
    /// -popularity * ln(rank) per expert.
    popularity: Vec<f32>,
    /// The experts the previous token routed to.
    previous: Vec<usize>,
    /// Tokens routed at this layer so far (the noise's counter).
    tokens: u64,
    /// The noise of later tokens, drawn ahead ([`SkewedRouting::prepare_noise_at`]): at most
    /// [`DRAWN_AHEAD`], none for a token already routed.
    drawn: Vec<Drawn>,
}

/// Tokens whose noise a layer keeps drawn ahead: a verifying pass routes two rows at once, and
/// the next pass's two rows are drawn while it runs.
const DRAWN_AHEAD: usize = 3;

/// One token's noise at one layer, and a lookahead's estimate of it where drawn.
struct Drawn {
    /// The token's counter at its layer.
    token: u64,
    /// Empty once [`SkewedRouting::bias`] took it.
    noise: Vec<f32>,
    /// rho * (rho * noise + sqrt(1 - rho^2) * its own noise): what a predictor adds (see the module
    /// docs); None where not drawn (yet).
    estimate: Option<Vec<f32>>,
}

#[derive(Default)]
struct State {
    layers: HashMap<usize, Layer>,
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

/// `n` standard-normal values (Box-Muller) from the splitmix stream starting at `state`.
pub(crate) fn normals(mut state: u64, n: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(n + 1);
    while out.len() < n {
        // Uniforms in (0, 1): 53 bits, offset by half a step so ln never sees 0.
        let u = ((splitmix(&mut state) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        let v = ((splitmix(&mut state) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        let (r, a) = ((-2.0 * u.ln()).sqrt(), 2.0 * std::f64::consts::PI * v);
        out.push((r * a.cos()) as f32);
        out.push((r * a.sin()) as f32);
    }
    out.truncate(n);
    out
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

    /// The noise of the `token`-th token routed at `layer`.
    fn noise(&self, layer: usize, token: u64, num_experts: usize) -> Vec<f32> {
        normals(self.noise_seed(layer, token), num_experts)
    }

    /// A predictor's estimate of `noise`, the noise of the `token`-th token routed at `layer` (see
    /// the module docs): zero without foresight.
    fn estimate(&self, layer: usize, token: u64, noise: &[f32]) -> Vec<f32> {
        let rho = self.skew.foresight as f32;
        if rho <= 0.0 {
            return vec![0.0; noise.len()];
        }
        let own = normals(self.noise_seed(layer, token) ^ 0x6A09_E667_F3BC_C908, noise.len());
        let c = (1.0 - rho * rho).max(0.0).sqrt();
        noise.iter().zip(own).map(|(n, f)| rho * (rho * n + c * f)).collect()
    }

    fn with_layer<T>(&self, layer: usize, num_experts: usize, f: impl FnOnce(&mut Layer) -> T) -> T {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let l = st.layers.entry(layer).or_insert_with(|| Layer {
            popularity: self.popularity(layer, num_experts),
            previous: Vec::new(),
            tokens: 0,
            drawn: Vec::new(),
        });
        f(l)
    }

    /// What `layer`'s bias holds for the token about to be routed there whatever its noise:
    /// popularity and the reuse bonus of the previous token's experts.
    fn known_bias(&self, layer: usize, num_experts: usize) -> Vec<f32> {
        self.with_layer(layer, num_experts, |l| {
            let mut b = l.popularity.clone();
            for &e in &l.previous {
                b[e] += self.skew.reuse as f32;
            }
            b
        })
    }

    /// What a predictor sees of `layer`'s bias for the token about to be routed there: popularity,
    /// the reuse bonus of the previous token's experts, and its estimate of the token's noise (none
    /// without foresight; see the module docs).
    pub fn predict_bias(&self, layer: usize, num_experts: usize) -> Vec<f32> {
        let mut b = self.known_bias(layer, num_experts);
        if self.skew.noise > 0.0 && self.skew.foresight > 0.0 {
            // The estimate drawn ahead for this token, if it was (left in place for its bias).
            let (token, ready) = self.with_layer(layer, num_experts, |l| {
                let ready = l.drawn.iter().find(|d| d.token == l.tokens);
                (l.tokens, ready.and_then(|d| d.estimate.clone()).filter(|m| m.len() == num_experts))
            });
            let estimate = ready.unwrap_or_else(|| self.estimate(layer, token, &self.noise(layer, token, num_experts)));
            let sigma = self.skew.noise as f32;
            for (b, m) in b.iter_mut().zip(estimate) {
                *b += sigma * m;
            }
        }
        b
    }

    /// The whole bias the router adds to `layer`'s logits for the token now being routed there:
    /// popularity, reuse and that token's noise. Calling it again before
    /// [`SkewedRouting::observe`] gives the same noise.
    pub fn bias(&self, layer: usize, num_experts: usize) -> Vec<f32> {
        self.bias_at(layer, num_experts, 0)
    }

    /// [`SkewedRouting::bias`] for the token `ahead` tokens after the one now being routed at
    /// `layer` (0: that one), with the reuse bonus of the last token observed there: a verifying
    /// pass routes its second row before the first row's experts are known to the host, so that
    /// row's reuse bonus is the first row's (the benchmark's synthetic routers only).
    pub fn bias_at(&self, layer: usize, num_experts: usize, ahead: u64) -> Vec<f32> {
        let mut b = vec![0f32; num_experts];
        self.bias_into(layer, num_experts, ahead, &mut b);
        b
    }

    /// [`SkewedRouting::bias_at`] written into `out` (`num_experts` values, the same ones): under
    /// one lock, with no allocation where the noise was drawn ahead. A CUDA step writes every
    /// layer's row this way into the host memory its routers read, on the host's turn between two
    /// steps.
    pub fn bias_into(&self, layer: usize, num_experts: usize, ahead: u64, out: &mut [f32]) {
        // The noise drawn ahead for this token, if it was (and only that: a draw for a later token
        // stays for it). Its estimate stays too: a CUDA step takes every layer's bias before the
        // lookahead predicts any layer, and drawing the estimate again cost 19.2 us of host time
        // per streamed block on the build machine (0.4 with it kept).
        let reuse = self.skew.reuse as f32;
        let (token, ready) = self.with_layer(layer, num_experts, |l| {
            // Popularity and the previous token's reuse bonus, as `known_bias`.
            out.copy_from_slice(&l.popularity);
            for &e in &l.previous {
                out[e] += reuse;
            }
            let token = l.tokens + ahead;
            let mine = l.drawn.iter_mut().find(|d| d.token == token);
            (token, mine.map(|d| std::mem::take(&mut d.noise)))
        });
        if self.skew.noise > 0.0 {
            let sigma = self.skew.noise as f32;
            let noise = match ready {
                Some(n) if n.len() == num_experts => n,
                _ => self.noise(layer, token, num_experts),
            };
            for (b, n) in out.iter_mut().zip(noise) {
                *b += sigma * n;
            }
        }
    }

    /// Computes the noise of the next token to be routed at `layer` (after the one being routed
    /// now) ahead, so its [`SkewedRouting::bias`] only adds it: drawing 512 normals costs about 10
    /// us of host time, which a benchmark step would otherwise spend per layer before its device
    /// work starts (`bias` is called for every layer first). With `estimate` (a lookahead will
    /// predict that token at `layer`), a predictor's estimate of it too, for
    /// [`SkewedRouting::predict_bias`]. The values are the same either way.
    pub fn prepare_noise(&self, layer: usize, num_experts: usize, estimate: bool) {
        self.prepare_noise_at(layer, num_experts, estimate, 1);
    }

    /// [`SkewedRouting::prepare_noise`] for the token `ahead` tokens after the one being routed now
    /// (1: the next one), keeping what was drawn for the tokens between.
    pub fn prepare_noise_at(&self, layer: usize, num_experts: usize, estimate: bool, ahead: u64) {
        if self.skew.noise <= 0.0 {
            return;
        }
        let estimate = estimate && self.skew.foresight > 0.0;
        // The token's counter and its noise if drawn already, unless nothing is missing.
        let todo = self.with_layer(layer, num_experts, |l| {
            let next = l.tokens + ahead;
            let tokens = l.tokens;
            l.drawn.retain(|d| d.token >= tokens);
            match l.drawn.iter().position(|d| d.token == next) {
                Some(i) if l.drawn[i].estimate.is_some() || !estimate => None,
                Some(i) => Some((next, Some(l.drawn.remove(i).noise))),
                None => Some((next, None)),
            }
        });
        let Some((next, drawn)) = todo else { return };
        // Drawn outside the lock: the lookahead may route meanwhile.
        let noise = match drawn {
            Some(n) if n.len() == num_experts => n,
            _ => self.noise(layer, next, num_experts),
        };
        let estimate = estimate.then(|| self.estimate(layer, next, &noise));
        self.with_layer(layer, num_experts, |l| {
            l.drawn.retain(|d| d.token != next);
            if l.drawn.len() == DRAWN_AHEAD {
                l.drawn.remove(0);
            }
            l.drawn.push(Drawn { token: next, noise, estimate });
        });
    }

    /// The noise stream of the `tokens`-th token routed at `layer`.
    fn noise_seed(&self, layer: usize, tokens: u64) -> u64 {
        let mut x = self.skew.seed ^ 0xD1B5_4A32_D192_ED03;
        x = splitmix(&mut x) ^ layer as u64;
        x = splitmix(&mut x) ^ tokens;
        splitmix(&mut x)
    }

    /// `model` times the standardised `logits` (see the module docs).
    pub fn model_logits(&self, logits: &[f32]) -> Vec<f32> {
        let n = logits.len().max(1) as f64;
        let mean = logits.iter().map(|&v| v as f64).sum::<f64>() / n;
        let var = logits.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
        let scale = if var > 0.0 && var.is_finite() { self.skew.model / var.sqrt() } else { 0.0 };
        logits.iter().map(|&v| ((v as f64 - mean) * scale) as f32).collect()
    }

    /// Routes one token at `layer` from its raw router `logits`: the skewed logits' softmax top-k
    /// (see [`top_k`]), recorded for the next token's reuse bonus and noise.
    pub fn route(&self, layer: usize, logits: &[f32], k: usize, norm: bool) -> Vec<(usize, f32)> {
        let e = logits.len();
        let top = top_k(&self.model_logits(logits), Some(&self.bias(layer, e)), k, norm);
        self.observe(layer, &top.iter().map(|x| x.0).collect::<Vec<_>>(), e);
        top
    }

    /// The lookahead's guess of the experts `layer` will route the next token to, from router
    /// `logits` computed early: like [`SkewedRouting::route`] with [`SkewedRouting::predict_bias`]
    /// (no noise) and nothing recorded.
    pub fn predict(&self, layer: usize, logits: &[f32], k: usize) -> Vec<usize> {
        let bias = self.predict_bias(layer, logits.len());
        top_k(&self.model_logits(logits), Some(&bias), k, false).into_iter().map(|x| x.0).collect()
    }

    /// Records the experts a token was routed to at `layer` (its successor's reuse bonus) and
    /// moves that layer's noise on to the next token.
    pub fn observe(&self, layer: usize, chosen: &[usize], num_experts: usize) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let State { layers, shared, counted } = &mut *st;
        let l = layers.entry(layer).or_insert_with(|| Layer {
            popularity: self.popularity(layer, num_experts),
            previous: Vec::new(),
            tokens: 0,
            drawn: Vec::new(),
        });
        if !l.previous.is_empty() {
            *shared += chosen.iter().filter(|e| l.previous.contains(e)).count() as u64;
            *counted += chosen.len() as u64;
        }
        l.previous = chosen.to_vec();
        l.tokens += 1;
    }

    /// The share of a token's experts that the previous token also used at the same layer.
    pub fn consecutive_share(&self) -> Option<f64> {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        (st.counted > 0).then(|| st.shared as f64 / st.counted as f64)
    }
}

/// The model's router logits fed to [`synthetic_trace`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub enum ModelLogits {
    /// Fresh standard-normal logits every (layer, token): a model whose routing varies a lot.
    Random,
    /// One standard-normal vector per layer, plus `jitter` times fresh standard-normal noise per
    /// token: a random network, whose hidden states barely change from token to token.
    Constant { jitter: f64 },
}

/// The routing trace of `skew`'s routers alone, without a model: `tokens` decode tokens through
/// `layers` MoE layers of `num_experts` experts, top-`k`, one [`Step`] per (token, layer) in decode
/// order, the model's router logits drawn as `model` says (from the seed, deterministically).
pub fn synthetic_trace(
    skew: Skew,
    model: ModelLogits,
    layers: usize,
    tokens: usize,
    num_experts: usize,
    k: usize,
) -> Vec<Step> {
    let r = SkewedRouting::new(skew);
    let mut state = skew.seed ^ 0x5851_F42D_4C95_7F2D;
    let base: Vec<Vec<f32>> = (0..layers).map(|_| normals(splitmix(&mut state), num_experts)).collect();
    let mut trace = Vec::with_capacity(layers * tokens);
    for _ in 0..tokens {
        for (layer, base) in base.iter().enumerate() {
            let fresh = normals(splitmix(&mut state), num_experts);
            let logits: Vec<f32> = match model {
                ModelLogits::Random => fresh,
                ModelLogits::Constant { jitter } => {
                    base.iter().zip(&fresh).map(|(b, f)| b + jitter as f32 * f).collect()
                }
            };
            let chosen = r.route(layer, &logits, k, true);
            trace.push(Step { layer: layer as u16, experts: chosen.iter().map(|x| x.0 as u16).collect() });
        }
    }
    trace
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
    use crate::policy::{Policy, consecutive_share, simulate};

    #[test]
    fn popularity_and_reuse_show_on_random_logits() {
        let (e, k, steps) = (512, 10, 1500);
        let mut x = 42u64;
        let run = |skew: Skew, x: &mut u64| {
            let r = SkewedRouting::new(skew);
            let mut counts = vec![0usize; e];
            for _ in 0..steps {
                let logits = normals(splitmix(x), e);
                let chosen: Vec<usize> = r.route(0, &logits, k, true).iter().map(|x| x.0).collect();
                for c in chosen {
                    counts[c] += 1;
                }
            }
            counts.sort_unstable_by(|a, b| b.cmp(a));
            let top = counts[..e / 6].iter().sum::<usize>() as f64 / (steps * k) as f64;
            (top, r.consecutive_share().unwrap())
        };
        let plain = Skew { popularity: 0.5, reuse: 0.5, noise: 0.0, model: 1.0, foresight: 0.0, seed: 3 };
        let (top, share) = run(plain, &mut x);
        assert!(top > 0.45, "the top sixth of experts take {top} of the routing");
        assert!(share > 0.1 && share < 0.4, "consecutive share {share}");
        let (utop, ushare) = run(Skew { popularity: 0.0, reuse: 0.0, ..plain }, &mut x);
        assert!(utop < 0.3 && ushare < 0.06, "uniform: top {utop}, share {ushare}");
    }

    /// The defaults reproduce the published traces' statistics whatever the model's logits do: a
    /// random network's near-constant vector, an exactly constant one, or fresh logits per token.
    /// Without noise, a near-constant vector routes alike token after token (the miscalibration
    /// the noise fixes), which this test must see too.
    #[test]
    fn defaults_match_published_traces_on_any_model() {
        let (layers, tokens, e, k) = (4, 800, 512, 10);
        let slots = (0.17 * (layers * e) as f64) as usize;
        let stats = |skew: Skew, model: ModelLogits| {
            let trace = synthetic_trace(skew, model, layers, tokens, e, k);
            (consecutive_share(&trace).unwrap(), simulate(&trace, slots, Policy::Lru).hit_rate())
        };
        let models =
            [ModelLogits::Constant { jitter: 0.05 }, ModelLogits::Constant { jitter: 0.0 }, ModelLogits::Random];
        for model in models {
            let (share, lru) = stats(Skew::default(), model);
            assert!((0.08..=0.34).contains(&share), "{model:?}: consecutive share {share}");
            assert!((0.60..=0.75).contains(&lru), "{model:?}: LRU hits {lru} with 17% cached");
        }
        let old = Skew { popularity: 0.5, reuse: 0.5, noise: 0.0, model: 1.0, foresight: 0.0, seed: 1 };
        let (share, lru) = stats(old, ModelLogits::Constant { jitter: 0.05 });
        assert!(share > 0.6 && lru > 0.9, "no noise on a random network: share {share}, LRU {lru}");
    }

    #[test]
    fn noise_drawn_ahead_is_the_noise_drawn_then() {
        let (e, k) = (512, 10);
        let (a, b) = (SkewedRouting::new(Skew::default()), SkewedRouting::new(Skew::default()));
        let logits = normals(99, e);
        for token in 0..6 {
            for layer in 0..3 {
                // `a` draws each next token's noise ahead (twice, the second a no-op), `b` never.
                if token % 2 == 0 {
                    a.prepare_noise(layer, e, true);
                    a.prepare_noise(layer, e, false);
                }
                assert_eq!(a.bias(layer, e), b.bias(layer, e), "token {token} layer {layer}");
                assert_eq!(a.route(layer, &logits, k, true), b.route(layer, &logits, k, true));
            }
        }
    }

    #[test]
    fn noise_is_fresh_per_token_and_hidden_from_predictions() {
        let (e, k) = (512, 10);
        let skew = Skew { noise: 2.0, foresight: 0.0, ..Skew::default() };
        let (a, b) = (SkewedRouting::new(skew), SkewedRouting::new(skew));
        let first = a.bias(3, e);
        assert_eq!(first, a.bias(3, e), "the same token's noise twice");
        assert_eq!(first, b.bias(3, e), "the noise follows from the seed");
        assert_ne!(first, a.bias(2, e), "each layer has its own noise");
        // bias - predict_bias is the noise alone: mean 0, standard deviation `noise`.
        let noise: Vec<f64> = first.iter().zip(a.predict_bias(3, e)).map(|(b, p)| (b - p) as f64).collect();
        let mean = noise.iter().sum::<f64>() / e as f64;
        let sd = (noise.iter().map(|n| (n - mean).powi(2)).sum::<f64>() / e as f64).sqrt();
        assert!(mean.abs() < 0.3 && (sd - 2.0).abs() < 0.2, "noise mean {mean}, sd {sd}");
        a.observe(3, &[0, 1], e);
        let next: Vec<f64> = a.bias(3, e).iter().zip(a.predict_bias(3, e)).map(|(b, p)| (b - p) as f64).collect();
        let same = noise.iter().zip(&next).filter(|(a, b)| (*a - *b).abs() < 1e-3).count();
        assert!(same < 5, "the next token gets new noise ({same} of {e} values repeat)");
        // The previous token's experts get the reuse bonus on top of their popularity.
        let (predicted, popularity) = (a.predict_bias(3, e), a.popularity(3, e));
        assert_eq!((predicted[0], predicted[2]), (popularity[0] + skew.reuse as f32, popularity[2]));

        // A predictor sees the model's logits, popularity and reuse, never the noise: on a random
        // network it gets most experts but not all of them.
        let logits = normals(7, e);
        let (mut correct, mut total) = (0, 0);
        for _ in 0..200 {
            let guess = a.predict(5, &logits, k);
            let chosen: Vec<usize> = a.route(5, &logits, k, false).iter().map(|x| x.0).collect();
            correct += chosen.iter().filter(|c| guess.contains(c)).count();
            total += k;
        }
        let accuracy = correct as f64 / total as f64;
        assert!(accuracy > 0.1 && accuracy < 0.9, "lookahead accuracy {accuracy}");
        let quiet = SkewedRouting::new(Skew { noise: 0.0, ..skew });
        let guess = quiet.predict(5, &logits, k);
        let chosen: Vec<usize> = quiet.route(5, &logits, k, false).iter().map(|x| x.0).collect();
        assert_eq!(guess, chosen, "without noise the prediction is the routing");
    }

    #[test]
    fn the_model_logits_scale_does_not_matter() {
        let (e, k) = (64, 4);
        let skew = Skew { noise: 0.0, ..Skew::default() };
        let (a, b) = (SkewedRouting::new(skew), SkewedRouting::new(skew));
        for i in 0..20 {
            let l = normals(100 + i, e);
            let scaled: Vec<f32> = l.iter().map(|v| 37.0 * v - 5.0).collect();
            let ra: Vec<usize> = a.route(0, &l, k, true).iter().map(|x| x.0).collect();
            let rb: Vec<usize> = b.route(0, &scaled, k, true).iter().map(|x| x.0).collect();
            assert_eq!(ra, rb, "token {i}");
        }
        let z = a.model_logits(&[2.0, 4.0, 6.0]);
        let want = [-0.2 * 1.5f32.sqrt(), 0.0, 0.2 * 1.5f32.sqrt()];
        assert!(z.iter().zip(want).all(|(z, w)| (z - w).abs() < 1e-6), "{z:?}");
        assert_eq!(a.model_logits(&[3.0; 5]), vec![0.0; 5], "equal logits carry no signal");
    }

    #[test]
    fn parse_checks_names_and_ranges() {
        assert_eq!(Skew::parse("").unwrap(), Skew::default());
        let k = Skew::parse("popularity=1.5, reuse=1,noise=0.5,model=0,seed=9").unwrap();
        assert_eq!(k, Skew { popularity: 1.5, reuse: 1.0, noise: 0.5, model: 0.0, seed: 9, ..Skew::default() });
        assert_eq!(Skew::parse(&k.label()).unwrap(), k, "label() lists every parameter");
        assert_eq!(Skew::parse("noise=2").unwrap(), Skew { noise: 2.0, ..Skew::default() });
        let err = |s: &str| format!("{:#}", Skew::parse(s).unwrap_err());
        assert!(err("reuse=-1").contains("reuse=-1 is out of range (reuse goes from 0 to 20)"), "{}", err("reuse=-1"));
        assert!(err("noise=21").contains("out of range"));
        assert!(err("model=x").contains("model=x is not a number"));
        assert!(err("seed=1.5").contains("seed=1.5 is not a whole number"));
        assert!(
            err("foo=1")
                .contains("unknown parameter \"foo\" (names: popularity, reuse, noise, model, foresight, seed)")
        );
        assert!(err("noise").contains("is not name=value"));
    }

    /// Lookahead accuracy on the routers alone (a random network's constant logit vector per
    /// layer, the lookahead predicting each block from the same logits) for `skew`, with the routed
    /// experts.
    fn lookahead_on_routers(skew: Skew, tokens: usize, prepare: bool) -> (f64, Vec<Vec<usize>>) {
        let (layers, e, k) = (4usize, 512usize, 10usize);
        let r = SkewedRouting::new(skew);
        let base: Vec<Vec<f32>> = (0..layers).map(|l| normals(l as u64, e)).collect();
        let (mut correct, mut total, mut routed) = (0usize, 0usize, Vec::new());
        for _ in 0..tokens {
            for (l, logits) in base.iter().enumerate() {
                let guess = r.predict(l, logits, k);
                let chosen: Vec<usize> = r.route(l, logits, k, true).iter().map(|x| x.0).collect();
                correct += chosen.iter().filter(|c| guess.contains(c)).count();
                total += k;
                routed.push(chosen);
                if prepare {
                    r.prepare_noise(l, e, true);
                }
            }
        }
        (correct as f64 / total as f64, routed)
    }

    /// The default foresight gives the published cross-layer predictors' accuracy (about 80%),
    /// none gives the earlier routers' (36-37%), and full foresight predicts every expert; the
    /// routing is the same whatever the foresight, and whether estimates are drawn ahead or not.
    #[test]
    fn foresight_sets_lookahead_accuracy() {
        let (default, routed) = lookahead_on_routers(Skew::default(), 500, false);
        assert!((0.75..=0.85).contains(&default), "default foresight: lookahead accuracy {default}");
        let (blind, blind_routed) = lookahead_on_routers(Skew { foresight: 0.0, ..Skew::default() }, 500, false);
        assert!((0.3..=0.45).contains(&blind), "no foresight: lookahead accuracy {blind}");
        let (full, _) = lookahead_on_routers(Skew { foresight: 1.0, ..Skew::default() }, 100, false);
        assert_eq!(full, 1.0, "full foresight");
        assert_eq!(routed, blind_routed, "foresight must not change the routing");
        let (ahead, ahead_routed) = lookahead_on_routers(Skew::default(), 500, true);
        assert_eq!((ahead, ahead_routed), (default, routed), "estimates drawn ahead are the ones drawn on demand");
    }

    /// A verifying pass takes its second row's bias before the first row is observed: the noise is
    /// the second token's, drawn ahead or not, and the reuse bonus the last observed token's.
    #[test]
    fn a_bias_ahead_has_the_later_tokens_noise() {
        let e = 512;
        let skew = Skew { reuse: 0.0, ..Skew::default() };
        let (a, b) = (SkewedRouting::new(skew), SkewedRouting::new(skew));
        a.observe(2, &[1, 2], e);
        b.observe(2, &[1, 2], e);
        // The next two tokens' noise drawn ahead by `a`, kept side by side.
        a.prepare_noise_at(2, e, false, 1);
        a.prepare_noise_at(2, e, false, 2);
        assert_eq!(a.with_layer(2, e, |l| l.drawn.len()), 2);
        let (now, ahead) = (a.bias_at(2, e, 0), a.bias_at(2, e, 1));
        assert_ne!(now, ahead);
        assert_eq!(now, b.bias(2, e));
        b.observe(2, &[3, 4], e);
        assert_eq!(ahead, b.bias(2, e), "the bias one token ahead is that token's bias");
    }

    /// The bias written in place is popularity, the previous token's reuse bonus and that token's
    /// noise times sigma, as the three parts give it apart, whether the noise was drawn ahead or
    /// not; the row it overwrites does not matter.
    #[test]
    fn the_bias_in_place_is_its_three_parts() {
        let e = 512;
        let (a, b) = (SkewedRouting::new(Skew::default()), SkewedRouting::new(Skew::default()));
        for r in [&a, &b] {
            r.observe(4, &[7, 300, 511], e);
            r.observe(4, &[1, 2, 3], e);
        }
        a.prepare_noise(4, e, false);
        let mut expected = a.known_bias(4, e);
        let sigma = a.skew.noise as f32;
        for (x, n) in expected.iter_mut().zip(a.noise(4, 2, e)) {
            *x += sigma * n;
        }
        let mut ahead = vec![f32::NAN; e];
        a.bias_into(4, e, 0, &mut ahead);
        let mut on_demand = vec![-1.0; e];
        b.bias_into(4, e, 0, &mut on_demand);
        assert_eq!(ahead, expected, "noise drawn ahead");
        assert_eq!(on_demand, expected, "noise drawn on demand");
        assert_eq!(a.bias(4, e), expected, "the allocating form");
    }

    /// A CUDA step takes every layer's bias first, then predicts the layers one by one: the
    /// estimate drawn ahead must survive the bias, and be the one drawn on demand.
    #[test]
    fn the_bias_leaves_the_estimate_drawn_ahead() {
        let e = 512;
        let (a, b) = (SkewedRouting::new(Skew::default()), SkewedRouting::new(Skew::default()));
        let drawn = |r: &SkewedRouting| {
            r.with_layer(2, e, |l| l.drawn.iter().any(|d| d.estimate.as_ref().is_some_and(|m| m.len() == e)))
        };
        a.observe(2, &[1, 2], e);
        b.observe(2, &[1, 2], e);
        // The next token's noise and estimate, drawn ahead by `a` only.
        a.prepare_noise(2, e, true);
        assert!(drawn(&a));
        // The next token comes: its bias first (the noise is taken), then its prediction.
        a.observe(2, &[3, 4], e);
        b.observe(2, &[3, 4], e);
        assert_eq!(a.bias(2, e), b.bias(2, e));
        assert!(drawn(&a), "the bias took the estimate");
        assert_eq!(a.predict_bias(2, e), b.predict_bias(2, e));
        assert_eq!(a.bias(2, e), b.bias(2, e), "the bias again, its noise drawn anew");
    }
}
