//! Source URIs: where a checkpoint comes from.
//!
//! - `hf://org/repo[@revision]`: a repository on the Hugging Face hub (`HF_ENDPOINT`), downloaded
//!   into the hub cache; the revision is a branch, tag or commit (default `main`).
//! - `disk://STORE/path[@revision]`: a checkpoint inside a registered disk store
//!   (`cherenkov store add`). In a plain directory store, `path` is a directory under it; in a
//!   Hugging Face cache store (the built-in `hfcache`, or any registered cache) it is `org/repo`,
//!   and the revision picks the snapshot (default `refs/main`).
//!
//! Registered models record their source as the canonical URI ([`Source::uri`]): `hf://` URIs
//! always carry their revision (`@main` when none was given).

use std::path::PathBuf;

use anyhow::{Result, bail};
use cherenkov_hub::cache::short;
use cherenkov_hub::{HubCache, RepoRef};
use cherenkov_registry::{DiskStore, DiskStoreKind, Entry, Registry, validate_name};

/// The disk store every home has: the Hugging Face hub cache the environment selects
/// (`HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`).
pub const HF_CACHE_STORE: &str = "hfcache";

/// A parsed source URI.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    Hf(RepoRef),
    Disk { store: String, path: String, revision: Option<String> },
}

impl Source {
    /// Parses `arg` if it is a URI (`scheme://...`); None for anything else (paths and names).
    pub fn parse(arg: &str) -> Result<Option<Source>> {
        let Some((scheme, rest)) = arg.split_once("://") else { return Ok(None) };
        match scheme {
            "hf" => {
                if rest.is_empty() {
                    bail!("{arg}: name a repository, as in hf://org/repo or hf://org/repo@revision");
                }
                Ok(Some(Source::Hf(RepoRef::parse(rest.trim_end_matches('/'))?)))
            }
            "disk" => {
                let Some((store, path)) = rest.split_once('/') else {
                    bail!("{arg}: expected disk://STORE/path (a checkpoint inside a registered disk store)");
                };
                validate_name(store).map_err(|e| anyhow::anyhow!("{arg}: the store name: {e}"))?;
                let path = path.trim_end_matches('/');
                let (path, revision) = match path.rsplit_once('@') {
                    Some((p, r)) if !r.contains('/') => (p, Some(r.to_string())),
                    _ => (path, None),
                };
                if path.is_empty()
                    || path.starts_with('/')
                    || path.split('/').any(|c| c.is_empty() || c == "." || c == "..")
                {
                    bail!("{arg}: the path inside the store must be relative, without empty, '.' or '..' parts");
                }
                if revision.as_deref() == Some("") {
                    bail!("{arg}: the revision after '@' is empty");
                }
                Ok(Some(Source::Disk { store: store.to_string(), path: path.to_string(), revision }))
            }
            _ => bail!(
                "{arg}: unknown source scheme {scheme}://; use hf://org/repo[@revision], disk://STORE/path[@revision] or a checkpoint directory"
            ),
        }
    }

    /// The canonical URI.
    pub fn uri(&self) -> String {
        match self {
            Source::Hf(r) => format!("hf://{}@{}", r.repo, r.revision),
            Source::Disk { store, path, revision: Some(r) } => format!("disk://{store}/{path}@{r}"),
            Source::Disk { store, path, revision: None } => format!("disk://{store}/{path}"),
        }
    }

    /// A default model name: the last part of the path or repository.
    pub fn default_name(&self) -> String {
        let last = match self {
            Source::Hf(r) => r.repo.rsplit('/').next().unwrap_or(&r.repo),
            Source::Disk { path, .. } => path.rsplit('/').next().unwrap_or(path),
        };
        crate::resolve::sanitize_name(last)
    }

    /// Whether a registered entry was prepared from this source. A revision matches the one
    /// recorded in the URI or, given as 7 or more hex digits, a prefix of the commit it resolved to.
    pub fn matches(&self, e: &Entry) -> bool {
        let Ok(Some(theirs)) = Source::parse(&e.source) else { return false };
        let rev_matches = |mine: Option<&str>, theirs: Option<&str>| match mine {
            None => theirs.is_none(),
            Some(m) => {
                theirs == Some(m)
                    || (m.len() >= 7
                        && m.bytes().all(|b| b.is_ascii_hexdigit())
                        && e.revision.as_deref().is_some_and(|c| c.starts_with(&m.to_ascii_lowercase())))
            }
        };
        match (self, &theirs) {
            (Source::Hf(a), Source::Hf(b)) => a.repo == b.repo && rev_matches(Some(&a.revision), Some(&b.revision)),
            (
                Source::Disk { store: s1, path: p1, revision: r1 },
                Source::Disk { store: s2, path: p2, revision: r2 },
            ) => s1 == s2 && p1 == p2 && rev_matches(r1.as_deref(), r2.as_deref()),
            _ => false,
        }
    }
}

/// The disk store `name`: a registered one, or the built-in Hugging Face cache.
pub fn disk_store(reg: &Registry, name: &str) -> Result<DiskStore> {
    if let Some(s) = reg.get_store(name)? {
        return Ok(s);
    }
    if name == HF_CACHE_STORE {
        return builtin_hf_cache();
    }
    let names: Vec<String> = reg.stores()?.into_iter().map(|s| s.name).collect();
    let registered =
        if names.is_empty() { "none registered".to_string() } else { format!("registered: {}", names.join(", ")) };
    bail!(
        "no disk store named {name:?} ({registered}; built in: {HF_CACHE_STORE}); register one with: cherenkov store add {name} /path/to/checkpoints"
    )
}

/// The built-in `hfcache` store.
pub fn builtin_hf_cache() -> Result<DiskStore> {
    Ok(DiskStore {
        name: HF_CACHE_STORE.into(),
        path: HubCache::from_env()?.root,
        kind: DiskStoreKind::HfCache,
        created: 0,
    })
}

/// A checkpoint directory found through a disk store, with the commit of a cache snapshot.
#[derive(Clone, Debug)]
pub struct Located {
    pub dir: PathBuf,
    pub revision: Option<String>,
}

/// The checkpoint directory `disk://store/path[@revision]` names.
pub fn locate_disk(reg: &Registry, store: &str, path: &str, revision: Option<&str>) -> Result<Located> {
    let s = disk_store(reg, store)?;
    let uri = Source::Disk { store: store.into(), path: path.into(), revision: revision.map(String::from) }.uri();
    match s.kind {
        DiskStoreKind::Dir => {
            if let Some(r) = revision {
                bail!(
                    "{uri}: '@{r}' names a revision, but {store} is a plain directory store ({}); revisions apply to Hugging Face cache stores",
                    s.path.display()
                );
            }
            let dir = s.path.join(path);
            if !dir.is_dir() {
                bail!("{uri}: {} does not exist (disk store {store} is {})", dir.display(), s.path.display());
            }
            Ok(Located { dir, revision: None })
        }
        DiskStoreKind::HfCache => {
            cherenkov_hub::repo::validate_repo_id(path).map_err(|e| anyhow::anyhow!("{uri}: {e}"))?;
            let snap =
                HubCache::new(&s.path).resolve_snapshot(path, revision).map_err(|e| anyhow::anyhow!("{uri}: {e}"))?;
            eprintln!("{uri} is snapshot {} in {}", short(&snap.commit), s.path.display());
            Ok(Located { dir: snap.dir, revision: Some(snap.commit) })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        let hf = Source::parse("hf://Org/M-4bit").unwrap().unwrap();
        assert_eq!(hf.uri(), "hf://Org/M-4bit@main");
        assert_eq!(hf.default_name(), "M-4bit");
        let d = Source::parse("disk://models/org/m@v2").unwrap().unwrap();
        assert_eq!(d, Source::Disk { store: "models".into(), path: "org/m".into(), revision: Some("v2".into()) });
        assert_eq!(d.uri(), "disk://models/org/m@v2");
        assert_eq!(Source::parse("disk://models/a/b/").unwrap().unwrap().uri(), "disk://models/a/b");
        assert_eq!(Source::parse("/plain/path").unwrap(), None);
        assert_eq!(Source::parse("flash").unwrap(), None);
        for (bad, why) in [
            ("s3://x", "unknown source scheme s3://"),
            ("hf://", "name a repository"),
            ("hf://a/b@", "is empty"),
            ("disk://models", "expected disk://STORE/path"),
            ("disk://models/../x", "relative"),
            ("disk://.x/y", "cannot start with '.'"),
        ] {
            let e = Source::parse(bad).unwrap_err().to_string();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn matches_entries() {
        let commit = format!("6cc9bbc0{}", "0".repeat(32));
        let e = Entry::new("flash", "/s".into(), "hf://Org/M@main").with_revision(Some(commit.clone()));
        let m = |uri: &str| Source::parse(uri).unwrap().unwrap().matches(&e);
        assert!(
            m("hf://Org/M") && m("hf://Org/M@main") && m("hf://Org/M@6cc9bbc0") && m(&format!("hf://Org/M@{commit}"))
        );
        assert!(!m("hf://Org/M@v2") && !m("hf://Org/Other") && !m("hf://Org/M@6cc9") && !m("disk://hfcache/Org/M"));
        let d = Entry::new("d", "/s".into(), "disk://models/org/m");
        assert!(Source::parse("disk://models/org/m/").unwrap().unwrap().matches(&d));
        assert!(!Source::parse("disk://models/org/m@main").unwrap().unwrap().matches(&d));
        assert!(!Source::parse("hf://org/m").unwrap().unwrap().matches(&Entry::new("p", "/s".into(), "/ckpt")));
    }
}
