//! A synthetic store written directly, without the BF16 checkpoint in between.
//!
//! [`write_store`] produces exactly what `prepare` makes of [`super::write_checkpoint`]'s output for
//! the same shape and options (the same values, quantized the same way, at the same offsets; only
//! the manifest's `source` differs), but never writes the BF16 tensors: for the released shape the
//! checkpoint would be about four times the store. Benchmarks use it to build stores of the real
//! width at any depth in seconds.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use anyhow::{Context, Result, bail};
use indicatif::ProgressBar;
use rayon::prelude::*;
use xxhash_rust::xxh3::xxh3_64;

use super::init::{BLOCK, Init, fill_block};
use super::{EOS_TOKEN, Planned, SynthOptions, SynthShape, TOKENIZER_FILES, TOKENIZER_VOCAB, plan};
use crate::arch::{self, Role};
use crate::checkpoint::Layout;
use crate::config::ModelConfig;
use crate::dtype::DType;
use crate::quant::{quantize_matrix, u16s_to_le_bytes, u32s_to_le_bytes};
use crate::store::manifest::*;
use crate::store::pack::{HashingWriter, expert_layouts, experts_tag, record_piece_sums, write_expert_sums};

/// Elements `[a, b)` of a planned tensor as little-endian bytes of its dtype.
fn elements(t: &Planned, seed: u64, a: usize, b: usize) -> Vec<u8> {
    let size = t.dtype.size();
    if let Init::Bytes(bytes) = &t.init {
        return bytes[a * size..b * size].to_vec();
    }
    let tensor_seed = xxh3_64_with_seed(t.key.as_bytes(), seed);
    let numel = t.numel();
    let mut out = Vec::with_capacity((b - a) * size);
    let mut block = vec![0u8; BLOCK * size];
    for blk in a / BLOCK..b.div_ceil(BLOCK) {
        let start = blk * BLOCK;
        let n = BLOCK.min(numel - start);
        fill_block(&t.init, t.dtype, tensor_seed, blk, &mut block[..n * size]);
        let lo = a.max(start) - start;
        let hi = b.min(start + n) - start;
        out.extend_from_slice(&block[lo * size..hi * size]);
    }
    out
}

fn xxh3_64_with_seed(b: &[u8], seed: u64) -> u64 {
    xxhash_rust::xxh3::xxh3_64_with_seed(b, seed)
}

/// Data, scales and biases of `rows x cols` elements (bf16 bytes) in precision `p`.
fn encode(bytes: Vec<u8>, rows: usize, cols: usize, p: Precision) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    match p.affine() {
        None => (bytes, vec![], vec![]),
        Some(fmt) => {
            let bf: Vec<u16> = bytes.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
            let q = quantize_matrix(&bf, rows, cols, fmt);
            (u32s_to_le_bytes(&q.words), u16s_to_le_bytes(&q.scales), u16s_to_le_bytes(&q.biases))
        }
    }
}

/// The precision `prepare` packs a BF16 dense tensor in (`dtype`: the tensor's own, where it is
/// kept as it is).
fn dense_precision(spec: &arch::TensorSpec, dtype: DType) -> Precision {
    let rule = if spec.quantizable() { arch::bf16_pack_rule(spec.role, spec.in_features()) } else { None };
    rule.map_or(Precision::Float { dtype }, Precision::from_affine)
}

/// The precisions of each of `layers` MoE layers' expert matrices (gate, up, down).
fn expert_precisions(c: &crate::config::TextConfig, layers: usize) -> Vec<[Precision; 3]> {
    let shapes = arch::expert_shapes(c);
    let one = shapes.map(|s| {
        arch::bf16_pack_rule(Role::Linear, s[1]).map_or(Precision::Float { dtype: DType::BF16 }, Precision::from_affine)
    });
    vec![one; layers]
}

/// The precision of an n-gram table's rows of `cols` values.
fn ngram_precision(cols: usize) -> Precision {
    arch::bf16_ngram_rule(cols).map_or(Precision::Float { dtype: DType::BF16 }, Precision::from_affine)
}

/// Writes the store of a synthetic model into `dir` (absent or empty). See the module docs.
pub fn write_store(shape: &SynthShape, opts: &SynthOptions, dir: &Path, progress: &ProgressBar) -> Result<Manifest> {
    let config_json = shape.config_json();
    let config = ModelConfig::from_value(&config_json).context("the synthetic shape is not a valid qwen4_exp model")?;
    let c = config.text.clone();
    if c.vocab_size < TOKENIZER_VOCAB {
        bail!("vocab_size {} is smaller than the bundled tokenizer's {TOKENIZER_VOCAB} tokens", c.vocab_size);
    }
    if dir.exists() && std::fs::read_dir(dir)?.next().is_some() {
        bail!("{} is not empty; a synthetic store needs a new or empty directory", dir.display());
    }
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mtp = shape.mtp_layers;
    let planned = plan(&c, mtp, opts);
    let find = |key: &str| planned.iter().find(|t| t.key == key).with_context(|| format!("no planned tensor {key}"));
    let hf = |name: &str| super::hf_key(name);
    let mut files = std::collections::BTreeMap::new();

    // dense.bin, in the packer's order and layout.
    progress.set_message("dense tensors");
    let specs: Vec<_> = arch::dense_specs(&c, mtp).into_iter().filter(|s| !s.optional).collect();
    let mut w = HashingWriter::create(&dir.join("dense.bin"))?;
    let mut tensors = Vec::new();
    for spec in &specs {
        let t = find(&hf(&spec.name))?;
        let precision = dense_precision(spec, t.dtype);
        let (rows, cols) = (spec.shape[..spec.shape.len() - 1].iter().product::<usize>(), *spec.shape.last().unwrap());
        let (d, s, b) = encode(elements(t, opts.seed, 0, rows * cols), rows, cols, precision);
        w.pad_to(DENSE_ALIGN)?;
        let data = Span { offset: w.pos(), len: d.len() as u64 };
        w.write(&d)?;
        let (s_span, b_span) = w.write_scales_biases(precision, &s, &b)?;
        progress.inc((rows * cols * t.dtype.size()) as u64);
        tensors.push(DenseTensor {
            name: spec.name.clone(),
            shape: spec.shape.clone(),
            precision,
            data,
            scales: s_span,
            biases: b_span,
        });
    }
    w.pad_to(DENSE_ALIGN)?;
    files.insert("dense.bin".to_string(), w.finish()?);

    // Expert records.
    progress.set_message("experts");
    let moe = arch::moe_layers(&c, mtp);
    let (layouts, record_bytes) = expert_layouts(&c, &moe, &expert_precisions(&c, moe.len()));
    let tag = experts_tag(&layouts);
    let (ename, sname) = (format!("experts-{tag}.bin"), format!("experts-{tag}.sums"));
    let ef = File::create(dir.join(&ename)).with_context(|| format!("cannot create {ename}"))?;
    let n_records = (moe.len() * c.num_experts) as u64;
    ef.set_len(n_records * record_bytes)?;
    let (inter, h) = (c.moe_intermediate_size, c.hidden_size);
    let mut sums = Vec::with_capacity(n_records as usize);
    let mut psums: Vec<u64> = Vec::new();
    let piece_bytes = PieceSums::piece_bytes_for(record_bytes);
    for (slot, layer) in moe.iter().enumerate() {
        let gu = find(&hf(&format!("{}.mlp.experts.gate_up_proj", layer.prefix)))?;
        let dn = find(&hf(&format!("{}.mlp.experts.down_proj", layer.prefix)))?;
        let layout = &layouts[slot];
        let layer_sums: Vec<(u64, Vec<u64>)> = (0..c.num_experts)
            .into_par_iter()
            .map(|e| -> Result<(u64, Vec<u64>)> {
                let mut rec = vec![0u8; record_bytes as usize];
                let parts = [
                    (&layout.gate_proj, elements(gu, opts.seed, e * 2 * inter * h, (e * 2 + 1) * inter * h)),
                    (&layout.up_proj, elements(gu, opts.seed, (e * 2 + 1) * inter * h, (e * 2 + 2) * inter * h)),
                    (&layout.down_proj, elements(dn, opts.seed, e * h * inter, (e + 1) * h * inter)),
                ];
                for (rm, bytes) in parts {
                    let (d, s, b) = encode(bytes, rm.shape[0], rm.shape[1], rm.precision);
                    rec[rm.data.range()].copy_from_slice(&d);
                    if let (Some(ss), Some(bs)) = (rm.scales, rm.biases) {
                        rec[ss.range()].copy_from_slice(&s);
                        rec[bs.range()].copy_from_slice(&b);
                    }
                }
                ef.write_all_at(&rec, (slot * c.num_experts + e) as u64 * record_bytes)?;
                progress.inc((3 * inter * h * 2) as u64);
                Ok((xxh3_64(&rec), record_piece_sums(&rec, piece_bytes)))
            })
            .collect::<Result<_>>()?;
        for (sum, pieces) in layer_sums {
            sums.push(sum);
            psums.extend(pieces);
        }
    }
    ef.sync_all()?;
    let pname = format!("experts-{tag}.psums");
    write_expert_sums(dir, [&ename, &sname, &pname], record_bytes, &sums, &psums, &mut files)?;

    // ngram.bin: shards in order, rows interleaved as words | scales | biases.
    let mut tables = Vec::new();
    let ple_layers: Vec<usize> = (0..c.num_hidden_layers).filter(|&l| c.ple_index(l).is_some()).collect();
    if !ple_layers.is_empty() {
        progress.set_message("n-gram tables");
        let mut w = HashingWriter::create(&dir.join("ngram.bin"))?;
        let cols = c.ngram_row_dim();
        for &layer in &ple_layers {
            let precision = ngram_precision(cols);
            let row_bytes = precision.row_bytes(cols);
            w.pad_to(DENSE_ALIGN)?;
            let offset = w.pos();
            let mut rows_total = 0u64;
            let prefix = hf(&format!("layers.{layer}.ple.ple_embedding.ngram_embedding.shard_"));
            for t in planned.iter().filter(|t| t.key.starts_with(&prefix)) {
                let rows = t.shape[0];
                let step = ((64 << 20) / row_bytes).max(1);
                let mut a = 0;
                while a < rows {
                    let b = (a + step).min(rows);
                    let n = b - a;
                    let (d, s, bi) = encode(elements(t, opts.seed, a * cols, b * cols), n, cols, precision);
                    let (dl, sl) = (d.len() / n, s.len() / n);
                    let mut buf = Vec::with_capacity(n * row_bytes);
                    for r in 0..n {
                        buf.extend_from_slice(&d[r * dl..(r + 1) * dl]);
                        buf.extend_from_slice(&s[r * sl..(r + 1) * sl]);
                        buf.extend_from_slice(&bi[r * sl..(r + 1) * sl]);
                    }
                    w.write(&buf)?;
                    progress.inc((n * cols * 2) as u64);
                    a = b;
                }
                rows_total += rows as u64;
            }
            tables.push(NgramTable { layer, rows: rows_total, cols, precision, row_bytes: row_bytes as u64, offset });
        }
        w.pad_to(DENSE_ALIGN)?;
        files.insert("ngram.bin".to_string(), w.finish()?);
    }

    // The side files `prepare` would copy from the checkpoint.
    let generation = serde_json::json!({"eos_token_id": [EOS_TOKEN, 0], "do_sample": true, "temperature": 0.7, "top_p": 0.8, "top_k": 20});
    let mut side: Vec<(&str, String)> = vec![
        ("config.json", serde_json::to_string_pretty(&config_json)?),
        ("generation_config.json", serde_json::to_string_pretty(&generation)?),
    ];
    side.extend(TOKENIZER_FILES.iter().map(|(n, t)| (*n, t.to_string())));
    for (name, text) in side {
        std::fs::write(dir.join(name), &text)?;
        files.insert(
            name.to_string(),
            FileSum { bytes: text.len() as u64, xxh3: format!("{:016x}", xxh3_64(text.as_bytes())) },
        );
    }
    let manifest = Manifest {
        format: FORMAT.to_string(),
        format_version: FORMAT_VERSION,
        created_by: format!("cherenkov {}", env!("CARGO_PKG_VERSION")),
        model_type: config.model_type.clone(),
        source: SourceInfo {
            path: format!("synthetic ({})", shape_label(shape)),
            layout: Layout::Hf,
            fingerprint: format!(
                "synthetic-{:016x}",
                xxh3_64(serde_json::to_string(&config_json)?.as_bytes()) ^ opts.seed
            ),
        },
        config: c.clone(),
        mtp_layers: mtp,
        tensors,
        experts: ExpertFile {
            file: ename,
            sums_file: sname,
            piece_sums: Some(PieceSums { file: pname, piece_bytes }),
            record_bytes,
            num_experts: c.num_experts,
            layers: layouts,
        },
        ngram: (!tables.is_empty()).then(|| NgramFile { file: "ngram.bin".to_string(), tables }),
        files,
    };
    std::fs::write(dir.join("manifest.json"), serde_json::to_vec_pretty(&manifest)?)?;
    progress.finish_with_message("written");
    Ok(manifest)
}

/// About how many bytes [`write_store`] writes for this shape, at least as many as it does: the
/// expert file exactly, the dense tensors and n-gram tables row by row with their alignment
/// padding counted in full, the checksum files and the side files (16 MiB covers those). For a
/// free-space check before the store is written.
pub fn store_bytes(shape: &SynthShape, opts: &SynthOptions) -> Result<u64> {
    let config =
        ModelConfig::from_value(&shape.config_json()).context("the synthetic shape is not a valid qwen4_exp model")?;
    let c = config.text;
    let mtp = shape.mtp_layers;
    let mut bytes = 16u64 << 20;
    let planned = plan(&c, mtp, opts);
    // Dense: each tensor's data, scales and biases, each padded to DENSE_ALIGN; a tensor kept as it
    // is in its planned dtype (f32, the widest, where none is planned).
    for spec in arch::dense_specs(&c, mtp).into_iter().filter(|s| !s.optional) {
        let key = super::hf_key(&spec.name);
        let dtype = planned.iter().find(|t| t.key == key).map_or(DType::F32, |t| t.dtype);
        let precision = dense_precision(&spec, dtype);
        let (rows, cols) = (spec.shape[..spec.shape.len() - 1].iter().product::<usize>(), *spec.shape.last().unwrap());
        bytes += (rows * precision.row_bytes(cols)) as u64 + 3 * DENSE_ALIGN;
    }
    // Experts: the records, one sum each and their pieces' sums.
    let moe = arch::moe_layers(&c, mtp);
    let (_, record_bytes) = expert_layouts(&c, &moe, &expert_precisions(&c, moe.len()));
    let records = (moe.len() * c.num_experts) as u64;
    let pieces = record_bytes.div_ceil(PieceSums::piece_bytes_for(record_bytes));
    bytes += records * (record_bytes + 8 + 8 * pieces);
    // N-gram tables: every PLE layer's rows, padded.
    let cols = c.ngram_row_dim();
    for layer in (0..c.num_hidden_layers).filter(|&l| c.ple_index(l).is_some()) {
        let precision = ngram_precision(cols);
        let prefix = super::hf_key(&format!("layers.{layer}.ple.ple_embedding.ngram_embedding.shard_"));
        let rows: usize = planned.iter().filter(|t| t.key.starts_with(&prefix)).map(|t| t.shape[0]).sum();
        bytes += (rows * precision.row_bytes(cols)) as u64 + DENSE_ALIGN;
    }
    Ok(bytes)
}

fn shape_label(s: &SynthShape) -> String {
    format!(
        "hidden {}, {} layers, {} experts top-{}",
        s.hidden_size, s.num_hidden_layers, s.num_experts, s.num_experts_per_tok
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::Checkpoint;
    use crate::store::{Store, pack::pack};

    #[test]
    fn equals_packing_the_synthetic_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let shape = SynthShape::tiny();
        let opts = SynthOptions { seed: 9, ..SynthOptions::default() };
        super::super::write_checkpoint(&shape, &opts, &dir.path().join("ck"), &ProgressBar::hidden()).unwrap();
        let ck = Checkpoint::open(&dir.path().join("ck")).unwrap();
        let packed = pack(&ck, &dir.path().join("packed"), &ProgressBar::hidden()).unwrap();
        let direct = write_store(&shape, &opts, &dir.path().join("direct"), &ProgressBar::hidden()).unwrap();
        assert_eq!(packed.tensors, direct.tensors);
        assert_eq!(packed.experts, direct.experts);
        assert_eq!(packed.ngram, direct.ngram);
        assert_eq!(packed.config, direct.config);
        assert_eq!(packed.files, direct.files, "file sizes or checksums differ");
        let s = Store::open(&dir.path().join("direct")).unwrap();
        assert!(s.verify(&ProgressBar::hidden()).unwrap().is_empty());
        // The estimate for a free-space check covers what was written, and not by much more than
        // its padding allowance and 16 MiB for the side files.
        let written: u64 =
            std::fs::read_dir(dir.path().join("direct")).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum();
        let estimate = store_bytes(&shape, &opts).unwrap();
        let padding = (direct.tensors.len() as u64 * 3 + 4) * DENSE_ALIGN + (16 << 20);
        assert!(estimate >= written && estimate <= written + padding, "estimate {estimate}, written {written}");
    }
}
