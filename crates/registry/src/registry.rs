//! The registry: a locked, atomically replaced `registry.json` under the home directory.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::entry::{DiskStore, Entry};
use crate::file::{self, Index};
use crate::name::validate_name;

/// Registered models by name.
pub type Models = BTreeMap<String, Entry>;

/// The environment variable that moves the home directory.
pub const HOME_ENV: &str = "CHERENKOV_HOME";

/// The model index under one home directory.
#[derive(Clone, Debug)]
pub struct Registry {
    home: PathBuf,
}

/// The exclusive lock on `registry.lock`; released when dropped (closing the file releases it too,
/// so a crashed process never leaves it held).
struct Lock {
    file: File,
}

impl Drop for Lock {
    fn drop(&mut self) {
        let _ = self.file.unlock();
    }
}

impl Registry {
    /// `$CHERENKOV_HOME` when set and not empty (made absolute), else `<data dir>/cherenkov`.
    pub fn default_home() -> Result<PathBuf> {
        match std::env::var_os(HOME_ENV) {
            Some(h) if !h.is_empty() => std::path::absolute(PathBuf::from(&h))
                .with_context(|| format!("{HOME_ENV}={} cannot be made absolute", Path::new(&h).display())),
            _ => match dirs::data_dir() {
                Some(d) => Ok(d.join("cherenkov")),
                None => bail!("no data directory is known for this user; set {HOME_ENV} to a directory"),
            },
        }
    }

    /// Opens (creating if needed) the registry in `home`.
    pub fn open(home: &Path) -> Result<Registry> {
        let home = std::path::absolute(home).with_context(|| format!("{} cannot be made absolute", home.display()))?;
        let stores = home.join("stores");
        std::fs::create_dir_all(&stores).with_context(|| format!("cannot create {}", stores.display()))?;
        Ok(Registry { home })
    }

    /// Opens the registry in [`Registry::default_home`].
    pub fn open_default() -> Result<Registry> {
        Registry::open(&Registry::default_home()?)
    }

    pub fn home(&self) -> &Path {
        &self.home
    }

    /// Where prepared stores live: `<home>/stores`.
    pub fn stores_dir(&self) -> PathBuf {
        self.home.join("stores")
    }

    pub fn path(&self) -> PathBuf {
        self.home.join("registry.json")
    }

    fn lock(&self) -> Result<Lock> {
        let p = self.home.join("registry.lock");
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&p)
            .with_context(|| format!("cannot open {}", p.display()))?;
        file.lock().with_context(|| format!("cannot lock {}", p.display()))?;
        Ok(Lock { file })
    }

    /// Where running servers announce themselves: `<home>/servers` (see [`crate::servers`]).
    pub fn servers_dir(&self) -> PathBuf {
        self.home.join("servers")
    }

    /// Everything registered: models and disk stores. Reads need no lock: the file is only ever
    /// replaced whole.
    pub fn index(&self) -> Result<Index> {
        file::load(&self.path())
    }

    /// Every registered model, by name.
    pub fn list(&self) -> Result<Vec<Entry>> {
        Ok(self.index()?.models.into_values().collect())
    }

    /// Every registered model, keyed by name.
    pub fn models(&self) -> Result<Models> {
        Ok(self.index()?.models)
    }

    pub fn get(&self, name: &str) -> Result<Option<Entry>> {
        Ok(self.index()?.models.remove(name))
    }

    /// Every registered disk store, by name.
    pub fn stores(&self) -> Result<Vec<DiskStore>> {
        Ok(self.index()?.stores.into_values().collect())
    }

    pub fn get_store(&self, name: &str) -> Result<Option<DiskStore>> {
        Ok(self.index()?.stores.remove(name))
    }

    /// Runs `f` on the whole index while holding the lock and writes the result back if it
    /// changed. When `f` fails nothing is written. `f` may do file-system work (renaming a store
    /// into place, deleting unreferenced stores) that must not interleave with another command's
    /// update; an `f` that changes nothing just runs under the lock.
    pub fn update_index<T>(&self, f: impl FnOnce(&mut Index) -> Result<T>) -> Result<T> {
        let _lock = self.lock()?;
        let path = self.path();
        let before = file::load(&path)?;
        let mut index = before.clone();
        let out = f(&mut index)?;
        for (key, e) in &index.models {
            validate_name(key)?;
            if *key != e.name {
                bail!("registry update put the entry named {:?} under {key:?}", e.name);
            }
            if !e.store.is_absolute() {
                bail!("model {key}: store path {} is not absolute", e.store.display());
            }
        }
        for (key, s) in &index.stores {
            validate_name(key)?;
            if *key != s.name {
                bail!("registry update put the disk store named {:?} under {key:?}", s.name);
            }
            if !s.path.is_absolute() {
                bail!("disk store {key}: path {} is not absolute", s.path.display());
            }
        }
        if index != before {
            file::save(&path, &index)?;
        }
        Ok(out)
    }

    /// Runs `f` on the models while holding the lock and writes the result back if it changed.
    /// When `f` fails nothing is written. `f` may do file-system work (renaming a store into
    /// place) that must not interleave with another command's update.
    pub fn update<T>(&self, f: impl FnOnce(&mut Models) -> Result<T>) -> Result<T> {
        self.update_index(|index| f(&mut index.models))
    }

    /// Registers `entry` (replacing any entry of that name). Returns the entry it replaced.
    pub fn register(&self, entry: Entry) -> Result<Option<Entry>> {
        validate_name(&entry.name)?;
        self.update(|m| Ok(m.insert(entry.name.clone(), entry)))
    }

    /// Removes a name (the store stays on disk). Returns the removed entry.
    pub fn remove(&self, name: &str) -> Result<Option<Entry>> {
        self.update(|m| Ok(m.remove(name)))
    }

    /// Registers a disk store; fails if the name is taken by a store with another path or kind.
    /// Returns false when the same store was registered already.
    pub fn add_store(&self, store: DiskStore) -> Result<bool> {
        validate_name(&store.name)?;
        self.update_index(|index| match index.stores.get(&store.name) {
            Some(s) if s.path == store.path && s.kind == store.kind => Ok(false),
            Some(s) => bail!(
                "disk store {} is already registered to {} ({}); remove it first (cherenkov store remove {})",
                s.name,
                s.path.display(),
                s.kind.label(),
                s.name
            ),
            None => {
                index.stores.insert(store.name.clone(), store);
                Ok(true)
            }
        })
    }

    /// Forgets a disk store (its directory is untouched). Returns the removed store.
    pub fn remove_store(&self, name: &str) -> Result<Option<DiskStore>> {
        self.update_index(|index| Ok(index.stores.remove(name)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(reg: &Registry, name: &str) -> Entry {
        Entry::new(name, reg.stores_dir().join(name), &format!("/src/{name}"))
    }

    #[test]
    fn register_get_list_remove() {
        let home = tempfile::tempdir().unwrap();
        let reg = Registry::open(home.path()).unwrap();
        assert!(reg.list().unwrap().is_empty());
        assert!(reg.stores_dir().is_dir());
        assert_eq!(reg.register(entry(&reg, "b")).unwrap(), None);
        assert_eq!(reg.register(entry(&reg, "a")).unwrap(), None);
        let names: Vec<String> = reg.list().unwrap().into_iter().map(|e| e.name).collect();
        assert_eq!(names, ["a", "b"]);
        let mut again = entry(&reg, "a");
        again.source = "/elsewhere".into();
        assert_eq!(reg.register(again.clone()).unwrap().unwrap().source, "/src/a");
        assert_eq!(reg.get("a").unwrap(), Some(again));
        assert_eq!(reg.remove("a").unwrap().unwrap().name, "a");
        assert_eq!(reg.remove("a").unwrap(), None);
        assert_eq!(reg.get("a").unwrap(), None);
        // Reopening sees the same file; no temporary files are left behind.
        let names: Vec<String> =
            Registry::open(home.path()).unwrap().list().unwrap().into_iter().map(|e| e.name).collect();
        assert_eq!(names, ["b"]);
        let leftovers: Vec<_> = std::fs::read_dir(home.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".tmp"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }

    #[test]
    fn failed_update_writes_nothing() {
        let home = tempfile::tempdir().unwrap();
        let reg = Registry::open(home.path()).unwrap();
        reg.register(entry(&reg, "kept")).unwrap();
        let before = std::fs::read(reg.path()).unwrap();
        let r: Result<()> = reg.update(|m| {
            m.clear();
            bail!("changed my mind")
        });
        assert_eq!(r.unwrap_err().to_string(), "changed my mind");
        assert_eq!(std::fs::read(reg.path()).unwrap(), before);
    }

    #[test]
    fn rejects_bad_names_and_relative_stores() {
        let home = tempfile::tempdir().unwrap();
        let reg = Registry::open(home.path()).unwrap();
        let e = reg.register(Entry::new(".x", reg.stores_dir(), "/s")).unwrap_err().to_string();
        assert!(e.contains("cannot start with '.'"), "{e}");
        let e = reg.register(Entry::new("x", "rel/store".into(), "/s")).unwrap_err().to_string();
        assert!(e.contains("not absolute") && e.contains("rel/store"), "{e}");
        assert!(!reg.path().exists());
    }

    #[test]
    fn corrupt_file_is_reported_not_overwritten() {
        let home = tempfile::tempdir().unwrap();
        let reg = Registry::open(home.path()).unwrap();
        std::fs::write(reg.path(), "{broken").unwrap();
        let e = format!("{:#}", reg.list().unwrap_err());
        assert!(e.contains("registry.json is not a valid registry"), "{e}");
        assert!(reg.register(entry(&reg, "a")).is_err());
        assert_eq!(std::fs::read_to_string(reg.path()).unwrap(), "{broken");
        std::fs::write(
            reg.path(),
            r#"{"version": 1, "models": {"a": {"name": "b", "store": "/s", "source": "x", "created": 0}}}"#,
        )
        .unwrap();
        let e = format!("{:#}", reg.list().unwrap_err());
        assert!(e.contains("under \"a\" is named \"b\""), "{e}");
    }

    #[test]
    fn disk_stores_and_models_share_the_file() {
        use crate::entry::DiskStoreKind;
        let home = tempfile::tempdir().unwrap();
        let reg = Registry::open(home.path()).unwrap();
        reg.register(entry(&reg, "m")).unwrap();
        let s = DiskStore::new("models", home.path().join("ckpts"), DiskStoreKind::Dir);
        assert!(reg.add_store(s.clone()).unwrap());
        assert!(!reg.add_store(s.clone()).unwrap(), "the same store again is not an error");
        let other = DiskStore::new("models", home.path().join("elsewhere"), DiskStoreKind::HfCache);
        let e = reg.add_store(other).unwrap_err().to_string();
        assert!(e.contains("already registered to") && e.contains("ckpts"), "{e}");
        // Updating models keeps the stores and the other way round.
        reg.register(entry(&reg, "n")).unwrap();
        assert_eq!(reg.stores().unwrap(), std::slice::from_ref(&s));
        assert_eq!(reg.remove_store("models").unwrap(), Some(s));
        assert_eq!(reg.list().unwrap().len(), 2);
        let rel = DiskStore::new("rel", "rel/path".into(), DiskStoreKind::Dir);
        assert!(reg.add_store(rel).unwrap_err().to_string().contains("not absolute"));
    }

    #[test]
    fn files_without_stores_or_revisions_still_read() {
        let home = tempfile::tempdir().unwrap();
        let reg = Registry::open(home.path()).unwrap();
        std::fs::write(
            reg.path(),
            r#"{"version": 1, "models": {"a": {"name": "a", "store": "/s", "source": "x", "created": 3}}}"#,
        )
        .unwrap();
        let a = reg.get("a").unwrap().unwrap();
        assert_eq!((a.revision, a.created), (None, 3));
        assert!(reg.stores().unwrap().is_empty());
        // Written back without an empty "stores" object or a null revision.
        reg.register(Entry::new("b", "/t".into(), "y")).unwrap();
        let text = std::fs::read_to_string(reg.path()).unwrap();
        assert!(!text.contains("stores") && !text.contains("revision"), "{text}");
    }

    #[test]
    fn threads_register_concurrently() {
        let home = tempfile::tempdir().unwrap();
        let (threads, per_thread) = (8, 25);
        std::thread::scope(|s| {
            for t in 0..threads {
                let home = home.path();
                s.spawn(move || {
                    // Each thread opens its own registry: separate lock-file descriptions, as in
                    // separate processes.
                    let reg = Registry::open(home).unwrap();
                    for i in 0..per_thread {
                        reg.register(entry(&reg, &format!("t{t}-m{i}"))).unwrap();
                    }
                });
            }
        });
        let reg = Registry::open(home.path()).unwrap();
        assert_eq!(reg.list().unwrap().len(), threads * per_thread);
    }
}
