//! Golden tests: the CPU forward reproduces transformers' logits (computed on the dequantized 4-bit
//! weights by tools/fixtures/make_golden.py) for the BF16 checkpoints packed by Cherenkov and for
//! their MLX twins, over a full forward, incremental decode, and with an expert cache smaller than
//! the model's experts.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use cherenkov_cpu::{CpuModel, Logits};
use cherenkov_engine::residency::{ExpertPool, HostSlots};
use cherenkov_model::checkpoint::Checkpoint;
use cherenkov_model::safetensors::SafeTensors;
use cherenkov_model::store::{Store, pack::pack};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/golden")
}

/// Packs each fixture checkpoint once per test process.
fn store(variant: &str) -> Arc<Store> {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    static LOCK: Mutex<()> = Mutex::new(());
    let dir = DIR.get_or_init(|| tempfile::tempdir().unwrap());
    let _g = LOCK.lock().unwrap();
    let out = dir.path().join(variant.replace('/', "-"));
    if !out.join("manifest.json").exists() {
        let ck = Checkpoint::open(&fixtures().join(variant)).unwrap();
        pack(&ck, &out, &indicatif::ProgressBar::hidden()).unwrap();
    }
    Arc::new(Store::open(&out).unwrap())
}

struct Golden {
    tokens: Vec<u32>,
    logits: Vec<f32>,
    vocab: usize,
}

fn golden(file: &str) -> Golden {
    let st = SafeTensors::open(&fixtures().join(file)).unwrap();
    let t = st.get("tokens").unwrap();
    let tokens =
        st.read(t).unwrap().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32).collect();
    let l = st.get("logits").unwrap();
    let vocab = l.shape[1];
    let logits = st.read(l).unwrap().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
    Golden { tokens, logits, vocab }
}

fn model(store: Arc<Store>, slots: usize) -> CpuModel {
    let memory = Arc::new(HostSlots::new(slots, store.record_bytes()).unwrap());
    let pool = Arc::new(ExpertPool::new(store.clone(), memory, 2).unwrap());
    CpuModel::new(store, pool).unwrap()
}

/// max |diff| <= 2e-3 max |ref| over the rows, and the top-1 token agrees wherever the reference's
/// top-1 margin exceeds 1e-2.
fn check_rows(what: &str, got: &[f32], want: &[f32], vocab: usize) {
    assert_eq!(got.len(), want.len(), "{what}: shape");
    let max_ref = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let max_diff = got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(max_diff <= 2e-3 * max_ref, "{what}: max |diff| {max_diff} > 2e-3 x max |ref| {max_ref}");
    let argmax = |r: &[f32]| r.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
    let mut compared = 0;
    for (row, (g, w)) in got.chunks_exact(vocab).zip(want.chunks_exact(vocab)).enumerate() {
        let mut sorted = w.to_vec();
        sorted.sort_by(|a, b| b.total_cmp(a));
        if sorted[0] - sorted[1] > 1e-2 {
            assert_eq!(argmax(g), argmax(w), "{what}: top-1 differs at row {row}");
            compared += 1;
        }
    }
    assert!(compared > 0, "{what}: no row had a clear top-1");
    eprintln!("{what}: max |diff| {max_diff:.3e} (max |ref| {max_ref:.3}), top-1 compared on {compared} rows");
}

fn full_forward(variant: &str, golden_file: &str) {
    let g = golden(golden_file);
    let m = model(store(variant), 64);
    let mut s = m.new_session();
    let logits = m.forward(&mut s, &g.tokens, Logits::All).unwrap();
    check_rows(&format!("{variant} full forward"), &logits, &g.logits, g.vocab);
}

fn incremental(variant: &str, golden_file: &str, slots: usize) -> cherenkov_engine::stats::PoolStats {
    let g = golden(golden_file);
    let m = model(store(variant), slots);
    let mut s = m.new_session();
    let split = g.tokens.len() / 3;
    let mut got = m.forward(&mut s, &g.tokens[..split], Logits::All).unwrap();
    for &tok in &g.tokens[split..] {
        got.extend(m.forward(&mut s, &[tok], Logits::Last).unwrap());
    }
    check_rows(&format!("{variant} incremental ({slots} slots)"), &got, &g.logits, g.vocab);
    m.pool.stats()
}

#[test]
fn tiny_a_bf16_full_forward() {
    full_forward("tiny-a/hf", "tiny-a/golden-mlx4.safetensors");
}

#[test]
fn tiny_a_mlx_full_forward() {
    full_forward("tiny-a/mlx4", "tiny-a/golden-mlx4.safetensors");
}

#[test]
fn tiny_b_bf16_full_forward() {
    full_forward("tiny-b/hf", "tiny-b/golden-mlx4.safetensors");
}

#[test]
fn tiny_b_mlx_full_forward() {
    full_forward("tiny-b/mlx4", "tiny-b/golden-mlx4.safetensors");
}

#[test]
fn tiny_b_mixed_bits_group_32_full_forward() {
    full_forward("tiny-b/mlx-mixed", "tiny-b/golden-mixed.safetensors");
}

#[test]
fn tiny_a_incremental_decode() {
    incremental("tiny-a/hf", "tiny-a/golden-mlx4.safetensors", 64);
    incremental("tiny-a/mlx4", "tiny-a/golden-mlx4.safetensors", 64);
}

#[test]
fn tiny_b_incremental_decode() {
    incremental("tiny-b/hf", "tiny-b/golden-mlx4.safetensors", 64);
    incremental("tiny-b/mlx-mixed", "tiny-b/golden-mixed.safetensors", 64);
}

#[test]
fn small_expert_cache_evicts_and_rereads() {
    // tiny-a has 4 MoE layers (3 + MTP) x 6 experts; 6 slots hold one prefill step's union but a
    // quarter of the model's experts, so decode evicts and reads experts again.
    for variant in ["tiny-a/hf", "tiny-a/mlx4"] {
        let st = store(variant);
        let total = st.manifest.experts.records();
        let stats = incremental(variant, "tiny-a/golden-mlx4.safetensors", 6);
        assert!(6 < total);
        assert!(stats.total.evictions > 0, "{variant}: no evictions with 6 slots");
        assert!(stats.total.misses > 18, "{variant}: experts were not read again after eviction");
    }
}

#[test]
fn incremental_equals_full_forward() {
    let g = golden("tiny-a/golden-mlx4.safetensors");
    let m = model(store("tiny-a/mlx4"), 64);
    let mut s = m.new_session();
    let full = m.forward(&mut s, &g.tokens, Logits::All).unwrap();
    let mut s = m.new_session();
    let mut inc = Vec::new();
    for &tok in &g.tokens {
        inc.extend(m.forward(&mut s, &[tok], Logits::Last).unwrap());
    }
    let max_diff = full.iter().zip(&inc).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(max_diff <= 1e-5, "incremental vs full forward: max |diff| {max_diff}");
}

#[test]
fn rejects_tokens_outside_the_vocabulary() {
    let m = model(store("tiny-b/mlx4"), 64);
    let mut s = m.new_session();
    let e = m.forward(&mut s, &[1, 512], Logits::Last).unwrap_err().to_string();
    assert!(e.contains("512") && e.contains("vocab"), "{e}");
}
