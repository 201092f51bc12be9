//! What the runtime needs from a compute backend (CPU now, CUDA next).
//!
//! A backend owns the model's weights and its expert pool; a session holds one sequence's decode
//! state. The runtime drives prefill and decode through [`Backend::forward`] and never looks inside
//! either, so the decode loop, sampling, the server and the statistics are written once.

use anyhow::Result;

use crate::stats::PoolStats;

/// Which logits a forward step returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only the last row's (decode, and the end of a prefill).
    Last,
    /// Every row's (`cherenkov logits`, prompt logprobs).
    All,
}

pub trait Backend: Send + Sync {
    /// One sequence's decode state. Cloning snapshots it.
    type Session: Send + Clone;

    /// A short name for messages (`cpu`, `cuda`).
    fn name(&self) -> &'static str;

    fn new_session(&self) -> Self::Session;

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

    fn vocab_size(&self) -> usize;

    /// The expert pool's counters.
    fn pool_stats(&self) -> PoolStats;
}
