//! Downloading the files of one commit into the hub cache: resumable (a `.incomplete` blob is
//! continued with an HTTP Range request, within one run after a dropped connection and across
//! runs), checked (sha256 for LFS files, the git blob id for the others), and safe to run twice
//! at once (a lock per blob, as `huggingface_hub` takes).

use std::collections::VecDeque;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use indicatif::{HumanBytes, ProgressBar};
use sha1::Sha1;
use sha2::{Digest, Sha256};

use crate::cache::HubCache;
use crate::client::{ExpectedHash, FetchError, FileMeta, Hub, content_range_start};

/// How downloads run.
#[derive(Clone, Debug)]
pub struct DownloadOptions {
    /// Files downloaded at once.
    pub threads: usize,
    /// Failed attempts in a row (dropped connections, 5xx answers) before a file is given up;
    /// an attempt that received bytes resets the count.
    pub attempts: u32,
    /// Wait before the first retry; doubled for each further one (at most 8 s).
    pub backoff: Duration,
    /// A file that records every blob (and ref) this downloader created, across runs, so that
    /// [`remove_journaled`] can later remove exactly those (see [`journal_path`]).
    pub journal: Option<PathBuf>,
}

impl Default for DownloadOptions {
    fn default() -> DownloadOptions {
        DownloadOptions { threads: 4, attempts: 5, backoff: Duration::from_millis(500), journal: None }
    }
}

/// Where downloads of `commit` of `repo` are journaled:
/// `<cache>/.locks/models--org--repo/cherenkov-<commit>.downloads`. One line per blob this
/// downloader completed (`blob<TAB>etag<TAB>file`) and per ref it wrote (`ref<TAB>revision`).
pub fn journal_path(cache: &HubCache, repo: &str, commit: &str) -> PathBuf {
    cache.lock_path(repo, &format!("cherenkov-{commit}")).with_extension("downloads")
}

fn journal_add(journal: Option<&Path>, line: &str) -> Result<()> {
    let Some(j) = journal else { return Ok(()) };
    if let Some(d) = j.parent() {
        std::fs::create_dir_all(d).with_context(|| format!("cannot create {}", d.display()))?;
    }
    let mut f =
        OpenOptions::new().create(true).append(true).open(j).with_context(|| format!("cannot open {}", j.display()))?;
    f.write_all(format!("{line}\n").as_bytes()).with_context(|| format!("write to {} failed", j.display()))
}

/// What the cache already holds of a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Local {
    /// The blob is there with the expected size.
    Complete,
    /// A `.incomplete` blob of this many bytes.
    Partial(u64),
    Missing,
}

#[derive(Clone, Debug)]
pub struct PlannedFile {
    pub meta: FileMeta,
    pub local: Local,
}

/// The files of one commit to bring into the cache.
#[derive(Clone, Debug)]
pub struct Plan {
    pub repo: String,
    /// The revision asked for (recorded as `refs/<revision>` when it is not the commit).
    pub revision: String,
    pub commit: String,
    pub files: Vec<PlannedFile>,
}

/// How a downloaded file was checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Check {
    Sha256,
    GitSha1,
    /// Not checked, and why.
    Unchecked(String),
}

/// A file this run downloaded (or finished downloading).
#[derive(Clone, Debug)]
pub struct Fetched {
    pub name: String,
    pub bytes: u64,
    pub check: Check,
    pub blob: PathBuf,
}

/// The result of [`download`].
#[derive(Clone, Debug)]
pub struct Downloaded {
    /// `snapshots/<commit>`: the checkpoint directory.
    pub snapshot: PathBuf,
    pub fetched: Vec<Fetched>,
    /// Files that were in the cache already.
    pub reused: Vec<String>,
    /// Whether this run wrote `refs/<revision>`.
    pub wrote_ref: bool,
}

impl Plan {
    /// Looks up each file's blob in the cache.
    pub fn new(cache: &HubCache, repo: &str, revision: &str, commit: &str, metas: Vec<FileMeta>) -> Plan {
        let files = metas
            .into_iter()
            .map(|meta| {
                let blob = cache.blob_path(repo, &meta.etag);
                let local = match std::fs::metadata(&blob) {
                    Ok(m) if m.len() == meta.size => Local::Complete,
                    _ => match std::fs::metadata(incomplete(&blob)) {
                        Ok(m) if m.len() <= meta.size => Local::Partial(m.len()),
                        _ => Local::Missing,
                    },
                };
                PlannedFile { meta, local }
            })
            .collect();
        Plan { repo: repo.to_string(), revision: revision.to_string(), commit: commit.to_string(), files }
    }

    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.meta.size).sum()
    }

    /// Bytes still to transfer (partial downloads count for what they lack).
    pub fn bytes_to_fetch(&self) -> u64 {
        self.files
            .iter()
            .map(|f| match f.local {
                Local::Complete => 0,
                Local::Partial(n) => f.meta.size - n,
                Local::Missing => f.meta.size,
            })
            .sum()
    }

    /// Bytes of partial downloads that will be resumed.
    pub fn partial_bytes(&self) -> u64 {
        self.files.iter().map(|f| if let Local::Partial(n) = f.local { n } else { 0 }).sum()
    }

    pub fn complete_files(&self) -> usize {
        self.files.iter().filter(|f| f.local == Local::Complete).count()
    }
}

fn incomplete(blob: &Path) -> PathBuf {
    let mut s = blob.as_os_str().to_owned();
    s.push(".incomplete");
    PathBuf::from(s)
}

/// `../../blobs/<etag>` as seen from `snapshots/<commit>/<name>`.
fn link_target(name: &str, etag: &str) -> PathBuf {
    let depth = name.matches('/').count();
    let mut p = PathBuf::new();
    for _ in 0..depth + 2 {
        p.push("..");
    }
    p.join("blobs").join(etag)
}

/// Points `snapshots/<commit>/<name>` at the blob.
fn link(cache: &HubCache, plan: &Plan, meta: &FileMeta) -> Result<()> {
    let path = cache.snapshot_dir(&plan.repo, &plan.commit).join(&meta.name);
    let dir = path.parent().context("a snapshot file has no parent directory")?;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let target = link_target(&meta.name, &meta.etag);
    if std::fs::read_link(&path).is_ok_and(|t| t == target) {
        return Ok(());
    }
    match std::fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("cannot replace {}", path.display())),
    }
    std::os::unix::fs::symlink(&target, &path)
        .with_context(|| format!("cannot link {} to {}", path.display(), target.display()))
}

enum Hasher {
    Sha256(Box<Sha256>),
    Git(Box<Sha1>),
    Skip,
}

impl Hasher {
    fn new(hash: &ExpectedHash, size: u64) -> Hasher {
        match hash {
            ExpectedHash::Sha256(_) => Hasher::Sha256(Box::default()),
            ExpectedHash::GitSha1(_) => {
                let mut h = Sha1::new();
                h.update(format!("blob {size}\0").as_bytes());
                Hasher::Git(Box::new(h))
            }
            ExpectedHash::Unknown(_) => Hasher::Skip,
        }
    }

    fn update(&mut self, b: &[u8]) {
        match self {
            Hasher::Sha256(h) => h.update(b),
            Hasher::Git(h) => h.update(b),
            Hasher::Skip => {}
        }
    }

    fn hex(self) -> Option<String> {
        let bytes: Vec<u8> = match self {
            Hasher::Sha256(h) => h.finalize().to_vec(),
            Hasher::Git(h) => h.finalize().to_vec(),
            Hasher::Skip => return None,
        };
        Some(bytes.iter().map(|b| format!("{b:02x}")).collect())
    }
}

/// The sha256 of a file, hex (for tests and checks of files already on disk).
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut h = Hasher::Sha256(Box::default());
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).with_context(|| format!("read of {} failed", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.hex().unwrap_or_default())
}

/// Set when another file failed: the others stop at their next chunk (keeping what they have).
struct Stop(AtomicBool);

/// The marker error of a download abandoned because another one failed.
#[derive(Debug)]
struct Stopped;

impl std::fmt::Display for Stopped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("stopped because another download failed")
    }
}

impl std::error::Error for Stopped {}

/// Downloads every file of the plan that the cache lacks, `opts.threads` at a time, and links
/// them all into `snapshots/<commit>/`. `bar` counts the bytes transferred (its length is set to
/// [`Plan::bytes_to_fetch`]); `log` receives one line per event worth telling (resumes, retries,
/// files that cannot be checked). On failure, completed files stay in the cache and partial ones
/// stay as `.incomplete` blobs, so the next run resumes; a file whose hash does not match is
/// deleted.
pub fn download(
    hub: &Hub,
    cache: &HubCache,
    plan: &Plan,
    opts: &DownloadOptions,
    bar: &ProgressBar,
    log: &(dyn Fn(&str) + Sync),
) -> Result<Downloaded> {
    let repo_dir = cache.repo_dir(&plan.repo);
    std::fs::create_dir_all(repo_dir.join("blobs"))
        .with_context(|| format!("cannot create {}/blobs", repo_dir.display()))?;
    bar.set_length(plan.bytes_to_fetch());
    let mut reused = Vec::new();
    let mut queue = VecDeque::new();
    for (i, f) in plan.files.iter().enumerate() {
        if f.local == Local::Complete {
            link(cache, plan, &f.meta)?;
            reused.push(f.meta.name.clone());
        } else {
            queue.push_back(i);
        }
    }
    let queue = Mutex::new(queue);
    let stop = Stop(AtomicBool::new(false));
    let fetched: Mutex<Vec<Fetched>> = Mutex::new(Vec::new());
    let errors: Mutex<Vec<anyhow::Error>> = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..opts.threads.max(1) {
            s.spawn(|| {
                loop {
                    let Some(i) = queue.lock().unwrap().pop_front() else { return };
                    if stop.0.load(Ordering::Relaxed) {
                        return;
                    }
                    let f = &plan.files[i];
                    match fetch_one(hub, cache, plan, f, opts, bar, log, &stop) {
                        Ok(Some(done)) => fetched.lock().unwrap().push(done),
                        Ok(None) => {}
                        Err(e) => {
                            if e.downcast_ref::<Stopped>().is_none() {
                                stop.0.store(true, Ordering::Relaxed);
                                errors.lock().unwrap().push(e);
                            }
                            return;
                        }
                    }
                }
            });
        }
    });
    if let Some(e) = errors.into_inner().unwrap().into_iter().next() {
        return Err(e);
    }
    let mut fetched = fetched.into_inner().unwrap();
    fetched.sort_by(|a, b| a.name.cmp(&b.name));
    // Files another process finished while this one waited for their lock count as reused.
    for f in &plan.files {
        if f.local != Local::Complete && !fetched.iter().any(|d| d.name == f.meta.name) {
            reused.push(f.meta.name.clone());
        }
    }
    let wrote_ref =
        plan.revision != plan.commit && cache.read_ref(&plan.repo, &plan.revision).as_deref() != Some(&plan.commit);
    cache.write_ref(&plan.repo, &plan.revision, &plan.commit)?;
    if wrote_ref {
        journal_add(opts.journal.as_deref(), &format!("ref\t{}", plan.revision))?;
    }
    Ok(Downloaded { snapshot: cache.snapshot_dir(&plan.repo, &plan.commit), fetched, reused, wrote_ref })
}

/// Downloads one file into its blob and links it. None: another process completed it meanwhile.
#[allow(clippy::too_many_arguments)]
fn fetch_one(
    hub: &Hub,
    cache: &HubCache,
    plan: &Plan,
    f: &PlannedFile,
    opts: &DownloadOptions,
    bar: &ProgressBar,
    log: &(dyn Fn(&str) + Sync),
    stop: &Stop,
) -> Result<Option<Fetched>> {
    let meta = &f.meta;
    let name = &meta.name;
    let blob = cache.blob_path(&plan.repo, &meta.etag);
    let lock_path = cache.lock_path(&plan.repo, &meta.etag);
    if let Some(d) = lock_path.parent() {
        std::fs::create_dir_all(d).with_context(|| format!("cannot create {}", d.display()))?;
    }
    let lock = File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&lock_path)
        .with_context(|| format!("cannot open {}", lock_path.display()))?;
    if lock.try_lock().is_err() {
        log(&format!("waiting for another process that is downloading {name}"));
        lock.lock().with_context(|| format!("cannot lock {}", lock_path.display()))?;
    }
    if std::fs::metadata(&blob).is_ok_and(|m| m.len() == meta.size) {
        bar.dec_length(f.meta.size - if let Local::Partial(n) = f.local { n } else { 0 });
        link(cache, plan, meta)?;
        return Ok(None);
    }
    let part = incomplete(&blob);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&part)
        .with_context(|| format!("cannot open {}", part.display()))?;
    let mut hasher = Hasher::new(&meta.hash, meta.size);
    let mut hashed = 0u64;
    let mut failures = 0u32;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        if stop.0.load(Ordering::Relaxed) {
            return Err(Stopped.into());
        }
        let mut have = file.metadata().with_context(|| format!("cannot stat {}", part.display()))?.len();
        if have > meta.size {
            file.set_len(0).with_context(|| format!("cannot truncate {}", part.display()))?;
            have = 0;
        }
        if have == meta.size {
            break;
        }
        if hashed != have {
            // Resuming: the bytes already on disk enter the hash first.
            hasher = Hasher::new(&meta.hash, meta.size);
            hash_prefix(&file, have, &mut hasher, &mut buf)
                .with_context(|| format!("read of {} failed", part.display()))?;
            hashed = have;
        }
        if have > 0 {
            log(&format!("resuming {name} at {} of {}", HumanBytes(have), HumanBytes(meta.size)));
        }
        let before = have;
        let outcome: std::result::Result<(), anyhow::Error> = match hub.open_range(&meta.url, have, name) {
            Err(FetchError::Fatal(e)) => return Err(e),
            Err(FetchError::RangeRejected) => {
                log(&format!("{name}: the server rejected the range from byte {have}; starting the file again"));
                file.set_len(0).with_context(|| format!("cannot truncate {}", part.display()))?;
                bar.inc_length(have);
                hashed = 0;
                hasher = Hasher::new(&meta.hash, meta.size);
                Err(anyhow!("range rejected"))
            }
            Err(FetchError::Retry(e)) => Err(e),
            Ok(resp) => {
                let status = resp.status().as_u16();
                let start = if status == 206 { content_range_start(resp.headers()) } else { Some(0) };
                if start != Some(have) {
                    if have > 0 {
                        log(&format!("{name}: the server did not resume at byte {have}; starting the file again"));
                        bar.inc_length(have);
                    }
                    file.set_len(0).with_context(|| format!("cannot truncate {}", part.display()))?;
                    have = 0;
                    hashed = 0;
                    hasher = Hasher::new(&meta.hash, meta.size);
                    if start != Some(0) {
                        // A partial answer that starts elsewhere cannot be used.
                        failures += 1;
                        continue;
                    }
                }
                file.seek(SeekFrom::Start(have)).with_context(|| format!("cannot seek in {}", part.display()))?;
                let mut body = resp.into_body().into_reader();
                let mut result = Ok(());
                loop {
                    if stop.0.load(Ordering::Relaxed) {
                        file.flush().ok();
                        return Err(Stopped.into());
                    }
                    let n = match body.read(&mut buf) {
                        Ok(0) => break,
                        Ok(n) => n,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        Err(e) => {
                            result = Err(anyhow!(e).context(format!("the transfer of {name} broke off")));
                            break;
                        }
                    };
                    if hashed + n as u64 > meta.size {
                        return Err(anyhow!(
                            "{name}: {} sent more than the {} bytes the hub announced",
                            meta.url,
                            meta.size
                        ));
                    }
                    file.write_all(&buf[..n]).with_context(|| format!("write to {} failed", part.display()))?;
                    hasher.update(&buf[..n]);
                    hashed += n as u64;
                    bar.inc(n as u64);
                }
                if result.is_ok() && hashed < meta.size {
                    result = Err(anyhow!(
                        "the transfer of {name} ended at byte {hashed} of {} (connection closed early)",
                        meta.size
                    ));
                }
                result
            }
        };
        if let Err(e) = outcome {
            if hashed > before {
                failures = 0;
            }
            failures += 1;
            if failures >= opts.attempts {
                file.sync_all().ok();
                return Err(e.context(format!(
                    "downloading {name} of {}@{} failed {failures} times in a row; the {} received so far stay in {} and the next run resumes from there",
                    plan.repo,
                    plan.commit,
                    HumanBytes(hashed),
                    part.display()
                )));
            }
            let wait = opts.backoff.saturating_mul(1 << (failures - 1).min(4)).min(Duration::from_secs(8));
            log(&format!(
                "{e:#}; retrying in {:.1} s (attempt {} of {})",
                wait.as_secs_f32(),
                failures + 1,
                opts.attempts
            ));
            std::thread::sleep(wait);
        }
    }
    if hashed != meta.size {
        hasher = Hasher::new(&meta.hash, meta.size);
        hash_prefix(&file, meta.size, &mut hasher, &mut buf)
            .with_context(|| format!("read of {} failed", part.display()))?;
    }
    let check = match (&meta.hash, hasher.hex()) {
        (ExpectedHash::Sha256(want), Some(got)) | (ExpectedHash::GitSha1(want), Some(got)) if got != *want => {
            drop(file);
            let _ = std::fs::remove_file(&part);
            let kind = if matches!(meta.hash, ExpectedHash::Sha256(_)) { "sha256" } else { "git blob id" };
            bail!(
                "{name} of {}@{} is corrupt: the {kind} of the {} bytes downloaded from {} is {got}, the hub says {want}; the download was deleted, run the command again",
                plan.repo,
                plan.commit,
                meta.size,
                meta.url
            );
        }
        (ExpectedHash::Sha256(_), _) => Check::Sha256,
        (ExpectedHash::GitSha1(_), _) => Check::GitSha1,
        (ExpectedHash::Unknown(why), _) => {
            log(&format!("note: {name} is not checked: {why}"));
            Check::Unchecked(why.clone())
        }
    };
    file.sync_all().with_context(|| format!("fsync of {} failed", part.display()))?;
    drop(file);
    std::fs::rename(&part, &blob).with_context(|| format!("cannot rename {} to {}", part.display(), blob.display()))?;
    journal_add(opts.journal.as_deref(), &format!("blob\t{}\t{name}", meta.etag))?;
    link(cache, plan, meta)?;
    Ok(Some(Fetched { name: name.clone(), bytes: meta.size, check, blob }))
}

/// Hashes the first `len` bytes of `file`.
fn hash_prefix(file: &File, len: u64, hasher: &mut Hasher, buf: &mut [u8]) -> std::io::Result<()> {
    let mut off = 0u64;
    while off < len {
        let want = buf.len().min((len - off) as usize);
        let n = file.read_at(&mut buf[..want], off)?;
        if n == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "file shorter than expected"));
        }
        hasher.update(&buf[..n]);
        off += n as u64;
    }
    Ok(())
}

/// What [`remove_journaled`] removed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Removed {
    pub files: usize,
    pub bytes: u64,
}

/// Removes what the journal says this downloader added for `commit` of `repo` (in this run or
/// earlier ones): those blobs and their snapshot links, the refs it wrote if the snapshot is then
/// gone, and directories left empty; then the journal itself. Blobs that were in the cache before
/// (downloaded by other tools) are not in the journal and stay. Without a journal it only removes
/// empty directories.
pub fn remove_journaled(cache: &HubCache, repo: &str, commit: &str, journal: &Path) -> Result<Removed> {
    let text = match std::fs::read_to_string(journal) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", journal.display())),
    };
    let snapshot = cache.snapshot_dir(repo, commit);
    let mut removed = Removed::default();
    let mut refs = Vec::new();
    for line in text.lines() {
        let parts: Vec<&str> = line.split('\t').collect();
        match parts.as_slice() {
            ["blob", etag, name] if !etag.is_empty() && !etag.contains('/') => {
                let link = snapshot.join(name);
                if std::fs::read_link(&link).is_ok_and(|t| t == link_target(name, etag)) {
                    std::fs::remove_file(&link).with_context(|| format!("cannot remove {}", link.display()))?;
                }
                let blob = cache.blob_path(repo, etag);
                if let Ok(m) = std::fs::symlink_metadata(&blob) {
                    std::fs::remove_file(&blob).with_context(|| format!("cannot remove {}", blob.display()))?;
                    removed.files += 1;
                    removed.bytes += m.len();
                }
            }
            ["ref", revision] => refs.push(revision.to_string()),
            _ => {}
        }
    }
    let repo_dir = cache.repo_dir(repo);
    remove_empty_dirs(&snapshot);
    if !snapshot.exists() {
        for r in refs {
            cache.remove_ref_if(repo, &r, commit)?;
        }
    }
    for sub in ["snapshots", "refs", "blobs"] {
        remove_empty_dirs(&repo_dir.join(sub));
    }
    let _ = std::fs::remove_dir(&repo_dir);
    match std::fs::remove_file(journal) {
        Ok(()) => Ok(removed),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(removed),
        Err(e) => Err(e).with_context(|| format!("cannot remove {}", journal.display())),
    }
}

/// Removes `dir` and its subdirectories if they hold no files.
fn remove_empty_dirs(dir: &Path) {
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.filter_map(|e| e.ok()) {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_empty_dirs(&e.path());
            }
        }
    }
    let _ = std::fs::remove_dir(dir);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_and_links() {
        let mut h = Hasher::new(&ExpectedHash::GitSha1(String::new()), 0);
        h.update(b"");
        // `git hash-object` of an empty file.
        assert_eq!(h.hex().unwrap(), "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391");
        let mut h = Hasher::new(&ExpectedHash::Sha256(String::new()), 3);
        h.update(b"abc");
        assert_eq!(h.hex().unwrap(), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        assert_eq!(link_target("a.json", "e"), Path::new("../../blobs/e"));
        assert_eq!(link_target("sub/a.json", "e"), Path::new("../../../blobs/e"));
    }
}
