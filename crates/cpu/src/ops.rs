//! Elementwise operations, norms and RoPE, in f32.

/// transformers' `Qwen4ExpTextRMSNorm`: y = x / rms(x) * (1 + w), over groups of `group` elements
/// (`group == x.len()` for a plain norm; `group = hidden` normalises each hyper-connection stream).
pub fn rms_norm_zc(x: &[f32], w: &[f32], eps: f32, group: usize, out: &mut [f32]) {
    for ((xg, og), wg) in x.chunks_exact(group).zip(out.chunks_exact_mut(group)).zip(w.chunks_exact(group).cycle()) {
        let inv = rsqrt_mean_sq(xg, eps);
        for ((o, &v), &wv) in og.iter_mut().zip(xg).zip(wg) {
            *o = v * inv * (1.0 + wv);
        }
    }
}

/// 1 / sqrt(mean(x^2) + eps), the mean accumulated in f64 for a stable reference.
#[inline]
pub fn rsqrt_mean_sq(x: &[f32], eps: f32) -> f32 {
    let ms = x.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / x.len() as f64;
    (1.0 / (ms + eps as f64).sqrt()) as f32
}

/// In place: x * rsqrt(sum(x^2) + eps) (the FLA-compatible l2norm of the GDN).
pub fn l2_normalize(x: &mut [f32], eps: f32) {
    let ss = x.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>();
    let inv = (1.0 / (ss + eps as f64).sqrt()) as f32;
    x.iter_mut().for_each(|v| *v *= inv);
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// torch's softplus (beta 1, threshold 20).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// In-place softmax.
pub fn softmax(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut s = 0f64;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        s += *v as f64;
    }
    let inv = (1.0 / s) as f32;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// RoPE tables: `inv_freq[i] = 1 / theta^(2i / rotary_dim)`, computed in f32 as transformers does.
#[derive(Clone, Debug)]
pub struct Rope {
    pub rotary_dim: usize,
    inv_freq: Vec<f32>,
}

impl Rope {
    pub fn new(theta: f64, rotary_dim: usize) -> Rope {
        let inv_freq =
            (0..rotary_dim / 2).map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / rotary_dim as f32)).collect();
        Rope { rotary_dim, inv_freq }
    }

    /// Rotates the first `rotary_dim` elements of `x` (a head vector) to position `pos`
    /// (rotate-half convention: pairs (i, i + rotary_dim/2)).
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        let half = self.rotary_dim / 2;
        for i in 0..half {
            let f = pos as f32 * self.inv_freq[i];
            let (c, s) = (f.cos(), f.sin());
            let (a, b) = (x[i], x[i + half]);
            x[i] = a * c - b * s;
            x[i + half] = b * c + a * s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn norm_and_softmax() {
        let x = [3.0f32, 4.0];
        let mut o = [0f32; 2];
        rms_norm_zc(&x, &[0.0, 1.0], 0.0, 2, &mut o);
        let r = (12.5f32).sqrt();
        assert!((o[0] - 3.0 / r).abs() < 1e-6 && (o[1] - 8.0 / r).abs() < 1e-6);
        let mut s = [1.0f32, 2.0, 3.0];
        softmax(&mut s);
        assert!((s.iter().sum::<f32>() - 1.0).abs() < 1e-6 && s[2] > s[1]);
    }

    #[test]
    fn rope_position_zero_is_identity() {
        let r = Rope::new(1e7, 8);
        let mut x: Vec<f32> = (0..16).map(|i| i as f32).collect();
        let y = x.clone();
        r.apply(&mut x, 0);
        assert_eq!(x, y);
        r.apply(&mut x, 5);
        assert_eq!(x[8..], y[8..]);
    }
}
