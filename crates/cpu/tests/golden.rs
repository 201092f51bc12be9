//! Golden tests: the CPU forward reproduces transformers' logits (computed on the dequantized 4-bit
//! weights by tools/fixtures/make_golden.py) for the BF16 checkpoints packed by Cherenkov and for
//! their MLX twins, over a full forward, incremental decode, and with an expert cache smaller than
//! the model's experts; the MTP head reproduces its reference (tools/fixtures/make_mtp_golden.py:
//! transformers' layers glued as vLLM's head), and a verifying forward committed to fewer rows
//! leaves the session as plain forwards would.

mod common;

use cherenkov_cpu::Logits;
use cherenkov_model::safetensors::SafeTensors;
use common::{fixtures, model, store};

struct Golden {
    tokens: Vec<u32>,
    logits: Vec<f32>,
    vocab: usize,
}

fn golden(file: &str) -> Golden {
    golden_named(file, "logits")
}

/// `tokens` and the logits tensor `name` of a golden file.
fn golden_named(file: &str, name: &str) -> Golden {
    let st = SafeTensors::open(&fixtures().join(file)).unwrap();
    let t = st.get("tokens").unwrap();
    let tokens =
        st.read(t).unwrap().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32).collect();
    let l = st.get(name).unwrap();
    let vocab = l.shape[1];
    let logits = st.read(l).unwrap().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
    Golden { tokens, logits, vocab }
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

/// The MTP head's reference logits (tools/fixtures/make_mtp_golden.py): row p pairs the trunk's
/// position p with token p + 1.
fn mtp_golden() -> (Vec<u32>, Vec<f32>, usize) {
    let g = golden_named("tiny-a/golden-mtp-mlx4.safetensors", "mtp_logits");
    (g.tokens, g.logits, g.vocab)
}

#[test]
fn tiny_a_mtp_head_matches_the_reference() {
    let (tokens, want, vocab) = mtp_golden();
    for variant in ["tiny-a/hf", "tiny-a/mlx4"] {
        let m = model(store(variant), 64);
        // One token at a time: each draft is the head's row for the token before it.
        let mut s = m.new_session();
        m.enable_drafting(&mut s).unwrap();
        let mut got = Vec::new();
        for p in 0..tokens.len() - 1 {
            m.forward(&mut s, &tokens[p..p + 1], Logits::Last).unwrap();
            got.extend(m.draft(&mut s, tokens[p + 1]).unwrap());
        }
        check_rows(&format!("{variant} MTP head, token by token"), &got, &want, vocab);
        // A prefill first: the head catches up on the prompt's rows, then drafts from its last.
        let split = tokens.len() / 3;
        let mut s = m.new_session();
        m.enable_drafting(&mut s).unwrap();
        m.forward(&mut s, &tokens[..split], Logits::Last).unwrap();
        let mut got = m.draft(&mut s, tokens[split]).unwrap();
        for p in split..tokens.len() - 1 {
            m.forward(&mut s, &tokens[p..p + 1], Logits::Last).unwrap();
            got.extend(m.draft(&mut s, tokens[p + 1]).unwrap());
        }
        check_rows(&format!("{variant} MTP head after a prefill"), &got, &want[(split - 1) * vocab..], vocab);
    }
}

/// A verifying forward of k tokens committed to `keep` leaves the session as a plain forward of
/// the first `keep` tokens: the logits of the rows and of the next forward, and the next draft.
#[test]
fn verify_then_commit_equals_plain_forwards() {
    let g = golden("tiny-a/golden-mlx4.safetensors");
    let m = model(store("tiny-a/mlx4"), 64);
    let prefix = &g.tokens[..20];
    let rows = &g.tokens[20..23];
    let after = g.tokens[23];
    let max_diff = |a: &[f32], b: &[f32]| a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    for keep in 1..=rows.len() {
        let mut plain = m.new_session();
        m.enable_drafting(&mut plain).unwrap();
        m.forward(&mut plain, prefix, Logits::Last).unwrap();
        let plain_rows = m.forward(&mut plain, &rows[..keep], Logits::All).unwrap();
        let plain_next = m.forward(&mut plain, &[after], Logits::Last).unwrap();
        let plain_draft = m.draft(&mut plain, g.tokens[24]).unwrap();

        let mut s = m.new_session();
        m.enable_drafting(&mut s).unwrap();
        m.forward(&mut s, prefix, Logits::Last).unwrap();
        let verified = m.verify(&mut s, rows).unwrap();
        assert!(max_diff(&verified[..keep * g.vocab], &plain_rows) <= 1e-5, "keep {keep}: verified rows");
        let e = m.forward(&mut s, &[after], Logits::Last).unwrap_err().to_string();
        assert!(e.contains("not committed"), "{e}");
        m.commit(&mut s, keep).unwrap();
        assert_eq!(s.pos, plain.pos - 1);
        let next = m.forward(&mut s, &[after], Logits::Last).unwrap();
        assert_eq!(s.pos, plain.pos);
        assert_eq!(s.ngram_context, plain.ngram_context);
        assert!(max_diff(&next, &plain_next) <= 1e-5, "keep {keep}: the forward after the commit");
        let draft = m.draft(&mut s, g.tokens[24]).unwrap();
        assert!(max_diff(&draft, &plain_draft) <= 1e-5, "keep {keep}: the draft after the commit");
    }
}

#[test]
fn drafting_errors_name_what_is_wrong() {
    let m = model(store("tiny-a/mlx4"), 64);
    let mut s = m.new_session();
    let e = m.draft(&mut s, 5).unwrap_err().to_string();
    assert!(e.contains("drafting is off"), "{e}");
    m.enable_drafting(&mut s).unwrap();
    let e = m.draft(&mut s, 5).unwrap_err().to_string();
    assert!(e.contains("no forward"), "{e}");
    let e = m.commit(&mut s, 1).unwrap_err().to_string();
    assert!(e.contains("no verifying forward"), "{e}");
    m.forward(&mut s, &[1, 2, 3], Logits::Last).unwrap();
    m.verify(&mut s, &[4, 5]).unwrap();
    let e = m.commit(&mut s, 3).unwrap_err().to_string();
    assert!(e.contains("1 to 2 rows"), "{e}");
    let e = m.draft(&mut s, 5).unwrap_err().to_string();
    assert!(e.contains("not committed"), "{e}");
    m.commit(&mut s, 2).unwrap();
    let e = m.enable_drafting(&mut s).unwrap_err().to_string();
    assert!(e.contains("start with the sequence") && e.contains("5 tokens"), "{e}");
    let b = model(store("tiny-b/mlx4"), 64);
    let e = b.enable_drafting(&mut b.new_session()).unwrap_err().to_string();
    assert!(e.contains("no MTP head"), "{e}");
}
