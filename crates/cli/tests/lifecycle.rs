//! A model's life after `prepare`: `model remove` and `model gc`, `status` (models, disk, GPUs,
//! servers), and integrity: a damaged store is reported by `inspect`, refused by `run` and by
//! `prepare`'s reuse, and replaced by `prepare --repack`.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::Path;

use common::{Home, fixture};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn remove_and_gc() {
    let home = Home::new();
    let (a, b) = (fixture("tiny-b/mlx4"), fixture("tiny-b/hf"));
    home.ok(&["prepare", s(&a), "--name", "a"]);
    home.ok(&["prepare", s(&a), "--name", "a2"]);
    home.ok(&["prepare", s(&b), "--name", "b"]);
    let out = home.ok(&["model", "gc", "--dry-run"]);
    assert!(out.contains("nothing to delete"), "{out}");

    let out = home.ok(&["model", "remove", "a"]);
    assert!(out.contains("removed a; its store") && out.contains("is still used by a2"), "{out}");
    let out = home.ok(&["model", "remove", s(&b)]);
    assert!(
        out.contains("removed b; its store") && out.contains("is no longer used: cherenkov model gc deletes it"),
        "{out}"
    );
    let err = home.fails(&["model", "remove", "b"]);
    assert!(err.contains("no model named \"b\" is registered"), "{err}");
    // A temporary store of a process that is gone is garbage too.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let stale = home.path().join(format!("stores/.tmp-c-{dead}"));
    std::fs::create_dir_all(&stale).unwrap();
    std::fs::write(stale.join("dense.bin"), vec![0u8; 5000]).unwrap();

    let out = home.ok(&["model", "gc", "--dry-run"]);
    let b_store = home.path().join("stores/b");
    assert!(
        out.contains(&format!("would delete {} (1.26 MiB): not registered; packed from {}", s(&b_store), s(&b))),
        "{out}"
    );
    assert!(out.contains(&format!("would delete {} (4.88 KiB): unfinished", s(&stale))), "{out}");
    assert!(out.contains("2 store(s), 1.26 MiB in all; run cherenkov model gc to delete them"), "{out}");
    assert!(b_store.exists() && stale.exists());
    let out = home.ok(&["model", "gc"]);
    assert!(out.contains("deleted") && out.contains("freed 1.26 MiB (2 store(s))"), "{out}");
    assert_eq!(home.store_dirs(), ["a"]);
    assert!(home.ok(&["model", "gc"]).contains("nothing to delete"));
    home.ok(&["inspect", "a2"]);
}

/// A one-shot HTTP server answering `GET /v1/models` as the server will.
fn fake_server() -> (String, std::thread::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", l.local_addr().unwrap());
    let h = std::thread::spawn(move || {
        let (mut c, _) = l.accept().unwrap();
        let mut r = BufReader::new(c.try_clone().unwrap());
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        assert!(line.starts_with("GET /v1/models "), "{line}");
        loop {
            let mut h = String::new();
            if r.read_line(&mut h).unwrap() == 0 || h.trim().is_empty() {
                break;
            }
        }
        let body = r#"{"object":"list","data":[{"id":"cherenkov","object":"model"},{"id":"flash","object":"model"}]}"#;
        write!(c, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len())
            .unwrap();
    });
    (url, h)
}

#[test]
fn status_reports_models_disk_gpus_and_servers() {
    let home = Home::new();
    let out = home.ok(&["status"]);
    assert!(out.contains("models    none registered") && out.contains("server    none running"), "{out}");
    assert!(out.contains("free of") && out.contains("(stores: "), "{out}");
    if !Path::new("/proc/driver/nvidia/gpus").exists() {
        // With no nvidia-smi on PATH and no driver.
        let o = home.command(&["status"]).env("PATH", "/nonexistent").output().unwrap();
        let text = String::from_utf8_lossy(&o.stdout);
        assert!(text.contains("gpu       no NVIDIA GPU detected (nvidia-smi not found"), "{text}");
    }
    home.ok(&["prepare", s(&fixture("tiny-b/mlx4")), "--name", "flash"]);

    // An nvidia-smi that reports two GPUs.
    let bin = home.scratch("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let smi = bin.join("nvidia-smi");
    std::fs::write(
        &smi,
        "#!/bin/sh\n[ \"$1\" = --query-gpu=name,memory.total,memory.used ] || exit 3\n\
         echo 'NVIDIA H200, 143771 MiB, 1024 MiB'\necho 'NVIDIA H200, 143771 MiB, 70000 MiB'\n",
    )
    .unwrap();
    std::fs::set_permissions(&smi, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();

    // Server files: one answering, one whose process is gone, one whose port is closed.
    let servers = home.path().join("servers");
    std::fs::create_dir_all(&servers).unwrap();
    let (url, answered) = fake_server();
    let me = std::process::id();
    std::fs::write(servers.join(format!("{me}.json")), format!(r#"{{"pid": {me}, "url": "{url}", "model": "flash"}}"#))
        .unwrap();
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    std::fs::write(
        servers.join(format!("{dead}.json")),
        format!(r#"{{"pid": {dead}, "url": "{url}", "model": "old"}}"#),
    )
    .unwrap();
    let closed = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let mut sleeper = std::process::Command::new("sleep").arg("30").spawn().unwrap();
    let spid = sleeper.id();
    std::fs::write(
        servers.join(format!("{spid}.json")),
        format!(r#"{{"pid": {spid}, "url": "http://{closed}", "model": "x"}}"#),
    )
    .unwrap();

    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let o = home.command(&["status"]).env("PATH", &path).output().unwrap();
    sleeper.kill().unwrap();
    sleeper.wait().unwrap();
    answered.join().unwrap();
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{out}{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        out.contains("models    1 registered") && out.contains(&format!("  flash  {}", s(&fixture("tiny-b/mlx4")))),
        "{out}"
    );
    assert!(out.contains("q4g64") && out.contains("1.26 MiB  ok"), "{out}");
    assert!(out.contains("gpu       0: NVIDIA H200, 1.00 GiB used of 140.40 GiB (via nvidia-smi)"), "{out}");
    assert!(out.contains("1: NVIDIA H200, 68.36 GiB used of 140.40 GiB"), "{out}");
    assert!(out.contains(&format!("pid {me} at {url} serving cherenkov, flash ({url}/v1/models answers)")), "{out}");
    assert!(out.contains(&format!("pid {dead} stale: process {dead} is not running")), "{out}");
    assert!(out.contains(&format!("pid {spid} not answering: GET http://{closed}/v1/models failed")), "{out}");

    let v: serde_json::Value = serde_json::from_str(&home.ok(&["status", "--json"])).unwrap();
    assert_eq!(v["models"][0]["name"], "flash");
    assert!(v["disk"][0]["free"].as_u64().unwrap() > 0);
    assert_eq!(v["servers"].as_array().unwrap().len(), 3);
}

/// Flips one byte in the middle of a store file (same size, new mtime).
fn flip(path: &Path) {
    let mut b = std::fs::read(path).unwrap();
    let mid = b.len() / 2;
    b[mid] ^= 0x10;
    std::fs::write(path, b).unwrap();
}

#[test]
fn damaged_stores_are_reported_refused_and_repacked() {
    let home = Home::new();
    let ck = fixture("tiny-b/mlx4");
    home.ok(&["prepare", s(&ck), "--name", "x"]);
    home.ok(&["prepare", s(&ck), "--name", "y"]);
    let store = home.store_of("x");
    let out = home.ok(&["inspect", "x"]);
    assert!(out.contains("integrity   ok: no file changed since the full check when it was packed"), "{out}");
    let run = ["run", "x", "hi", "--max-tokens", "1", "--temperature", "0"];
    let out = home.ok(&run);
    assert!(!out.contains("quick check"), "{out}");

    // Rewriting a file with the same bytes changes its metadata: the quick check hashes what is
    // read at start, and says so.
    let dense = store.join("dense.bin");
    std::fs::write(&dense, std::fs::read(&dense).unwrap()).unwrap();
    let out = home.ok(&["inspect", "x"]);
    assert!(
        out.contains("integrity   ok by the quick check: 8 file(s)")
            && out.contains("files changed since the full check of"),
        "{out}"
    );
    let out = home.ok(&run);
    assert!(out.contains("note: store") && out.contains("run `cherenkov inspect x --verify`"), "{out}");
    let out = home.ok(&["inspect", "x", "--verify"]);
    assert!(out.contains("verify      ok"), "{out}");
    let out = home.ok(&["inspect", "x"]);
    assert!(out.contains("no file changed since the full check when it was verified"), "{out}");

    // A flipped byte in dense.bin: inspect reports it, run refuses, status shows it.
    flip(&dense);
    let err = home.fails(&run);
    assert!(err.contains("is damaged and will not be used") && err.contains("dense.bin: checksum"), "{err}");
    assert!(err.contains(&format!("cherenkov prepare {} --name x --repack", s(&ck))), "{err}");
    let o = home.run(&["inspect", "x"]);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(1));
    assert!(stdout.contains("integrity   DAMAGED (found by quick check"), "{stdout}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("prepare it again: cherenkov prepare x --repack"));
    assert!(home.ok(&["status"]).contains("damaged"));
    // y shares the store, so it is refused too.
    let err = home.fails(&["run", "y", "hi", "--max-tokens", "1"]);
    assert!(err.contains("is damaged"), "{err}");

    // prepare does not reuse the damaged store: it packs again, in place, for both names.
    let out = home.ok(&["prepare", s(&ck), "--name", "x"]);
    assert!(out.contains("prepared x: packed store") && !out.contains("reused"), "{out}");
    assert_eq!(home.store_of("x"), store);
    home.ok(&run);
    home.ok(&["run", "y", "hi", "--max-tokens", "1"]);

    // A damage that only a full verify finds (an expert record) is remembered.
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(store.join("manifest.json")).unwrap()).unwrap();
    flip(&store.join(m["experts"]["file"].as_str().unwrap()));
    let err = home.fails(&["inspect", "x", "--verify"]);
    assert!(
        err.contains("failed verification (1 problem(s)); prepare it again: cherenkov prepare x --repack"),
        "{err}"
    );
    let err = home.fails(&run);
    assert!(err.contains("found by verified") && err.contains("corrupted expert record"), "{err}");
    // --repack by name prepares the recorded source again.
    let out = home.ok(&["prepare", "x", "--repack"]);
    assert!(out.contains("preparing x again from its source") && out.contains("prepared x: packed store"), "{out}");
    home.ok(&run);
    // --repack packs even when the store is fine.
    let before = std::fs::metadata(store.join("manifest.json")).unwrap().modified().unwrap();
    let out = home.ok(&["prepare", s(&ck), "--name", "x", "--repack"]);
    assert!(out.contains("packed store"), "{out}");
    assert_ne!(std::fs::metadata(store.join("manifest.json")).unwrap().modified().unwrap(), before);
    assert_eq!(home.store_dirs(), ["x"]);
}
