//! Running the built `cherenkov` binary against a private `CHERENKOV_HOME`, and copying and
//! damaging fixture checkpoints.
#![allow(dead_code)] // each test binary uses its own part

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use cherenkov_model::DType;
use cherenkov_model::safetensors::{SafeTensors, write};
use serde_json::Value;

pub fn fixture(p: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/golden").join(p).canonicalize().unwrap()
}

/// A temporary `CHERENKOV_HOME` (and scratch space beside it).
pub struct Home {
    pub tmp: tempfile::TempDir,
}

impl Home {
    pub fn new() -> Home {
        Home { tmp: tempfile::tempdir().unwrap() }
    }

    pub fn path(&self) -> PathBuf {
        self.tmp.path().join("home")
    }

    /// A scratch directory beside the home.
    pub fn scratch(&self, name: &str) -> PathBuf {
        self.tmp.path().join(name)
    }

    pub fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_cherenkov"));
        c.args(args).env("CHERENKOV_HOME", self.path());
        c
    }

    pub fn run(&self, args: &[&str]) -> Output {
        self.command(args).output().unwrap()
    }

    /// Runs a command that must succeed; returns stdout and stderr together.
    pub fn ok(&self, args: &[&str]) -> String {
        let o = self.run(args);
        let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        assert!(o.status.success(), "cherenkov {args:?} failed:\n{text}");
        text
    }

    /// Runs a command that must fail with an `error: ...` message; returns stderr.
    pub fn fails(&self, args: &[&str]) -> String {
        let o = self.run(args);
        let stderr = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(!o.status.success(), "cherenkov {args:?} succeeded:\n{}", String::from_utf8_lossy(&o.stdout));
        assert_eq!(o.status.code(), Some(1), "{stderr}");
        assert!(stderr.starts_with("error: ") || stderr.contains("\nerror: "), "{stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        stderr
    }

    /// Registered names and stores, from `registry.json` (absent: none).
    pub fn registered(&self) -> Vec<(String, PathBuf)> {
        let Ok(text) = std::fs::read_to_string(self.path().join("registry.json")) else { return vec![] };
        let v: Value = serde_json::from_str(&text).unwrap();
        v["models"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, e)| (k.clone(), PathBuf::from(e["store"].as_str().unwrap())))
            .collect()
    }

    pub fn store_of(&self, name: &str) -> PathBuf {
        self.registered().into_iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("{name} not registered")).1
    }

    /// Everything in `stores/`, hidden entries included.
    pub fn store_dirs(&self) -> Vec<String> {
        match std::fs::read_dir(self.path().join("stores")) {
            Ok(rd) => {
                let mut v: Vec<String> = rd.map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
                v.sort();
                v
            }
            Err(_) => vec![],
        }
    }
}

pub fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
}

pub type Tensors = Vec<(String, DType, Vec<usize>, Vec<u8>)>;

/// Rewrites a safetensors file through `edit` (every tensor read, edited, written back).
pub fn rewrite_tensors(file: &Path, edit: impl FnOnce(&mut Tensors)) {
    let st = SafeTensors::open(file).unwrap();
    let mut tensors: Tensors =
        st.tensors().iter().map(|(k, t)| (k.clone(), t.dtype, t.shape.clone(), st.read(t).unwrap())).collect();
    drop(st);
    edit(&mut tensors);
    write(file, &tensors).unwrap();
}

/// Rewrites a safetensors header through `edit`, keeping the data section's bytes.
pub fn patch_header(file: &Path, edit: impl FnOnce(&mut serde_json::Map<String, Value>, u64)) {
    let bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    edit(header.as_object_mut().unwrap(), data.len() as u64);
    let mut h = serde_json::to_vec(&header).unwrap();
    h.resize(h.len().next_multiple_of(8), b' ');
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(data);
    std::fs::write(file, out).unwrap();
}
