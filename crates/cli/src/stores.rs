//! The managed stores directory, `$CHERENKOV_HOME/stores`.
//!
//! - `stores/<name>`: a complete store, renamed into place only after packing finished.
//! - `stores/.tmp-<name>-<pid>`: a store being packed by process `pid` (or, with `-old-`, an old
//!   store moved aside while it is replaced). One whose process is gone is the remains of an
//!   interrupted command and is removed by the next `prepare`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use cherenkov_model::store::{Store, load_manifest};
use cherenkov_registry::{Models, Registry};

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

/// Whether process `pid` still runs. Without `/proc` nothing is known, so every process counts as
/// running and nothing is removed.
fn running(pid: u32) -> bool {
    !Path::new("/proc/self").exists() || Path::new("/proc").join(pid.to_string()).exists()
}

/// Removes `stores/.tmp-*` directories whose process no longer runs. Returns what it removed.
pub fn remove_stale_temps(reg: &Registry) -> Result<Vec<PathBuf>> {
    let dir = reg.stores_dir();
    let mut removed = Vec::new();
    for e in std::fs::read_dir(&dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let path = e.with_context(|| format!("cannot list {}", dir.display()))?.path();
        let file = path.file_name().unwrap_or_default().to_string_lossy().into_owned();
        let Some(pid) = file.strip_prefix(TEMP_PREFIX).and_then(|r| r.rsplit_once('-')).map(|(_, pid)| pid) else {
            continue;
        };
        let Ok(pid) = pid.parse::<u32>() else { continue };
        if pid != std::process::id() && !running(pid) {
            std::fs::remove_dir_all(&path)
                .with_context(|| format!("cannot remove the unfinished store {}", path.display()))?;
            removed.push(path);
        }
    }
    Ok(removed)
}

/// A complete store (every file present with its recorded size) packed from a checkpoint with
/// this fingerprint: `prefer` first, then the registered stores, then anything in `stores/`.
pub fn find_by_fingerprint(reg: &Registry, models: &Models, fingerprint: &str, prefer: &Path) -> Option<PathBuf> {
    let mut candidates = vec![prefer.to_path_buf()];
    candidates.extend(models.values().map(|e| e.store.clone()));
    if let Ok(rd) = std::fs::read_dir(reg.stores_dir()) {
        let mut dirs: Vec<PathBuf> = rd
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| !p.file_name().unwrap_or_default().to_string_lossy().starts_with('.'))
            .collect();
        dirs.sort();
        candidates.extend(dirs);
    }
    candidates
        .into_iter()
        .find(|dir| load_manifest(dir).is_ok_and(|m| m.source.fingerprint == fingerprint) && Store::open(dir).is_ok())
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
