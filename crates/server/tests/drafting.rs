//! Speculative decoding in the server (`scheduler.draft`): with the MTP head drafting, every
//! response is the one the server gives without drafts (greedy and sampled, candidates and full
//! logits, log-probabilities, stop sequences, chat, a prompt restored from the prefix cache), and
//! `/v1/stats/summary` reports the drafts. tiny-a, the fixture with an MTP head, on the CPU: its
//! random head's drafts are rejected, so an oracle that drafts the trunk's own choice takes the
//! accepting path too.

mod common;
#[path = "../../cpu/tests/support/oracle.rs"]
mod oracle;

use std::sync::Arc;

use cherenkov_cpu::CpuModel;
use cherenkov_engine::residency::{ExpertPool, HostSlots};
use cherenkov_engine::sampling::SamplingParams;
use cherenkov_model::store::Store;
use cherenkov_server::{Background, ModelSpec, ServerOptions};
use common::{get, post};
use oracle::Oracle;
use serde_json::{Value, json};

/// tiny-a, whose checkpoint has an MTP head (tiny-b's has none).
fn store() -> Arc<Store> {
    common::packed("tiny-a")
}

fn start(draft: usize) -> Background {
    start_on(draft, false)
}

fn start_on(draft: usize, oracle: bool) -> Background {
    let store = store();
    let c = store.config();
    let spec = ModelSpec::from_store_dir(
        &store.dir,
        Some("tiny-a"),
        c.max_position_embeddings,
        &c.eos_token_ids,
        SamplingParams::default(),
        "cpu",
    )
    .unwrap();
    let memory = Arc::new(HostSlots::new(64, store.record_bytes()).unwrap());
    let pool = Arc::new(ExpertPool::new(store.clone(), memory, 2).unwrap());
    let model = Arc::new(CpuModel::new(store, pool).unwrap());
    let mut config = common::config();
    config.scheduler.draft = draft;
    let options = ServerOptions { config, config_file: None, overrides: Default::default(), api_key: None };
    if oracle {
        Background::start(Arc::new(Oracle(model)), spec, options).unwrap()
    } else {
        Background::start(model, spec, options).unwrap()
    }
}

/// What a response says, without its id and time.
fn answer(v: &Value) -> Value {
    json!({"choices": v["choices"].as_array().unwrap().iter().map(|c| {
        let mut c = c.clone();
        c.as_object_mut().unwrap().remove("index");
        c
    }).collect::<Vec<_>>(), "usage": v["usage"]})
}

fn requests() -> Vec<(&'static str, Value)> {
    vec![
        ("/v1/completions", json!({"prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0})),
        ("/v1/completions", json!({"prompt": "The quick brown fox", "max_tokens": 16, "temperature": 1, "seed": 5})),
        (
            "/v1/completions",
            json!({"prompt": "Pack the experts", "max_tokens": 12, "temperature": 0.7, "top_k": 5, "seed": 9}),
        ),
        ("/v1/completions", json!({"prompt": "Pack the experts", "max_tokens": 10, "temperature": 0, "logprobs": 3})),
        (
            "/v1/completions",
            json!({"prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0, "stop": ["e"]}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 12, "temperature": 0}),
        ),
        // The first request again: its prompt comes back from the prefix cache.
        ("/v1/completions", json!({"prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0})),
    ]
}

/// Every request of [`requests`] gives the same answer from both servers.
fn same_answers(plain: &Background, drafting: &Background) {
    for (path, body) in requests() {
        let mut body = body;
        body["model"] = json!("cherenkov");
        let want = post(plain.addr(), path, &body);
        let got = post(drafting.addr(), path, &body);
        assert_eq!(want.status, 200, "{}", want.body);
        assert_eq!(got.status, 200, "{}", got.body);
        assert_eq!(answer(&got.json()), answer(&want.json()), "{path} {body}");
    }
}

fn summary(s: &Background) -> Value {
    get(s.addr(), "/v1/stats/summary").json()
}

#[test]
fn drafting_server_gives_the_responses_of_plain_decoding() {
    let plain = start(0);
    let drafting = start(1);
    same_answers(&plain, &drafting);
    let summary = |s: &Background| get(s.addr(), "/v1/stats/summary").json();
    assert!(summary(&plain)["mtp"].is_null(), "{}", summary(&plain));
    let m = summary(&drafting)["mtp"].clone();
    assert!(m["drafted"].as_u64().unwrap() > 20, "{m}");
    assert!(m["accepted"].as_u64().unwrap() <= m["drafted"].as_u64().unwrap(), "{m}");
    assert!(m["acceptance"].is_number(), "{m}");
    let hits = summary(&drafting)["prefix_cache"]["hits"].as_u64().unwrap();
    assert!(hits > 0, "the repeated prompt did not come from the prefix cache");
}

#[test]
fn accepted_drafts_give_the_same_responses_too() {
    let plain = start(0);
    let oracle = start_on(1, true);
    same_answers(&plain, &oracle);
    let m = summary(&oracle)["mtp"].clone();
    let (drafted, accepted) = (m["drafted"].as_u64().unwrap(), m["accepted"].as_u64().unwrap());
    // Greedy requests accept every draft; the sampled ones some.
    assert!(accepted * 2 > drafted && accepted < drafted, "{m}");
    // Decode throughput counts the accepted drafts' tokens: every generated token.
    let s = summary(&oracle);
    let generated: u64 = s["requests"]["completion_tokens"].as_u64().unwrap();
    let decoded = s["steps"]["decode"]["tokens"].as_u64().unwrap();
    assert!(decoded <= generated && decoded + 8 >= generated, "decode tokens {decoded}, generated {generated}");
}
