//! The model index of Cherenkov: names mapped to packed stores under `$CHERENKOV_HOME`.
//!
//! Layout of the home directory (`$CHERENKOV_HOME`, default `<data dir>/cherenkov`, e.g.
//! `~/.local/share/cherenkov` on Linux):
//! - `registry.json`: `{"version": 1, "models": {name: {name, store, source, revision?, created}},
//!   "stores": {name: {name, path, kind, created}}}`: the registered models and the registered
//!   disk stores (parent directories of checkpoints, `cherenkov store add`).
//! - `registry.lock`: held exclusively (`flock`) for every read-modify-write of `registry.json`.
//! - `stores/<name>`: the stores `cherenkov prepare` builds; `stores/.tmp-*` are unfinished ones.
//! - `servers/<pid>.json`: one file per running `cherenkov serve` ([`servers`]).
//!
//! `registry.json` is only ever replaced whole (written to `registry.json.tmp-<pid>`, fsynced,
//! renamed over the old file, directory fsynced), so a reader never sees a half-written file and a
//! crash leaves either the old or the new index.

mod entry;
mod file;
mod name;
mod registry;
pub mod servers;

pub use entry::{DiskStore, DiskStoreKind, Entry, now_unix};
pub use file::{Index, sync_dir};
pub use name::validate_name;
pub use registry::{Models, Registry};
