//! The CPU backend: the reference equations of `qwen4_exp`, computed in f32 from the packed store.
//!
//! Weights are read from the mapped `dense.bin` and decoded on the fly ([`linear`]); routed experts
//! come through the shared expert pool ([`cherenkov_engine::residency`]); n-gram rows are read from
//! `ngram.bin` one row at a time. One file per block kind: [`hyper`] (hyper-connections), [`gdn`]
//! (Gated DeltaNet), [`attention`] (QSA attention), [`ple`] (n-gram PLE), [`moe`] (router, experts,
//! shared expert), [`mtp`] (the MTP head, for drafts); [`expert`] is one expert for one token split by rows ([`q4`] its 4-bit kernels) and [`team`] the threads
//! that share it, for the GPU backend's experts computed on the CPU; [`model`] strings them together; [`state`] is a sequence's decode state.

pub mod attention;
pub mod expert;
pub mod gdn;
pub mod hyper;
pub mod linear;
pub mod model;
pub mod moe;
pub mod mtp;
pub mod ops;
pub mod ple;
pub mod q4;
pub mod state;
pub mod team;
#[cfg(test)]
mod testing;
pub mod weights;

pub use cherenkov_engine::backend::Logits;
pub use model::CpuModel;
pub use state::CpuSession;
