//! Whether a store can be trusted before it is run, without re-hashing it whole.
//!
//! A full check (`inspect --verify`) re-hashes every byte: for a 100 GB store that is minutes of
//! disk reads, too slow for every start. What runs on every start instead:
//!
//! 1. `Store::open` checks that every file has the size the manifest records (truncation,
//!    replacement by a different file).
//! 2. The stamp `integrity.json` in the store remembers the last check that covered every byte
//!    (the packer's, which computed the checksums as it wrote, or a successful `inspect --verify`)
//!    with each file's size, inode, mtime and ctime at that moment. If every file still has them,
//!    nothing was written to the store since, and it is trusted without reading it.
//! 3. Otherwise the small files that are read whole at start are re-hashed: `dense.bin` (it is
//!    read in full for inference anyway, so the hash costs one sequential read that warms the page
//!    cache), the expert sums files (record and piece sums: they anchor every expert record's
//!    checksums to the manifest),
//!    the tokenizer and config files. The experts file and `ngram.bin`, the bulk of the store,
//!    are not read: every expert record is checked against its sum whenever it is read, and
//!    n-gram rows only by `inspect --verify`.
//! 4. A store found damaged (by `inspect --verify` or by step 3) is marked so in its stamp and
//!    refused by `run` (and by `prepare`'s reuse) until a later `inspect --verify` passes or it is
//!    packed again (`prepare --repack`).
//!
//! The trade-off: corruption that changes no metadata (a failing disk flipping bits in place)
//! is caught at start only in the files step 3 reads, and only when the stamp does not match;
//! in expert records it is caught when the record is read (the step errors, naming the record);
//! in `ngram.bin` only by `inspect --verify`. Editing files in place, truncating, replacing or
//! copying them changes the metadata and brings back step 3.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;

use anyhow::{Context, Result, bail};
use cherenkov_model::store::{Manifest, Store};
use cherenkov_registry::now_unix;
use indicatif::ProgressBar;
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::Xxh3;

use crate::progress::bytes_bar;

/// The stamp's file name inside a store.
pub const STAMP: &str = "integrity.json";

/// A file's metadata at the time of a full check.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileStat {
    pub bytes: u64,
    pub inode: u64,
    pub mtime: (i64, i64),
    pub ctime: (i64, i64),
}

/// `integrity.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stamp {
    /// Whether the check found every byte as the manifest records it.
    pub ok: bool,
    /// What checked: `packed`, `verified` (inspect --verify) or `quick check`.
    pub by: String,
    /// Unix seconds.
    pub at: u64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub problems: Vec<String>,
    /// `manifest.json` and every file the manifest lists.
    pub files: BTreeMap<String, FileStat>,
}

/// What the cheap check found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Health {
    /// No file changed since the full check in the stamp.
    Unchanged(Stamp),
    /// Files changed since the stamp (or there is none); the files read at start match.
    QuickOk { stamp: Option<Stamp>, hashed: Vec<String>, bytes: u64 },
    /// Damage, found now or by an earlier check (`by`, `at`).
    Damaged { by: String, at: u64, problems: Vec<String> },
}

fn stat(path: &Path) -> Result<FileStat> {
    let m = std::fs::metadata(path).with_context(|| format!("cannot stat {}", path.display()))?;
    Ok(FileStat {
        bytes: m.len(),
        inode: m.ino(),
        mtime: (m.mtime(), m.mtime_nsec()),
        ctime: (m.ctime(), m.ctime_nsec()),
    })
}

/// The metadata of the manifest and every file it lists.
pub fn stat_files(dir: &Path, m: &Manifest) -> Result<BTreeMap<String, FileStat>> {
    let mut out = BTreeMap::new();
    out.insert("manifest.json".to_string(), stat(&dir.join("manifest.json"))?);
    for name in m.files.keys() {
        out.insert(name.clone(), stat(&dir.join(name))?);
    }
    Ok(out)
}

pub fn read_stamp(dir: &Path) -> Option<Stamp> {
    serde_json::from_slice(&std::fs::read(dir.join(STAMP)).ok()?).ok()
}

/// Writes the stamp (temporary file, then rename).
pub fn write_stamp(dir: &Path, m: &Manifest, by: &str, problems: &[String]) -> Result<()> {
    let stamp = Stamp {
        ok: problems.is_empty(),
        by: by.to_string(),
        at: now_unix(),
        problems: problems.to_vec(),
        files: stat_files(dir, m)?,
    };
    let tmp = dir.join(format!(".{STAMP}.tmp-{}", std::process::id()));
    std::fs::write(&tmp, serde_json::to_vec_pretty(&stamp)?)
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, dir.join(STAMP)).with_context(|| format!("cannot rename {} into place", tmp.display()))
}

/// Records a check's outcome, or says on stderr why it cannot (a read-only store still works).
pub fn record(dir: &Path, m: &Manifest, by: &str, problems: &[String]) {
    if let Err(e) = write_stamp(dir, m, by, problems) {
        eprintln!("note: cannot record the check in {}: {e:#}", dir.join(STAMP).display());
    }
}

/// Whether the stamp says the store is damaged.
pub fn marked_damaged(dir: &Path) -> bool {
    read_stamp(dir).is_some_and(|s| !s.ok)
}

/// The files read whole at start: everything but the experts file and `ngram.bin`.
fn start_files(m: &Manifest) -> Vec<&String> {
    let ngram = m.ngram.as_ref().map(|n| n.file.as_str());
    m.files.keys().filter(|n| **n != m.experts.file && Some(n.as_str()) != ngram).collect()
}

/// Hashes `path` with xxh3-64.
fn hash_file(path: &Path, bar: &ProgressBar) -> Result<(String, u64)> {
    let f = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut h = Xxh3::new();
    let mut buf = vec![0u8; 8 << 20];
    let mut off = 0u64;
    loop {
        let n = f.read_at(&mut buf, off).with_context(|| format!("read of {} failed", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        off += n as u64;
        bar.inc(n as u64);
    }
    Ok((format!("{:016x}", h.digest()), off))
}

/// The cheap check (module docs). A store damaged now is marked in its stamp.
pub fn quick_check(store: &Store) -> Result<Health> {
    let (dir, m) = (&store.dir, &store.manifest);
    let stamp = read_stamp(dir);
    if let Some(s) = &stamp
        && !s.ok
    {
        return Ok(Health::Damaged { by: s.by.clone(), at: s.at, problems: s.problems.clone() });
    }
    if let Some(s) = &stamp
        && s.files == stat_files(dir, m)?
    {
        return Ok(Health::Unchanged(s.clone()));
    }
    let files = start_files(m);
    let total: u64 = files.iter().map(|f| m.files[*f].bytes).sum();
    let bar = bytes_bar("checking");
    bar.set_length(total);
    let mut problems = Vec::new();
    for name in &files {
        let (got, bytes) = hash_file(&dir.join(name), &bar)?;
        let want = &m.files[*name];
        if got != want.xxh3 || bytes != want.bytes {
            problems.push(format!(
                "{name}: checksum {got} over {bytes} bytes, the manifest records {} over {}",
                want.xxh3, want.bytes
            ));
        }
    }
    bar.finish_and_clear();
    if !problems.is_empty() {
        record(dir, m, "quick check", &problems);
        return Ok(Health::Damaged { by: "quick check".into(), at: now_unix(), problems });
    }
    Ok(Health::QuickOk { stamp, hashed: files.into_iter().cloned().collect(), bytes: total })
}

/// `2026-01-02 03:04 UTC` for unix seconds.
pub fn format_time(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (proleptic Gregorian).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let mo = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(mo <= 2);
    format!("{y:04}-{mo:02}-{d:02} {:02}:{:02} UTC", rem / 3600, rem % 3600 / 60)
}

/// One line about a store's health, for `inspect` and `status`.
pub fn describe(h: &Health) -> String {
    match h {
        Health::Unchanged(s) => format!(
            "ok: no file changed since the full check when it was {} ({})",
            if s.by == "packed" { "packed" } else { "verified" },
            format_time(s.at)
        ),
        Health::QuickOk { stamp, hashed, bytes } => format!(
            "ok by the quick check: {} file(s) ({}) match their checksums; {}; expert records are checked as they are read (inspect --verify checks everything)",
            hashed.len(),
            indicatif::HumanBytes(*bytes),
            match stamp {
                Some(s) => format!("files changed since the full check of {}", format_time(s.at)),
                None => "no full check is recorded".to_string(),
            }
        ),
        Health::Damaged { by, at, problems } => {
            format!("DAMAGED (found by {by}, {}): {}", format_time(*at), problems.join("; "))
        }
    }
}

/// What the stamp alone says (no file is read; for listings): `ok`, `changed since the last
/// check`, `damaged` or `no check recorded`.
pub fn stamp_state(dir: &Path) -> &'static str {
    let Some(stamp) = read_stamp(dir) else { return "no check recorded" };
    if !stamp.ok {
        return "damaged";
    }
    match cherenkov_model::store::load_manifest(dir).and_then(|m| stat_files(dir, &m)) {
        Ok(files) if files == stamp.files => "ok",
        _ => "changed since the last check",
    }
}

/// The check `run` (and every command that runs a model) makes before it uses a store: refuses a
/// damaged one, says on stderr when it had to re-hash.
pub fn check_before_run(dir: &Path, name: Option<&str>, source: Option<&str>) -> Result<()> {
    let store = Store::open(dir)?;
    let health = quick_check(&store)?;
    match &health {
        Health::Unchanged(_) => Ok(()),
        Health::QuickOk { .. } => {
            eprintln!(
                "note: store {}: {}; run `cherenkov inspect {} --verify` to check every byte and skip this check on later starts",
                dir.display(),
                describe(&health),
                name.unwrap_or(&dir.display().to_string())
            );
            Ok(())
        }
        Health::Damaged { .. } => {
            let again = match (name, source) {
                (Some(n), Some(s)) => format!("prepare it again: cherenkov prepare {s} --name {n} --repack"),
                _ => "prepare its checkpoint again with --repack".to_string(),
            };
            bail!(
                "store {} is damaged and will not be used: {}; {again} (or, if the files were restored, re-check with cherenkov inspect {} --verify)",
                dir.display(),
                describe(&health),
                name.map(String::from).unwrap_or_else(|| dir.display().to_string())
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_times() {
        assert_eq!(format_time(0), "1970-01-01 00:00 UTC");
        assert_eq!(format_time(951_782_400), "2000-02-29 00:00 UTC");
        assert_eq!(format_time(1_767_225_600 + 3 * 3600 + 4 * 60), "2026-01-01 03:04 UTC");
    }
}
