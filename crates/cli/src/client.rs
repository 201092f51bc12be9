//! Talking to a running `cherenkov serve` from another terminal (`stats`, `dash`): which server,
//! and GETs of its statistics API with errors that say what to do.
//!
//! Which server: `--url`, else `--port` on 127.0.0.1, else the one a running server announced in
//! `$CHERENKOV_HOME/servers/<pid>.json` (as `cherenkov status` finds them; with several, the one
//! at the default address, else the most recently started), else http://127.0.0.1:8080.

use std::time::Duration;

use anyhow::{Result, bail};
use cherenkov_registry::Registry;
use cherenkov_registry::servers::process_alive;
use serde_json::Value;

/// Where `cherenkov serve` listens unless told otherwise.
pub const DEFAULT_URL: &str = "http://127.0.0.1:8080";

/// Picking the server (shared by `stats` and `dash`).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ServerArgs {
    /// The server's base URL (http://HOST:PORT; a trailing /v1 is ignored) [default: a server
    /// announced in $CHERENKOV_HOME/servers, else http://127.0.0.1:8080].
    #[arg(long, value_name = "URL", conflicts_with = "port")]
    pub url: Option<String>,
    /// The port of a server on 127.0.0.1.
    #[arg(long, value_name = "PORT")]
    pub port: Option<u16>,
    /// The server's API key [default: $CHERENKOV_API_KEY].
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,
}

/// Why a GET gave no document.
#[derive(Debug)]
pub enum FetchError {
    /// Nothing answered (refused, timed out, name unknown): the server is down or elsewhere.
    Unreachable(String),
    /// The server answered with an error status.
    Status { status: u16, message: String },
    /// The answer was not the expected JSON.
    Invalid(String),
}

impl std::fmt::Display for FetchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FetchError::Unreachable(e) => write!(f, "{e}"),
            FetchError::Status { status, message } => write!(f, "HTTP {status}: {message}"),
            FetchError::Invalid(e) => write!(f, "{e}"),
        }
    }
}

pub struct Client {
    /// `http://host:port`, no trailing slash.
    pub url: String,
    /// How the URL was chosen, for messages (`--url`, `announced by pid 42`, `the default`).
    pub source: String,
    api_key: Option<String>,
    agent: ureq::Agent,
}

/// `http://h:p/v1/` -> `http://h:p`.
pub fn normalize_url(url: &str) -> Result<String> {
    let u = url.trim().trim_end_matches('/');
    let u = u.strip_suffix("/v1").unwrap_or(u).trim_end_matches('/');
    if !(u.starts_with("http://") || u.starts_with("https://")) || u.len() <= "https://".len() {
        bail!("--url {url:?} is not an http:// URL (expected e.g. http://127.0.0.1:8080)");
    }
    Ok(u.to_string())
}

/// A server announced in `$CHERENKOV_HOME/servers` whose process runs: (url, started, file).
fn announced() -> Vec<(String, Option<u64>, String)> {
    let Ok(reg) = Registry::open_default() else { return vec![] };
    let Ok(files) = reg.server_files() else { return vec![] };
    files
        .into_iter()
        .filter_map(|f| {
            let r = f.record.ok()?;
            process_alive(r.pid).then(|| (r.url, r.started, f.path.display().to_string()))
        })
        .collect()
}

impl Client {
    pub fn new(args: &ServerArgs) -> Result<Client> {
        let (url, source) = match (&args.url, args.port) {
            (Some(u), _) => (normalize_url(u)?, "--url".to_string()),
            (None, Some(p)) => (format!("http://127.0.0.1:{p}"), "--port".to_string()),
            (None, None) => {
                let mut servers = announced();
                match servers.len() {
                    0 => (DEFAULT_URL.to_string(), "the default address".to_string()),
                    1 => {
                        let (u, _, file) = servers.remove(0);
                        (normalize_url(&u)?, format!("announced in {file}"))
                    }
                    n => {
                        servers.sort_by_key(|s| std::cmp::Reverse(s.1));
                        let pick = servers.iter().position(|s| s.0.trim_end_matches('/') == DEFAULT_URL).unwrap_or(0);
                        let (u, _, file) = servers.remove(pick);
                        let others: Vec<&str> = servers.iter().map(|s| s.0.as_str()).collect();
                        eprintln!(
                            "note: {n} servers are running; using {u} (others: {}; pick one with --url)",
                            others.join(", ")
                        );
                        (normalize_url(&u)?, format!("announced in {file}"))
                    }
                }
            }
        };
        let api_key =
            args.api_key.clone().or_else(|| std::env::var("CHERENKOV_API_KEY").ok()).filter(|k| !k.is_empty());
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(Duration::from_secs(5)))
            .http_status_as_error(false)
            .proxy(None)
            .build()
            .into();
        Ok(Client { url, source, api_key, agent })
    }

    /// The body of `GET {url}{path}` (an OK status), as text.
    pub fn get_text(&self, path: &str) -> std::result::Result<String, FetchError> {
        let endpoint = format!("{}{path}", self.url);
        let mut req = self.agent.get(&endpoint);
        if let Some(k) = &self.api_key {
            req = req.header("Authorization", &format!("Bearer {k}"));
        }
        let mut resp = req.call().map_err(|e| FetchError::Unreachable(format!("GET {endpoint}: {e}")))?;
        let status = resp.status().as_u16();
        let body = resp
            .body_mut()
            .with_config()
            .limit(64 << 20)
            .read_to_string()
            .map_err(|e| FetchError::Unreachable(format!("GET {endpoint}: {e}")))?;
        if status != 200 {
            let message = serde_json::from_str::<Value>(&body)
                .ok()
                .and_then(|v| v["error"]["message"].as_str().map(String::from))
                .unwrap_or_else(|| body.chars().take(200).collect());
            return Err(FetchError::Status { status, message });
        }
        Ok(body)
    }

    /// `GET {url}{path}` as JSON.
    pub fn get_json(&self, path: &str) -> std::result::Result<Value, FetchError> {
        let body = self.get_text(path)?;
        serde_json::from_str(&body).map_err(|e| {
            FetchError::Invalid(format!("GET {}{path}: not JSON ({e}); is this a Cherenkov server?", self.url))
        })
    }

    /// [`Client::get_json`] with an error that tells the user what to do.
    pub fn fetch(&self, path: &str) -> Result<Value> {
        self.get_json(path).map_err(|e| anyhow::anyhow!(self.explain(&e)))
    }

    /// A message for a failed GET: no server, a key needed, an old server without the API.
    pub fn explain(&self, e: &FetchError) -> String {
        match e {
            FetchError::Unreachable(why) => format!(
                "no Cherenkov server answers at {} ({}; {why}). Start one with `cherenkov serve --model NAME`, \
                 or point at a running one with --url URL or --port PORT",
                self.url, self.source
            ),
            FetchError::Status { status: 401, message } => format!(
                "the server at {} wants an API key ({message}): pass --api-key KEY or set CHERENKOV_API_KEY",
                self.url
            ),
            FetchError::Status { status: 404, message } if message.starts_with("Unknown request URL") => format!(
                "the server at {} has no statistics API ({message}); is it an older cherenkov, or another server?",
                self.url
            ),
            FetchError::Status { status, message } => {
                format!("the server at {} answered HTTP {status}: {message}", self.url)
            }
            FetchError::Invalid(why) => why.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_normalized() {
        assert_eq!(normalize_url("http://127.0.0.1:9000/v1/").unwrap(), "http://127.0.0.1:9000");
        assert_eq!(normalize_url(" http://h:1 ").unwrap(), "http://h:1");
        assert!(normalize_url("127.0.0.1:8080").is_err());
        assert!(normalize_url("http://").is_err());
    }
}
