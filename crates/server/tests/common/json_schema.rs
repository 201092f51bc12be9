//! A small JSON Schema validator: the subset `docs/stats.schema.json` uses (draft 2020-12 keywords
//! `type`, `enum`, `const`, `required`, `properties`, `additionalProperties: false`, `items`,
//! `minItems`, `maxItems`, `minimum`, `maximum`, `minLength`, local `$ref`, `oneOf`). A keyword it
//! does not know is an error, so the schema cannot silently rely on one it ignores. Shared by the
//! server's and the CLI's tests (`#[path]`).
#![allow(dead_code)]

use serde_json::Value;

pub struct Schema {
    root: Value,
}

const ANNOTATIONS: [&str; 4] = ["$schema", "$id", "title", "description"];

impl Schema {
    pub fn load(path: &std::path::Path) -> Schema {
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let root: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: not JSON: {e}", path.display()));
        Schema { root }
    }

    /// Errors (`/path: what`) of `doc` against `#/$defs/<def>` (or the root for `None`).
    pub fn errors(&self, def: Option<&str>, doc: &Value) -> Vec<String> {
        let schema = match def {
            Some(d) => self.resolve(&format!("#/$defs/{d}")),
            None => &self.root,
        };
        let mut errors = Vec::new();
        self.check(schema, doc, "", &mut errors);
        errors
    }

    /// Panics with every error unless `doc` is valid.
    pub fn assert_valid(&self, def: &str, doc: &Value) {
        let e = self.errors(Some(def), doc);
        assert!(e.is_empty(), "{def} does not match docs/stats.schema.json:\n  {}\n{doc:#}", e.join("\n  "));
    }

    fn resolve(&self, r: &str) -> &Value {
        let path = r.strip_prefix("#/").unwrap_or_else(|| panic!("only local $refs are supported: {r}"));
        path.split('/').fold(&self.root, |v, k| v.get(k).unwrap_or_else(|| panic!("$ref {r} resolves to nothing")))
    }

    fn check(&self, schema: &Value, v: &Value, at: &str, errors: &mut Vec<String>) {
        let s = schema.as_object().unwrap_or_else(|| panic!("schema at {at} is not an object: {schema}"));
        let here = if at.is_empty() { "/" } else { at };
        for (k, rule) in s {
            match k.as_str() {
                k if ANNOTATIONS.contains(&k) => {}
                "$defs" => {}
                "$ref" => self.check(self.resolve(rule.as_str().expect("$ref is a string")), v, at, errors),
                "type" => {
                    let types: Vec<&str> = match rule {
                        Value::String(t) => vec![t.as_str()],
                        Value::Array(a) => a.iter().map(|t| t.as_str().expect("type names are strings")).collect(),
                        _ => panic!("bad type at {at}: {rule}"),
                    };
                    if !types.iter().any(|t| is_type(v, t)) {
                        errors.push(format!("{here}: expected {}, found {}", types.join(" or "), short(v)));
                    }
                }
                "enum" => {
                    if !rule.as_array().expect("enum is a list").contains(v) {
                        errors.push(format!("{here}: {} is not one of {rule}", short(v)));
                    }
                }
                "const" => {
                    if rule != v {
                        errors.push(format!("{here}: expected {rule}, found {}", short(v)));
                    }
                }
                "oneOf" => {
                    let options = rule.as_array().expect("oneOf is a list");
                    let matching = options
                        .iter()
                        .filter(|o| {
                            let mut e = Vec::new();
                            self.check(o, v, at, &mut e);
                            e.is_empty()
                        })
                        .count();
                    if matching != 1 {
                        errors.push(format!("{here}: matches {matching} of the oneOf alternatives, not exactly one"));
                    }
                }
                "required" => {
                    if let Some(o) = v.as_object() {
                        for f in rule.as_array().expect("required is a list") {
                            let f = f.as_str().expect("required names are strings");
                            if !o.contains_key(f) {
                                errors.push(format!("{here}: missing field `{f}`"));
                            }
                        }
                    }
                }
                "properties" => {
                    if let Some(o) = v.as_object() {
                        for (name, sub) in rule.as_object().expect("properties is an object") {
                            if let Some(x) = o.get(name) {
                                self.check(sub, x, &format!("{at}/{name}"), errors);
                            }
                        }
                    }
                }
                "additionalProperties" => {
                    assert_eq!(rule, &Value::Bool(false), "only additionalProperties: false is supported");
                    if let Some(o) = v.as_object() {
                        let known = s.get("properties").and_then(Value::as_object);
                        for name in o.keys() {
                            if !known.is_some_and(|p| p.contains_key(name)) {
                                errors.push(format!("{here}: field `{name}` is not in the schema"));
                            }
                        }
                    }
                }
                "items" => {
                    if let Some(a) = v.as_array() {
                        for (i, x) in a.iter().enumerate() {
                            self.check(rule, x, &format!("{at}/{i}"), errors);
                        }
                    }
                }
                "minItems" | "maxItems" => {
                    if let Some(a) = v.as_array() {
                        let n = rule.as_u64().expect("a count") as usize;
                        if (k == "minItems" && a.len() < n) || (k == "maxItems" && a.len() > n) {
                            errors.push(format!("{here}: {} items, {k} is {n}", a.len()));
                        }
                    }
                }
                "minimum" | "maximum" => {
                    if let Some(x) = v.as_f64() {
                        let b = rule.as_f64().expect("a number");
                        if (k == "minimum" && x < b) || (k == "maximum" && x > b) {
                            errors.push(format!("{here}: {x} is outside the {k} {b}"));
                        }
                    }
                }
                "minLength" => {
                    if let Some(t) = v.as_str()
                        && (t.chars().count() as u64) < rule.as_u64().expect("a count")
                    {
                        errors.push(format!("{here}: {t:?} is shorter than {rule}"));
                    }
                }
                other => panic!("docs/stats.schema.json uses `{other}` at {here}, which this validator does not check"),
            }
        }
    }
}

fn is_type(v: &Value, t: &str) -> bool {
    match t {
        "null" => v.is_null(),
        "boolean" => v.is_boolean(),
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "number" => v.is_number(),
        "integer" => v.is_u64() || v.is_i64() || v.as_f64().is_some_and(|x| x.fract() == 0.0),
        _ => panic!("unknown type {t}"),
    }
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 60 { format!("{}...", s.chars().take(60).collect::<String>()) } else { s }
}
