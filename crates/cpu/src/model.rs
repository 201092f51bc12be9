//! The `qwen4_exp` forward on the CPU, layer by layer over the rows of a step.
//!
//! x = embed(tokens) tiled into hc streams; per layer: PLE (if any) adds to x; the attention-side
//! hyper-connection reads x, the mixer (Gated DeltaNet or QSA attention) runs, its output is
//! injected; the MLP-side hyper-connection reads x, the MoE runs, its output is injected. The final
//! mixer collapses the streams and `lm_head` gives the logits.

use std::sync::Arc;

use anyhow::{Context, Result, bail};
use cherenkov_engine::backend::{Backend, Logits};
use cherenkov_engine::residency::{ExpertPool, HostSlots};
use cherenkov_engine::routing::SkewedRouting;
use cherenkov_engine::stats::{ExpertStats, ForwardStats, PoolStats};
use cherenkov_model::config::TextConfig;
use cherenkov_model::ngram::{NgramHash, advance_context};
use cherenkov_model::store::Store;

use crate::ops::Rope;
use crate::state::{AttentionState, CpuSession, MixerState, MtpState, RowStates, Verify};
use crate::weights::{HyperConnection, Mixer, Weights};
use crate::{attention, gdn, hyper, moe, mtp, ple};

pub struct CpuModel {
    pub store: Arc<Store>,
    pub weights: Weights,
    pub pool: Arc<ExpertPool<HostSlots>>,
    /// Synthetic-benchmark routing (None: the model's router decides).
    pub skew: Option<Arc<SkewedRouting>>,
    /// Lookahead: during a decode step's MoE, apply the next layer's router to this layer's input
    /// and prefetch the experts it picks (behind the step's own misses).
    pub lookahead: bool,
    /// The lookahead's last prediction per MoE slot (to score it when that layer routes).
    predicted: std::sync::Mutex<Vec<Option<Vec<usize>>>>,
    rope: Rope,
    /// Per decoder layer, the n-gram hash of its PLE block.
    ngram: Vec<Option<NgramHash>>,
}

impl CpuModel {
    pub fn new(store: Arc<Store>, pool: Arc<ExpertPool<HostSlots>>) -> Result<CpuModel> {
        let weights = Weights::load(&store).with_context(|| format!("loading weights from {}", store.dir.display()))?;
        let c = store.config().clone();
        let ngram = (0..c.num_hidden_layers)
            .map(|i| -> Result<Option<NgramHash>> {
                let Some(k) = c.ple_index(i) else { return Ok(None) };
                let hash = NgramHash::new(&c, k);
                let table = store.ngram_table(i).with_context(|| format!("store has no n-gram table for layer {i}"))?;
                if table.rows != hash.table_rows {
                    bail!("layer {i}: n-gram table has {} rows, the config implies {}", table.rows, hash.table_rows);
                }
                Ok(Some(hash))
            })
            .collect::<Result<_>>()?;
        let predicted = std::sync::Mutex::new(vec![None; store.manifest.experts.layers.len()]);
        Ok(CpuModel {
            rope: Rope::new(c.rope_theta, c.rotary_dim()),
            store,
            weights,
            pool,
            skew: None,
            lookahead: true,
            predicted,
            ngram,
        })
    }

    pub fn config(&self) -> &TextConfig {
        self.store.config()
    }

    pub fn new_session(&self) -> CpuSession {
        CpuSession::new(self.config())
    }

    /// Runs `tokens` through the model after the session's history; returns logits
    /// (`[vocab]` for [`Logits::Last`], `[tokens, vocab]` for [`Logits::All`]).
    pub fn forward(&self, s: &mut CpuSession, tokens: &[u32], which: Logits) -> Result<Vec<f32>> {
        if s.verify.is_some() {
            bail!("the session's verifying forward is not committed yet (commit it before the next forward)");
        }
        let clock = cherenkov_engine::stats::ENABLED.then(std::time::Instant::now);
        let (x, _) = self.trunk(s, tokens, false)?;
        if s.mtp.is_some() {
            self.mtp_catch_up(s, &x, tokens)?;
        }
        let width = self.config().hc_hidden();
        let rows: &[f32] = match which {
            Logits::All => &x,
            Logits::Last => &x[(tokens.len() - 1) * width..],
        };
        let logits = self.logits(&self.weights.hyper_connection_mixer, rows);
        if let Some(c) = clock {
            self.pool.record_forward(tokens.len() as u64, c.elapsed().as_nanos() as u64);
        }
        Ok(logits)
    }

    /// Like [`CpuModel::forward`] with every row's logits, keeping each row's recurrent state so
    /// that [`CpuModel::commit`] can keep only the first rows (the drafted tokens it accepts).
    pub fn verify(&self, s: &mut CpuSession, tokens: &[u32]) -> Result<Vec<f32>> {
        if s.verify.is_some() {
            bail!("the session's verifying forward is not committed yet (commit it before the next forward)");
        }
        let clock = cherenkov_engine::stats::ENABLED.then(std::time::Instant::now);
        let (pos0, ngram_context0) = (s.pos, s.ngram_context.clone());
        let (x, rows) = self.trunk(s, tokens, true)?;
        let (mixer_rows, ple_rows) = rows.expect("recorded");
        let logits = self.logits(&self.weights.hyper_connection_mixer, &x);
        s.verify = Some(Verify { pos0, ngram_context0, tokens: tokens.to_vec(), mixer_rows, ple_rows, hidden: x });
        if let Some(c) = clock {
            self.pool.record_forward(tokens.len() as u64, c.elapsed().as_nanos() as u64);
        }
        Ok(logits)
    }

    /// Keeps the first `keep` rows of the last [`CpuModel::verify`].
    pub fn commit(&self, s: &mut CpuSession, keep: usize) -> Result<()> {
        let Some(v) = s.verify.take() else { bail!("there is no verifying forward to commit") };
        let n = v.tokens.len();
        if keep == 0 || keep > n {
            s.verify = Some(v);
            bail!("commit keeps 1 to {n} rows of the verifying forward, not {keep}");
        }
        let c = self.config();
        for ((ls, mixer), ple) in s.layers.iter_mut().zip(v.mixer_rows).zip(v.ple_rows) {
            match (&mut ls.mixer, mixer) {
                (MixerState::Gdn(st), RowStates::Gdn(mut rows)) => *st = rows.swap_remove(keep - 1),
                (MixerState::Attention(st), RowStates::Attention) => st.truncate(c, v.pos0 + keep),
                _ => unreachable!("recorded by this session's forward"),
            }
            if let (Some(conv), Some(mut rows)) = (ls.ple_conv.as_mut(), ple) {
                *conv = rows.swap_remove(keep - 1);
            }
        }
        s.pos = v.pos0 + keep;
        s.ngram_context = v.ngram_context0;
        advance_context(c.ngram_size, &mut s.ngram_context, &v.tokens[..keep]);
        if s.mtp.is_some() {
            self.mtp_catch_up(s, &v.hidden[..keep * c.hc_hidden()], &v.tokens[..keep])?;
        }
        Ok(())
    }

    /// Turns drafting on for a fresh session.
    pub fn enable_drafting(&self, s: &mut CpuSession) -> Result<()> {
        let Some(mtp) = &self.weights.mtp else {
            bail!("the model in {} has no MTP head, so it cannot draft tokens", self.store.dir.display());
        };
        if s.pos != 0 {
            bail!("drafting must start with the sequence (this session already holds {} tokens)", s.pos);
        }
        s.mtp = Some(MtpState {
            layers: vec![AttentionState::empty(); mtp.layers.len()],
            pos: 0,
            pending: Vec::new(),
            pending_tokens: Vec::new(),
        });
        Ok(())
    }

    /// The MTP head's logits for the token after `next` (which follows the session's history).
    pub fn draft(&self, s: &mut CpuSession, next: u32) -> Result<Vec<f32>> {
        let c = self.config();
        if next as usize >= c.vocab_size {
            bail!("token id {next} is outside the vocabulary (vocab_size {})", c.vocab_size);
        }
        if s.verify.is_some() {
            bail!("the session's verifying forward is not committed yet (commit it before drafting)");
        }
        let (Some(w), Some(m)) = (&self.weights.mtp, s.mtp.as_mut()) else {
            bail!("drafting is off for this session");
        };
        if m.pending_tokens.len() != 1 {
            bail!("nothing to draft from: no forward has run in this session yet");
        }
        let x = mtp::forward(
            &self.store,
            c,
            &self.rope,
            w,
            0,
            self.weights.embed_tokens,
            &self.pool,
            &mut m.layers[0],
            &m.pending,
            &[next],
            m.pos,
        )?;
        m.pos += 1;
        m.pending.clear();
        m.pending_tokens.clear();
        Ok(self.logits(&w.hyper_connection_mixer, &x))
    }

    /// Gives the MTP head the trunk rows `x` of `tokens`: every waiting row whose following token
    /// is now known runs through the head; the last row waits for its following token.
    fn mtp_catch_up(&self, s: &mut CpuSession, x: &[f32], tokens: &[u32]) -> Result<()> {
        let c = self.config();
        let width = c.hc_hidden();
        let (Some(w), Some(m)) = (&self.weights.mtp, s.mtp.as_mut()) else { return Ok(()) };
        m.pending.extend_from_slice(x);
        m.pending_tokens.extend_from_slice(tokens);
        let n = m.pending_tokens.len();
        if n < 2 {
            return Ok(());
        }
        let MtpState { layers, pos, pending, pending_tokens } = m;
        mtp::forward(
            &self.store,
            c,
            &self.rope,
            w,
            0,
            self.weights.embed_tokens,
            &self.pool,
            &mut layers[0],
            &pending[..(n - 1) * width],
            &pending_tokens[1..],
            *pos,
        )
        .context("MTP head")?;
        *pos += n - 1;
        pending.drain(..(n - 1) * width);
        pending_tokens.drain(..n - 1);
        Ok(())
    }

    /// `rows` (`[t, hc * H]`) through a final mixer and `lm_head`: `[t, vocab]`.
    fn logits(&self, mixer: &HyperConnection, rows: &[f32]) -> Vec<f32> {
        let store = &*self.store;
        let width = self.config().hc_hidden();
        let (mixed, _) = hyper::read(store, self.config(), mixer, rows);
        let lm = self.weights.lm_head.lin(store);
        let mut logits = vec![0f32; (rows.len() / width) * lm.rows()];
        lm.forward(&mixed, &mut logits);
        logits
    }

    /// Runs the decoder layers over `tokens` after the session's history; returns the residual
    /// rows before the final mixer (`[t, hc * H]`). With `record`, also each layer's state after
    /// each row (the mixers', then the PLE histories').
    #[allow(clippy::type_complexity)]
    fn trunk(
        &self,
        s: &mut CpuSession,
        tokens: &[u32],
        record: bool,
    ) -> Result<(Vec<f32>, Option<(Vec<RowStates>, Vec<Option<Vec<Vec<f32>>>>)>)> {
        let c = self.config();
        let store = &*self.store;
        if tokens.is_empty() {
            bail!("forward needs at least one token");
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            bail!("token id {bad} is outside the vocabulary (vocab_size {})", c.vocab_size);
        }
        let (h, width) = (c.hidden_size, c.hc_hidden());
        let t = tokens.len();
        let embed = self.weights.embed_tokens.lin(store);
        let mut x = vec![0f32; t * width];
        let mut e = vec![0f32; h];
        for (r, &tok) in tokens.iter().enumerate() {
            embed.row(tok as usize, &mut e);
            for st in 0..c.hc_count {
                x[r * width + st * h..r * width + (st + 1) * h].copy_from_slice(&e);
            }
        }

        let mut mixer_rows = Vec::new();
        let mut ple_rows = Vec::new();
        for (i, (layer, ls)) in self.weights.layers.iter().zip(s.layers.iter_mut()).enumerate() {
            let mut ple_r = (record && layer.ple.is_some()).then(Vec::new);
            if let (Some(p), Some(hash)) = (&layer.ple, &self.ngram[i]) {
                let table = store.ngram_table(i).expect("checked at load");
                let emb = ple::gather_embeddings(store, c, hash, table, tokens, &s.ngram_context)?;
                let conv = ls.ple_conv.as_mut().expect("PLE state");
                ple::forward(store, c, p, &emb, &mut x, conv, ple_r.as_mut());
            }
            let (inp, inj) = hyper::read(store, c, &layer.attn_hc, &x);
            let out = match (&layer.mixer, &mut ls.mixer) {
                (Mixer::Gdn(w), MixerState::Gdn(st)) => {
                    let mut rows = record.then(Vec::new);
                    let out = gdn::forward(store, c, w, st, &inp, rows.as_mut());
                    if let Some(rows) = rows {
                        mixer_rows.push(RowStates::Gdn(rows));
                    }
                    out
                }
                (Mixer::Attention(w), MixerState::Attention(st)) => {
                    if record {
                        mixer_rows.push(RowStates::Attention);
                    }
                    attention::forward(store, c, &self.rope, w, st, &inp, s.pos)
                }
                _ => unreachable!("session built for this model"),
            };
            if record {
                ple_rows.push(ple_r);
            }
            hyper::inject(c, &mut x, &inj.expect("attention hyper-connection injects"), &out);
            let (inp, inj) = hyper::read(store, c, &layer.mlp_hc, &x);
            let skew = self.skew.as_deref();
            let slot = layer.moe.expert_slot;
            let next = self.weights.layers.get(i + 1).map(|l| &l.moe).filter(|_| self.lookahead && t == 1);
            let mut look = |actual: &[usize]| {
                let mut pred = self.predicted.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(p) = pred[slot].take() {
                    self.pool.record_lookahead(slot, &p, actual);
                }
                if let Some(n) = next {
                    let guess = moe::predict(store, c, n, &inp, skew);
                    self.pool.prefetch(n.expert_slot, &guess);
                    pred[n.expert_slot] = Some(guess);
                }
            };
            let out = moe::forward(store, c, &layer.moe, &self.pool, &inp, skew, Some(&mut look))
                .with_context(|| format!("layer {i} experts"))?;
            hyper::inject(c, &mut x, &inj.expect("MLP hyper-connection injects"), &out);
        }

        advance_context(c.ngram_size, &mut s.ngram_context, tokens);
        s.pos += t;
        Ok((x, record.then_some((mixer_rows, ple_rows))))
    }
}

impl Backend for CpuModel {
    type Session = CpuSession;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn new_session(&self) -> Result<CpuSession> {
        Ok(CpuSession::new(self.config()))
    }

    fn snapshot_session(&self, s: &CpuSession) -> Result<CpuSession> {
        Ok(s.clone())
    }

    fn session_len(&self, s: &CpuSession) -> usize {
        s.pos
    }

    fn session_bytes(&self, s: &CpuSession) -> Option<usize> {
        Some(s.bytes())
    }

    fn forward(&self, s: &mut CpuSession, tokens: &[u32], which: Logits) -> Result<Vec<f32>> {
        CpuModel::forward(self, s, tokens, which)
    }

    fn enable_drafting(&self, s: &mut CpuSession) -> Result<()> {
        CpuModel::enable_drafting(self, s)
    }

    fn drafting(&self, s: &CpuSession) -> bool {
        s.mtp.is_some()
    }

    fn draft(&self, s: &mut CpuSession, next: u32) -> Result<Vec<f32>> {
        CpuModel::draft(self, s, next)
    }

    fn verify(&self, s: &mut CpuSession, tokens: &[u32]) -> Result<Vec<f32>> {
        CpuModel::verify(self, s, tokens)
    }

    fn commit(&self, s: &mut CpuSession, keep: usize) -> Result<()> {
        CpuModel::commit(self, s, keep)
    }

    fn vocab_size(&self) -> usize {
        self.config().vocab_size
    }

    fn pool_stats(&self) -> PoolStats {
        self.pool.stats()
    }

    fn forward_stats(&self) -> Option<ForwardStats> {
        cherenkov_engine::stats::ENABLED.then(|| self.pool.forward_stats())
    }

    fn expert_stats(&self, layer: usize) -> Option<Vec<ExpertStats>> {
        self.pool.expert_stats(layer)
    }
}
