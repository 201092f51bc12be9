//! Per-layer handles to the store's dense tensors, resolved once by name.
//!
//! A handle is an index into the store's tensor table; [`W::lin`] borrows the mapped bytes on
//! use, so nothing is copied or decoded ahead of time. Small vectors (norm weights,
//! `A_log`, `dt_bias`, conv kernels) are decoded to f32 once at load: they are a few KB per layer.

use anyhow::{Context, Result};
use cherenkov_model::LayerType;
use cherenkov_model::config::TextConfig;
use cherenkov_model::store::Store;

use crate::linear::Linear;

/// A linear weight of the store.
#[derive(Clone, Copy, Debug)]
pub struct W(pub usize);

impl W {
    pub fn lin<'s>(&self, store: &'s Store) -> Linear<'s> {
        Linear::from_view(&store.view(self.0)).expect("validated at load")
    }
}

fn w(store: &Store, name: &str) -> Result<W> {
    let i = store.tensor_index(name)?;
    Linear::from_view(&store.view(i)).with_context(|| format!("tensor {name}"))?;
    Ok(W(i))
}

fn f32s(store: &Store, name: &str) -> Result<Vec<f32>> {
    store.tensor(name)?.to_f32().with_context(|| format!("tensor {name}"))
}

/// A hyper-connection read (`GatedResidual`): norm, low-rank mixer, optional injection weights.
pub struct HyperConnection {
    pub hc_norm: Vec<f32>,
    pub input_mix_weight_down: W,
    pub input_mix_weight_up: W,
    pub block_inject_weight: Option<W>,
}

impl HyperConnection {
    fn load(store: &Store, p: &str, combine: bool) -> Result<Self> {
        Ok(HyperConnection {
            hc_norm: f32s(store, &format!("{p}.hc_norm.weight"))?,
            input_mix_weight_down: w(store, &format!("{p}.input_mix_weight_down.weight"))?,
            input_mix_weight_up: w(store, &format!("{p}.input_mix_weight_up.weight"))?,
            block_inject_weight: if combine {
                Some(w(store, &format!("{p}.block_inject_weight.weight"))?)
            } else {
                None
            },
        })
    }
}

pub struct GatedDeltaNet {
    pub in_proj_qkv: W,
    pub in_proj_z: W,
    pub in_proj_b: W,
    pub in_proj_a: W,
    /// `[conv_dim, kernel]`.
    pub conv1d: Vec<f32>,
    pub dt_bias: Vec<f32>,
    pub a_log: Vec<f32>,
    /// Plain RMSNorm weight of the gated output norm (`[value_head_dim]`).
    pub norm: Vec<f32>,
    pub out_proj: W,
}

pub struct Attention {
    pub q_proj: W,
    pub k_proj: W,
    pub v_proj: W,
    pub o_proj: W,
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
    pub indexer: Option<Indexer>,
}

pub struct Indexer {
    pub index_qk_proj: W,
    pub q_layernorm: Vec<f32>,
    pub k_layernorm: Vec<f32>,
}

pub struct Ple {
    /// Index among the PLE layers (seeds the n-gram hash).
    pub ple_index: usize,
    pub key_proj: W,
    pub value_proj: W,
    pub norm_key: Vec<f32>,
    pub norm_query: Vec<f32>,
    pub norm_conv: Vec<f32>,
    /// `[hc * hidden, kernel]`.
    pub conv1d: Vec<f32>,
}

pub struct Moe {
    /// Router `[num_experts, hidden]`.
    pub gate: W,
    pub shared_gate_proj: W,
    pub shared_up_proj: W,
    pub shared_down_proj: W,
    pub shared_expert_gate: W,
    /// Slot of this layer in the expert store (trunk layer index, or layers + k for MTP).
    pub expert_slot: usize,
}

pub enum Mixer {
    Gdn(GatedDeltaNet),
    Attention(Attention),
}

pub struct Layer {
    pub ple: Option<Ple>,
    pub attn_hc: HyperConnection,
    pub mixer: Mixer,
    pub mlp_hc: HyperConnection,
    pub moe: Moe,
}

pub struct Weights {
    pub embed_tokens: W,
    pub layers: Vec<Layer>,
    pub hyper_connection_mixer: HyperConnection,
    pub lm_head: W,
    /// The MTP head, when the store has one.
    pub mtp: Option<MtpWeights>,
}

/// The MTP head (`mtp.*`): a stem joining the trunk's residual with the next token's embedding,
/// decoder layers of QSA attention and MoE (no PLE), and a final mixer before the shared `lm_head`.
pub struct MtpWeights {
    pub fc_embedding: W,
    pub fc_hidden: W,
    pub pre_fc_norm_embedding: Vec<f32>,
    /// Zero-centred norm over the whole `hc * H` row.
    pub pre_fc_norm_hidden: Vec<f32>,
    pub hyper_connection_mixer: HyperConnection,
    pub layers: Vec<MtpLayer>,
}

pub struct MtpLayer {
    pub attn_hc: HyperConnection,
    pub attention: Attention,
    pub mlp_hc: HyperConnection,
    pub moe: Moe,
}

impl MtpWeights {
    fn load(store: &Store, layers: usize) -> Result<MtpWeights> {
        let trunk = store.config().num_hidden_layers;
        Ok(MtpWeights {
            fc_embedding: w(store, "mtp.fc_embedding.weight")?,
            fc_hidden: w(store, "mtp.fc_hidden.weight")?,
            pre_fc_norm_embedding: f32s(store, "mtp.pre_fc_norm_embedding.weight")?,
            pre_fc_norm_hidden: f32s(store, "mtp.pre_fc_norm_hidden.weight")?,
            hyper_connection_mixer: HyperConnection::load(store, "mtp.hyper_connection_mixer", false)?,
            layers: (0..layers)
                .map(|k| {
                    let p = format!("mtp.layers.{k}");
                    Ok(MtpLayer {
                        attn_hc: HyperConnection::load(store, &format!("{p}.attn_hyper_connection"), true)?,
                        attention: Attention::load(store, &format!("{p}.self_attn"))?,
                        mlp_hc: HyperConnection::load(store, &format!("{p}.mlp_hyper_connection"), true)?,
                        moe: Moe::load(store, &format!("{p}.mlp"), trunk + k)?,
                    })
                })
                .collect::<Result<_>>()?,
        })
    }
}

impl Weights {
    pub fn load(store: &Store) -> Result<Weights> {
        let c: &TextConfig = store.config();
        let mut layers = Vec::new();
        for (i, t) in c.layer_types.iter().enumerate() {
            let p = format!("layers.{i}");
            let ple = match c.ple_index(i) {
                Some(k) => {
                    let q = format!("{p}.ple");
                    Some(Ple {
                        ple_index: k,
                        key_proj: w(store, &format!("{q}.key_proj.weight"))?,
                        value_proj: w(store, &format!("{q}.value_proj.weight"))?,
                        norm_key: f32s(store, &format!("{q}.norm_key.weight"))?,
                        norm_query: f32s(store, &format!("{q}.norm_query.weight"))?,
                        norm_conv: f32s(store, &format!("{q}.norm_conv.weight"))?,
                        conv1d: f32s(store, &format!("{q}.conv1d.weight"))?,
                    })
                }
                None => None,
            };
            let mixer = match t {
                LayerType::LinearAttention => {
                    let q = format!("{p}.linear_attn");
                    Mixer::Gdn(GatedDeltaNet {
                        in_proj_qkv: w(store, &format!("{q}.in_proj_qkv.weight"))?,
                        in_proj_z: w(store, &format!("{q}.in_proj_z.weight"))?,
                        in_proj_b: w(store, &format!("{q}.in_proj_b.weight"))?,
                        in_proj_a: w(store, &format!("{q}.in_proj_a.weight"))?,
                        conv1d: f32s(store, &format!("{q}.conv1d.weight"))?,
                        dt_bias: f32s(store, &format!("{q}.dt_bias"))?,
                        a_log: f32s(store, &format!("{q}.A_log"))?,
                        norm: f32s(store, &format!("{q}.norm.weight"))?,
                        out_proj: w(store, &format!("{q}.out_proj.weight"))?,
                    })
                }
                LayerType::Attention => Mixer::Attention(Attention::load(store, &format!("{p}.self_attn"))?),
            };
            layers.push(Layer {
                ple,
                attn_hc: HyperConnection::load(store, &format!("{p}.attn_hyper_connection"), true)?,
                mixer,
                mlp_hc: HyperConnection::load(store, &format!("{p}.mlp_hyper_connection"), true)?,
                moe: Moe::load(store, &format!("{p}.mlp"), i)?,
            });
        }
        let lm_head = if c.tie_word_embeddings { "embed_tokens.weight" } else { "lm_head.weight" };
        Ok(Weights {
            embed_tokens: w(store, "embed_tokens.weight")?,
            layers,
            hyper_connection_mixer: HyperConnection::load(store, "hyper_connection_mixer", false)?,
            lm_head: w(store, lm_head)?,
            mtp: match store.manifest.mtp_layers {
                0 => None,
                n => Some(MtpWeights::load(store, n).context("loading the MTP head")?),
            },
        })
    }
}

impl Attention {
    pub fn load(store: &Store, q: &str) -> Result<Attention> {
        let c = store.config();
        Ok(Attention {
            q_proj: w(store, &format!("{q}.q_proj.weight"))?,
            k_proj: w(store, &format!("{q}.k_proj.weight"))?,
            v_proj: w(store, &format!("{q}.v_proj.weight"))?,
            o_proj: w(store, &format!("{q}.o_proj.weight"))?,
            q_norm: f32s(store, &format!("{q}.q_norm.weight"))?,
            k_norm: f32s(store, &format!("{q}.k_norm.weight"))?,
            indexer: match c.qsa {
                Some(_) => Some(Indexer {
                    index_qk_proj: w(store, &format!("{q}.indexer.index_qk_proj.weight"))?,
                    q_layernorm: f32s(store, &format!("{q}.indexer.q_layernorm.weight"))?,
                    k_layernorm: f32s(store, &format!("{q}.indexer.k_layernorm.weight"))?,
                }),
                None => None,
            },
        })
    }
}

impl Moe {
    pub fn load(store: &Store, q: &str, expert_slot: usize) -> Result<Moe> {
        Ok(Moe {
            gate: w(store, &format!("{q}.gate.weight"))?,
            shared_gate_proj: w(store, &format!("{q}.shared_expert.gate_proj.weight"))?,
            shared_up_proj: w(store, &format!("{q}.shared_expert.up_proj.weight"))?,
            shared_down_proj: w(store, &format!("{q}.shared_expert.down_proj.weight"))?,
            shared_expert_gate: w(store, &format!("{q}.shared_expert_gate.weight"))?,
            expert_slot,
        })
    }
}
