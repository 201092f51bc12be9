//! Experts computed on the CPU (`--cpu-experts`): when a block's misses would take longer to load
//! than the CPU takes to compute some of them from the expert file's pages in host memory, the CPU
//! computes those and uploads only their outputs (10 KB each instead of a 2.64 MiB record).
//!
//! The records come from the pinned expert file when it is pinned (checked when it was pinned),
//! else from a read-only map of the file, every record checked against its checksums when the team
//! starts (as pinning does; checking each record at its first use instead cost the step's thread
//! 0.4-0.5 ms per record on the H200 host, mostly page faults and one core's memory bandwidth).
//! Either way a page not in the page cache faults in from the disk.
//!
//! The choice is made per block from two measured rates: what one miss costs with nothing else
//! loading (pinned: the copy, [`DeviceSlots::lone_copy_ns`]; not pinned: the CPU's read into
//! pinned memory and the copy, [`DeviceSlots::lone_load_ns`]; measured at load) and what the CPU
//! team takes per expert (measured at load, then the median of its last jobs). The block's loads
//! share one resource (the link; host memory bandwidth for the reads), so `m` loads end after about
//! `m` lone ones; the team computes its experts one after another at its rate. [`cpu_share`]
//! picks the number of misses for the CPU that ends the block's experts soonest; the CPU takes the
//! misses of lowest routing weight, so the ones that matter most are the ones cached. An expert
//! computed on the CPU is not cached on the GPU.
//!
//! The team's rate is only measured by using it, so a rate that made the CPU lose (a slow job, a
//! busy host) would never be measured again: every 64th block with misses that gives the CPU none
//! gives it one anyway. Every streamed block keeps the team's threads spinning
//! ([`ExpertTeam::keep_warm`]), so a job never waits for threads to wake.
//!
//! `CHERENKOV_CPU_EXPERTS_ALL=1` gives every miss to the CPU whatever the rates: the GPU check runs
//! `run --check` with it, to compare the path with the CPU reference.
//!
//! Outputs differ from the GPU's in the last bits (another summation order), and which experts the
//! CPU takes depends on timing: like the deadline cut, runs with `--cpu-experts` are not
//! bit-reproducible.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use cherenkov_cpu::expert::ExpertMatrices;
use cherenkov_cpu::team::{ExpertTeam, JobExpert};
use cherenkov_engine::residency::{ExpertPool, StoreRecord};
use cherenkov_model::store::Store;
use rayon::prelude::*;

use crate::slots::DeviceSlots;

/// How long the team's threads spin for the next job (or keep-warm call) before parking.
const SPIN: Duration = Duration::from_millis(3);
/// Blocks with misses that give the CPU none before one gives it one, to measure its rate again.
const PROBE_EVERY: u64 = 64;

/// Where the CPU reads expert records.
enum Records {
    /// The pinned expert file (in the slots), checked when it was pinned.
    Pinned,
    /// A read-only map of the expert file, every record checked when the team started.
    Mapped(memmap2::Mmap),
}

/// The team computing experts on the CPU, and the load rate it competes with.
pub struct CpuExperts {
    pub team: ExpertTeam,
    /// One miss's load to the GPU with nothing else loading, ns (measured at load).
    pub copy_ns: u64,
    records: Records,
    /// Every miss goes to the CPU (`CHERENKOV_CPU_EXPERTS_ALL=1`).
    pub all: bool,
    /// Blocks with misses that gave the CPU none since it last had one.
    declined: AtomicU64,
}

impl CpuExperts {
    /// A team of `threads` threads for `pool`'s experts; measures what a miss's load costs and the
    /// team's rate on a few records of the first MoE layer. Without a pinned file it first checks
    /// every record, calling `progress(bytes checked)`.
    pub fn new(
        pool: &Arc<ExpertPool<DeviceSlots>>,
        threads: usize,
        progress: &(dyn Fn(u64) + Sync),
    ) -> Result<CpuExperts> {
        if threads == 0 {
            bail!("--cpu-experts needs at least one thread");
        }
        let store = pool.store();
        let slots = pool.memory();
        let ef = &store.manifest.experts;
        let (records, copy_ns) = match host_record(store, slots, 0, 0) {
            Some(first) => {
                (Records::Pinned, slots.lone_copy_ns(first).context("measuring an expert copy for --cpu-experts")?)
            }
            None => {
                let path = store.dir.join(&ef.file);
                let file = std::fs::File::open(&path).with_context(|| format!("cannot open {}", path.display()))?;
                // SAFETY: a read-only shared map of a store file, which nothing writes after
                // `prepare` (a file cut short under it would fault the process: stores are not
                // changed in place).
                let map =
                    unsafe { memmap2::Mmap::map(&file) }.with_context(|| format!("cannot map {}", path.display()))?;
                let n = ef.records() as usize;
                if (map.len() as u64) < ef.records() * ef.record_bytes {
                    bail!(
                        "{} holds {} bytes, less than its {n} records of {}",
                        path.display(),
                        map.len(),
                        ef.record_bytes
                    );
                }
                let lone = slots
                    .lone_load_ns(&StoreRecord { store, layer: 0, expert: 0 })
                    .context("measuring an expert load for --cpu-experts")?;
                let done = AtomicU64::new(0);
                (0..n).into_par_iter().try_for_each(|idx| {
                    crate::pinned::check_record(store, idx)?;
                    progress(done.fetch_add(ef.record_bytes, Ordering::Relaxed) + ef.record_bytes);
                    Ok::<(), anyhow::Error>(())
                })?;
                (Records::Mapped(map), lone)
            }
        };
        let team = ExpertTeam::new(threads, SPIN)?;
        let mut cx = CpuExperts { team, copy_ns, records, all: false, declined: AtomicU64::new(0) };
        // The team's rate: a few jobs of one expert on distinct records (from memory, not the
        // caches), which seed its moving mean.
        let layout = &ef.layers[0];
        let h = store.config().hidden_size;
        let x: Vec<f32> = (0..h).map(|i| ((i * 37 % 101) as f32 - 50.0) / 500.0).collect();
        for e in 0..ef.num_experts.min(16) {
            let rec = cx.record(store, slots, 0, e)?;
            let matrices = ExpertMatrices::from_record(rec, layout)?;
            cx.team.submit(&[JobExpert { matrices, x: &x }]).wait()?;
        }
        cx.all = std::env::var_os("CHERENKOV_CPU_EXPERTS_ALL").is_some_and(|v| v == "1");
        Ok(cx)
    }

    /// Expert `expert` of MoE layer `layer` in host memory (checked when the team started).
    pub fn record<'a>(
        &'a self,
        store: &Store,
        slots: &'a DeviceSlots,
        layer: usize,
        expert: usize,
    ) -> Result<&'a [u8]> {
        let ef = &store.manifest.experts;
        match &self.records {
            Records::Pinned => host_record(store, slots, layer, expert)
                .ok_or_else(|| anyhow!("expert {expert} of MoE layer {layer} is not in the pinned expert file")),
            Records::Mapped(map) => {
                let idx = ef.record_index(layer, expert) as usize;
                let (at, n) = (idx * ef.record_bytes as usize, ef.record_bytes as usize);
                map.get(at..at + n).ok_or_else(|| anyhow!("expert record {idx} is outside the map"))
            }
        }
    }

    /// How many of a block's `misses` the CPU computes (see [`cpu_share`] and the module docs).
    pub fn share(&self, misses: usize) -> usize {
        if self.all {
            return misses;
        }
        let n = cpu_share(misses, self.copy_ns, self.cpu_ns());
        if n > 0 || misses == 0 {
            self.declined.store(0, Ordering::Relaxed);
            return n;
        }
        if self.declined.fetch_add(1, Ordering::Relaxed) + 1 >= PROBE_EVERY {
            self.declined.store(0, Ordering::Relaxed);
            return 1;
        }
        0
    }

    /// The CPU team's current time per expert, ns.
    pub fn cpu_ns(&self) -> u64 {
        self.team.ns_per_expert().unwrap_or(u64::MAX)
    }
}

/// Expert `expert` of MoE layer `layer` in the pinned expert file's pages, if pinned.
pub fn host_record<'a>(store: &Store, slots: &'a DeviceSlots, layer: usize, expert: usize) -> Option<&'a [u8]> {
    let ef = &store.manifest.experts;
    slots.host_record(&store.dir, ef.record_index(layer, expert) * ef.record_bytes)
}

/// Of a block's `misses` (all copied at once, sharing the link: the last ends after `misses` lone
/// copies of `copy_ns`), how many the CPU should compute instead (one after another, `cpu_ns`
/// each) so that the block's experts end soonest; ties go to the copies (which also cache the
/// expert).
pub fn cpu_share(misses: usize, copy_ns: u64, cpu_ns: u64) -> usize {
    let end = |cpu: usize| ((misses - cpu) as u64).saturating_mul(copy_ns).max((cpu as u64).saturating_mul(cpu_ns));
    (0..=misses).fold(0, |best, cpu| if end(cpu) < end(best) { cpu } else { best })
}

#[cfg(test)]
mod tests {
    use super::cpu_share;

    #[test]
    fn the_cpu_takes_misses_only_where_the_block_ends_sooner() {
        // Nothing to share, or a CPU slower than the whole link's queue: all copies.
        assert_eq!(cpu_share(0, 50, 10), 0);
        assert_eq!(cpu_share(3, 50, 400), 0);
        // One miss: the CPU takes it only when strictly faster than its copy (a tie caches it).
        assert_eq!(cpu_share(1, 50, 40), 1);
        assert_eq!(cpu_share(1, 50, 50), 0);
        assert_eq!(cpu_share(1, 50, 60), 0);
        // Two misses, CPU a little slower than a copy: one each (60 instead of 100).
        assert_eq!(cpu_share(2, 50, 60), 1);
        // Four misses: the CPU at twice the copy time takes one (150 vs 200)... or, at the copy's
        // rate, half of them.
        assert_eq!(cpu_share(4, 50, 100), 1);
        assert_eq!(cpu_share(4, 50, 50), 2);
        // Unknown CPU rate (u64::MAX): never the CPU.
        assert_eq!(cpu_share(5, 50, u64::MAX), 0);
    }
}
