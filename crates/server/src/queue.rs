//! The hand-over point between the HTTP handlers and the inference thread: a bounded queue of jobs,
//! session deletions, the live configuration, and the counters `/status` and `/v1/stats` report.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::Duration;

use serde::Serialize;
use tokio::sync::oneshot;

use crate::config::Config;
use crate::error::ApiError;
use crate::job::Job;
use crate::prefix_cache::CacheStats;
use crate::stats::StepLog;

/// The configuration in force; a reload swaps it whole, and readers take a cheap `Arc`.
pub struct Live {
    config: RwLock<Arc<Config>>,
    generation: AtomicU64,
    failures: AtomicU64,
}

impl Live {
    pub fn new(config: Config) -> Self {
        Self { config: RwLock::new(Arc::new(config)), generation: AtomicU64::new(0), failures: AtomicU64::new(0) }
    }

    pub fn get(&self) -> Arc<Config> {
        self.config.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    pub fn set(&self, config: Config) {
        *self.config.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(config);
        self.generation.fetch_add(1, Ordering::SeqCst);
    }

    /// Counts a reload that failed (the configuration in force stays).
    pub fn reload_failed(&self) {
        self.failures.fetch_add(1, Ordering::SeqCst);
    }

    /// How many times the configuration was replaced.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }
}

/// Counters of finished requests.
#[derive(Debug, Default)]
pub struct Counters {
    pub completed: AtomicU64,
    pub cancelled: AtomicU64,
    pub timed_out: AtomicU64,
    pub failed: AtomicU64,
    pub rejected: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub cached_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    /// Drafted tokens verified, and those accepted.
    pub drafted: AtomicU64,
    pub accepted: AtomicU64,
}

/// What `/status` shows.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Status {
    pub active: usize,
    pub queued: usize,
    pub completed: u64,
    pub cancelled: u64,
    pub timed_out: u64,
    pub failed: u64,
    pub rejected: u64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub completion_tokens: u64,
    /// `scheduler.draft` now (0: the server does not draft).
    pub draft: usize,
    pub drafted: u64,
    pub accepted: u64,
    pub config_reloads: u64,
    pub config_reload_errors: u64,
    pub prefix_cache: CacheStats,
}

struct Inner {
    jobs: VecDeque<Job>,
    drops: Vec<(String, oneshot::Sender<bool>)>,
    shutdown: bool,
}

pub struct Shared {
    inner: Mutex<Inner>,
    wake: Condvar,
    /// Requests decoding now (written by the inference thread under the queue lock).
    active: AtomicUsize,
    pub counters: Counters,
    pub live: Live,
    cache_stats: Mutex<CacheStats>,
    /// The forwards the inference thread ran (`/v1/stats`).
    pub steps: StepLog,
}

/// What the inference thread takes from the queue in one go.
pub(crate) struct Intake {
    pub jobs: Vec<Job>,
    pub drops: Vec<(String, oneshot::Sender<bool>)>,
    pub shutdown: bool,
}

impl Shared {
    pub fn new(config: Config) -> Arc<Self> {
        Arc::new(Self {
            inner: Mutex::new(Inner { jobs: VecDeque::new(), drops: Vec::new(), shutdown: false }),
            wake: Condvar::new(),
            active: AtomicUsize::new(0),
            counters: Counters::default(),
            live: Live::new(config),
            cache_stats: Mutex::new(CacheStats::default()),
            steps: StepLog::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues a job, or refuses it with 429 when the decoding slots and the queue are full.
    pub fn submit(&self, job: Job) -> Result<(), ApiError> {
        let config = self.live.get();
        let mut q = self.lock();
        if q.shutdown {
            return Err(ApiError::unavailable("The server is shutting down"));
        }
        let active = self.active.load(Ordering::SeqCst);
        if active + q.jobs.len() >= config.scheduler.max_active + config.scheduler.queue_size {
            self.counters.rejected.fetch_add(1, Ordering::Relaxed);
            return Err(ApiError::queue_full(active, q.jobs.len()));
        }
        q.jobs.push_back(job);
        self.wake.notify_all();
        Ok(())
    }

    /// Asks the inference thread to forget a retained session; answers whether it had one.
    pub fn drop_session(&self, id: String) -> oneshot::Receiver<bool> {
        let (tx, rx) = oneshot::channel();
        let mut q = self.lock();
        q.drops.push((id, tx));
        self.wake.notify_all();
        rx
    }

    /// Ends the inference thread; queued and active jobs are dropped (their clients see the stream
    /// end).
    pub fn shutdown(&self) {
        self.lock().shutdown = true;
        self.wake.notify_all();
    }

    /// Takes up to `room` jobs and every pending deletion. With `wait` and nothing to take, sleeps
    /// until something arrives or `timeout` passes. `active_now` jobs decode already; with the taken
    /// ones, the count is published under the lock so `submit` never counts a job twice or not at all.
    pub(crate) fn take(&self, room: usize, active_now: usize, wait: Option<Duration>) -> Intake {
        let mut q = self.lock();
        if let Some(timeout) = wait
            && q.jobs.is_empty()
            && q.drops.is_empty()
            && !q.shutdown
        {
            q = self.wake.wait_timeout(q, timeout).unwrap_or_else(|e| e.into_inner()).0;
        }
        let n = room.min(q.jobs.len());
        let jobs: Vec<Job> = q.jobs.drain(..n).collect();
        self.active.store(active_now + jobs.len(), Ordering::SeqCst);
        Intake { jobs, drops: std::mem::take(&mut q.drops), shutdown: q.shutdown }
    }

    /// Publishes how many jobs decode now (after some finished).
    pub(crate) fn set_active(&self, n: usize) {
        let _q = self.lock();
        self.active.store(n, Ordering::SeqCst);
    }

    pub(crate) fn publish_cache_stats(&self, stats: CacheStats) {
        *self.cache_stats.lock().unwrap_or_else(|e| e.into_inner()) = stats;
    }

    pub fn status(&self) -> Status {
        let queued = self.lock().jobs.len();
        let c = &self.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Status {
            active: self.active.load(Ordering::SeqCst),
            queued,
            completed: get(&c.completed),
            cancelled: get(&c.cancelled),
            timed_out: get(&c.timed_out),
            failed: get(&c.failed),
            rejected: get(&c.rejected),
            prompt_tokens: get(&c.prompt_tokens),
            cached_tokens: get(&c.cached_tokens),
            completion_tokens: get(&c.completion_tokens),
            draft: self.live.get().scheduler.draft,
            drafted: get(&c.drafted),
            accepted: get(&c.accepted),
            config_reloads: self.live.generation(),
            config_reload_errors: self.live.failures.load(Ordering::SeqCst),
            prefix_cache: self.cache_stats.lock().unwrap_or_else(|e| e.into_inner()).clone(),
        }
    }
}
