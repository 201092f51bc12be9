//! `y = W x` for packed weights, decoded on the fly (no f32 copy of any weight).
//!
//! An affine weight row is consumed group by group: with x_g the inputs of group g,
//!   y = sum_g ( scale_g * sum_j q_j x_j + bias_g * sum_j x_j )
//! so each code costs one multiply-add and the per-group input sums are computed once per input
//! row, not once per weight row. Accumulation is f32. Rows of `W` are split across threads for
//! large matrices; the arithmetic per output element does not depend on the split, so results are
//! the same for any thread count and any batch size.

use anyhow::{Result, bail};
use cherenkov_model::DType;
use cherenkov_model::dtype::bf16_to_f32 as bf16;
use cherenkov_model::dtype::decode_f32;
use cherenkov_model::quant::Affine;
use cherenkov_model::store::{Precision, RecordMatrix, TensorView};
use rayon::prelude::*;

use crate::q4;

/// A borrowed weight matrix `[rows, cols]` (cols = input width).
#[derive(Clone, Copy)]
pub enum Linear<'a> {
    Affine { fmt: Affine, rows: usize, cols: usize, words: &'a [u32], scales: &'a [u16], biases: &'a [u16] },
    Float { dtype: DType, rows: usize, cols: usize, data: &'a [u8] },
}

/// Work per thread below which a matrix is not split.
const PAR_MIN_WEIGHTS: usize = 1 << 17;

impl<'a> Linear<'a> {
    pub fn from_view(v: &TensorView<'a>) -> Result<Linear<'a>> {
        let (rows, cols) = (v.meta.rows(), v.meta.cols());
        Self::from_parts(v.meta.precision, rows, cols, v.data, v.scales, v.biases, &v.meta.name)
    }

    /// A matrix inside an expert record.
    pub fn from_record(rec: &'a [u8], m: &RecordMatrix) -> Result<Linear<'a>> {
        let part = |s: Option<cherenkov_model::store::Span>| s.map(|s| &rec[s.range()]);
        Self::from_parts(
            m.precision,
            m.shape[0],
            m.shape[1],
            &rec[m.data.range()],
            part(m.scales),
            part(m.biases),
            "expert",
        )
    }

    fn from_parts(
        precision: Precision,
        rows: usize,
        cols: usize,
        data: &'a [u8],
        scales: Option<&'a [u8]>,
        biases: Option<&'a [u8]>,
        name: &str,
    ) -> Result<Linear<'a>> {
        Ok(match precision {
            Precision::Affine { bits, group_size } => {
                let fmt = Affine::new(bits, group_size);
                let (Some(s), Some(b)) = (scales, biases) else {
                    bail!("{name}: affine tensor without scales and biases")
                };
                Linear::Affine {
                    fmt,
                    rows,
                    cols,
                    words: bytemuck::try_cast_slice(data)
                        .map_err(|e| anyhow::anyhow!("{name}: words misaligned: {e}"))?,
                    scales: bytemuck::try_cast_slice(s)
                        .map_err(|e| anyhow::anyhow!("{name}: scales misaligned: {e}"))?,
                    biases: bytemuck::try_cast_slice(b)
                        .map_err(|e| anyhow::anyhow!("{name}: biases misaligned: {e}"))?,
                }
            }
            Precision::Float { dtype } => {
                if !dtype.is_float() {
                    bail!("{name}: {dtype} is not a weight type");
                }
                Linear::Float { dtype, rows, cols, data }
            }
        })
    }

    /// Codes per (scale, bias) group; 0 for float weights.
    fn group_size(&self) -> usize {
        match self {
            Linear::Affine { fmt, .. } => fmt.group_size,
            Linear::Float { .. } => 0,
        }
    }

    pub fn rows(&self) -> usize {
        match self {
            Linear::Affine { rows, .. } | Linear::Float { rows, .. } => *rows,
        }
    }

    pub fn cols(&self) -> usize {
        match self {
            Linear::Affine { cols, .. } | Linear::Float { cols, .. } => *cols,
        }
    }

    /// Decodes row `r` to f32 (embedding lookups, tests).
    pub fn row(&self, r: usize, out: &mut [f32]) {
        match *self {
            Linear::Affine { fmt, cols, words, scales, biases, .. } => {
                let (wpr, gpr) = (fmt.words_per_row(cols), fmt.groups_per_row(cols));
                cherenkov_model::quant::dequantize_row(
                    &words[r * wpr..(r + 1) * wpr],
                    &scales[r * gpr..(r + 1) * gpr],
                    &biases[r * gpr..(r + 1) * gpr],
                    fmt,
                    out,
                );
            }
            Linear::Float { dtype, cols, data, .. } => {
                let sz = dtype.size();
                decode_f32(dtype, &data[r * cols * sz..(r + 1) * cols * sz], out).expect("float row");
            }
        }
    }

    /// `y[t] = W x[t]` for `t` in `0..x.len() / cols`; `y` is `[t, rows]`.
    pub fn forward(&self, x: &[f32], y: &mut [f32]) {
        let (rows, cols) = (self.rows(), self.cols());
        let n = x.len() / cols;
        debug_assert_eq!(x.len(), n * cols);
        debug_assert_eq!(y.len(), n * rows);
        // Per input row, the sum of its inputs over each group (affine bias term).
        let xsums: Vec<f32> = match self {
            Linear::Affine { fmt, .. } => x.chunks_exact(fmt.group_size).map(|g| g.iter().sum::<f32>()).collect(),
            Linear::Float { .. } => Vec::new(),
        };
        let mut yt = vec![0f32; n * rows];
        // yt is [rows, n] so each task writes one contiguous block.
        let per_task = (PAR_MIN_WEIGHTS / cols.max(1)).max(1);
        let work = |(ci, block): (usize, &mut [f32])| {
            let r0 = ci * per_task;
            let mut scratch = vec![0f32; cols];
            for (k, out) in block.chunks_exact_mut(n).enumerate() {
                self.row_dots(r0 + k, x, &xsums, &mut scratch, out);
            }
        };
        if rows * cols >= 2 * PAR_MIN_WEIGHTS {
            yt.par_chunks_mut(per_task * n).enumerate().for_each(work);
        } else {
            yt.chunks_mut(per_task * n).enumerate().for_each(work);
        }
        for r in 0..rows {
            for t in 0..n {
                y[t * rows + r] = yt[r * n + t];
            }
        }
    }

    /// What [`Linear::dot_one`] needs of an input row beside its values: the per-group sums, and
    /// for 4-bit rows of whole groups of 64 or a multiple, on a CPU with AVX-512 VNNI, the row in
    /// fixed point ([`crate::q4`]).
    pub fn prepare(&self, x: &[f32]) -> DotInput {
        match *self {
            Linear::Affine { fmt, cols, .. } => DotInput {
                len: x.len(),
                group_size: fmt.group_size,
                sums: group_sums(x, fmt.group_size),
                fixed: (fmt.bits == 4
                    && fmt.group_size.is_multiple_of(q4::CHUNK)
                    && cols.is_multiple_of(fmt.group_size)
                    && x.len() == cols
                    && q4::use_vnni())
                .then(|| q4::Fixed::new(x)),
            },
            Linear::Float { .. } => DotInput { len: x.len(), group_size: 0, sums: Vec::new(), fixed: None },
        }
    }

    /// Whether an input prepared for `self` serves `other` ([`Linear::prepare`] would give the same).
    pub fn same_input(&self, other: &Linear) -> bool {
        match (self, other) {
            (Linear::Affine { fmt: a, .. }, Linear::Affine { fmt: b, .. }) => a == b,
            (Linear::Float { .. }, Linear::Float { .. }) => true,
            _ => false,
        }
    }

    /// The dot product of weight row `r` with one input row `x` (`input`: [`Linear::prepare`] of
    /// `x` for this matrix). The single-token path of the experts computed on the CPU
    /// ([`crate::expert`]): 4-bit rows use [`crate::q4`]'s vector kernels where the CPU has them,
    /// every other format the decode-then-dot of [`Linear::forward`]. The result does not depend
    /// on which rows a thread takes.
    pub fn dot_one(&self, r: usize, x: &[f32], input: &DotInput) -> f32 {
        assert!(
            input.len == x.len() && input.group_size == self.group_size(),
            "an input prepared for another input row or matrix"
        );
        if let Linear::Affine { fmt, cols, words, scales, biases, .. } = *self
            && fmt.bits == 4
            && fmt.group_size.is_multiple_of(8)
        {
            let (wpr, gpr) = (fmt.words_per_row(cols), fmt.groups_per_row(cols));
            let (w, s, b) =
                (&words[r * wpr..(r + 1) * wpr], &scales[r * gpr..(r + 1) * gpr], &biases[r * gpr..(r + 1) * gpr]);
            return q4::dot(w, s, b, &x[..cols], &input.sums[..gpr], input.fixed.as_ref(), fmt.group_size);
        }
        // A decoded row per thread, reused: this runs once per row of every expert the CPU computes.
        thread_local! {
            static ROW: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        ROW.with(|row| {
            let mut scratch = row.borrow_mut();
            scratch.resize(self.cols(), 0.0);
            let mut out = [0f32];
            self.row_dots(r, x, &input.sums, &mut scratch, &mut out);
            out[0]
        })
    }

    /// Dot products of weight row `r` with every input row.
    #[inline]
    fn row_dots(&self, r: usize, x: &[f32], xsums: &[f32], scratch: &mut [f32], out: &mut [f32]) {
        match *self {
            Linear::Affine { fmt, cols, words, scales, biases, .. } => {
                let (wpr, gpr, gs) = (fmt.words_per_row(cols), fmt.groups_per_row(cols), fmt.group_size);
                let w = &words[r * wpr..(r + 1) * wpr];
                // Unpack the codes once (as f32), then reuse them for every input row.
                unpack_codes(w, fmt.bits, scratch);
                let s = &scales[r * gpr..(r + 1) * gpr];
                let b = &biases[r * gpr..(r + 1) * gpr];
                for (t, o) in out.iter_mut().enumerate() {
                    let xr = &x[t * cols..(t + 1) * cols];
                    let xs = &xsums[t * gpr..(t + 1) * gpr];
                    let mut acc = 0f32;
                    for g in 0..gpr {
                        let q = &scratch[g * gs..(g + 1) * gs];
                        let xg = &xr[g * gs..(g + 1) * gs];
                        acc += bf16(s[g]) * dot(q, xg) + bf16(b[g]) * xs[g];
                    }
                    *o = acc;
                }
            }
            Linear::Float { dtype, cols, data, .. } => {
                let sz = dtype.size();
                decode_f32(dtype, &data[r * cols * sz..(r + 1) * cols * sz], scratch).expect("float row");
                for (t, o) in out.iter_mut().enumerate() {
                    *o = dot(scratch, &x[t * cols..(t + 1) * cols]);
                }
            }
        }
    }
}

/// An input row prepared for [`Linear::dot_one`] by [`Linear::prepare`].
#[derive(Clone, Debug)]
pub struct DotInput {
    /// The length of the input row it was prepared from.
    len: usize,
    /// The group size the sums are over (0 for float weights, which need none).
    group_size: usize,
    sums: Vec<f32>,
    fixed: Option<q4::Fixed>,
}

/// Per-group sums of `x` (the affine bias term's input; empty for float weights' callers that
/// pass it anyway).
pub fn group_sums(x: &[f32], group_size: usize) -> Vec<f32> {
    x.chunks_exact(group_size).map(|g| g.iter().sum::<f32>()).collect()
}

/// Dot product with 8 independent accumulators (vectorizes; fixed order, so deterministic).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// Unpacks a row of LSB-first codes to f32.
#[inline]
fn unpack_codes(words: &[u32], bits: u32, out: &mut [f32]) {
    match bits {
        4 => {
            for (w, o) in words.iter().zip(out.chunks_exact_mut(8)) {
                for k in 0..8 {
                    o[k] = ((w >> (4 * k)) & 0xF) as f32;
                }
            }
        }
        8 => {
            for (w, o) in words.iter().zip(out.chunks_exact_mut(4)) {
                for k in 0..4 {
                    o[k] = ((w >> (8 * k)) & 0xFF) as f32;
                }
            }
        }
        2 => {
            for (w, o) in words.iter().zip(out.chunks_exact_mut(16)) {
                for k in 0..16 {
                    o[k] = ((w >> (2 * k)) & 0x3) as f32;
                }
            }
        }
        _ => {
            for (j, o) in out.iter_mut().enumerate() {
                *o = cherenkov_model::quant::get_code(words, j, bits) as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{Quantized, rand_vec};
    use cherenkov_model::quant::dequantize_row;

    #[test]
    fn affine_forward_matches_dequantized_reference() {
        for bits in [2, 3, 4, 5, 6, 8] {
            let (rows, cols) = (37, 192);
            let fmt = Affine::new(bits, 64);
            let m = Quantized::new(rows, cols, fmt, bits as u64);
            let (lin, q) = (m.linear(), &m.q);
            let x = rand_vec(3 * cols, 99);
            let mut y = vec![0f32; 3 * rows];
            lin.forward(&x, &mut y);
            let mut row = vec![0f32; cols];
            for r in 0..rows {
                let (wpr, gpr) = (fmt.words_per_row(cols), fmt.groups_per_row(cols));
                dequantize_row(
                    &q.words[r * wpr..(r + 1) * wpr],
                    &q.scales[r * gpr..(r + 1) * gpr],
                    &q.biases[r * gpr..(r + 1) * gpr],
                    fmt,
                    &mut row,
                );
                for t in 0..3 {
                    let want: f64 =
                        row.iter().zip(&x[t * cols..(t + 1) * cols]).map(|(a, b)| *a as f64 * *b as f64).sum();
                    let got = y[t * rows + r] as f64;
                    assert!(
                        (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                        "bits {bits} row {r} t {t}: {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn batch_rows_equal_single_rows() {
        let (rows, cols) = (600, 512);
        let data: Vec<u8> = rand_vec(rows * cols, 5).iter().flat_map(|x| x.to_le_bytes()).collect();
        let lin = Linear::Float { dtype: DType::F32, rows, cols, data: &data };
        let x = rand_vec(4 * cols, 7);
        let mut all = vec![0f32; 4 * rows];
        lin.forward(&x, &mut all);
        for t in 0..4 {
            let mut one = vec![0f32; rows];
            lin.forward(&x[t * cols..(t + 1) * cols], &mut one);
            assert_eq!(one, all[t * rows..(t + 1) * rows]);
        }
    }
}
