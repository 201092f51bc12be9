//! Decode state of one sequence on the device: the same pieces as the CPU's `CpuSession`, in GPU
//! memory (KV cache and QSA index keys grow by doubling; the GDN state is f32).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::Result;
use cherenkov_model::LayerType;
use cherenkov_model::config::TextConfig;

use crate::gpu::{DevBuf, Gpu};

pub struct AttentionState {
    /// Tokens the buffers can hold.
    pub cap: usize,
    /// `[cap, kv_heads, head_dim]` rotated keys and values.
    pub k: DevBuf,
    pub v: DevBuf,
    /// QSA raw index keys `[cap, index_head_dim]`.
    pub index_keys: DevBuf,
    /// QSA pooled block keys `[cap / ratio + 1, index_head_dim]`.
    pub index_blocks: DevBuf,
    /// Complete blocks pooled so far.
    pub blocks: usize,
}

pub enum MixerState {
    Gdn { conv: DevBuf, recurrent: DevBuf },
    Attention(AttentionState),
}

pub struct LayerState {
    pub mixer: MixerState,
    pub ple_conv: Option<DevBuf>,
}

pub struct CudaSession {
    pub gpu: Arc<Gpu>,
    /// Unique per session (snapshots get their own): captured steps name the buffers they use.
    pub id: u64,
    /// Bumped whenever the buffers move (growth), so a step captured before is not replayed.
    pub generation: u64,
    pub pos: usize,
    /// The last `ngram_size - 1` tokens, most recent first (host side: the rows are gathered there).
    pub ngram_context: Vec<u32>,
    pub layers: Vec<LayerState>,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn next_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

fn attn_bufs(gpu: &Gpu, c: &TextConfig, cap: usize) -> Result<AttentionState> {
    let kv = c.num_key_value_heads * c.head_dim * 4;
    let (id, ratio) = c.qsa.as_ref().map_or((1, 1), |q| (q.head_dim, q.compress_ratio));
    Ok(AttentionState {
        cap,
        k: gpu.zeros(cap * kv, "the KV cache")?,
        v: gpu.zeros(cap * kv, "the KV cache")?,
        index_keys: gpu.zeros(cap * id * 4, "the QSA index keys")?,
        index_blocks: gpu.zeros((cap / ratio + 1) * id * 4, "the QSA index blocks")?,
        blocks: 0,
    })
}

impl CudaSession {
    pub fn new(gpu: Arc<Gpu>, c: &TextConfig) -> Result<CudaSession> {
        let mut layers = Vec::new();
        for (i, t) in c.layer_types.iter().enumerate() {
            let mixer = match t {
                LayerType::LinearAttention => MixerState::Gdn {
                    conv: gpu.zeros((c.linear_conv_kernel_dim - 1) * c.gdn_conv_dim() * 4, "the GDN conv state")?,
                    recurrent: gpu.zeros(
                        c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4,
                        "the GDN recurrent state",
                    )?,
                },
                LayerType::Attention => MixerState::Attention(attn_bufs(&gpu, c, 256)?),
            };
            let ple_conv = match c.ple_index(i) {
                Some(_) => Some(
                    gpu.zeros((c.ple_conv_kernel_size - 1) * c.ngram_size * c.hc_hidden() * 4, "the PLE conv state")?,
                ),
                None => None,
            };
            layers.push(LayerState { mixer, ple_conv });
        }
        let eos = c.eos().unwrap_or(0);
        Ok(CudaSession {
            gpu,
            id: next_id(),
            generation: 0,
            pos: 0,
            ngram_context: vec![eos; c.ngram_size.saturating_sub(1)],
            layers,
        })
    }

    /// Makes every attention layer able to hold `tokens` tokens (doubling, contents kept).
    pub fn reserve(&mut self, c: &TextConfig, tokens: usize) -> Result<()> {
        for l in &mut self.layers {
            if let MixerState::Attention(a) = &mut l.mixer
                && a.cap < tokens
            {
                let mut cap = a.cap;
                while cap < tokens {
                    cap *= 2;
                }
                let mut n = attn_bufs(&self.gpu, c, cap)?;
                for (dst, src) in
                    [(&n.k, &a.k), (&n.v, &a.v), (&n.index_keys, &a.index_keys), (&n.index_blocks, &a.index_blocks)]
                {
                    self.gpu.dtod(dst.ptr, src.ptr, src.bytes)?;
                }
                n.blocks = a.blocks;
                *a = n;
                self.generation += 1;
            }
        }
        self.gpu.sync()
    }

    /// A deep copy on the device (a snapshot of the sequence).
    pub fn try_clone(&self) -> Result<CudaSession> {
        let gpu = &self.gpu;
        let copy = |b: &DevBuf, what: &str| -> Result<DevBuf> {
            let n = gpu.alloc(b.bytes, what)?;
            gpu.dtod(n.ptr, b.ptr, b.bytes)?;
            Ok(n)
        };
        let mut layers = Vec::new();
        for l in &self.layers {
            let mixer = match &l.mixer {
                MixerState::Gdn { conv, recurrent } => MixerState::Gdn {
                    conv: copy(conv, "a session snapshot")?,
                    recurrent: copy(recurrent, "a session snapshot")?,
                },
                MixerState::Attention(a) => MixerState::Attention(AttentionState {
                    cap: a.cap,
                    k: copy(&a.k, "a session snapshot")?,
                    v: copy(&a.v, "a session snapshot")?,
                    index_keys: copy(&a.index_keys, "a session snapshot")?,
                    index_blocks: copy(&a.index_blocks, "a session snapshot")?,
                    blocks: a.blocks,
                }),
            };
            let ple_conv = match &l.ple_conv {
                Some(b) => Some(copy(b, "a session snapshot")?),
                None => None,
            };
            layers.push(LayerState { mixer, ple_conv });
        }
        gpu.sync()?;
        Ok(CudaSession {
            gpu: gpu.clone(),
            id: next_id(),
            generation: 0,
            pos: self.pos,
            ngram_context: self.ngram_context.clone(),
            layers,
        })
    }

    /// Device bytes held by this session.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| {
                let m = match &l.mixer {
                    MixerState::Gdn { conv, recurrent } => conv.bytes + recurrent.bytes,
                    MixerState::Attention(a) => a.k.bytes + a.v.bytes + a.index_keys.bytes + a.index_blocks.bytes,
                };
                m + l.ple_conv.as_ref().map_or(0, |b| b.bytes)
            })
            .sum()
    }
}
