//! What the runtime needs from a compute backend (CPU now, CUDA next).
//!
//! A backend owns the model's weights and its expert pool; a session holds one sequence's decode
//! state. The runtime drives prefill and decode through [`Backend::forward`] and never looks inside
//! either, so the decode loop, sampling, the server and the statistics are written once.

use anyhow::Result;

use crate::stats::{ExpertStats, ForwardStats, PoolStats};

/// Which logits a forward step returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only the last row's (decode, and the end of a prefill).
    Last,
    /// Every row's (`cherenkov logits`, prompt logprobs).
    All,
}

pub trait Backend: Send + Sync {
    /// One sequence's decode state ([`Backend::snapshot_session`] copies it).
    type Session: Send;

    /// A short name for messages (`cpu`, `cuda`).
    fn name(&self) -> &'static str;

    /// A fresh session. Sessions may live in memory the backend shares with its weights and expert
    /// cache (device memory for CUDA): running out is an error, not a panic.
    fn new_session(&self) -> Result<Self::Session>;

    /// An independent copy of `s` (the server's prefix-cache snapshots and their restores); fails
    /// like [`Backend::new_session`] when its memory runs out.
    fn snapshot_session(&self, s: &Self::Session) -> Result<Self::Session>;

    /// Tokens already processed by a session (the position of its next token).
    fn session_len(&self, s: &Self::Session) -> usize;

    /// Bytes of memory a session's state holds (what a snapshot of it costs), or `None` when the
    /// backend cannot say; the server's prefix cache, which is bounded in bytes, then keeps no
    /// snapshots.
    fn session_bytes(&self, _s: &Self::Session) -> Option<usize> {
        None
    }

    /// Runs `tokens` after the session's history and returns logits: `[vocab]` for
    /// [`Logits::Last`], `[tokens, vocab]` for [`Logits::All`].
    fn forward(&self, s: &mut Self::Session, tokens: &[u32], which: Logits) -> Result<Vec<f32>>;

    /// Speculative decoding with the checkpoint's MTP head: turns drafting on for a fresh session
    /// (the head keeps its own cache from the first position on). Fails where the backend or the
    /// model cannot draft.
    fn enable_drafting(&self, _s: &mut Self::Session) -> Result<()> {
        anyhow::bail!("the {} backend cannot run the MTP head (speculative decoding) yet", self.name())
    }

    /// Whether drafting is on for `s` (a snapshot of a drafting session drafts too).
    fn drafting(&self, _s: &Self::Session) -> bool {
        false
    }

    /// The MTP head's logits (`[vocab]`) for the token after `next`, where `next` is the token
    /// that follows the session's history (sampled, not yet forwarded). Needs drafting on.
    fn draft(&self, _s: &mut Self::Session, _next: u32) -> Result<Vec<f32>> {
        anyhow::bail!("the {} backend cannot run the MTP head (speculative decoding) yet", self.name())
    }

    /// Runs `tokens` after the session's history like [`Backend::forward`] with every row's
    /// logits (`[tokens, vocab]`), keeping what [`Backend::commit`] needs to keep only the first
    /// rows. Until that commit, the session takes no other forward.
    fn verify(&self, _s: &mut Self::Session, _tokens: &[u32]) -> Result<Vec<f32>> {
        anyhow::bail!("the {} backend cannot verify drafted tokens yet", self.name())
    }

    /// Keeps the first `keep` tokens (at least one) of the last [`Backend::verify`]: the session
    /// is then as if only they had been forwarded.
    fn commit(&self, _s: &mut Self::Session, _keep: usize) -> Result<()> {
        anyhow::bail!("the {} backend cannot verify drafted tokens yet", self.name())
    }

    fn vocab_size(&self) -> usize;

    /// The expert pool's counters.
    fn pool_stats(&self) -> PoolStats;

    /// Runs `tokens` like [`Backend::forward`] and returns only the `k` largest logits of the last
    /// one among ids below `among` (the tokenizer's vocabulary; rows past it pad the embedding), as
    /// (id, logit) in descending order (ties to the lower id): all a greedy or top-k sampler needs.
    /// Backends that can choose them where the logits live (CUDA) avoid copying the whole
    /// vocabulary back; the default selects them from the full logits.
    fn forward_top(&self, s: &mut Self::Session, tokens: &[u32], k: usize, among: usize) -> Result<Vec<(u32, f32)>> {
        let logits = self.forward(s, tokens, Logits::Last)?;
        Ok(top_of(&logits[..among.min(logits.len())], k))
    }

    /// [`Backend::draft`] as its `k` largest logits among ids below `among`, as
    /// [`Backend::forward_top`] gives them; the default selects them from the full logits.
    fn draft_top(&self, s: &mut Self::Session, next: u32, k: usize, among: usize) -> Result<Vec<(u32, f32)>> {
        let logits = self.draft(s, next)?;
        Ok(top_of(&logits[..among.min(logits.len())], k))
    }

    /// [`Backend::verify`] as each row's `k` largest logits among ids below `among`, as
    /// [`Backend::forward_top`] gives them; the default selects them from the full logits.
    fn verify_top(
        &self,
        s: &mut Self::Session,
        tokens: &[u32],
        k: usize,
        among: usize,
    ) -> Result<Vec<Vec<(u32, f32)>>> {
        let logits = self.verify(s, tokens)?;
        let vocab = logits.len() / tokens.len().max(1);
        Ok(logits.chunks(vocab.max(1)).map(|row| top_of(&row[..among.min(row.len())], k)).collect())
    }

    /// The forwards so far and where their time went (dense, routed experts, waiting on reads).
    /// Cheap (no lock), so callers may take it around every step. `None`: not measured.
    fn forward_stats(&self) -> Option<ForwardStats> {
        None
    }

    /// Every expert of MoE layer `layer`: its counters and whether it is resident. `None` when
    /// the layer is outside the model or the backend has no expert pool.
    fn expert_stats(&self, _layer: usize) -> Option<Vec<ExpertStats>> {
        None
    }
}

/// The `k` largest of `logits` as (id, logit), descending, ties to the lower id.
pub fn top_of(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let k = k.min(idx.len());
    let cmp = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    if k < idx.len() {
        idx.select_nth_unstable_by(k, cmp);
        idx.truncate(k);
    }
    idx.sort_by(cmp);
    idx.into_iter().map(|i| (i, logits[i as usize])).collect()
}
