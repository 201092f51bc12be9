//! A small imitation of the Hugging Face hub's file API on 127.0.0.1, for tests (nothing here
//! reaches the network).
//!
//! - `GET /api/models/{repo}/revision/{rev}[?blobs=true]`: `{"id", "sha", "siblings": [{"rfilename",
//!   "size", "blobId", "lfs": {"sha256", "size", "pointerSize"}}]}` (size, blobId and lfs only with
//!   `blobs=true`); 404 with `X-Error-Code: RepoNotFound` / `RevisionNotFound`.
//! - `HEAD|GET /{repo}/resolve/{rev}/{file}`: LFS files (`*.safetensors`) answer 302 to
//!   `/cdn/{sha256}` with `X-Linked-Etag` (the quoted sha256), `X-Linked-Size` and the pointer
//!   file's git blob id as `ETag`; other files answer 200 with their git blob id as `ETag`. Both
//!   carry `X-Repo-Commit`. 404 with `X-Error-Code: EntryNotFound` for a missing file.
//! - `HEAD|GET /cdn/{sha256}`: the bytes, with `Accept-Ranges: bytes`; `Range: bytes=N-` gives 206
//!   (or 416 past the end).
//! - With a token set, `/api` and `/resolve` answer 401 unless `Authorization: Bearer <token>`.
//! - Faults: cut a file's transfer after some bytes (the first N times), stall it after some bytes
//!   (the connection stays open until released, as a transfer that hangs until the client is
//!   killed), serve a file with one byte flipped (the headers still give the true hash), ignore
//!   ranges.
#![allow(dead_code)] // each test binary uses its own part

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use sha1::Sha1;
use sha2::{Digest, Sha256};

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub fn sha256(b: &[u8]) -> String {
    hex(&Sha256::digest(b))
}

pub fn git_oid(b: &[u8]) -> String {
    let mut h = Sha1::new();
    h.update(format!("blob {}\0", b.len()).as_bytes());
    h.update(b);
    hex(&h.finalize())
}

/// One request the hub saw.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub range: Option<String>,
    pub auth: Option<String>,
}

#[derive(Default)]
struct State {
    repo: String,
    commit: String,
    /// Branch and tag names -> commit.
    refs: BTreeMap<String, String>,
    files: BTreeMap<String, Vec<u8>>,
    token: Option<String>,
    /// File -> (bytes sent before the cut, times left).
    cuts: BTreeMap<String, (u64, u32)>,
    corrupt: BTreeSet<String>,
    /// File -> bytes sent before the transfer hangs (once).
    stalls: BTreeMap<String, u64>,
    stalled: bool,
    ignore_range: bool,
    seen: Vec<Seen>,
}

pub struct FakeHub {
    pub url: String,
    state: Arc<Mutex<State>>,
    stop: Arc<AtomicBool>,
    addr: std::net::SocketAddr,
}

fn is_lfs(name: &str) -> bool {
    name.ends_with(".safetensors")
}

impl FakeHub {
    /// Serves every file of `dir` (plus `extra`) as `repo` at one commit, reachable as `main`,
    /// `v1` and the commit id.
    pub fn start(repo: &str, dir: &Path, extra: &[(&str, &[u8])]) -> FakeHub {
        let mut files = BTreeMap::new();
        for e in std::fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            files.insert(e.file_name().to_string_lossy().into_owned(), std::fs::read(e.path()).unwrap());
        }
        for (n, b) in extra {
            files.insert(n.to_string(), b.to_vec());
        }
        let commit = git_oid(format!("{repo}:{}", files.len()).as_bytes());
        let refs = [("main".to_string(), commit.clone()), ("v1".to_string(), commit.clone())].into();
        let state = Arc::new(Mutex::new(State { repo: repo.into(), commit, refs, files, ..State::default() }));
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        {
            let (state, stop) = (state.clone(), stop.clone());
            std::thread::spawn(move || {
                for conn in listener.incoming() {
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    let Ok(conn) = conn else { continue };
                    let state = state.clone();
                    let stop = stop.clone();
                    std::thread::spawn(move || serve(conn, &state, &stop, addr));
                }
            });
        }
        FakeHub { url: format!("http://{addr}"), state, stop, addr }
    }

    pub fn commit(&self) -> String {
        self.state.lock().unwrap().commit.clone()
    }

    pub fn file(&self, name: &str) -> Vec<u8> {
        self.state.lock().unwrap().files[name].clone()
    }

    pub fn require_token(&self, token: Option<&str>) {
        self.state.lock().unwrap().token = token.map(String::from);
    }

    /// Cut the transfer of `file` after `at` bytes of the file, the next `times` times.
    pub fn cut(&self, file: &str, at: u64, times: u32) {
        self.state.lock().unwrap().cuts.insert(file.into(), (at, times));
    }

    /// The next transfer of `file` sends `at` bytes of it, then hangs until [`FakeHub::release`].
    pub fn stall(&self, file: &str, at: u64) {
        let mut s = self.state.lock().unwrap();
        s.stalls.insert(file.into(), at);
        s.stalled = true;
    }

    pub fn release(&self) {
        self.state.lock().unwrap().stalled = false;
    }

    pub fn corrupt(&self, file: &str, on: bool) {
        let mut s = self.state.lock().unwrap();
        if on {
            s.corrupt.insert(file.into());
        } else {
            s.corrupt.remove(file);
        }
    }

    pub fn ignore_range(&self, on: bool) {
        self.state.lock().unwrap().ignore_range = on;
    }

    /// Replaces a file's bytes under a new commit that `main` then points to.
    pub fn push(&self, name: &str, bytes: &[u8]) -> String {
        let mut s = self.state.lock().unwrap();
        s.files.insert(name.into(), bytes.to_vec());
        let commit = git_oid(format!("{}:{}", s.commit, sha256(bytes)).as_bytes());
        s.commit = commit.clone();
        s.refs.insert("main".into(), commit.clone());
        commit
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.state.lock().unwrap().seen.clone()
    }

    pub fn clear_seen(&self) {
        self.state.lock().unwrap().seen.clear();
    }

    /// Requests whose path contains `part`, in order.
    pub fn seen_for(&self, part: &str) -> Vec<Seen> {
        self.seen().into_iter().filter(|s| s.path.contains(part)).collect()
    }
}

impl Drop for FakeHub {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = TcpStream::connect(self.addr);
    }
}

struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    /// Close the connection after this many body bytes.
    cut_after: Option<usize>,
    /// After `cut_after` bytes, hang until released instead of closing.
    hang: bool,
}

fn reply(status: u16, headers: Vec<(&str, String)>, body: Vec<u8>) -> Reply {
    Reply {
        status,
        headers: headers.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
        body,
        cut_after: None,
        hang: false,
    }
}

fn error(status: u16, code: &str, message: &str) -> Reply {
    reply(
        status,
        vec![("X-Error-Code", code.into()), ("X-Error-Message", message.into())],
        format!("{{\"error\": \"{message}\"}}").into_bytes(),
    )
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        206 => "Partial Content",
        302 => "Found",
        401 => "Unauthorized",
        404 => "Not Found",
        416 => "Range Not Satisfiable",
        _ => "Status",
    }
}

fn serve(mut conn: TcpStream, state: &Mutex<State>, stop: &AtomicBool, addr: std::net::SocketAddr) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut line = String::new();
    if reader.read_line(&mut line).unwrap_or(0) == 0 {
        return;
    }
    let mut parts = line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or("").to_string(), parts.next().unwrap_or("").to_string());
    let mut headers = BTreeMap::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    let seen = Seen {
        method: method.clone(),
        path: target.clone(),
        range: headers.get("range").cloned(),
        auth: headers.get("authorization").cloned(),
    };
    let r = {
        let mut s = state.lock().unwrap();
        s.seen.push(seen);
        route(&mut s, &method, &target, &headers, addr)
    };
    let mut head = format!("HTTP/1.1 {} {}\r\n", r.status, reason(r.status));
    let has_length = r.headers.iter().any(|(k, _)| k == "Content-Length");
    for (k, v) in &r.headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if !has_length {
        head.push_str(&format!("Content-Length: {}\r\n", r.body.len()));
    }
    head.push_str("Connection: close\r\n\r\n");
    let _ = conn.write_all(head.as_bytes());
    if method != "HEAD" {
        let n = r.cut_after.unwrap_or(r.body.len()).min(r.body.len());
        let _ = conn.write_all(&r.body[..n]);
        let _ = conn.flush();
        // A stalled transfer: keep the connection open (at most a minute).
        let start = std::time::Instant::now();
        while r.hang
            && state.lock().unwrap().stalled
            && !stop.load(Ordering::Relaxed)
            && start.elapsed() < std::time::Duration::from_secs(60)
        {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
    let _ = conn.flush();
    let _ = conn.shutdown(std::net::Shutdown::Both);
}

fn route(
    s: &mut State,
    method: &str,
    target: &str,
    headers: &BTreeMap<String, String>,
    addr: std::net::SocketAddr,
) -> Reply {
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let authorized = match &s.token {
        None => true,
        Some(t) => headers.get("authorization").is_some_and(|a| *a == format!("Bearer {t}")),
    };
    if let Some(rest) = path.strip_prefix("/api/models/") {
        let Some((repo, rev)) = rest.split_once("/revision/") else { return error(404, "RepoNotFound", "bad path") };
        if repo != s.repo {
            return error(404, "RepoNotFound", &format!("Repository not found: {repo}"));
        }
        if !authorized {
            return error(
                401,
                "GatedRepo",
                &format!("Access to model {repo} is restricted; you must be authenticated"),
            );
        }
        let rev = rev.replace("%2F", "/");
        let Some(commit) = resolve_rev(s, &rev) else {
            return error(404, "RevisionNotFound", &format!("Invalid rev id: {rev}"));
        };
        let blobs = query.contains("blobs=true");
        let siblings: Vec<serde_json::Value> = s
            .files
            .iter()
            .map(|(n, b)| {
                let mut v = serde_json::json!({ "rfilename": n });
                if blobs {
                    v["size"] = b.len().into();
                    if is_lfs(n) {
                        v["blobId"] = git_oid(pointer(b).as_bytes()).into();
                        v["lfs"] =
                            serde_json::json!({"sha256": sha256(b), "size": b.len(), "pointerSize": pointer(b).len()});
                    } else {
                        v["blobId"] = git_oid(b).into();
                    }
                }
                v
            })
            .collect();
        let body = serde_json::to_vec(&serde_json::json!({"id": repo, "sha": commit, "siblings": siblings})).unwrap();
        return reply(200, vec![("Content-Type", "application/json".into())], body);
    }
    if let Some(sha) = path.strip_prefix("/cdn/") {
        let Some((name, bytes)) = s.files.iter().find(|(_, b)| sha256(b) == sha).map(|(n, b)| (n.clone(), b.clone()))
        else {
            return error(404, "EntryNotFound", "no such blob");
        };
        return content(s, method, &name, bytes, headers, vec![("ETag", format!("\"cdn-{}\"", &sha[..8]))]);
    }
    let Some((repo, rest)) = path.trim_start_matches('/').split_once("/resolve/") else {
        return error(404, "RepoNotFound", "unknown path");
    };
    if repo != s.repo {
        return error(404, "RepoNotFound", &format!("Repository not found: {repo}"));
    }
    if !authorized {
        return error(401, "GatedRepo", &format!("Access to model {repo} is restricted; you must be authenticated"));
    }
    let Some((rev, file)) = rest.split_once('/') else { return error(404, "EntryNotFound", "no file") };
    let Some(commit) = resolve_rev(s, rev) else {
        return error(404, "RevisionNotFound", &format!("Invalid rev id: {rev}"));
    };
    let Some(bytes) = s.files.get(file).cloned() else {
        return error(404, "EntryNotFound", &format!("{file} does not exist at {rev}"));
    };
    if is_lfs(file) {
        let sha = sha256(&bytes);
        return reply(
            302,
            vec![
                ("Location", format!("http://{addr}/cdn/{sha}")),
                ("X-Repo-Commit", commit),
                ("X-Linked-Etag", format!("\"{sha}\"")),
                ("X-Linked-Size", bytes.len().to_string()),
                ("ETag", format!("\"{}\"", git_oid(pointer(&bytes).as_bytes()))),
            ],
            Vec::new(),
        );
    }
    let etag = git_oid(&bytes);
    content(s, method, file, bytes, headers, vec![("X-Repo-Commit", commit), ("ETag", format!("\"{etag}\""))])
}

fn pointer(b: &[u8]) -> String {
    format!("version https://git-lfs.github.com/spec/v1\noid sha256:{}\nsize {}\n", sha256(b), b.len())
}

fn resolve_rev(s: &State, rev: &str) -> Option<String> {
    if let Some(c) = s.refs.get(rev) {
        return Some(c.clone());
    }
    (rev == s.commit).then(|| s.commit.clone())
}

/// A file's bytes, honouring `Range: bytes=N-` and the faults set for it.
fn content(
    s: &mut State,
    method: &str,
    name: &str,
    mut bytes: Vec<u8>,
    headers: &BTreeMap<String, String>,
    mut extra: Vec<(&str, String)>,
) -> Reply {
    let len = bytes.len() as u64;
    if s.corrupt.contains(name) && !bytes.is_empty() {
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0x55;
    }
    extra.push(("Accept-Ranges", "bytes".into()));
    let start = match headers.get("range").filter(|_| !s.ignore_range) {
        Some(r) => {
            let from: u64 = r.trim_start_matches("bytes=").split('-').next().unwrap().parse().unwrap();
            if from >= len {
                return reply(416, vec![("Content-Range", format!("bytes */{len}"))], Vec::new());
            }
            Some(from)
        }
        None => None,
    };
    let from = start.unwrap_or(0);
    let mut r = if let Some(from) = start {
        extra.push(("Content-Range", format!("bytes {from}-{}/{len}", len - 1)));
        reply(206, extra, bytes[from as usize..].to_vec())
    } else {
        reply(200, extra, bytes)
    };
    if method == "GET"
        && let Some((at, times)) = s.cuts.get_mut(name)
        && *times > 0
    {
        *times -= 1;
        r.cut_after = Some(at.saturating_sub(from) as usize);
    }
    if method == "GET"
        && let Some(at) = s.stalls.remove(name)
    {
        r.cut_after = Some(at.saturating_sub(from) as usize);
        r.hang = true;
    }
    r
}
