//! Random weight values: a seeded splitmix64 stream turned into approximately normal or
//! log-uniform numbers, written straight into little-endian tensor bytes.
//!
//! A tensor is generated in blocks of [`BLOCK`] elements, block `b` from its own stream seeded by
//! (tensor seed, b), so blocks can be generated in parallel and the bytes never depend on the
//! thread count.

use crate::dtype::{DType, f32_to_bf16};
use crate::ngram::splitmix64;

/// Elements per independently seeded block.
pub(crate) const BLOCK: usize = 1 << 20;

const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// How a tensor's values are drawn.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Init {
    /// mean + std * z, z approximately standard normal.
    Normal { mean: f32, std: f32 },
    /// ln(u), u uniform in [lo, hi) (`A_log`).
    LogUniform { lo: f32, hi: f32 },
    /// Fixed little-endian bytes (the n-gram hash buffers).
    Bytes(Vec<u8>),
}

/// splitmix64 as a stream.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GAMMA);
        splitmix64(self.0)
    }

    /// Irwin-Hall with four 16-bit uniforms from one draw: mean 0, variance 1, support ±2√3.
    fn normal(&mut self) -> f32 {
        let x = self.next();
        let sum: u32 = (0..4).map(|k| ((x >> (16 * k)) & 0xffff) as u32).sum();
        const SCALE: f32 = 1.732_050_8 / 65536.0; // √3 / 2^16
        (sum as f32 - 2.0 * 65536.0) * SCALE
    }

    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// Fills `out` with the little-endian bytes of elements `[block * BLOCK, ...)` of a tensor.
pub(crate) fn fill_block(init: &Init, dtype: DType, tensor_seed: u64, block: usize, out: &mut [u8]) {
    let mut rng = Rng(splitmix64(tensor_seed ^ (block as u64).wrapping_mul(GAMMA)));
    let mut value = || match *init {
        Init::Normal { mean, std } => mean + std * rng.normal(),
        Init::LogUniform { lo, hi } => (lo + (hi - lo) * rng.uniform()).ln(),
        Init::Bytes(_) => unreachable!("fixed bytes are written as they are"),
    };
    match dtype {
        DType::BF16 => out.chunks_exact_mut(2).for_each(|c| c.copy_from_slice(&f32_to_bf16(value()).to_le_bytes())),
        DType::F32 => out.chunks_exact_mut(4).for_each(|c| c.copy_from_slice(&value().to_le_bytes())),
        other => unreachable!("synthetic weights are BF16 or F32, not {other}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(v: &[f32]) -> (f64, f64) {
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        (mean, var.sqrt())
    }

    fn f32s(init: &Init, seed: u64, n: usize) -> Vec<f32> {
        let mut b = vec![0u8; n * 4];
        fill_block(init, DType::F32, seed, 0, &mut b);
        b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
    }

    #[test]
    fn normal_has_the_requested_moments() {
        let v = f32s(&Init::Normal { mean: 1.0, std: 0.1 }, 7, 200_000);
        let (m, s) = stats(&v);
        assert!((m - 1.0).abs() < 0.002 && (s - 0.1).abs() < 0.002, "mean {m} std {s}");
        // Bell-shaped: about 68% within one std (a uniform would give 58%).
        let within = v.iter().filter(|&&x| (x - 1.0).abs() < 0.1).count() as f64 / v.len() as f64;
        assert!((within - 0.68).abs() < 0.02, "{within}");
    }

    #[test]
    fn log_uniform_range_and_seeds() {
        let v = f32s(&Init::LogUniform { lo: 0.5, hi: 4.0 }, 1, 10_000);
        assert!(v.iter().all(|&x| x >= 0.5f32.ln() && x < 4f32.ln()));
        let (lo, hi) = v.iter().fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
        assert!(lo < 0.5f32.ln() + 0.01 && hi > 4f32.ln() - 0.01, "{lo} {hi}");
        let init = Init::Normal { mean: 0.0, std: 1.0 };
        assert_eq!(f32s(&init, 3, 64), f32s(&init, 3, 64));
        assert_ne!(f32s(&init, 3, 64), f32s(&init, 4, 64));
    }
}
