//! The server's settings: a TOML file for defaults, command-line flags on top, reloaded on `SIGHUP`.
//!
//! Every key is optional; a missing key keeps its default. Unknown keys are refused, so a typo does
//! not silently fall back to a default. Sizes are bytes, or strings with K/M/G/T (powers of 1024).
//!
//! ```toml
//! [server]
//! host = "127.0.0.1"          # listen address (restart to change)
//! port = 8080                 # (restart to change)
//! max_body = "4M"             # largest request body
//! request_timeout_secs = 600  # from arrival to the last token, queue time included
//!
//! [scheduler]
//! max_active = 2              # requests decoding interleaved
//! queue_size = 16             # requests waiting beyond those; more get 429
//! prefill_chunk = 256         # prompt tokens per forward, so a long prompt does not stall others
//!
//! [limits]
//! default_max_tokens = 1024   # when a request gives no max_tokens (never past the context)
//! max_top_logprobs = 20       # largest top_logprobs / logprobs a request may ask for
//!
//! [sampling]                  # defaults for fields a request leaves out (over generation_config.json)
//! temperature = 0.7
//! top_p = 0.8
//! top_k = 20
//! presence_penalty = 0.0
//! frequency_penalty = 0.0
//! repetition_penalty = 1.0
//!
//! [memory]
//! expert_cache = "8G"         # routed-expert pool (restart to change; --expert-cache overrides)
//!
//! [cache]                     # prefix cache of session snapshots
//! enabled = true
//! max_bytes = "2G"            # snapshots of every kind together, retained sessions included
//! max_entries = 64            # shared snapshots (retained sessions are counted by [sessions])
//! idle_secs = 600             # a snapshot unused this long is dropped
//! block_tokens = 0            # also snapshot every N prompt tokens (0: only at prompt ends)
//!
//! [sessions]                  # retained sessions (`session_id`)
//! max = 16
//! idle_secs = 1800
//! ```

use std::path::Path;

use anyhow::{Context, Result, bail};
use cherenkov_engine::residency::parse_size;
use serde::{Deserialize, Deserializer};

/// A byte count written as a number or as a size string (`"512M"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Size(pub u64);

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Bytes(u64),
            Text(String),
        }
        match Raw::deserialize(d).map_err(|_| serde::de::Error::custom("expected bytes or a size such as \"512M\""))? {
            Raw::Bytes(b) => Ok(Size(b)),
            Raw::Text(t) => parse_size(&t).map(Size).map_err(serde::de::Error::custom),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerSection {
    pub host: String,
    pub port: u16,
    pub max_body: Size,
    pub request_timeout_secs: u64,
}

impl Default for ServerSection {
    fn default() -> Self {
        Self { host: "127.0.0.1".into(), port: 8080, max_body: Size(4 << 20), request_timeout_secs: 600 }
    }
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SchedulerSection {
    pub max_active: usize,
    pub queue_size: usize,
    pub prefill_chunk: usize,
    /// Tokens the MTP head drafts per decode step (0: off; the backend and model must draft).
    pub draft: usize,
}

impl Default for SchedulerSection {
    fn default() -> Self {
        Self { max_active: 2, queue_size: 16, prefill_chunk: 256, draft: 0 }
    }
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsSection {
    pub default_max_tokens: usize,
    pub max_top_logprobs: usize,
}

impl Default for LimitsSection {
    fn default() -> Self {
        Self { default_max_tokens: 1024, max_top_logprobs: 20 }
    }
}

/// Sampling defaults; unset keys fall back to the model's generation_config.json.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingSection {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MemorySection {
    /// The routed-expert pool; read when the model is loaded.
    pub expert_cache: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CacheSection {
    pub enabled: bool,
    pub max_bytes: Size,
    pub max_entries: usize,
    pub idle_secs: u64,
    pub block_tokens: usize,
}

impl Default for CacheSection {
    fn default() -> Self {
        Self { enabled: true, max_bytes: Size(2 << 30), max_entries: 64, idle_secs: 600, block_tokens: 0 }
    }
}

#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SessionsSection {
    pub max: usize,
    pub idle_secs: u64,
}

impl Default for SessionsSection {
    fn default() -> Self {
        Self { max: 16, idle_secs: 1800 }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub server: ServerSection,
    pub scheduler: SchedulerSection,
    pub limits: LimitsSection,
    pub sampling: SamplingSection,
    pub memory: MemorySection,
    pub cache: CacheSection,
    pub sessions: SessionsSection,
}

/// Command-line values that take precedence over the file, at start and after every reload.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    pub host: Option<String>,
    pub port: Option<u16>,
    pub max_active: Option<usize>,
    pub queue_size: Option<usize>,
    pub request_timeout_secs: Option<u64>,
    pub prefix_cache_bytes: Option<u64>,
    pub expert_cache: Option<String>,
    pub draft: Option<usize>,
}

impl Config {
    /// Parses TOML text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Config> {
        let config: Config = toml::from_str(text).map_err(|e| anyhow::anyhow!("{origin}: {e}"))?;
        config.validate().with_context(|| origin.to_string())?;
        Ok(config)
    }

    /// Reads a TOML file.
    pub fn load(path: &Path) -> Result<Config> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("{}: cannot read the server configuration", path.display()))?;
        Self::parse(&text, &path.display().to_string())
    }

    /// The file (if any) with `overrides` applied, validated.
    pub fn resolve(path: Option<&Path>, overrides: &Overrides) -> Result<Config> {
        let mut c = match path {
            Some(p) => Config::load(p)?,
            None => Config::default(),
        };
        c.apply(overrides);
        c.validate().context("the command-line options")?;
        Ok(c)
    }

    pub fn apply(&mut self, o: &Overrides) {
        if let Some(h) = &o.host {
            self.server.host = h.clone();
        }
        if let Some(p) = o.port {
            self.server.port = p;
        }
        if let Some(n) = o.max_active {
            self.scheduler.max_active = n;
        }
        if let Some(n) = o.queue_size {
            self.scheduler.queue_size = n;
        }
        if let Some(s) = o.request_timeout_secs {
            self.server.request_timeout_secs = s;
        }
        if let Some(d) = o.draft {
            self.scheduler.draft = d;
        }
        if let Some(b) = o.prefix_cache_bytes {
            self.cache.max_bytes = Size(b);
            self.cache.enabled = b > 0;
        }
        if let Some(e) = &o.expert_cache {
            self.memory.expert_cache = Some(e.clone());
        }
    }

    /// Rejects values that cannot work, naming the key.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("scheduler.max_active", self.scheduler.max_active),
            ("scheduler.prefill_chunk", self.scheduler.prefill_chunk),
            ("server.request_timeout_secs", self.server.request_timeout_secs as usize),
            ("server.max_body", self.server.max_body.0 as usize),
        ];
        for (key, v) in positive {
            if v == 0 {
                bail!("{key} must be at least 1");
            }
        }
        let at_most = [
            ("scheduler.max_active", self.scheduler.max_active as u64, 64),
            ("scheduler.draft", self.scheduler.draft as u64, cherenkov_engine::generate::MAX_DRAFT as u64),
            ("server.request_timeout_secs", self.server.request_timeout_secs, 366 * 24 * 3600),
            ("limits.max_top_logprobs", self.limits.max_top_logprobs as u64, 1000),
        ];
        for (key, v, max) in at_most {
            if v > max {
                bail!("{key} must be at most {max}, got {v}");
            }
        }
        if self.server.host.is_empty() {
            bail!("server.host is empty; give an address such as 127.0.0.1");
        }
        let s = &self.sampling;
        let params = cherenkov_engine::sampling::SamplingParams {
            temperature: s.temperature.unwrap_or(1.0),
            top_p: s.top_p.unwrap_or(1.0),
            top_k: s.top_k.unwrap_or(0),
            seed: None,
            presence_penalty: s.presence_penalty.unwrap_or(0.0),
            frequency_penalty: s.frequency_penalty.unwrap_or(0.0),
            repetition_penalty: s.repetition_penalty.unwrap_or(1.0),
        };
        params.validate().context("[sampling]")?;
        if let Some(e) = &self.memory.expert_cache {
            parse_size(e).context("memory.expert_cache")?;
        }
        Ok(())
    }

    /// The settings that only take effect at start, as (key, old, new) for those that differ.
    pub fn restart_only_changes(&self, new: &Config) -> Vec<(&'static str, String, String)> {
        let mut out = Vec::new();
        if self.server.host != new.server.host {
            out.push(("server.host", self.server.host.clone(), new.server.host.clone()));
        }
        if self.server.port != new.server.port {
            out.push(("server.port", self.server.port.to_string(), new.server.port.to_string()));
        }
        if self.memory.expert_cache != new.memory.expert_cache {
            let show = |v: &Option<String>| v.clone().unwrap_or_else(|| "default".into());
            out.push(("memory.expert_cache", show(&self.memory.expert_cache), show(&new.memory.expert_cache)));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_section_and_sizes() {
        let c = Config::parse(
            "[server]\nport = 9000\nmax_body = \"1M\"\n[scheduler]\nmax_active = 3\n[cache]\nmax_bytes = 4096\n\
             block_tokens = 64\n[sampling]\ntemperature = 0.5\n[memory]\nexpert_cache = \"2G\"\n",
            "t.toml",
        )
        .unwrap();
        assert_eq!(c.server.port, 9000);
        assert_eq!(c.server.max_body, Size(1 << 20));
        assert_eq!(c.server.host, "127.0.0.1");
        assert_eq!(c.scheduler.max_active, 3);
        assert_eq!(c.cache.max_bytes, Size(4096));
        assert_eq!(c.sampling.temperature, Some(0.5));
        assert_eq!(c.memory.expert_cache.as_deref(), Some("2G"));
    }

    #[test]
    fn refuses_typos_and_bad_values() {
        let e = Config::parse("[scheduler]\nmax_activ = 3\n", "t.toml").unwrap_err().to_string();
        assert!(e.contains("max_activ") && e.contains("t.toml"), "{e}");
        let e = format!("{:#}", Config::parse("[scheduler]\nmax_active = 0\n", "t.toml").unwrap_err());
        assert!(e.contains("scheduler.max_active"), "{e}");
        let e = format!("{:#}", Config::parse("[sampling]\ntop_p = 2.0\n", "t.toml").unwrap_err());
        assert!(e.contains("top_p"), "{e}");
        let e = format!("{:#}", Config::parse("[cache]\nmax_bytes = \"12Q\"\n", "t.toml").unwrap_err());
        assert!(e.contains("max_bytes"), "{e}");
    }

    #[test]
    fn flags_override_the_file() {
        let o = Overrides { port: Some(0), max_active: Some(4), prefix_cache_bytes: Some(0), ..Overrides::default() };
        let mut c = Config::parse("[server]\nport = 9000\n[scheduler]\nmax_active = 3\n", "t.toml").unwrap();
        c.apply(&o);
        assert_eq!((c.server.port, c.scheduler.max_active, c.cache.enabled), (0, 4, false));
    }
}
