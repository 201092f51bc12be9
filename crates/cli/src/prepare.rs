//! `cherenkov prepare`: pack a checkpoint into a store and register it under a name.
//!
//! The checkpoint comes from a directory, a disk store (`disk://STORE/path[@rev]`), the hub
//! (`hf://org/repo[@rev]`, downloaded by [`crate::fetch`]), or a registered name (its recorded
//! source again).
//!
//! Packing goes to `stores/.tmp-<name>-<pid>` and is renamed to `stores/<name>` only when complete;
//! the rename and the registration happen together under the registry lock. A failure (or an
//! interrupt: the next prepare removes the leftovers) therefore never leaves a name registered to
//! an unfinished store. A complete store packed from a checkpoint with the same fingerprint is
//! reused instead of packing again, unless `--repack` is given or a check marked it damaged.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use cherenkov_model::checkpoint::{Checkpoint, Layout};
use cherenkov_model::store::load_manifest;
use cherenkov_model::store::pack::pack;
use cherenkov_registry::{Entry, Models, Registry, sync_dir, validate_name};
use indicatif::HumanBytes;

use crate::inspect::layout_label;
use crate::progress::bytes_bar;
use crate::resolve::name_from_dir;
use crate::source::{Source, locate_disk};
use crate::{integrity, space, stores};

#[derive(clap::Args, Debug, Clone)]
pub struct PrepareArgs {
    /// What to pack: a checkpoint directory (config.json plus *.safetensors: Hugging Face BF16, or
    /// an MLX affine conversion), `hf://org/repo[@revision]`, `disk://STORE/path[@revision]`, or a
    /// registered name (its recorded source is prepared again).
    pub source: String,
    /// Name to register the model under (letters, digits, '-', '_', '.'; not starting with '.').
    /// Default: the checkpoint directory's or repository's last path component.
    #[arg(long)]
    pub name: Option<String>,
    /// Re-point NAME even if it is registered to a different source.
    #[arg(long)]
    pub force: bool,
    /// Pack a new store even if a complete one packed from the same checkpoint exists (for example
    /// after `inspect --verify` found it damaged); the new store replaces it.
    #[arg(long)]
    pub repack: bool,
    /// hf:// sources: keep the downloaded checkpoint in the Hugging Face cache after packing
    /// (by default the files this command downloaded are removed once the store is complete).
    #[arg(long)]
    pub keep_source: bool,
}

/// A registered store and whether an existing one was reused.
pub struct Prepared {
    pub entry: Entry,
    pub reused: bool,
}

/// What to register a packed checkpoint as.
#[derive(Clone, Debug)]
pub struct PrepareOptions {
    pub name: String,
    /// The source recorded in the registry (a path or a URI).
    pub source: String,
    /// The commit the source resolved to (hf:// and Hugging Face cache sources).
    pub revision: Option<String>,
    pub force: bool,
    pub repack: bool,
}

pub fn run(args: &PrepareArgs, out: &mut dyn Write) -> Result<()> {
    if let Some(n) = &args.name {
        validate_name(n)?;
    }
    let reg = Registry::open_default()?;
    match Source::parse(&args.source)? {
        Some(Source::Hf(repo)) => {
            let name = args.name.clone().unwrap_or_else(|| Source::Hf(repo.clone()).default_name());
            crate::fetch::prepare_hf(&reg, &repo, &name, args, out)
        }
        Some(src @ Source::Disk { .. }) => {
            let Source::Disk { store, path, revision } = &src else { unreachable!() };
            let name = args.name.clone().unwrap_or_else(|| src.default_name());
            if args.keep_source {
                eprintln!(
                    "note: --keep-source only matters for hf:// downloads; disk:// checkpoints are never removed"
                );
            }
            check_conflict(reg.get(&name)?.as_ref(), &name, &src.uri(), args.force)?;
            let loc = locate_disk(&reg, store, path, revision.as_deref())?;
            let ck = open_checkpoint(&loc.dir)?;
            let opts = PrepareOptions {
                name,
                source: src.uri(),
                revision: loc.revision,
                force: args.force,
                repack: args.repack,
            };
            report(&prepare_checkpoint_with(&reg, &ck, &opts)?, out)
        }
        None => {
            let path = Path::new(&args.source);
            if !path.exists()
                && let Some(e) = reg.get(&args.source)?
            {
                eprintln!("preparing {} again from its source {}", e.name, e.source);
                let again = PrepareArgs {
                    source: e.source.clone(),
                    name: Some(args.name.clone().unwrap_or(e.name)),
                    ..args.clone()
                };
                if Source::parse(&again.source)?.is_none() && !Path::new(&again.source).exists() {
                    bail!("model {} was prepared from {}, which no longer exists", args.source, again.source);
                }
                return run(&again, out);
            }
            let ck = open_checkpoint(path)?;
            let name = args.name.clone().unwrap_or_else(|| name_from_dir(&ck.dir));
            if args.keep_source {
                eprintln!(
                    "note: --keep-source only matters for hf:// downloads; checkpoint directories are never removed"
                );
            }
            let opts =
                PrepareOptions { name, source: source_of(&ck), revision: None, force: args.force, repack: args.repack };
            report(&prepare_checkpoint_with(&reg, &ck, &opts)?, out)
        }
    }
}

/// The line `prepare` ends with.
pub fn report(p: &Prepared, out: &mut dyn Write) -> Result<()> {
    let bytes = stores::dir_bytes(&p.entry.store)?;
    let how = if p.reused { "reused" } else { "packed" };
    writeln!(out, "prepared {}: {how} store {} ({})", p.entry.name, p.entry.store.display(), HumanBytes(bytes))?;
    Ok(())
}

/// Opens and validates a local checkpoint directory by its absolute path (the path recorded as
/// the source).
pub fn open_checkpoint(dir: &Path) -> Result<Checkpoint> {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    Checkpoint::open(&dir).with_context(|| format!("cannot use {} as a checkpoint", dir.display()))
}

/// The source string recorded for a checkpoint directory.
pub fn source_of(ck: &Checkpoint) -> String {
    ck.dir.display().to_string()
}

/// Packs `ck` (or reuses a complete store of the same fingerprint) and registers it as `name`
/// with the checkpoint's path as the source.
pub fn prepare_checkpoint(reg: &Registry, ck: &Checkpoint, name: &str, force: bool) -> Result<Prepared> {
    let opts = PrepareOptions { name: name.to_string(), source: source_of(ck), revision: None, force, repack: false };
    prepare_checkpoint_with(reg, ck, &opts)
}

/// Packs `ck` (or reuses a complete, undamaged store of the same fingerprint unless
/// `opts.repack`) and registers it as `opts.name` from `opts.source`.
pub fn prepare_checkpoint_with(reg: &Registry, ck: &Checkpoint, opts: &PrepareOptions) -> Result<Prepared> {
    let name = opts.name.as_str();
    validate_name(name)?;
    let source = opts.source.as_str();
    for dir in stores::remove_stale_temps(reg)? {
        eprintln!("removed {} (left by an interrupted prepare)", dir.display());
    }
    check_conflict(reg.get(name)?.as_ref(), name, source, opts.force)?;
    let preferred = reg.stores_dir().join(name);
    let find = |models: &Models| {
        if opts.repack { None } else { stores::find_by_fingerprint(reg, models, &ck.fingerprint, &preferred) }
    };
    let mut packed: Option<TempStore> = None;
    loop {
        if packed.is_none() && find(&reg.models()?).is_none() {
            packed = Some(pack_to_temp(reg, ck, name)?);
        }
        let done = reg.update(|models| {
            check_conflict(models.get(name), name, source, opts.force)?;
            // Another command may have finished the same checkpoint while this one packed.
            let (store, reused) = match find(models) {
                Some(dir) => (dir, true),
                None => match packed.as_mut() {
                    Some(tmp) => (install(reg, models, name, &ck.fingerprint, tmp)?, false),
                    // The store found before taking the lock is gone: pack after all.
                    None => return Ok(None),
                },
            };
            let entry = match models.get(name) {
                Some(e) if e.store == store && e.source == source && e.revision == opts.revision => e.clone(),
                _ => Entry::new(name, store, source).with_revision(opts.revision.clone()),
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

/// Refuses to re-point `name` at another source without `--force`.
pub fn check_conflict(existing: Option<&Entry>, name: &str, source: &str, force: bool) -> Result<()> {
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
    let estimate = space::store_estimate(ck.source_bytes(), ck.layout == Layout::Mlx);
    let need = space::Need { what: "for the packed store", dir: reg.stores_dir(), bytes: estimate };
    let room = space::check(&[need])?;
    let tmp = TempStore { path, installed: false };
    eprintln!(
        "packing {} ({} of safetensors, {} layout) into {}; {room}",
        ck.dir.display(),
        HumanBytes(ck.source_bytes()),
        layout_label(ck.layout),
        tmp.path.display()
    );
    let bar = bytes_bar("packing");
    let manifest = pack(ck, &tmp.path, &bar).with_context(|| format!("packing {} failed", ck.dir.display()))?;
    bar.finish_and_clear();
    // The packer hashed every byte it wrote: that is the first full check.
    integrity::write_stamp(&tmp.path, &manifest, "packed", &[])?;
    Ok(tmp)
}

/// Renames a packed store to `stores/<name>`, replacing what is there unless another name still
/// uses it for a different checkpoint (then the new store goes to `stores/<name>-<fingerprint>`).
/// Other names that use it for the same checkpoint see the new store. Runs under the lock.
fn install(reg: &Registry, models: &Models, name: &str, fingerprint: &str, tmp: &mut TempStore) -> Result<PathBuf> {
    let mut target = reg.stores_dir().join(name);
    let same_checkpoint = load_manifest(&target).is_ok_and(|m| m.source.fingerprint == fingerprint);
    if !same_checkpoint && models.values().any(|e| e.store == target && e.name != name) {
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
