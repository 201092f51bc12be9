//! One routed expert for one token, computed from its packed record with the work split by rows,
//! so that a team of threads can share one expert: `act = silu(gate x) * (up x)` by rows of the
//! intermediate width, then `y = down act` by rows of the hidden width. The GPU backend uses it for
//! the experts it chooses to compute on the CPU instead of copying their records
//! (`--cpu-experts`); the split only decides which thread computes a row, never a row's value.

use std::ops::Range;

use anyhow::{Result, bail};
use cherenkov_model::store::ExpertLayout;

use crate::linear::{DotInput, Linear};
use crate::ops::silu;

/// The three matrices of one expert record.
#[derive(Clone, Copy)]
pub struct ExpertMatrices<'a> {
    pub gate: Linear<'a>,
    pub up: Linear<'a>,
    pub down: Linear<'a>,
}

impl<'a> ExpertMatrices<'a> {
    /// The matrices of `rec`, a record of a layer laid out as `layout`.
    pub fn from_record(rec: &'a [u8], layout: &ExpertLayout) -> Result<ExpertMatrices<'a>> {
        let m = ExpertMatrices {
            gate: Linear::from_record(rec, &layout.gate_proj)?,
            up: Linear::from_record(rec, &layout.up_proj)?,
            down: Linear::from_record(rec, &layout.down_proj)?,
        };
        let (i, h) = (m.gate.rows(), m.gate.cols());
        if m.up.rows() != i || m.up.cols() != h || m.down.rows() != h || m.down.cols() != i {
            bail!(
                "expert record of {}: gate [{i}, {h}], up [{}, {}] and down [{}, {}] do not make an MLP",
                layout.layer,
                m.up.rows(),
                m.up.cols(),
                m.down.rows(),
                m.down.cols()
            );
        }
        Ok(m)
    }

    /// The hidden width (the input's and the output's length).
    pub fn hidden(&self) -> usize {
        self.gate.cols()
    }

    /// The intermediate width (the activation's length).
    pub fn intermediate(&self) -> usize {
        self.gate.rows()
    }

    /// What [`ExpertMatrices::gate_up_rows`] needs of its input beside its values (see
    /// [`Linear::prepare`]); prepared once per expert and token, shared by the threads.
    pub fn prepare_input(&self, x: &[f32]) -> ExpertInput {
        let gate = self.gate.prepare(x);
        let up = (!self.gate.same_input(&self.up)).then(|| self.up.prepare(x));
        ExpertInput { gate, up }
    }

    /// What [`ExpertMatrices::down_rows`] needs of the activation beside its values.
    pub fn prepare_act(&self, act: &[f32]) -> DotInput {
        self.down.prepare(act)
    }

    /// `act[r - rows.start] = silu(gate_r x) * (up_r x)` for `r` in `rows`.
    pub fn gate_up_rows(&self, x: &[f32], input: &ExpertInput, rows: Range<usize>, act: &mut [f32]) {
        let up_input = input.up.as_ref().unwrap_or(&input.gate);
        for (r, a) in rows.zip(act.iter_mut()) {
            *a = silu(self.gate.dot_one(r, x, &input.gate)) * self.up.dot_one(r, x, up_input);
        }
    }

    /// `y[r - rows.start] = down_r act` for `r` in `rows`.
    pub fn down_rows(&self, act: &[f32], input: &DotInput, rows: Range<usize>, y: &mut [f32]) {
        for (r, o) in rows.zip(y.iter_mut()) {
            *o = self.down.dot_one(r, act, input);
        }
    }

    /// The whole expert on the calling thread.
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let mut act = vec![0f32; self.intermediate()];
        self.gate_up_rows(x, &self.prepare_input(x), 0..act.len(), &mut act);
        let mut y = vec![0f32; self.hidden()];
        self.down_rows(&act, &self.prepare_act(&act), 0..y.len(), &mut y);
        y
    }
}

/// An expert's input prepared for its gate and up rows (see [`ExpertMatrices::prepare_input`]).
pub struct ExpertInput {
    gate: DotInput,
    /// Where up's format differs from gate's (mixed-precision checkpoints); else gate's serves.
    up: Option<DotInput>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{Quantized, expert, matrices, rand_vec};
    use cherenkov_model::quant::Affine;

    /// The expert by the CPU backend's batch path (`Linear::forward`), against the single-token
    /// rows split over "threads", for the widths the GPU path meets. At 4 bits and widths of whole
    /// groups of 64 both phases take the fixed-point kernel where the CPU has VNNI; an intermediate
    /// width of 96 gives the down rows the float kernel.
    #[test]
    fn split_rows_match_the_batch_path() {
        let shapes = [(4, 64, 96), (4, 64, 128), (4, 128, 256), (4, 32, 96), (8, 64, 96), (3, 64, 96), (2, 32, 96)];
        for (bits, gs, i) in shapes {
            let h = 2 * i.max(128);
            let fmt = Affine::new(bits, gs);
            let q = expert(i, h, fmt, 1);
            let m = matrices(&q);
            let x = rand_vec(h, 9);
            // Reference: the batch kernels.
            let (mut gv, mut uv) = (vec![0f32; i], vec![0f32; i]);
            m.gate.forward(&x, &mut gv);
            m.up.forward(&x, &mut uv);
            let act: Vec<f32> = gv.iter().zip(&uv).map(|(a, b)| silu(*a) * b).collect();
            let mut want = vec![0f32; h];
            m.down.forward(&act, &mut want);
            let whole = m.forward(&x);
            // Rows in uneven chunks, as a team would take them.
            let xs = m.prepare_input(&x);
            let mut a2 = vec![0f32; i];
            for c in [0..7, 7..40, 40..i] {
                m.gate_up_rows(&x, &xs, c.clone(), &mut a2[c]);
            }
            let asums = m.prepare_act(&a2);
            let mut y2 = vec![0f32; h];
            for c in [0..100, 100..101, 101..h] {
                m.down_rows(&a2, &asums, c.clone(), &mut y2[c]);
            }
            assert_eq!(whole, y2, "bits {bits} gs {gs} i {i}: the split changed a value");
            for (r, (got, want)) in whole.iter().zip(&want).enumerate() {
                assert!(
                    (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                    "bits {bits} gs {gs} i {i} row {r}: {got} vs {want}"
                );
            }
        }
    }

    /// An input prepared for one matrix is refused by a matrix of another width, whichever
    /// kernel would run (it would otherwise read the wrong sums or digits).
    #[test]
    fn an_input_prepared_for_another_matrix_is_refused() {
        let q = expert(64, 256, Affine::new(4, 64), 3);
        let m = matrices(&q);
        let (x, act) = (rand_vec(256, 1), rand_vec(64, 2));
        let for_gate = m.gate.prepare(&x);
        let wrong = std::panic::catch_unwind(|| m.down.dot_one(0, &act, &for_gate));
        assert!(wrong.is_err(), "down took gate's prepared input");
        assert!(m.down.dot_one(0, &act, &m.down.prepare(&act)).is_finite());
    }

    /// The single-token 4-bit dot (its vector kernels, where the CPU has them) against the batch path.
    #[test]
    fn q4_paths_agree() {
        let (rows, cols) = (5, 512);
        let fmt = Affine::new(4, 64);
        let q = Quantized::new(rows, cols, fmt, 4);
        let l = q.linear();
        let x = rand_vec(cols, 5);
        let input = l.prepare(&x);
        let mut want = vec![0f32; rows];
        l.forward(&x, &mut want);
        for (r, want) in want.iter().enumerate() {
            let fast = l.dot_one(r, &x, &input);
            assert!((fast - want).abs() <= 1e-4 * (1.0 + want.abs()), "row {r}: {fast} vs {want}");
        }
    }
}
