//! Running servers announce themselves in `<home>/servers/<pid>.json`, so that other commands
//! (`cherenkov status`) can find them without a port scan.
//!
//! The file holds one JSON object:
//!
//! ```json
//! {"pid": 4242, "url": "http://127.0.0.1:8080", "model": "flash", "started": 1767225600}
//! ```
//!
//! - `pid`: the server's process id; the file name is `<pid>.json`.
//! - `url`: the base URL clients connect to (scheme, host and port, no trailing `/v1`).
//! - `model`: the name (or MODEL argument) it serves.
//! - `started`: unix seconds when it began listening (optional).
//!
//! The server writes the file once it listens (written under a temporary name and renamed, so a
//! reader never sees half of it: [`Registry::announce_server`] does this) and removes it when it
//! stops (dropping the returned [`Announcement`]). A server that crashed leaves its file behind;
//! readers therefore check that `pid` still runs and that `GET {url}/v1/models` answers before
//! they report it as running, and report a file whose process is gone as stale.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::file::sync_dir;
use crate::registry::Registry;

/// The content of `servers/<pid>.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerRecord {
    pub pid: u32,
    pub url: String,
    pub model: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started: Option<u64>,
}

/// One file found in `servers/`.
#[derive(Debug)]
pub struct ServerFile {
    pub path: PathBuf,
    /// The pid in the file name.
    pub pid: u32,
    /// The record, or why it could not be read.
    pub record: std::result::Result<ServerRecord, String>,
}

/// A published `servers/<pid>.json`; removed when dropped.
#[derive(Debug)]
pub struct Announcement {
    path: PathBuf,
}

impl Announcement {
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Announcement {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Whether process `pid` runs. Without `/proc` nothing is known and every process counts as
/// running.
pub fn process_alive(pid: u32) -> bool {
    !Path::new("/proc/self").exists() || Path::new("/proc").join(pid.to_string()).exists()
}

impl Registry {
    /// Writes `servers/<pid>.json` for `record` (temporary file, then rename) and returns a guard
    /// that removes it when dropped.
    pub fn announce_server(&self, record: &ServerRecord) -> Result<Announcement> {
        let dir = self.servers_dir();
        std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let path = dir.join(format!("{}.json", record.pid));
        let tmp = dir.join(format!(".{}.json.tmp", record.pid));
        std::fs::write(&tmp, serde_json::to_vec_pretty(record)?)
            .with_context(|| format!("cannot write {}", tmp.display()))?;
        std::fs::rename(&tmp, &path)
            .with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))?;
        let _ = sync_dir(&dir);
        Ok(Announcement { path })
    }

    /// Every `servers/<pid>.json`, sorted by pid; unreadable ones carry the reason.
    pub fn server_files(&self) -> Result<Vec<ServerFile>> {
        let dir = self.servers_dir();
        let rd = match std::fs::read_dir(&dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
            Err(e) => return Err(e).with_context(|| format!("cannot list {}", dir.display())),
        };
        let mut out = Vec::new();
        for e in rd {
            let path = e.with_context(|| format!("cannot list {}", dir.display()))?.path();
            let name = path.file_name().unwrap_or_default().to_string_lossy().into_owned();
            let Some(pid) = name.strip_suffix(".json").and_then(|p| p.parse::<u32>().ok()) else { continue };
            let record =
                std::fs::read(&path).map_err(|e| format!("cannot read {}: {e}", path.display())).and_then(|b| {
                    serde_json::from_slice::<ServerRecord>(&b).map_err(|e| {
                        format!("{} is not a server record ({{\"pid\", \"url\", \"model\"}}): {e}", path.display())
                    })
                });
            out.push(ServerFile { path, pid, record });
        }
        out.sort_by_key(|f| f.pid);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn announce_list_and_withdraw() {
        let home = tempfile::tempdir().unwrap();
        let reg = Registry::open(home.path()).unwrap();
        assert!(reg.server_files().unwrap().is_empty());
        let rec = ServerRecord {
            pid: std::process::id(),
            url: "http://127.0.0.1:8080".into(),
            model: "flash".into(),
            started: Some(5),
        };
        let a = reg.announce_server(&rec).unwrap();
        assert_eq!(a.path(), reg.servers_dir().join(format!("{}.json", rec.pid)));
        std::fs::write(reg.servers_dir().join("17.json"), "{not json").unwrap();
        std::fs::write(reg.servers_dir().join("notes.txt"), "ignored").unwrap();
        let files = reg.server_files().unwrap();
        assert_eq!(files.len(), 2);
        let bad = files.iter().find(|f| f.pid == 17).unwrap();
        assert!(bad.record.as_ref().unwrap_err().contains("is not a server record"));
        let ours = files.iter().find(|f| f.pid == rec.pid).unwrap();
        assert_eq!(ours.record.as_ref().unwrap(), &rec);
        assert!(process_alive(rec.pid));
        drop(a);
        assert_eq!(reg.server_files().unwrap().len(), 1);
        // The documented minimal form (no `started`) reads.
        let r: ServerRecord = serde_json::from_str(r#"{"pid": 1, "url": "http://h:1", "model": "m"}"#).unwrap();
        assert_eq!(r.started, None);
    }
}
