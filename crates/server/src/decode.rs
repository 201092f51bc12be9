//! One request's generation, a token at a time: sampling, stop conditions, detokenization and
//! log-probabilities. It never runs the model: the scheduler hands it the logits of the last position
//! and runs the forward it asks for, so several requests can take turns on one backend.
//!
//! Output passes three stages, each of which may hold something back:
//! 1. stop token sequences: tokens that could begin a stop sequence wait until they can no longer
//!    (a completed sequence is dropped, with nothing of it in the text);
//! 2. the stream decoder: bytes of an incomplete UTF-8 character wait for the tokens that end it;
//! 3. the stop-string filter: text that could begin a stop string waits likewise.
//!
//! Each token is reported with the text it belongs to, and carries its character offset in the
//! generated text (`text_offset` of the completions API).

use anyhow::Result;
use cherenkov_engine::generate::StopFilter;
use cherenkov_engine::sampling::{Sampler, log_softmax, top_logprobs};
use cherenkov_engine::tokenizer::{StreamDecoder, Tokenizer};

use crate::job::{Finish, GenParams, GenToken, TokenLogprob};

/// What to do after a step.
#[derive(Debug, PartialEq, Eq)]
pub enum Next {
    /// Run this token through the model and call [`Decoding::step`] with the logits.
    Forward(u32),
    Finished(Finish),
}

/// What one step produced.
#[derive(Debug)]
pub struct Step {
    pub text: String,
    pub tokens: Vec<GenToken>,
    pub next: Next,
}

/// A token that reached the stream decoder, waiting for its text to be emitted.
struct Released {
    token: GenToken,
    /// Byte range of its text in the decoder's output.
    start: usize,
    end: usize,
}

pub struct Decoding {
    params: GenParams,
    sampler: Sampler,
    /// Rows past the tokenizer's vocabulary are padding: never sampled, not in the logprobs.
    vocab: usize,
    /// Every sampled token except stop tokens (the penalties look at these).
    generated: Vec<u32>,
    held: Vec<GenToken>,
    decoder: StreamDecoder,
    filter: StopFilter,
    /// Decoder output so far, in bytes and characters.
    raw_bytes: usize,
    raw_chars: usize,
    emitted_bytes: usize,
    released: Vec<Released>,
    biased: Vec<f32>,
}

impl Decoding {
    /// Fails when the sampling parameters are invalid (requests are validated before this).
    pub fn new(params: GenParams, tokenizer: &Tokenizer) -> Result<Self> {
        let sampler = Sampler::try_new(params.sampling.clone())?;
        let filter = StopFilter::new(&params.stop_strings);
        Ok(Self {
            sampler,
            vocab: tokenizer.vocab_size(),
            generated: Vec::new(),
            held: Vec::new(),
            decoder: tokenizer.stream_decoder(true),
            filter,
            raw_bytes: 0,
            raw_chars: 0,
            emitted_bytes: 0,
            released: Vec::new(),
            biased: Vec::new(),
            params,
        })
    }

    /// Tokens sampled so far (stop tokens excluded).
    pub fn generated(&self) -> &[u32] {
        &self.generated
    }

    /// Call before the first step: with `max_tokens` 0 there is nothing to sample.
    pub fn done_before_start(&self) -> bool {
        self.params.max_tokens == 0
    }

    /// When the next token can be sampled from the `k` largest logits alone (greedy or a small
    /// top-k, without penalties, log-probabilities or a logit bias): `Some(k)`, and the scheduler
    /// asks the backend for just those (CUDA chooses them on the device instead of copying the
    /// whole vocabulary back) and calls [`Decoding::step_candidates`]. `None`: full logits and
    /// [`Decoding::step`].
    pub fn candidates_needed(&self) -> Option<usize> {
        if self.params.logprobs.is_some() || !self.params.logit_bias.is_empty() {
            return None;
        }
        self.sampler.candidates_needed()
    }

    /// [`Decoding::step`] from the `k` largest logits of the tokenizer's vocabulary as (id, logit) in
    /// descending order (ties to the lower id), `k` at least [`Decoding::candidates_needed`]: the
    /// same token, the same generator state, the same step.
    pub fn step_candidates(&mut self, candidates: &[(u32, f32)]) -> Result<Step> {
        anyhow::ensure!(self.candidates_needed().is_some(), "this request needs the full logits");
        let tok = self.sampler.sample_candidates(candidates)?;
        self.sampled(tok, None)
    }

    /// Samples from `logits` (the last position's, `[vocab]`) and applies every stop condition.
    pub fn step(&mut self, logits: &mut [f32]) -> Result<Step> {
        if logits.len() > self.vocab {
            logits[self.vocab..].fill(f32::NEG_INFINITY);
        }
        let tok = if self.params.logit_bias.is_empty() {
            self.sampler.try_sample(logits, &self.generated)?
        } else {
            self.biased.clear();
            self.biased.extend_from_slice(logits);
            for &(id, b) in &self.params.logit_bias {
                if let Some(l) = self.biased.get_mut(id as usize) {
                    *l += b;
                }
            }
            self.sampler.try_sample(&self.biased, &self.generated)?
        };
        let logprob = self.params.logprobs.map(|k| TokenLogprob {
            id: tok,
            logprob: Some(log_softmax(logits)[tok as usize]),
            top: top_logprobs(logits, k),
        });
        self.sampled(tok, logprob)
    }

    /// Everything after sampling `tok`: stop tokens, sequences and strings, release, the length.
    fn sampled(&mut self, tok: u32, logprob: Option<TokenLogprob>) -> Result<Step> {
        let mut out = Step { text: String::new(), tokens: Vec::new(), next: Next::Forward(tok) };
        if self.params.stop_tokens.contains(&tok) {
            self.finish(&mut out, Finish::Stop)?;
            return Ok(out);
        }
        self.generated.push(tok);
        self.held.push(GenToken { id: tok, text_offset: 0, logprob });

        if let Some(n) = self.completed_stop_sequence() {
            self.held.truncate(self.held.len() - n);
            if self.release_held(&mut out)? {
                return Ok(out);
            }
            self.finish(&mut out, Finish::Stop)?;
            return Ok(out);
        }
        let keep = self.longest_partial_stop_sequence();
        let release: Vec<GenToken> = self.held.drain(..self.held.len() - keep).collect();
        for t in release {
            if self.release(t, &mut out)? {
                out.next = Next::Finished(Finish::Stop);
                return Ok(out);
            }
        }
        if self.generated.len() >= self.params.max_tokens {
            self.finish(&mut out, Finish::Length)?;
        }
        Ok(out)
    }

    /// The length of a stop sequence the generated tokens end with.
    fn completed_stop_sequence(&self) -> Option<usize> {
        self.params
            .stop_sequences
            .iter()
            .filter(|s| !s.is_empty() && s.len() <= self.held.len() && self.generated.ends_with(s))
            .map(Vec::len)
            .max()
    }

    /// The longest suffix of the held tokens that is a proper prefix of some stop sequence.
    fn longest_partial_stop_sequence(&self) -> usize {
        let held: Vec<u32> = self.held.iter().map(|t| t.id).collect();
        (1..=held.len())
            .rev()
            .find(|&n| self.params.stop_sequences.iter().any(|s| s.len() > n && s.starts_with(&held[held.len() - n..])))
            .unwrap_or(0)
    }

    /// Releases every held token; true when a stop string ended the output.
    fn release_held(&mut self, out: &mut Step) -> Result<bool> {
        for t in std::mem::take(&mut self.held) {
            if self.release(t, out)? {
                out.next = Next::Finished(Finish::Stop);
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Passes one token to the decoder and its text to the stop-string filter; true when a stop
    /// string was found (the output ends there).
    fn release(&mut self, mut token: GenToken, out: &mut Step) -> Result<bool> {
        let piece = self.decoder.push(token.id)?;
        token.text_offset = self.raw_chars;
        let start = self.raw_bytes;
        self.raw_bytes += piece.len();
        self.raw_chars += piece.chars().count();
        self.released.push(Released { token, start, end: self.raw_bytes });
        Ok(self.filter_text(&piece, out))
    }

    fn filter_text(&mut self, piece: &str, out: &mut Step) -> bool {
        let (text, stopped) = self.filter.push(piece);
        self.emit(&text, stopped, out);
        stopped
    }

    /// Appends `text` to the output with the tokens whose text it completes (after a stop string:
    /// those whose text it starts).
    fn emit(&mut self, text: &str, stopped: bool, out: &mut Step) {
        self.emitted_bytes += text.len();
        out.text.push_str(text);
        let done = if stopped {
            self.released.iter().take_while(|r| r.start < self.emitted_bytes).count()
        } else {
            self.released.iter().take_while(|r| r.end <= self.emitted_bytes).count()
        };
        out.tokens.extend(self.released.drain(..done).map(|r| r.token));
        if stopped {
            self.released.clear();
        }
    }

    /// Ends the output: releases held tokens and flushes the decoder and the stop-string filter.
    fn finish(&mut self, out: &mut Step, finish: Finish) -> Result<()> {
        out.next = Next::Finished(finish);
        if self.release_held(out)? {
            return Ok(());
        }
        let rest = self.decoder.finish()?;
        if self.filter_text(&rest, out) {
            out.next = Next::Finished(Finish::Stop);
            return Ok(());
        }
        let tail = self.filter.finish();
        self.emitted_bytes += tail.len();
        out.text.push_str(&tail);
        out.tokens.extend(self.released.drain(..).map(|r| r.token));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cherenkov_engine::sampling::SamplingParams;

    fn tokenizer() -> Tokenizer {
        Tokenizer::from_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures/golden/tiny-b/mlx4")).unwrap()
    }

    fn params() -> GenParams {
        GenParams {
            max_tokens: 100,
            sampling: SamplingParams::greedy(),
            logit_bias: vec![],
            stop_tokens: vec![2],
            stop_sequences: vec![],
            stop_strings: vec![],
            logprobs: None,
            prompt_logprobs: None,
        }
    }

    /// Runs greedy steps that pick `ids` in turn; returns the text, the reported ids and the end.
    fn run(p: GenParams, ids: &[u32]) -> (String, Vec<u32>, Option<Finish>, Vec<GenToken>) {
        let tok = tokenizer();
        let mut d = Decoding::new(p, &tok).unwrap();
        let (mut text, mut tokens) = (String::new(), Vec::new());
        for &id in ids {
            let mut logits = vec![0f32; 512];
            logits[id as usize] = 10.0;
            let step = d.step(&mut logits).unwrap();
            text.push_str(&step.text);
            tokens.extend(step.tokens);
            if let Next::Finished(f) = step.next {
                return (text, tokens.iter().map(|t| t.id).collect(), Some(f), tokens);
            }
        }
        (text, tokens.iter().map(|t| t.id).collect(), None, tokens)
    }

    /// From the k largest logits a step picks what it picks from all of them (greedy and seeded
    /// top-k), step after step; requests that need every logit say so.
    #[test]
    fn candidates_give_the_steps_of_full_logits() {
        let tok = tokenizer();
        let top_k = SamplingParams { temperature: 0.8, top_k: 5, seed: Some(3), ..SamplingParams::default() };
        for sampling in [SamplingParams::greedy(), top_k] {
            let p = GenParams { sampling, stop_tokens: vec![], ..params() };
            let (mut full, mut cand) = (Decoding::new(p.clone(), &tok).unwrap(), Decoding::new(p, &tok).unwrap());
            let k = cand.candidates_needed().expect("greedy and small top-k take candidates");
            let mut seed = 17u64;
            for _ in 0..40 {
                let mut logits: Vec<f32> = (0..512)
                    .map(|_| {
                        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        (seed >> 40) as f32 / (1u64 << 22) as f32
                    })
                    .collect();
                let cands = cherenkov_engine::backend::top_of(&logits[..tok.vocab_size().min(512)], k);
                let (a, b) = (full.step(&mut logits).unwrap(), cand.step_candidates(&cands).unwrap());
                assert_eq!((a.next, a.text), (b.next, b.text));
            }
            assert_eq!(full.generated(), cand.generated());
        }
        let logprobs = GenParams { logprobs: Some(2), ..params() };
        assert_eq!(Decoding::new(logprobs, &tok).unwrap().candidates_needed(), None);
        let biased = GenParams { logit_bias: vec![(5, 1.0)], ..params() };
        let mut d = Decoding::new(biased, &tok).unwrap();
        assert_eq!(d.candidates_needed(), None);
        assert!(d.step_candidates(&[(5, 1.0)]).is_err());
    }

    #[test]
    fn stop_sequences_hold_tokens_back_and_drop_a_match() {
        let tok = tokenizer();
        let ids = tok.encode("one two three four", false).unwrap();
        assert!(ids.len() >= 4, "{ids:?}");
        let p = GenParams { stop_sequences: vec![vec![ids[1], ids[3]], vec![ids[2], ids[3]]], ..params() };
        // ids[1] could start a sequence; ids[2] ends that hope, so both are released; then
        // ids[2], ids[3] match the second sequence, which is dropped.
        let (text, reported, finish, _) = run(p, &ids);
        assert_eq!(finish, Some(Finish::Stop));
        assert_eq!(reported, &ids[..2]);
        assert_eq!(text, tok.decode(&ids[..2], true).unwrap());
    }

    #[test]
    fn budgets_stop_tokens_and_offsets() {
        let tok = tokenizer();
        let ids = tok.encode("alpha beta gamma delta", false).unwrap();
        let (text, reported, finish, tokens) = run(GenParams { max_tokens: 3, logprobs: Some(2), ..params() }, &ids);
        assert_eq!((finish, &reported[..]), (Some(Finish::Length), &ids[..3]));
        assert_eq!(text, tok.decode(&ids[..3], true).unwrap());
        let offsets: Vec<usize> = tokens.iter().map(|t| t.text_offset).collect();
        let want: Vec<usize> = (0..3).map(|i| tok.decode(&ids[..i], true).unwrap().chars().count()).collect();
        assert_eq!(offsets, want);
        let lp = tokens[0].logprob.as_ref().unwrap();
        assert_eq!((lp.top.len(), lp.top[0].0), (2, ids[0]));
        // An EOS ends it and is not reported.
        let (_, reported, finish, _) = run(params(), &[ids[0], 2, ids[1]]);
        assert_eq!((finish, reported), (Some(Finish::Stop), vec![ids[0]]));
    }

    #[test]
    fn stop_strings_cut_the_text_and_the_tokens_after() {
        let tok = tokenizer();
        let ids = tok.encode("red green blue", false).unwrap();
        let p = GenParams { stop_strings: vec!["een bl".into()], ..params() };
        let (text, reported, finish, _) = run(p, &ids);
        assert_eq!((finish, text.as_str()), (Some(Finish::Stop), "red gr"));
        // The tokens whose text reaches into what was kept.
        let kept = reported.len();
        assert!(tok.decode(&ids[..kept], true).unwrap().starts_with("red gr"), "{reported:?}");
        assert!(!tok.decode(&ids[..kept - 1], true).unwrap().starts_with("red gr"), "{reported:?}");
    }
}
