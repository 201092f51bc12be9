//! A CPU backend whose MTP drafts are the trunk's own next-token logits (from a copy of the
//! session), so that greedy drafts are always accepted; everything else is the CPU model's. The
//! fixtures' random MTP heads draft tokens the trunk rejects, so this takes the accepting path.
//! Shared by `crates/cpu/tests/speculative.rs` and `crates/server/tests/drafting.rs` (included
//! there by path).

use std::ops::Deref;

use anyhow::Result;
use cherenkov_cpu::{CpuModel, CpuSession, Logits};
use cherenkov_engine::backend::Backend;
use cherenkov_engine::stats::PoolStats;

/// `M` holds the model: a reference in a test, an `Arc` where a server owns the backend.
pub struct Oracle<M>(pub M);

impl<M: Deref<Target = CpuModel> + Send + Sync> Backend for Oracle<M> {
    type Session = CpuSession;
    fn name(&self) -> &'static str {
        "oracle"
    }
    fn new_session(&self) -> Result<CpuSession> {
        Ok(self.0.new_session())
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
        self.0.forward(s, tokens, which)
    }
    fn enable_drafting(&self, _s: &mut CpuSession) -> Result<()> {
        Ok(())
    }
    fn drafting(&self, _s: &CpuSession) -> bool {
        true
    }
    fn draft(&self, s: &mut CpuSession, next: u32) -> Result<Vec<f32>> {
        self.0.forward(&mut s.clone(), &[next], Logits::Last)
    }
    fn verify(&self, s: &mut CpuSession, tokens: &[u32]) -> Result<Vec<f32>> {
        self.0.verify(s, tokens)
    }
    fn commit(&self, s: &mut CpuSession, keep: usize) -> Result<()> {
        self.0.commit(s, keep)
    }
    fn vocab_size(&self) -> usize {
        self.0.config().vocab_size
    }
    fn pool_stats(&self) -> PoolStats {
        self.0.pool.stats()
    }
}
