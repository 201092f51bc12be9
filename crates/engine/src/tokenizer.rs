//! The checkpoint's `tokenizer.json`, loaded with Hugging Face's `tokenizers` crate, plus a
//! streaming detokenizer for generation.
//!
//! Encoding and whole-sequence decoding are delegated to `tokenizers` so that ids match what
//! transformers produces for the same text (normalizer, split regex, byte-level mapping, and the
//! added-token scan that turns `<|im_start|>` written in the text into its id).
//!
//! [`StreamDecoder`] exists because decoding one token at a time is not the same as decoding the
//! sequence: a byte-level BPE token is a run of *bytes*, and a multi-byte UTF-8 character (`é`,
//! `東`, `🚀`) is often split across two or three tokens. Decoding such a token alone yields
//! U+FFFD, and emitting that to a client would corrupt the text. The stream decoder therefore
//! keeps the bytes of an incomplete character back until the tokens that complete it arrive.

use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock};

use anyhow::{Context, Result, anyhow, bail};
use tokenizers::DecoderWrapper;

/// A loaded `tokenizer.json`. Cheap to clone (the vocabulary is shared).
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
    path: PathBuf,
    /// One past the largest id of the model vocabulary and the added tokens.
    vocab_size: usize,
    /// Whether the decoder is plain `ByteLevel`, which lets [`StreamDecoder`] work on exact bytes.
    byte_level: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size)
            .field("byte_level", &self.byte_level)
            .finish()
    }
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        Self::from_file(dir.as_ref().join("tokenizer.json"))
    }

    /// Loads a `tokenizer.json` at an explicit path.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).with_context(|| {
            format!("{}: cannot read the tokenizer (expected a Hugging Face tokenizer.json)", path.display())
        })?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| {
            anyhow!(
                "{}: not a valid Hugging Face tokenizer.json (expected the `tokenizers` \
                 serialization with model, added_tokens, pre_tokenizer and decoder): {e}",
                path.display()
            )
        })?;
        let vocab_size = inner.get_vocab(true).values().map(|&id| id as usize + 1).max().unwrap_or(0);
        if vocab_size == 0 {
            bail!("{}: the tokenizer has an empty vocabulary", path.display());
        }
        let byte_level = matches!(inner.get_decoder(), Some(DecoderWrapper::ByteLevel(_)));
        Ok(Self { inner: Arc::new(inner), path: path.to_path_buf(), vocab_size, byte_level })
    }

    /// The file this tokenizer was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Encodes `text`. Added special tokens written in the text (`<|im_start|>`) become their ids,
    /// exactly as in transformers; `add_special_tokens` only controls the post-processor (BOS/EOS
    /// templates, which Qwen's tokenizer does not have).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|e| anyhow!("{}: cannot encode the text: {e}", self.path.display()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Decodes `ids` the way transformers does. Unlike `tokenizers`, an id outside the vocabulary
    /// is an error rather than silently dropped: it means the logits had rows the tokenizer does not
    /// know (a padded vocabulary that was not masked), which the caller should hear about.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        for &id in ids {
            self.check_id(id)?;
        }
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| anyhow!("{}: cannot decode {} ids: {e}", self.path.display(), ids.len()))
    }

    /// The id of a token string (model vocabulary or added token).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token string of an id, in the vocabulary's own spelling (byte-level tokens show the
    /// GPT-2 byte-to-character mapping, e.g. `Ġthe`).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The bytes `id` contributes to decoded text (special tokens included), exactly: with a
    /// byte-level decoder a token can hold part of a UTF-8 character, which its decoded string
    /// alone would show as U+FFFD. Other decoders give the UTF-8 of the token decoded alone.
    pub fn token_bytes(&self, id: u32) -> Result<Vec<u8>> {
        if self.byte_level {
            Ok(self.byte_level_bytes(id, false)?.unwrap_or_default())
        } else {
            Ok(self.decode(&[id], false)?.into_bytes())
        }
    }

    /// One past the largest id, counting the added tokens: the number of rows an embedding table
    /// or the logits must cover for every id of this tokenizer to be valid.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Whether `id` is an added token marked `special` (`<|im_end|>`, `<think>` in Qwen).
    pub fn is_special(&self, id: u32) -> bool {
        self.inner.id_to_token(id).is_some_and(|t| self.inner.get_added_vocabulary().is_special_token(&t))
    }

    /// A streaming detokenizer over this tokenizer.
    pub fn stream_decoder(&self, skip_special_tokens: bool) -> StreamDecoder {
        StreamDecoder::new(self.clone(), skip_special_tokens)
    }

    fn check_id(&self, id: u32) -> Result<()> {
        match self.inner.id_to_token(id) {
            Some(_) => Ok(()),
            None => Err(self.unknown_id(id)),
        }
    }

    fn unknown_id(&self, id: u32) -> anyhow::Error {
        anyhow!(
            "{}: token id {id} is not in the vocabulary (expected an id below {} that names a token)",
            self.path.display(),
            self.vocab_size
        )
    }

    /// The bytes one token contributes to the decoded text under the `ByteLevel` decoder, or
    /// `None` when it is a special token being skipped. This mirrors `tokenizers`' `ByteLevel`
    /// decoder: each character of the token maps back to one byte (`<|im_end|>` is printable
    /// ASCII, which maps to itself), and a token with a character outside the mapping (an added
    /// token containing a space or non-ASCII text) contributes its UTF-8 spelling unchanged.
    fn byte_level_bytes(&self, id: u32, skip_special_tokens: bool) -> Result<Option<Vec<u8>>> {
        let Some(token) = self.inner.id_to_token(id) else {
            return Err(self.unknown_id(id));
        };
        if skip_special_tokens && self.inner.get_added_vocabulary().is_special_token(&token) {
            return Ok(None);
        }
        let mapped: Option<Vec<u8>> = token.chars().map(char_to_byte).collect();
        Ok(Some(mapped.unwrap_or_else(|| token.into_bytes())))
    }
}

/// The inverse of GPT-2's `bytes_to_unicode`: byte-level BPE spells every byte as a printable
/// character (printable Latin-1 bytes as themselves, the other 68 bytes as U+0100..U+0143).
static CHAR_TO_BYTE: LazyLock<[Option<u8>; 512]> = LazyLock::new(|| {
    let mut table = [None; 512];
    let mut next = 256usize;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        if printable {
            table[b as usize] = Some(b);
        } else {
            table[next] = Some(b);
            next += 1;
        }
    }
    table
});

fn char_to_byte(c: char) -> Option<u8> {
    CHAR_TO_BYTE.get(c as usize).copied().flatten()
}

/// Turns a stream of generated ids into text, one id at a time.
///
/// Concatenating everything [`push`](Self::push) returns and then [`finish`](Self::finish)
/// gives exactly `tokenizer.decode(all_ids, skip_special_tokens)`.
///
/// With a `ByteLevel` decoder (Qwen and every GPT-2-style tokenizer) the decoder works on exact
/// bytes: each token's bytes are appended to a pending buffer, the longest prefix that is complete
/// UTF-8 is emitted, and the trailing bytes of a character still being spelled are held back.
/// A byte sequence that can never become valid UTF-8 is emitted as U+FFFD right away, as
/// `String::from_utf8_lossy` (which `tokenizers` uses) would, so that nothing is held forever.
///
/// Other decoders (SentencePiece-style `Metaspace`/`ByteFallback` sequences) cannot be split per
/// token, so for them the decoder re-decodes a short window of recent ids and emits the text that
/// grew, holding back while the window ends in U+FFFD (an incomplete byte-fallback character).
#[derive(Debug)]
pub struct StreamDecoder {
    tokenizer: Tokenizer,
    skip_special_tokens: bool,
    /// Byte-level mode: bytes received but not yet emitted (an incomplete UTF-8 character).
    pending: Vec<u8>,
    /// Window mode: ids of the current window; `ids[..read]` have been emitted.
    ids: Vec<u32>,
    read: usize,
}

impl StreamDecoder {
    pub fn new(tokenizer: Tokenizer, skip_special_tokens: bool) -> Self {
        Self { tokenizer, skip_special_tokens, pending: Vec::new(), ids: Vec::new(), read: 0 }
    }

    /// Adds one id and returns the text that became complete (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String> {
        if self.tokenizer.byte_level {
            if let Some(bytes) = self.tokenizer.byte_level_bytes(id, self.skip_special_tokens)? {
                self.pending.extend_from_slice(&bytes);
            }
            Ok(self.drain_complete())
        } else {
            self.tokenizer.check_id(id)?;
            self.ids.push(id);
            self.push_window()
        }
    }

    /// Returns whatever is still held back (an incomplete character becomes U+FFFD, as in a
    /// whole-sequence decode) and resets the decoder for a new stream.
    pub fn finish(&mut self) -> Result<String> {
        if self.tokenizer.byte_level {
            let rest = String::from_utf8_lossy(&self.pending).into_owned();
            self.pending.clear();
            Ok(rest)
        } else {
            let emitted = self.decode_ids(&self.ids[..self.read])?;
            let all = self.decode_ids(&self.ids)?;
            self.ids.clear();
            self.read = 0;
            Ok(suffix_after(&all, &emitted))
        }
    }

    /// Emits the longest valid prefix of `pending`, replacing invalid sequences with U+FFFD and
    /// keeping an incomplete trailing sequence for the next token.
    fn drain_complete(&mut self) -> String {
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = start + e.valid_up_to();
                    // The prefix was just validated by `from_utf8`.
                    out.push_str(&String::from_utf8_lossy(&self.pending[start..valid]));
                    match e.error_len() {
                        // Invalid whatever follows: the same single U+FFFD that a lossy decode
                        // of the whole sequence produces for this maximal invalid subsequence.
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start = valid + n;
                        }
                        // A character cut short at the end: wait for the next token.
                        None => {
                            start = valid;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }

    /// Window mode: decode the window with and without its unread ids and emit the difference
    /// once it no longer ends in an incomplete character. The window keeps the already-emitted
    /// ids as context because decoders such as `Strip` or `Metaspace` treat the first token of a
    /// sequence differently.
    fn push_window(&mut self) -> Result<String> {
        let emitted = self.decode_ids(&self.ids[..self.read])?;
        let all = self.decode_ids(&self.ids)?;
        if all.len() <= emitted.len() || all.ends_with(char::REPLACEMENT_CHARACTER) {
            return Ok(String::new());
        }
        let new = suffix_after(&all, &emitted);
        // Keep the last emitted ids as context and drop older ones so the work per token stays
        // bounded.
        let keep_from = self.read;
        self.ids.drain(..keep_from);
        self.read = self.ids.len();
        Ok(new)
    }

    fn decode_ids(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer.decode(ids, self.skip_special_tokens)
    }
}

/// The part of `all` after `prefix`; if a decoder changed the earlier text when more ids were
/// appended (so `prefix` is not a prefix of `all`), the common prefix is skipped instead.
fn suffix_after(all: &str, prefix: &str) -> String {
    if let Some(rest) = all.strip_prefix(prefix) {
        return rest.to_string();
    }
    let common = all
        .char_indices()
        .zip(prefix.chars())
        .take_while(|((_, a), b)| a == b)
        .last()
        .map(|((i, c), _)| i + c.len_utf8())
        .unwrap_or(0);
    all[common..].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn char_to_byte_inverts_gpt2_mapping() {
        assert_eq!(char_to_byte('a'), Some(b'a'));
        assert_eq!(char_to_byte('Ġ'), Some(b' '));
        assert_eq!(char_to_byte('Ċ'), Some(b'\n'));
        assert_eq!(char_to_byte('ĉ'), Some(b'\t'));
        assert_eq!(char_to_byte('Ā'), Some(0));
        assert_eq!(char_to_byte('ÿ'), Some(0xFF));
        assert_eq!(char_to_byte(' '), None);
        assert_eq!(char_to_byte('東'), None);
        let mapped: std::collections::HashSet<u8> = CHAR_TO_BYTE.iter().filter_map(|b| *b).collect();
        assert_eq!(mapped.len(), 256);
    }

    #[test]
    fn suffix_after_handles_rewritten_prefix() {
        assert_eq!(suffix_after("hello world", "hello"), " world");
        assert_eq!(suffix_after("héllo", "hé"), "llo");
        assert_eq!(suffix_after("abXd", "abc"), "Xd");
    }
}
