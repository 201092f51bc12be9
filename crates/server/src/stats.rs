//! Statistics for `GET /v1/stats/...` and `GET /metrics`: what the expert cache, the backend and
//! the scheduler are doing.
//!
//! The engine keeps the counters (per MoE layer and per expert in the expert pool, forward time
//! split in the backend); this module adds what only the server sees, the steps it runs
//! ([`StepLog`]: per prefill chunk or decode step its tokens, time and time split, and tokens per
//! wall-clock second for the last minute), and turns it all into the JSON documents of
//! `docs/stats.md` (schema: `docs/stats.schema.json`) and the Prometheus text exposition.
//!
//! Nothing here runs per token beyond [`StepLog::record`]: one short lock and a few additions per
//! step. The documents are built when asked for.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use cherenkov_engine::backend::Backend;
use cherenkov_engine::stats::{
    ExpertStats, ForwardStats, LATENCY_BUCKET_BOUNDS_US, LATENCY_BUCKETS, LayerStats, PoolStats, Residency, SlotGauges,
};
use serde::Serialize;

use crate::queue::Status;

/// Steps kept for `GET /v1/stats/steps` (and the recent decode rate).
pub const RECENT_STEPS: usize = 128;
/// Seconds of tokens-per-second history in the summary.
pub const THROUGHPUT_WINDOW: usize = 60;

/// What the server needs from a backend for statistics (every [`Backend`] is one).
pub trait StatsSource: Send + Sync {
    fn pool_stats(&self) -> PoolStats;
    fn forward_stats(&self) -> Option<ForwardStats>;
    fn expert_stats(&self, layer: usize) -> Option<Vec<ExpertStats>>;
}

impl<B: Backend> StatsSource for B {
    fn pool_stats(&self) -> PoolStats {
        Backend::pool_stats(self)
    }
    fn forward_stats(&self) -> Option<ForwardStats> {
        Backend::forward_stats(self)
    }
    fn expert_stats(&self, layer: usize) -> Option<Vec<ExpertStats>> {
        Backend::expert_stats(self, layer)
    }
}

/// What a step ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StepKind {
    /// A chunk of a prompt.
    Prefill,
    /// One generated token through the model.
    Decode,
}

/// Where one step's time went, from the backend's own clocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Split {
    pub dense_ns: u64,
    pub experts_ns: u64,
    pub wait_ns: u64,
}

impl Split {
    fn of(f: &ForwardStats) -> Split {
        Split { dense_ns: f.dense_ns(), experts_ns: f.experts_ns, wait_ns: f.wait_ns }
    }
}

/// One forward the scheduler ran.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepRecord {
    /// Counts steps since the server started (1 is the first).
    pub step: u64,
    pub kind: StepKind,
    pub tokens: u64,
    /// Wall time of the forward as the scheduler measured it, ns.
    pub ns: u64,
    pub tokens_per_second: f64,
    /// `None` when the backend does not measure its time.
    pub split: Option<Split>,
    /// Unix milliseconds when it ended.
    pub ended_unix_ms: u64,
}

#[derive(Clone, Copy, Debug, Default)]
struct KindTotals {
    forwards: u64,
    tokens: u64,
    ns: u64,
}

#[derive(Default)]
struct LogInner {
    prefill: KindTotals,
    decode: KindTotals,
    recent: VecDeque<StepRecord>,
    /// (second since start, prompt tokens, generated tokens), oldest first, at most the window.
    seconds: VecDeque<(u64, u64, u64)>,
    steps: u64,
}

/// The steps the scheduler ran: totals per kind, the last [`RECENT_STEPS`], and tokens per second
/// of wall-clock time for the last [`THROUGHPUT_WINDOW`] seconds.
pub struct StepLog {
    started: Instant,
    started_unix: f64,
    inner: Mutex<LogInner>,
}

impl Default for StepLog {
    fn default() -> Self {
        Self::new()
    }
}

fn unix_now() -> Duration {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default()
}

fn rate(tokens: u64, ns: u64) -> Option<f64> {
    (ns > 0 && tokens > 0).then(|| tokens as f64 * 1e9 / ns as f64)
}

impl StepLog {
    pub fn new() -> StepLog {
        StepLog {
            started: Instant::now(),
            started_unix: unix_now().as_secs_f64(),
            inner: Mutex::new(LogInner::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LogInner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A forward of `tokens` that took `elapsed`; `split` is the backend's [`ForwardStats`] over
    /// it (after minus before), when it measures them.
    pub fn record(&self, kind: StepKind, tokens: usize, elapsed: Duration, split: Option<ForwardStats>) {
        if !cherenkov_engine::stats::ENABLED {
            return;
        }
        let ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        let tokens = tokens as u64;
        let second = self.started.elapsed().as_secs();
        let ended_unix_ms = u64::try_from(unix_now().as_millis()).unwrap_or(u64::MAX);
        let mut g = self.lock();
        let t = match kind {
            StepKind::Prefill => &mut g.prefill,
            StepKind::Decode => &mut g.decode,
        };
        t.forwards += 1;
        t.tokens += tokens;
        t.ns += ns;
        g.steps += 1;
        let record = StepRecord {
            step: g.steps,
            kind,
            tokens,
            ns,
            tokens_per_second: rate(tokens, ns).unwrap_or(0.0),
            split: split.map(|f| Split::of(&f)),
            ended_unix_ms,
        };
        if g.recent.len() == RECENT_STEPS {
            g.recent.pop_front();
        }
        g.recent.push_back(record);
        if g.seconds.back().is_none_or(|s| s.0 != second) {
            g.seconds.push_back((second, 0, 0));
        }
        let cur = g.seconds.back_mut().expect("pushed above");
        match kind {
            StepKind::Prefill => cur.1 += tokens,
            StepKind::Decode => cur.2 += tokens,
        }
        while g.seconds.front().is_some_and(|s| s.0 + (THROUGHPUT_WINDOW as u64) < second) {
            g.seconds.pop_front();
        }
    }

    /// Adds `tokens` generated without a step of their own (an accepted draft: the verifying
    /// forward's step counted only the token before it) to the decode totals and this second.
    pub fn credit_decode(&self, tokens: usize) {
        if !cherenkov_engine::stats::ENABLED {
            return;
        }
        let second = self.started.elapsed().as_secs();
        let mut g = self.lock();
        g.decode.tokens += tokens as u64;
        if g.seconds.back().is_none_or(|s| s.0 != second) {
            g.seconds.push_back((second, 0, 0));
        }
        g.seconds.back_mut().expect("pushed above").2 += tokens as u64;
    }

    /// Seconds since the server started.
    pub fn uptime(&self) -> Duration {
        self.started.elapsed()
    }

    /// The recent steps, oldest first.
    pub fn recent(&self) -> Vec<StepRecord> {
        self.lock().recent.iter().cloned().collect()
    }

    fn steps_summary(&self) -> (Steps, Throughput) {
        let g = self.lock();
        let recent_rate = |kind: StepKind| {
            let (tokens, ns) = g
                .recent
                .iter()
                .rev()
                .filter(|s| s.kind == kind)
                .take(32)
                .fold((0, 0), |(t, n), s| (t + s.tokens, n + s.ns));
            rate(tokens, ns)
        };
        let kind = |t: &KindTotals, k: StepKind| KindSummary {
            forwards: t.forwards,
            tokens: t.tokens,
            ns: t.ns,
            tokens_per_second: rate(t.tokens, t.ns),
            recent_tokens_per_second: recent_rate(k),
        };
        let steps = Steps {
            total: g.steps,
            prefill: kind(&g.prefill, StepKind::Prefill),
            decode: kind(&g.decode, StepKind::Decode),
            last: g.recent.back().cloned(),
        };
        // The complete seconds of the window, oldest first (the current second is still filling).
        let now = self.started.elapsed().as_secs();
        let mut prompt = vec![0; THROUGHPUT_WINDOW];
        let mut generated = vec![0; THROUGHPUT_WINDOW];
        for &(sec, p, d) in &g.seconds {
            if sec < now && sec + THROUGHPUT_WINDOW as u64 >= now {
                let i = THROUGHPUT_WINDOW - (now - sec) as usize;
                prompt[i] = p;
                generated[i] = d;
            }
        }
        let throughput = Throughput {
            interval_seconds: 1,
            tokens_per_second: generated[THROUGHPUT_WINDOW - 1] as f64,
            generated_tokens: generated,
            prompt_tokens: prompt,
        };
        (steps, throughput)
    }
}

// ---- documents ---------------------------------------------------------------------------------

#[derive(Serialize)]
pub struct KindSummary {
    pub forwards: u64,
    pub tokens: u64,
    pub ns: u64,
    /// `tokens / ns` over every step of the kind; null before the first.
    pub tokens_per_second: Option<f64>,
    /// The same over the last (up to) 32 steps of the kind among the recent steps.
    pub recent_tokens_per_second: Option<f64>,
}

#[derive(Serialize)]
pub struct Steps {
    pub total: u64,
    pub prefill: KindSummary,
    pub decode: KindSummary,
    pub last: Option<StepRecord>,
}

#[derive(Serialize)]
pub struct Throughput {
    pub interval_seconds: u64,
    /// Generated tokens in the last complete second.
    pub tokens_per_second: f64,
    /// Generated tokens per second, the last [`THROUGHPUT_WINDOW`] complete seconds, oldest first.
    pub generated_tokens: Vec<u64>,
    /// Prompt tokens computed (prefill) per second, same seconds.
    pub prompt_tokens: Vec<u64>,
}

#[derive(Serialize)]
pub struct ServerInfo {
    pub version: &'static str,
    pub backend: &'static str,
    pub models: Vec<String>,
    pub started_unix: f64,
    pub uptime_seconds: f64,
}

#[derive(Serialize)]
pub struct Requests {
    pub active: usize,
    pub queued: usize,
    pub completed: u64,
    pub cancelled: u64,
    pub timed_out: u64,
    pub failed: u64,
    pub rejected: u64,
    pub prompt_tokens: u64,
    pub cached_prompt_tokens: u64,
    pub completion_tokens: u64,
}

#[derive(Serialize)]
pub struct PrefixCache {
    pub enabled: bool,
    pub lookups: u64,
    pub hits: u64,
    pub hit_rate: Option<f64>,
    pub tokens_reused: u64,
    pub entries: usize,
    pub session_entries: usize,
    pub sessions: usize,
    pub bytes: u64,
    pub inserts: u64,
    pub evictions: u64,
    pub expirations: u64,
}

#[derive(Serialize)]
pub struct TimeSplit {
    pub forwards: u64,
    pub tokens: u64,
    pub total_ns: u64,
    pub dense_ns: u64,
    pub experts_ns: u64,
    pub wait_ns: u64,
    pub dense_share: Option<f64>,
    pub experts_share: Option<f64>,
    pub wait_share: Option<f64>,
}

impl TimeSplit {
    fn of(f: &ForwardStats) -> TimeSplit {
        let share = |ns: u64| (f.total_ns > 0).then(|| ns as f64 / f.total_ns as f64);
        TimeSplit {
            forwards: f.forwards,
            tokens: f.tokens,
            total_ns: f.total_ns,
            dense_ns: f.dense_ns(),
            experts_ns: f.experts_ns,
            wait_ns: f.wait_ns,
            dense_share: share(f.dense_ns()),
            experts_share: share(f.experts_ns),
            wait_share: share(f.wait_ns),
        }
    }
}

/// A [`LayerStats`] with the rates derived from it.
#[derive(Serialize)]
pub struct Counters {
    #[serde(flatten)]
    pub stats: LayerStats,
    pub hit_rate: Option<f64>,
    pub lookahead_accuracy: Option<f64>,
    pub lookahead_precision: Option<f64>,
    pub mean_read_ns: Option<f64>,
}

impl Counters {
    fn of(s: &LayerStats) -> Counters {
        Counters {
            stats: s.clone(),
            hit_rate: s.hit_rate(),
            lookahead_accuracy: s.lookahead_accuracy(),
            lookahead_precision: s.lookahead_precision(),
            mean_read_ns: s.mean_read_ns(),
        }
    }
}

#[derive(Serialize)]
pub struct ExpertCache {
    pub layers: usize,
    pub experts_per_layer: usize,
    pub slots: SlotGauges,
    pub total: Counters,
}

#[derive(Serialize)]
pub struct Summary {
    pub object: &'static str,
    pub server: ServerInfo,
    pub requests: Requests,
    pub prefix_cache: PrefixCache,
    pub steps: Steps,
    /// The backend's forwards since it loaded; `None` when it does not measure them.
    pub time_split: Option<TimeSplit>,
    pub throughput: Throughput,
    pub expert_cache: ExpertCache,
    /// MTP speculation: `None` while the server does not draft (`scheduler.draft` 0) and has not.
    pub mtp: Option<Mtp>,
}

/// MTP speculation: drafted tokens verified, those accepted, and their share (null before the
/// first draft).
#[derive(Serialize)]
pub struct Mtp {
    pub drafted: u64,
    pub accepted: u64,
    pub acceptance: Option<f64>,
}

#[derive(Serialize)]
pub struct LayerRow {
    pub layer: usize,
    pub name: String,
    pub precision: String,
    #[serde(flatten)]
    pub counters: Counters,
}

#[derive(Serialize)]
pub struct Layers {
    pub object: &'static str,
    pub record_bytes: usize,
    pub experts_per_layer: usize,
    pub latency_bounds_us: Vec<u64>,
    pub layers: Vec<LayerRow>,
    pub total: Counters,
}

#[derive(Serialize)]
pub struct ExpertRow {
    #[serde(flatten)]
    pub stats: ExpertStats,
    /// The precision of the record it holds; `None` when it is not in the pool.
    pub precision: Option<String>,
    pub hit_rate: Option<f64>,
}

#[derive(Serialize)]
pub struct Experts {
    pub object: &'static str,
    pub layer: usize,
    pub name: String,
    pub precision: String,
    pub record_bytes: usize,
    pub resident: usize,
    pub experts: Vec<ExpertRow>,
}

#[derive(Serialize)]
pub struct StepsDoc {
    pub object: &'static str,
    pub capacity: usize,
    pub steps: Vec<StepRecord>,
}

/// Everything a summary is made of, gathered by the route.
pub struct Inputs<'a> {
    pub backend: &'static str,
    pub models: &'a [String],
    pub status: Status,
    pub pool: PoolStats,
    pub forward: Option<ForwardStats>,
    pub log: &'a StepLog,
}

pub fn summary(i: Inputs<'_>) -> Summary {
    let (steps, throughput) = i.log.steps_summary();
    let s = &i.status;
    let c = &s.prefix_cache;
    Summary {
        object: "stats.summary",
        server: ServerInfo {
            version: env!("CARGO_PKG_VERSION"),
            backend: i.backend,
            models: i.models.to_vec(),
            started_unix: i.log.started_unix,
            uptime_seconds: i.log.uptime().as_secs_f64(),
        },
        requests: Requests {
            active: s.active,
            queued: s.queued,
            completed: s.completed,
            cancelled: s.cancelled,
            timed_out: s.timed_out,
            failed: s.failed,
            rejected: s.rejected,
            prompt_tokens: s.prompt_tokens,
            cached_prompt_tokens: s.cached_tokens,
            completion_tokens: s.completion_tokens,
        },
        prefix_cache: PrefixCache {
            enabled: c.enabled,
            lookups: c.lookups,
            hits: c.hits,
            hit_rate: (c.lookups > 0).then(|| c.hits as f64 / c.lookups as f64),
            tokens_reused: c.tokens_reused,
            entries: c.entries,
            session_entries: c.session_entries,
            sessions: c.sessions,
            bytes: c.bytes,
            inserts: c.inserts,
            evictions: c.evictions,
            expirations: c.expirations,
        },
        steps,
        time_split: i.forward.as_ref().map(TimeSplit::of),
        throughput,
        expert_cache: ExpertCache {
            layers: i.pool.layers.len(),
            experts_per_layer: i.pool.experts_per_layer,
            slots: i.pool.slots,
            total: Counters::of(&i.pool.total),
        },
        mtp: (s.draft > 0 || s.drafted > 0).then(|| Mtp {
            drafted: s.drafted,
            accepted: s.accepted,
            acceptance: (s.drafted > 0).then(|| s.accepted as f64 / s.drafted as f64),
        }),
    }
}

fn layer_name(pool: &PoolStats, l: usize) -> (String, String) {
    pool.info.get(l).map_or_else(|| (format!("moe.{l}"), "unknown".into()), |i| (i.name.clone(), i.precision.clone()))
}

pub fn layers(pool: &PoolStats) -> Layers {
    Layers {
        object: "stats.layers",
        record_bytes: pool.slots.record_bytes,
        experts_per_layer: pool.experts_per_layer,
        latency_bounds_us: LATENCY_BUCKET_BOUNDS_US.to_vec(),
        layers: pool
            .layers
            .iter()
            .enumerate()
            .map(|(l, s)| {
                let (name, precision) = layer_name(pool, l);
                LayerRow { layer: l, name, precision, counters: Counters::of(s) }
            })
            .collect(),
        total: Counters::of(&pool.total),
    }
}

pub fn experts(pool: &PoolStats, layer: usize, experts: Vec<ExpertStats>) -> Experts {
    let (name, precision) = layer_name(pool, layer);
    Experts {
        object: "stats.experts",
        layer,
        resident: experts.iter().filter(|e| e.state == Residency::Resident).count(),
        experts: experts
            .into_iter()
            .map(|e| ExpertRow {
                precision: (e.state != Residency::Absent).then(|| precision.clone()),
                hit_rate: e.hit_rate(),
                stats: e,
            })
            .collect(),
        name,
        precision,
        record_bytes: pool.slots.record_bytes,
    }
}

pub fn steps(log: &StepLog) -> StepsDoc {
    StepsDoc { object: "stats.steps", capacity: RECENT_STEPS, steps: log.recent() }
}

// ---- Prometheus --------------------------------------------------------------------------------

/// `text/plain; version=0.0.4`: the Prometheus text exposition format.
pub const PROMETHEUS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A label value with `\`, `"` and newlines escaped.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// A float as Prometheus writes it (`+Inf`, integers without a fraction).
fn num(v: f64) -> String {
    if v.is_infinite() {
        if v > 0.0 { "+Inf".into() } else { "-Inf".into() }
    } else if v.is_nan() {
        "NaN".into()
    } else {
        format!("{v}")
    }
}

struct Exposition {
    out: String,
}

impl Exposition {
    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.out.push_str(name);
        if !labels.is_empty() {
            let l: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{}\"", escape(v))).collect();
            let _ = write!(self.out, "{{{}}}", l.join(","));
        }
        let _ = writeln!(self.out, " {}", num(value));
    }

    /// One family with a sample per MoE layer.
    fn per_layer(&mut self, name: &str, kind: &str, help: &str, pool: &PoolStats, f: impl Fn(&LayerStats) -> f64) {
        self.family(name, kind, help);
        for (l, s) in pool.layers.iter().enumerate() {
            self.sample(name, &[("layer", &l.to_string())], f(s));
        }
    }
}

/// `GET /metrics`. Per-layer families carry a `layer` label (the MoE layer index of
/// `/v1/stats/layers`); per-expert counters are in the JSON API only (512 experts x 49 layers are
/// too many series for a scrape).
pub fn prometheus(i: Inputs<'_>) -> String {
    let mut e = Exposition { out: String::new() };
    let s = &i.status;
    let pool = &i.pool;
    let ns = |v: u64| v as f64 / 1e9;

    e.family("cherenkov_info", "gauge", "The server: version, backend and the model names it answers to (always 1).");
    e.sample(
        "cherenkov_info",
        &[("version", env!("CARGO_PKG_VERSION")), ("backend", i.backend), ("model", &i.models.join(","))],
        1.0,
    );
    e.family("cherenkov_uptime_seconds", "gauge", "Seconds since the server started.");
    e.sample("cherenkov_uptime_seconds", &[], i.log.uptime().as_secs_f64());

    // Requests.
    e.family("cherenkov_requests_total", "counter", "Requests that ended, by outcome.");
    for (outcome, v) in [
        ("completed", s.completed),
        ("cancelled", s.cancelled),
        ("timed_out", s.timed_out),
        ("failed", s.failed),
        ("rejected", s.rejected),
    ] {
        e.sample("cherenkov_requests_total", &[("outcome", outcome)], v as f64);
    }
    e.family("cherenkov_requests_active", "gauge", "Requests decoding now.");
    e.sample("cherenkov_requests_active", &[], s.active as f64);
    e.family("cherenkov_requests_queued", "gauge", "Requests waiting for a decoding slot.");
    e.sample("cherenkov_requests_queued", &[], s.queued as f64);
    e.family("cherenkov_prompt_tokens_total", "counter", "Prompt tokens of completed requests.");
    e.sample("cherenkov_prompt_tokens_total", &[], s.prompt_tokens as f64);
    e.family(
        "cherenkov_cached_prompt_tokens_total",
        "counter",
        "Prompt tokens of completed requests restored from the prefix cache instead of computed.",
    );
    e.sample("cherenkov_cached_prompt_tokens_total", &[], s.cached_tokens as f64);
    e.family("cherenkov_completion_tokens_total", "counter", "Tokens generated for completed requests.");
    e.sample("cherenkov_completion_tokens_total", &[], s.completion_tokens as f64);

    // Prefix cache.
    let c = &s.prefix_cache;
    e.family("cherenkov_prefix_cache_lookups_total", "counter", "Prompts looked up in the prefix cache.");
    e.sample("cherenkov_prefix_cache_lookups_total", &[], c.lookups as f64);
    e.family("cherenkov_prefix_cache_hits_total", "counter", "Lookups that restored a snapshot.");
    e.sample("cherenkov_prefix_cache_hits_total", &[], c.hits as f64);
    e.family("cherenkov_prefix_cache_tokens_reused_total", "counter", "Prompt tokens restored from snapshots.");
    e.sample("cherenkov_prefix_cache_tokens_reused_total", &[], c.tokens_reused as f64);
    e.family("cherenkov_prefix_cache_entries", "gauge", "Snapshots held (shared and retained sessions').");
    e.sample("cherenkov_prefix_cache_entries", &[], (c.entries + c.session_entries) as f64);
    e.family("cherenkov_prefix_cache_bytes", "gauge", "Bytes the snapshots hold.");
    e.sample("cherenkov_prefix_cache_bytes", &[], c.bytes as f64);

    // Steps.
    let (steps, throughput) = i.log.steps_summary();
    e.family("cherenkov_steps_total", "counter", "Forwards the scheduler ran, by kind (prefill chunk or decode step).");
    e.sample("cherenkov_steps_total", &[("kind", "prefill")], steps.prefill.forwards as f64);
    e.sample("cherenkov_steps_total", &[("kind", "decode")], steps.decode.forwards as f64);
    e.family("cherenkov_step_tokens_total", "counter", "Tokens those forwards processed, by kind.");
    e.sample("cherenkov_step_tokens_total", &[("kind", "prefill")], steps.prefill.tokens as f64);
    e.sample("cherenkov_step_tokens_total", &[("kind", "decode")], steps.decode.tokens as f64);
    e.family("cherenkov_step_seconds_total", "counter", "Wall time of those forwards, by kind.");
    e.sample("cherenkov_step_seconds_total", &[("kind", "prefill")], ns(steps.prefill.ns));
    e.sample("cherenkov_step_seconds_total", &[("kind", "decode")], ns(steps.decode.ns));
    e.family("cherenkov_generated_tokens_per_second", "gauge", "Tokens generated in the last complete second.");
    e.sample("cherenkov_generated_tokens_per_second", &[], throughput.tokens_per_second);
    if let Some(f) = &i.forward {
        e.family(
            "cherenkov_forward_seconds_total",
            "counter",
            "The backend's forward time by part: dense (everything but routed experts), routed experts, waiting on expert reads.",
        );
        e.sample("cherenkov_forward_seconds_total", &[("part", "dense")], ns(f.dense_ns()));
        e.sample("cherenkov_forward_seconds_total", &[("part", "experts")], ns(f.experts_ns));
        e.sample("cherenkov_forward_seconds_total", &[("part", "wait")], ns(f.wait_ns));
        e.family("cherenkov_forward_tokens_total", "counter", "Tokens the backend's forwards processed.");
        e.sample("cherenkov_forward_tokens_total", &[], f.tokens as f64);
    }

    // The expert pool, per MoE layer.
    e.per_layer("cherenkov_expert_routed_total", "counter", "Routed experts requested.", pool, |s| s.routed as f64);
    e.per_layer("cherenkov_expert_hits_total", "counter", "Routed experts resident and loaded.", pool, |s| {
        s.hits as f64
    });
    e.per_layer(
        "cherenkov_expert_inflight_total",
        "counter",
        "Routed experts whose read was already in flight (joined).",
        pool,
        |s| s.inflight as f64,
    );
    e.per_layer("cherenkov_expert_misses_total", "counter", "Routed experts for which a read was queued.", pool, |s| {
        s.misses as f64
    });
    e.per_layer("cherenkov_expert_reads_total", "counter", "Expert records read successfully.", pool, |s| {
        s.reads as f64
    });
    e.per_layer("cherenkov_expert_read_errors_total", "counter", "Expert reads that failed.", pool, |s| {
        s.read_errors as f64
    });
    e.per_layer("cherenkov_expert_read_bytes_total", "counter", "Bytes of successful expert reads.", pool, |s| {
        s.bytes_read as f64
    });
    e.family("cherenkov_expert_read_seconds", "histogram", "Latency of expert record reads (queueing excluded).");
    for (l, s) in pool.layers.iter().enumerate() {
        let layer = l.to_string();
        let mut cumulative = 0;
        for b in 0..LATENCY_BUCKETS {
            cumulative += s.latency[b];
            let le = LATENCY_BUCKET_BOUNDS_US.get(b).map_or_else(|| "+Inf".to_string(), |&us| num(us as f64 / 1e6));
            e.sample("cherenkov_expert_read_seconds_bucket", &[("layer", &layer), ("le", &le)], cumulative as f64);
        }
        e.sample("cherenkov_expert_read_seconds_sum", &[("layer", &layer)], ns(s.read_ns_sum));
        e.sample("cherenkov_expert_read_seconds_count", &[("layer", &layer)], (s.reads + s.read_errors) as f64);
    }
    e.per_layer(
        "cherenkov_expert_wait_seconds_total",
        "counter",
        "Time steps spent blocked on expert reads.",
        pool,
        |s| ns(s.wait_ns),
    );
    e.per_layer(
        "cherenkov_expert_compute_seconds_total",
        "counter",
        "Time steps spent computing routed experts (waits excluded).",
        pool,
        |s| ns(s.compute_ns),
    );
    e.per_layer("cherenkov_expert_evictions_total", "counter", "Expert records evicted to make room.", pool, |s| {
        s.evictions as f64
    });
    e.per_layer("cherenkov_expert_prefetched_total", "counter", "Reads queued by the lookahead.", pool, |s| {
        s.prefetched as f64
    });
    e.per_layer(
        "cherenkov_expert_prefetch_unused_total",
        "counter",
        "Prefetched records evicted before any step used them.",
        pool,
        |s| s.prefetch_unused as f64,
    );
    e.per_layer("cherenkov_lookahead_predicted_total", "counter", "Experts the lookahead predicted.", pool, |s| {
        s.lookahead_predicted as f64
    });
    e.per_layer(
        "cherenkov_lookahead_routed_total",
        "counter",
        "Routed experts of steps that had a lookahead prediction.",
        pool,
        |s| s.lookahead_routed as f64,
    );
    e.per_layer(
        "cherenkov_lookahead_correct_total",
        "counter",
        "Of those, the experts the lookahead had predicted.",
        pool,
        |s| s.lookahead_correct as f64,
    );
    e.per_layer(
        "cherenkov_expert_cpu_computed_total",
        "counter",
        "Misses computed on the CPU instead of read (--cpu-experts).",
        pool,
        |s| s.cpu_computed as f64,
    );
    e.per_layer("cherenkov_expert_resident", "gauge", "Expert records resident (loaded) now.", pool, |s| {
        s.resident as f64
    });

    // Slots.
    let g = &pool.slots;
    e.family("cherenkov_expert_slots", "gauge", "Slots of the expert pool, by state.");
    let ready = g.slots.saturating_sub(g.free + g.loading) as f64;
    e.sample("cherenkov_expert_slots", &[("state", "free")], g.free as f64);
    e.sample("cherenkov_expert_slots", &[("state", "loading")], g.loading as f64);
    e.sample("cherenkov_expert_slots", &[("state", "resident")], ready);
    e.family("cherenkov_expert_slots_pinned", "gauge", "Slots pinned by live leases.");
    e.sample("cherenkov_expert_slots_pinned", &[], g.pinned as f64);
    e.family("cherenkov_expert_record_bytes", "gauge", "Bytes of one expert record (one slot).");
    e.sample("cherenkov_expert_record_bytes", &[], g.record_bytes as f64);
    e.out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn throughput_window_counts_complete_seconds() {
        let log = StepLog::new();
        log.record(StepKind::Prefill, 7, Duration::from_millis(5), None);
        log.record(StepKind::Decode, 1, Duration::from_millis(5), None);
        let (steps, t) = log.steps_summary();
        assert_eq!((steps.total, steps.prefill.tokens, steps.decode.tokens), (2, 7, 1));
        assert_eq!(t.generated_tokens.len(), THROUGHPUT_WINDOW);
        // The current second is still filling: not in the window yet.
        assert_eq!(t.generated_tokens.iter().sum::<u64>() + t.prompt_tokens.iter().sum::<u64>(), 0);
        assert_eq!(steps.decode.tokens_per_second, Some(200.0));
        assert_eq!(steps.last.as_ref().map(|s| s.step), Some(2));
    }

    #[test]
    fn recent_steps_are_bounded() {
        let log = StepLog::new();
        for _ in 0..RECENT_STEPS + 5 {
            log.record(StepKind::Decode, 1, Duration::from_millis(1), None);
        }
        let r = log.recent();
        assert_eq!(r.len(), RECENT_STEPS);
        assert_eq!(r[0].step, 6);
    }

    #[test]
    fn a_backend_without_clocks_has_no_split() {
        let log = StepLog::new();
        log.record(StepKind::Decode, 1, Duration::from_millis(2), None);
        let models = vec!["cherenkov".to_string()];
        let inputs = || Inputs {
            backend: "test",
            models: &models,
            status: Status::default(),
            pool: PoolStats::default(),
            forward: None,
            log: &log,
        };
        let v = serde_json::to_value(summary(inputs())).unwrap();
        assert!(v["time_split"].is_null() && v["steps"]["last"]["split"].is_null() && v["mtp"].is_null(), "{v}");
        assert!(v["expert_cache"]["total"]["hit_rate"].is_null());
        let text = prometheus(inputs());
        assert!(!text.contains("cherenkov_forward_seconds_total"), "absent, not zero");
        assert!(text.contains("cherenkov_steps_total{kind=\"decode\"} 1\n"), "{text}");
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
        assert_eq!(num(f64::INFINITY), "+Inf");
        assert_eq!(num(0.00005), "0.00005");
        assert_eq!(num(3.0), "3");
    }
}
