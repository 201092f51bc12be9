//! The checkpoint's Jinja chat template, rendered the way transformers' `apply_chat_template` does,
//! and the set of end-of-sequence ids.
//!
//! The prompt a model sees must be byte-for-byte the one it was trained on, so rendering mirrors
//! transformers: `trim_blocks` and `lstrip_blocks` on, no auto-escaping, loop controls, Python
//! string and dict methods (`.strip()`, `.split()`, `.items()`, via minijinja-contrib's pycompat),
//! `raise_exception`, `strftime_now`, and a `tojson` that formats like Python's `json.dumps`
//! (transformers' own filter) rather than minijinja's compact, HTML-escaping one. Thinking is always
//! disabled (`enable_thinking=false`): the engine serves plain answers.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use minijinja::value::{Kwargs, Value};
use minijinja::{AutoEscape, Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

use crate::tokenizer::Tokenizer;

/// One chat message as the template sees it (`message.role`, `message.content`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self { role: role.into(), content: content.into() }
    }

    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// A compiled chat template with the special tokens transformers passes to it.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Where the template came from (a file, or a key in a file); also the template's name
    /// inside the environment, so every error can say which template failed.
    origin: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

/// The error `raise_exception` produces, attached as the minijinja error's source so that
/// [`describe`] can tell the template's own message from an engine error.
#[derive(Debug)]
struct TemplateException(String);

impl std::fmt::Display for TemplateException {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TemplateException {}

impl ChatTemplate {
    /// Finds the template of a checkpoint directory, in the order transformers prefers:
    /// `chat_template.jinja`, then `chat_template.json` (`{"chat_template": ...}`), then the
    /// `chat_template` key of `tokenizer_config.json`. The last two may hold a string or a list of
    /// `{name, template}`, of which the one named `default` is used. `Ok(None)` when the
    /// checkpoint has no template (a base model).
    ///
    /// `bos_token` / `eos_token` come from `tokenizer_config.json` when it names them.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Option<Self>> {
        let dir = dir.as_ref();
        let config_path = dir.join("tokenizer_config.json");
        let config = read_json_if_exists(&config_path)?;
        let bos_token = config.as_ref().and_then(|c| token_content(c.get("bos_token")));
        let eos_token = config.as_ref().and_then(|c| token_content(c.get("eos_token")));

        let jinja_path = dir.join("chat_template.jinja");
        if jinja_path.is_file() {
            let source = std::fs::read_to_string(&jinja_path)
                .with_context(|| format!("{}: cannot read the chat template", jinja_path.display()))?;
            let origin = jinja_path.display().to_string();
            return Self::new(&source, origin, bos_token, eos_token).map(Some);
        }

        let json_path = dir.join("chat_template.json");
        if let Some(json) = read_json_if_exists(&json_path)? {
            let source = template_from_value(json.get("chat_template"), &json_path)?
                .ok_or_else(|| anyhow!("{}: expected an object with a `chat_template` string", json_path.display()))?;
            let origin = format!("{} (chat_template)", json_path.display());
            return Self::new(&source, origin, bos_token, eos_token).map(Some);
        }

        if let Some(config) = &config
            && let Some(source) = template_from_value(config.get("chat_template"), &config_path)?
        {
            let origin = format!("{} (chat_template)", config_path.display());
            return Self::new(&source, origin, bos_token, eos_token).map(Some);
        }
        Ok(None)
    }

    /// Compiles `source`. `origin` names it in error messages (a path, or a path and key).
    pub fn new(
        source: &str,
        origin: impl Into<String>,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self> {
        let origin = origin.into();
        let mut env = Environment::new();
        // transformers: ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
        // extensions=[loopcontrols]); autoescape off. minijinja would otherwise pick JSON escaping
        // for a template named `....json`.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(origin.clone(), source.to_string()).map_err(|e| describe(&e, &origin))?;
        Ok(Self { env, origin, bos_token, eos_token })
    }

    /// Where the template came from.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Renders the conversation. With `add_generation_prompt` the result ends with the opening
    /// of the assistant's turn, ready for generation.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let mut ctx: BTreeMap<&str, Value> = BTreeMap::new();
        ctx.insert("messages", Value::from_serialize(messages));
        ctx.insert("add_generation_prompt", Value::from(add_generation_prompt));
        // transformers passes these as Python None when the caller gives none.
        ctx.insert("tools", Value::from(()));
        ctx.insert("documents", Value::from(()));
        ctx.insert("enable_thinking", Value::from(false));
        if let Some(bos) = &self.bos_token {
            ctx.insert("bos_token", Value::from(bos.as_str()));
        }
        if let Some(eos) = &self.eos_token {
            ctx.insert("eos_token", Value::from(eos.as_str()));
        }
        let template = self.env.get_template(&self.origin).map_err(|e| describe(&e, &self.origin))?;
        template.render(&ctx).map_err(|e| describe(&e, &self.origin))
    }
}

/// The end-of-sequence ids generation should stop at: the union, in this order and without
/// duplicates, of `config_eos` (the model config's `eos_token_id`), `generation_config.json`'s
/// `eos_token_id` (an int or a list) and `tokenizer_config.json`'s `eos_token` (a token string,
/// or an object with `content`, mapped through the tokenizer).
///
/// Qwen checkpoints disagree between these files (`<|endoftext|>` in one, `<|im_end|>` in
/// another) and a chat model must stop at either, hence the union. Missing or malformed files
/// and unknown tokens contribute nothing: these sources only add stop ids.
pub fn eos_token_ids(dir: impl AsRef<Path>, config_eos: &[u32], tok: &Tokenizer) -> Vec<u32> {
    let dir = dir.as_ref();
    let mut ids: Vec<u32> = Vec::new();
    let mut add = |id: u32| {
        if !ids.contains(&id) {
            ids.push(id);
        }
    };
    config_eos.iter().copied().for_each(&mut add);

    if let Ok(Some(generation)) = read_json_if_exists(&dir.join("generation_config.json")) {
        match generation.get("eos_token_id") {
            Some(Json::Number(n)) => n.as_u64().and_then(to_u32).into_iter().for_each(&mut add),
            Some(Json::Array(list)) => list.iter().filter_map(|v| v.as_u64().and_then(to_u32)).for_each(&mut add),
            _ => {}
        }
    }

    if let Ok(Some(config)) = read_json_if_exists(&dir.join("tokenizer_config.json"))
        && let Some(token) = token_content(config.get("eos_token"))
        && let Some(id) = tok.token_to_id(&token)
    {
        add(id);
    }
    ids
}

fn to_u32(v: u64) -> Option<u32> {
    u32::try_from(v).ok()
}

/// Reads and parses a JSON file; `Ok(None)` when it does not exist.
fn read_json_if_exists(path: &Path) -> Result<Option<Json>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("{}: cannot read", path.display())),
    };
    let json = serde_json::from_str(&text).with_context(|| format!("{}: expected a JSON document", path.display()))?;
    Ok(Some(json))
}

/// A special token as `tokenizer_config.json` writes it: a string, or an `AddedToken` object
/// with `content`.
fn token_content(value: Option<&Json>) -> Option<String> {
    match value? {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// A `chat_template` value: a string, or a list of `{name, template}` of which `default` is used.
fn template_from_value(value: Option<&Json>, path: &Path) -> Result<Option<String>> {
    match value {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Array(list)) => {
            let mut names = Vec::new();
            for entry in list {
                let name = entry.get("name").and_then(Json::as_str);
                let template = entry.get("template").and_then(Json::as_str);
                match (name, template) {
                    (Some("default"), Some(t)) => return Ok(Some(t.to_string())),
                    (Some(n), Some(_)) => names.push(n.to_string()),
                    _ => bail!(
                        "{}: chat_template list entries must be objects with `name` and `template` strings",
                        path.display()
                    ),
                }
            }
            bail!("{}: chat_template lists templates {names:?} but none named \"default\"", path.display())
        }
        Some(other) => {
            bail!("{}: chat_template must be a string or a list of {{name, template}}, found {other}", path.display())
        }
    }
}

/// Formats a minijinja error with the template's origin and line. An error raised by the
/// template itself (`raise_exception`) keeps its message verbatim.
fn describe(err: &Error, origin: &str) -> anyhow::Error {
    let location = match err.line() {
        Some(line) => format!("chat template {origin}, line {line}"),
        None => format!("chat template {origin}"),
    };
    let raised =
        std::error::Error::source(err).and_then(|s| s.downcast_ref::<TemplateException>()).map(|e| e.0.clone());
    match (raised, err.detail()) {
        (Some(message), _) => anyhow!("{location}: the template raised an error: {message}"),
        (None, Some(detail)) => anyhow!("{location}: {}: {detail}", err.kind()),
        (None, None) => anyhow!("{location}: {}", err.kind()),
    }
}

/// `raise_exception(message)`: templates reject conversations they cannot format this way.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(TemplateException(message)))
}

/// `strftime_now(format)`: the current time formatted like Python's `strftime`. The engine has
/// no time-zone database, so this is UTC (transformers uses the server's local time, which is
/// UTC on most servers).
fn strftime_now(format: String) -> Result<Value, Error> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("clock before 1970: {e}")))?;
    strftime(now.as_secs() as i64, &format).map(Value::from)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];

/// Python's `strftime` for a UTC timestamp, for the directives chat templates use.
fn strftime(unix_secs: i64, format: &str) -> Result<String, Error> {
    let days = unix_secs.div_euclid(86_400);
    let secs = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    // 1970-01-01 was a Thursday (index 3 with Monday = 0).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let year_day = days - days_from_civil(year, 1, 1) + 1;
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let directive = chars.next().ok_or_else(|| {
            Error::new(ErrorKind::InvalidOperation, format!("strftime_now: format {format:?} ends with a lone '%'"))
        })?;
        let piece = match directive {
            'Y' => format!("{year}"),
            'y' => format!("{:02}", year.rem_euclid(100)),
            'm' => format!("{month:02}"),
            'd' => format!("{day:02}"),
            'e' => format!("{day:>2}"),
            'B' => MONTHS[month as usize - 1].to_string(),
            'b' | 'h' => MONTHS[month as usize - 1][..3].to_string(),
            'A' => WEEKDAYS[weekday].to_string(),
            'a' => WEEKDAYS[weekday][..3].to_string(),
            'u' => format!("{}", weekday + 1),
            'w' => format!("{}", (weekday + 1) % 7),
            'j' => format!("{year_day:03}"),
            'H' => format!("{hour:02}"),
            'I' => format!("{hour12:02}"),
            'M' => format!("{minute:02}"),
            'S' => format!("{second:02}"),
            'p' => (if hour < 12 { "AM" } else { "PM" }).to_string(),
            'F' => format!("{year}-{month:02}-{day:02}"),
            'T' => format!("{hour:02}:{minute:02}:{second:02}"),
            'Z' => "UTC".to_string(),
            'z' => "+0000".to_string(),
            '%' => "%".to_string(),
            other => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: unsupported directive %{other} in {format:?} (expected one of \
                         %Y %y %m %d %e %B %b %h %A %a %u %w %j %H %I %M %S %p %F %T %Z %z %%)"
                    ),
                ));
            }
        };
        out.push_str(&piece);
    }
    Ok(out)
}

/// Days since 1970-01-01 to (year, month, day) in the proleptic Gregorian calendar
/// (Howard Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// The inverse of [`civil_from_days`].
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let yoe = year.rem_euclid(400);
    let month = i64::from(month);
    let doy = (153 * (if month > 2 { month - 3 } else { month + 9 }) + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=indent,
/// separators=separators, sort_keys=sort_keys)`. Python's separators differ from minijinja's
/// built-in filter (`", "` and `": "` without indent), and it does not HTML-escape `<`, `>`, `&`
/// and `'`; tool schemas rendered with the wrong spelling would not match training.
fn tojson(value: Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let invalid = |msg: String| Error::new(ErrorKind::InvalidOperation, msg);
    let indent = match indent {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    let indent: Option<String> = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => {
            if let Some(s) = v.as_str() {
                Some(s.to_string())
            } else if let Some(n) = v.as_usize() {
                Some(" ".repeat(n))
            } else {
                return Err(invalid(format!("tojson: indent must be a non-negative integer or a string, found {v}")));
            }
        }
    };
    let sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    let ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let (item_sep, key_sep) = match separators {
        Some(seps) if seps.len() == 2 => (seps[0].clone(), seps[1].clone()),
        Some(seps) => {
            return Err(invalid(format!(
                "tojson: separators must be a pair (item, key), found {} strings",
                seps.len()
            )));
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let json = serde_json::to_value(&value)
        .map_err(|e| invalid(format!("tojson: value is not representable as JSON: {e}")))?;
    let style = JsonStyle { indent, item_sep, key_sep, sort_keys, ensure_ascii };
    let mut out = String::new();
    style.write(&json, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

/// The knobs of Python's `json.dumps`.
struct JsonStyle {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl JsonStyle {
    fn write(&self, value: &Json, depth: usize, out: &mut String) {
        match value {
            Json::Array(items) if !items.is_empty() => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    self.separate(i, depth + 1, out);
                    self.write(item, depth + 1, out);
                }
                self.close(depth, out);
                out.push(']');
            }
            Json::Object(map) if !map.is_empty() => {
                let mut entries: Vec<(&String, &Json)> = map.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (key, item)) in entries.into_iter().enumerate() {
                    self.separate(i, depth + 1, out);
                    self.string(key, out);
                    out.push_str(&self.key_sep);
                    self.write(item, depth + 1, out);
                }
                self.close(depth, out);
                out.push('}');
            }
            Json::Array(_) => out.push_str("[]"),
            Json::Object(_) => out.push_str("{}"),
            Json::String(s) => self.string(s, out),
            Json::Number(n) => out.push_str(&n.to_string()),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Null => out.push_str("null"),
        }
    }

    /// Before the `index`-th element of a container whose elements sit at `depth`.
    fn separate(&self, index: usize, depth: usize, out: &mut String) {
        if index > 0 {
            out.push_str(&self.item_sep);
        }
        self.newline(depth, out);
    }

    fn close(&self, depth: usize, out: &mut String) {
        self.newline(depth, out);
    }

    fn newline(&self, depth: usize, out: &mut String) {
        if let Some(indent) = &self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(indent);
            }
        }
    }

    fn string(&self, s: &str, out: &mut String) {
        // serde_json escapes exactly what Python does with ensure_ascii=False: `"`, `\`, and the
        // control characters (as \n, \t, ... or \u00XX).
        let quoted = serde_json::to_string(s).unwrap_or_default();
        if !self.ensure_ascii {
            out.push_str(&quoted);
            return;
        }
        for c in quoted.chars() {
            if c.is_ascii() {
                out.push(c);
            } else {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_formats_known_instants() {
        // 2024-02-29 13:05:09 UTC, a Thursday, day 60 of a leap year.
        let t = 1_709_211_909;
        assert_eq!(strftime(t, "%Y-%m-%d %H:%M:%S").unwrap(), "2024-02-29 13:05:09");
        assert_eq!(strftime(t, "%d %b %Y").unwrap(), "29 Feb 2024");
        assert_eq!(strftime(t, "%A, %B %e, %y %I%p %j %%").unwrap(), "Thursday, February 29, 24 01PM 060 %");
        assert_eq!(strftime(0, "%F %T %a %u %w").unwrap(), "1970-01-01 00:00:00 Thu 4 4");
        // 1969-12-31 23:59:59, before the epoch.
        assert_eq!(strftime(-1, "%F %T %A").unwrap(), "1969-12-31 23:59:59 Wednesday");
        let err = strftime(t, "%Q").unwrap_err();
        assert!(err.to_string().contains("%Q"), "{err}");
    }

    #[test]
    fn civil_days_round_trip() {
        for days in (-800_000..800_000).step_by(997) {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days);
        }
    }

    fn render_tojson(template: &str, ctx: Json) -> String {
        let t = ChatTemplate::new(template, "test", None, None).unwrap();
        let tmpl = t.env.get_template("test").unwrap();
        tmpl.render(Value::from_serialize(&ctx)).unwrap()
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let ctx = serde_json::json!({
            "x": {"name": "f<x>", "args": [1, 2.5, true, null], "empty": {}, "d": "é\n\"q\""}
        });
        assert_eq!(
            render_tojson("{{ x | tojson }}", ctx.clone()),
            r#"{"name": "f<x>", "args": [1, 2.5, true, null], "empty": {}, "d": "é\n\"q\""}"#
        );
        assert_eq!(
            render_tojson("{{ x.args | tojson(indent=2) }}", ctx.clone()),
            "[\n  1,\n  2.5,\n  true,\n  null\n]"
        );
        assert_eq!(
            render_tojson("{{ x | tojson(sort_keys=true, separators=[',', ':']) }}", ctx.clone()),
            r#"{"args":[1,2.5,true,null],"d":"é\n\"q\"","empty":{},"name":"f<x>"}"#
        );
        assert_eq!(render_tojson("{{ x.d | tojson(ensure_ascii=true) }}", ctx), r#""\u00e9\n\"q\"""#);
    }
}
