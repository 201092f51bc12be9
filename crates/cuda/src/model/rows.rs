//! A verifying forward of two rows as one pass over both, stage by stage.
//!
//! Each layer's work for the second row needs only what the first row's work on the same layer
//! left behind (the GDN layer's conv and recurrent states, the PLE layer's history, the attention
//! layer's keys and values at the first row's position) and its own previous layer. So the pass
//! runs each stage of a layer for both rows before the next stage: both rows' hyper-connection
//! reads, then both rows' mixers, then both rows' MoE blocks. A stage that keeps a state (the PLE
//! layer, a GDN mixer) runs for the first row, its state is copied into the record a commit of
//! one row restores, then it runs for the second row.
//!
//! Launches may serve both rows at once: the rows' scratch vectors lie in one allocation at one
//! distance from each other (`RowScratch::stride`), the split matvecs' scratch included, so that a
//! kernel given the first row's pointers can find the second row's. The hyper-connection reads
//! (a grid twice as deep), the GDN input projections (each block both rows), the GDN recurrence
//! and lm_head do; every other stage launches the plain step's kernels once a row, on the same
//! inputs. Each row's results are those of two steps one after another, bit for bit.
//!
//! Only where a plain step would be replayed from a graph (every expert resident, attention below
//! the QSA budget) and nothing of the step uses the side stream (the shared expert rides in the
//! routed experts' launches); elsewhere the verifying forward runs its rows as steps.

use std::sync::atomic::Ordering;

use anyhow::{Context, Result};
use cherenkov_model::config::TextConfig;
use cherenkov_model::ngram::advance_context;

use super::{CudaModel, MoeStep, Scratch, Want, cached_graph, radix_candidates, scratch_with};
use crate::gpu::Arg;
use crate::gpu::{DevBuf, Gpu, SPLIT_SCRATCH_BYTES};
use crate::session::{CudaSession, LayerStates, MixerState};
use crate::weights::{FoldedConv, GatedDeltaNet, HyperConnection, Mixer, RowsOutput, matvec_many_conv_x2};

/// Both rows' scratch in one zeroed allocation: row 1's every vector (and its split matvecs'
/// scratch) `stride` bytes past row 0's.
pub(crate) struct RowScratch {
    pub(crate) rows: [Scratch; 2],
    /// Bytes from a row's vector to the same vector of the next row.
    pub(crate) stride: usize,
    /// Each row's split matvec scratch ([`Gpu::with_split_scratch`]).
    split: [u64; 2],
    /// Holds the views' memory; dropped after them (fields drop in order).
    _arena: DevBuf,
}

impl RowScratch {
    fn new(gpu: &Gpu, c: &TextConfig, moe_layers: usize) -> Result<RowScratch> {
        const ALIGN: usize = 256;
        // The vectors' bytes, from the layout itself: a scratch made and dropped, once, at the
        // model's first pass (a few MB; its buffers are real, since making the MoE buffers writes
        // to one of them).
        let mut bytes = 0usize;
        drop(scratch_with(gpu, c, moe_layers, &mut |n, what| {
            bytes += n.next_multiple_of(ALIGN);
            gpu.zeros(n, what)
        })?);
        let stride = (bytes + SPLIT_SCRATCH_BYTES).next_multiple_of(ALIGN);
        let arena = gpu.zeros(2 * stride, "a verifying pass's two rows of scratch")?;
        let row = |r: usize| {
            let mut off = r * stride;
            scratch_with(gpu, c, moe_layers, &mut |n, _| {
                let v = arena.view(off, n)?;
                off += n.next_multiple_of(ALIGN);
                Ok(v)
            })
        };
        let mut rows = [row(0)?, row(1)?];
        // The synthetic routers' bias rows are host memory, each row's its own allocation.
        rows[0].moe.bias_next = rows[1].moe.bias_host.dev.wrapping_sub(rows[0].moe.bias_host.dev) as i64;
        let split = [arena.at(bytes), arena.at(stride + bytes)];
        Ok(RowScratch { rows, stride, split, _arena: arena })
    }
}

/// What a captured pass launched over both rows, layer by layer (the checks name it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RowsLayers {
    /// GDN layers whose recurrence ran over both rows in one launch.
    pub gdn: u16,
    /// Of those, the layers whose input projections took both rows in each block.
    pub in_proj_x2: u16,
    /// Attention layers.
    pub attention: u16,
    /// Of those, the layers whose projections took both rows in each block.
    pub qkv_x2: u16,
    /// MoE blocks.
    pub moe: u16,
    /// Of those, the blocks whose every launch served both rows.
    pub moe_x2: u16,
}

/// What a captured pass depends on: as a step's graph (the session's buffers and their
/// generation, the output, the depth), and where the rows' residuals and the record go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct RowsKey {
    session: u64,
    generation: u64,
    want: Want,
    depth: usize,
    hidden: u64,
    states: u64,
}

impl CudaModel {
    /// Whether a verifying forward of `rows` rows at the session's position runs as one pass
    /// ([`CudaModel::verify_rows`]). `sc` is the model's scratch, residency decided.
    pub(super) fn runs_rows(&self, s: &CudaSession, sc: &Scratch, rows: usize) -> bool {
        let c = self.config();
        // Both rows below the QSA budget: the second is at s.pos + 1.
        let dense = c.qsa.as_ref().is_none_or(|q| (s.pos + 2) / q.compress_ratio <= q.block_topk());
        let depth = self.depth.min(self.weights.layers.len());
        let no_side = !self.shared_beside
            || self.weights.layers[..depth].iter().all(|l| self.shared_riding(sc, &l.moe).is_some());
        rows == 2 && self.verify_rows.load(Ordering::Relaxed) && self.graphs && sc.moe.map.is_some() && dense && no_side
    }

    /// Runs `tokens` (two) as a verifying forward's rows in one pass, replayed from a graph,
    /// writing each row's residual to `hidden` (one row of `hc * H` floats each) and the states
    /// after the first row to the record at `states`; returns what `want` asks for each row, as
    /// two steps would.
    pub(super) fn verify_rows(
        &self,
        s: &mut CudaSession,
        tokens: [u32; 2],
        want: Want,
        hidden: u64,
        states: u64,
    ) -> Result<Vec<f32>> {
        let c = self.config().clone();
        let g = &*self.gpu;
        let call = std::time::Instant::now();
        let mut held = self.row_scratch.lock().unwrap_or_else(|e| e.into_inner());
        if held.is_none() {
            *held = Some(RowScratch::new(g, &c, self.store.manifest.experts.layers.len())?);
        }
        let rs = held.as_mut().expect("made above");
        for sc in &mut rs.rows {
            self.decide_residency(sc)?;
        }
        s.prepare_state_spans(states)?;
        let depth = self.depth.min(self.weights.layers.len());
        // Host inputs, row by row as the steps would write them: token and position, the PLE
        // rows from the n-gram context as it stands before the row. The benchmark's synthetic
        // routers' biases: each row's own noise, and the reuse bonus of the token before the
        // first row for both (the host learns the first row's experts only after the pass).
        let (pos, context) = (s.pos, s.ngram_context.clone());
        for (r, (sc, &tok)) in rs.rows.iter().zip(&tokens).enumerate() {
            self.set_step_inputs(sc, tok, pos + r)?;
            for (i, layer) in self.weights.layers.iter().enumerate().take(depth) {
                if let (Some(_), Some(hash)) = (&layer.ple, &self.ngram[i]) {
                    self.ple_gather(sc, hash, i, tok, &s.ngram_context)?;
                }
                self.write_bias_at(sc, layer.moe.expert_slot, 0, r as u64)?;
            }
            advance_context(c.ngram_size, &mut s.ngram_context, &[tok]);
        }
        // The kernel timeline counts the pass as one step.
        let timed = match &g.timeline {
            Some(t) => t.begin_step(|| g.sync())?,
            None => false,
        };
        let key = RowsKey { session: s.id, generation: s.generation, want, depth, hidden, states };
        let replayed = {
            let mut graphs = self.rows_graphs.lock().unwrap_or_else(|e| e.into_inner());
            cached_graph(&mut graphs, key, || self.gpu.capture(|| self.queue_rows(s, rs, want, hidden, states)))
                .context("a verifying forward's two rows (captured as one graph)")
                .and_then(|graph| g.replay(graph))
        };
        // The synthetic routers draw the noise of the next pass's rows (or the next step's) while
        // the device runs this pass, as a step draws its successor's.
        if replayed.is_ok()
            && let Some(sk) = &self.skew
        {
            for layer in self.weights.layers.iter().take(depth) {
                for ahead in 2..4 {
                    sk.prepare_noise_at(layer.moe.expert_slot, c.num_experts, false, ahead);
                }
            }
        }
        if let Err(e) = replayed {
            // Nothing ran: the session stays where it was.
            s.ngram_context = context;
            return Err(e);
        }
        s.pos += 2;
        // The QSA block counters the captured kernels advance on the device.
        for l in &mut s.layers {
            if let (MixerState::Attention(a), Some(q)) = (&mut l.mixer, &c.qsa) {
                a.blocks = s.pos / q.compress_ratio;
            }
        }
        let mut out = Vec::new();
        for sc in &rs.rows {
            self.read_output(sc, want, &mut out)?;
        }
        // Each row's routing, accounted as a replayed step's.
        for sc in &rs.rows {
            let mut st = MoeStep::new();
            st.untimed = true;
            st.routed.extend(self.weights.layers.iter().take(depth).map(|l| l.moe.expert_slot));
            self.finish_step(sc, st)?;
        }
        if timed && let Some(t) = &g.timeline {
            t.end_step(|| g.sync())?;
        }
        let ns = call.elapsed().as_nanos() as u64;
        self.add_timing(|t| {
            t.steps += 2;
            t.total_ns += ns;
        });
        self.pool.record_forward(2, ns);
        self.rows_run.fetch_add(1, Ordering::Relaxed);
        Ok(out)
    }

    /// Turns [`CudaModel::verify_rows`] on or off for later verifying forwards (the checks
    /// compare both ways).
    pub fn set_verify_rows(&self, on: bool) {
        self.verify_rows.store(on, Ordering::Relaxed);
    }

    /// What the last captured pass launched over both rows, layer by layer.
    pub fn rows_layers(&self) -> RowsLayers {
        *self.rows_layers.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Verifying forwards run as passes over their rows so far.
    pub fn rows_run(&self) -> u64 {
        self.rows_run.load(Ordering::Relaxed)
    }

    /// Queues [`CudaModel::verify_rows`]'s device work (its host inputs written).
    fn queue_rows(&self, s: &mut CudaSession, rs: &mut RowScratch, want: Want, hidden: u64, states: u64) -> Result<()> {
        let c = self.config();
        let g = &*self.gpu;
        let w = &self.weights;
        let depth = self.depth.min(w.layers.len());
        let row = c.hc_hidden() * 4;
        let pos = s.pos;
        // Row r's launches, with its own split matvec scratch.
        let on = |rs: &mut RowScratch, r: usize, f: &mut dyn FnMut(&mut Scratch) -> Result<()>| {
            let at = rs.split[r];
            g.with_split_scratch(at, || f(&mut rs.rows[r]))
        };
        // Copies between kernels cost a pass their launch dependency (an upload between the two
        // embeddings left about 10 us idle, session 54's timeline): both uploads first, and the
        // residual rows' copies and the routing's downloads after the last kernel.
        for sc in &rs.rows {
            self.upload_step_inputs(sc)?;
        }
        for r in 0..2 {
            on(rs, r, &mut |sc| w.embed_tokens.embed(g, sc.step_in.ptr, sc.x.ptr, c.hc_count))?;
        }
        let mut st = [MoeStep::new(), MoeStep::new()];
        for st in &mut st {
            st.untimed = true;
            // The combination injects the MoE output (no separate hc_inject).
            st.inject = true;
        }
        let mut done = RowsLayers::default();
        for (i, layer) in w.layers.iter().enumerate().take(depth) {
            let next = w.layers[..depth].get(i + 1).map(|l| &l.moe);
            if let Some(p) = &layer.ple {
                for r in 0..2 {
                    if r == 1 {
                        s.copy_layer_states(states, i, LayerStates::Ple, true)?;
                    }
                    let state = s.layers[i].ple_conv.as_ref().context("PLE state")?;
                    on(rs, r, &mut |sc| self.ple(sc, p, state))?;
                }
            }
            self.hc_read_rows(rs, &layer.attn_hc)?;
            let mid = s.recurrent_record_at(states, i);
            match (&layer.mixer, &s.layers[i].mixer, mid) {
                (Mixer::Gdn(gw), MixerState::Gdn { conv, recurrent }, Some(mid)) if self.gdn_rows_apply(gw) => {
                    let (conv, recurrent) = (conv.ptr, recurrent.ptr);
                    let conv_mid = s.conv_record_at(states, i);
                    let both = match conv_mid {
                        Some(cm) if self.rows_in_proj_x2 => self.gdn_in_proj_x2(rs, gw, conv, cm)?,
                        _ => false,
                    };
                    done.gdn += 1;
                    done.in_proj_x2 += u16::from(both);
                    for r in (0..2).filter(|_| !both) {
                        if r == 1 {
                            s.copy_layer_states(states, i, LayerStates::Conv, true)?;
                        }
                        on(rs, r, &mut |sc| self.gdn_in_proj(sc, gw, conv))?;
                    }
                    self.gdn_recurrence_rows(rs, gw, recurrent, mid)?;
                    for r in 0..2 {
                        on(rs, r, &mut |sc| {
                            let input = self.gdn_out_input(sc, &self.gdn_recurrence(gw));
                            gw.out_proj.matvec_to(g, input, self.mixer_out(sc))
                        })?;
                    }
                }
                (Mixer::Attention(aw), MixerState::Attention(_), _) => {
                    done.attention += 1;
                    let both = self.attention_qkv_x2(rs, aw)?;
                    done.qkv_x2 += u16::from(both);
                    for r in 0..2 {
                        let MixerState::Attention(a) = &mut s.layers[i].mixer else { unreachable!("matched") };
                        on(rs, r, &mut |sc| self.attention(sc, aw, a, pos + r, self.mixer_out(sc), !both))?;
                    }
                }
                _ => {
                    for r in 0..2 {
                        if r == 1 {
                            s.copy_layer_states(states, i, LayerStates::Mixer, true)?;
                        }
                        let ls = &mut s.layers[i];
                        on(rs, r, &mut |sc| self.queue_mixer(sc, layer, ls, pos + r))?;
                    }
                }
            }
            self.hc_read_rows(rs, &layer.mlp_hc)?;
            done.moe += 1;
            if self.rows_fused && self.rows_moe && self.moe_rows_fit(&rs.rows[0], &layer.moe) {
                // Every launch of the block serves both rows: row 0's buffers, row 1's a stride on.
                done.moe_x2 += 1;
                let (split, stride) = (rs.split[0], rs.stride as u64);
                let (sc, st) = (&mut rs.rows[0], &mut st[0]);
                st.head_queued = true;
                g.with_split_scratch(split, || {
                    g.with_rows(2, stride, || {
                        self.moe_head(sc, &layer.moe, next, false, 0)?;
                        self.moe(sc, &layer.moe, next, st)
                    })
                })?;
                continue;
            }
            for (r, st) in st.iter_mut().enumerate() {
                st.head_queued = true;
                on(rs, r, &mut |sc| {
                    self.moe_head(sc, &layer.moe, next, false, 0)?;
                    self.moe(sc, &layer.moe, next, st)
                })?;
            }
        }
        *self.rows_layers.lock().unwrap_or_else(|e| e.into_inner()) = done;
        // (The final mixer reads the residual rows and writes only its output, so their copies to
        // `hidden` wait until after the last kernel.)
        if want != Want::Nothing {
            // The final mixer, then lm_head over both rows in one launch where its weights allow.
            self.hc_read_rows(rs, &w.hyper_connection_mixer)?;
            let [a, b] = &rs.rows;
            if self.rows_fused {
                let out = RowsOutput::Store { y: a.logits.ptr, stride: rs.stride };
                w.lm_head.matvec_rows(g, a.inp.ptr, rs.stride, out, 2)?;
            } else {
                for sc in [a, b] {
                    w.lm_head.matvec(g, sc.inp.ptr, sc.logits.ptr)?;
                }
            }
        }
        if let Want::Top { k, among } = want {
            for sc in &rs.rows {
                self.queue_candidates(sc, k, among, radix_candidates())?;
            }
        }
        for (r, sc) in rs.rows.iter().enumerate() {
            g.dtod(hidden + (r * row) as u64, sc.x.ptr, row)?;
        }
        for sc in &rs.rows {
            let bytes = sc.moe.ids.bytes.min(sc.moe.ids_host.bytes);
            g.download(&sc.moe.ids_host, 0, sc.moe.ids.ptr, bytes)?;
        }
        Ok(())
    }

    /// Whether MoE block `m`'s launches can each serve both rows of a pass (`_rows` kernels): every
    /// expert resident, the shared expert riding in the routed experts' launches (nothing of the
    /// block on the side stream or in a launch of its own), the tiled expert kernels, and the
    /// router's matrices in one tiled launch.
    fn moe_rows_fit(&self, sc: &Scratch, m: &crate::weights::Moe) -> bool {
        let layout = &self.store.manifest.experts.layers[m.expert_slot];
        let router = [&m.gate, &m.shared_expert_gate, &m.shared_gate_proj, &m.shared_up_proj];
        sc.moe.map.is_some()
            && self.shared_riding(sc, m).is_some()
            && crate::weights::experts_tiled(layout, self.store.record_bytes(), self.expert_dims())
            && router.iter().all(|l| l.cols == m.gate.cols && l.tiled_shmem().is_some())
    }

    /// Whether a GDN mixer's recurrence runs as one launch over both rows
    /// ([`CudaModel::gdn_recurrence_rows`]): the split kernel's layout, in at most 512 threads.
    fn gdn_rows_apply(&self, gw: &GatedDeltaNet) -> bool {
        let r = self.gdn_recurrence(gw);
        self.rows_fused && r.split && r.threads <= 512
    }

    /// Both rows' hyper-connection read: its two fused launches serving both rows where the read
    /// runs as those ([`CudaModel::hc_read_fused`]), else the read once a row.
    fn hc_read_rows(&self, rs: &RowScratch, hcw: &HyperConnection) -> Result<()> {
        let g = &*self.gpu;
        if self.rows_fused && self.hc_read_fused(hcw) {
            return g.with_split_scratch(rs.split[0], || {
                g.with_rows(2, rs.stride as u64, || self.hc_read(&rs.rows[0], hcw))
            });
        }
        for r in 0..2 {
            g.with_split_scratch(rs.split[r], || self.hc_read(&rs.rows[r], hcw))?;
        }
        Ok(())
    }

    /// Both rows' attention projections (query and gate, key, value, the QSA index's) in one
    /// launch whose blocks serve both rows (`matvec_many_x2`), ahead of each row's `attn_prep`:
    /// the rows' inputs are both read by now, and row 1's cache entry is written by its own
    /// `attn_prep` after row 0's. Returns false, queueing nothing, where that launch does not apply
    /// or `CHERENKOV_ROWS_ATTN_APART=1` (a measurement: each row projects its own).
    fn attention_qkv_x2(&self, rs: &RowScratch, aw: &crate::weights::Attention) -> Result<bool> {
        if !(self.rows_fused && self.rows_attn_x2 && super::fused_attn_prep()) {
            return Ok(false);
        }
        let sc = &rs.rows[0];
        crate::weights::matvec_many_x2(&self.gpu, sc.inp.ptr, rs.stride, &self.attention_parts(sc, aw))
    }

    /// Both rows' GDN input projections in one launch whose blocks serve both rows
    /// (`matvec_many_x2`), the conv folded row after row with the state after row 0 written to the
    /// record at `conv_mid`. Returns false, queueing nothing, where that launch does not apply.
    fn gdn_in_proj_x2(&self, rs: &RowScratch, gw: &GatedDeltaNet, conv: u64, conv_mid: u64) -> Result<bool> {
        let c = self.config();
        let sc = &rs.rows[0];
        let [_, z, b, a, conv_out, ..] = &sc.big;
        let folded =
            FoldedConv { state: conv, w: gw.conv1d.ptr, k: c.linear_conv_kernel_dim, channels: c.gdn_conv_dim() };
        let parts =
            [(&gw.in_proj_qkv, conv_out.ptr), (&gw.in_proj_z, z.ptr), (&gw.in_proj_b, b.ptr), (&gw.in_proj_a, a.ptr)];
        matvec_many_conv_x2(&self.gpu, sc.inp.ptr, rs.stride, &parts, folded, conv_mid)
    }

    /// Both rows' GDN recurrence in one launch (`gdn_recurrent_rows`): the state after the first
    /// row goes to the record at `mid`, after the second to the session's `state`; each row's
    /// output (and the out_proj's staged image) in its own scratch.
    fn gdn_recurrence_rows(&self, rs: &RowScratch, gw: &GatedDeltaNet, state: u64, mid: u64) -> Result<()> {
        let c = self.config();
        let r = self.gdn_recurrence(gw);
        let [_, z, b, a, conv_out, core, digits] = &rs.rows[0].big;
        let mut args = self.gdn_recurrent_args(gw, conv_out.ptr, a.ptr, b.ptr, state, core.ptr, z.ptr);
        // The record after the state (the rows kernel's S_mid).
        args.insert(6, Arg::Ptr(mid));
        args.push(Arg::Ptr(if r.image { digits.ptr } else { 0 }));
        // Row 1's vectors one stride past row 0's (floats, and words of the image).
        let f = i32::try_from(rs.stride / 4).context("a verifying pass's scratch past 2^31 floats a row")?;
        args.extend([Arg::I32(2), Arg::I32(f), Arg::I32(f), Arg::I32(f), Arg::I32(f)]);
        let shared = Self::gdn_rows_shared(r.shared, c.linear_key_head_dim);
        self.gpu.launch("gdn_recurrent_rows", (c.linear_num_value_heads as u32, 1, 1), r.threads, shared, &args)
    }
}
