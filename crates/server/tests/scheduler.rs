//! The inference thread with a scripted backend: interleaving, the bounded queue, cancellation
//! within one step, timeouts, and failures that end one request without stopping the others.
//! Nothing here measures time: slow steps are made slow on purpose so that the order of events is
//! certain.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cherenkov_engine::backend::{Backend, Logits};
use cherenkov_engine::sampling::SamplingParams;
use cherenkov_engine::stats::PoolStats;
use cherenkov_server::Config;
use cherenkov_server::job::{Event, GenParams, Job};
use cherenkov_server::queue::Shared;
use cherenkov_server::scheduler;
use tokio::sync::mpsc::UnboundedReceiver;

const VOCAB: usize = 512;
/// A prompt starting with this token makes the backend panic; one starting with the next fails.
const PANIC: u32 = 7;
const FAIL: u32 = 8;

/// A session is its token history; the next token is a function of it. Each forward sleeps
/// `delay` and is logged with the session's first token (which request it served).
struct Scripted {
    delay: Duration,
    log: Mutex<Vec<u32>>,
    forwards: AtomicUsize,
    /// While set, new sessions fail (as when a GPU's memory is full).
    fail_sessions: std::sync::atomic::AtomicBool,
    /// Forwards that returned only the largest logits.
    top_forwards: AtomicUsize,
}

impl Backend for Scripted {
    type Session = Vec<u32>;
    fn name(&self) -> &'static str {
        "scripted"
    }
    fn new_session(&self) -> anyhow::Result<Vec<u32>> {
        anyhow::ensure!(!self.fail_sessions.load(Ordering::SeqCst), "out of device memory (scripted)");
        Ok(Vec::new())
    }
    fn snapshot_session(&self, s: &Vec<u32>) -> anyhow::Result<Vec<u32>> {
        Ok(s.clone())
    }
    fn session_len(&self, s: &Vec<u32>) -> usize {
        s.len()
    }
    fn session_bytes(&self, s: &Vec<u32>) -> Option<usize> {
        Some(4 * s.len())
    }
    fn forward(&self, s: &mut Vec<u32>, tokens: &[u32], which: Logits) -> anyhow::Result<Vec<f32>> {
        std::thread::sleep(self.delay);
        s.extend_from_slice(tokens);
        match s[0] {
            PANIC => panic!("scripted panic"),
            FAIL => anyhow::bail!("scripted failure"),
            _ => {}
        }
        self.log.lock().unwrap().push(s[0]);
        self.forwards.fetch_add(1, Ordering::SeqCst);
        let rows = if which == Logits::All { tokens.len() } else { 1 };
        let mut out = vec![0f32; rows * VOCAB];
        let next = 10 + s.iter().sum::<u32>() as usize % 400;
        out[(rows - 1) * VOCAB + next] = 10.0;
        Ok(out)
    }
    fn vocab_size(&self) -> usize {
        VOCAB
    }
    fn forward_top(&self, s: &mut Vec<u32>, tokens: &[u32], k: usize, among: usize) -> anyhow::Result<Vec<(u32, f32)>> {
        self.top_forwards.fetch_add(1, Ordering::SeqCst);
        let logits = self.forward(s, tokens, Logits::Last)?;
        Ok(cherenkov_engine::backend::top_of(&logits[..among.min(VOCAB)], k))
    }
    fn pool_stats(&self) -> PoolStats {
        PoolStats::default()
    }
}

fn engine(delay_ms: u64, edit: impl FnOnce(&mut Config)) -> (Arc<Scripted>, Arc<Shared>) {
    let mut config = Config::default();
    edit(&mut config);
    let backend = Arc::new(Scripted {
        delay: Duration::from_millis(delay_ms),
        log: Mutex::new(vec![]),
        forwards: AtomicUsize::new(0),
        fail_sessions: Default::default(),
        top_forwards: AtomicUsize::new(0),
    });
    let shared = Shared::new(config);
    scheduler::spawn(backend.clone(), common::spec().tokenizer, shared.clone());
    (backend, shared)
}

fn job(first: u32, max_tokens: usize, timeout: Duration) -> (Job, UnboundedReceiver<Event>) {
    let (events, rx) = tokio::sync::mpsc::unbounded_channel();
    let params = GenParams {
        max_tokens,
        sampling: SamplingParams::greedy(),
        logit_bias: vec![],
        stop_tokens: vec![],
        stop_sequences: vec![],
        stop_strings: vec![],
        logprobs: None,
        prompt_logprobs: None,
    };
    let job = Job {
        id: format!("job-{first}"),
        prompt: vec![first, 20, 30],
        snapshot_at: vec![],
        params,
        session_id: None,
        deadline: Instant::now() + timeout,
        timeout_secs: timeout.as_secs(),
        events,
    };
    (job, rx)
}

const LONG: Duration = Duration::from_secs(600);

/// Events until the job ends; the error, if it ended with one.
fn finish(rx: &mut UnboundedReceiver<Event>) -> Option<cherenkov_server::error::ApiError> {
    loop {
        match rx.blocking_recv() {
            Some(Event::Done { .. }) => return None,
            Some(Event::Error(e)) => return Some(e),
            Some(_) => {}
            None => panic!("the job ended without Done or Error"),
        }
    }
}

/// Polls the status until `done` holds (the scheduler publishes after every step).
fn wait_for(shared: &Shared, what: &str, done: impl Fn(&cherenkov_server::queue::Status) -> bool) {
    for _ in 0..6000 {
        if done(&shared.status()) {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("{what} never happened: {:?}", shared.status());
}

#[test]
fn two_requests_take_turns_token_by_token() {
    let (backend, shared) = engine(1, |_| {});
    // A runs long enough that B, submitted right after it, starts while A decodes.
    let (a, mut ra) = job(100, 300, LONG);
    let (b, mut rb) = job(200, 12, LONG);
    shared.submit(a).unwrap();
    shared.submit(b).unwrap();
    assert!(finish(&mut rb).is_none() && finish(&mut ra).is_none());
    let log = backend.log.lock().unwrap().clone();
    // Over B's whole life, the two alternate: one forward of A, one of B.
    let first_b = log.iter().position(|&r| r == 200).unwrap();
    let last_b = log.iter().rposition(|&r| r == 200).unwrap();
    let window = &log[first_b..=last_b];
    // One prefill and 11 decode forwards (the 12th token is sampled, never run).
    assert_eq!(window.iter().filter(|&&r| r == 200).count(), 12, "{log:?}");
    assert!(window.windows(2).all(|w| w[0] != w[1]), "not interleaved: {log:?}");
}

#[test]
fn a_full_queue_refuses_with_429_and_frees_up() {
    let (_, shared) = engine(20, |c| {
        c.scheduler.max_active = 1;
        c.scheduler.queue_size = 1;
    });
    let (a, ra) = job(100, 1000, LONG);
    let (b, mut rb) = job(200, 2, LONG);
    let (c, _rc) = job(300, 2, LONG);
    shared.submit(a).unwrap();
    shared.submit(b).unwrap();
    let e = shared.submit(c).unwrap_err();
    assert_eq!(e.status.as_u16(), 429);
    assert_eq!(e.body()["error"]["code"], "rate_limit_exceeded");
    drop(ra); // A's client leaves: B runs.
    assert!(finish(&mut rb).is_none());
    assert_eq!(shared.status().rejected, 1);
}

#[test]
fn a_client_that_leaves_is_cancelled_within_one_step() {
    let (backend, shared) = engine(5, |_| {});
    let (a, mut ra) = job(100, 100_000, LONG);
    shared.submit(a).unwrap();
    let mut texts = 0;
    while texts < 3 {
        if let Some(Event::Text { .. }) = ra.blocking_recv() {
            texts += 1;
        }
    }
    drop(ra);
    let at_drop = backend.forwards.load(Ordering::SeqCst);
    wait_for(&shared, "the cancellation", |s| s.active == 0 && s.cancelled == 1);
    let after = backend.forwards.load(Ordering::SeqCst);
    assert!(after <= at_drop + 1, "{} forwards ran after the client left", after - at_drop);
    assert_eq!(shared.status().completed, 0);
    // The slot is free again.
    let (b, mut rb) = job(200, 3, LONG);
    shared.submit(b).unwrap();
    assert!(finish(&mut rb).is_none());
}

#[test]
fn a_request_past_its_deadline_ends_with_a_timeout() {
    // 50 ms per forward and 1000 tokens cannot fit in one second.
    let (_, shared) = engine(50, |_| {});
    let (a, mut ra) = job(100, 1000, Duration::from_secs(1));
    shared.submit(a).unwrap();
    let e = finish(&mut ra).expect("no timeout");
    assert_eq!((e.status.as_u16(), e.code), (504, Some("timeout")));
    wait_for(&shared, "the timeout count", |s| s.timed_out == 1 && s.active == 0);
}

#[test]
fn a_failing_or_panicking_step_ends_only_its_request() {
    let (_, shared) = engine(1, |_| {});
    let (p, mut rp) = job(PANIC, 5, LONG);
    let (f, mut rf) = job(FAIL, 5, LONG);
    let (ok, mut rok) = job(100, 5, LONG);
    shared.submit(p).unwrap();
    shared.submit(f).unwrap();
    let e = finish(&mut rp).expect("the panic was not reported");
    assert!(e.status.as_u16() == 500 && e.message.contains("scripted panic"), "{e}");
    let e = finish(&mut rf).expect("the failure was not reported");
    assert!(e.status.as_u16() == 500 && e.message.contains("scripted failure"), "{e}");
    shared.submit(ok).unwrap();
    assert!(finish(&mut rok).is_none());
    assert_eq!(shared.status().failed, 2);
}

/// A session the backend cannot make (a GPU with its memory full) fails that request with a 503
/// that says so; the server goes on, and serves the next request once sessions can be made again.
#[test]
fn a_session_that_cannot_be_made_fails_only_its_request() {
    let (backend, shared) = engine(0, |_| {});
    backend.fail_sessions.store(true, Ordering::SeqCst);
    let (a, mut ra) = job(100, 3, LONG);
    shared.submit(a).unwrap();
    let e = finish(&mut ra).expect("the request fails");
    assert_eq!(e.status.as_u16(), 503);
    assert!(
        e.message.contains("cannot start a session") && e.message.contains("out of device memory"),
        "{}",
        e.message
    );
    assert_eq!(backend.forwards.load(Ordering::SeqCst), 0);
    backend.fail_sessions.store(false, Ordering::SeqCst);
    let (b, mut rb) = job(200, 3, LONG);
    shared.submit(b).unwrap();
    assert!(finish(&mut rb).is_none());
    let s = shared.status();
    assert_eq!((s.failed, s.completed), (1, 1));
}

/// Greedy decoding asks the backend for the largest logit only (CUDA picks it on the device); a
/// request that wants log-probabilities gets every logit. Both generate the same tokens.
#[test]
fn greedy_decode_steps_take_candidates_and_logprobs_take_everything() {
    let (backend, shared) = engine(0, |_| {});
    let tokens = |rx: &mut UnboundedReceiver<Event>| {
        let mut out = Vec::new();
        loop {
            match rx.blocking_recv() {
                Some(Event::Text { tokens, .. }) => out.extend(tokens.iter().map(|t| t.id)),
                Some(Event::Done { .. }) => return out,
                Some(Event::Error(e)) => panic!("{}", e.message),
                Some(_) => {}
                None => panic!("the job ended without Done"),
            }
        }
    };
    let (a, mut ra) = job(100, 6, LONG);
    shared.submit(a).unwrap();
    let greedy = tokens(&mut ra);
    // One prefill, then 5 decode forwards (the 6th token is sampled, never run).
    assert_eq!(backend.top_forwards.load(Ordering::SeqCst), 5);
    let (mut b, mut rb) = job(100, 6, LONG);
    b.params.logprobs = Some(2);
    shared.submit(b).unwrap();
    assert_eq!(tokens(&mut rb), greedy);
    assert_eq!(backend.top_forwards.load(Ordering::SeqCst), 5, "a logprobs request took candidates");
}
