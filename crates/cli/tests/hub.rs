//! `prepare hf://...` against an imitation of the hub on 127.0.0.1 (nothing reaches the network):
//! download into the Hugging Face cache layout, pack, register, remove the download; resume after
//! a dropped connection and after an interrupted run; corrupt files, missing revisions and gated
//! repositories fail with nothing registered.

mod common;
#[path = "../../hub/tests/fakehub/mod.rs"]
mod fakehub;

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::{Home, fixture};
use fakehub::{FakeHub, sha256};

const REPO: &str = "org/tiny";

/// A home, an HF_HOME beside it, and the fake hub.
struct Env {
    home: Home,
    hub: FakeHub,
}

impl Env {
    fn new() -> Env {
        let hub = FakeHub::start(
            REPO,
            &fixture("tiny-b/mlx4"),
            &[("README.md", b"# tiny\n"), ("original/params.json", b"{}")],
        );
        Env { home: Home::new(), hub }
    }

    fn hf_home(&self) -> PathBuf {
        self.home.scratch("hf")
    }

    fn hub_cache(&self) -> PathBuf {
        self.hf_home().join("hub")
    }

    fn command(&self, args: &[&str], token: Option<&str>) -> Command {
        let mut c = self.home.command(args);
        c.env("HF_HOME", self.hf_home()).env("HF_ENDPOINT", &self.hub.url);
        for v in ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"] {
            c.env_remove(v);
        }
        for v in ["HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"] {
            c.env_remove(v);
        }
        if let Some(t) = token {
            c.env("HF_TOKEN", t);
        }
        c
    }

    fn run(&self, args: &[&str], token: Option<&str>) -> Output {
        self.command(args, token).output().unwrap()
    }

    fn ok(&self, args: &[&str]) -> String {
        self.ok_with(args, None)
    }

    fn ok_with(&self, args: &[&str], token: Option<&str>) -> String {
        let o = self.run(args, token);
        let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        assert!(o.status.success(), "cherenkov {args:?} failed:\n{text}");
        text
    }

    fn fails(&self, args: &[&str], token: Option<&str>) -> String {
        let o = self.run(args, token);
        let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
        assert_eq!(o.status.code(), Some(1), "cherenkov {args:?}:\n{stderr}");
        assert!(stderr.contains("error: ") && !stderr.contains("panicked"), "{stderr}");
        stderr
    }

    fn weights_blob(&self) -> PathBuf {
        let sha = sha256(&self.hub.file("model.safetensors"));
        self.hub_cache().join("models--org--tiny/blobs").join(sha)
    }

    fn cdn_gets(&self) -> Vec<Option<String>> {
        self.hub.seen_for("/cdn/").into_iter().filter(|s| s.method == "GET").map(|s| s.range).collect()
    }

    fn nothing_registered(&self) {
        assert!(self.home.registered().is_empty(), "{:?}", self.home.registered());
        assert!(self.home.store_dirs().is_empty(), "{:?}", self.home.store_dirs());
    }
}

#[test]
fn prepare_downloads_packs_registers_and_cleans_up() {
    let env = Env::new();
    let commit = env.hub.commit();
    let out = env.ok(&["prepare", "hf://org/tiny", "--name", "tiny"]);
    for want in [
        format!("resolving hf://org/tiny@main at {}", env.hub.url),
        format!("org/tiny@main is commit {commit}"),
        "1 weight file(s), 881.27 KiB; needs about".to_string(),
        "to download in".to_string(),
        "for the packed store in".to_string(),
        "downloaded 6 file(s)".to_string(),
        "(sha256 checked for 1, git blob id for 5)".to_string(),
        "removed the 895.53 KiB (6 file(s)) Cherenkov downloaded".to_string(),
        "prepared tiny: packed store".to_string(),
    ] {
        assert!(out.contains(&want), "{want:?} missing from:\n{out}");
    }
    // Only what a checkpoint needs was fetched: no README, nothing from subfolders.
    assert!(env.hub.seen().iter().all(|s| !s.path.contains("README") && !s.path.contains("original")));
    // The temporary source is gone from the cache, refs included.
    assert!(!env.hub_cache().join("models--org--tiny").exists());
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(env.home.path().join("registry.json")).unwrap()).unwrap();
    assert_eq!(v["models"]["tiny"]["source"], "hf://org/tiny@main");
    assert_eq!(v["models"]["tiny"]["revision"], commit.as_str());

    let list = env.ok(&["model", "list"]);
    let line = list.lines().find(|l| l.starts_with("tiny ")).unwrap();
    assert!(line.contains("hf://org/tiny@main") && line.contains(&commit[..12]) && line.contains("q4g64"), "{list}");
    assert!(list.lines().next().unwrap().contains("REVISION"), "{list}");
    let out = env.ok(&["inspect", "hf://org/tiny@main"]);
    assert!(
        out.contains("model       tiny\n")
            && out.contains(&format!("registered  from hf://org/tiny@main at commit {commit}")),
        "{out}"
    );
    assert!(out.contains("integrity   ok: no file changed since the full check when it was packed"), "{out}");
    let out = env.ok(&["inspect", &format!("hf://org/tiny@{}", &commit[..8])]);
    assert!(out.contains("model       tiny\n"), "{out}");
    let out = env.ok(&["run", "hf://org/tiny", "hello", "--max-tokens", "2", "--temperature", "0"]);
    assert!(out.contains("expert cache"), "{out}");

    // Preparing the same commit again (another name) reuses the store without downloading.
    env.hub.clear_seen();
    let out = env.ok(&["prepare", "hf://org/tiny@v1", "--name", "again"]);
    assert!(
        out.contains("reused the complete store") && out.contains("already prepared from org/tiny at commit"),
        "{out}"
    );
    assert!(env.cdn_gets().is_empty());
    assert_eq!(env.home.store_of("again"), env.home.store_of("tiny"));

    // --repack --keep-source downloads again, packs anew, and leaves the snapshot in the cache
    // where huggingface_hub would look for it.
    let out = env.ok(&["prepare", "hf://org/tiny@v1", "--name", "kept", "--repack", "--keep-source"]);
    assert!(out.contains("packed store") && out.contains("kept the downloaded checkpoint"), "{out}");
    let snap = env.hub_cache().join("models--org--tiny/snapshots").join(&commit);
    assert_eq!(std::fs::read(snap.join("model.safetensors")).unwrap(), env.hub.file("model.safetensors"));
    assert!(std::fs::read_link(snap.join("config.json")).unwrap().starts_with("../../blobs"));
    assert_eq!(std::fs::read_to_string(env.hub_cache().join("models--org--tiny/refs/v1")).unwrap(), commit);
    // That snapshot is now a disk:// source of the built-in hfcache store.
    let out = env.ok(&["store", "list"]);
    assert!(out.contains("disk://hfcache/org/tiny  (1 snapshot(s); v1 -> "), "{out}");
    let out = env.ok(&["prepare", "disk://hfcache/org/tiny@v1", "--name", "cached"]);
    assert!(out.contains("reused the complete store"), "{out}");

    // A URI that was never prepared is not downloaded implicitly.
    let err = env.fails(&["inspect", "hf://org/other"], None);
    assert!(
        err.contains("hf://org/other@main has not been prepared")
            && err.contains("cherenkov prepare hf://org/other@main"),
        "{err}"
    );
    // A name registered to another source is refused before anything is downloaded.
    env.hub.clear_seen();
    let err = env.fails(&["prepare", "hf://org/tiny@main", "--name", "cached"], None);
    assert!(err.contains("model cached is already registered to disk://hfcache/org/tiny@v1"), "{err}");
    assert!(env.hub.seen().is_empty());
}

#[test]
fn a_dropped_transfer_resumes_in_the_same_run() {
    let env = Env::new();
    env.hub.cut("model.safetensors", 400_000, 1);
    let out = env.ok(&["prepare", "hf://org/tiny@main", "--name", "tiny"]);
    assert!(out.contains("the transfer of model.safetensors broke off") && out.contains("retrying"), "{out}");
    assert!(out.contains("resuming model.safetensors at 390.62 KiB of 881.27 KiB"), "{out}");
    assert_eq!(env.cdn_gets(), [None, Some("bytes=400000-".to_string())]);
    assert_eq!(env.home.registered().len(), 1);
}

#[test]
fn an_interrupted_download_leaves_nothing_registered_and_resumes() {
    let env = Env::new();
    env.hub.stall("model.safetensors", 300_000);
    let mut child = env
        .command(&["prepare", "hf://org/tiny@main", "--name", "tiny"], None)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut partial = env.weights_blob().into_os_string();
    partial.push(".incomplete");
    let partial = PathBuf::from(partial);
    let start = Instant::now();
    while std::fs::metadata(&partial).map(|m| m.len()).unwrap_or(0) < 300_000 {
        assert!(child.try_wait().unwrap().is_none(), "prepare ended before it was interrupted");
        assert!(start.elapsed() < Duration::from_secs(60), "the download never reached the stall");
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    env.hub.release();
    assert!(env.home.registered().is_empty());
    assert!(!env.home.path().join("stores/tiny").exists());

    let out = env.ok(&["prepare", "hf://org/tiny@main", "--name", "tiny"]);
    assert!(out.contains("292.97 KiB of partial downloads to resume"), "{out}");
    assert!(out.contains("resuming model.safetensors at 292.97 KiB"), "{out}");
    assert_eq!(env.cdn_gets(), [None, Some("bytes=300000-".to_string())]);
    assert!(out.contains("prepared tiny: packed store"), "{out}");
}

#[test]
fn corrupt_files_missing_revisions_and_gated_repositories_register_nothing() {
    let env = Env::new();
    env.hub.corrupt("model.safetensors", true);
    let err = env.fails(&["prepare", "hf://org/tiny@main", "--name", "tiny"], None);
    assert!(
        err.contains("model.safetensors of org/tiny@") && err.contains("is corrupt: the sha256 of the 902424 bytes"),
        "{err}"
    );
    assert!(err.contains("the download was deleted, run the command again"), "{err}");
    env.nothing_registered();
    let mut partial = env.weights_blob().into_os_string();
    partial.push(".incomplete");
    assert!(!env.weights_blob().exists() && !PathBuf::from(partial).exists());

    let err = env.fails(&["prepare", "hf://org/tiny@nope", "--name", "tiny"], None);
    assert!(err.contains("revision nope of org/tiny not found at http://127.0.0.1:") && err.contains("404"), "{err}");
    let err = env.fails(&["prepare", "hf://org/missing", "--name", "tiny"], None);
    assert!(err.contains("repository org/missing not found"), "{err}");
    let err = env.fails(&["prepare", "hf://org/a b"], None);
    assert!(err.contains("contains ' '"), "{err}");
    env.nothing_registered();

    env.hub.corrupt("model.safetensors", false);
    env.hub.require_token(Some("hf_secret"));
    let err = env.fails(&["prepare", "hf://org/tiny@main", "--name", "tiny"], None);
    assert!(
        err.contains("org/tiny needs authentication") && err.contains("401") && err.contains("set HF_TOKEN"),
        "{err}"
    );
    let err = env.fails(&["prepare", "hf://org/tiny@main", "--name", "tiny"], Some("hf_wrong"));
    assert!(err.contains("did not accept the token (HF_TOKEN)"), "{err}");
    env.nothing_registered();
    env.hub.clear_seen();
    let out = env.ok_with(&["prepare", "hf://org/tiny@main"], Some("hf_secret"));
    assert!(
        out.contains("with a token (HF_TOKEN or the huggingface-cli login file)")
            && out.contains("prepared tiny: packed store"),
        "{out}"
    );
    let resolves = env.hub.seen_for("/resolve/");
    assert!(!resolves.is_empty() && resolves.iter().all(|s| s.auth.as_deref() == Some("Bearer hf_secret")));
    // The small files the first (corrupt) run fetched were reused, and removed with the rest.
    assert!(
        out.contains("5 file(s) were in the cache already") && out.contains("(6 file(s)) Cherenkov downloaded"),
        "{out}"
    );
    assert!(!env.hub_cache().join("models--org--tiny").exists());
}
