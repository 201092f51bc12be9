//! The CUDA backend (NVIDIA GPUs, Hopper first).
//!
//! Always compiled in: the CUDA driver and NVRTC are loaded dynamically, and kernels are CUDA C
//! compiled at run time ([`compile`]), so the same binary runs on machines without a GPU (where
//! `--backend cuda` says so clearly) and on GPU machines without a toolkit beyond NVRTC.
//!
//! - [`gpu`]: probe, context, module, memory, launches.
//! - [`weights`]: `dense.bin` on the device, bound to the model's tensors.
//! - [`slots`]: device expert slots behind the shared residency manager.
//! - [`pinned`]: the store's expert file pinned for the copy engine.
//! - [`offload`]: which misses the CPU computes instead of copying (`--cpu-experts`).
//! - [`session`]: a sequence's decode state in device memory.
//! - [`timeline`]: one step's kernels on a time line (`CHERENKOV_TIMELINE`), a measurement.
//! - [`model`]: the forward and the [`cherenkov_engine::backend::Backend`] implementation.

pub mod check;
pub mod compile;
pub mod gpu;
pub mod model;
pub mod offload;
pub mod pinned;
pub mod session;
pub mod slots;
pub mod timeline;
pub mod weights;

pub use model::CudaModel;
