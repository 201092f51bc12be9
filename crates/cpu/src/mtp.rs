//! The MTP head (`mtp.*`): drafts the token after next, for speculative decoding.
//!
//! transformers ignores the head; vLLM's `Qwen4ExpMultiTokenPredictor` is the public reference.
//! For the trunk's residual before its final mixer at position p (`h`, `[hc * H]`) and the token
//! at p + 1:
//!
//!   e   = fc_embedding(norm_e(embed(token)))              `[H]`
//!   x_s = fc_hidden(norm_h(h)_s) + e                       for each stream s
//!
//! where `norm_e` is a zero-centred RMSNorm over H and `norm_h` one over the whole `hc * H` row.
//! Then a decoder layer of QSA attention and MoE (its own hyper-connections and KV cache, no PLE)
//! runs at position p, and the head's own final mixer and the shared `lm_head` give logits for the
//! token at p + 2. The residual before that mixer would feed a chained second draft.

use anyhow::{Result, bail};
use cherenkov_engine::residency::{ExpertPool, HostSlots};
use cherenkov_model::config::TextConfig;
use cherenkov_model::store::Store;

use crate::ops::{Rope, rms_norm_zc};
use crate::state::AttentionState;
use crate::weights::{MtpWeights, W};
use crate::{attention, hyper, moe};

/// Runs MTP layer `k` over trunk rows `hidden` (`[t, hc * H]`, positions `pos0..pos0 + t`), each
/// paired with the token that follows it (`next`, `[t]`); appends to the layer's caches and
/// returns the head's residual rows `[t, hc * H]` before its final mixer.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    store: &Store,
    c: &TextConfig,
    rope: &Rope,
    w: &MtpWeights,
    k: usize,
    embed_tokens: W,
    pool: &ExpertPool<HostSlots>,
    st: &mut AttentionState,
    hidden: &[f32],
    next: &[u32],
    pos0: usize,
) -> Result<Vec<f32>> {
    let (h, width) = (c.hidden_size, c.hc_hidden());
    let t = next.len();
    if hidden.len() != t * width {
        bail!("MTP head: {} residual values for {t} tokens (expected {})", hidden.len(), t * width);
    }
    let Some(layer) = w.layers.get(k) else {
        bail!("MTP head: layer {k} asked for, the checkpoint has {}", w.layers.len());
    };
    let eps = c.rms_norm_eps as f32;

    // The embedding branch: [t, H].
    let embed = embed_tokens.lin(store);
    let mut e = vec![0f32; h];
    let mut en = vec![0f32; t * h];
    for (r, &tok) in next.iter().enumerate() {
        embed.row(tok as usize, &mut e);
        rms_norm_zc(&e, &w.pre_fc_norm_embedding, eps, h, &mut en[r * h..(r + 1) * h]);
    }
    let mut fe = vec![0f32; t * h];
    w.fc_embedding.lin(store).forward(&en, &mut fe);

    // The trunk branch: one norm over the whole row, then fc_hidden on each stream ([t * hc, H]).
    let mut hn = vec![0f32; t * width];
    for (src, dst) in hidden.chunks_exact(width).zip(hn.chunks_exact_mut(width)) {
        rms_norm_zc(src, &w.pre_fc_norm_hidden, eps, width, dst);
    }
    let mut x = vec![0f32; t * width];
    w.fc_hidden.lin(store).forward(&hn, &mut x);
    for (xr, er) in x.chunks_exact_mut(width).zip(fe.chunks_exact(h)) {
        for stream in xr.chunks_exact_mut(h) {
            for (v, &a) in stream.iter_mut().zip(er) {
                *v += a;
            }
        }
    }

    let (inp, inj) = hyper::read(store, c, &layer.attn_hc, &x);
    let out = attention::forward(store, c, rope, &layer.attention, st, &inp, pos0);
    hyper::inject(c, &mut x, &inj.expect("attention hyper-connection injects"), &out);
    let (inp, inj) = hyper::read(store, c, &layer.mlp_hc, &x);
    let out = moe::forward(store, c, &layer.moe, pool, &inp, None, None)?;
    hyper::inject(c, &mut x, &inj.expect("MLP hyper-connection injects"), &out);
    Ok(x)
}
