//! Free space and file-system identity of paths (statvfs, stat).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// The nearest existing ancestor of `path` (itself if it exists).
pub fn existing_ancestor(path: &Path) -> Result<PathBuf> {
    let mut p = std::path::absolute(path).with_context(|| format!("{} cannot be made absolute", path.display()))?;
    loop {
        if p.exists() {
            return Ok(p);
        }
        if !p.pop() {
            bail!("no part of {} exists", path.display());
        }
    }
}

/// Space on the file system holding `path` (or the nearest existing ancestor).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Space {
    /// Bytes an unprivileged process may still write.
    pub free: u64,
    pub total: u64,
    /// The file system's device id (paths with the same one share their free space).
    pub device: u64,
}

/// [`Space`] of the file system holding `path`.
pub fn space(path: &Path) -> Result<Space> {
    let p = existing_ancestor(path)?;
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes())
        .with_context(|| format!("{} contains a NUL byte", p.display()))?;
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a valid NUL-terminated path and `st` a writable statvfs.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error()).with_context(|| format!("statvfs of {} failed", p.display()));
    }
    let device = std::fs::metadata(&p).with_context(|| format!("cannot stat {}", p.display()))?.dev();
    let frsize = st.f_frsize as u64;
    Ok(Space { free: st.f_bavail as u64 * frsize, total: st.f_blocks as u64 * frsize, device })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn space_of_a_path_that_does_not_exist_yet() {
        let tmp = tempfile::tempdir().unwrap();
        let here = space(tmp.path()).unwrap();
        let later = space(&tmp.path().join("a/b/c")).unwrap();
        assert_eq!(here.device, later.device);
        assert!(here.total >= here.free && here.total > 0);
        assert_eq!(existing_ancestor(&tmp.path().join("x/y")).unwrap(), tmp.path());
    }
}
