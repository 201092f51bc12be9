//! The Rust quantizer against real `mx.quantize` output (fixtures/quant, made by
//! tools/fixtures/make_quant.py with mlx[cpu]): words, scales and biases bit for bit, and
//! dequantization equal to MLX's.

use std::path::PathBuf;

use cherenkov_model::quant::{Affine, dequantize_row, quantize_matrix};
use cherenkov_model::safetensors::SafeTensors;

fn fixture() -> SafeTensors {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/quant/mlx-affine.safetensors");
    SafeTensors::open(&p).unwrap()
}

fn u16s(st: &SafeTensors, name: &str) -> Vec<u16> {
    let t = st.get(name).unwrap_or_else(|| panic!("fixture lacks {name}"));
    st.read(t).unwrap().chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect()
}

#[test]
fn quantize_is_bit_exact_with_mlx() {
    let st = fixture();
    let mut checked = 0;
    for bits in [2u32, 3, 4, 5, 6, 8] {
        for gs in [32usize, 64, 128] {
            let key = format!("{bits}.{gs}");
            let wt = st.get(&format!("w.{key}")).unwrap();
            let (rows, cols) = (wt.shape[0], wt.shape[1]);
            let w = u16s(&st, &format!("w.{key}"));
            let fmt = Affine::new(bits, gs);
            let q = quantize_matrix(&w, rows, cols, fmt);
            let qt = st.get(&format!("q.{key}")).unwrap();
            let want_q: Vec<u32> =
                st.read(qt).unwrap().chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
            let want_s = u16s(&st, &format!("s.{key}"));
            let want_b = u16s(&st, &format!("b.{key}"));
            for r in 0..rows {
                let wpr = fmt.words_per_row(cols);
                let gpr = fmt.groups_per_row(cols);
                assert_eq!(
                    q.words[r * wpr..(r + 1) * wpr],
                    want_q[r * wpr..(r + 1) * wpr],
                    "words, bits {bits} group {gs} row {r}"
                );
                assert_eq!(
                    q.scales[r * gpr..(r + 1) * gpr],
                    want_s[r * gpr..(r + 1) * gpr],
                    "scales, bits {bits} group {gs} row {r}"
                );
                assert_eq!(
                    q.biases[r * gpr..(r + 1) * gpr],
                    want_b[r * gpr..(r + 1) * gpr],
                    "biases, bits {bits} group {gs} row {r}"
                );
            }
            // Dequantization matches mx.dequantize (f32 scales and biases).
            let dt = st.get(&format!("deq.{key}")).unwrap();
            let want_d: Vec<f32> =
                st.read(dt).unwrap().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
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
                for (j, (&a, &b)) in row.iter().zip(&want_d[r * cols..(r + 1) * cols]).enumerate() {
                    assert!(a.to_bits() == b.to_bits(), "dequant bits {bits} group {gs} [{r},{j}]: {a} vs mlx {b}");
                }
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 18);
}
