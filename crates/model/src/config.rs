//! `config.json` for `qwen4_exp` (a wrapper whose `text_config` holds the language model) and
//! `qwen4_exp_text` (the language model alone).
//!
//! Every field of transformers' `Qwen4ExpTextConfig` is read with its default when absent, and the
//! combinations transformers' `validate_architecture` rejects are rejected here with a message that
//! names the field and the value. Fields the engine cannot honour (another activation, RoPE
//! scaling, attention biases) are refused the same way rather than silently ignored.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::quant::Affine;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerType {
    /// Gated DeltaNet (`linear_attention`).
    LinearAttention,
    /// Gated attention with the QSA indexer (`full_attention`, `qwen_sparse_attention`, `indexed_attention`).
    Attention,
}

/// Activation of the Gated DeltaNet output gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GateAct {
    Sigmoid,
    Silu,
}

/// The QSA token indexer of the attention layers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct QsaConfig {
    pub n_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Tokens selected from complete blocks per query.
    pub budget: usize,
    /// Tokens per mean-pooled index block.
    pub compress_ratio: usize,
}

impl QsaConfig {
    pub fn block_topk(&self) -> usize {
        self.budget / self.compress_ratio
    }
}

/// The language model's hyperparameters (transformers' `Qwen4ExpTextConfig`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TextConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub hidden_act: String,
    pub gate_act: GateAct,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub tie_word_embeddings: bool,
    pub rope_theta: f64,
    pub partial_rotary_factor: f64,
    pub linear_conv_kernel_dim: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub moe_intermediate_size: usize,
    pub shared_expert_intermediate_size: usize,
    pub num_experts_per_tok: usize,
    pub num_experts: usize,
    pub norm_topk_prob: bool,
    pub layer_types: Vec<LayerType>,
    pub hc_count: usize,
    pub hc_lowrank: usize,
    /// One-indexed decoder layers with a PLE block.
    pub ple_layer_ids: Vec<usize>,
    pub ple_embed_dim: usize,
    pub ple_conv_kernel_size: usize,
    pub ngram_size: usize,
    pub heads_per_ngram: usize,
    pub ngram_vocab_size_base: u64,
    pub make_ngram_vocab_size_divisible_by: u64,
    pub seed: u64,
    pub split_ngram_parts: usize,
    pub qsa: Option<QsaConfig>,
    pub eos_token_ids: Vec<u32>,
    pub pad_token_id: Option<u32>,
    pub bos_token_id: Option<u32>,
    /// Layers of the MTP head (0 when the checkpoint has none).
    pub mtp_num_hidden_layers: usize,
}

impl TextConfig {
    /// Dimensions rotated by RoPE (`int(head_dim * partial_rotary_factor)`).
    pub fn rotary_dim(&self) -> usize {
        (self.head_dim as f64 * self.partial_rotary_factor) as usize
    }
    pub fn hc_hidden(&self) -> usize {
        self.hc_count * self.hidden_size
    }
    pub fn gdn_key_dim(&self) -> usize {
        self.linear_num_key_heads * self.linear_key_head_dim
    }
    pub fn gdn_value_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }
    /// Floats of one GDN layer's recurrent state: a key x value matrix per value head.
    pub fn gdn_state_len(&self) -> usize {
        self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
    }
    /// Channels of the GDN causal convolution (q, k and v).
    pub fn gdn_conv_dim(&self) -> usize {
        2 * self.gdn_key_dim() + self.gdn_value_dim()
    }
    /// Hashed n-gram heads per PLE layer.
    pub fn ngram_heads(&self) -> usize {
        (self.ngram_size.saturating_sub(1)) * self.heads_per_ngram
    }
    /// Columns of one n-gram table row.
    pub fn ngram_row_dim(&self) -> usize {
        self.ple_embed_dim / self.ngram_heads().max(1)
    }
    /// Index of `layer` (zero-based) among the PLE layers, if it has one.
    pub fn ple_index(&self, layer: usize) -> Option<usize> {
        self.ple_layer_ids.iter().position(|&id| id == layer + 1)
    }
    /// The first EOS id: padding and segment restarts of the n-gram hash use it.
    pub fn eos(&self) -> Option<u32> {
        self.eos_token_ids.first().copied()
    }
}

/// MLX quantization parameters from `quantization` / `quantization_config`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct QuantConfig {
    pub default: Affine,
    /// Per-path settings: `Some(format)` overrides, `None` means the path is left unquantized.
    pub overrides: BTreeMap<String, Option<Affine>>,
}

impl QuantConfig {
    /// The format declared for an MLX module path.
    pub fn for_path(&self, path: &str) -> Option<Affine> {
        match self.overrides.get(path) {
            Some(v) => *v,
            None => Some(self.default),
        }
    }
}

/// A parsed `config.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// `qwen4_exp` or `qwen4_exp_text`.
    pub model_type: String,
    pub text: TextConfig,
    pub quantization: Option<QuantConfig>,
}

impl ModelConfig {
    /// Reads and validates `path` (a `config.json`).
    pub fn load(path: &Path) -> Result<ModelConfig> {
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
        ModelConfig::parse(&text).with_context(|| format!("{}", path.display()))
    }

    pub fn parse(json: &str) -> Result<ModelConfig> {
        let v: Value = serde_json::from_str(json).context("not valid JSON")?;
        ModelConfig::from_value(&v)
    }

    pub fn from_value(v: &Value) -> Result<ModelConfig> {
        let top = v.as_object().context("the top level is not a JSON object")?;
        let model_type = match top.get("model_type") {
            Some(Value::String(s)) => s.clone(),
            Some(other) => bail!("model_type must be a string, found {other}"),
            None => bail!("model_type is missing (expected \"qwen4_exp\" or \"qwen4_exp_text\")"),
        };
        let (text_obj, prefix) = match model_type.as_str() {
            "qwen4_exp" => match top.get("text_config") {
                Some(Value::Object(t)) => (t, "text_config."),
                None | Some(Value::Null) => bail!("model_type \"qwen4_exp\" needs a text_config object"),
                Some(other) => bail!("text_config must be an object, found {}", short(other)),
            },
            "qwen4_exp_text" => (top, ""),
            "qwen3_next" | "qwen3_5_moe" | "qwen3_5_moe_text" => bail!(
                "model_type {model_type:?} (a sibling of qwen4_exp without hyper-connections, PLE and QSA) is not supported yet; \
                 supported: \"qwen4_exp\", \"qwen4_exp_text\""
            ),
            other => bail!("unsupported model_type {other:?}; supported: \"qwen4_exp\", \"qwen4_exp_text\""),
        };
        if let Some(t) = text_obj.get("model_type").and_then(|t| t.as_str())
            && prefix == "text_config."
            && t != "qwen4_exp_text"
        {
            bail!("text_config.model_type must be \"qwen4_exp_text\", found {t:?}");
        }
        let mut text = parse_text(&Fields { obj: text_obj, prefix })?;
        // The wrapper's own tie_word_embeddings decides for the wrapper model.
        if prefix == "text_config."
            && let Some(t) = top.get("tie_word_embeddings")
        {
            text.tie_word_embeddings = t.as_bool().context("tie_word_embeddings must be true or false")?;
        }
        if text.eos_token_ids.is_empty()
            && let Some(e) = top.get("eos_token_id")
        {
            text.eos_token_ids = eos_list(e, "eos_token_id")?;
        }
        validate(&text, prefix)?;
        let quantization = match top.get("quantization").or_else(|| top.get("quantization_config")) {
            None | Some(Value::Null) => None,
            Some(q) => Some(parse_quant(q)?),
        };
        Ok(ModelConfig { model_type, text, quantization })
    }
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 60 { format!("{}...", &s[..60]) } else { s }
}

struct Fields<'a> {
    obj: &'a Map<String, Value>,
    prefix: &'a str,
}

impl Fields<'_> {
    fn get(&self, name: &str) -> Option<&Value> {
        match self.obj.get(name) {
            None | Some(Value::Null) => None,
            Some(v) => Some(v),
        }
    }
    fn usize(&self, name: &str, default: usize) -> Result<usize> {
        Ok(self.opt_usize(name)?.unwrap_or(default))
    }
    fn opt_usize(&self, name: &str) -> Result<Option<usize>> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) => Ok(Some(n as usize)),
                None => bail!("{}{name} must be a non-negative integer, found {}", self.prefix, short(v)),
            },
        }
    }
    fn u64(&self, name: &str, default: u64) -> Result<u64> {
        match self.get(name) {
            None => Ok(default),
            Some(v) => v
                .as_u64()
                .with_context(|| format!("{}{name} must be a non-negative integer, found {}", self.prefix, short(v))),
        }
    }
    fn f64(&self, name: &str, default: f64) -> Result<f64> {
        match self.get(name) {
            None => Ok(default),
            Some(v) => {
                v.as_f64().with_context(|| format!("{}{name} must be a number, found {}", self.prefix, short(v)))
            }
        }
    }
    fn bool(&self, name: &str, default: bool) -> Result<bool> {
        match self.get(name) {
            None => Ok(default),
            Some(v) => {
                v.as_bool().with_context(|| format!("{}{name} must be true or false, found {}", self.prefix, short(v)))
            }
        }
    }
    fn string(&self, name: &str) -> Result<Option<String>> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => bail!("{}{name} must be a string, found {}", self.prefix, short(v)),
        }
    }
}

fn eos_list(v: &Value, field: &str) -> Result<Vec<u32>> {
    match v {
        Value::Null => Ok(vec![]),
        Value::Number(n) => {
            Ok(vec![n.as_u64().with_context(|| format!("{field} must be a token id, found {n}"))? as u32])
        }
        Value::Array(a) => a
            .iter()
            .map(|x| x.as_u64().map(|x| x as u32).with_context(|| format!("{field} must hold token ids, found {x}")))
            .collect(),
        other => bail!("{field} must be a token id or a list of them, found {}", short(other)),
    }
}

fn parse_text(f: &Fields) -> Result<TextConfig> {
    let p = f.prefix;
    let num_hidden_layers = f.usize("num_hidden_layers", 40)?;
    let hidden_act = f.string("hidden_act")?.unwrap_or_else(|| "silu".into());
    let gate_name = f.string("output_gate_type")?.unwrap_or_else(|| hidden_act.clone());
    let gate_act = match gate_name.as_str() {
        "sigmoid" => GateAct::Sigmoid,
        "silu" => GateAct::Silu,
        other => bail!(
            "{p}output_gate_type {other:?} is not supported (Qwen4-Exp output gate activation must be \"sigmoid\" or \"silu\"{})",
            if f.get("output_gate_type").is_none() { "; it falls back to hidden_act" } else { "" }
        ),
    };

    // layer_types: explicit, or every `full_attention_interval`-th layer attention.
    let layer_types = match f.get("layer_types") {
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, t)| match t.as_str() {
                Some("linear_attention") => Ok(LayerType::LinearAttention),
                Some("full_attention" | "qwen_sparse_attention" | "indexed_attention") => Ok(LayerType::Attention),
                Some(other) => bail!(
                    "{p}layer_types[{i}] = {other:?} is not a Qwen4-Exp layer type \
                     (linear_attention, full_attention, qwen_sparse_attention or indexed_attention)"
                ),
                None => bail!("{p}layer_types[{i}] must be a string, found {t}"),
            })
            .collect::<Result<Vec<_>>>()?,
        Some(other) => bail!("{p}layer_types must be a list of strings, found {}", short(other)),
        None => {
            let interval = f.usize("full_attention_interval", 4)?;
            if interval == 0 {
                bail!("{p}full_attention_interval must be positive, found 0");
            }
            (0..num_hidden_layers)
                .map(|i| if (i + 1) % interval != 0 { LayerType::LinearAttention } else { LayerType::Attention })
                .collect()
        }
    };

    // RoPE: `rope_parameters` (or the legacy `rope_scaling`), with top-level `rope_theta` and
    // `partial_rotary_factor` as fallbacks, as transformers standardises them.
    let rope = match f.get("rope_parameters").or_else(|| f.get("rope_scaling")) {
        None => Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(other) => bail!("{p}rope_parameters must be an object, found {}", short(other)),
    };
    let rope_type = rope.get("rope_type").or_else(|| rope.get("type")).and_then(|t| t.as_str()).unwrap_or("default");
    if rope_type != "default" {
        bail!("{p}rope_parameters.rope_type {rope_type:?} is not supported (only \"default\" RoPE is implemented)");
    }
    let rope_theta = match rope.get("rope_theta") {
        Some(v) => v.as_f64().with_context(|| format!("{p}rope_parameters.rope_theta must be a number, found {v}"))?,
        None => f.f64("rope_theta", 10_000.0)?,
    };
    let partial_rotary_factor = match rope.get("partial_rotary_factor") {
        Some(v) => v
            .as_f64()
            .with_context(|| format!("{p}rope_parameters.partial_rotary_factor must be a number, found {v}"))?,
        None => f.f64("partial_rotary_factor", 1.0)?,
    };

    let qsa_fields =
        ["indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio"];
    let qsa_values: Vec<Option<usize>> = qsa_fields.iter().map(|n| f.opt_usize(n)).collect::<Result<_>>()?;
    let qsa = if qsa_values.iter().any(|v| v.is_some()) {
        let missing: Vec<&str> =
            qsa_fields.iter().zip(&qsa_values).filter(|(_, v)| v.is_none()).map(|(n, _)| *n).collect();
        if !missing.is_empty() {
            bail!(
                "QSA config is missing required fields: {}",
                missing.iter().map(|m| format!("{p}{m}")).collect::<Vec<_>>().join(", ")
            );
        }
        let v: Vec<usize> = qsa_values.into_iter().map(|v| v.unwrap()).collect();
        if let Some(i) = v.iter().position(|&x| x == 0) {
            bail!("QSA config values must be positive: {p}{} = 0", qsa_fields[i]);
        }
        Some(QsaConfig { n_heads: v[0], kv_heads: v[1], head_dim: v[2], budget: v[3], compress_ratio: v[4] })
    } else {
        None
    };

    let hidden_size = f.usize("hidden_size", 2048)?;
    let ple_layer_ids = match f.get("ple_layer_ids") {
        None => vec![],
        Some(Value::Array(a)) => {
            let mut ids = a
                .iter()
                .map(|x| x.as_u64().map(|x| x as usize))
                .collect::<Option<Vec<usize>>>()
                .with_context(|| format!("{p}ple_layer_ids must be a list of layer numbers"))?;
            ids.sort_unstable();
            ids.dedup();
            ids
        }
        Some(other) => bail!("{p}ple_layer_ids must be a list of layer numbers, found {}", short(other)),
    };
    let eos_token_ids = match f.get("eos_token_id") {
        None => vec![],
        Some(v) => eos_list(v, &format!("{p}eos_token_id"))?,
    };
    let opt_id = |name: &str| -> Result<Option<u32>> { Ok(f.opt_usize(name)?.map(|x| x as u32)) };
    if f.bool("attention_bias", false)? {
        bail!("{p}attention_bias = true is not supported (Qwen4-Exp attention has no biases)");
    }

    Ok(TextConfig {
        vocab_size: f.usize("vocab_size", 248_320)?,
        hidden_size,
        num_hidden_layers,
        num_attention_heads: f.usize("num_attention_heads", 16)?,
        num_key_value_heads: f.usize("num_key_value_heads", 2)?,
        head_dim: f.usize("head_dim", 256)?,
        hidden_act,
        gate_act,
        max_position_embeddings: f.usize("max_position_embeddings", 32_768)?,
        rms_norm_eps: f.f64("rms_norm_eps", 1e-6)?,
        tie_word_embeddings: f.bool("tie_word_embeddings", false)?,
        rope_theta,
        partial_rotary_factor,
        linear_conv_kernel_dim: f.usize("linear_conv_kernel_dim", 4)?,
        linear_key_head_dim: f.usize("linear_key_head_dim", 128)?,
        linear_value_head_dim: f.usize("linear_value_head_dim", 128)?,
        linear_num_key_heads: f.usize("linear_num_key_heads", 16)?,
        linear_num_value_heads: f.usize("linear_num_value_heads", 32)?,
        moe_intermediate_size: f.usize("moe_intermediate_size", 512)?,
        shared_expert_intermediate_size: f.usize("shared_expert_intermediate_size", 512)?,
        num_experts_per_tok: f.usize("num_experts_per_tok", 10)?,
        num_experts: f.usize("num_experts", 512)?,
        norm_topk_prob: f.bool("norm_topk_prob", true)?,
        layer_types,
        hc_count: f.usize("hc_count", 4)?,
        hc_lowrank: f.usize("hc_lowrank", 320)?,
        ple_layer_ids,
        ple_embed_dim: f.usize("ple_embed_dim", hidden_size)?,
        ple_conv_kernel_size: f.usize("ple_conv_kernel_size", 4)?,
        ngram_size: f.usize("ngram_size", 3)?,
        heads_per_ngram: f.usize("heads_per_ngram", 8)?,
        ngram_vocab_size_base: f.u64("ngram_vocab_size_base", 20_000_000)?,
        make_ngram_vocab_size_divisible_by: f.u64("make_ngram_vocab_size_divisible_by", 128)?,
        seed: f.u64("seed", 1234)?,
        split_ngram_parts: f.usize("split_ngram_parts", 512)?,
        qsa,
        eos_token_ids,
        pad_token_id: opt_id("pad_token_id")?,
        bos_token_id: opt_id("bos_token_id")?,
        mtp_num_hidden_layers: f.usize("mtp_num_hidden_layers", 1)?,
    })
}

/// transformers' `validate_architecture` for Qwen4-Exp, plus what the engine needs to be true.
fn validate(c: &TextConfig, p: &str) -> Result<()> {
    for (name, v) in [
        ("vocab_size", c.vocab_size),
        ("hidden_size", c.hidden_size),
        ("num_hidden_layers", c.num_hidden_layers),
        ("num_attention_heads", c.num_attention_heads),
        ("num_key_value_heads", c.num_key_value_heads),
        ("head_dim", c.head_dim),
        ("linear_conv_kernel_dim", c.linear_conv_kernel_dim),
        ("linear_key_head_dim", c.linear_key_head_dim),
        ("linear_value_head_dim", c.linear_value_head_dim),
        ("linear_num_key_heads", c.linear_num_key_heads),
        ("linear_num_value_heads", c.linear_num_value_heads),
        ("hc_lowrank", c.hc_lowrank),
    ] {
        if v == 0 {
            bail!("{p}{name} must be positive, found 0");
        }
    }
    if c.layer_types.len() != c.num_hidden_layers {
        bail!("{p}layer_types has {} entries but {p}num_hidden_layers is {}", c.layer_types.len(), c.num_hidden_layers);
    }
    if c.hidden_act != "silu" {
        bail!("{p}hidden_act {:?} is not supported (Qwen4-Exp experts and convolutions use \"silu\")", c.hidden_act);
    }
    if c.hc_count <= 1 {
        bail!("Qwen4-Exp requires hc_count > 1, got {p}hc_count = {}", c.hc_count);
    }
    if c.num_experts == 0 {
        bail!("{p}num_experts must be > 0, got 0");
    }
    if c.num_experts_per_tok == 0 || c.num_experts_per_tok > c.num_experts {
        bail!(
            "{p}num_experts_per_tok must be in [1, num_experts], got {} and {p}num_experts = {}",
            c.num_experts_per_tok,
            c.num_experts
        );
    }
    if c.moe_intermediate_size == 0 || c.shared_expert_intermediate_size == 0 {
        bail!(
            "{p}moe_intermediate_size and {p}shared_expert_intermediate_size must be > 0, got {} and {}",
            c.moe_intermediate_size,
            c.shared_expert_intermediate_size
        );
    }
    if !c.num_attention_heads.is_multiple_of(c.num_key_value_heads) {
        bail!(
            "{p}num_attention_heads ({}) must be a multiple of {p}num_key_value_heads ({})",
            c.num_attention_heads,
            c.num_key_value_heads
        );
    }
    if !c.linear_num_value_heads.is_multiple_of(c.linear_num_key_heads) {
        bail!(
            "{p}linear_num_value_heads ({}) must be a multiple of {p}linear_num_key_heads ({})",
            c.linear_num_value_heads,
            c.linear_num_key_heads
        );
    }
    if !(c.partial_rotary_factor > 0.0 && c.partial_rotary_factor <= 1.0) {
        bail!("{p}rope_parameters.partial_rotary_factor must be in (0, 1], found {}", c.partial_rotary_factor);
    }
    if !c.rotary_dim().is_multiple_of(2) || c.rotary_dim() == 0 {
        bail!(
            "RoPE needs an even, positive number of rotated dimensions: head_dim {} x partial_rotary_factor {} = {}",
            c.head_dim,
            c.partial_rotary_factor,
            c.rotary_dim()
        );
    }
    if let Some(q) = &c.qsa {
        if q.kv_heads != 1 {
            bail!("Qwen4-Exp QSA requires indexer_kv_heads=1, got {p}indexer_kv_heads = {}", q.kv_heads);
        }
        if q.budget % q.compress_ratio != 0 {
            bail!(
                "{p}indexer_budget ({}) must be divisible by {p}indexer_compress_ratio ({})",
                q.budget,
                q.compress_ratio
            );
        }
        if c.rotary_dim() > q.head_dim {
            bail!(
                "Qwen4-Exp attention RoPE dimensions must fit the QSA index head: rotary_dim={}, {p}indexer_head_dim={}",
                c.rotary_dim(),
                q.head_dim
            );
        }
    }
    if !c.ple_layer_ids.is_empty() {
        let heads = c.ngram_heads();
        if heads == 0 || c.ple_embed_dim == 0 || !c.ple_embed_dim.is_multiple_of(heads) {
            bail!(
                "{p}ple_embed_dim and the total number of n-gram heads must be positive, and ple_embed_dim must be \
                 divisible by the number of heads: {} % {heads} != 0 ({p}ngram_size = {}, {p}heads_per_ngram = {})",
                c.ple_embed_dim,
                c.ngram_size,
                c.heads_per_ngram
            );
        }
        let bad: Vec<usize> = c.ple_layer_ids.iter().copied().filter(|&l| l < 1 || l > c.num_hidden_layers).collect();
        if !bad.is_empty() {
            bail!("{p}ple_layer_ids must contain one-indexed ids in [1, {}], got {bad:?}", c.num_hidden_layers);
        }
        let non_linear: Vec<usize> =
            c.ple_layer_ids.iter().copied().filter(|&l| c.layer_types[l - 1] != LayerType::LinearAttention).collect();
        if !non_linear.is_empty() {
            bail!(
                "Qwen4-Exp PLE is only supported on linear_attention layers, got PLE on layers {non_linear:?} ({p}ple_layer_ids)"
            );
        }
        if c.eos_token_ids.is_empty() {
            bail!("{p}eos_token_id must be set when Qwen4-Exp PLE layers are enabled ({p}ple_layer_ids is not empty)");
        }
        if c.ple_conv_kernel_size == 0 {
            bail!("{p}ple_conv_kernel_size must be positive, found 0");
        }
        if c.split_ngram_parts == 0 {
            bail!("{p}split_ngram_parts must be positive, found 0");
        }
        if c.make_ngram_vocab_size_divisible_by == 0 {
            bail!("{p}make_ngram_vocab_size_divisible_by must be positive, found 0");
        }
    }
    for &e in &c.eos_token_ids {
        if e as usize >= c.vocab_size {
            bail!("{p}eos_token_id {e} is outside the vocabulary ({p}vocab_size = {})", c.vocab_size);
        }
    }
    Ok(())
}

fn parse_quant(q: &Value) -> Result<QuantConfig> {
    let obj = q.as_object().context("quantization must be an object")?;
    if let Some(mode) = obj.get("mode").and_then(|m| m.as_str())
        && mode != "affine"
    {
        bail!("quantization.mode {mode:?} is not supported (only MLX \"affine\" quantization)");
    }
    let fmt = |v: &Value, path: &str| -> Result<Affine> {
        let o = v.as_object().with_context(|| format!("quantization.{path} must be an object"))?;
        if let Some(mode) = o.get("mode").and_then(|m| m.as_str())
            && mode != "affine"
        {
            bail!("quantization.{path}.mode {mode:?} is not supported (only \"affine\")");
        }
        let bits =
            o.get("bits").and_then(|b| b.as_u64()).with_context(|| format!("quantization.{path}.bits missing"))?;
        let gs = o
            .get("group_size")
            .and_then(|b| b.as_u64())
            .with_context(|| format!("quantization.{path}.group_size missing"))?;
        let a = Affine::new(bits as u32, gs as usize);
        a.check(gs as usize).with_context(|| format!("quantization.{path}"))?;
        Ok(a)
    };
    let default = fmt(q, "(defaults)")?;
    let mut overrides = BTreeMap::new();
    for (k, v) in obj {
        if matches!(k.as_str(), "bits" | "group_size" | "mode") {
            continue;
        }
        match v {
            Value::Object(_) => {
                overrides.insert(k.clone(), Some(fmt(v, k)?));
            }
            Value::Bool(false) => {
                overrides.insert(k.clone(), None);
            }
            Value::Bool(true) => {
                overrides.insert(k.clone(), Some(default));
            }
            _ => {}
        }
    }
    Ok(QuantConfig { default, overrides })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> Value {
        serde_json::json!({
            "model_type": "qwen4_exp",
            "text_config": {
                "vocab_size": 512, "hidden_size": 192, "num_hidden_layers": 4,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
                "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
                "ple_layer_ids": [2, 1], "ple_embed_dim": 128, "heads_per_ngram": 2,
                "indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 32,
                "indexer_budget": 16, "indexer_compress_ratio": 4,
                "num_experts": 8, "num_experts_per_tok": 3, "eos_token_id": 2,
                "output_gate_type": "sigmoid"
            }
        })
    }

    fn err(mut v: Value, path: &[&str], val: Value) -> String {
        let mut o = &mut v;
        for p in &path[..path.len() - 1] {
            o = o.get_mut(*p).unwrap();
        }
        o.as_object_mut().unwrap().insert(path[path.len() - 1].into(), val);
        format!("{:#}", ModelConfig::from_value(&v).unwrap_err())
    }

    #[test]
    fn parses_and_normalises() {
        let c = ModelConfig::from_value(&base()).unwrap();
        assert_eq!(c.text.ple_layer_ids, vec![1, 2]);
        assert_eq!(c.text.layer_types[3], LayerType::Attention);
        assert_eq!(c.text.rotary_dim(), 16);
        assert_eq!(c.text.gate_act, GateAct::Sigmoid);
        assert_eq!(c.text.ngram_row_dim(), 32);
        assert_eq!(c.text.qsa.as_ref().unwrap().block_topk(), 4);
    }

    #[test]
    fn layer_type_spellings_and_interval() {
        for t in ["full_attention", "qwen_sparse_attention", "indexed_attention"] {
            let mut v = base();
            v["text_config"]["layer_types"][3] = t.into();
            assert!(ModelConfig::from_value(&v).is_ok(), "{t}");
        }
        let mut v = base();
        v["text_config"].as_object_mut().unwrap().remove("layer_types");
        let c = ModelConfig::from_value(&v).unwrap();
        assert_eq!(c.text.layer_types[3], LayerType::Attention);
        assert_eq!(c.text.layer_types[2], LayerType::LinearAttention);
    }

    #[test]
    fn rejects_with_field_and_value() {
        let e = err(base(), &["text_config", "hc_count"], 1.into());
        assert!(e.contains("hc_count") && e.contains('1'), "{e}");
        let e = err(base(), &["text_config", "num_experts_per_tok"], 9.into());
        assert!(e.contains("num_experts_per_tok") && e.contains('9'), "{e}");
        let e = err(base(), &["text_config", "indexer_kv_heads"], 2.into());
        assert!(e.contains("indexer_kv_heads") && e.contains('2'), "{e}");
        let e = err(base(), &["text_config", "indexer_budget"], 18.into());
        assert!(e.contains("indexer_budget") && e.contains("18"), "{e}");
        let e = err(base(), &["text_config", "indexer_head_dim"], 8.into());
        assert!(e.contains("rotary_dim=16") && e.contains("indexer_head_dim=8"), "{e}");
        let e = err(base(), &["text_config", "ple_layer_ids"], serde_json::json!([4]));
        assert!(e.contains("linear_attention") && e.contains("[4]"), "{e}");
        let e = err(base(), &["text_config", "ple_layer_ids"], serde_json::json!([0, 9]));
        assert!(e.contains("ple_layer_ids") && e.contains("[0, 9]"), "{e}");
        let e = err(base(), &["text_config", "ple_embed_dim"], 102.into());
        assert!(e.contains("ple_embed_dim") && e.contains("102"), "{e}");
        let e = err(base(), &["text_config", "output_gate_type"], "relu".into());
        assert!(e.contains("output_gate_type") && e.contains("relu"), "{e}");
        let e = err(base(), &["text_config", "eos_token_id"], Value::Null);
        assert!(e.contains("eos_token_id"), "{e}");
        let e = err(base(), &["text_config", "indexer_budget"], Value::Null);
        assert!(e.contains("missing") && e.contains("indexer_budget"), "{e}");
        let e = err(base(), &["text_config", "hidden_size"], "big".into());
        assert!(e.contains("hidden_size") && e.contains("big"), "{e}");
        let e = err(
            base(),
            &["text_config", "layer_types"],
            serde_json::json!(["linear_attention", "mamba", "linear_attention", "full_attention"]),
        );
        assert!(e.contains("layer_types[1]") && e.contains("mamba"), "{e}");
        let e = err(base(), &["model_type"], "llama".into());
        assert!(e.contains("unsupported model_type") && e.contains("llama"), "{e}");
    }

    #[test]
    fn not_json() {
        assert!(format!("{:#}", ModelConfig::parse("{oops").unwrap_err()).contains("not valid JSON"));
    }

    #[test]
    fn quantization_block() {
        let mut v = base();
        v["quantization"] = serde_json::json!({
            "group_size": 32, "bits": 4, "mode": "affine",
            "language_model.model.layers.0.mlp.gate": {"group_size": 64, "bits": 8},
            "language_model.lm_head": false
        });
        let q = ModelConfig::from_value(&v).unwrap().quantization.unwrap();
        assert_eq!(q.default, Affine::new(4, 32));
        assert_eq!(q.for_path("language_model.model.layers.0.mlp.gate"), Some(Affine::new(8, 64)));
        assert_eq!(q.for_path("language_model.lm_head"), None);
        assert_eq!(q.for_path("anything"), Some(Affine::new(4, 32)));
        v["quantization"]["bits"] = 7.into();
        assert!(format!("{:#}", ModelConfig::from_value(&v).unwrap_err()).contains("7 bits"));
    }
}
