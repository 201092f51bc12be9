//! Disk stores: `store add/list/remove`, `prepare disk://STORE/path`, Hugging Face cache stores
//! (registered ones and the built-in `hfcache`), and MODEL arguments given as disk:// URIs.

mod common;

use std::path::{Path, PathBuf};

use common::{Home, copy_dir, fixture};
use sha2::{Digest, Sha256};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Lays out `src`'s files as `huggingface_hub` caches them: blobs named by hash, a snapshot of
/// relative symlinks, and `refs/main`.
fn fake_hf_cache(cache: &Path, repo: &str, commit: &str, src: &Path) -> PathBuf {
    let repo_dir = cache.join(format!("models--{}", repo.replace('/', "--")));
    let snap = repo_dir.join("snapshots").join(commit);
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(repo_dir.join("blobs")).unwrap();
    std::fs::create_dir_all(repo_dir.join("refs")).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        let bytes = std::fs::read(e.path()).unwrap();
        let sha: String = Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
        std::fs::write(repo_dir.join("blobs").join(&sha), &bytes).unwrap();
        std::os::unix::fs::symlink(format!("../../blobs/{sha}"), snap.join(e.file_name())).unwrap();
    }
    std::fs::write(repo_dir.join("refs/main"), commit).unwrap();
    snap
}

#[test]
fn directory_stores() {
    let home = Home::new();
    let models = home.scratch("models");
    copy_dir(&fixture("tiny-b/mlx4"), &models.join("org/tiny-mlx"));
    copy_dir(&fixture("tiny-b/hf"), &models.join("org/tiny-hf"));
    std::fs::create_dir_all(models.join("notes")).unwrap();

    let out = home.ok(&["store", "add", "models", s(&models)]);
    assert!(out.contains(&format!("added disk store models: {} (dir), 2 checkpoint(s) found", s(&models))), "{out}");
    assert!(out.contains("disk://models/org/tiny-hf\n") && out.contains("disk://models/org/tiny-mlx\n"), "{out}");
    assert!(home.ok(&["store", "add", "models", s(&models)]).contains("already registered"));
    let err = home.fails(&["store", "add", "models", s(&home.scratch("models/org"))]);
    assert!(err.contains("disk store models is already registered to"), "{err}");
    let err = home.fails(&["store", "add", "hfcache", s(&models)]);
    assert!(err.contains("hfcache is built in"), "{err}");
    let err = home.fails(&["store", "add", "x", s(&home.scratch("nope"))]);
    assert!(err.contains("is not a directory"), "{err}");

    let out = home.ok(&["prepare", "disk://models/org/tiny-mlx", "--name", "m"]);
    assert!(out.contains("prepared m: packed store"), "{out}");
    let list = home.ok(&["model", "list"]);
    assert!(list.lines().any(|l| l.starts_with("m ") && l.contains("disk://models/org/tiny-mlx")), "{list}");
    let out = home.ok(&["inspect", "disk://models/org/tiny-mlx/"]);
    assert!(out.contains("model       m\n") && out.contains("registered  from disk://models/org/tiny-mlx\n"), "{out}");
    // Without --name the name is the directory's; a URI not prepared yet is packed on first use.
    let out = home.ok(&["inspect", "disk://models/org/tiny-hf"]);
    assert!(out.contains("model       tiny-hf\n"), "{out}");
    // The same checkpoint by direct path is another source, so the name conflicts; its store is shared.
    let err = home.fails(&["prepare", s(&models.join("org/tiny-mlx")), "--name", "m"]);
    assert!(err.contains("model m is already registered to disk://models/org/tiny-mlx"), "{err}");
    let out = home.ok(&["prepare", s(&models.join("org/tiny-mlx")), "--name", "direct"]);
    assert!(out.contains("reused"), "{out}");

    for (uri, want) in [
        ("disk://nostore/org/x", "no disk store named \"nostore\" (registered: models; built in: hfcache)"),
        ("disk://models/org/missing", "models/org/missing does not exist"),
        ("disk://models/org/tiny-mlx@v2", "revisions apply to Hugging Face cache stores"),
        ("disk://models/notes", "no config.json in"),
    ] {
        let err = home.fails(&["prepare", uri, "--name", "z"]);
        assert!(err.contains(want), "{uri}: {err}");
    }
    let out = home.ok(&["store", "list"]);
    assert!(out.contains(&format!("models  {} (dir)", s(&models))) && out.contains("hfcache  "), "{out}");
    let out = home.ok(&["store", "remove", "models"]);
    assert!(out.contains("removed disk store models") && out.contains("keep their stores: m, tiny-hf"), "{out}");
    // The models stay usable; the store's URIs no longer resolve to new checkpoints.
    home.ok(&["inspect", "m"]);
    let err = home.fails(&["prepare", "disk://models/org/tiny-hf", "--name", "other"]);
    assert!(err.contains("no disk store named \"models\""), "{err}");
    let err = home.fails(&["store", "remove", "models"]);
    assert!(err.contains("no disk store named \"models\" is registered"), "{err}");
}

#[test]
fn hugging_face_cache_stores() {
    let home = Home::new();
    let hf_home = home.scratch("hf-home");
    let commit = "0123456789abcdef0123456789abcdef01234567";
    fake_hf_cache(&hf_home.join("hub"), "org/tiny", commit, &fixture("tiny-b/mlx4"));

    // Registering an HF_HOME finds the cache in hub/.
    let out = home.ok(&["store", "add", "shared", s(&hf_home)]);
    assert!(
        out.contains("(hf-cache), 1 checkpoint(s) found")
            && out.contains("disk://shared/org/tiny  (1 snapshot(s); main -> 0123456789ab)"),
        "{out}"
    );
    let out = home.ok(&["prepare", "disk://shared/org/tiny", "--name", "c"]);
    assert!(
        out.contains("disk://shared/org/tiny is snapshot 0123456789ab") && out.contains("prepared c: packed store"),
        "{out}"
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(home.path().join("registry.json")).unwrap()).unwrap();
    assert_eq!(v["models"]["c"]["source"], "disk://shared/org/tiny");
    assert_eq!(v["models"]["c"]["revision"], commit);
    assert_eq!(v["stores"]["shared"]["kind"], "hf-cache");
    // The cached files are never removed by prepare.
    assert!(hf_home.join("hub/models--org--tiny/snapshots").join(commit).join("model.safetensors").exists());

    // The built-in hfcache store follows HF_HOME; revisions are refs, commits or commit prefixes.
    let with_hf = |args: &[&str]| {
        let o = home.command(args).env("HF_HOME", &hf_home).env_remove("HF_HUB_CACHE").output().unwrap();
        (o.status.success(), format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)))
    };
    let (ok, out) = with_hf(&["prepare", "disk://hfcache/org/tiny@0123456789", "--name", "b"]);
    assert!(ok && out.contains("reused the complete store"), "{out}");
    let (ok, out) = with_hf(&["inspect", "disk://hfcache/org/tiny@0123456789"]);
    assert!(ok && out.contains("model       b\n"), "{out}");
    let (ok, out) = with_hf(&["prepare", "disk://hfcache/org/tiny@v9", "--name", "x"]);
    assert!(
        !ok && out.contains("no revision v9 of org/tiny in the Hugging Face cache")
            && out.contains("main -> 0123456789ab"),
        "{out}"
    );
    let (ok, out) = with_hf(&["prepare", "disk://hfcache/org/absent", "--name", "x"]);
    assert!(
        !ok && out.contains("org/absent is not in the Hugging Face cache") && out.contains("models--org--absent"),
        "{out}"
    );
    let (ok, out) = with_hf(&["store", "list"]);
    assert!(ok && out.contains("disk://hfcache/org/tiny  (1 snapshot(s); main -> 0123456789ab)"), "{out}");
    assert!(out.contains("built in: HF_HUB_CACHE, else HF_HOME/hub"), "{out}");
}
