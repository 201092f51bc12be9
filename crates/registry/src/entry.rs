//! One registered model.

use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// A name and the store it refers to.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub name: String,
    /// Absolute path of the store directory (the one holding `manifest.json`).
    pub store: PathBuf,
    /// The checkpoint the store was packed from: a path or URI, as given to `prepare`.
    pub source: String,
    /// When the name was registered (unix seconds).
    pub created: u64,
}

impl Entry {
    /// An entry created now.
    pub fn new(name: &str, store: PathBuf, source: &str) -> Entry {
        let created = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        Entry { name: name.to_string(), store, source: source.to_string(), created }
    }
}
