//! `POST /v1/completions`: a raw prompt (text or token ids) continued as it is, with `echo` and
//! prompt log-probabilities for scoring.

use axum::body::Bytes;
use axum::http::HeaderMap;
use axum::response::Response;
use cherenkov_engine::tokenizer::Tokenizer;
use serde_json::{Map, Value, json};

use crate::error::ApiError;
use crate::job::{Finish, GenParams, GenToken, TokenLogprob, Usage};
use crate::request::{self, Body, refuse_unsupported, token_id, top_count, wrong_type};
use crate::respond::{ChunkFormat, Collected, Meta, lp, off_runtime, respond, submit};
use crate::routes::App;
use crate::spec::ModelSpec;

struct Prepared {
    model: String,
    stream: bool,
    include_usage: bool,
    echo: bool,
    /// The prompt as text (what `echo` returns).
    prompt_text: String,
    prompt: Vec<u32>,
    params: GenParams,
    session_id: Option<String>,
}

pub async fn handle(app: App, headers: HeaderMap, bytes: Bytes) -> Result<Response, ApiError> {
    let p = off_runtime(&app, headers, bytes, prepare).await?;
    let logprobs = p.params.logprobs.is_some();
    let echo = p.echo.then(|| (p.prompt_text, p.prompt.clone()));
    let sub = submit(&app, "cmpl", p.prompt, Vec::new(), p.params, p.session_id)?;
    let meta = Meta::new(&app, sub.id, sub.created, p.model);
    let tokenizer = app.spec.tokenizer.clone();
    let format = Chunks { meta, tokenizer, logprobs, include_usage: p.include_usage, echo, base_offset: 0 };
    respond(sub.rx, p.stream, format).await
}

fn prepare(app: &App, headers: &HeaderMap, bytes: &[u8]) -> Result<Prepared, ApiError> {
    let body = Body::parse(bytes)?;
    let config = app.shared.live.get();
    let spec = &app.spec;
    let common = request::common(&body, headers, spec, &config)?;
    refuse_unsupported(&body, &[("suffix", "this model does not fill in the middle")])?;
    if let Some(b) = body.int("best_of", 1..=i64::MAX)?
        && b != 1
    {
        return Err(ApiError::invalid("best_of", "Only best_of = 1 is supported"));
    }
    let (prompt_text, prompt) = prompt(&body, spec)?;
    let echo = body.bool("echo")?.unwrap_or(false);
    let logprobs = top_count(&body, "logprobs", &config)?;
    let requested = body.int("max_tokens", 0..=i64::MAX)?;
    let max_tokens = request::max_tokens(requested, "max_tokens", prompt.len(), "prompt", spec, &config)?;
    let params = GenParams {
        max_tokens,
        sampling: common.sampling,
        logit_bias: common.logit_bias,
        stop_tokens: spec.eos.clone(),
        stop_sequences: common.stop_sequences,
        stop_strings: common.stop_strings,
        logprobs,
        prompt_logprobs: if echo { logprobs } else { None },
    };
    Ok(Prepared {
        model: common.model,
        stream: common.stream,
        include_usage: common.include_usage,
        echo,
        prompt_text,
        prompt,
        params,
        session_id: common.session_id,
    })
}

/// `prompt`: a string or an array of token ids, or either wrapped in a one-element array.
fn prompt(body: &Body, spec: &ModelSpec) -> Result<(String, Vec<u32>), ApiError> {
    let missing = || ApiError::invalid("prompt", "Missing required parameter: 'prompt'");
    let mut value = body.raw("prompt").ok_or_else(missing)?;
    if let Value::Array(items) = value
        && items.first().is_some_and(|v| v.is_string() || v.is_array())
    {
        if items.len() > 1 {
            return Err(ApiError::invalid("prompt", "One prompt per request: send several requests instead"));
        }
        value = &items[0];
    }
    let tok = &spec.tokenizer;
    let (text, ids) = match value {
        Value::String(s) => {
            let ids = tok.encode(s, false).map_err(|e| ApiError::invalid("prompt", format!("{e:#}")))?;
            (s.clone(), ids)
        }
        Value::Array(items) => {
            let ids = items
                .iter()
                .enumerate()
                .map(|(i, v)| token_id(v, &format!("prompt[{i}]"), spec))
                .collect::<Result<Vec<u32>, _>>()?;
            let text = tok.decode(&ids, false).map_err(|e| ApiError::invalid("prompt", format!("{e:#}")))?;
            (text, ids)
        }
        v => return Err(wrong_type("prompt", "a string or an array of token ids", v)),
    };
    if ids.is_empty() {
        return Err(ApiError::invalid("prompt", "The prompt is empty; give at least one token"));
    }
    Ok((text, ids))
}

/// `choices[].logprobs` of the completions API: parallel lists over the (echoed and) generated
/// tokens.
#[derive(Default)]
struct Logprobs {
    tokens: Vec<Value>,
    token_logprobs: Vec<Value>,
    top_logprobs: Vec<Value>,
    text_offset: Vec<usize>,
}

fn token_text(tok: &Tokenizer, id: u32) -> String {
    String::from_utf8_lossy(&tok.token_bytes(id).unwrap_or_default()).into_owned()
}

fn top_map(tok: &Tokenizer, top: &[(u32, f32)]) -> Value {
    let mut m = Map::new();
    for &(id, p) in top {
        m.entry(token_text(tok, id)).or_insert_with(|| lp(p));
    }
    Value::Object(m)
}

impl Logprobs {
    /// The prompt's tokens; offsets count the characters decoded before each.
    fn prompt(&mut self, tok: &Tokenizer, ids: &[u32], lps: &[TokenLogprob]) {
        let mut decoder = tok.stream_decoder(false);
        let mut offset = 0;
        for (&id, l) in ids.iter().zip(lps) {
            self.tokens.push(token_text(tok, id).into());
            self.text_offset.push(offset);
            offset += decoder.push(id).map(|s| s.chars().count()).unwrap_or(0);
            match l.logprob {
                Some(p) => {
                    self.token_logprobs.push(lp(p));
                    self.top_logprobs.push(top_map(tok, &l.top));
                }
                None => {
                    self.token_logprobs.push(Value::Null);
                    self.top_logprobs.push(Value::Null);
                }
            }
        }
    }

    fn generated(&mut self, tok: &Tokenizer, tokens: &[GenToken], base_offset: usize) {
        for t in tokens {
            let Some(l) = &t.logprob else { continue };
            self.tokens.push(token_text(tok, t.id).into());
            self.text_offset.push(base_offset + t.text_offset);
            self.token_logprobs.push(lp(l.logprob.unwrap_or(f32::NEG_INFINITY)));
            self.top_logprobs.push(top_map(tok, &l.top));
        }
    }

    fn into_json(self) -> Value {
        json!({
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        })
    }
}

struct Chunks {
    meta: Meta,
    tokenizer: Tokenizer,
    logprobs: bool,
    include_usage: bool,
    /// The prompt text and ids, when echoed.
    echo: Option<(String, Vec<u32>)>,
    /// Characters before the generated text (the echoed prompt's).
    base_offset: usize,
}

impl Chunks {
    fn chunk(&self, text: String, logprobs: Option<Logprobs>, finish: Option<Finish>) -> Value {
        let choice = json!({
            "text": text,
            "index": 0,
            "logprobs": logprobs.map(Logprobs::into_json),
            "finish_reason": finish.map(Finish::as_str),
        });
        self.meta.object("text_completion", json!([choice]), None)
    }
}

impl ChunkFormat for Chunks {
    fn prompt(&mut self, _cached: usize, logprobs: Option<Vec<TokenLogprob>>) -> Vec<Value> {
        let Some((text, ids)) = self.echo.take() else { return Vec::new() };
        self.base_offset = text.chars().count();
        let lps = match (self.logprobs, logprobs) {
            (true, Some(p)) => {
                let mut l = Logprobs::default();
                l.prompt(&self.tokenizer, &ids, &p);
                Some(l)
            }
            _ => None,
        };
        vec![self.chunk(text, lps, None)]
    }

    fn text(&mut self, text: String, tokens: Vec<GenToken>) -> Vec<Value> {
        if text.is_empty() && !self.logprobs {
            return Vec::new(); // a token that holds part of a character: nothing to show yet
        }
        let lps = self.logprobs.then(|| {
            let mut l = Logprobs::default();
            l.generated(&self.tokenizer, &tokens, self.base_offset);
            l
        });
        vec![self.chunk(text, lps, None)]
    }

    fn whole(self, c: Collected) -> Value {
        let mut text = String::new();
        let mut lps = self.logprobs.then(Logprobs::default);
        let mut base_offset = 0;
        if let Some((prompt_text, ids)) = &self.echo {
            text.push_str(prompt_text);
            if let (Some(l), Some(p)) = (&mut lps, &c.prompt_logprobs) {
                l.prompt(&self.tokenizer, ids, p);
            }
            base_offset = prompt_text.chars().count();
        }
        text.push_str(&c.text);
        if let Some(l) = &mut lps {
            l.generated(&self.tokenizer, &c.tokens, base_offset);
        }
        let choice = json!([{
            "text": text,
            "index": 0,
            "logprobs": lps.map(Logprobs::into_json),
            "finish_reason": c.finish.as_str(),
        }]);
        self.meta.object("text_completion", choice, Some(&c.usage))
    }

    fn done(&mut self, finish: Finish, usage: Usage) -> Vec<Value> {
        let mut out = vec![self.chunk(String::new(), None, Some(finish))];
        if self.include_usage {
            out.push(self.meta.object("text_completion", json!([]), Some(&usage)));
        }
        out
    }
}
