//! The managed stores directory, `$CHERENKOV_HOME/stores`.
//!
//! - `stores/<name>`: a complete store, renamed into place only after packing finished.
//! - `stores/.tmp-<name>-<pid>`: a store being packed by process `pid` (or, with `-old-`, an old
//!   store moved aside while it is replaced). One whose process is gone is the remains of an
//!   interrupted command and is removed by the next `prepare` (or `model gc`).
//!
//! Stores under `stores/` are managed: `model gc` deletes those no registered name uses. Stores
//! elsewhere (a MODEL given as a store directory) are never deleted.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use cherenkov_model::store::{Store, load_manifest};
use cherenkov_registry::servers::process_alive;
use cherenkov_registry::{Models, Registry};

use crate::integrity;
use crate::source::Source;

const TEMP_PREFIX: &str = ".tmp-";

/// `stores/.tmp-<name>-<pid>`, or `stores/.tmp-<name>-<what>-<pid>`.
pub fn temp_dir(reg: &Registry, name: &str, what: Option<&str>) -> PathBuf {
    let pid = std::process::id();
    let file = match what {
        Some(w) => format!("{TEMP_PREFIX}{name}-{w}-{pid}"),
        None => format!("{TEMP_PREFIX}{name}-{pid}"),
    };
    reg.stores_dir().join(file)
}

/// `stores/.tmp-*` directories whose process no longer runs (without `/proc` nothing is known, so
/// none is).
pub fn stale_temps(reg: &Registry) -> Result<Vec<PathBuf>> {
    let dir = reg.stores_dir();
    let mut stale = Vec::new();
    for e in std::fs::read_dir(&dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let path = e.with_context(|| format!("cannot list {}", dir.display()))?.path();
        let file = path.file_name().unwrap_or_default().to_string_lossy().into_owned();
        let Some(pid) = file.strip_prefix(TEMP_PREFIX).and_then(|r| r.rsplit_once('-')).map(|(_, pid)| pid) else {
            continue;
        };
        let Ok(pid) = pid.parse::<u32>() else { continue };
        if pid != std::process::id() && !process_alive(pid) {
            stale.push(path);
        }
    }
    stale.sort();
    Ok(stale)
}

/// Removes `stores/.tmp-*` directories whose process no longer runs. Returns what it removed.
pub fn remove_stale_temps(reg: &Registry) -> Result<Vec<PathBuf>> {
    let stale = stale_temps(reg)?;
    for path in &stale {
        std::fs::remove_dir_all(path)
            .with_context(|| format!("cannot remove the unfinished store {}", path.display()))?;
    }
    Ok(stale)
}

/// The complete stores directly under `stores/` (not the hidden temporaries), sorted.
pub fn managed_stores(reg: &Registry) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(reg.stores_dir())
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_dir() && !p.file_name().unwrap_or_default().to_string_lossy().starts_with('.'))
                .collect()
        })
        .unwrap_or_default();
    dirs.sort();
    dirs
}

/// Whether `dir` can be reused: a complete store, not marked damaged.
fn usable(dir: &Path) -> bool {
    Store::open(dir).is_ok() && !integrity::marked_damaged(dir)
}

/// A complete store (every file present with its recorded size, not marked damaged by a check)
/// packed from a checkpoint with this fingerprint: `prefer` first, then the registered stores,
/// then anything in `stores/`.
pub fn find_by_fingerprint(reg: &Registry, models: &Models, fingerprint: &str, prefer: &Path) -> Option<PathBuf> {
    let mut candidates = vec![prefer.to_path_buf()];
    candidates.extend(models.values().map(|e| e.store.clone()));
    candidates.extend(managed_stores(reg));
    candidates
        .into_iter()
        .find(|dir| load_manifest(dir).is_ok_and(|m| m.source.fingerprint == fingerprint) && usable(dir))
}

/// A usable store prepared from commit `commit` of hub repository `repo`: a registered name's
/// (its source `hf://repo@...` resolved to that commit), else a managed store whose manifest says
/// it was packed from that commit's snapshot in a hub cache (`.../models--org--repo/snapshots/<commit>`).
pub fn find_by_commit(reg: &Registry, models: &Models, repo: &str, commit: &str) -> Option<PathBuf> {
    let registered = models.values().filter(|e| {
        e.revision.as_deref() == Some(commit)
            && matches!(Source::parse(&e.source), Ok(Some(Source::Hf(r))) if r.repo == repo)
    });
    let suffix = Path::new(&cherenkov_hub::repo::cache_folder(repo)).join("snapshots").join(commit);
    let mut candidates: Vec<PathBuf> = registered.map(|e| e.store.clone()).collect();
    candidates.extend(
        managed_stores(reg)
            .into_iter()
            .filter(|d| load_manifest(d).is_ok_and(|m| Path::new(&m.source.path).ends_with(&suffix))),
    );
    candidates.into_iter().find(|d| usable(d))
}

/// Bytes of the files in a store directory.
pub fn dir_bytes(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for e in std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let meta = e.and_then(|e| e.metadata()).with_context(|| format!("cannot list {}", dir.display()))?;
        if meta.is_file() {
            total += meta.len();
        }
    }
    Ok(total)
}
