//! The backend-independent runtime of Cherenkov.
//!
//! - [`residency`]: the bounded expert pool (slots, LRFU or LRU eviction that spares the current
//!   step's experts, IO threads issuing positioned reads of whole records) shared by every backend.
//! - [`policy`]: the same eviction policies and Belady's optimum replayed offline on a routing
//!   trace; [`routing`]: calibrated skewed routers for synthetic benchmark models.
//! - [`stats`]: per-layer cache and IO counters.
//! - [`tokenizer`], [`chat`]: `tokenizer.json` and the checkpoint's Jinja chat template.
//! - [`sampling`]: temperature / top-p / top-k sampling with a seeded generator.
//! - [`backend`]: what a compute backend provides; [`generate`]: the decode loop on top of it.

pub mod backend;
pub mod chat;
pub mod generate;
pub mod policy;
pub mod residency;
pub mod routing;
pub mod sampling;
pub mod stats;
pub mod tokenizer;
