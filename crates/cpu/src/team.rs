//! A team of threads that computes routed experts for one token together ([`crate::expert`]), for
//! the GPU backend's experts computed on the CPU (`--cpu-experts`).
//!
//! A job is a few experts of one MoE block. The team takes the gate/up rows of all of them in
//! small chunks (an atomic counter hands them out, so a late thread simply takes fewer), waits
//! until every activation row is in, then takes the down rows the same way. An expert's input and
//! activation are prepared for the kernels ([`ExpertMatrices::prepare_input`]) by the first thread
//! to need them, not by the submitter. The thread that
//! submitted the job helps once it has nothing else to queue ([`Job::wait`]). Between jobs the
//! threads spin for a while, then park until the next job: a job that finds the team parked waits
//! for the threads to wake (tens of microseconds each), which is as long as the job itself. So a
//! user calls [`ExpertTeam::keep_warm`] wherever a job may follow soon (the GPU backend: every
//! streamed MoE block, before it knows whether the CPU takes any miss): that wakes parked threads
//! and restarts their spinning.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::expert::{ExpertInput, ExpertMatrices};
use crate::linear::DotInput;

/// Gate/up rows per chunk (each row is two dot products of the hidden width).
const GATE_UP_ROWS: usize = 8;
/// Down rows per chunk (each a dot product of the intermediate width).
const DOWN_ROWS: usize = 64;
/// Jobs whose times make the team's rate.
const RECENT: usize = 9;

/// One expert of a job: its matrices (borrowing a record the submitter keeps alive until the job
/// is done) and its input.
pub struct JobExpert<'a> {
    pub matrices: ExpertMatrices<'a>,
    pub x: &'a [f32],
}

struct Work {
    experts: Vec<ExpertMatrices<'static>>,
    xs: Vec<&'static [f32]>,
    /// Each expert's input prepared for its gate and up rows, by the first thread to take one of
    /// them (off the submitter, whose thread is the GPU step's).
    inputs: Vec<OnceLock<ExpertInput>>,
    inter: usize,
    hidden: usize,
    act: Vec<f32>,
    out: Vec<f32>,
    next_up: AtomicUsize,
    done_up: AtomicUsize,
    next_down: AtomicUsize,
    done_down: AtomicUsize,
    /// Each expert's activation prepared for its down rows, by the first thread to need it.
    acts: Vec<OnceLock<DotInput>>,
    /// When the job was submitted, and how long it took (ns; written by the thread that completes
    /// the last chunk: the submitter may come to wait much later).
    start: Instant,
    took_ns: AtomicU64,
    /// A thread panicked in a chunk (the job can never complete), and the threads inside
    /// [`Work::help`] now (the submitter waits for none before it lets the borrows go).
    failed: AtomicBool,
    inside: AtomicUsize,
}

impl Work {
    fn up_chunks(&self) -> usize {
        self.experts.len() * self.inter.div_ceil(GATE_UP_ROWS)
    }

    fn down_chunks(&self) -> usize {
        self.experts.len() * self.hidden.div_ceil(DOWN_ROWS)
    }

    /// Takes chunks until none is left (or the job failed); returns whether the job is complete.
    fn help(&self) -> bool {
        self.inside.fetch_add(1, Ordering::AcqRel);
        // Left inside on unwinding too (the worker marks the job failed).
        struct Leave<'a>(&'a AtomicUsize);
        impl Drop for Leave<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, Ordering::AcqRel);
            }
        }
        let _leave = Leave(&self.inside);
        self.take_chunks()
    }

    fn take_chunks(&self) -> bool {
        let (uc, dc) = (self.up_chunks(), self.down_chunks());
        let per_up = self.inter.div_ceil(GATE_UP_ROWS);
        loop {
            if self.failed.load(Ordering::Acquire) {
                return false;
            }
            let c = self.next_up.fetch_add(1, Ordering::Relaxed);
            if c >= uc {
                break;
            }
            let (e, r0) = (c / per_up, (c % per_up) * GATE_UP_ROWS);
            let r1 = (r0 + GATE_UP_ROWS).min(self.inter);
            // SAFETY: chunk c's rows are written by the one thread that took c, and read only after
            // done_up reaches every chunk (the Release below, the Acquire in the down phase).
            let act = unsafe { rows_mut(&self.act, e * self.inter + r0, r1 - r0) };
            let input = self.inputs[e].get_or_init(|| self.experts[e].prepare_input(self.xs[e]));
            self.experts[e].gate_up_rows(self.xs[e], input, r0..r1, act);
            self.done_up.fetch_add(1, Ordering::Release);
        }
        let per_down = self.hidden.div_ceil(DOWN_ROWS);
        let mut spins = 0u32;
        loop {
            if self.failed.load(Ordering::Acquire) {
                return false;
            }
            let c = self.next_down.load(Ordering::Relaxed);
            if c >= dc {
                return self.done_down.load(Ordering::Acquire) == dc;
            }
            if self.done_up.load(Ordering::Acquire) < uc {
                spin(&mut spins);
                continue;
            }
            let c = self.next_down.fetch_add(1, Ordering::Relaxed);
            if c >= dc {
                continue;
            }
            let (e, r0) = (c / per_down, (c % per_down) * DOWN_ROWS);
            let r1 = (r0 + DOWN_ROWS).min(self.hidden);
            let act = &self.act[e * self.inter..(e + 1) * self.inter];
            let prepared = self.acts[e].get_or_init(|| self.experts[e].prepare_act(act));
            // SAFETY: as for the activation rows: one writer per chunk, read after done_down.
            let out = unsafe { rows_mut(&self.out, e * self.hidden + r0, r1 - r0) };
            self.experts[e].down_rows(act, prepared, r0..r1, out);
            if self.done_down.fetch_add(1, Ordering::Release) + 1 == dc {
                let ns = u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX);
                self.took_ns.store(ns.max(1), Ordering::Release);
            }
        }
    }

    fn complete(&self) -> bool {
        self.done_down.load(Ordering::Acquire) == self.down_chunks()
    }
}

/// `len` values of `v` from `at`, writable through a shared reference.
///
/// # Safety
/// No other reference to those values may be used while the slice lives.
#[allow(clippy::mut_from_ref)]
unsafe fn rows_mut(v: &[f32], at: usize, len: usize) -> &mut [f32] {
    assert!(at + len <= v.len());
    // SAFETY: in bounds (checked); the caller guarantees exclusive use of the range.
    unsafe { std::slice::from_raw_parts_mut(v.as_ptr().add(at) as *mut f32, len) }
}

fn spin(spins: &mut u32) {
    *spins += 1;
    if *spins < 1 << 12 {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

struct Shared {
    /// The current job and its number (0: none yet).
    job: Mutex<(u64, Option<Arc<Work>>)>,
    /// The current job's number, read by spinning threads without the lock.
    epoch: AtomicU64,
    wake: Condvar,
    parked: AtomicUsize,
    /// Bumped by [`ExpertTeam::keep_warm`]: spinning threads restart their spin when it changes.
    warm: AtomicU64,
    shutdown: AtomicBool,
    spin_for: Duration,
    /// Nanoseconds per expert of the last jobs (submission to completion), and their median (0:
    /// none yet).
    recent: Mutex<std::collections::VecDeque<u64>>,
    ns_per_expert: AtomicU64,
}

/// The team (see the module docs). Dropping it stops and joins its threads.
pub struct ExpertTeam {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

/// A submitted job: wait for it, then read its outputs.
pub struct Job<'a> {
    work: Arc<Work>,
    team: &'a ExpertTeam,
    done: bool,
}

impl ExpertTeam {
    /// A team of `threads` threads that spin for `spin_for` after each job before parking.
    pub fn new(threads: usize, spin_for: Duration) -> Result<ExpertTeam> {
        let shared = Arc::new(Shared {
            job: Mutex::new((0, None)),
            epoch: AtomicU64::new(0),
            wake: Condvar::new(),
            parked: AtomicUsize::new(0),
            warm: AtomicU64::new(0),
            shutdown: AtomicBool::new(false),
            spin_for,
            recent: Mutex::new(std::collections::VecDeque::with_capacity(RECENT)),
            ns_per_expert: AtomicU64::new(0),
        });
        let mut team = ExpertTeam { shared, threads: Vec::new() };
        for i in 0..threads {
            let shared = Arc::clone(&team.shared);
            // On failure `team` drops here, which stops and joins the threads already started.
            let handle = std::thread::Builder::new()
                .name(format!("cherenkov-cpu-expert-{i}"))
                .spawn(move || worker(&shared))
                .with_context(|| format!("cannot start CPU expert thread {i} of {threads}"))?;
            team.threads.push(handle);
        }
        Ok(team)
    }

    /// Says a job may follow soon: parked threads wake, and spinning ones spin for another
    /// `spin_for` from now.
    pub fn keep_warm(&self) {
        // SeqCst here and where a thread parks: the bump and the parked count form a Dekker pair
        // (either this call sees the thread parked, or the thread sees the bump before waiting).
        self.shared.warm.fetch_add(1, Ordering::SeqCst);
        if self.shared.parked.load(Ordering::SeqCst) > 0 {
            // Under the lock, so a thread between its last check and its wait cannot miss it.
            let _j = self.shared.job.lock().unwrap_or_else(|p| p.into_inner());
            self.shared.wake.notify_all();
        }
    }

    /// Median time per expert of the last jobs, from submission to their last chunk's end (None
    /// before the first): a median, so one slow job (a page fault, a busy host) does not move it.
    pub fn ns_per_expert(&self) -> Option<u64> {
        match self.shared.ns_per_expert.load(Ordering::Relaxed) {
            0 => None,
            ns => Some(ns),
        }
    }

    /// Starts computing `experts`. The records and inputs they borrow must stay alive and
    /// unchanged until the job is waited for (the returned [`Job`] borrows them; dropping it
    /// without waiting waits).
    pub fn submit<'a>(&'a self, experts: &[JobExpert<'a>]) -> Job<'a> {
        let start = Instant::now();
        let (inter, hidden) = experts.first().map_or((0, 0), |e| (e.matrices.intermediate(), e.matrices.hidden()));
        assert!(experts.iter().all(|e| e.matrices.intermediate() == inter && e.matrices.hidden() == hidden));
        let n = experts.len();
        // SAFETY: the 'static borrows never outlive the job: `Job` borrows them for 'a and its
        // wait (also run on drop) returns only when no thread uses the work's borrows any more
        // (every chunk done; threads drop their Arc before looking for the next job and hold no
        // borrow while idle).
        let extend =
            |m: ExpertMatrices<'a>| unsafe { std::mem::transmute::<ExpertMatrices<'a>, ExpertMatrices<'static>>(m) };
        let work = Arc::new(Work {
            experts: experts.iter().map(|e| extend(e.matrices)).collect(),
            // SAFETY: as above.
            xs: experts.iter().map(|e| unsafe { std::mem::transmute::<&'a [f32], &'static [f32]>(e.x) }).collect(),
            inputs: (0..n).map(|_| OnceLock::new()).collect(),
            inter,
            hidden,
            act: vec![0f32; n * inter],
            out: vec![0f32; n * hidden],
            next_up: AtomicUsize::new(0),
            done_up: AtomicUsize::new(0),
            next_down: AtomicUsize::new(0),
            done_down: AtomicUsize::new(0),
            acts: (0..n).map(|_| OnceLock::new()).collect(),
            start,
            took_ns: AtomicU64::new(0),
            failed: AtomicBool::new(false),
            inside: AtomicUsize::new(0),
        });
        {
            let mut j = self.shared.job.lock().unwrap_or_else(|p| p.into_inner());
            j.0 += 1;
            j.1 = Some(Arc::clone(&work));
            self.shared.epoch.store(j.0, Ordering::Release);
        }
        if self.shared.parked.load(Ordering::Acquire) > 0 {
            self.shared.wake.notify_all();
        }
        Job { work, team: self, done: false }
    }
}

impl Job<'_> {
    /// Helps until the job is complete; returns the outputs, `hidden` values per expert in the
    /// order submitted. Fails if a thread panicked computing it (after every thread has left it).
    pub fn wait(&mut self) -> Result<&[f32]> {
        if !self.done {
            let mut spins = 0u32;
            while !self.work.help() && !self.work.complete() {
                if self.work.failed.load(Ordering::Acquire) {
                    self.settle();
                    bail!("a CPU expert thread panicked computing a job (an engine bug)");
                }
                spin(&mut spins);
            }
            self.done = true;
            let n = self.work.experts.len().max(1) as u64;
            // From submission to the last chunk's end, not to this call (which may come later).
            let took = match self.work.took_ns.load(Ordering::Acquire) {
                0 => u64::try_from(self.work.start.elapsed().as_nanos()).unwrap_or(u64::MAX),
                ns => ns,
            };
            let ns = (took / n).max(1);
            let sh = &self.team.shared;
            let mut recent = sh.recent.lock().unwrap_or_else(|p| p.into_inner());
            if recent.len() == RECENT {
                recent.pop_front();
            }
            recent.push_back(ns);
            let mut sorted: Vec<u64> = recent.iter().copied().collect();
            sorted.sort_unstable();
            sh.ns_per_expert.store(sorted[sorted.len() / 2], Ordering::Relaxed);
        }
        Ok(&self.work.out)
    }

    /// Waits until no thread is inside the job (they leave a failed job at their next chunk).
    fn settle(&mut self) {
        let mut spins = 0u32;
        while self.work.inside.load(Ordering::Acquire) > 0 {
            spin(&mut spins);
        }
        self.done = true;
    }
}

impl Drop for Job<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        if std::thread::panicking() {
            // The submitter panicked (perhaps inside a chunk): the job cannot complete; the other
            // threads leave it, and only then do its borrows go.
            self.work.failed.store(true, Ordering::Release);
            self.settle();
        } else {
            let _ = self.wait();
        }
    }
}

fn worker(shared: &Shared) {
    let mut seen = 0u64;
    loop {
        // Spin for the next job (restarting when told to keep warm), then park until a job or a
        // keep-warm call.
        let mut t0 = Instant::now();
        let mut warm = shared.warm.load(Ordering::Acquire);
        let mut spins = 0u32;
        while shared.epoch.load(Ordering::Acquire) == seen && !shared.shutdown.load(Ordering::Acquire) {
            let w = shared.warm.load(Ordering::Acquire);
            if w != warm {
                (warm, t0) = (w, Instant::now());
            }
            if t0.elapsed() >= shared.spin_for {
                let mut j = shared.job.lock().unwrap_or_else(|p| p.into_inner());
                shared.parked.fetch_add(1, Ordering::SeqCst);
                while j.0 == seen
                    && shared.warm.load(Ordering::SeqCst) == warm
                    && !shared.shutdown.load(Ordering::Acquire)
                {
                    j = shared.wake.wait(j).unwrap_or_else(|p| p.into_inner());
                }
                shared.parked.fetch_sub(1, Ordering::AcqRel);
                (warm, t0) = (shared.warm.load(Ordering::Acquire), Instant::now());
            }
            spin(&mut spins);
        }
        if shared.shutdown.load(Ordering::Acquire) {
            return;
        }
        let work = {
            let j = shared.job.lock().unwrap_or_else(|p| p.into_inner());
            seen = j.0;
            j.1.clone()
        };
        if let Some(w) = work
            && std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| w.help())).is_err()
        {
            w.failed.store(true, Ordering::Release);
        }
    }
}

impl Drop for ExpertTeam {
    fn drop(&mut self) {
        {
            let _j = self.shared.job.lock().unwrap_or_else(|p| p.into_inner());
            self.shared.shutdown.store(true, Ordering::Release);
        }
        self.shared.wake.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{expert, matrices, rand_vec};
    use cherenkov_model::quant::Affine;

    #[test]
    fn a_team_computes_what_one_thread_does() {
        let (i, h) = (160, 256);
        let fmt = Affine::new(4, 64);
        let q: Vec<_> = (0..3).map(|e| expert(i, h, fmt, 3 * e + 1)).collect();
        let experts: Vec<ExpertMatrices> = q.iter().map(matrices).collect();
        let xs: Vec<Vec<f32>> = (0..3).map(|e| rand_vec(h, 100 + e)).collect();
        // Parked threads (no spinning) and spinning ones, several jobs in a row, one to three experts.
        for spin_for in [Duration::ZERO, Duration::from_millis(5)] {
            let team = ExpertTeam::new(3, spin_for).unwrap();
            for round in 0..6 {
                let n = 1 + round % 3;
                let jobs: Vec<JobExpert> = (0..n).map(|e| JobExpert { matrices: experts[e], x: &xs[e] }).collect();
                let mut job = team.submit(&jobs);
                let got = job.wait().unwrap().to_vec();
                for e in 0..n {
                    assert_eq!(got[e * h..(e + 1) * h], experts[e].forward(&xs[e])[..], "round {round} expert {e}");
                }
            }
            assert!(team.ns_per_expert().is_some());
            // Parked or spinning, a keep-warm call and then a job still complete.
            std::thread::sleep(spin_for + Duration::from_millis(2));
            team.keep_warm();
            team.keep_warm();
            let mut job = team.submit(&[JobExpert { matrices: experts[0], x: &xs[0] }]);
            assert_eq!(job.wait().unwrap()[..], experts[0].forward(&xs[0])[..]);
        }
    }

    /// A chunk that panics (here: an input shorter than the matrices) fails the job, on a team
    /// thread (an error) or on the submitter (its panic) — it never hangs — and the team then
    /// computes the next job.
    #[test]
    fn a_panicking_chunk_fails_the_job_and_the_team_goes_on() {
        let (i, h) = (64, 128);
        let fmt = Affine::new(4, 64);
        let q = expert(i, h, fmt, 1);
        let m = matrices(&q);
        let team = ExpertTeam::new(2, Duration::from_millis(1)).unwrap();
        let short = rand_vec(h / 2, 1);
        let x = rand_vec(h, 2);
        for _ in 0..4 {
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let mut job = team.submit(&[JobExpert { matrices: m, x: &short }]);
                job.wait().map(|_| ())
            }));
            assert!(matches!(outcome, Err(_) | Ok(Err(_))), "a job with a short input cannot succeed");
            let mut job = team.submit(&[JobExpert { matrices: m, x: &x }]);
            assert_eq!(job.wait().unwrap()[..], m.forward(&x)[..]);
        }
    }
}
