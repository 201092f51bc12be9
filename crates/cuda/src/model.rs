//! The `qwen4_exp` forward on the GPU, one token at a time.
//!
//! Same block order and equations as `cherenkov_cpu::model`; every intermediate stays on the
//! device. Per MoE block the router's top-k choices come back to the host, the host forms the
//! step's experts, leases them from the expert pool (misses are read by IO threads into their
//! device slots) and writes the address table: one u64 per expert (device address of its record,
//! precision tag in bits 63/62), then the resident count and the total count; the expert kernels
//! follow the table, and the outputs are combined per row in top-k order.

use std::sync::{Arc, Mutex};

use anyhow::{Context, Result, bail};
use cherenkov_cpu::ple::gather_embeddings;
use cherenkov_cpu::weights::Weights;
use cherenkov_engine::backend::{Backend, Logits};
use cherenkov_engine::residency::ExpertPool;
use cherenkov_engine::routing::top_k;
use cherenkov_engine::stats::{ExpertStats, ForwardStats, PoolStats};
use cherenkov_model::config::{GateAct, TextConfig};
use cherenkov_model::ngram::NgramHash;
use cherenkov_model::store::{ExpertLayout, Precision, RecordMatrix, Store};

use crate::gpu::{Arg, BLOCKS_WANTED, DevBuf, Gpu, blocks, rows_per_block};
use crate::session::{CudaSession, MixerState};
use crate::slots::DeviceSlots;
use crate::weights::{DeviceWeights, HyperConnection, Mixer};

/// Precision tags of address-table entries.
pub const TAG_Q3: u64 = 1 << 63;
pub const TAG_Q2: u64 = 1 << 62;

/// What a step returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Want {
    Nothing,
    Logits,
    /// The `k` largest logits among ids below `among`, chosen on the device.
    Top {
        k: usize,
        among: usize,
    },
}

/// Where decode time goes (host clocks around synchronised sections).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepTiming {
    pub steps: u64,
    /// Whole steps, ns.
    pub total_ns: u64,
    /// Waiting for expert reads (`Lease::wait_all`), ns.
    pub wait_ns: u64,
    /// Routed-expert kernels (from the table upload to their completion), ns.
    pub experts_ns: u64,
}

impl StepTiming {
    /// Everything that is neither waiting nor routed experts: dense layers, routing, syncs.
    pub fn dense_ns(&self) -> u64 {
        self.total_ns.saturating_sub(self.wait_ns + self.experts_ns)
    }
}

/// Scratch vectors of one forward (sized for the largest use).
pub(crate) struct Scratch {
    pub(crate) x: DevBuf,
    pub(crate) normed: DevBuf,
    pub(crate) low: DevBuf,
    pub(crate) mix: DevBuf,
    pub(crate) inp: DevBuf,
    pub(crate) inj: DevBuf,
    pub(crate) out: DevBuf,
    pub(crate) big: [DevBuf; 6],
    pub(crate) table: DevBuf,
    pub(crate) rank_entry: DevBuf,
    pub(crate) weights: DevBuf,
    pub(crate) ids: DevBuf,
    pub(crate) act: DevBuf,
    pub(crate) eout: DevBuf,
    pub(crate) scores: DevBuf,
    pub(crate) idx: DevBuf,
    pub(crate) logits: DevBuf,
}

pub struct CudaModel {
    pub store: Arc<Store>,
    pub gpu: Arc<Gpu>,
    pub pool: Arc<ExpertPool<DeviceSlots>>,
    /// Synthetic-benchmark routing (None: the model's router decides).
    pub skew: Option<Arc<cherenkov_engine::routing::SkewedRouting>>,
    /// Lookahead: apply the next layer's router to this layer's MoE input and prefetch its experts
    /// behind the step's own misses.
    pub lookahead: bool,
    predicted: Mutex<Vec<Option<Vec<usize>>>>,
    /// Accumulated decode timing (reset with [`CudaModel::reset_timing`]).
    timing: Mutex<StepTiming>,
    pub(crate) weights: DeviceWeights,
    inv_freq: DevBuf,
    ngram: Vec<Option<NgramHash>>,
    pub(crate) scratch: Mutex<Scratch>,
}

fn f32s(n: usize) -> usize {
    n.max(1) * 4
}

impl CudaModel {
    /// Uploads the dense weights and binds the expert pool (whose slots live on this GPU).
    pub fn new(store: Arc<Store>, gpu: Arc<Gpu>, pool: Arc<ExpertPool<DeviceSlots>>) -> Result<CudaModel> {
        let c = store.config().clone();
        let host = Weights::load(&store).with_context(|| format!("loading weights from {}", store.dir.display()))?;
        let weights = DeviceWeights::upload(&gpu, &store, &host)?;
        for l in &store.manifest.experts.layers {
            expert_kernels(l)?;
        }
        let rd = c.rotary_dim();
        let inv: Vec<f32> = (0..rd / 2).map(|i| 1.0 / (c.rope_theta as f32).powf((2 * i) as f32 / rd as f32)).collect();
        let inv_freq = gpu.alloc(f32s(inv.len()), "RoPE tables")?;
        gpu.htod(inv_freq.ptr, &inv)?;
        let ngram = (0..c.num_hidden_layers).map(|i| c.ple_index(i).map(|k| NgramHash::new(&c, k))).collect();
        let widest = [
            c.hc_hidden(),
            c.gdn_conv_dim(),
            c.num_attention_heads * c.head_dim * 2,
            c.qsa.as_ref().map_or(0, |q| (q.n_heads + q.kv_heads) * q.head_dim),
            c.ple_embed_dim,
            c.shared_expert_intermediate_size,
            c.num_experts,
            c.gdn_value_dim(),
        ]
        .into_iter()
        .max()
        .unwrap();
        let e = c.num_experts;
        let z = |n: usize, w: &str| gpu.zeros(n, w);
        let scratch = Scratch {
            x: z(f32s(c.hc_hidden()), "activations")?,
            normed: z(f32s(c.hc_hidden()), "activations")?,
            low: z(f32s(c.hc_lowrank), "activations")?,
            mix: z(f32s(c.hc_hidden()), "activations")?,
            inp: z(f32s(c.hidden_size), "activations")?,
            inj: z(f32s(c.hc_count), "activations")?,
            out: z(f32s(c.hidden_size), "activations")?,
            big: [
                z(f32s(widest), "activations")?,
                z(f32s(widest), "activations")?,
                z(f32s(widest), "activations")?,
                z(f32s(widest), "activations")?,
                z(f32s(widest), "activations")?,
                z(f32s(widest), "activations")?,
            ],
            table: z((e + 2) * 8, "the expert address table")?,
            rank_entry: z(e * 4, "the expert address table")?,
            weights: z(e.max(1024) * 4, "the routing weights")?,
            ids: z(e.max(1024) * 4, "the routing ids")?,
            act: z(f32s(e * c.moe_intermediate_size), "expert activations")?,
            eout: z(f32s(e * c.hidden_size), "expert outputs")?,
            scores: z(f32s(c.num_attention_heads * 4096), "attention scores")?,
            idx: z(4 * 4096, "attention token lists")?,
            logits: z(f32s(c.vocab_size), "logits")?,
        };
        gpu.sync()?;
        let predicted = Mutex::new(vec![None; store.manifest.experts.layers.len()]);
        Ok(CudaModel {
            store,
            gpu,
            pool,
            skew: None,
            lookahead: true,
            predicted,
            timing: Mutex::new(StepTiming::default()),
            weights,
            inv_freq,
            ngram,
            scratch: Mutex::new(scratch),
        })
    }

    pub fn config(&self) -> &TextConfig {
        self.store.config()
    }

    pub fn timing(&self) -> StepTiming {
        *self.timing.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn reset_timing(&self) {
        *self.timing.lock().unwrap_or_else(|e| e.into_inner()) = StepTiming::default();
    }

    fn add_timing(&self, f: impl FnOnce(&mut StepTiming)) {
        f(&mut self.timing.lock().unwrap_or_else(|e| e.into_inner()));
    }

    pub fn new_session(&self) -> Result<CudaSession> {
        CudaSession::new(self.gpu.clone(), self.config())
    }

    /// Runs tokens one at a time; logits as for the CPU backend.
    pub fn forward_tokens(&self, s: &mut CudaSession, tokens: &[u32], which: Logits) -> Result<Vec<f32>> {
        let all = which == Logits::All;
        self.run_steps(s, tokens, |last| if all || last { Want::Logits } else { Want::Nothing })
    }

    /// Runs `tokens` and returns the `k` largest logits of the last one among ids below `among`, as
    /// (id, logit), descending (ties to the lower id), chosen on the device: the host samples from
    /// them without copying the vocabulary back. `k` is at most 1024.
    pub fn forward_candidates(
        &self,
        s: &mut CudaSession,
        tokens: &[u32],
        k: usize,
        among: usize,
    ) -> Result<Vec<(u32, f32)>> {
        let among = among.min(self.config().vocab_size);
        let k = k.clamp(1, 1024).min(among);
        let out = self.run_steps(s, tokens, |last| if last { Want::Top { k, among } } else { Want::Nothing })?;
        let ids: Vec<u32> = out[..k].iter().map(|x| x.to_bits()).collect();
        // Fewer than k logits above -inf leave ids past the vocabulary (the kernel's "none").
        Ok(ids.into_iter().zip(out[k..].iter().copied()).filter(|&(i, _)| (i as usize) < among).collect())
    }

    /// Checks `tokens`, makes room in the session, and runs one step per token; `want(last)` says
    /// what each step leaves in the output. Records the steps' timing and the forward.
    fn run_steps(&self, s: &mut CudaSession, tokens: &[u32], want: impl Fn(bool) -> Want) -> Result<Vec<f32>> {
        let c = self.config();
        if tokens.is_empty() {
            bail!("forward needs at least one token");
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            bail!("token id {bad} is outside the vocabulary (vocab_size {})", c.vocab_size);
        }
        s.reserve(c, s.pos + tokens.len() + 1)?;
        let mut sc = self.scratch.lock().unwrap();
        self.gpu.bind()?;
        let call = std::time::Instant::now();
        let mut out = Vec::new();
        for (i, &tok) in tokens.iter().enumerate() {
            let t0 = std::time::Instant::now();
            self.step(s, &mut sc, tok, want(i + 1 == tokens.len()), &mut out)?;
            let ns = t0.elapsed().as_nanos() as u64;
            self.add_timing(|t| {
                t.steps += 1;
                t.total_ns += ns;
            });
        }
        self.pool.record_forward(tokens.len() as u64, call.elapsed().as_nanos() as u64);
        Ok(out)
    }

    fn step(&self, s: &mut CudaSession, sc: &mut Scratch, tok: u32, want: Want, out: &mut Vec<f32>) -> Result<()> {
        let c = self.config().clone();
        let g = &*self.gpu;
        let w = &self.weights;
        let hc = c.hc_count;
        w.embed_tokens.embed(g, tok, sc.x.ptr, hc)?;
        for (i, (layer, ls)) in w.layers.iter().zip(s.layers.iter_mut()).enumerate() {
            if let (Some(p), Some(hash)) = (&layer.ple, &self.ngram[i]) {
                let state = ls.ple_conv.as_ref().context("PLE state")?;
                self.ple(sc, p, hash, i, tok, &s.ngram_context, state)?;
            }
            self.hc_read(sc, &layer.attn_hc)?;
            match (&layer.mixer, &mut ls.mixer) {
                (Mixer::Gdn(gw), MixerState::Gdn { conv, recurrent }) => self.gdn(sc, gw, conv, recurrent)?,
                (Mixer::Attention(aw), MixerState::Attention(st)) => {
                    self.attention(sc, aw, st, s.pos)?;
                }
                _ => unreachable!("session built for this model"),
            }
            self.inject(sc)?;
            self.hc_read(sc, &layer.mlp_hc)?;
            self.moe(sc, &layer.moe, w.layers.get(i + 1).map(|l| &l.moe))?;
            self.inject(sc)?;
        }
        s.ngram_context.insert(0, tok);
        s.ngram_context.truncate(c.ngram_size.saturating_sub(1));
        s.pos += 1;
        if want != Want::Nothing {
            self.hc_read(sc, &w.hyper_connection_mixer)?;
            w.lm_head.matvec(g, sc.inp.ptr, sc.logits.ptr)?;
        }
        match want {
            Want::Nothing => {}
            Want::Logits => {
                let mut logits = vec![0f32; c.vocab_size];
                g.dtoh(sc.logits.ptr, &mut logits)?;
                out.extend_from_slice(&logits);
            }
            Want::Top { k, among } => {
                // ids (as f32 bit patterns) then values, in `out`.
                let top = self.top_candidates(sc, k, among)?;
                out.extend(top.iter().map(|&(i, _)| f32::from_bits(i)));
                out.extend(top.iter().map(|&(_, v)| v));
            }
        }
        Ok(())
    }

    /// The `k` largest of the first `among` entries of `sc.logits` as (id, logit), descending, ties
    /// to the lower id, chosen on the device (one block; `k` passes of an argmax). Overwrites the
    /// chosen logits with -inf. Where fewer than `k` entries exist, the rest have id `i32::MAX`.
    pub(crate) fn top_candidates(&self, sc: &Scratch, k: usize, among: usize) -> Result<Vec<(u32, f32)>> {
        let g = &*self.gpu;
        let v = among.min(self.config().vocab_size);
        g.launch(
            "top_candidates",
            (1, 1, 1),
            1024,
            0,
            &[
                Arg::Ptr(sc.logits.ptr),
                Arg::I32(v as i32),
                Arg::I32(k as i32),
                Arg::Ptr(sc.ids.ptr),
                Arg::Ptr(sc.weights.ptr),
            ],
        )?;
        let mut ids = vec![0u32; k];
        let mut vals = vec![0f32; k];
        g.dtoh(sc.ids.ptr, &mut ids)?;
        g.dtoh(sc.weights.ptr, &mut vals)?;
        Ok(ids.into_iter().zip(vals).collect())
    }

    /// The PLE block for token `tok` of decoder layer `layer`: x += ple(x).
    pub(crate) fn ple(
        &self,
        sc: &Scratch,
        p: &crate::weights::Ple,
        hash: &NgramHash,
        layer: usize,
        tok: u32,
        context: &[u32],
        state: &DevBuf,
    ) -> Result<()> {
        let c = self.config();
        let g = &*self.gpu;
        let (h, hc) = (c.hidden_size, c.hc_count);
        let table = self.store.ngram_table(layer).context("store has no n-gram table")?;
        let emb = gather_embeddings(&self.store, c, hash, table, &[tok], context)?;
        let [e, key, value, kn, qn, gated] = &sc.big;
        g.htod(e.ptr, &emb)?;
        p.key_proj.matvec(g, e.ptr, key.ptr)?;
        p.value_proj.matvec(g, e.ptr, value.ptr)?;
        self.rmsnorm(key.ptr, p.norm_key.ptr, kn.ptr, hc, h, c.hc_hidden())?;
        self.rmsnorm(sc.x.ptr, p.norm_query.ptr, qn.ptr, hc, h, c.hc_hidden())?;
        g.launch(
            "ple_gate",
            (hc as u32, 1, 1),
            256,
            0,
            &[Arg::Ptr(kn.ptr), Arg::Ptr(qn.ptr), Arg::Ptr(value.ptr), Arg::Ptr(gated.ptr), Arg::I32(h as i32)],
        )?;
        // The normalised gated values reuse `key`'s buffer.
        self.rmsnorm(gated.ptr, p.norm_conv.ptr, key.ptr, hc, h, c.hc_hidden())?;
        g.launch(
            "ple_conv",
            (blocks(c.hc_hidden(), 256), 1, 1),
            256,
            0,
            &[
                Arg::Ptr(key.ptr),
                Arg::Ptr(gated.ptr),
                Arg::Ptr(state.ptr),
                Arg::Ptr(p.conv1d.ptr),
                Arg::Ptr(sc.x.ptr),
                Arg::I32(c.hc_hidden() as i32),
                Arg::I32(c.ple_conv_kernel_size as i32),
                Arg::I32(c.ngram_size as i32),
            ],
        )
    }

    /// Gated DeltaNet on `inp` into `out`, advancing the state.
    pub(crate) fn gdn(
        &self,
        sc: &Scratch,
        gw: &crate::weights::GatedDeltaNet,
        conv: &DevBuf,
        recurrent: &DevBuf,
    ) -> Result<()> {
        let c = self.config();
        let g = &*self.gpu;
        let [qkv, z, b, a, conv_out, core] = &sc.big;
        gw.in_proj_qkv.matvec(g, sc.inp.ptr, qkv.ptr)?;
        gw.in_proj_z.matvec(g, sc.inp.ptr, z.ptr)?;
        gw.in_proj_b.matvec(g, sc.inp.ptr, b.ptr)?;
        gw.in_proj_a.matvec(g, sc.inp.ptr, a.ptr)?;
        let cd = c.gdn_conv_dim();
        g.launch(
            "gdn_conv",
            (blocks(cd, 256), 1, 1),
            256,
            0,
            &[
                Arg::Ptr(qkv.ptr),
                Arg::Ptr(conv.ptr),
                Arg::Ptr(gw.conv1d.ptr),
                Arg::Ptr(conv_out.ptr),
                Arg::I32(cd as i32),
                Arg::I32(c.linear_conv_kernel_dim as i32),
            ],
        )?;
        let (nk, nv, dk, dv) =
            (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim);
        g.launch(
            "gdn_qk_norm",
            ((2 * nk) as u32, 1, 1),
            128,
            0,
            &[Arg::Ptr(conv_out.ptr), Arg::I32(nk as i32), Arg::I32(dk as i32)],
        )?;
        // Columns split over 4 threads holding their rows in registers where the head fits (the
        // kernel's GDN_SPLIT and GDN_MAX_ROWS), else one thread per column.
        const SPLIT: usize = 4;
        let split = dk % SPLIT == 0 && dk / SPLIT <= 32 && dv * SPLIT <= 1024;
        let (kernel, threads, shared) = if split {
            ("gdn_recurrent_split", dv * SPLIT, 2 * dk + SPLIT * dv)
        } else {
            ("gdn_recurrent", dv.min(1024), 2 * dk)
        };
        g.launch(
            kernel,
            (nv as u32, 1, 1),
            threads as u32,
            (shared * 4) as u32,
            &[
                Arg::Ptr(conv_out.ptr),
                Arg::Ptr(a.ptr),
                Arg::Ptr(b.ptr),
                Arg::Ptr(gw.a_log.ptr),
                Arg::Ptr(gw.dt_bias.ptr),
                Arg::Ptr(recurrent.ptr),
                Arg::Ptr(core.ptr),
                Arg::I32(nk as i32),
                Arg::I32(nv as i32),
                Arg::I32(dk as i32),
                Arg::I32(dv as i32),
            ],
        )?;
        let act = if c.gate_act == GateAct::Sigmoid { 0 } else { 1 };
        g.launch(
            "gdn_out_norm",
            (nv as u32, 1, 1),
            128,
            0,
            &[
                Arg::Ptr(core.ptr),
                Arg::Ptr(z.ptr),
                Arg::Ptr(gw.norm.ptr),
                Arg::I32(dv as i32),
                Arg::F32(c.rms_norm_eps as f32),
                Arg::I32(act),
            ],
        )?;
        gw.out_proj.matvec(g, core.ptr, sc.out.ptr)
    }

    /// Grouped zero-centred RMSNorm of `groups` groups of `group` elements.
    pub(crate) fn rmsnorm(&self, x: u64, w: u64, y: u64, groups: usize, group: usize, wlen: usize) -> Result<()> {
        self.gpu.launch(
            "rmsnorm_zc",
            (groups as u32, 1, 1),
            256,
            0,
            &[
                Arg::Ptr(x),
                Arg::Ptr(w),
                Arg::Ptr(y),
                Arg::I32(group as i32),
                Arg::I32(wlen as i32),
                Arg::F32(self.config().rms_norm_eps as f32),
            ],
        )
    }

    /// Hyper-connection read of x into `inp` (and the raw injection logits into `inj`).
    pub(crate) fn hc_read(&self, sc: &Scratch, hcw: &HyperConnection) -> Result<()> {
        let c = self.config();
        let (h, hc) = (c.hidden_size, c.hc_count);
        let g = &*self.gpu;
        self.rmsnorm(sc.x.ptr, hcw.hc_norm.ptr, sc.normed.ptr, hc, h, c.hc_hidden())?;
        hcw.input_mix_weight_down.matvec(g, sc.normed.ptr, sc.low.ptr)?;
        g.launch(
            "scale_silu",
            (blocks(c.hc_lowrank, 256), 1, 1),
            256,
            0,
            &[Arg::Ptr(sc.low.ptr), Arg::I32(c.hc_lowrank as i32), Arg::F32(1.0 / hc as f32)],
        )?;
        hcw.input_mix_weight_up.matvec(g, sc.low.ptr, sc.mix.ptr)?;
        g.launch(
            "hc_mix",
            (blocks(h, 256), 1, 1),
            256,
            0,
            &[
                Arg::Ptr(sc.mix.ptr),
                Arg::Ptr(sc.normed.ptr),
                Arg::Ptr(sc.inp.ptr),
                Arg::I32(hc as i32),
                Arg::I32(h as i32),
            ],
        )?;
        if let Some(inj) = &hcw.block_inject_weight {
            inj.matvec(g, sc.normed.ptr, sc.inj.ptr)?;
        }
        Ok(())
    }

    /// x += 2 sigmoid(inj / hc) (outer) out.
    pub(crate) fn inject(&self, sc: &Scratch) -> Result<()> {
        let c = self.config();
        self.gpu.launch(
            "hc_inject",
            (blocks(c.hc_hidden(), 256), 1, 1),
            256,
            0,
            &[
                Arg::Ptr(sc.x.ptr),
                Arg::Ptr(sc.inj.ptr),
                Arg::Ptr(sc.out.ptr),
                Arg::I32(c.hc_count as i32),
                Arg::I32(c.hidden_size as i32),
            ],
        )
    }

    pub(crate) fn attention(
        &self,
        sc: &mut Scratch,
        aw: &crate::weights::Attention,
        st: &mut crate::session::AttentionState,
        pos: usize,
    ) -> Result<()> {
        let c = self.config().clone();
        let g = &*self.gpu;
        let (nh, nkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let rd = c.rotary_dim() as i32;
        let eps = c.rms_norm_eps as f32;
        let [qg, q, gate, k, v, attn] = &sc.big;
        aw.q_proj.matvec(g, sc.inp.ptr, qg.ptr)?;
        aw.k_proj.matvec(g, sc.inp.ptr, k.ptr)?;
        aw.v_proj.matvec(g, sc.inp.ptr, v.ptr)?;
        g.launch(
            "split_q_gate",
            (blocks(nh * d, 256), 1, 1),
            256,
            0,
            &[Arg::Ptr(qg.ptr), Arg::Ptr(q.ptr), Arg::Ptr(gate.ptr), Arg::I32(nh as i32), Arg::I32(d as i32)],
        )?;
        g.launch(
            "norm_rope",
            (nh as u32, 1, 1),
            128,
            0,
            &[
                Arg::Ptr(q.ptr),
                Arg::Ptr(aw.q_norm.ptr),
                Arg::I32(d as i32),
                Arg::F32(eps),
                Arg::Ptr(self.inv_freq.ptr),
                Arg::I32(rd),
                Arg::I32(pos as i32),
            ],
        )?;
        g.launch(
            "norm_rope",
            (nkv as u32, 1, 1),
            128,
            0,
            &[
                Arg::Ptr(k.ptr),
                Arg::Ptr(aw.k_norm.ptr),
                Arg::I32(d as i32),
                Arg::F32(eps),
                Arg::Ptr(self.inv_freq.ptr),
                Arg::I32(rd),
                Arg::I32(pos as i32),
            ],
        )?;
        let kvb = nkv * d * 4;
        g.dtod(st.k.at(pos * kvb), k.ptr, kvb)?;
        g.dtod(st.v.at(pos * kvb), v.ptr, kvb)?;

        // QSA: which tokens this query sees (None: all of 0..=pos).
        let mut list: Option<Vec<i32>> = None;
        if let (Some(qsa), Some(ix)) = (&c.qsa, &aw.indexer) {
            let (ih, id, ratio) = (qsa.n_heads, qsa.head_dim, qsa.compress_ratio);
            // `qg` is free again after split_q_gate: it holds the indexer projection.
            ix.index_qk_proj.matvec(g, sc.inp.ptr, qg.ptr)?;
            g.dtod(st.index_keys.at(pos * id * 4), qg.ptr + (ih * id * 4) as u64, id * 4)?;
            g.launch(
                "norm_rope",
                (ih as u32, 1, 1),
                128,
                0,
                &[
                    Arg::Ptr(qg.ptr),
                    Arg::Ptr(ix.q_layernorm.ptr),
                    Arg::I32(id as i32),
                    Arg::F32(eps),
                    Arg::Ptr(self.inv_freq.ptr),
                    Arg::I32(rd),
                    Arg::I32(pos as i32),
                ],
            )?;
            let complete = (pos + 1) / ratio;
            while st.blocks < complete {
                g.launch(
                    "qsa_pool_block",
                    (1, 1, 1),
                    128,
                    (id * 4) as u32,
                    &[
                        Arg::Ptr(st.index_keys.ptr),
                        Arg::Ptr(st.index_blocks.ptr),
                        Arg::I32(st.blocks as i32),
                        Arg::I32(ratio as i32),
                        Arg::I32(id as i32),
                        Arg::Ptr(ix.k_layernorm.ptr),
                        Arg::F32(eps),
                        Arg::Ptr(self.inv_freq.ptr),
                        Arg::I32(rd),
                    ],
                )?;
                st.blocks += 1;
            }
            let topk = qsa.block_topk();
            if complete > topk {
                if complete * 4 > sc.scores.bytes {
                    sc.scores = g.zeros(complete * 8, "attention scores")?;
                }
                g.launch(
                    "qsa_scores",
                    (blocks(complete * 32, 128), 1, 1),
                    128,
                    0,
                    &[
                        Arg::Ptr(qg.ptr),
                        Arg::Ptr(st.index_blocks.ptr),
                        Arg::Ptr(sc.scores.ptr),
                        Arg::I32(complete as i32),
                        Arg::I32(ih as i32),
                        Arg::I32(id as i32),
                    ],
                )?;
                let mut scores = vec![0f32; complete];
                g.dtoh(sc.scores.ptr, &mut scores)?;
                let mut order: Vec<usize> = (0..complete).collect();
                order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
                let mut chosen: Vec<usize> = order[..topk].to_vec();
                chosen.sort_unstable();
                let mut toks: Vec<i32> =
                    chosen.iter().flat_map(|&b| (b * ratio) as i32..((b + 1) * ratio) as i32).collect();
                toks.extend((complete * ratio) as i32..=pos as i32);
                list = Some(toks);
            }
        }
        let n = list.as_ref().map_or(pos + 1, |l| l.len());
        if nh * n * 4 > sc.scores.bytes {
            sc.scores = g.zeros(nh * n * 8, "attention scores")?;
        }
        let idx_ptr = match &list {
            Some(l) => {
                if l.len() * 4 > sc.idx.bytes {
                    sc.idx = g.zeros(l.len() * 8, "attention token lists")?;
                }
                g.htod(sc.idx.ptr, l)?;
                sc.idx.ptr
            }
            None => 0,
        };
        g.launch(
            "attend",
            (nh as u32, 1, 1),
            256,
            0,
            &[
                Arg::Ptr(q.ptr),
                Arg::Ptr(st.k.ptr),
                Arg::Ptr(st.v.ptr),
                Arg::Ptr(idx_ptr),
                Arg::I32(n as i32),
                Arg::Ptr(sc.scores.ptr),
                Arg::Ptr(attn.ptr),
                Arg::I32(nh as i32),
                Arg::I32(nkv as i32),
                Arg::I32(d as i32),
                Arg::F32(1.0 / (d as f32).sqrt()),
            ],
        )?;
        g.launch(
            "mul_sigmoid",
            (blocks(nh * d, 256), 1, 1),
            256,
            0,
            &[Arg::Ptr(attn.ptr), Arg::Ptr(gate.ptr), Arg::I32((nh * d) as i32)],
        )?;
        aw.o_proj.matvec(g, attn.ptr, sc.out.ptr)
    }

    pub(crate) fn moe(
        &self,
        sc: &mut Scratch,
        m: &crate::weights::Moe,
        next: Option<&crate::weights::Moe>,
    ) -> Result<()> {
        let c = self.config().clone();
        let g = &*self.gpu;
        let (h, e, k, inter) = (c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size);
        let [logits, sg, su, shared, sgate, _] = &sc.big;
        m.gate.matvec(g, sc.inp.ptr, logits.ptr)?;
        if self.skew.is_none() {
            g.launch(
                "route_topk",
                (1, 1, 1),
                256,
                (e * 4) as u32,
                &[
                    Arg::Ptr(logits.ptr),
                    Arg::I32(e as i32),
                    Arg::I32(k as i32),
                    Arg::I32(c.norm_topk_prob as i32),
                    Arg::Ptr(sc.ids.ptr),
                    Arg::Ptr(sc.weights.ptr),
                ],
            )?;
        }
        // Shared expert while the routing comes back.
        m.shared_gate_proj.matvec(g, sc.inp.ptr, sg.ptr)?;
        m.shared_up_proj.matvec(g, sc.inp.ptr, su.ptr)?;
        let s = c.shared_expert_intermediate_size;
        g.launch(
            "silu_mul",
            (blocks(s, 256), 1, 1),
            256,
            0,
            &[Arg::Ptr(sg.ptr), Arg::Ptr(su.ptr), Arg::I32(s as i32)],
        )?;
        m.shared_down_proj.matvec(g, sg.ptr, shared.ptr)?;
        m.shared_expert_gate.matvec(g, sc.inp.ptr, sgate.ptr)?;
        let experts: Vec<usize> = match &self.skew {
            None => {
                let mut ids = vec![0i32; k];
                g.dtoh(sc.ids.ptr, &mut ids)?;
                ids.iter().map(|&i| i as usize).collect()
            }
            Some(sk) => {
                // Synthetic routing: the router's logits plus the skew's bias, chosen on the host.
                let mut l = vec![0f32; e];
                g.dtoh(logits.ptr, &mut l)?;
                let top = top_k(&l, Some(&sk.bias(m.expert_slot, e)), k, c.norm_topk_prob);
                let ids: Vec<usize> = top.iter().map(|x| x.0).collect();
                sk.observe(m.expert_slot, &ids, e);
                let wts: Vec<f32> = top.iter().map(|x| x.1).collect();
                g.htod(sc.weights.ptr, &wts)?;
                ids
            }
        };
        let lease = self.pool.acquire(m.expert_slot, &experts)?;
        if self.lookahead {
            self.look_ahead(sc, m.expert_slot, &experts, next)?;
        }
        let tw = std::time::Instant::now();
        lease.wait_all()?;
        let wait_ns = tw.elapsed().as_nanos() as u64;
        let entries = lease.entries();
        // Table order: resident first, then the rest, each by routing weight (experts arrive sorted).
        let mut order: Vec<usize> = (0..entries.len()).filter(|&i| entries[i].hit).collect();
        order.extend((0..entries.len()).filter(|&i| !entries[i].hit));
        let layout = &self.store.manifest.experts.layers[m.expert_slot];
        let tag = match layout.gate_proj.precision {
            Precision::Affine { bits: 3, .. } => TAG_Q3,
            Precision::Affine { bits: 2, .. } => TAG_Q2,
            _ => 0,
        };
        let mem = self.pool.memory();
        let mut table: Vec<u64> = order.iter().map(|&i| mem.slot_ptr(entries[i].slot) | tag).collect();
        let resident = order.iter().filter(|&&i| entries[i].hit).count();
        table.push(resident as u64);
        table.push(order.len() as u64);
        // For each top-k rank, the table entry of its expert.
        let rank_entry: Vec<i32> =
            (0..k).map(|r| order.iter().position(|&i| entries[i].expert == experts[r]).unwrap() as i32).collect();
        g.htod(sc.table.ptr, &table)?;
        g.htod(sc.rank_entry.ptr, &rank_entry)?;
        let te = std::time::Instant::now();
        let n = order.len() as u32;
        let (gk, dk) = expert_kernels(layout)?;
        let (gu, down) = (&layout.gate_proj, &layout.down_proj);
        let gs = |m: &RecordMatrix| match m.precision {
            Precision::Affine { group_size, .. } => group_size as i32,
            _ => 1,
        };
        let off = |s: Option<cherenkov_model::store::Span>| s.map_or(0, |s| s.offset);
        let staged = |bits_of: &RecordMatrix, n: usize| match bits_of.precision {
            Precision::Affine { bits: 2 | 4 | 8, .. } => (n * 4) as u32,
            _ => 0,
        };
        // Experts fill the GPU together: rows per block from the rows of all entries.
        let rpb_g = rows_per_block(inter * n as usize, BLOCKS_WANTED);
        let rpb_d = rows_per_block(h * n as usize, BLOCKS_WANTED);
        g.launch(
            &gk,
            (blocks(inter, rpb_g), n, 1),
            256,
            staged(gu, h),
            &[
                Arg::Ptr(sc.table.ptr),
                Arg::I32(0),
                Arg::Ptr(sc.inp.ptr),
                Arg::Ptr(sc.act.ptr),
                Arg::I32(inter as i32),
                Arg::I32(h as i32),
                Arg::I32(gs(gu)),
                Arg::I32(rpb_g as i32),
                Arg::U64(gu.data.offset),
                Arg::U64(off(gu.scales)),
                Arg::U64(off(gu.biases)),
                Arg::U64(layout.up_proj.data.offset),
                Arg::U64(off(layout.up_proj.scales)),
                Arg::U64(off(layout.up_proj.biases)),
            ],
        )?;
        g.launch(
            &dk,
            (blocks(h, rpb_d), n, 1),
            256,
            staged(down, inter),
            &[
                Arg::Ptr(sc.table.ptr),
                Arg::I32(0),
                Arg::Ptr(sc.act.ptr),
                Arg::Ptr(sc.eout.ptr),
                Arg::I32(inter as i32),
                Arg::I32(h as i32),
                Arg::I32(gs(down)),
                Arg::I32(rpb_d as i32),
                Arg::U64(down.data.offset),
                Arg::U64(off(down.scales)),
                Arg::U64(off(down.biases)),
            ],
        )?;
        g.launch(
            "moe_combine",
            (blocks(h, 256), 1, 1),
            256,
            0,
            &[
                Arg::Ptr(sc.eout.ptr),
                Arg::Ptr(sc.rank_entry.ptr),
                Arg::Ptr(sc.weights.ptr),
                Arg::I32(k as i32),
                Arg::Ptr(shared.ptr),
                Arg::Ptr(sgate.ptr),
                Arg::Ptr(sc.out.ptr),
                Arg::I32(h as i32),
            ],
        )?;
        // The slots must not be reloaded before the kernels that read them finish.
        g.sync()?;
        drop(lease);
        let experts_ns = te.elapsed().as_nanos() as u64;
        self.pool.record_compute(m.expert_slot, experts_ns);
        self.add_timing(|t| {
            t.wait_ns += wait_ns;
            t.experts_ns += experts_ns;
        });
        Ok(())
    }
}

impl CudaModel {
    /// Scores the last prediction for `slot` against `actual`, then predicts the next layer's experts
    /// (its router on this layer's MoE input) and prefetches them behind the step's misses.
    fn look_ahead(
        &self,
        sc: &Scratch,
        slot: usize,
        actual: &[usize],
        next: Option<&crate::weights::Moe>,
    ) -> Result<()> {
        let mut pred = self.predicted.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = pred[slot].take() {
            self.pool.record_lookahead(slot, &p, actual);
        }
        let Some(n) = next else { return Ok(()) };
        let c = self.config();
        let e = c.num_experts;
        let buf = &sc.big[5];
        n.gate.matvec(&self.gpu, sc.inp.ptr, buf.ptr)?;
        let mut l = vec![0f32; e];
        self.gpu.dtoh(buf.ptr, &mut l)?;
        let bias = self.skew.as_ref().map(|sk| sk.bias(n.expert_slot, e));
        let guess: Vec<usize> =
            top_k(&l, bias.as_deref(), c.num_experts_per_tok, false).into_iter().map(|x| x.0).collect();
        self.pool.prefetch(n.expert_slot, &guess);
        pred[n.expert_slot] = Some(guess);
        Ok(())
    }
}

/// The expert kernels for a layer's record layout (gate and up must share a format).
pub fn expert_kernels(l: &ExpertLayout) -> Result<(String, String)> {
    let bits = |m: &RecordMatrix, what: &str| match m.precision {
        Precision::Affine { bits, .. } => Ok(bits),
        Precision::Float { dtype } => {
            bail!("{}: {what} experts in {dtype} are not supported on CUDA (affine-quantized experts only)", l.layer)
        }
    };
    let (gb, ub, db) =
        (bits(&l.gate_proj, "gate_proj")?, bits(&l.up_proj, "up_proj")?, bits(&l.down_proj, "down_proj")?);
    if l.gate_proj.precision != l.up_proj.precision {
        bail!(
            "{}: gate_proj and up_proj experts differ in precision ({gb} vs {ub} bits); not supported on CUDA",
            l.layer
        );
    }
    Ok((format!("expert_gate_up_q{gb}"), format!("expert_down_q{db}")))
}

impl Backend for CudaModel {
    type Session = CudaSession;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn new_session(&self) -> CudaSession {
        CudaModel::new_session(self).unwrap_or_else(|e| panic!("cannot create a CUDA session: {e:#}"))
    }

    fn session_len(&self, s: &CudaSession) -> usize {
        s.pos
    }

    fn session_bytes(&self, s: &CudaSession) -> Option<usize> {
        Some(s.bytes())
    }

    fn forward(&self, s: &mut CudaSession, tokens: &[u32], which: Logits) -> Result<Vec<f32>> {
        self.forward_tokens(s, tokens, which)
    }

    fn vocab_size(&self) -> usize {
        self.config().vocab_size
    }

    fn pool_stats(&self) -> PoolStats {
        self.pool.stats()
    }

    fn forward_top(&self, s: &mut CudaSession, tokens: &[u32], k: usize, among: usize) -> Result<Vec<(u32, f32)>> {
        self.forward_candidates(s, tokens, k, among)
    }

    fn forward_stats(&self) -> Option<ForwardStats> {
        cherenkov_engine::stats::ENABLED.then(|| self.pool.forward_stats())
    }

    fn expert_stats(&self, layer: usize) -> Option<Vec<ExpertStats>> {
        self.pool.expert_stats(layer)
    }
}
