//! Turning a job's events into an HTTP response: collected into one JSON body, or streamed as
//! server-sent events (`data: {chunk}` lines, then `data: [DONE]`).
//!
//! Streams hold the job's event receiver; when the client goes away the body is dropped with it,
//! which the inference thread notices before its next step and ends the job.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::Stream;
use serde_json::{Value, json};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use crate::error::ApiError;
use crate::job::{Event, Finish, GenParams, GenToken, Job, TokenLogprob, Usage};
use crate::routes::App;

/// Runs a handler's `prepare` (parsing, rendering the chat template, tokenizing: CPU work that grows
/// with the prompt) on the blocking pool, off the async workers.
pub async fn off_runtime<T: Send + 'static>(
    app: &App,
    headers: HeaderMap,
    bytes: Bytes,
    prepare: fn(&App, &HeaderMap, &[u8]) -> Result<T, ApiError>,
) -> Result<T, ApiError> {
    let app = app.clone();
    tokio::task::spawn_blocking(move || prepare(&app, &headers, &bytes))
        .await
        .map_err(|e| ApiError::server(format!("internal error: {e}")))?
}

/// A queued job's identity and its event stream.
pub struct Submitted {
    pub id: String,
    pub created: u64,
    pub rx: UnboundedReceiver<Event>,
}

/// Queues a job for the inference thread (429 when the queue is full).
pub fn submit(
    app: &App,
    prefix: &str,
    prompt: Vec<u32>,
    snapshot_at: Vec<usize>,
    params: GenParams,
    session_id: Option<String>,
) -> Result<Submitted, ApiError> {
    let config = app.shared.live.get();
    let timeout_secs = config.server.request_timeout_secs;
    let id = format!("{prefix}-{:016x}{:08x}", rand::random::<u64>(), rand::random::<u32>());
    let (events, rx) = unbounded_channel();
    let job = Job {
        id: id.clone(),
        prompt,
        snapshot_at,
        params,
        session_id,
        deadline: Instant::now() + Duration::from_secs(timeout_secs),
        timeout_secs,
        events,
    };
    app.shared.submit(job)?;
    let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    Ok(Submitted { id, created, rx })
}

/// The fields every response object and chunk repeats.
pub struct Meta {
    pub id: String,
    pub created: u64,
    /// The model name as the client gave it.
    pub model: String,
    pub fingerprint: String,
}

impl Meta {
    pub fn new(app: &App, id: String, created: u64, model: String) -> Self {
        let fingerprint = format!("cherenkov-{}-{}", env!("CARGO_PKG_VERSION"), app.spec.backend);
        Self { id, created, model, fingerprint }
    }

    /// A response object or chunk; `usage` only where there is one.
    pub fn object(&self, object: &str, choices: Value, usage: Option<&Usage>) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
            "choices": choices,
        });
        if let Some(u) = usage {
            v["usage"] = usage_json(u);
        }
        v
    }
}

/// Everything a finished job reported.
#[derive(Debug)]
pub struct Collected {
    pub text: String,
    pub tokens: Vec<GenToken>,
    pub prompt_logprobs: Option<Vec<TokenLogprob>>,
    pub finish: Finish,
    pub usage: Usage,
}

/// Waits for the job to finish.
async fn collect(rx: &mut UnboundedReceiver<Event>) -> Result<Collected, ApiError> {
    let (mut text, mut tokens, mut prompt_logprobs) = (String::new(), Vec::new(), None);
    while let Some(event) = rx.recv().await {
        match event {
            Event::Prompt { logprobs, .. } => prompt_logprobs = logprobs,
            Event::Text { text: t, tokens: ts } => {
                text.push_str(&t);
                tokens.extend(ts);
            }
            Event::Done { finish, usage } => return Ok(Collected { text, tokens, prompt_logprobs, finish, usage }),
            Event::Error(e) => return Err(e),
        }
    }
    Err(ApiError::unavailable("The server stopped before the request finished"))
}

pub fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

/// A log-probability as JSON; `-inf` (a token the model rules out) becomes OpenAI's -9999.
pub fn lp(x: f32) -> Value {
    if x.is_finite() { json!(x) } else { json!(-9999.0) }
}

/// Formats one job's events as stream chunks (chat and completions differ only here).
pub trait ChunkFormat: Send + 'static {
    /// The prompt is done (chat: the role chunk; completions: the echoed prompt).
    fn prompt(&mut self, cached_tokens: usize, logprobs: Option<Vec<TokenLogprob>>) -> Vec<Value>;
    fn text(&mut self, text: String, tokens: Vec<GenToken>) -> Vec<Value>;
    /// The last chunks: the finish reason, then usage when asked for.
    fn done(&mut self, finish: Finish, usage: Usage) -> Vec<Value>;
    /// The response object of a request that was not streamed.
    fn whole(self, c: Collected) -> Value;
}

/// The job's answer: streamed, or collected into one JSON object.
pub async fn respond<F: ChunkFormat>(
    mut rx: UnboundedReceiver<Event>,
    streamed: bool,
    format: F,
) -> Result<Response, ApiError> {
    if streamed {
        return Ok(stream(rx, format));
    }
    let c = collect(&mut rx).await?;
    Ok(axum::Json(format.whole(c)).into_response())
}

struct StreamState<F> {
    rx: UnboundedReceiver<Event>,
    format: F,
    pending: VecDeque<SseEvent>,
    finished: bool,
}

/// The SSE response for a job.
fn stream<F: ChunkFormat>(rx: UnboundedReceiver<Event>, format: F) -> Response {
    let state = StreamState { rx, format, pending: VecDeque::new(), finished: false };
    let body = futures_util::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(ev) = s.pending.pop_front() {
                return Some((Ok::<_, Infallible>(ev), s));
            }
            if s.finished {
                return None;
            }
            let data = |v: &Value| SseEvent::default().data(v.to_string());
            match s.rx.recv().await {
                Some(Event::Prompt { cached_tokens, logprobs }) => {
                    s.pending.extend(s.format.prompt(cached_tokens, logprobs).iter().map(data));
                }
                Some(Event::Text { text, tokens }) => s.pending.extend(s.format.text(text, tokens).iter().map(data)),
                Some(Event::Done { finish, usage }) => {
                    s.pending.extend(s.format.done(finish, usage).iter().map(data));
                    s.pending.push_back(SseEvent::default().data("[DONE]"));
                    s.finished = true;
                }
                Some(Event::Error(e)) => {
                    s.pending.push_back(data(&e.body()));
                    s.finished = true;
                }
                None => {
                    let e = ApiError::unavailable("The server stopped before the request finished");
                    s.pending.push_back(data(&e.body()));
                    s.finished = true;
                }
            }
        }
    });
    Sse::new(boxed(body)).keep_alive(KeepAlive::new().interval(Duration::from_secs(15))).into_response()
}

fn boxed<S: Stream<Item = Result<SseEvent, Infallible>> + Send + 'static>(
    s: S,
) -> std::pin::Pin<Box<dyn Stream<Item = Result<SseEvent, Infallible>> + Send>> {
    Box::pin(s)
}
