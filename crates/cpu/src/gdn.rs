//! Gated DeltaNet (`linear_attention` layers), one token at a time.
//!
//! qkv = silu(causal depthwise conv(in_proj_qkv h)); z = in_proj_z h; beta = sigmoid(in_proj_b h);
//! g = -exp(A_log) softplus(in_proj_a h + dt_bias). q and k are l2-normalised per key head (q also
//! scaled by dk^-1/2) and shared by the value heads of their group. Per value head with state
//! `S[dk][dv]` (f32):  `S *= exp(g);  delta = beta (v - S^T k);  S += k delta^T;  y = S^T q`.
//! Then y = rmsnorm(y) * weight * act(z) per head (act = sigmoid or silu) and out = out_proj y.

use cherenkov_model::config::{GateAct, TextConfig};
use cherenkov_model::store::Store;

use crate::ops::{l2_normalize, rsqrt_mean_sq, sigmoid, silu, softplus};
use crate::state::GdnState;
use crate::weights::GatedDeltaNet;

/// `h` is `[t, H]`; returns `[t, H]` and advances the state by t tokens. With `rows`, the state
/// after each token is pushed there (a verifying forward, which may keep fewer rows).
pub fn forward(
    store: &Store,
    c: &TextConfig,
    w: &GatedDeltaNet,
    st: &mut GdnState,
    h: &[f32],
    mut rows: Option<&mut Vec<GdnState>>,
) -> Vec<f32> {
    let hid = c.hidden_size;
    let t = h.len() / hid;
    let (nk, nv, dk, dv) =
        (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim);
    let (key_dim, value_dim, conv_dim) = (c.gdn_key_dim(), c.gdn_value_dim(), c.gdn_conv_dim());
    let kernel = c.linear_conv_kernel_dim;
    let eps = c.rms_norm_eps as f32;

    let proj = |wt: &crate::weights::W, rows: usize| {
        let mut y = vec![0f32; t * rows];
        wt.lin(store).forward(h, &mut y);
        y
    };
    let qkv = proj(&w.in_proj_qkv, conv_dim);
    let z = proj(&w.in_proj_z, value_dim);
    let b = proj(&w.in_proj_b, nv);
    let a = proj(&w.in_proj_a, nv);

    let mut core = vec![0f32; t * value_dim];
    let group = nv / nk;
    let q_scale = 1.0 / (dk as f32).sqrt();
    let mut conv_out = vec![0f32; conv_dim];
    for r in 0..t {
        // Causal depthwise conv over [history (kernel-1), current].
        let x = &qkv[r * conv_dim..(r + 1) * conv_dim];
        for ch in 0..conv_dim {
            let wk = &w.conv1d[ch * kernel..(ch + 1) * kernel];
            let mut acc = 0f32;
            for k in 0..kernel - 1 {
                acc += wk[k] * st.conv[k * conv_dim + ch];
            }
            acc += wk[kernel - 1] * x[ch];
            conv_out[ch] = silu(acc);
        }
        // Shift the history.
        if kernel > 1 {
            st.conv.copy_within(conv_dim.., 0);
            let last = (kernel - 2) * conv_dim;
            st.conv[last..last + conv_dim].copy_from_slice(x);
        }
        let (q_all, rest) = conv_out.split_at(key_dim);
        let (k_all, v_all) = rest.split_at(key_dim);
        let mut q = q_all.to_vec();
        let mut k = k_all.to_vec();
        for hk in 0..nk {
            l2_normalize(&mut q[hk * dk..(hk + 1) * dk], 1e-6);
            l2_normalize(&mut k[hk * dk..(hk + 1) * dk], 1e-6);
        }
        q.iter_mut().for_each(|v| *v *= q_scale);
        for hv in 0..nv {
            let hk = hv / group;
            let (qh, kh) = (&q[hk * dk..(hk + 1) * dk], &k[hk * dk..(hk + 1) * dk]);
            let vh = &v_all[hv * dv..(hv + 1) * dv];
            let beta = sigmoid(b[r * nv + hv]);
            let g = -w.a_log[hv].exp() * softplus(a[r * nv + hv] + w.dt_bias[hv]);
            let decay = g.exp();
            let s = &mut st.recurrent[hv * dk * dv..(hv + 1) * dk * dv];
            s.iter_mut().for_each(|x| *x *= decay);
            // kv_mem[j] = sum_i S[i][j] k[i]
            let mut delta = vec![0f32; dv];
            for i in 0..dk {
                let row = &s[i * dv..(i + 1) * dv];
                for j in 0..dv {
                    delta[j] += row[j] * kh[i];
                }
            }
            for j in 0..dv {
                delta[j] = (vh[j] - delta[j]) * beta;
            }
            let out = &mut core[r * value_dim + hv * dv..r * value_dim + (hv + 1) * dv];
            for i in 0..dk {
                let row = &mut s[i * dv..(i + 1) * dv];
                for j in 0..dv {
                    row[j] += kh[i] * delta[j];
                    out[j] += row[j] * qh[i];
                }
            }
        }
        if let Some(rows) = rows.as_deref_mut() {
            rows.push(st.clone());
        }
    }

    // Gated RMSNorm per value head, then out_proj.
    for r in 0..t {
        for hv in 0..nv {
            let o = &mut core[r * value_dim + hv * dv..r * value_dim + (hv + 1) * dv];
            let zz = &z[r * value_dim + hv * dv..r * value_dim + (hv + 1) * dv];
            let inv = rsqrt_mean_sq(o, eps);
            for j in 0..dv {
                let gate = match c.gate_act {
                    GateAct::Sigmoid => sigmoid(zz[j]),
                    GateAct::Silu => silu(zz[j]),
                };
                o[j] = w.norm[j] * (o[j] * inv) * gate;
            }
        }
    }
    let mut out = vec![0f32; t * hid];
    w.out_proj.lin(store).forward(&core, &mut out);
    out
}
