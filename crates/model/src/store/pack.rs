//! Packing a checkpoint into a store directory.
//!
//! Streams tensor by tensor (rows in bounded chunks, experts one record at a time per thread), so
//! memory stays far below the checkpoint's size: nothing is mapped, every source byte is read with
//! a positioned read into a buffer that is dropped once written. Floating sources are rounded to
//! bf16 and quantized exactly as `mx.quantize` would (see [`crate::arch::bf16_pack_rule`]); MLX
//! sources are copied word for word. The caller chooses the directory (a temporary one that it
//! renames into place when this returns `Ok`).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;

use anyhow::{Context, Result, bail};
use indicatif::ProgressBar;
use rayon::prelude::*;
use xxhash_rust::xxh3::{Xxh3, xxh3_64};

use super::manifest::*;
use crate::arch::{self, Role};
use crate::checkpoint::{Checkpoint, Matrix, RowData};
use crate::dtype::to_bf16_vec;
use crate::quant::{Affine, quantize_matrix, u16s_to_le_bytes, u32s_to_le_bytes};

/// Files copied from the checkpoint when present.
pub const SIDE_FILES: [&str; 9] = [
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
];

/// Rows per read when streaming a dense tensor (bounded to ~64 MiB of source).
fn chunk_rows(row_bytes: usize) -> usize {
    ((64 << 20) / row_bytes.max(1)).max(1)
}

pub(crate) fn align(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

/// A sequential writer that hashes what it writes and can pad to an alignment.
pub(crate) struct HashingWriter {
    out: BufWriter<File>,
    hash: Xxh3,
    pos: u64,
    name: String,
}

impl HashingWriter {
    pub(crate) fn create(path: &Path) -> Result<HashingWriter> {
        let f = File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
        Ok(HashingWriter {
            out: BufWriter::with_capacity(8 << 20, f),
            hash: Xxh3::new(),
            pos: 0,
            name: path.display().to_string(),
        })
    }
    pub(crate) fn write(&mut self, b: &[u8]) -> Result<()> {
        self.out.write_all(b).with_context(|| format!("write to {} failed", self.name))?;
        self.hash.update(b);
        self.pos += b.len() as u64;
        Ok(())
    }
    pub(crate) fn pos(&self) -> u64 {
        self.pos
    }
    pub(crate) fn pad_to(&mut self, a: u64) -> Result<()> {
        let target = align(self.pos, a);
        let zeros = vec![0u8; (target - self.pos) as usize];
        self.write(&zeros)
    }
    /// After a dense tensor's data: its scales and biases, each 4 KiB aligned (affine only).
    pub(crate) fn write_scales_biases(
        &mut self,
        p: Precision,
        scales: &[u8],
        biases: &[u8],
    ) -> Result<(Option<Span>, Option<Span>)> {
        if p.affine().is_none() {
            return Ok((None, None));
        }
        self.pad_to(DENSE_ALIGN)?;
        let s = Span { offset: self.pos, len: scales.len() as u64 };
        self.write(scales)?;
        self.pad_to(DENSE_ALIGN)?;
        let b = Span { offset: self.pos, len: biases.len() as u64 };
        self.write(biases)?;
        Ok((Some(s), Some(b)))
    }

    pub(crate) fn finish(mut self) -> Result<FileSum> {
        self.out.flush().with_context(|| format!("write to {} failed", self.name))?;
        let f = self.out.into_inner().map_err(|e| anyhow::anyhow!("write failed: {e}"))?;
        f.sync_all().with_context(|| format!("fsync of {} failed", self.name))?;
        Ok(FileSum { bytes: self.pos, xxh3: format!("{:016x}", self.hash.digest()) })
    }
}

/// The store precision of a matrix: MLX sources keep theirs; floating sources follow the rule.
fn target_precision(m: &Matrix, rule: Option<Affine>) -> Precision {
    match (m.affine(), &m.enc) {
        (Some(fmt), _) => Precision::from_affine(fmt),
        (None, crate::checkpoint::Encoding::Float { dtype, .. }) => match rule {
            Some(fmt) => Precision::from_affine(fmt),
            None => Precision::Float { dtype: *dtype },
        },
        (None, _) => unreachable!(),
    }
}

/// Converts rows to the target precision: (data, scales, biases) bytes.
fn convert_rows(
    rows: RowData,
    n: usize,
    cols: usize,
    target: Precision,
    name: &str,
) -> Result<(Vec<u8>, Vec<u8>, Vec<u8>)> {
    Ok(match (rows, target) {
        (RowData::Float { dtype, data }, Precision::Float { dtype: t }) => {
            debug_assert_eq!(dtype, t);
            (data, vec![], vec![])
        }
        (RowData::Float { dtype, data }, Precision::Affine { bits, group_size }) => {
            let bf = to_bf16_vec(dtype, &data)?;
            let q = quantize_matrix(&bf, n, cols, Affine::new(bits, group_size));
            (u32s_to_le_bytes(&q.words), u16s_to_le_bytes(&q.scales), u16s_to_le_bytes(&q.biases))
        }
        (RowData::Affine { words, scales, biases, .. }, Precision::Affine { .. }) => (words, scales, biases),
        (RowData::Affine { .. }, Precision::Float { .. }) => bail!("{name}: cannot store an affine source as floats"),
    })
}

/// The record layout of every MoE layer (gate | up | down, each as data | scales | biases at
/// 256-byte aligned offsets) for the given precisions, and the record size (the largest layer's,
/// rounded up to 4 KiB).
pub fn expert_layouts(
    c: &crate::config::TextConfig,
    moe_layers: &[arch::MoeLayer],
    precisions: &[[Precision; 3]],
) -> (Vec<ExpertLayout>, u64) {
    let mut layouts = Vec::new();
    for (layer, prec) in moe_layers.iter().zip(precisions) {
        let mut mats = Vec::new();
        let mut off = 0u64;
        for (which, shape) in arch::expert_shapes(c).iter().enumerate() {
            let prec = prec[which];
            let (rows, cols) = (shape[0], shape[1]);
            let (data_len, side_len) = match prec.affine() {
                Some(f) => ((rows * f.words_per_row(cols) * 4) as u64, (rows * f.groups_per_row(cols) * 2) as u64),
                None => ((rows * prec.row_bytes(cols)) as u64, 0),
            };
            let data = Span { offset: off, len: data_len };
            off = align(off + data_len, PART_ALIGN);
            let (scales, biases) = if side_len > 0 {
                let s = Span { offset: off, len: side_len };
                off = align(off + side_len, PART_ALIGN);
                let b = Span { offset: off, len: side_len };
                off = align(off + side_len, PART_ALIGN);
                (Some(s), Some(b))
            } else {
                (None, None)
            };
            mats.push(RecordMatrix { shape: *shape, precision: prec, data, scales, biases });
        }
        let [gate_proj, up_proj, down_proj]: [RecordMatrix; 3] = mats.try_into().unwrap();
        layouts.push(ExpertLayout { layer: layer.prefix.clone(), gate_proj, up_proj, down_proj });
    }
    let record_bytes = align(layouts.iter().map(|l| l.used_bytes()).max().unwrap_or(0).max(1), RECORD_ALIGN);
    (layouts, record_bytes)
}

/// `q4` when every expert matrix is 4-bit (likewise other widths), else `mixed`: names the file.
pub fn experts_tag(layouts: &[ExpertLayout]) -> String {
    let bits: Vec<Option<u32>> =
        layouts.iter().flat_map(|l| l.matrices().map(|m| m.precision.affine().map(|a| a.bits))).collect();
    match bits.first() {
        Some(Some(b)) if bits.iter().all(|x| *x == Some(*b)) => format!("q{b}"),
        _ => "mixed".to_string(),
    }
}

/// Packs `ck` into `out` (which must not exist or be empty). Returns the manifest written.
pub fn pack(ck: &Checkpoint, out: &Path, progress: &ProgressBar) -> Result<Manifest> {
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let c = ck.text().clone();

    // ---- plan --------------------------------------------------------------------------------
    let mut dense = Vec::new();
    for spec in arch::dense_specs(&c, ck.mtp_layers) {
        if let Some(m) = ck.dense(&spec)? {
            let rule = if spec.quantizable() { arch::bf16_pack_rule(spec.role, spec.in_features()) } else { None };
            let prec = target_precision(&m, rule);
            dense.push((spec, m, prec));
        }
    }
    let moe_layers = arch::moe_layers(&c, ck.mtp_layers);
    let mut precisions = Vec::new();
    for layer in &moe_layers {
        let mut p = [Precision::Float { dtype: crate::DType::BF16 }; 3];
        for (which, shape) in arch::expert_shapes(&c).iter().enumerate() {
            let m = ck.expert(layer, 0, which)?;
            p[which] = target_precision(&m, arch::bf16_pack_rule(Role::Linear, shape[1]));
        }
        precisions.push(p);
    }
    let (layouts, record_bytes) = expert_layouts(&c, &moe_layers, &precisions);
    let tag = experts_tag(&layouts);

    let mut ngram_plan = Vec::new();
    for layer in 0..c.num_hidden_layers {
        if c.ple_index(layer).is_none() {
            continue;
        }
        let shards = ck.ngram_shards(layer)?;
        let cols = c.ngram_row_dim();
        let prec = target_precision(&shards[0], arch::bf16_ngram_rule(cols));
        ngram_plan.push((layer, shards, prec));
    }

    let total: u64 = dense.iter().map(|(_, m, _)| m.source_bytes()).sum::<u64>()
        + (0..moe_layers.len())
            .map(|s| -> Result<u64> {
                (0..3).map(|w| Ok(ck.expert(&moe_layers[s], 0, w)?.source_bytes() * c.num_experts as u64)).sum()
            })
            .sum::<Result<u64>>()?
        + ngram_plan.iter().flat_map(|(_, s, _)| s.iter().map(|m| m.source_bytes())).sum::<u64>();
    progress.set_length(total);

    let mut files = BTreeMap::new();

    // ---- dense.bin ---------------------------------------------------------------------------
    progress.set_message("dense tensors");
    let mut w = HashingWriter::create(&out.join("dense.bin"))?;
    let mut tensors = Vec::new();
    for (spec, m, prec) in &dense {
        let (rows, cols) = (m.rows, m.cols);
        let step = chunk_rows(m.source_bytes() as usize / rows.max(1));
        w.pad_to(DENSE_ALIGN)?;
        let data_off = w.pos;
        let mut scales = Vec::new();
        let mut biases = Vec::new();
        let mut a = 0;
        while a < rows {
            let b = (a + step).min(rows);
            let (d, s, bi) = convert_rows(ck.read_rows(m, a, b)?, b - a, cols, *prec, &spec.name)?;
            w.write(&d)?;
            scales.extend_from_slice(&s);
            biases.extend_from_slice(&bi);
            progress.inc(m.source_bytes() * (b - a) as u64 / rows as u64);
            a = b;
        }
        let data = Span { offset: data_off, len: w.pos - data_off };
        let (s_span, b_span) = w.write_scales_biases(*prec, &scales, &biases)?;
        tensors.push(DenseTensor {
            name: spec.name.clone(),
            shape: spec.shape.clone(),
            precision: *prec,
            data,
            scales: s_span,
            biases: b_span,
        });
    }
    w.pad_to(DENSE_ALIGN)?;
    files.insert("dense.bin".to_string(), w.finish()?);

    // ---- experts -----------------------------------------------------------------------------
    progress.set_message("experts");
    let experts_name = format!("experts-{tag}.bin");
    let sums_name = format!("experts-{tag}.sums");
    let psums_name = format!("experts-{tag}.psums");
    let piece_bytes = PieceSums::piece_bytes_for(record_bytes);
    let ef = File::create(out.join(&experts_name)).with_context(|| format!("cannot create {experts_name}"))?;
    let n_records = (moe_layers.len() * c.num_experts) as u64;
    ef.set_len(n_records * record_bytes).with_context(|| format!("cannot size {experts_name}"))?;
    let mut sums = vec![0u64; n_records as usize];
    let mut psums = Vec::new();
    for (slot, layer) in moe_layers.iter().enumerate() {
        let layout = &layouts[slot];
        let layer_sums: Vec<(u64, Vec<u64>)> = (0..c.num_experts)
            .into_par_iter()
            .map(|e| -> Result<(u64, Vec<u64>)> {
                let mut rec = vec![0u8; record_bytes as usize];
                for (which, rm) in layout.matrices().into_iter().enumerate() {
                    let m = ck.expert(layer, e, which)?;
                    let name = format!("{}.mlp.experts.{e}.{}", layer.prefix, arch::EXPERT_MATRICES[which]);
                    let (d, s, b) = convert_rows(ck.read_rows(&m, 0, m.rows)?, m.rows, m.cols, rm.precision, &name)?;
                    rec[rm.data.range()].copy_from_slice(&d);
                    if let (Some(ss), Some(bs)) = (rm.scales, rm.biases) {
                        rec[ss.range()].copy_from_slice(&s);
                        rec[bs.range()].copy_from_slice(&b);
                    }
                    progress.inc(m.source_bytes());
                }
                let idx = (slot * c.num_experts + e) as u64;
                ef.write_all_at(&rec, idx * record_bytes).with_context(|| format!("write to {experts_name} failed"))?;
                Ok((xxh3_64(&rec), record_piece_sums(&rec, piece_bytes)))
            })
            .collect::<Result<_>>()?;
        for (e, (sum, pieces)) in layer_sums.into_iter().enumerate() {
            sums[slot * c.num_experts + e] = sum;
            psums.extend(pieces);
        }
    }
    ef.sync_all().with_context(|| format!("fsync of {experts_name} failed"))?;
    write_expert_sums(out, [&experts_name, &sums_name, &psums_name], record_bytes, &sums, &psums, &mut files)?;

    // ---- ngram.bin ---------------------------------------------------------------------------
    let ngram = if ngram_plan.is_empty() {
        None
    } else {
        progress.set_message("n-gram tables");
        let mut w = HashingWriter::create(&out.join("ngram.bin"))?;
        let mut tables = Vec::new();
        for (layer, shards, prec) in &ngram_plan {
            let cols = c.ngram_row_dim();
            w.pad_to(DENSE_ALIGN)?;
            let offset = w.pos;
            let row_bytes = prec.row_bytes(cols);
            let mut rows_total = 0u64;
            for m in shards {
                let step = chunk_rows(row_bytes);
                let mut a = 0;
                while a < m.rows {
                    let b = (a + step).min(m.rows);
                    let n = b - a;
                    let (d, s, bi) = convert_rows(ck.read_rows(m, a, b)?, n, cols, *prec, &m.name)?;
                    // Interleave per row: words | scales | biases.
                    let (dl, sl) = (d.len() / n, s.len() / n);
                    let mut buf = Vec::with_capacity(n * row_bytes);
                    for r in 0..n {
                        buf.extend_from_slice(&d[r * dl..(r + 1) * dl]);
                        buf.extend_from_slice(&s[r * sl..(r + 1) * sl]);
                        buf.extend_from_slice(&bi[r * sl..(r + 1) * sl]);
                    }
                    w.write(&buf)?;
                    progress.inc(m.source_bytes() * n as u64 / m.rows as u64);
                    a = b;
                }
                rows_total += m.rows as u64;
            }
            tables.push(NgramTable {
                layer: *layer,
                rows: rows_total,
                cols,
                precision: *prec,
                row_bytes: row_bytes as u64,
                offset,
            });
        }
        w.pad_to(DENSE_ALIGN)?;
        files.insert("ngram.bin".to_string(), w.finish()?);
        Some(NgramFile { file: "ngram.bin".to_string(), tables })
    };

    // ---- side files and manifest ---------------------------------------------------------------
    for f in SIDE_FILES {
        let src = ck.dir.join(f);
        if src.is_file() {
            let bytes = std::fs::read(&src).with_context(|| format!("cannot read {}", src.display()))?;
            std::fs::write(out.join(f), &bytes).with_context(|| format!("cannot write {f} into the store"))?;
            files.insert(
                f.to_string(),
                FileSum { bytes: bytes.len() as u64, xxh3: format!("{:016x}", xxh3_64(&bytes)) },
            );
        }
    }
    let manifest = Manifest {
        format: FORMAT.to_string(),
        format_version: FORMAT_VERSION,
        created_by: format!("cherenkov {}", env!("CARGO_PKG_VERSION")),
        model_type: ck.config.model_type.clone(),
        source: super::manifest::SourceInfo {
            path: ck.dir.display().to_string(),
            layout: ck.layout,
            fingerprint: ck.fingerprint.clone(),
        },
        config: c,
        mtp_layers: ck.mtp_layers,
        tensors,
        experts: ExpertFile {
            file: experts_name,
            sums_file: sums_name,
            piece_sums: Some(PieceSums { file: psums_name, piece_bytes }),
            record_bytes,
            num_experts: ck.text().num_experts,
            layers: layouts,
        },
        ngram,
        files,
    };
    let json = serde_json::to_vec_pretty(&manifest)?;
    let mp = out.join("manifest.json");
    std::fs::write(&mp, json).with_context(|| format!("cannot write {}", mp.display()))?;
    File::open(&mp).and_then(|f| f.sync_all()).ok();
    progress.finish_with_message("packed");
    Ok(manifest)
}

/// Writes the record sums and piece sums files of an experts file whose records were written, and
/// their entries in `files`: `names` are the experts, sums and piece sums files. The experts
/// file's checksum is the hash of its record sums (each record is checked on read).
pub(crate) fn write_expert_sums(
    dir: &Path,
    names: [&str; 3],
    record_bytes: u64,
    sums: &[u64],
    psums: &[u64],
    files: &mut BTreeMap<String, FileSum>,
) -> Result<()> {
    let [experts, sums_name, psums_name] = names;
    let sums_bytes: Vec<u8> = sums.iter().flat_map(|s| s.to_le_bytes()).collect();
    let bytes = sums.len() as u64 * record_bytes;
    files.insert(experts.to_string(), FileSum { bytes, xxh3: format!("{:016x}", xxh3_64(&sums_bytes)) });
    let mut sw = HashingWriter::create(&dir.join(sums_name))?;
    sw.write(&sums_bytes)?;
    files.insert(sums_name.to_string(), sw.finish()?);
    let mut pw = HashingWriter::create(&dir.join(psums_name))?;
    pw.write(&psums.iter().flat_map(|s| s.to_le_bytes()).collect::<Vec<u8>>())?;
    files.insert(psums_name.to_string(), pw.finish()?);
    Ok(())
}

/// The xxh3-64 of each `piece_bytes` piece of a record (the last one may be shorter).
pub fn record_piece_sums(record: &[u8], piece_bytes: u64) -> Vec<u64> {
    record.chunks(piece_bytes as usize).map(xxh3_64).collect()
}
