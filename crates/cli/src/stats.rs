//! `cherenkov stats summary|layers|experts LAYER|steps`: a running server's statistics as tables
//! (or, with `--json`, the API's documents whole). Everything comes from the server's JSON API
//! (`docs/stats.md`); nothing here knows the model. The cell formatting is shared with `dash`.

use std::io::Write;

use anyhow::Result;
use cherenkov_engine::residency::format_bytes;
use serde_json::Value;

use crate::client::{Client, ServerArgs};

#[derive(clap::Subcommand, Debug)]
pub enum StatsCommand {
    /// Server, requests, decode speed, time split, expert cache totals, prefix cache, MTP.
    #[command(after_help = "Examples:\n  cherenkov stats summary\n  cherenkov stats summary --port 9000 --json")]
    Summary(StatsArgs),
    /// One row per MoE layer: hit rate, reads, bytes, read latency, waiting, residency, lookahead.
    #[command(after_help = "Examples:\n  cherenkov stats layers\n  cherenkov stats layers --json")]
    Layers(StatsArgs),
    /// One row per expert of a MoE layer: routed, hits, misses, reads, evictions, residency.
    #[command(after_help = "Examples:\n  cherenkov stats experts 7\n  cherenkov stats experts 7 --json")]
    Experts(ExpertsArgs),
    /// The most recent forwards (prefill chunks and decode steps) with their time split.
    #[command(after_help = "Examples:\n  cherenkov stats steps\n  cherenkov stats steps --json")]
    Steps(StatsArgs),
}

#[derive(clap::Args, Debug)]
pub struct StatsArgs {
    /// Print the server's JSON document (every field) instead of a table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub server: ServerArgs,
}

#[derive(clap::Args, Debug)]
pub struct ExpertsArgs {
    /// The MoE layer (its index in `stats layers`).
    pub layer: usize,
    #[command(flatten)]
    pub common: StatsArgs,
}

pub fn run(cmd: &StatsCommand, out: &mut dyn Write) -> Result<()> {
    let (args, path) = match cmd {
        StatsCommand::Summary(a) => (a, "/v1/stats/summary".to_string()),
        StatsCommand::Layers(a) => (a, "/v1/stats/layers".to_string()),
        StatsCommand::Experts(a) => (&a.common, format!("/v1/stats/layers/{}/experts", a.layer)),
        StatsCommand::Steps(a) => (a, "/v1/stats/steps".to_string()),
    };
    let client = Client::new(&args.server)?;
    let doc = client.fetch(&path)?;
    if args.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&doc)?)?;
        return Ok(());
    }
    let text = match cmd {
        StatsCommand::Summary(_) => summary_text(&doc, &client.url),
        StatsCommand::Layers(_) => layers_text(&doc),
        StatsCommand::Experts(_) => experts_text(&doc),
        StatsCommand::Steps(_) => steps_text(&doc),
    };
    write!(out, "{text}")?;
    Ok(())
}

// ---- reading the documents ---------------------------------------------------------------------

/// `v[key]` as an integer (absent or null: None).
pub fn int(v: &Value, key: &str) -> Option<u64> {
    v.get(key).and_then(Value::as_u64)
}

/// `v[key]` as a number (absent or null: None).
pub fn float(v: &Value, key: &str) -> Option<f64> {
    v.get(key).and_then(Value::as_f64)
}

/// An integer cell: the number, or `-` when absent.
pub fn n(v: &Value, key: &str) -> String {
    int(v, key).map_or_else(|| "-".into(), |x| x.to_string())
}

/// `78.2%`, or `-` for null (nothing to rate yet).
pub fn pct(x: Option<f64>) -> String {
    x.map_or_else(|| "-".into(), |v| format!("{:.1}%", v * 100.0))
}

/// A duration in ns as `850ns`, `15.5us`, `4.21ms`, `1.20s`.
pub fn dur(ns: Option<f64>) -> String {
    match ns {
        None => "-".into(),
        Some(ns) if ns < 1e3 => format!("{ns:.0}ns"),
        Some(ns) if ns < 1e6 => format!("{:.1}us", ns / 1e3),
        Some(ns) if ns < 1e9 => format!("{:.2}ms", ns / 1e6),
        Some(ns) => format!("{:.2}s", ns / 1e9),
    }
}

pub fn bytes(v: &Value, key: &str) -> String {
    int(v, key).map_or_else(|| "-".into(), format_bytes)
}

/// The read-latency bucket bound at or below which `q` of the reads fall (`<=250us`, `>100ms`),
/// from a row's `latency` histogram and the document's `latency_bounds_us`.
pub fn latency_quantile(row: &Value, bounds: &[u64], q: f64) -> String {
    let counts: Vec<u64> = row
        .get("latency")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default();
    let total: u64 = counts.iter().sum();
    if total == 0 {
        return "-".into();
    }
    let want = ((q * total as f64).ceil() as u64).max(1);
    let show = |us: u64| if us >= 1000 { format!("{}ms", us as f64 / 1000.0) } else { format!("{us}us") };
    let mut seen = 0;
    for (i, c) in counts.iter().enumerate() {
        seen += c;
        if seen >= want {
            return match bounds.get(i) {
                Some(&b) => format!("<={}", show(b)),
                None => bounds.last().map_or_else(|| "-".into(), |&b| format!(">{}", show(b))),
            };
        }
    }
    "-".into()
}

pub fn bounds(doc: &Value) -> Vec<u64> {
    doc.get("latency_bounds_us")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default()
}

pub fn rows<'a>(doc: &'a Value, key: &str) -> &'a [Value] {
    doc.get(key).and_then(Value::as_array).map_or(&[], |a| a.as_slice())
}

// ---- tables ------------------------------------------------------------------------------------

/// Columns of the layer table (shared with `dash`); the first two are left-aligned.
pub const LAYER_COLUMNS: [&str; 15] = [
    "layer",
    "name",
    "precision",
    "routed",
    "hit",
    "misses",
    "reads",
    "read",
    "mean",
    "p99",
    "max",
    "waited",
    "compute",
    "resident",
    "lookahead",
];

/// One row of the layer table.
pub fn layer_cells(row: &Value, bounds: &[u64]) -> Vec<String> {
    vec![
        n(row, "layer"),
        row.get("name").and_then(Value::as_str).unwrap_or("total").to_string(),
        row.get("precision").and_then(Value::as_str).unwrap_or("").to_string(),
        n(row, "routed"),
        pct(float(row, "hit_rate")),
        n(row, "misses"),
        n(row, "reads"),
        bytes(row, "bytes_read"),
        dur(float(row, "mean_read_ns")),
        latency_quantile(row, bounds, 0.99),
        dur(float(row, "read_ns_max")
            .filter(|_| int(row, "reads").unwrap_or(0) + int(row, "read_errors").unwrap_or(0) > 0)),
        dur(float(row, "wait_ns")),
        dur(float(row, "compute_ns")),
        n(row, "resident"),
        pct(float(row, "lookahead_accuracy")),
    ]
}

/// Columns of the expert table (shared with `dash`).
pub const EXPERT_COLUMNS: [&str; 11] =
    ["expert", "state", "routed", "hit", "hits", "joined", "misses", "reads", "read", "evictions", "prefetched"];

pub fn expert_cells(row: &Value) -> Vec<String> {
    vec![
        n(row, "expert"),
        row.get("state").and_then(Value::as_str).unwrap_or("-").to_string(),
        n(row, "routed"),
        pct(float(row, "hit_rate")),
        n(row, "hits"),
        n(row, "inflight"),
        n(row, "misses"),
        n(row, "reads"),
        bytes(row, "bytes_read"),
        n(row, "evictions"),
        n(row, "prefetched"),
    ]
}

/// Columns of the step table.
pub const STEP_COLUMNS: [&str; 8] = ["step", "kind", "tokens", "time", "tok/s", "dense", "experts", "waiting"];

pub fn step_cells(s: &Value) -> Vec<String> {
    let split = s.get("split").filter(|v| !v.is_null());
    let part = |k: &str| split.map_or_else(|| "-".into(), |sp| dur(float(sp, k)));
    vec![
        n(s, "step"),
        s.get("kind").and_then(Value::as_str).unwrap_or("-").to_string(),
        n(s, "tokens"),
        dur(float(s, "ns")),
        float(s, "tokens_per_second").map_or_else(|| "-".into(), |r| format!("{r:.1}")),
        part("dense_ns"),
        part("experts_ns"),
        part("wait_ns"),
    ]
}

/// Aligned columns: the first `left` columns left-aligned, the rest right-aligned.
pub fn table(headers: &[&str], rows: &[Vec<String>], left: usize) -> String {
    let mut width: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (w, c) in width.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let parts: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(i, c)| if i < left { format!("{c:<w$}", w = width[i]) } else { format!("{c:>w$}", w = width[i]) })
            .collect();
        parts.join("  ").trim_end().to_string() + "\n"
    };
    let mut out = line(headers.to_vec());
    for r in rows {
        out.push_str(&line(r.iter().map(String::as_str).collect()));
    }
    out
}

pub fn layers_text(doc: &Value) -> String {
    let b = bounds(doc);
    let mut body: Vec<Vec<String>> = rows(doc, "layers").iter().map(|r| layer_cells(r, &b)).collect();
    if let Some(t) = doc.get("total") {
        body.push(layer_cells(t, &b));
        if let Some(last) = body.last_mut() {
            last[0] = "total".into();
            last[1] = String::new();
        }
    }
    let mut out = table(&LAYER_COLUMNS, &body, 3);
    out.push_str(&format!(
        "{} experts per layer, records of {}; read = bytes read, mean/p99/max = read latency, waited = steps blocked \
         on reads, compute = routed-expert compute, lookahead = routed experts it predicted\n",
        n(doc, "experts_per_layer"),
        bytes(doc, "record_bytes")
    ));
    out
}

pub fn experts_text(doc: &Value) -> String {
    let body: Vec<Vec<String>> = rows(doc, "experts").iter().map(expert_cells).collect();
    let mut out = format!(
        "layer {} ({}), records {} of {}, {} resident\n",
        n(doc, "layer"),
        doc.get("name").and_then(Value::as_str).unwrap_or("?"),
        doc.get("precision").and_then(Value::as_str).unwrap_or("?"),
        bytes(doc, "record_bytes"),
        n(doc, "resident"),
    );
    out.push_str(&table(&EXPERT_COLUMNS, &body, 2));
    out
}

pub fn steps_text(doc: &Value) -> String {
    let body: Vec<Vec<String>> = rows(doc, "steps").iter().map(step_cells).collect();
    if body.is_empty() {
        return "no steps yet (the server has not run a forward)\n".into();
    }
    table(&STEP_COLUMNS, &body, 2)
}

/// `1h 02m`, `3m 07s`, `12s`.
pub fn uptime(secs: f64) -> String {
    let s = secs as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m {:02}s", s / 60, s % 60),
        _ => format!("{}h {:02}m", s / 3600, s % 3600 / 60),
    }
}

/// The time split of a `time_split` object: `dense 61.2%, routed experts 35.0%, waiting 3.8%`.
pub fn split_text(ts: &Value) -> String {
    format!(
        "dense {}, routed experts {}, waiting on reads {}",
        pct(float(ts, "dense_share")),
        pct(float(ts, "experts_share")),
        pct(float(ts, "wait_share"))
    )
}

pub fn summary_text(doc: &Value, url: &str) -> String {
    let null = Value::Null;
    let get = |k: &str| doc.get(k).unwrap_or(&null);
    let (server, req, pc, steps, ec) =
        (get("server"), get("requests"), get("prefix_cache"), get("steps"), get("expert_cache"));
    let total = ec.get("total").unwrap_or(&null);
    let slots = ec.get("slots").unwrap_or(&null);
    let decode = steps.get("decode").unwrap_or(&null);
    let prefill = steps.get("prefill").unwrap_or(&null);
    let rate = |v: &Value, k: &str| float(v, k).map_or_else(|| "-".into(), |r| format!("{r:.1} tok/s"));
    let models: Vec<&str> = server
        .get("models")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let mut lines = vec![
        (
            "server",
            format!(
                "{url}  {} backend, serving {}, up {}, version {}",
                server.get("backend").and_then(Value::as_str).unwrap_or("?"),
                models.join(", "),
                float(server, "uptime_seconds").map_or_else(|| "-".into(), uptime),
                server.get("version").and_then(Value::as_str).unwrap_or("?")
            ),
        ),
        (
            "requests",
            format!(
                "{} active, {} queued; {} completed, {} cancelled, {} timed out, {} failed, {} rejected",
                n(req, "active"),
                n(req, "queued"),
                n(req, "completed"),
                n(req, "cancelled"),
                n(req, "timed_out"),
                n(req, "failed"),
                n(req, "rejected")
            ),
        ),
        (
            "tokens",
            format!(
                "{} prompt ({} from the prefix cache), {} generated",
                n(req, "prompt_tokens"),
                n(req, "cached_prompt_tokens"),
                n(req, "completion_tokens")
            ),
        ),
        (
            "decode",
            format!(
                "{} over {} steps (last 32: {}); {} generated in the last second",
                rate(decode, "tokens_per_second"),
                n(decode, "forwards"),
                rate(decode, "recent_tokens_per_second"),
                doc.get("throughput")
                    .and_then(|t| float(t, "tokens_per_second"))
                    .map_or_else(|| "-".into(), |r| format!("{r:.0}"))
            ),
        ),
        (
            "prefill",
            format!(
                "{} over {} chunks of {} tokens",
                rate(prefill, "tokens_per_second"),
                n(prefill, "forwards"),
                n(prefill, "tokens")
            ),
        ),
    ];
    match doc.get("time_split").filter(|v| !v.is_null()) {
        Some(ts) => lines.push((
            "time",
            format!("{} in {} forwards: {}", dur(float(ts, "total_ns")), n(ts, "forwards"), split_text(ts)),
        )),
        None => lines.push(("time", "not measured by this backend".into())),
    }
    if let Some(last) = steps.get("last").filter(|v| !v.is_null()) {
        let c = step_cells(last);
        lines.push((
            "last step",
            format!(
                "{} of {} tokens, {} ({} tok/s): dense {}, experts {}, waiting {}",
                c[1], c[2], c[3], c[4], c[5], c[6], c[7]
            ),
        ));
    }
    lines.push((
        "experts",
        format!(
            "{} hits over {} routed ({} hits, {} joined reads, {} misses); {} reads, {}, mean {}; {} waiting; {} evictions",
            pct(float(total, "hit_rate")),
            n(total, "routed"),
            n(total, "hits"),
            n(total, "inflight"),
            n(total, "misses"),
            n(total, "reads"),
            bytes(total, "bytes_read"),
            dur(float(total, "mean_read_ns")),
            dur(float(total, "wait_ns")),
            n(total, "evictions")
        ),
    ));
    lines.push((
        "lookahead",
        format!(
            "predicted {} of the routed experts ({} of {}); {} of its {} predictions used; {} reads prefetched",
            pct(float(total, "lookahead_accuracy")),
            n(total, "lookahead_correct"),
            n(total, "lookahead_routed"),
            pct(float(total, "lookahead_precision")),
            n(total, "lookahead_predicted"),
            n(total, "prefetched")
        ),
    ));
    lines.push((
        "pool",
        format!(
            "{} MoE layers x {} experts; {} slots of {}: {} resident, {} loading, {} free, {} pinned",
            n(ec, "layers"),
            n(ec, "experts_per_layer"),
            n(slots, "slots"),
            bytes(slots, "record_bytes"),
            n(total, "resident"),
            n(slots, "loading"),
            n(slots, "free"),
            n(slots, "pinned")
        ),
    ));
    lines.push((
        "prefix",
        if pc.get("enabled").and_then(Value::as_bool) == Some(false) {
            "cache off".to_string()
        } else {
            format!(
                "{} hits of {} lookups ({}), {} tokens reused; {} snapshots ({} of sessions), {}",
                n(pc, "hits"),
                n(pc, "lookups"),
                pct(float(pc, "hit_rate")),
                n(pc, "tokens_reused"),
                n(pc, "entries"),
                n(pc, "session_entries"),
                bytes(pc, "bytes")
            )
        },
    ));
    lines.push((
        "mtp",
        match doc.get("mtp").filter(|v| !v.is_null()) {
            None => "absent (the server does not draft: scheduler.draft is 0)".into(),
            Some(m) => format!(
                "{} accepted of {} drafted ({})",
                n(m, "accepted"),
                n(m, "drafted"),
                pct(float(m, "acceptance"))
            ),
        },
    ));
    lines.iter().map(|(k, v)| format!("{k:<10} {v}\n")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn cells_and_quantiles() {
        let row = json!({"layer": 3, "name": "layers.3", "precision": "q4g64", "routed": 10, "hit_rate": 0.25,
            "latency": [1, 0, 8, 1, 0, 0, 0, 0, 0, 0, 0, 0], "reads": 10, "read_errors": 0,
            "read_ns_max": 420000.0, "mean_read_ns": 151000.0});
        let b = [50, 100, 250, 500, 1000, 2500, 5000, 10000, 25000, 50000, 100000];
        assert_eq!(latency_quantile(&row, &b, 0.5), "<=250us");
        assert_eq!(latency_quantile(&row, &b, 0.99), "<=500us");
        assert_eq!(latency_quantile(&json!({"latency": [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]}), &b, 0.99), ">100ms");
        assert_eq!(latency_quantile(&json!({}), &b, 0.99), "-");
        let c = layer_cells(&row, &b);
        assert_eq!((c[0].as_str(), c[4].as_str(), c[8].as_str(), c[10].as_str()), ("3", "25.0%", "151.0us", "420.0us"));
        assert_eq!(pct(None), "-");
        assert_eq!(dur(Some(1.5e9)), "1.50s");
        assert_eq!(uptime(3725.0), "1h 02m");
    }

    #[test]
    fn tables_align() {
        let t = table(&["a", "bb"], &[vec!["xyz".into(), "1".into()], vec!["q".into(), "22".into()]], 1);
        assert_eq!(t, "a    bb\nxyz   1\nq    22\n");
    }
}
