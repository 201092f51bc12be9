//! Kernel checks: every CUDA kernel against the CPU reference on fresh random inputs.
//!
//! Linear kernels are checked on random matrices of every precision; the blocks (hyper-connection
//! read and inject, Gated DeltaNet with a random starting state, QSA attention over more tokens
//! than its budget, PLE, MoE through both expert pools) are checked with a store's real weights on
//! random activations. Each row reports ||gpu - cpu|| / ||cpu|| against its limit: about 1e-5 for
//! f32 arithmetic; the blocks compound several kernels and use a looser one.

use anyhow::{Result, bail};
use cherenkov_cpu::linear::Linear;
use cherenkov_cpu::ops::Rope;
use cherenkov_cpu::state::{AttentionState, GdnState};
use cherenkov_cpu::{CpuModel, attention, gdn, hyper, moe, ple};
use cherenkov_engine::backend::Logits;
use cherenkov_model::DType;
use cherenkov_model::dtype::f32_to_bf16;
use cherenkov_model::quant::{Affine, quantize_matrix};
use cherenkov_model::store::Precision;

use crate::gpu::{Arg, Gpu};
use crate::model::CudaModel;
use crate::session::MixerState;
use crate::weights::MatvecOutput;
use crate::weights::{DevLinear, Mixer};

/// One comparison.
#[derive(Clone, Debug)]
pub struct CheckRow {
    pub name: String,
    pub rel_err: f64,
    pub limit: f64,
}

impl CheckRow {
    pub fn ok(&self) -> bool {
        self.rel_err.is_finite() && self.rel_err <= self.limit
    }
}

/// ||a - b|| / ||b||, NaN if anything is not finite.
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() || a.iter().chain(b).any(|x| !x.is_finite()) {
        return f64::NAN;
    }
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((*x - *y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-300)).sqrt()
}

/// A small seeded generator of normal values.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        cherenkov_model::ngram::splitmix64(self.0)
    }
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    pub fn normal(&mut self, n: usize, std: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let (u, v) = (self.uniform(), self.uniform());
                ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32 * std
            })
            .collect()
    }
}

const LINEAR_LIMIT: f64 = 1e-5;
const BLOCK_LIMIT: f64 = 1e-4;

/// Matrix-vector products of every precision on random matrices.
pub fn linear_checks(gpu: &Gpu, rng: &mut Rng) -> Result<Vec<CheckRow>> {
    let mut rows = Vec::new();
    let (r, cols) = (333, 768);
    let x = rng.normal(cols, 1.0);
    let dx = gpu.alloc(cols * 4, "check input")?;
    gpu.htod(dx.ptr, &x)?;
    let dy = gpu.alloc(r * 4, "check output")?;
    for bits in [2u32, 3, 4, 5, 6, 8] {
        for gs in [32usize, 64, 128] {
            let fmt = Affine::new(bits, gs);
            let w = rng.normal(r * cols, 0.05);
            let bf: Vec<u16> = w.iter().map(|&v| f32_to_bf16(v)).collect();
            let q = quantize_matrix(&bf, r, cols, fmt);
            let cpu = Linear::Affine { fmt, rows: r, cols, words: &q.words, scales: &q.scales, biases: &q.biases };
            let mut want = vec![0f32; r];
            cpu.forward(&x, &mut want);
            let (dw, ds, db) = (
                gpu.alloc(q.words.len() * 4, "w")?,
                gpu.alloc(q.scales.len() * 2, "s")?,
                gpu.alloc(q.biases.len() * 2, "b")?,
            );
            gpu.htod(dw.ptr, &q.words)?;
            gpu.htod(ds.ptr, &q.scales)?;
            gpu.htod(db.ptr, &q.biases)?;
            let lin = DevLinear {
                precision: Precision::Affine { bits, group_size: gs },
                rows: r,
                cols,
                data: dw.ptr,
                scales: ds.ptr,
                biases: db.ptr,
            };
            lin.matvec(gpu, dx.ptr, dy.ptr)?;
            let mut got = vec![0f32; r];
            gpu.dtoh(dy.ptr, &mut got)?;
            rows.push(CheckRow {
                name: format!("matvec q{bits} g{gs}"),
                rel_err: rel_err(&got, &want),
                limit: LINEAR_LIMIT,
            });
        }
    }
    rows.extend(tiled_checks(gpu, rng)?);
    rows.extend(input_checks(gpu, rng)?);
    rows.extend(inject_checks(gpu, rng)?);
    rows.extend(image_checks(gpu, rng)?);
    rows.extend(rows_checks(gpu, rng)?);
    rows.extend(ahead_checks(gpu, rng)?);
    rows.extend(route_checks(gpu, rng)?);
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        let w = rng.normal(r * cols, 0.05);
        let data: Vec<u8> = match dtype {
            DType::BF16 => w.iter().flat_map(|&v| f32_to_bf16(v).to_le_bytes()).collect(),
            DType::F16 => w.iter().flat_map(|&v| half::f16::from_f32(v).to_bits().to_le_bytes()).collect(),
            _ => w.iter().flat_map(|&v| v.to_le_bytes()).collect(),
        };
        let cpu = Linear::Float { dtype, rows: r, cols, data: &data };
        let mut want = vec![0f32; r];
        cpu.forward(&x, &mut want);
        let dw = gpu.alloc(data.len(), "w")?;
        gpu.htod(dw.ptr, &data)?;
        let lin =
            DevLinear { precision: Precision::Float { dtype }, rows: r, cols, data: dw.ptr, scales: 0, biases: 0 };
        lin.matvec(gpu, dx.ptr, dy.ptr)?;
        let mut got = vec![0f32; r];
        gpu.dtoh(dy.ptr, &mut got)?;
        rows.push(CheckRow { name: format!("matvec {dtype}"), rel_err: rel_err(&got, &want), limit: LINEAR_LIMIT });
    }
    Ok(rows)
}

/// Matvecs of a transformed input ([`crate::weights::MatvecInput`]: silu(x s) and silu(a) b, which
/// the kernels apply as they read or stage x) against the CPU product of the transformed vector:
/// the tiled kernels (whole and column-split, with an unaligned input), the 4-bit kernel with rows
/// per block (weights not 16-byte aligned), 3 bits (padded staging, and past its limit the
/// elementwise launch before the plain matvec) and bf16 weights.
fn input_checks(gpu: &Gpu, rng: &mut Rng) -> Result<Vec<CheckRow>> {
    use crate::weights::MatvecInput;
    use cherenkov_cpu::ops::silu;
    let mut rows = Vec::new();
    let n = 40960;
    let (a, b) = (rng.normal(n + 1, 2.0), rng.normal(n + 1, 1.0));
    let s = 0.25f32;
    let scaled: Vec<f32> = a.iter().map(|&v| silu(v * s)).collect();
    let mul: Vec<f32> = a.iter().zip(&b).map(|(&u, &v)| silu(u) * v).collect();
    let gated: Vec<f32> = a.iter().zip(&b).map(|(&u, &v)| u * (1.0 / (1.0 + (-v).exp()))).collect();
    let (da, db) = (gpu.alloc(a.len() * 4, "check input")?, gpu.alloc(b.len() * 4, "check input")?);
    let dy = gpu.alloc(2560 * 4, "check output")?;
    // (bits (0: bf16), group size, rows, cols, input offset (floats), weights offset (bytes), path)
    let mut cases = Vec::new();
    for (bits, gs) in [(2u32, 64usize), (4, 64), (8, 32)] {
        cases.push((bits, gs, 1280, 320, 0, 0, "tiled"));
        cases.push((bits, gs, 333, 1024, 1, 0, "tiled, unaligned input"));
        cases.push((bits, gs, 4, 2560, 0, 0, "columns split"));
    }
    cases.push((4, 64, 333, 768, 0, 4, "rows per block, unaligned weights"));
    cases.push((3, 64, 333, 768, 0, 0, "padded staging"));
    cases.push((3, 64, 8, n, 0, 0, "elementwise fallback"));
    cases.push((0, 0, 333, 768, 0, 0, "staged"));
    for (bits, gs, r, c, off, woff, path) in cases {
        let w = rng.normal(r * c, 0.05);
        let want_of = |cpu: &Linear| {
            [&scaled, &mul, &gated].map(|t| {
                let mut y = vec![0f32; r];
                cpu.forward(&t[off..off + c], &mut y);
                y
            })
        };
        let (lin, _keep, wants, what) = if bits == 0 {
            let data: Vec<u8> = w.iter().flat_map(|&v| f32_to_bf16(v).to_le_bytes()).collect();
            let wants = want_of(&Linear::Float { dtype: DType::BF16, rows: r, cols: c, data: &data });
            let dw = gpu.alloc(data.len(), "w")?;
            gpu.htod(dw.ptr, &data)?;
            let lin = DevLinear {
                precision: Precision::Float { dtype: DType::BF16 },
                rows: r,
                cols: c,
                data: dw.ptr,
                scales: 0,
                biases: 0,
            };
            (lin, vec![dw], wants, "bf16".to_string())
        } else {
            let fmt = Affine::new(bits, gs);
            let bf: Vec<u16> = w.iter().map(|&v| f32_to_bf16(v)).collect();
            let q = quantize_matrix(&bf, r, c, fmt);
            let wants = want_of(&Linear::Affine {
                fmt,
                rows: r,
                cols: c,
                words: &q.words,
                scales: &q.scales,
                biases: &q.biases,
            });
            let (dw, ds, dbb) = (
                gpu.alloc(q.words.len() * 4 + 16, "w")?,
                gpu.alloc(q.scales.len() * 2, "s")?,
                gpu.alloc(q.biases.len() * 2, "b")?,
            );
            gpu.htod(dw.at(woff), &q.words)?;
            gpu.htod(ds.ptr, &q.scales)?;
            gpu.htod(dbb.ptr, &q.biases)?;
            let lin = DevLinear {
                precision: Precision::Affine { bits, group_size: gs },
                rows: r,
                cols: c,
                data: dw.at(woff),
                scales: ds.ptr,
                biases: dbb.ptr,
            };
            (lin, vec![dw, ds, dbb], wants, format!("q{bits} g{gs}"))
        };
        for (k, want) in wants.iter().enumerate() {
            // Fresh inputs each time: the elementwise fallback overwrites its input.
            gpu.htod(da.ptr, &a)?;
            gpu.htod(db.ptr, &b)?;
            let (xa, xb) = (da.at(off * 4), db.at(off * 4));
            let (input, tf) = match k {
                0 => (MatvecInput::SiluScaled(xa, s), "silu(x s)"),
                1 => (MatvecInput::SiluMul(xa, xb), "silu(a) b"),
                _ => (MatvecInput::MulSigmoid(xa, xb), "a sigmoid(b)"),
            };
            lin.matvec_in(gpu, input, dy.ptr)?;
            let mut got = vec![0f32; r];
            gpu.dtoh(dy.ptr, &mut got)?;
            rows.push(CheckRow {
                name: format!("matvec {what} {r}x{c} of {tf} ({path})"),
                rel_err: rel_err(&got, want),
                // 40960 inputs summed in f32 (in another order than the CPU's).
                limit: if c > 10240 { 4.0 * LINEAR_LIMIT } else { LINEAR_LIMIT },
            });
        }
    }
    Ok(rows)
}

/// Matvecs whose rows are injected into a hyper-connection residual
/// ([`crate::weights::MatvecOutput::Inject`]) against the CPU product injected as `hyper::inject` does:
/// the tiled kernel, the 3-bit kernel (both inject as they write) and a column-split shape (its
/// rows go through the scratch and `hc_inject`).
fn inject_checks(gpu: &Gpu, rng: &mut Rng) -> Result<Vec<CheckRow>> {
    use crate::weights::MatvecInput;
    let mut rows = Vec::new();
    let hc = 4;
    let x = rng.normal(2560, 1.0);
    let dx = gpu.alloc(x.len() * 4, "check input")?;
    gpu.htod(dx.ptr, &x)?;
    let inj: Vec<f32> = rng.normal(hc, 2.0);
    let dinj = gpu.alloc(hc * 4, "check input")?;
    gpu.htod(dinj.ptr, &inj)?;
    let scratch = gpu.alloc(2560 * 4, "check output")?;
    let weights: Vec<f32> = inj.iter().map(|&v| 2.0 / (1.0 + (-v / hc as f32).exp())).collect();
    for (bits, gs, r, c, path) in
        [(4u32, 64usize, 1280, 320, "tiled"), (3, 64, 333, 768, "one warp per row"), (4, 64, 8, 2560, "columns split")]
    {
        let (lin, _keep, want) = rand_linear(gpu, rng, Affine::new(bits, gs), r, c, &x)?;
        let res = rng.normal(hc * r, 1.0);
        let dres = gpu.alloc(res.len() * 4, "check residual")?;
        gpu.htod(dres.ptr, &res)?;
        let mut want_res = res.clone();
        // As hyper::inject, with r-wide streams.
        for (s, w) in weights.iter().enumerate() {
            for (j, v) in want.iter().enumerate() {
                want_res[s * r + j] += w * v;
            }
        }
        let out = MatvecOutput::Inject { x: dres.ptr, inj: dinj.ptr, hc, scratch: scratch.ptr };
        lin.matvec_to(gpu, MatvecInput::Plain(dx.ptr), out)?;
        let mut got = vec![0f32; res.len()];
        gpu.dtoh(dres.ptr, &mut got)?;
        rows.push(CheckRow {
            name: format!("matvec q{bits} {r}x{c} injected into {hc} streams ({path})"),
            rel_err: rel_err(&got, &want_res),
            limit: LINEAR_LIMIT,
        });
    }
    Ok(rows)
}

/// `route_topk` alone against the host's routing ([`cherenkov_engine::routing::top_k`], renormalised)
/// at widths the models' blocks do not reach (their stores have 32 experts): the released 512 experts
/// top-10, where the kernel's threshold comes from its warps' largest keys, 1024 top-32 (as many
/// warps as k), and 1000 top-40 (k above the warps: every expert a candidate), each with random
/// logits and with logits rounded to steps of 0.5 (many ties; every 9th -inf). The chosen ids, the
/// address table written from a map and the rank entries must be the host's exactly; so must the
/// ids it writes into host memory, with its ready flag set there (a streamed block's host polls it).
fn route_checks(gpu: &Gpu, rng: &mut Rng) -> Result<Vec<CheckRow>> {
    let mut rows = Vec::new();
    // Its own generator for the rows from column slices, so the rows before them draw what they
    // drew before those existed.
    let mut slice_rng = Rng::new(0x5eed_0020);
    for (e, k, slices) in [(512usize, 10usize, 0usize), (1024, 32, 0), (1000, 40, 0), (512, 10, 8), (1000, 40, 11)] {
        for tied in [false, true] {
            if slices > 0 && tied {
                continue;
            }
            // From slices: the logits are their sum in slice order from 0, as the router launch's
            // last block adds them up (and route_topk, given the slices).
            let parts = if slices > 0 { slice_rng.normal(e * slices, 1.0) } else { Vec::new() };
            let mut logits = if slices > 0 {
                (0..e).map(|i| (0..slices).fold(0.0f32, |s, j| s + parts[j * e + i])).collect()
            } else {
                rng.normal(e, 2.0)
            };
            if tied {
                for (i, v) in logits.iter_mut().enumerate() {
                    *v = if i % 9 == 4 { f32::NEG_INFINITY } else { (*v * 2.0).round() / 2.0 + 0.0 };
                }
            }
            let want = cherenkov_engine::routing::top_k(&logits, None, k, true);
            let map: Vec<u64> = (0..e as u64).map(|i| 0x1000 + 8 * i).collect();
            let (dl, dmap) = (gpu.alloc(e * 4, "check logits")?, gpu.alloc(e * 8, "check map")?);
            let (dids, dw) = (gpu.alloc(k * 4, "check ids")?, gpu.alloc(k * 4, "check weights")?);
            let (dtable, dranks) = (gpu.alloc(k * 8, "check table")?, gpu.alloc(k * 4, "check ranks")?);
            let dparts = gpu.alloc(parts.len().max(1) * 4, "check router slices")?;
            let (ids_host, ready) = (gpu.pinned(k * 4, "check host ids")?, gpu.pinned(4, "check ready flag")?);
            // SAFETY: fresh buffers no kernel uses yet.
            unsafe {
                ids_host.as_mut_slice::<i32>().fill(-1);
                ready.as_mut_slice::<u32>()[0] = 0;
            }
            if slices > 0 {
                // The logits buffer holds something else: only the slices may be read.
                gpu.htod(dl.ptr, &vec![f32::NAN; e])?;
                gpu.htod(dparts.ptr, &parts)?;
            } else {
                gpu.htod(dl.ptr, &logits)?;
            }
            gpu.htod(dmap.ptr, &map)?;
            // From slices (the streamed router's path), the lookahead's top-k runs beside as the
            // launch's second block: its own logits, a bias row, a width of k + 2 and its own
            // outputs, host ids included.
            let beside = slices > 0;
            let ak = k + 2;
            let a_logits = slice_rng.normal(e, 2.0);
            let a_bias = slice_rng.normal(e, 0.5);
            let (da, dab) = (gpu.alloc(e * 4, "check lookahead logits")?, gpu.alloc(e * 4, "check lookahead bias")?);
            let (daids, daw) =
                (gpu.alloc(ak * 4, "check lookahead ids")?, gpu.alloc(ak * 4, "check lookahead weights")?);
            let a_host = gpu.pinned(ak * 4, "check lookahead host ids")?;
            gpu.htod(da.ptr, &a_logits)?;
            gpu.htod(dab.ptr, &a_bias)?;
            gpu.launch(
                "route_topk",
                (if beside { 2 } else { 1 }, 1, 1),
                e.next_multiple_of(32) as u32,
                0,
                &[
                    Arg::Ptr(dl.ptr),
                    Arg::Ptr(0),
                    Arg::F32(1.0),
                    Arg::I32(e as i32),
                    Arg::I32(k as i32),
                    Arg::I32(1),
                    Arg::Ptr(dids.ptr),
                    Arg::Ptr(dw.ptr),
                    Arg::Ptr(ids_host.dev),
                    Arg::Ptr(dmap.ptr),
                    Arg::Ptr(dtable.ptr),
                    Arg::Ptr(dranks.ptr),
                    Arg::Ptr(if slices > 0 { dparts.ptr } else { 0 }),
                    Arg::I32(slices as i32),
                    Arg::Ptr(ready.dev),
                    Arg::Ptr(0),
                    Arg::Ptr(if beside { da.ptr } else { 0 }),
                    Arg::Ptr(if beside { dab.ptr } else { 0 }),
                    Arg::I32(ak as i32),
                    Arg::Ptr(if beside { daids.ptr } else { 0 }),
                    Arg::Ptr(if beside { daw.ptr } else { 0 }),
                    Arg::Ptr(if beside { a_host.dev } else { 0 }),
                ],
            )?;
            let (mut ids, mut w, mut table, mut ranks) = (vec![0i32; k], vec![0f32; k], vec![0u64; k], vec![0i32; k]);
            gpu.dtoh(dids.ptr, &mut ids)?;
            gpu.dtoh(dw.ptr, &mut w)?;
            gpu.dtoh(dtable.ptr, &mut table)?;
            gpu.dtoh(dranks.ptr, &mut ranks)?;
            let wrong = (0..k)
                .filter(|&r| {
                    let id = want[r].0;
                    ids[r] != id as i32 || table[r] != map[id] || ranks[r] != r as i32
                })
                .count();
            let what = match (tied, slices) {
                (true, _) => ", tied".to_string(),
                (false, 0) => String::new(),
                (false, s) => format!(", from {s} column slices"),
            };
            rows.push(CheckRow {
                name: format!("route_topk {e} experts top-{k}{what} (fraction not the host's choice)"),
                rel_err: wrong as f64 / k as f64,
                limit: 0.0,
            });
            // SAFETY: the launch finished (the copies back above synchronise).
            let (host_ids, flag) = unsafe { (ids_host.as_slice::<i32>().to_vec(), ready.as_slice::<u32>()[0]) };
            let wrong_host = (0..k).filter(|&r| host_ids[r] != want[r].0 as i32).count() + usize::from(flag != 1);
            rows.push(CheckRow {
                name: format!(
                    "route_topk {e} experts top-{k}{what}: ids in host memory and the ready flag (fraction wrong)"
                ),
                rel_err: wrong_host as f64 / (k + 1) as f64,
                limit: 0.0,
            });
            let want_w: Vec<f32> = want.iter().map(|x| x.1).collect();
            rows.push(CheckRow {
                name: format!("route_topk {e} experts top-{k}{what}: weights"),
                rel_err: rel_err(&w, &want_w),
                limit: LINEAR_LIMIT,
            });
            if beside {
                // The bias adds to the logits' standard score (model weight 1 here), as the
                // synthetic routers' does (engine::routing).
                let n = e as f32;
                let mean = a_logits.iter().sum::<f32>() / n;
                let var = (a_logits.iter().map(|v| v * v).sum::<f32>() / n - mean * mean).max(0.0);
                let scale = if var > 0.0 { 1.0 / var.sqrt() } else { 0.0 };
                let scored: Vec<f32> = a_logits.iter().zip(&a_bias).map(|(l, b)| scale * l + b).collect();
                let a_want = cherenkov_engine::routing::top_k(&scored, None, ak, true);
                let (mut a_ids, mut a_w) = (vec![0i32; ak], vec![0f32; ak]);
                gpu.dtoh(daids.ptr, &mut a_ids)?;
                gpu.dtoh(daw.ptr, &mut a_w)?;
                // SAFETY: the launch finished (the copies back above synchronise).
                let a_host_ids = unsafe { a_host.as_slice::<i32>().to_vec() };
                let wrong =
                    (0..ak).filter(|&r| a_ids[r] != a_want[r].0 as i32 || a_host_ids[r] != a_want[r].0 as i32).count();
                rows.push(CheckRow {
                    name: format!(
                        "route_topk {e} experts top-{k}{what}, the lookahead's top-{ak} beside: ids (fraction wrong)"
                    ),
                    rel_err: wrong as f64 / ak as f64,
                    limit: 0.0,
                });
                let a_want_w: Vec<f32> = a_want.iter().map(|x| x.1).collect();
                rows.push(CheckRow {
                    name: format!("route_topk {e} experts top-{k}{what}, the lookahead's top-{ak} beside: weights"),
                    rel_err: rel_err(&a_w, &a_want_w),
                    limit: LINEAR_LIMIT,
                });
            }
        }
    }
    Ok(rows)
}

/// A random quantized matrix on the device, with its CPU reference product for `x`.
fn rand_linear(
    gpu: &Gpu,
    rng: &mut Rng,
    fmt: Affine,
    rows: usize,
    cols: usize,
    x: &[f32],
) -> Result<(DevLinear, Vec<crate::gpu::DevBuf>, Vec<f32>)> {
    let w = rng.normal(rows * cols, 0.05);
    let bf: Vec<u16> = w.iter().map(|&v| f32_to_bf16(v)).collect();
    let q = quantize_matrix(&bf, rows, cols, fmt);
    let cpu = Linear::Affine { fmt, rows, cols, words: &q.words, scales: &q.scales, biases: &q.biases };
    let mut want = vec![0f32; rows];
    cpu.forward(&x[..cols], &mut want);
    let (lin, bufs) = upload_linear(gpu, &q, fmt, rows, cols)?;
    Ok((lin, bufs, want))
}

/// A quantized matrix of `rows` x `cols` in `fmt` uploaded as a dense matrix (with the buffers
/// that hold it).
fn upload_linear(
    gpu: &Gpu,
    q: &cherenkov_model::quant::QuantizedMatrix,
    fmt: Affine,
    rows: usize,
    cols: usize,
) -> Result<(DevLinear, Vec<crate::gpu::DevBuf>)> {
    let (dw, ds, db) =
        (gpu.alloc(q.words.len() * 4, "w")?, gpu.alloc(q.scales.len() * 2, "s")?, gpu.alloc(q.biases.len() * 2, "b")?);
    gpu.htod(dw.ptr, &q.words)?;
    gpu.htod(ds.ptr, &q.scales)?;
    gpu.htod(db.ptr, &q.biases)?;
    let lin = DevLinear {
        precision: Precision::Affine { bits: fmt.bits, group_size: fmt.group_size },
        rows,
        cols,
        data: dw.ptr,
        scales: ds.ptr,
        biases: db.ptr,
    };
    Ok((lin, vec![dw, ds, db]))
}

/// `matvec_many` with the weights taken ahead (`matvec_many_ahead` in linear.cu: each block's rows
/// copied into shared memory before it waits) on the GDN input projection's shape (qkv, z, b and a
/// of 2560 inputs, 4-bit): against the CPU, and bit for bit against the same launch without them.
/// Hopper and later only; there it fails if no part took its weights ahead.
fn ahead_checks(gpu: &Gpu, rng: &mut Rng) -> Result<Vec<CheckRow>> {
    if gpu.info.compute_capability.0 < 9 {
        return Ok(Vec::new());
    }
    let c = 2560usize;
    let x = rng.normal(c, 1.0);
    let dx = gpu.alloc(c * 4, "check input")?;
    gpu.htod(dx.ptr, &x)?;
    let (mut lins, mut keep, mut want) = (Vec::new(), Vec::new(), Vec::new());
    for r in [10240usize, 6144, 48, 48] {
        let (lin, bufs, w) = rand_linear(gpu, rng, Affine::new(4, 64), r, c, &x)?;
        lins.push(lin);
        keep.push(bufs);
        want.extend(w);
    }
    let n = want.len();
    let dy = gpu.zeros(2 * n * 4, "check output")?;
    let mut got = Vec::new();
    for (i, ahead) in [false, true].into_iter().enumerate() {
        let mut at = dy.ptr + (i * n * 4) as u64;
        let parts: Vec<(&DevLinear, u64)> = lins
            .iter()
            .map(|l| {
                let y = at;
                at += (l.rows * 4) as u64;
                (l, y)
            })
            .collect();
        let took = crate::weights::matvec_many_ahead(gpu, dx.ptr, &parts, ahead)?;
        if took != ahead {
            bail!("matvec_many on the GDN input projection's shape: weights ahead asked {ahead}, taken {took}");
        }
        let mut y = vec![0f32; n];
        gpu.dtoh(dy.ptr + (i * n * 4) as u64, &mut y)?;
        got.push(y);
    }
    let differ = got[0].iter().zip(&got[1]).filter(|(p, q)| p.to_bits() != q.to_bits()).count();
    Ok(vec![
        CheckRow {
            name: "matvec_many q4 g64 (10240, 6144, 48, 48)x2560, weights ahead".into(),
            rel_err: rel_err(&got[1], &want),
            limit: LINEAR_LIMIT,
        },
        CheckRow {
            name:
                "matvec_many q4 g64 (10240, 6144, 48, 48)x2560, weights ahead against without (fraction not identical)"
                    .into(),
            rel_err: differ as f64 / n as f64,
            limit: 0.0,
        },
    ])
}

/// The tiled 4-bit matvec on the GDN out_proj's shape with its input as a producer's staged image
/// ([`MatvecInput::Digits`], written by `mvd_image` as the GDN recurrence writes it, a chunk a
/// warp, and as `attend`'s merge does, 8 a warp): against the CPU, and bit for bit against the
/// same matvec staging x itself.
fn image_checks(gpu: &Gpu, rng: &mut Rng) -> Result<Vec<CheckRow>> {
    use crate::weights::MatvecInput;
    let (r, c) = (2560usize, 6144usize);
    let mut x = rng.normal(c, 1.0);
    x[..32].fill(0.0); // a chunk of zeros (xs = 0)
    let dx = gpu.alloc(c * 4, "check input")?;
    gpu.htod(dx.ptr, &x)?;
    let (lin, _bufs, want) = rand_linear(gpu, rng, Affine::new(4, 64), r, c, &x)?;
    let dy = gpu.zeros(2 * r * 4, "check output")?;
    let y2 = dy.ptr + (r * 4) as u64;
    lin.matvec_in(gpu, MatvecInput::Plain(dx.ptr), dy.ptr)?;
    let mut a = vec![0f32; r];
    gpu.dtoh(dy.ptr, &mut a)?;
    let mut rows = Vec::new();
    // A chunk a warp (the GDN recurrence), then 8 a warp (attend's merge, mvd_put_chunks).
    for (per, what) in [(1usize, ""), (8, ", 8 chunks a warp")] {
        let img = gpu.zeros(c * 4, "check input image")?;
        gpu.launch(
            "mvd_image",
            (c.div_ceil(32 * 8 * per) as u32, 1, 1),
            256,
            0,
            &[Arg::Ptr(dx.ptr), Arg::Ptr(img.ptr), Arg::I32(c as i32), Arg::I32(per as i32)],
        )?;
        lin.matvec_in(gpu, MatvecInput::Digits(dx.ptr, img.ptr), y2)?;
        let mut b = vec![0f32; r];
        gpu.dtoh(y2, &mut b)?;
        let differ = a.iter().zip(&b).filter(|(p, q)| p.to_bits() != q.to_bits()).count();
        rows.push(CheckRow {
            name: format!("matvec q4 g64 {r}x{c} from its producer's staged image{what}"),
            rel_err: rel_err(&b, &want),
            limit: LINEAR_LIMIT,
        });
        rows.push(CheckRow {
            name: format!("matvec q4 g64 {r}x{c}, image{what} against staging x (fraction of rows not identical)"),
            rel_err: differ as f64 / r as f64,
            limit: 0.0,
        });
    }
    Ok(rows)
}

/// Several input rows through one 4-bit matrix in one launch (`DevLinear::matvec_rows`,
/// `matvec_q4_x2` and `_x4`): against the CPU, and each row bit for bit against the tiled
/// `matvec_q4` with the same lanes a tile on that row alone; stored, and injected into each row's
/// residual streams (the out_proj's way). Shapes of the MTP head's `fc_hidden` and the GDN
/// out_proj.
pub fn rows_checks(gpu: &Gpu, rng: &mut Rng) -> Result<Vec<CheckRow>> {
    use crate::weights::{MV_TILED, RowsOutput};
    let mut out = Vec::new();
    let hc = 4usize;
    for (r, c) in [(2560usize, 2560usize), (2560, 6144)] {
        for nx in [2usize, 4] {
            let mut x = rng.normal(nx * c, 1.0);
            x[c..c + 32].fill(0.0); // a chunk of zeros in row 1 (xs = 0)
            let fmt = Affine::new(4, 64);
            let bf: Vec<u16> = rng.normal(r * c, 0.05).iter().map(|&v| f32_to_bf16(v)).collect();
            let q = quantize_matrix(&bf, r, c, fmt);
            let (lin, _bufs) = upload_linear(gpu, &q, fmt, r, c)?;
            if !lin.rows_in_one(nx) {
                bail!("matvec_rows: {nx} rows of a {r}x{c} q4 g64 matrix should take one launch");
            }
            // The CPU's rows.
            let cpu = Linear::Affine { fmt, rows: r, cols: c, words: &q.words, scales: &q.scales, biases: &q.biases };
            let mut cpu_rows = vec![0f32; nx * r];
            for i in 0..nx {
                cpu.forward(&x[i * c..(i + 1) * c], &mut cpu_rows[i * r..(i + 1) * r]);
            }
            let dx = gpu.alloc(nx * c * 4, "check input")?;
            gpu.htod(dx.ptr, &x)?;
            let (plan, _) = lin.rows_plan(gpu, nx);
            let Some(shmem) = lin.tiled_shmem() else { bail!("a {r}x{c} q4 g64 matrix should be tiled") };
            let group_size: i32 = 64;
            // One row at a time: the tiled matvec_q4 with the plan's lanes; stored, then injected.
            let one = |row: usize, y: u64, xres: u64, inj: u64| -> Result<()> {
                gpu.launch(
                    "matvec_q4",
                    (plan.blocks as u32, 1, 1),
                    plan.threads as u32,
                    shmem as u32,
                    &[
                        Arg::Ptr(lin.data),
                        Arg::Ptr(lin.scales),
                        Arg::Ptr(lin.biases),
                        Arg::Ptr(dx.ptr + (row * c * 4) as u64),
                        Arg::Ptr(y),
                        Arg::I32(r as i32),
                        Arg::I32(c as i32),
                        Arg::I32(group_size),
                        Arg::I32((MV_TILED | plan.lanes) as i32),
                        Arg::Ptr(0),
                        Arg::F32(0.0),
                        Arg::I32(0),
                        Arg::Ptr(xres),
                        Arg::Ptr(inj),
                        Arg::I32(if xres != 0 { hc as i32 } else { 0 }),
                    ],
                )
            };
            let read = |ptr: u64, n: usize| -> Result<Vec<f32>> {
                let mut v = vec![0f32; n];
                gpu.dtoh(ptr, &mut v)?;
                Ok(v)
            };
            let differ = |a: &[f32], b: &[f32]| {
                a.iter().zip(b).filter(|(p, q)| p.to_bits() != q.to_bits()).count() as f64 / a.len() as f64
            };
            let ys = gpu.zeros(2 * nx * r * 4, "check output")?;
            let (ya, yb) = (ys.ptr, ys.ptr + (nx * r * 4) as u64);
            for i in 0..nx {
                one(i, ya + (i * r * 4) as u64, 0, 0)?;
            }
            lin.matvec_rows(gpu, dx.ptr, c * 4, RowsOutput::Store { y: yb, stride: r * 4 }, nx)?;
            let (a, b) = (read(ya, nx * r)?, read(yb, nx * r)?);
            out.push(CheckRow {
                name: format!("matvec q4 g64 {r}x{c}, {nx} rows in one launch"),
                rel_err: rel_err(&b, &cpu_rows),
                limit: LINEAR_LIMIT,
            });
            out.push(CheckRow {
                name: format!(
                    "matvec q4 g64 {r}x{c}, {nx} rows in one launch against one each (fraction not identical)"
                ),
                rel_err: differ(&a, &b),
                limit: 0.0,
            });
            // Injected: each row's residual of hc streams and its logits, twice (one launch a row,
            // and all rows in one).
            let res = rng.normal(nx * hc * r, 1.0);
            let logit = rng.normal(nx * hc, 1.0);
            let (xa, xb) = (gpu.alloc(res.len() * 4, "check residual")?, gpu.alloc(res.len() * 4, "check residual")?);
            let inj = gpu.alloc(logit.len() * 4, "check logits")?;
            gpu.htod(xa.ptr, &res)?;
            gpu.htod(xb.ptr, &res)?;
            gpu.htod(inj.ptr, &logit)?;
            for i in 0..nx {
                one(i, 0, xa.ptr + (i * hc * r * 4) as u64, inj.ptr + (i * hc * 4) as u64)?;
            }
            let to = RowsOutput::Inject { x: xb.ptr, x_stride: hc * r * 4, inj: inj.ptr, inj_stride: hc * 4, hc };
            lin.matvec_rows(gpu, dx.ptr, c * 4, to, nx)?;
            let (a, b) = (read(xa.ptr, res.len())?, read(xb.ptr, res.len())?);
            let want: Vec<f32> = (0..nx * hc * r)
                .map(|j| {
                    let (i, s, k) = (j / (hc * r), (j / r) % hc, j % r);
                    let g = 2.0 / (1.0 + (-logit[i * hc + s] / hc as f32).exp());
                    res[j] + g * cpu_rows[i * r + k]
                })
                .collect();
            out.push(CheckRow {
                name: format!("matvec q4 g64 {r}x{c}, {nx} rows in one launch, injected"),
                rel_err: rel_err(&b, &want),
                limit: LINEAR_LIMIT,
            });
            out.push(CheckRow {
                name: format!(
                    "matvec q4 g64 {r}x{c}, {nx} rows in one launch, injected, against one each (fraction not identical)"
                ),
                rel_err: differ(&a, &b),
                limit: 0.0,
            });
        }
    }
    Ok(out)
}

/// The tiled kernels on the model's shapes: column-split matvecs (few rows, many columns), several
/// matrices of one input in one launch (`matvec_many`), and the expert kernels on synthetic
/// records (gate/up tiles, down tiles, tagged address-table entries).
fn tiled_checks(gpu: &Gpu, rng: &mut Rng) -> Result<Vec<CheckRow>> {
    use cherenkov_model::store::{ExpertLayout, RecordMatrix, Span};
    let mut rows = Vec::new();
    let x = rng.normal(10240, 1.0);
    let dx = gpu.alloc(x.len() * 4, "check input")?;
    gpu.htod(dx.ptr, &x)?;
    let dy = gpu.alloc(8192 * 4, "check output")?;
    let read = |ptr: u64, n: usize| -> Result<Vec<f32>> {
        let mut v = vec![0f32; n];
        gpu.dtoh(ptr, &mut v)?;
        Ok(v)
    };
    for (bits, gs) in [(2u32, 128usize), (4, 64), (8, 32)] {
        let fmt = Affine::new(bits, gs);
        for (r, c) in [(4, 10240), (1, 2560), (48, 2560), (320, 10240)] {
            let (lin, _bufs, want) = rand_linear(gpu, rng, fmt, r, c, &x)?;
            lin.matvec(gpu, dx.ptr, dy.ptr)?;
            rows.push(CheckRow {
                name: format!("matvec q{bits} g{gs} {r}x{c} (columns split)"),
                rel_err: rel_err(&read(dy.ptr, r)?, &want),
                limit: LINEAR_LIMIT,
            });
        }
        // Five parts: one launch of four, then one of one.
        let parts = [1000usize, 48, 1, 256, 7].map(|r| (fmt, r));
        rows.push(CheckRow {
            name: format!("matvec_many q{bits} g{gs} (5 parts of 2560 inputs)"),
            rel_err: many_check(gpu, rng, &parts, &x, dx.ptr, dy.ptr)?,
            limit: LINEAR_LIMIT,
        });

        // Experts: 2 records, 3 table entries (the third repeats the first), tagged like the pool.
        // The released widths (a width that is not a multiple of the group never gets quantized).
        let (inter, h) = (640usize, 2560usize);
        let mats: Vec<_> = (0..2)
            .map(|_| {
                let g = rng.normal(inter * h, 0.05);
                let u = rng.normal(inter * h, 0.05);
                let d = rng.normal(h * inter, 0.05);
                let q = |w: &[f32], r: usize, c: usize| {
                    let bf: Vec<u16> = w.iter().map(|&v| f32_to_bf16(v)).collect();
                    quantize_matrix(&bf, r, c, fmt)
                };
                (q(&g, inter, h), q(&u, inter, h), q(&d, h, inter))
            })
            .collect();
        let mut rec: Vec<u8> = Vec::new();
        let span = |rec: &mut Vec<u8>, bytes: Vec<u8>| {
            while !rec.len().is_multiple_of(16) {
                rec.push(0);
            }
            let s = Span { offset: rec.len() as u64, len: bytes.len() as u64 };
            rec.extend(bytes);
            s
        };
        let words = |w: &[u32]| w.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
        let halves = |w: &[u16]| w.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
        let mut records = Vec::new();
        let mut layout = None;
        for (g, u, d) in &mats {
            rec.clear();
            let mut m = |q: &cherenkov_model::quant::QuantizedMatrix, shape: [usize; 2]| RecordMatrix {
                shape,
                precision: Precision::Affine { bits, group_size: gs },
                data: span(&mut rec, words(&q.words)),
                scales: Some(span(&mut rec, halves(&q.scales))),
                biases: Some(span(&mut rec, halves(&q.biases))),
            };
            let l = ExpertLayout {
                layer: "check".into(),
                gate_proj: m(g, [inter, h]),
                up_proj: m(u, [inter, h]),
                down_proj: m(d, [h, inter]),
            };
            layout = Some(l);
            records.push(rec.clone());
        }
        let layout = layout.expect("two records");
        let record_bytes = records[0].len().div_ceil(4096) * 4096;
        let pool = gpu.alloc(record_bytes * 2, "check records")?;
        for (i, r) in records.iter().enumerate() {
            gpu.htod(pool.at(i * record_bytes), r)?;
        }
        let tag = if bits == 2 { crate::model::TAG_Q2 } else { 0 };
        let entries = [0usize, 1, 0];
        let table: Vec<u64> = entries.iter().map(|&e| pool.at(e * record_bytes) | tag).collect();
        let dtable = gpu.alloc(table.len() * 8, "check table")?;
        gpu.htod(dtable.ptr, &table)?;
        let act = gpu.alloc(entries.len() * inter * 4, "check act")?;
        let out = gpu.alloc(entries.len() * h * 4, "check out")?;
        let io = crate::weights::ExpertIo::new(dx.ptr, act.ptr, out.ptr);
        // Entry 0 alone, then entries 1 and 2 (a nonzero `first`), as the streaming path does.
        crate::weights::launch_experts(gpu, &layout, record_bytes, dtable.ptr, 0, 1, io, (inter, h), &mut || Ok(()))?;
        crate::weights::launch_experts(gpu, &layout, record_bytes, dtable.ptr, 1, 2, io, (inter, h), &mut || Ok(()))?;
        // The CPU's product of a record matrix of r x c with v.
        let f = |q: &cherenkov_model::quant::QuantizedMatrix, r: usize, c: usize, v: &[f32]| {
            let mut y = vec![0f32; r];
            Linear::Affine { fmt, rows: r, cols: c, words: &q.words, scales: &q.scales, biases: &q.biases }
                .forward(v, &mut y);
            y
        };
        let (mut want_act, mut want_out) = (Vec::new(), Vec::new());
        for &e in &entries {
            let (g, u, d) = &mats[e];
            let (gv, uv) = (f(g, inter, h, &x[..h]), f(u, inter, h, &x[..h]));
            let a: Vec<f32> = gv.iter().zip(&uv).map(|(&g, &u)| g / (1.0 + (-g).exp()) * u).collect();
            want_out.extend(f(d, h, inter, &a));
            want_act.extend(a);
        }
        rows.push(CheckRow {
            name: format!("expert gate/up q{bits} g{gs} (3 entries)"),
            rel_err: rel_err(&read(act.ptr, want_act.len())?, &want_act),
            limit: LINEAR_LIMIT,
        });
        rows.push(CheckRow {
            name: format!("expert down q{bits} g{gs} (3 entries)"),
            rel_err: rel_err(&read(out.ptr, want_out.len())?, &want_out),
            limit: LINEAR_LIMIT,
        });

        // The shared expert riding along in the down launch (a resident MoE block): the second
        // record's down projection as a dense matrix, its input silu(gate) * up of two vectors,
        // beside entry 0 (a resident block's first entry; `first` is 0 there).
        let (_, _, d) = &mats[1];
        let (lin, _dense) = upload_linear(gpu, d, fmt, h, inter)?;
        // Its own generator, so the rows above draw what they drew before these rows existed: with
        // the shared rng, the next format's one-row matvec drew an output near zero, whose relative
        // error (4.0e-5) then failed the limit (a one-row relative error is ill-conditioned).
        let mut rider_rng = Rng::new(0x5eed_0019 + u64::from(bits));
        let (sg, su) = (rider_rng.normal(inter, 1.0), rider_rng.normal(inter, 1.0));
        let (dg, du, dout) = (
            gpu.alloc(inter * 4, "check shared gate")?,
            gpu.alloc(inter * 4, "check shared up")?,
            gpu.alloc(h * 4, "check shared out")?,
        );
        gpu.htod(dg.ptr, &sg)?;
        gpu.htod(du.ptr, &su)?;
        let rides = crate::weights::shared_rides(&layout, record_bytes, &lin, (inter, h));
        let shared = crate::weights::SharedDown {
            data: lin.data,
            scales: lin.scales,
            biases: lin.biases,
            group_size: gs,
            gate: dg.ptr,
            up: du.ptr,
            out: dout.ptr,
        };
        gpu.htod(out.ptr, &vec![0f32; h])?;
        let io = crate::weights::ExpertIo { shared: Some(shared), ..io };
        crate::weights::launch_experts(gpu, &layout, record_bytes, dtable.ptr, 0, 1, io, (inter, h), &mut || Ok(()))?;
        let a: Vec<f32> = sg.iter().zip(&su).map(|(&g, &u)| g / (1.0 + (-g).exp()) * u).collect();
        let want_shared = f(d, h, inter, &a);
        // The rider's row and entry 0's, which shares its launch; a rider that cannot ride is an error.
        let (got_shared, got_0) = (read(dout.ptr, h)?, read(out.ptr, h)?);
        rows.push(CheckRow {
            name: format!("expert down q{bits} g{gs} with the shared expert riding along: shared row"),
            rel_err: if rides { rel_err(&got_shared, &want_shared) } else { f64::INFINITY },
            limit: LINEAR_LIMIT,
        });
        rows.push(CheckRow {
            name: format!("expert down q{bits} g{gs} with the shared expert riding along: entry 0"),
            rel_err: rel_err(&got_0, &want_out[..h]),
            limit: LINEAR_LIMIT,
        });

        // The shared expert's gate and up projections riding along in the gate/up launch too (the
        // second record's, as dense matrices, on the routed experts' x), beside entry 0: their rows,
        // entry 0's, and the riding down projection's row computed from them.
        let (g1, u1, _) = &mats[1];
        let (lin_g, _dense_g) = upload_linear(gpu, g1, fmt, inter, h)?;
        let (lin_u, _dense_u) = upload_linear(gpu, u1, fmt, inter, h)?;
        let lin_gu = [lin_g, lin_u];
        let gu_rides = crate::weights::shared_gate_up_rides(&layout, record_bytes, &lin_gu[0], &lin_gu[1], (inter, h));
        let (dg2, du2) = (gpu.alloc(inter * 4, "check shared gate")?, gpu.alloc(inter * 4, "check shared up")?);
        let part = |l: &crate::weights::DevLinear| (l.data, l.scales, l.biases);
        let shared_gu = crate::weights::SharedGateUp {
            gate: part(&lin_gu[0]),
            up: part(&lin_gu[1]),
            group_size: gs,
            gate_out: dg2.ptr,
            up_out: du2.ptr,
        };
        gpu.htod(out.ptr, &vec![0f32; h])?;
        gpu.htod(act.ptr, &vec![0f32; inter])?;
        gpu.htod(dout.ptr, &vec![0f32; h])?;
        let io = crate::weights::ExpertIo {
            shared: Some(crate::weights::SharedDown { gate: dg2.ptr, up: du2.ptr, ..shared }),
            shared_gate_up: Some(shared_gu),
            ..io
        };
        crate::weights::launch_experts(gpu, &layout, record_bytes, dtable.ptr, 0, 1, io, (inter, h), &mut || Ok(()))?;
        let (want_g, want_u) = (f(g1, inter, h, &x[..h]), f(u1, inter, h, &x[..h]));
        let a1: Vec<f32> = want_g.iter().zip(&want_u).map(|(&g, &u)| g / (1.0 + (-g).exp()) * u).collect();
        let want_sd = f(d, h, inter, &a1);
        let gu_err = |got: &[f32], want: &[f32]| if gu_rides { rel_err(got, want) } else { f64::INFINITY };
        let name =
            |what: &str| format!("expert gate/up q{bits} g{gs} with the shared gate and up riding along: {what}");
        rows.push(CheckRow {
            name: name("shared gate"),
            rel_err: gu_err(&read(dg2.ptr, inter)?, &want_g),
            limit: LINEAR_LIMIT,
        });
        rows.push(CheckRow {
            name: name("shared up"),
            rel_err: gu_err(&read(du2.ptr, inter)?, &want_u),
            limit: LINEAR_LIMIT,
        });
        rows.push(CheckRow {
            name: name("entry 0"),
            rel_err: rel_err(&read(act.ptr, inter)?, &want_act[..inter]),
            limit: LINEAR_LIMIT,
        });
        rows.push(CheckRow {
            name: name("the shared down row from them"),
            rel_err: gu_err(&read(dout.ptr, h)?, &want_sd),
            limit: LINEAR_LIMIT,
        });
    }
    // Parts of different formats in one launch (the MoE block: the router and the shared-expert
    // gate at 8 bits, the shared expert's gate and up at 4; here 2 bits too).
    let formats = [
        (Affine::new(8, 64), 512usize),
        (Affine::new(8, 64), 1),
        (Affine::new(4, 64), 640),
        (Affine::new(2, 128), 640),
    ];
    rows.push(CheckRow {
        name: "matvec_many of q8, q8, q4 and q2 parts (2560 inputs)".into(),
        rel_err: many_check(gpu, rng, &formats, &x, dx.ptr, dy.ptr)?,
        limit: LINEAR_LIMIT,
    });
    Ok(rows)
}

/// `matvec_many` over random matrices of the given (format, rows), 2560 inputs each (x on the host
/// and at `dx`), their outputs one after another from `dy`: the relative error against the CPU.
fn many_check(gpu: &Gpu, rng: &mut Rng, parts: &[(Affine, usize)], x: &[f32], dx: u64, dy: u64) -> Result<f64> {
    let mut lins = Vec::new();
    let mut want = Vec::new();
    let mut keep = Vec::new();
    for &(fmt, r) in parts {
        let (lin, bufs, w) = rand_linear(gpu, rng, fmt, r, 2560, x)?;
        lins.push(lin);
        want.extend(w);
        keep.push(bufs);
    }
    let mut at = 0u64;
    let parts: Vec<(&DevLinear, u64)> = lins
        .iter()
        .map(|l| {
            let y = dy + at * 4;
            at += l.rows as u64;
            (l, y)
        })
        .collect();
    crate::weights::matvec_many(gpu, dx, &parts)?;
    let mut got = vec![0f32; want.len()];
    gpu.dtoh(dy, &mut got)?;
    Ok(rel_err(&got, &want))
}

/// The blocks of `cuda` against those of `cpu` (the same store), on random activations.
pub fn block_checks(cuda: &CudaModel, cpu: &CpuModel, rng: &mut Rng, label: &str) -> Result<Vec<CheckRow>> {
    let c = cpu.config().clone();
    let store = &*cpu.store;
    let g = &*cuda.gpu;
    let (h, width) = (c.hidden_size, c.hc_hidden());
    let mut rows = Vec::new();
    let mut push = |name: String, rel: f64, limit: f64| {
        rows.push(CheckRow { name: format!("{label}: {name}"), rel_err: rel, limit })
    };
    let mut sc = cuda.scratch.lock().unwrap();
    let dw = &cuda.weights;
    let cw = &cpu.weights;
    let read = |ptr: u64, n: usize| -> Result<Vec<f32>> {
        let mut v = vec![0f32; n];
        g.dtoh(ptr, &mut v)?;
        Ok(v)
    };

    // Hyper-connection read and inject (layer 0, attention side).
    let x = rng.normal(width, 1.0);
    let (inp, inj) = hyper::read(store, &c, &cw.layers[0].attn_hc, &x);
    let inj = inj.expect("attention side injects");
    g.htod(sc.x.ptr, &x)?;
    cuda.hc_read(&sc, &dw.layers[0].attn_hc)?;
    let got_inp = read(sc.inp.ptr, h)?;
    let got_inj: Vec<f32> =
        read(sc.inj.ptr, c.hc_count)?.iter().map(|v| 2.0 / (1.0 + (-v / c.hc_count as f32).exp())).collect();
    push("hyper-connection read".into(), rel_err(&got_inp, &inp), BLOCK_LIMIT);
    push("hyper-connection injection weights".into(), rel_err(&got_inj, &inj), BLOCK_LIMIT);
    let out = rng.normal(h, 1.0);
    let mut want_x = x.clone();
    hyper::inject(&c, &mut want_x, &inj, &out);
    g.htod(sc.out.ptr, &out)?;
    cuda.inject(&sc)?;
    push("hyper-connection inject".into(), rel_err(&read(sc.x.ptr, width)?, &want_x), BLOCK_LIMIT);

    let mut session = cuda.new_session()?;
    for (i, layer) in cw.layers.iter().enumerate() {
        match (&layer.mixer, &dw.layers[i].mixer) {
            (cherenkov_cpu::weights::Mixer::Gdn(cg), Mixer::Gdn(gg)) => {
                // Gated DeltaNet from a random state, three tokens.
                let kc = (c.linear_conv_kernel_dim - 1) * c.gdn_conv_dim();
                let nr = c.gdn_state_len();
                let mut st = GdnState { conv: rng.normal(kc, 1.0), recurrent: rng.normal(nr, 0.1) };
                let conv = g.alloc(kc * 4, "check state")?;
                let rec = g.alloc(nr * 4, "check state")?;
                g.htod(conv.ptr, &st.conv)?;
                g.htod(rec.ptr, &st.recurrent)?;
                let (mut worst_out, mut worst_state, mut worst_conv) = (0f64, 0f64, 0f64);
                for _ in 0..3 {
                    let hv = rng.normal(h, 1.0);
                    let want = gdn::forward(store, &c, cg, &mut st, &hv, None);
                    g.htod(sc.inp.ptr, &hv)?;
                    cuda.gdn(&sc, gg, &conv, &rec, MatvecOutput::Store(sc.out.ptr))?;
                    worst_out = worst_out.max(rel_err(&read(sc.out.ptr, h)?, &want));
                    worst_state = worst_state.max(rel_err(&read(rec.ptr, nr)?, &st.recurrent));
                    worst_conv = worst_conv.max(rel_err(&read(conv.ptr, kc)?, &st.conv));
                }
                push(format!("layer {i} Gated DeltaNet output (3 tokens)"), worst_out, BLOCK_LIMIT);
                push(format!("layer {i} Gated DeltaNet state"), worst_state, BLOCK_LIMIT);
                push(format!("layer {i} Gated DeltaNet conv history"), worst_conv, BLOCK_LIMIT);
            }
            (cherenkov_cpu::weights::Mixer::Attention(ca), Mixer::Attention(ga)) => {
                // QSA attention over enough tokens to pass its budget.
                let steps = c.qsa.as_ref().map_or(40, |q| q.budget + 3 * q.compress_ratio + 5).min(300);
                let rope = Rope::new(c.rope_theta, c.rotary_dim());
                let mut st = AttentionState { k: vec![], v: vec![], index_keys: vec![], index_blocks: vec![] };
                session.reserve(&c, steps + 1)?;
                let MixerState::Attention(dst) = &mut session.layers[i].mixer else { bail!("layer {i} state") };
                let mut worst = 0f64;
                for pos in 0..steps {
                    let hv = rng.normal(h, 1.0);
                    let want = attention::forward(store, &c, &rope, ca, &mut st, &hv, pos);
                    g.htod(sc.inp.ptr, &hv)?;
                    cuda.load_step_inputs(&sc, 0, pos)?;
                    let out = MatvecOutput::Store(sc.out.ptr);
                    cuda.attention(&mut sc, ga, dst, pos, out, true)?;
                    worst = worst.max(rel_err(&read(sc.out.ptr, h)?, &want));
                }
                push(format!("layer {i} QSA attention ({steps} tokens)"), worst, BLOCK_LIMIT);
            }
            _ => bail!("layer {i}: CPU and CUDA weights disagree"),
        }
        // PLE: random residual and conv history, a few tokens.
        if let (Some(cp), Some(gp)) = (&layer.ple, &dw.layers[i].ple) {
            let hash = cherenkov_model::ngram::NgramHash::new(&c, cp.ple_index);
            let table = store.ngram_table(i).expect("PLE table");
            let hist = (c.ple_conv_kernel_size - 1) * c.ngram_size * width;
            let mut conv = rng.normal(hist, 1.0);
            let dconv = g.alloc(hist * 4, "check state")?;
            g.htod(dconv.ptr, &conv)?;
            let mut ctx = vec![c.eos().unwrap_or(0); c.ngram_size - 1];
            let mut worst = 0f64;
            for step in 0..4u32 {
                let tok = (rng.next_u64() % c.vocab_size as u64) as u32;
                let mut x = rng.normal(width, 1.0);
                g.htod(sc.x.ptr, &x)?;
                let emb = ple::gather_embeddings(store, &c, &hash, table, &[tok], &ctx)?;
                ple::forward(store, &c, cp, &emb, &mut x, &mut conv, None);
                cuda.ple_gather(&sc, &hash, i, tok, &ctx)?;
                cuda.load_step_inputs(&sc, tok, 0)?;
                cuda.ple(&sc, gp, &dconv)?;
                worst = worst.max(rel_err(&read(sc.x.ptr, width)?, &x));
                ctx.insert(0, if step == 2 { c.eos().unwrap_or(0) } else { tok });
                ctx.truncate(c.ngram_size - 1);
            }
            push(format!("layer {i} PLE (4 tokens)"), worst, BLOCK_LIMIT);
        }
        // MoE through both expert pools.
        let mut worst = 0f64;
        for _ in 0..3 {
            let hv = rng.normal(h, 1.0);
            let want = moe::forward(store, &c, &layer.moe, &cpu.pool, &hv, None, None)?;
            g.htod(sc.inp.ptr, &hv)?;
            cuda.moe_alone(&mut sc, &dw.layers[i].moe)?;
            worst = worst.max(rel_err(&read(sc.out.ptr, h)?, &want));
        }
        push(format!("layer {i} MoE (router, top-k, experts, shared expert)"), worst, BLOCK_LIMIT);
    }
    // Final mixer and lm_head.
    let x = rng.normal(width, 1.0);
    let (mixed, _) = hyper::read(store, &c, &cw.hyper_connection_mixer, &x);
    let lm = cw.lm_head.lin(store);
    let mut want = vec![0f32; lm.rows()];
    lm.forward(&mixed, &mut want);
    g.htod(sc.x.ptr, &x)?;
    cuda.hc_read(&sc, &dw.hyper_connection_mixer)?;
    dw.lm_head.matvec(g, sc.inp.ptr, sc.logits.ptr)?;
    let logits = read(sc.logits.ptr, lm.rows())?;
    push("final mixer + lm_head".into(), rel_err(&logits, &want), BLOCK_LIMIT);
    // Candidate selection on the device: exactly the host's choice from the same logits.
    // Also with many ties (logits rounded to steps of 2, every 5th -inf): the lower id goes first.
    // No -0: the host orders it below +0 (`total_cmp`), as the two launches' keys do; the one-block
    // kernel counts them equal.
    let tied: Vec<f32> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| if i % 5 == 0 { f32::NEG_INFINITY } else { (l / 2.0).round() * 2.0 + 0.0 })
        .collect();
    // Both ways: two launches (sorted chunks, then their best) and one block (a pass per candidate).
    for (k, row, what, two) in [
        (1, &logits, "", true),
        (40, &logits, "", true),
        (64, &tied, ", tied", true),
        (100, &tied, ", tied", true),
        (40, &logits, ", one block", false),
        (100, &tied, ", tied, one block", false),
    ] {
        g.htod(sc.logits.ptr, row)?;
        // Ids from 7 on only, as a tokenizer smaller than the embedding would ask.
        let among = c.vocab_size - 7;
        let got = cuda.top_candidates_by(&sc, k, among, two)?;
        let expected = cherenkov_engine::backend::top_of(&row[..among], k);
        let wrong = got.iter().zip(&expected).filter(|(a, b)| a.0 != b.0 || a.1.to_bits() != b.1.to_bits()).count()
            + k.saturating_sub(expected.len().min(got.len()));
        push(format!("top-{k} candidates{what} (fraction not identical to the host's)"), wrong as f64 / k as f64, 0.0);
    }
    // Embedding rows.
    let embed = cw.embed_tokens.lin(store);
    let mut worst = 0f64;
    for _ in 0..4 {
        let tok = (rng.next_u64() % c.vocab_size as u64) as u32;
        let mut row = vec![0f32; h];
        embed.row(tok as usize, &mut row);
        let want: Vec<f32> = (0..c.hc_count).flat_map(|_| row.iter().copied()).collect();
        cuda.load_step_inputs(&sc, tok, 0)?;
        dw.embed_tokens.embed(g, sc.step_in.ptr, sc.x.ptr, c.hc_count)?;
        worst = worst.max(rel_err(&read(sc.x.ptr, width)?, &want));
    }
    push("embedding rows".into(), worst, LINEAR_LIMIT);
    Ok(rows)
}

/// Everything, as one report.
pub fn run_all(cuda: &CudaModel, cpu: &CpuModel, seed: u64, label: &str) -> Result<Vec<CheckRow>> {
    let mut rng = Rng::new(seed);
    let mut rows = linear_checks(&cuda.gpu, &mut rng)?;
    rows.extend(block_checks(cuda, cpu, &mut rng, label)?);
    rows.extend(drafting_checks(cuda, cpu, &mut rng, label)?);
    rows.extend(verify_rows_checks(cuda, &mut rng, label)?);
    rows.extend(gdn_rows_checks(&cuda.gpu, &mut rng)?);
    Ok(rows)
}

/// A verifying forward of two rows run as one pass over both ([`CudaModel::verify_rows`]) against
/// the same rows run as two steps, on two sessions fed the same tokens: both rows' logits, then a
/// commit of one row (the pass's record restored) and of two, each followed by a plain forward.
/// Where the pass launches the steps' kernels once a row, the rows differ only where a kernel's
/// sums are ordered by the hardware. The rows' names say where the pass did not run (experts not
/// all resident, or the shared expert on the side stream).
pub fn verify_rows_checks(cuda: &CudaModel, rng: &mut Rng, label: &str) -> Result<Vec<CheckRow>> {
    let vocab = cuda.config().vocab_size;
    let (mut p, mut q) = (cuda.new_session()?, cuda.new_session()?);
    let tokens: Vec<u32> = (0..11).map(|_| (rng.next_u64() % vocab as u64) as u32).collect();
    let mut worst = [0f64; 3];
    let before = cuda.rows_run();
    let both = |f: &mut dyn FnMut(&mut crate::session::CudaSession) -> Result<Vec<f32>>,
                p: &mut crate::session::CudaSession,
                q: &mut crate::session::CudaSession|
     -> Result<f64> {
        cuda.set_verify_rows(true);
        let a = f(p);
        cuda.set_verify_rows(false);
        let b = f(q);
        cuda.set_verify_rows(true);
        Ok(rel_err(&a?, &b?))
    };
    worst[0] = worst[0].max(both(&mut |s| cuda.forward_tokens(s, &tokens[..5], Logits::Last), &mut p, &mut q)?);
    for (i, keep) in [(5, 1), (8, 2)] {
        let e = both(&mut |s| cuda.verify(s, &tokens[i..i + 2]), &mut p, &mut q)?;
        worst[1] = worst[1].max(e);
        cuda.commit(&mut p, keep)?;
        cuda.commit(&mut q, keep)?;
        let e = both(&mut |s| cuda.forward_tokens(s, &tokens[i + 2..i + 3], Logits::Last), &mut p, &mut q)?;
        worst[2] = worst[2].max(e);
    }
    let ran = cuda.rows_run() - before;
    let l = cuda.rows_layers();
    let how = if ran == 2 {
        format!(
            "as one pass (input projections over both rows in one launch in {} of {} GDN layers and {} of {} \
             attention layers, every launch of {} of {} MoE blocks over both rows)",
            l.in_proj_x2, l.gdn, l.qkv_x2, l.attention, l.moe_x2, l.moe
        )
    } else {
        format!("(ran as one pass {ran} of 2 times)")
    };
    Ok(vec![
        CheckRow {
            name: format!("{label}: verifying forward {how} against two steps, both rows"),
            rel_err: worst[1],
            limit: 1e-6,
        },
        CheckRow {
            name: format!("{label}: verifying forward {how}, plain forwards after commits of 1 and 2"),
            rel_err: worst[2].max(worst[0]),
            limit: 1e-6,
        },
    ])
}

/// `gdn_recurrent_rows` over two rows, and over three, against as many launches of
/// `gdn_recurrent_split`, on random inputs of the released shape (16 key heads, 32 value heads of
/// 128 x 128): each row's output and the state after each row, as fractions of values not
/// identical. (A pass launches two rows, both held ahead; the third is one the kernel takes as it
/// comes.)
pub fn gdn_rows_checks(gpu: &Gpu, rng: &mut Rng) -> Result<Vec<CheckRow>> {
    let mut rows = gdn_rows_check(gpu, rng, 2)?;
    rows.extend(gdn_rows_check(gpu, rng, 3)?);
    Ok(rows)
}

fn gdn_rows_check(gpu: &Gpu, rng: &mut Rng, n: usize) -> Result<Vec<CheckRow>> {
    let (nk, nv, dk, dv) = (16usize, 32usize, 128usize, 128usize);
    let (width, heads, state) = (2 * nk * dk + nv * dv, nv * dv, nv * dk * dv);
    let upload = |v: &[f32], what: &str| -> Result<crate::gpu::DevBuf> {
        let b = gpu.alloc(v.len() * 4, what)?;
        gpu.htod(b.ptr, v)?;
        Ok(b)
    };
    let qkv = upload(&rng.normal(n * width, 1.0), "check input")?;
    let a = upload(&rng.normal(n * nv, 1.0), "check input")?;
    let b = upload(&rng.normal(n * nv, 1.0), "check input")?;
    let z = upload(&rng.normal(n * heads, 1.0), "check input")?;
    let a_log = upload(&rng.normal(nv, 0.5), "check input")?;
    let dt_bias = upload(&rng.normal(nv, 0.5), "check input")?;
    let norm_w = upload(&rng.normal(dv, 1.0), "check input")?;
    let s0 = rng.normal(state, 0.1);
    let threads = (dv * 4) as u32;
    let shared = ((2 * dk + 4 * dv) * 4) as u32;
    let args = |qkv: u64, a: u64, b: u64, s: u64, out: u64, z: u64| {
        vec![
            Arg::Ptr(qkv),
            Arg::Ptr(a),
            Arg::Ptr(b),
            Arg::Ptr(a_log.ptr),
            Arg::Ptr(dt_bias.ptr),
            Arg::Ptr(s),
            Arg::Ptr(out),
            Arg::I32(nk as i32),
            Arg::I32(nv as i32),
            Arg::I32(dk as i32),
            Arg::I32(dv as i32),
            Arg::Ptr(z),
            Arg::Ptr(norm_w.ptr),
            Arg::F32(1e-6),
            Arg::I32(0),
            Arg::Ptr(0),
        ]
    };
    // One launch of the one-row kernel a row, the state read back after each.
    let s = upload(&s0, "check state")?;
    let out = gpu.zeros(n * heads * 4, "check output")?;
    let mut want_states = Vec::new();
    for row in 0..n as u64 {
        let f = 4 * row;
        gpu.launch(
            "gdn_recurrent_split",
            (nv as u32, 1, 1),
            threads,
            shared,
            &args(
                qkv.ptr + f * width as u64,
                a.ptr + f * nv as u64,
                b.ptr + f * nv as u64,
                s.ptr,
                out.ptr + f * heads as u64,
                z.ptr + f * heads as u64,
            ),
        )?;
        let mut st = vec![0f32; state];
        gpu.dtoh(s.ptr, &mut st)?;
        want_states.push(st);
    }
    let mut want_out = vec![0f32; n * heads];
    gpu.dtoh(out.ptr, &mut want_out)?;
    // One launch over every row.
    let s2 = upload(&s0, "check state")?;
    let mid = gpu.zeros((n - 1) * state * 4, "check state")?;
    let out2 = gpu.zeros(n * heads * 4, "check output")?;
    let mut rows_args = args(qkv.ptr, a.ptr, b.ptr, s2.ptr, out2.ptr, z.ptr);
    rows_args.insert(6, Arg::Ptr(mid.ptr));
    rows_args.extend([
        Arg::I32(n as i32),
        Arg::I32(width as i32),
        Arg::I32(nv as i32),
        Arg::I32(heads as i32),
        Arg::I32(0),
    ]);
    let rows_shared = crate::model::CudaModel::gdn_rows_shared(shared, dk);
    gpu.launch("gdn_recurrent_rows", (nv as u32, 1, 1), threads, rows_shared, &rows_args)?;
    let read = |p: u64, n: usize| -> Result<Vec<f32>> {
        let mut v = vec![0f32; n];
        gpu.dtoh(p, &mut v)?;
        Ok(v)
    };
    let differ = |got: &[f32], want: &[f32]| {
        got.iter().zip(want).filter(|(g, w)| g.to_bits() != w.to_bits()).count() as f64 / want.len().max(1) as f64
    };
    let got_out = read(out2.ptr, n * heads)?;
    let got_mid = read(mid.ptr, (n - 1) * state)?;
    let got_last = read(s2.ptr, state)?;
    let row = |name: String, rel_err: f64| CheckRow {
        name: format!("gdn_recurrent_rows over {n} rows against {n} launches, {name} (fraction not identical)"),
        rel_err,
        limit: 0.0,
    };
    let mut rows = Vec::new();
    for t in 0..n {
        let o = t * heads..(t + 1) * heads;
        rows.push(row(format!("row {t} output"), differ(&got_out[o.clone()], &want_out[o])));
        let got = if t + 1 < n { &got_mid[t * state..(t + 1) * state] } else { &got_last[..] };
        rows.push(row(format!("state after row {t}"), differ(got, &want_states[t])));
    }
    Ok(rows)
}

/// Drafting with the MTP head against the CPU backend, where the store has a head: the logits of
/// a prefill, of the head's drafts, of verifying forwards over a token and its draft, and of what
/// follows a commit of one row (the draft rolled back) and of both. Each next token is the CPU's
/// greedy choice, fed to both backends.
pub fn drafting_checks(cuda: &CudaModel, cpu: &CpuModel, rng: &mut Rng, label: &str) -> Result<Vec<CheckRow>> {
    let mut rows = Vec::new();
    if cpu.weights.mtp.is_none() {
        return Ok(rows);
    }
    let vocab = cpu.config().vocab_size;
    let greedy = |l: &[f32]| cherenkov_engine::backend::top_of(l, 1)[0].0;
    let (mut a, mut b) = (cpu.new_session(), cuda.new_session()?);
    cpu.enable_drafting(&mut a)?;
    cuda.enable_drafting(&mut b)?;
    let row = |name: &str, got: &[f32], want: &[f32]| CheckRow {
        name: format!("{label}: drafting, {name}"),
        rel_err: rel_err(got, want),
        limit: BLOCK_LIMIT,
    };
    let prompt: Vec<u32> = (0..7).map(|_| (rng.next_u64() % vocab as u64) as u32).collect();
    let want = cpu.forward(&mut a, &prompt, Logits::Last)?;
    rows.push(row("prefill of 7 tokens", &cuda.forward_tokens(&mut b, &prompt, Logits::Last)?, &want));
    // The candidates chosen on the device: their values against the CPU's logits at their ids,
    // and the first of them against the CPU's greedy choice (1: differs).
    let top_rows = |name: &str, got: &[(u32, f32)], want: &[f32]| {
        let at: Vec<f32> = got.iter().map(|&(i, _)| want[i as usize]).collect();
        let values: Vec<f32> = got.iter().map(|&(_, v)| v).collect();
        let first = if got.first().map(|c| c.0) == Some(greedy(want)) { 0.0 } else { 1.0 };
        [
            CheckRow { name: format!("{label}: drafting, {name}"), rel_err: rel_err(&values, &at), limit: BLOCK_LIMIT },
            CheckRow {
                name: format!("{label}: drafting, {name}, first against the CPU's greedy"),
                rel_err: first,
                limit: 0.0,
            },
        ]
    };
    let mut next = greedy(&want);
    // Every logit the first time, the candidates on the device the second.
    for keep in [1, 2] {
        let want = cpu.draft(&mut a, next)?;
        if keep == 1 {
            rows.push(row(&format!("MTP draft before a commit of {keep}"), &cuda.draft(&mut b, next)?, &want));
        } else {
            rows.extend(top_rows("MTP draft's top 40", &cuda.draft_candidates(&mut b, next, 40, vocab)?, &want));
        }
        let d = greedy(&want);
        let want = cpu.verify(&mut a, &[next, d])?;
        if keep == 1 {
            rows.push(row(
                &format!("verifying forward of 2 rows, then kept {keep}"),
                &cuda.verify(&mut b, &[next, d])?,
                &want,
            ));
        } else {
            let got = cuda.verify_candidates(&mut b, &[next, d], 40, vocab)?;
            for (r, got_row) in got.iter().enumerate() {
                rows.extend(top_rows(
                    &format!("verifying forward's row {r} top 40"),
                    got_row,
                    &want[r * vocab..(r + 1) * vocab],
                ));
            }
        }
        cpu.commit(&mut a, keep)?;
        cuda.commit(&mut b, keep)?;
        next = greedy(&want[(keep - 1) * vocab..keep * vocab]);
    }
    // A plain forward after the commit (the head catches up on its pending row), then a draft.
    let want = cpu.forward(&mut a, &[next], Logits::Last)?;
    rows.push(row(
        "plain forward after committing 2 rows",
        &cuda.forward_tokens(&mut b, &[next], Logits::Last)?,
        &want,
    ));
    let next = greedy(&want);
    rows.push(row("MTP draft after that forward", &cuda.draft(&mut b, next)?, &cpu.draft(&mut a, next)?));
    Ok(rows)
}
