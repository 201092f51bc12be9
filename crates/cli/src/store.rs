//! `cherenkov store add|list|remove`: disk stores, the parent directories that `disk://` URIs
//! name checkpoints in.
//!
//! A plain directory store holds checkpoint directories at any depth (`disk://NAME/org/repo` is
//! `<path>/org/repo`). A Hugging Face cache store is a hub cache (`models--org--repo/snapshots/`):
//! `disk://NAME/org/repo[@rev]` is the snapshot `refs/<rev>` (default `main`) points at, or the
//! snapshot of that commit. The hub cache the environment selects is always available as
//! `hfcache`.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use cherenkov_hub::cache::short;
use cherenkov_hub::{HubCache, looks_like_hub_cache};
use cherenkov_registry::{DiskStore, DiskStoreKind, Registry, validate_name};
use serde::Serialize;

use crate::source::{HF_CACHE_STORE, builtin_hf_cache};

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum KindArg {
    /// A Hugging Face cache if the directory holds models--* folders (or a hub/ folder that
    /// does), else a plain directory.
    Auto,
    Dir,
    HfCache,
}

#[derive(clap::Subcommand, Debug)]
pub enum StoreCommand {
    /// Register a directory of checkpoints under a name, for `prepare disk://NAME/path`.
    #[command(after_help = "Examples:\n  cherenkov store add models /data/models\n  \
            cherenkov prepare disk://models/Org/Model-4bit --name flash\n  \
            cherenkov store add shared-hf /mnt/shared/huggingface --kind hf-cache\n  \
            cherenkov prepare disk://shared-hf/Org/Model-4bit@main --name flash")]
    Add {
        /// The store's name (letters, digits, '-', '_', '.'; `hfcache` is built in).
        name: String,
        /// The directory.
        path: PathBuf,
        /// What the directory is.
        #[arg(long, value_enum, default_value_t = KindArg::Auto)]
        kind: KindArg,
    },
    /// List the disk stores and the checkpoints in them, as the disk:// URIs that prepare takes.
    #[command(after_help = "Examples:\n  cherenkov store list\n  cherenkov store list --json")]
    List {
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Forget a disk store. Its directory is untouched, and models prepared from it keep their stores.
    #[command(after_help = "Example:\n  cherenkov store remove models")]
    Remove { name: String },
}

#[derive(Serialize)]
struct Listed {
    #[serde(flatten)]
    store: DiskStore,
    builtin: bool,
    exists: bool,
    /// The disk:// URIs of the checkpoints found, with a note (revisions of cached repositories).
    checkpoints: Vec<(String, String)>,
}

pub fn run(cmd: &StoreCommand, out: &mut dyn Write) -> Result<()> {
    let reg = Registry::open_default()?;
    match cmd {
        StoreCommand::Add { name, path, kind } => add(&reg, name, path, *kind, out),
        StoreCommand::List { json } => list(&reg, *json, out),
        StoreCommand::Remove { name } => remove(&reg, name, out),
    }
}

fn add(reg: &Registry, name: &str, path: &Path, kind: KindArg, out: &mut dyn Write) -> Result<()> {
    validate_name(name)?;
    if name == HF_CACHE_STORE {
        bail!(
            "{HF_CACHE_STORE} is built in: it is the Hugging Face cache the environment selects (now {}; set HF_HUB_CACHE or HF_HOME to move it); register other caches under another name",
            builtin_hf_cache()?.path.display()
        );
    }
    if !path.is_dir() {
        bail!("{} is not a directory", path.display());
    }
    let path = std::fs::canonicalize(path).with_context(|| format!("cannot resolve {}", path.display()))?;
    let (dir, kind) = match kind {
        KindArg::Dir => (path, DiskStoreKind::Dir),
        KindArg::HfCache | KindArg::Auto if looks_like_hub_cache(&path) => (path, DiskStoreKind::HfCache),
        KindArg::HfCache | KindArg::Auto if looks_like_hub_cache(&path.join("hub")) => {
            eprintln!("{} holds a Hugging Face cache in hub/; registering that", path.display());
            (path.join("hub"), DiskStoreKind::HfCache)
        }
        KindArg::HfCache => (path, DiskStoreKind::HfCache),
        KindArg::Auto => (path, DiskStoreKind::Dir),
    };
    let store = DiskStore::new(name, dir, kind);
    let added = reg.add_store(store.clone())?;
    let found = checkpoints(&store);
    writeln!(
        out,
        "{} disk store {name}: {} ({}), {} checkpoint(s) found",
        if added { "added" } else { "already registered:" },
        store.path.display(),
        kind.label(),
        found.len()
    )?;
    for (uri, note) in found.iter().take(20) {
        writeln!(out, "  {uri}{note}")?;
    }
    if found.len() > 20 {
        writeln!(out, "  ... (cherenkov store list shows all)")?;
    }
    let example = match kind {
        DiskStoreKind::Dir => format!("disk://{name}/org/model"),
        DiskStoreKind::HfCache => format!("disk://{name}/org/model[@revision]"),
    };
    writeln!(out, "prepare one with: cherenkov prepare {example} --name NAME")?;
    Ok(())
}

fn remove(reg: &Registry, name: &str, out: &mut dyn Write) -> Result<()> {
    match reg.remove_store(name)? {
        Some(s) => {
            let prefix = format!("disk://{name}/");
            let users: Vec<String> =
                reg.list()?.into_iter().filter(|e| e.source.starts_with(&prefix)).map(|e| e.name).collect();
            write!(out, "removed disk store {name} ({}); its files are untouched", s.path.display())?;
            if !users.is_empty() {
                write!(out, "; models prepared from it keep their stores: {}", users.join(", "))?;
            }
            writeln!(out)?;
            Ok(())
        }
        None if name == HF_CACHE_STORE => bail!("{HF_CACHE_STORE} is built in and cannot be removed"),
        None => bail!("no disk store named {name:?} is registered (see cherenkov store list)"),
    }
}

fn list(reg: &Registry, json: bool, out: &mut dyn Write) -> Result<()> {
    let mut stores: Vec<(DiskStore, bool)> = reg.stores()?.into_iter().map(|s| (s, false)).collect();
    if !stores.iter().any(|(s, _)| s.name == HF_CACHE_STORE) {
        stores.push((builtin_hf_cache()?, true));
    }
    let listed: Vec<Listed> = stores
        .into_iter()
        .map(|(store, builtin)| Listed {
            exists: store.path.is_dir(),
            checkpoints: checkpoints(&store),
            store,
            builtin,
        })
        .collect();
    if json {
        writeln!(out, "{}", serde_json::to_string_pretty(&listed)?)?;
        return Ok(());
    }
    for l in &listed {
        let mut notes = vec![l.store.kind.label().to_string()];
        if l.builtin {
            notes.push("built in: HF_HUB_CACHE, else HF_HOME/hub".into());
        }
        if !l.exists {
            notes.push("does not exist".into());
        }
        writeln!(out, "{}  {} ({})", l.store.name, l.store.path.display(), notes.join("; "))?;
        if l.checkpoints.is_empty() && l.exists {
            writeln!(out, "  (no checkpoints found)")?;
        }
        for (uri, note) in &l.checkpoints {
            writeln!(out, "  {uri}{note}")?;
        }
    }
    Ok(())
}

/// The checkpoints in a store as (disk:// URI, note).
fn checkpoints(store: &DiskStore) -> Vec<(String, String)> {
    match store.kind {
        DiskStoreKind::HfCache => HubCache::new(&store.path)
            .repos()
            .unwrap_or_default()
            .into_iter()
            .filter(|r| !r.snapshots.is_empty())
            .map(|r| {
                let refs: Vec<String> = r.refs.iter().map(|(n, c)| format!("{n} -> {}", short(c))).collect();
                let note = format!(
                    "  ({} snapshot(s){})",
                    r.snapshots.len(),
                    if refs.is_empty() { String::new() } else { format!("; {}", refs.join(", ")) }
                );
                (format!("disk://{}/{}", store.name, r.repo), note)
            })
            .collect(),
        DiskStoreKind::Dir => {
            let mut found = Vec::new();
            walk(&store.path, &store.path, 0, &mut found);
            found.sort();
            found.into_iter().map(|rel| (format!("disk://{}/{rel}", store.name), String::new())).collect()
        }
    }
}

/// Checkpoint directories (with config.json) up to three levels down; not inside checkpoints.
fn walk(root: &Path, dir: &Path, depth: usize, found: &mut Vec<String>) {
    if depth > 0 && dir.join("config.json").is_file() {
        if let Ok(rel) = dir.strip_prefix(root) {
            found.push(rel.to_string_lossy().into_owned());
        }
        return;
    }
    if depth >= 3 {
        return;
    }
    let Ok(rd) = std::fs::read_dir(dir) else { return };
    for e in rd.filter_map(|e| e.ok()) {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with('.') && e.path().is_dir() {
            walk(root, &e.path(), depth + 1, found);
        }
    }
}
