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
use cherenkov_model::DType;
use cherenkov_model::dtype::f32_to_bf16;
use cherenkov_model::quant::{Affine, quantize_matrix};
use cherenkov_model::store::Precision;

use crate::gpu::Gpu;
use crate::model::CudaModel;
use crate::session::MixerState;
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
                let nr = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim;
                let mut st = GdnState { conv: rng.normal(kc, 1.0), recurrent: rng.normal(nr, 0.1) };
                let conv = g.alloc(kc * 4, "check state")?;
                let rec = g.alloc(nr * 4, "check state")?;
                g.htod(conv.ptr, &st.conv)?;
                g.htod(rec.ptr, &st.recurrent)?;
                let (mut worst_out, mut worst_state) = (0f64, 0f64);
                for _ in 0..3 {
                    let hv = rng.normal(h, 1.0);
                    let want = gdn::forward(store, &c, cg, &mut st, &hv);
                    g.htod(sc.inp.ptr, &hv)?;
                    cuda.gdn(&sc, gg, &conv, &rec)?;
                    worst_out = worst_out.max(rel_err(&read(sc.out.ptr, h)?, &want));
                    worst_state = worst_state.max(rel_err(&read(rec.ptr, nr)?, &st.recurrent));
                }
                push(format!("layer {i} Gated DeltaNet output (3 tokens)"), worst_out, BLOCK_LIMIT);
                push(format!("layer {i} Gated DeltaNet state"), worst_state, BLOCK_LIMIT);
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
                    cuda.attention(&mut sc, ga, dst, pos)?;
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
                ple::forward(store, &c, cp, &emb, &mut x, &mut conv);
                cuda.ple(&sc, gp, &hash, i, tok, &ctx, &dconv)?;
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
            cuda.moe(&mut sc, &dw.layers[i].moe, None)?;
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
    for k in [1, 40] {
        g.htod(sc.logits.ptr, &logits)?;
        // Ids from 7 on only, as a tokenizer smaller than the embedding would ask.
        let among = c.vocab_size - 7;
        let got = cuda.top_candidates(&sc, k, among)?;
        let expected = cherenkov_engine::backend::top_of(&logits[..among], k);
        let wrong = got.iter().zip(&expected).filter(|(a, b)| a.0 != b.0 || a.1.to_bits() != b.1.to_bits()).count();
        push(format!("top-{k} candidates (fraction not identical to the host's)"), wrong as f64 / k as f64, 0.0);
    }
    // Embedding rows.
    let embed = cw.embed_tokens.lin(store);
    let mut worst = 0f64;
    for _ in 0..4 {
        let tok = (rng.next_u64() % c.vocab_size as u64) as u32;
        let mut row = vec![0f32; h];
        embed.row(tok as usize, &mut row);
        let want: Vec<f32> = (0..c.hc_count).flat_map(|_| row.iter().copied()).collect();
        dw.embed_tokens.embed(g, tok, sc.x.ptr, c.hc_count)?;
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
    Ok(rows)
}
