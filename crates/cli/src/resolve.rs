//! What a MODEL argument names, for every command that takes one.
//!
//! In order:
//! 1. a source URI: `hf://org/repo[@rev]` or `disk://STORE/path[@rev]` names the model prepared
//!    from it (a revision also matches a prefix of at least 7 hex digits of the commit it resolved
//!    to); a `disk://` checkpoint not prepared yet is packed on first use like a directory, an
//!    `hf://` one must be prepared first (a download is never started implicitly);
//! 2. a directory with `manifest.json`: a store, used as it is;
//! 3. a directory with `config.json`: a checkpoint, packed on first use and registered under the
//!    directory's name (a complete store of the same fingerprint is reused; if that name already
//!    belongs to another checkpoint, `<name>-<fingerprint>` is used);
//! 4. a registered name;
//! 5. otherwise an error that lists the registered names.
//!
//! [`resolve_model`] is for commands that run the model: it also refuses a damaged store
//! ([`crate::integrity::check_before_run`]). [`resolve_for_inspection`] is for commands that only
//! look at it.

use std::path::{Path, PathBuf};

use anyhow::{Result, bail};
use cherenkov_registry::{Entry, Registry};

use crate::integrity;
use crate::prepare::{PrepareOptions, open_checkpoint, prepare_checkpoint_with, source_of};
use crate::source::{Source, locate_disk};

/// A store to open (`Store::open`), with the registered name when there is one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResolvedModel {
    pub store: PathBuf,
    /// None for a store directory given by path.
    pub name: Option<String>,
    /// The registered entry, if any.
    pub entry: Option<Entry>,
}

/// Resolves a MODEL argument (see the module docs) for running it: a store that a check found
/// damaged, or whose files read at start no longer match their checksums, is refused.
pub fn resolve_model(reg: &Registry, arg: &str) -> Result<ResolvedModel> {
    let r = resolve_for_inspection(reg, arg)?;
    let e = r.entry.as_ref();
    integrity::check_before_run(&r.store, r.name.as_deref(), e.map(|e| e.source.as_str()))?;
    Ok(r)
}

/// Resolves a MODEL argument without checking the store's contents.
pub fn resolve_for_inspection(reg: &Registry, arg: &str) -> Result<ResolvedModel> {
    if arg.is_empty() {
        bail!(
            "the MODEL argument is empty; give a registered name, a source URI, a store directory or a checkpoint directory"
        );
    }
    if let Some(src) = Source::parse(arg)? {
        return resolve_uri(reg, &src);
    }
    let path = Path::new(arg);
    if path.is_file() {
        bail!(
            "{arg} is a file; a MODEL is a registered name, a source URI, a store directory or a checkpoint directory"
        );
    }
    if path.is_dir() {
        if path.join("manifest.json").is_file() {
            let store = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
            return Ok(ResolvedModel { store, name: None, entry: None });
        }
        if path.join("config.json").is_file() {
            return packed_on_first_use(reg, path, None);
        }
        bail!("{arg} is a directory but neither a store (no manifest.json) nor a checkpoint (no config.json)");
    }
    if let Some(e) = reg.get(arg)? {
        return registered(e);
    }
    let names: Vec<String> = reg.list()?.into_iter().map(|e| e.name).collect();
    let what = if path.components().count() > 1 || arg.starts_with('.') {
        format!("{arg} does not exist, and no model is registered under that name")
    } else {
        format!("no model named {arg:?} is registered, and there is no directory {arg}")
    };
    if names.is_empty() {
        bail!(
            "{what}; no models are registered yet (cherenkov prepare CHECKPOINT_DIR|hf://org/repo|disk://STORE/path --name NAME)"
        );
    }
    bail!("{what}; registered models: {}", names.join(", "))
}

fn registered(e: Entry) -> Result<ResolvedModel> {
    if !e.store.join("manifest.json").is_file() {
        bail!(
            "model {} is registered to the store {}, which is missing or incomplete; prepare it again: \
             cherenkov prepare {} --name {}",
            e.name,
            e.store.display(),
            e.source,
            e.name
        );
    }
    Ok(ResolvedModel { store: e.store.clone(), name: Some(e.name.clone()), entry: Some(e) })
}

/// The registered models prepared from `src`.
pub fn entries_for(reg: &Registry, src: &Source) -> Result<Vec<Entry>> {
    Ok(reg.list()?.into_iter().filter(|e| src.matches(e)).collect())
}

/// The one model a URI names: several names for one store are fine (the exact source first),
/// several stores are ambiguous.
pub fn entry_for(reg: &Registry, src: &Source) -> Result<Option<Entry>> {
    let mut found = entries_for(reg, src)?;
    let uri = src.uri();
    found.sort_by_key(|e| (e.source != uri, std::cmp::Reverse(e.created)));
    let Some(first) = found.first() else { return Ok(None) };
    if found.iter().any(|e| e.store != first.store) {
        let list: Vec<String> = found
            .iter()
            .map(|e| {
                format!(
                    "{} ({}{})",
                    e.name,
                    e.source,
                    e.revision.as_deref().map(|r| format!(" at {r}")).unwrap_or_default()
                )
            })
            .collect();
        bail!("{uri} names several prepared models: {}; give the name instead", list.join(", "));
    }
    Ok(Some(first.clone()))
}

fn resolve_uri(reg: &Registry, src: &Source) -> Result<ResolvedModel> {
    if let Some(e) = entry_for(reg, src)? {
        return registered(e);
    }
    match src {
        Source::Hf(_) => bail!(
            "{} has not been prepared; download and pack it first: cherenkov prepare {} --name NAME",
            src.uri(),
            src.uri()
        ),
        Source::Disk { store, path, revision } => {
            let loc = locate_disk(reg, store, path, revision.as_deref())?;
            packed_on_first_use(reg, &loc.dir, Some((src, loc.revision)))
        }
    }
}

/// A name made of the characters a model name allows (others become `-`), not starting with '.'.
pub fn sanitize_name(raw: &str) -> String {
    let name: String =
        raw.chars().map(|c| if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') { c } else { '-' }).collect();
    let name = name.trim_start_matches('.');
    if name.is_empty() { "model".to_string() } else { name.to_string() }
}

/// The directory's name, made a valid model name.
pub fn name_from_dir(dir: &Path) -> String {
    sanitize_name(&dir.file_name().unwrap_or_default().to_string_lossy())
}

/// Packs and registers a checkpoint directory found by path or through a disk store.
fn packed_on_first_use(reg: &Registry, dir: &Path, via: Option<(&Source, Option<String>)>) -> Result<ResolvedModel> {
    let ck = open_checkpoint(dir)?;
    let (source, revision, mut name) = match via {
        Some((src, rev)) => (src.uri(), rev, src.default_name()),
        None => (source_of(&ck), None, name_from_dir(&ck.dir)),
    };
    if reg.get(&name)?.is_some_and(|e| e.source != source) {
        name = format!("{name}-{}", ck.fingerprint);
    }
    let opts = PrepareOptions { name, source, revision, force: false, repack: false };
    let p = prepare_checkpoint_with(reg, &ck, &opts)?;
    Ok(ResolvedModel { store: p.entry.store.clone(), name: Some(p.entry.name.clone()), entry: Some(p.entry) })
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
