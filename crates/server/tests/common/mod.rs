//! The golden fixtures packed into stores (tiny-b by default), the CPU backend over it, servers on free ports, a bare
//! HTTP/1.1 client (so a test can send any bytes), and the Python interpreter the client tests use.
#![allow(dead_code)] // each test binary uses its own part

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use cherenkov_cpu::CpuModel;
use cherenkov_engine::residency::{ExpertPool, HostSlots};
use cherenkov_engine::sampling::SamplingParams;
use cherenkov_model::checkpoint::Checkpoint;
use cherenkov_model::store::{Store, pack::pack};
use cherenkov_server::{Background, Config, ModelSpec, ServerOptions};
use serde_json::Value;

pub fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

/// tiny-b's MLX twin packed once per test process: 2 layers (Gated DeltaNet, then QSA attention
/// with a budget of 8), PLE, 6 experts top-2, a 500-token tokenizer in a 512-row vocabulary,
/// max_position_embeddings 4096.
pub fn store() -> Arc<Store> {
    packed("tiny-b")
}

/// The golden fixture `name`'s MLX twin (`fixtures/golden/NAME/mlx4`), packed once per test
/// process.
pub fn packed(name: &str) -> Arc<Store> {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    static LOCK: Mutex<()> = Mutex::new(());
    let dir = DIR.get_or_init(|| tempfile::tempdir().unwrap());
    let _g = LOCK.lock().unwrap();
    let out = dir.path().join(name);
    if !out.join("manifest.json").exists() {
        let ck = Checkpoint::open(&workspace().join(format!("fixtures/golden/{name}/mlx4"))).unwrap();
        pack(&ck, &out, &indicatif::ProgressBar::hidden()).unwrap();
    }
    Arc::new(Store::open(&out).unwrap())
}

pub fn model() -> Arc<CpuModel> {
    let store = store();
    let memory = Arc::new(HostSlots::new(64, store.record_bytes()).unwrap());
    let pool = Arc::new(ExpertPool::new(store.clone(), memory, 2).unwrap());
    Arc::new(CpuModel::new(store, pool).unwrap())
}

/// The spec the CLI would build, registered as `tiny`, with the engine's sampling defaults.
pub fn spec() -> ModelSpec {
    let store = store();
    let c = store.config();
    ModelSpec::from_store_dir(
        &store.dir,
        Some("tiny"),
        c.max_position_embeddings,
        &c.eos_token_ids,
        SamplingParams::default(),
        "cpu",
    )
    .unwrap()
}

/// A configuration for tests: port 0 on 127.0.0.1.
pub fn config() -> Config {
    let mut c = Config::default();
    c.server.port = 0;
    c
}

pub fn start(config: Config) -> Background {
    start_with(config, None, None)
}

pub fn start_with(config: Config, api_key: Option<&str>, file: Option<&Path>) -> Background {
    let options = ServerOptions {
        config,
        config_file: file.map(Path::to_path_buf),
        overrides: Default::default(),
        api_key: api_key.map(str::to_string),
    };
    Background::start(model(), spec(), options).unwrap()
}

pub struct Reply {
    pub status: u16,
    pub headers: String,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    /// Asserts an OpenAI-shaped error with this status; returns its `error` object.
    pub fn error(&self, status: u16) -> Value {
        assert_eq!(self.status, status, "{}", self.body);
        let v = self.json();
        let e = v["error"].clone();
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{}", self.body);
        assert!(e["type"].is_string(), "{}", self.body);
        assert!(e.get("param").is_some() && e.get("code").is_some(), "{}", self.body);
        e
    }
}

/// One request on its own connection (`Connection: close`); `body` goes out byte for byte.
pub fn http(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
    let mut s = TcpStream::connect(addr).unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    s.write_all(req.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body =
        if head.to_ascii_lowercase().contains("transfer-encoding: chunked") { dechunk(rest) } else { rest.into() };
    Reply { status, headers: head.to_string(), body }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

pub fn post(addr: SocketAddr, path: &str, body: &Value) -> Reply {
    http(addr, "POST", path, &[("Content-Type", "application/json")], body.to_string().as_bytes())
}

pub fn get(addr: SocketAddr, path: &str) -> Reply {
    http(addr, "GET", path, &[], b"")
}

/// The Python of the client tests: $CHERENKOV_TEST_PYTHON, else `target/venv/bin/python`, which
/// the README's set-up command (and .ci/run) creates with the pinned `openai` package.
pub fn python() -> PathBuf {
    let p = std::env::var_os("CHERENKOV_TEST_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join("target/venv/bin/python"));
    let ok = std::process::Command::new(&p).args(["-c", "import openai"]).output().is_ok_and(|o| o.status.success());
    assert!(
        ok,
        "{} cannot import openai. The server's client tests drive it with the official Python client; \
         run the suite with tools/test, which creates target/venv and installs\n  \
         tools/test-requirements.txt into it\n\
         (or point CHERENKOV_TEST_PYTHON at a Python that has it)",
        p.display()
    );
    p
}
