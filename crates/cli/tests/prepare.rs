//! `prepare`, `model list` and MODEL resolution on the golden fixtures: both layouts pack and
//! register, a second prepare reuses the store, names conflict only on purpose, and interrupted or
//! concurrent prepares never leave a half-made store registered.

mod common;

use std::time::{Duration, Instant};

use cherenkov_model::synth::{SynthOptions, SynthShape, write_checkpoint};
use common::{Home, fixture};
use indicatif::ProgressBar;

const FIXTURES: [(&str, &str, &str); 5] = [
    ("tiny-a/hf", "hf", "q4g64"),
    ("tiny-a/mlx4", "mlx", "q4g64"),
    ("tiny-b/hf", "hf", "q4g64"),
    ("tiny-b/mlx4", "mlx", "q4g64"),
    ("tiny-b/mlx-mixed", "mlx", "q3g32+q4g32"),
];

fn s(p: &std::path::Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn fixtures_pack_register_and_list() {
    let home = Home::new();
    for (i, (dir, ..)) in FIXTURES.iter().enumerate() {
        let out = home.ok(&["prepare", s(&fixture(dir)), "--name", &format!("m{i}")]);
        assert!(out.contains(&format!("prepared m{i}: packed store")), "{out}");
        assert!(home.store_of(&format!("m{i}")).join("manifest.json").is_file());
        let out = home.ok(&["inspect", &format!("m{i}")]);
        let layers = if dir.starts_with("tiny-a") {
            "layers      3: 2 linear_attention"
        } else {
            "layers      2: 1 linear_attention"
        };
        assert!(out.contains(layers) && out.contains(&format!("source      {}", s(&fixture(dir)))), "{out}");
    }
    // tiny-a's BF16 checkpoint and its MLX twin are different sources: two stores.
    assert_eq!(home.store_dirs(), ["m0", "m1", "m2", "m3", "m4"]);
    let list = home.ok(&["model", "list"]);
    let lines: Vec<&str> = list.lines().collect();
    assert!(lines[0].starts_with("NAME") && lines[0].contains("EXPERTS") && lines[0].contains("SIZE"), "{list}");
    for (i, (dir, layout, experts)) in FIXTURES.iter().enumerate() {
        let line = lines.iter().find(|l| l.starts_with(&format!("m{i} "))).unwrap();
        for want in [s(&fixture(dir)), layout, experts, s(&home.store_of(&format!("m{i}")))] {
            assert!(line.contains(want), "{want:?} missing from {line:?}");
        }
    }
    let json: serde_json::Value = serde_json::from_str(&home.ok(&["model", "list", "--json"])).unwrap();
    let rows = json.as_array().unwrap();
    assert_eq!(rows.len(), 5);
    assert_eq!(rows[4]["experts"], "q3g32+q4g32");
    assert!(rows[0]["bytes"].as_u64().unwrap() > 1_000_000);
}

#[test]
fn second_prepare_reuses_the_store() {
    let home = Home::new();
    let ck = fixture("tiny-a/mlx4");
    home.ok(&["prepare", s(&ck), "--name", "a"]);
    let manifest = home.store_of("a").join("manifest.json");
    let before = std::fs::metadata(&manifest).unwrap().modified().unwrap();
    let out = home.ok(&["prepare", s(&ck), "--name", "a"]);
    assert!(out.contains("reused the complete store") && out.contains("prepared a: reused store"), "{out}");
    assert_eq!(std::fs::metadata(&manifest).unwrap().modified().unwrap(), before);
    // A second name for the same checkpoint shares the store.
    let out = home.ok(&["prepare", s(&ck), "--name", "b"]);
    assert!(out.contains("reused"), "{out}");
    assert_eq!(home.store_of("a"), home.store_of("b"));
    assert_eq!(home.store_dirs(), ["a"]);
}

#[test]
fn a_name_changes_source_only_with_force() {
    let home = Home::new();
    let (a, b) = (fixture("tiny-b/hf"), fixture("tiny-b/mlx4"));
    home.ok(&["prepare", s(&a), "--name", "x"]);
    home.ok(&["prepare", s(&a), "--name", "y"]);
    let err = home.fails(&["prepare", s(&b), "--name", "x"]);
    assert!(err.contains("model x is already registered to") && err.contains("--force"), "{err}");
    assert_eq!(home.store_dirs(), ["x"]);
    // x's old store is still y's, so the new one goes beside it.
    let out = home.ok(&["prepare", s(&b), "--name", "x", "--force"]);
    assert!(out.contains("packed"), "{out}");
    assert_ne!(home.store_of("x"), home.store_of("y"));
    assert!(home.store_of("x").file_name().unwrap().to_str().unwrap().starts_with("x-"));
    assert!(home.ok(&["inspect", "y"]).contains(s(&a)));
    assert!(home.ok(&["inspect", "x"]).contains(s(&b)));
    // With no other user, a forced re-point replaces stores/<name> in place.
    let (c, d) = (fixture("tiny-a/mlx4"), fixture("tiny-a/hf"));
    home.ok(&["prepare", s(&c), "--name", "w"]);
    home.ok(&["prepare", s(&d), "--name", "w", "--force"]);
    assert_eq!(home.store_of("w"), home.path().join("stores/w"));
    assert!(home.ok(&["inspect", "w"]).contains(&format!("source      {} (hf layout", s(&d))));
    let dirs = home.store_dirs();
    assert_eq!(dirs.len(), 3, "{dirs:?}");
    assert!(dirs.iter().all(|d| !d.starts_with('.')), "{dirs:?}");
}

#[test]
fn model_arguments_resolve() {
    let home = Home::new();
    // A checkpoint directory is packed on first use under its directory's name.
    let out = home.ok(&["inspect", s(&fixture("tiny-b/hf"))]);
    assert!(out.contains("model       hf\n"), "{out}");
    assert_eq!(home.registered().len(), 1);
    let out = home.ok(&["inspect", s(&fixture("tiny-b/hf"))]);
    assert!(out.contains("reused the complete store"), "{out}");
    // Another checkpoint in a directory of the same name gets a distinct name.
    let out = home.ok(&["inspect", s(&fixture("tiny-a/hf"))]);
    let names: Vec<String> = home.registered().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names.len(), 2);
    let other = names.iter().find(|n| n.starts_with("hf-")).unwrap();
    assert!(out.contains(&format!("model       {other}\n")), "{out}");
    // A store directory is used as it is.
    let out = home.ok(&["inspect", s(&home.store_of("hf"))]);
    assert!(out.contains("model       (not registered)"), "{out}");
    // Unknown names list what is registered.
    let err = home.fails(&["inspect", "nope"]);
    assert!(
        err.contains("no model named \"nope\"") && err.contains(&format!("registered models: hf, {other}")),
        "{err}"
    );
    let err = Home::new().fails(&["inspect", "nope"]);
    assert!(err.contains("no models are registered yet"), "{err}");
    let err = home.fails(&["inspect", ""]);
    assert!(err.contains("the MODEL argument is empty"), "{err}");
    let err = home.fails(&["inspect", s(&fixture("tiny-b/hf/config.json"))]);
    assert!(err.contains("config.json is a file"), "{err}");
    let err = home.fails(&["inspect", s(home.tmp.path())]);
    assert!(err.contains("neither a store (no manifest.json) nor a checkpoint (no config.json)"), "{err}");
    // A registered store that has gone missing is named.
    std::fs::remove_dir_all(home.store_of("hf")).unwrap();
    let err = home.fails(&["inspect", "hf"]);
    assert!(err.contains("registered to the store") && err.contains("missing"), "{err}");
    assert!(home.ok(&["model", "list"]).contains("store missing"));
    home.ok(&["model", "remove", "hf"]);
    let err = home.fails(&["model", "remove", "hf"]);
    assert!(err.contains("no model named \"hf\""), "{err}");
}

#[test]
fn stale_temporary_stores_are_removed() {
    let home = Home::new();
    // A finished process's id: its temporary store is a leftover.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let stores = home.path().join("stores");
    let stale = stores.join(format!(".tmp-a-{dead}"));
    let live = stores.join(format!(".tmp-b-{}", std::process::id()));
    for d in [&stale, &live] {
        std::fs::create_dir_all(d).unwrap();
        std::fs::write(d.join("dense.bin"), b"partial").unwrap();
    }
    let out = home.ok(&["prepare", s(&fixture("tiny-b/mlx4")), "--name", "a"]);
    assert!(out.contains("left by an interrupted prepare"), "{out}");
    assert!(!stale.exists());
    assert!(live.exists(), "a running process's temporary store must stay");
}

#[test]
fn an_interrupted_prepare_registers_nothing() {
    let home = Home::new();
    let ck = home.scratch("demo");
    // Large enough (about 50 MB) that packing is still running when it is killed.
    write_checkpoint(&SynthShape::demo(), &SynthOptions::default(), &ck, &ProgressBar::hidden()).unwrap();
    let mut child = home.command(&["prepare", s(&ck), "--name", "demo"]).spawn().unwrap();
    let start = Instant::now();
    while !home.store_dirs().iter().any(|d| d.starts_with(".tmp-demo-")) {
        assert!(child.try_wait().unwrap().is_none(), "prepare ended before it was interrupted");
        assert!(start.elapsed() < Duration::from_secs(60));
        std::thread::sleep(Duration::from_millis(2));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(home.registered().is_empty());
    assert!(!home.path().join("stores/demo").exists());
    let out = home.ok(&["prepare", s(&ck), "--name", "demo"]);
    assert!(out.contains("left by an interrupted prepare") && out.contains("packed"), "{out}");
    assert_eq!(home.store_dirs(), ["demo"]);
}

#[test]
fn concurrent_prepares_share_one_store() {
    let home = Home::new();
    let ck = fixture("tiny-a/hf");
    let children: Vec<_> = (0..4)
        .map(|i| {
            home.command(&["prepare", s(&ck), "--name", &format!("c{i}")])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    for mut c in children {
        assert!(c.wait().unwrap().success());
    }
    let reg = home.registered();
    assert_eq!(reg.len(), 4);
    assert!(reg.iter().all(|(_, store)| *store == reg[0].1), "{reg:?}");
    assert_eq!(home.store_dirs().len(), 1, "{:?}", home.store_dirs());
}
