//! The packed store: format ([`manifest`]), writer ([`pack`]) and reader ([`Store`]).

pub mod manifest;
pub mod pack;

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use memmap2::Mmap;
use xxhash_rust::xxh3::Xxh3;

pub use manifest::*;

/// An open store. `dense.bin` is mapped (the CPU backend reads weights straight from the map);
/// experts and n-gram rows are read with positioned reads, never loaded whole (the expert file is
/// mapped too, but only asked which of its pages are in the page cache, never read through).
pub struct Store {
    pub dir: PathBuf,
    pub manifest: Manifest,
    dense: Mmap,
    experts: File,
    /// The expert file mapped, for `mincore` only (None where it cannot be mapped).
    experts_map: Option<Mmap>,
    sums: Vec<u64>,
    /// Per-piece sums, record-major (empty for stores packed without them).
    piece_sums: Vec<u64>,
    ngram: Option<File>,
    index: HashMap<String, usize>,
}

/// A dense tensor's bytes inside the map.
pub struct TensorView<'a> {
    pub meta: &'a DenseTensor,
    pub data: &'a [u8],
    pub scales: Option<&'a [u8]>,
    pub biases: Option<&'a [u8]>,
}

impl TensorView<'_> {
    /// Affine words (`dense.bin` parts are 4 KiB aligned, so the cast cannot fail).
    pub fn words(&self) -> &[u32] {
        bytemuck::cast_slice(self.data)
    }
    pub fn scales_u16(&self) -> &[u16] {
        bytemuck::cast_slice(self.scales.unwrap_or(&[]))
    }
    pub fn biases_u16(&self) -> &[u16] {
        bytemuck::cast_slice(self.biases.unwrap_or(&[]))
    }
    /// Decodes a float tensor to f32.
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        match self.meta.precision {
            Precision::Float { dtype } => crate::dtype::to_f32_vec(dtype, self.data),
            Precision::Affine { .. } => bail!("{} is quantized; decode it row by row", self.meta.name),
        }
    }
}

fn read_manifest(dir: &Path) -> Result<Manifest> {
    let p = dir.join("manifest.json");
    let text = std::fs::read_to_string(&p)
        .with_context(|| format!("{} is not a store (no readable manifest.json)", dir.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not valid JSON", p.display()))?;
    if v.get("format").and_then(|f| f.as_str()) != Some(FORMAT) {
        bail!("{}: not a Cherenkov store manifest", p.display());
    }
    let ver = v.get("format_version").and_then(|f| f.as_u64()).unwrap_or(0);
    if ver != FORMAT_VERSION as u64 {
        bail!(
            "{}: store format version {ver}, this build reads version {FORMAT_VERSION}; prepare the model again",
            p.display()
        );
    }
    serde_json::from_value(v).with_context(|| format!("{}: malformed manifest", p.display()))
}

impl Store {
    /// Opens a store, checking that every file is present with the size the manifest records.
    pub fn open(dir: &Path) -> Result<Store> {
        let manifest = read_manifest(dir)?;
        for (name, sum) in &manifest.files {
            let p = dir.join(name);
            let len = std::fs::metadata(&p)
                .with_context(|| format!("store {} is incomplete: {name} is missing", dir.display()))?
                .len();
            if len != sum.bytes {
                bail!(
                    "store {}: {name} has {len} bytes, the manifest records {} (truncated or replaced; prepare again)",
                    dir.display(),
                    sum.bytes
                );
            }
        }
        let dense_f =
            File::open(dir.join("dense.bin")).with_context(|| format!("cannot open {}/dense.bin", dir.display()))?;
        // SAFETY: the store's files are written once and never modified in place.
        let dense =
            unsafe { Mmap::map(&dense_f) }.with_context(|| format!("cannot map {}/dense.bin", dir.display()))?;
        let experts = File::open(dir.join(&manifest.experts.file))
            .with_context(|| format!("cannot open {}/{}", dir.display(), manifest.experts.file))?;
        // SAFETY: as for dense.bin; the map is never read, only passed to mincore.
        let experts_map = unsafe { Mmap::map(&experts) }.ok();
        let sums_bytes = std::fs::read(dir.join(&manifest.experts.sums_file))
            .with_context(|| format!("cannot read {}/{}", dir.display(), manifest.experts.sums_file))?;
        let sums: Vec<u64> = sums_bytes.chunks_exact(8).map(|b| u64::from_le_bytes(b.try_into().unwrap())).collect();
        if sums.len() as u64 != manifest.experts.records() {
            bail!(
                "store {}: {} holds {} sums for {} records",
                dir.display(),
                manifest.experts.sums_file,
                sums.len(),
                manifest.experts.records()
            );
        }
        let ef = &manifest.experts;
        let piece_sums = match &ef.piece_sums {
            Some(ps) => {
                let bytes = std::fs::read(dir.join(&ps.file))
                    .with_context(|| format!("cannot read {}/{}", dir.display(), ps.file))?;
                let v: Vec<u64> = bytes.chunks_exact(8).map(|b| u64::from_le_bytes(b.try_into().unwrap())).collect();
                let want = ef.records() * ps.pieces(ef.record_bytes) as u64;
                if ps.piece_bytes == 0 || ps.piece_bytes % RECORD_ALIGN != 0 || v.len() as u64 != want {
                    bail!(
                        "store {}: {} holds {} piece sums of {} bytes, expected {want}",
                        dir.display(),
                        ps.file,
                        v.len(),
                        ps.piece_bytes
                    );
                }
                v
            }
            None => Vec::new(),
        };
        let ngram = match &manifest.ngram {
            Some(n) => Some(
                File::open(dir.join(&n.file)).with_context(|| format!("cannot open {}/{}", dir.display(), n.file))?,
            ),
            None => None,
        };
        let index = manifest.tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        for t in &manifest.tensors {
            for s in [Some(t.data), t.scales, t.biases].into_iter().flatten() {
                if s.offset + s.len > dense.len() as u64 || s.offset % DENSE_ALIGN != 0 {
                    bail!("store {}: tensor {} lies outside dense.bin or off its alignment", dir.display(), t.name);
                }
            }
        }
        Ok(Store { dir: dir.to_path_buf(), manifest, dense, experts, experts_map, sums, piece_sums, ngram, index })
    }

    pub fn config(&self) -> &crate::config::TextConfig {
        &self.manifest.config
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Index of a tensor in the manifest's table (resolve names once, then use [`Store::view`]).
    pub fn tensor_index(&self, name: &str) -> Result<usize> {
        self.index.get(name).copied().with_context(|| format!("store {} has no tensor {name}", self.dir.display()))
    }

    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        Ok(self.view(self.tensor_index(name)?))
    }

    /// The tensor at `index` of the manifest's table.
    pub fn view(&self, index: usize) -> TensorView<'_> {
        let meta = &self.manifest.tensors[index];
        let slice = |s: Span| &self.dense[s.range()];
        TensorView { meta, data: slice(meta.data), scales: meta.scales.map(slice), biases: meta.biases.map(slice) }
    }

    /// The whole mapped `dense.bin` (for backends that upload it).
    pub fn dense_bytes(&self) -> &[u8] {
        &self.dense
    }

    pub fn record_bytes(&self) -> usize {
        self.manifest.experts.record_bytes as usize
    }

    /// Reads the record of (MoE slot, expert) into `buf` (`record_bytes` long) and checks its sum.
    pub fn read_expert(&self, slot: usize, expert: usize, buf: &mut [u8]) -> Result<()> {
        self.read_expert_range(slot, expert, 0, buf)?;
        self.verify_expert(slot, expert, buf)
    }

    /// Reads bytes `offset..offset + buf.len()` of the record of (MoE slot, expert), unchecked
    /// (pieces of one record may be read in parallel; [`Store::verify_expert`] checks the whole).
    pub fn read_expert_range(&self, slot: usize, expert: usize, offset: usize, buf: &mut [u8]) -> Result<()> {
        let ef = &self.manifest.experts;
        if slot >= ef.layers.len() || expert >= ef.num_experts {
            bail!(
                "expert ({slot}, {expert}) is outside the store ({} layers x {} experts)",
                ef.layers.len(),
                ef.num_experts
            );
        }
        if offset + buf.len() > ef.record_bytes as usize {
            bail!("bytes {offset}..{} are outside an expert record of {}", offset + buf.len(), ef.record_bytes);
        }
        let idx = ef.record_index(slot, expert);
        self.experts
            .read_exact_at(buf, idx * ef.record_bytes + offset as u64)
            .with_context(|| format!("read of expert record {idx} from {}/{} failed", self.dir.display(), ef.file))
    }

    /// Prepares a read of the whole record of (MoE slot, expert): when any of its first, middle and
    /// last pages is not in the page cache, tells the kernel the record will be read now
    /// (`POSIX_FADV_WILLNEED`), so it is read from the disk in large requests while the pieces'
    /// parallel positioned reads wait for them. On the H200 host that took a cold load from 3.9 to
    /// 3.0 ms; the advice costs 0.03 ms on a cached record, hence the check. Linux reports page
    /// cache residency through `mincore` only for files the caller owns or may write; for a store
    /// it may only read, every record is advised (correct, 0.03 ms slower per cached load). Advice
    /// only: failures are ignored. Returns whether it advised.
    pub fn advise_expert(&self, slot: usize, expert: usize) -> bool {
        use std::os::fd::AsRawFd;
        let ef = &self.manifest.experts;
        if slot >= ef.layers.len() || expert >= ef.num_experts {
            return false;
        }
        let at = (ef.record_index(slot, expert) * ef.record_bytes) as usize;
        let len = ef.record_bytes as usize;
        if let Some(map) = &self.experts_map {
            let page = RECORD_ALIGN as usize;
            let cached = [at, at + len / 2 / page * page, at + len - page].iter().all(|&p| {
                let mut v = 0u8;
                // SAFETY: p is page-aligned (records are 4 KiB multiples) and inside the map; one
                // page, one result byte.
                let r = unsafe { libc::mincore(map.as_ptr().add(p) as *mut libc::c_void, page, &mut v) };
                r == 0 && v & 1 == 1
            });
            if cached {
                return false;
            }
        }
        // SAFETY: a valid descriptor; advice only.
        unsafe {
            libc::posix_fadvise(self.experts.as_raw_fd(), at as i64, len as i64, libc::POSIX_FADV_WILLNEED);
        }
        true
    }

    /// Bytes per separately checked piece of a record, when the store has piece sums.
    pub fn expert_piece_bytes(&self) -> Option<usize> {
        let ps = self.manifest.experts.piece_sums.as_ref()?;
        (!self.piece_sums.is_empty()).then_some(ps.piece_bytes as usize)
    }

    /// Reads piece `piece` of the record of (MoE slot, expert) into `buf` (the piece's length) and
    /// checks it against its piece sum. Pieces of one record may be read in parallel; all of them
    /// checked is the whole record checked.
    pub fn read_expert_piece(&self, slot: usize, expert: usize, piece: usize, buf: &mut [u8]) -> Result<()> {
        let ef = &self.manifest.experts;
        let ps = ef.piece_sums.as_ref().filter(|_| !self.piece_sums.is_empty());
        let ps = ps.with_context(|| format!("store {} has no per-piece checksums", self.dir.display()))?;
        let pieces = ps.pieces(ef.record_bytes);
        let start = piece * ps.piece_bytes as usize;
        let end = (start + ps.piece_bytes as usize).min(ef.record_bytes as usize);
        if piece >= pieces || buf.len() != end - start {
            bail!("piece {piece} ({} bytes) does not fit records of {pieces} pieces", buf.len());
        }
        self.read_expert_range(slot, expert, start, buf)?;
        self.check_piece(slot, expert, piece, twox_hash::XxHash3_64::oneshot(buf))
    }

    /// Reads piece `piece` of the record of (MoE slot, expert) like [`Store::read_expert_piece`],
    /// but in chunks of `bounce.len()` bytes through `bounce`, handing each chunk to
    /// `put(offset in the piece, bytes)` and checking the piece's sum as the chunks pass. For a
    /// destination that should not be written by the read itself: the CUDA loader puts the chunks
    /// into pinned memory with non-temporal stores, so the copy engine reads it from DRAM instead
    /// of snooping it out of other cores' caches. On a checksum mismatch every chunk has already
    /// been put, and the error says the piece is corrupted.
    pub fn read_expert_piece_chunked(
        &self,
        slot: usize,
        expert: usize,
        piece: usize,
        bounce: &mut [u8],
        put: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<()> {
        use std::hash::Hasher as _;
        let ef = &self.manifest.experts;
        let ps = ef.piece_sums.as_ref().filter(|_| !self.piece_sums.is_empty());
        let ps = ps.with_context(|| format!("store {} has no per-piece checksums", self.dir.display()))?;
        let start = piece * ps.piece_bytes as usize;
        if piece >= ps.pieces(ef.record_bytes) || bounce.is_empty() {
            bail!("piece {piece} is outside records of {} pieces (or no bounce buffer)", ps.pieces(ef.record_bytes));
        }
        let end = (start + ps.piece_bytes as usize).min(ef.record_bytes as usize);
        let mut hasher = twox_hash::XxHash3_64::new();
        let mut at = start;
        while at < end {
            let n = (end - at).min(bounce.len());
            let chunk = &mut bounce[..n];
            self.read_expert_range(slot, expert, at, chunk)?;
            hasher.write(chunk);
            put(at - start, chunk);
            at += n;
        }
        self.check_piece(slot, expert, piece, hasher.finish())
    }

    /// Compares a piece's computed sum with the stored one.
    fn check_piece(&self, slot: usize, expert: usize, piece: usize, got: u64) -> Result<()> {
        let ef = &self.manifest.experts;
        let ps = ef.piece_sums.as_ref().context("no per-piece checksums")?;
        let idx = ef.record_index(slot, expert);
        let want = self.piece_sums[idx as usize * ps.pieces(ef.record_bytes) + piece];
        if got != want {
            bail!(
                "corrupted expert record: layer {} expert {expert} (record {idx} of {}/{}) piece {piece} has checksum \
                 {got:016x}, expected {want:016x}; the store is damaged, prepare it again",
                ef.layers[slot].layer,
                self.dir.display(),
                ef.file
            );
        }
        Ok(())
    }

    /// Checks a whole record of (MoE slot, expert) against the store's checksum.
    pub fn verify_expert(&self, slot: usize, expert: usize, record: &[u8]) -> Result<()> {
        let ef = &self.manifest.experts;
        let idx = ef.record_index(slot, expert);
        // XXH3-64 as written by `pack` (xxhash-rust), computed with run-time SIMD dispatch: this
        // check sits on the expert read path.
        let got = twox_hash::XxHash3_64::oneshot(record);
        if got != self.sums[idx as usize] {
            bail!(
                "corrupted expert record: layer {} expert {expert} (record {idx} of {}/{}) has checksum {got:016x}, \
                 expected {:016x}; the store is damaged, prepare it again",
                ef.layers[slot].layer,
                self.dir.display(),
                ef.file,
                self.sums[idx as usize]
            );
        }
        Ok(())
    }

    pub fn ngram_table(&self, layer: usize) -> Option<&NgramTable> {
        self.manifest.ngram.as_ref()?.tables.iter().find(|t| t.layer == layer)
    }

    /// Reads one n-gram row (`row_bytes` long) of `table` into `buf`.
    pub fn read_ngram_row(&self, table: &NgramTable, row: u64, buf: &mut [u8]) -> Result<()> {
        if row >= table.rows {
            bail!("n-gram row {row} is outside layer {}'s table of {} rows", table.layer, table.rows);
        }
        let f = self.ngram.as_ref().context("store has no ngram.bin")?;
        f.read_exact_at(buf, table.offset + row * table.row_bytes)
            .with_context(|| format!("read of n-gram row {row} failed"))
    }

    /// Re-hashes every file (and every expert record). Returns the problems found.
    pub fn verify(&self, progress: &indicatif::ProgressBar) -> Result<Vec<String>> {
        let total: u64 = self.manifest.files.values().map(|f| f.bytes).sum();
        progress.set_length(total);
        let mut problems = Vec::new();
        let ef = &self.manifest.experts;
        for (name, sum) in &self.manifest.files {
            if *name == ef.file {
                let mut buf = vec![0u8; ef.record_bytes as usize];
                for slot in 0..ef.layers.len() {
                    for e in 0..ef.num_experts {
                        if let Err(err) = self.read_expert(slot, e, &mut buf) {
                            problems.push(format!("{err:#}"));
                        }
                        progress.inc(ef.record_bytes);
                    }
                }
                continue;
            }
            let p = self.dir.join(name);
            let f = File::open(&p).with_context(|| format!("cannot open {}", p.display()))?;
            let mut h = Xxh3::new();
            let mut buf = vec![0u8; 8 << 20];
            let mut off = 0u64;
            loop {
                let n = f.read_at(&mut buf, off).with_context(|| format!("read of {} failed", p.display()))?;
                if n == 0 {
                    break;
                }
                h.update(&buf[..n]);
                off += n as u64;
                progress.inc(n as u64);
            }
            let got = format!("{:016x}", h.digest());
            if got != sum.xxh3 || off != sum.bytes {
                problems.push(format!(
                    "{name}: checksum {got} over {off} bytes, the manifest records {} over {}",
                    sum.xxh3, sum.bytes
                ));
            }
        }
        Ok(problems)
    }
}

/// Reads a store's manifest without opening its files (for listings).
pub fn load_manifest(dir: &Path) -> Result<Manifest> {
    read_manifest(dir)
}

#[cfg(test)]
mod tests {
    /// Records are summed by `pack` with xxhash-rust and checked on read with twox-hash: the two
    /// must agree on every length (short inputs, the SIMD block sizes and record-sized ones).
    #[test]
    fn both_xxh3_implementations_agree() {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let data: Vec<u8> = (0..(3 << 20) + 17)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        for len in [0, 1, 3, 16, 17, 128, 129, 240, 241, 1024, 4096, 65_536 + 5, 2_768_896, data.len()] {
            let d = &data[..len];
            assert_eq!(xxhash_rust::xxh3::xxh3_64(d), twox_hash::XxHash3_64::oneshot(d), "length {len}");
        }
    }
}
