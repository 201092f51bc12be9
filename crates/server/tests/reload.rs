//! SIGHUP re-reads the configuration file: new requests get the new settings, a request in flight
//! finishes untouched, and a file that does not parse leaves the running configuration in place.
//! (One test in its own binary: the signal goes to the whole test process.)

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::Duration;

use common::{get, post};
use serde_json::{Value, json};

fn hangup() {
    let ok = std::process::Command::new("kill")
        .args(["-HUP", &std::process::id().to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "cannot send SIGHUP");
}

fn wait_status(addr: std::net::SocketAddr, key: &str, value: u64) {
    for _ in 0..6000 {
        if get(addr, "/status").json()[key] == value {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("{key} never reached {value}: {}", get(addr, "/status").body);
}

#[test]
fn sighup_reloads_without_dropping_requests_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("serve.toml");
    let write = |max_tokens: usize| {
        let text =
            format!("[server]\nport = 0\n[limits]\ndefault_max_tokens = {max_tokens}\n[sampling]\ntemperature = 0\n");
        std::fs::write(&file, text).unwrap();
    };
    write(2000);
    let config = cherenkov_server::Config::load(&file).unwrap();
    let server = common::start_with(config, None, Some(&file));
    let addr = server.addr();
    // No max_tokens: the configured default applies, taken when the request arrives. The EOS ids
    // (0 and 2) are biased away so that only the budget ends a request.
    let no_eos = json!({"0": -100, "2": -100});
    let ask = || {
        let r =
            post(addr, "/v1/completions", &json!({"model": "cherenkov", "prompt": [10, 11, 12], "logit_bias": no_eos}));
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["usage"]["completion_tokens"].as_u64().unwrap()
    };

    // A long stream is decoding while the configuration changes under it.
    let mut s = TcpStream::connect(addr).unwrap();
    let body = json!({"model": "cherenkov", "prompt": "a", "stream": true, "logit_bias": no_eos,
                      "stream_options": {"include_usage": true}})
    .to_string();
    write!(s, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut reader = BufReader::new(s);
    let mut line = String::new();
    while !line.starts_with("data: ") {
        line.clear();
        reader.read_line(&mut line).unwrap();
    }

    write(5);
    hangup();
    wait_status(addr, "config_reloads", 1);
    assert_eq!(ask(), 5);

    std::fs::write(&file, "[limits]\ndefault_max_tokens = \"many\"\n").unwrap();
    hangup();
    wait_status(addr, "config_reload_errors", 1);
    assert_eq!(ask(), 5, "a broken file replaced the configuration");

    // The stream ran to its end with its own settings.
    let mut usage = Value::Null;
    let mut done = false;
    loop {
        line.clear();
        if reader.read_line(&mut line).unwrap() == 0 {
            break;
        }
        if let Some(data) = line.trim().strip_prefix("data: ") {
            if data == "[DONE]" {
                done = true;
                break;
            }
            let v: Value = serde_json::from_str(data).unwrap();
            assert!(v.get("error").is_none(), "{v}");
            if !v["usage"].is_null() {
                usage = v["usage"].clone();
            }
        }
    }
    assert!(done, "the stream was cut");
    assert_eq!(usage["completion_tokens"], 2000, "{usage}");
}
