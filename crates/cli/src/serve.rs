//! `cherenkov serve --model NAME`: the OpenAI-compatible HTTP server, with the model loaded once.
//! The server itself lives in `cherenkov-server`; this opens the model and the configuration.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use cherenkov_engine::backend::Backend;
use cherenkov_engine::residency::parse_size;
use cherenkov_registry::Registry;
use cherenkov_registry::servers::ServerRecord;
use cherenkov_server::{Config, ModelSpec, Overrides, Server, ServerOptions};

use crate::backend::AnyModel;
use crate::load::{LoadArgs, open_model};
use crate::resolve::resolve_model;
use crate::run::SamplingArgs;

#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// A registered name, a store directory, or a checkpoint directory (packed on first use).
    #[arg(long, value_name = "MODEL")]
    pub model: String,
    /// Address to listen on [default: 127.0.0.1]. Anything else (0.0.0.0) exposes the server to
    /// the network: set an API key.
    #[arg(long, value_name = "ADDR")]
    pub host: Option<String>,
    /// Port to listen on; 0 picks a free one [default: 8080].
    #[arg(long, value_name = "PORT")]
    pub port: Option<u16>,
    /// A TOML file of defaults (sampling, limits, memory, cache policy, concurrency); flags given
    /// here override it. SIGHUP re-reads it.
    #[arg(long, value_name = "FILE.toml")]
    pub config: Option<PathBuf>,
    /// Require `Authorization: Bearer KEY` on every /v1 request [default: $CHERENKOV_API_KEY].
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,
    /// Requests that decode interleaved [default: 2].
    #[arg(long, value_name = "N")]
    pub max_active: Option<usize>,
    /// Requests that may wait beyond those; more get 429 [default: 16].
    #[arg(long, value_name = "N")]
    pub queue_size: Option<usize>,
    /// Seconds a request may take, queueing included [default: 600].
    #[arg(long, value_name = "SECS")]
    pub request_timeout: Option<u64>,
    /// Memory for prefix-cache snapshots (e.g. 2G); 0 turns the cache off [default: 2G].
    #[arg(long, value_name = "SIZE")]
    pub prefix_cache: Option<String>,
    /// Speculative decoding: tokens the checkpoint's MTP head drafts per decode step (0: off; 1
    /// is the most supported), as `run --draft`; the same text, and /v1/stats reports the drafts
    /// accepted. On CUDA the pass that checks a draft costs about 1.56x a step where every expert
    /// is resident (two steps otherwise), so drafting pays only at depth and high acceptance
    /// [default: 0].
    #[arg(long, value_name = "N")]
    pub draft: Option<usize>,
    #[command(flatten)]
    pub load: LoadArgs,
}

impl ServeArgs {
    fn overrides(&self) -> Result<Overrides> {
        let prefix_cache_bytes = match &self.prefix_cache {
            Some(s) => Some(parse_size(s).with_context(|| format!("--prefix-cache {s}"))?),
            None => None,
        };
        Ok(Overrides {
            host: self.host.clone(),
            port: self.port,
            max_active: self.max_active,
            queue_size: self.queue_size,
            request_timeout_secs: self.request_timeout,
            prefix_cache_bytes,
            expert_cache: self.load.expert_cache.clone(),
            draft: self.draft,
        })
    }
}

pub fn run(args: &ServeArgs, out: &mut dyn Write) -> Result<()> {
    let overrides = args.overrides()?;
    let config = Config::resolve(args.config.as_deref(), &overrides)?;
    let api_key = args.api_key.clone().or_else(|| std::env::var("CHERENKOV_API_KEY").ok()).filter(|k| !k.is_empty());
    let reg = Registry::open_default()?;
    let resolved = resolve_model(&reg, &args.model)?;
    let load = LoadArgs { expert_cache: config.memory.expert_cache.clone(), ..args.load.clone() };
    let loaded = open_model(&resolved.store, &load)?;
    let model: AnyModel = loaded.model;
    if config.scheduler.draft > 0 {
        // Refused at start, not at the first request: the backend or the model cannot draft.
        model.enable_drafting(&mut model.new_session()?).context("scheduler.draft (--draft) is set")?;
    }
    let dir = &loaded.store.dir;
    let c = loaded.store.config();
    let spec = ModelSpec::from_store_dir(
        dir,
        resolved.name.as_deref(),
        c.max_position_embeddings,
        &c.eos_token_ids,
        SamplingArgs::default().resolve(dir),
        Backend::name(&model),
    )?;
    let names = spec.names.join(", ");
    let loopback = config.server.host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
        || config.server.host == "localhost";
    if !loopback && api_key.is_none() {
        eprintln!(
            "warning: listening on {} without an API key: anyone who reaches this address can use the \
             model (set CHERENKOV_API_KEY or --api-key)",
            config.server.host
        );
    }
    let options = ServerOptions { config, config_file: args.config.clone(), overrides, api_key };
    let key_note = if options.api_key.is_some() { "; API key required" } else { "" };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async {
        let server = Server::bind(Arc::new(model), spec, options).await?;
        let url = format!("http://{}", server.local_addr());
        writeln!(out, "serving {names} at {url}/v1{key_note} (Ctrl-C stops)")?;
        out.flush()?;
        let model = resolved.name.clone().unwrap_or_else(|| args.model.clone());
        let record = ServerRecord { pid: std::process::id(), url, model, started: Some(unix_now()) };
        // Lets `cherenkov status` find this server; removed when it stops.
        let _announcement = reg.announce_server(&record).map_err(|e| eprintln!("note: {e:#}")).ok();
        server.run(stop_signal()).await
    })
}

fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Ctrl-C or SIGTERM.
async fn stop_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let term = async {
        match signal(SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
    eprintln!("stopping");
}
