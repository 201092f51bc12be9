//! The Hugging Face hub cache, laid out as `huggingface_hub` lays it out, so that files downloaded
//! here are found by Python tools and the other way round:
//!
//! ```text
//! <cache>/models--org--repo/
//!     blobs/<etag>                 file contents, named by their hash (sha256 for LFS files,
//!                                  the git blob id otherwise)
//!     blobs/<etag>.incomplete      a download in progress (resumed from its length)
//!     snapshots/<commit>/<file>    relative symlinks to ../../blobs/<etag>
//!     refs/<branch or tag>         the commit the branch or tag pointed to
//! <cache>/.locks/models--org--repo/<etag>.lock
//! ```
//!
//! The cache directory is `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
//! `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::repo::{cache_folder, is_commit, repo_of_folder};

/// `$HF_HOME`, else `$XDG_CACHE_HOME/huggingface`, else `~/.cache/huggingface`.
pub fn hf_home() -> Result<PathBuf> {
    if let Some(h) = non_empty_env("HF_HOME") {
        return Ok(PathBuf::from(h));
    }
    let cache = match non_empty_env("XDG_CACHE_HOME") {
        Some(x) => PathBuf::from(x),
        None => dirs::home_dir().context("no home directory is known; set HF_HOME or HF_HUB_CACHE")?.join(".cache"),
    };
    Ok(cache.join("huggingface"))
}

pub(crate) fn non_empty_env(key: &str) -> Option<String> {
    std::env::var(key).ok().filter(|v| !v.is_empty())
}

/// A hub cache directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HubCache {
    pub root: PathBuf,
}

/// A snapshot found in the cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CachedSnapshot {
    pub commit: String,
    pub dir: PathBuf,
}

/// A repository found in the cache: its refs (name, commit) and snapshot commits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CachedRepo {
    pub repo: String,
    pub refs: Vec<(String, String)>,
    pub snapshots: Vec<String>,
}

impl HubCache {
    pub fn new(root: impl Into<PathBuf>) -> HubCache {
        HubCache { root: root.into() }
    }

    /// The cache the environment selects (see the module docs), made absolute.
    pub fn from_env() -> Result<HubCache> {
        let root = match non_empty_env("HF_HUB_CACHE").or_else(|| non_empty_env("HUGGINGFACE_HUB_CACHE")) {
            Some(c) => PathBuf::from(c),
            None => hf_home()?.join("hub"),
        };
        let root = std::path::absolute(&root).with_context(|| format!("{} cannot be made absolute", root.display()))?;
        Ok(HubCache { root })
    }

    pub fn repo_dir(&self, repo: &str) -> PathBuf {
        self.root.join(cache_folder(repo))
    }

    pub fn blob_path(&self, repo: &str, etag: &str) -> PathBuf {
        self.repo_dir(repo).join("blobs").join(etag)
    }

    pub fn snapshot_dir(&self, repo: &str, commit: &str) -> PathBuf {
        self.repo_dir(repo).join("snapshots").join(commit)
    }

    pub fn lock_path(&self, repo: &str, etag: &str) -> PathBuf {
        self.root.join(".locks").join(cache_folder(repo)).join(format!("{etag}.lock"))
    }

    fn ref_path(&self, repo: &str, revision: &str) -> PathBuf {
        self.repo_dir(repo).join("refs").join(revision)
    }

    /// The commit `refs/<revision>` names, if the file exists.
    pub fn read_ref(&self, repo: &str, revision: &str) -> Option<String> {
        let text = std::fs::read_to_string(self.ref_path(repo, revision)).ok()?;
        let c = text.trim();
        (!c.is_empty()).then(|| c.to_string())
    }

    /// Records that `revision` points at `commit` (not needed when the revision is the commit).
    pub fn write_ref(&self, repo: &str, revision: &str, commit: &str) -> Result<()> {
        if revision == commit {
            return Ok(());
        }
        let p = self.ref_path(repo, revision);
        if let Some(dir) = p.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        }
        let tmp = p.with_file_name(format!(
            ".{}.tmp-{}",
            p.file_name().unwrap_or_default().to_string_lossy(),
            std::process::id()
        ));
        std::fs::write(&tmp, commit).with_context(|| format!("cannot write {}", tmp.display()))?;
        std::fs::rename(&tmp, &p).with_context(|| format!("cannot rename {} to {}", tmp.display(), p.display()))
    }

    /// Removes `refs/<revision>` if it names `commit`.
    pub fn remove_ref_if(&self, repo: &str, revision: &str, commit: &str) -> Result<bool> {
        if self.read_ref(repo, revision).as_deref() != Some(commit) {
            return Ok(false);
        }
        let p = self.ref_path(repo, revision);
        std::fs::remove_file(&p).with_context(|| format!("cannot remove {}", p.display()))?;
        Ok(true)
    }

    /// The snapshot commits present for `repo`, sorted.
    pub fn snapshots(&self, repo: &str) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(self.repo_dir(repo).join("snapshots"))
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .filter(|e| e.path().is_dir())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }

    /// Every `refs/` entry of `repo` as (name, commit), sorted (`refs/pr/1` style names included).
    pub fn refs(&self, repo: &str) -> Vec<(String, String)> {
        fn walk(dir: &Path, prefix: &str, out: &mut Vec<(String, String)>) {
            let Ok(rd) = std::fs::read_dir(dir) else { return };
            for e in rd.filter_map(|e| e.ok()) {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with('.') {
                    continue;
                }
                let full = if prefix.is_empty() { name.clone() } else { format!("{prefix}/{name}") };
                let p = e.path();
                if p.is_dir() {
                    walk(&p, &full, out);
                } else if let Ok(t) = std::fs::read_to_string(&p) {
                    out.push((full, t.trim().to_string()));
                }
            }
        }
        let mut out = Vec::new();
        walk(&self.repo_dir(repo).join("refs"), "", &mut out);
        out.sort();
        out
    }

    /// The snapshot a revision names: `refs/<revision>`, a snapshot directory of that commit, or a
    /// unique commit prefix (at least 7 hex digits). Without a revision: `refs/main`, or the only
    /// snapshot.
    pub fn resolve_snapshot(&self, repo: &str, revision: Option<&str>) -> Result<CachedSnapshot> {
        let dir = self.repo_dir(repo);
        if !dir.is_dir() {
            bail!(
                "{repo} is not in the Hugging Face cache {} (no {}); download it first or check the name",
                self.root.display(),
                cache_folder(repo)
            );
        }
        let snapshots = self.snapshots(repo);
        let rev = revision.unwrap_or(crate::repo::DEFAULT_REVISION);
        let commit = if let Some(c) = self.read_ref(repo, rev) {
            Some(c)
        } else if snapshots.iter().any(|s| s == rev) {
            Some(rev.to_string())
        } else if rev.len() >= 7 && rev.bytes().all(|b| b.is_ascii_hexdigit()) {
            let matches: Vec<&String> = snapshots.iter().filter(|s| s.starts_with(&rev.to_ascii_lowercase())).collect();
            match matches.as_slice() {
                [one] => Some((*one).clone()),
                [] => None,
                many => bail!(
                    "{repo}@{rev} is ambiguous in {}: snapshots {}",
                    dir.display(),
                    many.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
                ),
            }
        } else if revision.is_none() && snapshots.len() == 1 {
            Some(snapshots[0].clone())
        } else {
            None
        };
        let describe = || {
            let refs: Vec<String> = self.refs(repo).into_iter().map(|(r, c)| format!("{r} -> {}", short(&c))).collect();
            format!(
                "refs: {}; snapshots: {}",
                if refs.is_empty() { "none".into() } else { refs.join(", ") },
                if snapshots.is_empty() { "none".into() } else { snapshots.join(", ") }
            )
        };
        let Some(commit) = commit else {
            bail!("no revision {rev} of {repo} in the Hugging Face cache {} ({})", self.root.display(), describe());
        };
        let snap = self.snapshot_dir(repo, &commit);
        if !snap.is_dir() {
            bail!("{repo}@{rev} points at commit {commit}, but {} is missing ({})", snap.display(), describe());
        }
        Ok(CachedSnapshot { commit, dir: snap })
    }

    /// The model repositories in the cache, sorted.
    pub fn repos(&self) -> Result<Vec<CachedRepo>> {
        let rd = match std::fs::read_dir(&self.root) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
            Err(e) => return Err(e).with_context(|| format!("cannot list {}", self.root.display())),
        };
        let mut out: Vec<CachedRepo> = rd
            .filter_map(|e| e.ok())
            .filter_map(|e| repo_of_folder(&e.file_name().to_string_lossy()))
            .map(|repo| CachedRepo { refs: self.refs(&repo), snapshots: self.snapshots(&repo), repo })
            .collect();
        out.sort_by(|a, b| a.repo.cmp(&b.repo));
        Ok(out)
    }
}

/// Whether `dir` looks like a hub cache: it holds at least one `models--*` folder.
pub fn looks_like_hub_cache(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|rd| {
        rd.filter_map(|e| e.ok()).any(|e| e.file_name().to_string_lossy().starts_with("models--") && e.path().is_dir())
    })
}

/// The first 12 characters of a commit id (all of anything else).
pub fn short(commit: &str) -> &str {
    if is_commit(commit) { &commit[..12] } else { commit }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_repo(cache: &HubCache, repo: &str, commits: &[&str], refs: &[(&str, &str)]) {
        for c in commits {
            std::fs::create_dir_all(cache.snapshot_dir(repo, c)).unwrap();
        }
        for (r, c) in refs {
            cache.write_ref(repo, r, c).unwrap();
        }
    }

    #[test]
    fn resolves_revisions() {
        let tmp = tempfile::tempdir().unwrap();
        let cache = HubCache::new(tmp.path());
        let (a, b) = ("a".repeat(40), format!("{}{}", "ab".repeat(4), "0".repeat(32)));
        fake_repo(&cache, "org/m", &[&a, &b], &[("main", &a), ("refs/pr/1", &b)]);
        assert_eq!(cache.resolve_snapshot("org/m", None).unwrap().commit, a);
        assert_eq!(cache.resolve_snapshot("org/m", Some("refs/pr/1")).unwrap().commit, b);
        assert_eq!(cache.resolve_snapshot("org/m", Some(&b)).unwrap().commit, b);
        assert_eq!(cache.resolve_snapshot("org/m", Some("abababab0")).unwrap().commit, b);
        let e = cache.resolve_snapshot("org/m", Some("v2")).unwrap_err().to_string();
        assert!(e.contains("no revision v2 of org/m") && e.contains("main -> aaaaaaaaaaaa"), "{e}");
        let e = cache.resolve_snapshot("org/none", None).unwrap_err().to_string();
        assert!(e.contains("org/none is not in the Hugging Face cache") && e.contains("models--org--none"), "{e}");
        // Without refs/main, a single snapshot is the one.
        fake_repo(&cache, "solo", &[&a], &[]);
        assert_eq!(cache.resolve_snapshot("solo", None).unwrap().dir, cache.snapshot_dir("solo", &a));
        let repos = cache.repos().unwrap();
        assert_eq!(repos.iter().map(|r| r.repo.as_str()).collect::<Vec<_>>(), ["org/m", "solo"]);
        assert_eq!(repos[0].refs, [("main".to_string(), a.clone()), ("refs/pr/1".to_string(), b.clone())]);
        assert!(looks_like_hub_cache(tmp.path()) && !looks_like_hub_cache(&cache.repo_dir("org/m")));
        assert!(cache.remove_ref_if("org/m", "main", &a).unwrap());
        assert!(!cache.remove_ref_if("org/m", "refs/pr/1", &a).unwrap());
    }
}
