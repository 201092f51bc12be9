//! Packing the golden fixtures: MLX sources are preserved bit for bit, and a BF16 checkpoint packs to
//! exactly the bytes of its MLX twin (the packer quantizes as `mx.quantize` does).

use std::path::{Path, PathBuf};

use cherenkov_model::checkpoint::{Checkpoint, Layout};
use cherenkov_model::safetensors::SafeTensors;
use cherenkov_model::store::{Precision, Store, pack::pack};
use indicatif::ProgressBar;

fn golden(p: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/golden").join(p)
}

fn packed(src: &Path, out: &Path) -> Store {
    let ck = Checkpoint::open(src).unwrap_or_else(|e| panic!("{}: {e:#}", src.display()));
    pack(&ck, out, &ProgressBar::hidden()).unwrap();
    Store::open(out).unwrap()
}

fn same_binaries(a: &Store, b: &Store) {
    let (ma, mb) = (&a.manifest, &b.manifest);
    assert_eq!(ma.tensors, mb.tensors, "tensor tables differ");
    assert_eq!(ma.experts, mb.experts, "expert layouts differ");
    assert_eq!(ma.ngram, mb.ngram, "n-gram tables differ");
    let psums = &ma.experts.piece_sums.as_ref().expect("packed with piece sums").file;
    for f in ["dense.bin", &ma.experts.file, &ma.experts.sums_file, psums, "ngram.bin"] {
        let x = std::fs::read(a.dir.join(f)).unwrap();
        let y = std::fs::read(b.dir.join(f)).unwrap();
        assert!(x == y, "{f} differs between {} and {}", a.dir.display(), b.dir.display());
        assert_eq!(ma.files[f], mb.files[f]);
    }
}

/// Every MLX tensor's words, scales and biases (or float data) appear unchanged in the store.
fn preserves_mlx_bytes(src: &Path, store: &Store) {
    let st = SafeTensors::open(&src.join("model.safetensors")).unwrap();
    let raw = |k: &str| st.read(st.get(k).unwrap_or_else(|| panic!("source lacks {k}"))).unwrap();
    let m = &store.manifest;
    let mut checked = 0;
    for t in &m.tensors {
        let base = if t.name.starts_with("mtp.") {
            format!("language_model.{}", t.name)
        } else if t.name == "lm_head.weight" {
            "language_model.lm_head.weight".to_string()
        } else {
            format!("language_model.model.{}", t.name)
        };
        let v = store.tensor(&t.name).unwrap();
        assert_eq!(v.data, raw(&base).as_slice(), "{}: data differs from the source", t.name);
        if let Precision::Affine { .. } = t.precision {
            let stem = base.strip_suffix(".weight").unwrap();
            assert_eq!(v.scales.unwrap(), raw(&format!("{stem}.scales")).as_slice(), "{}: scales", t.name);
            assert_eq!(v.biases.unwrap(), raw(&format!("{stem}.biases")).as_slice(), "{}: biases", t.name);
        }
        checked += 1;
    }
    assert!(checked > 30);
    // Expert records: each matrix slice of the stacked switch_mlp tensors.
    let ef = &m.experts;
    let mut rec = vec![0u8; ef.record_bytes as usize];
    for (slot, layout) in ef.layers.iter().enumerate() {
        let prefix = if layout.layer.starts_with("mtp.") {
            format!("language_model.{}", layout.layer)
        } else {
            format!("language_model.model.{}", layout.layer)
        };
        for e in 0..ef.num_experts {
            store.read_expert(slot, e, &mut rec).unwrap();
            for (which, rm) in layout.matrices().into_iter().enumerate() {
                let name = ["gate_proj", "up_proj", "down_proj"][which];
                let stem = format!("{prefix}.mlp.switch_mlp.{name}");
                let parts: Vec<(&str, _)> =
                    vec![("weight", Some(rm.data)), ("scales", rm.scales), ("biases", rm.biases)];
                for (part, span) in parts {
                    let Some(span) = span else { continue };
                    let all = raw(&format!("{stem}.{part}"));
                    let per = all.len() / ef.num_experts;
                    assert_eq!(&rec[span.range()], &all[e * per..(e + 1) * per], "{stem}.{part} expert {e}");
                }
            }
        }
    }
    // n-gram rows: row r of the table = words | scales | biases of the shards' row r.
    if let Some(ng) = &m.ngram {
        for t in &ng.tables {
            let stem = format!("language_model.model.layers.{}.ple.ple_embedding.ngram_embedding.shards", t.layer);
            let mut row = vec![0u8; t.row_bytes as usize];
            let mut r = 0u64;
            for i in 0.. {
                let Some(w) = st.get(&format!("{stem}.{i}.weight")) else { break };
                let (wb, sb, bb) = (
                    raw(&format!("{stem}.{i}.weight")),
                    raw(&format!("{stem}.{i}.scales")),
                    raw(&format!("{stem}.{i}.biases")),
                );
                let n = w.shape[0];
                let (wl, sl) = (wb.len() / n, sb.len() / n);
                for k in 0..n {
                    store.read_ngram_row(t, r, &mut row).unwrap();
                    assert_eq!(&row[..wl], &wb[k * wl..(k + 1) * wl]);
                    assert_eq!(&row[wl..wl + sl], &sb[k * sl..(k + 1) * sl]);
                    assert_eq!(&row[wl + sl..], &bb[k * sl..(k + 1) * sl]);
                    r += 1;
                }
            }
            assert_eq!(r, t.rows);
        }
    }
}

#[test]
fn tiny_a_bf16_and_mlx_twin_pack_identically() {
    let dir = tempfile::tempdir().unwrap();
    let hf = packed(&golden("tiny-a/hf"), &dir.path().join("hf"));
    let mlx = packed(&golden("tiny-a/mlx4"), &dir.path().join("mlx"));
    assert_eq!(hf.manifest.source.layout, Layout::Hf);
    assert_eq!(mlx.manifest.source.layout, Layout::Mlx);
    assert_eq!(hf.manifest.mtp_layers, 1);
    assert_eq!(hf.manifest.experts.file, "experts-q4.bin");
    assert_eq!(hf.manifest.experts.record_bytes % 4096, 0);
    // Routers are 8-bit, narrow linears stay bf16, A_log stays f32.
    let prec = |n: &str| hf.manifest.tensor(n).unwrap().precision;
    assert_eq!(prec("layers.0.mlp.gate.weight"), Precision::Affine { bits: 8, group_size: 64 });
    assert_eq!(prec("layers.0.mlp.shared_expert_gate.weight"), Precision::Affine { bits: 8, group_size: 64 });
    assert_eq!(
        prec("layers.0.attn_hyper_connection.input_mix_weight_up.weight"),
        Precision::Float { dtype: cherenkov_model::DType::BF16 }
    );
    assert_eq!(
        prec("layers.0.mlp.shared_expert.down_proj.weight"),
        Precision::Float { dtype: cherenkov_model::DType::BF16 }
    );
    assert_eq!(prec("layers.0.linear_attn.A_log"), Precision::Float { dtype: cherenkov_model::DType::F32 });
    assert_eq!(prec("embed_tokens.weight"), Precision::Affine { bits: 4, group_size: 64 });
    assert_eq!(hf.manifest.ngram.as_ref().unwrap().tables[0].precision, Precision::Affine { bits: 4, group_size: 32 });
    same_binaries(&hf, &mlx);
    preserves_mlx_bytes(&golden("tiny-a/mlx4"), &mlx);
    for s in [&hf, &mlx] {
        assert!(s.verify(&ProgressBar::hidden()).unwrap().is_empty());
    }
}

#[test]
fn tiny_b_twins_and_mixed_bits() {
    let dir = tempfile::tempdir().unwrap();
    let hf = packed(&golden("tiny-b/hf"), &dir.path().join("hf"));
    let mlx = packed(&golden("tiny-b/mlx4"), &dir.path().join("mlx"));
    same_binaries(&hf, &mlx);
    let mixed = packed(&golden("tiny-b/mlx-mixed"), &dir.path().join("mixed"));
    preserves_mlx_bytes(&golden("tiny-b/mlx-mixed"), &mixed);
    let m = &mixed.manifest;
    assert_eq!(m.experts.file, "experts-mixed.bin");
    assert_eq!(m.experts.layers[0].down_proj.precision, Precision::Affine { bits: 3, group_size: 32 });
    assert_eq!(m.experts.layers[0].gate_proj.precision, Precision::Affine { bits: 4, group_size: 32 });
    let prec = |n: &str| m.tensor(n).unwrap().precision;
    assert_eq!(prec("lm_head.weight"), Precision::Affine { bits: 6, group_size: 64 });
    assert_eq!(prec("embed_tokens.weight"), Precision::Affine { bits: 5, group_size: 32 });
    assert_eq!(prec("layers.0.mlp.shared_expert.up_proj.weight"), Precision::Affine { bits: 2, group_size: 32 });
    assert_eq!(prec("layers.0.mlp.gate.weight"), Precision::Affine { bits: 8, group_size: 64 });
}

/// Piece checksums: every piece reads back and checks; a flipped byte fails its piece (named) and
/// the whole record, not the other pieces; a store whose manifest predates piece sums still opens
/// and checks whole records.
#[test]
fn piece_checksums_catch_a_flipped_byte_and_old_manifests_still_open() {
    let tmp = tempfile::tempdir().unwrap();
    let store = packed(&golden("tiny-a/mlx4"), &tmp.path().join("s"));
    let ef = &store.manifest.experts;
    let piece = store.expert_piece_bytes().expect("piece sums");
    let rb = ef.record_bytes as usize;
    let pieces = rb.div_ceil(piece);
    assert!(pieces >= 2, "records of {rb} bytes in pieces of {piece}");
    let (layer, expert) = (1, 2);
    let mut whole = vec![0u8; rb];
    store.read_expert(layer, expert, &mut whole).unwrap();
    // Just read, so in the page cache: no advice; outside the store: none either.
    assert!(!store.advise_expert(layer, expert));
    assert!(!store.advise_expert(ef.layers.len(), 0));
    for i in 0..pieces {
        let mut buf = vec![0u8; piece.min(rb - i * piece)];
        store.read_expert_piece(layer, expert, i, &mut buf).unwrap();
        assert_eq!(buf, whole[i * piece..i * piece + buf.len()]);
        // Through a bounce buffer smaller than the piece, dividing it or not: the same bytes.
        for bounce_len in [4096, 3000, piece + 1] {
            let mut bounce = vec![0u8; bounce_len];
            let mut got = vec![0u8; buf.len()];
            store
                .read_expert_piece_chunked(layer, expert, i, &mut bounce, &mut |at, b| {
                    got[at..at + b.len()].copy_from_slice(b)
                })
                .unwrap();
            assert_eq!(got, buf, "piece {i} through a bounce of {bounce_len}");
        }
    }

    // Flip one byte in the last piece of record (layer, expert).
    let dir = tmp.path().join("s");
    let path = dir.join(&ef.file);
    let mut bytes = std::fs::read(&path).unwrap();
    let at = ef.record_index(layer, expert) as usize * rb + (pieces - 1) * piece + 5;
    bytes[at] ^= 0x5a;
    std::fs::write(&path, bytes).unwrap();
    let bad = Store::open(&dir).unwrap();
    let mut buf = vec![0u8; piece.min(rb - (pieces - 1) * piece)];
    let e = format!("{:#}", bad.read_expert_piece(layer, expert, pieces - 1, &mut buf).unwrap_err());
    assert!(e.contains("corrupted expert record") && e.contains(&format!("piece {}", pieces - 1)), "{e}");
    let mut bounce = vec![0u8; 4096];
    let e = format!(
        "{:#}",
        bad.read_expert_piece_chunked(layer, expert, pieces - 1, &mut bounce, &mut |_, _| ()).unwrap_err()
    );
    assert!(e.contains("corrupted expert record") && e.contains(&format!("piece {}", pieces - 1)), "{e}");
    let mut first = vec![0u8; piece];
    bad.read_expert_piece(layer, expert, 0, &mut first).unwrap();
    bad.read_expert_piece_chunked(layer, expert, 0, &mut bounce, &mut |_, _| ()).unwrap();
    assert!(bad.read_expert(layer, expert, &mut whole).is_err());

    // A manifest written before piece sums existed.
    let mpath = dir.join("manifest.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&mpath).unwrap()).unwrap();
    m["experts"].as_object_mut().unwrap().remove("piece_sums").expect("the field is written");
    std::fs::write(&mpath, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
    let old = Store::open(&dir).unwrap();
    assert_eq!(old.expert_piece_bytes(), None);
    assert!(old.read_expert_piece(0, 0, 0, &mut first).is_err());
    assert!(old.read_expert_piece_chunked(0, 0, 0, &mut bounce, &mut |_, _| ()).is_err());
    old.read_expert(0, 0, &mut whole).unwrap();
}
