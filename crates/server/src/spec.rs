//! What the server knows about the model it serves, beyond the backend: the names clients may use,
//! the tokenizer, the chat template, the end-of-sequence ids, the context length and the sampling
//! defaults of its `generation_config.json`.

use std::path::Path;

use anyhow::{Result, bail};
use cherenkov_engine::chat::{ChatTemplate, eos_token_ids};
use cherenkov_engine::sampling::SamplingParams;
use cherenkov_engine::tokenizer::Tokenizer;

/// The name every server answers to, whatever model it runs.
pub const MODEL_ALIAS: &str = "cherenkov";

pub struct ModelSpec {
    /// `cherenkov` first, then the registered name (when there is one).
    pub names: Vec<String>,
    pub tokenizer: Tokenizer,
    /// `None` for a model without a chat template (then only `/v1/completions` works).
    pub template: Option<ChatTemplate>,
    /// Token ids that end generation.
    pub eos: Vec<u32>,
    /// The longest sequence (prompt and completion) the model takes: `max_position_embeddings`.
    pub max_context: usize,
    /// The model's own sampling defaults; the `[sampling]` configuration overrides them.
    pub sampling: SamplingParams,
    /// Which backend computes (`cpu`, `cuda`), for `system_fingerprint`.
    pub backend: &'static str,
    /// Unix seconds when the server loaded the model (`created` of `/v1/models`).
    pub created: u64,
}

impl ModelSpec {
    /// Reads the tokenizer, chat template and EOS ids from a store directory. `config_eos` is the
    /// model config's `eos_token_id`; `sampling` the defaults to start from.
    pub fn from_store_dir(
        dir: &Path,
        registered_name: Option<&str>,
        max_context: usize,
        config_eos: &[u32],
        sampling: SamplingParams,
        backend: &'static str,
    ) -> Result<ModelSpec> {
        if max_context == 0 {
            bail!("{}: the model's max_position_embeddings is 0", dir.display());
        }
        let tokenizer = Tokenizer::from_dir(dir)?;
        let template = ChatTemplate::from_dir(dir)?;
        let eos = eos_token_ids(dir, config_eos, &tokenizer);
        let mut names = vec![MODEL_ALIAS.to_string()];
        if let Some(n) = registered_name
            && n != MODEL_ALIAS
        {
            names.push(n.to_string());
        }
        let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        Ok(ModelSpec { names, tokenizer, template, eos, max_context, sampling, backend, created })
    }

    pub fn serves(&self, model: &str) -> bool {
        self.names.iter().any(|n| n == model)
    }
}
