//! The tensors a `qwen4_exp` config implies: names, shapes, roles, and how BF16 sources are packed.
//!
//! Names are the Hugging Face text-model names (`layers.3.linear_attn.in_proj_qkv.weight`,
//! `lm_head.weight`, `mtp.layers.0.self_attn.q_proj.weight`), used unchanged from checkpoint key to
//! store entry to kernel argument. Routed experts are the exception: the checkpoint's fused
//! `experts.gate_up_proj` is split into `gate_proj` and `up_proj`, and each expert becomes one record
//! of the expert file instead of a dense tensor. The PLE n-gram tables go to `ngram.bin`.

use crate::config::{LayerType, TextConfig};
use crate::ngram::NgramHash;
use crate::quant::Affine;

/// What a tensor is, which decides whether and how it is quantized.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A linear layer's `[out, in]` weight.
    Linear,
    /// A token-embedding table `[vocab, hidden]`.
    Embedding,
    /// A router (`mlp.gate`, `shared_expert_gate`): 8-bit in MLX conversions.
    Router,
    /// A norm weight (never quantized).
    Norm,
    /// A depthwise convolution weight `[channels, 1, kernel]` (never quantized).
    Conv,
    /// Other parameters (`A_log`, `dt_bias`), never quantized.
    Param,
}

#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub role: Role,
    /// May be absent from a checkpoint (e.g. the MTP mixer's unused `block_inject_weight`).
    pub optional: bool,
}

impl TensorSpec {
    fn new(name: String, shape: Vec<usize>, role: Role) -> TensorSpec {
        TensorSpec { name, shape, role, optional: false }
    }

    pub fn quantizable(&self) -> bool {
        matches!(self.role, Role::Linear | Role::Embedding | Role::Router)
    }

    /// Input width (the quantized dimension) of a quantizable tensor.
    pub fn in_features(&self) -> usize {
        *self.shape.last().unwrap()
    }
}

/// How a BF16/F16/F32 checkpoint is packed: the usual MLX conversion (4-bit g64; routers 8-bit g64;
/// n-gram rows 4-bit g32), leaving in bf16 every width a group does not divide.
pub fn bf16_pack_rule(role: Role, in_features: usize) -> Option<Affine> {
    let fmt = match role {
        Role::Linear | Role::Embedding => Affine::new(4, 64),
        Role::Router => Affine::new(8, 64),
        Role::Norm | Role::Conv | Role::Param => return None,
    };
    in_features.is_multiple_of(fmt.group_size).then_some(fmt)
}

/// The n-gram table rule for BF16 sources.
pub fn bf16_ngram_rule(cols: usize) -> Option<Affine> {
    let fmt = Affine::new(4, 32);
    cols.is_multiple_of(fmt.group_size).then_some(fmt)
}

/// A decoder layer that owns routed experts: trunk layer `i`, or MTP layer `k` (record slot
/// `num_hidden_layers + k`).
#[derive(Clone, Debug, PartialEq)]
pub struct MoeLayer {
    /// Name prefix: `layers.3` or `mtp.layers.0`.
    pub prefix: String,
}

/// The three matrices of a routed expert, in record order.
pub const EXPERT_MATRICES: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];

/// Shapes `[out, in]` of gate, up and down for one expert.
pub fn expert_shapes(c: &TextConfig) -> [[usize; 2]; 3] {
    let (h, i) = (c.hidden_size, c.moe_intermediate_size);
    [[i, h], [i, h], [h, i]]
}

/// The model's expert-owning layers: trunk layers, then the MTP layers.
pub fn moe_layers(c: &TextConfig, mtp_layers: usize) -> Vec<MoeLayer> {
    let mut v: Vec<MoeLayer> = (0..c.num_hidden_layers).map(|i| MoeLayer { prefix: format!("layers.{i}") }).collect();
    v.extend((0..mtp_layers).map(|k| MoeLayer { prefix: format!("mtp.layers.{k}") }));
    v
}

/// Rows and columns of a PLE layer's n-gram table.
pub fn ngram_table_shape(c: &TextConfig, layer: usize) -> Option<(u64, usize)> {
    let k = c.ple_index(layer)?;
    Some((NgramHash::new(c, k).table_rows, c.ngram_row_dim()))
}

fn hyper_connection(c: &TextConfig, p: &str, combine: bool, out: &mut Vec<TensorSpec>) {
    let (hc, r) = (c.hc_hidden(), c.hc_lowrank);
    out.push(TensorSpec::new(format!("{p}.hc_norm.weight"), vec![hc], Role::Norm));
    out.push(TensorSpec::new(format!("{p}.input_mix_weight_down.weight"), vec![r, hc], Role::Linear));
    out.push(TensorSpec::new(format!("{p}.input_mix_weight_up.weight"), vec![hc, r], Role::Linear));
    if combine {
        out.push(TensorSpec::new(format!("{p}.block_inject_weight.weight"), vec![c.hc_count, hc], Role::Linear));
    }
}

fn attention(c: &TextConfig, p: &str, out: &mut Vec<TensorSpec>) {
    let (h, nh, nkv, d) = (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    out.push(TensorSpec::new(format!("{p}.q_proj.weight"), vec![nh * d * 2, h], Role::Linear));
    out.push(TensorSpec::new(format!("{p}.k_proj.weight"), vec![nkv * d, h], Role::Linear));
    out.push(TensorSpec::new(format!("{p}.v_proj.weight"), vec![nkv * d, h], Role::Linear));
    out.push(TensorSpec::new(format!("{p}.o_proj.weight"), vec![h, nh * d], Role::Linear));
    out.push(TensorSpec::new(format!("{p}.q_norm.weight"), vec![d], Role::Norm));
    out.push(TensorSpec::new(format!("{p}.k_norm.weight"), vec![d], Role::Norm));
    if let Some(q) = &c.qsa {
        out.push(TensorSpec::new(
            format!("{p}.indexer.index_qk_proj.weight"),
            vec![(q.n_heads + q.kv_heads) * q.head_dim, h],
            Role::Linear,
        ));
        out.push(TensorSpec::new(format!("{p}.indexer.q_layernorm.weight"), vec![q.head_dim], Role::Norm));
        out.push(TensorSpec::new(format!("{p}.indexer.k_layernorm.weight"), vec![q.head_dim], Role::Norm));
    }
}

fn gated_delta_net(c: &TextConfig, p: &str, out: &mut Vec<TensorSpec>) {
    let h = c.hidden_size;
    let nv = c.linear_num_value_heads;
    out.push(TensorSpec::new(format!("{p}.in_proj_qkv.weight"), vec![c.gdn_conv_dim(), h], Role::Linear));
    out.push(TensorSpec::new(format!("{p}.in_proj_z.weight"), vec![c.gdn_value_dim(), h], Role::Linear));
    out.push(TensorSpec::new(format!("{p}.in_proj_b.weight"), vec![nv, h], Role::Linear));
    out.push(TensorSpec::new(format!("{p}.in_proj_a.weight"), vec![nv, h], Role::Linear));
    out.push(TensorSpec::new(
        format!("{p}.conv1d.weight"),
        vec![c.gdn_conv_dim(), 1, c.linear_conv_kernel_dim],
        Role::Conv,
    ));
    out.push(TensorSpec::new(format!("{p}.dt_bias"), vec![nv], Role::Param));
    out.push(TensorSpec::new(format!("{p}.A_log"), vec![nv], Role::Param));
    out.push(TensorSpec::new(format!("{p}.norm.weight"), vec![c.linear_value_head_dim], Role::Norm));
    out.push(TensorSpec::new(format!("{p}.out_proj.weight"), vec![h, c.gdn_value_dim()], Role::Linear));
}

fn ple(c: &TextConfig, p: &str, out: &mut Vec<TensorSpec>) {
    let (h, hc, d) = (c.hidden_size, c.hc_hidden(), c.ple_embed_dim);
    out.push(TensorSpec::new(format!("{p}.key_proj.weight"), vec![hc, d], Role::Linear));
    out.push(TensorSpec::new(format!("{p}.value_proj.weight"), vec![h, d], Role::Linear));
    out.push(TensorSpec::new(format!("{p}.norm_key.weight"), vec![hc], Role::Norm));
    out.push(TensorSpec::new(format!("{p}.norm_query.weight"), vec![hc], Role::Norm));
    out.push(TensorSpec::new(format!("{p}.norm_conv.weight"), vec![hc], Role::Norm));
    out.push(TensorSpec::new(format!("{p}.conv1d.weight"), vec![hc, 1, c.ple_conv_kernel_size], Role::Conv));
}

fn moe_dense(c: &TextConfig, p: &str, out: &mut Vec<TensorSpec>) {
    let (h, e, s) = (c.hidden_size, c.num_experts, c.shared_expert_intermediate_size);
    out.push(TensorSpec::new(format!("{p}.gate.weight"), vec![e, h], Role::Router));
    out.push(TensorSpec::new(format!("{p}.shared_expert.gate_proj.weight"), vec![s, h], Role::Linear));
    out.push(TensorSpec::new(format!("{p}.shared_expert.up_proj.weight"), vec![s, h], Role::Linear));
    out.push(TensorSpec::new(format!("{p}.shared_expert.down_proj.weight"), vec![h, s], Role::Linear));
    out.push(TensorSpec::new(format!("{p}.shared_expert_gate.weight"), vec![1, h], Role::Router));
}

/// Every non-expert, non-n-gram tensor, in model order. `mtp_layers` is 0 for a checkpoint without
/// the MTP head.
pub fn dense_specs(c: &TextConfig, mtp_layers: usize) -> Vec<TensorSpec> {
    let mut v = Vec::new();
    v.push(TensorSpec::new("embed_tokens.weight".into(), vec![c.vocab_size, c.hidden_size], Role::Embedding));
    for (i, t) in c.layer_types.iter().enumerate() {
        let p = format!("layers.{i}");
        if c.ple_index(i).is_some() {
            ple(c, &format!("{p}.ple"), &mut v);
        }
        hyper_connection(c, &format!("{p}.attn_hyper_connection"), true, &mut v);
        hyper_connection(c, &format!("{p}.mlp_hyper_connection"), true, &mut v);
        match t {
            LayerType::LinearAttention => gated_delta_net(c, &format!("{p}.linear_attn"), &mut v),
            LayerType::Attention => attention(c, &format!("{p}.self_attn"), &mut v),
        }
        moe_dense(c, &format!("{p}.mlp"), &mut v);
    }
    hyper_connection(c, "hyper_connection_mixer", false, &mut v);
    if !c.tie_word_embeddings {
        v.push(TensorSpec::new("lm_head.weight".into(), vec![c.vocab_size, c.hidden_size], Role::Linear));
    }
    if mtp_layers > 0 {
        let h = c.hidden_size;
        v.push(TensorSpec::new("mtp.fc_embedding.weight".into(), vec![h, h], Role::Linear));
        v.push(TensorSpec::new("mtp.fc_hidden.weight".into(), vec![h, h], Role::Linear));
        v.push(TensorSpec::new("mtp.pre_fc_norm_embedding.weight".into(), vec![h], Role::Norm));
        v.push(TensorSpec::new("mtp.pre_fc_norm_hidden.weight".into(), vec![c.hc_hidden()], Role::Norm));
        hyper_connection(c, "mtp.hyper_connection_mixer", false, &mut v);
        let mut inject = TensorSpec::new(
            "mtp.hyper_connection_mixer.block_inject_weight.weight".into(),
            vec![c.hc_count, c.hc_hidden()],
            Role::Linear,
        );
        inject.optional = true;
        v.push(inject);
        for k in 0..mtp_layers {
            let p = format!("mtp.layers.{k}");
            hyper_connection(c, &format!("{p}.attn_hyper_connection"), true, &mut v);
            hyper_connection(c, &format!("{p}.mlp_hyper_connection"), true, &mut v);
            attention(c, &format!("{p}.self_attn"), &mut v);
            moe_dense(c, &format!("{p}.mlp"), &mut v);
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;

    #[test]
    fn released_shape_counts() {
        let cfg = ModelConfig::from_value(&serde_json::json!({
            "model_type": "qwen4_exp_text", "vocab_size": 248320, "hidden_size": 2560, "num_hidden_layers": 48,
            "num_attention_heads": 24, "num_key_value_heads": 2, "head_dim": 256,
            "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25},
            "linear_num_key_heads": 16, "linear_num_value_heads": 48, "output_gate_type": "sigmoid",
            "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 640,
            "shared_expert_intermediate_size": 640, "ple_layer_ids": [1], "ple_embed_dim": 2560,
            "indexer_n_heads": 16, "indexer_kv_heads": 1, "indexer_head_dim": 128, "indexer_budget": 2048,
            "indexer_compress_ratio": 64, "eos_token_id": 248044
        }))
        .unwrap()
        .text;
        let specs = dense_specs(&cfg, 1);
        assert!(specs.iter().all(|s| !s.name.contains("experts")));
        let expert_params: usize =
            expert_shapes(&cfg).iter().map(|s| s[0] * s[1]).sum::<usize>() * cfg.num_experts * cfg.num_hidden_layers;
        // About 121B routed parameters (MODEL.md).
        assert!((expert_params as f64 / 1e9 - 120.8).abs() < 1.0, "{expert_params}");
        let (rows, cols) = ngram_table_shape(&cfg, 0).unwrap();
        assert_eq!(cols, 160);
        assert!(rows > 300_000_000 && rows < 340_000_000, "{rows}");
    }
}
