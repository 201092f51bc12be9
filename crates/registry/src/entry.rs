//! One registered model, and one registered checkpoint directory (a "disk store").

use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// Seconds since the Unix epoch, now.
pub fn now_unix() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// A name and the store it refers to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub name: String,
    /// Absolute path of the store directory (the one holding `manifest.json`).
    pub store: PathBuf,
    /// The checkpoint the store was packed from, as given to `prepare`: an absolute path, or a
    /// source URI (`hf://org/repo@rev`, `disk://STORE/path[@rev]`).
    pub source: String,
    /// The commit the source resolved to when it was prepared (hf:// and Hugging Face cache
    /// sources); absent for plain directories.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    /// When the name was registered (unix seconds).
    pub created: u64,
}

impl Entry {
    /// An entry created now.
    pub fn new(name: &str, store: PathBuf, source: &str) -> Entry {
        Entry { name: name.to_string(), store, source: source.to_string(), revision: None, created: now_unix() }
    }

    /// The same entry with `revision` set.
    pub fn with_revision(mut self, revision: Option<String>) -> Entry {
        self.revision = revision;
        self
    }
}

/// What a disk store holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DiskStoreKind {
    /// A plain directory: `disk://NAME/a/b` is the checkpoint directory `<path>/a/b`.
    Dir,
    /// A Hugging Face hub cache (`models--org--repo/snapshots/<commit>/`, `refs/<branch>`):
    /// `disk://NAME/org/repo[@rev]` is the snapshot of that revision.
    HfCache,
}

impl DiskStoreKind {
    pub fn label(self) -> &'static str {
        match self {
            DiskStoreKind::Dir => "dir",
            DiskStoreKind::HfCache => "hf-cache",
        }
    }
}

/// A parent directory of checkpoints registered under a name (`cherenkov store add`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskStore {
    pub name: String,
    /// Absolute path of the directory.
    pub path: PathBuf,
    pub kind: DiskStoreKind,
    /// When it was registered (unix seconds).
    pub created: u64,
}

impl DiskStore {
    pub fn new(name: &str, path: PathBuf, kind: DiskStoreKind) -> DiskStore {
        DiskStore { name: name.to_string(), path, kind, created: now_unix() }
    }
}
