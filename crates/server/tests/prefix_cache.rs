//! Reusing a cached prefix changes nothing: the logits a request's forwards return with the prefix
//! cache (restoring a snapshot and running only the rest of the prompt) are bit for bit those of the
//! same request on a server without a cache, on the CPU backend over tiny-b (Gated DeltaNet, QSA past
//! its budget, PLE). Requests go straight to the inference thread, which runs exactly as under HTTP;
//! a recording wrapper of the backend captures every forward's logits.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cherenkov_cpu::{CpuModel, CpuSession};
use cherenkov_engine::backend::{Backend, Logits};
use cherenkov_engine::sampling::SamplingParams;
use cherenkov_engine::stats::PoolStats;
use cherenkov_server::Config;
use cherenkov_server::job::{Event, GenParams, Job, TokenLogprob};
use cherenkov_server::queue::Shared;
use cherenkov_server::scheduler;

/// The CPU backend, recording (tokens, logits) of every forward; its snapshots fail while
/// `fail_snapshots` is set (as a GPU's would with its memory full).
struct Recording {
    inner: Arc<CpuModel>,
    log: Mutex<Vec<(Vec<u32>, Vec<f32>)>>,
    fail_snapshots: std::sync::atomic::AtomicBool,
    /// Sessions made by `new_session`.
    sessions_made: std::sync::atomic::AtomicUsize,
}

impl Backend for Recording {
    type Session = CpuSession;
    fn name(&self) -> &'static str {
        "recording-cpu"
    }
    fn new_session(&self) -> anyhow::Result<CpuSession> {
        self.sessions_made.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Backend::new_session(&*self.inner)
    }
    fn snapshot_session(&self, s: &CpuSession) -> anyhow::Result<CpuSession> {
        anyhow::ensure!(!self.fail_snapshots.load(std::sync::atomic::Ordering::SeqCst), "out of memory (scripted)");
        self.inner.snapshot_session(s)
    }
    fn session_len(&self, s: &CpuSession) -> usize {
        self.inner.session_len(s)
    }
    fn session_bytes(&self, s: &CpuSession) -> Option<usize> {
        self.inner.session_bytes(s)
    }
    fn forward(&self, s: &mut CpuSession, tokens: &[u32], which: Logits) -> anyhow::Result<Vec<f32>> {
        let out = Backend::forward(&*self.inner, s, tokens, which)?;
        self.log.lock().unwrap().push((tokens.to_vec(), out.clone()));
        Ok(out)
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn pool_stats(&self) -> PoolStats {
        self.inner.pool_stats()
    }
}

struct Engine {
    backend: Arc<Recording>,
    shared: Arc<Shared>,
}

/// What one request did.
#[derive(Debug)]
struct Run {
    cached: usize,
    generated: Vec<u32>,
    logprobs: Vec<TokenLogprob>,
    /// (tokens, logits) of each forward, in order.
    forwards: Vec<(Vec<u32>, Vec<f32>)>,
}

impl Engine {
    fn new(cache: bool, block_tokens: usize) -> Engine {
        let mut config = Config::default();
        config.cache.enabled = cache;
        config.cache.block_tokens = block_tokens;
        config.scheduler.prefill_chunk = 16;
        let backend = Arc::new(Recording {
            inner: common::model(),
            log: Mutex::new(Vec::new()),
            fail_snapshots: Default::default(),
            sessions_made: Default::default(),
        });
        let shared = Shared::new(config);
        scheduler::spawn(backend.clone(), common::spec().tokenizer, shared.clone());
        Engine { backend, shared }
    }

    fn run(&self, prompt: &[u32], snapshot_at: &[usize], session: Option<&str>, max_tokens: usize) -> Run {
        self.backend.log.lock().unwrap().clear();
        let (events, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let params = GenParams {
            max_tokens,
            sampling: SamplingParams { seed: Some(11), ..SamplingParams::default() },
            logit_bias: vec![],
            stop_tokens: vec![],
            stop_sequences: vec![],
            stop_strings: vec![],
            logprobs: Some(5),
            prompt_logprobs: None,
        };
        let job = Job {
            id: "test".into(),
            prompt: prompt.to_vec(),
            snapshot_at: snapshot_at.to_vec(),
            params,
            session_id: session.map(str::to_string),
            deadline: Instant::now() + Duration::from_secs(600),
            timeout_secs: 600,
            events,
        };
        self.shared.submit(job).unwrap();
        let mut run = Run { cached: 0, generated: vec![], logprobs: vec![], forwards: vec![] };
        loop {
            match rx.blocking_recv().expect("the job ended without Done") {
                Event::Prompt { cached_tokens, .. } => run.cached = cached_tokens,
                Event::Text { tokens, .. } => {
                    for t in tokens {
                        run.generated.push(t.id);
                        run.logprobs.push(t.logprob.unwrap());
                    }
                }
                Event::Done { usage, .. } => {
                    assert_eq!(usage.cached_tokens, run.cached);
                    assert_eq!(usage.completion_tokens, max_tokens, "an EOS in a sampled run; pick another seed");
                    break;
                }
                Event::Error(e) => panic!("{e}"),
            }
        }
        run.forwards = std::mem::take(&mut *self.backend.log.lock().unwrap());
        run
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shared.shutdown();
    }
}

/// The warm run's forwards cover only the prompt after the restored prefix; from there on every
/// logit equals the cold run's.
fn assert_same(cold: &Run, warm: &Run, prompt_len: usize) {
    assert_eq!(cold.generated, warm.generated);
    assert_eq!(cold.logprobs, warm.logprobs);
    let prefill_cold: usize = cold.forwards.iter().map(|f| f.0.len()).sum::<usize>() - (cold.generated.len() - 1);
    assert_eq!(prefill_cold, prompt_len);
    let decode = cold.generated.len() - 1;
    let warm_prefill = &warm.forwards[..warm.forwards.len() - decode];
    let warm_tokens: usize = warm_prefill.iter().map(|f| f.0.len()).sum();
    assert_eq!(warm_tokens, prompt_len - warm.cached, "the warm run recomputed cached tokens");
    // The logits at the end of the prompt (absent when the whole prompt was cached).
    if let Some(last) = warm_prefill.last() {
        let cold_last = &cold.forwards[cold.forwards.len() - decode - 1].1;
        assert!(last.1 == *cold_last, "prompt logits differ with the cache");
    }
    for (i, (c, w)) in cold.forwards[cold.forwards.len() - decode..]
        .iter()
        .zip(&warm.forwards[warm.forwards.len() - decode..])
        .enumerate()
    {
        assert_eq!(c.0, w.0);
        assert!(c.1 == w.1, "decode step {i}: logits differ with the cache");
    }
}

fn tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| 5 + (i * 37 + seed * 101) % 490).collect()
}

#[test]
fn restoring_a_prefix_gives_the_logits_of_a_full_run() {
    let warm = Engine::new(true, 0);
    let cold = Engine::new(false, 0);
    let a = tokens(21, 1);
    let q: Vec<u32> = a.iter().copied().chain(tokens(13, 2)).collect();

    // A snapshot at the end of one prompt serves a longer prompt that starts with it.
    let first = warm.run(&a, &[], None, 4);
    assert_eq!(first.cached, 0);
    let w = warm.run(&q, &[], None, 6);
    assert_eq!(w.cached, a.len());
    let c = cold.run(&q, &[], None, 6);
    assert_eq!(c.cached, 0);
    assert_same(&c, &w, q.len());

    // The same prompt again runs no prefill at all: the stored logits are the prompt's.
    let again = warm.run(&q, &[], None, 6);
    assert_eq!(again.cached, q.len());
    assert_same(&c, &again, q.len());

    // A marked point inside the prompt (the chat boundary) is restored by a prompt that shares
    // only that much.
    let marked: Vec<u32> = a.iter().copied().chain(tokens(9, 3)).collect();
    warm.run(&marked, &[a.len() + 4], None, 2);
    let branch: Vec<u32> = marked[..a.len() + 4].iter().copied().chain(tokens(7, 4)).collect();
    let w = warm.run(&branch, &[], None, 5);
    assert_eq!(w.cached, a.len() + 4);
    assert_same(&cold.run(&branch, &[], None, 5), &w, branch.len());

    // One long beginning, different endings: the second prompt finds where it parts from the
    // first and leaves a snapshot there, which the third restores.
    let system = tokens(40, 9);
    let ask = |seed| -> Vec<u32> { system.iter().copied().chain(tokens(6, seed)).collect() };
    assert_eq!(warm.run(&ask(10), &[], None, 2).cached, 0);
    assert_eq!(warm.run(&ask(11), &[], None, 2).cached, 0);
    let third = ask(12);
    let w = warm.run(&third, &[], None, 5);
    assert_eq!(w.cached, system.len());
    assert_same(&cold.run(&third, &[], None, 5), &w, third.len());
}

#[test]
fn block_snapshots_and_retained_sessions_change_nothing() {
    let warm = Engine::new(true, 8);
    let cold = Engine::new(false, 0);
    let p = tokens(30, 5);
    warm.run(&p, &[], None, 3);
    // Shares 20 tokens with p: the block snapshot at 16 is the longest prefix held.
    let q: Vec<u32> = p[..20].iter().copied().chain(tokens(11, 6)).collect();
    let w = warm.run(&q, &[], None, 5);
    assert_eq!(w.cached, 16);
    assert_same(&cold.run(&q, &[], None, 5), &w, q.len());

    // A retained session continues from its last state (prompt and generated tokens), which no
    // other request sees.
    let turn1 = tokens(12, 7);
    let r1 = warm.run(&turn1, &[], Some("conv"), 6);
    let mut turn2: Vec<u32> = turn1.iter().chain(&r1.generated).copied().collect();
    turn2.extend(tokens(5, 8));
    let other = warm.run(&turn2, &[], Some("someone-else"), 4);
    assert!(other.cached <= turn1.len(), "a session's snapshot served another session");
    let made = warm.backend.sessions_made.load(std::sync::atomic::Ordering::SeqCst);
    let w = warm.run(&turn2, &[], Some("conv"), 4);
    // Every generated token but the last ran through the model in turn 1.
    assert_eq!(w.cached, turn1.len() + r1.generated.len() - 1);
    // The restored snapshot is the request's session: no fresh one was made for it.
    assert_eq!(warm.backend.sessions_made.load(std::sync::atomic::Ordering::SeqCst), made);
    assert_same(&cold.run(&turn2, &[], None, 4), &w, turn2.len());
}

/// Snapshots that cannot be taken or restored (a GPU with its memory full) cost only the reuse:
/// the requests finish with the logits of a run without a cache, and nothing half-made is kept.
#[test]
fn snapshots_that_fail_cost_only_the_reuse() {
    use std::sync::atomic::Ordering;
    let warm = Engine::new(true, 8);
    let cold = Engine::new(false, 0);
    let p = tokens(30, 5);
    let q: Vec<u32> = p[..20].iter().copied().chain(tokens(11, 6)).collect();
    // Taking them fails: nothing is cached.
    warm.backend.fail_snapshots.store(true, Ordering::SeqCst);
    warm.run(&p, &[], None, 3);
    let w = warm.run(&q, &[], None, 5);
    assert_eq!(w.cached, 0);
    assert_same(&cold.run(&q, &[], None, 5), &w, q.len());
    // Taken, then restoring fails: the request runs its whole prompt.
    warm.backend.fail_snapshots.store(false, Ordering::SeqCst);
    warm.run(&p, &[], None, 3);
    warm.backend.fail_snapshots.store(true, Ordering::SeqCst);
    let w = warm.run(&q, &[], None, 5);
    assert_eq!(w.cached, 0);
    assert_same(&cold.run(&q, &[], None, 5), &w, q.len());
    // And restoring works again once memory is back.
    warm.backend.fail_snapshots.store(false, Ordering::SeqCst);
    assert_eq!(warm.run(&q, &[], None, 5).cached, 16);
}
