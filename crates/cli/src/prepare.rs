//! `cherenkov prepare`: pack a checkpoint into a store and register it under a name.
//!
//! Packing goes to `stores/.tmp-<name>-<pid>` and is renamed to `stores/<name>` only when complete;
//! the rename and the registration happen together under the registry lock. A failure (or an
//! interrupt: the next prepare removes the leftovers) therefore never leaves a name registered to
//! an unfinished store. A complete store packed from a checkpoint with the same fingerprint is
//! reused instead of packing again.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use cherenkov_model::checkpoint::Checkpoint;
use cherenkov_model::store::pack::pack;
use cherenkov_registry::{Entry, Models, Registry, sync_dir, validate_name};
use indicatif::HumanBytes;

use crate::inspect::layout_label;
use crate::progress::bytes_bar;
use crate::stores;

#[derive(clap::Args, Debug)]
pub struct PrepareArgs {
    /// Checkpoint directory: config.json plus *.safetensors (Hugging Face BF16, or an MLX affine
    /// conversion; model.safetensors.index.json when sharded).
    pub checkpoint: PathBuf,
    /// Name to register the model under (letters, digits, '-', '_', '.'; not starting with '.').
    #[arg(long)]
    pub name: String,
    /// Re-point NAME even if it is registered to a different checkpoint.
    #[arg(long)]
    pub force: bool,
}

/// A registered store and whether an existing one was reused.
pub struct Prepared {
    pub entry: Entry,
    pub reused: bool,
}

pub fn run(args: &PrepareArgs, out: &mut dyn Write) -> Result<()> {
    validate_name(&args.name)?;
    let reg = Registry::open_default()?;
    let ck = open_checkpoint(&args.checkpoint)?;
    let p = prepare_checkpoint(&reg, &ck, &args.name, args.force)?;
    let bytes = stores::dir_bytes(&p.entry.store)?;
    let how = if p.reused { "reused" } else { "packed" };
    writeln!(out, "prepared {}: {how} store {} ({})", p.entry.name, p.entry.store.display(), HumanBytes(bytes))?;
    Ok(())
}

/// Opens and validates a local checkpoint directory by its absolute path (the path recorded as
/// the source).
pub fn open_checkpoint(dir: &Path) -> Result<Checkpoint> {
    if dir.to_string_lossy().contains("://") {
        bail!(
            "{}: only local checkpoint directories can be prepared for now (hf:// and disk:// sources are not supported)",
            dir.display()
        );
    }
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    Checkpoint::open(&dir).with_context(|| format!("cannot use {} as a checkpoint", dir.display()))
}

/// The source string recorded for a checkpoint.
pub fn source_of(ck: &Checkpoint) -> String {
    ck.dir.display().to_string()
}

/// Packs `ck` (or reuses a complete store of the same fingerprint) and registers it as `name`.
pub fn prepare_checkpoint(reg: &Registry, ck: &Checkpoint, name: &str, force: bool) -> Result<Prepared> {
    validate_name(name)?;
    let source = source_of(ck);
    for dir in stores::remove_stale_temps(reg)? {
        eprintln!("removed {} (left by an interrupted prepare)", dir.display());
    }
    check_conflict(reg.get(name)?.as_ref(), name, &source, force)?;
    let preferred = reg.stores_dir().join(name);
    let mut packed: Option<TempStore> = None;
    loop {
        if packed.is_none() && stores::find_by_fingerprint(reg, &reg.models()?, &ck.fingerprint, &preferred).is_none() {
            packed = Some(pack_to_temp(reg, ck, name)?);
        }
        let done = reg.update(|models| {
            check_conflict(models.get(name), name, &source, force)?;
            // Another command may have finished the same checkpoint while this one packed.
            let (store, reused) = match stores::find_by_fingerprint(reg, models, &ck.fingerprint, &preferred) {
                Some(dir) => (dir, true),
                None => match packed.as_mut() {
                    Some(tmp) => (install(reg, models, name, &ck.fingerprint, tmp)?, false),
                    // The store found before taking the lock is gone: pack after all.
                    None => return Ok(None),
                },
            };
            let entry = match models.get(name) {
                Some(e) if e.store == store && e.source == source => e.clone(),
                _ => Entry::new(name, store, &source),
            };
            models.insert(name.to_string(), entry.clone());
            Ok(Some(Prepared { entry, reused }))
        })?;
        if let Some(p) = done {
            if p.reused {
                eprintln!(
                    "reused the complete store {} (packed from a checkpoint with the same fingerprint {})",
                    p.entry.store.display(),
                    ck.fingerprint
                );
            }
            return Ok(p);
        }
    }
}

fn check_conflict(existing: Option<&Entry>, name: &str, source: &str, force: bool) -> Result<()> {
    match existing {
        Some(e) if e.source != source && !force => bail!(
            "model {name} is already registered to {} (store {}); choose another --name, or pass --force to point {name} at {source}",
            e.source,
            e.store.display()
        ),
        _ => Ok(()),
    }
}

/// A store directory being packed; removed when dropped unless it was installed.
struct TempStore {
    path: PathBuf,
    installed: bool,
}

impl Drop for TempStore {
    fn drop(&mut self) {
        if !self.installed {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

fn pack_to_temp(reg: &Registry, ck: &Checkpoint, name: &str) -> Result<TempStore> {
    let path = stores::temp_dir(reg, name, None);
    if path.exists() {
        std::fs::remove_dir_all(&path).with_context(|| format!("cannot remove {}", path.display()))?;
    }
    let tmp = TempStore { path, installed: false };
    eprintln!(
        "packing {} ({} of safetensors, {} layout) into {}",
        ck.dir.display(),
        HumanBytes(ck.source_bytes()),
        layout_label(ck.layout),
        tmp.path.display()
    );
    let bar = bytes_bar("packing");
    pack(ck, &tmp.path, &bar).with_context(|| format!("packing {} failed", ck.dir.display()))?;
    bar.finish_and_clear();
    Ok(tmp)
}

/// Renames a packed store to `stores/<name>`, replacing what is there unless another name still
/// uses it (then the new store goes to `stores/<name>-<fingerprint>`). Runs under the lock.
fn install(reg: &Registry, models: &Models, name: &str, fingerprint: &str, tmp: &mut TempStore) -> Result<PathBuf> {
    let mut target = reg.stores_dir().join(name);
    if models.values().any(|e| e.store == target && e.name != name) {
        target = reg.stores_dir().join(format!("{name}-{fingerprint}"));
    }
    let aside = stores::temp_dir(reg, name, Some("old"));
    let replaced = target.exists();
    if replaced {
        std::fs::rename(&target, &aside)
            .with_context(|| format!("cannot move the old store {} aside", target.display()))?;
    }
    if let Err(e) = std::fs::rename(&tmp.path, &target) {
        if replaced {
            let _ = std::fs::rename(&aside, &target);
        }
        return Err(e).with_context(|| format!("cannot rename {} to {}", tmp.path.display(), target.display()));
    }
    tmp.installed = true;
    sync_dir(&reg.stores_dir())?;
    if replaced && let Err(e) = std::fs::remove_dir_all(&aside) {
        eprintln!("warning: cannot remove the replaced store {}: {e}", aside.display());
    }
    Ok(target)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pack_that_fails_midway_leaves_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let reg = Registry::open(&tmp.path().join("home")).unwrap();
        let src = tmp.path().join("ck");
        std::fs::create_dir(&src).unwrap();
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/golden/tiny-b/hf");
        for e in std::fs::read_dir(fixture).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), src.join(e.file_name())).unwrap();
        }
        let ck = open_checkpoint(&src).unwrap();
        // Shrink the weights after validation: packing then reads past the end of the file.
        let weights = src.join("model.safetensors");
        let len = std::fs::metadata(&weights).unwrap().len();
        std::fs::OpenOptions::new().write(true).open(&weights).unwrap().set_len(len / 2).unwrap();
        let err = format!("{:#}", prepare_checkpoint(&reg, &ck, "x", false).err().unwrap());
        assert!(err.contains(&format!("packing {} failed", src.display())) && err.contains("read failed"), "{err}");
        assert!(reg.list().unwrap().is_empty());
        assert_eq!(std::fs::read_dir(reg.stores_dir()).unwrap().count(), 0);
    }
}
