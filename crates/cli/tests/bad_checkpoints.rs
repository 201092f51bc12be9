//! A damaged or unsupported checkpoint gets a clear error naming the problem, a non-zero exit,
//! nothing registered and no store directory left behind.

mod common;

use std::path::{Path, PathBuf};

use common::{Home, copy_dir, fixture, patch_header, rewrite_tensors};
use serde_json::json;

/// A copy of `fixture` under the scratch space, damaged by `damage`.
fn damaged(home: &Home, fixture_dir: &str, damage: impl FnOnce(&Path)) -> PathBuf {
    let dir = home.scratch("ck");
    copy_dir(&fixture(fixture_dir), &dir);
    damage(&dir);
    dir
}

/// `prepare` fails with a message containing every one of `expect`, and leaves nothing behind.
fn refused(home: &Home, dir: &Path, expect: &[&str]) -> String {
    let err = home.fails(&["prepare", dir.to_str().unwrap(), "--name", "broken"]);
    for e in expect {
        assert!(err.contains(e), "expected {e:?} in:\n{err}");
    }
    assert!(home.registered().is_empty(), "{:?}", home.registered());
    assert!(home.store_dirs().is_empty(), "{:?}", home.store_dirs());
    err
}

#[test]
fn missing_tensor() {
    let home = Home::new();
    let dir = damaged(&home, "tiny-b/hf", |d| {
        rewrite_tensors(&d.join("model.safetensors"), |t| t.retain(|x| x.0 != "model.layers.1.self_attn.k_proj.weight"))
    });
    refused(&home, &dir, &["missing tensor layers.1.self_attn.k_proj.weight (expected shape [64, 192])"]);
}

#[test]
fn wrong_shape() {
    let home = Home::new();
    let dir = damaged(&home, "tiny-b/hf", |d| {
        rewrite_tensors(&d.join("model.safetensors"), |t| {
            let x = t.iter_mut().find(|x| x.0 == "model.layers.0.linear_attn.in_proj_z.weight").unwrap();
            x.2 = vec![192, 128];
        })
    });
    refused(
        &home,
        &dir,
        &["tensor model.layers.0.linear_attn.in_proj_z.weight", "has shape [192, 128], expected [128, 192]"],
    );
}

#[test]
fn wrong_expert_shape() {
    let home = Home::new();
    let dir = damaged(&home, "tiny-b/hf", |d| {
        rewrite_tensors(&d.join("model.safetensors"), |t| {
            let x = t.iter_mut().find(|x| x.0 == "model.layers.1.mlp.experts.gate_up_proj").unwrap();
            x.2 = vec![6, 192, 128];
        })
    });
    refused(&home, &dir, &["model.layers.1.mlp.experts.gate_up_proj", "expected [6, 128, 192]"]);
}

#[test]
fn unsupported_model_type() {
    let home = Home::new();
    let dir = damaged(&home, "tiny-b/hf", |d| {
        let p = d.join("config.json");
        let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        v["model_type"] = json!("llama");
        std::fs::write(&p, v.to_string()).unwrap();
    });
    refused(&home, &dir, &["config.json", "unsupported model_type \"llama\"", "qwen4_exp"]);
}

#[test]
fn config_not_json() {
    let home = Home::new();
    let dir = damaged(&home, "tiny-a/hf", |d| std::fs::write(d.join("config.json"), "{\"model_type\": ").unwrap());
    refused(&home, &dir, &["config.json", "not valid JSON"]);
}

#[test]
fn truncated_file() {
    let home = Home::new();
    let dir = damaged(&home, "tiny-b/hf", |d| {
        let p = d.join("model.safetensors");
        let len = std::fs::metadata(&p).unwrap().len();
        std::fs::OpenOptions::new().write(true).open(&p).unwrap().set_len(len / 2).unwrap();
    });
    refused(&home, &dir, &["model.safetensors", "point past the end of the data section", "truncated"]);

    let home = Home::new();
    let dir = damaged(&home, "tiny-a/mlx4", |d| {
        std::fs::OpenOptions::new().write(true).open(d.join("model.safetensors")).unwrap().set_len(5).unwrap();
    });
    refused(&home, &dir, &["model.safetensors", "truncated safetensors file (5 bytes"]);
}

#[test]
fn offsets_past_the_end() {
    let home = Home::new();
    let dir = damaged(&home, "tiny-b/hf", |d| {
        patch_header(&d.join("model.safetensors"), |h, data_len| {
            h["lm_head.weight"]["data_offsets"] = json!([data_len, data_len + 512 * 192 * 2]);
        })
    });
    refused(&home, &dir, &["tensor \"lm_head.weight\"", "point past the end of the data section"]);
}

#[test]
fn overlapping_tensors() {
    let home = Home::new();
    let dir = damaged(&home, "tiny-b/hf", |d| {
        patch_header(&d.join("model.safetensors"), |h, _| {
            // Two [768] BF16 norms: same length, so only the overlap is wrong.
            let a = h["model.layers.0.attn_hyper_connection.hc_norm.weight"]["data_offsets"].clone();
            h["model.layers.0.mlp_hyper_connection.hc_norm.weight"]["data_offsets"] = a;
        })
    });
    refused(&home, &dir, &["model.layers.0.attn_hyper_connection.hc_norm.weight", "overlap in the data section"]);
}

#[test]
fn mlx_weight_without_scales() {
    let home = Home::new();
    let dir = damaged(&home, "tiny-a/mlx4", |d| {
        rewrite_tensors(&d.join("model.safetensors"), |t| {
            t.retain(|x| x.0 != "language_model.model.layers.0.linear_attn.in_proj_z.scales")
        })
    });
    refused(
        &home,
        &dir,
        &["language_model.model.layers.0.linear_attn.in_proj_z.weight", "needs both scales and biases"],
    );
}

#[test]
fn shard_missing_from_index() {
    let home = Home::new();
    let dir =
        damaged(&home, "tiny-a/hf", |d| std::fs::remove_file(d.join("model-00002-of-00002.safetensors")).unwrap());
    refused(&home, &dir, &["model.safetensors.index.json lists model-00002-of-00002.safetensors, which is missing"]);
}

#[test]
fn directory_that_does_not_exist() {
    let home = Home::new();
    let dir = home.scratch("no-such-checkpoint");
    refused(&home, &dir, &["checkpoint directory", "no-such-checkpoint does not exist"]);
}

#[test]
fn bad_names_and_sources() {
    let home = Home::new();
    let ck = fixture("tiny-b/hf");
    let err = home.fails(&["prepare", ck.to_str().unwrap(), "--name", ".hidden"]);
    assert!(err.contains("model name \".hidden\" cannot start with '.'"), "{err}");
    let err = home.fails(&["prepare", ck.to_str().unwrap(), "--name", "a/b"]);
    assert!(err.contains("contains '/'"), "{err}");
    let err = home.fails(&["prepare", "s3://bucket/repo", "--name", "remote"]);
    assert!(err.contains("unknown source scheme s3://"), "{err}");
    let err = home.fails(&["prepare", home.tmp.path().to_str().unwrap(), "--name", "empty"]);
    assert!(err.contains("no config.json in"), "{err}");
    assert!(home.registered().is_empty());
    assert!(home.store_dirs().is_empty());
}
