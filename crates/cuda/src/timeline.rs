//! The kernel timeline: where one step's time goes between and inside its kernels, from clock
//! readings the kernels take themselves, so it works inside a replayed CUDA graph and with the
//! kernels' early launch (PDL), where events between kernels would change what they measure.
//!
//! With `CHERENKOV_TIMELINE=FILE` the kernels are compiled with `TIMELINE` (common.cuh's `KSPAN`):
//! thread 0 of every block of every kernel appends a record while recording is on. The model switches
//! it on for the steps `CHERENKOV_TIMELINE_STEP` names (comma-separated, default 40, counted from the
//! process's first step on the GPU, across models) and writes two tab-separated files per step:
//! `FILE-stepN.tsv` (one row per launch, in the order the launches' first blocks passed their wait)
//! and `FILE-stepN.blocks.tsv` (every record). A measurement, not a mode to run in:
//! every block does a little more work, and the step that records waits for its end.

use std::collections::HashMap;
use std::ffi::CString;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::{Context, Result};
use cudarc::driver::result as cu;
use cudarc::driver::sys;

use crate::gpu::DevBuf;

/// Records the buffer holds (a 16-layer step has about 60 000 blocks).
const CAPACITY: u32 = 1 << 21;

/// One block's record, as `TlRec` in common.cuh lays it out.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BlockRecord {
    pub name: u32,
    pub block: u32,
    pub blocks: u32,
    pub smid: u32,
    /// Thread 0's start, its return from `grid_wait` (0 if it never waited), its end, and its
    /// first pass through `tl_mark()` (0 if none); ns.
    pub start: u64,
    pub waited: u64,
    pub end: u64,
    pub marked: u64,
}

/// One launch: its blocks' records put together.
#[derive(Clone, Debug, PartialEq)]
pub struct Launch {
    pub name: String,
    pub blocks: u32,
    /// Records found for it (fewer than `blocks` when the buffer filled).
    pub records: u32,
    pub first_start: u64,
    pub first_waited: u64,
    pub last_waited: u64,
    pub last_end: u64,
}

pub struct Timeline {
    buf: DevBuf,
    n_addr: u64,
    on_addr: u64,
    names: HashMap<u32, &'static str>,
    steps: AtomicUsize,
    /// The steps to record, and the one being recorded.
    record: Vec<usize>,
    current: AtomicUsize,
    path: PathBuf,
}

/// FNV-1a of a kernel's name, as `TlSpan` computes it.
pub fn name_hash(name: &str) -> u32 {
    name.bytes().fold(2166136261u32, |h, b| (h ^ b as u32).wrapping_mul(16777619))
}

/// The address of the module's global `name`.
fn global(module: sys::CUmodule, name: &str) -> Result<u64> {
    // SAFETY: module is a loaded module; the name is NUL-terminated.
    let (ptr, _) = unsafe { cu::module::get_global(module, CString::new(name).expect("no NUL")) }
        .map_err(|e| anyhow::anyhow!("the kernels have no global {name} (compiled without TIMELINE?): {e}"))?;
    Ok(ptr)
}

impl Timeline {
    /// The timeline `CHERENKOV_TIMELINE` asks for, if it does.
    pub fn requested() -> Option<(PathBuf, Vec<usize>)> {
        let path = std::env::var_os("CHERENKOV_TIMELINE")?;
        let steps = std::env::var("CHERENKOV_TIMELINE_STEP").unwrap_or_else(|_| "40".into());
        let steps = steps.split(',').filter_map(|s| s.trim().parse().ok()).collect();
        Some((PathBuf::from(path), steps))
    }

    /// Points the module's timeline globals at a buffer `alloc` gives (the context bound).
    pub fn new(
        module: sys::CUmodule,
        alloc: impl FnOnce(usize) -> Result<DevBuf>,
        kernels: &[&'static str],
        path: PathBuf,
        record: Vec<usize>,
    ) -> Result<Timeline> {
        let buf = alloc(CAPACITY as usize * std::mem::size_of::<BlockRecord>())?;
        let (buf_addr, cap_addr) = (global(module, "tl_buf")?, global(module, "tl_cap")?);
        let (n_addr, on_addr) = (global(module, "tl_n")?, global(module, "tl_on")?);
        // SAFETY: the globals' sizes are those of common.cuh (a pointer, three u32).
        unsafe {
            cu::memcpy_htod_sync(buf_addr, &[buf.ptr])
                .and_then(|()| cu::memcpy_htod_sync(cap_addr, &[CAPACITY]))
                .and_then(|()| cu::memcpy_htod_sync(on_addr, &[0u32]))
        }
        .map_err(|e| anyhow::anyhow!("cannot set up the kernel timeline: {e}"))?;
        let names = kernels.iter().map(|&k| (name_hash(k), k)).collect();
        Ok(Timeline {
            buf,
            n_addr,
            on_addr,
            names,
            steps: AtomicUsize::new(0),
            record,
            current: AtomicUsize::new(0),
            path,
        })
    }

    /// Counts a step; for the step to record, switches recording on (after `sync`, before the
    /// step's work is queued) and returns true.
    pub fn begin_step(&self, sync: impl Fn() -> Result<()>) -> Result<bool> {
        let step = self.steps.fetch_add(1, Ordering::Relaxed);
        if !self.record.contains(&step) {
            return Ok(false);
        }
        self.current.store(step, Ordering::Relaxed);
        sync()?;
        // SAFETY: two u32 globals of the module; the device is idle.
        unsafe {
            cu::memcpy_htod_sync(self.n_addr, &[0u32]).and_then(|()| cu::memcpy_htod_sync(self.on_addr, &[1u32]))
        }
        .map_err(|e| anyhow::anyhow!("cannot start the kernel timeline: {e}"))?;
        Ok(true)
    }

    /// After the recorded step (`sync` waits for it): switches recording off and writes the files.
    pub fn end_step(&self, sync: impl Fn() -> Result<()>) -> Result<()> {
        sync()?;
        let mut n = [0u32];
        // SAFETY: as in begin_step; the step's work has finished.
        unsafe { cu::memcpy_htod_sync(self.on_addr, &[0u32]).and_then(|()| cu::memcpy_dtoh_sync(&mut n, self.n_addr)) }
            .map_err(|e| anyhow::anyhow!("cannot stop the kernel timeline: {e}"))?;
        let kept = n[0].min(CAPACITY) as usize;
        let mut recs = vec![BlockRecord::default(); kept];
        // SAFETY: the buffer holds CAPACITY records, of which the kernels wrote the first `kept`.
        unsafe { cu::memcpy_dtoh_sync(&mut recs, self.buf.ptr) }
            .map_err(|e| anyhow::anyhow!("cannot read the kernel timeline: {e}"))?;
        let launches = launches(&recs, &|h| self.names.get(&h).map_or_else(|| format!("{h:08x}"), |s| s.to_string()));
        let t0 = recs.iter().map(|r| r.start).min().unwrap_or(0);
        let step = self.current.load(Ordering::Relaxed);
        let file = |ext: &str| {
            let mut name = self.path.file_name().unwrap_or_default().to_os_string();
            name.push(format!("-step{step}.{ext}"));
            self.path.with_file_name(name)
        };
        let table = file("tsv");
        std::fs::write(&table, launch_table(&launches, t0, n[0] as usize, kept))
            .with_context(|| format!("cannot write the kernel timeline {}", table.display()))?;
        let mut blocks = String::from("kernel\tblock\tblocks\tsm\tstart_ns\twaited_ns\tend_ns\tmarked_ns\n");
        for r in &recs {
            let name = self.names.get(&r.name).copied().unwrap_or("?");
            let rel = |t: u64| if t == 0 { -1 } else { (t - t0) as i64 };
            let _ = writeln!(
                blocks,
                "{name}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
                r.block,
                r.blocks,
                r.smid,
                rel(r.start),
                rel(r.waited),
                rel(r.end),
                rel(r.marked)
            );
        }
        let path = file("blocks.tsv");
        std::fs::write(&path, blocks).with_context(|| format!("cannot write {}", path.display()))?;
        eprintln!("kernel timeline of step {step}: {} launches, {kept} blocks, in {}", launches.len(), table.display());
        Ok(())
    }
}

/// Puts the blocks' records together into launches. Launches of one kernel on one stream follow
/// each other (each waits for the previous one's end), so a kernel's records sorted by the time
/// they passed their wait fall into its launches in order, `blocks` at a time.
pub fn launches(recs: &[BlockRecord], name: &dyn Fn(u32) -> String) -> Vec<Launch> {
    let mut by_name: HashMap<u32, Vec<&BlockRecord>> = HashMap::new();
    for r in recs {
        by_name.entry(r.name).or_default().push(r);
    }
    let mut out = Vec::new();
    for (h, mut v) in by_name {
        v.sort_by_key(|r| (r.waited.max(r.start), r.start));
        let mut i = 0;
        while i < v.len() {
            let blocks = v[i].blocks.max(1);
            let part = &v[i..(i + blocks as usize).min(v.len())];
            // A launch's wait is its waiting blocks' (blocks that never wait, such as the shared
            // expert riding along in the experts' gate/up launch, run beside the kernel before);
            // a launch none of whose blocks waits counts from its blocks' starts.
            let waiting: Vec<u64> = part.iter().filter(|r| r.waited != 0).map(|r| r.waited).collect();
            let waited: Vec<u64> = if waiting.is_empty() { part.iter().map(|r| r.start).collect() } else { waiting };
            out.push(Launch {
                name: name(h),
                blocks,
                records: part.len() as u32,
                first_start: part.iter().map(|r| r.start).min().unwrap_or(0),
                first_waited: waited.iter().copied().min().unwrap_or(0),
                last_waited: waited.iter().copied().max().unwrap_or(0),
                last_end: part.iter().map(|r| r.end).max().unwrap_or(0),
            });
            i += part.len();
        }
    }
    out.sort_by_key(|l| (l.first_waited, l.last_end));
    out
}

/// The launch table: per launch, its times from the step's first block (us) and what it added to
/// the step: from the latest end of the launches before it to its own end.
pub fn launch_table(launches: &[Launch], t0: u64, recorded: usize, kept: usize) -> String {
    let us = |t: u64| t.saturating_sub(t0) as f64 / 1000.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "# {} launches, {kept} block records{}",
        launches.len(),
        if recorded > kept { format!(" ({} more did not fit)", recorded - kept) } else { String::new() }
    );
    let _ = writeln!(
        s,
        "# times in us from the step's first block: first start, first past its wait, last past its wait, last end;\n\
         # gap = first past its wait - the latest end before it; own = last end - first past its wait;\n\
         # added = last end - the latest end before it (its share of the step)"
    );
    s.push_str("launch\tkernel\tblocks\tstart\twaited\twaited_last\tend\tgap\town\tadded\n");
    let mut latest = t0;
    let mut totals: Vec<(String, u32, f64)> = Vec::new();
    for (i, l) in launches.iter().enumerate() {
        let gap = l.first_waited as f64 / 1000.0 - latest as f64 / 1000.0;
        let own = (l.last_end.saturating_sub(l.first_waited)) as f64 / 1000.0;
        let added = l.last_end.saturating_sub(latest) as f64 / 1000.0;
        let _ = writeln!(
            s,
            "{i}\t{}\t{}{}\t{:.2}\t{:.2}\t{:.2}\t{:.2}\t{:.2}\t{:.2}\t{:.2}",
            l.name,
            l.blocks,
            if l.records < l.blocks { format!(" ({} recorded)", l.records) } else { String::new() },
            us(l.first_start),
            us(l.first_waited),
            us(l.last_waited),
            us(l.last_end),
            gap,
            own,
            added
        );
        match totals.iter_mut().find(|t| t.0 == l.name) {
            Some(t) => {
                t.1 += 1;
                t.2 += added;
            }
            None => totals.push((l.name.clone(), 1, added)),
        }
        latest = latest.max(l.last_end);
    }
    totals.sort_by(|a, b| b.2.total_cmp(&a.2));
    let _ = writeln!(s, "\n# by kernel: launches, added us in all, added us per launch (step {:.2} us)", us(latest));
    for (name, n, added) in totals {
        let _ = writeln!(s, "# {name}\t{n}\t{added:.2}\t{:.2}", added / n as f64);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(name: u32, block: u32, blocks: u32, start: u64, waited: u64, end: u64) -> BlockRecord {
        BlockRecord { name, block, blocks, smid: 0, start, waited, end, marked: 0 }
    }

    #[test]
    fn records_fall_into_their_launches_in_order() {
        // Kernel 1 launched twice (2 blocks each), kernel 2 once between them (early start, waits).
        let recs = [
            rec(1, 1, 2, 100, 110, 200),
            rec(2, 0, 1, 150, 210, 300),
            rec(1, 0, 2, 100, 105, 190),
            rec(1, 0, 2, 290, 310, 400),
            rec(1, 1, 2, 295, 305, 420),
        ];
        let l = launches(&recs, &|h| format!("k{h}"));
        let got: Vec<(&str, u32, u64, u64, u64)> =
            l.iter().map(|l| (l.name.as_str(), l.records, l.first_waited, l.last_waited, l.last_end)).collect();
        assert_eq!(got, [("k1", 2, 105, 110, 200), ("k2", 1, 210, 210, 300), ("k1", 2, 305, 310, 420)]);
        let table = launch_table(&l, 100, 5, 5);
        // The second kernel waited 10 ns past the first's end and added 100 ns to the step.
        assert!(table.contains("1\tk2\t1\t0.05\t0.11\t0.11\t0.20\t0.01\t0.09\t0.10"), "{table}");
        assert!(table.contains("# k1\t2\t0.22\t0.11"), "{table}");
    }

    #[test]
    fn a_block_that_never_waits_leaves_its_launchs_wait_to_the_others() {
        // Kernel 3's second block rides along: it starts early and never waits (waited 0).
        let recs = [rec(3, 0, 2, 100, 150, 200), rec(3, 1, 2, 90, 0, 130), rec(4, 0, 1, 80, 0, 95)];
        let l = launches(&recs, &|h| format!("k{h}"));
        let got: Vec<(&str, u64, u64, u64, u64)> =
            l.iter().map(|l| (l.name.as_str(), l.first_start, l.first_waited, l.last_waited, l.last_end)).collect();
        // A launch none of whose blocks waits counts from its starts.
        assert_eq!(got, [("k4", 80, 80, 80, 95), ("k3", 90, 150, 150, 200)]);
    }

    #[test]
    fn the_hash_is_fnv1a() {
        assert_eq!(name_hash(""), 2166136261);
        assert_eq!(name_hash("a"), 0xe40c292c);
    }
}
