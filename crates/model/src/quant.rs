//! MLX affine quantization, bit for bit.
//!
//! A row of `cols` weights is cut into groups of `group_size`; each group has a scale and a bias
//! (stored as bf16) and each weight a `bits`-wide code q in `[0, 2^bits)`, so w = scale * q + bias.
//! The codes of one row form a little-endian bit stream, least significant bit first: code j occupies
//! bits `[j*bits, (j+1)*bits)`, packed into u32 words (3-, 5- and 6-bit codes straddle words). A row
//! therefore takes `cols * bits / 32` words, `cols / group_size` scales and as many biases.
//!
//! [`quantize_row`] reproduces MLX's CPU `fast::Quantize` exactly (same f32 arithmetic, same
//! round-half-even, same order of operations); the test below checks it against `mx.quantize`
//! output for every supported bits/group size. Do not reorder its arithmetic: the scale is divided,
//! not multiplied by a reciprocal, and q is computed from the f32 scale before it is rounded to bf16.

use anyhow::{Result, bail};
use serde::{Deserialize, Serialize};

use crate::dtype::{bf16_to_f32, f32_to_bf16};

pub const SUPPORTED_BITS: [u32; 6] = [2, 3, 4, 5, 6, 8];
pub const SUPPORTED_GROUPS: [usize; 3] = [32, 64, 128];

/// Bits per code and codes per (scale, bias) group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Affine {
    pub bits: u32,
    pub group_size: usize,
}

impl Affine {
    pub const fn new(bits: u32, group_size: usize) -> Affine {
        Affine { bits, group_size }
    }

    /// Checks the format and that it can hold a row of `cols` weights.
    pub fn check(&self, cols: usize) -> Result<()> {
        if !SUPPORTED_BITS.contains(&self.bits) {
            bail!("{} bits is not an MLX affine width (supported: 2, 3, 4, 5, 6, 8)", self.bits);
        }
        if !SUPPORTED_GROUPS.contains(&self.group_size) {
            bail!("group size {} is not supported (32, 64 or 128)", self.group_size);
        }
        if !cols.is_multiple_of(self.group_size) {
            bail!("a row of {cols} weights is not a whole number of groups of {}", self.group_size);
        }
        Ok(())
    }

    pub fn words_per_row(&self, cols: usize) -> usize {
        cols * self.bits as usize / 32
    }

    pub fn groups_per_row(&self, cols: usize) -> usize {
        cols / self.group_size
    }

    /// Bytes of one quantized row: words + scales + biases.
    pub fn row_bytes(&self, cols: usize) -> usize {
        self.words_per_row(cols) * 4 + self.groups_per_row(cols) * 4
    }
}

impl std::fmt::Display for Affine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "q{}g{}", self.bits, self.group_size)
    }
}

/// Quantizes one row (f32 values, normally exact bf16 values) as `mx.quantize` does.
pub fn quantize_row(w: &[f32], fmt: Affine, words: &mut [u32], scales: &mut [u16], biases: &mut [u16]) {
    let bits = fmt.bits;
    let gs = fmt.group_size;
    let n_bins = ((1u32 << bits) - 1) as f32;
    let eps = 1e-7f32;
    words.iter_mut().for_each(|x| *x = 0);
    for (g, group) in w.chunks_exact(gs).enumerate() {
        let mut w_min = f32::INFINITY;
        let mut w_max = f32::NEG_INFINITY;
        for &x in group {
            w_max = w_max.max(x);
            w_min = w_min.min(x);
        }
        let mask = w_min.abs() > w_max.abs();
        let mut scale = ((w_max - w_min) / n_bins).max(eps);
        scale = if mask { scale } else { -scale };
        let edge = if mask { w_min } else { w_max };
        let q0 = (edge / scale).round_ties_even();
        let mut bias = 0.0f32;
        if q0 != 0.0 {
            scale = edge / q0;
            bias = edge;
        }
        for (k, &x) in group.iter().enumerate() {
            let q = ((x - bias) / scale).round_ties_even().clamp(0.0, n_bins) as u32;
            put_code(words, g * gs + k, bits, q);
        }
        scales[g] = f32_to_bf16(scale);
        biases[g] = f32_to_bf16(bias);
    }
}

/// Writes code `q` at position `j` of a packed row.
#[inline]
pub fn put_code(words: &mut [u32], j: usize, bits: u32, q: u32) {
    let bit = j * bits as usize;
    let (w, s) = (bit / 32, (bit % 32) as u32);
    words[w] |= q << s;
    if s + bits > 32 {
        words[w + 1] |= q >> (32 - s);
    }
}

/// Reads code `j` of a packed row.
#[inline]
pub fn get_code(words: &[u32], j: usize, bits: u32) -> u32 {
    let bit = j * bits as usize;
    let (w, s) = (bit / 32, (bit % 32) as u32);
    let mask = (1u32 << bits) - 1;
    let mut q = words[w] >> s;
    if s + bits > 32 {
        q |= words[w + 1] << (32 - s);
    }
    q & mask
}

/// w = scale * q + bias for one row, in f32 (scales and biases upcast from bf16 first).
pub fn dequantize_row(words: &[u32], scales: &[u16], biases: &[u16], fmt: Affine, out: &mut [f32]) {
    let gs = fmt.group_size;
    for (g, chunk) in out.chunks_exact_mut(gs).enumerate() {
        let s = bf16_to_f32(scales[g]);
        let b = bf16_to_f32(biases[g]);
        for (k, o) in chunk.iter_mut().enumerate() {
            *o = s * get_code(words, g * gs + k, fmt.bits) as f32 + b;
        }
    }
}

/// A quantized matrix: `rows` rows of `cols` weights.
#[derive(Clone, Debug, Default)]
pub struct QuantizedMatrix {
    pub words: Vec<u32>,
    pub scales: Vec<u16>,
    pub biases: Vec<u16>,
}

/// Quantizes a row-major `[rows, cols]` matrix of bf16 bit patterns.
pub fn quantize_matrix(bf16: &[u16], rows: usize, cols: usize, fmt: Affine) -> QuantizedMatrix {
    use rayon::prelude::*;
    let wpr = fmt.words_per_row(cols);
    let gpr = fmt.groups_per_row(cols);
    let mut m =
        QuantizedMatrix { words: vec![0; rows * wpr], scales: vec![0; rows * gpr], biases: vec![0; rows * gpr] };
    let work = |((src, w), (s, b)): ((&[u16], &mut [u32]), (&mut [u16], &mut [u16]))| {
        let row: Vec<f32> = src.iter().map(|&x| bf16_to_f32(x)).collect();
        quantize_row(&row, fmt, w, s, b);
    };
    let iter = bf16
        .chunks_exact(cols)
        .zip(m.words.chunks_exact_mut(wpr))
        .zip(m.scales.chunks_exact_mut(gpr).zip(m.biases.chunks_exact_mut(gpr)));
    if rows * cols >= 1 << 16 {
        bf16.par_chunks_exact(cols)
            .zip(m.words.par_chunks_exact_mut(wpr))
            .zip(m.scales.par_chunks_exact_mut(gpr).zip(m.biases.par_chunks_exact_mut(gpr)))
            .for_each(work);
    } else {
        iter.for_each(work);
    }
    m
}

/// Byte view helpers for writing words, scales and biases little-endian.
pub fn u32s_to_le_bytes(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn u16s_to_le_bytes(v: &[u16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn le_bytes_to_u32s(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

pub fn le_bytes_to_u16s(b: &[u8]) -> Vec<u16> {
    b.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_every_width() {
        for bits in SUPPORTED_BITS {
            let cols = 128;
            let mut words = vec![0u32; cols * bits as usize / 32];
            let codes: Vec<u32> = (0..cols as u32).map(|j| (j * 7 + 3) % (1 << bits)).collect();
            for (j, &q) in codes.iter().enumerate() {
                put_code(&mut words, j, bits, q);
            }
            for (j, &q) in codes.iter().enumerate() {
                assert_eq!(get_code(&words, j, bits), q, "bits {bits} code {j}");
            }
        }
    }

    #[test]
    fn constant_group_has_zero_scale_path() {
        let fmt = Affine::new(4, 32);
        let w = vec![0.375f32; 32];
        let (mut q, mut s, mut b) = (vec![0u32; 4], vec![0u16; 1], vec![0u16; 1]);
        quantize_row(&w, fmt, &mut q, &mut s, &mut b);
        let mut out = vec![0f32; 32];
        dequantize_row(&q, &s, &b, fmt, &mut out);
        assert!(out.iter().all(|&x| x == 0.375), "{out:?}");
    }
}
