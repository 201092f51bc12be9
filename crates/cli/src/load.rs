//! Opening a store for inference: the expert pool's size and threads, and the CPU backend.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result};
use cherenkov_cpu::CpuModel;
use cherenkov_engine::residency::{ExpertPool, HostSlots, format_bytes, parse_size, slots_for_budget};
use cherenkov_model::store::Store;

/// Memory and threading options shared by every command that runs a model.
#[derive(clap::Args, Debug, Clone)]
pub struct LoadArgs {
    /// Memory for routed experts (e.g. 512M, 4G; K/M/G are powers of 1024). Default: every expert
    /// if they fit in half the available memory, otherwise half the available memory. At least one
    /// expert record; a cache smaller than one step's experts (top-k) works but reads more.
    #[arg(long, value_name = "SIZE")]
    pub expert_cache: Option<String>,
    /// Threads issuing expert reads.
    #[arg(long, default_value_t = 4, value_name = "N")]
    pub io_threads: usize,
    /// Compute threads (default: one per core).
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
}

/// Bytes the kernel reports as available (MemAvailable), if it says.
fn mem_available() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

pub struct Loaded {
    pub store: Arc<Store>,
    pub model: CpuModel,
}

/// Opens the store and builds the CPU backend with its expert pool. Prints the pool size to stderr.
pub fn open_cpu(store_dir: &Path, args: &LoadArgs) -> Result<Loaded> {
    if let Some(n) = args.threads {
        // Ignore the error if a pool exists already (tests run several commands in one process).
        let _ = rayon::ThreadPoolBuilder::new().num_threads(n.max(1)).build_global();
    }
    let store = Arc::new(Store::open(store_dir)?);
    let ef = &store.manifest.experts;
    let record = store.record_bytes();
    let all = ef.records() as usize;
    let slots = match &args.expert_cache {
        Some(s) => {
            let bytes = parse_size(s).with_context(|| format!("--expert-cache {s}"))?;
            if bytes < record as u64 {
                anyhow::bail!(
                    "--expert-cache {s} is smaller than one expert record ({}); give at least that much, \
                     ideally enough for the experts of one step ({} x {})",
                    format_bytes(record as u64),
                    store.config().num_experts_per_tok,
                    format_bytes(record as u64)
                );
            }
            slots_for_budget(bytes, record).min(all)
        }
        None => {
            let half = mem_available().map(|m| m / 2).unwrap_or(u64::MAX);
            slots_for_budget(half.min((all * record) as u64), record).min(all)
        }
    };
    let memory = Arc::new(HostSlots::new(slots.max(1), record)?);
    let pool = Arc::new(ExpertPool::new(store.clone(), memory, args.io_threads.max(1))?);
    eprintln!(
        "expert cache: {slots} slots x {} = {} ({:.0}% of the {all} experts, {})",
        format_bytes(record as u64),
        format_bytes((slots * record) as u64),
        100.0 * slots as f64 / all as f64,
        format_bytes((all * record) as u64),
    );
    let model = CpuModel::new(store.clone(), pool)?;
    Ok(Loaded { store, model })
}
