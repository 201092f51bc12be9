//! Gated attention with the QSA token indexer.
//!
//! q_proj gives per head a query and a gate; q and k get zero-centred per-head norms and partial
//! RoPE; out = o_proj(attention * sigmoid(gate)). The indexer restricts the keys a query sees: one
//! raw index key per token (from `index_qk_proj`); every complete block of `compress_ratio` tokens
//! is mean-pooled, `k_layernorm`ed and rotated at the block's first position; a query's block score
//! is sum over index heads of relu(q_idx . k_block) / sqrt(d_idx), and it sees the tokens of the
//! top `budget / compress_ratio` blocks plus the incomplete tail. While the complete blocks fit the
//! budget that is every token: dense causal attention.

use cherenkov_model::config::TextConfig;
use cherenkov_model::store::Store;

use crate::linear::dot;
use crate::ops::{Rope, rms_norm_zc, sigmoid};
use crate::state::AttentionState;
use crate::weights::Attention;

/// `h` is `[t, H]` for positions `pos0..pos0+t`; returns `[t, H]`, appending to the caches.
pub fn forward(
    store: &Store,
    c: &TextConfig,
    rope: &Rope,
    w: &Attention,
    st: &mut AttentionState,
    h: &[f32],
    pos0: usize,
) -> Vec<f32> {
    let hid = c.hidden_size;
    let t = h.len() / hid;
    let (nh, nkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    let eps = c.rms_norm_eps as f32;

    let mut qg = vec![0f32; t * nh * d * 2];
    w.q_proj.lin(store).forward(h, &mut qg);
    let mut k = vec![0f32; t * nkv * d];
    w.k_proj.lin(store).forward(h, &mut k);
    let mut v = vec![0f32; t * nkv * d];
    w.v_proj.lin(store).forward(h, &mut v);

    // Split q and gate: the projection is [heads, 2*d] with the query first.
    let mut q = vec![0f32; t * nh * d];
    let mut gate = vec![0f32; t * nh * d];
    for r in 0..t {
        for hh in 0..nh {
            let src = &qg[(r * nh + hh) * 2 * d..(r * nh + hh + 1) * 2 * d];
            q[(r * nh + hh) * d..(r * nh + hh + 1) * d].copy_from_slice(&src[..d]);
            gate[(r * nh + hh) * d..(r * nh + hh + 1) * d].copy_from_slice(&src[d..]);
        }
    }
    for r in 0..t {
        let pos = pos0 + r;
        for hh in 0..nh {
            let qh = &mut q[(r * nh + hh) * d..(r * nh + hh + 1) * d];
            let src = qh.to_vec();
            rms_norm_zc(&src, &w.q_norm, eps, d, qh);
            rope.apply(qh, pos);
        }
        for hk in 0..nkv {
            let kh = &mut k[(r * nkv + hk) * d..(r * nkv + hk + 1) * d];
            let src = kh.to_vec();
            rms_norm_zc(&src, &w.k_norm, eps, d, kh);
            rope.apply(kh, pos);
        }
    }
    st.k.extend_from_slice(&k);
    st.v.extend_from_slice(&v);

    let visible = select_tokens(store, c, rope, w, st, h, pos0);

    let group = nh / nkv;
    let scale = 1.0 / (d as f32).sqrt();
    let mut attn = vec![0f32; t * nh * d];
    let mut scores = Vec::new();
    for r in 0..t {
        let toks = &visible[r];
        for hh in 0..nh {
            let hk = hh / group;
            let qh = &q[(r * nh + hh) * d..(r * nh + hh + 1) * d];
            scores.clear();
            scores.extend(toks.iter().map(|&j| dot(qh, &st.k[(j * nkv + hk) * d..(j * nkv + hk + 1) * d]) * scale));
            crate::ops::softmax(&mut scores);
            let out = &mut attn[(r * nh + hh) * d..(r * nh + hh + 1) * d];
            for (&p, &j) in scores.iter().zip(toks) {
                let vj = &st.v[(j * nkv + hk) * d..(j * nkv + hk + 1) * d];
                for (o, &x) in out.iter_mut().zip(vj) {
                    *o += p * x;
                }
            }
        }
    }
    for (a, g) in attn.iter_mut().zip(&gate) {
        *a *= sigmoid(*g);
    }
    let mut out = vec![0f32; t * hid];
    w.o_proj.lin(store).forward(&attn, &mut out);
    out
}

/// The tokens each query row may attend to (ascending positions).
fn select_tokens(
    store: &Store,
    c: &TextConfig,
    rope: &Rope,
    w: &Attention,
    st: &mut AttentionState,
    h: &[f32],
    pos0: usize,
) -> Vec<Vec<usize>> {
    let t = h.len() / c.hidden_size;
    let (Some(qsa), Some(ix)) = (&c.qsa, &w.indexer) else {
        return (0..t).map(|r| (0..=pos0 + r).collect()).collect();
    };
    let (ih, id, ratio) = (qsa.n_heads, qsa.head_dim, qsa.compress_ratio);
    let eps = c.rms_norm_eps as f32;
    let width = (ih + qsa.kv_heads) * id;
    let mut qk = vec![0f32; t * width];
    ix.index_qk_proj.lin(store).forward(h, &mut qk);
    for r in 0..t {
        st.index_keys.extend_from_slice(&qk[r * width + ih * id..r * width + ih * id + id]);
    }
    // Complete blocks not yet pooled.
    let tokens = pos0 + t;
    while st.index_blocks.len() / id < tokens / ratio {
        let b = st.index_blocks.len() / id;
        let mut pooled = vec![0f32; id];
        for j in b * ratio..(b + 1) * ratio {
            for (p, &x) in pooled.iter_mut().zip(&st.index_keys[j * id..(j + 1) * id]) {
                *p += x;
            }
        }
        pooled.iter_mut().for_each(|p| *p /= ratio as f32);
        let mut normed = vec![0f32; id];
        rms_norm_zc(&pooled, &ix.k_layernorm, eps, id, &mut normed);
        rope.apply(&mut normed, b * ratio);
        st.index_blocks.extend_from_slice(&normed);
    }
    let block_topk = qsa.block_topk();
    let inv_sqrt = 1.0 / (id as f32).sqrt();
    (0..t)
        .map(|r| {
            let pos = pos0 + r;
            let complete = (pos + 1) / ratio;
            if complete <= block_topk {
                return (0..=pos).collect();
            }
            let mut qh = vec![0f32; ih * id];
            for hh in 0..ih {
                let src = &qk[r * width + hh * id..r * width + (hh + 1) * id];
                rms_norm_zc(src, &ix.q_layernorm, eps, id, &mut qh[hh * id..(hh + 1) * id]);
                rope.apply(&mut qh[hh * id..(hh + 1) * id], pos);
            }
            let mut scored: Vec<(f32, usize)> = (0..complete)
                .map(|b| {
                    let kb = &st.index_blocks[b * id..(b + 1) * id];
                    let s: f32 = (0..ih).map(|hh| dot(&qh[hh * id..(hh + 1) * id], kb).max(0.0)).sum();
                    (s * inv_sqrt, b)
                })
                .collect();
            // Highest score first; ties to the earlier block.
            scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            let mut blocks: Vec<usize> = scored[..block_topk].iter().map(|s| s.1).collect();
            blocks.sort_unstable();
            let mut toks: Vec<usize> = blocks.iter().flat_map(|&b| b * ratio..(b + 1) * ratio).collect();
            toks.extend(complete * ratio..=pos);
            toks
        })
        .collect()
}
