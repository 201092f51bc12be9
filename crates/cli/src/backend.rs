//! Choosing a backend: `--backend auto|cuda|cpu`, and one type that is either.

use anyhow::Result;
use cherenkov_cpu::{CpuModel, CpuSession};
use cherenkov_cuda::CudaModel;
use cherenkov_cuda::session::CudaSession;
use cherenkov_engine::backend::{Backend, Logits};
use cherenkov_engine::stats::{ExpertStats, ForwardStats, PoolStats};

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum BackendChoice {
    /// CUDA when an NVIDIA GPU is usable, otherwise the CPU.
    #[default]
    Auto,
    /// The GPU (fails clearly without one).
    Cuda,
    /// The CPU reference path.
    Cpu,
}

/// The model on the backend it was opened on.
pub enum AnyModel {
    Cpu(Box<CpuModel>),
    Cuda(Box<CudaModel>),
}

pub enum AnySession {
    Cpu(CpuSession),
    Cuda(CudaSession),
}

impl Backend for AnyModel {
    type Session = AnySession;

    fn name(&self) -> &'static str {
        match self {
            AnyModel::Cpu(m) => m.name(),
            AnyModel::Cuda(m) => m.name(),
        }
    }

    fn new_session(&self) -> Result<AnySession> {
        Ok(match self {
            AnyModel::Cpu(m) => AnySession::Cpu(Backend::new_session(&**m)?),
            AnyModel::Cuda(m) => AnySession::Cuda(Backend::new_session(&**m)?),
        })
    }

    fn snapshot_session(&self, s: &AnySession) -> Result<AnySession> {
        Ok(match (self, s) {
            (AnyModel::Cpu(m), AnySession::Cpu(s)) => AnySession::Cpu(m.snapshot_session(s)?),
            (AnyModel::Cuda(m), AnySession::Cuda(s)) => AnySession::Cuda(m.snapshot_session(s)?),
            _ => anyhow::bail!("a session of one backend given to another"),
        })
    }

    fn session_len(&self, s: &AnySession) -> usize {
        match s {
            AnySession::Cpu(s) => s.pos,
            AnySession::Cuda(s) => s.pos,
        }
    }

    fn session_bytes(&self, s: &AnySession) -> Option<usize> {
        match s {
            AnySession::Cpu(s) => Some(s.bytes()),
            AnySession::Cuda(s) => Some(s.bytes()),
        }
    }

    fn forward(&self, s: &mut AnySession, tokens: &[u32], which: Logits) -> Result<Vec<f32>> {
        match (self, s) {
            (AnyModel::Cpu(m), AnySession::Cpu(s)) => m.forward(s, tokens, which),
            (AnyModel::Cuda(m), AnySession::Cuda(s)) => m.forward_tokens(s, tokens, which),
            _ => anyhow::bail!("a session of one backend was given to another"),
        }
    }

    fn forward_top(&self, s: &mut AnySession, tokens: &[u32], k: usize, among: usize) -> Result<Vec<(u32, f32)>> {
        match (self, s) {
            (AnyModel::Cpu(m), AnySession::Cpu(s)) => m.forward_top(s, tokens, k, among),
            (AnyModel::Cuda(m), AnySession::Cuda(s)) => m.forward_top(s, tokens, k, among),
            _ => anyhow::bail!("a session of one backend was given to another"),
        }
    }

    fn enable_drafting(&self, s: &mut AnySession) -> Result<()> {
        match (self, s) {
            (AnyModel::Cpu(m), AnySession::Cpu(s)) => m.enable_drafting(s),
            (AnyModel::Cuda(m), AnySession::Cuda(s)) => m.enable_drafting(s),
            _ => anyhow::bail!("a session of one backend was given to another"),
        }
    }

    fn drafting(&self, s: &AnySession) -> bool {
        match (self, s) {
            (AnyModel::Cpu(m), AnySession::Cpu(s)) => m.drafting(s),
            (AnyModel::Cuda(m), AnySession::Cuda(s)) => m.drafting(s),
            _ => false,
        }
    }

    fn draft(&self, s: &mut AnySession, next: u32) -> Result<Vec<f32>> {
        match (self, s) {
            (AnyModel::Cpu(m), AnySession::Cpu(s)) => m.draft(s, next),
            (AnyModel::Cuda(m), AnySession::Cuda(s)) => m.draft(s, next),
            _ => anyhow::bail!("a session of one backend was given to another"),
        }
    }

    fn verify(&self, s: &mut AnySession, tokens: &[u32]) -> Result<Vec<f32>> {
        match (self, s) {
            (AnyModel::Cpu(m), AnySession::Cpu(s)) => m.verify(s, tokens),
            (AnyModel::Cuda(m), AnySession::Cuda(s)) => m.verify(s, tokens),
            _ => anyhow::bail!("a session of one backend was given to another"),
        }
    }

    fn commit(&self, s: &mut AnySession, keep: usize) -> Result<()> {
        match (self, s) {
            (AnyModel::Cpu(m), AnySession::Cpu(s)) => m.commit(s, keep),
            (AnyModel::Cuda(m), AnySession::Cuda(s)) => m.commit(s, keep),
            _ => anyhow::bail!("a session of one backend was given to another"),
        }
    }

    fn draft_top(&self, s: &mut AnySession, next: u32, k: usize, among: usize) -> Result<Vec<(u32, f32)>> {
        match (self, s) {
            (AnyModel::Cpu(m), AnySession::Cpu(s)) => m.draft_top(s, next, k, among),
            (AnyModel::Cuda(m), AnySession::Cuda(s)) => m.draft_candidates(s, next, k, among),
            _ => anyhow::bail!("a session of one backend was given to another"),
        }
    }

    fn verify_top(&self, s: &mut AnySession, tokens: &[u32], k: usize, among: usize) -> Result<Vec<Vec<(u32, f32)>>> {
        match (self, s) {
            (AnyModel::Cpu(m), AnySession::Cpu(s)) => m.verify_top(s, tokens, k, among),
            (AnyModel::Cuda(m), AnySession::Cuda(s)) => m.verify_candidates(s, tokens, k, among),
            _ => anyhow::bail!("a session of one backend was given to another"),
        }
    }

    fn vocab_size(&self) -> usize {
        match self {
            AnyModel::Cpu(m) => m.config().vocab_size,
            AnyModel::Cuda(m) => m.config().vocab_size,
        }
    }

    fn pool_stats(&self) -> PoolStats {
        match self {
            AnyModel::Cpu(m) => m.pool.stats(),
            AnyModel::Cuda(m) => m.pool.stats(),
        }
    }

    fn forward_stats(&self) -> Option<ForwardStats> {
        match self {
            AnyModel::Cpu(m) => m.forward_stats(),
            AnyModel::Cuda(m) => m.forward_stats(),
        }
    }

    fn expert_stats(&self, layer: usize) -> Option<Vec<ExpertStats>> {
        match self {
            AnyModel::Cpu(m) => m.expert_stats(layer),
            AnyModel::Cuda(m) => m.expert_stats(layer),
        }
    }
}
