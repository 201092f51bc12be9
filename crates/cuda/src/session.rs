//! Decode state of one sequence on the device: the same pieces as the CPU's `CpuSession`, in GPU
//! memory (KV cache and QSA index keys grow by doubling; the GDN state is f32).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Result, bail};
use cherenkov_model::LayerType;
use cherenkov_model::config::TextConfig;

use crate::gpu::{Arg, DevBuf, Gpu, blocks};

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

/// The spans ([`CudaSession::state_bufs`] order) of decoder layer `layer`'s states `which` names,
/// for layers of these kinds (a GDN mixer, a PLE layer): a GDN layer's conv then its recurrent
/// state, then a PLE layer's history.
fn layer_spans(kinds: &[(bool, bool)], layer: usize, which: LayerStates) -> std::ops::Range<usize> {
    let gdn = |&(g, _): &(bool, bool)| 2 * usize::from(g);
    let spans = |k: &(bool, bool)| gdn(k) + usize::from(k.1);
    let first = kinds[..layer].iter().map(spans).sum::<usize>();
    let k = &kinds[layer];
    match which {
        LayerStates::Mixer => first..first + gdn(k),
        LayerStates::Conv => first..first + gdn(k).min(1),
        LayerStates::Ple => first + gdn(k)..first + spans(k),
    }
}

/// Which of a decoder layer's recorded states [`CudaSession::copy_layer_states`] copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerStates {
    /// A GDN layer's conv and recurrent states.
    Mixer,
    /// A GDN layer's conv state alone (a launch over several rows records the recurrent state
    /// itself: [`CudaSession::recurrent_record_at`]).
    Conv,
    /// A PLE layer's history.
    Ple,
}

pub struct LayerState {
    pub mixer: MixerState,
    pub ple_conv: Option<DevBuf>,
}

/// The MTP head's side of a sequence on the device. As on the CPU, the head sees position p as the
/// trunk's residual at p paired with the token at p + 1, so it runs one position behind the trunk:
/// the last trunk row waits in `pending` until its following token is known.
pub struct MtpSession {
    /// The head's attention layers' caches (positions `0..pos`).
    pub layers: Vec<AttentionState>,
    /// Positions the head has seen.
    pub pos: usize,
    /// One trunk residual row `[hc * H]` whose following token is not known yet.
    pub pending: DevBuf,
    pub has_pending: bool,
    /// Where the next trunk row lands while the head runs on `pending`.
    pub spare: DevBuf,
}

/// A verifying forward's rows until `commit` keeps some of them.
pub struct VerifyRecord {
    pub pos0: usize,
    pub ngram_context0: Vec<u32>,
    pub tokens: Vec<u32>,
    /// Each row's trunk residual `[rows, hc * H]` (for the MTP head at commit).
    pub hidden: DevBuf,
    /// The recurrent states after each row but the last (whose states are the live ones): per row,
    /// every GDN layer's conv and recurrent state and every PLE layer's history, in layer order
    /// ([`CudaSession::state_bufs`]).
    pub states: DevBuf,
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
    /// The MTP head's state (None: drafting is off for this session).
    pub mtp: Option<MtpSession>,
    /// The last verifying forward, until it is committed.
    pub verify: Option<VerifyRecord>,
    /// A committed verifying forward's buffers (rows, states), kept for the next one.
    pub verify_bufs: Option<(DevBuf, DevBuf)>,
    /// The span tables [`CudaSession::copy_states`] launches with, per record address.
    state_spans: Vec<StateSpans>,
}

/// The `copy_spans` tables that save the recurrent states into a record at `at` and restore them.
struct StateSpans {
    at: u64,
    save: DevBuf,
    restore: DevBuf,
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
                    recurrent: gpu.zeros(c.gdn_state_len() * 4, "the GDN recurrent state")?,
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
            mtp: None,
            verify: None,
            verify_bufs: None,
            state_spans: Vec::new(),
        })
    }

    /// Turns the MTP head's state on (`layers` head layers; nothing seen yet).
    pub fn enable_mtp(&mut self, c: &TextConfig, layers: usize) -> Result<()> {
        let row = c.hc_hidden() * 4;
        self.mtp = Some(MtpSession {
            layers: (0..layers).map(|_| attn_bufs(&self.gpu, c, 256)).collect::<Result<_>>()?,
            pos: 0,
            pending: self.gpu.zeros(row, "the MTP head's pending row")?,
            has_pending: false,
            spare: self.gpu.zeros(row, "the MTP head's pending row")?,
        });
        Ok(())
    }

    /// The recurrent state buffers a verifying forward records after each row, in layer order:
    /// each GDN layer's conv and recurrent state, each PLE layer's history.
    pub fn state_bufs(&self) -> Vec<&DevBuf> {
        let mut v = Vec::new();
        for l in &self.layers {
            if let MixerState::Gdn { conv, recurrent } = &l.mixer {
                v.extend([conv, recurrent]);
            }
            v.extend(l.ple_conv.as_ref());
        }
        v
    }

    /// Each state buffer's place in a row's record ([`CudaSession::state_bufs`] order, 256-byte
    /// aligned) and the record's bytes.
    fn state_layout(&self) -> (Vec<(u64, usize, u64)>, usize) {
        let mut off = 0usize;
        let mut v = Vec::new();
        for b in self.state_bufs() {
            v.push((b.ptr, b.bytes, off as u64));
            off = (off + b.bytes).next_multiple_of(256);
        }
        (v, off)
    }

    /// Bytes of one row's record of [`CudaSession::state_bufs`].
    pub fn state_bytes(&self) -> usize {
        self.state_layout().1
    }

    /// Copies the recurrent states into (`save`) or out of the record at `at` (256-byte aligned),
    /// queued on the compute stream as one launch (`copy_spans`); the span tables are uploaded
    /// once per record address.
    pub fn copy_states(&mut self, at: u64, save: bool) -> Result<()> {
        let n = self.state_bufs().len();
        self.copy_state_spans(at, save, 0..n)
    }

    /// [`CudaSession::copy_states`] for decoder layer `layer`'s buffers alone, those `which` names
    /// (a GDN layer's conv and recurrent states, or a PLE layer's history; none where the layer has
    /// no such state), into or out of the same places of the record at `at`.
    pub fn copy_layer_states(&mut self, at: u64, layer: usize, which: LayerStates, save: bool) -> Result<()> {
        let kinds: Vec<(bool, bool)> =
            self.layers.iter().map(|l| (matches!(l.mixer, MixerState::Gdn { .. }), l.ple_conv.is_some())).collect();
        self.copy_state_spans(at, save, layer_spans(&kinds, layer, which))
    }

    /// Where decoder layer `layer`'s GDN recurrent state lies in the record at `at` (None for an
    /// attention layer).
    pub fn recurrent_record_at(&self, at: u64, layer: usize) -> Option<u64> {
        let MixerState::Gdn { recurrent, .. } = &self.layers.get(layer)?.mixer else { return None };
        self.record_at(at, recurrent.ptr)
    }

    /// Where decoder layer `layer`'s GDN conv state lies in the record at `at` (None for an
    /// attention layer).
    pub fn conv_record_at(&self, at: u64, layer: usize) -> Option<u64> {
        let MixerState::Gdn { conv, .. } = &self.layers.get(layer)?.mixer else { return None };
        self.record_at(at, conv.ptr)
    }

    /// Where the state buffer at `ptr` lies in the record at `at`.
    fn record_at(&self, at: u64, ptr: u64) -> Option<u64> {
        let (layout, _) = self.state_layout();
        layout.iter().find(|(p, ..)| *p == ptr).map(|&(_, _, off)| at + off)
    }

    /// Uploads the span tables for a record at `at` unless they are there (a graph that copies
    /// states is captured after this: an upload cannot be captured).
    pub fn prepare_state_spans(&mut self, at: u64) -> Result<()> {
        self.state_spans_at(at).map(|_| ())
    }

    /// The index of the span tables for a record at `at`, uploaded first where there are none.
    fn state_spans_at(&mut self, at: u64) -> Result<usize> {
        let (layout, _) = self.state_layout();
        Ok(match self.state_spans.iter().position(|t| t.at == at) {
            Some(i) => i,
            None => {
                let table = |save: bool| -> Result<DevBuf> {
                    let rows: Vec<u64> = layout
                        .iter()
                        .flat_map(|&(ptr, bytes, off)| {
                            let (dst, src) = if save { (at + off, ptr) } else { (ptr, at + off) };
                            [dst, src, bytes as u64]
                        })
                        .collect();
                    let b = self.gpu.alloc(rows.len().max(1) * 8, "a verifying forward's copy table")?;
                    if !rows.is_empty() {
                        self.gpu.htod(b.ptr, &rows)?;
                    }
                    Ok(b)
                };
                let spans = StateSpans { at, save: table(true)?, restore: table(false)? };
                // Records move only when a longer verify needs more room: a few addresses at most.
                if self.state_spans.len() == 8 {
                    self.state_spans.remove(0);
                }
                self.state_spans.push(spans);
                self.state_spans.len() - 1
            }
        })
    }

    /// Queues `copy_spans` over the record's spans `which` ([`CudaSession::state_bufs`] order).
    fn copy_state_spans(&mut self, at: u64, save: bool, which: std::ops::Range<usize>) -> Result<()> {
        if which.is_empty() {
            return Ok(());
        }
        let i = self.state_spans_at(at)?;
        let (layout, _) = self.state_layout();
        let t = &self.state_spans[i];
        let largest = layout[which.clone()].iter().map(|l| l.1).max().unwrap_or(0);
        // Enough blocks that the largest span (a GDN recurrent state) takes a few passes a thread.
        let per = blocks(largest / 16, 256 * 8).max(1);
        // A span is three u64s in the table.
        let table = if save { t.save.ptr } else { t.restore.ptr } + (which.start * 24) as u64;
        self.gpu.launch(
            "copy_spans",
            (per, which.len() as u32, 1),
            256,
            0,
            &[Arg::Ptr(table), Arg::I32(which.len() as i32)],
        )
    }

    /// Makes every attention layer (the MTP head's too) able to hold `tokens` tokens (doubling,
    /// contents kept).
    pub fn reserve(&mut self, c: &TextConfig, tokens: usize) -> Result<()> {
        let gpu = self.gpu.clone();
        let mut grown = false;
        for l in &mut self.layers {
            if let MixerState::Attention(a) = &mut l.mixer {
                grown |= grow(&gpu, c, a, tokens)?;
            }
        }
        if grown {
            // Captured steps name the trunk's buffers; the head's are never captured.
            self.generation += 1;
        }
        if let Some(m) = &mut self.mtp {
            for a in &mut m.layers {
                grow(&gpu, c, a, tokens)?;
            }
        }
        self.gpu.sync()
    }

    /// A deep copy on the device (a snapshot of the sequence, with the MTP head's state).
    pub fn try_clone(&self) -> Result<CudaSession> {
        if self.verify.is_some() {
            bail!("the session's verifying forward is not committed yet (commit it before copying the session)");
        }
        let gpu = &self.gpu;
        let copy = |b: &DevBuf| copy_buf(gpu, b);
        let mut layers = Vec::new();
        for l in &self.layers {
            let mixer = match &l.mixer {
                MixerState::Gdn { conv, recurrent } => {
                    MixerState::Gdn { conv: copy(conv)?, recurrent: copy(recurrent)? }
                }
                MixerState::Attention(a) => MixerState::Attention(copy_attention(gpu, a)?),
            };
            let ple_conv = match &l.ple_conv {
                Some(b) => Some(copy(b)?),
                None => None,
            };
            layers.push(LayerState { mixer, ple_conv });
        }
        let mtp = match &self.mtp {
            Some(m) => Some(MtpSession {
                layers: m.layers.iter().map(|a| copy_attention(gpu, a)).collect::<Result<_>>()?,
                pos: m.pos,
                pending: copy(&m.pending)?,
                has_pending: m.has_pending,
                spare: copy(&m.spare)?,
            }),
            None => None,
        };
        gpu.sync()?;
        Ok(CudaSession {
            gpu: gpu.clone(),
            id: next_id(),
            generation: 0,
            pos: self.pos,
            ngram_context: self.ngram_context.clone(),
            layers,
            mtp,
            verify: None,
            verify_bufs: None,
            state_spans: Vec::new(),
        })
    }

    /// Device bytes held by this session.
    pub fn bytes(&self) -> usize {
        let trunk: usize = self
            .layers
            .iter()
            .map(|l| {
                let m = match &l.mixer {
                    MixerState::Gdn { conv, recurrent } => conv.bytes + recurrent.bytes,
                    MixerState::Attention(a) => a.bytes(),
                };
                m + l.ple_conv.as_ref().map_or(0, |b| b.bytes)
            })
            .sum();
        let head = self
            .mtp
            .as_ref()
            .map_or(0, |m| m.layers.iter().map(AttentionState::bytes).sum::<usize>() + m.pending.bytes + m.spare.bytes);
        let verify = self.verify.as_ref().map_or(0, |v| v.hidden.bytes + v.states.bytes)
            + self.verify_bufs.as_ref().map_or(0, |(h, s)| h.bytes + s.bytes);
        trunk + head + verify
    }
}

impl AttentionState {
    pub fn bytes(&self) -> usize {
        self.k.bytes + self.v.bytes + self.index_keys.bytes + self.index_blocks.bytes
    }
}

fn copy_buf(gpu: &Gpu, b: &DevBuf) -> Result<DevBuf> {
    let n = gpu.alloc(b.bytes, "a session snapshot")?;
    gpu.dtod(n.ptr, b.ptr, b.bytes)?;
    Ok(n)
}

fn copy_attention(gpu: &Gpu, a: &AttentionState) -> Result<AttentionState> {
    Ok(AttentionState {
        cap: a.cap,
        k: copy_buf(gpu, &a.k)?,
        v: copy_buf(gpu, &a.v)?,
        index_keys: copy_buf(gpu, &a.index_keys)?,
        index_blocks: copy_buf(gpu, &a.index_blocks)?,
        blocks: a.blocks,
    })
}

/// Doubles `a` until it holds `tokens` tokens, contents kept; whether it grew.
fn grow(gpu: &Gpu, c: &TextConfig, a: &mut AttentionState, tokens: usize) -> Result<bool> {
    if a.cap >= tokens {
        return Ok(false);
    }
    let mut cap = a.cap;
    while cap < tokens {
        cap *= 2;
    }
    let mut n = attn_bufs(gpu, c, cap)?;
    for (dst, src) in [(&n.k, &a.k), (&n.v, &a.v), (&n.index_keys, &a.index_keys), (&n.index_blocks, &a.index_blocks)] {
        gpu.dtod(dst.ptr, src.ptr, src.bytes)?;
    }
    n.blocks = a.blocks;
    *a = n;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Layers GDN+PLE, attention, GDN, attention+PLE: spans conv 0, recurrent 1, PLE 2, then
    /// conv 3, recurrent 4, then PLE 5.
    #[test]
    fn a_layers_spans_are_its_own_states_in_record_order() {
        let kinds = [(true, true), (false, false), (true, false), (false, true)];
        assert_eq!(layer_spans(&kinds, 0, LayerStates::Mixer), 0..2);
        assert_eq!(layer_spans(&kinds, 0, LayerStates::Conv), 0..1);
        assert_eq!(layer_spans(&kinds, 0, LayerStates::Ple), 2..3);
        assert!(layer_spans(&kinds, 1, LayerStates::Mixer).is_empty());
        assert!(layer_spans(&kinds, 1, LayerStates::Ple).is_empty());
        assert_eq!(layer_spans(&kinds, 2, LayerStates::Mixer), 3..5);
        assert_eq!(layer_spans(&kinds, 2, LayerStates::Conv), 3..4);
        assert!(layer_spans(&kinds, 2, LayerStates::Ple).is_empty());
        assert!(layer_spans(&kinds, 3, LayerStates::Conv).is_empty());
        assert_eq!(layer_spans(&kinds, 3, LayerStates::Ple), 5..6);
    }
}
