//! Choosing the next token from the logits: penalties, then greedy or temperature / top-k /
//! top-p sampling with a seeded generator, plus the log-probability helpers the server reports.
//!
//! Every run is reproducible: the generator is ChaCha20 seeded from `seed`, or from entropy with
//! the drawn seed recorded ([`Sampler::seed`]) so a surprising completion can be replayed.
//!
//! Masked logits (`-inf`, e.g. padded vocabulary rows or grammar constraints) are first-class: a
//! token whose probability is zero is never returned, whatever the settings. NaN logits are
//! treated as `-inf`.

use std::cmp::Ordering;
use std::collections::HashMap;

use anyhow::{Context, Result, bail};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;
use serde::{Deserialize, Serialize};

/// How to pick tokens. The defaults are OpenAI's: temperature 1, no truncation, no penalties.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy (argmax).
    pub temperature: f32,
    /// Nucleus sampling: keep the most likely tokens whose cumulative probability first reaches
    /// `top_p`, in (0, 1]; 1 keeps everything.
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens; 0 turns it off.
    pub top_k: usize,
    /// Generator seed; `None` draws one from entropy (see [`Sampler::seed`]).
    pub seed: Option<u64>,
    /// Subtracted once from the logit of every token that appears in `previous` (OpenAI
    /// semantics), in [-2, 2].
    pub presence_penalty: f32,
    /// Subtracted `count` times from the logit of a token that appears `count` times in
    /// `previous`, in [-2, 2].
    pub frequency_penalty: f32,
    /// transformers' multiplicative repetition penalty: a seen token's positive logit is divided
    /// by it and a negative one multiplied; 1 turns it off, must be > 0.
    pub repetition_penalty: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
        }
    }
}

impl SamplingParams {
    /// Deterministic argmax decoding.
    pub fn greedy() -> Self {
        Self { temperature: 0.0, ..Self::default() }
    }

    /// Rejects settings that would make sampling meaningless, naming the field and the value.
    pub fn validate(&self) -> Result<()> {
        let t = self.temperature;
        if !t.is_finite() || t < 0.0 {
            bail!("sampling: temperature must be a finite number >= 0 (0 = greedy), got {t}");
        }
        let p = self.top_p;
        if !p.is_finite() || p <= 0.0 || p > 1.0 {
            bail!("sampling: top_p must be in (0, 1], got {p}");
        }
        for (name, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if !v.is_finite() || !(-2.0..=2.0).contains(&v) {
                bail!("sampling: {name} must be in [-2, 2], got {v}");
            }
        }
        let r = self.repetition_penalty;
        if !r.is_finite() || r <= 0.0 {
            bail!("sampling: repetition_penalty must be a finite number > 0 (1 = off), got {r}");
        }
        Ok(())
    }

    fn has_penalties(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0 || self.repetition_penalty != 1.0
    }
}

/// Picks tokens with one generator for a whole generation.
pub struct Sampler {
    params: SamplingParams,
    seed: u64,
    rng: ChaCha20Rng,
    /// Scratch reused across calls: a 248k-entry vocabulary would otherwise allocate several MB
    /// per token.
    logits: Vec<f32>,
    candidates: Vec<(u32, f32)>,
    weights: Vec<(u32, f64)>,
}

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sampler").field("params", &self.params).field("seed", &self.seed).finish_non_exhaustive()
    }
}

impl Sampler {
    /// Seeds the generator from `params.seed`, or from entropy.
    ///
    /// # Panics
    ///
    /// When `params` fails [`SamplingParams::validate`]; callers validate requests up front (and
    /// report the error to the client), or use [`try_new`](Self::try_new).
    pub fn new(params: SamplingParams) -> Self {
        match Self::try_new(params) {
            Ok(sampler) => sampler,
            Err(e) => panic!("{e}"),
        }
    }

    /// Validates `params` and seeds the generator.
    pub fn try_new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        let seed = params.seed.unwrap_or_else(rand::random::<u64>);
        Ok(Self {
            params,
            seed,
            rng: ChaCha20Rng::seed_from_u64(seed),
            logits: Vec::new(),
            candidates: Vec::new(),
            weights: Vec::new(),
        })
    }

    /// The seed actually in use: pass it back as `SamplingParams::seed` to reproduce the run.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token. `previous` are the tokens the penalties look at (the generated
    /// tokens, for OpenAI semantics); ids outside `logits` are ignored.
    ///
    /// # Panics
    ///
    /// When no token can be chosen: `logits` is empty, or every logit is `-inf` or NaN. That is a
    /// broken model output, not a sampling condition; [`try_sample`](Self::try_sample) reports it
    /// as an error instead.
    pub fn sample(&mut self, logits: &[f32], previous: &[u32]) -> u32 {
        match self.try_sample(logits, previous) {
            Ok(id) => id,
            Err(e) => panic!("{e}"),
        }
    }

    /// [`sample`](Self::sample) that returns an error when no token has non-zero probability.
    pub fn try_sample(&mut self, logits: &[f32], previous: &[u32]) -> Result<u32> {
        if logits.is_empty() {
            bail!("sampling: the logits are empty (expected one value per vocabulary entry)");
        }
        self.logits.clear();
        self.logits.extend(logits.iter().map(|&l| if l.is_nan() { f32::NEG_INFINITY } else { l }));
        if self.params.has_penalties() {
            apply_penalties(&mut self.logits, previous, &self.params);
        }
        if self.params.temperature == 0.0 {
            return argmax(&self.logits).ok_or_else(|| no_candidate(logits.len()));
        }
        self.sample_tempered(logits.len())
    }

    /// How many of the largest logits this sampler needs to see, when that is all it needs:
    /// 1 for greedy decoding, `top_k` for small top-k sampling, `None` when it needs every logit
    /// (penalties, or no top-k). A backend can then return just those
    /// ([`Backend::forward_top`](crate::backend::Backend::forward_top)).
    pub fn candidates_needed(&self) -> Option<usize> {
        const MAX_CANDIDATES: usize = 64;
        if self.params.has_penalties() {
            return None;
        }
        if self.params.temperature == 0.0 {
            return Some(1);
        }
        (1..=MAX_CANDIDATES).contains(&self.params.top_k).then_some(self.params.top_k)
    }

    /// Picks a token from the `k` largest logits only, as (id, logit) in descending order with
    /// ties to the lower id, where `k` is [`candidates_needed`](Self::candidates_needed) or more
    /// (fewer only when the vocabulary is smaller).
    /// Picks the same token, and advances the generator the same way, as
    /// [`try_sample`](Self::try_sample) on the full logits would.
    pub fn sample_candidates(&mut self, candidates: &[(u32, f32)]) -> Result<u32> {
        self.candidates_needed().context("sampling: this sampler needs the full logits")?;
        let logits: Vec<f32> = candidates.iter().map(|c| c.1).collect();
        let at = self.try_sample(&logits, &[])?;
        Ok(candidates[at as usize].0)
    }

    fn sample_tempered(&mut self, vocab: usize) -> Result<u32> {
        let cands = &mut self.candidates;
        cands.clear();
        if self.logits.contains(&f32::INFINITY) {
            // The limit of softmax: the +inf tokens share all the probability equally.
            cands.extend(ids_where(&self.logits, |l| l == f32::INFINITY).map(|i| (i, 0.0)));
        } else {
            cands.extend(ids_where(&self.logits, |l| l > f32::NEG_INFINITY).map(|i| (i, self.logits[i as usize])));
        }
        if cands.is_empty() {
            return Err(no_candidate(vocab));
        }

        let k = self.params.top_k;
        if k > 0 && k < cands.len() {
            cands.select_nth_unstable_by(k - 1, by_logit_desc);
            cands.truncate(k);
            // A fixed order for the draw below, so sampling from these candidates alone
            // ([`sample_candidates`](Self::sample_candidates)) picks the same token.
            cands.sort_unstable_by(by_logit_desc);
        }

        // Unnormalized probabilities relative to the best token (which gets weight 1), in f64 so
        // the tail of a large vocabulary does not vanish in the sum.
        let max = cands.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
        let inv_t = 1.0 / f64::from(self.params.temperature);
        let weights = &mut self.weights;
        weights.clear();
        weights.extend(cands.iter().map(|&(id, l)| (id, ((f64::from(l) - f64::from(max)) * inv_t).exp())));

        if self.params.top_p < 1.0 {
            nucleus(weights, f64::from(self.params.top_p));
        }

        let total: f64 = weights.iter().map(|w| w.1).sum();
        let target = self.rng.random::<f64>() * total;
        let mut cum = 0.0;
        for &(id, w) in weights.iter() {
            cum += w;
            if w > 0.0 && cum > target {
                return Ok(id);
            }
        }
        // Rounding left `target` at or above the running sum: take the last token that has
        // probability (the best token always does, with weight 1).
        weights.iter().rev().find(|w| w.1 > 0.0).map(|w| w.0).ok_or_else(|| no_candidate(vocab))
    }
}

fn no_candidate(vocab: usize) -> anyhow::Error {
    anyhow::anyhow!(
        "sampling: every one of the {vocab} logits is -inf or NaN, so no token has a non-zero \
         probability (expected at least one finite logit)"
    )
}

fn ids_where<'a>(logits: &'a [f32], keep: impl Fn(f32) -> bool + 'a) -> impl Iterator<Item = u32> + 'a {
    logits.iter().enumerate().filter(move |(_, l)| keep(**l)).map(|(i, _)| i as u32)
}

/// Descending logit, then ascending id: a total order, so truncation and ties are deterministic.
fn by_logit_desc(a: &(u32, f32), b: &(u32, f32)) -> Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// Presence and frequency penalties (OpenAI) and the repetition penalty (transformers).
fn apply_penalties(logits: &mut [f32], previous: &[u32], params: &SamplingParams) {
    let mut counts: HashMap<u32, u32> = HashMap::new();
    for &id in previous {
        if (id as usize) < logits.len() {
            *counts.entry(id).or_default() += 1;
        }
    }
    for (id, count) in counts {
        let l = &mut logits[id as usize];
        if params.repetition_penalty != 1.0 {
            *l = if *l > 0.0 { *l / params.repetition_penalty } else { *l * params.repetition_penalty };
        }
        *l -= params.presence_penalty + params.frequency_penalty * count as f32;
    }
}

/// The index of the largest logit, the lowest one on ties; `None` when all are `-inf`.
fn argmax(logits: &[f32]) -> Option<u32> {
    let mut best: Option<(u32, f32)> = None;
    for (i, &l) in logits.iter().enumerate() {
        if l > f32::NEG_INFINITY && best.is_none_or(|(_, b)| l > b) {
            best = Some((i as u32, l));
        }
    }
    best.map(|(i, _)| i)
}

/// Keeps the nucleus of `weights`: sorted by descending probability, the shortest prefix whose
/// cumulative probability reaches `top_p` (always at least the most likely token).
///
/// Sorting a 248k vocabulary every token is wasteful when the nucleus holds a handful of tokens,
/// so the sort is limited to the tokens above a weight threshold whenever those alone already
/// reach `top_p`: they form a prefix of the sorted order, so the nucleus lies within them and the
/// result is the same as sorting everything.
fn nucleus(weights: &mut Vec<(u32, f64)>, top_p: f64) {
    let total: f64 = weights.iter().map(|w| w.1).sum();
    let needed = top_p * total;
    for threshold in [1e-4, 1e-9, 0.0] {
        let above: f64 = weights.iter().filter(|w| w.1 >= threshold).map(|w| w.1).sum();
        if above >= needed || threshold == 0.0 {
            weights.retain(|w| w.1 >= threshold);
            break;
        }
    }
    weights.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut cum = 0.0;
    let mut keep = 0;
    for w in weights.iter() {
        if keep > 0 && cum >= needed {
            break;
        }
        cum += w.1;
        keep += 1;
    }
    weights.truncate(keep);
}

/// `log(softmax(logits))`, computed stably. `-inf` (and NaN) logits get `-inf`; if every logit
/// is `-inf` the result is all `-inf` (no token has probability).
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let clean = |l: f32| if l.is_nan() { f32::NEG_INFINITY } else { l };
    let max = logits.iter().map(|&l| clean(l)).fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return vec![f32::NEG_INFINITY; logits.len()];
    }
    if max == f32::INFINITY {
        let n = logits.iter().filter(|&&l| l == f32::INFINITY).count() as f32;
        return logits.iter().map(|&l| if l == f32::INFINITY { -n.ln() } else { f32::NEG_INFINITY }).collect();
    }
    let max64 = f64::from(max);
    let sum: f64 = logits.iter().map(|&l| (f64::from(clean(l)) - max64).exp()).sum();
    let lse = max64 + sum.ln();
    logits.iter().map(|&l| (f64::from(clean(l)) - lse) as f32).collect()
}

/// The `n` most likely tokens with their log-probabilities, most likely first (lowest id first on
/// ties). Tokens with zero probability are left out, so fewer than `n` may come back.
pub fn top_logprobs(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut all: Vec<(u32, f32)> = log_softmax(logits)
        .into_iter()
        .enumerate()
        .filter(|(_, lp)| *lp > f32::NEG_INFINITY)
        .map(|(i, lp)| (i as u32, lp))
        .collect();
    if n == 0 {
        return Vec::new();
    }
    if n < all.len() {
        all.select_nth_unstable_by(n - 1, by_logit_desc);
        all.truncate(n);
    }
    all.sort_unstable_by(by_logit_desc);
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nucleus_threshold_shortcut_matches_full_sort() {
        let mut rng = ChaCha20Rng::seed_from_u64(7);
        for case in 0..200 {
            let n = 1 + case % 50;
            let spread = [1.0, 5.0, 30.0][case % 3];
            let weights: Vec<(u32, f64)> =
                (0..n as u32).map(|i| (i, (-(rng.random::<f64>() * spread)).exp())).collect();
            for top_p in [0.01, 0.5, 0.9, 0.999] {
                let mut fast = weights.clone();
                nucleus(&mut fast, top_p);
                // Reference: full sort, prefix until the cumulative probability reaches top_p.
                let mut full = weights.clone();
                full.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                let total: f64 = weights.iter().map(|w| w.1).sum();
                let mut cum = 0.0;
                let mut keep = 0;
                while keep < full.len() && (keep == 0 || cum < top_p * total) {
                    cum += full[keep].1;
                    keep += 1;
                }
                full.truncate(keep);
                assert_eq!(fast, full, "case {case}, top_p {top_p}");
            }
        }
    }

    #[test]
    fn argmax_takes_lowest_id_on_ties_and_skips_neg_inf() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), Some(1));
        assert_eq!(argmax(&[f32::NEG_INFINITY, -5.0]), Some(1));
        assert_eq!(argmax(&[f32::NEG_INFINITY; 3]), None);
    }
}
