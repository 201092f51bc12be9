//! The model index of Cherenkov: names mapped to packed stores under `$CHERENKOV_HOME`.
//!
//! Layout of the home directory (`$CHERENKOV_HOME`, default `<data dir>/cherenkov`, e.g.
//! `~/.local/share/cherenkov` on Linux):
//! - `registry.json`: `{"version": 1, "models": {name: {name, store, source, created}}}`.
//! - `registry.lock`: held exclusively (`flock`) for every read-modify-write of `registry.json`.
//! - `stores/<name>`: the stores `cherenkov prepare` builds; `stores/.tmp-*` are unfinished ones.
//!
//! `registry.json` is only ever replaced whole (written to `registry.json.tmp-<pid>`, fsynced,
//! renamed over the old file, directory fsynced), so a reader never sees a half-written file and a
//! crash leaves either the old or the new index.

mod entry;
mod file;
mod name;
mod registry;

pub use entry::Entry;
pub use file::sync_dir;
pub use name::validate_name;
pub use registry::{Models, Registry};
