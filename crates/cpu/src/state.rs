//! Decode state of one sequence on the CPU.
//!
//! Everything a token needs from the tokens before it: per attention layer the KV cache, the QSA
//! index keys (raw per token, and pooled/normalised/rotated per complete block); per Gated DeltaNet
//! layer the f32 recurrent state and the convolution history; per PLE layer the history of its
//! dilated convolution; and the last `ngram_size - 1` tokens for the n-gram hash. The state is a
//! plain value: cloning it snapshots a sequence (the prefix cache relies on that).
//!
//! With drafting on, the session also holds the MTP head's state ([`MtpState`]), and after a
//! verifying forward what [`crate::CpuModel::commit`] needs to keep only some of its rows
//! ([`Verify`]).

use cherenkov_model::LayerType;
use cherenkov_model::config::TextConfig;

#[derive(Clone, Debug)]
pub struct AttentionState {
    /// `[tokens, kv_heads, head_dim]`, rotated keys.
    pub k: Vec<f32>,
    /// `[tokens, kv_heads, head_dim]`.
    pub v: Vec<f32>,
    /// QSA: raw index key per token `[tokens, index_head_dim]`.
    pub index_keys: Vec<f32>,
    /// QSA: per complete block, the mean-pooled key after `k_layernorm` and RoPE at the block's
    /// first position `[blocks, index_head_dim]`.
    pub index_blocks: Vec<f32>,
}

impl AttentionState {
    pub fn empty() -> AttentionState {
        AttentionState { k: Vec::new(), v: Vec::new(), index_keys: Vec::new(), index_blocks: Vec::new() }
    }

    /// Keeps the first `tokens` positions (and the index blocks complete within them).
    pub fn truncate(&mut self, c: &TextConfig, tokens: usize) {
        let kv = c.num_key_value_heads * c.head_dim;
        self.k.truncate(tokens * kv);
        self.v.truncate(tokens * kv);
        if let Some(q) = &c.qsa {
            self.index_keys.truncate(tokens * q.head_dim);
            self.index_blocks.truncate(tokens / q.compress_ratio * q.head_dim);
        }
    }
}

#[derive(Clone, Debug)]
pub struct GdnState {
    /// The last `kernel - 1` inputs of the causal convolution, oldest first: `[kernel - 1, conv_dim]`.
    pub conv: Vec<f32>,
    /// Per value head, `S[key_dim][value_dim]` (f32; transformers' layout).
    pub recurrent: Vec<f32>,
}

#[derive(Clone, Debug)]
pub enum MixerState {
    Gdn(GdnState),
    Attention(AttentionState),
}

#[derive(Clone, Debug)]
pub struct LayerState {
    pub mixer: MixerState,
    /// PLE: the last `(kernel - 1) * dilation` normalised gated values, oldest first: `[len, hc * hidden]`.
    pub ple_conv: Option<Vec<f32>>,
}

#[derive(Clone, Debug)]
pub struct CpuSession {
    /// Tokens processed so far (the position of the next token).
    pub pos: usize,
    /// The last `ngram_size - 1` tokens, most recent first, EOS-padded at the start.
    pub ngram_context: Vec<u32>,
    pub layers: Vec<LayerState>,
    /// The MTP head's state (None: drafting is off for this session).
    pub mtp: Option<MtpState>,
    /// The last verifying forward's rows, until [`crate::CpuModel::commit`] keeps some of them.
    pub verify: Option<Verify>,
}

/// The MTP head's side of a sequence. The head sees position p as the trunk's residual at p
/// paired with the token at p + 1, so it runs one position behind the trunk: the trunk rows
/// whose following token is not yet known wait in `pending`.
#[derive(Clone, Debug)]
pub struct MtpState {
    /// Per MTP layer, the attention caches (positions `0..pos`).
    pub layers: Vec<AttentionState>,
    /// Positions the head has seen.
    pub pos: usize,
    /// Trunk residual rows `[n, hc * H]` for positions `pos..pos + n`, not yet seen by the head.
    pub pending: Vec<f32>,
    /// The token at each pending row's position (row j's following token is `pending_tokens[j + 1]`).
    pub pending_tokens: Vec<u32>,
}

/// A layer's state after each row of a verifying forward.
#[derive(Clone, Debug)]
pub enum RowStates {
    /// Gated DeltaNet: the whole state after each row.
    Gdn(Vec<GdnState>),
    /// Attention: the caches are cut back to the kept rows instead.
    Attention,
}

/// What a verifying forward leaves for [`crate::CpuModel::commit`].
#[derive(Clone, Debug)]
pub struct Verify {
    /// The session's position and n-gram context before the forward.
    pub pos0: usize,
    pub ngram_context0: Vec<u32>,
    pub tokens: Vec<u32>,
    /// Per trunk layer, its mixer's state after each row, and its PLE history after each row.
    pub mixer_rows: Vec<RowStates>,
    pub ple_rows: Vec<Option<Vec<Vec<f32>>>>,
    /// The trunk's pre-mixer residual rows `[t, hc * H]` (the MTP head's input).
    pub hidden: Vec<f32>,
}

impl CpuSession {
    pub fn new(c: &TextConfig) -> CpuSession {
        let eos = c.eos().unwrap_or(0);
        let layers = c
            .layer_types
            .iter()
            .enumerate()
            .map(|(i, t)| LayerState {
                mixer: match t {
                    LayerType::LinearAttention => MixerState::Gdn(GdnState {
                        conv: vec![0.0; (c.linear_conv_kernel_dim - 1) * c.gdn_conv_dim()],
                        recurrent: vec![0.0; c.gdn_state_len()],
                    }),
                    LayerType::Attention => MixerState::Attention(AttentionState::empty()),
                },
                ple_conv: c
                    .ple_index(i)
                    .map(|_| vec![0.0; (c.ple_conv_kernel_size - 1) * c.ngram_size * c.hc_hidden()]),
            })
            .collect();
        CpuSession { pos: 0, ngram_context: vec![eos; c.ngram_size.saturating_sub(1)], layers, mtp: None, verify: None }
    }

    /// Bytes held by this session's state.
    pub fn bytes(&self) -> usize {
        let f = std::mem::size_of::<f32>();
        self.layers
            .iter()
            .map(|l| {
                let m = match &l.mixer {
                    MixerState::Gdn(g) => g.conv.len() + g.recurrent.len(),
                    MixerState::Attention(a) => a.k.len() + a.v.len() + a.index_keys.len() + a.index_blocks.len(),
                };
                (m + l.ple_conv.as_ref().map_or(0, |p| p.len())) * f
            })
            .sum::<usize>()
            + self.mtp.as_ref().map_or(0, |m| {
                let kv: usize =
                    m.layers.iter().map(|a| a.k.len() + a.v.len() + a.index_keys.len() + a.index_blocks.len()).sum();
                (kv + m.pending.len()) * f
            })
    }
}
