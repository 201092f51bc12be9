//! The PLE layer: hashed n-gram embeddings gated into every hyper-connection stream.
//!
//! e = concat of the token's n-gram table rows (read from `ngram.bin`, never loaded whole);
//! key = norm_key(key_proj e) per stream, value = value_proj e; g_s = <key_s, norm_query(x)_s>/sqrt(H),
//! g_s = sign(g_s) sqrt(max(|g_s|, 1e-6)); gated_s = sigmoid(g_s) value; out = gated +
//! silu(depthwise conv(norm_conv(gated)), kernel K, dilation ngram_size, causal); x += out.

use anyhow::{Context, Result};
use cherenkov_model::config::TextConfig;
use cherenkov_model::ngram::NgramHash;
use cherenkov_model::quant::Affine;
use cherenkov_model::store::{NgramTable, Precision, Store};

use crate::linear::Linear;
use crate::ops::{rms_norm_zc, sigmoid, silu};
use crate::weights::Ple;

/// Gathers the n-gram embedding of every row: `[t, ple_embed_dim]`.
/// `tokens` are the new tokens; `context` the tokens before them, most recent first.
pub fn gather_embeddings(
    store: &Store,
    c: &TextConfig,
    hash: &NgramHash,
    table: &NgramTable,
    tokens: &[u32],
    context: &[u32],
) -> Result<Vec<f32>> {
    let cols = table.cols;
    let heads = c.ngram_heads();
    let mut out = vec![0f32; tokens.len() * heads * cols];
    let mut rows = Vec::new();
    let mut buf = vec![0u8; table.row_bytes as usize];
    let mut prev: Vec<u32> = context.to_vec();
    for (r, &tok) in tokens.iter().enumerate() {
        hash.rows(tok, &prev, &mut rows);
        for (hd, &row) in rows.iter().enumerate() {
            store
                .read_ngram_row(table, row, &mut buf)
                .with_context(|| format!("PLE layer {}: n-gram row {row}", table.layer))?;
            let o = &mut out[(r * heads + hd) * cols..(r * heads + hd + 1) * cols];
            decode_row(table.precision, cols, &buf, o);
        }
        prev.insert(0, tok);
        prev.truncate(c.ngram_size.saturating_sub(1));
    }
    Ok(out)
}

/// Decodes one `ngram.bin` row (words | scales | biases, or floats).
fn decode_row(p: Precision, cols: usize, bytes: &[u8], out: &mut [f32]) {
    match p {
        Precision::Affine { bits, group_size } => {
            let fmt = Affine::new(bits, group_size);
            let wl = fmt.words_per_row(cols) * 4;
            let sl = fmt.groups_per_row(cols) * 2;
            let words: Vec<u32> =
                bytes[..wl].chunks_exact(4).map(|b| u32::from_le_bytes(b.try_into().unwrap())).collect();
            let s: Vec<u16> = bytes[wl..wl + sl].chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
            let bi: Vec<u16> =
                bytes[wl + sl..wl + 2 * sl].chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
            cherenkov_model::quant::dequantize_row(&words, &s, &bi, fmt, out);
        }
        Precision::Float { dtype } => {
            cherenkov_model::dtype::decode_f32(dtype, bytes, out).expect("n-gram row");
        }
    }
}

/// Adds the PLE output to `x` (`[t, hc * H]`). `conv` is the layer's dilated-conv history; with
/// `rows`, its value after each token is pushed there (a verifying forward).
pub fn forward(
    store: &Store,
    c: &TextConfig,
    w: &Ple,
    emb: &[f32],
    x: &mut [f32],
    conv: &mut [f32],
    mut rows: Option<&mut Vec<Vec<f32>>>,
) {
    let (h, n_hc) = (c.hidden_size, c.hc_count);
    let width = h * n_hc;
    let t = x.len() / width;
    let eps = c.rms_norm_eps as f32;
    let key_proj: Linear = w.key_proj.lin(store);
    let mut key = vec![0f32; t * width];
    key_proj.forward(emb, &mut key);
    let mut value = vec![0f32; t * h];
    w.value_proj.lin(store).forward(emb, &mut value);

    let kernel = c.ple_conv_kernel_size;
    let dil = c.ngram_size;
    let hist = (kernel - 1) * dil;
    let inv_sqrt_h = 1.0 / (h as f32).sqrt();
    let mut kn = vec![0f32; width];
    let mut qn = vec![0f32; width];
    let mut gated = vec![0f32; width];
    let mut gn = vec![0f32; width];
    for r in 0..t {
        let xr = &mut x[r * width..(r + 1) * width];
        rms_norm_zc(&key[r * width..(r + 1) * width], &w.norm_key, eps, h, &mut kn);
        rms_norm_zc(xr, &w.norm_query, eps, h, &mut qn);
        for s in 0..n_hc {
            let g: f32 = (0..h).map(|j| kn[s * h + j] * qn[s * h + j]).sum::<f32>() * inv_sqrt_h;
            let g = if g == 0.0 { 0.0 } else { g.abs().max(1e-6).sqrt() * g.signum() };
            let sg = sigmoid(g);
            for j in 0..h {
                gated[s * h + j] = sg * value[r * h + j];
            }
        }
        rms_norm_zc(&gated, &w.norm_conv, eps, h, &mut gn);
        // Causal dilated depthwise conv over [history (hist rows), current].
        for ch in 0..width {
            let wk = &w.conv1d[ch * kernel..(ch + 1) * kernel];
            let mut acc = wk[kernel - 1] * gn[ch];
            for k in 0..kernel - 1 {
                // input at t - (kernel-1-k)*dil, i.e. history row hist - (kernel-1-k)*dil
                let row = hist - (kernel - 1 - k) * dil;
                acc += wk[k] * conv[row * width + ch];
            }
            xr[ch] += gated[ch] + silu(acc);
        }
        if hist > 0 {
            conv.copy_within(width.., 0);
            conv[(hist - 1) * width..].copy_from_slice(&gn);
        }
        if let Some(rows) = rows.as_deref_mut() {
            rows.push(conv.to_vec());
        }
    }
}
