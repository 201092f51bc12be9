//! The decode loop: prefill a prompt, then sample one token at a time until a stop condition.
//!
//! Text is streamed as it becomes complete (the stream decoder holds back partial UTF-8), and held
//! back further while it could still be the start of a stop string, so a stop string never reaches
//! the caller. Timing separates prefill from decode, so tokens/s figures mean what they say.
//!
//! With drafting on ([`GenerateOptions::draft`]), each decode step lets the model's MTP head draft
//! the token after the one just sampled, runs both through the trunk in one verifying forward, and
//! keeps the draft where the trunk's own sample at that position equals it. The tokens sampled are
//! the same as without drafting, in the same order from the same generator: a draft only decides
//! how many of them one forward yields.

use std::time::Instant;

use anyhow::Result;

use crate::backend::{Backend, Logits};
use crate::sampling::{Sampler, SamplingParams};
use crate::tokenizer::Tokenizer;

#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Token ids that end generation (EOS); the stop token itself is not part of the text.
    pub stop_tokens: Vec<u32>,
    /// Strings that end generation; the text stops before the first occurrence.
    pub stop_strings: Vec<String>,
    /// Tokens the MTP head drafts per decode step (0: off; at most [`MAX_DRAFT`]). Needs a fresh
    /// session and a backend and model that can draft.
    pub draft: usize,
}

/// The most drafted tokens per step this engine runs (the MTP head's first draft; chaining a
/// second draft on the head's own residual is not built yet).
pub const MAX_DRAFT: usize = 1;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token or stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The caller asked to stop (e.g. a client disconnected).
    Cancelled,
}

impl FinishReason {
    /// The OpenAI spelling.
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct Timing {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub prefill_secs: f64,
    /// Time in decode steps (a forward each; with drafting, the draft, the verifying forward
    /// and its commit).
    pub decode_secs: f64,
    pub decode_steps: usize,
    /// Tokens sampled from decode steps' logits (every generated token after the first).
    pub decode_tokens: usize,
    /// Drafted tokens verified, and how many of them the trunk accepted.
    pub drafted: usize,
    pub accepted: usize,
}

impl Timing {
    pub fn prefill_tps(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_secs.max(1e-9)
    }
    /// Decode tokens/s: the tokens decode steps gave over the time they took (the first token
    /// comes from the prefill's logits and is not counted).
    pub fn decode_tps(&self) -> f64 {
        self.decode_tokens as f64 / self.decode_secs.max(1e-9)
    }

    /// The share of drafted tokens the trunk accepted (`None` without drafts).
    pub fn acceptance(&self) -> Option<f64> {
        (self.drafted > 0).then(|| self.accepted as f64 / self.drafted as f64)
    }
}

#[derive(Clone, Debug)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish: FinishReason,
    pub timing: Timing,
    /// The seed the sampler used (to reproduce the run).
    pub seed: u64,
}

/// Holds back text that may be the beginning of a stop string.
pub struct StopFilter {
    stops: Vec<String>,
    pending: String,
}

impl StopFilter {
    /// A filter for `stops` (empty strings are ignored).
    pub fn new(stops: &[String]) -> Self {
        Self { stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(), pending: String::new() }
    }

    /// Adds text; returns (text safe to emit, whether a stop string was found). After a stop
    /// string, the text from it on is dropped.
    pub fn push(&mut self, s: &str) -> (String, bool) {
        self.pending.push_str(s);
        if let Some(at) = self.stops.iter().filter_map(|st| self.pending.find(st.as_str())).min() {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return (out, true);
        }
        // Keep the longest suffix that is a proper prefix of some stop string.
        let mut keep = 0;
        for st in &self.stops {
            for (i, _) in st.char_indices().skip(1) {
                if self.pending.ends_with(&st[..i]) {
                    keep = keep.max(i);
                }
            }
        }
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
    }

    /// The text still held back, at the end of a generation that no stop string ended.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

/// Prefills `prompt` after the session's history and generates. `on_text` receives text as it
/// becomes final; returning false cancels.
pub fn generate<B: Backend>(
    backend: &B,
    session: &mut B::Session,
    prompt: &[u32],
    tokenizer: &Tokenizer,
    opts: &GenerateOptions,
    on_text: &mut dyn FnMut(&str) -> bool,
) -> Result<Generation> {
    opts.sampling.validate()?;
    if opts.draft > MAX_DRAFT {
        anyhow::bail!("at most {MAX_DRAFT} drafted token(s) per step are supported, not {}", opts.draft);
    }
    if opts.draft > 0 {
        backend.enable_drafting(session)?;
    }
    let mut sampler = Sampler::new(opts.sampling.clone());
    let mut next = NextToken::new(tokenizer, &sampler);
    let mut timing = Timing { prompt_tokens: prompt.len(), ..Timing::default() };
    let t0 = Instant::now();
    next.forward(backend, session, prompt)?;
    timing.prefill_secs = t0.elapsed().as_secs_f64();

    let mut decoder = tokenizer.stream_decoder(true);
    let mut filter = StopFilter::new(&opts.stop_strings);
    let mut tokens = Vec::new();
    let mut text = String::new();
    let mut emit = |out: &str, text: &mut String| -> bool {
        if out.is_empty() {
            return true;
        }
        text.push_str(out);
        on_text(out)
    };
    let mut stop_string_hit = false;
    // With drafting: the last verifying forward's draft and its second row (the logits after the
    // draft), until the forward is committed.
    let mut verifying: Option<(u32, NextToken)> = None;
    let finish = loop {
        if tokens.len() == opts.max_tokens {
            break FinishReason::Length;
        }
        if opts.draft == 0 && !tokens.is_empty() {
            let ts = Instant::now();
            next.forward(backend, session, &tokens[tokens.len() - 1..])?;
            timing.decode_secs += ts.elapsed().as_secs_f64();
            timing.decode_steps += 1;
        }
        let tok = next.sample(&mut sampler, &tokens)?;
        if !tokens.is_empty() {
            timing.decode_tokens += 1;
        }
        let mut finish = None;
        if opts.stop_tokens.contains(&tok) {
            finish = Some(FinishReason::Stop);
        } else {
            tokens.push(tok);
            let (out, stopped) = filter.push(&decoder.push(tok)?);
            if !emit(&out, &mut text) {
                finish = Some(FinishReason::Cancelled);
            } else if stopped {
                stop_string_hit = true;
                finish = Some(FinishReason::Stop);
            }
        }
        let ends = finish.is_some() || tokens.len() == opts.max_tokens;
        // Commit the verifying forward: the sampled token's row, and the draft's where the draft is
        // the sampled token (unless generation ends here: the last token stays unforwarded, as
        // without drafting).
        let mut have_next = false;
        if let Some((d, row)) = verifying.take() {
            timing.drafted += 1;
            let keep = if d == tok {
                timing.accepted += 1;
                if ends { 1 } else { 2 }
            } else {
                1
            };
            let ts = Instant::now();
            backend.commit(session, keep)?;
            timing.decode_secs += ts.elapsed().as_secs_f64();
            if keep == 2 {
                next = row;
                have_next = true;
            }
        }
        if let Some(f) = finish {
            break f;
        }
        if opts.draft > 0 && !ends && !have_next {
            let ts = Instant::now();
            let d = backend.draft_top(session, tok, 1, next.vocab)?[0].0;
            let mut rows = next.verify(backend, session, &[tok, d])?;
            let missing = || anyhow::anyhow!("the verifying forward gave fewer than two rows");
            let second = rows.pop().ok_or_else(missing)?;
            next = rows.pop().ok_or_else(missing)?;
            verifying = Some((d, second));
            timing.decode_secs += ts.elapsed().as_secs_f64();
            timing.decode_steps += 1;
        }
    };
    // Flush what the decoder and the stop filter still hold (unless a stop string cut the text).
    if finish != FinishReason::Cancelled && !stop_string_hit {
        let (mut out, stopped) = filter.push(&decoder.finish()?);
        if !stopped {
            out.push_str(&filter.finish());
        }
        emit(&out, &mut text);
    }
    timing.completion_tokens = tokens.len();
    Ok(Generation { tokens, text, finish, timing, seed: sampler.seed() })
}

/// One forward's output, in the form the sampler needs: the few largest logits when that is all
/// it looks at (greedy or small top-k without penalties; the backend picks them where the logits
/// live), else every logit.
struct NextToken {
    vocab: usize,
    /// Candidates to ask the backend for (among the tokenizer's ids: rows past them pad the
    /// embedding and are never sampled). `None`: full logits.
    ask: Option<usize>,
    logits: Vec<f32>,
    candidates: Vec<(u32, f32)>,
}

impl NextToken {
    fn new(tokenizer: &Tokenizer, sampler: &Sampler) -> Self {
        Self {
            vocab: tokenizer.vocab_size(),
            ask: sampler.candidates_needed(),
            logits: Vec::new(),
            candidates: Vec::new(),
        }
    }

    fn forward<B: Backend>(&mut self, backend: &B, session: &mut B::Session, tokens: &[u32]) -> Result<()> {
        match self.ask {
            Some(k) => {
                self.candidates = backend.forward_top(session, tokens, k, self.vocab)?;
            }
            None => {
                self.logits = backend.forward(session, tokens, Logits::Last)?;
                // Rows past the tokenizer's vocabulary are padding of the embedding: never sample them.
                if self.logits.len() > self.vocab {
                    self.logits[self.vocab..].fill(f32::NEG_INFINITY);
                }
            }
        }
        Ok(())
    }

    /// A verifying forward of `tokens`, each row in this form: its candidates where that is all the
    /// sampler needs ([`Backend::verify_top`]), else every logit.
    fn verify<B: Backend>(&self, backend: &B, session: &mut B::Session, tokens: &[u32]) -> Result<Vec<NextToken>> {
        let row = |logits: Vec<f32>, candidates: Vec<(u32, f32)>| NextToken {
            vocab: self.vocab,
            ask: self.ask,
            logits,
            candidates,
        };
        Ok(match self.ask {
            Some(k) => {
                backend.verify_top(session, tokens, k, self.vocab)?.into_iter().map(|c| row(Vec::new(), c)).collect()
            }
            None => {
                let logits = backend.verify(session, tokens)?;
                let vocab = logits.len() / tokens.len().max(1);
                logits
                    .chunks(vocab.max(1))
                    .map(|r| {
                        let mut l = r.to_vec();
                        // Rows past the tokenizer's vocabulary are padding of the embedding.
                        if l.len() > self.vocab {
                            l[self.vocab..].fill(f32::NEG_INFINITY);
                        }
                        row(l, Vec::new())
                    })
                    .collect()
            }
        })
    }

    /// Penalties count `generated` tokens only (OpenAI semantics).
    fn sample(&self, sampler: &mut Sampler, generated: &[u32]) -> Result<u32> {
        match self.ask {
            Some(_) => sampler.sample_candidates(&self.candidates),
            None => sampler.try_sample(&self.logits, generated),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_filter_holds_back_prefixes() {
        let mut f = StopFilter::new(&["</end>".into(), String::new()]);
        assert_eq!(f.push("hello </e"), ("hello ".to_string(), false));
        assert_eq!(f.push("x"), ("</ex".to_string(), false));
        assert_eq!(f.push("ok </en"), ("ok ".to_string(), false));
        assert_eq!(f.push("d> tail"), (String::new(), true));
    }
}
