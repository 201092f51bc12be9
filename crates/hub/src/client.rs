//! The hub's HTTP API: repository info by revision, file metadata (HEAD on `resolve`), and ranged
//! downloads. Blocking (ureq, rustls); redirects are followed by hand so that the token is only
//! ever sent to the endpoint's own origin, never to the CDN a large file redirects to.

use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use serde::Deserialize;
use ureq::Agent;
use ureq::http::{HeaderMap, Response};

use crate::cache::{hf_home, non_empty_env};
use crate::repo::{RepoRef, encode_path, encode_segment};

/// The hub used when `HF_ENDPOINT` is not set.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Redirects followed for one request (repository renames, then the CDN).
const MAX_REDIRECTS: usize = 5;

/// A hub endpoint and the token to present to it.
pub struct Hub {
    endpoint: String,
    token: Option<String>,
    agent: Agent,
}

/// One file of a repository, as the repository info lists it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct Sibling {
    #[serde(rename = "rfilename")]
    pub name: String,
    #[serde(default)]
    pub size: Option<u64>,
    #[serde(default, rename = "blobId")]
    pub blob_id: Option<String>,
    #[serde(default)]
    pub lfs: Option<LfsInfo>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct LfsInfo {
    pub sha256: String,
    #[serde(default)]
    pub size: Option<u64>,
}

/// A revision of a repository: the commit it resolved to and the files in it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RepoInfo {
    pub repo: RepoRef,
    pub commit: String,
    pub files: Vec<Sibling>,
}

/// What a file's hash must be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExpectedHash {
    /// LFS files: the sha256 of the content.
    Sha256(String),
    /// Files kept in git: the git blob id (sha1 of `blob <len>\0` and the content).
    GitSha1(String),
    /// The hub gave an ETag that is neither; the file is not checked (the reason says why).
    Unknown(String),
}

/// Where and how to download one file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileMeta {
    pub name: String,
    pub size: u64,
    /// The blob's name in the cache (the normalized ETag).
    pub etag: String,
    pub hash: ExpectedHash,
    /// Where the bytes come from (the CDN location for LFS files).
    pub url: String,
    pub lfs: bool,
}

/// Why a download request did not give bytes: worth retrying, or not.
#[derive(Debug)]
pub(crate) enum FetchError {
    Retry(anyhow::Error),
    /// 416: the range start is past the end; restart the file.
    RangeRejected,
    Fatal(anyhow::Error),
}

/// `HF_TOKEN` (or the older `HUGGING_FACE_HUB_TOKEN`), else the token file `huggingface-cli login`
/// writes (`$HF_TOKEN_PATH`, else `$HF_HOME/token`).
pub fn token_from_env() -> Option<String> {
    if let Some(t) = non_empty_env("HF_TOKEN").or_else(|| non_empty_env("HUGGING_FACE_HUB_TOKEN")) {
        return Some(t.trim().to_string());
    }
    let path = match non_empty_env("HF_TOKEN_PATH") {
        Some(p) => p.into(),
        None => hf_home().ok()?.join("token"),
    };
    let t = std::fs::read_to_string(path).ok()?;
    let t = t.trim();
    (!t.is_empty()).then(|| t.to_string())
}

/// `scheme://host[:port]` of a URL.
fn origin(url: &str) -> &str {
    let after = url.find("://").map(|i| i + 3).unwrap_or(0);
    match url[after..].find('/') {
        Some(i) => &url[..after + i],
        None => url,
    }
}

/// A redirect target made absolute.
fn join_location(base: &str, location: &str) -> String {
    if location.contains("://") {
        location.to_string()
    } else if location.starts_with('/') {
        format!("{}{location}", origin(base))
    } else {
        let dir = base.rsplit_once('/').map(|(d, _)| d).unwrap_or(base);
        format!("{dir}/{location}")
    }
}

fn header<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).and_then(|v| v.to_str().ok()).map(str::trim).filter(|v| !v.is_empty())
}

/// An ETag without `W/` and quotes.
pub fn normalize_etag(e: &str) -> String {
    e.trim().trim_start_matches("W/").trim_matches('"').to_string()
}

fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// What the hub's error headers say, for messages: ` (X-Error-Code: ...; message)`.
fn hub_says(h: &HeaderMap) -> String {
    let parts: Vec<&str> = [header(h, "x-error-code"), header(h, "x-error-message")].into_iter().flatten().collect();
    if parts.is_empty() { String::new() } else { format!(" ({})", parts.join(": ")) }
}

/// What a request was about, for error messages.
enum About<'a> {
    Revision(&'a RepoRef),
    File { repo: &'a str, commit: &'a str, file: &'a str },
}

impl Hub {
    /// `HF_ENDPOINT` (default [`DEFAULT_ENDPOINT`]) and [`token_from_env`].
    pub fn from_env() -> Result<Hub> {
        let endpoint = non_empty_env("HF_ENDPOINT").unwrap_or_else(|| DEFAULT_ENDPOINT.to_string());
        Hub::new(&endpoint, token_from_env())
    }

    pub fn new(endpoint: &str, token: Option<String>) -> Result<Hub> {
        let endpoint = endpoint.trim_end_matches('/').to_string();
        if !(endpoint.starts_with("https://") || endpoint.starts_with("http://")) || endpoint.len() <= "https://".len()
        {
            bail!("hub endpoint {endpoint:?} (HF_ENDPOINT) is not an http:// or https:// URL");
        }
        let config = Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0)
            .user_agent(concat!("cherenkov/", env!("CARGO_PKG_VERSION")))
            .timeout_connect(Some(Duration::from_secs(30)))
            .timeout_recv_response(Some(Duration::from_secs(120)))
            .timeout_per_read(Some(Duration::from_secs(120)))
            .build();
        Ok(Hub { endpoint, token, agent: config.into() })
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    pub fn has_token(&self) -> bool {
        self.token.is_some()
    }

    /// One request, without following redirects. The token goes only to the endpoint's origin.
    fn send(&self, head: bool, url: &str, range_from: Option<u64>) -> Result<Response<ureq::Body>, ureq::Error> {
        let mut req = if head { self.agent.head(url) } else { self.agent.get(url) };
        req = req.header("Accept-Encoding", "identity");
        if let Some(t) = &self.token
            && origin(url) == origin(&self.endpoint)
        {
            req = req.header("Authorization", format!("Bearer {t}"));
        }
        if let Some(from) = range_from.filter(|&f| f > 0) {
            req = req.header("Range", format!("bytes={from}-"));
        }
        req.call()
    }

    fn status_error(&self, status: u16, h: &HeaderMap, about: &About) -> anyhow::Error {
        let says = hub_says(h);
        let code = header(h, "x-error-code").unwrap_or("");
        let (repo, what) = match about {
            About::Revision(r) => (r.repo.as_str(), format!("revision {} of {}", r.revision, r.repo)),
            About::File { repo, commit, file } => (*repo, format!("{file} of {repo} at commit {commit}")),
        };
        let ep = &self.endpoint;
        match status {
            401 if self.token.is_some() => anyhow!(
                "{ep} did not accept the token (HF_TOKEN) for {repo} (401 Unauthorized{says}); check that the token is valid and has access"
            ),
            401 => anyhow!(
                "{repo} needs authentication at {ep} (401 Unauthorized{says}): it is gated or private, or does not exist; set HF_TOKEN to a token with access"
            ),
            403 => anyhow!(
                "{ep} refused access to {repo} (403 Forbidden{says}); a gated repository needs its terms accepted on the hub by the token's account"
            ),
            404 if code == "RepoNotFound" => anyhow!("repository {repo} not found at {ep} (404{says})"),
            404 if code == "RevisionNotFound" || matches!(about, About::Revision(_)) => {
                anyhow!("{what} not found at {ep} (404{says}); check the branch, tag or commit")
            }
            404 => anyhow!("{what} not found at {ep} (404{says})"),
            s => anyhow!("{what}: {ep} answered HTTP {s}{says}"),
        }
    }

    /// The commit a revision points to and the files in it
    /// (`GET {endpoint}/api/models/{repo}/revision/{revision}?blobs=true`).
    pub fn repo_info(&self, r: &RepoRef) -> Result<RepoInfo> {
        let url =
            format!("{}/api/models/{}/revision/{}?blobs=true", self.endpoint, r.repo, encode_segment(&r.revision));
        let mut resp =
            self.send(false, &url, None).with_context(|| format!("cannot reach {} for {r}", self.endpoint))?;
        let status = resp.status().as_u16();
        if status != 200 {
            return Err(self.status_error(status, resp.headers(), &About::Revision(r)));
        }
        let body = resp
            .body_mut()
            .with_config()
            .limit(256 << 20)
            .read_to_vec()
            .with_context(|| format!("cannot read the repository info of {r} from {url}"))?;
        #[derive(Deserialize)]
        struct Info {
            sha: Option<String>,
            #[serde(default)]
            siblings: Vec<Sibling>,
        }
        let info: Info = serde_json::from_slice(&body).with_context(|| {
            format!("{url}: the repository info is not the expected JSON ({{\"sha\", \"siblings\"}})")
        })?;
        let commit = info.sha.with_context(|| format!("{url}: the repository info has no commit (\"sha\")"))?;
        if !crate::repo::is_commit(&commit) {
            bail!("{url}: the repository info gives commit {commit:?}, not a 40-digit commit id");
        }
        Ok(RepoInfo { repo: r.clone(), commit, files: info.siblings })
    }

    /// The URL of a file at a commit.
    pub fn resolve_url(&self, repo: &str, commit: &str, file: &str) -> String {
        format!("{}/{repo}/resolve/{commit}/{}", self.endpoint, encode_path(file))
    }

    /// Size, hash and download location of one file (`HEAD .../resolve/{commit}/{file}`; a
    /// redirect to another origin is the CDN location of an LFS file, whose size and sha256 come
    /// in `X-Linked-Size` and `X-Linked-Etag`). `listed` is the repository info's entry, whose
    /// `lfs.sha256` and sizes fill in what the headers leave out and must agree with them.
    pub fn file_meta(&self, repo: &str, commit: &str, listed: &Sibling) -> Result<FileMeta> {
        let file = listed.name.as_str();
        let about = About::File { repo, commit, file };
        let mut url = self.resolve_url(repo, commit, file);
        for _ in 0..=MAX_REDIRECTS {
            let resp = self
                .send(true, &url, None)
                .with_context(|| format!("cannot reach {} for {file} of {repo}", self.endpoint))?;
            let status = resp.status().as_u16();
            let h = resp.headers();
            if (300..400).contains(&status) {
                let raw =
                    header(h, "location").with_context(|| format!("{url}: redirect ({status}) without a Location"))?;
                let location = join_location(&url, raw);
                if !raw.contains("://") && header(h, "x-linked-etag").is_none() {
                    // A renamed repository: ask again at the new place.
                    url = location;
                    continue;
                }
                return self.meta_from(h, listed, location, &url);
            }
            if status != 200 {
                return Err(self.status_error(status, h, &about));
            }
            return self.meta_from(h, listed, url.clone(), &url);
        }
        bail!("{url}: more than {MAX_REDIRECTS} redirects");
    }

    fn meta_from(&self, h: &HeaderMap, listed: &Sibling, download: String, asked: &str) -> Result<FileMeta> {
        let file = &listed.name;
        let redirected = download != asked;
        if let Some(c) = header(h, "x-repo-commit")
            && !asked.contains(&format!("/resolve/{c}/"))
        {
            bail!("{asked}: the hub answered for commit {c}, not the one asked for");
        }
        let linked = header(h, "x-linked-etag").map(normalize_etag);
        let listed_sha = listed.lfs.as_ref().map(|l| l.sha256.to_ascii_lowercase());
        if let (Some(l), Some(s)) = (&linked, &listed_sha)
            && !l.eq_ignore_ascii_case(s)
        {
            bail!("{file}: the hub's X-Linked-Etag {l} and the repository info's lfs.sha256 {s} disagree");
        }
        let etag = linked
            .clone()
            .or(listed_sha.clone())
            .or_else(|| header(h, "etag").map(normalize_etag))
            .or_else(|| listed.blob_id.clone())
            .with_context(|| {
                format!("{asked}: no ETag or X-Linked-Etag header, so the file cannot be named or checked")
            })?;
        if etag.is_empty() || etag.contains(['/', '\\']) || etag.starts_with('.') {
            bail!("{asked}: ETag {etag:?} cannot name a cache blob");
        }
        let content_length = if redirected { None } else { header(h, "content-length").and_then(|v| v.parse().ok()) };
        let size = header(h, "x-linked-size")
            .and_then(|v| v.parse().ok())
            .or(listed.lfs.as_ref().and_then(|l| l.size))
            .or(content_length)
            .or(listed.size)
            .with_context(|| format!("{asked}: the hub gave no size (X-Linked-Size or Content-Length)"))?;
        let hash = if is_hex(&etag, 64) {
            ExpectedHash::Sha256(etag.to_ascii_lowercase())
        } else if is_hex(&etag, 40) {
            ExpectedHash::GitSha1(etag.to_ascii_lowercase())
        } else {
            ExpectedHash::Unknown(format!("its ETag {etag:?} is neither a sha256 nor a git blob id"))
        };
        let lfs = linked.is_some() || listed_sha.is_some();
        Ok(FileMeta { name: file.clone(), size, etag, hash, url: download, lfs })
    }

    /// Starts a download of `url` from byte `from`, following redirects.
    pub(crate) fn open_range(
        &self,
        url: &str,
        from: u64,
        file: &str,
    ) -> std::result::Result<Response<ureq::Body>, FetchError> {
        let mut url = url.to_string();
        for _ in 0..=MAX_REDIRECTS {
            let resp = match self.send(false, &url, Some(from)) {
                Ok(r) => r,
                Err(e) => {
                    return Err(FetchError::Retry(anyhow!(e).context(format!("request for {file} to {url} failed"))));
                }
            };
            let status = resp.status().as_u16();
            match status {
                200 | 206 => return Ok(resp),
                300..=399 => match header(resp.headers(), "location") {
                    Some(l) => url = join_location(&url, l),
                    None => return Err(FetchError::Fatal(anyhow!("{url}: redirect ({status}) without a Location"))),
                },
                416 => return Err(FetchError::RangeRejected),
                408 | 429 | 500..=599 => {
                    return Err(FetchError::Retry(anyhow!(
                        "{file}: {url} answered HTTP {status}{}",
                        hub_says(resp.headers())
                    )));
                }
                _ => {
                    let (repo, commit) = split_resolve(&url).unwrap_or(("the repository", "the revision"));
                    return Err(FetchError::Fatal(self.status_error(
                        status,
                        resp.headers(),
                        &About::File { repo, commit, file },
                    )));
                }
            }
        }
        Err(FetchError::Fatal(anyhow!("{url}: more than {MAX_REDIRECTS} redirects")))
    }
}

/// The repository and commit of a `.../{repo}/resolve/{commit}/...` URL.
fn split_resolve(url: &str) -> Option<(&str, &str)> {
    let path = &url[origin(url).len()..];
    let (repo, rest) = path.trim_start_matches('/').split_once("/resolve/")?;
    Some((repo, rest.split('/').next()?))
}

/// `start` of a `Content-Range: bytes start-end/total` header.
pub(crate) fn content_range_start(h: &HeaderMap) -> Option<u64> {
    let v = header(h, "content-range")?;
    v.strip_prefix("bytes ")?.split('-').next()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_etags() {
        assert_eq!(origin("http://127.0.0.1:8080/a/b"), "http://127.0.0.1:8080");
        assert_eq!(origin("https://h"), "https://h");
        assert_eq!(join_location("http://h:1/a/b", "/c/d"), "http://h:1/c/d");
        assert_eq!(join_location("http://h:1/a/b", "https://cdn/x"), "https://cdn/x");
        assert_eq!(join_location("http://h:1/a/b", "c"), "http://h:1/a/c");
        assert_eq!(normalize_etag("W/\"abc\""), "abc");
        assert_eq!(split_resolve("http://h/org/m/resolve/c0ffee/x.json"), Some(("org/m", "c0ffee")));
        assert!(Hub::new("ftp://x", None).is_err());
        assert_eq!(Hub::new("http://h:1/", None).unwrap().endpoint(), "http://h:1");
    }
}
