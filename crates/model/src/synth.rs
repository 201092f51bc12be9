//! Synthetic `qwen4_exp` checkpoints: random BF16 weights in the real Hugging Face layout.
//!
//! [`write_checkpoint`] writes a directory that [`crate::checkpoint::Checkpoint::open`] accepts:
//! `config.json` (a `qwen4_exp` wrapper), sharded `model-XXXXX-of-YYYYY.safetensors` with
//! `model.safetensors.index.json`, `generation_config.json`, and the golden fixtures' tokenizer and
//! chat template. Tensor names and shapes come from [`crate::arch`], so the files always agree with
//! the loader: `model.language_model.*` for the trunk, `lm_head.weight`, `mtp.*`, fused experts
//! `experts.gate_up_proj [E, 2I, H]` (gate rows first) and `experts.down_proj [E, H, I]`, n-gram
//! tables as `ngram_embedding.shard_{i}.weight` (row blocks of `ceil(rows / split_ngram_parts)`),
//! plus the n-gram hash buffers transformers saves.
//!
//! Writing streams: every shape is known first, each shard's header is written, then each tensor's
//! bytes are generated block by block and appended, so a checkpoint of many GB never sits in
//! memory (about 16 blocks of `init::BLOCK` elements at a time).
//!
//! Values (see `synth/init.rs`): linears N(0, 1/fan_in), routers N(0, router_gain^2/fan_in), embeddings
//! and n-gram rows N(0, 1), zero-centred norm weights N(0, 0.1^2), the Gated DeltaNet `norm.weight`
//! N(1, 0.1^2), `A_log` = ln U(0.5, 4) in f32, `dt_bias` N(0, 0.5^2), convolutions N(0, 0.3^2).

mod init;
mod shape;
mod store;

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use indicatif::ProgressBar;
use rayon::prelude::*;
use serde_json::{Map, Value, json};

use crate::arch::{self, Role, TensorSpec};
use crate::config::{ModelConfig, TextConfig};
use crate::dtype::DType;
use crate::ngram::NgramHash;
use init::{BLOCK, Init, fill_block};
pub use shape::{SynthDims, SynthShape};
pub use store::{store_bytes, write_store};

/// Token ids the bundled tokenizer produces (`0..TOKENIZER_VOCAB`); `vocab_size` must cover them.
pub const TOKENIZER_VOCAB: usize = 500;
/// `<|im_end|>` in the bundled tokenizer.
pub const EOS_TOKEN: u32 = 2;

pub(crate) const TOKENIZER_FILES: [(&str, &str); 3] = [
    ("tokenizer.json", include_str!("../../../fixtures/golden/tiny-a/hf/tokenizer.json")),
    ("tokenizer_config.json", include_str!("../../../fixtures/golden/tiny-a/hf/tokenizer_config.json")),
    ("chat_template.jinja", include_str!("../../../fixtures/golden/tiny-a/hf/chat_template.jinja")),
];

/// How the weights are drawn and the files cut.
#[derive(Clone, Debug, PartialEq)]
pub struct SynthOptions {
    pub seed: u64,
    /// Scales the routers' weights (`mlp.gate`, `shared_expert_gate`): larger means peakier routing.
    pub router_gain: f32,
    /// A shard file is closed before it would grow past this (a larger tensor gets a file alone).
    pub max_shard_bytes: u64,
}

impl Default for SynthOptions {
    fn default() -> SynthOptions {
        SynthOptions { seed: 0, router_gain: 1.0, max_shard_bytes: 1 << 30 }
    }
}

/// What [`write_checkpoint`] wrote.
#[derive(Clone, Debug)]
pub struct SynthSummary {
    /// The safetensors shards, in order.
    pub shards: Vec<PathBuf>,
    pub tensors: usize,
    /// Bytes of tensor data in all shards.
    pub tensor_bytes: u64,
    /// The largest tensor: checkpoint key and bytes.
    pub largest: (String, u64),
}

/// One tensor to write.
pub(crate) struct Planned {
    /// The checkpoint key.
    pub(crate) key: String,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<usize>,
    pub(crate) init: Init,
}

impl Planned {
    pub(crate) fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    fn bytes(&self) -> u64 {
        (self.numel() * self.dtype.size()) as u64
    }
}

/// The Hugging Face key of a canonical name (`layers.0...` lives under `model.language_model.`).
pub(crate) fn hf_key(name: &str) -> String {
    if name == "lm_head.weight" || name.starts_with("mtp.") {
        name.to_string()
    } else {
        format!("model.language_model.{name}")
    }
}

fn normal(std: f32) -> Init {
    Init::Normal { mean: 0.0, std }
}

fn dense_tensor(spec: &TensorSpec, opts: &SynthOptions) -> Planned {
    let fan_in = (*spec.shape.last().unwrap_or(&1)).max(1) as f32;
    let (dtype, init) = match spec.role {
        Role::Embedding => (DType::BF16, normal(1.0)),
        Role::Linear => (DType::BF16, normal(1.0 / fan_in.sqrt())),
        Role::Router => (DType::BF16, normal(opts.router_gain / fan_in.sqrt())),
        // Gated DeltaNet's RMSNorm multiplies by w; every other norm here by (1 + w).
        Role::Norm if spec.name.ends_with("linear_attn.norm.weight") => {
            (DType::BF16, Init::Normal { mean: 1.0, std: 0.1 })
        }
        Role::Norm => (DType::BF16, normal(0.1)),
        Role::Conv => (DType::BF16, normal(0.3)),
        Role::Param if spec.name.ends_with("A_log") => (DType::F32, Init::LogUniform { lo: 0.5, hi: 4.0 }),
        Role::Param => (DType::BF16, normal(0.5)),
    };
    Planned { key: hf_key(&spec.name), dtype, shape: spec.shape.clone(), init }
}

/// The fused experts of one MoE layer: `gate_up_proj [E, 2I, H]` (gate rows first) and
/// `down_proj [E, H, I]`.
fn expert_tensors(c: &TextConfig, prefix: &str) -> [Planned; 2] {
    let [gate, _, down] = arch::expert_shapes(c);
    let e = c.num_experts;
    [
        Planned {
            key: hf_key(&format!("{prefix}.mlp.experts.gate_up_proj")),
            dtype: DType::BF16,
            shape: vec![e, 2 * gate[0], gate[1]],
            init: normal(1.0 / (gate[1] as f32).sqrt()),
        },
        Planned {
            key: hf_key(&format!("{prefix}.mlp.experts.down_proj")),
            dtype: DType::BF16,
            shape: vec![e, down[0], down[1]],
            init: normal(1.0 / (down[1] as f32).sqrt()),
        },
    ]
}

/// The n-gram table shards of PLE layer `layer` and the hash buffers transformers saves with them.
fn ngram_tensors(c: &TextConfig, layer: usize) -> Vec<Planned> {
    let (rows, cols) = arch::ngram_table_shape(c, layer).expect("a PLE layer");
    let base = format!("layers.{layer}.ple.ple_embedding");
    let per_shard = rows.div_ceil(c.split_ngram_parts as u64);
    let mut v = Vec::new();
    let mut row = 0;
    while row < rows {
        let n = per_shard.min(rows - row);
        v.push(Planned {
            key: hf_key(&format!("{base}.ngram_embedding.shard_{}.weight", v.len())),
            dtype: DType::BF16,
            shape: vec![n as usize, cols],
            init: normal(1.0),
        });
        row += n;
    }
    let hash = NgramHash::new(c, c.ple_index(layer).expect("a PLE layer"));
    for (name, values) in [
        ("layer_multipliers", hash.multipliers),
        ("ngram_heads_vocab_sizes", hash.head_rows),
        ("ngram_heads_offsets", hash.head_offsets),
    ] {
        v.push(Planned {
            key: hf_key(&format!("{base}.{name}")),
            dtype: DType::I64,
            shape: vec![values.len()],
            init: Init::Bytes(values.iter().flat_map(|x| x.to_le_bytes()).collect()),
        });
    }
    v
}

/// Every tensor in module order: a layer's n-gram table after its PLE block, its experts after its
/// router.
pub(crate) fn plan(c: &TextConfig, mtp_layers: usize, opts: &SynthOptions) -> Vec<Planned> {
    let moe_prefixes: Vec<String> = arch::moe_layers(c, mtp_layers).into_iter().map(|l| l.prefix).collect();
    let mut out = Vec::new();
    for spec in arch::dense_specs(c, mtp_layers).iter().filter(|s| !s.optional) {
        out.push(dense_tensor(spec, opts));
        if let Some(prefix) = spec.name.strip_suffix(".mlp.gate.weight")
            && moe_prefixes.iter().any(|p| p == prefix)
        {
            out.extend(expert_tensors(c, prefix));
        }
        if let Some(layer) = spec.name.strip_prefix("layers.").and_then(|r| r.strip_suffix(".ple.conv1d.weight")) {
            out.extend(ngram_tensors(c, layer.parse().expect("a layer number")));
        }
    }
    out
}

/// Cuts the plan into shards of at most `max` bytes (a bigger tensor gets a shard of its own).
fn shard(plan: &[Planned], max: u64) -> Vec<std::ops::Range<usize>> {
    let mut shards = Vec::new();
    let (mut start, mut bytes) = (0, 0u64);
    for (i, t) in plan.iter().enumerate() {
        if i > start && bytes + t.bytes() > max {
            shards.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes += t.bytes();
    }
    if start < plan.len() {
        shards.push(start..plan.len());
    }
    shards
}

/// Writes one safetensors file: the header, then each tensor's bytes in order.
fn write_shard(path: &Path, tensors: &[Planned], seed: u64, progress: &ProgressBar) -> Result<()> {
    let mut header = Map::new();
    // The seed in the metadata makes the header, and so `Checkpoint::fingerprint` (which hashes
    // headers, not data), differ between checkpoints of different weights.
    header.insert("__metadata__".into(), json!({"format": "pt", "cherenkov_synth_seed": seed.to_string()}));
    let mut offset = 0u64;
    for t in tensors {
        header.insert(
            t.key.clone(),
            json!({"dtype": t.dtype.name(), "shape": t.shape, "data_offsets": [offset, offset + t.bytes()]}),
        );
        offset += t.bytes();
    }
    let mut h = serde_json::to_vec(&Value::Object(header))?;
    h.resize(h.len().next_multiple_of(8), b' ');
    let show = path.display();
    let f = File::create(path).with_context(|| format!("cannot create {show}"))?;
    let mut w = BufWriter::with_capacity(8 << 20, f);
    w.write_all(&(h.len() as u64).to_le_bytes())
        .and_then(|_| w.write_all(&h))
        .with_context(|| format!("write to {show} failed"))?;
    let batch = 4 * rayon::current_num_threads().max(1);
    for t in tensors {
        if let Init::Bytes(b) = &t.init {
            w.write_all(b).with_context(|| format!("write to {show} failed"))?;
            continue;
        }
        let tensor_seed = xxhash_rust::xxh3::xxh3_64_with_seed(t.key.as_bytes(), seed);
        let (numel, size) = (t.numel(), t.dtype.size());
        let blocks = numel.div_ceil(BLOCK);
        for first in (0..blocks).step_by(batch) {
            let chunks: Vec<Vec<u8>> = (first..(first + batch).min(blocks))
                .into_par_iter()
                .map(|b| {
                    let mut out = vec![0u8; (BLOCK.min(numel - b * BLOCK)) * size];
                    fill_block(&t.init, t.dtype, tensor_seed, b, &mut out);
                    out
                })
                .collect();
            for c in &chunks {
                w.write_all(c).with_context(|| format!("write to {show} failed"))?;
                progress.inc(c.len() as u64);
            }
        }
    }
    let f = w.into_inner().map_err(|e| anyhow::anyhow!("write to {show} failed: {}", e.error()))?;
    f.sync_all().with_context(|| format!("fsync of {show} failed"))
}

/// Writes a synthetic checkpoint of `shape` into `dir` (which must be absent or empty).
pub fn write_checkpoint(
    shape: &SynthShape,
    opts: &SynthOptions,
    dir: &Path,
    progress: &ProgressBar,
) -> Result<SynthSummary> {
    let config_json = shape.config_json();
    let config = ModelConfig::from_value(&config_json).context("the synthetic shape is not a valid qwen4_exp model")?;
    let c = &config.text;
    if c.vocab_size < TOKENIZER_VOCAB {
        bail!("vocab_size {} is smaller than the bundled tokenizer's {TOKENIZER_VOCAB} tokens", c.vocab_size);
    }
    if dir.exists() && !dir.is_dir() {
        bail!("{} exists and is not a directory", dir.display());
    }
    if dir.exists()
        && std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))?.next().is_some()
    {
        bail!("{} is not empty; a synthetic checkpoint needs a new or empty directory", dir.display());
    }
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;

    let plan = plan(c, shape.mtp_layers, opts);
    let shards = shard(&plan, opts.max_shard_bytes.max(1));
    let tensor_bytes: u64 = plan.iter().map(Planned::bytes).sum();
    progress.set_length(tensor_bytes);
    let mut weight_map = Map::new();
    let mut paths = Vec::new();
    for (i, range) in shards.iter().enumerate() {
        let file = format!("model-{:05}-of-{:05}.safetensors", i + 1, shards.len());
        write_shard(&dir.join(&file), &plan[range.clone()], opts.seed, progress)?;
        for t in &plan[range.clone()] {
            weight_map.insert(t.key.clone(), Value::String(file.clone()));
        }
        paths.push(dir.join(file));
    }
    let index = json!({"metadata": {"total_size": tensor_bytes}, "weight_map": weight_map});
    let generation =
        json!({"eos_token_id": [EOS_TOKEN, 0], "do_sample": true, "temperature": 0.7, "top_p": 0.8, "top_k": 20});
    let mut files: Vec<(&str, String)> = vec![
        ("config.json", serde_json::to_string_pretty(&config_json)?),
        ("model.safetensors.index.json", serde_json::to_string_pretty(&index)?),
        ("generation_config.json", serde_json::to_string_pretty(&generation)?),
    ];
    files.extend(TOKENIZER_FILES.iter().map(|(n, t)| (*n, t.to_string())));
    for (name, text) in files {
        std::fs::write(dir.join(name), text).with_context(|| format!("cannot write {}", dir.join(name).display()))?;
    }
    let largest = plan.iter().max_by_key(|t| t.bytes()).map(|t| (t.key.clone(), t.bytes())).unwrap_or_default();
    Ok(SynthSummary { shards: paths, tensors: plan.len(), tensor_bytes, largest })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::{Checkpoint, Layout};
    use crate::safetensors::SafeTensors;
    use crate::store::{Store, pack::pack};

    fn write(shape: &SynthShape, opts: &SynthOptions, dir: &Path) -> SynthSummary {
        write_checkpoint(shape, opts, dir, &ProgressBar::hidden()).unwrap()
    }

    #[test]
    fn tiny_opens_packs_and_verifies() {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("ck");
        let opts = SynthOptions { max_shard_bytes: 1 << 20, ..SynthOptions::default() };
        let sum = write(&SynthShape::tiny(), &opts, &src);
        assert!(sum.shards.len() >= 3, "{:?}", sum.shards);
        assert!(sum.tensor_bytes > 2_500_000 && sum.tensor_bytes < 4_500_000, "{}", sum.tensor_bytes);
        assert!(sum.largest.0.ends_with("experts.gate_up_proj"), "{:?}", sum.largest);
        let ck = Checkpoint::open(&src).unwrap_or_else(|e| panic!("{e:#}"));
        assert_eq!(ck.layout, Layout::Hf);
        assert_eq!(ck.mtp_layers, 1);
        assert_eq!(ck.source_bytes(), sum.tensor_bytes);
        let out = tmp.path().join("store");
        pack(&ck, &out, &ProgressBar::hidden()).unwrap();
        let store = Store::open(&out).unwrap();
        assert!(store.verify(&ProgressBar::hidden()).unwrap().is_empty());
        assert_eq!(store.manifest.experts.layers.len(), 3);
        assert!(out.join("tokenizer.json").is_file() && out.join("chat_template.jinja").is_file());
    }

    #[test]
    fn values_follow_the_roles() {
        let tmp = tempfile::tempdir().unwrap();
        let shape = SynthShape { vocab_size: 600, ..SynthShape::tiny() };
        write(&shape, &SynthOptions { max_shard_bytes: u64::MAX, ..SynthOptions::default() }, tmp.path());
        let st = SafeTensors::open(&tmp.path().join("model-00001-of-00001.safetensors")).unwrap();
        let read = |k: &str| {
            let t = st.get(k).unwrap_or_else(|| panic!("no {k}"));
            crate::dtype::to_f32_vec(t.dtype, &st.read(t).unwrap()).unwrap()
        };
        let moments = |v: &[f32]| {
            let n = v.len() as f32;
            let m = v.iter().sum::<f32>() / n;
            (m, (v.iter().map(|x| (x - m) * (x - m)).sum::<f32>() / n).sqrt())
        };
        let (m, s) = moments(&read("model.language_model.embed_tokens.weight"));
        assert!(m.abs() < 0.02 && (s - 1.0).abs() < 0.02, "embedding {m} {s}");
        assert_eq!(st.get("model.language_model.embed_tokens.weight").unwrap().shape, vec![600, 192]);
        let (m, s) = moments(&read("model.language_model.layers.1.self_attn.o_proj.weight"));
        let want = 1.0 / 128f32.sqrt();
        assert!(m.abs() < 0.01 && (s - want).abs() < 0.05 * want, "o_proj {m} {s}");
        let (m, _) = moments(&read("model.language_model.layers.0.linear_attn.norm.weight"));
        assert!((m - 1.0).abs() < 0.1, "GDN norm {m}");
        let a = read("model.language_model.layers.0.linear_attn.A_log");
        assert_eq!(st.get("model.language_model.layers.0.linear_attn.A_log").unwrap().dtype, DType::F32);
        assert!(a.iter().all(|&x| x >= 0.5f32.ln() && x < 4f32.ln()), "{a:?}");
        let (_, s) = moments(&read("model.language_model.layers.0.linear_attn.conv1d.weight"));
        assert!((s - 0.3).abs() < 0.03, "conv {s}");
    }

    #[test]
    fn seeded_and_checked() {
        let tmp = tempfile::tempdir().unwrap();
        let opts = SynthOptions::default();
        let fp = |dir: &str, o: &SynthOptions| {
            write(&SynthShape::tiny(), o, &tmp.path().join(dir));
            Checkpoint::open(&tmp.path().join(dir)).unwrap().fingerprint
        };
        let a = fp("a", &opts);
        assert_eq!(a, fp("b", &opts));
        assert_ne!(a, fp("c", &SynthOptions { seed: 1, ..opts.clone() }));
        let e = write_checkpoint(&SynthShape::tiny(), &opts, &tmp.path().join("a"), &ProgressBar::hidden());
        assert!(e.unwrap_err().to_string().contains("is not empty"));
        let small = SynthShape { vocab_size: 100, ..SynthShape::tiny() };
        let e = write_checkpoint(&small, &opts, &tmp.path().join("d"), &ProgressBar::hidden()).unwrap_err();
        assert!(e.to_string().contains("vocab_size 100"), "{e}");
        let bad = SynthShape { ple_layer_ids: vec![2], ..SynthShape::tiny() };
        let e =
            format!("{:#}", write_checkpoint(&bad, &opts, &tmp.path().join("e"), &ProgressBar::hidden()).unwrap_err());
        assert!(e.contains("PLE is only supported on linear_attention layers"), "{e}");
    }

    #[test]
    fn tokenizer_vocab_matches_the_bundled_file() {
        let v: Value = serde_json::from_str(TOKENIZER_FILES[0].1).unwrap();
        let max = v["model"]["vocab"].as_object().unwrap().values().map(|x| x.as_u64().unwrap()).max().unwrap();
        let added = v["added_tokens"].as_array().unwrap().iter().map(|t| t["id"].as_u64().unwrap()).max().unwrap();
        assert_eq!(max.max(added) as usize + 1, TOKENIZER_VOCAB);
        let eos = v["added_tokens"].as_array().unwrap().iter().find(|t| t["content"] == "<|im_end|>").unwrap();
        assert_eq!(eos["id"], EOS_TOKEN);
    }

    #[test]
    fn presets_are_valid_models() {
        for (shape, lo, hi) in
            [(SynthShape::demo(), 20e6, 80e6), (SynthShape::from_dims(&SynthDims::default()), 100e6, 2e9)]
        {
            let cfg = ModelConfig::from_value(&shape.config_json()).unwrap();
            let bytes: u64 =
                plan(&cfg.text, shape.mtp_layers, &SynthOptions::default()).iter().map(|t| t.bytes()).sum();
            assert!((lo..hi).contains(&(bytes as f64)), "{bytes}");
        }
    }
}
