//! The `qwen4_exp` forward on the GPU, one token at a time.
//!
//! Same block order and equations as `cherenkov_cpu::model`; every intermediate stays on the
//! device, and the host never waits for the whole device inside a step. Per MoE block the router
//! (top-k on the device) writes the step's address table: one u64 per chosen expert (device address
//! of its record, precision tag in bits 63/62), in the order the expert kernels take them.
//!
//! - Every expert resident (the cache holds the whole store): the records are loaded once
//!   ([`ExpertPool::preload_all`]) and a device map from expert to record lets the router kernel
//!   write the table itself. No host round trip per layer: the step is captured once as a CUDA
//!   graph and replayed (kernels read the position from the step inputs on the device), and the
//!   host learns the step's routing (statistics, synthetic-router state) from a copy after it.
//! - Streaming (a bounded cache): the handshake per MoE block is
//!   1. router ready: the router kernel writes its choice into host-mapped memory and an event
//!      marks it; the host waits for that event only (the shared expert is still running);
//!   2. table ready: the host leases the experts (misses go to the IO threads), writes the table
//!      with the resident experts first and queues their kernels; then it reads the lookahead's
//!      prediction for the next block (the next router on this block's input, queued after the
//!      router-ready event so it never delays it) and queues those reads behind the misses;
//!   3. resident done: those kernels run while the reads finish;
//!   4. reads done: the host queues the kernels of the experts that were read, then the
//!      combination. The lease (which keeps the slots from being reused) is released once a later
//!      event shows those kernels finished.
//!
//!   With the expert file pinned (`DeviceSlots::copies_in_background`), this thread queues the
//!   block's copies itself right after the lease, and "reads done" is a stream wait on each read
//!   slot's copy event rather than a host wait: the host goes on queueing while the copies run.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use cherenkov_cpu::ple::gather_embeddings;
use cherenkov_cpu::weights::Weights;
use cherenkov_engine::backend::{Backend, Logits};
use cherenkov_engine::residency::{ExpertPool, Lease};
use cherenkov_engine::stats::{ExpertStats, ForwardStats, PoolStats};
use cherenkov_model::config::{GateAct, TextConfig};
use cherenkov_model::ngram::{NgramHash, advance_context};
use cherenkov_model::store::{ExpertLayout, Precision, RecordMatrix, Store};

use crate::gpu::{Arg, DevBuf, Event, Gpu, Graph, Pinned, blocks};
use crate::session::{CudaSession, MixerState};
use crate::slots::DeviceSlots;
use crate::weights::{
    DeviceWeights, FoldedConv, FoldedNorm, HyperConnection, MatvecInput, MatvecOutput, Mixer, Normed, matvec_many,
    matvec_many_conv,
};

mod mtp;
mod rows;
use mtp::uncommitted;
pub use rows::RowsLayers;

/// The candidates a step with [`Want::Top`] left in its output (`k` ids as f32 bit patterns, then
/// their `k` values), as (id, logit).
fn candidates_from(out: &[f32], k: usize, among: usize) -> Vec<(u32, f32)> {
    let ids = out[..k].iter().map(|x| x.to_bits());
    // Fewer than k logits above -inf leave ids past the vocabulary (the kernel's "none").
    ids.zip(out[k..2 * k].iter().copied()).filter(|&(i, _)| (i as usize) < among).collect()
}

/// The `k` and `among` of a request for candidates, as the device takes them.
fn candidate_counts(c: &TextConfig, k: usize, among: usize) -> (usize, usize) {
    let among = among.min(c.vocab_size);
    (k.clamp(1, MAX_CANDIDATES).min(among), among)
}

/// The most sampling candidates a step chooses on the device (`top_candidates`' k).
const MAX_CANDIDATES: usize = 1024;

/// Precision tags of address-table entries.
pub const TAG_Q3: u64 = 1 << 63;
pub const TAG_Q2: u64 = 1 << 62;

/// Whether the sampling candidates are chosen by radix selection (`CHERENKOV_ONE_BLOCK_CANDIDATES`:
/// by one block in a pass per candidate, a measurement knob).
fn radix_candidates() -> bool {
    use std::sync::OnceLock;
    static RADIX: OnceLock<bool> = OnceLock::new();
    *RADIX.get_or_init(|| std::env::var_os("CHERENKOV_ONE_BLOCK_CANDIDATES").is_none())
}

/// Whether a streamed block draws its synthetic-router noise before it returns
/// (`CHERENKOV_NOISE_IN_BLOCK`, a measurement knob; [`MoeStep::noise`]).
fn noise_in_block() -> bool {
    use std::sync::OnceLock;
    static IN_BLOCK: OnceLock<bool> = OnceLock::new();
    *IN_BLOCK.get_or_init(|| std::env::var_os("CHERENKOV_NOISE_IN_BLOCK").is_some())
}

/// Whether the attention runs `attn_prep` (one launch) between its projections and `attend`;
/// `CHERENKOV_NO_FUSED_ATTN_PREP` gives the separate launches it replaced.
fn fused_attn_prep() -> bool {
    use std::sync::OnceLock;
    static FUSED: OnceLock<bool> = OnceLock::new();
    *FUSED.get_or_init(|| std::env::var_os("CHERENKOV_NO_FUSED_ATTN_PREP").is_none())
}

/// Rows whose inputs `gdn_recurrent_rows` loads, and whose q and k it stages, before its first
/// row's work (gdn.cu's GDN_ROWS_AHEAD; it sizes the kernel's shared memory).
pub(crate) const GDN_ROWS_AHEAD: usize = 2;

/// `attend`'s token splits per head (attention.cu; at most 32, one lane each in the merge).
const ATTEND_SPLITS: usize = 32;
/// Logits per block of `top_candidates_part`, the most candidates it picks, and the most keys
/// `top_candidates_merge` takes (`CAND_CHUNK`, `CAND_SEL`, `CAND_KEYS` in ple_moe.cu).
const CAND_CHUNK: usize = 4096;
const CAND_SEL: usize = 256;
const CAND_KEYS: usize = 16384;
/// `attend`'s register slots per lane: head_dim up to 32 x this (attention.cu's ATTEND_R).
const ATTEND_MAX_R: usize = 8;
/// `attend_cl`'s cluster: blocks a pair of query heads spreads over, each merging 32 of a head's
/// dims (attention.cu's ATTEND_CL).
const ATTEND_CLUSTER: usize = 8;

/// What a step returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Want {
    Nothing,
    Logits,
    /// The `k` largest logits among ids below `among`, chosen on the device.
    Top {
        k: usize,
        among: usize,
    },
}

/// Where decode time goes (host clocks around synchronised sections).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepTiming {
    pub steps: u64,
    /// Whole steps, ns.
    pub total_ns: u64,
    /// Waiting for expert reads (`Lease::wait_all`), ns.
    pub wait_ns: u64,
    /// Routed-expert kernels' GPU time (CUDA events around them), ns; steps replayed from a
    /// CUDA graph are not timed (their expert time counts as dense).
    pub experts_ns: u64,
    /// Host time spent queueing the steps' work, up to the final wait for the GPU, ns (close to
    /// `total_ns` when the host, not the GPU, sets the pace).
    pub queue_ns: u64,
    /// Experts dropped by the deadline cut (`--cut-weak`).
    pub cut: u64,
    /// Misses computed on the CPU (`--cpu-experts`), and the host's wait for them after queueing
    /// everything else of their block, ns.
    pub cpu_experts: u64,
    pub cpu_wait_ns: u64,
    /// Where the timed MoE blocks' time went on the GPU (steps not replayed from a graph).
    pub anatomy: BlockAnatomy,
    /// The host's turns in flagged steps ([`CudaModel::step_flagged`]).
    pub flagged: FlaggedTurns,
    /// Steps replayed whole from one graph, timed ([`CudaModel::replay_timing`]).
    pub replay: ReplayTiming,
}

/// Steps replayed whole from one CUDA graph (every expert resident), summed over the steps timed
/// with [`CudaModel::replay_timing`], ns: the device's span of a step, from an event recorded just
/// before the replay to one recorded just after it (the graph's launch included; what a token
/// takes beyond it is the host's turn between steps, the device idle), and parts of that turn on
/// the host's clock: from the step's start to its replay (the step's inputs, n-gram rows and
/// synthetic-router biases), the replay call, and after the step's end the routing's accounting.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ReplayTiming {
    pub steps: u64,
    pub gpu_ns: u64,
    pub inputs_ns: u64,
    pub launch_ns: u64,
    pub account_ns: u64,
}

/// The host's turns of the blocks of flagged steps ([`CudaModel::turn_flagged`]), summed over
/// blocks (ns, the host's clock; every flagged step, timed or not): how long the host waited for
/// each router's flag (none: the host, not the GPU, was behind), then from the flag seen until
/// each point of the turn: the lease returned (the misses' copies queued), the block's flags set or
/// queued behind its copies, the lookahead's reads queued, the turn flag set (the landed records
/// published: the next router waits for it), the ghosts replayed (the turn's end).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FlaggedTurns {
    pub blocks: u64,
    pub router_wait_ns: u64,
    pub marks: [u64; 5],
}

/// One flagged block's turn, for the per-block table `CHERENKOV_FLAG_BLOCKS=path` appends to
/// ([`CudaModel::write_flag_rows`]): what the lease found and queued, and the turn's marks (ns,
/// the host's clock, from the router's flag seen; `router_wait_ns` before it).
#[derive(Clone, Copy, Debug)]
struct FlagRow {
    layer: usize,
    /// Entries the lease queued reads for, entries being read already (loads still running, or
    /// prefetches whose copies from the pinned file still run), entries the router did not find
    /// in the hit map, and whether any of those was still copying when the block's flags were set.
    misses: usize,
    inflight: usize,
    rest: usize,
    copying: bool,
    /// The lookahead's reads this turn queued.
    prefetched: usize,
    router_wait_ns: u64,
    marks: [u64; 5],
}

/// Where `CHERENKOV_FLAG_BLOCKS` sends its rows (None: nowhere).
fn flag_blocks_path() -> Option<&'static std::path::Path> {
    use std::sync::OnceLock;
    static PATH: OnceLock<Option<std::path::PathBuf>> = OnceLock::new();
    PATH.get_or_init(|| std::env::var_os("CHERENKOV_FLAG_BLOCKS").map(std::path::PathBuf::from)).as_deref()
}

/// The header of the `CHERENKOV_FLAG_BLOCKS` table; [`flag_row_line`] writes its rows.
pub const FLAG_ROW_HEADER: &str = "model\tstep\tlayer\tmisses\tinflight\trest\tcopying\tprefetched\t\
router_wait_us\tlease_us\tflags_us\tlookahead_us\tturn_flag_us\tturn_end_us\t\
start_us\twait_began_us\twait_past_us\tcombine_us";

/// One row of the `CHERENKOV_FLAG_BLOCKS` table: the turn (`r`, host clock) and the block's GPU
/// clock stamps `s` (experts started, combination started, past its flag's wait, began to wait),
/// in us from `origin` (the step's first block's start on the GPU's clock).
fn flag_row_line(model: usize, step: u64, r: &FlagRow, s: [u64; 4], origin: u64) -> String {
    let us = |ns: u64| format!("{:.3}", ns as f64 / 1e3);
    let gpu = |t: u64| if t >= origin && t > 0 { us(t - origin) } else { "-".to_string() };
    let mut cols = vec![
        model.to_string(),
        step.to_string(),
        r.layer.to_string(),
        r.misses.to_string(),
        r.inflight.to_string(),
        r.rest.to_string(),
        u8::from(r.copying).to_string(),
        r.prefetched.to_string(),
        us(r.router_wait_ns),
    ];
    cols.extend(r.marks.iter().map(|&m| us(m)));
    cols.extend([gpu(s[0]), gpu(s[3]), gpu(s[2]), gpu(s[1])]);
    cols.join("\t")
}

impl ReplayTiming {
    fn add(&mut self, o: &ReplayTiming) {
        self.steps += o.steps;
        self.gpu_ns += o.gpu_ns;
        self.inputs_ns += o.inputs_ns;
        self.launch_ns += o.launch_ns;
        self.account_ns += o.account_ns;
    }
}

impl FlaggedTurns {
    fn add(&mut self, o: &FlaggedTurns) {
        self.blocks += o.blocks;
        self.router_wait_ns += o.router_wait_ns;
        (0..5).for_each(|i| self.marks[i] += o.marks[i]);
    }
}

/// Where the timed MoE blocks' GPU time went, summed over blocks (ns; CUDA events on the compute
/// stream and the copy streams, all read after the step). Times are measured from the router-ready
/// event (the routing written) of each block. The copy times cover blocks with misses copied into
/// slots whose copy events still describe that block's copies.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BlockAnatomy {
    /// Blocks timed, and those of them with misses read to the GPU.
    pub blocks: u64,
    pub blocks_missing: u64,
    /// Router ready to the resident experts' first kernel, and those kernels.
    pub to_resident_ns: u64,
    pub resident_ns: u64,
    /// Blocks with misses: router ready to the first miss's copy start; first copy start to last
    /// copy end; last copy end to the read experts' end (what the block spends after its last byte
    /// landed); the read experts' kernels (from the first's start: they may start before the
    /// last copy ends).
    pub copies_timed: u64,
    pub to_copy_ns: u64,
    pub copy_ns: u64,
    pub copy_to_read_end_ns: u64,
    pub read_ns: u64,
    /// Host time from the router-ready wait's return to the lease (the misses' copies queued),
    /// over the blocks with misses, and the part of it in the pool's loads (their bookkeeping and
    /// the copies' driver calls).
    pub host_turn_ns: u64,
    pub host_loads_ns: u64,
    /// Host time from the router-ready wait's return to the resident experts' kernels queued,
    /// over all blocks.
    pub host_resident_ns: u64,
    /// The host's turn step by step (ns from the router-ready wait's return, summed over all
    /// blocks): the pool's acquire called, the lease returned, the back parts queued, the table
    /// written, the stream's waits for the resident experts' copies queued. And over the blocks
    /// with misses: the pool's batch of loads begun, its first copy queued (its end where it
    /// queued none: a block whose only misses were prefetches still copying).
    pub host_marks: [u64; 5],
    pub host_batch_marks: [u64; 2],
    /// Router ready to the next block's router ready (blocks followed by one in the same step):
    /// one layer, and how many were measured.
    pub spans: u64,
    pub span_ns: u64,
}

impl BlockAnatomy {
    fn add(&mut self, o: &BlockAnatomy) {
        self.blocks += o.blocks;
        self.blocks_missing += o.blocks_missing;
        self.to_resident_ns += o.to_resident_ns;
        self.resident_ns += o.resident_ns;
        self.copies_timed += o.copies_timed;
        self.to_copy_ns += o.to_copy_ns;
        self.copy_ns += o.copy_ns;
        self.copy_to_read_end_ns += o.copy_to_read_end_ns;
        self.read_ns += o.read_ns;
        self.host_turn_ns += o.host_turn_ns;
        self.host_loads_ns += o.host_loads_ns;
        self.host_resident_ns += o.host_resident_ns;
        (0..5).for_each(|i| self.host_marks[i] += o.host_marks[i]);
        (0..2).for_each(|i| self.host_batch_marks[i] += o.host_batch_marks[i]);
        self.spans += o.spans;
        self.span_ns += o.span_ns;
    }
}

impl StepTiming {
    /// Everything that is neither waiting nor routed experts: dense layers, routing, syncs.
    pub fn dense_ns(&self) -> u64 {
        self.total_ns.saturating_sub(self.wait_ns + self.experts_ns)
    }
}

/// Scratch vectors of one forward (sized for the largest use).
pub(crate) struct Scratch {
    pub(crate) x: DevBuf,
    pub(crate) normed: DevBuf,
    /// The hyper-connection streams' 1 / rms, where the norm is folded into the read's matvecs.
    pub(crate) hc_inv: DevBuf,
    pub(crate) low: DevBuf,
    pub(crate) mix: DevBuf,
    pub(crate) inp: DevBuf,
    pub(crate) inj: DevBuf,
    pub(crate) out: DevBuf,
    pub(crate) big: [DevBuf; 7],
    pub(crate) weights: DevBuf,
    pub(crate) ids: DevBuf,
    /// The chunks' candidates of `top_candidates_part` ([`CAND_KEYS`] keys of 8 bytes).
    pub(crate) cand: DevBuf,
    pub(crate) act: DevBuf,
    pub(crate) eout: DevBuf,
    /// The QSA block scores the host reads back past the budget.
    pub(crate) scores: DevBuf,
    /// `attend`'s per-split partial results ([heads][ATTEND_SPLITS][head_dim + 2]) and its
    /// per-head-group counters (zero between launches).
    pub(crate) attn_part: DevBuf,
    pub(crate) attn_count: DevBuf,
    pub(crate) idx: DevBuf,
    pub(crate) logits: DevBuf,
    pub(crate) moe: MoeBufs,
    /// The step inputs the kernels read, uploaded in one copy at the step's start: token and
    /// position (i32 each), then from [`STEP_PLE_AT`] each PLE layer's gathered n-gram rows
    /// ([`ple_rows_at`]); and their host side.
    pub(crate) step_in: DevBuf,
    pub(crate) step_host: Pinned,
    /// The sampling candidates again, in host memory mapped for the device: [`MAX_CANDIDATES`] ids
    /// (i32), then as many values (f32), written by the candidates' last kernel so that
    /// [`CudaModel::read_candidates`] needs no copy after the step (two synchronous copies to
    /// pageable memory a row, before).
    pub(crate) cand_host: Pinned,
}

/// How a GDN layer's recurrence runs ([`CudaModel::gdn_recurrence`]).
pub(crate) struct GdnRecurrence {
    pub(crate) kernel: &'static str,
    pub(crate) threads: u32,
    /// Dynamic shared memory, bytes.
    pub(crate) shared: u32,
    /// Whether the kernel is `gdn_recurrent_split` (whose rows kernel is `gdn_recurrent_rows`).
    pub(crate) split: bool,
    /// Whether it writes the out_proj's staged image.
    pub(crate) image: bool,
}

/// Where the PLE rows start in the step inputs (bytes): past the token and position, aligned as
/// a matvec's input.
const STEP_PLE_AT: usize = 256;

/// Bytes of the step inputs for `c`: the token and position, then each PLE layer's rows.
fn step_in_bytes(c: &TextConfig) -> usize {
    STEP_PLE_AT + c.ple_layer_ids.len() * ple_row_bytes(c)
}

/// Bytes a PLE layer's rows take in the step inputs (rounded up to keep the next layer's aligned).
fn ple_row_bytes(c: &TextConfig) -> usize {
    (c.ple_embed_dim * 4).next_multiple_of(STEP_PLE_AT)
}

/// Byte offset in the step inputs of the rows of PLE layer `ple_index` (its place in
/// `ple_layer_ids`).
fn ple_rows_at(c: &TextConfig, ple_index: usize) -> usize {
    STEP_PLE_AT + ple_index * ple_row_bytes(c)
}

/// What a streamed layer's segment graph ([`CudaModel::queue_layer_head`]) was captured for:
/// the session's buffers, and the settings that change what the head queues.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct SegmentKey {
    session: u64,
    generation: u64,
    depth: usize,
    lookahead: bool,
    cpu_experts: bool,
    cut_weak: bool,
    /// The head records the timed router-ready event (the blocks' anatomy).
    anatomy_event: bool,
    /// The router reads the hit map ([`CudaModel::finds_hits`]).
    device_hits: bool,
}

/// The segment graphs of one [`SegmentKey`], per decoder layer (captured at first use).
#[derive(Default)]
struct SegmentGraphs {
    key: Option<SegmentKey>,
    graphs: Vec<Option<Graph>>,
}

/// Who runs a flagged turn's lookahead reads ([`CudaModel::turn_flagged`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum PrefetchHere {
    /// The pool's IO threads, woken for them.
    Threads,
    /// The turn's thread, before it sets the turn flag.
    BeforeTurn,
    /// The turn's thread, after it sets the turn flag (the reads' slots were taken before it).
    AfterTurn,
}

/// What a captured step depends on besides the step inputs: the session's buffers (its identity
/// and their generation), what it ends with (logits, candidates), and the depth.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct GraphKey {
    session: u64,
    generation: u64,
    /// The step's output: logits, and the candidates' launches, are part of the graph.
    want: Want,
    depth: usize,
}

/// Per MoE layer (the store's expert slot index `l`, `k` entries each): what the router and the
/// lookahead choose, the address tables, and the synthetic routers' biases; host sides mapped.
pub(crate) struct MoeBufs {
    /// Top-k ids and weights `[l, k]`.
    ids: DevBuf,
    weights: DevBuf,
    /// The router's ids as the host sees them `[l, k]` (i32).
    ids_host: Pinned,
    /// The lookahead's predicted ids `[l, 2k]`, the most likely first (device scratch and host
    /// copy; [`CudaModel::lookahead_width`] of each row are written).
    pred_ids: DevBuf,
    pred_weights: DevBuf,
    pred_host: Pinned,
    /// Per MoE layer its entries ([`entries_stride`] bytes): the address table (k u64), then per
    /// top-k rank its table entry (k i32), so that a streamed block's are one upload.
    entries: DevBuf,
    /// Per MoE layer the address table its router writes from the hit map (k u64, in rank
    /// order, 0 for an expert not found there; [`CudaModel::moe_found`]).
    found: DevBuf,
    entries_host: Pinned,
    /// The routing weights as the host sees them `[l, k]` (for the deadline cut).
    weights_host: Pinned,
    /// Synthetic-router biases `[l, 2, E]`: for routing, then for predicting (read by the router
    /// from host memory).
    bias_host: Pinned,
    /// Bytes from these bias rows to the next row's of a verifying pass (`route_topk_rows`; 0
    /// elsewhere): host memory, outside the rows' allocation.
    bias_next: i64,
    /// Per MoE layer [`STAMPS`] u64: the GPU clock (ns) when the block's expert kernels started
    /// (the read experts' gate/up launch, or the found experts' where the router finds them) and
    /// when the combination after them started, written by those kernels (`stamp_first`): the
    /// experts' time without an event between the combination and the next layer's kernels. In a
    /// flagged step also when the read experts' gate/up launch was past its flag's wait, then when
    /// it began to wait (the found experts done): the GPU's wait for the block's copies.
    stamps: Pinned,
    /// Per MoE layer (u32), set by the router once its ids are in `ids_host` (`route_topk`'s
    /// `ready`) where it finds its experts in the hit map: the host polls it instead of waiting for
    /// the router-ready event ([`CudaModel::await_router`]). Cleared at the step's start.
    ready: Pinned,
    /// Per MoE layer four u32 flags ([`FLAG_FRONT`], [`FLAG_BACK`], [`FLAG_TURN`], unused) for a
    /// flagged streamed step ([`CudaModel::step_flagged`]), set by the host or the copy stream.
    /// Cleared at the step's start.
    flags: Pinned,
    /// Each flag's relay in device memory (`flag_wait` in common.cuh): 32 bytes, a u32 `seen` the
    /// waiting grid's first block sets once it read the flag set, a u32 count of 8-byte words it
    /// copies first, the flag's device address, and the words' source and destination: a front or
    /// back flag's relay copies the block's entries (table and per-rank rows) from the pinned
    /// `entries_host` the host wrote to `entries` ([`relay_rows`]), so that the read experts and
    /// the combination read them from device memory. The kernels take the relay's address; the
    /// step's graph zeroes every `seen` first.
    relays: DevBuf,
    /// The MoE input as the host sees it `[l, hidden]`, and the outputs of the experts computed
    /// on the CPU `[l, k, hidden]` (`--cpu-experts`; empty without).
    x_host: Pinned,
    cpu_out: Pinned,
    /// Expert address per (layer, expert) `[l, E]` when every expert is resident.
    map: Option<DevBuf>,
    /// Whether residency was decided (the first step decides).
    decided: bool,
    /// Per MoE layer: router ready; resident experts' kernels start/end; read experts' start/end;
    /// the lookahead's prediction ready; router ready with timing (recorded only for the blocks'
    /// anatomy, so the router-ready event the host waits on stays a cheap one).
    events: Vec<[Event; 7]>,
}

/// One step's MoE bookkeeping: the lease whose kernels may still run, the MoE layers routed, and
/// the time the host waited on reads.
pub(crate) struct MoeStep<'p> {
    pending: Option<Lease<'p, DeviceSlots>>,
    routed: Vec<usize>,
    /// MoE layers whose read experts' kernels were timed by events (streaming with misses).
    read_timed: Vec<usize>,
    /// MoE layers whose expert kernels were timed by the kernels' own clock stamps
    /// ([`MoeBufs::stamps`]): all of them (every expert resident) or the read ones (streaming).
    stamped: Vec<usize>,
    /// Streamed MoE layers whose experts were all resident and on the GPU, timed by their clock
    /// stamps alone (no events around them); and those whose router found experts in the hit
    /// map ([`CudaModel::moe_found`]), timed by the stamps from the found experts' start to the
    /// combination's, less the GPU's wait for copies between.
    whole_stamped: Vec<usize>,
    found: Vec<usize>,
    /// MoE layers with misses whose copies the stream waited for (copies in the background): their
    /// waiting is the GPU's, from the resident experts' end to the read experts' start.
    gpu_waited: Vec<usize>,
    /// The host's turns of a flagged step ([`FlaggedTurns`]).
    flagged: FlaggedTurns,
    /// MoE layers of a flagged step whose read experts' wait for their flag was stamped
    /// ([`MoeBufs::stamps`]): their waiting is the GPU's, from the found experts' end to the wait's.
    flag_waited: Vec<usize>,
    /// The flagged turns of this step, for `CHERENKOV_FLAG_BLOCKS` ([`FlagRow`]).
    flag_rows: Vec<FlagRow>,
    /// Timed blocks in step order (their router-ready events recorded): the MoE layer and the
    /// slots its read experts were copied into.
    blocks: Vec<(usize, Vec<usize>)>,
    /// Host time from the router-ready waits' return to the leases, over the timed blocks with
    /// misses (ns).
    host_turn_ns: u64,
    host_loads_ns: u64,
    host_resident_ns: u64,
    host_marks: [u64; 5],
    host_batch_marks: [u64; 2],
    wait_ns: u64,
    start: std::time::Instant,
    /// Host time until everything up to the logits was queued.
    queued_ns: Option<u64>,
    /// Experts dropped by the deadline cut.
    cut: u64,
    /// Experts computed on the CPU, and the host's wait for them (ns).
    cpu_experts: u64,
    cpu_wait_ns: u64,
    /// The combination also injects the block's output into the residual streams (steps; the
    /// block checks read the output alone).
    inject: bool,
    /// Being captured into a graph, or replayed from one: no timing events (a captured event
    /// record cannot be read as a clock).
    untimed: bool,
    /// Replayed from one graph between the model's two `replay_events`: the host's time from the
    /// step's start to the replay, and of the replay call (ns).
    replay_timed: Option<[u64; 2]>,
    /// Streamed MoE layers whose synthetic-router noise for the next token is still to be drawn
    /// (the benchmark's): drawn while the host waits for the next block's router, not between a
    /// block's combination and the next layer's kernels.
    noise: Vec<usize>,
    /// The next block's head ([`CudaModel::moe_head`]) is on the stream already (replayed with
    /// its layer's segment graph); `moe` clears it.
    head_queued: bool,
}

impl MoeStep<'_> {
    pub(crate) fn new() -> Self {
        MoeStep {
            pending: None,
            noise: Vec::new(),
            routed: Vec::new(),
            read_timed: Vec::new(),
            stamped: Vec::new(),
            whole_stamped: Vec::new(),
            found: Vec::new(),
            gpu_waited: Vec::new(),
            flag_waited: Vec::new(),
            flag_rows: Vec::new(),
            flagged: FlaggedTurns::default(),
            blocks: Vec::new(),
            host_turn_ns: 0,
            host_loads_ns: 0,
            host_resident_ns: 0,
            host_marks: [0; 5],
            host_batch_marks: [0; 2],
            wait_ns: 0,
            start: std::time::Instant::now(),
            queued_ns: None,
            untimed: false,
            replay_timed: None,
            cut: 0,
            cpu_experts: 0,
            cpu_wait_ns: 0,
            inject: false,
            head_queued: false,
        }
    }
}

pub struct CudaModel {
    pub store: Arc<Store>,
    pub gpu: Arc<Gpu>,
    pub pool: Arc<ExpertPool<DeviceSlots>>,
    /// Synthetic-benchmark routing (None: the model's router decides).
    pub skew: Option<Arc<cherenkov_engine::routing::SkewedRouting>>,
    /// This model's number in the `CHERENKOV_FLAG_BLOCKS` table (models of one process count
    /// from 0), and its flagged steps written there so far.
    model_no: usize,
    flag_steps: std::sync::atomic::AtomicU64,
    /// Lookahead: apply the next layer's router to this layer's MoE input and prefetch its experts
    /// behind the step's own misses.
    pub lookahead: bool,
    /// Experts the lookahead prefetches per block: its most likely ones, from top-k to 2k
    /// (`CHERENKOV_LOOKAHEAD_WIDTH`, for measurements; default top-k). Its accuracy is scored on
    /// its top-k alone.
    lookahead_width: usize,
    /// At most this many prefetch reads per block, the most likely first (None: every predicted
    /// miss). Default 2: the link is free for about 1.5 records between a block's misses and the
    /// next block's router, and a prefetch still copying then delays that block's misses on the one
    /// copy stream; capped at 2 a streamed layer took 0.218-0.233 ms against 0.254-0.259 uncapped
    /// (`benchmark/notes-cuda.md`, session 10). `CHERENKOV_LOOKAHEAD_READS=n` sets it, 0 for no cap.
    lookahead_reads: Option<usize>,
    /// The lookahead's router (the next block's gate on this block's input) rides in this block's
    /// router launch as one more part, instead of a launch of its own between the routing and
    /// the found experts (`CHERENKOV_LOOKAHEAD_OWN_LAUNCH=1`: its own launch, a measurement knob).
    lookahead_rides: bool,
    /// Where it rides, its top-k is a second block of the routing's launch
    /// (`CHERENKOV_LOOKAHEAD_OWN_TOPK=1`: a launch of its own after it, a measurement knob).
    lookahead_topk_beside: bool,
    /// Every expert resident: the shared expert's down projection on the side stream
    /// (`CHERENKOV_NO_SIDE_STREAM=1` queues it in line, before the routed experts), where it does
    /// not ride along in the routed experts' down launch (`shared_ride`).
    shared_beside: bool,
    /// Every expert resident: the shared expert's down projection as the last entry of the routed
    /// experts' down launch where its format allows ([`crate::weights::shared_rides`]), so the
    /// combination follows that launch alone (`CHERENKOV_NO_SHARED_RIDE=1`: on its own, beside).
    shared_ride: bool,
    /// Where the down projection rides along: the shared expert's gate and up projections too, as
    /// the last entry of the routed experts' gate/up launch
    /// ([`crate::weights::shared_gate_up_rides`]); their blocks need nothing the router writes and
    /// run beside the routing, and the router's launch is the router and the shared expert's gate
    /// alone (`CHERENKOV_NO_SHARED_GATE_UP_RIDE=1`: in the router's launch).
    shared_gate_up_ride: bool,
    /// The router's launch leaves its column slices unsummed and `route_topk` adds them up as it
    /// loads its logits ([`crate::weights::matvec_many_deferring`]), so no block of that launch
    /// waits for the others to sum them (`CHERENKOV_NO_ROUTE_SUM=1`: its last block adds them up).
    route_sum: bool,
    /// The hyper-connection reads' down projection leaves its column slices (one a stream) unsummed,
    /// and `hc_up_mix` adds them up as it loads its input (`MvLdSlices` in linear.cu), so no block
    /// of the down launch waits for the others (`CHERENKOV_NO_READ_SUM=1`: its last block adds them
    /// up).
    read_sum: bool,
    /// With `read_sum`, the read's injection logits are left unsummed too and one block more of
    /// `hc_up_mix` adds them up beside its tiles, so that no block of the read's launch sums them
    /// at its end (`CHERENKOV_NO_INJECT_BESIDE=1`: the read launch's last block sums them).
    inject_beside: bool,
    /// The GDN recurrence also writes its output as the out_proj's 4-bit kernel stages it, and
    /// that kernel's blocks copy the image instead of converting the output each
    /// ([`MatvecInput::Digits`]; `CHERENKOV_NO_GDN_DIGITS=1`: every block converts it).
    gdn_digits: bool,
    /// `attend`'s merge applies the attention output gate (x sigmoid(gate)), so that the output
    /// projection stages a plain input (`CHERENKOV_NO_ATTEND_GATE=1`: the projection applies it,
    /// every block computing the sigmoids as it stages).
    attend_gate: bool,
    /// With `attend_gate`, the merge also writes its output as the output projection's 4-bit kernel
    /// stages it, as the GDN recurrence does for its out_proj (`CHERENKOV_NO_ATTEND_DIGITS=1`: the
    /// projection's blocks convert it).
    attend_digits: bool,
    /// Attention's splits merged through a thread block cluster's shared memory (`attend_cl`)
    /// where query heads pair up on a KV head and head_dim is 256, on compute capability 9.0
    /// (`CHERENKOV_NO_ATTEND_CLUSTER=1`: `attend`, merged by the last block through L2).
    attend_cluster: bool,
    /// Streaming: a block's read experts are queued before its lookahead's host work where the host
    /// has nothing to wait for (see `moe`; `CHERENKOV_READS_FIRST=0` queues them after it).
    reads_first: bool,
    /// Streaming from a pinned expert file: a block's router finds its landed experts in the
    /// slots' hit map and their kernels run without waiting for the host's turn
    /// ([`CudaModel::moe_found`]; `CHERENKOV_DEVICE_HITS=0`: the host chooses every expert's
    /// slot). Not with the deadline cut, experts on the CPU or the blocks' anatomy, which keep the
    /// host's choice. Session 29's pinned A/B on the H200 (16 layers, 8 rounds): 344.5 tok/s
    /// against 331.3, ahead in 6.
    device_hits: bool,
    /// Where the router finds its experts ([`CudaModel::finds_hits`]): the host polls the flag the
    /// router sets once its ids are in host memory ([`MoeBufs::ready`]) instead of waiting for the
    /// router-ready event (`CHERENKOV_ROUTER_POLL=0`: the event).
    router_poll: bool,
    /// Whether a flagged step's turn replays the adaptive policy's ghosts before its turn flag
    /// (`CHERENKOV_GHOSTS_BEFORE_TURN=1`, a measurement knob: the order before session 32) rather
    /// than after it (the default), where the replay does not hold up the next router. On the
    /// H200 (16 layers, 21G pinned, 4 rounds): 358.0 tok/s after against 350.9 before.
    ghosts_before_turn: bool,
    /// Who runs a flagged turn's lookahead reads: the turn's own thread, which launches nothing
    /// else in a flagged step, before its turn flag (the default), or after it
    /// (`CHERENKOV_PREFETCH_HERE=2`), or the pool's IO threads, woken for them (`=0`; the order
    /// before session 33). On the H200 (16 layers, 21G pinned, 6 alternating rounds): 371.8 tok/s
    /// before the flag, 368.8 after it, 349.8 on the IO threads.
    prefetch_here: PrefetchHere,
    /// A streamed step whose router finds its experts is replayed whole from one graph, each
    /// block's read experts and combination waiting in their kernels for flags the copy stream or
    /// the host sets ([`CudaModel::step_flagged`]; `CHERENKOV_STEP_GRAPH=0`: the segment graphs,
    /// launched block by block). On the H200 (16 layers, 21G pinned, session 32, three calls of 6
    /// alternating rounds): 355.8, 348.3 and 351.8 tok/s against 346.3, 340.7 and 341.8.
    step_graph: bool,
    /// The flagged steps' graphs ([`CudaModel::step_flagged`]), as `graph` for resident steps.
    /// Keyed also by whether the lookahead is on (its router is part of each head).
    flag_graphs: Mutex<Vec<((GraphKey, bool), Graph)>>,
    /// While a flagged step is captured: the heads leave the side stream that records their
    /// events unjoined, so that no kernel of the step depends on two nodes (which would cost it
    /// its early launch); the step joins it once, at its end.
    joins_deferred: std::sync::atomic::AtomicBool,
    /// The deadline cut's weight (`--cut-weak`): None waits for every read.
    pub cut_weak: Option<f32>,
    /// Replay steps that never wait for the host (every expert resident) as CUDA graphs.
    pub graphs: bool,
    /// Streaming (with `graphs`): replay each layer's work up to its routing as a graph of its
    /// own, where attention needs no host choice (`CHERENKOV_NO_SEGMENT_GRAPHS=1`: launch it
    /// kernel by kernel). The events the host waits on inside it are the graph's event nodes.
    segments: bool,
    segments_cache: Mutex<SegmentGraphs>,
    /// A streamed head records its events on the side stream ([`Gpu::record_beside`]), so that
    /// the head's kernels keep their early launch (`CHERENKOV_EVENTS_IN_LINE=1`: in line).
    events_beside: bool,
    /// Compute some misses on the CPU instead of copying them (`--cpu-experts`; see
    /// [`crate::offload`]); set with [`CudaModel::set_cpu_experts`].
    cpu_experts: Option<crate::offload::CpuExperts>,
    /// Decoder layers a step runs: every layer, except in the bench, which also times a shallower
    /// step of the same weights to tell the time per layer from the time per token (lm_head,
    /// sampling). A shallower step's outputs are not the model's.
    pub depth: usize,
    /// Read every timed MoE block's events after its step into [`StepTiming::anatomy`] (the
    /// bench): about ten event-time reads per block on the host between steps.
    pub anatomy: bool,
    /// Time each step replayed from a graph with two events around its replay
    /// ([`StepTiming::replay`]; the bench): two event records and one read a step.
    pub replay_timing: bool,
    /// The two events of `replay_timing`.
    replay_events: [Event; 2],
    /// Captured steps and what each was captured for (the most recently used last).
    graph: Mutex<Vec<(GraphKey, Graph)>>,
    /// The MTP head's steps replayed from graphs (every expert resident, below the QSA budget).
    mtp_graphs: Mutex<Vec<(mtp::MtpGraphKey, Graph)>>,
    /// A verifying forward of two rows runs as one pass over both, stage by stage
    /// ([`CudaModel::verify_rows`]; `CHERENKOV_VERIFY_ROWS=0`: as two steps). The rows' scratch
    /// (made at the first such forward) and the passes' graphs.
    verify_rows: std::sync::atomic::AtomicBool,
    /// Verifying forwards run as passes so far (the checks ask whether theirs did).
    rows_run: std::sync::atomic::AtomicU64,
    /// Whether a verifying pass launches the stages that can serve both rows once for both
    /// (`CHERENKOV_ROWS_APART=1`: every stage once a row, a measurement of the scaffold alone).
    rows_fused: bool,
    /// Whether the pass's GDN input projections take both rows in each block (`matvec_many_x2`;
    /// `CHERENKOV_ROWS_IN_PROJ_APART=1`: one launch a row, a measurement).
    rows_in_proj_x2: bool,
    /// Whether the pass's MoE blocks launch once for both rows where they can
    /// ([`CudaModel::moe_rows_fit`]; `CHERENKOV_ROWS_MOE_APART=1`: once a row, a measurement).
    rows_moe: bool,
    /// Whether the pass's attention projections take both rows in each block
    /// (`matvec_many_x2`; `CHERENKOV_ROWS_ATTN_APART=1`: once a row, a measurement).
    rows_attn_x2: bool,
    /// What the last captured pass launched over both rows, layer by layer (the checks name it).
    rows_layers: Mutex<rows::RowsLayers>,
    row_scratch: Mutex<Option<rows::RowScratch>>,
    rows_graphs: Mutex<Vec<(rows::RowsKey, Graph)>>,
    predicted: Mutex<Vec<Option<Vec<usize>>>>,
    /// Accumulated decode timing (reset with [`CudaModel::reset_timing`]).
    timing: Mutex<StepTiming>,
    pub(crate) weights: DeviceWeights,
    inv_freq: DevBuf,
    ngram: Vec<Option<NgramHash>>,
    pub(crate) scratch: Mutex<Scratch>,
}

/// The scratch vectors of one forward for `c` with `moe_layers` MoE layers, each device vector
/// from `z` (bytes, what it holds; zeroed): the model's own ([`new_scratch`]), and a verifying
/// pass's rows, whose vectors lie at one distance from each other's ([`rows::RowScratch`]).
fn scratch_with(
    gpu: &Gpu,
    c: &TextConfig,
    moe_layers: usize,
    z: &mut dyn FnMut(usize, &str) -> Result<DevBuf>,
) -> Result<Scratch> {
    let widest = [
        c.hc_hidden(),
        c.gdn_conv_dim(),
        c.num_attention_heads * c.head_dim * 2,
        c.qsa.as_ref().map_or(0, |q| (q.n_heads + q.kv_heads) * q.head_dim),
        c.ple_embed_dim,
        c.shared_expert_intermediate_size,
        c.num_experts,
        c.gdn_value_dim(),
    ]
    .into_iter()
    .max()
    .unwrap();
    let e = c.num_experts;
    Ok(Scratch {
        x: z(f32s(c.hc_hidden()), "activations")?,
        normed: z(f32s(c.hc_hidden()), "activations")?,
        hc_inv: z(f32s(c.hc_count), "activations")?,
        low: z(f32s(c.hc_lowrank), "activations")?,
        mix: z(f32s(c.hc_hidden()), "activations")?,
        inp: z(f32s(c.hidden_size), "activations")?,
        inj: z(f32s(c.hc_count), "activations")?,
        out: z(f32s(c.hidden_size), "activations")?,
        big: [
            z(f32s(widest), "activations")?,
            z(f32s(widest), "activations")?,
            z(f32s(widest), "activations")?,
            z(f32s(widest), "activations")?,
            z(f32s(widest), "activations")?,
            z(f32s(widest), "activations")?,
            z(f32s(widest), "activations")?,
        ],
        weights: z(e.max(1024) * 4, "the routing weights")?,
        ids: z(e.max(1024) * 4, "the routing ids")?,
        cand: z(CAND_KEYS * 8, "the sampling candidates' keys")?,
        act: z(f32s(e * c.moe_intermediate_size), "expert activations")?,
        // One row more than entries: the deadline cut points dropped experts at a zero row.
        eout: z(f32s((e + 1) * c.hidden_size), "expert outputs")?,
        scores: z(f32s(4096), "attention scores")?,
        attn_part: z(f32s(c.num_attention_heads * ATTEND_SPLITS * (c.head_dim + 2)), "attention partials")?,
        attn_count: z(4 * c.num_attention_heads.max(1), "attention counters")?,
        idx: z(4 * 4096, "attention token lists")?,
        logits: z(f32s(c.vocab_size), "logits")?,
        moe: MoeBufs::new(gpu, c, moe_layers, false, &mut *z)?,
        step_in: z(step_in_bytes(c), "the step inputs")?,
        step_host: gpu.pinned(step_in_bytes(c), "the step inputs")?,
        cand_host: gpu.pinned(2 * MAX_CANDIDATES * 4, "the sampling candidates")?,
    })
}

/// The model's scratch: [`scratch_with`] each vector an allocation of its own.
fn new_scratch(gpu: &Gpu, c: &TextConfig, moe_layers: usize) -> Result<Scratch> {
    scratch_with(gpu, c, moe_layers, &mut |n, w| gpu.zeros(n, w))
}

fn f32s(n: usize) -> usize {
    n.max(1) * 4
}

/// [`MoeBufs`]' host buffers of the experts computed on the CPU: the MoE inputs `[l, hidden]` and
/// the outputs `[l, k, hidden]` (a byte each when `on` is false).
fn cpu_expert_bufs(gpu: &Gpu, c: &TextConfig, layers: usize, on: bool) -> Result<(Pinned, Pinned)> {
    let (l, k, h) = (layers.max(1), c.num_experts_per_tok.max(1), f32s(c.hidden_size));
    let what = "experts computed on the CPU";
    Ok((gpu.pinned(if on { l * h } else { 1 }, what)?, gpu.pinned(if on { l * k * h } else { 1 }, what)?))
}

/// A flagged streamed step's flags per MoE layer ([`MoeBufs::flags`]): the read experts' fronts
/// landed (their gate/up launch waits for it), their backs landed (the down launch), and the host's
/// turn done (the next layer's router waits for it before it reads the hit map).
const FLAG_FRONT: usize = 0;
const FLAG_BACK: usize = 1;
const FLAG_TURN: usize = 2;

/// The lookahead's top-k where it runs as the routing launch's second block (`route_topk`'s `a_`
/// arguments): its logits, bias row (0: none), width, and its ids, weights and ids in host memory.
#[derive(Clone, Copy, Default)]
struct AheadTopk {
    logits: u64,
    bias: u64,
    k: usize,
    ids: u64,
    weights: u64,
    host: u64,
}

/// Clock stamps per MoE layer ([`MoeBufs::stamps`]).
const STAMPS: usize = 4;

/// The graph for `key` in `cache`, captured by `capture` where there is none. A few are kept
/// (decode steps and prompt steps, which want no logits, alternate), the latest used last.
fn cached_graph<K: PartialEq>(
    cache: &mut Vec<(K, Graph)>,
    key: K,
    capture: impl FnOnce() -> Result<Graph>,
) -> Result<&Graph> {
    const KEEP: usize = 4;
    match cache.iter().position(|(k, _)| *k == key) {
        Some(i) => {
            let g = cache.remove(i);
            cache.push(g);
        }
        None => {
            let graph = capture()?;
            if cache.len() == KEEP {
                cache.remove(0);
            }
            cache.push((key, graph));
        }
    }
    Ok(&cache.last().expect("present above").1)
}

/// The relays of `layers` MoE layers' flags ([`MoeBufs::relays`]), four u64 each: the count of
/// words to copy (high half; the low half, `seen`, zero), the flag's address, and the copy's source
/// and destination. A front or back flag's relay copies its layer's entries (`stride` bytes) from
/// the pinned `entries_host` to `entries` (the down launch reads its table before it waits for the
/// gate/up launch, which copied the same words); the turn flags' copy nothing.
fn relay_rows(layers: usize, stride: usize, flags: u64, entries_host: u64, entries: u64) -> Vec<u64> {
    (0..layers * 4)
        .flat_map(|f| {
            let flag = flags + (f * 4) as u64;
            match (f / 4, f % 4) {
                (layer, FLAG_FRONT | FLAG_BACK) => {
                    let at = (layer * stride) as u64;
                    [((stride / 8) as u64) << 32, flag, entries_host + at, entries + at]
                }
                _ => [0, flag, 0, 0],
            }
        })
        .collect()
}

/// Bytes of one MoE layer's entries in [`MoeBufs`]: `k` table entries (u64), then `k` ranks
/// (i32), padded so that the next layer's table is 8-byte aligned.
fn entries_stride(k: usize) -> usize {
    k * 8 + (k * 4).next_multiple_of(8)
}

impl MoeBufs {
    /// The MoE layers it holds rows for.
    fn layers(&self) -> usize {
        self.ready.bytes / 4
    }

    /// The device's address of MoE layer `l`'s clock stamps ([`MoeBufs::stamps`]).
    fn stamps_at(&self, l: usize) -> u64 {
        self.stamps.dev + (l * STAMPS * 8) as u64
    }

    /// MoE layer `l`'s clock stamps as the device left them ([`MoeBufs::stamps`]).
    ///
    /// # Safety
    /// No kernel that writes them may be running (the step ended with its stream sync).
    unsafe fn read_stamps(&self, l: usize) -> [u64; STAMPS] {
        // SAFETY: in bounds (STAMPS u64 a MoE layer); the caller's guarantee; read volatile, as
        // the device wrote them.
        unsafe {
            let p = self.stamps.host.cast::<u64>().add(l * STAMPS);
            std::array::from_fn(|i| p.add(i).read_volatile())
        }
    }

    /// Where MoE layer `l`'s address table starts on the device.
    fn table_at(&self, l: usize, k: usize) -> u64 {
        self.entries.at(l * entries_stride(k))
    }

    /// The device's address of MoE layer `l`'s flag `which` ([`MoeBufs::flags`]).
    fn flag_dev(&self, l: usize, which: usize) -> u64 {
        self.flags.dev + ((l * 4 + which) * 4) as u64
    }

    /// The device's address of the relay of MoE layer `l`'s flag `which` ([`MoeBufs::relays`]),
    /// for the kernels that wait for it.
    fn flag_relay(&self, l: usize, which: usize) -> u64 {
        self.relays.ptr + ((l * 4 + which) * 32) as u64
    }

    /// Zeroes every relay's `seen` on the compute stream, before the kernels that wait on them.
    fn clear_relays(&self, gpu: &Gpu) -> Result<()> {
        gpu.fill_u32_strided(self.relays.ptr, 32, 0, self.relays.bytes / 32)
            .context("clearing the flagged step's flag relays")
    }

    /// Sets MoE layer `l`'s flag `which` from the host, after everything this thread wrote before
    /// (a release store).
    fn set_flag(&self, l: usize, which: usize) {
        // SAFETY: in bounds (four u32 per MoE layer, 4-aligned); pinned memory the device reads.
        let flag = unsafe { &*(self.flags.host.cast::<std::sync::atomic::AtomicU32>().add(l * 4 + which)) };
        flag.store(1, std::sync::atomic::Ordering::Release);
    }

    /// Where MoE layer `l`'s per-rank table entries start on the device.
    fn ranks_at(&self, l: usize, k: usize) -> u64 {
        self.entries.at(l * entries_stride(k) + k * 8)
    }

    /// The buffers of `layers` MoE layers; the device ones from `z` (zeroed), so that a verifying
    /// pass's rows find each other's at one distance ([`RowScratch`](rows::RowScratch)).
    fn new(
        gpu: &Gpu,
        c: &TextConfig,
        layers: usize,
        cpu_experts: bool,
        z: &mut dyn FnMut(usize, &str) -> Result<DevBuf>,
    ) -> Result<MoeBufs> {
        let (l, k, e) = (layers.max(1), c.num_experts_per_tok.max(1), c.num_experts.max(1));
        let what = "the routing tables";
        let cpu_bufs = cpu_expert_bufs(gpu, c, layers, cpu_experts)?;
        let events = (0..l)
            .map(|_| {
                Ok([
                    gpu.event(false)?,
                    gpu.event(true)?,
                    gpu.event(true)?,
                    gpu.event(true)?,
                    gpu.event(true)?,
                    gpu.event(false)?,
                    gpu.event(true)?,
                ])
            })
            .collect::<Result<Vec<_>>>()?;
        let flags = gpu.pinned(l * 16, what)?;
        let stride = entries_stride(k);
        let entries = z(l * stride, what)?;
        let entries_host = gpu.pinned(l * stride, what)?;
        let relays = z(l * 4 * 32, what)?;
        gpu.htod(relays.ptr, &relay_rows(l, stride, flags.dev, entries_host.dev, entries.ptr))?;
        Ok(MoeBufs {
            ids: z(l * k * 4, what)?,
            weights: z(l * k * 4, what)?,
            ids_host: gpu.pinned(l * k * 4, what)?,
            weights_host: gpu.pinned(l * k * 4, what)?,
            pred_ids: z(l * 2 * k * 4, what)?,
            pred_weights: z(l * 2 * k * 4, what)?,
            pred_host: gpu.pinned(l * 2 * k * 4, what)?,
            entries,
            found: z(l * k * 8, what)?,
            entries_host,
            bias_host: gpu.pinned(l * 2 * e * 4, what)?,
            bias_next: 0,
            stamps: gpu.pinned(l * STAMPS * 8, what)?,
            ready: gpu.pinned(l * 4, what)?,
            flags,
            relays,
            x_host: cpu_bufs.0,
            cpu_out: cpu_bufs.1,
            map: None,
            decided: false,
            events,
        })
    }
}

impl CudaModel {
    /// Uploads the dense weights and binds the expert pool (whose slots live on this GPU).
    pub fn new(store: Arc<Store>, gpu: Arc<Gpu>, pool: Arc<ExpertPool<DeviceSlots>>) -> Result<CudaModel> {
        let attend_cluster =
            std::env::var_os("CHERENKOV_NO_ATTEND_CLUSTER").is_none() && gpu.info.compute_capability.0 >= 9;
        let c = store.config().clone();
        if !Arc::ptr_eq(pool.memory().gpu(), &gpu) {
            bail!("the expert pool's slots live on another GPU handle than the model's");
        }
        let host = Weights::load(&store).with_context(|| format!("loading weights from {}", store.dir.display()))?;
        let weights = DeviceWeights::upload(&gpu, &store, &host)?;
        for l in &store.manifest.experts.layers {
            expert_kernels(l)?;
        }
        // Copies from a pinned expert file land the gate and up projections first, where the
        // records' layout puts them ahead of the down projection.
        if std::env::var_os("CHERENKOV_WHOLE_COPIES").is_none() {
            pool.memory().set_front_bytes(front_bytes(&store.manifest.experts.layers));
        }
        let device_hits = std::env::var("CHERENKOV_DEVICE_HITS").map_or(true, |v| v != "0");
        if device_hits {
            let tags = store.manifest.experts.layers.iter().map(layer_tag).collect();
            pool.memory().enable_hit_map(tags, c.num_experts)?;
        }
        if c.num_experts > 1024 || c.num_experts_per_tok > 64 || c.num_experts_per_tok > c.num_experts {
            bail!(
                "{} experts top-{}: the CUDA router handles at most 1024 experts and top-64",
                c.num_experts,
                c.num_experts_per_tok
            );
        }
        let rd = c.rotary_dim();
        let inv: Vec<f32> = (0..rd / 2).map(|i| 1.0 / (c.rope_theta as f32).powf((2 * i) as f32 / rd as f32)).collect();
        let inv_freq = gpu.alloc(f32s(inv.len()), "RoPE tables")?;
        gpu.htod(inv_freq.ptr, &inv)?;
        let ngram = (0..c.num_hidden_layers).map(|i| c.ple_index(i).map(|k| NgramHash::new(&c, k))).collect();
        let scratch = new_scratch(&gpu, &c, store.manifest.experts.layers.len())?;
        gpu.sync()?;
        let predicted = Mutex::new(vec![None; store.manifest.experts.layers.len()]);
        let replay_events = [gpu.event(true)?, gpu.event(true)?];
        Ok(CudaModel {
            store,
            gpu,
            pool,
            skew: None,
            model_no: {
                static MODELS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
                MODELS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            },
            flag_steps: std::sync::atomic::AtomicU64::new(0),
            lookahead: true,
            lookahead_width: std::env::var("CHERENKOV_LOOKAHEAD_WIDTH")
                .ok()
                .and_then(|w| w.parse().ok())
                .unwrap_or(0usize)
                .clamp(c.num_experts_per_tok, 2 * c.num_experts_per_tok),
            lookahead_rides: std::env::var_os("CHERENKOV_LOOKAHEAD_OWN_LAUNCH").is_none(),
            lookahead_topk_beside: std::env::var_os("CHERENKOV_LOOKAHEAD_OWN_TOPK").is_none(),
            lookahead_reads: match std::env::var("CHERENKOV_LOOKAHEAD_READS").ok().and_then(|n| n.parse().ok()) {
                Some(0) => None,
                Some(n) => Some(n),
                None => Some(2),
            },
            shared_beside: std::env::var_os("CHERENKOV_NO_SIDE_STREAM").is_none(),
            shared_ride: std::env::var_os("CHERENKOV_NO_SHARED_RIDE").is_none(),
            shared_gate_up_ride: std::env::var_os("CHERENKOV_NO_SHARED_GATE_UP_RIDE").is_none(),
            route_sum: std::env::var_os("CHERENKOV_NO_ROUTE_SUM").is_none(),
            read_sum: std::env::var_os("CHERENKOV_NO_READ_SUM").is_none(),
            gdn_digits: std::env::var_os("CHERENKOV_NO_GDN_DIGITS").is_none(),
            attend_gate: std::env::var_os("CHERENKOV_NO_ATTEND_GATE").is_none(),
            attend_digits: std::env::var_os("CHERENKOV_NO_ATTEND_DIGITS").is_none(),
            attend_cluster,
            inject_beside: std::env::var_os("CHERENKOV_NO_INJECT_BESIDE").is_none(),
            reads_first: std::env::var("CHERENKOV_READS_FIRST").map_or(true, |v| v != "0"),
            device_hits,
            router_poll: std::env::var("CHERENKOV_ROUTER_POLL").map_or(true, |v| v != "0"),
            ghosts_before_turn: std::env::var("CHERENKOV_GHOSTS_BEFORE_TURN").is_ok_and(|v| v == "1"),
            prefetch_here: match std::env::var("CHERENKOV_PREFETCH_HERE").as_deref() {
                Ok("0") => PrefetchHere::Threads,
                Ok("2") => PrefetchHere::AfterTurn,
                _ => PrefetchHere::BeforeTurn,
            },
            step_graph: std::env::var("CHERENKOV_STEP_GRAPH").map_or(true, |v| v != "0"),
            flag_graphs: Mutex::new(Vec::new()),
            joins_deferred: std::sync::atomic::AtomicBool::new(false),
            cut_weak: None,
            cpu_experts: None,
            graphs: std::env::var_os("CHERENKOV_NO_GRAPHS").is_none(),
            segments: std::env::var_os("CHERENKOV_NO_SEGMENT_GRAPHS").is_none(),
            segments_cache: Mutex::new(SegmentGraphs::default()),
            events_beside: std::env::var_os("CHERENKOV_EVENTS_IN_LINE").is_none(),
            depth: c.num_hidden_layers,
            anatomy: false,
            replay_timing: false,
            replay_events,
            graph: Mutex::new(Vec::new()),
            mtp_graphs: Mutex::new(Vec::new()),
            verify_rows: std::sync::atomic::AtomicBool::new(
                std::env::var("CHERENKOV_VERIFY_ROWS").map_or(true, |v| v != "0"),
            ),
            rows_run: std::sync::atomic::AtomicU64::new(0),
            rows_fused: std::env::var_os("CHERENKOV_ROWS_APART").is_none(),
            rows_in_proj_x2: std::env::var_os("CHERENKOV_ROWS_IN_PROJ_APART").is_none(),
            rows_moe: std::env::var_os("CHERENKOV_ROWS_MOE_APART").is_none(),
            rows_attn_x2: std::env::var_os("CHERENKOV_ROWS_ATTN_APART").is_none(),
            rows_layers: Mutex::new(rows::RowsLayers::default()),
            row_scratch: Mutex::new(None),
            rows_graphs: Mutex::new(Vec::new()),
            predicted,
            timing: Mutex::new(StepTiming::default()),
            weights,
            inv_freq,
            ngram,
            scratch: Mutex::new(scratch),
        })
    }

    pub fn config(&self) -> &TextConfig {
        self.store.config()
    }

    /// Computes misses on the CPU from now on when that ends a block sooner (see
    /// [`crate::offload`]), with `threads` threads; the deadline cut must be off (the two would
    /// reorder one table). Without a pinned expert file every record is checked first
    /// (`progress(bytes checked)`).
    pub fn set_cpu_experts(&mut self, threads: usize, progress: &(dyn Fn(u64) + Sync)) -> Result<()> {
        if self.cut_weak.is_some() {
            bail!("--cpu-experts and --cut-weak cannot be combined");
        }
        let cx = crate::offload::CpuExperts::new(&self.pool, threads, progress)?;
        let c = self.config().clone();
        let sc = self.scratch.get_mut().unwrap_or_else(|e| e.into_inner());
        let layers = self.store.manifest.experts.layers.len();
        (sc.moe.x_host, sc.moe.cpu_out) = cpu_expert_bufs(&self.gpu, &c, layers, true)?;
        self.cpu_experts = Some(cx);
        Ok(())
    }

    /// The copy and CPU rates `--cpu-experts` chooses by (ns per expert), if it is on.
    pub fn cpu_expert_rates(&self) -> Option<(u64, u64)> {
        self.cpu_experts.as_ref().map(|cx| (cx.copy_ns, cx.cpu_ns()))
    }

    pub fn timing(&self) -> StepTiming {
        *self.timing.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn reset_timing(&self) {
        *self.timing.lock().unwrap_or_else(|e| e.into_inner()) = StepTiming::default();
    }

    fn add_timing(&self, f: impl FnOnce(&mut StepTiming)) {
        f(&mut self.timing.lock().unwrap_or_else(|e| e.into_inner()));
    }

    pub fn new_session(&self) -> Result<CudaSession> {
        CudaSession::new(self.gpu.clone(), self.config())
    }

    /// Runs tokens one at a time; logits as for the CPU backend.
    pub fn forward_tokens(&self, s: &mut CudaSession, tokens: &[u32], which: Logits) -> Result<Vec<f32>> {
        let all = which == Logits::All;
        uncommitted(s)?;
        self.run_steps(s, tokens, |last| if all || last { Want::Logits } else { Want::Nothing }, &mut |m, s, sc, i| {
            m.mtp_catch_up(s, sc, tokens[i])
        })
    }

    /// Runs `tokens` and returns the `k` largest logits of the last one among ids below `among`, as
    /// (id, logit), descending (ties to the lower id), chosen on the device: the host samples from
    /// them without copying the vocabulary back. `k` is at most 1024.
    pub fn forward_candidates(
        &self,
        s: &mut CudaSession,
        tokens: &[u32],
        k: usize,
        among: usize,
    ) -> Result<Vec<(u32, f32)>> {
        let (k, among) = candidate_counts(self.config(), k, among);
        uncommitted(s)?;
        let want = |last| if last { Want::Top { k, among } } else { Want::Nothing };
        let out = self.run_steps(s, tokens, want, &mut |m, s, sc, i| m.mtp_catch_up(s, sc, tokens[i]))?;
        Ok(candidates_from(&out, k, among))
    }

    /// Checks `tokens`, makes room in the session, and runs one step per token; `want(last)` says
    /// what each step leaves in the output, and `after(model, session, scratch, i)` runs after the
    /// step of `tokens[i]` (its residual row still in the scratch). Records the steps' timing and
    /// the forward.
    fn run_steps(
        &self,
        s: &mut CudaSession,
        tokens: &[u32],
        want: impl Fn(bool) -> Want,
        after: &mut dyn FnMut(&Self, &mut CudaSession, &mut Scratch, usize) -> Result<()>,
    ) -> Result<Vec<f32>> {
        let c = self.config();
        if tokens.is_empty() {
            bail!("forward needs at least one token");
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            bail!("token id {bad} is outside the vocabulary (vocab_size {})", c.vocab_size);
        }
        s.reserve(c, s.pos + tokens.len() + 1)?;
        let mut sc = self.scratch.lock().unwrap();
        self.gpu.bind()?;
        let call = std::time::Instant::now();
        let mut out = Vec::new();
        for (i, &tok) in tokens.iter().enumerate() {
            let t0 = std::time::Instant::now();
            self.step(s, &mut sc, tok, want(i + 1 == tokens.len()), &mut out)?;
            let ns = t0.elapsed().as_nanos() as u64;
            self.add_timing(|t| {
                t.steps += 1;
                t.total_ns += ns;
            });
            after(self, s, &mut sc, i)?;
        }
        self.pool.record_forward(tokens.len() as u64, call.elapsed().as_nanos() as u64);
        Ok(out)
    }

    fn step(&self, s: &mut CudaSession, sc: &mut Scratch, tok: u32, want: Want, out: &mut Vec<f32>) -> Result<()> {
        let c = self.config().clone();
        let g = &*self.gpu;
        self.decide_residency(sc)?;
        let mut st = MoeStep::new();
        let timed = match &g.timeline {
            Some(t) => t.begin_step(|| g.sync())?,
            None => false,
        };
        // Host inputs first (token and position, n-gram rows, synthetic-router biases), so the
        // device work below never waits for the host when every expert is resident.
        self.set_step_inputs(sc, tok, s.pos)?;
        for (i, layer) in self.weights.layers.iter().enumerate().take(self.depth) {
            if let (Some(_), Some(hash)) = (&layer.ple, &self.ngram[i]) {
                self.ple_gather(sc, hash, i, tok, &s.ngram_context)?;
            }
            self.write_bias(sc, layer.moe.expert_slot, 0)?;
        }
        // A replayable step: every expert resident and attention below the QSA budget (past it the
        // host picks the visible blocks).
        let dense_attention = c.qsa.as_ref().is_none_or(|q| (s.pos + 1) / q.compress_ratio <= q.block_topk());
        let flagged = sc.moe.map.is_none()
            && self.step_graph
            && self.graphs
            && self.segments
            && self.router_poll
            && self.finds_hits()
            && dense_attention;
        if sc.moe.map.is_some() && dense_attention && self.graphs {
            self.replay_step(s, sc, want, &mut st)?;
        } else if flagged {
            self.step_flagged(s, sc, want, &mut st)?;
        } else {
            self.queue_step(s, sc, want, &mut st)?;
        }
        // The benchmark's synthetic routers draw the next token's noise while the device runs
        // this step, not before the next step's work is queued (a streamed block drew its own
        // layer's already).
        if let Some(sk) = &self.skew {
            for layer in self.weights.layers.iter().take(self.depth) {
                sk.prepare_noise(layer.moe.expert_slot, c.num_experts, false);
            }
        }
        advance_context(c.ngram_size, &mut s.ngram_context, &[tok]);
        s.pos += 1;
        st.queued_ns = Some(st.start.elapsed().as_nanos() as u64);
        self.read_output(sc, want, out)?;
        self.finish_step(sc, st)?;
        if timed && let Some(t) = &g.timeline {
            t.end_step(|| g.sync())?;
        }
        Ok(())
    }

    /// Appends what `want` asks of the step that just ran on `sc` to `out`: its logits, or its
    /// candidates' ids (as f32 bit patterns) then their values.
    fn read_output(&self, sc: &Scratch, want: Want, out: &mut Vec<f32>) -> Result<()> {
        match want {
            Want::Nothing => {}
            Want::Logits => {
                let mut logits = vec![0f32; self.config().vocab_size];
                self.gpu.dtoh(sc.logits.ptr, &mut logits)?;
                out.extend_from_slice(&logits);
            }
            Want::Top { k, .. } => {
                let top = self.read_candidates(sc, k)?;
                out.extend(top.iter().map(|&(i, _)| f32::from_bits(i)));
                out.extend(top.iter().map(|&(_, v)| v));
            }
        }
        Ok(())
    }

    /// Queues the device work of one step (inputs already written by the host): upload of the
    /// step inputs, embedding, every layer, and unless `want` is nothing the final mixer and
    /// lm_head, then for candidates their choice ([`CudaModel::queue_candidates`]).
    fn queue_step<'p>(&'p self, s: &mut CudaSession, sc: &mut Scratch, want: Want, st: &mut MoeStep<'p>) -> Result<()> {
        let g = &*self.gpu;
        let w = &self.weights;
        self.upload_step_inputs(sc)?;
        w.embed_tokens.embed(g, sc.step_in.ptr, sc.x.ptr, self.config().hc_count)?;
        let pos = s.pos;
        let depth = self.depth.min(w.layers.len());
        if sc.moe.map.is_none() && self.finds_hits() {
            // SAFETY: the previous step's kernels that wrote these ended with its stream sync.
            unsafe { self.clear_block_marks(&sc.moe, 0..sc.moe.layers()) };
        }
        // Streaming, each layer's work up to its MoE block's routing is replayed from a graph of
        // its own (`segments`), where nothing in it waits for the host.
        let c = self.config();
        let dense_attention = c.qsa.as_ref().is_none_or(|q| (pos + 1) / q.compress_ratio <= q.block_topk());
        let anatomy_event = self.anatomy && !st.untimed;
        let segment_key =
            (sc.moe.map.is_none() && self.graphs && self.segments && dense_attention).then_some(SegmentKey {
                session: s.id,
                generation: s.generation,
                depth,
                lookahead: self.lookahead,
                cpu_experts: self.cpu_experts.is_some(),
                cut_weak: self.cut_weak.is_some(),
                anatomy_event,
                device_hits: self.finds_hits(),
            });
        for (i, (layer, ls)) in w.layers.iter().zip(s.layers.iter_mut()).enumerate().take(depth) {
            let next = w.layers[..depth].get(i + 1).map(|l| &l.moe);
            match segment_key {
                Some(key) => {
                    // The head's host input: the lookahead's bias row (written again at each replay).
                    if let Some(n) = next.filter(|_| self.lookahead) {
                        self.write_bias(sc, n.expert_slot, 1)?;
                    }
                    let mut segs = self.segments_cache.lock().unwrap_or_else(|e| e.into_inner());
                    if segs.key != Some(key) {
                        segs.key = Some(key);
                        segs.graphs.clear();
                    }
                    segs.graphs.resize_with(depth, || None);
                    if segs.graphs[i].is_none() {
                        let graph = self
                            .gpu
                            .capture(|| self.queue_layer_head(sc, layer, ls, pos, next, anatomy_event, 0))
                            .with_context(|| format!("decoder layer {i}'s segment graph (streamed step)"))?;
                        segs.graphs[i] = Some(graph);
                    }
                    self.gpu.replay(segs.graphs[i].as_ref().expect("captured above"))?;
                    // What queueing the head does on the host: the attention's count of complete
                    // QSA blocks (the captured kernels advance them on the device).
                    if let (MixerState::Attention(a), Some(q)) = (&mut ls.mixer, &c.qsa) {
                        a.blocks = (pos + 1) / q.compress_ratio;
                    }
                }
                None => self.queue_layer_head(sc, layer, ls, pos, next, anatomy_event, 0)?,
            }
            // The head is on the stream either way: `moe` queues the rest.
            st.head_queued = true;
            // The combination injects the MoE output (no separate hc_inject).
            st.inject = true;
            self.moe(sc, &layer.moe, next, st)?;
        }
        if want != Want::Nothing {
            self.hc_read(sc, &w.hyper_connection_mixer)?;
            w.lm_head.matvec(g, sc.inp.ptr, sc.logits.ptr)?;
        }
        if let Want::Top { k, among } = want {
            self.queue_candidates(sc, k, among, radix_candidates())?;
        }
        // The last streamed blocks' noise draws, while the step ends.
        self.draw_noise(st);
        if sc.moe.map.is_some() {
            // Every layer's routing, for the host's accounting after the step.
            let bytes = sc.moe.ids.bytes.min(sc.moe.ids_host.bytes);
            g.download(&sc.moe.ids_host, 0, sc.moe.ids.ptr, bytes)?;
        }
        Ok(())
    }

    /// A streamed step replayed whole from one graph (the default, `CHERENKOV_STEP_GRAPH=0` turns
    /// it off; where every block's router finds its landed experts, the host polls the routers'
    /// flags and attention is below the QSA budget). The graph ([`CudaModel::queue_flagged_step`])
    /// holds every layer's head, then its read experts and combination, which wait in their
    /// kernels for flags: the read experts' gate/up for their fronts to land and the down
    /// projections for their backs (set by the copy stream behind the block's copies, or by the
    /// host where nothing is copying), and each router for the previous block's turn to be done
    /// (the hit map and the slots the host retires change only in a turn). After launching it the
    /// host takes each block's turn in order ([`CudaModel::turn_flagged`]): it launches nothing
    /// per layer, so no launch or graph boundary sits between a block's copies and its kernels or
    /// between two layers.
    fn step_flagged<'p>(
        &'p self,
        s: &mut CudaSession,
        sc: &mut Scratch,
        want: Want,
        st: &mut MoeStep<'p>,
    ) -> Result<()> {
        let c = self.config();
        let w = &self.weights;
        let depth = self.depth.min(w.layers.len());
        // SAFETY: the previous step's kernels that wrote these ended with its stream sync.
        unsafe { self.clear_block_marks(&sc.moe, 0..sc.moe.layers()) };
        // The heads' host inputs: the lookahead's bias rows (the routers' were written already).
        if self.lookahead {
            for layer in w.layers.iter().take(depth).skip(1) {
                self.write_bias(sc, layer.moe.expert_slot, 1)?;
            }
        }
        let key = (GraphKey { session: s.id, generation: s.generation, want, depth }, self.lookahead);
        {
            let mut graphs = self.flag_graphs.lock().unwrap_or_else(|e| e.into_inner());
            let graph = cached_graph(&mut graphs, key, || {
                use std::sync::atomic::Ordering::Relaxed;
                self.joins_deferred.store(true, Relaxed);
                let graph = self.gpu.capture(|| self.queue_flagged_step(s, sc, want));
                self.joins_deferred.store(false, Relaxed);
                graph.context("the streamed step's graph (CHERENKOV_STEP_GRAPH)")
            })?;
            self.gpu.replay(graph)?;
        }
        // What queueing the heads does on the host: the attention's count of complete QSA blocks
        // (the captured kernels advance them on the device).
        let pos = s.pos;
        for l in &mut s.layers {
            if let (MixerState::Attention(a), Some(q)) = (&mut l.mixer, &c.qsa) {
                a.blocks = (pos + 1) / q.compress_ratio;
            }
        }
        for (i, layer) in w.layers.iter().enumerate().take(depth) {
            let next = w.layers[..depth].get(i + 1).map(|l| &l.moe).filter(|_| self.lookahead);
            self.turn_flagged(sc, &layer.moe, next, st)?;
        }
        // The last blocks' noise draws, while the step ends.
        self.draw_noise(st);
        Ok(())
    }

    /// The device work of a flagged step ([`CudaModel::step_flagged`]), for its graph: as
    /// [`CudaModel::queue_step`], each layer's head followed by its block's tail
    /// ([`CudaModel::queue_flagged_tail`]), each router after the previous block's turn flag.
    fn queue_flagged_step(&self, s: &mut CudaSession, sc: &mut Scratch, want: Want) -> Result<()> {
        let g = &*self.gpu;
        let w = &self.weights;
        self.upload_step_inputs(sc)?;
        w.embed_tokens.embed(g, sc.step_in.ptr, sc.x.ptr, self.config().hc_count)?;
        let pos = s.pos;
        let depth = self.depth.min(w.layers.len());
        sc.moe.clear_relays(g)?;
        let mut after = 0u64;
        for (i, (layer, ls)) in w.layers.iter().zip(s.layers.iter_mut()).enumerate().take(depth) {
            let next = w.layers[..depth].get(i + 1).map(|l| &l.moe);
            self.queue_layer_head(sc, layer, ls, pos, next, false, after)?;
            self.queue_flagged_tail(sc, &layer.moe)?;
            after = sc.moe.flag_relay(layer.moe.expert_slot, FLAG_TURN);
        }
        if want != Want::Nothing {
            self.hc_read(sc, &w.hyper_connection_mixer)?;
            w.lm_head.matvec(g, sc.inp.ptr, sc.logits.ptr)?;
        }
        if let Want::Top { k, among } = want {
            self.queue_candidates(sc, k, among, radix_candidates())?;
        }
        // The heads' side stream, left unjoined (`joins_deferred`), rejoins: a capture ends joined.
        if self.gpu.capturing() && self.events_beside {
            g.join()?;
        }
        Ok(())
    }

    /// A flagged block's tail, queued in the step's graph behind its head (whose launch computed
    /// the found experts): the read experts, a launch of k entries that skips zero ones, behind the
    /// block's front and back flags, their table and the per-rank rows the host writes in its turn
    /// copied to the device by those flags' relays; then the combination (injected, its stamp
    /// the block's end).
    fn queue_flagged_tail(&self, sc: &Scratch, m: &crate::weights::Moe) -> Result<()> {
        let c = self.config();
        let k = c.num_experts_per_tok;
        let l = m.expert_slot;
        let mb = &sc.moe;
        let layout = &self.store.manifest.experts.layers[l];
        let row = mb.table_at(l, k);
        // The gate/up launch stamps when its flag's wait began and ended ([`MoeBufs::stamps`]).
        let io = crate::weights::ExpertIo {
            wait_front: mb.flag_relay(l, FLAG_FRONT),
            wait_back: mb.flag_relay(l, FLAG_BACK),
            stamp: mb.stamps_at(l) + 16,
            ..self.read_expert_io(sc)
        };
        self.launch_experts(layout, row, 0, k, &mut || Ok(()), io)?;
        let [_, _, _, shared, _, _, _] = &sc.big;
        let shared_out = self.shared_riding(sc, m).map_or(shared.ptr, |r| r.out);
        let stamp = mb.stamps_at(l) + 8;
        self.launch_combine(&self.gpu, sc, l, row + (k * 8) as u64, shared_out, true, stamp)
    }

    /// A flagged block's turn ([`CudaModel::step_flagged`]), on the host while the step's graph
    /// runs: as [`CudaModel::moe_found`]'s, but instead of launching the read experts and the
    /// combination it writes their table and per-rank rows into the pinned entries and sets the
    /// block's flags: behind the copies on the copy stream where a read expert is still copying,
    /// else at once; then the lookahead's reads, queued on the copy stream by this thread (no IO
    /// thread to wake: in a flagged step this thread launches nothing else); then the turn flag,
    /// once the landed records are published in the hit map; last the adaptive policy's ghost
    /// replay, which the next router does not wait for.
    fn turn_flagged<'p>(
        &'p self,
        sc: &Scratch,
        m: &crate::weights::Moe,
        ahead_of: Option<&crate::weights::Moe>,
        st: &mut MoeStep<'p>,
    ) -> Result<()> {
        let l = m.expert_slot;
        let mb = &sc.moe;
        let mem = self.pool.memory();
        st.routed.push(l);
        self.draw_noise(st);
        let waiting = Instant::now();
        self.await_router(mb, l)?;
        let seen = Instant::now();
        let since = |at: Instant| at.duration_since(seen).as_nanos() as u64;
        let mut marks = [0u64; 5];
        st.pending = None;
        // The map changes only in turns, and this router waited for the last one.
        let (experts, _, lease, rest) = self.lease_found(mb, l)?;
        marks[0] = since(Instant::now());
        let entries = lease.entries();
        // SAFETY: the device reads this layer's row only behind its flags, set below; the previous
        // step's reads of it ended with its stream sync.
        unsafe { self.write_found_rows(mb, l, &lease, &rest) };
        let mut copying = false;
        // Hits whose copies from the pinned file still run: prefetches not landed yet (the pool
        // counts such a load done once its copy is queued, so the lease's `inflight` misses them).
        let mut late = 0;
        for &r in &rest {
            lease.wait(r)?;
            let still = mem.still_copying(entries[r].slot)?;
            copying |= still;
            late += usize::from(still && entries[r].hit);
        }
        if copying {
            mem.signal_after_copies(mb.flag_dev(l, FLAG_FRONT))?;
            mem.queue_backs()?;
            mem.signal_after_copies(mb.flag_dev(l, FLAG_BACK))?;
        } else {
            mem.queue_backs()?;
            mb.set_flag(l, FLAG_FRONT);
            mb.set_flag(l, FLAG_BACK);
        }
        marks[1] = since(Instant::now());
        if !st.untimed && !self.anatomy {
            st.stamped.push(l);
            st.whole_stamped.push(l);
            st.flag_waited.push(l);
        }
        // The next router waits for the turn flag, which needs the lookahead's retires and the
        // landed records published; the ghosts' replay (the pool's own bookkeeping) can follow it.
        if self.ghosts_before_turn {
            self.pool.replay_ghosts();
        }
        let here = self.prefetch_here;
        let prefetched = self.queue_lookahead(mb, l, &experts, ahead_of, here != PrefetchHere::Threads)?;
        if here == PrefetchHere::BeforeTurn {
            self.pool.load_prefetches();
        }
        marks[2] = since(Instant::now());
        mem.publish_landed()?;
        mb.set_flag(l, FLAG_TURN);
        marks[3] = since(Instant::now());
        if here == PrefetchHere::AfterTurn {
            self.pool.load_prefetches();
        }
        if !self.ghosts_before_turn {
            self.pool.replay_ghosts();
        }
        marks[4] = since(Instant::now());
        let router_wait_ns = seen.duration_since(waiting).as_nanos() as u64;
        let f = &mut st.flagged;
        f.blocks += 1;
        f.router_wait_ns += router_wait_ns;
        (0..5).for_each(|i| f.marks[i] += marks[i]);
        if flag_blocks_path().is_some() && !st.untimed {
            st.flag_rows.push(FlagRow {
                layer: l,
                misses: lease.misses(),
                inflight: lease.inflight() + late,
                rest: rest.len(),
                copying,
                prefetched,
                router_wait_ns,
                marks,
            });
        }
        self.end_block(st, l, lease);
        Ok(())
    }

    /// Queues decoder layer `layer` up to its MoE block's routing: the PLE, the mixer with its
    /// hyper-connection read, the MoE block's read and its head ([`CudaModel::moe_head`], with
    /// its timed router-ready event where `anatomy_event`).
    #[allow(clippy::too_many_arguments)]
    fn queue_layer_head(
        &self,
        sc: &mut Scratch,
        layer: &crate::weights::Layer,
        ls: &mut crate::session::LayerState,
        pos: usize,
        next: Option<&crate::weights::Moe>,
        anatomy_event: bool,
        after: u64,
    ) -> Result<()> {
        if let Some(p) = &layer.ple {
            let state = ls.ple_conv.as_ref().context("PLE state")?;
            self.ple(sc, p, state)?;
        }
        self.hc_read(sc, &layer.attn_hc)?;
        self.queue_mixer(sc, layer, ls, pos)?;
        self.hc_read(sc, &layer.mlp_hc)?;
        self.moe_head(sc, &layer.moe, next, anatomy_event, after)
    }

    /// Where a mixer's output projection puts its rows: injected into the residual streams of `sc`.
    pub(crate) fn mixer_out(&self, sc: &Scratch) -> MatvecOutput {
        MatvecOutput::Inject { x: sc.x.ptr, inj: sc.inj.ptr, hc: self.config().hc_count, scratch: sc.out.ptr }
    }

    /// A decoder layer's mixer (GDN or attention) at position `pos`, its input read into `inp`;
    /// its output projection injects its rows into the residual as it writes them.
    fn queue_mixer(
        &self,
        sc: &mut Scratch,
        layer: &crate::weights::Layer,
        ls: &mut crate::session::LayerState,
        pos: usize,
    ) -> Result<()> {
        let out = self.mixer_out(sc);
        match (&layer.mixer, &mut ls.mixer) {
            (Mixer::Gdn(gw), MixerState::Gdn { conv, recurrent }) => self.gdn(sc, gw, conv, recurrent, out),
            (Mixer::Attention(aw), MixerState::Attention(a)) => self.attention(sc, aw, a, pos, out, true),
            _ => unreachable!("session built for this model"),
        }
    }

    /// Runs the step as a replay of a captured graph, capturing it first when there is none for
    /// this session's buffers. Only for steps that never wait for the host.
    fn replay_step<'p>(
        &'p self,
        s: &mut CudaSession,
        sc: &mut Scratch,
        want: Want,
        st: &mut MoeStep<'p>,
    ) -> Result<()> {
        let c = self.config();
        let key = GraphKey { session: s.id, generation: s.generation, want, depth: self.depth };
        let mut graphs = self.graph.lock().unwrap_or_else(|e| e.into_inner());
        let graph = cached_graph(&mut graphs, key, || {
            let mut throwaway = MoeStep::new();
            throwaway.untimed = true;
            self.gpu.capture(|| self.queue_step(s, sc, want, &mut throwaway))
        })?;
        if self.replay_timing {
            let inputs_ns = st.start.elapsed().as_nanos() as u64;
            let t = Instant::now();
            self.gpu.record(&self.replay_events[0])?;
            self.gpu.replay(graph)?;
            self.gpu.record(&self.replay_events[1])?;
            st.replay_timed = Some([inputs_ns, t.elapsed().as_nanos() as u64]);
        } else {
            self.gpu.replay(graph)?;
        }
        // The replay routes every MoE layer (on the device, from the resident map).
        st.untimed = true;
        st.routed.extend(self.weights.layers.iter().take(self.depth).map(|l| l.moe.expert_slot));
        // The QSA block counters the captured kernels advance on the device.
        let pos = s.pos;
        for l in &mut s.layers {
            if let (MixerState::Attention(a), Some(q)) = (&mut l.mixer, &c.qsa) {
                a.blocks = (pos + 1) / q.compress_ratio;
            }
        }
        Ok(())
    }

    /// Writes the step inputs and queues their upload (the kernel checks: one block at a time).
    pub(crate) fn load_step_inputs(&self, sc: &Scratch, tok: u32, pos: usize) -> Result<()> {
        self.set_step_inputs(sc, tok, pos)?;
        self.upload_step_inputs(sc)
    }

    /// Queues the upload of the step inputs: token, position and the PLE rows the host gathered
    /// ([`CudaModel::ple_gather`]), one copy at the step's start (a copy between two kernels
    /// costs the step its latency: about 13-19 us where the PLE rows had one of their own).
    pub(crate) fn upload_step_inputs(&self, sc: &Scratch) -> Result<()> {
        self.gpu.upload(sc.step_in.ptr, &sc.step_host, 0, sc.step_host.bytes)
    }

    /// Writes the step's token and position into pinned memory (uploaded by the step's work).
    pub(crate) fn set_step_inputs(&self, sc: &Scratch, tok: u32, pos: usize) -> Result<()> {
        let pos = i32::try_from(pos).context("position past 2^31")?;
        // SAFETY: the previous step's upload finished (steps end with a stream sync).
        unsafe { sc.step_host.as_mut_slice::<i32>()[..2].copy_from_slice(&[tok as i32, pos]) };
        Ok(())
    }

    /// Ends a step's MoE work: waits for the stream, releases the last lease, and accounts the
    /// routing (statistics; with every expert resident also the pool's counters, which the step
    /// never asked) and the expert kernels' GPU time.
    pub(crate) fn finish_step(&self, sc: &Scratch, st: MoeStep<'_>) -> Result<()> {
        let queue_ns = st.queued_ns.unwrap_or_else(|| st.start.elapsed().as_nanos() as u64);
        self.gpu.sync()?;
        let synced = Instant::now();
        drop(st.pending);
        let c = self.config();
        let (k, e) = (c.num_experts_per_tok, c.num_experts);
        let mb = &sc.moe;
        // SAFETY: the stream is idle: no kernel writes the host copy now.
        let ids_host = unsafe { mb.ids_host.as_slice::<i32>() };
        let (mut experts_ns, mut gpu_wait_ns) = (0u64, 0u64);
        for &l in &st.routed {
            let ids: Vec<usize> = ids_host[l * k..(l + 1) * k].iter().map(|&i| i as usize).collect();
            // Every expert resident: the step ran from them; only the accounting is left (one lock,
            // no lease, where they are all resident as they should be).
            if mb.map.is_some() && !self.pool.record_hits(l, &ids) {
                drop(self.pool.acquire(l, &ids)?);
            }
            if let Some(sk) = &self.skew {
                sk.observe(l, &ids, e);
            }
            if st.untimed {
                continue;
            }
            let ev = &mb.events[l];
            let ms = |a: &Event, b: &Event| -> Result<u64> { Ok((b.since(a)? as f64 * 1e6) as u64) };
            let stamped = if st.stamped.contains(&l) {
                // SAFETY: written by kernels of this step, which ended with the stream sync before
                // this call; read as the device left them.
                let [start, end, ..] = unsafe { mb.read_stamps(l) };
                // Both written (a kernel always writes its stamp; 0 would mean it did not run).
                if start > 0 && end >= start { end - start } else { 0 }
            } else {
                0
            };
            // Every expert resident: the stamps, or for the anatomy the events around the experts.
            // Streaming: the resident experts' events, then the read experts' stamps or events.
            let mut ns = stamped;
            let whole = st.stamped.contains(&l) && (mb.map.is_some() || st.whole_stamped.contains(&l));
            if !whole {
                ns += ms(&ev[1], &ev[2])?;
            }
            if st.read_timed.contains(&l) {
                ns += ms(&ev[3], &ev[4])?;
            }
            if st.gpu_waited.contains(&l) {
                let w = ms(&ev[2], &ev[3])?;
                self.pool.record_wait(l, w);
                gpu_wait_ns += w;
                if st.found.contains(&l) {
                    ns = ns.saturating_sub(w);
                }
            }
            if st.flag_waited.contains(&l) {
                // SAFETY: as the stamps above.
                let [_, _, past, began] = unsafe { mb.read_stamps(l) };
                if began > 0 && past >= began {
                    let w = past - began;
                    self.pool.record_wait(l, w);
                    gpu_wait_ns += w;
                    ns = ns.saturating_sub(w);
                }
            }
            self.pool.record_compute(l, ns);
            experts_ns += ns;
        }
        if !st.flag_rows.is_empty() {
            self.write_flag_rows(mb, &st.flag_rows);
        }
        let anatomy = if st.untimed || !self.anatomy {
            BlockAnatomy::default()
        } else {
            BlockAnatomy {
                host_turn_ns: st.host_turn_ns,
                host_loads_ns: st.host_loads_ns,
                host_resident_ns: st.host_resident_ns,
                host_marks: st.host_marks,
                host_batch_marks: st.host_batch_marks,
                ..self.block_anatomy(mb, &st.blocks, &st.read_timed)?
            }
        };
        let replay = match st.replay_timed {
            Some([inputs_ns, launch_ns]) => ReplayTiming {
                steps: 1,
                // Both recorded before the stream sync above.
                gpu_ns: (self.replay_events[1].since(&self.replay_events[0])? as f64 * 1e6) as u64,
                inputs_ns,
                launch_ns,
                account_ns: synced.elapsed().as_nanos() as u64,
            },
            None => ReplayTiming::default(),
        };
        self.add_timing(|t| {
            t.replay.add(&replay);
            t.anatomy.add(&anatomy);
            t.flagged.add(&st.flagged);
            t.wait_ns += st.wait_ns + gpu_wait_ns;
            t.experts_ns += experts_ns;
            t.queue_ns += queue_ns;
            t.cut += st.cut;
            t.cpu_experts += st.cpu_experts;
            t.cpu_wait_ns += st.cpu_wait_ns;
        });
        Ok(())
    }

    /// Appends a flagged step's per-block rows to the `CHERENKOV_FLAG_BLOCKS` table (its header
    /// first where the file is new); a file that cannot be written is reported once and then
    /// left alone, since the table is a measurement and the step's results do not depend on it.
    fn write_flag_rows(&self, mb: &MoeBufs, rows: &[FlagRow]) {
        use std::io::Write;
        use std::sync::atomic::{AtomicBool, Ordering};
        static FAILED: AtomicBool = AtomicBool::new(false);
        let Some(path) = flag_blocks_path() else { return };
        if FAILED.load(Ordering::Relaxed) {
            return;
        }
        // SAFETY: the step's kernels ended with the stream sync before the caller.
        let stamps = |l: usize| unsafe { mb.read_stamps(l) };
        let origin = rows.iter().map(|r| stamps(r.layer)[0]).filter(|&t| t > 0).min().unwrap_or(0);
        let step = self.flag_steps.fetch_add(1, Ordering::Relaxed);
        let mut text = String::new();
        for r in rows {
            text.push_str(&flag_row_line(self.model_no, step, r, stamps(r.layer), origin));
            text.push('\n');
        }
        let fresh = !path.exists();
        let written = std::fs::OpenOptions::new().create(true).append(true).open(path).and_then(|mut f| {
            if fresh {
                writeln!(f, "{FLAG_ROW_HEADER}")?;
            }
            f.write_all(text.as_bytes())
        });
        if let Err(e) = written {
            FAILED.store(true, Ordering::Relaxed);
            eprintln!(
                "warning: CHERENKOV_FLAG_BLOCKS: cannot append to {}: {e}; no more rows are written",
                path.display()
            );
        }
    }

    /// The timed blocks' anatomy (see [`BlockAnatomy`]), read from their events once the step has
    /// finished.
    fn block_anatomy(
        &self,
        mb: &MoeBufs,
        blocks: &[(usize, Vec<usize>)],
        read_timed: &[usize],
    ) -> Result<BlockAnatomy> {
        let mut a = BlockAnatomy::default();
        let ns = |ms: f32| (ms.max(0.0) as f64 * 1e6) as u64;
        let mem = self.pool.memory();
        for (i, (l, slots)) in blocks.iter().enumerate() {
            let ev = &mb.events[*l];
            a.blocks += 1;
            a.to_resident_ns += ns(ev[1].since(&ev[6])?);
            a.resident_ns += ns(ev[2].since(&ev[1])?);
            if let Some((next, _)) = blocks.get(i + 1) {
                a.spans += 1;
                a.span_ns += ns(mb.events[*next][6].since(&ev[6])?);
            }
            if slots.is_empty() || !read_timed.contains(l) {
                continue;
            }
            a.blocks_missing += 1;
            // The copies' window, where every slot's events still describe this block's copy (a
            // later copy into the slot in this step, or a copy that never ran, leaves it out).
            let windows: Option<Vec<(f32, f32)>> = slots.iter().map(|&s| mem.copy_window(s, &ev[6])).collect();
            let read_end = ev[4].since(&ev[6])?;
            if let Some(w) = windows.filter(|w| !w.is_empty()) {
                let first = w.iter().map(|x| x.0).fold(f32::INFINITY, f32::min);
                let last = w.iter().map(|x| x.1).fold(f32::NEG_INFINITY, f32::max);
                if first >= 0.0 && last <= read_end {
                    a.copies_timed += 1;
                    a.to_copy_ns += ns(first);
                    a.copy_ns += ns(last - first);
                    a.copy_to_read_end_ns += ns(read_end - last);
                }
            }
            a.read_ns += ns(ev[4].since(&ev[3])?);
        }
        Ok(a)
    }

    /// With a cache that holds every expert, loads them all now (otherwise the first step does);
    /// returns whether every expert is resident. For callers that show progress while it runs
    /// (the pool's statistics count the records read).
    pub fn make_resident(&self) -> Result<bool> {
        let mut sc = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        self.gpu.bind()?;
        self.decide_residency(&mut sc)?;
        Ok(sc.moe.map.is_some())
    }

    /// With a cache that holds every expert, loads them all once and writes the device map the
    /// router kernel builds its tables from. Decided at the first step.
    fn decide_residency(&self, sc: &mut Scratch) -> Result<()> {
        if sc.moe.decided {
            return Ok(());
        }
        sc.moe.decided = true;
        let layers = &self.store.manifest.experts.layers;
        let e = self.config().num_experts;
        if self.pool.slot_count() < layers.len() * e {
            return Ok(());
        }
        let slots = self.pool.preload_all()?;
        // The replayed steps read every slot without waiting for copies.
        self.pool.memory().sync_copies()?;
        let mem = self.pool.memory();
        let mut map = Vec::with_capacity(layers.len() * e);
        for (layout, row) in layers.iter().zip(&slots) {
            let tag = layer_tag(layout);
            map.extend(row.iter().map(|&s| mem.slot_ptr(s) | tag));
        }
        let dev = self.gpu.alloc(map.len().max(1) * 8, "the resident expert map")?;
        self.gpu.htod(dev.ptr, &map)?;
        sc.moe.map = Some(dev);
        Ok(())
    }

    /// One MoE block on its own (the kernel checks): a step of just this block.
    pub(crate) fn moe_alone(&self, sc: &mut Scratch, m: &crate::weights::Moe) -> Result<()> {
        self.decide_residency(sc)?;
        let mut st = MoeStep::new();
        self.moe(sc, m, None, &mut st)?;
        if sc.moe.map.is_some() {
            let bytes = sc.moe.ids.bytes.min(sc.moe.ids_host.bytes);
            self.gpu.download(&sc.moe.ids_host, 0, sc.moe.ids.ptr, bytes)?;
        }
        self.finish_step(sc, st)
    }

    /// The `k` largest of the first `among` entries of `sc.logits` as (id, logit), descending, ties
    /// to the lower id, chosen on the device: by radix selection where `radix` and it applies (the
    /// host's order: `total_cmp`), else by one block in `k` passes of an argmax, which overwrites
    /// the chosen logits with -inf, counts -0 equal to +0 and never picks NaN (where fewer than `k`
    /// entries are left, the rest have id `i32::MAX`).
    pub(crate) fn top_candidates_by(
        &self,
        sc: &Scratch,
        k: usize,
        among: usize,
        radix: bool,
    ) -> Result<Vec<(u32, f32)>> {
        self.queue_candidates(sc, k, among, radix)?;
        self.read_candidates(sc, k)
    }

    /// Queues the choice of the `k` largest logits among ids below `among` (into `sc.ids` and
    /// `sc.weights`; graph-safe), by radix selection where `radix` and it applies.
    fn queue_candidates(&self, sc: &Scratch, k: usize, among: usize, radix: bool) -> Result<()> {
        let g = &*self.gpu;
        let v = among.min(self.config().vocab_size);
        // Radix selection: every block takes the k largest of its chunk, one block the k largest of
        // theirs (one launch for one chunk); for more than CAND_SEL candidates, or more chunks' best
        // than one block holds, one block in a pass per candidate.
        let chunks = v.div_ceil(CAND_CHUNK);
        let n = chunks * k;
        if k > MAX_CANDIDATES {
            bail!("{k} sampling candidates asked; a step chooses at most {MAX_CANDIDATES}");
        }
        // The last launch also writes them into the mapped host buffer.
        let (hids, hvals) = (Arg::Ptr(sc.cand_host.dev), Arg::Ptr(sc.cand_host.dev + (MAX_CANDIDATES * 4) as u64));
        if radix && k <= v && k <= CAND_SEL && n <= CAND_KEYS {
            let (ids, vals) = (Arg::Ptr(sc.ids.ptr), Arg::Ptr(sc.weights.ptr));
            let (hids_part, hvals_part) = if chunks > 1 { (Arg::Ptr(0), Arg::Ptr(0)) } else { (hids, hvals) };
            g.launch(
                "top_candidates_part",
                (chunks as u32, 1, 1),
                1024,
                0,
                &[
                    Arg::Ptr(sc.logits.ptr),
                    Arg::I32(v as i32),
                    Arg::I32(k as i32),
                    Arg::Ptr(sc.cand.ptr),
                    ids,
                    vals,
                    hids_part,
                    hvals_part,
                ],
            )?;
            if chunks > 1 {
                let args = [Arg::Ptr(sc.cand.ptr), Arg::I32(n as i32), Arg::I32(k as i32), ids, vals, hids, hvals];
                g.launch("top_candidates_merge", (1, 1, 1), 1024, 0, &args)?;
            }
        } else {
            g.launch(
                "top_candidates",
                (1, 1, 1),
                1024,
                0,
                &[
                    Arg::Ptr(sc.logits.ptr),
                    Arg::I32(v as i32),
                    Arg::I32(k as i32),
                    Arg::Ptr(sc.ids.ptr),
                    Arg::Ptr(sc.weights.ptr),
                    hids,
                    hvals,
                ],
            )?;
        }
        Ok(())
    }

    /// The candidates [`CudaModel::queue_candidates`] chose, after the work queued before.
    fn read_candidates(&self, sc: &Scratch, k: usize) -> Result<Vec<(u32, f32)>> {
        if k > MAX_CANDIDATES {
            bail!("{k} sampling candidates asked; a step chooses at most {MAX_CANDIDATES}");
        }
        self.gpu.sync()?;
        // SAFETY: the stream is idle: the kernel that wrote the mapped buffer has finished, and no
        // other work of this scratch is queued (its owner holds it).
        let words = unsafe { sc.cand_host.as_slice::<u32>() };
        let (ids, vals) = words.split_at(MAX_CANDIDATES);
        Ok(ids[..k].iter().zip(&vals[..k]).map(|(&i, &v)| (i, f32::from_bits(v))).collect())
    }

    /// Gathers the n-gram rows of the step's token for PLE layer `layer` (host side: the table
    /// stays on disk) into that layer's place in the step inputs, which
    /// [`CudaModel::upload_step_inputs`] uploads for [`CudaModel::ple`].
    pub(crate) fn ple_gather(
        &self,
        sc: &Scratch,
        hash: &NgramHash,
        layer: usize,
        tok: u32,
        context: &[u32],
    ) -> Result<()> {
        let c = self.config();
        let table = self.store.ngram_table(layer).context("store has no n-gram table")?;
        let emb = gather_embeddings(&self.store, c, hash, table, &[tok], context)?;
        let k = c.ple_index(layer).with_context(|| format!("layer {layer} is not a PLE layer"))?;
        let (at, n) = (ple_rows_at(c, k) / 4, c.ple_embed_dim);
        if emb.len() != n {
            bail!("PLE rows of layer {layer}: {} values gathered, {n} expected", emb.len());
        }
        // SAFETY: this layer's rows are written once per step, and their previous upload finished
        // before the step began (steps end with a stream sync; the checks read results back in
        // between).
        unsafe { sc.step_host.as_mut_slice::<f32>()[at..at + n].copy_from_slice(&emb) };
        Ok(())
    }

    /// The PLE block of weights `p` (its rows gathered by [`CudaModel::ple_gather`] and uploaded with
    /// the step inputs): x += ple(x).
    pub(crate) fn ple(&self, sc: &Scratch, p: &crate::weights::Ple, state: &DevBuf) -> Result<()> {
        let c = self.config();
        let g = &*self.gpu;
        let (h, hc) = (c.hidden_size, c.hc_count);
        let [_, key, value, gn, _, gated, _] = &sc.big;
        // The rows came with the step inputs' upload.
        let e = sc.step_in.ptr + ple_rows_at(c, p.ple_index) as u64;
        matvec_many(g, e, &[(&p.key_proj, key.ptr), (&p.value_proj, value.ptr)])?;
        // The key's, the residual's and the gated values' norms in the gate's launch.
        g.launch(
            "ple_gate",
            (hc as u32, 1, 1),
            1024,
            0,
            &[
                Arg::Ptr(key.ptr),
                Arg::Ptr(sc.x.ptr),
                Arg::Ptr(value.ptr),
                Arg::Ptr(p.norm_key.ptr),
                Arg::Ptr(p.norm_query.ptr),
                Arg::Ptr(p.norm_conv.ptr),
                Arg::Ptr(gated.ptr),
                Arg::Ptr(gn.ptr),
                Arg::I32(h as i32),
                Arg::F32(c.rms_norm_eps as f32),
            ],
        )?;
        g.launch(
            "ple_conv",
            (blocks(c.hc_hidden(), 256), 1, 1),
            256,
            0,
            &[
                Arg::Ptr(gn.ptr),
                Arg::Ptr(gated.ptr),
                Arg::Ptr(state.ptr),
                Arg::Ptr(p.conv1d.ptr),
                Arg::Ptr(sc.x.ptr),
                Arg::I32(c.hc_hidden() as i32),
                Arg::I32(c.ple_conv_kernel_size as i32),
                Arg::I32(c.ngram_size as i32),
            ],
        )
    }

    /// Gated DeltaNet on `inp`, advancing the state; the output projection writes to `out` (stored,
    /// or injected into the residual).
    pub(crate) fn gdn(
        &self,
        sc: &Scratch,
        gw: &crate::weights::GatedDeltaNet,
        conv: &DevBuf,
        recurrent: &DevBuf,
        out: MatvecOutput,
    ) -> Result<()> {
        self.gdn_in_proj(sc, gw, conv.ptr)?;
        let r = self.gdn_recurrence(gw);
        let [_, z, b, a, conv_out, core, digits] = &sc.big;
        let c = self.config();
        let mut args = self.gdn_recurrent_args(gw, conv_out.ptr, a.ptr, b.ptr, recurrent.ptr, core.ptr, z.ptr);
        args.push(Arg::Ptr(if r.image { digits.ptr } else { 0 }));
        self.gpu.launch(r.kernel, (c.linear_num_value_heads as u32, 1, 1), r.threads, r.shared, &args)?;
        gw.out_proj.matvec_to(&self.gpu, self.gdn_out_input(sc, &r), out)
    }

    /// The GDN layer's input projections (qkv, z, b, a) of `inp`, the conv riding on their launch
    /// where it can (otherwise a launch of its own, in place on the projection's output; one
    /// thread per channel reads its input before writing).
    pub(crate) fn gdn_in_proj(&self, sc: &Scratch, gw: &crate::weights::GatedDeltaNet, conv: u64) -> Result<()> {
        let c = self.config();
        let g = &*self.gpu;
        let [_, z, b, a, conv_out, ..] = &sc.big;
        let cd = c.gdn_conv_dim();
        let folded = FoldedConv { state: conv, w: gw.conv1d.ptr, k: c.linear_conv_kernel_dim, channels: cd };
        let parts =
            [(&gw.in_proj_qkv, conv_out.ptr), (&gw.in_proj_z, z.ptr), (&gw.in_proj_b, b.ptr), (&gw.in_proj_a, a.ptr)];
        if !matvec_many_conv(g, sc.inp.ptr, &parts, Some(folded))? {
            g.launch(
                "gdn_conv",
                (blocks(cd, 256), 1, 1),
                256,
                0,
                &[
                    Arg::Ptr(conv_out.ptr),
                    Arg::Ptr(conv),
                    Arg::Ptr(gw.conv1d.ptr),
                    Arg::Ptr(conv_out.ptr),
                    Arg::I32(cd as i32),
                    Arg::I32(c.linear_conv_kernel_dim as i32),
                ],
            )?;
        }
        Ok(())
    }

    /// How the GDN recurrence runs for these weights: columns split over 4 threads holding their
    /// rows in registers where the head fits (the kernel's GDN_SPLIT and GDN_MAX_ROWS), else one
    /// thread per column. Both normalise q and k while staging them (block reductions: whole
    /// warps). The split kernel's head is whole warps (and whole 32-input chunks) where dv is a
    /// multiple of 32: then it writes the out_proj's staged image too (its 3.75 bytes an input fit
    /// the scratch vector's 4), for 4-bit out_proj weights (the only ones staged that way).
    pub(crate) fn gdn_recurrence(&self, gw: &crate::weights::GatedDeltaNet) -> GdnRecurrence {
        let c = self.config();
        let (dk, dv) = (c.linear_key_head_dim, c.linear_value_head_dim);
        const SPLIT: usize = 4;
        let split = dk % SPLIT == 0 && dk / SPLIT <= 32 && dv * SPLIT <= 1024 && (dv * SPLIT).is_multiple_of(32);
        let (kernel, threads, shared) = if split {
            ("gdn_recurrent_split", dv * SPLIT, 2 * dk + SPLIT * dv)
        } else {
            ("gdn_recurrent", dv.min(1024).next_multiple_of(32), 2 * dk)
        };
        let image = self.gdn_digits && split && dv.is_multiple_of(32) && gw.out_proj.stages_digits();
        GdnRecurrence { kernel, threads: threads as u32, shared: (shared * 4) as u32, split, image }
    }

    /// `gdn_recurrent_rows`' shared memory for a key head width `dk`, given the split kernel's
    /// (`split_shared` bytes): the q and k of [`GDN_ROWS_AHEAD`] rows instead of one.
    pub(crate) fn gdn_rows_shared(split_shared: u32, dk: usize) -> u32 {
        split_shared + (2 * dk * (GDN_ROWS_AHEAD - 1) * 4) as u32
    }

    /// The recurrence kernels' leading arguments, from the conv's output through the gated
    /// output norm's (the one-row kernel then takes the digits; the rows kernel the record
    /// first).
    pub(crate) fn gdn_recurrent_args(
        &self,
        gw: &crate::weights::GatedDeltaNet,
        conv_out: u64,
        a: u64,
        b: u64,
        state: u64,
        core: u64,
        z: u64,
    ) -> Vec<Arg> {
        let c = self.config();
        let (nk, nv, dk, dv) =
            (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim);
        vec![
            Arg::Ptr(conv_out),
            Arg::Ptr(a),
            Arg::Ptr(b),
            Arg::Ptr(gw.a_log.ptr),
            Arg::Ptr(gw.dt_bias.ptr),
            Arg::Ptr(state),
            Arg::Ptr(core),
            Arg::I32(nk as i32),
            Arg::I32(nv as i32),
            Arg::I32(dk as i32),
            Arg::I32(dv as i32),
            // The gated output norm, fused.
            Arg::Ptr(z),
            Arg::Ptr(gw.norm.ptr),
            Arg::F32(c.rms_norm_eps as f32),
            Arg::I32(if c.gate_act == GateAct::Sigmoid { 0 } else { 1 }),
        ]
    }

    /// The out_proj's input: the recurrence's output, with its staged image where the recurrence
    /// wrote one.
    pub(crate) fn gdn_out_input(&self, sc: &Scratch, r: &GdnRecurrence) -> MatvecInput {
        let [.., core, digits] = &sc.big;
        if r.image { MatvecInput::Digits(core.ptr, digits.ptr) } else { MatvecInput::Plain(core.ptr) }
    }

    /// Grouped zero-centred RMSNorm of `groups` groups of `group` elements.
    pub(crate) fn rmsnorm(&self, x: u64, w: u64, y: u64, groups: usize, group: usize, wlen: usize) -> Result<()> {
        self.gpu.launch(
            "rmsnorm_zc",
            (groups as u32, 1, 1),
            1024,
            0,
            &[
                Arg::Ptr(x),
                Arg::Ptr(w),
                Arg::Ptr(y),
                Arg::I32(group as i32),
                Arg::I32(wlen as i32),
                Arg::F32(self.config().rms_norm_eps as f32),
            ],
        )
    }

    /// Whether [`CudaModel::hc_read`] runs as its two fused launches (the norm folded into the
    /// down projection, then `hc_up_mix`), which serve a verifying pass's rows.
    pub(crate) fn hc_read_fused(&self, hcw: &HyperConnection) -> bool {
        let c = self.config();
        let mut down = vec![&hcw.input_mix_weight_down];
        down.extend(hcw.block_inject_weight.as_ref());
        crate::weights::hc_up_mix_applies(&hcw.input_mix_weight_up, c.hc_count, c.hidden_size)
            && crate::weights::matvec_many_norm_fits(&self.gpu, &down, c.hidden_size)
    }

    /// Hyper-connection read of x into `inp` (and the raw injection logits into `inj`).
    pub(crate) fn hc_read(&self, sc: &Scratch, hcw: &HyperConnection) -> Result<()> {
        let c = self.config();
        let (h, hc) = (c.hidden_size, c.hc_count);
        let g = &*self.gpu;
        // The injection logits are read only by `inject`, after the block: computed here with the
        // down projection of the same input, in one launch.
        let mut down = vec![(&hcw.input_mix_weight_down, sc.low.ptr)];
        if let Some(inj) = &hcw.block_inject_weight {
            down.push((inj, sc.inj.ptr));
        }
        // silu(low / hc) (as the CPU: silu(low * (1 / hc))), applied by the up projection as it
        // stages its input; `low` keeps the down projection.
        let input = MatvecInput::SiluScaled(sc.low.ptr, 1.0 / hc as f32);
        let up = &hcw.input_mix_weight_up;
        // Where both kernels apply: the norm folded into the down projection and recomputed by the
        // up projection and mix (two launches, nothing normalised is stored).
        if crate::weights::hc_up_mix_applies(up, hc, h) {
            // The down projection's sum left to the up projection where its rows are that one's
            // inputs (`read_sum`).
            let defer = self.read_sum && hcw.input_mix_weight_down.rows == up.cols;
            let defer_second = defer && self.inject_beside && hcw.block_inject_weight.is_some();
            let norm = FoldedNorm { group: h, eps: c.rms_norm_eps as f32, inv: sc.hc_inv.ptr, defer, defer_second };
            let normed = Normed::Folded { x: sc.x.ptr, w: hcw.hc_norm.ptr, inv: sc.hc_inv.ptr };
            let sum = match crate::weights::matvec_many_norm(g, sc.x.ptr, hcw.hc_norm.ptr, &down, norm)? {
                crate::weights::NormLaunch::Unfit => None,
                crate::weights::NormLaunch::Summed => Some((None, None)),
                crate::weights::NormLaunch::Deferred(d, inj) => Some((Some(d), inj.map(|i| (i, sc.inj.ptr)))),
            };
            if let Some((sum, inject)) = sum {
                if !crate::weights::hc_up_mix(g, up, input, normed, sc.inp.ptr, hc, h, sum, inject)? {
                    bail!("hc_up_mix refused a read it applies to");
                }
                return Ok(());
            }
        }
        self.rmsnorm(sc.x.ptr, hcw.hc_norm.ptr, sc.normed.ptr, hc, h, c.hc_hidden())?;
        matvec_many(g, sc.normed.ptr, &down)?;
        // The up projection and the mix in one launch where the kernel applies.
        if crate::weights::hc_up_mix(g, up, input, Normed::Stored(sc.normed.ptr), sc.inp.ptr, hc, h, None, None)? {
            return Ok(());
        }
        hcw.input_mix_weight_up.matvec_in(g, input, sc.mix.ptr)?;
        g.launch(
            "hc_mix",
            (blocks(h, 256), 1, 1),
            256,
            0,
            &[
                Arg::Ptr(sc.mix.ptr),
                Arg::Ptr(sc.normed.ptr),
                Arg::Ptr(sc.inp.ptr),
                Arg::I32(hc as i32),
                Arg::I32(h as i32),
            ],
        )?;
        Ok(())
    }

    /// x += 2 sigmoid(inj / hc) (outer) out.
    pub(crate) fn inject(&self, sc: &Scratch) -> Result<()> {
        let c = self.config();
        crate::weights::hc_inject(&self.gpu, sc.x.ptr, sc.inj.ptr, sc.out.ptr, c.hc_count, c.hidden_size)
    }

    /// QSA-gated attention of the step's token (position `pos`, also in the step inputs on the
    /// device); o_proj writes to `out` (stored, or injected into the residual). Below the QSA budget
    /// nothing waits for the host (graph-safe); past it the block scores come back to the host,
    /// which picks the visible blocks.
    pub(crate) fn attention(
        &self,
        sc: &mut Scratch,
        aw: &crate::weights::Attention,
        st: &mut crate::session::AttentionState,
        pos: usize,
        out: MatvecOutput,
        project: bool,
    ) -> Result<()> {
        let c = self.config().clone();
        let g = &*self.gpu;
        let (nh, nkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let rd = c.rotary_dim() as i32;
        let eps = c.rms_norm_eps as f32;
        let step = sc.step_in.ptr;
        let [qg, q, gate, k, v, _, iq] = &sc.big;
        let qsa = c.qsa.as_ref().zip(aw.indexer.as_ref());
        if fused_attn_prep() {
            // The four projections of one input in one launch (unless the caller queued them:
            // `project` false), then everything up to `attend` in one more (attn_prep in
            // attention.cu).
            if project {
                matvec_many(g, sc.inp.ptr, &self.attention_parts(sc, aw))?;
            }
            let (ih, id, ratio, iqn, ikn) = match qsa {
                Some((q, ix)) => (q.n_heads, q.head_dim, q.compress_ratio, ix.q_layernorm.ptr, ix.k_layernorm.ptr),
                None => (0, 0, 1, 0, 0),
            };
            g.launch(
                "attn_prep",
                ((nh + nkv + ih + 1) as u32, 1, 1),
                128,
                (d.max(id) * 4) as u32,
                &[
                    Arg::Ptr(qg.ptr),
                    Arg::Ptr(q.ptr),
                    Arg::Ptr(gate.ptr),
                    Arg::Ptr(k.ptr),
                    Arg::Ptr(v.ptr),
                    Arg::Ptr(st.k.ptr),
                    Arg::Ptr(st.v.ptr),
                    Arg::Ptr(iq.ptr),
                    Arg::Ptr(st.index_keys.ptr),
                    Arg::Ptr(st.index_blocks.ptr),
                    Arg::Ptr(aw.q_norm.ptr),
                    Arg::Ptr(aw.k_norm.ptr),
                    Arg::Ptr(iqn),
                    Arg::Ptr(ikn),
                    Arg::I32(nh as i32),
                    Arg::I32(nkv as i32),
                    Arg::I32(d as i32),
                    Arg::I32(ih as i32),
                    Arg::I32(id as i32),
                    Arg::I32(ratio as i32),
                    Arg::F32(eps),
                    Arg::Ptr(self.inv_freq.ptr),
                    Arg::I32(rd),
                    Arg::Ptr(step),
                ],
            )?;
        } else {
            self.attn_prep_launches(sc, aw, st)?;
        }
        let [qg, q, _, _, _, attn, iq] = &sc.big;

        // QSA: which tokens this query sees (None: all of 0..=pos).
        let mut list: Option<Vec<i32>> = None;
        if let Some((qsa, _)) = qsa {
            let ratio = qsa.compress_ratio;
            let complete = (pos + 1) / ratio;
            st.blocks = complete;
            let topk = qsa.block_topk();
            if complete > topk {
                if complete * 4 > sc.scores.bytes {
                    sc.scores = g.zeros(complete * 8, "attention scores")?;
                }
                g.launch(
                    "qsa_scores",
                    (blocks(complete * 32, 128), 1, 1),
                    128,
                    0,
                    &[
                        Arg::Ptr(iq.ptr),
                        Arg::Ptr(st.index_blocks.ptr),
                        Arg::Ptr(sc.scores.ptr),
                        Arg::I32(complete as i32),
                        Arg::I32(qsa.n_heads as i32),
                        Arg::I32(qsa.head_dim as i32),
                    ],
                )?;
                let mut scores = vec![0f32; complete];
                g.dtoh(sc.scores.ptr, &mut scores)?;
                let mut order: Vec<usize> = (0..complete).collect();
                order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
                let mut chosen: Vec<usize> = order[..topk].to_vec();
                chosen.sort_unstable();
                let mut toks: Vec<i32> =
                    chosen.iter().flat_map(|&b| (b * ratio) as i32..((b + 1) * ratio) as i32).collect();
                toks.extend((complete * ratio) as i32..=pos as i32);
                list = Some(toks);
            }
        }
        let n = list.as_ref().map_or(pos + 1, |l| l.len());
        let idx_ptr = match &list {
            Some(l) => {
                if l.len() * 4 > sc.idx.bytes {
                    sc.idx = g.zeros(l.len() * 8, "attention token lists")?;
                }
                g.htod(sc.idx.ptr, l)?;
                sc.idx.ptr
            }
            None => 0,
        };
        // Split over the tokens (attention.cu); a block's query heads share their KV head.
        if d > 32 * ATTEND_MAX_R {
            bail!("attention head_dim {d} is wider than the CUDA attend kernel takes ({})", 32 * ATTEND_MAX_R);
        }
        let group = [4, 2, 1].into_iter().find(|g| (nh / nkv.max(1)).is_multiple_of(*g)).unwrap_or(1);
        // The merge gates its output, and where o_proj is 4-bit and a head whole 32-input chunks,
        // writes the staged image too, into `qg` (read by attn_prep only; the image's 3.75 bytes an
        // input fit its 8 a head dimension).
        let image = self.attend_gate && self.attend_digits && d.is_multiple_of(32) && aw.o_proj.stages_digits();
        let (gate_arg, digits_arg) = match (self.attend_gate, image) {
            (false, _) => (0, 0),
            (true, false) => (gate.ptr, 0),
            (true, true) => (gate.ptr, qg.ptr),
        };
        let scale = 1.0 / (d as f32).sqrt();
        let clustered = self.attend_cluster && (nh / nkv.max(1)).is_multiple_of(2) && d == 32 * ATTEND_CLUSTER;
        // Both kernels take the same arguments, except `attend`'s partials and counts for its
        // merge through L2 (after the step's inputs); `attend_cl` merges in the cluster.
        let mut args = vec![
            Arg::Ptr(q.ptr),
            Arg::Ptr(st.k.ptr),
            Arg::Ptr(st.v.ptr),
            Arg::Ptr(idx_ptr),
            Arg::I32(n as i32),
            Arg::Ptr(step),
        ];
        if !clustered {
            args.extend([Arg::Ptr(sc.attn_part.ptr), Arg::Ptr(sc.attn_count.ptr)]);
        }
        args.extend([
            Arg::Ptr(attn.ptr),
            Arg::I32(nh as i32),
            Arg::I32(nkv as i32),
            Arg::I32(d as i32),
            Arg::F32(scale),
            Arg::Ptr(gate_arg),
            Arg::Ptr(digits_arg),
        ]);
        if clustered {
            let grid = ((nh / 2 * ATTEND_CLUSTER) as u32, 1, 1);
            g.launch_clustered("attend_cl", grid, 256, 0, &args, ATTEND_CLUSTER as u32)?;
        } else {
            let grid = ((nh / group) as u32, ATTEND_SPLITS as u32, 1);
            g.launch("attend", grid, 32 * group as u32, 0, &args)?;
        }
        let input = match (self.attend_gate, image) {
            // attn * sigmoid(gate), applied by o_proj as it stages its input.
            (false, _) => MatvecInput::MulSigmoid(attn.ptr, gate.ptr),
            (true, false) => MatvecInput::Plain(attn.ptr),
            (true, true) => MatvecInput::Digits(attn.ptr, qg.ptr),
        };
        aw.o_proj.matvec_to(g, input, out)
    }

    /// An attention mixer's projections of its input as `attn_prep` takes them, with where each
    /// goes in `sc`: the query and gate, the key, the value and (QSA) the index queries and key
    /// into `iq`. Only where [`fused_attn_prep`].
    pub(crate) fn attention_parts<'w>(
        &self,
        sc: &Scratch,
        aw: &'w crate::weights::Attention,
    ) -> Vec<(&'w crate::weights::DevLinear, u64)> {
        let [qg, _, _, k, v, _, iq] = &sc.big;
        let mut parts = vec![(&aw.q_proj, qg.ptr), (&aw.k_proj, k.ptr), (&aw.v_proj, v.ptr)];
        if let (Some(_), Some(ix)) = (&self.config().qsa, &aw.indexer) {
            parts.push((&ix.index_qk_proj, iq.ptr));
        }
        parts
    }

    /// What `attn_prep` does, as the separate launches it replaced (`CHERENKOV_NO_FUSED_ATTN_PREP=1`,
    /// for measurements): the q, k, v projections, the query and gate split, the norms and RoPE,
    /// the index projection, the cache appends and the QSA pool.
    fn attn_prep_launches(
        &self,
        sc: &Scratch,
        aw: &crate::weights::Attention,
        st: &crate::session::AttentionState,
    ) -> Result<()> {
        let c = self.config();
        let g = &*self.gpu;
        let (nh, nkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let rd = c.rotary_dim() as i32;
        let eps = c.rms_norm_eps as f32;
        let step = sc.step_in.ptr;
        let [qg, q, gate, k, v, _, iq] = &sc.big;
        matvec_many(g, sc.inp.ptr, &[(&aw.q_proj, qg.ptr), (&aw.k_proj, k.ptr), (&aw.v_proj, v.ptr)])?;
        g.launch(
            "split_q_gate",
            (blocks(nh * d, 256), 1, 1),
            256,
            0,
            &[Arg::Ptr(qg.ptr), Arg::Ptr(q.ptr), Arg::Ptr(gate.ptr), Arg::I32(nh as i32), Arg::I32(d as i32)],
        )?;
        let norm_rope = |v: u64, heads: usize, w: u64, dim: usize| {
            g.launch(
                "norm_rope",
                (heads as u32, 1, 1),
                128,
                0,
                &[
                    Arg::Ptr(v),
                    Arg::Ptr(w),
                    Arg::I32(dim as i32),
                    Arg::F32(eps),
                    Arg::Ptr(self.inv_freq.ptr),
                    Arg::I32(rd),
                    Arg::Ptr(step),
                ],
            )
        };
        norm_rope(q.ptr, nh, aw.q_norm.ptr, d)?;
        norm_rope(k.ptr, nkv, aw.k_norm.ptr, d)?;
        // QSA's index projection: index queries, then the token's index key.
        let qsa = c.qsa.as_ref().zip(aw.indexer.as_ref());
        let mut ikey = (0u64, 0u64, 0usize);
        if let Some((qsa, ix)) = qsa {
            ix.index_qk_proj.matvec(g, sc.inp.ptr, iq.ptr)?;
            ikey = (iq.ptr + (qsa.n_heads * qsa.head_dim * 4) as u64, st.index_keys.ptr, qsa.head_dim);
        }
        let kvd = nkv * d;
        g.launch(
            "kv_append",
            (blocks(kvd.max(ikey.2), 256), 1, 1),
            256,
            0,
            &[
                Arg::Ptr(k.ptr),
                Arg::Ptr(v.ptr),
                Arg::Ptr(ikey.0),
                Arg::Ptr(st.k.ptr),
                Arg::Ptr(st.v.ptr),
                Arg::Ptr(ikey.1),
                Arg::Ptr(step),
                Arg::I32(kvd as i32),
                Arg::I32(ikey.2 as i32),
            ],
        )?;
        if let Some((qsa, ix)) = qsa {
            let (ih, id, ratio) = (qsa.n_heads, qsa.head_dim, qsa.compress_ratio);
            norm_rope(iq.ptr, ih, ix.q_layernorm.ptr, id)?;
            // Pools the block this token completes, if it completes one.
            g.launch(
                "qsa_pool_block",
                (1, 1, 1),
                128,
                (id * 4) as u32,
                &[
                    Arg::Ptr(st.index_keys.ptr),
                    Arg::Ptr(st.index_blocks.ptr),
                    Arg::Ptr(step),
                    Arg::I32(ratio as i32),
                    Arg::I32(id as i32),
                    Arg::Ptr(ix.k_layernorm.ptr),
                    Arg::F32(eps),
                    Arg::Ptr(self.inv_freq.ptr),
                    Arg::I32(rd),
                ],
            )?;
        }
        Ok(())
    }

    /// A MoE block's head, device work only (a step's segment graph may hold it): the router and
    /// its routing; streaming, the router-ready event (and with `anatomy_event` its timed twin),
    /// then the lookahead's router and the shared expert. Every expert resident, the router's
    /// launch also takes the shared expert's gate/up and its down projection goes to the side
    /// stream (the block's tail joins it). `after` (0: none): a flag the router waits for before
    /// it reads the hit map (a flagged step's previous turn, [`CudaModel::step_flagged`]).
    #[allow(clippy::too_many_arguments)]
    fn moe_head(
        &self,
        sc: &Scratch,
        m: &crate::weights::Moe,
        next: Option<&crate::weights::Moe>,
        anatomy_event: bool,
        after: u64,
    ) -> Result<()> {
        let c = self.config();
        let g = &*self.gpu;
        let (h, e, k) = (c.hidden_size, c.num_experts, c.num_experts_per_tok);
        let l = m.expert_slot;
        let [logits, sg, su, shared, sgate, ahead, _] = &sc.big;
        let mb = &sc.moe;
        let resident = mb.map.is_some();
        // Streaming where the router finds its landed experts in the hit map: the found experts'
        // launch ends the head, so that it runs behind the router without waiting for the host's
        // launch, with the shared expert riding along in it where it can (as every expert resident).
        let found_here = !resident && self.finds_hits();
        let ride = self.shared_riding(sc, m);
        let gate_up_ride = self.shared_gate_up_riding(sc, m);
        // The router, the shared expert's gate (both 8-bit in MLX conversions; the gate is read only
        // by the combination) and the shared expert's gate and up projections (4-bit) in one launch
        // where the tiled kernels take all four. Streaming, the router is on every block's critical
        // path (the host turn and the misses' copies wait for it): it and the gate go alone, and the
        // shared expert's projections follow the router-ready event.
        // Every expert resident, or found: the shared expert's down projection rides along in the
        // routed experts' down launch (`moe`, or below) where it can. Else every expert resident,
        // it runs on the side stream, beside the routing and the routed experts (it needs only this
        // launch's outputs), and the combination waits for both.
        let rides = ride.is_some();
        let beside = resident && self.shared_beside && !rides;
        // Lookahead (streaming only): the next block's router on this block's input.
        let ahead_of = next.filter(|_| self.lookahead && !resident);
        // It rides in the router's launch where it can (the same input, and the launch takes
        // three parts), so that no launch of its own sits between the routing and the found
        // experts, and its logits are there when the router's flag is.
        let riding_ahead = ahead_of.filter(|n| self.lookahead_rides && n.gate.cols == m.gate.cols);
        let router = [(&m.gate, logits.ptr), (&m.shared_expert_gate, sgate.ptr)];
        let router_ahead;
        let router: &[_] = match riding_ahead {
            Some(n) => {
                router_ahead = [router[0], router[1], (&n.gate, ahead.ptr)];
                &router_ahead
            }
            None => &router,
        };
        let shared_gate_up = [(&m.shared_gate_proj, sg.ptr), (&m.shared_up_proj, su.ptr)];
        // (Its gate and up projections may ride along in the routed experts' gate/up launch.) The
        // router's column slices are added up by `route_topk` where nothing runs beside it on the
        // side stream, which could use the same scratch meanwhile (`route_sum`).
        let parts: &[_] = if !resident || gate_up_ride.is_some() {
            router
        } else {
            &[router[0], router[1], shared_gate_up[0], shared_gate_up[1]]
        };
        let slices = if self.route_sum && !beside {
            crate::weights::matvec_many_deferring(g, sc.inp.ptr, parts)?
        } else {
            matvec_many(g, sc.inp.ptr, parts)?;
            None
        };
        if beside {
            g.fork()?;
        }
        let bias = self.bias_row(mb, l, 0);
        let (table, ranks, weights) = (mb.table_at(l, k), mb.ranks_at(l, k), mb.weights.at(l * k * 4));
        // Every expert resident: the step's table from the resident map. Streaming with the hit
        // map: the found experts' table (`moe_found`), the host writing the rest.
        let (map, table, ranks) = match (&mb.map, self.finds_hits()) {
            (Some(d), _) => (d.at(l * e * 8), table, ranks),
            (None, true) => (self.pool.memory().hit_map_at(l).context("the hit map")?, mb.found.at(l * k * 8), 0),
            (None, false) => (0, table, ranks),
        };
        // The lookahead's top-k: where its router rode along, a second block of the routing's
        // launch; else a launch of its own below.
        let lookahead_topk = |n: &crate::weights::Moe| -> Result<AheadTopk> {
            let nl = n.expert_slot;
            self.write_bias(sc, nl, 1)?;
            Ok(AheadTopk {
                logits: ahead.ptr,
                bias: self.bias_row(mb, nl, 1),
                k: self.lookahead_width,
                ids: mb.pred_ids.at(nl * 2 * k * 4),
                weights: mb.pred_weights.at(nl * 2 * k * 4),
                host: mb.pred_host.dev + (nl * 2 * k * 4) as u64,
            })
        };
        let topk_beside = match riding_ahead.filter(|_| self.lookahead_topk_beside) {
            Some(n) => Some(lookahead_topk(n)?),
            None => None,
        };
        self.route(
            logits.ptr,
            slices,
            (bias, mb.bias_next),
            k,
            mb.ids.at(l * k * 4),
            weights,
            // Streaming: straight into host memory, read at the router-ready event. Resident: the
            // step copies every layer's ids back once, at its end.
            if resident { 0 } else { mb.ids_host.dev + (l * k * 4) as u64 },
            map,
            table,
            ranks,
            if found_here && self.router_poll { mb.ready.dev + (l * 4) as u64 } else { 0 },
            after,
            topk_beside,
        )?;
        let ev = &mb.events[l];
        if !resident {
            if self.cpu_experts.is_some() {
                // The block's input, for experts the CPU may compute.
                g.download(&mb.x_host, l * h * 4, sc.inp.ptr, h * 4)?;
            }
            if self.cut_weak.is_some() {
                // The routing weights too, for the deadline cut.
                g.download(&mb.weights_host, l * k * 4, weights, k * 4)?;
            }
            self.record_head_event(&ev[0])?;
            if anatomy_event {
                self.record_head_event(&ev[6])?;
            }
        }
        // The lookahead's top-k (and its router where it did not ride along), queued after the
        // router-ready event so it does not delay this block's reads; the host reads the
        // prediction once this block's resident experts are queued.
        if let Some(n) = ahead_of {
            if topk_beside.is_none() {
                if riding_ahead.is_none() {
                    n.gate.matvec(g, sc.inp.ptr, ahead.ptr)?;
                }
                let a = lookahead_topk(n)?;
                self.route(a.logits, None, (a.bias, 0), a.k, a.ids, a.weights, a.host, 0, 0, 0, 0, 0, None)?;
            }
            self.record_head_event(&ev[5])?;
        }
        // Streaming, the shared expert's gate and up projections where they do not ride along; its
        // down projection then runs while the host reads the routing (silu(gate) * up, applied as it
        // stages its input), unless it rides along in the found experts' launch.
        if !resident && gate_up_ride.is_none() {
            matvec_many(g, sc.inp.ptr, &shared_gate_up)?;
        }
        let shared_down = || m.shared_down_proj.matvec_in(g, MatvecInput::SiluMul(sg.ptr, su.ptr), shared.ptr);
        if beside {
            g.on_side(shared_down)?;
        } else if !rides {
            shared_down()?;
        }
        if found_here {
            // Their first stamp is the block's (`moe_found`; cleared at the step's start).
            let stamps = mb.stamps_at(l);
            let io = self.expert_io(sc, stamps, ride, gate_up_ride);
            let layout = &self.store.manifest.experts.layers[l];
            self.launch_experts(layout, mb.found.at(l * k * 8), 0, k, &mut || Ok(()), io)?;
        }
        if !resident && self.head_events_beside() && !self.joins_deferred.load(std::sync::atomic::Ordering::Relaxed) {
            // The side stream that recorded the head's events rejoins (a capture ends joined).
            g.join()?;
        }
        Ok(())
    }

    /// Queues MoE layer `l`'s combination ([`moe_combine` in ple_moe.cu]): the expert rows of
    /// `sc.eout` by the per-rank rows at `ranks`, weighted, plus the shared expert's row
    /// `shared_out` gated; injected into the residual where `inject` (the step's blocks).
    #[allow(clippy::too_many_arguments)]
    fn launch_combine(
        &self,
        gpu: &Gpu,
        sc: &Scratch,
        l: usize,
        ranks: u64,
        shared_out: u64,
        inject: bool,
        stamp: u64,
    ) -> Result<()> {
        let c = self.config();
        let (h, k) = (c.hidden_size, c.num_experts_per_tok);
        let [_, _, _, _, sgate, _, _] = &sc.big;
        let mut args = vec![
            Arg::Ptr(sc.eout.ptr),
            Arg::Ptr(ranks),
            Arg::Ptr(sc.moe.weights.at(l * k * 4)),
            Arg::I32(k as i32),
            Arg::Ptr(shared_out),
            Arg::Ptr(sgate.ptr),
            Arg::Ptr(sc.out.ptr),
            Arg::I32(h as i32),
            // Fused hyper-connection injection (the step's blocks), else none.
            Arg::Ptr(if inject { sc.x.ptr } else { 0 }),
            Arg::Ptr(sc.inj.ptr),
            Arg::I32(c.hc_count as i32),
            Arg::Ptr(stamp),
        ];
        // A verifying pass's rows: each row's own vectors, one stride apart.
        let (rows, rs) = gpu.rows();
        if rows > 1 {
            if stamp != 0 {
                bail!("moe_combine_rows: a verifying pass's rows are not stamped");
            }
            args.push(Arg::U64(rs));
            return gpu.launch("moe_combine_rows", (blocks(h, 256), 1, rows), 256, 0, &args);
        }
        gpu.launch("moe_combine", (blocks(h, 256), 1, 1), 256, 0, &args)
    }

    /// Records one of a streamed head's events (router ready, its timed twin, lookahead ready):
    /// beside the compute stream ([`Gpu::record_beside`]) in a segment graph's capture, unless
    /// `CHERENKOV_EVENTS_IN_LINE=1`; in line where the head's kernels are launched one by one (there
    /// a record between two launches costs the second its early launch either way, and the fork's
    /// four driver calls would only delay the host).
    fn record_head_event(&self, ev: &Event) -> Result<()> {
        if self.head_events_beside() { self.gpu.record_beside(ev) } else { self.gpu.record(ev) }
    }

    /// Whether a streamed block's router finds its landed experts in the slots' hit map
    /// (`device_hits`, copies from a pinned expert file, no deadline cut, no experts on the CPU, no
    /// anatomy).
    fn finds_hits(&self) -> bool {
        self.device_hits
            && self.pool.memory().copies_in_background()
            && self.cut_weak.is_none()
            && self.cpu_experts.is_none()
            && !self.anatomy
    }

    fn head_events_beside(&self) -> bool {
        self.events_beside && self.gpu.capturing()
    }

    /// The MoE block of the step on `sc.inp` into `sc.out` (see the module docs for the handshake):
    /// its head ([`CudaModel::moe_head`], unless the step queued it already:
    /// [`MoeStep::head_queued`]), then the routed experts and the combination; streaming, the host
    /// waits here for the router and leases the block's experts. `next` is the following layer's
    /// block, whose experts the lookahead predicts.
    pub(crate) fn moe<'p>(
        &'p self,
        sc: &mut Scratch,
        m: &crate::weights::Moe,
        next: Option<&crate::weights::Moe>,
        st: &mut MoeStep<'p>,
    ) -> Result<()> {
        if !std::mem::take(&mut st.head_queued) {
            if sc.moe.map.is_none() && self.finds_hits() {
                let l = m.expert_slot;
                // SAFETY: a block queued alone ([`CudaModel::moe_alone`]) follows a stream sync.
                unsafe { self.clear_block_marks(&sc.moe, l..l + 1) };
            }
            self.moe_head(sc, m, next, self.anatomy && !st.untimed, 0)?;
        }
        let c = self.config().clone();
        let g = &*self.gpu;
        let (h, k) = (c.hidden_size, c.num_experts_per_tok);
        let l = m.expert_slot;
        let [_, _, _, shared, _, _, _] = &sc.big;
        let mb = &sc.moe;
        let resident = mb.map.is_some();
        let ride = self.shared_riding(sc, m);
        let beside = resident && self.shared_beside && ride.is_none();
        // The shared expert's output: the down launch's extra row where it rides along.
        let shared_out = ride.map_or(shared.ptr, |r| r.out);
        let (table, ranks) = (mb.table_at(l, k), mb.ranks_at(l, k));
        let ev = &mb.events[l];
        let ahead_of = next.filter(|_| self.lookahead && !resident);
        st.routed.push(l);
        let layout = &self.store.manifest.experts.layers[l];
        // Clock stamps instead of events where nothing else needs events (the anatomy reads them).
        let stamp = !st.untimed && !self.anatomy;
        let stamps = mb.stamps_at(l);
        // (Where the router finds its experts, the head's launch may have written them already:
        // `queue_step` cleared them.)
        if stamp && !self.finds_hits() {
            // SAFETY: the previous step's kernels that wrote these ended with its stream sync.
            unsafe { mb.stamps.as_mut_slice::<u64>()[l * STAMPS..(l + 1) * STAMPS].fill(0) };
        }
        let inject = st.inject;
        let combine = |gpu: &Gpu, stamp: u64| self.launch_combine(gpu, sc, l, ranks, shared_out, inject, stamp);
        if resident {
            // The router wrote the table: all k experts, in rank order. Timed by the kernels' clock
            // stamps (from the gate/up kernel's start to the combination's), or for the anatomy by
            // events around them.
            if !st.untimed && self.anatomy {
                g.record(&ev[6])?;
                st.blocks.push((l, Vec::new()));
                g.record(&ev[1])?;
            }
            let io = self.expert_io(sc, if stamp { stamps } else { 0 }, ride, self.shared_gate_up_riding(sc, m));
            self.launch_experts(layout, table, 0, k, &mut || Ok(()), io)?;
            if beside {
                g.join()?;
            }
            combine(g, if stamp { stamps + 8 } else { 0 })?;
            if !st.untimed && self.anatomy {
                g.record(&ev[2])?;
            }
            if stamp {
                st.stamped.push(l);
            }
            return Ok(());
        }

        if self.finds_hits() {
            return self.moe_found(sc, m, ahead_of, st, &combine, if stamp { stamps } else { 0 });
        }
        // The CPU team spins while blocks come, ready for a job (`--cpu-experts`).
        if let Some(cx) = &self.cpu_experts {
            cx.team.keep_warm();
        }
        // The previous blocks' noise draws, while this block's router runs.
        self.draw_noise(st);
        // 1. Router ready.
        ev[0].wait()?;
        let awake = std::time::Instant::now();
        // Every kernel queued before this router has finished, those of the previous lease too.
        st.pending = None;
        // SAFETY: the router kernel that wrote these has finished (ev[0]); nothing writes them now.
        let experts: Vec<usize> =
            unsafe { mb.ids_host.as_slice::<i32>() }[l * k..(l + 1) * k].iter().map(|&i| i as usize).collect();
        let mem = self.pool.memory();
        // Misses the CPU computes (`--cpu-experts`): those of lowest routing weight, as many as end
        // the block soonest at the measured rates; their job starts now, before the lease.
        let (cpu_ranks, gpu_ranks) = self.split_for_cpu(l, &experts);
        let mut cpu_job = match (&self.cpu_experts, cpu_ranks.is_empty()) {
            (Some(cx), false) => {
                // SAFETY: the download of the block's input finished before ev[0], which was
                // waited for; the next write of this row is the next step's, after this job.
                let x = unsafe { &mb.x_host.as_slice::<f32>()[l * h..(l + 1) * h] };
                let jobs = cpu_ranks
                    .iter()
                    .map(|&r| {
                        let rec = cx.record(&self.store, mem, l, experts[r])?;
                        let matrices = cherenkov_cpu::expert::ExpertMatrices::from_record(rec, layout)?;
                        Ok(cherenkov_cpu::team::JobExpert { matrices, x })
                    })
                    .collect::<Result<Vec<_>>>()?;
                Some(cx.team.submit(&jobs))
            }
            _ => None,
        };
        let gpu_experts: Vec<usize> = gpu_ranks.iter().map(|&r| experts[r]).collect();
        // 2. Lease (misses are queued first). Copies from a pinned expert file only need queueing:
        // this thread queues them at once, and no IO thread is woken for them.
        let background = mem.copies_in_background();
        let batch0 = mem.batch_ns();
        let acquire_at = std::time::Instant::now();
        let lease = if background {
            self.pool.acquire_loading(l, &gpu_experts)?
        } else {
            self.pool.acquire(l, &gpu_experts)?
        };
        let turn_ns = awake.elapsed().as_nanos() as u64;
        let loads_ns = mem.batch_ns() - batch0;
        // The host's turn step by step, where the anatomy is read (no clock reads otherwise).
        let timed_turn = !st.untimed && self.anatomy;
        let since = |t: std::time::Instant| t.saturating_duration_since(awake).as_nanos() as u64;
        let mark = || if timed_turn { since(std::time::Instant::now()) } else { 0 };
        let mut marks = [since(acquire_at), turn_ns, 0, 0, 0];
        let batch_marks = match crate::slots::last_batch() {
            (Some(a), Some(b)) if timed_turn && background && a >= awake => Some([since(a), since(b)]),
            _ => None,
        };
        // The misses' back parts (their down projections) behind every front (the lease queued the
        // fronts), so the read experts' gate/up kernel can start before they land.
        if background {
            mem.queue_backs()?;
        }
        marks[2] = mark();
        if !cpu_ranks.is_empty() {
            let ids: Vec<usize> = cpu_ranks.iter().map(|&r| experts[r]).collect();
            self.pool.record_cpu_computed(l, &ids);
        }
        let entries = lease.entries();
        let n_gpu = entries.len();
        // Table order: resident first, then the rest, each by routing weight (experts arrive sorted);
        // the experts computed on the CPU last. A record the pool holds whose copy from the pinned
        // file is still running (a prefetch) goes with the read experts, so the resident experts'
        // kernels do not wait for it.
        let landed: Vec<bool> = (0..n_gpu)
            .map(|i| {
                let copied = || {
                    mem.landed(entries[i].slot).with_context(|| {
                        format!("expert {} of MoE layer {l} ({}), copied ahead", entries[i].expert, layout.layer)
                    })
                };
                Ok(entries[i].hit && (!background || copied()?))
            })
            .collect::<Result<_>>()?;
        let mut order: Vec<usize> = (0..n_gpu).filter(|&i| landed[i]).collect();
        let hits = order.len();
        order.extend((0..n_gpu).filter(|&i| !landed[i]));
        // SAFETY: the stream has passed this layer's previous use of its table rows (ev[0] follows
        // the previous step's end), so no copy reads them while they are written.
        unsafe { self.write_entries(mb, l, &lease, &gpu_ranks, &order, n_gpu, &cpu_ranks)? };
        marks[3] = mark();
        if !st.untimed && self.anatomy {
            st.blocks.push((l, order[hits..].iter().map(|&i| entries[i].slot).collect()));
            if hits < n_gpu {
                st.host_turn_ns += turn_ns;
                st.host_loads_ns += loads_ns;
                if let Some(b) = batch_marks {
                    (0..2).for_each(|i| st.host_batch_marks[i] += b[i]);
                }
            }
        }
        // 3. The resident experts' kernels run while the reads finish (a copy that landed since it
        // was checked above costs the stream nothing to wait for).
        for &i in &order[..hits] {
            mem.await_slot(entries[i].slot)?;
        }
        marks[4] = mark();
        if timed_turn {
            (0..5).for_each(|i| st.host_marks[i] += marks[i]);
        }
        // (Events around them: they run while the copies do, so an event between kernels costs
        // nothing there, and the one after them is the deadline cut's. In a block with every
        // expert on the GPU and resident, the kernels' clock stamps time them instead, as in a
        // resident step: an event between them and the combination cost it its early launch,
        // about 3 us a block on the H200.)
        let whole = stamp && hits == n_gpu && cpu_ranks.is_empty();
        if whole {
            self.launch_experts(layout, table, 0, hits, &mut || Ok(()), self.expert_io(sc, stamps, None, None))?;
            st.stamped.push(l);
            st.whole_stamped.push(l);
        } else {
            g.record(&ev[1])?;
            self.launch_experts(layout, table, 0, hits, &mut || Ok(()), self.expert_io(sc, 0, None, None))?;
            g.record(&ev[2])?;
        }
        if !st.untimed && self.anatomy {
            st.host_resident_ns += awake.elapsed().as_nanos() as u64;
        }
        let look = || self.after_queueing(mb, l, &experts, ahead_of);
        // Where the host has nothing to wait for before queueing the read experts (copies from the
        // pinned file, no deadline cut, no experts on the CPU), their kernels and the combination
        // are queued before the lookahead's work, so that the stream holds them when the copies
        // land instead of when the host gets to them (`CHERENKOV_READS_FIRST=0`: after it).
        let early = background && self.cut_weak.is_none() && cpu_job.is_none() && self.reads_first;
        if !early {
            look()?;
        }
        // 4. Reads done: the read experts, then the combination.
        if hits < n_gpu {
            let tw = std::time::Instant::now();
            let kept = match self.cut_weak {
                Some(w) => self.cut_at_deadline(mb, l, &lease, &order, hits, &ev[2], w)?,
                None => n_gpu,
            };
            // With copies in the background the host only waits for them to be queued; the stream
            // waits for the copies themselves: for the gate and up projections first (the copies'
            // fronts, queued before every back part), then, between the two kernels, for the rest.
            for &i in &order[hits..kept] {
                lease.wait(i)?;
                mem.await_front(entries[i].slot)?;
            }
            st.cut += (n_gpu - kept) as u64;
            if background {
                st.gpu_waited.push(l);
            } else {
                st.wait_ns += tw.elapsed().as_nanos() as u64;
            }
            // The read experts are timed by events where the anatomy or the CPU's experts need
            // them, else by clock stamps: an event between the combination and the next layer's
            // first kernel would cost that kernel its early launch on every block's critical path
            // (about 0.01 ms a block, measured).
            let stamp_read = stamp && cpu_job.is_none() && kept > hits;
            g.record(&ev[3])?;
            if kept > hits {
                let mut backs = || -> Result<()> {
                    for &i in &order[hits..kept] {
                        mem.await_slot(entries[i].slot)?;
                    }
                    Ok(())
                };
                let io = self.expert_io(sc, if stamp_read { stamps } else { 0 }, None, None);
                self.launch_experts(layout, table, hits, kept - hits, &mut backs, io)?;
                if stamp_read {
                    st.stamped.push(l);
                } else {
                    st.read_timed.push(l);
                }
            }
            if cpu_job.is_some() {
                // The read experts' end, before the stream waits for the CPU's outputs.
                g.record(&ev[4])?;
            }
        }
        // The experts computed on the CPU: their outputs into their table entries' rows.
        if let Some(job) = cpu_job.as_mut() {
            let tw = std::time::Instant::now();
            let out = job.wait().with_context(|| {
                let ids: Vec<usize> = cpu_ranks.iter().map(|&r| experts[r]).collect();
                format!("experts {ids:?} of MoE layer {l} ({}), computed on the CPU", layout.layer)
            })?;
            st.cpu_wait_ns += tw.elapsed().as_nanos() as u64;
            st.cpu_experts += cpu_ranks.len() as u64;
            let at = l * k * h;
            // SAFETY: this layer's rows of cpu_out were last uploaded by the previous step, which
            // ended with a stream sync; nothing reads them now.
            unsafe { mb.cpu_out.as_mut_slice::<f32>()[at..at + out.len()].copy_from_slice(out) };
            g.upload(sc.eout.at(n_gpu * h * 4), &mb.cpu_out, at * 4, out.len() * 4)?;
        }
        drop(cpu_job);
        let stamped = st.stamped.last() == Some(&l);
        combine(g, if stamped { stamps + 8 } else { 0 })?;
        if st.read_timed.last() == Some(&l) && cpu_ranks.is_empty() {
            g.record(&ev[4])?;
        }
        if early {
            look()?;
        }
        self.end_block(st, l, lease);
        Ok(())
    }

    /// A streamed block's host work once its kernels are queued: the cache policy's bookkeeping
    /// (adaptive LRFU's ghost caches) while the copies run, then the lookahead's reads, behind
    /// this block's misses (`ahead_of`: the block it predicts).
    fn after_queueing(
        &self,
        mb: &MoeBufs,
        l: usize,
        experts: &[usize],
        ahead_of: Option<&crate::weights::Moe>,
    ) -> Result<()> {
        self.pool.replay_ghosts();
        self.queue_lookahead(mb, l, experts, ahead_of, false).map(|_| ())
    }

    /// The lookahead's reads for the block `ahead_of` predicts, once its router's prediction is
    /// ready ([`CudaModel::look_ahead`]); `unwoken`: left queued for this thread to run
    /// ([`ExpertPool::load_prefetches`]) instead of waking an IO thread. Returns how many reads it
    /// queued.
    fn queue_lookahead(
        &self,
        mb: &MoeBufs,
        l: usize,
        experts: &[usize],
        ahead_of: Option<&crate::weights::Moe>,
        unwoken: bool,
    ) -> Result<usize> {
        if ahead_of.is_some() {
            mb.events[l][5].wait()?;
        }
        self.look_ahead(mb, l, experts, ahead_of, unwoken)
    }

    /// Ends a streamed block's turn: the synthetic routers' next noise for this layer (the
    /// benchmark's), with its estimate where a lookahead will predict it: 19 us of host time on
    /// the build machine (9.6 without the estimate), drawn while the next block's router runs
    /// (`draw_noise`), where it delays no kernel: drawn here, it held up the next layer's first
    /// kernel by about 10 us a block (`CHERENKOV_NOISE_IN_BLOCK=1` draws it here, a measurement
    /// knob). The slots stay leased until a later event shows the block's kernels finished.
    fn end_block<'p>(&self, st: &mut MoeStep<'p>, l: usize, lease: Lease<'p, DeviceSlots>) {
        if self.skew.is_some() {
            st.noise.push(l);
            if noise_in_block() {
                self.draw_noise(st);
            }
        }
        st.pending = Some(lease);
    }

    /// A streamed block whose router looked its experts up in the slots' hit map
    /// ([`crate::slots::DeviceSlots::enable_hit_map`]) and wrote the found ones' table entries
    /// (`MoeBufs::found`, 0 for the others). Their kernels end the block's head
    /// ([`CudaModel::moe_head`], in its segment graph), so they run while the host takes its turn;
    /// they skip the zero entries, and the shared expert rides along in them where it can. The
    /// host then leases all k experts as before and queues the rest (misses, copies still
    /// running, records not yet in the map) into the expert rows after row k (row k is the riding
    /// shared expert's), behind their copies, and the combination, whose per-rank rows it
    /// uploads: rank r's row is r where it was found, else k + 1 + its place among the rest. Last,
    /// the lookahead's reads, and the records whose copies have landed enter the map for the
    /// routers queued after this.
    ///
    /// The map changes only here, between this block's router and the next one's: the pool
    /// retires a slot's record before it reuses the slot, and a record this router found is a
    /// hit of this block's lease, so it stays until this block's kernels are done.
    fn moe_found<'p>(
        &'p self,
        sc: &Scratch,
        m: &crate::weights::Moe,
        ahead_of: Option<&crate::weights::Moe>,
        st: &mut MoeStep<'p>,
        combine: &dyn Fn(&Gpu, u64) -> Result<()>,
        stamps: u64,
    ) -> Result<()> {
        let c = self.config();
        let g = &*self.gpu;
        let k = c.num_experts_per_tok;
        let l = m.expert_slot;
        let mb = &sc.moe;
        let ev = &mb.events[l];
        let layout = &self.store.manifest.experts.layers[l];
        let mem = self.pool.memory();
        // 1. The found experts (and the shared expert where it rides along) ended the head
        // ([`CudaModel::moe_head`]). Timed by the clock stamps from their start to the
        // combination's, less the wait for copies (ev[2] to ev[3]): an event before them would
        // cost their launch its early start behind the head's last kernel.
        g.record(&ev[2])?;
        self.draw_noise(st);
        // 2. Router ready: the host's turn.
        self.await_router(mb, l)?;
        st.pending = None;
        // The map has not changed since this router was queued.
        let (experts, found, lease, rest) = self.lease_found(mb, l)?;
        mem.queue_backs()?;
        let entries = lease.entries();
        // SAFETY: the stream has passed this layer's previous use of its entries (ev[0] follows the
        // previous step's end), so no copy reads them while they are written.
        unsafe { self.write_found_entries(mb, l, &lease, &found, &rest)? };
        // 3. The rest, behind their copies: the gate and up projections once their fronts landed,
        // the down projections once the backs did.
        let stamped = stamps != 0;
        if stamped {
            st.stamped.push(l);
            st.whole_stamped.push(l);
            st.found.push(l);
        }
        if !rest.is_empty() {
            for &r in &rest {
                lease.wait(r)?;
                mem.await_front(entries[r].slot)?;
            }
            st.gpu_waited.push(l);
            g.record(&ev[3])?;
            let mut backs = || -> Result<()> {
                for &r in &rest {
                    mem.await_slot(entries[r].slot)?;
                }
                Ok(())
            };
            let io = self.read_expert_io(sc);
            self.launch_experts(layout, mb.table_at(l, k), 0, rest.len(), &mut backs, io)?;
            if !stamped {
                st.read_timed.push(l);
            }
        }
        combine(g, if stamped { stamps + 8 } else { 0 })?;
        if st.read_timed.last() == Some(&l) {
            g.record(&ev[4])?;
        }
        // 4. The pool's bookkeeping and the lookahead's reads, then what landed enters the map.
        self.after_queueing(mb, l, &experts, ahead_of)?;
        mem.publish_landed()?;
        self.end_block(st, l, lease);
        Ok(())
    }

    /// Clears what the heads of MoE layers `layers` write into host memory for the host where the
    /// router finds its experts: their clock stamps (the found experts' launch stamps the block's
    /// start, [`CudaModel::moe_head`]) and their routers' ready flags ([`CudaModel::await_router`]).
    ///
    /// # Safety
    /// No kernel that writes them may be queued or running (the previous step ended with a stream
    /// sync, and these heads are not queued yet).
    unsafe fn clear_block_marks(&self, mb: &MoeBufs, layers: std::ops::Range<usize>) {
        // SAFETY: the caller's guarantee; in bounds (two stamps and one flag per MoE layer).
        unsafe {
            mb.stamps.as_mut_slice::<u64>()[layers.start * STAMPS..layers.end * STAMPS].fill(0);
            mb.ready.as_mut_slice::<u32>()[layers.clone()].fill(0);
            mb.flags.as_mut_slice::<u32>()[layers.start * 4..layers.end * 4].fill(0);
        }
    }

    /// A block's turn where its router looked its experts up in the hit map, once the router has
    /// chosen: its experts (from host memory), which ranks it found, the lease of all k (misses'
    /// copies queued) with each found expert checked to be in its lease's slot, and the ranks it
    /// did not find (the read experts), in rank order. The caller guarantees the map has not
    /// changed since the router read it.
    #[allow(clippy::type_complexity)]
    fn lease_found(
        &self,
        mb: &MoeBufs,
        l: usize,
    ) -> Result<(Vec<usize>, Vec<bool>, Lease<'_, DeviceSlots>, Vec<usize>)> {
        let k = self.config().num_experts_per_tok;
        let mem = self.pool.memory();
        // SAFETY: the router has written these (`await_router`); nothing writes them now.
        let experts: Vec<usize> =
            unsafe { mb.ids_host.as_slice::<i32>() }[l * k..(l + 1) * k].iter().map(|&i| i as usize).collect();
        let at: Vec<u64> = experts.iter().map(|&e| mem.hit_map_entry(l, e)).collect();
        let found: Vec<bool> = at.iter().map(|&a| a != 0).collect();
        let lease = self.pool.acquire_loading(l, &experts)?;
        let tag = layer_tag(&self.store.manifest.experts.layers[l]);
        for (r, e) in lease.entries().iter().enumerate() {
            if found[r] && at[r] != mem.slot_ptr(e.slot) | tag {
                bail!(
                    "MoE layer {l}: the hit map holds expert {} in another slot than the pool (an engine bug)",
                    e.expert
                );
            }
        }
        let rest: Vec<usize> = (0..k).filter(|&r| !found[r]).collect();
        Ok((experts, found, lease, rest))
    }

    /// Waits for MoE layer `l`'s router to choose ([`CudaModel::moe_found`]): polls the flag it sets
    /// in host memory once its ids are there ([`MoeBufs::ready`]), which comes before its launch
    /// ends and the router-ready event after it, where `router_poll`; else that event. Either way
    /// every kernel queued before the router has finished (it waited for them before it set the
    /// flag). The event is asked every 4096 polls, so a failed kernel or a router that ended
    /// without setting the flag is an error, not a hang.
    fn await_router(&self, mb: &MoeBufs, l: usize) -> Result<()> {
        let ev = &mb.events[l][0];
        if !self.router_poll {
            return ev.wait();
        }
        // SAFETY: in bounds (one u32 per MoE layer); the device writes it, so read volatile.
        let flag = unsafe { mb.ready.host.cast::<u32>().add(l) };
        let set = || {
            // SAFETY: as above.
            let v = unsafe { flag.read_volatile() };
            // The ids read after this were written before the flag (the kernel's system fence).
            std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
            v != 0
        };
        let mut polls = 0u32;
        while !set() {
            polls = polls.wrapping_add(1);
            if polls.is_multiple_of(4096) && ev.done()? && !set() {
                bail!("MoE layer {l}: the router ended without setting its ready flag (an engine bug)");
            }
            std::hint::spin_loop();
        }
        Ok(())
    }

    /// Writes MoE layer `l`'s entries for [`CudaModel::moe_found`] into pinned memory and queues
    /// their upload: the table holds the lease's entries of ranks `rest`, in that order; rank r's
    /// row is r where `found[r]`, else k + 1 + its place in `rest`.
    ///
    /// # Safety
    /// No queued copy may still be reading layer `l`'s row of the pinned entries.
    unsafe fn write_found_entries(
        &self,
        mb: &MoeBufs,
        l: usize,
        lease: &Lease<'_, DeviceSlots>,
        found: &[bool],
        rest: &[usize],
    ) -> Result<()> {
        debug_assert_eq!(found.iter().filter(|&&f| !f).count(), rest.len());
        let (t, r) = self.found_rows(l, lease, rest);
        // SAFETY: the caller's guarantee.
        unsafe { self.upload_entries(mb, l, &t, &r) }
    }

    /// [`CudaModel::write_found_entries`]'s table and per-rank rows, written into the pinned
    /// entries only: in a flagged step the block's front and back flags' relays copy them to the
    /// device ([`MoeBufs::relays`]).
    ///
    /// # Safety
    /// Nothing may be reading layer `l`'s row of the pinned entries.
    unsafe fn write_found_rows(&self, mb: &MoeBufs, l: usize, lease: &Lease<'_, DeviceSlots>, rest: &[usize]) {
        let (t, r) = self.found_rows(l, lease, rest);
        // SAFETY: the caller's guarantee.
        unsafe { self.write_entry_rows(mb, l, &t, &r) }
    }

    /// The address table (the lease's entries of ranks `rest`, in that order, then zeros) and the
    /// per-rank rows (rank r's row is r, the found launch's, except k + 1 + its place in `rest`).
    fn found_rows(&self, l: usize, lease: &Lease<'_, DeviceSlots>, rest: &[usize]) -> (Vec<u64>, Vec<i32>) {
        let k = self.config().num_experts_per_tok;
        let entries = lease.entries();
        let tag = layer_tag(&self.store.manifest.experts.layers[l]);
        let mem = self.pool.memory();
        let (mut t, mut r) = (vec![0u64; k], vec![0i32; k]);
        for (rank, row) in r.iter_mut().enumerate() {
            *row = rank as i32;
        }
        for (j, &rank) in rest.iter().enumerate() {
            t[j] = mem.slot_ptr(entries[rank].slot) | tag;
            r[rank] = (k + 1 + j) as i32;
        }
        (t, r)
    }

    /// Writes MoE layer `l`'s address table `t` and per-rank table entries `r` (k each) into its
    /// row of the pinned entries and queues their upload (one copy: they lie together,
    /// [`entries_stride`]).
    ///
    /// # Safety
    /// No queued copy may still be reading layer `l`'s row of the pinned entries.
    unsafe fn upload_entries(&self, mb: &MoeBufs, l: usize, t: &[u64], r: &[i32]) -> Result<()> {
        let stride = entries_stride(self.config().num_experts_per_tok);
        // SAFETY: the caller's guarantee.
        unsafe { self.write_entry_rows(mb, l, t, r) };
        self.gpu.upload(mb.entries.at(l * stride), &mb.entries_host, l * stride, stride)
    }

    /// Writes MoE layer `l`'s address table `t` and per-rank table entries `r` into its row of the
    /// pinned entries.
    ///
    /// # Safety
    /// Nothing may be reading layer `l`'s row of the pinned entries.
    unsafe fn write_entry_rows(&self, mb: &MoeBufs, l: usize, t: &[u64], r: &[i32]) {
        let k = self.config().num_experts_per_tok;
        let stride = entries_stride(k);
        // SAFETY: the caller guarantees nothing reads these rows now.
        let row = unsafe { &mut mb.entries_host.as_mut_slice::<u8>()[l * stride..(l + 1) * stride] };
        let (table_bytes, rank_bytes) = row.split_at_mut(k * 8);
        for (dst, v) in table_bytes.chunks_exact_mut(8).zip(t) {
            dst.copy_from_slice(&v.to_ne_bytes());
        }
        for (dst, v) in rank_bytes.chunks_exact_mut(4).zip(r) {
            dst.copy_from_slice(&v.to_ne_bytes());
        }
    }

    /// Draws the synthetic routers' noise of the layers `st` holds ([`MoeStep::noise`]).
    fn draw_noise(&self, st: &mut MoeStep<'_>) {
        if let Some(sk) = &self.skew {
            for l in st.noise.drain(..) {
                sk.prepare_noise(l, self.config().num_experts, self.lookahead);
            }
        }
    }

    /// Splits a block's top-k ranks into those the CPU computes (`--cpu-experts`: misses of lowest
    /// routing weight, as many as [`crate::offload::cpu_share`] gives) and those the GPU computes
    /// (in rank order). Without `--cpu-experts`, every rank is the GPU's.
    fn split_for_cpu(&self, l: usize, experts: &[usize]) -> (Vec<usize>, Vec<usize>) {
        let all: Vec<usize> = (0..experts.len()).collect();
        let Some(cx) = &self.cpu_experts else { return (Vec::new(), all) };
        let absent = self.pool.absent(l, experts);
        let misses: Vec<usize> = all.iter().copied().filter(|&r| absent[r]).collect();
        let n = cx.share(misses.len());
        let cpu = misses[misses.len() - n..].to_vec();
        let gpu = all.into_iter().filter(|r| !cpu.contains(r)).collect();
        (cpu, gpu)
    }

    /// Writes the synthetic routers' bias for MoE layer `l` (`which`: 0 routing, 1 predicting) into
    /// pinned memory; nothing without synthetic routing.
    fn write_bias(&self, sc: &Scratch, l: usize, which: usize) -> Result<()> {
        self.write_bias_at(sc, l, which, 0)
    }

    /// [`CudaModel::write_bias`] with the routing bias of the token `ahead` tokens after the one
    /// the synthetic routers route next (a verifying pass's second row: 1).
    fn write_bias_at(&self, sc: &Scratch, l: usize, which: usize, ahead: u64) -> Result<()> {
        let Some(sk) = &self.skew else { return Ok(()) };
        let e = self.config().num_experts;
        let at = (l * 2 + which) * e;
        // SAFETY: each (layer, which) row is written once per step, and the kernels that read the
        // previous step's row finished before this step began (steps end with a stream sync).
        let row = unsafe { &mut sc.moe.bias_host.as_mut_slice::<f32>()[at..at + e] };
        if which == 0 {
            // In place: this runs for every layer on the host's turn between two steps.
            sk.bias_into(l, e, ahead, row);
        } else {
            row.copy_from_slice(&sk.predict_bias(l, e));
        }
        Ok(())
    }

    /// The device address of a bias row [`CudaModel::write_bias`] wrote, or 0 without synthetic
    /// routing: the row in host memory as the device sees it, which the router reads before it
    /// waits for the logits. (An upload queued in the stream sat between the router's two kernels,
    /// about 0.01 ms per block that the real model does not spend.)
    fn bias_row(&self, mb: &MoeBufs, l: usize, which: usize) -> u64 {
        if self.skew.is_none() {
            return 0;
        }
        let e = self.config().num_experts;
        mb.bias_host.dev + ((l * 2 + which) * e * 4) as u64
    }

    /// The deadline cut (`--cut-weak`): waits until every read of the block is done or the
    /// resident experts' kernels have finished (`deadline`), whichever comes first. At the
    /// deadline the experts still being read whose routing weight is below `weak` are dropped:
    /// the table is rewritten with the kept read experts after the resident ones and the dropped
    /// last, and the dropped ranks point at an entry whose output is zero. Their slots stay leased
    /// until the lease is dropped, and their reads finish in the background. Returns the number of
    /// table entries kept (resident + kept read experts).
    #[allow(clippy::too_many_arguments)]
    fn cut_at_deadline(
        &self,
        mb: &MoeBufs,
        l: usize,
        lease: &Lease<'_, DeviceSlots>,
        order: &[usize],
        hits: usize,
        deadline: &Event,
        weak: f32,
    ) -> Result<usize> {
        let k = order.len();
        let mem = self.pool.memory();
        let entries = lease.entries();
        // Read and on the GPU (a copy in the background may still be running after its load).
        let arrived = |i: usize| -> Result<bool> { Ok(lease.is_ready(i) && mem.landed(entries[i].slot)?) };
        loop {
            let mut all = true;
            for &i in &order[hits..] {
                all &= arrived(i)?;
            }
            if all {
                return Ok(k);
            }
            if deadline.done()? {
                break;
            }
            // Not a tight spin: querying the event takes a driver lock the IO threads' copies
            // need too.
            std::thread::sleep(std::time::Duration::from_micros(20));
        }
        // SAFETY: downloaded before the router-ready event, which the caller waited for.
        let w = unsafe { &mb.weights_host.as_slice::<f32>()[l * k..(l + 1) * k] };
        // Decided once per entry: a read may finish while the table is being built, and an entry
        // judged twice could land in neither part (a rank without an entry).
        let (mut new_order, mut cut): (Vec<usize>, Vec<usize>) = (order[..hits].to_vec(), Vec::new());
        for &i in &order[hits..] {
            if !arrived(i)? && w[i] < weak { cut.push(i) } else { new_order.push(i) }
        }
        let kept = new_order.len();
        if kept == k {
            return Ok(k);
        }
        new_order.extend(cut);
        // SAFETY: the table's first upload ran before the resident kernels, which have finished
        // (the deadline passed), so these rows are not being read.
        unsafe { self.write_table(mb, l, lease, &new_order, kept)? };
        Ok(kept)
    }

    /// [`CudaModel::write_entries`] for a lease of the whole top-k (lease entry i is rank i) and
    /// no expert computed on the CPU.
    ///
    /// # Safety
    /// As for [`CudaModel::write_entries`].
    unsafe fn write_table(
        &self,
        mb: &MoeBufs,
        l: usize,
        lease: &Lease<'_, DeviceSlots>,
        order: &[usize],
        kept: usize,
    ) -> Result<()> {
        let ranks: Vec<usize> = (0..lease.len()).collect();
        // SAFETY: the caller's guarantee.
        unsafe { self.write_entries(mb, l, lease, &ranks, order, kept, &[]) }
    }

    /// Writes MoE layer `l`'s address table and, per top-k rank, its table entry into pinned
    /// memory, and queues their upload (one copy: they lie together, [`entries_stride`]). Two
    /// uploads took about 1.3 us of driver time each on the H200 host (session 17).
    /// The table holds the lease's entries in `order` (lease entry
    /// i serves top-k rank `rank_of[i]`), then one entry per rank of `cpu_ranks` (computed on the
    /// CPU: no address; their outputs are uploaded into those entries' rows). Ranks whose entry
    /// comes at or after `kept` among the lease's (dropped by the deadline cut) point at entry k,
    /// whose output row is zero.
    ///
    /// # Safety
    /// No queued copy may still be reading layer `l`'s row of the pinned entries.
    #[allow(clippy::too_many_arguments)]
    unsafe fn write_entries(
        &self,
        mb: &MoeBufs,
        l: usize,
        lease: &Lease<'_, DeviceSlots>,
        rank_of: &[usize],
        order: &[usize],
        kept: usize,
        cpu_ranks: &[usize],
    ) -> Result<()> {
        let k = self.config().num_experts_per_tok;
        let entries = lease.entries();
        let tag = layer_tag(&self.store.manifest.experts.layers[l]);
        let mem = self.pool.memory();
        let (mut t, mut r) = (vec![0u64; k], vec![-1i32; k]);
        for (p, &i) in order.iter().enumerate() {
            t[p] = mem.slot_ptr(entries[i].slot) | tag;
            r[rank_of[i]] = if p < kept { p as i32 } else { k as i32 };
        }
        for (j, &rank) in cpu_ranks.iter().enumerate() {
            t[order.len() + j] = 0;
            r[rank] = (order.len() + j) as i32;
        }
        if let Some(rank) = r.iter().position(|&e| e < 0) {
            bail!("MoE layer {l}: top-k rank {rank} has no table entry (an engine bug)");
        }
        // SAFETY: the caller's guarantee.
        unsafe { self.upload_entries(mb, l, &t, &r) }
    }

    /// Queues the router kernel (see `route_topk` in ple_moe.cu), choosing the top `k`; zero
    /// pointers are absent.
    #[allow(clippy::too_many_arguments)]
    fn route(
        &self,
        logits: u64,
        slices: Option<crate::weights::DeferredSlices>,
        (bias, bias_next): (u64, i64),
        k: usize,
        ids: u64,
        weights: u64,
        host: u64,
        map: u64,
        table: u64,
        ranks: u64,
        ready: u64,
        after: u64,
        beside: Option<AheadTopk>,
    ) -> Result<()> {
        let c = self.config();
        let a = beside.unwrap_or_default();
        let mut args = vec![
            Arg::Ptr(logits),
            Arg::Ptr(bias),
            Arg::F32(self.skew.as_ref().map_or(1.0, |s| s.skew.model as f32)),
            Arg::I32(c.num_experts as i32),
            Arg::I32(k as i32),
            Arg::I32(c.norm_topk_prob as i32),
            Arg::Ptr(ids),
            Arg::Ptr(weights),
            Arg::Ptr(host),
            Arg::Ptr(map),
            Arg::Ptr(table),
            Arg::Ptr(ranks),
            // The router launch's slices where it left them (`logits` is then not written).
            Arg::Ptr(slices.map_or(0, |s| s.parts)),
            Arg::I32(slices.map_or(0, |s| s.slices as i32)),
            Arg::Ptr(ready),
            Arg::Ptr(after),
        ];
        // One thread per expert.
        let threads = c.num_experts.next_multiple_of(32) as u32;
        // A verifying pass's rows: one block a row, each row's own buffers (none on the host).
        let (rows, rs) = self.gpu.rows();
        if rows > 1 {
            if beside.is_some() || host != 0 || ready != 0 || after != 0 {
                bail!("route_topk_rows: a verifying pass's rows take no lookahead, host ids, ready flag or wait");
            }
            args.extend([Arg::U64(rs), Arg::U64(bias_next as u64)]);
            return self.gpu.launch("route_topk_rows", (1, 1, rows), threads, 0, &args);
        }
        args.extend([
            Arg::Ptr(a.logits),
            Arg::Ptr(a.bias),
            Arg::I32(a.k as i32),
            Arg::Ptr(a.ids),
            Arg::Ptr(a.weights),
            Arg::Ptr(a.host),
        ]);
        self.gpu.launch("route_topk", (if beside.is_some() { 2 } else { 1 }, 1, 1), threads, 0, &args)
    }

    /// The gate/up then the down kernel of table entries `first..first + n`, on `io`
    /// ([`CudaModel::expert_io`]); `between` runs between the two launches (the read experts' stream
    /// waits for their down projections' copies there).
    fn launch_experts(
        &self,
        layout: &ExpertLayout,
        table: u64,
        first: usize,
        n: usize,
        between: &mut dyn FnMut() -> Result<()>,
        io: crate::weights::ExpertIo,
    ) -> Result<()> {
        crate::weights::launch_experts(
            &self.gpu,
            layout,
            self.store.record_bytes(),
            table,
            first,
            n,
            io,
            self.expert_dims(),
            between,
        )
    }

    /// The expert kernels' buffers: x, act and out of the step's scratch, and what rides along.
    fn expert_io(
        &self,
        sc: &Scratch,
        stamp: u64,
        shared: Option<crate::weights::SharedDown>,
        shared_gate_up: Option<crate::weights::SharedGateUp>,
    ) -> crate::weights::ExpertIo {
        crate::weights::ExpertIo {
            stamp,
            shared,
            shared_gate_up,
            ..crate::weights::ExpertIo::new(sc.inp.ptr, sc.act.ptr, sc.eout.ptr)
        }
    }

    /// The read experts' buffers where the router found the others ([`CudaModel::moe_found`]):
    /// their rows after row k (the found experts' rows, then the riding shared expert's).
    fn read_expert_io(&self, sc: &Scratch) -> crate::weights::ExpertIo {
        let c = self.config();
        let (h, k, inter) = (c.hidden_size, c.num_experts_per_tok, c.moe_intermediate_size);
        crate::weights::ExpertIo::new(sc.inp.ptr, sc.act.at((k + 1) * inter * 4), sc.eout.at((k + 1) * h * 4))
    }

    /// (intermediate, hidden) of the routed experts.
    fn expert_dims(&self) -> (usize, usize) {
        let c = self.config();
        (c.moe_intermediate_size, c.hidden_size)
    }

    /// Where the shared expert's gate and up projections of block `m` ride along in the routed
    /// experts' gate/up launch: where its down projection rides ([`CudaModel::shared_riding`]),
    /// `shared_gate_up_ride` on, and both of the experts' gate/up format
    /// ([`crate::weights::shared_gate_up_rides`]). Their outputs are the riding down projection's
    /// input.
    fn shared_gate_up_riding(&self, sc: &Scratch, m: &crate::weights::Moe) -> Option<crate::weights::SharedGateUp> {
        if !self.shared_gate_up_ride {
            return None;
        }
        let down = self.shared_riding(sc, m)?;
        let layout = &self.store.manifest.experts.layers[m.expert_slot];
        let (g, u) = (&m.shared_gate_proj, &m.shared_up_proj);
        if !crate::weights::shared_gate_up_rides(layout, self.store.record_bytes(), g, u, self.expert_dims()) {
            return None;
        }
        let group_size = match g.precision {
            Precision::Affine { group_size, .. } => group_size,
            Precision::Float { .. } => return None,
        };
        Some(crate::weights::SharedGateUp {
            gate: (g.data, g.scales, g.biases),
            up: (u.data, u.scales, u.biases),
            group_size,
            gate_out: down.gate,
            up_out: down.up,
        })
    }

    /// Where the shared expert's down projection of block `m` rides along in the routed experts'
    /// down launch: every expert resident, or streaming where the router finds its experts in the
    /// hit map (in the found experts' launch, [`CudaModel::moe_head`]; else it runs while the host
    /// reads the routing), `shared_ride` on, and its format that of the layer's experts
    /// ([`crate::weights::shared_rides`]). Its input is the router launch's shared gate and up
    /// outputs; its row goes after the k entries' rows.
    fn shared_riding(&self, sc: &Scratch, m: &crate::weights::Moe) -> Option<crate::weights::SharedDown> {
        let c = self.config();
        if !(sc.moe.map.is_some() || self.finds_hits()) || !self.shared_ride {
            return None;
        }
        let layout = &self.store.manifest.experts.layers[m.expert_slot];
        let dims = (c.moe_intermediate_size, c.hidden_size);
        let d = &m.shared_down_proj;
        if !crate::weights::shared_rides(layout, self.store.record_bytes(), d, dims) {
            return None;
        }
        let group_size = match d.precision {
            Precision::Affine { group_size, .. } => group_size,
            Precision::Float { .. } => return None,
        };
        let [_, sg, su, ..] = &sc.big;
        Some(crate::weights::SharedDown {
            data: d.data,
            scales: d.scales,
            biases: d.biases,
            group_size,
            gate: sg.ptr,
            up: su.ptr,
            out: sc.eout.at(c.num_experts_per_tok * c.hidden_size * 4),
        })
    }

    /// Scores the last prediction for layer `l` against `actual`; then takes the lookahead's
    /// prediction for the next block (computed on the device before the router-ready event) and
    /// queues its reads behind this step's misses. Returns how many reads it queued.
    fn look_ahead(
        &self,
        mb: &MoeBufs,
        l: usize,
        actual: &[usize],
        next: Option<&crate::weights::Moe>,
        unwoken: bool,
    ) -> Result<usize> {
        let mut pred = self.predicted.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = pred[l].take() {
            self.pool.record_lookahead(l, &p, actual);
        }
        let Some(n) = next else { return Ok(0) };
        let k = self.config().num_experts_per_tok;
        let nl = n.expert_slot;
        // SAFETY: written by a kernel that finished before the prediction-ready event the caller
        // waited for.
        let at = nl * 2 * k;
        let guess: Vec<usize> = unsafe { mb.pred_host.as_slice::<i32>() }[at..at + self.lookahead_width]
            .iter()
            .map(|&i| i as usize)
            .collect();
        // Where a step's thread launches its blocks' kernels (the segments path) the IO threads
        // queue the reads, copies from a pinned expert file too: queued from that thread, the
        // driver calls delayed the block's next launches, and a streamed layer took 0.240-0.265 ms
        // against 0.218-0.219, measured. A flagged turn launches nothing, and runs them itself
        // (`unwoken`; `CudaModel::turn_flagged`).
        let queued = match self.lookahead_reads {
            Some(most) => {
                let absent = self.pool.absent(nl, &guess);
                let reads: Vec<usize> =
                    guess.iter().zip(absent).filter(|(_, a)| *a).map(|(&e, _)| e).take(most).collect();
                self.prefetch(nl, &reads, unwoken)
            }
            None => self.prefetch(nl, &guess, unwoken),
        };
        pred[nl] = Some(guess[..k].to_vec());
        Ok(queued)
    }

    /// Queues the pool's reads of `experts` of MoE layer `layer`: woken IO threads run them, or
    /// (`unwoken`) this thread later ([`ExpertPool::load_prefetches`]).
    fn prefetch(&self, layer: usize, experts: &[usize], unwoken: bool) -> usize {
        if unwoken { self.pool.prefetch_unwoken(layer, experts) } else { self.pool.prefetch(layer, experts) }
    }
}

/// Where a record splits into the gate and up projections (every piece of them before it) and the
/// down projection (every piece of it at or after it), the same for every layer; 0 where the
/// layouts do not split so.
fn front_bytes(layers: &[ExpertLayout]) -> usize {
    let spans = |m: &RecordMatrix| [Some(m.data), m.scales, m.biases].into_iter().flatten().collect::<Vec<_>>();
    let mut front = u64::MAX;
    let mut gate_up_end = 0u64;
    for l in layers {
        for m in [&l.gate_proj, &l.up_proj] {
            gate_up_end = gate_up_end.max(spans(m).iter().map(|s| s.offset + s.len).max().unwrap_or(0));
        }
        front = front.min(spans(&l.down_proj).iter().map(|s| s.offset).min().unwrap_or(0));
    }
    if layers.is_empty() || gate_up_end > front { 0 } else { front as usize }
}

/// The precision tag of a layer's address-table entries.
fn layer_tag(layout: &ExpertLayout) -> u64 {
    match layout.gate_proj.precision {
        Precision::Affine { bits: 3, .. } => TAG_Q3,
        Precision::Affine { bits: 2, .. } => TAG_Q2,
        _ => 0,
    }
}

/// The expert kernels for a layer's record layout (gate and up must share a format).
pub fn expert_kernels(l: &ExpertLayout) -> Result<(String, String)> {
    let bits = |m: &RecordMatrix, what: &str| match m.precision {
        Precision::Affine { bits, .. } => Ok(bits),
        Precision::Float { dtype } => {
            bail!("{}: {what} experts in {dtype} are not supported on CUDA (affine-quantized experts only)", l.layer)
        }
    };
    let (gb, ub, db) =
        (bits(&l.gate_proj, "gate_proj")?, bits(&l.up_proj, "up_proj")?, bits(&l.down_proj, "down_proj")?);
    if l.gate_proj.precision != l.up_proj.precision {
        bail!(
            "{}: gate_proj and up_proj experts differ in precision ({gb} vs {ub} bits); not supported on CUDA",
            l.layer
        );
    }
    Ok((format!("expert_gate_up_q{gb}"), format!("expert_down_q{db}")))
}

impl Backend for CudaModel {
    type Session = CudaSession;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn new_session(&self) -> Result<CudaSession> {
        CudaModel::new_session(self)
    }

    fn snapshot_session(&self, s: &CudaSession) -> Result<CudaSession> {
        s.try_clone()
    }

    fn session_len(&self, s: &CudaSession) -> usize {
        s.pos
    }

    fn session_bytes(&self, s: &CudaSession) -> Option<usize> {
        Some(s.bytes())
    }

    fn forward(&self, s: &mut CudaSession, tokens: &[u32], which: Logits) -> Result<Vec<f32>> {
        self.forward_tokens(s, tokens, which)
    }

    fn enable_drafting(&self, s: &mut CudaSession) -> Result<()> {
        CudaModel::enable_drafting(self, s)
    }

    fn drafting(&self, s: &CudaSession) -> bool {
        CudaModel::drafting(self, s)
    }

    fn draft(&self, s: &mut CudaSession, next: u32) -> Result<Vec<f32>> {
        CudaModel::draft(self, s, next)
    }

    fn verify(&self, s: &mut CudaSession, tokens: &[u32]) -> Result<Vec<f32>> {
        CudaModel::verify(self, s, tokens)
    }

    fn commit(&self, s: &mut CudaSession, keep: usize) -> Result<()> {
        CudaModel::commit(self, s, keep)
    }

    fn draft_top(&self, s: &mut CudaSession, next: u32, k: usize, among: usize) -> Result<Vec<(u32, f32)>> {
        self.draft_candidates(s, next, k, among)
    }

    fn verify_top(&self, s: &mut CudaSession, tokens: &[u32], k: usize, among: usize) -> Result<Vec<Vec<(u32, f32)>>> {
        self.verify_candidates(s, tokens, k, among)
    }

    fn vocab_size(&self) -> usize {
        self.config().vocab_size
    }

    fn pool_stats(&self) -> PoolStats {
        self.pool.stats()
    }

    fn forward_top(&self, s: &mut CudaSession, tokens: &[u32], k: usize, among: usize) -> Result<Vec<(u32, f32)>> {
        self.forward_candidates(s, tokens, k, among)
    }

    fn forward_stats(&self) -> Option<ForwardStats> {
        cherenkov_engine::stats::ENABLED.then(|| self.pool.forward_stats())
    }

    fn expert_stats(&self, layer: usize) -> Option<Vec<ExpertStats>> {
        self.pool.expert_stats(layer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cherenkov_model::store::Span;

    #[test]
    fn the_rows_recurrence_shares_its_rows_ahead_with_gdn_cu() {
        // gdn_rows_shared sizes the kernel's shared memory from the host's count; a kernel that
        // stages more rows than that would write past it.
        let gdn = crate::compile::SOURCES.iter().find(|(n, _)| *n == "gdn.cu").expect("gdn.cu").1;
        let define = gdn.lines().find_map(|l| l.strip_prefix("#define GDN_ROWS_AHEAD ")).expect("the define");
        assert_eq!(define.trim().parse::<usize>().ok(), Some(GDN_ROWS_AHEAD));
    }

    #[test]
    fn a_flagged_blocks_row_has_a_column_for_every_header_and_its_stamps_from_the_steps_start() {
        let r = FlagRow {
            layer: 3,
            misses: 1,
            inflight: 2,
            rest: 3,
            copying: true,
            prefetched: 2,
            router_wait_ns: 81_500,
            marks: [9_000, 15_250, 27_000, 30_000, 36_000],
        };
        // Experts started, combination started, past the wait, began to wait (GPU ns).
        let line = flag_row_line(1, 7, &r, [1_010_000, 1_090_500, 1_060_000, 1_020_000], 1_000_000);
        let cols: Vec<&str> = line.split('\t').collect();
        assert_eq!(cols.len(), FLAG_ROW_HEADER.split('\t').count());
        assert_eq!(cols[..9], ["1", "7", "3", "1", "2", "3", "1", "2", "81.500"]);
        assert_eq!(cols[9..14], ["9.000", "15.250", "27.000", "30.000", "36.000"]);
        // start, wait began, wait past, combination.
        assert_eq!(cols[14..], ["10.000", "20.000", "60.000", "90.500"]);
        // A stamp its kernel never wrote (0) is no time.
        let unwritten = flag_row_line(1, 7, &r, [1_010_000, 0, 0, 0], 1_000_000);
        assert!(unwritten.ends_with("10.000\t-\t-\t-"), "{unwritten}");
    }

    #[test]
    fn a_layers_entries_hold_its_table_then_its_ranks_with_the_next_table_aligned() {
        for k in 1..=64 {
            let s = entries_stride(k);
            assert_eq!(s % 8, 0, "k = {k}: stride {s}");
            assert!(s >= k * 12 && s < k * 12 + 8, "k = {k}: stride {s}");
        }
        assert_eq!(entries_stride(10), 120);
    }

    #[test]
    fn a_front_or_back_flags_relay_copies_its_layers_entries_and_a_turn_flags_nothing() {
        let (flags, host, dev) = (0x1000u64, 0x2000_0000u64, 0x7000_0000u64);
        let stride = entries_stride(10);
        let rows = relay_rows(3, stride, flags, host, dev);
        assert_eq!(rows.len(), 3 * 4 * 4);
        for (f, r) in rows.chunks(4).enumerate() {
            let (layer, which) = (f / 4, f % 4);
            assert_eq!(r[0] as u32, 0, "flag {f}: `seen` starts clear");
            assert_eq!(r[1], flags + (f * 4) as u64, "flag {f}: its own word in the flags");
            if which == FLAG_FRONT || which == FLAG_BACK {
                assert_eq!(r[0] >> 32, 15, "layer {layer}: 120 bytes of entries are 15 words");
                assert_eq!((r[2], r[3]), (host + (layer * 120) as u64, dev + (layer * 120) as u64));
            } else {
                assert_eq!((r[0] >> 32, r[2], r[3]), (0, 0, 0), "flag {f} copies nothing");
            }
        }
    }

    fn matrix(data: (u64, u64), scales: (u64, u64)) -> RecordMatrix {
        RecordMatrix {
            shape: [8, 64],
            precision: Precision::Affine { bits: 4, group_size: 64 },
            data: Span { offset: data.0, len: data.1 },
            scales: Some(Span { offset: scales.0, len: scales.1 }),
            biases: None,
        }
    }

    fn layout(gate: u64, up: u64, down: u64) -> ExpertLayout {
        ExpertLayout {
            layer: "layers.0".into(),
            gate_proj: matrix((gate, 100), (gate + 100, 20)),
            up_proj: matrix((up, 100), (up + 100, 20)),
            down_proj: matrix((down, 100), (down + 100, 20)),
        }
    }

    #[test]
    fn records_split_where_the_down_projection_starts_in_every_layer() {
        assert_eq!(front_bytes(&[layout(0, 128, 256)]), 256);
        // The earliest down projection of all layers, as long as every gate/up ends before it.
        assert_eq!(front_bytes(&[layout(0, 128, 256), layout(0, 120, 248)]), 248);
        // A layer whose gate/up reach past another layer's down start: no split.
        assert_eq!(front_bytes(&[layout(0, 128, 256), layout(0, 200, 400)]), 0);
        // The down projection first: no split.
        assert_eq!(front_bytes(&[layout(128, 256, 0)]), 0);
        assert_eq!(front_bytes(&[]), 0);
    }
}
