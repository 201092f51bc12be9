//! One 4-bit affine row against one input row: the single-token kernel of the experts the CPU
//! computes for the GPU backend (`--cpu-experts`, [`crate::expert`]).
//!
//! A row holds `cols` codes (LSB-first, 8 per u32 word), in groups of `gs` codes with a bf16 scale
//! and bias each, and computes
//!   y = sum_g scale_g * (sum_j q_j x_j) + bias_g * xsum_g
//! where xsum_g is the sum of the group's inputs. Three kernels, the first the CPU can run:
//!
//! - `vnni` (AVX-512 with VNNI, groups a multiple of 64 codes): the input is held in fixed
//!   point ([`Fixed`]): per chunk of 64 inputs x_j = step * n_j, |n_j| <= 2^22 - 2^15, each n_j as
//!   three balanced base-256 digits (signed bytes). `vpdpbusd` multiplies the codes (unsigned
//!   bytes) by a digit and sums four products a lane exactly; a lane's three digit sums combine
//!   exactly in 32 bits (|lane| < 4 x 15 x 2^22 < 2^28); each chunk's lanes then become floats, scaled by
//!   scale_g * step. Rounding the input to its step costs less than one step, 2^-22 of its
//!   chunk's largest value (the GPU's dp4a kernels hold their input the same way).
//! - `avx2` (AVX2 and FMA, groups a multiple of 32): each word's codes to floats, four chains of
//!   multiply-adds.
//! - `portable`.
//!
//! Every kernel's result depends only on the row and the input, never on which thread or which
//! other rows, so a team may split an expert's rows any way.

use std::sync::OnceLock;

use cherenkov_model::dtype::bf16_to_f32 as bf16;

/// Inputs per fixed-point chunk: a chunk's codes are 32 bytes, 64 when unpacked, one 512-bit
/// register.
pub const CHUNK: usize = 64;

/// The largest |n_j| of a chunk: its top digit then stays within +-64, so rounding never carries
/// a digit out of a signed byte.
const N_MAX: f32 = ((1 << 22) - (1 << 15)) as f32;

/// Whether `vnni` runs here: the CPU has AVX-512 (F, BW, VL) and VNNI, and
/// `CHERENKOV_CPU_NO_VNNI=1` (a measurement knob: the float kernel instead) is not set.
pub fn use_vnni() -> bool {
    static USE: OnceLock<bool> = OnceLock::new();
    *USE.get_or_init(|| {
        let off = std::env::var_os("CHERENKOV_CPU_NO_VNNI").is_some_and(|v| v == "1");
        !off && has_vnni()
    })
}

/// The kernel 4-bit expert rows take here (groups of 64 or a multiple), in words for reports.
pub fn kernel_name() -> &'static str {
    if use_vnni() {
        return "AVX-512 VNNI on fixed-point inputs";
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
        return "AVX2 floats";
    }
    "portable floats"
}

fn has_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// An input row in fixed point, for `vnni` (see the module docs).
///
/// `digits`: per chunk of [`CHUNK`] inputs, three runs of 64 signed bytes (the digits of weight
/// 65536, 256 and 1), each in input order. `step`: per chunk, the value of one unit (0 for a chunk
/// of zeros; NaN where the chunk holds a NaN or an infinity, so the result is NaN, as the float
/// kernels' would be non-finite).
#[derive(Clone, Debug, PartialEq)]
pub struct Fixed {
    pub digits: Vec<i8>,
    pub step: Vec<f32>,
}

impl Fixed {
    /// `x` in fixed point; its length must be a multiple of [`CHUNK`].
    pub fn new(x: &[f32]) -> Fixed {
        assert!(x.len().is_multiple_of(CHUNK), "fixed-point input of {} values: not whole chunks of {CHUNK}", x.len());
        #[cfg(target_arch = "x86_64")]
        if has_vnni() {
            // SAFETY: the CPU has AVX-512 F and BW (checked above).
            return unsafe { fixed_avx512(x) };
        }
        Fixed::portable(x)
    }

    /// [`Fixed::new`] without vector instructions (the same values).
    pub fn portable(x: &[f32]) -> Fixed {
        let chunks = x.len() / CHUNK;
        let mut f = Fixed { digits: vec![0; 3 * CHUNK * chunks], step: vec![0.0; chunks] };
        for (c, xc) in x.chunks_exact(CHUNK).enumerate() {
            let Some((step, inv)) = chunk_scale(xc.iter().fold(0, |m, v| m.max(v.abs().to_bits()))) else {
                f.step[c] = f32::NAN;
                continue;
            };
            f.step[c] = step;
            let d = &mut f.digits[3 * CHUNK * c..3 * CHUNK * (c + 1)];
            for (j, &v) in xc.iter().enumerate() {
                let n = (v * inv).round_ties_even() as i32;
                // Balanced digits: each is the low byte read as signed, the rest carried up.
                let d0 = n as i8;
                let r = (n - d0 as i32) >> 8;
                let d1 = r as i8;
                let d2 = ((r - d1 as i32) >> 8) as i8;
                (d[j], d[CHUNK + j], d[2 * CHUNK + j]) = (d2, d1, d0);
            }
        }
        f
    }
}

/// A chunk's step and its inverse from the bits of its largest |x|. The bits of non-negative
/// floats order as integers do, with NaN above infinity, so their integer maximum is the largest
/// value, or NaN or infinity where the chunk holds one: then None.
fn chunk_scale(max_bits: u32) -> Option<(f32, f32)> {
    let max = f32::from_bits(max_bits);
    if !max.is_finite() {
        return None;
    }
    if max == 0.0 { Some((0.0, 0.0)) } else { Some((max / N_MAX, N_MAX / max)) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn fixed_avx512(x: &[f32]) -> Fixed {
    use std::arch::x86_64::*;
    let chunks = x.len() / CHUNK;
    let mut f = Fixed { digits: vec![0; 3 * CHUNK * chunks], step: vec![0.0; chunks] };
    let abs = _mm512_set1_epi32(0x7FFF_FFFF);
    for (c, xc) in x.chunks_exact(CHUNK).enumerate() {
        // SAFETY (loads): xc holds 64 floats, four registers.
        let v: [__m512; 4] = std::array::from_fn(|k| unsafe { _mm512_loadu_ps(xc.as_ptr().add(16 * k)) });
        let a = |k: usize| _mm512_and_si512(_mm512_castps_si512(v[k]), abs);
        let max = _mm512_reduce_max_epu32(_mm512_max_epu32(_mm512_max_epu32(a(0), a(1)), _mm512_max_epu32(a(2), a(3))));
        let Some((step, inv)) = chunk_scale(max) else {
            f.step[c] = f32::NAN;
            continue;
        };
        f.step[c] = step;
        let inv = _mm512_set1_ps(inv);
        let d = f.digits[3 * CHUNK * c..].as_mut_ptr();
        for (k, v) in v.iter().enumerate() {
            // The default rounding (to nearest, ties to even), as `round_ties_even` above.
            let n = _mm512_cvtps_epi32(_mm512_mul_ps(*v, inv));
            let low = |n: __m512i| _mm512_srai_epi32(_mm512_slli_epi32(n, 24), 24);
            let r = _mm512_srai_epi32(_mm512_sub_epi32(n, low(n)), 8);
            let r2 = _mm512_srai_epi32(_mm512_sub_epi32(r, low(r)), 8);
            // SAFETY: 16 bytes at 16k of each of the chunk's three runs of 64, inside `digits`.
            unsafe {
                _mm_storeu_si128(d.add(16 * k) as *mut __m128i, _mm512_cvtepi32_epi8(r2));
                _mm_storeu_si128(d.add(CHUNK + 16 * k) as *mut __m128i, _mm512_cvtepi32_epi8(r));
                _mm_storeu_si128(d.add(2 * CHUNK + 16 * k) as *mut __m128i, _mm512_cvtepi32_epi8(n));
            }
        }
    }
    f
}

/// The row's dot product with one input row (`xsums`: its per-group sums; `fixed`: the input in
/// fixed point, where [`use_vnni`] said so when it was prepared; a CPU without VNNI ignores it).
pub fn dot(
    words: &[u32],
    scales: &[u16],
    biases: &[u16],
    x: &[f32],
    xsums: &[f32],
    fixed: Option<&Fixed>,
    gs: usize,
) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if let Some(fx) = fixed
            && gs.is_multiple_of(CHUNK)
            && has_vnni()
        {
            // SAFETY: the CPU has AVX-512 F, BW, VL and VNNI (checked); `vnni` checks the lengths.
            return unsafe { vnni(words, scales, biases, fx, xsums, gs) };
        }
        if gs.is_multiple_of(32)
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX2 and FMA (checked above); `avx2` checks the lengths.
            return unsafe { avx2(words, scales, biases, x, xsums, gs) };
        }
    }
    let _ = fixed;
    portable(words, scales, biases, x, xsums, gs)
}

pub fn portable(words: &[u32], scales: &[u16], biases: &[u16], x: &[f32], xsums: &[f32], gs: usize) -> f32 {
    let wpg = gs / 8;
    let mut acc = 0f32;
    for (g, (gw, gx)) in words.chunks_exact(wpg).zip(x.chunks_exact(gs)).enumerate() {
        let mut lanes = [0f32; 8];
        for (w, xs) in gw.iter().zip(gx.chunks_exact(8)) {
            for k in 0..8 {
                lanes[k] += ((w >> (4 * k)) & 0xF) as f32 * xs[k];
            }
        }
        let d = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
        acc += bf16(scales[g]) * d + bf16(biases[g]) * xsums[g];
    }
    acc
}

/// See the module docs. Per chunk: the 32 bytes of codes unpacked in input order (byte b holds
/// inputs 2b and 2b+1: as 16-bit lanes, b | b << 4 masked to 0x0F0F puts them in its two bytes),
/// three `vpdpbusd` with a shift of 8 between them, one conversion, one multiply-add by the chunk's
/// factor scale_g * step. The factors and the bias terms are computed 16 chunks at a time, off the
/// chunks' chain.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn vnni(words: &[u32], scales: &[u16], biases: &[u16], fx: &Fixed, xsums: &[f32], gs: usize) -> f32 {
    use std::arch::x86_64::*;
    let chunks = fx.step.len();
    let (per_group, groups) = (gs / CHUNK, chunks * CHUNK / gs);
    assert!(gs.is_multiple_of(CHUNK) && chunks.is_multiple_of(per_group));
    // The row and the input must be as wide (an input prepared for another matrix is not).
    assert!(words.len() == chunks * CHUNK / 8 && fx.digits.len() == 3 * CHUNK * chunks);
    assert!(scales.len() == groups && biases.len() == groups && xsums.len() == groups);
    let nibbles = _mm512_set1_epi16(0x0F0F);
    let (wp, dp) = (words.as_ptr() as *const u8, fx.digits.as_ptr());
    // 16 bf16 values (the first `m` of `at`) as floats.
    let bf16s = |at: *const u16, m: __mmask16| {
        // SAFETY: callers pass `m` no wider than what `at` holds.
        let h = unsafe { _mm256_maskz_loadu_epi16(m, at as *const i16) };
        _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
    };
    // Two accumulators, so one chunk's multiply-add need not wait for the last one's.
    let mut acc = [_mm512_setzero_ps(); 2];
    let mut bias = _mm512_setzero_ps();
    let mut factor = [0f32; 16];
    for c0 in (0..chunks).step_by(16) {
        let m = (chunks - c0).min(16);
        let mask = (u32::MAX >> (32 - m)) as __mmask16;
        if per_group == 1 {
            // SAFETY: chunks c0..c0 + m are groups, in bounds of the scales, biases, sums and steps.
            unsafe {
                let step = _mm512_maskz_loadu_ps(mask, fx.step.as_ptr().add(c0));
                _mm512_storeu_ps(factor.as_mut_ptr(), _mm512_mul_ps(bf16s(scales.as_ptr().add(c0), mask), step));
                let sums = _mm512_maskz_loadu_ps(mask, xsums.as_ptr().add(c0));
                bias = _mm512_fmadd_ps(bf16s(biases.as_ptr().add(c0), mask), sums, bias);
            }
        } else {
            for (k, f) in factor[..m].iter_mut().enumerate() {
                *f = bf16(scales[(c0 + k) / per_group]) * fx.step[c0 + k];
            }
        }
        for (k, &f) in factor[..m].iter().enumerate() {
            let c = c0 + k;
            // SAFETY: chunk c's 32 bytes of codes and 192 of digits are in bounds (asserted).
            let (b, d) = unsafe {
                (_mm512_cvtepu8_epi16(_mm256_loadu_si256(wp.add(32 * c) as *const __m256i)), dp.add(3 * CHUNK * c))
            };
            let codes = _mm512_and_si512(_mm512_or_si512(b, _mm512_slli_epi16(b, 4)), nibbles);
            // SAFETY: as above.
            let digit = |k: usize| unsafe { _mm512_loadu_si512(d.add(CHUNK * k) as *const __m512i) };
            let mut n = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, digit(0));
            n = _mm512_dpbusd_epi32(_mm512_slli_epi32(n, 8), codes, digit(1));
            n = _mm512_dpbusd_epi32(_mm512_slli_epi32(n, 8), codes, digit(2));
            let a = &mut acc[k & 1];
            *a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(n), _mm512_set1_ps(f), *a);
        }
    }
    let mut total = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
    if per_group == 1 {
        total += _mm512_reduce_add_ps(bias);
    } else {
        for g in 0..groups {
            total += bf16(biases[g]) * xsums[g];
        }
    }
    total
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2(words: &[u32], scales: &[u16], biases: &[u16], x: &[f32], xsums: &[f32], gs: usize) -> f32 {
    use std::arch::x86_64::*;
    let (groups, wpg) = (x.len() / gs, gs / 8);
    assert!(words.len() >= groups * wpg && scales.len() >= groups && biases.len() >= groups);
    assert!(xsums.len() >= groups && wpg.is_multiple_of(4));
    let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    let mask = _mm256_set1_epi32(0xF);
    let mut row = _mm256_setzero_ps();
    let mut bias = 0f32;
    let (wp, xp) = (words.as_ptr(), x.as_ptr());
    // Codes of word j as 8 floats.
    let codes = |j: usize| {
        // SAFETY: callers pass j < groups * wpg <= words.len().
        let w = unsafe { *wp.add(j) } as i32;
        _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w), shifts), mask))
    };
    // SAFETY: callers pass j < groups * wpg, and x holds 8 values per word.
    let xs = |j: usize| unsafe { _mm256_loadu_ps(xp.add(8 * j)) };
    for g in 0..groups {
        // Four chains, so the multiply-adds' latency does not set the pace.
        let (mut a0, mut a1, mut a2, mut a3) =
            (_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps());
        let mut j = g * wpg;
        while j < (g + 1) * wpg {
            a0 = _mm256_fmadd_ps(codes(j), xs(j), a0);
            a1 = _mm256_fmadd_ps(codes(j + 1), xs(j + 1), a1);
            a2 = _mm256_fmadd_ps(codes(j + 2), xs(j + 2), a2);
            a3 = _mm256_fmadd_ps(codes(j + 3), xs(j + 3), a3);
            j += 4;
        }
        let a = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
        row = _mm256_fmadd_ps(a, _mm256_set1_ps(bf16(scales[g])), row);
        bias += bf16(biases[g]) * xsums[g];
    }
    let mut lanes = [0f32; 8];
    // SAFETY: 8 floats into an array of 8.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), row) };
    ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7])) + bias
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linear::group_sums;
    use crate::testing::{Quantized, rand_vec};
    use cherenkov_model::quant::Affine;

    /// Inputs of very different sizes chunk to chunk, a chunk of zeros, and exact ties.
    fn awkward_input(n: usize, seed: u64) -> Vec<f32> {
        let mut x = rand_vec(n, seed);
        for (c, xc) in x.chunks_exact_mut(CHUNK).enumerate() {
            let scale = [1.0, 1e-3, 37.0, 0.0, 2.5e-6][c % 5];
            xc.iter_mut().for_each(|v| *v *= scale);
        }
        x[1] = 0.5;
        x[2] = -0.5;
        x
    }

    #[test]
    fn fixed_point_digits_rebuild_each_input() {
        let x = awkward_input(10 * CHUNK, 11);
        let f = Fixed::new(&x);
        assert_eq!(f, Fixed::portable(&x), "the vector and the portable digits differ");
        for (c, xc) in x.chunks_exact(CHUNK).enumerate() {
            let max = xc.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(f.step[c], max / N_MAX, "chunk {c}");
            for (j, &v) in xc.iter().enumerate() {
                let d = &f.digits[3 * CHUNK * c..];
                let (d2, d1, d0) = (d[j] as i64, d[CHUNK + j] as i64, d[2 * CHUNK + j] as i64);
                assert!(d2.abs() <= 64, "chunk {c} input {j}: top digit {d2}");
                let n = d2 * 65536 + d1 * 256 + d0;
                assert!(n.abs() as f32 <= N_MAX, "chunk {c} input {j}: {n}");
                // Rounding to the step: half a step, and the f32 product v * (1 / step) itself
                // rounded (up to a quarter of a unit, and the inverse's rounding as much again).
                let err = (v as f64 - n as f64 * f.step[c] as f64).abs();
                assert!(
                    err == 0.0 || err < f.step[c] as f64,
                    "chunk {c} input {j}: {v} off by {err} (step {})",
                    f.step[c]
                );
            }
        }
    }

    #[test]
    fn a_non_finite_input_makes_its_chunk_nan() {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut x = rand_vec(3 * CHUNK, 2);
            x[CHUNK + 5] = bad;
            let (f, p) = (Fixed::new(&x), Fixed::portable(&x));
            assert_eq!(f.digits, p.digits);
            assert_eq!(f.step.map_bits(), p.step.map_bits());
            assert!(f.step[1].is_nan() && f.step[0].is_finite() && f.step[2].is_finite(), "{bad}: {:?}", f.step);
        }
    }

    trait Bits {
        fn map_bits(&self) -> Vec<u32>;
    }
    impl Bits for Vec<f32> {
        /// NaN compares unequal to itself: compare bits.
        fn map_bits(&self) -> Vec<u32> {
            self.iter().map(|v| v.to_bits()).collect()
        }
    }

    /// Every kernel this CPU runs against the portable one, on rows of the released experts'
    /// widths, for each group size.
    #[test]
    fn the_vector_kernels_agree_with_the_portable_one() {
        for (gs, cols) in [(32, 256), (64, 2560), (64, 640), (128, 512)] {
            let (rows, fmt) = (6, Affine::new(4, gs));
            let q = Quantized::new(rows, cols, fmt, gs as u64).q;
            let x = awkward_input(cols, 3);
            let xs = group_sums(&x, gs);
            let fixed = gs.is_multiple_of(CHUNK).then(|| Fixed::portable(&x));
            let (wpr, gpr) = (fmt.words_per_row(cols), fmt.groups_per_row(cols));
            for r in 0..rows {
                let (w, s, b) = (
                    &q.words[r * wpr..(r + 1) * wpr],
                    &q.scales[r * gpr..(r + 1) * gpr],
                    &q.biases[r * gpr..(r + 1) * gpr],
                );
                let slow = portable(w, s, b, &x, &xs, gs);
                // The size of the terms, which bounds the float kernels' rounding.
                let scale: f32 = (0..gpr)
                    .map(|g| {
                        (bf16(s[g]) * 15.0).abs() * x[g * gs..(g + 1) * gs].iter().map(|v| v.abs()).sum::<f32>()
                            + (bf16(b[g]) * xs[g]).abs()
                    })
                    .sum();
                let mut got = vec![("dispatch, no fixed input", dot(w, s, b, &x, &xs, None, gs))];
                #[cfg(target_arch = "x86_64")]
                {
                    if std::arch::is_x86_feature_detected!("avx2")
                        && std::arch::is_x86_feature_detected!("fma")
                        && gs.is_multiple_of(32)
                    {
                        // SAFETY: the CPU has AVX2 and FMA.
                        got.push(("avx2", unsafe { avx2(w, s, b, &x, &xs, gs) }));
                    }
                    if let (true, Some(fx)) = (has_vnni(), &fixed) {
                        // SAFETY: the CPU has AVX-512 F, BW, VL and VNNI.
                        got.push(("vnni", unsafe { vnni(w, s, b, fx, &xs, gs) }));
                        got.push(("dispatch, fixed input", dot(w, s, b, &x, &xs, Some(fx), gs)));
                    }
                }
                for (kernel, v) in got {
                    assert!(
                        (v - slow).abs() <= 1e-6 * scale,
                        "gs {gs} row {r} {kernel}: {v} vs {slow} (terms {scale})"
                    );
                }
            }
        }
    }

    /// The fixed-point kernel is exact up to the input's rounding: on inputs that are whole
    /// multiples of their chunk's step, it gives the f64 sum to f32 precision.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_fixed_point_kernel_sums_exactly() {
        if !has_vnni() {
            eprintln!("no AVX-512 VNNI on this CPU: the fixed-point kernel is not run here");
            return;
        }
        let (cols, fmt) = (2560, Affine::new(4, 64));
        let q = Quantized::new(1, cols, fmt, 9).q;
        // Inputs n * 2^-20 with |n| up to N_MAX, so the step is a power of two and nothing rounds.
        let top = N_MAX as i64;
        let x: Vec<f32> = (0..cols as i64)
            .map(|j| if j % CHUNK as i64 == 0 { top } else { (j * 7919 % (2 * top)) - top })
            .map(|n| n as f32 * 2f32.powi(-20))
            .collect();
        let f = Fixed::new(&x);
        assert!(f.step.iter().all(|&s| s == 2f32.powi(-20)));
        let xs = group_sums(&x, 64);
        // SAFETY: the CPU has AVX-512 F, BW, VL and VNNI (checked above).
        let got = unsafe { vnni(&q.words, &q.scales, &q.biases, &f, &xs, 64) } as f64;
        let want: f64 = (0..cols / 64)
            .map(|g| {
                let codes: f64 = (0..64)
                    .map(|j| ((q.words[(64 * g + j) / 8] >> (4 * (j % 8))) & 0xF) as f64 * x[64 * g + j] as f64)
                    .sum();
                bf16(q.scales[g]) as f64 * codes + bf16(q.biases[g]) as f64 * xs[g] as f64
            })
            .sum();
        let terms: f64 = (0..cols / 64)
            .map(|g| {
                (bf16(q.scales[g]) as f64).abs()
                    * 15.0
                    * x[64 * g..64 * (g + 1)].iter().map(|v| v.abs() as f64).sum::<f64>()
            })
            .sum();
        assert!((got - want).abs() <= 1e-6 * terms, "{got} vs {want} (terms {terms})");
    }
}
