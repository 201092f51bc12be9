//! A checkpoint directory (config.json + safetensors) seen through one set of tensor names.
//!
//! Two layouts are accepted:
//! - Hugging Face: `model.language_model.*` (vision-language save) or `model.*` (text-only save),
//!   `lm_head.weight`, `mtp.*`; experts fused as `experts.gate_up_proj [E, 2I, H]` (gate rows first)
//!   and `experts.down_proj [E, H, I]`, or one tensor per expert (`experts.{e}.gate_proj.weight`);
//!   the n-gram table sharded as `ngram_embedding.shard_{i}.weight`. Vision weights are ignored.
//! - MLX: `language_model.model.*`, `language_model.lm_head`, `language_model.mtp.*`; experts
//!   stacked as `switch_mlp.{gate,up,down}_proj`; n-gram shards as `ngram_embedding.shards.{i}`;
//!   conv weights as `[C, K, 1]`; every quantized linear as `{weight (u32), scales, biases}` with the
//!   format from `quantization` in config.json (per-path overrides first).
//!
//! [`Checkpoint::open`] checks everything before anything is packed: every tensor the config implies
//! is present with its shape (and quantized shapes agree with bits and group size), nothing unknown
//! is left over, and the n-gram hash buffers, when a checkpoint carries them, match the config.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

use crate::arch::{self, MoeLayer, Role, TensorSpec};
use crate::config::{ModelConfig, TextConfig};
use crate::dtype::DType;
use crate::ngram::NgramHash;
use crate::quant::{Affine, SUPPORTED_BITS, SUPPORTED_GROUPS};
use crate::safetensors::{SafeTensors, TensorInfo};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Layout {
    /// Hugging Face, floating point.
    Hf,
    /// An MLX conversion (affine-quantized linears).
    Mlx,
}

/// One tensor of one file.
#[derive(Clone, Debug)]
pub struct Piece {
    pub file: usize,
    pub info: TensorInfo,
}

/// How a matrix is stored in the checkpoint.
#[derive(Clone, Debug)]
pub enum Encoding {
    Float { dtype: DType, data: Piece },
    Affine { fmt: Affine, words: Piece, scales: Piece, biases: Piece },
}

/// A matrix of `rows x cols` (cols = the input width) starting at row `row0` of its pieces.
/// Every tensor is seen as one: a norm is 1 x n, a conv `[C, 1, K]` is C x K.
#[derive(Clone, Debug)]
pub struct Matrix {
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    pub row0: usize,
    pub enc: Encoding,
}

impl Matrix {
    pub fn affine(&self) -> Option<Affine> {
        match &self.enc {
            Encoding::Affine { fmt, .. } => Some(*fmt),
            Encoding::Float { .. } => None,
        }
    }

    /// Bytes this matrix occupies in the checkpoint.
    pub fn source_bytes(&self) -> u64 {
        match &self.enc {
            Encoding::Float { dtype, .. } => (self.rows * self.cols * dtype.size()) as u64,
            Encoding::Affine { fmt, .. } => (self.rows * fmt.row_bytes(self.cols)) as u64,
        }
    }
}

/// Raw bytes of some rows of a matrix.
pub enum RowData {
    Float { dtype: DType, data: Vec<u8> },
    Affine { fmt: Affine, words: Vec<u8>, scales: Vec<u8>, biases: Vec<u8> },
}

#[derive(Clone, Debug)]
struct Entry {
    /// Raw key of the weight (`...weight` or the bare parameter name).
    raw: String,
    weight: Piece,
    scales: Option<Piece>,
    biases: Option<Piece>,
}

pub struct Checkpoint {
    pub dir: PathBuf,
    pub config: ModelConfig,
    pub layout: Layout,
    pub mtp_layers: usize,
    files: Vec<SafeTensors>,
    /// Canonical name -> entry.
    entries: BTreeMap<String, Entry>,
    /// A cheap identity of the source: config bytes, file names, sizes and headers.
    pub fingerprint: String,
}

const IGNORED_PREFIXES: [&str; 6] = [
    "model.visual.",
    "visual.",
    "vision_tower.",
    "model.vision_tower.",
    "language_model.vision_tower.",
    "vision_model.",
];
const NGRAM_BUFFERS: [&str; 3] = ["layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets"];

/// Canonical name of a raw key (None: ignored). Also returns the MLX part suffix if any.
fn canonical(raw: &str) -> Option<(String, &'static str)> {
    if IGNORED_PREFIXES.iter().any(|p| raw.starts_with(p)) || raw.ends_with("rotary_emb.inv_freq") {
        return None;
    }
    let mut name = raw;
    for p in ["model.language_model.", "language_model.model.", "language_model.", "model."] {
        if let Some(rest) = name.strip_prefix(p) {
            name = rest;
            break;
        }
    }
    for (suffix, part) in [(".scales", "scales"), (".biases", "biases")] {
        if let Some(base) = name.strip_suffix(suffix) {
            return Some((format!("{base}.weight"), part));
        }
    }
    Some((name.to_string(), "weight"))
}

fn list_shards(dir: &Path) -> Result<(Vec<PathBuf>, Option<BTreeMap<String, String>>)> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index).with_context(|| format!("cannot read {}", index.display()))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", index.display()))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .with_context(|| format!("{}: no weight_map object", index.display()))?;
        let mut weight_map = BTreeMap::new();
        let mut files = BTreeSet::new();
        for (k, f) in map {
            let f = f.as_str().with_context(|| format!("{}: weight_map[{k:?}] is not a file name", index.display()))?;
            if f.contains('/') || f.contains("..") {
                bail!(
                    "{}: weight_map[{k:?}] names {f:?}, which is not a file in the checkpoint directory",
                    index.display()
                );
            }
            files.insert(f.to_string());
            weight_map.insert(k.clone(), f.to_string());
        }
        let mut paths = Vec::new();
        for f in files {
            let p = dir.join(&f);
            if !p.exists() {
                bail!("{} lists {f}, which is missing from {}", index.display(), dir.display());
            }
            paths.push(p);
        }
        return Ok((paths, Some(weight_map)));
    }
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot list {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    paths.sort();
    if paths.is_empty() {
        bail!("no .safetensors files in {}", dir.display());
    }
    Ok((paths, None))
}

impl Checkpoint {
    /// Opens and fully validates a checkpoint directory.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        if !dir.exists() {
            bail!("checkpoint directory {} does not exist", dir.display());
        }
        if !dir.is_dir() {
            bail!(
                "{} is not a directory (expected a checkpoint directory with config.json and *.safetensors)",
                dir.display()
            );
        }
        let config_path = dir.join("config.json");
        if !config_path.exists() {
            bail!("no config.json in {}", dir.display());
        }
        let config_bytes =
            std::fs::read(&config_path).with_context(|| format!("cannot read {}", config_path.display()))?;
        let config = ModelConfig::load(&config_path)?;
        let (paths, weight_map) = list_shards(dir)?;
        let mut files = Vec::new();
        for p in &paths {
            files.push(SafeTensors::open(p)?);
        }

        let mut fp = xxhash_rust::xxh3::Xxh3::new();
        fp.update(&config_bytes);
        for f in &files {
            fp.update(f.path().file_name().unwrap().as_encoded_bytes());
            fp.update(&f.fingerprint().to_le_bytes());
        }
        let fingerprint = format!("{:016x}", fp.digest());

        // Every raw key, with its file; duplicates across shards are an error.
        let mut raw: BTreeMap<String, Piece> = BTreeMap::new();
        for (i, f) in files.iter().enumerate() {
            for (k, info) in f.tensors() {
                if let Some(prev) = raw.get(k) {
                    bail!(
                        "tensor {k:?} appears in both {} and {}",
                        files[prev.file].path().display(),
                        f.path().display()
                    );
                }
                raw.insert(k.clone(), Piece { file: i, info: info.clone() });
            }
        }
        if let Some(map) = &weight_map {
            for (k, f) in map {
                match raw.get(k) {
                    Some(p) if files[p.file].path().file_name().is_some_and(|n| n == f.as_str()) => {}
                    Some(p) => bail!(
                        "model.safetensors.index.json puts {k:?} in {f}, but it is in {}",
                        files[p.file].path().display()
                    ),
                    None => bail!("model.safetensors.index.json lists {k:?} in {f}, but no shard holds it"),
                }
            }
        }

        let mut entries: BTreeMap<String, Entry> = BTreeMap::new();
        let mut buffers: BTreeMap<String, Piece> = BTreeMap::new();
        let mut any_scales = false;
        for (k, piece) in &raw {
            let Some((name, part)) = canonical(k) else { continue };
            if NGRAM_BUFFERS.iter().any(|b| name.ends_with(&format!("ple_embedding.{b}"))) {
                buffers.insert(name, piece.clone());
                continue;
            }
            let e = entries.entry(name.clone()).or_insert_with(|| Entry {
                raw: String::new(),
                weight: piece.clone(),
                scales: None,
                biases: None,
            });
            match part {
                "weight" => {
                    e.raw = k.clone();
                    e.weight = piece.clone();
                }
                "scales" => {
                    any_scales = true;
                    e.scales = Some(piece.clone())
                }
                _ => e.biases = Some(piece.clone()),
            }
        }
        for (name, e) in &entries {
            if e.raw.is_empty() {
                bail!("{name}: scales or biases without the quantized weight in the checkpoint");
            }
            if e.scales.is_some() != e.biases.is_some() {
                bail!("{}: a quantized tensor needs both scales and biases", e.raw);
            }
        }
        let layout = if any_scales || config.quantization.is_some() { Layout::Mlx } else { Layout::Hf };
        let mtp_layers =
            if entries.keys().any(|k| k.starts_with("mtp.")) { config.text.mtp_num_hidden_layers.max(1) } else { 0 };
        let ck = Checkpoint { dir: dir.to_path_buf(), config, layout, mtp_layers, files, entries, fingerprint };
        ck.validate(&buffers)?;
        Ok(ck)
    }

    pub fn text(&self) -> &TextConfig {
        &self.config.text
    }

    pub fn file_path(&self, i: usize) -> &Path {
        self.files[i].path()
    }

    /// Total bytes of the safetensors files.
    pub fn source_bytes(&self) -> u64 {
        self.files.iter().flat_map(|f| f.tensors().values()).map(|t| t.len).sum()
    }

    fn where_(&self, p: &Piece) -> String {
        format!("{}", self.files[p.file].path().display())
    }

    /// Resolves entry `name` as a `rows x cols` matrix (`shape` is the logical shape).
    fn matrix(&self, name: &str, shape: &[usize], conv: bool) -> Result<Matrix> {
        let e = self
            .entries
            .get(name)
            .with_context(|| format!("missing tensor {name} (expected shape {shape:?}) in {}", self.dir.display()))?;
        let cols = *shape.last().unwrap();
        let rows: usize = shape[..shape.len() - 1].iter().product();
        let raw_shape = &e.weight.info.shape;
        match (&e.scales, &e.biases) {
            (Some(scales), Some(biases)) => {
                let fmt = self.affine_format(e, scales, cols)?;
                let want_w: Vec<usize> =
                    shape[..shape.len() - 1].iter().copied().chain([fmt.words_per_row(cols)]).collect();
                let want_s: Vec<usize> =
                    shape[..shape.len() - 1].iter().copied().chain([fmt.groups_per_row(cols)]).collect();
                if e.weight.info.dtype != DType::U32 || raw_shape != &want_w {
                    bail!(
                        "tensor {} in {}: {} {:?}, expected U32 {:?} for {shape:?} at {fmt}",
                        e.raw,
                        self.where_(&e.weight),
                        e.weight.info.dtype,
                        raw_shape,
                        want_w
                    );
                }
                for (part, p) in [("scales", scales), ("biases", biases)] {
                    if p.info.shape != want_s {
                        bail!(
                            "tensor {} {part} in {}: {} {:?}, expected {:?} for {shape:?} at {fmt}",
                            e.raw,
                            self.where_(p),
                            p.info.dtype,
                            p.info.shape,
                            want_s
                        );
                    }
                    if p.info.dtype != DType::BF16 {
                        bail!(
                            "tensor {} {part} in {}: {} (only bf16 scales and biases are supported)",
                            e.raw,
                            self.where_(p),
                            p.info.dtype
                        );
                    }
                }
                Ok(Matrix {
                    name: name.to_string(),
                    rows,
                    cols,
                    row0: 0,
                    enc: Encoding::Affine {
                        fmt,
                        words: e.weight.clone(),
                        scales: scales.clone(),
                        biases: biases.clone(),
                    },
                })
            }
            _ => {
                let shape_ok = raw_shape.as_slice() == shape
                    || (conv && shape.len() == 3 && raw_shape.as_slice() == [shape[0], shape[2], shape[1]]);
                if !shape_ok {
                    bail!(
                        "tensor {} in {} has shape {:?}, expected {shape:?}",
                        e.raw,
                        self.where_(&e.weight),
                        raw_shape
                    );
                }
                if !e.weight.info.dtype.is_float() {
                    bail!(
                        "tensor {} in {} is {}, expected BF16, F16 or F32 (or MLX affine words with scales and biases)",
                        e.raw,
                        self.where_(&e.weight),
                        e.weight.info.dtype
                    );
                }
                Ok(Matrix {
                    name: name.to_string(),
                    rows,
                    cols,
                    row0: 0,
                    enc: Encoding::Float { dtype: e.weight.info.dtype, data: e.weight.clone() },
                })
            }
        }
    }

    /// The affine format of an MLX tensor: the config's (per-path override first), or, when the
    /// config does not fit the stored shapes, the one (bits, group) that does.
    fn affine_format(&self, e: &Entry, scales: &Piece, cols: usize) -> Result<Affine> {
        let words_cols = *e.weight.info.shape.last().unwrap_or(&0);
        let scale_cols = *scales.info.shape.last().unwrap_or(&0);
        let fits = |f: Affine| {
            f.check(cols).is_ok() && f.words_per_row(cols) == words_cols && f.groups_per_row(cols) == scale_cols
        };
        let path = e.raw.strip_suffix(".weight").unwrap_or(&e.raw);
        if let Some(q) = &self.config.quantization
            && let Some(f) = q.for_path(path)
            && fits(f)
        {
            return Ok(f);
        }
        let candidates: Vec<Affine> = SUPPORTED_BITS
            .iter()
            .flat_map(|&b| SUPPORTED_GROUPS.iter().map(move |&g| Affine::new(b, g)))
            .filter(|&f| fits(f))
            .collect();
        match candidates.as_slice() {
            [f] => Ok(*f),
            [] => bail!(
                "tensor {} in {}: {words_cols} words and {scale_cols} scales per row fit no MLX affine format for {cols} inputs",
                e.raw,
                self.where_(&e.weight)
            ),
            many => bail!(
                "tensor {} in {}: the quantization config does not say its format and its shapes fit several ({})",
                e.raw,
                self.where_(&e.weight),
                many.iter().map(|f| f.to_string()).collect::<Vec<_>>().join(", ")
            ),
        }
    }

    /// A dense (non-expert) tensor, or None for an absent optional one.
    pub fn dense(&self, spec: &TensorSpec) -> Result<Option<Matrix>> {
        if spec.optional && !self.entries.contains_key(&spec.name) {
            return Ok(None);
        }
        let m = self.matrix(&spec.name, &spec.shape, spec.role == Role::Conv)?;
        if m.affine().is_some() && !spec.quantizable() {
            bail!(
                "tensor {} is quantized in the checkpoint, but a {:?} weight is never quantized",
                spec.name,
                spec.role
            );
        }
        Ok(Some(m))
    }

    /// Matrix `which` (0 gate, 1 up, 2 down) of expert `e` in `layer`.
    pub fn expert(&self, layer: &MoeLayer, e: usize, which: usize) -> Result<Matrix> {
        let c = self.text();
        let shape = arch::expert_shapes(c)[which];
        let nexp = c.num_experts;
        let p = &layer.prefix;
        let mname = arch::EXPERT_MATRICES[which];
        // MLX: stacked switch_mlp.
        let switch = format!("{p}.mlp.switch_mlp.{mname}.weight");
        if self.entries.contains_key(&switch) {
            let mut m = self.matrix(&switch, &[nexp, shape[0], shape[1]], false)?;
            m.rows = shape[0];
            m.row0 = e * shape[0];
            return Ok(m);
        }
        // HF: one tensor per expert.
        let per = format!("{p}.mlp.experts.{e}.{mname}.weight");
        if self.entries.contains_key(&per) {
            return self.matrix(&per, &shape, false);
        }
        // HF: fused gate_up [E, 2I, H] and down [E, H, I].
        if which == 2 {
            let mut m = self.matrix(&format!("{p}.mlp.experts.down_proj"), &[nexp, shape[0], shape[1]], false)?;
            m.rows = shape[0];
            m.row0 = e * shape[0];
            return Ok(m);
        }
        let mut m = self
            .matrix(&format!("{p}.mlp.experts.gate_up_proj"), &[nexp, 2 * shape[0], shape[1]], false)
            .with_context(|| format!("no routed experts for {p} (looked for switch_mlp.{mname}, experts.{e}.{mname}, experts.gate_up_proj)"))?;
        m.rows = shape[0];
        m.row0 = e * 2 * shape[0] + which * shape[0];
        Ok(m)
    }

    /// The n-gram table of PLE layer `layer` as row blocks, in order.
    pub fn ngram_shards(&self, layer: usize) -> Result<Vec<Matrix>> {
        let c = self.text();
        let (rows, cols) = arch::ngram_table_shape(c, layer).context("not a PLE layer")?;
        let base = format!("layers.{layer}.ple.ple_embedding.ngram_embedding");
        let mut shards: Vec<(usize, String)> = self
            .entries
            .keys()
            .filter_map(|k| {
                let rest = k.strip_prefix(&base)?;
                let idx = rest.strip_prefix(".shard_").or_else(|| rest.strip_prefix(".shards."))?;
                let idx = idx.strip_suffix(".weight")?;
                Some((idx.parse::<usize>().ok()?, k.clone()))
            })
            .collect();
        shards.sort();
        if shards.is_empty() {
            let whole = format!("{base}.weight");
            if self.entries.contains_key(&whole) {
                return Ok(vec![self.matrix(&whole, &[rows as usize, cols], false)?]);
            }
            bail!(
                "missing n-gram table for layer {layer}: no {base}.shard_*.weight / .shards.* / .weight in {}",
                self.dir.display()
            );
        }
        for (want, (idx, k)) in shards.iter().enumerate() {
            if *idx != want {
                bail!("n-gram table of layer {layer}: shard {want} is missing (next is {k})");
            }
        }
        let mut out = Vec::new();
        let mut total = 0u64;
        for (_, k) in &shards {
            let e = &self.entries[k];
            let r = e.weight.info.shape.first().copied().unwrap_or(0);
            out.push(self.matrix(k, &[r, cols], false)?);
            total += r as u64;
        }
        if total != rows {
            bail!(
                "n-gram table of layer {layer}: its {} shards hold {total} rows, but the config implies {rows} \
                 (ngram_vocab_size_base, heads and padding)",
                shards.len()
            );
        }
        Ok(out)
    }

    /// Reads rows `[a, b)` of a matrix (relative to the matrix).
    pub fn read_rows(&self, m: &Matrix, a: usize, b: usize) -> Result<RowData> {
        let (r0, r1) = (m.row0 + a, m.row0 + b);
        let read = |p: &Piece, row_bytes: usize| -> Result<Vec<u8>> {
            let mut v = vec![0u8; (r1 - r0) * row_bytes];
            self.files[p.file].read_at(&p.info, (r0 * row_bytes) as u64, &mut v)?;
            Ok(v)
        };
        Ok(match &m.enc {
            Encoding::Float { dtype, data } => {
                RowData::Float { dtype: *dtype, data: read(data, m.cols * dtype.size())? }
            }
            Encoding::Affine { fmt, words, scales, biases } => RowData::Affine {
                fmt: *fmt,
                words: read(words, fmt.words_per_row(m.cols) * 4)?,
                scales: read(scales, fmt.groups_per_row(m.cols) * 2)?,
                biases: read(biases, fmt.groups_per_row(m.cols) * 2)?,
            },
        })
    }

    fn validate(&self, buffers: &BTreeMap<String, Piece>) -> Result<()> {
        let c = self.text();
        let mut used: BTreeSet<String> = BTreeSet::new();
        for spec in arch::dense_specs(c, self.mtp_layers) {
            if self.dense(&spec)?.is_some() {
                used.insert(spec.name.clone());
            }
        }
        for layer in arch::moe_layers(c, self.mtp_layers) {
            for which in 0..3 {
                // Resolving expert 0 and the last checks the stacked/fused tensors' shapes;
                // per-expert layouts need every expert.
                for e in 0..c.num_experts {
                    let m = self.expert(&layer, e, which)?;
                    used.insert(m.name.clone());
                }
            }
        }
        for layer in 0..c.num_hidden_layers {
            if let Some(k) = c.ple_index(layer) {
                for m in self.ngram_shards(layer)? {
                    used.insert(m.name.clone());
                }
                self.check_ngram_buffers(layer, k, buffers)?;
            }
        }
        let unknown: Vec<&str> =
            self.entries.iter().filter(|(k, _)| !used.contains(*k)).map(|(_, e)| e.raw.as_str()).collect();
        if !unknown.is_empty() {
            let more = if unknown.len() > 5 { format!(" and {} more", unknown.len() - 5) } else { String::new() };
            bail!(
                "unexpected tensors in {} that the config does not account for: {}{more}",
                self.dir.display(),
                unknown[..unknown.len().min(5)].join(", ")
            );
        }
        Ok(())
    }

    /// transformers' checkpoints may carry the n-gram hash buffers; they must match the config.
    fn check_ngram_buffers(&self, layer: usize, k: usize, buffers: &BTreeMap<String, Piece>) -> Result<()> {
        let hash = NgramHash::new(self.text(), k);
        let expect: [(&str, Vec<u64>); 3] = [
            ("layer_multipliers", hash.multipliers.clone()),
            ("ngram_heads_vocab_sizes", hash.head_rows.clone()),
            ("ngram_heads_offsets", hash.head_offsets.clone()),
        ];
        for (buf, want) in expect {
            let name = format!("layers.{layer}.ple.ple_embedding.{buf}");
            let Some(p) = buffers.get(&name) else { continue };
            if p.info.dtype != DType::I64 {
                bail!("{name} in {} is {}, expected I64", self.where_(p), p.info.dtype);
            }
            let bytes = self.files[p.file].read(&p.info)?;
            let got: Vec<u64> = bytes.chunks_exact(8).map(|b| u64::from_le_bytes(b.try_into().unwrap())).collect();
            if got != want {
                bail!(
                    "{name} in {} is {got:?}, but the config (seed, vocab_size, ngram_vocab_size_base, ...) gives {want:?}",
                    self.where_(p)
                );
            }
        }
        Ok(())
    }
}
