//! The tokenizer, stream decoder, chat template and EOS ids against the tiny-a fixture (a byte-level
//! BPE in Qwen's layout and a Qwen3-style template), plus small hand-written variants in temporary
//! directories for the other file layouts real checkpoints use.

use std::path::{Path, PathBuf};

use cherenkov_engine::chat::{ChatTemplate, Message, eos_token_ids};
use cherenkov_engine::tokenizer::Tokenizer;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/golden/tiny-a/hf")
}

fn fixture_tokenizer() -> Tokenizer {
    Tokenizer::from_dir(fixture_dir()).expect("fixture tokenizer.json loads")
}

const TEXTS: &[&str] = &[
    "The quick brown fox jumps over the lazy dog.",
    "Hello! How are you today?\n\nI am fine, thank you.",
    "  leading spaces, trailing spaces  \n\ttab",
    "fn main() { println!(\"hi\"); } // 2026: 42 + 100",
    "naïve café — 東京 🚀",
    "Ünïcödé: ελληνικά, русский, العربية, 한국어, 😀👍🏽",
    "",
];

#[test]
fn encode_decode_round_trips() {
    let tok = fixture_tokenizer();
    for text in TEXTS {
        let ids = tok.encode(text, false).unwrap();
        assert_eq!(&tok.decode(&ids, false).unwrap(), text, "ids {ids:?}");
        assert_eq!(&tok.decode(&ids, true).unwrap(), text);
    }
}

#[test]
fn vocab_size_counts_every_id() {
    let tok = fixture_tokenizer();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture_dir().join("tokenizer.json")).unwrap()).unwrap();
    let model_max = json["model"]["vocab"].as_object().unwrap().values().map(|v| v.as_u64().unwrap()).max().unwrap();
    let added_max = json["added_tokens"].as_array().unwrap().iter().map(|t| t["id"].as_u64().unwrap()).max().unwrap();
    assert_eq!(tok.vocab_size() as u64, model_max.max(added_max) + 1);
    let last = tok.vocab_size() as u32 - 1;
    assert!(tok.id_to_token(last).is_some());
    assert!(tok.id_to_token(last + 1).is_none());
}

#[test]
fn special_tokens_map_to_their_ids() {
    let tok = fixture_tokenizer();
    let expected = [("<|endoftext|>", 0), ("<|im_start|>", 1), ("<|im_end|>", 2), ("<think>", 3), ("</think>", 4)];
    for (token, id) in expected {
        assert_eq!(tok.token_to_id(token), Some(id), "{token}");
        assert_eq!(tok.id_to_token(id).as_deref(), Some(token));
        assert!(tok.is_special(id), "{token}");
        // Written in the text, a special token is one id, whatever surrounds it.
        let ids = tok.encode(&format!("a{token}b"), false).unwrap();
        assert_eq!(ids.iter().filter(|&&i| i == id).count(), 1, "{token}: {ids:?}");
        assert_eq!(ids.iter().filter(|&&i| i <= 4).count(), 1, "{token}: {ids:?}");
    }
    assert!(!tok.is_special(tok.token_to_id("a").unwrap()));

    let ids = tok.encode("<|im_start|>user\nHello!<|im_end|>\n", false).unwrap();
    let body = tok.encode("user\nHello!", false).unwrap();
    let newline = tok.encode("\n", false).unwrap();
    let mut expected = vec![1];
    expected.extend(&body);
    expected.push(2);
    expected.extend(&newline);
    assert_eq!(ids, expected);
    assert_eq!(tok.decode(&ids, true).unwrap(), "user\nHello!\n");
    assert_eq!(tok.decode(&ids, false).unwrap(), "<|im_start|>user\nHello!<|im_end|>\n");
}

#[test]
fn encoding_normalizes_to_nfc() {
    let tok = fixture_tokenizer();
    let composed = tok.encode("caf\u{e9}", false).unwrap();
    let decomposed = tok.encode("cafe\u{301}", false).unwrap();
    assert_eq!(composed, decomposed);
}

/// Streams `ids` one at a time and returns the chunks (the last one from `finish`).
fn stream(tok: &Tokenizer, ids: &[u32], skip_special: bool) -> Vec<String> {
    let mut decoder = tok.stream_decoder(skip_special);
    let mut chunks: Vec<String> = ids.iter().map(|&id| decoder.push(id).unwrap()).collect();
    chunks.push(decoder.finish().unwrap());
    chunks
}

#[test]
fn stream_decoder_holds_back_partial_characters() {
    let tok = fixture_tokenizer();
    let text = "naïve café — 東京 🚀";
    let ids = tok.encode(text, false).unwrap();
    // The test is only meaningful if some token ends inside a multi-byte character.
    let split = ids.iter().filter(|&&id| tok.decode(&[id], false).unwrap().contains('\u{FFFD}')).count();
    assert!(split > 0, "no token splits a character in {ids:?}");

    let chunks = stream(&tok, &ids, false);
    for chunk in &chunks {
        assert!(!chunk.contains('\u{FFFD}'), "partial character emitted: {chunks:?}");
    }
    assert_eq!(chunks.concat(), text);
    assert_eq!(chunks.concat(), tok.decode(&ids, false).unwrap());
    assert_eq!(chunks.last().unwrap(), "", "nothing should be left for finish");
    // A character appears with the token that completes it: 🚀 only with the last token, and
    // 東京 (complete earlier) before it.
    let last_push = &chunks[chunks.len() - 2];
    assert!(last_push.ends_with('🚀'), "{chunks:?}");
    let before = chunks[..chunks.len() - 2].concat();
    assert!(before.contains("東京") && !before.contains('🚀'), "{chunks:?}");
}

#[test]
fn stream_decoder_matches_decode_for_every_fixture_text() {
    let tok = fixture_tokenizer();
    for text in TEXTS {
        let mut ids = vec![1];
        ids.extend(tok.encode(text, false).unwrap());
        ids.extend([2, 3, 4]);
        for skip in [false, true] {
            let streamed = stream(&tok, &ids, skip).concat();
            assert_eq!(streamed, tok.decode(&ids, skip).unwrap(), "{text:?} skip={skip}");
        }
    }
}

#[test]
fn stream_decoder_finish_flushes_an_incomplete_character() {
    let tok = fixture_tokenizer();
    let ids = tok.encode("東", false).unwrap();
    assert!(ids.len() > 1, "東 should span several byte tokens: {ids:?}");
    let cut = &ids[..ids.len() - 1];
    let mut decoder = tok.stream_decoder(false);
    for &id in cut {
        assert_eq!(decoder.push(id).unwrap(), "");
    }
    let rest = decoder.finish().unwrap();
    assert_eq!(rest, tok.decode(cut, false).unwrap());
    assert!(rest.contains('\u{FFFD}'));
    // finish() resets: the decoder can be reused for a new stream.
    let again: String = tok.encode("ok", false).unwrap().into_iter().map(|id| decoder.push(id).unwrap()).collect();
    assert_eq!(again + &decoder.finish().unwrap(), "ok");
}

#[test]
fn stream_decoder_emits_invalid_bytes_without_waiting() {
    let tok = fixture_tokenizer();
    // A lead byte of a 3-byte character followed by ASCII can never complete: the lead byte is
    // replaced at once, as a whole-sequence decode does.
    let lead = tok.encode("東", false).unwrap()[0];
    let a = tok.token_to_id("a").unwrap();
    let ids = [lead, a];
    let mut decoder = tok.stream_decoder(false);
    let first = decoder.push(lead).unwrap();
    let second = decoder.push(a).unwrap();
    assert_eq!(first, "");
    assert_eq!(second, tok.decode(&ids, false).unwrap());
    assert!(second.ends_with('a'));
    assert_eq!(decoder.finish().unwrap(), "");
}

#[test]
fn unknown_ids_are_errors() {
    let tok = fixture_tokenizer();
    let bad = tok.vocab_size() as u32 + 10;
    let err = tok.decode(&[5, bad], false).unwrap_err().to_string();
    assert!(err.contains(&bad.to_string()) && err.contains("tokenizer.json"), "{err}");
    let err = tok.stream_decoder(false).push(bad).unwrap_err().to_string();
    assert!(err.contains(&bad.to_string()), "{err}");
}

#[test]
fn missing_or_invalid_tokenizer_names_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let err = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
    assert!(err.contains("tokenizer.json") && err.contains(&dir.path().display().to_string()), "{err}");
    std::fs::write(dir.path().join("tokenizer.json"), "{\"model\": 3}").unwrap();
    let err = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
    assert!(err.contains("tokenizer.json") && err.contains("not a valid"), "{err}");
}

/// A SentencePiece-style tokenizer (Metaspace, byte fallback, a decoder that strips the first
/// space): decoding is not per-token bytes, so the stream decoder uses its window mode.
const SENTENCEPIECE_STYLE: &str = r#"{
  "version": "1.0", "truncation": null, "padding": null,
  "added_tokens": [{"id": 0, "content": "<unk>", "single_word": false, "lstrip": false,
    "rstrip": false, "normalized": false, "special": true}],
  "normalizer": null,
  "pre_tokenizer": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": false},
  "post_processor": null,
  "decoder": {"type": "Sequence", "decoders": [
    {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
    {"type": "ByteFallback"}, {"type": "Fuse"},
    {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
  "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
    "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
    "vocab": {"<unk>": 0, "\u2581hello": 1, "\u2581wor": 2, "ld": 3, "\u2581": 4,
      "<0xE6>": 5, "<0x9D>": 6, "<0xB1>": 7, "\u2581!": 8},
    "merges": []}
}"#;

#[test]
fn stream_decoder_window_mode_for_other_decoders() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), SENTENCEPIECE_STYLE).unwrap();
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    let ids = [1, 2, 3, 4, 5, 6, 7, 8];
    assert_eq!(tok.decode(&ids, false).unwrap(), "hello world 東 !");
    let chunks = stream(&tok, &ids, false);
    assert_eq!(chunks.concat(), "hello world 東 !");
    assert_eq!(chunks[2], "ld", "the stripped first space must not cost later spaces");
    assert!(chunks.iter().all(|c| !c.contains('\u{FFFD}')), "{chunks:?}");
    assert_eq!(chunks[4], "");
    assert_eq!(chunks[5], "");
    assert_eq!(chunks[6], "東");

    let cut = [1, 5, 6];
    let streamed = stream(&tok, &cut, false).concat();
    assert_eq!(streamed, tok.decode(&cut, false).unwrap());
}

// ---------------------------------------------------------------------------------------------
// Chat template

fn fixture_template() -> ChatTemplate {
    ChatTemplate::from_dir(fixture_dir()).unwrap().expect("the fixture has a chat template")
}

#[test]
fn fixture_template_comes_from_the_jinja_file() {
    let t = fixture_template();
    assert!(t.origin().ends_with("chat_template.jinja"), "{}", t.origin());
    assert_eq!(t.eos_token(), Some("<|im_end|>"));
    assert_eq!(t.bos_token(), None);
}

#[test]
fn renders_system_and_user_exactly() {
    let t = fixture_template();
    let messages = [Message::system("  You are a helpful assistant.\n"), Message::user("Hello!")];
    assert_eq!(
        t.render(&messages, false).unwrap(),
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n"
    );
    let prompt = t.render(&messages, true).unwrap();
    assert_eq!(
        prompt,
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n\
         <|im_start|>assistant\n<think>\n\n</think>\n\n"
    );
    assert!(prompt.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
}

#[test]
fn assistant_reasoning_is_dropped_from_history() {
    let t = fixture_template();
    let messages =
        [Message::user("2+2?"), Message::assistant("<think>\nadd them\n</think>\n\n4"), Message::user("Thanks")];
    assert_eq!(
        t.render(&messages, false).unwrap(),
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n\
         <|im_start|>user\nThanks<|im_end|>\n"
    );
}

#[test]
fn template_exceptions_carry_the_template_text_and_line() {
    let t = fixture_template();
    let err = t.render(&[Message::new("tool", "42")], false).unwrap_err().to_string();
    assert!(err.contains("Unknown role: tool"), "{err}");
    assert!(err.contains("chat_template.jinja"), "{err}");
    assert!(err.contains("line 16"), "{err}");

    let err = t.render(&[Message::user("hi"), Message::system("late")], false).unwrap_err().to_string();
    assert!(err.contains("System message must be first"), "{err}");
    assert!(err.contains("line 7"), "{err}");
}

#[test]
fn message_is_serde() {
    let m: Message = serde_json::from_str(r#"{"role": "user", "content": "hi"}"#).unwrap();
    assert_eq!(m, Message::user("hi"));
    assert_eq!(serde_json::to_string(&m).unwrap(), r#"{"role":"user","content":"hi"}"#);
}

/// The fixture's template as stored in tokenizer_config.json.
fn config_template() -> String {
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture_dir().join("tokenizer_config.json")).unwrap()).unwrap();
    config["chat_template"].as_str().unwrap().to_string()
}

fn write_json(dir: &Path, name: &str, value: serde_json::Value) {
    std::fs::write(dir.join(name), serde_json::to_string_pretty(&value).unwrap()).unwrap();
}

#[test]
fn template_sources_and_precedence() {
    let messages = [Message::system("Be brief."), Message::user("Hi")];
    let expected = fixture_template().render(&messages, true).unwrap();

    // Only tokenizer_config.json, as a string.
    let dir = tempfile::tempdir().unwrap();
    write_json(
        dir.path(),
        "tokenizer_config.json",
        serde_json::json!({"eos_token": "<|im_end|>", "chat_template": config_template()}),
    );
    let t = ChatTemplate::from_dir(dir.path()).unwrap().unwrap();
    assert!(t.origin().contains("tokenizer_config.json"), "{}", t.origin());
    assert_eq!(t.render(&messages, true).unwrap(), expected);

    // tokenizer_config.json with a list of named templates: "default" is used.
    write_json(
        dir.path(),
        "tokenizer_config.json",
        serde_json::json!({"chat_template": [
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": config_template()},
        ]}),
    );
    let t = ChatTemplate::from_dir(dir.path()).unwrap().unwrap();
    assert_eq!(t.render(&messages, true).unwrap(), expected);

    // chat_template.json wins over tokenizer_config.json.
    write_json(dir.path(), "chat_template.json", serde_json::json!({"chat_template": "from json"}));
    let t = ChatTemplate::from_dir(dir.path()).unwrap().unwrap();
    assert!(t.origin().contains("chat_template.json"), "{}", t.origin());
    assert_eq!(t.render(&messages, true).unwrap(), "from json");

    // chat_template.jinja wins over both.
    std::fs::write(dir.path().join("chat_template.jinja"), "from jinja").unwrap();
    let t = ChatTemplate::from_dir(dir.path()).unwrap().unwrap();
    assert_eq!(t.render(&messages, true).unwrap(), "from jinja");
}

#[test]
fn template_source_errors_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    // No template at all: a base model.
    assert!(ChatTemplate::from_dir(dir.path()).unwrap().is_none());
    write_json(dir.path(), "tokenizer_config.json", serde_json::json!({"eos_token": "x"}));
    assert!(ChatTemplate::from_dir(dir.path()).unwrap().is_none());

    write_json(
        dir.path(),
        "tokenizer_config.json",
        serde_json::json!({"chat_template": [{"name": "tool_use", "template": "T"}]}),
    );
    let err = ChatTemplate::from_dir(dir.path()).unwrap_err().to_string();
    assert!(err.contains("tokenizer_config.json") && err.contains("default"), "{err}");

    std::fs::write(dir.path().join("tokenizer_config.json"), "{not json").unwrap();
    let err = ChatTemplate::from_dir(dir.path()).unwrap_err().to_string();
    assert!(err.contains("tokenizer_config.json") && err.contains("JSON"), "{err}");

    std::fs::remove_file(dir.path().join("tokenizer_config.json")).unwrap();
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "line one\n{% for m in messages %}\n{{ m.role }\n{% endfor %}\n",
    )
    .unwrap();
    let err = ChatTemplate::from_dir(dir.path()).unwrap_err().to_string();
    assert!(err.contains("chat_template.jinja") && err.contains("line 3"), "{err}");
}

#[test]
fn template_environment_matches_transformers() {
    let dir = tempfile::tempdir().unwrap();
    write_json(
        dir.path(),
        "tokenizer_config.json",
        serde_json::json!({
            "bos_token": {"__type": "AddedToken", "content": "<s>"},
            "eos_token": "</s>",
        }),
    );
    // bos/eos, tojson with Python's separators and no HTML escaping, dict order kept, loop
    // controls, `tools` passed as None, trim_blocks (no newline after a block tag), lstrip_blocks
    // (no indentation before one), strftime_now. The expected output was checked against jinja2
    // configured as transformers configures it.
    let template = concat!(
        "{{ bos_token }}|{{ eos_token }}|{{ messages | tojson }}\n",
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role.upper() }}{% endfor %}\n",
        "{% if tools is none %}no tools{% endif %}\n",
        "    {% for k, v in messages[0].items() %}{{ k }}={{ v }};{% endfor %}\n",
        "[{{ strftime_now('%Y-%m-%d') }}]"
    );
    std::fs::write(dir.path().join("chat_template.jinja"), template).unwrap();
    let t = ChatTemplate::from_dir(dir.path()).unwrap().unwrap();
    let out = t.render(&[Message::user("a<b & \"c\""), Message::assistant("d")], false).unwrap();
    let (head, date) = out.rsplit_once('[').unwrap();
    assert_eq!(
        head,
        "<s>|</s>|[{\"role\": \"user\", \"content\": \"a<b & \\\"c\\\"\"}, {\"role\": \"assistant\", \"content\": \"d\"}]\n\
         USERno toolsrole=user;content=a<b & \"c\";"
    );
    let date = date.strip_suffix(']').unwrap();
    let parts: Vec<&str> = date.split('-').collect();
    assert_eq!(parts.len(), 3, "{date}");
    assert!(parts[0].len() == 4 && parts[0].parse::<u32>().unwrap() >= 2024, "{date}");
    assert!((1..=12).contains(&parts[1].parse::<u32>().unwrap()), "{date}");
    assert!((1..=31).contains(&parts[2].parse::<u32>().unwrap()), "{date}");
}

#[test]
fn eos_ids_are_the_union_of_all_sources() {
    let tok = fixture_tokenizer();
    // generation_config.json: [2, 0]; tokenizer_config.json: "<|im_end|>" = 2.
    assert_eq!(eos_token_ids(fixture_dir(), &[], &tok), vec![2, 0]);
    assert_eq!(eos_token_ids(fixture_dir(), &[0], &tok), vec![0, 2]);
    assert_eq!(eos_token_ids(fixture_dir(), &[4, 2], &tok), vec![4, 2, 0]);

    let dir = tempfile::tempdir().unwrap();
    assert_eq!(eos_token_ids(dir.path(), &[7], &tok), vec![7]);
    write_json(dir.path(), "generation_config.json", serde_json::json!({"eos_token_id": 0}));
    write_json(
        dir.path(),
        "tokenizer_config.json",
        serde_json::json!({"eos_token": {"content": "<think>", "special": true}}),
    );
    assert_eq!(eos_token_ids(dir.path(), &[5], &tok), vec![5, 0, 3]);
    // An eos_token the tokenizer does not know adds nothing.
    write_json(dir.path(), "tokenizer_config.json", serde_json::json!({"eos_token": "<|not-a-token|>"}));
    assert_eq!(eos_token_ids(dir.path(), &[], &tok), vec![0]);
}
