//! The official `openai` Python client against the server: chat, completions, streaming, echo with
//! prompt logprobs (checked against `Logits::All`, what `cherenkov logits` writes), cancellation
//! mid-stream, four concurrent streams, and the API key. Each case is a function of
//! `tests/py/client_cases.py`, run against a fresh server on a free port.

mod common;

use std::path::Path;
use std::process::Command;

use cherenkov_engine::backend::{Backend, Logits};
use cherenkov_engine::generate::{GenerateOptions, generate};
use cherenkov_engine::sampling::SamplingParams;
use cherenkov_server::Background;
use serde_json::{Value, json};

fn run_case(case: &str, server: &Background, key: Option<&str>, expect: Option<Value>) {
    let python = common::python();
    let dir = tempfile::tempdir().unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/py/client_cases.py");
    let mut cmd = Command::new(python);
    cmd.arg(&script).arg(case).env("CHERENKOV_BASE_URL", server.base_url()).env_remove("OPENAI_BASE_URL");
    if let Some(k) = key {
        cmd.env("CHERENKOV_TEST_KEY", k);
    }
    if let Some(e) = expect {
        let file = dir.path().join("expect.json");
        std::fs::write(&file, e.to_string()).unwrap();
        cmd.env("CHERENKOV_EXPECT", &file);
    }
    let out = cmd.output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "client case {case} failed:\n{text}");
}

#[test]
fn chat_completions() {
    run_case("chat", &common::start(common::config()), None, None);
}

#[test]
fn text_completions() {
    let spec = common::spec();
    let text = "Once upon a time";
    let ids = spec.tokenizer.encode(text, false).unwrap();
    let model = common::model();
    let opts = GenerateOptions {
        max_tokens: 8,
        sampling: SamplingParams::greedy(),
        stop_tokens: spec.eos.clone(),
        stop_strings: vec![],
        draft: 0,
    };
    let greedy = generate(&*model, &mut model.new_session(), &ids, &spec.tokenizer, &opts, &mut |_| true).unwrap();
    let expect = json!({"prompt_text": text, "prompt_ids": ids, "greedy_text": greedy.text});
    run_case("completions", &common::start(common::config()), None, Some(expect));
}

#[test]
fn streaming() {
    run_case("stream", &common::start(common::config()), None, None);
}

/// The prompt's log-probabilities, computed here from one `Logits::All` forward (what `cherenkov
/// logits` writes) with a log-softmax of its own, in f64, over the tokenizer's 500 ids (the 12
/// padding rows of tiny-b's 512 are never produced and get no probability).
#[test]
fn echo_logprobs_equal_the_full_forward() {
    let spec = common::spec();
    let model = common::model();
    let text = "The cat sat on the mat, and then it slept.";
    let ids = spec.tokenizer.encode(text, false).unwrap();
    assert!(ids.len() > 8, "want a prompt past the QSA budget");
    let logits = model.forward(&mut model.new_session(), &ids, Logits::All).unwrap();
    let vocab = model.vocab_size();
    let usable = spec.tokenizer.vocab_size();
    assert!(usable < vocab);
    let mut token_logprobs = vec![Value::Null];
    let mut top5 = vec![Value::Null];
    for (i, row) in logits.chunks_exact(vocab).enumerate().take(ids.len() - 1) {
        let row = &row[..usable];
        let max = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
        let lse = max + row.iter().map(|&x| (f64::from(x) - max).exp()).sum::<f64>().ln();
        let lp: Vec<f64> = row.iter().map(|&x| f64::from(x) - lse).collect();
        token_logprobs.push(json!(lp[ids[i + 1] as usize]));
        let mut sorted = lp.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        top5.push(json!(sorted[..5]));
    }
    let expect = json!({"prompt_ids": ids, "prompt_text": text, "token_logprobs": token_logprobs, "top5": top5});
    run_case("echo", &common::start(common::config()), None, Some(expect));
}

#[test]
fn cancellation_mid_stream() {
    run_case("cancel", &common::start(common::config()), None, None);
}

#[test]
fn four_concurrent_streams() {
    let mut c = common::config();
    c.scheduler.max_active = 2;
    c.scheduler.queue_size = 2;
    run_case("concurrent", &common::start(c), None, None);
}

#[test]
fn api_key() {
    run_case("auth", &common::start_with(common::config(), Some("k-123"), None), Some("k-123"), None);
}
