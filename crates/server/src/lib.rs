//! The OpenAI-compatible HTTP server of Cherenkov, generic over the compute backend.
//!
//! - [`routes`]: the endpoints and the API key check; [`chat`] and [`completions`] read requests
//!   ([`request`]) into [`job::Job`]s; [`respond`] turns a job's events into a JSON body or a stream.
//! - [`queue`]: the bounded queue between handlers and the inference thread, the live configuration
//!   and the counters; [`scheduler`]: the inference thread, which interleaves up to
//!   `scheduler.max_active` requests one forward at a time; [`decode`]: one request's sampling and
//!   stop conditions; [`prefix_cache`]: session snapshots keyed by token prefix.
//! - [`stats`]: the step log and the statistics documents (`/v1/stats/...`, `/metrics`).
//! - [`config`]: the TOML configuration, command-line overrides, `SIGHUP` reloads.
//!
//! Forwards run only on the inference thread, never on the async runtime. `docs/server.md`
//! describes the API as clients see it.

pub mod chat;
pub mod completions;
pub mod config;
pub mod decode;
pub mod error;
pub mod job;
pub mod prefix_cache;
pub mod queue;
pub mod request;
pub mod respond;
pub mod routes;
pub mod scheduler;
pub mod spec;
pub mod stats;

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;

use anyhow::{Context, Result};
use cherenkov_engine::backend::Backend;
use tokio::net::TcpListener;
use tokio::signal::unix::{Signal, SignalKind, signal};

pub use config::{Config, Overrides};
pub use spec::{MODEL_ALIAS, ModelSpec};

use crate::queue::Shared;
use crate::routes::{App, AppInner};

/// How to run: the resolved configuration and where it came from (to reload it).
#[derive(Clone, Debug, Default)]
pub struct ServerOptions {
    pub config: Config,
    pub config_file: Option<PathBuf>,
    /// Re-applied over the file at every reload.
    pub overrides: Overrides,
    pub api_key: Option<String>,
}

/// A bound server with its inference thread running.
pub struct Server {
    listener: TcpListener,
    app: App,
    options: ServerOptions,
    inference: JoinHandle<()>,
    /// Listening from `bind` on: a SIGHUP that arrives before `run` is a reload, not the default
    /// action (which ends the process).
    hangups: Option<Signal>,
}

impl Server {
    /// Binds `server.host:server.port` (port 0 picks a free one) and starts the inference thread.
    /// Call inside a tokio runtime.
    pub async fn bind<B: Backend + 'static>(
        backend: Arc<B>,
        spec: ModelSpec,
        options: ServerOptions,
    ) -> Result<Server> {
        let c = &options.config.server;
        let listener = TcpListener::bind((c.host.as_str(), c.port))
            .await
            .with_context(|| format!("cannot listen on {}:{}", c.host, c.port))?;
        let shared = Shared::new(options.config.clone());
        let inference = scheduler::spawn(backend.clone(), spec.tokenizer.clone(), shared.clone());
        let app = App(Arc::new(AppInner { shared, spec, api_key: options.api_key.clone(), backend }));
        let hangups = signal(SignalKind::hangup())
            .map_err(|e| eprintln!("config: cannot listen for SIGHUP ({e}); reloading is off"))
            .ok();
        Ok(Server { listener, app, options, inference, hangups })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("a bound listener has an address")
    }

    /// Serves until `shutdown` completes, reloading the configuration on `SIGHUP`. At shutdown the
    /// inference thread stops first, which ends every request in flight.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<()> {
        let Server { listener, app, options, inference, hangups } = self;
        let shared = app.shared.clone();
        let reloader = tokio::spawn(reload_on_sighup(shared.clone(), hangups, options.config_file, options.overrides));
        let stop = shared.clone();
        let result = axum::serve(listener, routes::router(app))
            .with_graceful_shutdown(async move {
                shutdown.await;
                stop.shutdown();
            })
            .await;
        reloader.abort();
        shared.shutdown();
        let _ = tokio::task::spawn_blocking(move || inference.join()).await;
        result.context("the HTTP server failed")
    }
}

/// Re-reads the configuration file on every `SIGHUP`; a file that fails to parse or validate is
/// reported and the running configuration stays. Requests in flight keep the settings they started
/// with; new requests get the new ones.
async fn reload_on_sighup(shared: Arc<Shared>, hangups: Option<Signal>, file: Option<PathBuf>, overrides: Overrides) {
    let Some(mut hangups) = hangups else { return };
    while hangups.recv().await.is_some() {
        let Some(path) = &file else {
            eprintln!("config: SIGHUP received, but the server was started without --config; nothing to reload");
            continue;
        };
        match Config::resolve(Some(path), &overrides) {
            Ok(new) => {
                for (key, old, now) in shared.live.get().restart_only_changes(&new) {
                    eprintln!("config: {key} changed from {old} to {now}; it takes effect at the next start");
                }
                shared.live.set(new);
                eprintln!("config: reloaded {}", path.display());
            }
            Err(e) => {
                shared.live.reload_failed();
                eprintln!("config: not reloaded, keeping the running configuration: {e:#}");
            }
        }
    }
}

/// A server on a thread of its own, with its own runtime: for tests and benchmarks that drive it
/// from synchronous code. Dropping it stops the server.
pub struct Background {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<()>>>,
}

impl Background {
    pub fn start<B: Backend + 'static>(backend: Arc<B>, spec: ModelSpec, options: ServerOptions) -> Result<Background> {
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || -> Result<()> {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
            rt.block_on(async move {
                let server = match Server::bind(backend, spec, options).await {
                    Ok(s) => s,
                    Err(e) => {
                        let _ = addr_tx.send(Err(e));
                        return Ok(());
                    }
                };
                let _ = addr_tx.send(Ok(server.local_addr()));
                server
                    .run(async move {
                        let _ = stopped.await;
                    })
                    .await
            })
        });
        let addr = addr_rx.recv().context("the server thread ended before it listened")??;
        Ok(Background { addr, stop: Some(stop), thread: Some(thread) })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT/v1`
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Stops the server and waits for it.
    pub fn stop(mut self) -> Result<()> {
        self.shut()
    }

    fn shut(&mut self) -> Result<()> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        match self.thread.take() {
            Some(t) => t.join().map_err(|_| anyhow::anyhow!("the server thread panicked"))?,
            None => Ok(()),
        }
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        let _ = self.shut();
    }
}
