//! `run`, the `cherenkov MODEL PROMPT` shorthand, `logits` and `demo` through the binary.

mod common;

use cherenkov_model::safetensors::SafeTensors;
use common::{Home, fixture};

fn read_npy_f32(path: &std::path::Path) -> (Vec<usize>, Vec<f32>) {
    let b = std::fs::read(path).unwrap();
    assert_eq!(&b[..6], b"\x93NUMPY");
    let hl = u16::from_le_bytes([b[8], b[9]]) as usize;
    let header = std::str::from_utf8(&b[10..10 + hl]).unwrap();
    assert!(header.contains("'descr': '<f4'"), "{header}");
    let shape_s = header.split("'shape': (").nth(1).unwrap().split(')').next().unwrap();
    let shape: Vec<usize> = shape_s.split(',').filter_map(|d| d.trim().parse().ok()).collect();
    let data = b[10 + hl..].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    (shape, data)
}

#[test]
fn logits_match_the_golden_reference() {
    let home = Home::new();
    let st = SafeTensors::open(&fixture("tiny-a/golden-mlx4.safetensors")).unwrap();
    let toks: Vec<String> = st
        .read(st.get("tokens").unwrap())
        .unwrap()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()).to_string())
        .collect();
    let want: Vec<f32> = st
        .read(st.get("logits").unwrap())
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let out = home.scratch("l.npy");
    let model = fixture("tiny-a/mlx4");
    home.ok(&["logits", model.to_str().unwrap(), "--tokens", &toks.join(","), "--out", out.to_str().unwrap()]);
    let (shape, got) = read_npy_f32(&out);
    assert_eq!(shape, vec![toks.len(), 512]);
    let max_ref = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let max_diff = got.iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(max_diff <= 2e-3 * max_ref, "max |diff| {max_diff}");
}

#[test]
fn greedy_run_is_deterministic_and_the_shorthand_works() {
    let home = Home::new();
    let model = fixture("tiny-b/mlx4");
    let m = model.to_str().unwrap();
    let a = home.run(&["run", m, "hello", "--temperature", "0", "--max-tokens", "12"]);
    let b = home.run(&[m, "hello", "--temperature", "0", "--max-tokens", "12", "--expert-cache", "100K"]);
    assert!(a.status.success() && b.status.success(), "{}", String::from_utf8_lossy(&a.stderr));
    assert_eq!(a.stdout, b.stdout, "greedy output depends on the cache size or the spelling");
    let err = String::from_utf8_lossy(&b.stderr);
    assert!(err.contains("expert cache:") && err.contains("tok/s") && err.contains("hits"), "{err}");
    // A seeded sample is reproducible.
    let s1 = home.run(&[m, "hello", "--temperature", "1", "--seed", "5", "--max-tokens", "12"]);
    let s2 = home.run(&[m, "hello", "--temperature", "1", "--seed", "5", "--max-tokens", "12"]);
    assert_eq!(s1.stdout, s2.stdout);
}

#[test]
fn drafted_run_writes_the_same_text_and_reports_the_drafts() {
    let home = Home::new();
    let model = fixture("tiny-a/mlx4");
    let m = model.to_str().unwrap();
    let args = ["run", m, "hello", "--temperature", "1", "--seed", "5", "--max-tokens", "12", "--backend", "cpu"];
    let plain = home.run(&args);
    let drafted = home.run(&[&args[..], &["--draft", "1"]].concat());
    assert!(drafted.status.success(), "{}", String::from_utf8_lossy(&drafted.stderr));
    assert_eq!(plain.stdout, drafted.stdout, "drafting changed the text");
    let err = String::from_utf8_lossy(&drafted.stderr);
    assert!(err.contains("MTP drafts:") && err.contains("accepted"), "{err}");
    assert!(!String::from_utf8_lossy(&plain.stderr).contains("MTP drafts:"));
    let two = home.run(&[&args[..], &["--draft", "2"]].concat());
    let e = String::from_utf8_lossy(&two.stderr);
    assert!(!two.status.success() && e.contains("--draft") && e.contains("0..=1"), "{e}");
    let b = fixture("tiny-b/mlx4");
    let e = home.fails(&["run", b.to_str().unwrap(), "hi", "--draft", "1", "--backend", "cpu"]);
    assert!(e.contains("no MTP head"), "{e}");
    // The server refuses to start drafting with it, before it listens.
    let e = home.fails(&["serve", "--model", b.to_str().unwrap(), "--draft", "1", "--backend", "cpu", "--port", "0"]);
    assert!(e.contains("no MTP head") && e.contains("--draft"), "{e}");
    let e = home.fails(&["serve", "--model", m, "--draft", "2", "--backend", "cpu", "--port", "0"]);
    assert!(e.contains("scheduler.draft must be at most 1"), "{e}");
}

#[test]
fn bad_input_is_refused_clearly() {
    let home = Home::new();
    let e = home.fails(&["run", "no-such-model", "hi"]);
    assert!(e.contains("no-such-model"), "{e}");
    let model = fixture("tiny-b/mlx4");
    let m = model.to_str().unwrap();
    let out = home.scratch("x.npy");
    let e = home.fails(&["logits", m, "--tokens", "1,99999", "--out", out.to_str().unwrap()]);
    assert!(e.contains("99999") && e.contains("vocab"), "{e}");
    let e = home.fails(&["run", m, "hi", "--temperature=-1"]);
    assert!(e.contains("temperature"), "{e}");
    let e = home.fails(&["run", m, "hi", "--expert-cache", "10K"]);
    assert!(e.contains("expert cache") || e.contains("--expert-cache"), "{e}");
}

#[test]
fn corrupted_expert_record_is_reported() {
    let home = Home::new();
    let model = fixture("tiny-b/mlx4");
    home.ok(&["prepare", model.to_str().unwrap(), "--name", "b"]);
    let store = home.store_of("b");
    let experts = store.join("experts-q4.bin");
    let mut bytes = std::fs::read(&experts).unwrap();
    for b in bytes.iter_mut().step_by(4096) {
        *b ^= 0x5a;
    }
    std::fs::write(&experts, bytes).unwrap();
    let e = home.fails(&["run", "b", "hello", "--temperature", "0", "--max-tokens", "4"]);
    assert!(e.contains("corrupted expert record") && e.contains("prepare"), "{e}");
}

#[test]
fn demo_runs_end_to_end() {
    let home = Home::new();
    let text = home.ok(&["demo", "--max-tokens", "8"]);
    assert!(text.contains("expert cache:") && text.contains("evictions"), "{text}");
    // The second run reuses the checkpoint and the store.
    let text = home.ok(&["demo", "--max-tokens", "4"]);
    assert!(text.contains("reusing store"), "{text}");
}
