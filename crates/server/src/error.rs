//! Errors as the OpenAI API spells them: `{"error": {"message", "type", "param", "code"}}` with the
//! matching HTTP status, so the official clients raise their usual exception types.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// `invalid_request_error`, `authentication_error`, `rate_limit_error`, `server_error`, ...
    pub kind: &'static str,
    /// The request field at fault (`messages[0].content`, `max_tokens`), if one is.
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self { status, message: message.into(), kind, param: None, code: None }
    }

    /// 400: the request is wrong; `param` names the field.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message).param(param)
    }

    /// 400 about the request as a whole (a body that is not JSON, say).
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "invalid_request_error", message).code("invalid_api_key")
    }

    pub fn model_not_found(model: &str, served: &[String]) -> Self {
        let msg = format!("The model `{model}` does not exist; this server serves {}", served.join(", "));
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", msg).param("model").code("model_not_found")
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", message).code("not_found")
    }

    pub fn method_not_allowed(message: impl Into<String>) -> Self {
        Self::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", message)
    }

    pub fn too_large(limit: u64) -> Self {
        let msg = format!("The request body is larger than this server accepts ({limit} bytes; server.max_body)");
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", msg).code("request_too_large")
    }

    /// 429: every decoding slot is busy and the queue is full.
    pub fn queue_full(active: usize, queued: usize) -> Self {
        let msg = format!(
            "The server is busy: {active} requests are decoding and {queued} are waiting, which is all it \
             queues (scheduler.queue_size); retry later"
        );
        Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", msg).code("rate_limit_exceeded")
    }

    pub fn timeout(secs: u64) -> Self {
        let msg = format!("The request did not finish within {secs} s (server.request_timeout_secs)");
        Self::new(StatusCode::GATEWAY_TIMEOUT, "timeout_error", msg).code("timeout")
    }

    pub fn context_length(message: impl Into<String>, param: &str) -> Self {
        Self::invalid(param, message).code("context_length_exceeded")
    }

    pub fn server(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message)
    }

    pub fn param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    pub fn code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            r.headers_mut().insert("retry-after", axum::http::HeaderValue::from_static("1"));
        }
        r
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status.as_u16(), self.message)
    }
}
