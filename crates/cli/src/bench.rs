//! `cherenkov bench`: decode speed on a synthetic model of the released shape, on the GPU.
//!
//! One run measures: the device and pinned host-to-device bandwidths (the latter also from the
//! pinned expert file; the PCIe bounds take the higher); decode with every expert
//! resident (at this depth and half of it); decode with the expert cache a 21 GB budget would
//! leave the full model (copied from the pinned expert file, read by the CPU from the page cache,
//! then from a cold cache; and with some misses computed on the CPU, `--cpu-experts`, pinned and
//! not); hit rates, lookahead accuracy, bytes read per token and
//! where the time goes; the offline policy study (LRU, LRFU, Belady) on the streamed run's routing
//! trace; the roofline ratios; and the same shape in transformers' eager implementation (first,
//! alone on the GPU, at the depths that fit it, `--peer-layers`, extrapolated per layer as
//! Cherenkov's figures are). The model has random weights and skewed synthetic routers (see
//! `cherenkov_engine::routing`); its depth is `--layers` (to fit a disk), and 48-layer figures are
//! extrapolated per layer from it and half of it (a per-token part and a per-layer part) and said
//! so.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use cherenkov_cuda::CudaModel;
use cherenkov_cuda::gpu::{Gpu, measure_bandwidth};
use cherenkov_cuda::pinned::PinnedExperts;
use cherenkov_cuda::slots::DeviceSlots;
use cherenkov_engine::policy::{Policy, simulate_from};
use cherenkov_engine::residency::{ExpertPool, format_bytes, parse_size};
use cherenkov_engine::routing::{Skew, SkewedRouting};
use cherenkov_engine::sampling::{Sampler, SamplingParams};
use cherenkov_engine::tokenizer::Tokenizer;
use cherenkov_model::arch;
use cherenkov_model::config::{LayerType, ModelConfig, TextConfig};
use cherenkov_model::store::Store;
use cherenkov_model::synth::{SynthOptions, SynthShape, store_bytes, write_store};
use cherenkov_registry::Registry;
use serde_json::json;

use crate::load::session_bytes;
use crate::progress::bytes_bar;
use crate::run::prompt_tokens;

mod peer;

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Decoder layers of the synthetic model (the released model has 48; 48-layer figures add 48
    /// times each case's time per layer to the time per token, both measured from this depth and
    /// half of it).
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    /// Routed experts per layer.
    #[arg(long, default_value_t = 512)]
    pub experts: usize,
    /// Decode tokens timed per case (after --warmup untimed ones).
    #[arg(long, default_value_t = 128)]
    pub tokens: usize,
    /// Untimed decode tokens per case before the timed ones: they fill the expert cache, and capture
    /// the CUDA graph in the cases that replay one; the cache-policy study replays them uncounted,
    /// as the pool saw them.
    #[arg(long, default_value_t = 8)]
    pub warmup: usize,
    /// The full model's GPU budget to emulate: the expert cache is the share of the experts it would
    /// leave a 48-layer model, applied to this model's layers.
    #[arg(long, default_value = "21G")]
    pub gpu_memory: String,
    /// Skew of the synthetic routers: popularity, reuse, noise, model, foresight, seed (see
    /// engine::routing; the defaults give about 24% consecutive-token sharing, 71% LRU hits with 17%
    /// cached, and a lookahead right about 80% of the time, as published cross-layer predictors are).
    #[arg(long, default_value = "popularity=0.55,reuse=0.25,noise=1,model=0.2,foresight=0.96")]
    pub synthetic_routing: String,
    /// Rows of the first n-gram head (the real table has 20M per head; fewer rows, same width).
    #[arg(long, default_value_t = 200_003)]
    pub ngram_base: u64,
    /// Directory for the results (markdown and JSON).
    #[arg(long, default_value = "benchmark/results")]
    pub out: PathBuf,
    /// Python with torch and transformers for the peer measurement.
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// Skip the transformers peer.
    #[arg(long)]
    pub no_peer: bool,
    /// Decoder layers of the transformers peer (default: the deepest multiple of the attention
    /// layers' spacing whose bf16 model fits the GPU's free memory with a tenth to spare: 24 on a
    /// 141 GB H200, 12 on an 80 GB card). Its bf16 experts take about 5 GB a layer of the released
    /// shape, so the 48-layer model does not fit the GPU: the peer runs at the lower of this and
    /// --layers and at half that, never shallower than the first attention layer (4 in the
    /// released shape: transformers' cache needs one), twice at each depth in turn (its faster run
    /// counts), and its 48-layer rate is extrapolated per layer as Cherenkov's is. It runs first,
    /// before the bench takes the GPU, and times --tokens tokens as the cases do.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub peer_layers: Option<u32>,
    /// Threads that read missing expert records from the store when the expert file is not
    /// pinned (the pinned cases copy from the page cache without them).
    #[arg(long, default_value_t = 8)]
    pub io_threads: usize,
    /// Routing weight below which the last case's deadline cut drops late experts.
    #[arg(long, default_value_t = 0.05)]
    pub cut_weak: f32,
    /// Threads of the last cases' CPU expert team (`--cpu-experts`; auto: half the cores).
    #[arg(long, default_value = "auto", value_name = "THREADS")]
    pub cpu_experts: String,
    /// Runs of the resident case at each of the two depths (alternated) in the full benchmark; each
    /// depth's middle run by tok/s is reported and fits the per-layer extrapolation, whose
    /// per-token part one noisy run at half the depth moves by several tok/s at 48 layers.
    /// `--quick` runs each once (tools/gpu/ab.sh alternates its own rounds).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=15))]
    pub repeats: u32,
    /// Only the cases that compare two builds: every expert resident (with and without CUDA
    /// graphs, and at half the depth) and the budget's pinned streaming (with and without the
    /// lookahead); no policy study and no peer. Writes bench-<date>-quick.md.
    #[arg(long)]
    pub quick: bool,
    /// Adds a case drafting with the MTP head, every expert resident, at the store's full depth
    /// and at half of it: each decode step drafts a token, verifies it with the sampled one, and
    /// keeps the draft at this rate (declared, spread evenly over the passes: the random weights'
    /// head never drafts the trunk's token). It times the drafting machinery at that acceptance,
    /// not a real head's acceptance; the report names the rate and the drafts kept, and
    /// extrapolates the two depths per layer to 48 layers as it does plain decoding.
    #[arg(long, value_name = "P", value_parser = acceptance)]
    pub draft_accept: Option<f64>,
    /// Where the disk lacks room for this depth's synthetic store, delete the benchmark's other
    /// synthetic stores (beside it in $CHERENKOV_HOME/bench, one per depth, experts and n-gram
    /// base; each is rewritten when a bench asks for it again), the oldest first, until the new one
    /// fits; each deletion is printed. Nothing is deleted where even all of them would not make
    /// room. Without it the bench stops and names them.
    #[arg(long)]
    pub make_room: bool,
}

fn acceptance(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(p) if (0.0..=1.0).contains(&p) => Ok(p),
        _ => Err(format!("an acceptance rate from 0 to 1, not {s:?}")),
    }
}

/// What one case runs: expert slots, the page cache dropped first, graphs, the deadline cut, the
/// lookahead, the expert file pinned, the layers a step runs, and the CPU expert team's threads.
#[derive(Clone, Copy)]
struct Spec {
    slots: usize,
    cold: bool,
    graphs: bool,
    cut: Option<f32>,
    lookahead: bool,
    pin: bool,
    depth: usize,
    cpu: Option<usize>,
    /// Read the MoE blocks' events after each step (their anatomy; costs host time between steps).
    anatomy: bool,
    /// Draft with the MTP head, keeping each draft with this declared probability.
    draft: Option<f64>,
}

/// What one case measured.
#[derive(Default)]
struct Case {
    name: String,
    /// Layers a step ran.
    depth: usize,
    slots: usize,
    tok_s: f64,
    hit_rate: f64,
    /// The pool's LRFU decay at the end of the case and adaptive LRFU's changes of it.
    decay: (Option<f64>, u64),
    lookahead: Option<f64>,
    bytes_per_token: f64,
    /// Of those, the bytes of prefetched records evicted before any step used them.
    wasted_per_token: f64,
    dense_ms: f64,
    experts_ms: f64,
    wait_ms: f64,
    /// Host time to queue a step's work (close to the step's time when the host sets the pace).
    queue_ms: f64,
    /// Experts the deadline cut dropped per token.
    cut_per_token: f64,
    /// Misses computed on the CPU per token, the host's wait for them (ms per token), and the
    /// rates the choice used at the end (copy, CPU; ns per expert).
    cpu_per_token: f64,
    cpu_wait_ms: f64,
    cpu_rates: Option<(u64, u64)>,
    /// Where the timed loads' time went.
    loads: cherenkov_cuda::slots::LoadSplit,
    /// Where the timed MoE blocks' GPU time went.
    anatomy: cherenkov_cuda::model::BlockAnatomy,
    /// The host's turns in steps replayed whole from one graph.
    flagged: cherenkov_cuda::model::FlaggedTurns,
    /// Share of a token's experts the previous token also used (same layer).
    share: Option<f64>,
    /// Routing steps from the prompt on; the first `warm_steps` (prompt and warm-up) only fill.
    trace: Vec<cherenkov_engine::policy::Step>,
    warm_steps: usize,
    /// The drafting case's passes and where their host time went.
    draft_split: DraftSplit,
    /// Plain decoding from one graph a step (every expert resident): the replays' timing, where
    /// every timed token's step was one.
    replay: Option<cherenkov_cuda::model::ReplayTiming>,
}

/// Host time of the drafting case's calls, summed over its passes (s): the draft, the verifying
/// forward of two rows, and the commit with the draft kept or not.
#[derive(Default)]
struct DraftSplit {
    draft: f64,
    verify: f64,
    commit_kept: f64,
    commit_dropped: f64,
    kept: usize,
    dropped: usize,
    /// Verifying forwards that ran as one pass over both rows (`verify_rows`).
    row_passes: u64,
}

impl DraftSplit {
    fn add(&mut self, t0: std::time::Instant, t1: std::time::Instant, t2: std::time::Instant, keep: usize) {
        self.draft += (t1 - t0).as_secs_f64();
        self.verify += (t2 - t1).as_secs_f64();
        let commit = t2.elapsed().as_secs_f64();
        if keep == 2 {
            self.commit_kept += commit;
            self.kept += 1;
        } else {
            self.commit_dropped += commit;
            self.dropped += 1;
        }
    }

    fn passes(&self) -> usize {
        self.kept + self.dropped
    }
}

/// The drafting case's keep decisions: drafts kept at the declared rate `p`, spread evenly over
/// the passes, so that after n passes floor(n p + 1/2) drafts are kept (n p rounded). Seeded random
/// draws (before session 55) kept 60 of 69 drafts at a declared 0.8, a run faster than its rate.
struct Keeps {
    p: f64,
    /// Passes so far.
    n: u64,
    /// Drafts kept so far.
    kept: u64,
}

impl Keeps {
    fn new(p: f64) -> Self {
        Keeps { p, n: 0, kept: 0 }
    }

    /// Whether the next pass keeps its draft.
    fn next(&mut self) -> bool {
        self.n += 1;
        let keep = (self.n as f64 * self.p + 0.5).floor() as u64 > self.kept;
        self.kept += u64::from(keep);
        keep
    }
}

/// The drafting case's flag as the report's command line gives it.
fn draft_flag(args: &BenchArgs) -> String {
    args.draft_accept.map_or(String::new(), |p| format!(" --draft-accept {p}"))
}

/// The drafting case against the plain resident case at the same depth.
fn drafting_report(k: &Case, plain: &Case) -> String {
    let s = &k.draft_split;
    let per = |sum: f64, n: usize| if n == 0 { "-".to_string() } else { format!("{:.3}", 1e3 * sum / n as f64) };
    let split = format!(
        "Per pass ({} passes, {} drafts kept, {} verifying forwards as one pass over both rows), ms of host time: the draft {}, the verifying forward of two rows {}, the commit {} with the draft kept and {} without; a plain step {:.3}.\n",
        s.passes(),
        s.kept,
        s.row_passes,
        per(s.draft, s.passes()),
        per(s.verify, s.passes()),
        per(s.commit_kept, s.kept),
        per(s.commit_dropped, s.dropped),
        1e3 / plain.tok_s
    );
    drafting_rate(&k.name, k.tok_s, k.depth, plain.tok_s) + &split
}

/// The drafting case at 48 layers, extrapolated per layer from its runs at two depths as the
/// resident cases' 48-layer figures are from theirs (its own part per token: the draft and the
/// commit's catch-up do not grow with the depth), against plain decoding's 48-layer rate and the
/// 48-layer roofline. Returns the rate and the report's sentence.
fn drafting_at_48(full: &Case, half: &Case, plain_48: f64, roofline_48: f64) -> (f64, String) {
    let (ms, half_ms) = (1e3 / full.tok_s, 1e3 / half.tok_s);
    let at_48 = tok_s_at_depth(48, per_token_part(ms, full.depth, half_ms, half.depth), ms, full.depth);
    let text = format!(
        "At 48 layers, by the per-layer extrapolation from its runs at {} and {} layers ({:.1} and {:.1} tok/s): {at_48:.1} tok/s against {plain_48:.1} without drafting ({:.2}x), {:.1}% of the HBM roofline ({roofline_48:.0} tok/s).\n",
        full.depth,
        half.depth,
        full.tok_s,
        half.tok_s,
        at_48 / plain_48,
        100.0 * at_48 / roofline_48
    );
    (at_48, text)
}

/// The drafting case's name at a declared acceptance `p` (the first words of its report).
fn drafting_case_name(p: f64) -> String {
    format!("all experts resident, drafting with the MTP head (acceptance {p} declared)")
}

/// The drafting report's first sentence: the drafting case's rate against plain decoding's.
/// `tools/gpu/ab.sh -d` reads the rate from it (the test below holds the two together).
fn drafting_rate(name: &str, tok_s: f64, depth: usize, plain_tok_s: f64) -> String {
    format!(
        "\n{name}: {tok_s:.1} tok/s at {depth} layers against {plain_tok_s:.1} without drafting ({:.2}x). The drafts are kept at the declared rate, spread evenly over the passes, not judged by the head (random weights never draft the trunk's token): this times the drafting machinery, a draft and a verifying forward of two rows a step, at that acceptance.\n",
        tok_s / plain_tok_s
    )
}

/// Today's date (UTC) as the results' file names carry it.
fn today() -> String {
    std::process::Command::new("date")
        .args(["-u", "+%Y-%m-%d"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// The host's turn between steps where each step is replayed from one graph: a token's time
/// against the device's span of its step, as a markdown paragraph (empty when no case has one).
fn host_turn_note(cases: &[Case]) -> String {
    let timed: Vec<String> = cases
        .iter()
        .filter_map(|k| {
            let r = k.replay?;
            let ms = |ns: u64| ns as f64 / 1e6 / r.steps as f64;
            let (token, gpu) = (1e3 / k.tok_s, ms(r.gpu_ns));
            Some(format!(
                "{} ({} layers): {token:.3} ms a token, {gpu:.3} ms of it the step's graph on the device, {:.3} ms ({:.1}%) the host's turn with the device idle, of which the host's clock gives {:.3} ms to the step's inputs before the replay, {:.3} to the replay call and {:.3} to the routing's accounting",
                k.name,
                k.depth,
                token - gpu,
                100.0 * (token - gpu) / token,
                ms(r.inputs_ns),
                ms(r.launch_ns),
                ms(r.account_ns)
            ))
        })
        .collect();
    if timed.is_empty() {
        return String::new();
    }
    format!(
        "\nThe host's turn between resident steps (each step replayed from one graph; the device's span from an event recorded before the replay to one after it, the graph's launch included; the turn reads the candidates, samples, writes the next step's inputs, n-gram rows and synthetic-router biases, and accounts the routing): {}.\n",
        timed.join("; ")
    )
}

/// The MoE blocks' anatomy of the cases whose steps were timed block by block (not replayed from a
/// graph), as a markdown section (empty when there are none).
fn anatomy_table(cases: &[Case]) -> String {
    let timed: Vec<&Case> = cases.iter().filter(|k| k.anatomy.blocks > 0).collect();
    if timed.is_empty() {
        return String::new();
    }
    let mut md = String::from(
        "\nWhere a MoE block's time goes on the GPU (CUDA events; mean ms per block, from the router's routing being ready; the copy columns over blocks whose misses were copied from the pinned file, the read experts over blocks with misses):\n\n| case | blocks (with misses) | router to router (one layer) | router to resident experts | resident experts | router to first copy | host: router seen to copies queued | copies (first start to last end) | last copy end to read experts' end | read experts |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    let per = |ns: u64, n: u64| if n == 0 { "-".to_string() } else { format!("{:.3}", ns as f64 / 1e6 / n as f64) };
    for k in timed {
        let a = &k.anatomy;
        md.push_str(&format!(
            "| {} | {} ({}) | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            k.name,
            a.blocks,
            a.blocks_missing,
            per(a.span_ns, a.spans),
            per(a.to_resident_ns, a.blocks),
            per(a.resident_ns, a.blocks),
            per(a.to_copy_ns, a.copies_timed),
            per(a.host_turn_ns, a.blocks_missing),
            per(a.copy_ns, a.copies_timed),
            per(a.copy_to_read_end_ns, a.copies_timed),
            per(a.read_ns, a.blocks_missing)
        ));
    }
    md.push_str("\nThe host's turn (mean ms per block, from the router-ready wait's return):\n\n| case | to the copies queued (blocks with misses) | of which in the pool's loads (their bookkeeping and the copies' driver calls) | to the resident experts' kernels queued (all blocks) |\n| --- | --- | --- | --- |\n");
    for k in cases.iter().filter(|k| k.anatomy.blocks > 0) {
        let a = &k.anatomy;
        md.push_str(&format!(
            "| {} | {} | {} | {} |\n",
            k.name,
            per(a.host_turn_ns, a.blocks_missing),
            per(a.host_loads_ns, a.blocks_missing),
            per(a.host_resident_ns, a.blocks)
        ));
    }
    md.push_str("\nThe host's turn step by step (mean ms per block from the router-ready wait's return until each point; the pool's batch over the blocks with misses):\n\n| case | pool's acquire called | its batch of loads begun | its first copy queued | lease returned | back parts queued | table written | stream's waits for resident copies queued | resident experts' kernels queued |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    for k in cases.iter().filter(|k| k.anatomy.blocks > 0) {
        let a = &k.anatomy;
        let (m, b) = (a.host_marks, a.host_batch_marks);
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            k.name,
            per(m[0], a.blocks),
            per(b[0], a.blocks_missing),
            per(b[1], a.blocks_missing),
            per(m[1], a.blocks),
            per(m[2], a.blocks),
            per(m[3], a.blocks),
            per(m[4], a.blocks),
            per(a.host_resident_ns, a.blocks)
        ));
    }
    md
}

/// The host's turns in the cases whose streamed steps were replayed whole from one graph, as a
/// markdown section (empty when there are none).
fn flagged_turn_table(cases: &[Case]) -> String {
    let flagged: Vec<&Case> = cases.iter().filter(|k| k.flagged.blocks > 0).collect();
    if flagged.is_empty() {
        return String::new();
    }
    let mut md = String::from(
        "
The host's turn in steps replayed whole from one graph (mean ms per block, the host's clock: its wait for the router's flag, then from the flag seen until each point; the next router waits for the turn flag):

| case | blocks | waiting for the router | lease returned (misses' copies queued) | the block's flags set or queued | lookahead's reads queued | turn flag set | ghosts replayed (turn's end) |
| --- | --- | --- | --- | --- | --- | --- | --- |
",
    );
    for k in flagged {
        let f = &k.flagged;
        let per = |ns: u64| format!("{:.3}", ns as f64 / 1e6 / f.blocks as f64);
        md.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |\n",
            k.name,
            f.blocks,
            per(f.router_wait_ns),
            per(f.marks[0]),
            per(f.marks[1]),
            per(f.marks[2]),
            per(f.marks[3]),
            per(f.marks[4])
        ));
    }
    md
}

/// Bytes of the dense weights a store of config `c` holds (packed as `prepare` would), and those a
/// decode step reads (everything but the embedding table, which is read one row at a time, and the
/// MTP head, which decoding without speculation never runs).
fn dense_bytes(c: &TextConfig, mtp: usize) -> (u64, u64) {
    let (mut all, mut read) = (0u64, 0u64);
    for s in arch::dense_specs(c, mtp).iter().filter(|s| !s.optional) {
        let (rows, cols) = (s.shape[..s.shape.len() - 1].iter().product::<usize>(), *s.shape.last().unwrap());
        let rule = if s.quantizable() { arch::bf16_pack_rule(s.role, s.in_features()) } else { None };
        let b = match rule {
            Some(f) => (rows * f.row_bytes(cols)) as u64,
            None => (rows * cols * if s.name.ends_with("A_log") { 4 } else { 2 }) as u64,
        };
        all += b;
        if s.name != "embed_tokens.weight" && !s.name.starts_with("mtp.") {
            read += b;
        }
    }
    (all, read)
}

/// Bytes of state a token reads and writes beyond the weights, for the roofline that counts them:
/// each GDN layer's recurrent state (value heads x key width x value width, f32), read and written
/// whole once a token. The smaller states are left out: the convolutions' histories (a GDN layer's
/// is 4% of its recurrent state) and attention's KV cache, which grows with the context.
fn state_bytes(c: &TextConfig) -> u64 {
    let recurrent = c.gdn_state_len() * 4;
    let gdn_layers = c.layer_types.iter().filter(|t| matches!(t, LayerType::LinearAttention)).count();
    2 * (gdn_layers * recurrent) as u64
}

/// The middle of `runs` by `rate` (the upper of the two middle ones for an even count), and every
/// run's rate in run order.
fn middle_run<T>(mut runs: Vec<T>, rate: impl Fn(&T) -> f64) -> (T, Vec<f64>) {
    assert!(!runs.is_empty(), "middle_run of no runs");
    let rates = runs.iter().map(&rate).collect();
    runs.sort_by(|a, b| rate(a).total_cmp(&rate(b)));
    let mid = runs.len() / 2;
    (runs.swap_remove(mid), rates)
}

/// The part of a step's time that does not grow with depth, from the same step timed at two depths
/// (`deep_ms` at `deep` layers, `shallow_ms` at `shallow`): the line through both points at zero
/// layers, never below zero (run-to-run noise could put it there).
fn per_token_part(deep_ms: f64, deep: usize, shallow_ms: f64, shallow: usize) -> f64 {
    let per_layer = (deep_ms - shallow_ms) / (deep as f64 - shallow as f64);
    (deep_ms - deep as f64 * per_layer).max(0.0)
}

/// The link rate the PCIe bounds use (bytes/s): the higher of a fresh pinned buffer's and (`file`,
/// 0 where no case pinned it) the pinned expert file's, so that one low reading of either cannot
/// make a share look better than the link allows.
fn link_rate(buffer: f64, file: f64) -> f64 {
    buffer.max(file)
}

/// The header's words on the link: the pinned host-to-device rates measured from a fresh pinned
/// buffer and (`file`, 0 where no case pinned it) from the pinned expert file, in bytes/s, and
/// which one the PCIe bounds use (the higher).
fn link_rates(buffer: f64, file: f64) -> String {
    if file > 0.0 {
        format!(
            "pinned host-to-device {:.1} GB/s from a pinned buffer and {:.1} from the pinned expert file (measured; the PCIe bounds use the higher)",
            buffer / 1e9,
            file / 1e9
        )
    } else {
        format!("pinned host-to-device {:.1} GB/s (measured)", buffer / 1e9)
    }
}

/// A streamed case's share of the bound PCIe sets (the bound in tok/s after it): the time to move
/// the bytes its steps used over the link at the measured pinned host-to-device rate
/// (`host_to_device`, bytes/s: the higher of a pinned buffer's and the pinned expert file's), or
/// the roofline (tok/s) where that is lower. Reads of prefetched
/// records evicted before any step used them are left out: wasted reads make the link busier
/// without serving a token.
fn pcie_share(k: &Case, roofline: f64, host_to_device: f64) -> (f64, f64) {
    pcie_share_at(k, k.depth, roofline, host_to_device, k.tok_s)
}

/// [`pcie_share`] at `target` layers, for the issue's targets at the released depth: the bytes a
/// step used grow with the layers (every expert byte belongs to one), the bound is the lower of
/// their link time and `roofline_at` (the HBM roofline at that depth), and the rate is the case's
/// own extrapolated to that depth (`tok_s_at`, [`tok_s_at_depth`]).
fn pcie_share_at(k: &Case, target: usize, roofline_at: f64, host_to_device: f64, tok_s_at: f64) -> (f64, f64) {
    let used = (k.bytes_per_token - k.wasted_per_token).max(0.0) * target as f64 / k.depth.max(1) as f64;
    let bound = 1.0 / (1.0 / roofline_at).max(used / host_to_device);
    (tok_s_at / bound, bound)
}

/// Tokens per second at `target` layers of a case that took `ms` per token at `depth` layers:
/// its time beyond the per-token part, per layer, times the target depth, plus the per-token part.
fn tok_s_at_depth(target: usize, per_token_ms: f64, ms: f64, depth: usize) -> f64 {
    let layer_ms = (ms - per_token_ms).max(0.0) / depth as f64;
    1e3 / (per_token_ms + target as f64 * layer_ms)
}

/// Checks that the file system of the benchmark's store `dir` has room for `bytes` more, before
/// the store is written; where it has not, the error names the benchmark's other stores beside
/// `dir` (one per depth, experts and n-gram base) and their sizes, since they are what a series
/// of benchmarks at several depths fills a disk with. With `make_room` it deletes them instead,
/// the oldest first, until the store fits (see `--make-room`).
fn check_room(dir: &Path, bytes: u64, make_room: bool) -> Result<()> {
    check_room_with(dir, bytes, make_room, cherenkov_hub::disk::space)
}

fn check_room_with(
    dir: &Path,
    bytes: u64,
    make_room: bool,
    space_of: impl Fn(&Path) -> Result<cherenkov_hub::disk::Space>,
) -> Result<()> {
    let parent = dir.parent().context("the benchmark's store has no parent directory")?;
    std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
    let need = crate::space::Need { what: "for the benchmark's synthetic store", dir: parent.to_path_buf(), bytes };
    let check = |hint: &str| crate::space::check_with(std::slice::from_ref(&need), &space_of, hint).map(|_| ());
    let mut others = other_stores(parent, dir);
    if make_room && check("").is_err() {
        let free = space_of(parent)?.free;
        let theirs: u64 = others.iter().map(|o| o.bytes).sum();
        if free.saturating_add(theirs) >= bytes {
            others.sort_by_key(|o| o.modified);
            while !others.is_empty() && check("").is_err() {
                let o = others.remove(0);
                let path = parent.join(&o.name);
                std::fs::remove_dir_all(&path).with_context(|| format!("cannot delete {}", path.display()))?;
                eprintln!(
                    "--make-room: deleted the benchmark's store {} ({})",
                    path.display(),
                    indicatif::HumanBytes(o.bytes)
                );
            }
            others.sort_by(|a, b| a.name.cmp(&b.name));
        }
    }
    let hint = if others.is_empty() {
        "Free some space, or point CHERENKOV_HOME at a larger disk".to_string()
    } else {
        let list: Vec<String> =
            others.iter().map(|o| format!("{} ({})", o.name, indicatif::HumanBytes(o.bytes))).collect();
        let how = if make_room {
            "deleting all of them would not make room either; point CHERENKOV_HOME at a larger disk"
        } else {
            "delete those not needed (--make-room deletes them, the oldest first), or point CHERENKOV_HOME at a larger disk"
        };
        format!("The benchmark's other stores in {}: {}; {how}", parent.display(), list.join(", "))
    };
    check(&hint)
}

/// One of the benchmark's stores beside the one a run asks for.
struct OtherStore {
    name: String,
    /// The bytes of its files.
    bytes: u64,
    /// When its directory last changed (written whole when synthesized).
    modified: std::time::SystemTime,
}

/// The benchmark's stores in `parent` other than `dir`, by name.
fn other_stores(parent: &Path, dir: &Path) -> Vec<OtherStore> {
    let Ok(entries) = std::fs::read_dir(parent) else { return Vec::new() };
    let mut out: Vec<OtherStore> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.path() != dir && e.path().is_dir())
        .map(|e| {
            let bytes = std::fs::read_dir(e.path())
                .map(|fs| fs.filter_map(|f| f.ok()?.metadata().ok()).map(|m| m.len()).sum())
                .unwrap_or(0);
            let modified = e.metadata().and_then(|m| m.modified()).unwrap_or(std::time::UNIX_EPOCH);
            OtherStore { name: e.file_name().to_string_lossy().into_owned(), bytes, modified }
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

fn drop_page_cache(path: &std::path::Path) -> Result<()> {
    let f = std::fs::File::open(path)?;
    // SAFETY: a valid descriptor; advice only.
    let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if r != 0 {
        bail!("posix_fadvise(DONTNEED) on {} failed ({r})", path.display());
    }
    Ok(())
}

pub fn run(args: &BenchArgs, out: &mut dyn Write) -> Result<()> {
    // A machine without a usable GPU is told so before the store (tens of GB) is written; the
    // probe's context is let go, so the peer below runs alone.
    let probe = cherenkov_cuda::gpu::probe().context("cherenkov bench measures on the GPU")?;
    let reg = Registry::open_default()?;
    let skew = Skew::parse(&args.synthetic_routing)?;
    let shape = SynthShape {
        num_hidden_layers: args.layers,
        num_experts: args.experts,
        ngram_vocab_size_base: args.ngram_base,
        ..SynthShape::flash()
    };
    let dir = reg.home().join("bench").join(format!("flash-{}L-{}E-{}", args.layers, args.experts, args.ngram_base));
    if !dir.join("manifest.json").exists() {
        let tmp = dir.with_extension("tmp");
        let _ = std::fs::remove_dir_all(&tmp);
        let opts = SynthOptions { seed: 1, ..SynthOptions::default() };
        check_room(&dir, store_bytes(&shape, &opts)?, args.make_room)?;
        eprintln!(
            "writing a synthetic store of the released shape ({} layers, {} experts) to {}",
            args.layers,
            args.experts,
            dir.display()
        );
        let bar = bytes_bar("synthesizing");
        write_store(&shape, &opts, &tmp, &bar)?;
        bar.finish_and_clear();
        std::fs::rename(&tmp, &dir)?;
    }
    let store = Arc::new(Store::open(&dir)?);
    let c = store.config().clone();

    // The peer first, before this process takes the GPU, pins the expert file or starts its
    // threads, so that nothing of ours runs beside it (in session 42 its 4-layer runs decoded
    // 43-47 tok/s after the cases and 68-71 alone, 32 tokens each).
    let peer = if args.no_peer {
        None
    } else {
        Some(peer::measure(args, &c, &store.dir.join("config.json"), probe.free_bytes as u64, out)?)
    };

    let gpu = Gpu::new()?;
    let bw = measure_bandwidth(&gpu, 2 << 30)?;
    writeln!(
        out,
        "GPU {}: device copy {:.0} GB/s, pinned host-to-device {:.1} GB/s",
        gpu.info.name,
        bw.device / 1e9,
        bw.host_to_device / 1e9
    )?;

    // The expert cache a 48-layer model would get from the budget, as a share of its experts.
    let full = ModelConfig::from_value(
        &SynthShape { ngram_vocab_size_base: args.ngram_base, ..SynthShape::flash() }.config_json(),
    )?
    .text;
    let record = store.record_bytes() as u64;
    let (dense_full, _) = dense_bytes(&full, 1);
    let reserve_full = 2 * session_bytes(&full, 8192) as u64 + (64 << 20);
    let budget = parse_size(&args.gpu_memory)?;
    let experts_full = (full.num_hidden_layers * full.num_experts) as u64 * record;
    let share = (budget.saturating_sub(dense_full + reserve_full)) as f64 / experts_full as f64;
    if share <= 0.0 {
        bail!(
            "--gpu-memory {} leaves no room for experts in the full model (dense {})",
            args.gpu_memory,
            format_bytes(dense_full)
        );
    }
    let trunk_records = c.num_hidden_layers * c.num_experts;
    let streamed_slots = ((share * trunk_records as f64) as usize).max(c.num_experts_per_tok);
    writeln!(
        out,
        "full model at {}: dense {}, sessions+scratch {}, experts {} -> expert cache {:.1}% of the experts; here {} of {} trunk records",
        args.gpu_memory,
        format_bytes(dense_full),
        format_bytes(reserve_full),
        format_bytes(experts_full),
        100.0 * share,
        streamed_slots,
        trunk_records
    )?;

    let tok = Tokenizer::from_dir(&store.dir)?;
    let prompt = prompt_tokens(&store.dir, &tok, None, "Explain hash collisions.", false)?;
    let experts_file = store.dir.join(&store.manifest.experts.file);
    // The link's rate for copies from the pinned expert file (bytes/s; 0 until a case pins it),
    // the pages the engine copies from. A fresh pinned buffer's reading moved by 2% between two
    // runs on one H200 host (53.6 and 54.8 GB/s), and one host read 52.5 while its pinned cases
    // ran as fast as on hosts that read 55.5 (benchmark/notes-cuda.md, "Session 34"). The PCIe
    // bounds take the higher of the two rates, so a low reading cannot flatter a share.
    let file_bw = std::cell::Cell::new(0.0f64);
    let link = || link_rate(bw.host_to_device, file_bw.get());
    let run_case = |name: &str, spec: Spec| -> Result<Case> {
        let Spec { slots, cold, graphs, cut, lookahead, pin, depth, cpu, anatomy, draft } = spec;
        if cold {
            drop_page_cache(&experts_file)?;
        }
        let mut memory = DeviceSlots::new(gpu.clone(), slots, store.record_bytes())?;
        // The copies are timed on the GPU where the blocks are (the anatomy reads their windows).
        memory.set_copy_timing(anatomy);
        if pin {
            let pinned = PinnedExperts::pin(gpu.clone(), &store, &|_| {})?;
            if file_bw.get() == 0.0 {
                file_bw.set(pinned.measure_copy(1 << 30)?);
            }
            memory.set_pinned(pinned);
        }
        let memory = Arc::new(memory);
        let pool = Arc::new(ExpertPool::new(store.clone(), memory.clone(), args.io_threads)?);
        let mut model = CudaModel::new(store.clone(), gpu.clone(), pool.clone())?;
        model.skew = Some(Arc::new(SkewedRouting::new(skew)));
        model.graphs = graphs;
        model.cut_weak = cut;
        model.lookahead = lookahead;
        model.depth = depth;
        model.anatomy = anatomy;
        // Two events around each resident step's replay: what the device spends of a token.
        model.replay_timing = draft.is_none();
        if let Some(threads) = cpu {
            model.set_cpu_experts(threads, &|_| {})?;
        }
        let mut s = model.new_session()?;
        if draft.is_some() {
            model.enable_drafting(&mut s)?;
        }
        // The trace starts with the prompt, so the policy replays fill their caches as the pool
        // filled its own; only the timed steps are counted.
        pool.record_trace(true);
        // Sampled (temperature 1, top-k 40), not greedy: a random model's argmax repeats itself.
        // The 40 candidates are chosen on the device, as `run` and `serve` do for such settings.
        let mut sampler =
            Sampler::new(SamplingParams { temperature: 1.0, top_k: 40, seed: Some(7), ..SamplingParams::default() });
        let k = sampler.candidates_needed().context("top-k sampling samples from candidates")?;
        let among = tok.vocab_size().min(c.vocab_size);
        let mut cands = model.forward_candidates(&mut s, &prompt, k, among)?;
        for _ in 0..args.warmup {
            let t = sampler.sample_candidates(&cands)?;
            cands = model.forward_candidates(&mut s, &[t], k, among)?;
        }
        pool.reset_stats();
        memory.reset_load_split();
        let warm_trace = pool.take_trace();
        model.reset_timing();
        let t0 = std::time::Instant::now();
        let mut produced = 0;
        let mut keeps = draft.map(Keeps::new);
        let mut split = DraftSplit::default();
        let row_passes = model.rows_run();
        while produced < args.tokens {
            let t = sampler.sample_candidates(&cands)?;
            let Some(keeps) = &mut keeps else {
                cands = model.forward_candidates(&mut s, &[t], k, among)?;
                produced += 1;
                continue;
            };
            // Draft, verify both rows, keep the draft at the declared rate; the kept row gives the
            // next candidates (every choice on the device, as `run` and `serve` make it).
            let t0 = std::time::Instant::now();
            let d = model.draft_candidates(&mut s, t, 1, among)?[0].0;
            let t1 = std::time::Instant::now();
            let mut rows = model.verify_candidates(&mut s, &[t, d], k, among)?;
            let t2 = std::time::Instant::now();
            let keep = if keeps.next() { 2 } else { 1 };
            model.commit(&mut s, keep)?;
            split.add(t0, t1, t2, keep);
            cands = rows.swap_remove(keep - 1);
            produced += keep;
        }
        let secs = t0.elapsed().as_secs_f64();
        split.row_passes = model.rows_run() - row_passes;
        // Copies still running in the background (prefetches no step read) are timed too.
        memory.sync_copies()?;
        let st = pool.stats();
        let tm = model.timing();
        let n = produced as f64;
        Ok(Case {
            name: name.to_string(),
            depth,
            slots,
            tok_s: n / secs,
            hit_rate: st.hit_rate().unwrap_or(0.0),
            decay: pool.decay(),
            lookahead: st.total.lookahead_accuracy(),
            bytes_per_token: st.total.bytes_read as f64 / n,
            wasted_per_token: (st.total.prefetch_unused * record) as f64 / n,
            dense_ms: tm.dense_ns() as f64 / 1e6 / n,
            experts_ms: tm.experts_ns as f64 / 1e6 / n,
            wait_ms: tm.wait_ns as f64 / 1e6 / n,
            queue_ms: tm.queue_ns as f64 / 1e6 / n,
            cut_per_token: tm.cut as f64 / n,
            cpu_per_token: tm.cpu_experts as f64 / n,
            cpu_wait_ms: tm.cpu_wait_ns as f64 / 1e6 / n,
            cpu_rates: model.cpu_expert_rates(),
            loads: memory.load_split(),
            anatomy: tm.anatomy,
            flagged: tm.flagged,
            share: model.skew.as_ref().and_then(|k| k.consecutive_share()),
            warm_steps: warm_trace.len(),
            trace: warm_trace.into_iter().chain(pool.take_trace()).collect(),
            draft_split: split,
            replay: (tm.replay.steps > 0 && tm.replay.steps == produced as u64).then_some(tm.replay),
        })
    };
    let all = store.manifest.experts.records() as usize;
    let layers = c.num_hidden_layers;
    let resident = Spec {
        slots: all,
        cold: false,
        graphs: true,
        cut: None,
        lookahead: true,
        pin: false,
        depth: layers,
        cpu: None,
        // The quick bench times its blocks (the anatomy's events), unless
        // `CHERENKOV_BENCH_NO_ANATOMY` (a measurement knob): then its cases run as the full
        // bench's do, with the kernels' clock stamps alone.
        anatomy: args.quick && std::env::var_os("CHERENKOV_BENCH_NO_ANATOMY").is_none(),
        draft: None,
    };
    // The drafting case: resident, its steps' timing kept out of the anatomy; at the full depth,
    // then at half of it for its own 48-layer extrapolation (the second is None at one layer).
    let drafting = |p: f64| -> Result<(Case, Option<Case>)> {
        let spec = Spec { draft: Some(p), anatomy: false, ..resident };
        let full = run_case(&drafting_case_name(p), spec)?;
        let half = (layers >= 2)
            .then(|| {
                let name = format!("{}, first {} layers only", drafting_case_name(p), layers / 2);
                run_case(&name, Spec { depth: layers / 2, ..spec })
            })
            .transpose()?;
        Ok((full, half))
    };
    let pinned = Spec { slots: streamed_slots, pin: true, ..resident };
    let g = &args.gpu_memory;
    // Roofline.
    let (_, dense_read) = dense_bytes(&c, store.manifest.mtp_layers);
    let resident_bytes = dense_read as f64 + (c.num_hidden_layers * c.num_experts_per_tok) as f64 * record as f64;
    let roofline = bw.device / resident_bytes;
    let pcie = |k: &Case| pcie_share(k, roofline, link());
    // The same at the released depth (the 48-layer figures' bounds).
    let (_, dense_read_full) = dense_bytes(&full, 1);
    let roofline_full = bw.device
        / (dense_read_full as f64 + (full.num_hidden_layers * full.num_experts_per_tok) as f64 * record as f64);
    // The stricter bound, the weights and the states a token reads and writes (the report's
    // targets stay against the weights alone).
    let (states, states_full) = (state_bytes(&c), state_bytes(&full));
    let with_states = |roofline: f64, states: u64| 1.0 / (1.0 / roofline + states as f64 / bw.device);
    let (roofline_states, roofline_states_full) =
        (with_states(roofline, states), with_states(roofline_full, states_full));
    // Cases: 0 resident, 1 resident without graphs, 2 streamed from the pinned page cache, 3 cold
    // (read by the CPU from the disk), 4 pinned with the deadline cut, 5 pinned without the
    // lookahead (what its reads gain), 6 warm but read by the CPU (what pinning gains), 7 resident
    // at half the depth (the per-layer extrapolation's second point), then pinned with some misses
    // computed on the CPU.
    if args.quick {
        // `CHERENKOV_BENCH_RESIDENT_ONLY` (a measurement knob for kernel work, as
        // `CHERENKOV_TWICE`): only the resident case at both depths, which no streaming case
        // changes.
        // `CHERENKOV_BENCH_PINNED_ONLY` (a knob for A/B runs of the streaming path): only the
        // pinned streamed case, without the 48-layer extrapolation.
        let resident_only = std::env::var_os("CHERENKOV_BENCH_RESIDENT_ONLY").is_some();
        let pinned_only = std::env::var_os("CHERENKOV_BENCH_PINNED_ONLY").is_some();
        let mut cases = Vec::new();
        if !pinned_only {
            cases.push(run_case("all experts resident", resident)?);
        }
        if !resident_only && !pinned_only {
            cases.push(run_case("all experts resident, no CUDA graphs", Spec { graphs: false, ..resident })?);
        }
        if !resident_only {
            cases.push(run_case(&format!("{g} budget, page cache warm, expert file pinned"), pinned)?);
        }
        if !resident_only && !pinned_only {
            cases.push(run_case(&format!("{g} budget, pinned, no lookahead"), Spec { lookahead: false, ..pinned })?);
        }
        let per_token_ms = if pinned_only {
            None
        } else {
            cases.push(run_case(
                &format!("all experts resident, first {} layers only", layers / 2),
                Spec { depth: (layers / 2).max(1), ..resident },
            )?);
            let half = &cases[cases.len() - 1];
            Some(per_token_part(1e3 / cases[0].tok_s, layers, 1e3 / half.tok_s, half.depth))
        };
        let mut md = format!(
            "# Decode benchmark (quick), {}\n\nCommand: `cherenkov bench --quick --layers {} --tokens {} --gpu-memory {} --synthetic-routing {}{}`  \nGPU: {}; device copy {:.0} GB/s, {}.\n\n",
            today(),
            args.layers,
            args.tokens,
            args.gpu_memory,
            args.synthetic_routing,
            draft_flag(args),
            gpu.info.name,
            bw.device / 1e9,
            link_rates(bw.host_to_device, file_bw.get())
        );
        md.push_str("| case | tok/s | 48-layer tok/s | hit rate | lookahead accuracy | read per token (unused prefetches) | dense ms/tok | experts ms/tok | waiting ms/tok | vs PCIe bound |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
        for k in &cases {
            md.push_str(&format!(
                "| {} | {:.1} | {} | {:.1}% | {} | {} ({}) | {:.2} | {:.2} | {:.2} | {} |\n",
                k.name,
                k.tok_s,
                per_token_ms.map_or("-".into(), |p| format!("{:.1}", tok_s_at_depth(48, p, 1e3 / k.tok_s, k.depth))),
                100.0 * k.hit_rate,
                k.lookahead.map_or("-".to_string(), |a| format!("{:.1}%", 100.0 * a)),
                format_bytes(k.bytes_per_token as u64),
                format_bytes(k.wasted_per_token as u64),
                k.dense_ms,
                k.experts_ms,
                k.wait_ms,
                if k.slots < all { format!("{:.1}% ({:.0} tok/s)", 100.0 * pcie(k).0, pcie(k).1) } else { "-".into() }
            ));
        }
        if let Some(p) = per_token_ms {
            md.push_str(&format!("\nPer-token part {p:.3} ms.\n"));
        }
        if let (Some(p), Some(plain)) = (args.draft_accept, cases.first().filter(|_| !pinned_only)) {
            let (k, half) = drafting(p)?;
            md.push_str(&drafting_report(&k, plain));
            if let (Some(half), Some(per_token)) = (&half, per_token_ms) {
                let plain_48 = tok_s_at_depth(48, per_token, 1e3 / plain.tok_s, plain.depth);
                md.push_str(&drafting_at_48(&k, half, plain_48, roofline_full).1);
            }
        }
        md.push_str(&host_turn_note(&cases));
        md.push_str(&anatomy_table(&cases));
        md.push_str(&flagged_turn_table(&cases));
        std::fs::create_dir_all(&args.out)?;
        let path = args.out.join(format!("bench-{}-quick.md", today()));
        std::fs::write(&path, &md)?;
        writeln!(out, "{md}")?;
        writeln!(out, "wrote {}", path.display())?;
        return Ok(());
    }
    // The resident case at both depths, alternated, `--repeats` times: the middle run of each
    // depth stands for it (and fits the extrapolation below).
    let half_name = format!("all experts resident, first {} layers only", layers / 2);
    let mut full_runs = Vec::new();
    let mut half_runs = Vec::new();
    for _ in 0..args.repeats {
        full_runs.push(run_case("all experts resident", resident)?);
        if layers >= 2 {
            half_runs.push(run_case(&half_name, Spec { depth: layers / 2, ..resident })?);
        }
    }
    let (full_mid, full_rates) = middle_run(full_runs, |k| k.tok_s);
    let half_mid = (!half_runs.is_empty()).then(|| middle_run(half_runs, |k| k.tok_s));
    let half_rates = half_mid.as_ref().map(|(_, r)| r.clone()).unwrap_or_default();
    let mut cases = vec![
        full_mid,
        // Its blocks' anatomy is the reference for the streamed one's (below); resident blocks
        // read few events.
        run_case("all experts resident, no CUDA graphs", Spec { graphs: false, anatomy: true, ..resident })?,
        run_case(&format!("{g} budget, page cache warm, expert file pinned"), pinned)?,
        run_case(&format!("{g} budget, page cache cold (read by the CPU)"), Spec { cold: true, pin: false, ..pinned })?,
        run_case(
            &format!("{g} budget, pinned, --cut-weak {}", args.cut_weak),
            Spec { cut: Some(args.cut_weak), ..pinned },
        )?,
        run_case(&format!("{g} budget, pinned, no lookahead"), Spec { lookahead: false, ..pinned })?,
        run_case(&format!("{g} budget, page cache warm, read by the CPU (not pinned)"), Spec { pin: false, ..pinned })?,
    ];
    if let Some((half, _)) = half_mid {
        cases.push(half);
    }
    let cpu_threads = crate::load::cpu_expert_threads(&args.cpu_experts)?;
    cases.push(run_case(
        &format!("{g} budget, pinned, --cpu-experts {cpu_threads}"),
        Spec { cpu: Some(cpu_threads), ..pinned },
    )?);
    cases.push(run_case(
        &format!("{g} budget, read by the CPU (not pinned), --cpu-experts {cpu_threads}"),
        Spec { cpu: Some(cpu_threads), pin: false, ..pinned },
    )?);
    // The pinned case again with its blocks' anatomy (the event reads between steps would slow
    // the cases above).
    cases.push(run_case(&format!("{g} budget, pinned, blocks timed"), Spec { anatomy: true, ..pinned })?);

    // 48-layer figures. A step's time is a part per token (embedding, the final mixer, lm_head,
    // picking candidates, the host's turn) plus a part per layer; the resident case at two depths
    // gives both, and each case's own per-layer time is what it spends beyond the part per token.
    // Without the second depth (or if noise makes the part per token negative) every millisecond
    // counts as per-layer, which understates the 48-layer speed.
    let ms = |k: &Case| 1e3 / k.tok_s;
    let half_depth = cases.iter().find(|k| k.depth != layers);
    let per_token_ms = half_depth.map_or(0.0, |half| per_token_part(ms(&cases[0]), layers, ms(half), half.depth));
    let per_layer = |k: &Case| tok_s_at_depth(48, per_token_ms, ms(k), k.depth);
    // Each case's share of its bound at 48 layers: the HBM roofline (every expert resident), the
    // PCIe bound (streamed), from its extrapolated rate.
    let share_48 = |i: usize, k: &Case| -> (f64, f64) {
        if i < 2 {
            (per_layer(k) / roofline_full, roofline_full)
        } else {
            pcie_share_at(k, 48, roofline_full, link(), per_layer(k))
        }
    };

    // The policy study on the warm streamed run's trace.
    // Cases: 0 resident, 1 resident without graphs, 2 streamed warm, 3 streamed cold, 4 streamed
    // warm with the deadline cut, 5 streamed warm without the lookahead (what its reads gain).
    let trace = &cases[2].trace;
    let mut policies = Vec::new();
    for p in [
        Policy::Lru,
        Policy::Lrfu { lambda: 0.1 },
        Policy::Lrfu { lambda: 0.03 },
        Policy::Lrfu { lambda: 0.01 },
        Policy::Adaptive,
        Policy::Belady,
    ] {
        policies.push((p.label(), simulate_from(trace, cases[2].warm_steps, streamed_slots, p).hit_rate()));
    }
    let belady = policies.last().map(|p| p.1).unwrap_or(1.0);

    // Report.
    let date = today();
    let mut md = String::new();
    md.push_str(&format!("# Decode benchmark, {date}\n\n"));
    md.push_str(&format!(
        "Command: `cherenkov bench --layers {} --experts {} --tokens {} --gpu-memory {} --synthetic-routing {}{}`  \n",
        args.layers,
        args.experts,
        args.tokens,
        args.gpu_memory,
        args.synthetic_routing,
        draft_flag(args)
    ));
    md.push_str(&format!(
        "GPU: {}; device copy {:.0} GB/s, {}.  \n",
        gpu.info.name,
        bw.device / 1e9,
        link_rates(bw.host_to_device, file_bw.get())
    ));
    md.push_str(&format!(
        "Model: synthetic, released shape (hidden 2560, {} experts top-10 of width 640, 4 streams, QSA, PLE) at {} layers, random weights, routers skewed with {} (consecutive-token expert share measured below).  \n",
        c.num_experts, c.num_hidden_layers, skew.label()
    ));
    md.push_str(&format!(
        "Decoding: {} timed tokens after {} warm-up ones, sampled at temperature 1 from the top 40 (chosen on the GPU).  \n",
        args.tokens, args.warmup
    ));
    md.push_str(&format!(
        "Resident bytes per token: {} (dense read {} + {} experts of {}); roofline at the measured device bandwidth: {:.0} tok/s.\n\n",
        format_bytes(resident_bytes as u64),
        format_bytes(dense_read),
        c.num_hidden_layers * c.num_experts_per_tok,
        format_bytes(record),
        roofline
    ));
    md.push_str(&format!(
        "Each token also reads and writes {} of state at this depth, {} at 48 layers (the GDN layers' recurrent states, f32, read and written whole; the convolutions' histories and attention's KV cache, far smaller, are not counted). With those bytes the bound is {:.0} tok/s here and {:.0} at 48 layers, and the resident case is {:.1}% and {:.1}% of it. The ratios below are against the weights alone, as the targets are stated.\n\n",
        format_bytes(states),
        format_bytes(states_full),
        roofline_states,
        roofline_states_full,
        100.0 * cases[0].tok_s / roofline_states,
        100.0 * per_layer(&cases[0]) / roofline_states_full
    ));
    md.push_str("| case | expert slots | tok/s | 48-layer tok/s (per-layer extrapolation) | hit rate | lookahead accuracy | read per token (unused prefetches) | dense ms/tok | experts ms/tok | waiting ms/tok | host queueing ms/tok | vs roofline / PCIe bound |\n");
    md.push_str("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    for (i, k) in cases.iter().enumerate() {
        let ratio = if k.depth != layers {
            "(the extrapolation's second depth)".to_string()
        } else if i < 2 {
            let (share48, bound48) = share_48(i, k);
            format!(
                "{:.1}% of HBM roofline; at 48 layers {:.1}% ({:.0} tok/s)",
                100.0 * k.tok_s / roofline,
                100.0 * share48,
                bound48
            )
        } else {
            let (share, bound) = pcie(k);
            let (share48, bound48) = share_48(i, k);
            format!(
                "{:.1}% of the PCIe bound ({:.0} tok/s); at 48 layers {:.1}% ({:.0} tok/s)",
                100.0 * share,
                bound,
                100.0 * share48,
                bound48
            )
        };
        md.push_str(&format!(
            "| {} | {} | {:.1} | {:.1} | {:.1}% | {} | {} ({}) | {:.2} | {:.2} | {:.2} | {:.2} | {} |\n",
            k.name,
            k.slots,
            k.tok_s,
            per_layer(k),
            100.0 * k.hit_rate,
            k.lookahead.map_or("-".to_string(), |a| format!("{:.1}%", 100.0 * a)),
            format_bytes(k.bytes_per_token as u64),
            format_bytes(k.wasted_per_token as u64),
            k.dense_ms,
            k.experts_ms,
            k.wait_ms,
            k.queue_ms,
            ratio
        ));
    }
    md.push_str(&format!(
        "\n48-layer figures: {}. The shares at 48 layers set those rates against the 48-layer model's bounds: its HBM roofline ({:.0} tok/s at the measured device bandwidth) and, for the streamed cases, the link time of the bytes their steps used per layer, times 48. The pinned cases pin this model's {} expert file; `--pin-experts auto` pins an expert file that fits in the available memory with a quarter of the host's memory to spare, and on this host it {} the 48-layer model's {}.\n",
        match half_depth {
            Some(half) => format!(
                "a step is {:.3} ms per token (embedding, final mixer, lm_head, candidates, the host) plus each case's time per layer beyond that; the resident case gives {:.3} ms per layer from its {} and {} layer runs ({:.3} and {:.3} ms per token)",
                per_token_ms,
                (ms(&cases[0]) - per_token_ms) / layers as f64,
                layers,
                half.depth,
                ms(&cases[0]),
                ms(half)
            ),
            None => "the whole step time counts as per layer (one layer: no second depth to split it)".to_string(),
        },
        roofline_full,
        format_bytes(all as u64 * record),
        if crate::load::auto_pins(experts_full) { "would pin" } else { "would not pin" },
        format_bytes(experts_full)
    ));
    let list = |r: &[f64]| r.iter().map(|v| format!("{v:.1}")).collect::<Vec<_>>().join(", ");
    md.push_str(&format!(
        "The resident rows are each depth's middle run of {} (tok/s in run order, the depths alternated: {} layers {}{}).\n",
        args.repeats,
        layers,
        list(&full_rates),
        if half_rates.is_empty() { String::new() } else { format!("; {} layers {}", layers / 2, list(&half_rates)) }
    ));
    md.push_str(
        "Waiting is the host's wait for reads; in the pinned cases the host does not wait for copies, and it is the GPU's, from the resident experts' end to the read experts' start (CUDA events; in a step replayed whole from one graph, the read experts' clock stamps around their wait for the copies' flag).\n",
    );
    md.push_str(&format!(
        "\nCache policies replayed on the warm streamed run's routing trace ({} timed steps, {} slots; each replay starts empty and first replays the {} steps of the prompt and warm-up tokens, uncounted, as the pool did):\n\n",
        trace.len() - cases[2].warm_steps,
        streamed_slots,
        cases[2].warm_steps
    ));
    md.push_str("| policy | hit rate | of Belady's |\n| --- | --- | --- |\n");
    for (name, h) in &policies {
        md.push_str(&format!("| {name} | {:.1}% | {:.1}% |\n", 100.0 * h, 100.0 * h / belady.max(1e-9)));
    }
    md.push_str(&format!(
        "\nThe pool itself ({}{} with lookahead prefetch) hit {:.1}% in that run ({:.1}% of Belady's), {:.1}% without the lookahead. Consecutive tokens shared {} of their experts per layer.\n",
        cherenkov_engine::residency::Eviction::DEFAULT.label(),
        match cases[2].decay {
            (Some(l), n) if cherenkov_engine::residency::Eviction::DEFAULT == cherenkov_engine::residency::Eviction::Adaptive => {
                format!(", ranking by lambda {l} at the end after {n} change(s) of decay,")
            }
            _ => String::new(),
        },
        100.0 * cases[2].hit_rate,
        100.0 * cases[2].hit_rate / belady.max(1e-9),
        100.0 * cases[5].hit_rate,
        cases[2].share.map_or("-".to_string(), |s| format!("{:.1}%", 100.0 * s))
    ));
    md.push_str("\nExpert loads in the timed part (how many were copied straight from the pinned expert file; mean per load: reading the record's pieces in parallel into pinned memory, none for a pinned file; the driver call queueing the copy; the checksum, while the copy to the GPU runs; then waiting for the copy; and the copy itself, timed by GPU events on its stream: for a copy in two parts, from its front's start to its back's end, other copies between; copies from the pinned file are timed only in the cases that time their blocks, since the timing events cost the link time):\n\n| case | loads | from the pinned file | read ms | queue copy ms | checksum ms | copy wait ms | copy on the GPU ms |\n| --- | --- | --- | --- | --- | --- | --- | --- |\n");
    for k in cases.iter().filter(|k| k.loads.loads > 0) {
        let per = |ns: u64| ns as f64 / 1e6 / k.loads.loads as f64;
        md.push_str(&format!(
            "| {} | {} | {} | {:.3} | {:.3} | {:.3} | {:.3} | {} |\n",
            k.name,
            k.loads.loads,
            k.loads.direct,
            per(k.loads.read_ns),
            per(k.loads.queue_ns),
            per(k.loads.verify_ns),
            per(k.loads.copy_wait_ns),
            if k.loads.copies_timed == 0 {
                "-".to_string()
            } else {
                format!("{:.3}", k.loads.copy_gpu_ns as f64 / 1e6 / k.loads.copies_timed as f64)
            }
        ));
    }
    md.push_str(&format!(
        "\nThe deadline cut (`--cut-weak {}`: read experts of routing weight below that, still being read when the resident experts are done, are dropped) dropped {:.2} experts per token; its output depends on read timing and is not reproducible.\n",
        args.cut_weak, cases[4].cut_per_token
    ));
    md.push_str(&format!(
        "\nExperts computed on the CPU (`--cpu-experts {cpu_threads}`, 4-bit rows by {}: per block, as many of the misses of lowest routing weight as end the block soonest at the measured rates; not reproducible):\n\n| case | computed on the CPU per token | host wait for them ms/tok | an expert on the CPU (median of the last jobs) | a lone miss's load (measured at start) |\n| --- | --- | --- | --- | --- |\n",
        cherenkov_cpu::q4::kernel_name()
    ));
    for k in cases.iter().filter(|k| k.cpu_rates.is_some()) {
        let r = k.cpu_rates.expect("filtered");
        md.push_str(&format!(
            "| {} | {:.2} | {:.3} | {:.3} ms | {:.3} ms |\n",
            k.name,
            k.cpu_per_token,
            k.cpu_wait_ms,
            r.1 as f64 / 1e6,
            r.0 as f64 / 1e6
        ));
    }
    md.push_str(&host_turn_note(&cases));
    md.push_str(&anatomy_table(&cases));
    md.push_str(&flagged_turn_table(&cases));
    // The peer's rates, its 48-layer extrapolation, and Cherenkov's resident rate against it.
    let peer = peer.as_ref().and_then(|p| p.report(per_layer(&cases[0]), cases[0].depth, cases[0].tok_s));
    if let Some((text, _)) = &peer {
        md.push_str(text);
    }
    let peer = peer.map(|(_, v)| v);
    let drafted = match args.draft_accept {
        Some(p) => {
            let (k, half) = drafting(p)?;
            md.push_str(&drafting_report(&k, &cases[0]));
            let at_48 = half.as_ref().map(|half| drafting_at_48(&k, half, per_layer(&cases[0]), roofline_full));
            if let Some((_, text)) = &at_48 {
                md.push_str(text);
            }
            Some(json!({"acceptance_declared": p, "tok_s": k.tok_s, "plain_tok_s": cases[0].tok_s, "depth": k.depth,
                        "half_depth_tok_s": half.as_ref().map(|h| h.tok_s), "tok_s_48_layers": at_48.map(|a| a.0)}))
        }
        None => None,
    };
    std::fs::create_dir_all(&args.out)?;
    let stem = args.out.join(format!("bench-{date}"));
    std::fs::write(stem.with_extension("md"), &md)?;
    let cases_json: Vec<_> = cases
        .iter()
        .enumerate()
        .map(|(i, k)| json!({"case": k.name, "slots": k.slots, "depth": k.depth, "tok_s": k.tok_s, "tok_s_48_layers": per_layer(k),
                        "share_of_bound_48_layers": share_48(i, k).0, "bound_48_layers_tok_s": share_48(i, k).1, "loads": k.loads.loads, "loads_from_pinned_file": k.loads.direct, "hit_rate": k.hit_rate, "decay_lambda": k.decay.0, "decay_changes": k.decay.1, "lookahead_accuracy": k.lookahead,
                        "bytes_per_token": k.bytes_per_token, "unused_prefetch_bytes_per_token": k.wasted_per_token, "dense_ms": k.dense_ms, "experts_ms": k.experts_ms, "wait_ms": k.wait_ms, "queue_ms": k.queue_ms, "cut_per_token": k.cut_per_token,
                        "cpu_experts_per_token": k.cpu_per_token, "cpu_wait_ms": k.cpu_wait_ms, "cpu_expert_ns": k.cpu_rates.map(|r| r.1), "lone_copy_ns": k.cpu_rates.map(|r| r.0)}))
        .collect();
    let j = json!({"date": date, "gpu": gpu.info.name, "device_bw": bw.device, "h2d_bw": bw.host_to_device, "h2d_bw_expert_file": file_bw.get(), "h2d_bw_bound": link(), "layers": c.num_hidden_layers,
                   "experts": c.num_experts, "skew": skew, "roofline_tok_s": roofline, "roofline_48_layers_tok_s": roofline_full, "state_bytes_per_token": states, "state_bytes_per_token_48_layers": states_full, "roofline_with_states_tok_s": roofline_states, "roofline_with_states_48_layers_tok_s": roofline_states_full, "per_token_ms": per_token_ms, "cases": cases_json,
                   "resident_runs_tok_s": {"layers": layers, "full": full_rates, "half": half_rates},
                   "policies": policies.iter().map(|(n, h)| json!({"policy": n, "hit_rate": h})).collect::<Vec<_>>(), "policy_uncounted_steps": cases[2].warm_steps, "peer": peer, "drafting": drafted,
                   "cpu_expert_kernel": cherenkov_cpu::q4::kernel_name()});
    std::fs::write(stem.with_extension("json"), serde_json::to_vec_pretty(&j)?)?;
    writeln!(out, "{md}")?;
    writeln!(out, "wrote {} and .json", stem.with_extension("md").display())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `tools/gpu/ab.sh -d` against a stand-in binary whose report has the real drafting sentence
    /// (`drafting_rate`) and the rates table's row: the rates it prints are the report's. (Its
    /// first version looked for a table row the report does not have and stopped silently.)
    #[test]
    fn ab_sh_reads_the_drafting_reports_rates() {
        let dir = tempfile::tempdir().unwrap();
        let report = format!(
            "| case | tok/s |\n| --- | --- |\n| all experts resident | 1300.0 | 280.0 |\n{}Per pass (9 passes, 7 drafts kept, 9 verifying forwards as one pass over both rows), ms of host time: the draft 0.270, the verifying forward of two rows 1.250, the commit 0.150 with the draft kept and 0.040 without; a plain step 0.769.\n",
            drafting_rate(&drafting_case_name(0.8), 1100.0, 8, 1300.0)
        );
        std::fs::write(dir.path().join("report.md"), &report).unwrap();
        // The stand-in: writes the report where `bench --out DIR` would, and prints it.
        let bin = dir.path().join("cherenkov");
        std::fs::write(
            &bin,
            format!(
                "#!/usr/bin/env bash\nwhile [ $# -gt 0 ]; do [ \"$1\" = --out ] && out=$2; shift; done\nmkdir -p \"$out\"\ncp {r} \"$out/bench-2026-01-01-quick.md\"\ncat {r}\n",
                r = dir.path().join("report.md").display()
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
        let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/gpu/ab.sh");
        let out = std::process::Command::new("bash")
            .arg(&script)
            .args(["-l", "8", "-d", "0.8", "-r", "2", "new", "old:X=1"])
            .env("BIN", &bin)
            .env("OUT", dir.path().join("ab"))
            .env("CHERENKOV_HOME", dir.path().join("home"))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
        let runs = text.matches("drafting 1100.0 tok/s, plain 1300.0, the pass 1.250 ms (P = 0.8, 8 layers)").count();
        assert_eq!(runs, 4, "{text}");
        assert!(text.contains("new          drafting mean 1100.0 over 2"), "{text}");
        assert!(text.contains("old          plain mean 1300.0 over 2"), "{text}");
    }

    /// The released shape (MODEL.md): 48 layers, every 4th attention, so 36 GDN layers, each with
    /// 48 value heads of a 128 x 128 f32 state, read and written once a token.
    #[test]
    fn the_state_bytes_are_the_gdn_layers_recurrent_states_both_ways() {
        let flash = ModelConfig::from_value(&SynthShape::flash().config_json()).unwrap().text;
        assert_eq!(state_bytes(&flash), 36 * 48 * 128 * 128 * 4 * 2);
        // Half the depth: 24 layers, 18 of them GDN.
        let half = ModelConfig::from_value(&SynthShape { num_hidden_layers: 24, ..SynthShape::flash() }.config_json())
            .unwrap()
            .text;
        assert_eq!(state_bytes(&half), 18 * 48 * 128 * 128 * 4 * 2);
    }

    #[test]
    fn the_per_layer_extrapolation_recovers_a_linear_step() {
        // 0.3 ms per token plus 0.17 ms per layer.
        let step = |layers: usize| 0.3 + 0.17 * layers as f64;
        let fixed = per_token_part(step(16), 16, step(8), 8);
        assert!((fixed - 0.3).abs() < 1e-9, "{fixed}");
        let at48 = tok_s_at_depth(48, fixed, step(4), 4);
        assert!((at48 - 1e3 / step(48)).abs() < 1e-6, "{at48}");
        // A streamed case at 4 layers, 0.1 ms per layer slower: its own per-layer time counts.
        let streamed = tok_s_at_depth(48, fixed, step(4) + 0.4, 4);
        assert!((streamed - 1e3 / (step(48) + 4.8)).abs() < 1e-6, "{streamed}");
        // Without a second depth every millisecond counts as per layer (the old, lower figure).
        assert!((tok_s_at_depth(48, 0.0, step(4), 4) - 1e3 * 4.0 / 48.0 / step(4)).abs() < 1e-6);
        // Noise that tilts the line below zero at zero layers gives no negative part.
        assert_eq!(per_token_part(1.0, 4, 0.2, 2), 0.0);
    }

    #[test]
    fn a_store_that_would_not_fit_is_refused_naming_the_other_stores() {
        let home = tempfile::tempdir().unwrap();
        let bench = home.path().join("bench");
        let other = bench.join("flash-2L-512E-100003");
        std::fs::create_dir_all(&other).unwrap();
        std::fs::write(other.join("experts.bin"), vec![0u8; 3000]).unwrap();
        let dir = bench.join("flash-32L-512E-100003");
        check_room(&dir, 1 << 20, false).unwrap();
        let e = check_room(&dir, u64::MAX / 4, false).unwrap_err().to_string();
        assert!(e.contains("not enough free disk space") && e.contains("for the benchmark's synthetic store"), "{e}");
        assert!(e.contains("other stores in") && e.contains("flash-2L-512E-100003 (2.93 KiB)"), "{e}");
        assert!(e.contains("--make-room deletes them"), "{e}");
        // Where deleting every other store would not make room either, --make-room deletes none.
        let e = check_room(&dir, u64::MAX / 4, true).unwrap_err().to_string();
        assert!(e.contains("flash-2L-512E-100003 (2.93 KiB)") && e.contains("would not make room either"), "{e}");
        assert!(other.join("experts.bin").exists());
        // Without other stores, the hint is the general one.
        std::fs::remove_dir_all(&other).unwrap();
        let e = check_room(&dir, u64::MAX / 4, false).unwrap_err().to_string();
        assert!(e.contains("point CHERENKOV_HOME at a larger disk") && !e.contains("other stores"), "{e}");
    }

    /// A disk of 10000 bytes whose only contents are the files under `root`.
    fn small_disk(root: &Path) -> impl Fn(&Path) -> Result<cherenkov_hub::disk::Space> + '_ {
        fn used(p: &Path) -> u64 {
            std::fs::read_dir(p)
                .map(|es| {
                    es.filter_map(|e| e.ok())
                        .map(|e| if e.path().is_dir() { used(&e.path()) } else { e.metadata().map_or(0, |m| m.len()) })
                        .sum()
                })
                .unwrap_or(0)
        }
        move |_| Ok(cherenkov_hub::disk::Space { free: 10_000 - used(root), total: 10_000, device: 1 })
    }

    #[test]
    fn make_room_deletes_the_oldest_other_stores_until_the_new_one_fits() {
        let home = tempfile::tempdir().unwrap();
        let bench = home.path().join("bench");
        let store = |name: &str, bytes: usize| {
            let d = bench.join(name);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("experts.bin"), vec![0u8; bytes]).unwrap();
            // The directories' times order them: each written a little after the last.
            std::thread::sleep(std::time::Duration::from_millis(20));
            d
        };
        let (old, mid, new) = (
            store("flash-8L-512E-100003", 3000),
            store("flash-16L-512E-100003", 2500),
            store("flash-2L-512E-100003", 2000),
        );
        let dir = bench.join("flash-32L-512E-100003");
        let disk = small_disk(home.path());
        // 2500 bytes free; 4000 asked: without the flag nothing is touched.
        let e = check_room_with(&dir, 4000, false, &disk).unwrap_err().to_string();
        assert!(e.contains("2.44 KiB free, 1.46 KiB short") && e.contains("--make-room deletes them"), "{e}");
        assert!(old.exists() && mid.exists() && new.exists());
        // With it, the oldest goes first, and only as many as the new store needs.
        check_room_with(&dir, 4000, true, &disk).unwrap();
        assert!(!old.exists() && mid.exists() && new.exists());
        // 5000 more: the next oldest, then the newest.
        check_room_with(&dir, 9000, true, &disk).unwrap();
        assert!(!mid.exists() && !new.exists());
        // A store that fits is no reason to delete anything.
        let kept = store("flash-4L-512E-100003", 1000);
        check_room_with(&dir, 8000, true, &disk).unwrap();
        assert!(kept.exists());
    }

    #[test]
    fn the_pcie_share_scales_the_used_bytes_with_the_depth() {
        // 16 layers, 90 MB read per token of which 4 MB were unused prefetches, 55 GB/s: the link
        // needs 86e6 / 55e9 s a token (639.5 tok/s); at 48 layers three times that (213.2).
        let k = Case { depth: 16, tok_s: 360.0, bytes_per_token: 90e6, wasted_per_token: 4e6, ..Default::default() };
        let (share, bound) = pcie_share(&k, 3000.0, 55e9);
        assert!((bound - 55e9 / 86e6).abs() < 1e-6, "{bound}");
        assert!((share - 360.0 / bound).abs() < 1e-12);
        // At its own depth and rate the two agree.
        assert_eq!(pcie_share_at(&k, 16, 3000.0, 55e9, 360.0), (share, bound));
        let (share48, bound48) = pcie_share_at(&k, 48, 1000.0, 55e9, 127.0);
        assert!((bound48 - 55e9 / (3.0 * 86e6)).abs() < 1e-6, "{bound48}");
        assert!((share48 - 127.0 / bound48).abs() < 1e-12);
        // Where the HBM roofline at that depth is lower, it is the bound.
        assert_eq!(pcie_share_at(&k, 48, 150.0, 55e9, 120.0), (0.8, 150.0));
    }

    #[test]
    fn a_low_link_reading_does_not_raise_the_share() {
        // Session 34: one host read 52.5 GB/s from a pinned buffer; the file's pages gave more.
        let k = Case { depth: 32, tok_s: 195.0, bytes_per_token: 184e6, wasted_per_token: 25e6, ..Default::default() };
        let (low, _) = pcie_share(&k, 3000.0, 52.5e9);
        let (used, bound) = pcie_share(&k, 3000.0, link_rate(52.5e9, 55.2e9));
        assert!((bound - 55.2e9 / 159e6).abs() < 1e-9, "{bound}");
        assert!(used < low, "{used} against {low}");
        // Either reading may be the higher; a file not measured (0) leaves the buffer's.
        assert_eq!(link_rate(55.5e9, 54.6e9), 55.5e9);
        assert_eq!(link_rate(53.6e9, 0.0), 53.6e9);
        let words = link_rates(53.6e9, 55.2e9);
        assert!(words.contains("53.6 GB/s from a pinned buffer and 55.2 from the pinned expert file"), "{words}");
        assert_eq!(link_rates(53.6e9, 0.0), "pinned host-to-device 53.6 GB/s (measured)");
    }

    #[test]
    fn the_declared_acceptance_is_a_rate_and_the_drafts_kept_keep_it() {
        assert_eq!(acceptance("0.8"), Ok(0.8));
        assert_eq!(acceptance("1"), Ok(1.0));
        assert!(acceptance("1.5").is_err() && acceptance("-0.1").is_err() && acceptance("most").is_err());
        // After every pass the drafts kept are the passes times the rate, rounded: never a
        // draft more or fewer than the rate allows, however short the run.
        for p in [0.0, 0.1, 1.0 / 3.0, 0.5, 0.8, 0.87, 0.9, 1.0] {
            let mut keeps = Keeps::new(p);
            let mut kept = 0i64;
            for n in 1..=500i64 {
                kept += i64::from(keeps.next());
                let want = n as f64 * p;
                assert!((kept as f64 - want).abs() <= 0.5 + 1e-9, "p {p}: {kept} kept after {n} passes");
            }
        }
        // Spread evenly: at 0.8 a dropped draft every fifth pass, never two in a row.
        let mut keeps = Keeps::new(0.8);
        let first: String = (0..10).map(|_| if keeps.next() { 'k' } else { 'd' }).collect();
        assert_eq!(first, "kkdkkkkdkk");
    }

    #[test]
    fn drafting_at_48_layers_comes_from_its_own_two_depths() {
        // A pass of 0.4 ms beside the layers and 0.11 ms a layer, 1.8 tokens a pass: 32 and 16
        // layers give 2 / (ms a pass) tokens a ms, and 48 layers the same line further on.
        let tok_s = |layers: f64| 1.8e3 / (0.4 + 0.11 * layers);
        let full = Case { depth: 32, tok_s: tok_s(32.0), ..Default::default() };
        let half = Case { depth: 16, tok_s: tok_s(16.0), ..Default::default() };
        let (at_48, text) = drafting_at_48(&full, &half, 300.0, 1100.0);
        assert!((at_48 - tok_s(48.0)).abs() < 1e-9, "{at_48}");
        let want = format!(
            "at 32 and 16 layers ({:.1} and {:.1} tok/s): {:.1} tok/s against 300.0 without drafting ({:.2}x), {:.1}% of the HBM roofline (1100 tok/s)",
            tok_s(32.0),
            tok_s(16.0),
            tok_s(48.0),
            tok_s(48.0) / 300.0,
            100.0 * tok_s(48.0) / 1100.0
        );
        assert!(text.contains(&want), "{text}");
    }

    #[test]
    fn the_middle_run_stands_for_its_depth() {
        let (mid, rates) = middle_run(vec![(0, 690.0), (1, 640.0), (2, 701.0)], |r| r.1);
        assert_eq!(mid, (0, 690.0));
        assert_eq!(rates, vec![690.0, 640.0, 701.0]);
        // Even counts take the upper middle; one run is its own middle.
        assert_eq!(middle_run(vec![3.0, 1.0, 4.0, 2.0], |&r| r).0, 3.0);
        assert_eq!(middle_run(vec![5.0], |&r| r), (5.0, vec![5.0]));
    }

    #[test]
    fn the_anatomy_gives_the_host_turn_as_means_per_block() {
        let anatomy = cherenkov_cuda::model::BlockAnatomy {
            blocks: 4,
            blocks_missing: 2,
            host_marks: [4_000, 40_000, 60_000, 80_000, 88_000],
            host_batch_marks: [20_000, 36_000],
            host_resident_ns: 120_000,
            ..Default::default()
        };
        let untimed = Case { name: "resident".into(), ..Default::default() };
        let md = anatomy_table(&[untimed, Case { name: "streamed".into(), anatomy, ..Default::default() }]);
        let rows: Vec<&str> = md.lines().filter(|l| l.starts_with("| streamed |")).collect();
        // The per-block columns over all four blocks, the batch's over the two with misses.
        assert_eq!(rows.last(), Some(&"| streamed | 0.001 | 0.010 | 0.018 | 0.010 | 0.015 | 0.020 | 0.022 | 0.030 |"));
        assert!(!md.contains("| resident |"), "a case without timed blocks has no rows:\n{md}");
        assert_eq!(anatomy_table(&[Case::default()]), "");
    }

    #[test]
    fn the_flagged_turns_are_means_per_block() {
        let flagged = cherenkov_cuda::model::FlaggedTurns {
            blocks: 4,
            router_wait_ns: 8_000,
            marks: [40_000, 48_000, 80_000, 100_000, 120_000],
        };
        let segments = Case { name: "segments".into(), ..Default::default() };
        let md = flagged_turn_table(&[segments, Case { name: "flagged".into(), flagged, ..Default::default() }]);
        let rows: Vec<&str> = md.lines().filter(|l| l.starts_with("| flagged |")).collect();
        assert_eq!(rows, vec!["| flagged | 4 | 0.002 | 0.010 | 0.012 | 0.020 | 0.025 | 0.030 |"]);
        assert!(!md.contains("| segments |"), "a case without flagged steps has no rows:\n{md}");
        assert_eq!(flagged_turn_table(&[Case::default()]), "");
    }

    #[test]
    fn the_host_turn_is_a_tokens_time_beyond_its_graph() {
        let replay = cherenkov_cuda::model::ReplayTiming {
            steps: 2,
            gpu_ns: 7_000_000,
            inputs_ns: 100_000,
            launch_ns: 40_000,
            account_ns: 20_000,
        };
        let timed =
            Case { name: "resident".into(), depth: 32, tok_s: 250.0, replay: Some(replay), ..Default::default() };
        let untimed = Case { name: "no graphs".into(), tok_s: 100.0, ..Default::default() };
        let md = host_turn_note(&[timed, untimed]);
        assert!(
            md.contains("resident (32 layers): 4.000 ms a token, 3.500 ms of it the step's graph on the device, 0.500 ms (12.5%) the host's turn with the device idle, of which the host's clock gives 0.050 ms to the step's inputs before the replay, 0.020 to the replay call and 0.010 to the routing's accounting"),
            "{md}"
        );
        assert!(!md.contains("no graphs"), "a case without replayed steps is left out:\n{md}");
        assert_eq!(host_turn_note(&[Case::default()]), "");
    }
}
