//! The HTTP surface: routes, the API key check, body limits, and the small endpoints
//! (`/v1/models`, `/v1/sessions/{id}`, `/status`, `/health`, and the statistics: `/v1/stats/...`,
//! `/metrics`).

use std::sync::Arc;

use axum::Router;
use axum::body::{Body as HttpBody, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, Method, Uri, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use serde_json::json;

use crate::error::ApiError;
use crate::queue::Shared;
use crate::spec::ModelSpec;
use crate::stats::{self, StatsSource};
use crate::{chat, completions};

pub struct AppInner {
    pub shared: Arc<Shared>,
    pub spec: ModelSpec,
    /// Required as `Authorization: Bearer <key>` when set.
    pub api_key: Option<String>,
    /// The backend's counters, for `/status`, `/v1/stats` and `/metrics`.
    pub backend: Arc<dyn StatsSource>,
}

/// The state every handler gets (cheap to clone).
#[derive(Clone)]
pub struct App(pub Arc<AppInner>);

impl std::ops::Deref for App {
    type Target = AppInner;
    fn deref(&self) -> &AppInner {
        &self.0
    }
}

pub fn router(app: App) -> Router {
    let api = Router::new()
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(text_completions))
        .route("/v1/sessions/{id}", delete(delete_session))
        .route("/status", get(status))
        .route("/v1/stats/summary", get(stats_summary))
        .route("/v1/stats/layers", get(stats_layers))
        .route("/v1/stats/layers/{layer}/experts", get(stats_experts))
        .route("/v1/stats/steps", get(stats_steps))
        .route("/metrics", get(metrics))
        .route_layer(middleware::from_fn_with_state(app.clone(), authorize));
    Router::new()
        .merge(api)
        .route("/health", get(|| async { axum::Json(json!({"status": "ok"})) }))
        .fallback(|method: Method, uri: Uri| async move {
            ApiError::not_found(format!("Unknown request URL: {method} {}", uri.path()))
        })
        .method_not_allowed_fallback(|method: Method, uri: Uri| async move {
            ApiError::method_not_allowed(format!("{method} is not allowed on {}", uri.path()))
        })
        .with_state(app)
}

/// Checks `Authorization: Bearer <key>` when the server has a key.
async fn authorize(State(app): State<App>, request: Request, next: Next) -> Response {
    if let Some(key) = &app.api_key {
        let given = request.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
        let token = given.and_then(|v| v.strip_prefix("Bearer ")).map(str::trim);
        match token {
            None => {
                return ApiError::unauthorized(
                    "You didn't provide an API key; send it as the header `Authorization: Bearer <key>`",
                )
                .into_response();
            }
            Some(t) if !constant_time_eq(t.as_bytes(), key.as_bytes()) => {
                return ApiError::unauthorized("Incorrect API key provided").into_response();
            }
            Some(_) => {}
        }
    }
    next.run(request).await
}

/// Compares without an early exit, so the time taken does not reveal how much of a key matched.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    for (i, &x) in a.iter().enumerate() {
        diff |= x ^ b.get(i).copied().unwrap_or(!x);
    }
    diff == 0
}

/// Reads the body up to `server.max_body` bytes (413 beyond).
async fn read_body(app: &App, headers: &HeaderMap, body: HttpBody) -> Result<Bytes, ApiError> {
    let limit = app.shared.live.get().server.max_body.0;
    let declared = headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(ApiError::too_large(limit));
    }
    axum::body::to_bytes(body, limit as usize).await.map_err(|_| ApiError::too_large(limit))
}

async fn chat_completions(State(app): State<App>, headers: HeaderMap, body: HttpBody) -> Response {
    let bytes = read_body(&app, &headers, body).await;
    let answer = match bytes {
        Ok(bytes) => chat::handle(app, headers, bytes).await,
        Err(e) => Err(e),
    };
    answer.unwrap_or_else(IntoResponse::into_response)
}

async fn text_completions(State(app): State<App>, headers: HeaderMap, body: HttpBody) -> Response {
    let bytes = read_body(&app, &headers, body).await;
    let answer = match bytes {
        Ok(bytes) => completions::handle(app, headers, bytes).await,
        Err(e) => Err(e),
    };
    answer.unwrap_or_else(IntoResponse::into_response)
}

fn model_json(app: &App, id: &str) -> serde_json::Value {
    json!({"id": id, "object": "model", "created": app.spec.created, "owned_by": "cherenkov"})
}

async fn models(State(app): State<App>) -> Response {
    let data: Vec<_> = app.spec.names.iter().map(|n| model_json(&app, n)).collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

async fn model(State(app): State<App>, Path(id): Path<String>) -> Response {
    if app.spec.serves(&id) {
        axum::Json(model_json(&app, &id)).into_response()
    } else {
        ApiError::model_not_found(&id, &app.spec.names).into_response()
    }
}

/// Forgets a retained session's snapshots (404 when it has none).
async fn delete_session(State(app): State<App>, Path(id): Path<String>) -> Response {
    match app.shared.drop_session(id.clone()).await {
        Ok(true) => axum::Json(json!({"id": id, "object": "session", "deleted": true})).into_response(),
        Ok(false) => ApiError::not_found(format!("No retained session `{id}`")).param("session_id").into_response(),
        Err(_) => ApiError::unavailable("The server is shutting down").into_response(),
    }
}

async fn status(State(app): State<App>) -> Response {
    let mut v = serde_json::to_value(app.shared.status()).unwrap_or_default();
    v["expert_cache"] = serde_json::to_value(app.backend.pool_stats().total).unwrap_or_default();
    v["model"] = json!(app.spec.names);
    axum::Json(v).into_response()
}

fn stats_inputs(app: &App) -> stats::Inputs<'_> {
    stats::Inputs {
        backend: app.spec.backend,
        models: &app.spec.names,
        status: app.shared.status(),
        pool: app.backend.pool_stats(),
        forward: app.backend.forward_stats(),
        log: &app.shared.steps,
    }
}

async fn stats_summary(State(app): State<App>) -> Response {
    axum::Json(stats::summary(stats_inputs(&app))).into_response()
}

async fn stats_layers(State(app): State<App>) -> Response {
    axum::Json(stats::layers(&app.backend.pool_stats())).into_response()
}

async fn stats_experts(State(app): State<App>, Path(layer): Path<String>) -> Response {
    let pool = app.backend.pool_stats();
    let n = pool.layers.len();
    let not_found = || {
        ApiError::not_found(format!("No MoE layer `{layer}`: the model has {n} (0 to {})", n.saturating_sub(1)))
            .param("layer")
            .into_response()
    };
    let Ok(l) = layer.parse::<usize>() else { return not_found() };
    match app.backend.expert_stats(l) {
        Some(experts) if l < n => axum::Json(stats::experts(&pool, l, experts)).into_response(),
        _ => not_found(),
    }
}

async fn stats_steps(State(app): State<App>) -> Response {
    axum::Json(stats::steps(&app.shared.steps)).into_response()
}

async fn metrics(State(app): State<App>) -> Response {
    let text = stats::prometheus(stats_inputs(&app));
    ([(header::CONTENT_TYPE, stats::PROMETHEUS_CONTENT_TYPE)], text).into_response()
}

#[cfg(test)]
mod tests {
    use super::constant_time_eq;

    #[test]
    fn key_comparison() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"x"));
        assert!(constant_time_eq(b"", b""));
    }
}
