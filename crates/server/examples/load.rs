//! Load benchmark for a running `cherenkov serve`: N clients send text completions back to back for
//! a fixed time; the report gives requests/s, tokens/s, latency percentiles and the server's peak
//! memory. Not a test: it measures.
//!
//! ```sh
//! cargo run --release -p cherenkov-server --example load -- \
//!     --url http://127.0.0.1:8080 --clients 4 --seconds 60 --max-tokens 32 --pid $(pgrep -n cherenkov)
//! ```
//!
//! Options: `--prompt-words N` (unique words per prompt, default 24), `--shared-words N` (a prefix
//! every prompt shares, default 0: with it the prefix cache serves the shared part), `--stream`
//! (streamed responses, adding time-to-first-token percentiles), `--api-key K`, `--pid P` (read the
//! server's peak resident memory, VmHWM, from /proc/P/status).

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

struct Args {
    url: String,
    clients: usize,
    seconds: u64,
    max_tokens: usize,
    prompt_words: usize,
    shared_words: usize,
    api_key: Option<String>,
    pid: Option<u32>,
    stream: bool,
}

fn parse_args() -> Args {
    let mut a = Args {
        url: "http://127.0.0.1:8080".into(),
        clients: 4,
        seconds: 30,
        max_tokens: 32,
        prompt_words: 24,
        shared_words: 0,
        api_key: std::env::var("CHERENKOV_API_KEY").ok(),
        pid: None,
        stream: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--url" => a.url = value().trim_end_matches('/').trim_end_matches("/v1").to_string(),
            "--clients" => a.clients = value().parse().expect("--clients N"),
            "--seconds" => a.seconds = value().parse().expect("--seconds N"),
            "--max-tokens" => a.max_tokens = value().parse().expect("--max-tokens N"),
            "--prompt-words" => a.prompt_words = value().parse().expect("--prompt-words N"),
            "--shared-words" => a.shared_words = value().parse().expect("--shared-words N"),
            "--api-key" => a.api_key = Some(value()),
            "--pid" => a.pid = Some(value().parse().expect("--pid PID")),
            "--stream" => a.stream = true,
            other => panic!("unknown option {other}; see the header of examples/load.rs"),
        }
    }
    a
}

const WORDS: [&str; 16] = [
    "river", "copper", "lantern", "orbit", "meadow", "signal", "harbor", "quartz", "violet", "engine", "summit",
    "thread", "marble", "falcon", "ember", "canyon",
];

fn words(n: usize, seed: u64) -> String {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x ^= x >> 33;
            x = x.wrapping_mul(0xff51afd7ed558ccd);
            WORDS[(x >> 60) as usize]
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// One request: (status, usage, seconds to the first streamed text). A streamed response is read
/// event by event; its usage comes in the last chunk.
fn post(host: &str, key: Option<&str>, body: &str, t0: Instant) -> std::io::Result<(u16, Value, Option<f64>)> {
    let mut s = TcpStream::connect(host)?;
    let auth = key.map(|k| format!("Authorization: Bearer {k}\r\n")).unwrap_or_default();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Type: application/json\r\n\
         {auth}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line)?;
    let status = line.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    // Skip the headers.
    loop {
        line.clear();
        if r.read_line(&mut line)? == 0 || line == "\r\n" {
            break;
        }
    }
    let (mut usage, mut first) = (Value::Null, None);
    let mut rest = String::new();
    loop {
        line.clear();
        if r.read_line(&mut line)? == 0 {
            break;
        }
        rest.push_str(&line);
        // Streamed: `data: {...}` lines inside chunked framing; the others are framing.
        if let Some(v) = line.trim().strip_prefix("data: ").and_then(|d| serde_json::from_str::<Value>(d).ok()) {
            if first.is_none() && v["choices"][0]["text"].as_str().is_some_and(|t| !t.is_empty()) {
                first = Some(t0.elapsed().as_secs_f64());
            }
            if !v["usage"].is_null() {
                usage = v["usage"].clone();
            }
        }
    }
    if usage.is_null() {
        usage = serde_json::from_str::<Value>(&rest).map(|v| v["usage"].clone()).unwrap_or_else(|_| json!(rest));
    }
    Ok((status, usage, first))
}

#[derive(Default)]
struct Tally {
    latencies: Vec<f64>,
    first_token: Vec<f64>,
    errors: Vec<String>,
    prompt_tokens: u64,
    cached_tokens: u64,
    completion_tokens: u64,
}

fn client(i: usize, a: &Args, host: &str, shared: &str, until: Instant) -> Tally {
    let mut t = Tally::default();
    let mut n = 0u64;
    while Instant::now() < until {
        n += 1;
        let prompt = format!("{shared} {}", words(a.prompt_words, (i as u64) << 32 | n));
        let body = json!({"model": "cherenkov", "prompt": prompt.trim(), "max_tokens": a.max_tokens,
                          "temperature": 0.8, "seed": n, "stream": a.stream,
                          "stream_options": if a.stream { json!({"include_usage": true}) } else { Value::Null }})
        .to_string();
        let t0 = Instant::now();
        match post(host, a.api_key.as_deref(), &body, t0) {
            Ok((200, u, first)) => {
                t.latencies.push(t0.elapsed().as_secs_f64());
                t.first_token.extend(first);
                t.prompt_tokens += u["prompt_tokens"].as_u64().unwrap_or(0);
                t.cached_tokens += u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
                t.completion_tokens += u["completion_tokens"].as_u64().unwrap_or(0);
            }
            Ok((status, u, _)) => {
                t.errors.push(format!("{status} {}", u.to_string().chars().take(160).collect::<String>()))
            }
            Err(e) => t.errors.push(e.to_string()),
        }
    }
    t
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((p * (sorted.len() - 1) as f64).round() as usize).min(sorted.len() - 1)]
}

fn vm_hwm(pid: u32) -> Option<String> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    Some(line.trim_start_matches("VmHWM:").trim().to_string())
}

fn main() {
    let a = parse_args();
    let host = a.url.trim_start_matches("http://").to_string();
    let shared = words(a.shared_words, u64::MAX);
    let start = Instant::now();
    let until = start + Duration::from_secs(a.seconds);
    let tallies: Vec<Tally> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..a.clients)
            .map(|i| {
                let (a, host, shared) = (&a, &host, &shared);
                s.spawn(move || client(i, a, host, shared, until))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a client thread panicked")).collect()
    });
    let wall = start.elapsed().as_secs_f64();
    let mut lat: Vec<f64> = tallies.iter().flat_map(|t| t.latencies.iter().copied()).collect();
    lat.sort_by(f64::total_cmp);
    let sum = |f: fn(&Tally) -> u64| tallies.iter().map(f).sum::<u64>();
    let (prompt, cached, completion) =
        (sum(|t| t.prompt_tokens), sum(|t| t.cached_tokens), sum(|t| t.completion_tokens));
    let errors: Vec<&String> = tallies.iter().flat_map(|t| &t.errors).collect();
    println!(
        "{} clients for {wall:.1} s, max_tokens {}, prompts of {} shared + {} unique words",
        a.clients, a.max_tokens, a.shared_words, a.prompt_words
    );
    println!("requests:   {} ok, {} failed, {:.2} requests/s", lat.len(), errors.len(), lat.len() as f64 / wall);
    println!(
        "tokens:     {completion} generated ({:.1}/s), {prompt} prompt ({:.1}/s, {cached} of them from the prefix cache)",
        completion as f64 / wall,
        prompt as f64 / wall
    );
    println!(
        "latency:    p50 {:.3} s, p99 {:.3} s, max {:.3} s (whole request)",
        percentile(&lat, 0.5),
        percentile(&lat, 0.99),
        lat.last().copied().unwrap_or(f64::NAN)
    );
    let mut ttft: Vec<f64> = tallies.iter().flat_map(|t| t.first_token.iter().copied()).collect();
    if !ttft.is_empty() {
        ttft.sort_by(f64::total_cmp);
        println!("first text: p50 {:.3} s, p99 {:.3} s (streamed)", percentile(&ttft, 0.5), percentile(&ttft, 0.99));
    }
    if let Some(pid) = a.pid {
        println!("memory:     server peak resident {}", vm_hwm(pid).unwrap_or_else(|| "unknown".into()));
    }
    for e in errors.iter().take(5) {
        println!("error: {e}");
    }
}
