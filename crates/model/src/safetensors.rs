//! A validating safetensors reader.
//!
//! Format: `u64` little-endian header length N, N bytes of JSON (`name -> {dtype, shape,
//! data_offsets: [begin, end]}` plus an optional `__metadata__`), then the data section; offsets are
//! relative to the data section. Everything is checked when a file is opened, so later reads cannot
//! run past the end: the header length, every tensor's offsets against the data section, its byte
//! length against dtype x shape, and overlaps between tensors. Reads are positioned (`pread`), so
//! packing a checkpoint touches only the bytes it converts and holds none of it in memory.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::dtype::DType;

/// Largest header accepted (the real 100 GB checkpoints have headers of a few MB).
const MAX_HEADER: u64 = 256 << 20;

#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// Absolute byte offset of the first element in the file.
    pub offset: u64,
    /// Byte length (= numel * dtype size).
    pub len: u64,
}

impl TensorInfo {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// One open `.safetensors` file.
pub struct SafeTensors {
    path: PathBuf,
    file: File,
    tensors: BTreeMap<String, TensorInfo>,
    metadata: BTreeMap<String, String>,
    /// xxh3 of the header, the file length and samples of the data: identifies the file cheaply.
    fingerprint: u64,
}

impl SafeTensors {
    pub fn open(path: &Path) -> Result<SafeTensors> {
        let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        let file_len = file.metadata().with_context(|| format!("cannot stat {}", path.display()))?.len();
        let show = path.display();
        if file_len < 8 {
            bail!("{show}: truncated safetensors file ({file_len} bytes; the header length alone takes 8)");
        }
        let mut len_bytes = [0u8; 8];
        file.read_exact_at(&mut len_bytes, 0).with_context(|| format!("{show}: cannot read the header length"))?;
        let header_len = u64::from_le_bytes(len_bytes);
        if header_len > MAX_HEADER {
            bail!(
                "{show}: header length {header_len} is larger than the {MAX_HEADER}-byte limit; not a safetensors file?"
            );
        }
        if 8 + header_len > file_len {
            bail!(
                "{show}: truncated safetensors file: the header claims {header_len} bytes but the file has {file_len} in all"
            );
        }
        let mut header = vec![0u8; header_len as usize];
        file.read_exact_at(&mut header, 8).with_context(|| format!("{show}: cannot read the header"))?;
        let json: serde_json::Value = serde_json::from_slice(&header)
            .with_context(|| format!("{show}: the header is not valid JSON (is this a safetensors file?)"))?;
        let obj = json.as_object().with_context(|| format!("{show}: the header is not a JSON object"))?;
        let data_start = 8 + header_len;
        let data_len = file_len - data_start;

        let mut tensors = BTreeMap::new();
        let mut metadata = BTreeMap::new();
        for (name, v) in obj {
            if name == "__metadata__" {
                if let Some(m) = v.as_object() {
                    for (k, v) in m {
                        if let Some(s) = v.as_str() {
                            metadata.insert(k.clone(), s.to_string());
                        }
                    }
                }
                continue;
            }
            let entry =
                v.as_object().with_context(|| format!("{show}: tensor {name:?}: header entry is not an object"))?;
            let dtype_s = entry
                .get("dtype")
                .and_then(|d| d.as_str())
                .with_context(|| format!("{show}: tensor {name:?}: missing dtype"))?;
            let dtype = DType::parse(dtype_s).with_context(|| format!("{show}: tensor {name:?}"))?;
            let shape = entry
                .get("shape")
                .and_then(|s| s.as_array())
                .with_context(|| format!("{show}: tensor {name:?}: missing shape"))?
                .iter()
                .map(|d| d.as_u64().map(|d| d as usize))
                .collect::<Option<Vec<usize>>>()
                .with_context(|| format!("{show}: tensor {name:?}: shape is not a list of non-negative integers"))?;
            let offs = entry
                .get("data_offsets")
                .and_then(|s| s.as_array())
                .with_context(|| format!("{show}: tensor {name:?}: missing data_offsets"))?;
            if offs.len() != 2 {
                bail!("{show}: tensor {name:?}: data_offsets must hold two numbers");
            }
            let (begin, end) = match (offs[0].as_u64(), offs[1].as_u64()) {
                (Some(b), Some(e)) => (b, e),
                _ => bail!("{show}: tensor {name:?}: data_offsets are not non-negative integers"),
            };
            if begin > end {
                bail!("{show}: tensor {name:?}: data_offsets [{begin}, {end}] run backwards");
            }
            if end > data_len {
                bail!(
                    "{show}: tensor {name:?}: data_offsets [{begin}, {end}] point past the end of the data section \
                     ({data_len} bytes): the file is truncated or the header is corrupt"
                );
            }
            let numel = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            let expect = numel.and_then(|n| n.checked_mul(dtype.size()));
            if expect != Some((end - begin) as usize) {
                bail!(
                    "{show}: tensor {name:?}: {dtype} {shape:?} needs {} bytes but data_offsets span {}",
                    expect.map(|e| e.to_string()).unwrap_or_else(|| "too many".into()),
                    end - begin
                );
            }
            tensors.insert(name.clone(), TensorInfo { dtype, shape, offset: data_start + begin, len: end - begin });
        }

        // Overlaps: sort by start; each tensor must begin at or after the previous one's end.
        let mut spans: Vec<(&String, u64, u64)> =
            tensors.iter().filter(|(_, t)| t.len > 0).map(|(n, t)| (n, t.offset, t.offset + t.len)).collect();
        spans.sort_by_key(|s| (s.1, s.2));
        for w in spans.windows(2) {
            if w[1].1 < w[0].2 {
                bail!("{show}: tensors {:?} and {:?} overlap in the data section", w[0].0, w[1].0);
            }
        }
        // Identity: the header, the length, and samples of the data (start, middle, end), so two
        // checkpoints with the same architecture but different weights differ.
        let mut h = xxhash_rust::xxh3::Xxh3::with_seed(file_len);
        h.update(&header);
        let sample = (64u64 << 10).min(data_len);
        for at in [data_start, data_start + (data_len - sample) / 2, file_len - sample] {
            let mut buf = vec![0u8; sample as usize];
            file.read_exact_at(&mut buf, at).with_context(|| format!("{show}: cannot read the data section"))?;
            h.update(&buf);
        }
        let fingerprint = h.digest();
        Ok(SafeTensors { path: path.to_path_buf(), file, tensors, metadata, fingerprint })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn tensors(&self) -> &BTreeMap<String, TensorInfo> {
        &self.tensors
    }

    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    pub fn get(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    /// Reads `out.len()` bytes starting `rel` bytes into tensor `t`.
    pub fn read_at(&self, t: &TensorInfo, rel: u64, out: &mut [u8]) -> Result<()> {
        if rel + out.len() as u64 > t.len {
            bail!(
                "{}: read of {} bytes at {rel} runs past a tensor of {} bytes",
                self.path.display(),
                out.len(),
                t.len
            );
        }
        self.file
            .read_exact_at(out, t.offset + rel)
            .with_context(|| format!("{}: read failed at byte {}", self.path.display(), t.offset + rel))
    }

    /// Reads a whole tensor.
    pub fn read(&self, t: &TensorInfo) -> Result<Vec<u8>> {
        let mut v = vec![0u8; t.len as usize];
        self.read_at(t, 0, &mut v)?;
        Ok(v)
    }
}

/// Writes a safetensors file (used by tests and by the synthetic-model builder).
pub fn write(path: &Path, tensors: &[(String, DType, Vec<usize>, Vec<u8>)]) -> Result<()> {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, dtype, shape, data) in tensors {
        let n: usize = shape.iter().product::<usize>() * dtype.size();
        if n != data.len() {
            bail!("tensor {name}: {dtype} {shape:?} needs {n} bytes, given {}", data.len());
        }
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype.name(), "shape": shape, "data_offsets": [offset, offset + n]}),
        );
        offset += n;
    }
    let mut h = serde_json::to_vec(&serde_json::Value::Object(header))?;
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + h.len() + offset);
    out.extend_from_slice(&(h.len() as u64).to_le_bytes());
    out.extend_from_slice(&h);
    for (_, _, _, data) in tensors {
        out.extend_from_slice(data);
    }
    std::fs::write(path, out).with_context(|| format!("cannot write {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header_file(dir: &Path, header: &str, data: usize) -> PathBuf {
        let p = dir.join("x.safetensors");
        let mut out = (header.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(header.as_bytes());
        out.extend(std::iter::repeat_n(0u8, data));
        std::fs::write(&p, out).unwrap();
        p
    }

    #[test]
    fn round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.safetensors");
        let data: Vec<u8> = (0..24u8).collect();
        write(&p, &[("a".into(), DType::F32, vec![2, 3], data.clone()), ("b".into(), DType::I64, vec![0], vec![])])
            .unwrap();
        let st = SafeTensors::open(&p).unwrap();
        let a = st.get("a").unwrap();
        assert_eq!(a.shape, vec![2, 3]);
        assert_eq!(st.read(a).unwrap(), data);
        assert_eq!(st.get("b").unwrap().len, 0);
    }

    #[test]
    fn rejects_offsets_past_end() {
        let dir = tempfile::tempdir().unwrap();
        let p = header_file(dir.path(), r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#, 8);
        let e = SafeTensors::open(&p).err().unwrap().to_string();
        assert!(e.contains("past the end") && e.contains("\"a\""), "{e}");
    }

    #[test]
    fn rejects_overlap() {
        let dir = tempfile::tempdir().unwrap();
        let p = header_file(
            dir.path(),
            r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}"#,
            16,
        );
        let e = SafeTensors::open(&p).err().unwrap().to_string();
        assert!(e.contains("overlap"), "{e}");
    }

    #[test]
    fn rejects_wrong_length_and_truncation() {
        let dir = tempfile::tempdir().unwrap();
        let p = header_file(dir.path(), r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}}"#, 16);
        let e = SafeTensors::open(&p).err().unwrap().to_string();
        assert!(e.contains("needs 12 bytes"), "{e}");
        let p = dir.path().join("t.safetensors");
        std::fs::write(&p, 1000u64.to_le_bytes()).unwrap();
        let e = SafeTensors::open(&p).err().unwrap().to_string();
        assert!(e.contains("truncated"), "{e}");
        std::fs::write(&p, [1u8, 2]).unwrap();
        let e = SafeTensors::open(&p).err().unwrap().to_string();
        assert!(e.contains("truncated"), "{e}");
    }

    #[test]
    fn rejects_bad_json_and_dtype() {
        let dir = tempfile::tempdir().unwrap();
        let p = header_file(dir.path(), "{not json", 0);
        assert!(SafeTensors::open(&p).err().unwrap().to_string().contains("not valid JSON"));
        let p = header_file(dir.path(), r#"{"a":{"dtype":"Q9","shape":[1],"data_offsets":[0,1]}}"#, 1);
        let e = format!("{:#}", SafeTensors::open(&p).err().unwrap());
        assert!(e.contains("Q9") && e.contains("\"a\""), "{e}");
    }
}
