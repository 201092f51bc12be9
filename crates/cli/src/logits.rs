//! `cherenkov logits`: the float32 `[tokens, vocab]` logits of one full forward, as a `.npy` file.
//! The diagnostic interface for comparing backends and references.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use cherenkov_engine::backend::{Backend, Logits};
use cherenkov_engine::tokenizer::Tokenizer;
use cherenkov_registry::Registry;

use crate::load::{LoadArgs, open_model};
use crate::resolve::resolve_model;

#[derive(clap::Args, Debug)]
pub struct LogitsArgs {
    /// A registered name, a store directory, or a checkpoint directory (packed on first use).
    pub model: String,
    /// Token ids, comma-separated (e.g. 1,2,3).
    #[arg(long, value_name = "IDS", conflicts_with = "text", required_unless_present = "text")]
    pub tokens: Option<String>,
    /// Text to tokenize instead of --tokens (no chat template).
    #[arg(long, value_name = "TEXT")]
    pub text: Option<String>,
    /// Output file (.npy, float32, shape [tokens, vocab]).
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
    #[command(flatten)]
    pub load: LoadArgs,
}

/// Parses "1, 2,3" into ids.
pub fn parse_tokens(s: &str) -> Result<Vec<u32>> {
    let ids = s
        .split(',')
        .map(|t| t.trim())
        .filter(|t| !t.is_empty())
        .map(|t| t.parse::<u32>().with_context(|| format!("--tokens: {t:?} is not a token id")))
        .collect::<Result<Vec<_>>>()?;
    if ids.is_empty() {
        bail!("--tokens holds no token ids");
    }
    Ok(ids)
}

/// Writes a little-endian float32 array in NumPy's `.npy` format (version 1.0).
pub fn write_npy(path: &std::path::Path, shape: &[usize], data: &[f32]) -> Result<()> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let tuple = if dims.len() == 1 { format!("({},)", dims[0]) } else { format!("({})", dims.join(", ")) };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {tuple}, }}");
    // magic(6) + version(2) + len(2) + header + '\n' is a multiple of 64.
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut bytes = Vec::with_capacity(10 + header.len() + data.len() * 4);
    bytes.extend_from_slice(b"\x93NUMPY\x01\x00");
    bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
    bytes.extend_from_slice(header.as_bytes());
    for v in data {
        bytes.extend_from_slice(&v.to_le_bytes());
    }
    let tmp = path.with_extension("npy.tmp");
    std::fs::write(&tmp, &bytes).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))
}

pub fn run(args: &LogitsArgs, out: &mut dyn Write) -> Result<()> {
    let reg = Registry::open_default()?;
    let resolved = resolve_model(&reg, &args.model)?;
    let loaded = open_model(&resolved.store, &args.load)?;
    let ids = match (&args.tokens, &args.text) {
        (Some(t), _) => parse_tokens(t)?,
        (None, Some(text)) => Tokenizer::from_dir(&loaded.store.dir)?.encode(text, false)?,
        (None, None) => bail!("give --tokens or --text"),
    };
    let model = &loaded.model;
    let mut s = model.new_session()?;
    let logits = model.forward(&mut s, &ids, Logits::All)?;
    let vocab = model.vocab_size();
    write_npy(&args.out, &[ids.len(), vocab], &logits)?;
    writeln!(out, "wrote {} ([{}, {}] float32)", args.out.display(), ids.len(), vocab)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_lists() {
        assert_eq!(parse_tokens("1, 2,3").unwrap(), vec![1, 2, 3]);
        assert!(parse_tokens("1,x").is_err());
        assert!(parse_tokens(" , ").is_err());
    }

    #[test]
    fn npy_header_is_aligned() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.npy");
        write_npy(&p, &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        let b = std::fs::read(&p).unwrap();
        assert_eq!(&b[..6], b"\x93NUMPY");
        let hl = u16::from_le_bytes([b[8], b[9]]) as usize;
        assert_eq!((10 + hl) % 64, 0);
        assert!(std::str::from_utf8(&b[10..10 + hl]).unwrap().contains("'shape': (2, 3)"));
        assert_eq!(b.len(), 10 + hl + 24);
    }
}
