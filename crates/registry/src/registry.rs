//! The registry: a locked, atomically replaced `registry.json` under the home directory.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::entry::Entry;
use crate::file;
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

    /// Every registered model, by name. Reads need no lock: the file is only ever replaced whole.
    pub fn list(&self) -> Result<Vec<Entry>> {
        Ok(file::load(&self.path())?.into_values().collect())
    }

    /// Every registered model, keyed by name.
    pub fn models(&self) -> Result<Models> {
        file::load(&self.path())
    }

    pub fn get(&self, name: &str) -> Result<Option<Entry>> {
        Ok(file::load(&self.path())?.remove(name))
    }

    /// Runs `f` on the models while holding the lock and writes the result back if it changed.
    /// When `f` fails nothing is written. `f` may do file-system work (renaming a store into
    /// place) that must not interleave with another command's update.
    pub fn update<T>(&self, f: impl FnOnce(&mut Models) -> Result<T>) -> Result<T> {
        let _lock = self.lock()?;
        let path = self.path();
        let before = file::load(&path)?;
        let mut models = before.clone();
        let out = f(&mut models)?;
        for (key, e) in &models {
            validate_name(key)?;
            if *key != e.name {
                bail!("registry update put the entry named {:?} under {key:?}", e.name);
            }
            if !e.store.is_absolute() {
                bail!("model {key}: store path {} is not absolute", e.store.display());
            }
        }
        if models != before {
            file::save(&path, &models)?;
        }
        Ok(out)
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
