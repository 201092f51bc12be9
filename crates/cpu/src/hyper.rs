//! Hyper-connections: the residual is `hc` streams of width H.
//!
//! Read (`GatedResidual`): n = hc_norm(x) per stream; mix = sigmoid(W_up silu(W_down n / hc));
//! input = mean over streams of mix * n; inject = 2 sigmoid(W_inject n / hc).
//! After the block F: x += inject (outer) F(input): stream s gets `inject[s] * F(input)`.
//! The final mixer is a read without injection.

use cherenkov_model::config::TextConfig;
use cherenkov_model::store::Store;

use crate::ops::{rms_norm_zc, sigmoid, silu};
use crate::weights::HyperConnection;

/// Reads `t` rows of the residual `x` (`[t, hc * H]`). Returns the block input `[t, H]` and, when
/// the connection injects, the per-stream injection weights `[t, hc]`.
pub fn read(store: &Store, c: &TextConfig, hc: &HyperConnection, x: &[f32]) -> (Vec<f32>, Option<Vec<f32>>) {
    let (h, n_hc) = (c.hidden_size, c.hc_count);
    let width = h * n_hc;
    let t = x.len() / width;
    let eps = c.rms_norm_eps as f32;
    let mut normed = vec![0f32; x.len()];
    for (xr, nr) in x.chunks_exact(width).zip(normed.chunks_exact_mut(width)) {
        rms_norm_zc(xr, &hc.hc_norm, eps, h, nr);
    }
    let down = hc.input_mix_weight_down.lin(store);
    let mut low = vec![0f32; t * down.rows()];
    down.forward(&normed, &mut low);
    let inv_hc = 1.0 / n_hc as f32;
    low.iter_mut().for_each(|v| *v = silu(*v * inv_hc));
    let up = hc.input_mix_weight_up.lin(store);
    let mut mix = vec![0f32; t * width];
    up.forward(&low, &mut mix);
    let mut input = vec![0f32; t * h];
    for r in 0..t {
        let (m, n) = (&mix[r * width..(r + 1) * width], &normed[r * width..(r + 1) * width]);
        let out = &mut input[r * h..(r + 1) * h];
        for s in 0..n_hc {
            for j in 0..h {
                out[j] += sigmoid(m[s * h + j]) * n[s * h + j];
            }
        }
        out.iter_mut().for_each(|v| *v *= inv_hc);
    }
    let inject = hc.block_inject_weight.map(|wi| {
        let lin = wi.lin(store);
        let mut inj = vec![0f32; t * n_hc];
        lin.forward(&normed, &mut inj);
        inj.iter_mut().for_each(|v| *v = 2.0 * sigmoid(*v * inv_hc));
        inj
    });
    (input, inject)
}

/// x[r, s*H + j] += inject[r, s] * out[r, j].
pub fn inject(c: &TextConfig, x: &mut [f32], inject: &[f32], out: &[f32]) {
    let (h, n_hc) = (c.hidden_size, c.hc_count);
    for (r, xr) in x.chunks_exact_mut(h * n_hc).enumerate() {
        for s in 0..n_hc {
            let w = inject[r * n_hc + s];
            for j in 0..h {
                xr[s * h + j] += w * out[r * h + j];
            }
        }
    }
}
