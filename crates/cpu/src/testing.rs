//! Helpers for the CPU kernels' unit tests: reproducible random vectors and random matrices
//! quantized to an affine format.

use cherenkov_model::quant::{Affine, QuantizedMatrix, quantize_matrix};

use crate::expert::ExpertMatrices;
use crate::linear::Linear;

/// `n` values in [-0.5, 0.5) from `seed` (a linear congruential sequence).
pub fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect()
}

/// A random `[rows, cols]` matrix (rounded to BF16) quantized to `fmt`.
pub struct Quantized {
    pub q: QuantizedMatrix,
    pub rows: usize,
    pub cols: usize,
    pub fmt: Affine,
}

impl Quantized {
    pub fn new(rows: usize, cols: usize, fmt: Affine, seed: u64) -> Quantized {
        let bf: Vec<u16> =
            rand_vec(rows * cols, seed).iter().map(|&x| cherenkov_model::dtype::f32_to_bf16(x)).collect();
        Quantized { q: quantize_matrix(&bf, rows, cols, fmt), rows, cols, fmt }
    }

    pub fn linear(&self) -> Linear<'_> {
        let (q, fmt, rows, cols) = (&self.q, self.fmt, self.rows, self.cols);
        Linear::Affine { fmt, rows, cols, words: &q.words, scales: &q.scales, biases: &q.biases }
    }
}

/// Gate, up and down of a random expert (intermediate `i`, hidden `h`), seeds from `seed`.
pub fn expert(i: usize, h: usize, fmt: Affine, seed: u64) -> [Quantized; 3] {
    [Quantized::new(i, h, fmt, seed), Quantized::new(i, h, fmt, seed + 1), Quantized::new(h, i, fmt, seed + 2)]
}

/// The matrices of [`expert`]'s result.
pub fn matrices(m: &[Quantized; 3]) -> ExpertMatrices<'_> {
    ExpertMatrices { gate: m[0].linear(), up: m[1].linear(), down: m[2].linear() }
}
