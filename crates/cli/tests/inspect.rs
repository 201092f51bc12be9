//! `inspect` reports what a store holds and `--verify` finds damage; `synth` writes checkpoints
//! that prepare and verify.

mod common;

use common::{Home, fixture};

#[test]
fn inspect_reports_both_layouts() {
    let home = Home::new();
    for (dir, name) in [("tiny-a/hf", "a-hf"), ("tiny-a/mlx4", "a-mlx")] {
        home.ok(&["prepare", fixture(dir).to_str().unwrap(), "--name", name]);
        let out = home.ok(&["inspect", name]);
        for want in [
            format!("model       {name}\n"),
            "model type  qwen4_exp\n".to_string(),
            "layers      3: 2 linear_attention (Gated DeltaNet), 1 attention\n".to_string(),
            "hidden      192 (vocab 512, 4 hyper-connection streams, low rank 40)".to_string(),
            "experts     6 routed, top-2, intermediate 64; shared expert intermediate 96".to_string(),
            "PLE         layers [0, 1] (zero-based), embed dim 64".to_string(),
            "QSA         4 heads, 1 KV head, head_dim 32, budget 16, compress ratio 4".to_string(),
            "MTP         1 layer(s)".to_string(),
            "experts   down_proj q4g64; gate_proj q4g64; up_proj q4g64".to_string(),
            "n-gram    q4g32".to_string(),
            "(24 records of".to_string(),
        ] {
            assert!(out.contains(&want), "{want:?} missing from:\n{out}");
        }
        let layout = if name == "a-hf" { "(hf layout" } else { "(mlx layout" };
        assert!(out.contains(layout), "{out}");
    }
    // The twins pack to the same bytes, so the JSON reports agree apart from name and source.
    let json =
        |name: &str| -> serde_json::Value { serde_json::from_str(&home.ok(&["inspect", name, "--json"])).unwrap() };
    let (h, m) = (json("a-hf"), json("a-mlx"));
    for key in ["layers", "precisions", "config", "mtp_layers"] {
        assert_eq!(h[key], m[key], "{key}");
    }
    for key in ["dense", "dense_tensors", "experts", "expert_record", "expert_records", "ngram"] {
        assert_eq!(h["bytes"][key], m["bytes"][key], "{key}");
    }
    assert_eq!(h["precisions"]["dense"]["q8g64"], 8); // mlp.gate and shared_expert_gate of 3 layers + MTP
    assert_eq!(h["precisions"]["dense"]["f32"], 2);
    assert_eq!(h["config"]["num_experts"], 6);
    assert_eq!(h["source"]["layout"], "hf");
    assert!(h.get("verify").is_none());
}

#[test]
fn verify_finds_a_damaged_record() {
    let home = Home::new();
    home.ok(&["prepare", fixture("tiny-b/mlx4").to_str().unwrap(), "--name", "b"]);
    let out = home.ok(&["inspect", "b", "--verify"]);
    assert!(out.contains("verify      ok"), "{out}");
    let v: serde_json::Value = serde_json::from_str(&home.ok(&["inspect", "b", "--verify", "--json"])).unwrap();
    assert_eq!(v["verify"], serde_json::json!([]));

    // Flip one byte of expert 3 of the second MoE layer (record 6 + 3 = 9).
    let store = home.store_of("b");
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(store.join("manifest.json")).unwrap()).unwrap();
    let record = m["experts"]["record_bytes"].as_u64().unwrap();
    let path = store.join(m["experts"]["file"].as_str().unwrap());
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[(9 * record + 100) as usize] ^= 0x40;
    std::fs::write(&path, bytes).unwrap();
    let tok = store.join("tokenizer.json");
    let mut t = std::fs::read(&tok).unwrap();
    t[10] ^= 1;
    std::fs::write(&tok, &t).unwrap();

    let o = home.run(&["inspect", "b", "--verify"]);
    let (stdout, stderr) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert_eq!(o.status.code(), Some(1));
    assert!(stdout.contains("verify      2 problem(s)"), "{stdout}");
    assert!(stdout.contains("corrupted expert record: layer layers.1 expert 3"), "{stdout}");
    assert!(stdout.contains("tokenizer.json: checksum"), "{stdout}");
    assert!(stderr.contains("error: store") && stderr.contains("failed verification (2 problem(s))"), "{stderr}");

    // A file of the wrong size is caught as soon as the store is opened.
    std::fs::write(&tok, "{}").unwrap();
    let err = home.fails(&["inspect", "b"]);
    assert!(err.contains("tokenizer.json has 2 bytes, the manifest records"), "{err}");
}

#[test]
fn synth_checkpoints_prepare_and_verify() {
    let home = Home::new();
    let ck = home.scratch("tiny");
    let out = home.ok(&["synth", ck.to_str().unwrap(), "--preset", "tiny", "--shard-mib", "1", "--seed", "5"]);
    assert!(out.contains("97 tensors") && out.contains("4 shard(s)"), "{out}");
    assert!(ck.join("model.safetensors.index.json").is_file() && ck.join("tokenizer.json").is_file());
    home.ok(&["prepare", ck.to_str().unwrap(), "--name", "tiny"]);
    let out = home.ok(&["inspect", "tiny", "--verify"]);
    assert!(out.contains("layers      2: 1 linear_attention") && out.contains("verify      ok"), "{out}");

    // Scaled shapes from explicit dimensions.
    let scaled = home.scratch("scaled");
    let args = ["synth", scaled.to_str().unwrap(), "--hidden", "256", "--layers", "4", "--experts", "8"];
    let out =
        home.ok(&[&args[..], &["--top-k", "2", "--moe-intermediate", "128", "--vocab", "512", "--ngram-base", "257"]]
            .concat());
    assert!(out.contains("wrote"), "{out}");
    let out = home.ok(&["inspect", scaled.to_str().unwrap()]);
    assert!(out.contains("experts     8 routed, top-2, intermediate 128"), "{out}");

    let err = home.fails(&["synth", ck.to_str().unwrap(), "--preset", "tiny"]);
    assert!(err.contains("is not empty"), "{err}");
    let err = home.fails(&["synth", home.scratch("v").to_str().unwrap(), "--vocab", "100"]);
    assert!(err.contains("vocab_size 100 is smaller than the bundled tokenizer's 500 tokens"), "{err}");
    let err = home.fails(&["synth", home.scratch("w").to_str().unwrap(), "--preset", "tiny", "--hidden", "64"]);
    assert!(err.contains("fixed dimensions"), "a preset and explicit dimensions conflict: {err}");
}
