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
use cherenkov_model::ngram::NgramHash;
use cherenkov_model::store::Store;

use crate::ops::Rope;
use crate::state::{CpuSession, MixerState};
use crate::weights::{Mixer, Weights};
use crate::{attention, gdn, hyper, moe, ple};

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
        let c = self.config();
        let store = &*self.store;
        if tokens.is_empty() {
            bail!("forward needs at least one token");
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            bail!("token id {bad} is outside the vocabulary (vocab_size {})", c.vocab_size);
        }
        let clock = cherenkov_engine::stats::ENABLED.then(std::time::Instant::now);
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

        for (i, (layer, ls)) in self.weights.layers.iter().zip(s.layers.iter_mut()).enumerate() {
            if let (Some(p), Some(hash)) = (&layer.ple, &self.ngram[i]) {
                let table = store.ngram_table(i).expect("checked at load");
                let emb = ple::gather_embeddings(store, c, hash, table, tokens, &s.ngram_context)?;
                ple::forward(store, c, p, &emb, &mut x, ls.ple_conv.as_mut().expect("PLE state"));
            }
            let (inp, inj) = hyper::read(store, c, &layer.attn_hc, &x);
            let out = match (&layer.mixer, &mut ls.mixer) {
                (Mixer::Gdn(w), MixerState::Gdn(st)) => gdn::forward(store, c, w, st, &inp),
                (Mixer::Attention(w), MixerState::Attention(st)) => {
                    attention::forward(store, c, &self.rope, w, st, &inp, s.pos)
                }
                _ => unreachable!("session built for this model"),
            };
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

        for &tok in tokens {
            s.ngram_context.insert(0, tok);
            s.ngram_context.truncate(c.ngram_size.saturating_sub(1));
        }
        s.pos += t;

        let rows: &[f32] = match which {
            Logits::All => &x,
            Logits::Last => &x[(t - 1) * width..],
        };
        let (mixed, _) = hyper::read(store, c, &self.weights.hyper_connection_mixer, rows);
        let lm = self.weights.lm_head.lin(store);
        let mut logits = vec![0f32; (rows.len() / width) * lm.rows()];
        lm.forward(&mixed, &mut logits);
        if let Some(c) = clock {
            self.pool.record_forward(t as u64, c.elapsed().as_nanos() as u64);
        }
        Ok(logits)
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
