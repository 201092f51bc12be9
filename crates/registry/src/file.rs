//! Reading `registry.json` and replacing it atomically.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

use crate::entry::{DiskStore, Entry};
use crate::name::validate_name;

const VERSION: u32 = 1;

/// Everything `registry.json` holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Index {
    /// Registered models by name.
    pub models: BTreeMap<String, Entry>,
    /// Registered disk stores (parent directories of checkpoints) by name.
    pub stores: BTreeMap<String, DiskStore>,
}

#[derive(Serialize, Deserialize)]
struct RegistryFile {
    version: u32,
    models: BTreeMap<String, Entry>,
    /// Absent in files written before disk stores existed.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    stores: BTreeMap<String, DiskStore>,
}

/// The index in `path`; an absent file is an empty registry.
pub(crate) fn load(path: &Path) -> Result<Index> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Index::default()),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
    };
    let file: RegistryFile = serde_json::from_str(&text).with_context(|| {
        format!(
            "{} is not a valid registry (expected {{\"version\": {VERSION}, \"models\": {{...}}}}); fix or remove it",
            path.display()
        )
    })?;
    if file.version != VERSION {
        bail!("{}: registry version {}, this build reads version {VERSION}", path.display(), file.version);
    }
    for (key, e) in &file.models {
        if *key != e.name {
            bail!("{}: the entry under {key:?} is named {:?}", path.display(), e.name);
        }
        validate_name(key).with_context(|| format!("{}", path.display()))?;
    }
    for (key, s) in &file.stores {
        if *key != s.name {
            bail!("{}: the disk store under {key:?} is named {:?}", path.display(), s.name);
        }
        validate_name(key).with_context(|| format!("{}", path.display()))?;
    }
    Ok(Index { models: file.models, stores: file.stores })
}

/// Replaces `path` with `index`: write a temporary file, fsync it, rename it over `path`, fsync
/// the directory. The caller holds the registry lock, so the pid-named temporary is ours alone.
pub(crate) fn save(path: &Path, index: &Index) -> Result<()> {
    let dir = path.parent().context("registry path has no parent directory")?;
    let file_name = path.file_name().context("registry path has no file name")?.to_string_lossy();
    let tmp = dir.join(format!("{file_name}.tmp-{}", std::process::id()));
    let json = serde_json::to_vec_pretty(&RegistryFile {
        version: VERSION,
        models: index.models.clone(),
        stores: index.stores.clone(),
    })?;
    let write = || -> Result<()> {
        let mut f = File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
        f.write_all(&json).with_context(|| format!("write to {} failed", tmp.display()))?;
        f.sync_all().with_context(|| format!("fsync of {} failed", tmp.display()))?;
        std::fs::rename(&tmp, path)
            .with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))?;
        sync_dir(dir)
    };
    let result = write();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Flushes a directory's entries (a rename or a new file in it) to disk.
pub fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).with_context(|| format!("fsync of directory {} failed", dir.display()))
}
