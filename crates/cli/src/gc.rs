//! `cherenkov model gc`: delete managed stores no registered name uses.
//!
//! Managed stores are the directories under `$CHERENKOV_HOME/stores`. A store is garbage when no
//! registered model points at it (compared by canonical path); an unfinished `.tmp-*` store whose
//! process is gone is garbage too. Deletion runs under the registry lock, so a `prepare` cannot
//! register a store while it is being deleted; a `prepare` that found a store before the lock and
//! sees it gone afterwards packs again.
//!
//! A process still running from a store that was deleted keeps working (its files stay readable
//! until it closes them), but the space is only freed when it exits.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use cherenkov_model::store::load_manifest;
use cherenkov_registry::Registry;
use indicatif::HumanBytes;

use crate::stores::{dir_bytes, managed_stores, stale_temps};

/// A store `gc` would delete.
pub struct Garbage {
    pub dir: PathBuf,
    pub bytes: u64,
    /// Why it is garbage and where it came from.
    pub why: String,
}

fn tree_bytes(dir: &std::path::Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else { return 0 };
    rd.filter_map(|e| e.ok())
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => tree_bytes(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map(|m| m.len()).unwrap_or(0),
            _ => 0,
        })
        .sum()
}

/// The garbage under `stores/` given the registered stores.
pub fn find(reg: &Registry, registered: &BTreeSet<PathBuf>) -> Result<Vec<Garbage>> {
    let canon = |p: &PathBuf| std::fs::canonicalize(p).unwrap_or_else(|_| p.clone());
    let mut out = Vec::new();
    for dir in managed_stores(reg) {
        if registered.contains(&canon(&dir)) {
            continue;
        }
        let why = match load_manifest(&dir) {
            Ok(m) => format!("not registered; packed from {}", m.source.path),
            Err(_) => "not registered; not a readable store".to_string(),
        };
        let bytes = dir_bytes(&dir).unwrap_or_else(|_| tree_bytes(&dir));
        out.push(Garbage { dir, bytes, why });
    }
    for dir in stale_temps(reg)? {
        out.push(Garbage { bytes: tree_bytes(&dir), dir, why: "unfinished, left by an interrupted prepare".into() });
    }
    Ok(out)
}

pub fn run(reg: &Registry, dry_run: bool, out: &mut dyn Write) -> Result<()> {
    let deleted = reg.update_index(|index| {
        let canon = |p: &PathBuf| std::fs::canonicalize(p).unwrap_or_else(|_| p.clone());
        let registered: BTreeSet<PathBuf> = index.models.values().map(|e| canon(&e.store)).collect();
        let garbage = find(reg, &registered)?;
        if !dry_run {
            for g in &garbage {
                std::fs::remove_dir_all(&g.dir).with_context(|| format!("cannot delete {}", g.dir.display()))?;
            }
        }
        Ok(garbage)
    })?;
    let total: u64 = deleted.iter().map(|g| g.bytes).sum();
    if deleted.is_empty() {
        writeln!(out, "nothing to delete: every store in {} is registered", reg.stores_dir().display())?;
        return Ok(());
    }
    let verb = if dry_run { "would delete" } else { "deleted" };
    for g in &deleted {
        writeln!(out, "{verb} {} ({}): {}", g.dir.display(), HumanBytes(g.bytes), g.why)?;
    }
    if dry_run {
        writeln!(
            out,
            "{} store(s), {} in all; run cherenkov model gc to delete them",
            deleted.len(),
            HumanBytes(total)
        )?;
    } else {
        writeln!(out, "freed {} ({} store(s))", HumanBytes(total), deleted.len())?;
    }
    Ok(())
}
