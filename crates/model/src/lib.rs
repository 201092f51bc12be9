//! The model side of Cherenkov: everything about `qwen4_exp` weights that is not arithmetic.
//!
//! - [`config`]: `config.json` parsing and the architecture rules transformers applies.
//! - [`safetensors`]: a validating reader for single and sharded safetensors checkpoints.
//! - [`quant`]: MLX affine quantization (bit-exact with `mx.quantize`) and the packed bit layout.
//! - [`arch`]: the tensors a config implies, with their shapes and quantization rules.
//! - [`checkpoint`]: Hugging Face (BF16) and MLX (affine) layouts mapped onto one set of names.
//! - [`synth`]: synthetic checkpoints (random weights, the real Hugging Face layout) for tests and benchmarks.
//! - [`store`]: the packed store (`manifest.json`, `dense.bin`, `experts-*.bin`, `ngram.bin`),
//!   its writer ([`store::pack`]) and its reader ([`store::Store`]).

pub mod arch;
pub mod checkpoint;
pub mod config;
pub mod dtype;
pub mod ngram;
pub mod quant;
pub mod safetensors;
pub mod store;
pub mod synth;

pub use config::{LayerType, ModelConfig, TextConfig};
pub use dtype::DType;
