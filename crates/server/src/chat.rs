//! `POST /v1/chat/completions`: messages rendered with the checkpoint's chat template (thinking
//! disabled), generated as one assistant message.

use axum::body::Bytes;
use axum::http::HeaderMap;
use axum::response::Response;
use cherenkov_engine::chat::Message;
use cherenkov_engine::tokenizer::Tokenizer;
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::job::{Finish, GenParams, GenToken, TokenLogprob, Usage};
use crate::request::{self, Body, refuse_unsupported, top_count, wrong_type};
use crate::respond::{ChunkFormat, Collected, Meta, lp, off_runtime, respond, submit};
use crate::routes::App;

/// A checked chat request, tokenized.
struct Prepared {
    model: String,
    stream: bool,
    include_usage: bool,
    logprobs: bool,
    prompt: Vec<u32>,
    snapshot_at: Vec<usize>,
    params: GenParams,
    session_id: Option<String>,
}

pub async fn handle(app: App, headers: HeaderMap, bytes: Bytes) -> Result<Response, ApiError> {
    let p = off_runtime(&app, headers, bytes, prepare).await?;
    let sub = submit(&app, "chatcmpl", p.prompt, p.snapshot_at, p.params, p.session_id)?;
    let meta = Meta::new(&app, sub.id, sub.created, p.model);
    let tokenizer = app.spec.tokenizer.clone();
    let format = ChatChunks { meta, tokenizer, logprobs: p.logprobs, include_usage: p.include_usage };
    respond(sub.rx, p.stream, format).await
}

fn prepare(app: &App, headers: &HeaderMap, bytes: &[u8]) -> Result<Prepared, ApiError> {
    let body = Body::parse(bytes)?;
    let config = app.shared.live.get();
    let spec = &app.spec;
    let common = request::common(&body, headers, spec, &config)?;
    refuse_unsupported(
        &body,
        &[
            ("tools", "this server generates plain text"),
            ("functions", "this server generates plain text"),
            ("audio", "this server generates text only"),
            ("prediction", "predicted outputs are not implemented"),
        ],
    )?;
    if let Some(rf) = body.raw("response_format") {
        let t = rf.get("type").and_then(Value::as_str);
        if t != Some("text") {
            return Err(ApiError::invalid("response_format", "Only response_format {\"type\": \"text\"} is supported"));
        }
    }
    let messages = messages(&body)?;
    let template = spec.template.as_ref().ok_or_else(|| {
        ApiError::invalid("messages", "This model has no chat template; use /v1/completions with a prompt")
    })?;
    let render = |generation_prompt: bool| {
        let text = template
            .render(&messages, generation_prompt)
            // The template's origin is a path on this machine: not the client's business.
            .map_err(|e| {
                let why = format!("{e:#}").replace(&format!("chat template {}", template.origin()), "chat template");
                ApiError::invalid("messages", format!("The chat template refused the messages ({why})"))
            })?;
        spec.tokenizer.encode(&text, false).map_err(|e| ApiError::invalid("messages", format!("{e:#}")))
    };
    let prompt = render(true)?;
    if prompt.is_empty() {
        return Err(ApiError::invalid("messages", "The messages render to an empty prompt"));
    }
    // The conversation without the generation prompt is what the next turn repeats: snapshot there.
    let history = render(false)?;
    let snapshot_at = if !history.is_empty() && history.len() < prompt.len() && prompt.starts_with(&history) {
        vec![history.len()]
    } else {
        Vec::new()
    };

    let logprobs = body.bool("logprobs")?.unwrap_or(false);
    let top = top_count(&body, "top_logprobs", &config)?;
    if top.is_some() && !logprobs {
        return Err(ApiError::invalid("top_logprobs", "top_logprobs requires logprobs: true"));
    }
    let newer = body.int("max_completion_tokens", 0..=i64::MAX)?.map(|n| (n, "max_completion_tokens"));
    let requested = newer.or(body.int("max_tokens", 0..=i64::MAX)?.map(|n| (n, "max_tokens")));
    let max_tokens = request::max_tokens(
        requested.map(|r| r.0),
        requested.map_or("max_tokens", |r| r.1),
        prompt.len(),
        "messages",
        spec,
        &config,
    )?;
    let params = GenParams {
        max_tokens,
        sampling: common.sampling,
        logit_bias: common.logit_bias,
        stop_tokens: spec.eos.clone(),
        stop_sequences: common.stop_sequences,
        stop_strings: common.stop_strings,
        logprobs: logprobs.then(|| top.unwrap_or(0)),
        prompt_logprobs: None,
    };
    Ok(Prepared {
        model: common.model,
        stream: common.stream,
        include_usage: common.include_usage,
        logprobs,
        prompt,
        snapshot_at,
        params,
        session_id: common.session_id,
    })
}

/// `messages`: objects with a `role` and a `content` that is a string, null, or an array of text
/// parts. `developer` is the newer spelling of `system`.
fn messages(body: &Body) -> Result<Vec<Message>, ApiError> {
    let list = match body.raw("messages") {
        Some(Value::Array(a)) if !a.is_empty() => a,
        Some(Value::Array(_)) => return Err(ApiError::invalid("messages", "'messages' is empty; give at least one")),
        Some(v) => return Err(wrong_type("messages", "an array of messages", v)),
        None => return Err(ApiError::invalid("messages", "Missing required parameter: 'messages'")),
    };
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let at = |field: &str| format!("messages[{i}].{field}");
            let obj = m.as_object().ok_or_else(|| wrong_type(&format!("messages[{i}]"), "an object", m))?;
            let role = match obj.get("role") {
                Some(Value::String(r)) => r.as_str(),
                Some(v) => return Err(wrong_type(&at("role"), "a string", v)),
                None => {
                    return Err(ApiError::invalid(at("role"), format!("Missing required parameter: '{}'", at("role"))));
                }
            };
            let role = if role == "developer" { "system" } else { role };
            let content = match obj.get("content") {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => text_parts(parts, &at("content"))?,
                Some(v) => return Err(wrong_type(&at("content"), "a string or an array of text parts", v)),
            };
            Ok(Message::new(role, content))
        })
        .collect()
}

fn text_parts(parts: &[Value], param: &str) -> Result<String, ApiError> {
    let mut text = String::new();
    for (j, part) in parts.iter().enumerate() {
        let p = format!("{param}[{j}]");
        match (part.get("type").and_then(Value::as_str), part.get("text")) {
            (Some("text"), Some(Value::String(t))) => text.push_str(t),
            (Some("text"), other) => {
                return Err(wrong_type(&format!("{p}.text"), "a string", other.unwrap_or(&Value::Null)));
            }
            (Some(t), _) => {
                return Err(ApiError::invalid(
                    format!("{p}.type"),
                    format!("Content parts of type '{t}' are not supported; this model reads text"),
                ));
            }
            (None, _) => return Err(ApiError::invalid(format!("{p}.type"), "Each content part needs a 'type'")),
        }
    }
    Ok(text)
}

fn token_entry(tok: &Tokenizer, id: u32, logprob: f32) -> Value {
    let bytes = tok.token_bytes(id).unwrap_or_default();
    json!({"token": String::from_utf8_lossy(&bytes), "logprob": lp(logprob), "bytes": bytes})
}

/// `choices[].logprobs` of the chat API: one entry per generated token with its alternatives.
fn chat_logprobs(tok: &Tokenizer, tokens: &[GenToken]) -> Value {
    let content: Vec<Value> = tokens
        .iter()
        .filter_map(|t| t.logprob.as_ref())
        .map(|l: &TokenLogprob| {
            let mut e = token_entry(tok, l.id, l.logprob.unwrap_or(f32::NEG_INFINITY));
            e["top_logprobs"] = l.top.iter().map(|&(id, p)| token_entry(tok, id, p)).collect();
            e
        })
        .collect();
    json!({"content": content, "refusal": null})
}

struct ChatChunks {
    meta: Meta,
    tokenizer: Tokenizer,
    logprobs: bool,
    include_usage: bool,
}

impl ChatChunks {
    fn chunk(&self, delta: Value, logprobs: Value, finish: Option<Finish>) -> Value {
        let choice =
            json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish.map(Finish::as_str)});
        self.meta.object("chat.completion.chunk", json!([choice]), None)
    }
}

impl ChunkFormat for ChatChunks {
    fn prompt(&mut self, _cached: usize, _logprobs: Option<Vec<TokenLogprob>>) -> Vec<Value> {
        vec![self.chunk(json!({"role": "assistant", "content": ""}), Value::Null, None)]
    }

    fn text(&mut self, text: String, tokens: Vec<GenToken>) -> Vec<Value> {
        if text.is_empty() && !self.logprobs {
            return Vec::new(); // a token that holds part of a character: nothing to show yet
        }
        let logprobs = if self.logprobs { chat_logprobs(&self.tokenizer, &tokens) } else { Value::Null };
        vec![self.chunk(json!({"content": text}), logprobs, None)]
    }

    fn whole(self, c: Collected) -> Value {
        let logprobs = self.logprobs.then(|| chat_logprobs(&self.tokenizer, &c.tokens));
        let choice = json!([{
            "index": 0,
            "message": {"role": "assistant", "content": c.text, "refusal": null},
            "logprobs": logprobs,
            "finish_reason": c.finish.as_str(),
        }]);
        self.meta.object("chat.completion", choice, Some(&c.usage))
    }

    fn done(&mut self, finish: Finish, usage: Usage) -> Vec<Value> {
        let mut out = vec![self.chunk(json!({}), Value::Null, Some(finish))];
        if self.include_usage {
            out.push(self.meta.object("chat.completion.chunk", json!([]), Some(&usage)));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_accept_text_parts_and_refuse_the_rest() {
        let body = Body::parse(
            br#"{"messages": [{"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": null}]}"#,
        )
        .unwrap();
        let m = messages(&body).unwrap();
        assert_eq!(m, vec![Message::system("be brief"), Message::user("ab"), Message::assistant("")]);
        let bad = |s: &str| messages(&Body::parse(s.as_bytes()).unwrap()).unwrap_err();
        assert_eq!(bad(r#"{"messages": []}"#).param.as_deref(), Some("messages"));
        assert_eq!(bad(r#"{"messages": [{"role": 3}]}"#).param.as_deref(), Some("messages[0].role"));
        let e = bad(r#"{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}"#);
        assert_eq!(e.param.as_deref(), Some("messages[0].content[0].type"));
        assert_eq!(
            bad(r#"{"messages": [{"role": "user", "content": 5}]}"#).param.as_deref(),
            Some("messages[0].content")
        );
    }
}
