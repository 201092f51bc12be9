//! Opening a store for inference: the backend, the expert pool's size and threads.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use cherenkov_cpu::CpuModel;
use cherenkov_cuda::CudaModel;
use cherenkov_cuda::gpu::Gpu;
use cherenkov_cuda::pinned::PinnedExperts;
use cherenkov_cuda::slots::DeviceSlots;
use cherenkov_engine::residency::{ExpertPool, HostSlots, format_bytes, parse_size, slots_for_budget};
use cherenkov_model::LayerType;
use cherenkov_model::config::TextConfig;
use cherenkov_model::store::Store;

use crate::backend::{AnyModel, BackendChoice};
use crate::progress::bytes_bar;

/// Memory, backend and threading options shared by every command that runs a model.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct LoadArgs {
    /// Where to compute: auto picks CUDA when an NVIDIA GPU is usable, else the CPU.
    #[arg(long, value_enum, default_value_t = BackendChoice::Auto)]
    pub backend: BackendChoice,
    /// Memory for routed experts (e.g. 512M, 4G; K/M/G are powers of 1024). On the CPU the default
    /// is every expert if they fit in half the available memory, else half of it; on CUDA it is what
    /// --gpu-memory leaves after the dense weights and the sessions. At least one expert record; a
    /// cache smaller than one step's experts (top-k) works on the CPU but reads more.
    #[arg(long, value_name = "SIZE")]
    pub expert_cache: Option<String>,
    /// CUDA: the whole device-memory budget (dense weights, two sessions of --max-context tokens,
    /// scratch, and the expert cache, which gets the rest). Default: 90% of the free memory.
    #[arg(long, value_name = "SIZE")]
    pub gpu_memory: Option<String>,
    /// CUDA: tokens of context reserved per session when sizing the expert cache.
    #[arg(long, default_value_t = 8192, value_name = "N")]
    pub max_context: usize,
    /// Threads issuing expert reads.
    #[arg(long, default_value_t = 4, value_name = "N")]
    pub io_threads: usize,
    /// Compute threads on the CPU (default: one per core).
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
    /// CUDA, bounded expert cache: once the resident experts of a block are computed, drop the
    /// experts still being read whose routing weight is below WEIGHT (e.g. 0.05) instead of
    /// waiting for them; their reads finish in the background. Off by default. Output then
    /// depends on read timing: runs are not reproducible.
    #[arg(long, value_name = "WEIGHT")]
    pub cut_weak: Option<f32>,
    /// CUDA, bounded expert cache: pin the store's expert file in host memory (the page cache) so
    /// the GPU copies missing experts straight from it, with no CPU copy (on the H200 host a miss
    /// took 0.12 ms instead of 0.37). Pinned memory cannot be reclaimed while the model is loaded,
    /// and pinning first reads and checks every record. auto pins when the expert file fits in the available memory with a
    /// quarter of the host's memory left over.
    #[arg(long, value_enum, default_value_t = PinExperts::Auto, value_name = "WHEN")]
    pub pin_experts: PinExperts,
    /// CUDA, bounded expert cache: let a team of THREADS CPU threads (auto: half the cores)
    /// compute some of a block's misses from the expert file in host memory instead of loading
    /// them, when the measured rates say the block then ends sooner (the misses of lowest routing
    /// weight; they are not cached on the GPU). Without a pinned file every record is checked
    /// first. Off by default: the CPU's sums differ from the GPU's in the last bits and the choice
    /// depends on timing, so runs are not reproducible; on the H200 host it gained 0-3%, within
    /// noise (see docs/engine.md).
    #[arg(long, value_name = "THREADS")]
    pub cpu_experts: Option<String>,
}

/// The team size `--cpu-experts` asks for: a positive count, or auto: half the cores. The team's
/// threads spin between jobs, and on the H200 host 14 of 16 cores took the cores the step's thread
/// and the expert reads needed (a miss read by the CPU took 0.83-0.90 ms instead of 0.38-0.49),
/// while 8 threads computed an expert about as fast as 14 (0.113 ms vs 0.098 in `expert_probe`).
pub fn cpu_expert_threads(arg: &str) -> Result<usize> {
    if arg == "auto" {
        return Ok((std::thread::available_parallelism().map_or(1, |p| p.get()) / 2).max(1));
    }
    match arg.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => bail!("--cpu-experts {arg}: a number of threads (at least 1) or auto is expected"),
    }
}

/// When to pin the expert file for the GPU (`--pin-experts`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PinExperts {
    /// When the GPU cannot hold every expert and the expert file fits in the available memory
    /// with a quarter of the host's memory left over.
    #[default]
    Auto,
    /// Always (fails if the file cannot be pinned).
    On,
    /// Never: the CPU reads each missing record from the page cache.
    Off,
}

/// Bytes of a /proc/meminfo line (`MemAvailable`, `MemTotal`), if the kernel says.
fn meminfo(key: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.strip_prefix(key).is_some_and(|r| r.starts_with(':')))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Bytes the kernel reports as available (MemAvailable), if it says.
fn mem_available() -> Option<u64> {
    meminfo("MemAvailable")
}

/// Whether `--pin-experts auto` pins an expert file of `bytes`: it must fit in the available
/// memory (which counts the page cache, so a file already cached counts as available) with a
/// quarter of the host's memory left over.
pub fn auto_pins(bytes: u64) -> bool {
    match (meminfo("MemAvailable"), meminfo("MemTotal")) {
        (Some(avail), Some(total)) => fits_with_a_quarter_spare(bytes, avail, total),
        _ => false,
    }
}

/// `bytes` fit in `available` with a quarter of `total` left over.
fn fits_with_a_quarter_spare(bytes: u64, available: u64, total: u64) -> bool {
    bytes <= available.saturating_sub(total / 4)
}

pub struct LoadedAny {
    pub store: Arc<Store>,
    pub model: AnyModel,
}

fn open_store(store_dir: &Path, args: &LoadArgs) -> Result<Arc<Store>> {
    if let Some(n) = args.threads {
        // Ignore the error if a pool exists already (tests run several commands in one process).
        let _ = rayon::ThreadPoolBuilder::new().num_threads(n.max(1)).build_global();
    }
    Ok(Arc::new(Store::open(store_dir)?))
}

fn parse_budget(s: &str, flag: &str) -> Result<u64> {
    parse_size(s).with_context(|| format!("{flag} {s}"))
}

fn check_one_record(bytes: u64, record: usize, flag: &str, s: &str, c: &TextConfig) -> Result<()> {
    if bytes < record as u64 {
        bail!(
            "{flag} {s} is smaller than one expert record ({}); give at least that much, ideally enough for the \
             experts of one step ({} x {})",
            format_bytes(record as u64),
            c.num_experts_per_tok,
            format_bytes(record as u64)
        );
    }
    Ok(())
}

/// The CPU backend with its expert pool. Prints the pool size to stderr.
pub fn cpu_model(store: Arc<Store>, args: &LoadArgs) -> Result<CpuModel> {
    let ef = &store.manifest.experts;
    let record = store.record_bytes();
    let all = ef.records() as usize;
    let slots = match &args.expert_cache {
        Some(s) => {
            let bytes = parse_budget(s, "--expert-cache")?;
            check_one_record(bytes, record, "--expert-cache", s, store.config())?;
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
    CpuModel::new(store, pool)
}

/// Device bytes one session needs at `tokens` of context.
pub fn session_bytes(c: &TextConfig, tokens: usize) -> usize {
    let per_attn = tokens * (2 * c.num_key_value_heads * c.head_dim + c.qsa.as_ref().map_or(0, |q| q.head_dim * 2));
    let per_gdn = c.gdn_state_len() + (c.linear_conv_kernel_dim - 1) * c.gdn_conv_dim();
    let attn = c.layer_types.iter().filter(|t| **t == LayerType::Attention).count();
    let ple = c.ple_layer_ids.len() * (c.ple_conv_kernel_size - 1) * c.ngram_size * c.hc_hidden();
    4 * (attn * per_attn + (c.num_hidden_layers - attn) * per_gdn + ple)
}

/// The CUDA backend with its device expert pool sized from the budget. Prints the sizes to stderr.
pub fn cuda_model(store: Arc<Store>, args: &LoadArgs) -> Result<CudaModel> {
    let gpu = Gpu::new()?;
    let (free, total) = gpu.mem_info()?;
    let c = store.config().clone();
    let record = store.record_bytes();
    let all = store.manifest.experts.records() as usize;
    let dense = store.dense_bytes().len();
    // Two sessions (the server's default concurrency) at --max-context, plus scratch.
    let scratch = 4 * (c.num_experts * (c.moe_intermediate_size + c.hidden_size) + c.vocab_size + 16 * c.hc_hidden())
        + (64 << 20);
    let reserve = 2 * session_bytes(&c, args.max_context) + scratch;
    let budget = match &args.gpu_memory {
        Some(s) => {
            let b = parse_budget(s, "--gpu-memory")? as usize;
            if b > total {
                bail!(
                    "--gpu-memory {s} ({}) exceeds the {}'s {} of memory",
                    format_bytes(b as u64),
                    gpu.info.name,
                    format_bytes(total as u64)
                );
            }
            b
        }
        None => free / 10 * 9,
    };
    let pool_bytes = match &args.expert_cache {
        Some(s) => {
            let b = parse_budget(s, "--expert-cache")?;
            check_one_record(b, record, "--expert-cache", s, &c)?;
            b as usize
        }
        None => {
            let left = budget.saturating_sub(dense + reserve);
            if left < record * c.num_experts_per_tok {
                bail!(
                    "the GPU budget of {} leaves no room for experts: dense weights take {}, two sessions of {} \
                     tokens and scratch take {}, and one step's experts need {} more (on the {} with {} free of {})",
                    format_bytes(budget as u64),
                    format_bytes(dense as u64),
                    args.max_context,
                    format_bytes(reserve as u64),
                    format_bytes((record * c.num_experts_per_tok) as u64),
                    gpu.info.name,
                    format_bytes(free as u64),
                    format_bytes(total as u64)
                );
            }
            left
        }
    };
    if dense + pool_bytes.min(all * record) + reserve > free {
        bail!(
            "not enough GPU memory: dense weights {} + expert cache {} + sessions and scratch {} exceed the {} free \
             on the {} ({} in all); lower --expert-cache or --max-context",
            format_bytes(dense as u64),
            format_bytes(pool_bytes.min(all * record) as u64),
            format_bytes(reserve as u64),
            format_bytes(free as u64),
            gpu.info.name,
            format_bytes(total as u64)
        );
    }
    let slots = slots_for_budget(pool_bytes as u64, record).min(all).max(1);
    let mut memory = DeviceSlots::new(gpu.clone(), slots, record)?;
    let file_bytes = (all * record) as u64;
    let pin = match args.pin_experts {
        PinExperts::Off => false,
        PinExperts::On => true,
        PinExperts::Auto => slots < all && auto_pins(file_bytes),
    };
    if pin {
        match pin_experts(&gpu, &store) {
            Ok(p) => memory.set_pinned(p),
            Err(e) if args.pin_experts == PinExperts::Auto => {
                eprintln!("note: the expert file stays unpinned (the CPU reads missing experts): {e:#}")
            }
            Err(e) => return Err(e.context("--pin-experts on")),
        }
    }
    let pinned = memory.pinned_bytes();
    let pool = Arc::new(ExpertPool::new(store.clone(), Arc::new(memory), args.io_threads.max(1))?);
    eprintln!(
        "cuda: {} ({} free of {}); dense {}; expert cache {slots} slots x {} = {} ({:.0}% of the {all} experts){}",
        gpu.info.name,
        format_bytes(free as u64),
        format_bytes(total as u64),
        format_bytes(dense as u64),
        format_bytes(record as u64),
        format_bytes((slots * record) as u64),
        100.0 * slots as f64 / all as f64,
        if pinned > 0 {
            format!("; expert file pinned in host memory ({})", format_bytes(pinned))
        } else {
            String::new()
        },
    );
    let mut model = CudaModel::new(store, gpu, pool.clone())?;
    if let Some(w) = args.cut_weak {
        if !(0.0..=1.0).contains(&w) {
            bail!("--cut-weak {w}: a routing weight between 0 and 1 is expected");
        }
        model.cut_weak = Some(w);
    }
    if let Some(arg) = &args.cpu_experts {
        let threads = cpu_expert_threads(arg)?;
        if slots >= all {
            eprintln!("note: --cpu-experts has nothing to do: every expert is resident on the GPU");
        } else {
            let bar = bytes_bar("checking experts");
            bar.set_length(if pinned > 0 { 0 } else { file_bytes });
            model.set_cpu_experts(threads, &|done| bar.set_position(done)).context("--cpu-experts")?;
            bar.finish_and_clear();
            if let Some((copy, cpu)) = model.cpu_expert_rates() {
                eprintln!(
                    "cuda: {threads} CPU threads compute misses when sooner: an expert takes {:.3} ms on the CPU \
                     ({}), a miss {:.3} ms to load",
                    cpu as f64 / 1e6,
                    cherenkov_cpu::q4::kernel_name(),
                    copy as f64 / 1e6
                );
            }
        }
    }
    if slots >= all {
        // Every expert fits: load them all now, with progress, rather than in the first step.
        let bar = bytes_bar("experts");
        bar.set_length((all * record) as u64);
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    bar.set_position(pool.stats().total.bytes_read.min((all * record) as u64));
                    std::thread::sleep(std::time::Duration::from_millis(100));
                }
            });
            let r = model.make_resident();
            done.store(true, std::sync::atomic::Ordering::Relaxed);
            r
        })
        .context("loading every expert into the GPU")?;
        bar.finish_and_clear();
    }
    Ok(model)
}

/// Checks every expert record and pins the expert file for the GPU, with progress.
pub fn pin_experts(gpu: &Arc<Gpu>, store: &Store) -> Result<PinnedExperts> {
    let bar = bytes_bar("pinning experts");
    bar.set_length(store.manifest.experts.records() * store.manifest.experts.record_bytes);
    let pinned = PinnedExperts::pin(gpu.clone(), store, &|done| bar.set_position(done));
    bar.finish_and_clear();
    pinned
}

/// Opens the store on the chosen backend.
pub fn open_model(store_dir: &Path, args: &LoadArgs) -> Result<LoadedAny> {
    let store = open_store(store_dir, args)?;
    let model = match args.backend {
        BackendChoice::Cpu => AnyModel::Cpu(Box::new(cpu_model(store.clone(), args)?)),
        BackendChoice::Cuda => AnyModel::Cuda(Box::new(
            cuda_model(store.clone(), args).context("--backend cuda (use --backend cpu to run on the CPU)")?,
        )),
        BackendChoice::Auto => {
            if cherenkov_cuda::gpu::driver_present() && cherenkov_cuda::gpu::probe().is_ok() {
                AnyModel::Cuda(Box::new(cuda_model(store.clone(), args)?))
            } else {
                AnyModel::Cpu(Box::new(cpu_model(store.clone(), args)?))
            }
        }
    };
    Ok(LoadedAny { store, model })
}

/// Both backends on one store (for --check).
pub fn open_both(store_dir: &Path, args: &LoadArgs) -> Result<(Arc<Store>, CpuModel, CudaModel)> {
    let store = open_store(store_dir, args)?;
    let cuda = cuda_model(store.clone(), args).context("--check needs a usable GPU")?;
    let cpu = cpu_model(store.clone(), &LoadArgs { expert_cache: None, ..args.clone() })?;
    Ok((store, cpu, cuda))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_pinning_leaves_a_quarter_of_the_host_free() {
        const G: u64 = 1 << 30;
        // The 48-layer model's 63.3 GiB expert file: pinned on the 125 GiB GPU host, not on a
        // 64 GiB one, nor when other programs hold most of the memory.
        assert!(fits_with_a_quarter_spare(63 * G, 120 * G, 125 * G));
        assert!(!fits_with_a_quarter_spare(63 * G, 60 * G, 64 * G));
        assert!(!fits_with_a_quarter_spare(63 * G, 80 * G, 125 * G));
        assert!(fits_with_a_quarter_spare(0, 0, 0));
        assert!(!fits_with_a_quarter_spare(1, 10, 100));
    }

    #[test]
    fn cpu_expert_threads_are_a_count_or_auto() {
        assert_eq!(cpu_expert_threads("6").unwrap(), 6);
        assert!(cpu_expert_threads("auto").unwrap() >= 1);
        for bad in ["0", "-1", "many", ""] {
            let e = cpu_expert_threads(bad).unwrap_err().to_string();
            assert!(e.contains("--cpu-experts") && e.contains("auto"), "{bad}: {e}");
        }
    }
}
