//! The inference thread: the only place forwards run.
//!
//! Up to `scheduler.max_active` requests are active at once; each turn of the loop gives every
//! active request one step, which is one forward: a chunk of its prompt (at most
//! `scheduler.prefill_chunk` tokens, cut at snapshot points) or one generated token. So two requests
//! decode interleaved, token by token, on one backend, and a long prompt does not stall the others
//! for more than a chunk. Requests beyond that wait in the queue ([`crate::queue`]).
//!
//! Before each step a request is checked for a client that went away (its event receiver was
//! dropped) and for its deadline; either ends it there, dropping its session. Prompts start from
//! the longest prefix the [`PrefixCache`] holds and store snapshots at their end, at the chat
//! boundary the handler marked, at a branch point from earlier prompts, and every
//! `cache.block_tokens` tokens.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Result;
use cherenkov_engine::backend::{Backend, Logits};
use cherenkov_engine::sampling::{log_softmax, top_logprobs};
use cherenkov_engine::tokenizer::Tokenizer;

use crate::config::Config;
use crate::decode::{Decoding, Next};
use crate::error::ApiError;
use crate::job::{Event, Finish, Job, TokenLogprob, Usage};
use crate::prefix_cache::{CachePolicy, PrefixCache};
use crate::queue::Shared;
use crate::stats::StepKind;

/// A branch point (see [`PrefixCache::shared_prefix`]) gets a snapshot when it saves at least
/// this many tokens over what the cache restores already; shorter shared beginnings (a chat
/// template's opening) are not worth a snapshot's memory.
const MIN_BRANCH_TOKENS: usize = 16;

pub fn cache_policy(c: &Config) -> CachePolicy {
    CachePolicy {
        enabled: c.cache.enabled,
        max_bytes: c.cache.max_bytes.0,
        max_entries: c.cache.max_entries,
        idle: Duration::from_secs(c.cache.idle_secs),
        max_sessions: c.sessions.max,
        session_idle: Duration::from_secs(c.sessions.idle_secs),
    }
}

/// Starts the inference thread.
pub fn spawn<B: Backend + 'static>(backend: Arc<B>, tokenizer: Tokenizer, shared: Arc<Shared>) -> JoinHandle<()> {
    std::thread::Builder::new()
        .name("cherenkov-inference".into())
        .spawn(move || Scheduler::new(backend, tokenizer, shared).run())
        .expect("cannot start the inference thread")
}

/// How a step left a request.
enum State {
    Running,
    Finished,
}

/// What the last forward left for the next sampling step.
enum NextLogits {
    /// Every logit of the last position.
    Full(Vec<f32>),
    /// Only the largest few of the tokenizer's vocabulary, as (id, logit) in descending order: all
    /// the request's sampler looks at (`Decoding::candidates_needed`).
    Top(Vec<(u32, f32)>),
}

impl NextLogits {
    fn full(&self) -> Option<&[f32]> {
        match self {
            NextLogits::Full(l) => Some(l),
            NextLogits::Top(_) => None,
        }
    }
}

struct Active<S> {
    job: Job,
    serial: u64,
    session: S,
    /// Prompt tokens processed.
    pos: usize,
    cached: usize,
    /// The logits after the session's last token, once the prompt is done.
    logits: Option<NextLogits>,
    prompt_logprobs: Option<Vec<TokenLogprob>>,
    decoding: Decoding,
    /// Generated tokens run through the model (all but the last sampled one).
    forwarded: Vec<u32>,
    /// Whether the session drafts with the MTP head.
    drafts: bool,
    /// The last verifying forward's draft and the logits after it, until the forward is
    /// committed (the next sampled token says how many of its rows stay).
    verifying: Option<(u32, NextLogits)>,
    prompt_reported: bool,
    started: Instant,
    /// The last event (Done or Error), sent once the counters and `/status` show the request
    /// finished, so a client that saw its end never sees it still running.
    last: Option<Event>,
}

struct Scheduler<B: Backend> {
    backend: Arc<B>,
    tokenizer: Tokenizer,
    shared: Arc<Shared>,
    cache: PrefixCache<B::Session>,
    config: Arc<Config>,
    generation: u64,
    serial: u64,
    /// Whether the backend reports session sizes (the prefix cache is bounded in bytes).
    sizes_known: bool,
}

impl<B: Backend> Scheduler<B> {
    fn new(backend: Arc<B>, tokenizer: Tokenizer, shared: Arc<Shared>) -> Self {
        let config = shared.live.get();
        let mut policy = cache_policy(&config);
        let sizes_known = match backend.new_session() {
            Ok(s) => backend.session_bytes(&s).is_some(),
            Err(e) => {
                eprintln!("prefix cache: off (a first session could not be made: {e:#})");
                false
            }
        };
        if !sizes_known && policy.enabled {
            eprintln!("prefix cache: off (the {} backend does not report session sizes)", backend.name());
        }
        policy.enabled &= sizes_known;
        Self {
            cache: PrefixCache::new(policy),
            generation: shared.live.generation(),
            backend,
            tokenizer,
            shared,
            config,
            serial: 0,
            sizes_known,
        }
    }

    fn run(mut self) {
        let mut active: Vec<Active<B::Session>> = Vec::new();
        loop {
            self.reconfigure();
            let room = self.config.scheduler.max_active.saturating_sub(active.len());
            let wait = active.is_empty().then_some(Duration::from_millis(500));
            let intake = self.shared.take(room, active.len(), wait);
            if intake.shutdown {
                return;
            }
            let now = Instant::now();
            for (id, reply) in intake.drops {
                let _ = reply.send(self.cache.drop_session(&id));
            }
            for job in intake.jobs {
                if let Some(a) = self.admit(job) {
                    active.push(a);
                }
            }
            self.cache.expire(now);
            let mut last = Vec::new();
            active.retain_mut(|a| {
                let going = self.step_guarded(a);
                if !going && let Some(event) = a.last.take() {
                    last.push((a.job.events.clone(), event));
                }
                going
            });
            self.shared.set_active(active.len());
            self.shared.publish_cache_stats(self.cache.stats());
            for (events, event) in last {
                let _ = events.send(event);
            }
        }
    }

    /// One step; true while the request goes on. A panic ends the request with a 500, not the
    /// thread that serves everyone.
    fn step_guarded(&mut self, a: &mut Active<B::Session>) -> bool {
        match catch_unwind(AssertUnwindSafe(|| self.step(a))) {
            Ok(State::Running) => true,
            Ok(State::Finished) => false,
            Err(panic) => {
                let what = panic_message(&panic);
                self.fail(a, ApiError::server(format!("internal error: the inference step panicked: {what}")));
                false
            }
        }
    }

    /// Picks up a reloaded configuration.
    fn reconfigure(&mut self) {
        let generation = self.shared.live.generation();
        if generation == self.generation {
            return;
        }
        self.generation = generation;
        self.config = self.shared.live.get();
        let mut policy = cache_policy(&self.config);
        policy.enabled &= self.sizes_known;
        self.cache.set_policy(policy, Instant::now());
    }

    /// Starts a job from the longest cached prefix (unless it wants prompt logprobs, which need
    /// every prompt position's logits).
    fn admit(&mut self, job: Job) -> Option<Active<B::Session>> {
        if job.events.is_closed() {
            self.shared.counters.cancelled.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let decoding = match Decoding::new(job.params.clone(), &self.tokenizer) {
            Ok(d) => d,
            Err(e) => {
                let _ = job.events.send(Event::Error(ApiError::bad_request(e.to_string())));
                self.shared.counters.failed.fetch_add(1, Ordering::Relaxed);
                return None;
            }
        };
        // The longest cached prefix, restored as the request's session (no fresh one is made for
        // it, which on CUDA would hold a second session's memory for a moment).
        let mut restored = None;
        let mut snapshot_at = Vec::new();
        if job.params.prompt_logprobs.is_none() {
            let owner = job.session_id.as_deref();
            let branch = self.cache.shared_prefix(&job.prompt, owner);
            let mut failed = None;
            if let Some(hit) = self.cache.lookup(&job.prompt, owner, Instant::now()) {
                match self.backend.snapshot_session(hit.state) {
                    Ok(s) => restored = Some((s, hit.len, hit.logits)),
                    Err(e) => {
                        eprintln!(
                            "{}: prefix cache: the snapshot of {} tokens could not be restored ({e:#}); running the whole prompt",
                            job.id, hit.len
                        );
                        failed = Some(hit.len);
                    }
                }
            }
            if let Some(len) = failed {
                self.cache.restore_failed(len);
            }
            let from = restored.as_ref().map_or(0, |r| r.1);
            if branch >= from + MIN_BRANCH_TOKENS && branch < job.prompt.len() {
                snapshot_at.push(branch);
            }
        }
        let draft = self.config.scheduler.draft;
        let (session, pos, logits) = match restored {
            Some(r) => r,
            None => match self.backend.new_session() {
                Ok(mut s) => {
                    // The head's cache must cover the prompt, so drafting starts with the session.
                    if draft > 0
                        && let Err(e) = self.backend.enable_drafting(&mut s)
                    {
                        eprintln!("{}: drafting off for this request: {e:#}", job.id);
                    }
                    (s, 0, None)
                }
                Err(e) => {
                    let message = format!("cannot start a session for this request: {e:#}");
                    eprintln!("{}: failed: {message}", job.id);
                    let _ = job.events.send(Event::Error(ApiError::unavailable(message)));
                    self.shared.counters.failed.fetch_add(1, Ordering::Relaxed);
                    return None;
                }
            },
        };
        self.serial += 1;
        let mut a = Active {
            serial: self.serial,
            session,
            pos,
            cached: pos,
            logits: logits.map(NextLogits::Full),
            prompt_logprobs: None,
            decoding,
            forwarded: Vec::new(),
            drafts: false,
            verifying: None,
            prompt_reported: false,
            started: Instant::now(),
            last: None,
            job,
        };
        a.drafts = draft > 0 && self.backend.drafting(&a.session);
        a.job.snapshot_at.extend(snapshot_at);
        if a.job.params.prompt_logprobs.is_some() {
            a.prompt_logprobs = Some(vec![TokenLogprob { id: a.job.prompt[0], logprob: None, top: Vec::new() }]);
        }
        Some(a)
    }

    fn step(&mut self, a: &mut Active<B::Session>) -> State {
        if a.job.events.is_closed() {
            self.shared.counters.cancelled.fetch_add(1, Ordering::Relaxed);
            eprintln!("{}: cancelled (the client went away) after {} tokens", a.job.id, a.decoding.generated().len());
            return State::Finished;
        }
        if Instant::now() > a.job.deadline {
            self.shared.counters.timed_out.fetch_add(1, Ordering::Relaxed);
            a.last = Some(Event::Error(ApiError::timeout(a.job.timeout_secs)));
            eprintln!("{}: timed out after {} s", a.job.id, a.job.timeout_secs);
            return State::Finished;
        }
        let result = if a.pos < a.job.prompt.len() { self.prefill(a) } else { self.decode(a) };
        result.unwrap_or_else(|e| {
            self.fail(a, ApiError::server(format!("{e:#}")));
            State::Finished
        })
    }

    fn fail(&self, a: &mut Active<B::Session>, e: ApiError) {
        eprintln!("{}: failed: {}", a.job.id, e.message);
        self.shared.counters.failed.fetch_add(1, Ordering::Relaxed);
        a.last = Some(Event::Error(e));
    }

    /// Runs the next chunk of the prompt.
    fn prefill(&mut self, a: &mut Active<B::Session>) -> Result<State> {
        let prompt = &a.job.prompt;
        let end = self.chunk_end(a);
        let which = if a.prompt_logprobs.is_some() { Logits::All } else { Logits::Last };
        let out = self.forward(StepKind::Prefill, &mut a.session, &prompt[a.pos..end], which)?;
        let vocab = out.len() / if which == Logits::All { end - a.pos } else { 1 };
        if let (Some(lps), Some(k)) = (&mut a.prompt_logprobs, a.job.params.prompt_logprobs) {
            let usable = self.tokenizer.vocab_size().min(vocab);
            for (r, row) in out.chunks_exact(vocab).enumerate() {
                let next = a.pos + r + 1;
                if next < prompt.len() {
                    lps.push(score(&row[..usable], prompt[next], k));
                }
            }
        }
        let last = out[out.len() - vocab..].to_vec();
        a.pos = end;
        let boundary = end == prompt.len() || a.job.snapshot_at.contains(&end) || self.is_block_boundary(end);
        if boundary {
            self.snapshot(a, &a.job.prompt[..end], Some(&last));
        }
        a.logits = Some(NextLogits::Full(last));
        Ok(State::Running)
    }

    /// One forward, recorded in the step log with the backend's time split over it.
    fn forward(&self, kind: StepKind, session: &mut B::Session, tokens: &[u32], which: Logits) -> Result<Vec<f32>> {
        self.recorded(kind, tokens.len(), || self.backend.forward(session, tokens, which))
    }

    /// One decode forward that returns only the `k` largest logits (see [`NextLogits::Top`]).
    fn forward_top(&self, session: &mut B::Session, token: u32, k: usize) -> Result<Vec<(u32, f32)>> {
        let among = self.tokenizer.vocab_size().min(self.backend.vocab_size());
        self.recorded(StepKind::Decode, 1, || self.backend.forward_top(session, &[token], k, among))
    }

    /// Runs `run` (one forward of `tokens` tokens), recorded in the step log.
    fn recorded<T>(&self, kind: StepKind, tokens: usize, run: impl FnOnce() -> Result<T>) -> Result<T> {
        if !cherenkov_engine::stats::ENABLED {
            return run();
        }
        let before = self.backend.forward_stats();
        let t = Instant::now();
        let out = run()?;
        let elapsed = t.elapsed();
        let split = before.zip(self.backend.forward_stats()).map(|(b, a)| a.since(&b));
        self.shared.steps.record(kind, tokens, elapsed, split);
        Ok(out)
    }

    /// Where the chunk starting at `a.pos` ends: the prompt's end, the chunk size, or the next
    /// snapshot point, whichever comes first.
    fn chunk_end(&self, a: &Active<B::Session>) -> usize {
        let len = a.job.prompt.len();
        let mut end = len.min(a.pos + self.config.scheduler.prefill_chunk);
        let block = self.config.cache.block_tokens;
        if block > 0 && self.cache.enabled() {
            end = end.min((a.pos / block + 1) * block);
        }
        if let Some(&p) = a.job.snapshot_at.iter().filter(|&&p| p > a.pos).min() {
            end = end.min(p);
        }
        end
    }

    fn is_block_boundary(&self, pos: usize) -> bool {
        let block = self.config.cache.block_tokens;
        block > 0 && pos.is_multiple_of(block)
    }

    /// Keeps a copy of the session after `tokens`, with the logits that follow them when the last
    /// forward returned them all (a snapshot without them serves only longer prompts).
    fn snapshot(&mut self, a: &Active<B::Session>, tokens: &[u32], logits: Option<&[f32]>) {
        let owner = a.job.session_id.as_deref();
        if !self.cache.wants(tokens, owner) {
            return;
        }
        let Some(bytes) = self.backend.session_bytes(&a.session) else { return };
        match self.backend.snapshot_session(&a.session) {
            Ok(s) => self.cache.insert(tokens, s, logits.unwrap_or(&[]), bytes, owner, a.serial, Instant::now()),
            Err(e) => eprintln!("{}: prefix cache: no snapshot of {} tokens ({e:#})", a.job.id, tokens.len()),
        }
    }

    /// Samples one token from the last logits and runs it through the model.
    fn decode(&mut self, a: &mut Active<B::Session>) -> Result<State> {
        if !a.prompt_reported {
            a.prompt_reported = true;
            let logprobs = a.prompt_logprobs.take();
            let _ = a.job.events.send(Event::Prompt { cached_tokens: a.cached, logprobs });
        }
        let mut logits = a.logits.take().expect("the prompt leaves logits");
        if a.decoding.done_before_start() {
            return Ok(self.finish(a, Finish::Length, logits.full()));
        }
        let step = match &mut logits {
            NextLogits::Full(l) => a.decoding.step(l)?,
            NextLogits::Top(c) => a.decoding.step_candidates(c)?,
        };
        if !step.text.is_empty() || !step.tokens.is_empty() {
            let _ = a.job.events.send(Event::Text { text: step.text, tokens: step.tokens });
        }
        // A verifying forward keeps the sampled token's row, and the draft's where the draft is the
        // sampled token and generation goes on (the last token stays unforwarded, as without drafts).
        if let Some((d, after)) = a.verifying.take() {
            let accepted = step.next == Next::Forward(d);
            let c = &self.shared.counters;
            c.drafted.fetch_add(1, Ordering::Relaxed);
            c.accepted.fetch_add(accepted as u64, Ordering::Relaxed);
            self.backend.commit(&mut a.session, if accepted { 2 } else { 1 })?;
            if accepted {
                self.shared.steps.credit_decode(1);
                a.logits = Some(after);
                a.forwarded.push(d);
                return Ok(State::Running);
            }
        }
        match step.next {
            Next::Forward(tok) if a.drafts => {
                let k = a.decoding.candidates_needed();
                let vocab = self.tokenizer.vocab_size();
                let (d, mut rows) = self.recorded(StepKind::Decode, 1, || {
                    let d = self.backend.draft_top(&mut a.session, tok, 1, vocab)?[0].0;
                    // Each row's candidates where that is all the sampler needs, else every logit.
                    let rows: Vec<NextLogits> = match k {
                        Some(k) => self
                            .backend
                            .verify_top(&mut a.session, &[tok, d], k, vocab)?
                            .into_iter()
                            .map(NextLogits::Top)
                            .collect(),
                        None => {
                            let logits = self.backend.verify(&mut a.session, &[tok, d])?;
                            let (first, second) = logits.split_at(logits.len() / 2);
                            vec![NextLogits::Full(first.to_vec()), NextLogits::Full(second.to_vec())]
                        }
                    };
                    Ok((d, rows))
                })?;
                let missing = || anyhow::anyhow!("the verifying forward gave fewer than two rows");
                let second = rows.pop().ok_or_else(missing)?;
                let first = rows.pop().ok_or_else(missing)?;
                a.logits = Some(first);
                a.verifying = Some((d, second));
                a.forwarded.push(tok);
                Ok(State::Running)
            }
            Next::Forward(tok) => {
                a.logits = Some(match a.decoding.candidates_needed() {
                    Some(k) => NextLogits::Top(self.forward_top(&mut a.session, tok, k)?),
                    None => NextLogits::Full(self.forward(StepKind::Decode, &mut a.session, &[tok], Logits::Last)?),
                });
                a.forwarded.push(tok);
                Ok(State::Running)
            }
            Next::Finished(f) => Ok(self.finish(a, f, logits.full())),
        }
    }

    /// Reports the end; a retained session keeps the final state (prompt and the generated tokens
    /// that ran through the model) for its next request.
    fn finish(&mut self, a: &mut Active<B::Session>, finish: Finish, logits: Option<&[f32]>) -> State {
        let usage = Usage {
            prompt_tokens: a.job.prompt.len(),
            cached_tokens: a.cached,
            completion_tokens: a.decoding.generated().len(),
        };
        a.last = Some(Event::Done { finish, usage });
        if a.job.session_id.is_some() && !a.forwarded.is_empty() {
            let tokens: Vec<u32> = a.job.prompt.iter().chain(&a.forwarded).copied().collect();
            self.snapshot(a, &tokens, logits);
        }
        let c = &self.shared.counters;
        c.completed.fetch_add(1, Ordering::Relaxed);
        c.prompt_tokens.fetch_add(usage.prompt_tokens as u64, Ordering::Relaxed);
        c.cached_tokens.fetch_add(usage.cached_tokens as u64, Ordering::Relaxed);
        c.completion_tokens.fetch_add(usage.completion_tokens as u64, Ordering::Relaxed);
        eprintln!(
            "{}: {} prompt tokens ({} cached), {} generated, {}, {:.2} s",
            a.job.id,
            usage.prompt_tokens,
            usage.cached_tokens,
            usage.completion_tokens,
            finish.as_str(),
            a.started.elapsed().as_secs_f64()
        );
        State::Finished
    }
}

/// A prompt token's log-probability under `row` (the previous position's logits) and the top `k`.
fn score(row: &[f32], token: u32, k: usize) -> TokenLogprob {
    let logprob = log_softmax(row).get(token as usize).copied().unwrap_or(f32::NEG_INFINITY);
    TokenLogprob { id: token, logprob: Some(logprob), top: top_logprobs(row, k) }
}

fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default()
}
