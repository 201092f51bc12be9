//! Drafting on the device: the MTP head's forward, and the verifying forward whose rows `commit`
//! keeps or rolls back. The CPU backend's `CpuModel::{enable_drafting, draft, verify, commit}` is
//! the reference for each (`gpu-check` compares them row by row).
//!
//! The head runs one position behind the trunk, as on the CPU: after each trunk step its residual
//! row (the scratch's `x`, before the final mixer) waits in the session's `pending` row until the
//! following token is known; then the head runs on the pair and appends to its own KV cache.
//!
//! The verifying forward keeps, after every row but the last, the recurrent states (each GDN
//! layer's conv and recurrent state, each PLE layer's history) in a record, so that a commit of
//! fewer rows restores them. Attention needs no record: its caches are cut by moving the position
//! back. Two rows with every expert resident run as one pass over both, replayed from a graph
//! (rows.rs, `verify_rows`); otherwise the rows run as ordinary steps, one after another, each
//! followed by the record's copy.

use anyhow::{Context, Result, bail};
use cherenkov_model::ngram::advance_context;

use super::{CudaModel, MoeStep, Scratch, Want, candidate_counts, candidates_from};
use crate::gpu::{Arg, DevBuf, blocks};
use crate::session::{CudaSession, MtpSession, VerifyRecord};
use crate::weights::MatvecOutput;

/// Refuses a plain forward while a verifying forward waits for its commit.
pub(super) fn uncommitted(s: &CudaSession) -> Result<()> {
    if s.verify.is_some() {
        bail!("the session's verifying forward is not committed yet (commit it before the next forward)");
    }
    Ok(())
}

impl CudaModel {
    /// Turns drafting on for a fresh session.
    pub fn enable_drafting(&self, s: &mut CudaSession) -> Result<()> {
        let Some(mtp) = &self.weights.mtp else {
            bail!("the model in {} has no MTP head, so it cannot draft tokens", self.store.dir.display());
        };
        if s.pos != 0 {
            bail!("drafting must start with the sequence (this session already holds {} tokens)", s.pos);
        }
        // A model run at a part of its depth (`depth`, the benchmark's half-depth cases) drafts
        // from its last layer's output: the head's input is then not the trained one, which only
        // a benchmark at a declared acceptance may want. The record of the recurrent states still
        // covers every layer, so a dropped draft restores as many bytes as at the full depth.
        let c = self.config();
        s.enable_mtp(c, mtp.layers.len())
    }

    pub fn drafting(&self, s: &CudaSession) -> bool {
        s.mtp.is_some()
    }

    /// The MTP head's logits for the token after `next` (which follows the session's history).
    pub fn draft(&self, s: &mut CudaSession, next: u32) -> Result<Vec<f32>> {
        self.draft_with(s, next, Want::Logits)
    }

    /// [`CudaModel::draft`]'s `k` largest logits among ids below `among`, chosen on the device as
    /// [`CudaModel::forward_candidates`] chooses them.
    pub fn draft_candidates(&self, s: &mut CudaSession, next: u32, k: usize, among: usize) -> Result<Vec<(u32, f32)>> {
        let (k, among) = candidate_counts(self.config(), k, among);
        Ok(candidates_from(&self.draft_with(s, next, Want::Top { k, among })?, k, among))
    }

    fn draft_with(&self, s: &mut CudaSession, next: u32, want: Want) -> Result<Vec<f32>> {
        let c = self.config();
        if next as usize >= c.vocab_size {
            bail!("token id {next} is outside the vocabulary (vocab_size {})", c.vocab_size);
        }
        if s.verify.is_some() {
            bail!("the session's verifying forward is not committed yet (commit it before drafting)");
        }
        let Some(m) = s.mtp.as_ref() else { bail!("drafting is off for this session") };
        if !m.has_pending {
            bail!("nothing to draft from: no forward has run in this session yet");
        }
        let tokens = m.pos + 1;
        s.reserve(c, tokens)?;
        let m = s.mtp.as_mut().expect("checked above");
        let mut sc = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        self.gpu.bind()?;
        let row = m.pending.ptr;
        let out = self.mtp_step(&mut sc, m, row, next, want)?;
        m.has_pending = false;
        Ok(out)
    }

    /// Like a forward with every row's logits, keeping each row's recurrent states so that
    /// [`CudaModel::commit`] can keep only the first rows (the drafted tokens it accepts).
    pub fn verify(&self, s: &mut CudaSession, tokens: &[u32]) -> Result<Vec<f32>> {
        self.verify_with(s, tokens, Want::Logits)
    }

    /// [`CudaModel::verify`] with each row's `k` largest logits among ids below `among`, chosen on
    /// the device.
    pub fn verify_candidates(
        &self,
        s: &mut CudaSession,
        tokens: &[u32],
        k: usize,
        among: usize,
    ) -> Result<Vec<Vec<(u32, f32)>>> {
        let (k, among) = candidate_counts(self.config(), k, among);
        let out = self.verify_with(s, tokens, Want::Top { k, among })?;
        Ok(out.chunks(2 * k).map(|row| candidates_from(row, k, among)).collect())
    }

    fn verify_with(&self, s: &mut CudaSession, tokens: &[u32], want: Want) -> Result<Vec<f32>> {
        uncommitted(s)?;
        let (pos0, ngram_context0) = (s.pos, s.ngram_context.clone());
        let row = self.config().hc_hidden() * 4;
        let state = s.state_bytes();
        let rows = tokens.len();
        // The last verify's buffers where they are large enough (a record is tens of MB).
        let (hidden, states) = match s.verify_bufs.take() {
            Some((h, st)) if h.bytes >= rows * row && st.bytes >= rows.saturating_sub(1) * state => (h, st),
            _ => (
                self.gpu.alloc(rows * row, "a verifying forward's rows")?,
                self.gpu.alloc((rows.saturating_sub(1) * state).max(1), "a verifying forward's recurrent states")?,
            ),
        };
        let (h, st) = (hidden.ptr, states.ptr);
        let logits = match self.verify_as_rows(s, tokens, want, h, st) {
            Ok(Some(l)) => Ok(l),
            Ok(None) => self.run_steps(s, tokens, |_| want, &mut |_, s, sc, i| {
                self.gpu.dtod(h + (i * row) as u64, sc.x.ptr, row)?;
                if i + 1 < rows {
                    s.copy_states(st + (i * state) as u64, true)?;
                }
                Ok(())
            }),
            Err(e) => Err(e),
        };
        let logits = match logits {
            Ok(l) => l,
            Err(e) => {
                s.verify_bufs = Some((hidden, states));
                return Err(e);
            }
        };
        self.gpu.sync()?;
        s.verify = Some(VerifyRecord { pos0, ngram_context0, tokens: tokens.to_vec(), hidden, states });
        Ok(logits)
    }

    /// A verifying forward of two rows as one pass ([`CudaModel::verify_rows`]) where it can run
    /// as one; None where its rows run as steps.
    fn verify_as_rows(
        &self,
        s: &mut CudaSession,
        tokens: &[u32],
        want: Want,
        hidden: u64,
        states: u64,
    ) -> Result<Option<Vec<f32>>> {
        let &[t0, t1] = tokens else { return Ok(None) };
        let c = self.config();
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            bail!("token id {bad} is outside the vocabulary (vocab_size {})", c.vocab_size);
        }
        s.reserve(c, s.pos + tokens.len() + 1)?;
        let mut sc = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        self.gpu.bind()?;
        self.decide_residency(&mut sc)?;
        if !self.runs_rows(s, &sc, tokens.len()) {
            return Ok(None);
        }
        // The model's scratch stays locked through the pass (which has its own scratch): that lock
        // keeps every session's device work off the stream while another's is queued or captured.
        let out = self.verify_rows(s, [t0, t1], want, hidden, states).map(Some);
        drop(sc);
        out
    }

    /// Keeps the first `keep` rows of the last [`CudaModel::verify`].
    pub fn commit(&self, s: &mut CudaSession, keep: usize) -> Result<()> {
        let Some(v) = s.verify.take() else { bail!("there is no verifying forward to commit") };
        let n = v.tokens.len();
        if keep == 0 || keep > n {
            s.verify = Some(v);
            bail!("commit keeps 1 to {n} rows of the verifying forward, not {keep}");
        }
        let c = self.config();
        let row = c.hc_hidden() * 4;
        self.gpu.bind()?;
        if keep < n {
            s.copy_states(v.states.ptr + ((keep - 1) * s.state_bytes()) as u64, false)?;
        }
        s.pos = v.pos0 + keep;
        s.ngram_context = v.ngram_context0.clone();
        advance_context(c.ngram_size, &mut s.ngram_context, &v.tokens[..keep]);
        if let Some(m) = s.mtp.as_mut() {
            let mut sc = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
            for (j, &tok) in v.tokens[..keep].iter().enumerate() {
                if m.has_pending {
                    let pending = m.pending.ptr;
                    self.mtp_step(&mut sc, m, pending, tok, Want::Nothing).context("MTP head")?;
                }
                self.gpu.dtod(m.pending.ptr, v.hidden.ptr + (j * row) as u64, row)?;
                m.has_pending = true;
            }
        }
        self.gpu.sync()?;
        s.verify_bufs = Some((v.hidden, v.states));
        Ok(())
    }

    /// After a plain step of `tok`: the head runs on the pending row and `tok`, and the step's
    /// residual row becomes the pending one (nothing where drafting is off).
    pub(super) fn mtp_catch_up(&self, s: &mut CudaSession, sc: &mut Scratch, tok: u32) -> Result<()> {
        let row = self.config().hc_hidden() * 4;
        let Some(m) = s.mtp.as_mut() else { return Ok(()) };
        if !m.has_pending {
            self.gpu.dtod(m.pending.ptr, sc.x.ptr, row)?;
            m.has_pending = true;
            return Ok(());
        }
        // The head overwrites the scratch's residual: the step's row goes aside first.
        self.gpu.dtod(m.spare.ptr, sc.x.ptr, row)?;
        let pending = m.pending.ptr;
        self.mtp_step(sc, m, pending, tok, Want::Nothing).context("MTP head")?;
        std::mem::swap(&mut m.pending, &mut m.spare);
        Ok(())
    }

    /// One position of the MTP head's layer 0 (the one the CPU runs): trunk residual row `row`
    /// (`[hc * H]` on the device) with the token that follows it, at the head's position. Appends
    /// to the head's caches; returns what `want` asks, as a trunk step does. With every expert
    /// resident and attention below the QSA budget, the step is replayed from a graph.
    fn mtp_step(&self, sc: &mut Scratch, m: &mut MtpSession, row: u64, tok: u32, want: Want) -> Result<Vec<f32>> {
        let c = self.config();
        let g = &*self.gpu;
        let w = self.weights.mtp.as_ref().context("the model has no MTP head")?;
        let layer = w.layers.first().context("the MTP head has no layers")?;
        self.decide_residency(sc)?;
        let mut st = MoeStep::new();
        // The head's blocks stay out of the trunk's step timing.
        st.untimed = true;
        self.set_step_inputs(sc, tok, m.pos)?;
        // The benchmark's synthetic routers skew the head's router as the trunk's.
        self.write_bias(sc, layer.moe.expert_slot, 0)?;
        let dense_attention = c.qsa.as_ref().is_none_or(|q| (m.pos + 1) / q.compress_ratio <= q.block_topk());
        if self.graphs && sc.moe.map.is_some() && dense_attention {
            let a = &m.layers[0];
            let key = MtpGraphKey { cache: a.k.ptr, cap: a.cap, row, want };
            let mut graphs = self.mtp_graphs.lock().unwrap_or_else(|e| e.into_inner());
            let graph = super::cached_graph(&mut graphs, key, || {
                let mut throwaway = MoeStep::new();
                throwaway.untimed = true;
                self.gpu.capture(|| self.queue_mtp(sc, m, row, want, &mut throwaway))
            })?;
            g.replay(graph)?;
            st.routed.push(layer.moe.expert_slot);
            // The QSA block count the captured kernels advance on the device.
            if let Some(q) = &c.qsa {
                m.layers[0].blocks = (m.pos + 1) / q.compress_ratio;
            }
        } else {
            self.queue_mtp(sc, m, row, want, &mut st)?;
        }
        let mut out = Vec::new();
        match want {
            Want::Nothing => {}
            Want::Logits => {
                out = vec![0f32; c.vocab_size];
                g.dtoh(sc.logits.ptr, &mut out)?;
            }
            Want::Top { k, .. } => {
                let top = self.read_candidates(sc, k)?;
                out.extend(top.iter().map(|&(i, _)| f32::from_bits(i)));
                out.extend(top.iter().map(|&(_, v)| v));
            }
        }
        self.finish_step(sc, st)?;
        m.pos += 1;
        Ok(out)
    }

    /// Queues [`CudaModel::mtp_step`]'s device work (its host inputs already written).
    fn queue_mtp<'p>(
        &'p self,
        sc: &mut Scratch,
        m: &mut MtpSession,
        row: u64,
        want: Want,
        st: &mut MoeStep<'p>,
    ) -> Result<()> {
        let c = self.config();
        let g = &*self.gpu;
        let w = self.weights.mtp.as_ref().context("the model has no MTP head")?;
        let layer = w.layers.first().context("the MTP head has no layers")?;
        let (h, hc, width) = (c.hidden_size, c.hc_count, c.hc_hidden());
        self.upload_step_inputs(sc)?;
        // The stem: e = fc_embedding(norm_e(embed(tok))); x_s = fc_hidden(norm_h(row)_s) + e.
        let stem: [&DevBuf; 4] = [&sc.big[0], &sc.big[1], &sc.big[2], &sc.big[3]];
        let [e, en, fe, hn] = stem.map(|b| b.ptr);
        self.weights.embed_tokens.embed(g, sc.step_in.ptr, e, 1)?;
        self.rmsnorm(e, w.pre_fc_norm_embedding.ptr, en, 1, h, h)?;
        w.fc_embedding.matvec(g, en, fe)?;
        self.rmsnorm(row, w.pre_fc_norm_hidden.ptr, hn, 1, width, width)?;
        for s in 0..hc {
            let at = (s * h * 4) as u64;
            w.fc_hidden.matvec(g, hn + at, sc.x.ptr + at)?;
        }
        g.launch(
            "add_streams",
            (blocks(width, 256), 1, 1),
            256,
            0,
            &[Arg::Ptr(sc.x.ptr), Arg::Ptr(fe), Arg::I32(hc as i32), Arg::I32(h as i32)],
        )?;
        // The layer: attention and MoE, each read and injected through its hyper-connection.
        self.hc_read(sc, &layer.attn_hc)?;
        let out = MatvecOutput::Inject { x: sc.x.ptr, inj: sc.inj.ptr, hc, scratch: sc.out.ptr };
        self.attention(sc, &layer.attention, &mut m.layers[0], m.pos, out, true)?;
        self.hc_read(sc, &layer.mlp_hc)?;
        st.inject = true;
        self.moe(sc, &layer.moe, None, st)?;
        if want != Want::Nothing {
            self.hc_read(sc, &w.hyper_connection_mixer)?;
            self.weights.lm_head.matvec(g, sc.inp.ptr, sc.logits.ptr)?;
        }
        if let Want::Top { k, among } = want {
            self.queue_candidates(sc, k, among, super::radix_candidates())?;
        }
        if sc.moe.map.is_some() {
            // The block's routing, for the host's accounting after the step.
            let bytes = sc.moe.ids.bytes.min(sc.moe.ids_host.bytes);
            g.download(&sc.moe.ids_host, 0, sc.moe.ids.ptr, bytes)?;
        }
        Ok(())
    }
}

/// What a captured MTP head step depends on: the head's KV cache (its address and size), the
/// trunk row it reads, and what it ends with (logits, candidates).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct MtpGraphKey {
    cache: u64,
    cap: usize,
    row: u64,
    want: Want,
}
