//! The HTTP API with a bare client: OpenAI-shaped errors for bad requests (the server keeps
//! serving), the API key, limits, the prefix cache and sessions as clients see them, and greedy
//! output equal to the engine's own decode loop.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;

use cherenkov_engine::generate::{GenerateOptions, generate};
use cherenkov_engine::sampling::SamplingParams;
use common::{config, get, http, post, start, start_with};
use serde_json::{Value, json};

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";

/// A `logit_bias` that bans tiny-b's EOS tokens (0 and 2), for requests that must still be
/// decoding when the test acts on them (a sampled EOS would end them early, at random).
fn no_eos() -> Value {
    json!({"0": -100, "2": -100})
}

#[test]
fn bad_requests_get_openai_errors_and_the_server_keeps_serving() {
    let mut c = config();
    c.server.max_body = cherenkov_server::config::Size(64 << 10);
    let server = start(c);
    let addr = server.addr();
    let chat = |extra: Value| {
        let mut b = json!({"model": "cherenkov", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    // (path, body, status, param)
    let long_prompt: Vec<u32> = (0..5000).map(|i| 5 + i % 400).collect();
    let cases: Vec<(&str, Vec<u8>, u16, Option<&str>)> = vec![
        (CHAT, b"{\"model\": \"cherenkov\", \"messages\": [".to_vec(), 400, None),
        (CHAT, b"[1, 2]".to_vec(), 400, None),
        (CHAT, b"".to_vec(), 400, None),
        (
            CHAT,
            b"{\"model\": \"cherenkov\", \"messages\": [{\"role\": \"user\", \"content\": \"\xff\xfe\"}]}".to_vec(),
            400,
            None,
        ),
        (CHAT, chat(json!({"temperature": "hot"})).to_string().into_bytes(), 400, Some("temperature")),
        (CHAT, chat(json!({"temperature": 7})).to_string().into_bytes(), 400, Some("temperature")),
        (CHAT, chat(json!({"top_p": 0})).to_string().into_bytes(), 400, Some("top_p")),
        (CHAT, chat(json!({"max_tokens": -1})).to_string().into_bytes(), 400, Some("max_tokens")),
        (CHAT, chat(json!({"max_tokens": 1_000_000_000_000u64})).to_string().into_bytes(), 400, Some("max_tokens")),
        (
            CHAT,
            chat(json!({"max_completion_tokens": "many"})).to_string().into_bytes(),
            400,
            Some("max_completion_tokens"),
        ),
        (CHAT, chat(json!({"n": 3})).to_string().into_bytes(), 400, Some("n")),
        (CHAT, chat(json!({"stream": "yes"})).to_string().into_bytes(), 400, Some("stream")),
        (CHAT, chat(json!({"top_logprobs": 3})).to_string().into_bytes(), 400, Some("top_logprobs")),
        (CHAT, chat(json!({"logprobs": true, "top_logprobs": 99})).to_string().into_bytes(), 400, Some("top_logprobs")),
        (CHAT, chat(json!({"stop": [1, 2]})).to_string().into_bytes(), 400, Some("stop[0]")),
        (CHAT, chat(json!({"stop": [[1, 99999]]})).to_string().into_bytes(), 400, Some("stop[0][1]")),
        (CHAT, chat(json!({"logit_bias": {"x": 1}})).to_string().into_bytes(), 400, Some("logit_bias.x")),
        (CHAT, chat(json!({"logit_bias": {"10": 500}})).to_string().into_bytes(), 400, Some("logit_bias.10")),
        (CHAT, chat(json!({"seed": "abc"})).to_string().into_bytes(), 400, Some("seed")),
        (CHAT, chat(json!({"tools": [{"type": "function"}]})).to_string().into_bytes(), 400, Some("tools")),
        (CHAT, chat(json!({"messages": "hi"})).to_string().into_bytes(), 400, Some("messages")),
        (CHAT, chat(json!({"messages": []})).to_string().into_bytes(), 400, Some("messages")),
        (
            CHAT,
            chat(json!({"messages": [{"role": "wizard", "content": "x"}]})).to_string().into_bytes(),
            400,
            Some("messages"),
        ),
        (CHAT, chat(json!({"messages": [{"content": "x"}]})).to_string().into_bytes(), 400, Some("messages[0].role")),
        (CHAT, chat(json!({"session_id": ""})).to_string().into_bytes(), 400, Some("session_id")),
        (CHAT, chat(json!({"model": "gpt-4"})).to_string().into_bytes(), 404, Some("model")),
        (CHAT, json!({"messages": [{"role": "user", "content": "x"}]}).to_string().into_bytes(), 400, Some("model")),
        (COMPLETIONS, json!({"model": "cherenkov"}).to_string().into_bytes(), 400, Some("prompt")),
        (COMPLETIONS, json!({"model": "cherenkov", "prompt": ""}).to_string().into_bytes(), 400, Some("prompt")),
        (
            COMPLETIONS,
            json!({"model": "cherenkov", "prompt": ["a", "b"]}).to_string().into_bytes(),
            400,
            Some("prompt"),
        ),
        (
            COMPLETIONS,
            json!({"model": "cherenkov", "prompt": [1, -2]}).to_string().into_bytes(),
            400,
            Some("prompt[1]"),
        ),
        (
            COMPLETIONS,
            json!({"model": "cherenkov", "prompt": [1, 600]}).to_string().into_bytes(),
            400,
            Some("prompt[1]"),
        ),
        (COMPLETIONS, json!({"model": "cherenkov", "prompt": {"a": 1}}).to_string().into_bytes(), 400, Some("prompt")),
        (
            COMPLETIONS,
            json!({"model": "cherenkov", "prompt": long_prompt}).to_string().into_bytes(),
            400,
            Some("prompt"),
        ),
        (
            COMPLETIONS,
            json!({"model": "cherenkov", "prompt": "x", "suffix": "y"}).to_string().into_bytes(),
            400,
            Some("suffix"),
        ),
        (
            COMPLETIONS,
            json!({"model": "cherenkov", "prompt": "x", "logprobs": -1}).to_string().into_bytes(),
            400,
            Some("logprobs"),
        ),
        (
            COMPLETIONS,
            json!({"model": "cherenkov", "prompt": "x", "echo": 1}).to_string().into_bytes(),
            400,
            Some("echo"),
        ),
        (COMPLETIONS, vec![b' '; 70 << 10], 413, None),
    ];
    for (path, body, status, param) in cases {
        let r = http(addr, "POST", path, &[("Content-Type", "application/json")], &body);
        let what = String::from_utf8_lossy(&body[..body.len().min(120)]).into_owned();
        assert_eq!(r.status, status, "{what}: {}", r.body);
        let e = r.error(status);
        assert_eq!(e["param"].as_str(), param, "{what}: {}", r.body);
    }
    let e = http(addr, "POST", CHAT, &[], chat(json!({"max_tokens": 5000})).to_string().as_bytes()).error(400);
    assert_eq!(e["code"], "context_length_exceeded");
    assert_eq!(get(addr, "/v1/nothing").error(404)["code"], "not_found");
    get(addr, CHAT).error(405);
    get(addr, "/v1/models/gpt-4").error(404);

    // Still serving, and nothing was left running.
    let r = post(addr, CHAT, &chat(json!({})));
    assert_eq!(r.status, 200, "{}", r.body);
    let s = get(addr, "/status").json();
    assert_eq!((s["active"].as_u64(), s["queued"].as_u64(), s["completed"].as_u64()), (Some(0), Some(0), Some(1)));
}

#[test]
fn the_api_key_is_required_as_a_bearer_token() {
    let server = start_with(config(), Some("s3cret"), None);
    let addr = server.addr();
    let body = json!({"model": "cherenkov", "prompt": "hello", "max_tokens": 2}).to_string();
    let send = |auth: Option<&str>| {
        let mut h = vec![("Content-Type", "application/json")];
        if let Some(a) = auth {
            h.push(("Authorization", a));
        }
        http(addr, "POST", COMPLETIONS, &h, body.as_bytes())
    };
    assert_eq!(send(None).error(401)["code"], "invalid_api_key");
    assert_eq!(send(Some("Bearer nope")).error(401)["code"], "invalid_api_key");
    assert_eq!(send(Some("s3cret")).status, 401);
    assert_eq!(send(Some("Bearer s3cret")).status, 200);
    assert_eq!(http(addr, "GET", "/v1/models", &[], b"").status, 401);
    assert_eq!(http(addr, "GET", "/status", &[], b"").status, 401);
    assert_eq!(get(addr, "/health").status, 200, "the health check needs no key");
}

#[test]
fn models_status_and_sessions() {
    let server = start(config());
    let addr = server.addr();
    let m = get(addr, "/v1/models").json();
    let ids: Vec<&str> = m["data"].as_array().unwrap().iter().map(|d| d["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["cherenkov", "tiny"]);
    assert_eq!(get(addr, "/v1/models/tiny").json()["object"], "model");

    // The registered name works too; a session id comes in the body or the header.
    let turn = |content: &str, session: &str| {
        let b = json!({"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 3,
                       "temperature": 0});
        let r = http(addr, "POST", CHAT, &[("X-Session-Id", session)], b.to_string().as_bytes());
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()
    };
    let first = turn("hello there", "s1");
    assert_eq!(first["model"], "tiny");
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // The same conversation again restores it whole (the session's snapshot).
    let again = turn("hello there", "s1");
    assert_eq!(again["usage"]["prompt_tokens_details"]["cached_tokens"], again["usage"]["prompt_tokens"]);
    assert_eq!(again["choices"][0]["message"], first["choices"][0]["message"]);
    let s = get(addr, "/status").json();
    assert_eq!(s["prefix_cache"]["sessions"], 1);
    assert!(s["prefix_cache"]["bytes"].as_u64().unwrap() > 0);
    assert_eq!(http(addr, "DELETE", "/v1/sessions/s1", &[], b"").json()["deleted"], true);
    http(addr, "DELETE", "/v1/sessions/s1", &[], b"").error(404);
    assert_eq!(get(addr, "/status").json()["prefix_cache"]["sessions"], 0);
}

#[test]
fn chat_turns_reuse_the_conversation_so_far() {
    let server = start(config());
    let addr = server.addr();
    let ask = |messages: Value| {
        let r =
            post(addr, CHAT, &json!({"model": "cherenkov", "messages": messages, "max_tokens": 4, "temperature": 0}));
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()
    };
    let q1 = json!([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]);
    let a1 = ask(q1.clone());
    assert_eq!(a1["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let mut q2 = q1.as_array().unwrap().clone();
    q2.push(json!({"role": "assistant", "content": a1["choices"][0]["message"]["content"]}));
    q2.push(json!({"role": "user", "content": "Another."}));
    let a2 = ask(Value::Array(q2));
    // Everything before the first turn's generation prompt came from the cache.
    let cached = a2["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    let p1 = a1["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(cached > 0 && cached < p1, "cached {cached} of a first prompt of {p1}");
}

#[test]
fn greedy_output_equals_the_engine_and_stops_cut_it() {
    let server = start(config());
    let addr = server.addr();
    let spec = common::spec();
    let tok = &spec.tokenizer;
    let prompt = tok.encode("The quick brown fox", false).unwrap();
    let model = common::model();
    let opts = GenerateOptions {
        max_tokens: 12,
        sampling: SamplingParams::greedy(),
        stop_tokens: spec.eos.clone(),
        stop_strings: vec![],
        draft: 0,
    };
    let mut session = model.new_session();
    let want = generate(&*model, &mut session, &prompt, tok, &opts, &mut |_| true).unwrap();
    assert!(want.tokens.len() >= 6, "the engine stopped early: {want:?}");

    let complete = |extra: Value| {
        let mut b = json!({"model": "cherenkov", "prompt": prompt, "max_tokens": 12, "temperature": 0});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        let r = post(addr, COMPLETIONS, &b);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()
    };
    let got = complete(json!({}));
    assert_eq!(got["object"], "text_completion");
    assert_eq!(got["choices"][0]["text"], want.text.as_str());
    assert_eq!(got["usage"]["completion_tokens"], want.tokens.len());
    assert_eq!(got["usage"]["prompt_tokens"], prompt.len());
    // The same prompt as text.
    let as_text = complete(json!({"prompt": "The quick brown fox"}));
    assert_eq!(as_text["choices"][0]["text"], want.text.as_str());

    // A stop sequence of token ids ends the text before it.
    let seq = &want.tokens[3..5];
    let cut = complete(json!({"stop": [seq]}));
    let before = tok.decode(&want.tokens[..3], true).unwrap();
    assert_eq!(cut["choices"][0]["text"], before.as_str());
    assert_eq!(cut["choices"][0]["finish_reason"], "stop");
    assert_eq!(cut["usage"]["completion_tokens"], 5);
    // So does a stop string.
    let tail: String = want.text.chars().skip(want.text.chars().count() / 2).take(3).collect();
    if !tail.trim().is_empty() {
        let at = want.text.find(&tail).unwrap();
        let cut = complete(json!({"stop": ["\u{1}never", tail]}));
        assert_eq!(cut["choices"][0]["text"], &want.text[..at]);
        assert_eq!(cut["choices"][0]["finish_reason"], "stop");
    }
    // logit_bias pushes a token to be chosen every time.
    let biased = complete(json!({"logit_bias": {"42": 100}, "max_tokens": 3}));
    assert_eq!(biased["choices"][0]["text"], tok.decode(&[42, 42, 42], true).unwrap().as_str());
}

#[test]
fn a_full_queue_answers_429() {
    let mut c = config();
    c.scheduler.max_active = 1;
    c.scheduler.queue_size = 0;
    let server = start(c);
    let addr = server.addr();
    // A long streamed completion holds the only slot while its client reads.
    let mut s = TcpStream::connect(addr).unwrap();
    let body = json!({"model": "cherenkov", "prompt": "a", "max_tokens": 4000, "stream": true, "logit_bias": no_eos()})
        .to_string();
    write!(s, "POST {COMPLETIONS} HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut reader = BufReader::new(s.try_clone().unwrap());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    assert!(line.contains("200"), "{line}");
    let r = post(addr, COMPLETIONS, &json!({"model": "cherenkov", "prompt": "b", "max_tokens": 1}));
    let e = r.error(429);
    assert_eq!(e["code"], "rate_limit_exceeded");
    assert!(r.headers.to_ascii_lowercase().contains("retry-after"));
    drop(reader);
    drop(s);
    // Once the stream's client is gone, its slot is freed.
    for attempt in 0.. {
        let r = post(addr, COMPLETIONS, &json!({"model": "cherenkov", "prompt": "b", "max_tokens": 1}));
        if r.status == 200 {
            break;
        }
        assert!(attempt < 600, "the slot was never freed: {}", r.body);
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(get(addr, "/status").json()["cancelled"], 1);
}

#[test]
fn a_client_that_leaves_before_the_answer_is_cancelled() {
    let server = start(config());
    let addr = server.addr();
    let body = json!({"model": "cherenkov", "prompt": "a", "max_tokens": 4000, "logit_bias": no_eos()}).to_string();
    let mut s = TcpStream::connect(addr).unwrap();
    write!(s, "POST {COMPLETIONS} HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    // Wait until it decodes, then hang up without reading.
    for attempt in 0.. {
        if get(addr, "/status").json()["active"] == 1 {
            break;
        }
        assert!(attempt < 6000, "the request never started");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    drop(s);
    for attempt in 0.. {
        let st = get(addr, "/status").json();
        if st["active"] == 0 {
            assert_eq!((st["cancelled"].as_u64(), st["completed"].as_u64()), (Some(1), Some(0)), "{st}");
            break;
        }
        assert!(attempt < 6000, "the request was never cancelled: {st}");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}
