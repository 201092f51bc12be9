//! Downloads from a Hugging Face hub endpoint (`HF_ENDPOINT`, default `https://huggingface.co`)
//! into the hub cache (`HF_HUB_CACHE` / `HF_HOME`), laid out as `huggingface_hub` lays it out.
//!
//! - [`RepoRef`]: `org/repo@revision` references.
//! - [`Hub`]: the HTTP API: [`Hub::repo_info`] (the commit a revision names and its files) and
//!   [`Hub::file_meta`] (size, hash and download location of a file).
//! - [`HubCache`]: the cache layout; also resolves snapshots already in a cache.
//! - [`download`](mod@download): resumable, hash-checked downloads of a commit's files into the cache.
//! - [`disk`]: free space and file systems.

pub mod cache;
pub mod client;
pub mod disk;
pub mod download;
pub mod repo;

pub use cache::{CachedRepo, CachedSnapshot, HubCache, looks_like_hub_cache};
pub use client::{DEFAULT_ENDPOINT, ExpectedHash, FileMeta, Hub, RepoInfo, Sibling, token_from_env};
pub use download::{
    Check, DownloadOptions, Downloaded, Local, Plan, Removed, download, journal_path, remove_journaled,
};
pub use repo::{RepoRef, is_commit};
