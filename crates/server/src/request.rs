//! Reading a request body into checked values: every field a request may send is looked at by name
//! and type here, so a bad one gets a 400 that names it (`param`) and says what was expected.
//!
//! Fields the server does not know are ignored (clients send extras such as `user` or `metadata`);
//! known fields of the wrong type, out of range, or asking for something unsupported (`n` > 1, tools)
//! are refused.

use axum::http::HeaderMap;
use cherenkov_engine::sampling::SamplingParams;
use serde_json::{Map, Value};

use crate::config::Config;
use crate::error::ApiError;
use crate::spec::ModelSpec;

/// Most stop strings and stop sequences together.
const MAX_STOPS: usize = 16;
/// Longest session id.
const MAX_SESSION_ID: usize = 256;

/// A parsed JSON object body.
pub struct Body(Map<String, Value>);

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The error for a field of the wrong type.
pub fn wrong_type(param: &str, expected: &str, got: &Value) -> ApiError {
    ApiError::invalid(param, format!("Invalid type for '{param}': expected {expected}, but got {}", kind(got)))
}

impl Body {
    /// UTF-8, then JSON, then an object.
    pub fn parse(bytes: &[u8]) -> Result<Body, ApiError> {
        let text = std::str::from_utf8(bytes).map_err(|e| {
            ApiError::bad_request(format!(
                "The request body is not valid UTF-8 (the bytes at offset {} are not a UTF-8 character)",
                e.valid_up_to()
            ))
        })?;
        if text.trim().is_empty() {
            return Err(ApiError::bad_request("The request body is empty; expected a JSON object"));
        }
        let value: Value = serde_json::from_str(text)
            .map_err(|e| ApiError::bad_request(format!("We could not parse the JSON body of your request: {e}")))?;
        match value {
            Value::Object(map) => Ok(Body(map)),
            other => {
                Err(ApiError::bad_request(format!("The request body must be a JSON object, not {}", kind(&other))))
            }
        }
    }

    /// The field, `None` when absent or null.
    pub fn raw(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    pub fn string(&self, key: &str) -> Result<Option<&str>, ApiError> {
        match self.raw(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(wrong_type(key, "a string", v)),
        }
    }

    pub fn bool(&self, key: &str) -> Result<Option<bool>, ApiError> {
        match self.raw(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(wrong_type(key, "a boolean", v)),
        }
    }

    /// A finite number within `range`.
    pub fn number(&self, key: &str, range: std::ops::RangeInclusive<f64>) -> Result<Option<f64>, ApiError> {
        let Some(v) = self.raw(key) else { return Ok(None) };
        let x = v.as_f64().ok_or_else(|| wrong_type(key, "a number", v))?;
        if !range.contains(&x) {
            return Err(ApiError::invalid(
                key,
                format!("Invalid value for '{key}': {x} is outside [{}, {}]", range.start(), range.end()),
            ));
        }
        Ok(Some(x))
    }

    /// An integer (`3` or `3.0`) within `range`.
    pub fn int(&self, key: &str, range: std::ops::RangeInclusive<i64>) -> Result<Option<i64>, ApiError> {
        let Some(v) = self.raw(key) else { return Ok(None) };
        let n = as_int(v).ok_or_else(|| wrong_type(key, "an integer", v))?;
        if !range.contains(&n) {
            let (lo, hi) = (range.start(), range.end());
            let bound = if *hi == i64::MAX { format!("at least {lo}") } else { format!("in [{lo}, {hi}]") };
            return Err(ApiError::invalid(key, format!("Invalid value for '{key}': {n} must be {bound}")));
        }
        Ok(Some(n))
    }
}

fn as_int(v: &Value) -> Option<i64> {
    match v {
        Value::Number(n) => {
            n.as_i64().or_else(|| n.as_f64().filter(|f| f.fract() == 0.0 && f.abs() < 9e18).map(|f| f as i64))
        }
        _ => None,
    }
}

/// A token id within the tokenizer's vocabulary.
pub fn token_id(v: &Value, param: &str, spec: &ModelSpec) -> Result<u32, ApiError> {
    let vocab = spec.tokenizer.vocab_size();
    match (v.as_u64(), v) {
        (Some(id), _) if (id as usize) < vocab && spec.tokenizer.id_to_token(id as u32).is_some() => Ok(id as u32),
        (Some(id), _) => {
            Err(ApiError::invalid(param, format!("Token id {id} is not in the vocabulary (ids are below {vocab})")))
        }
        (None, Value::Number(n)) => Err(ApiError::invalid(param, format!("{n} is not a token id (an integer >= 0)"))),
        (None, _) => Err(wrong_type(param, "a token id (an integer >= 0)", v)),
    }
}

/// What both endpoints take besides the prompt.
#[derive(Debug)]
pub struct Common {
    /// As the client spelled it (echoed in responses).
    pub model: String,
    pub stream: bool,
    pub include_usage: bool,
    pub sampling: SamplingParams,
    pub stop_strings: Vec<String>,
    pub stop_sequences: Vec<Vec<u32>>,
    pub logit_bias: Vec<(u32, f32)>,
    pub session_id: Option<String>,
}

pub fn common(body: &Body, headers: &HeaderMap, spec: &ModelSpec, config: &Config) -> Result<Common, ApiError> {
    let model = body.string("model")?.ok_or_else(|| {
        ApiError::invalid("model", "You must provide a model parameter (this server serves `cherenkov`)")
    })?;
    if !spec.serves(model) {
        return Err(ApiError::model_not_found(model, &spec.names));
    }
    if let Some(n) = body.int("n", 1..=i64::MAX)?
        && n != 1
    {
        return Err(ApiError::invalid("n", "Only n = 1 is supported: one choice per request"));
    }
    let stream = body.bool("stream")?.unwrap_or(false);
    let include_usage = match body.raw("stream_options") {
        None => false,
        Some(Value::Object(o)) => match o.get("include_usage") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(v) => return Err(wrong_type("stream_options.include_usage", "a boolean", v)),
        },
        Some(v) => return Err(wrong_type("stream_options", "an object", v)),
    };
    let (stop_strings, stop_sequences) = stops(body, spec)?;
    Ok(Common {
        model: model.to_string(),
        stream,
        include_usage,
        sampling: sampling(body, spec, config)?,
        stop_strings,
        stop_sequences,
        logit_bias: logit_bias(body, spec)?,
        session_id: session_id(body, headers)?,
    })
}

/// Request fields over the `[sampling]` configuration over the model's generation_config.json.
fn sampling(body: &Body, spec: &ModelSpec, config: &Config) -> Result<SamplingParams, ApiError> {
    let c = &config.sampling;
    let mut p = spec.sampling.clone();
    p.temperature = c.temperature.unwrap_or(p.temperature);
    p.top_p = c.top_p.unwrap_or(p.top_p);
    p.top_k = c.top_k.unwrap_or(p.top_k);
    p.presence_penalty = c.presence_penalty.unwrap_or(p.presence_penalty);
    p.frequency_penalty = c.frequency_penalty.unwrap_or(p.frequency_penalty);
    p.repetition_penalty = c.repetition_penalty.unwrap_or(p.repetition_penalty);
    p.seed = None;
    if let Some(t) = body.number("temperature", 0.0..=2.0)? {
        p.temperature = t as f32;
    }
    if let Some(t) = body.number("top_p", 0.0..=1.0)? {
        if t == 0.0 {
            return Err(ApiError::invalid("top_p", "Invalid value for 'top_p': it must be in (0, 1]"));
        }
        p.top_p = t as f32;
    }
    if let Some(k) = body.int("top_k", -1..=i64::from(u32::MAX))? {
        p.top_k = k.max(0) as usize;
    }
    if let Some(s) = body.raw("seed") {
        // OpenAI takes any 64-bit integer; negative seeds map onto the same generator bits.
        p.seed = Some(
            as_int(s).map(|n| n as u64).or_else(|| s.as_u64()).ok_or_else(|| wrong_type("seed", "an integer", s))?,
        );
    }
    if let Some(x) = body.number("presence_penalty", -2.0..=2.0)? {
        p.presence_penalty = x as f32;
    }
    if let Some(x) = body.number("frequency_penalty", -2.0..=2.0)? {
        p.frequency_penalty = x as f32;
    }
    if let Some(x) = body.number("repetition_penalty", 0.0..=100.0)? {
        if x == 0.0 {
            return Err(ApiError::invalid("repetition_penalty", "'repetition_penalty' must be > 0 (1 = off)"));
        }
        p.repetition_penalty = x as f32;
    }
    p.validate().map_err(|e| ApiError::bad_request(e.to_string()))?;
    Ok(p)
}

/// `stop`: a string, or an array whose items are strings or (an extension) arrays of token ids.
fn stops(body: &Body, spec: &ModelSpec) -> Result<(Vec<String>, Vec<Vec<u32>>), ApiError> {
    let (mut strings, mut sequences) = (Vec::new(), Vec::new());
    let items: Vec<&Value> = match body.raw("stop") {
        None => return Ok((strings, sequences)),
        Some(Value::String(s)) => {
            strings.push(s.clone());
            return Ok((strings, sequences));
        }
        Some(Value::Array(a)) => a.iter().collect(),
        Some(v) => return Err(wrong_type("stop", "a string or an array", v)),
    };
    if items.len() > MAX_STOPS {
        return Err(ApiError::invalid("stop", format!("At most {MAX_STOPS} stop strings or sequences are allowed")));
    }
    for (i, item) in items.into_iter().enumerate() {
        let param = format!("stop[{i}]");
        match item {
            Value::String(s) => strings.push(s.clone()),
            Value::Array(ids) if !ids.is_empty() => {
                let seq = ids
                    .iter()
                    .enumerate()
                    .map(|(j, v)| token_id(v, &format!("{param}[{j}]"), spec))
                    .collect::<Result<Vec<u32>, _>>()?;
                sequences.push(seq);
            }
            other => return Err(wrong_type(&param, "a string or a non-empty array of token ids", other)),
        }
    }
    Ok((strings, sequences))
}

/// `logit_bias`: `{"token id": bias}` with biases in [-100, 100].
fn logit_bias(body: &Body, spec: &ModelSpec) -> Result<Vec<(u32, f32)>, ApiError> {
    let map = match body.raw("logit_bias") {
        None => return Ok(Vec::new()),
        Some(Value::Object(m)) => m,
        Some(v) => return Err(wrong_type("logit_bias", "an object mapping token ids to numbers", v)),
    };
    let mut out = Vec::with_capacity(map.len());
    for (k, v) in map {
        let param = format!("logit_bias.{k}");
        let id: u64 = k.trim().parse().map_err(|_| ApiError::invalid(&param, format!("'{k}' is not a token id")))?;
        let id = token_id(&Value::from(id), &param, spec)?;
        let b = v.as_f64().ok_or_else(|| wrong_type(&param, "a number", v))?;
        if !(-100.0..=100.0).contains(&b) {
            return Err(ApiError::invalid(&param, format!("Invalid value for '{param}': {b} is outside [-100, 100]")));
        }
        out.push((id, b as f32));
    }
    Ok(out)
}

/// `session_id` in the body, or the `X-Session-Id` header.
fn session_id(body: &Body, headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let from_body = body.string("session_id")?.map(str::to_string);
    let from_header = match headers.get("x-session-id") {
        None => None,
        Some(h) => Some(
            h.to_str()
                .map_err(|_| ApiError::invalid("X-Session-Id", "The X-Session-Id header must be printable ASCII"))?
                .to_string(),
        ),
    };
    let id = match (from_body, from_header) {
        (Some(b), Some(h)) if b != h => {
            return Err(ApiError::invalid(
                "session_id",
                "session_id and the X-Session-Id header name different sessions",
            ));
        }
        (b, h) => b.or(h),
    };
    if let Some(id) = &id
        && (id.is_empty() || id.len() > MAX_SESSION_ID || id.chars().any(char::is_control))
    {
        return Err(ApiError::invalid(
            "session_id",
            format!("A session id is 1 to {MAX_SESSION_ID} bytes of printable characters"),
        ));
    }
    Ok(id)
}

/// The completion budget: `requested` (checked against the context) or the configured default,
/// never past the context. `prompt_param` names the prompt field for errors.
pub fn max_tokens(
    requested: Option<i64>,
    requested_param: &str,
    prompt_len: usize,
    prompt_param: &str,
    spec: &ModelSpec,
    config: &Config,
) -> Result<usize, ApiError> {
    let ctx = spec.max_context;
    if prompt_len > ctx {
        return Err(ApiError::context_length(
            format!(
                "This model's maximum context length is {ctx} tokens, but the prompt has {prompt_len} tokens; \
                 shorten it"
            ),
            prompt_param,
        ));
    }
    match requested {
        Some(m) if prompt_len as u64 + m as u64 > ctx as u64 => Err(ApiError::context_length(
            format!(
                "This model's maximum context length is {ctx} tokens, but you requested {} tokens \
                 ({prompt_len} in the prompt, {m} for the completion); lower {requested_param} or shorten the prompt",
                prompt_len as u64 + m as u64
            ),
            requested_param,
        )),
        Some(m) => Ok(m as usize),
        None => Ok(config.limits.default_max_tokens.min(ctx - prompt_len)),
    }
}

/// `logprobs`-style counts: at most `limits.max_top_logprobs`.
pub fn top_count(body: &Body, key: &str, config: &Config) -> Result<Option<usize>, ApiError> {
    Ok(body.int(key, 0..=config.limits.max_top_logprobs as i64)?.map(|n| n as usize))
}

/// Refuses fields that ask for features this server does not have.
pub fn refuse_unsupported(body: &Body, keys: &[(&str, &str)]) -> Result<(), ApiError> {
    for (key, why) in keys {
        let present = match body.raw(key) {
            None => false,
            Some(Value::Array(a)) => !a.is_empty(),
            Some(Value::String(s)) => !s.is_empty(),
            Some(_) => true,
        };
        if present {
            return Err(ApiError::invalid(*key, format!("'{key}' is not supported: {why}")));
        }
    }
    Ok(())
}
