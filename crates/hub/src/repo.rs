//! Repository references (`org/repo@revision`) and how they appear in URLs and cache folders.

use anyhow::{Result, bail};

/// The revision used when a reference names none.
pub const DEFAULT_REVISION: &str = "main";

/// A model repository on the hub and a revision of it (branch, tag or commit).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RepoRef {
    /// `org/repo`, or a bare `repo` (old top-level repositories).
    pub repo: String,
    /// As given; `main` when none was.
    pub revision: String,
    /// Whether the reference named a revision.
    pub explicit_revision: bool,
}

impl RepoRef {
    /// Parses `org/repo` or `org/repo@revision`.
    pub fn parse(s: &str) -> Result<RepoRef> {
        let (repo, revision) = match s.split_once('@') {
            Some((r, rev)) => (r, Some(rev)),
            None => (s, None),
        };
        validate_repo_id(repo)?;
        if let Some(rev) = revision {
            validate_revision(repo, rev)?;
        }
        Ok(RepoRef {
            repo: repo.to_string(),
            revision: revision.unwrap_or(DEFAULT_REVISION).to_string(),
            explicit_revision: revision.is_some(),
        })
    }

    /// The repository's folder in the hub cache: `models--org--repo`.
    pub fn cache_folder(&self) -> String {
        cache_folder(&self.repo)
    }
}

impl std::fmt::Display for RepoRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{}", self.repo, self.revision)
    }
}

/// `models--org--repo` for `org/repo`.
pub fn cache_folder(repo: &str) -> String {
    format!("models--{}", repo.replace('/', "--"))
}

/// `org/repo` for `models--org--repo` (None for other folders: datasets, spaces, locks).
pub fn repo_of_folder(folder: &str) -> Option<String> {
    let rest = folder.strip_prefix("models--")?;
    let repo = rest.replacen("--", "/", 1);
    validate_repo_id(&repo).ok()?;
    Some(repo)
}

/// Accepts `name` or `org/name`, each part made of ASCII letters, digits, `-`, `_` and `.`,
/// without `--` or `..` (the hub refuses those; the cache folder uses `--` as separator).
pub fn validate_repo_id(repo: &str) -> Result<()> {
    let parts: Vec<&str> = repo.split('/').collect();
    if repo.is_empty() || parts.len() > 2 || parts.iter().any(|p| p.is_empty()) {
        bail!("{repo:?} is not a repository id; expected org/name (for example Qwen/Qwen3-8B)");
    }
    for p in &parts {
        if let Some(c) = p.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))) {
            bail!("repository id {repo:?} contains {c:?}; use letters, digits, '-', '_' and '.'");
        }
        if p.contains("--") || p.contains("..") || p.starts_with(['-', '.']) || p.ends_with(['-', '.']) {
            bail!("repository id {repo:?} is not valid ('--' and '..' are not allowed, nor '-' or '.' at either end)");
        }
    }
    if repo.len() > 96 {
        bail!("repository id {repo:?} is longer than 96 characters");
    }
    Ok(())
}

/// A revision is a branch, tag or commit: no spaces or control characters, no empty, `.` or
/// `..` path segments.
pub fn validate_revision(repo: &str, rev: &str) -> Result<()> {
    if rev.is_empty() {
        bail!("{repo}@: the revision after '@' is empty; give a branch, tag or commit (or leave out '@')");
    }
    if rev.chars().any(|c| c.is_whitespace() || c.is_control() || matches!(c, '\\' | '?' | '#' | '%')) {
        bail!("{repo}@{rev}: a revision cannot contain spaces, control characters, '\\', '?', '#' or '%'");
    }
    if rev.split('/').any(|s| s.is_empty() || s == "." || s == "..") {
        bail!("{repo}@{rev}: a revision cannot have empty, '.' or '..' parts");
    }
    Ok(())
}

/// Whether `s` looks like a full commit id (40 lowercase hex digits).
pub fn is_commit(s: &str) -> bool {
    s.len() == 40 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Percent-encodes `s` for one URL path segment (`/` encoded too).
pub fn encode_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Percent-encodes a file path for a URL, keeping its `/` separators.
pub fn encode_path(path: &str) -> String {
    path.split('/').map(encode_segment).collect::<Vec<_>>().join("/")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_references() {
        let r = RepoRef::parse("Org/Model-4bit@6cc9bbc0").unwrap();
        assert_eq!((r.repo.as_str(), r.revision.as_str(), r.explicit_revision), ("Org/Model-4bit", "6cc9bbc0", true));
        assert_eq!(r.cache_folder(), "models--Org--Model-4bit");
        let r = RepoRef::parse("gpt2").unwrap();
        assert_eq!((r.revision.as_str(), r.explicit_revision), ("main", false));
        assert_eq!(r.to_string(), "gpt2@main");
        assert_eq!(RepoRef::parse("a/b@refs/pr/1").unwrap().revision, "refs/pr/1");
        for (bad, why) in [
            ("", "not a repository id"),
            ("a/b/c", "not a repository id"),
            ("a//b", "not a repository id"),
            ("a/b c", "contains ' '"),
            ("a/b--c", "'--'"),
            ("a/..", "'..'"),
            ("a/b@", "is empty"),
            ("a/b@x y", "cannot contain"),
            ("a/b@../x", "'..' parts"),
        ] {
            let e = RepoRef::parse(bad).unwrap_err().to_string();
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }

    #[test]
    fn folders_and_urls() {
        assert_eq!(repo_of_folder("models--Org--Model"), Some("Org/Model".into()));
        assert_eq!(repo_of_folder("models--gpt2"), Some("gpt2".into()));
        assert_eq!(repo_of_folder("datasets--a--b"), None);
        assert_eq!(encode_segment("refs/pr/1"), "refs%2Fpr%2F1");
        assert_eq!(encode_path("sub dir/a+b.json"), "sub%20dir/a%2Bb.json");
        assert!(is_commit(&"a1".repeat(20)) && !is_commit("main") && !is_commit(&"A1".repeat(20)));
    }
}
