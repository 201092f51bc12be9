//! The statistics API: every document against `docs/stats.schema.json` (and the schema check
//! failing on broken documents), the numbers agreeing with each other and with what the requests
//! did, and `/metrics` parsed as the Prometheus text format.

mod common;
#[path = "common/json_schema.rs"]
mod json_schema;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use cherenkov_cpu::CpuModel;
use cherenkov_engine::residency::{ExpertPool, HostSlots};
use cherenkov_server::{Background, ServerOptions};
use common::{config, get, http, post, spec, store, workspace};
use json_schema::Schema;
use serde_json::{Value, json};

fn schema() -> Schema {
    Schema::load(&workspace().join("docs/stats.schema.json"))
}

/// The tiny model with an expert cache of 4 of its 12 records, so steps miss and evict.
fn start_small_pool(api_key: Option<&str>) -> Background {
    let store = store();
    let memory = Arc::new(HostSlots::new(4, store.record_bytes()).unwrap());
    let pool = Arc::new(ExpertPool::new(store.clone(), memory, 2).unwrap());
    let model = Arc::new(CpuModel::new(store, pool).unwrap());
    let options = ServerOptions { config: config(), api_key: api_key.map(String::from), ..Default::default() };
    Background::start(model, spec(), options).unwrap()
}

fn doc(addr: std::net::SocketAddr, path: &str) -> Value {
    let r = get(addr, path);
    assert_eq!(r.status, 200, "GET {path}: {}", r.body);
    r.json()
}

fn u(v: &Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or_else(|| panic!("`{k}` is not an integer in {v}"))
}

#[test]
fn documents_match_the_schema_and_each_other() {
    let s = schema();
    let server = start_small_pool(None);
    let addr = server.addr();

    // Before any request: valid, with nothing to rate yet.
    let before = doc(addr, "/v1/stats/summary");
    s.assert_valid("summary", &before);
    assert!(before["steps"]["last"].is_null() && before["expert_cache"]["total"]["hit_rate"].is_null());
    assert!(before["mtp"].is_null(), "MTP is absent, not zero");
    assert_eq!(s.errors(None, &before), Vec::<String>::new(), "the root schema accepts a summary");

    // Two identical prompts (the second restores the first from the prefix cache) and a chat.
    let mut completion_tokens = 0;
    for _ in 0..2 {
        let r = post(
            addr,
            "/v1/completions",
            &json!({"model": "cherenkov", "prompt": "Hash tables store keys", "max_tokens": 5, "temperature": 0}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        completion_tokens += u(&r.json()["usage"], "completion_tokens");
    }
    let r = post(
        addr,
        "/v1/chat/completions",
        &json!({"model": "cherenkov", "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 4}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    completion_tokens += u(&r.json()["usage"], "completion_tokens");

    let sum = doc(addr, "/v1/stats/summary");
    let layers = doc(addr, "/v1/stats/layers");
    let steps = doc(addr, "/v1/stats/steps");
    s.assert_valid("summary", &sum);
    s.assert_valid("layers", &layers);
    s.assert_valid("steps", &steps);

    // Requests and the prefix cache.
    let req = &sum["requests"];
    assert_eq!((u(req, "completed"), u(req, "completion_tokens")), (3, completion_tokens));
    assert!(u(&sum["prefix_cache"], "hits") >= 1 && u(req, "cached_prompt_tokens") > 0, "{sum:#}");
    assert_eq!(sum["server"]["backend"], "cpu");

    // Steps: the log, the totals and the backend's own count of forwards agree.
    let st = &sum["steps"];
    let list = steps["steps"].as_array().unwrap();
    let (pf, dc) = (&st["prefill"], &st["decode"]);
    assert_eq!(u(st, "total"), u(pf, "forwards") + u(dc, "forwards"));
    assert_eq!(list.len() as u64, u(st, "total"), "fewer steps than the capacity: all are listed");
    assert!(u(dc, "forwards") > 0 && dc["tokens_per_second"].as_f64().unwrap() > 0.0);
    let listed_tokens: u64 = list.iter().map(|x| u(x, "tokens")).sum();
    assert_eq!(listed_tokens, u(pf, "tokens") + u(dc, "tokens"));
    let ts = &sum["time_split"];
    assert_eq!(u(ts, "forwards"), u(st, "total"), "the server drives every forward");
    assert_eq!(u(ts, "tokens"), listed_tokens);
    assert_eq!(u(ts, "dense_ns") + u(ts, "experts_ns") + u(ts, "wait_ns"), u(ts, "total_ns"));
    assert!(u(ts, "experts_ns") > 0 && u(ts, "dense_ns") > 0);
    assert_eq!(&st["last"], list.last().unwrap());
    for x in list {
        let sp = &x["split"];
        assert!(u(sp, "dense_ns") + u(sp, "experts_ns") + u(sp, "wait_ns") <= u(x, "ns"), "{x}");
    }
    // Generated tokens per second cover the decode steps once their second is complete.
    std::thread::sleep(std::time::Duration::from_millis(1100));
    let later = doc(addr, "/v1/stats/summary");
    let per_second: u64 =
        later["throughput"]["generated_tokens"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).sum();
    assert_eq!(per_second, u(dc, "tokens"));

    // Layers: totals are the sums; each expert row sums to its layer.
    let rows = layers["layers"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(u(&layers, "experts_per_layer"), 6);
    for key in ["routed", "hits", "misses", "reads", "bytes_read", "evictions", "resident", "lookahead_routed"] {
        assert_eq!(rows.iter().map(|r| u(r, key)).sum::<u64>(), u(&layers["total"], key), "{key}");
    }
    assert_eq!(&layers["total"], &sum["expert_cache"]["total"]);
    assert!(u(&layers["total"], "evictions") > 0, "a pool of 4 slots for 12 experts evicts");
    assert!(u(&rows[1], "lookahead_predicted") > 0, "layer 0 predicts layer 1");
    for (l, row) in rows.iter().enumerate() {
        assert_eq!(u(row, "routed"), u(row, "hits") + u(row, "inflight") + u(row, "misses"));
        assert_eq!(
            row["latency"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap()).sum::<u64>(),
            u(row, "reads") + u(row, "read_errors")
        );
        assert_eq!(
            (row["name"].as_str().unwrap(), row["precision"].as_str().unwrap()),
            (format!("layers.{l}").as_str(), "q4g64")
        );
        let ex = doc(addr, &format!("/v1/stats/layers/{l}/experts"));
        s.assert_valid("experts", &ex);
        let e = ex["experts"].as_array().unwrap();
        assert_eq!(e.len(), 6);
        for key in ["routed", "hits", "inflight", "misses", "reads", "bytes_read", "evictions", "prefetched"] {
            assert_eq!(e.iter().map(|x| u(x, key)).sum::<u64>(), u(row, key), "layer {l} {key}");
        }
        let resident = e.iter().filter(|x| x["state"] == "resident").count() as u64;
        assert_eq!((resident, u(&ex, "resident")), (u(row, "resident"), u(row, "resident")));
        for x in e {
            assert_eq!(x["precision"].is_null(), x["state"] == "absent", "{x}");
        }
    }
    assert!(u(&sum["expert_cache"]["slots"], "slots") == 4);

    // Unknown layers.
    for bad in ["2", "99", "x"] {
        let e = get(addr, &format!("/v1/stats/layers/{bad}/experts")).error(404);
        assert!(e["message"].as_str().unwrap().contains("the model has 2"), "{e}");
    }
}

#[test]
fn the_schema_check_fails_on_broken_documents() {
    let s = schema();
    let server = common::start(config());
    let addr = server.addr();
    let r = post(addr, "/v1/completions", &json!({"model": "cherenkov", "prompt": "abc", "max_tokens": 2}));
    assert_eq!(r.status, 200, "{}", r.body);
    let layers = doc(addr, "/v1/stats/layers");
    let summary = doc(addr, "/v1/stats/summary");
    s.assert_valid("layers", &layers);
    s.assert_valid("summary", &summary);
    let broken = |f: &dyn Fn(&mut Value)| {
        let mut d = layers.clone();
        f(&mut d);
        s.errors(Some("layers"), &d)
    };
    let e = broken(&|d| {
        d["layers"][0].as_object_mut().unwrap().remove("hits");
    });
    assert!(e.iter().any(|m| m.contains("/layers/0: missing field `hits`")), "{e:?}");
    let e = broken(&|d| d["layers"][1]["routed"] = json!("12"));
    assert!(e.iter().any(|m| m.contains("/layers/1/routed: expected integer")), "{e:?}");
    let e = broken(&|d| d["total"]["hit_rate"] = json!(1.5));
    assert!(e.iter().any(|m| m.contains("/total/hit_rate")), "{e:?}");
    let e = broken(&|d| d["total"]["surprise"] = json!(1));
    assert!(e.iter().any(|m| m.contains("`surprise` is not in the schema")), "{e:?}");
    let e = broken(&|d| d["layers"][0]["latency"] = json!([1, 2]));
    assert!(e.iter().any(|m| m.contains("minItems")), "{e:?}");
    let e = broken(&|d| d["object"] = json!("stats.summary"));
    assert!(!e.is_empty());
    // A summary with MTP reported as zero instead of absent is still well-formed only as an object.
    let mut m = summary.clone();
    m["mtp"] = json!(0);
    assert!(!s.errors(Some("summary"), &m).is_empty());
    // The root accepts each document as exactly one kind.
    assert!(s.errors(None, &layers).is_empty());
    assert!(!s.errors(None, &json!({"object": "stats.layers"})).is_empty());
}

/// One sample line: (name, labels, value).
fn parse_sample(line: &str) -> (String, BTreeMap<String, String>, f64) {
    let (head, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("no value: {line}"));
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().unwrap_or_else(|_| panic!("bad value in {line}")),
    };
    let (name, labels) = match head.split_once('{') {
        None => (head.to_string(), BTreeMap::new()),
        Some((n, rest)) => {
            let body = rest.strip_suffix('}').unwrap_or_else(|| panic!("unclosed labels: {line}"));
            let mut labels = BTreeMap::new();
            let mut chars = body.chars().peekable();
            while chars.peek().is_some() {
                let key: String = chars.by_ref().take_while(|&c| c != '=').collect();
                assert_eq!(chars.next(), Some('"'), "{line}");
                let mut val = String::new();
                while let Some(c) = chars.next() {
                    match c {
                        '\\' => val.push(match chars.next() {
                            Some('n') => '\n',
                            Some(c) => c,
                            None => panic!("{line}"),
                        }),
                        '"' => break,
                        c => val.push(c),
                    }
                }
                assert!(key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'), "label {key:?} in {line}");
                labels.insert(key, val);
                if chars.peek() == Some(&',') {
                    chars.next();
                }
            }
            (n.to_string(), labels)
        }
    };
    assert!(
        name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
            && !name.starts_with(|c: char| c.is_ascii_digit()),
        "metric name {name:?}"
    );
    (name, labels, value)
}

#[test]
fn metrics_are_prometheus_text() {
    let server = start_small_pool(None);
    let addr = server.addr();
    for p in ["One prompt", "Another prompt"] {
        let r = post(addr, "/v1/completions", &json!({"model": "cherenkov", "prompt": p, "max_tokens": 4}));
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let layers = doc(addr, "/v1/stats/layers");
    let r = get(addr, "/metrics");
    assert_eq!(r.status, 200);
    assert!(r.headers.to_ascii_lowercase().contains("content-type: text/plain; version=0.0.4"), "{}", r.headers);

    let mut types: BTreeMap<String, String> = BTreeMap::new();
    let mut helps = BTreeSet::new();
    let mut samples: Vec<(String, BTreeMap<String, String>, f64)> = Vec::new();
    let mut seen = BTreeSet::new();
    for line in r.body.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap();
            assert!(!help.is_empty() && helps.insert(name.to_string()), "{line}");
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            assert!(["counter", "gauge", "histogram"].contains(&kind), "{line}");
            assert!(helps.contains(name), "TYPE before HELP: {line}");
            assert!(types.insert(name.to_string(), kind.to_string()).is_none(), "family twice: {line}");
        } else {
            assert!(!line.trim().is_empty() && !line.starts_with('#'), "unexpected line {line:?}");
            let s = parse_sample(line);
            // A sample belongs to the family declared last (its name, or the histogram's suffixes).
            let family = types
                .keys()
                .rev()
                .find(|f| s.0 == **f || ["_bucket", "_sum", "_count"].iter().any(|x| s.0 == format!("{f}{x}")));
            assert!(family.is_some(), "sample of an undeclared family: {line}");
            assert!(seen.insert(format!("{}{:?}", s.0, s.1)), "duplicate series: {line}");
            samples.push(s);
        }
    }
    for (name, kind) in &types {
        assert!(samples.iter().any(|s| s.0 == *name || s.0.starts_with(&format!("{name}_"))), "{name} has no sample");
        match kind.as_str() {
            "counter" => assert!(name.ends_with("_total"), "counter {name} without _total"),
            _ => assert!(!name.ends_with("_total"), "{kind} {name} named like a counter"),
        }
    }
    let value = |name: &str, labels: &[(&str, &str)]| -> f64 {
        let want: BTreeMap<String, String> = labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        samples.iter().find(|s| s.0 == name && s.1 == want).unwrap_or_else(|| panic!("no {name}{want:?}")).2
    };
    // Per-layer counters and gauges equal the JSON.
    for (l, row) in layers["layers"].as_array().unwrap().iter().enumerate() {
        let l = l.to_string();
        for (metric, key) in [
            ("cherenkov_expert_routed_total", "routed"),
            ("cherenkov_expert_hits_total", "hits"),
            ("cherenkov_expert_misses_total", "misses"),
            ("cherenkov_expert_reads_total", "reads"),
            ("cherenkov_expert_read_bytes_total", "bytes_read"),
            ("cherenkov_expert_evictions_total", "evictions"),
            ("cherenkov_expert_resident", "resident"),
            ("cherenkov_lookahead_correct_total", "lookahead_correct"),
            ("cherenkov_expert_cpu_computed_total", "cpu_computed"),
        ] {
            assert_eq!(value(metric, &[("layer", &l)]), u(row, key) as f64, "{metric} layer {l}");
        }
        // The histogram: ascending `le` ending at +Inf, cumulative, +Inf equal to _count.
        let buckets: Vec<(f64, f64)> = samples
            .iter()
            .filter(|s| s.0 == "cherenkov_expert_read_seconds_bucket" && s.1["layer"] == l)
            .map(|s| (if s.1["le"] == "+Inf" { f64::INFINITY } else { s.1["le"].parse().unwrap() }, s.2))
            .collect();
        assert_eq!(buckets.len(), 12);
        assert!(buckets.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1), "{buckets:?}");
        assert_eq!(buckets[0].0, 50e-6);
        assert!(buckets[11].0.is_infinite());
        let count = value("cherenkov_expert_read_seconds_count", &[("layer", &l)]);
        assert_eq!(buckets[11].1, count);
        assert_eq!(count, (u(row, "reads") + u(row, "read_errors")) as f64);
        let sum = value("cherenkov_expert_read_seconds_sum", &[("layer", &l)]);
        assert!((sum - u(row, "read_ns_sum") as f64 / 1e9).abs() < 1e-9);
    }
    assert_eq!(value("cherenkov_requests_total", &[("outcome", "completed")]), 2.0);
    assert_eq!(
        value("cherenkov_expert_slots", &[("state", "free")])
            + value("cherenkov_expert_slots", &[("state", "loading")])
            + value("cherenkov_expert_slots", &[("state", "resident")]),
        4.0
    );
    let parts: f64 =
        ["dense", "experts", "wait"].iter().map(|p| value("cherenkov_forward_seconds_total", &[("part", p)])).sum();
    assert!(parts > 0.0);
    assert!(!types.keys().any(|k| k.contains("mtp")), "MTP is absent, not exported as zero");
    assert_eq!(
        value(
            "cherenkov_info",
            &[("version", env!("CARGO_PKG_VERSION")), ("backend", "cpu"), ("model", "cherenkov,tiny")]
        ),
        1.0
    );
}

#[test]
fn statistics_need_the_api_key() {
    let server = start_small_pool(Some("sekrit"));
    let addr = server.addr();
    for path in ["/v1/stats/summary", "/v1/stats/layers", "/v1/stats/layers/0/experts", "/v1/stats/steps", "/metrics"] {
        get(addr, path).error(401);
        let r = http(addr, "GET", path, &[("Authorization", "Bearer sekrit")], b"");
        assert_eq!(r.status, 200, "{path}: {}", r.body);
    }
}
