//! The dimensions of a synthetic `qwen4_exp` model and the `config.json` they imply.

use serde_json::{Value, json};

/// Every dimension of a synthetic model. Build one from a preset ([`SynthShape::tiny`],
/// [`SynthShape::demo`]) or from a few headline dimensions ([`SynthShape::from_dims`]), then change
/// fields with struct update syntax if needed.
#[derive(Clone, Debug, PartialEq)]
pub struct SynthShape {
    /// At least [`super::TOKENIZER_VOCAB`] (the bundled tokenizer's ids); extra rows are never produced.
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    /// Every `full_attention_interval`-th layer is QSA attention, the others Gated DeltaNet.
    pub full_attention_interval: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub shared_expert_intermediate_size: usize,
    pub hc_lowrank: usize,
    /// One-indexed layers with a PLE block (Gated DeltaNet layers only).
    pub ple_layer_ids: Vec<usize>,
    pub ple_embed_dim: usize,
    /// Heads per n-gram order; with n-gram size 3 a PLE layer has `2 * heads_per_ngram` tables.
    pub heads_per_ngram: usize,
    /// Rows of the first head's table (successive primes from here on).
    pub ngram_vocab_size_base: u64,
    /// Shards the n-gram table is saved in (`ngram_embedding.shard_{i}.weight`).
    pub split_ngram_parts: usize,
    pub indexer_n_heads: usize,
    pub indexer_head_dim: usize,
    pub indexer_budget: usize,
    pub indexer_compress_ratio: usize,
    /// Layers of the MTP head (0: none).
    pub mtp_layers: usize,
}

/// The headline dimensions [`SynthShape::from_dims`] scales a model from.
#[derive(Clone, Debug, PartialEq)]
pub struct SynthDims {
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub vocab_size: usize,
    pub ngram_vocab_size_base: u64,
}

impl Default for SynthDims {
    fn default() -> SynthDims {
        SynthDims {
            hidden_size: 1024,
            num_hidden_layers: 4,
            num_experts: 32,
            num_experts_per_tok: 4,
            moe_intermediate_size: 512,
            vocab_size: 32768,
            ngram_vocab_size_base: 100_003,
        }
    }
}

impl SynthShape {
    /// About 3.5 MB of BF16: 2 layers (Gated DeltaNet with PLE, then QSA attention), an MTP layer,
    /// 6 experts top-2, hidden 192: the golden fixtures' proportions.
    pub fn tiny() -> SynthShape {
        SynthShape {
            vocab_size: 512,
            hidden_size: 192,
            num_hidden_layers: 2,
            full_attention_interval: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 32,
            linear_num_key_heads: 2,
            linear_num_value_heads: 4,
            linear_key_head_dim: 32,
            linear_value_head_dim: 32,
            num_experts: 6,
            num_experts_per_tok: 2,
            moe_intermediate_size: 64,
            shared_expert_intermediate_size: 64,
            hc_lowrank: 32,
            ple_layer_ids: vec![1],
            ple_embed_dim: 64,
            heads_per_ngram: 1,
            ngram_vocab_size_base: 211,
            split_ngram_parts: 4,
            indexer_n_heads: 4,
            indexer_head_dim: 32,
            indexer_budget: 8,
            indexer_compress_ratio: 2,
            mtp_layers: 1,
        }
    }

    /// About 50 MB of BF16 for demonstrations: hidden 256, 4 layers (3 Gated DeltaNet, 1 QSA),
    /// 16 experts top-4, PLE on the first two layers, an MTP layer.
    pub fn demo() -> SynthShape {
        SynthShape {
            vocab_size: 1024,
            hidden_size: 256,
            num_hidden_layers: 4,
            full_attention_interval: 4,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 64,
            linear_num_key_heads: 2,
            linear_num_value_heads: 4,
            linear_key_head_dim: 64,
            linear_value_head_dim: 64,
            num_experts: 16,
            num_experts_per_tok: 4,
            moe_intermediate_size: 256,
            shared_expert_intermediate_size: 256,
            hc_lowrank: 64,
            ple_layer_ids: vec![1, 2],
            ple_embed_dim: 128,
            heads_per_ngram: 2,
            ngram_vocab_size_base: 20_011,
            split_ngram_parts: 8,
            indexer_n_heads: 4,
            indexer_head_dim: 64,
            indexer_budget: 64,
            indexer_compress_ratio: 8,
            mtp_layers: 1,
        }
    }

    /// The released Qwen3.8-Flash-Next shape (MODEL.md): hidden 2560, 48 layers (every 4th QSA
    /// attention), vocab 248320, 24 query heads and 2 KV heads of 256, GDN 16 key / 48 value heads of
    /// 128, 512 experts top-10 of width 640 plus a shared expert of 640, 4 streams with a rank-320
    /// mixer, PLE on layer 1 with 16 n-gram heads of 160 columns, an MTP layer. The QSA indexer's
    /// sizes are not in MODEL.md; 16 heads of 128, a 2048-token budget and blocks of 64 are assumed.
    /// Change `num_hidden_layers`, `num_experts` or the n-gram base to fit a disk.
    pub fn flash() -> SynthShape {
        SynthShape {
            vocab_size: 248_320,
            hidden_size: 2560,
            num_hidden_layers: 48,
            full_attention_interval: 4,
            num_attention_heads: 24,
            num_key_value_heads: 2,
            head_dim: 256,
            linear_num_key_heads: 16,
            linear_num_value_heads: 48,
            linear_key_head_dim: 128,
            linear_value_head_dim: 128,
            num_experts: 512,
            num_experts_per_tok: 10,
            moe_intermediate_size: 640,
            shared_expert_intermediate_size: 640,
            hc_lowrank: 320,
            ple_layer_ids: vec![1],
            ple_embed_dim: 2560,
            heads_per_ngram: 8,
            ngram_vocab_size_base: 20_000_000,
            split_ngram_parts: 64,
            indexer_n_heads: 16,
            indexer_head_dim: 128,
            indexer_budget: 2048,
            indexer_compress_ratio: 64,
            mtp_layers: 1,
        }
    }

    /// A model scaled from headline dimensions (for benchmarks), with the released model's
    /// proportions elsewhere: every 4th layer attention, PLE on the first layer, 16 n-gram heads of
    /// 32 columns, an MTP layer, shared expert as wide as a routed one.
    pub fn from_dims(d: &SynthDims) -> SynthShape {
        let h = d.hidden_size;
        let wide = h >= 1024;
        let head_dim = if wide { 128 } else { 64 };
        SynthShape {
            vocab_size: d.vocab_size,
            hidden_size: h,
            num_hidden_layers: d.num_hidden_layers,
            full_attention_interval: 4,
            num_attention_heads: 2 * (h / 256).max(1),
            num_key_value_heads: 2,
            head_dim,
            linear_num_key_heads: (h / 256).max(2),
            linear_num_value_heads: 2 * (h / 256).max(2),
            linear_key_head_dim: head_dim,
            linear_value_head_dim: head_dim,
            num_experts: d.num_experts,
            num_experts_per_tok: d.num_experts_per_tok,
            moe_intermediate_size: d.moe_intermediate_size,
            shared_expert_intermediate_size: d.moe_intermediate_size,
            hc_lowrank: 64,
            ple_layer_ids: vec![1],
            ple_embed_dim: 512,
            heads_per_ngram: 8,
            ngram_vocab_size_base: d.ngram_vocab_size_base,
            split_ngram_parts: 16,
            indexer_n_heads: 4,
            indexer_head_dim: 64,
            indexer_budget: 256,
            indexer_compress_ratio: 16,
            mtp_layers: 1,
        }
    }

    /// The `config.json` of the checkpoint: a `qwen4_exp` wrapper around the text config.
    pub fn config_json(&self) -> Value {
        let layer_types: Vec<&str> =
            (0..self.num_hidden_layers)
                .map(|i| {
                    if (i + 1) % self.full_attention_interval.max(1) == 0 {
                        "full_attention"
                    } else {
                        "linear_attention"
                    }
                })
                .collect();
        let mut text = json!({
            "model_type": "qwen4_exp_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "layer_types": layer_types,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "output_gate_type": "sigmoid",
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": false,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
            "attention_bias": false,
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "moe_intermediate_size": self.moe_intermediate_size,
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
            "num_experts_per_tok": self.num_experts_per_tok,
            "num_experts": self.num_experts,
            "norm_topk_prob": true,
            "hc_count": 4,
            "hc_lowrank": self.hc_lowrank,
        });
        let rest = json!({
            "ple_layer_ids": self.ple_layer_ids,
            "ple_embed_dim": self.ple_embed_dim,
            "ple_conv_kernel_size": 4,
            "ngram_size": 3,
            "heads_per_ngram": self.heads_per_ngram,
            "ngram_vocab_size_base": self.ngram_vocab_size_base,
            "make_ngram_vocab_size_divisible_by": 128,
            "seed": 1234,
            "split_ngram_parts": self.split_ngram_parts,
            "indexer_n_heads": self.indexer_n_heads,
            "indexer_kv_heads": 1,
            "indexer_head_dim": self.indexer_head_dim,
            "indexer_budget": self.indexer_budget,
            "indexer_compress_ratio": self.indexer_compress_ratio,
            "mtp_num_hidden_layers": self.mtp_layers,
            "eos_token_id": super::EOS_TOKEN,
            "pad_token_id": null,
            "bos_token_id": null
        });
        if let (Value::Object(t), Value::Object(r)) = (&mut text, rest) {
            t.extend(r);
        }
        json!({
            "architectures": ["Qwen4ExpForConditionalGeneration"],
            "model_type": "qwen4_exp",
            "text_config": text,
            "tie_word_embeddings": false,
            "torch_dtype": "bfloat16"
        })
    }
}
