//! What a MODEL argument names, for every command that takes one.
//!
//! In order:
//! 1. a directory with `manifest.json`: a store, used as it is;
//! 2. a directory with `config.json`: a checkpoint, packed on first use and registered under the
//!    directory's name (a complete store of the same fingerprint is reused; if that name already
//!    belongs to another checkpoint, `<name>-<fingerprint>` is used);
//! 3. a registered name;
//! 4. otherwise an error that lists the registered names.

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};
use cherenkov_registry::Registry;

use crate::prepare::{open_checkpoint, prepare_checkpoint, source_of};

/// A store to open (`Store::open`), with the registered name when there is one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResolvedModel {
    pub store: PathBuf,
    /// None for a store directory given by path.
    pub name: Option<String>,
}

/// Resolves a MODEL argument (see the module docs).
pub fn resolve_model(reg: &Registry, arg: &str) -> Result<ResolvedModel> {
    if arg.is_empty() {
        bail!("the MODEL argument is empty; give a registered name, a store directory or a checkpoint directory");
    }
    let path = Path::new(arg);
    if path.is_file() {
        bail!("{arg} is a file; a MODEL is a registered name, a store directory or a checkpoint directory");
    }
    if path.is_dir() {
        if path.join("manifest.json").is_file() {
            let store = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
            return Ok(ResolvedModel { store, name: None });
        }
        if path.join("config.json").is_file() {
            return packed_on_first_use(reg, path);
        }
        bail!("{arg} is a directory but neither a store (no manifest.json) nor a checkpoint (no config.json)");
    }
    if let Some(e) = reg.get(arg)? {
        if !e.store.join("manifest.json").is_file() {
            bail!(
                "model {arg} is registered to the store {}, which is missing or incomplete; prepare it again: \
                 cherenkov prepare {} --name {arg}",
                e.store.display(),
                e.source
            );
        }
        return Ok(ResolvedModel { store: e.store, name: Some(e.name) });
    }
    let names: Vec<String> = reg.list()?.into_iter().map(|e| e.name).collect();
    let what = if path.components().count() > 1 || arg.starts_with('.') {
        format!("{arg} does not exist, and no model is registered under that name")
    } else {
        format!("no model named {arg:?} is registered, and there is no directory {arg}")
    };
    if names.is_empty() {
        bail!("{what}; no models are registered yet (cherenkov prepare CHECKPOINT_DIR --name NAME)");
    }
    bail!("{what}; registered models: {}", names.join(", "))
}

/// The directory's name, made a valid model name.
fn name_from_dir(dir: &Path) -> String {
    let raw = dir.file_name().unwrap_or_default().to_string_lossy();
    let name: String =
        raw.chars().map(|c| if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') { c } else { '-' }).collect();
    let name = name.trim_start_matches('.');
    if name.is_empty() { "model".to_string() } else { name.to_string() }
}

fn packed_on_first_use(reg: &Registry, dir: &Path) -> Result<ResolvedModel> {
    let ck = open_checkpoint(dir)?;
    let source = source_of(&ck);
    let mut name = name_from_dir(&ck.dir);
    if reg.get(&name)?.is_some_and(|e| e.source != source) {
        name = format!("{name}-{}", ck.fingerprint);
    }
    let p = prepare_checkpoint(reg, &ck, &name, false)?;
    Ok(ResolvedModel { store: p.entry.store, name: Some(p.entry.name) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_from_directories() {
        assert_eq!(name_from_dir(Path::new("/m/Qwen3.8-Flash_4bit")), "Qwen3.8-Flash_4bit");
        assert_eq!(name_from_dir(Path::new("/m/my model (v2)")), "my-model--v2-");
        assert_eq!(name_from_dir(Path::new("/m/.hidden")), "hidden");
        assert_eq!(name_from_dir(Path::new("/")), "model");
    }
}
