//! The store's expert file pinned where the page cache holds it, so the copy engine reads missing
//! records straight from there.
//!
//! A streamed miss otherwise costs a CPU copy before the GPU copy: the record is read from the page
//! cache into pinned staging memory (0.27-0.29 ms per 2.64 MiB record on the H200 host, bound by
//! host memory bandwidth when several loads run at once), then copied to the GPU (0.06-0.08 ms).
//! CUDA can register a read-only file mapping (`cuMemHostRegister` with
//! `CU_MEMHOSTREGISTER_READ_ONLY`): that pins the file's page-cache pages, and the copy engine then
//! reads a record from them at the pinned-memory rate (46 GB/s, 0.06 ms per record, in
//! `tools/gpu/register_probe.py`), with no CPU copy at all.
//!
//! Pinning keeps the whole expert file in host memory for as long as the model is loaded (it
//! cannot be evicted), so it is only for hosts with the memory to spare (`--pin-experts`). Every
//! record is checked against the store's checksums once, when the file is pinned, by positioned
//! reads of the same page-cache pages; a store is never written after `prepare`, so a record is not
//! checked again on each load as records read by the CPU are.

use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, anyhow, bail};
use cherenkov_model::store::Store;
use cudarc::driver::sys;
use rayon::prelude::*;

use crate::gpu::Gpu;

/// Bytes registered per `cuMemHostRegister` call (whole records; progress is reported per chunk).
const CHUNK_BYTES: usize = 1 << 30;

/// A store's expert file, mapped read-only, checked, and registered with CUDA in chunks of whole
/// records.
pub struct PinnedExperts {
    gpu: Arc<Gpu>,
    /// The store directory the file belongs to (what [`RecordSource::location`] names).
    ///
    /// [`RecordSource::location`]: cherenkov_engine::residency::RecordSource::location
    dir: PathBuf,
    map: memmap2::Mmap,
    /// The registered ranges of the map (start, bytes), in order.
    chunks: Vec<(usize, usize)>,
}

// SAFETY: the map is read-only and never read by the CPU after checking; the registered ranges are
// only handed to the copy engine.
unsafe impl Send for PinnedExperts {}
unsafe impl Sync for PinnedExperts {}

impl PinnedExperts {
    /// Checks every record of the store's expert file and pins the file's pages for the GPU,
    /// calling `progress(bytes done)` as it goes. Reading the records first (in parallel, on the
    /// rayon pool) also brings a cold file into the page cache, so the registration that follows
    /// finds its pages there.
    pub fn pin(gpu: Arc<Gpu>, store: &Store, progress: &(dyn Fn(u64) + Sync)) -> Result<PinnedExperts> {
        let ef = &store.manifest.experts;
        let path = store.dir.join(&ef.file);
        gpu.bind()?;
        let supported = gpu
            .ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED)
            .map_err(|e| anyhow!("cannot query the GPU's attributes: {e}"))?;
        if supported == 0 {
            bail!("{} cannot register read-only host memory, so the expert file cannot be pinned", gpu.info.name);
        }
        let file = std::fs::File::open(&path).with_context(|| format!("cannot open {}", path.display()))?;
        // SAFETY: a read-only shared mapping of a store file, which nothing writes after `prepare`;
        // the CPU never reads through it (the checks below use positioned reads), so a file cut
        // short under it cannot fault this process.
        let map = unsafe { memmap2::Mmap::map(&file) }.with_context(|| format!("cannot map {}", path.display()))?;
        let record = ef.record_bytes as usize;
        let records = ef.records() as usize;
        if map.len() < records * record {
            bail!("{} holds {} bytes, less than its {records} records of {record}", path.display(), map.len());
        }
        let per_chunk = (CHUNK_BYTES / record).max(1);
        let mut pinned = PinnedExperts {
            gpu: gpu.clone(),
            dir: store.dir.clone(),
            map,
            chunks: Vec::with_capacity(records / per_chunk + 1),
        };
        let done = std::sync::atomic::AtomicU64::new(0);
        for first in (0..records).step_by(per_chunk) {
            let last = (first + per_chunk).min(records);
            (first..last).into_par_iter().try_for_each(|idx| {
                check_record(store, idx)?;
                let d = done.fetch_add(record as u64, std::sync::atomic::Ordering::Relaxed);
                progress(d + record as u64);
                Ok::<(), anyhow::Error>(())
            })?;
            let (start, bytes) = (first * record, (last - first) * record);
            // SAFETY: the range lies inside the live read-only map (checked above); unregistered in
            // Drop before the map is unmapped.
            let r = unsafe {
                sys::cuMemHostRegister_v2(
                    pinned.map.as_ptr().add(start) as *mut c_void,
                    bytes,
                    sys::CU_MEMHOSTREGISTER_READ_ONLY,
                )
            };
            if r != sys::CUresult::CUDA_SUCCESS {
                bail!(
                    "cannot pin bytes {start}..{} of {} for the GPU ({r:?}); run with --pin-experts off",
                    start + bytes,
                    path.display()
                );
            }
            pinned.chunks.push((start, bytes));
        }
        Ok(pinned)
    }

    /// Bytes pinned.
    pub fn bytes(&self) -> u64 {
        self.chunks.iter().map(|c| c.1 as u64).sum()
    }

    /// The link's rate for copies from these pinned pages, in bytes/s: about `bytes` in slices
    /// from up to 8 registered ranges spread through the file (so pages count wherever the page
    /// cache put them, on whichever memory node), copied to the device back to back on the
    /// compute stream; the median of 5 rounds after an untimed one. Where the host's memory nodes
    /// differ in their path to the GPU this can differ from [`crate::gpu::measure_bandwidth`]'s
    /// rate, which copies from one fresh pinned buffer.
    pub fn measure_copy(&self, bytes: usize) -> Result<f64> {
        let n = self.chunks.len().min(8);
        let smallest = self.chunks.iter().map(|c| c.1).min().unwrap_or(0);
        let slice = (bytes / n.max(1)).min(smallest) & !0xFFF;
        if n == 0 {
            bail!("nothing of {}'s expert file is pinned, so its copy rate cannot be measured", self.dir.display());
        }
        if slice == 0 {
            bail!(
                "the pinned ranges of {}'s expert file ({smallest} bytes the smallest) are too small to time copies from",
                self.dir.display()
            );
        }
        let starts: Vec<usize> = (0..n).map(|i| self.chunks[i * self.chunks.len() / n].0).collect();
        let dst = self.gpu.alloc(slice, "the pinned expert file's copy test")?;
        self.gpu.bind()?;
        let round = || -> Result<f64> {
            let t = std::time::Instant::now();
            for &s in &starts {
                // SAFETY: `s..s + slice` lies in a registered range of the live map (slice is at
                // most the smallest range); dst holds `slice` bytes; the copy is waited for below.
                unsafe { cudarc::driver::result::memcpy_htod_async(dst.ptr, &self.map[s..s + slice], self.gpu.stream) }
                    .map_err(|e| anyhow!("a copy from {}'s pinned expert file failed: {e}", self.dir.display()))?;
            }
            self.gpu.sync()?;
            Ok(t.elapsed().as_secs_f64())
        };
        round()?;
        let mut times = (0..5).map(|_| round()).collect::<Result<Vec<f64>>>()?;
        times.sort_by(f64::total_cmp);
        Ok((slice * n) as f64 / times[times.len() / 2])
    }

    /// The pinned bytes of the record at `offset` of store `dir`'s expert file, if pinned whole.
    pub fn record(&self, dir: &Path, offset: u64, bytes: usize) -> Option<&[u8]> {
        if dir != self.dir {
            return None;
        }
        let start = usize::try_from(offset).ok()?;
        let end = start.checked_add(bytes)?;
        within_one(&self.chunks, start, end).then(|| &self.map[start..end])
    }
}

/// Whether bytes `start..end` lie inside one of the registered ranges `(start, bytes)` (a copy
/// must not span two registrations).
fn within_one(chunks: &[(usize, usize)], start: usize, end: usize) -> bool {
    chunks.iter().any(|&(s, n)| start >= s && end <= s + n)
}

/// Reads record `idx` of the store through its checksums (each piece, or the whole record).
pub(crate) fn check_record(store: &Store, idx: usize) -> Result<()> {
    let ef = &store.manifest.experts;
    let (slot, expert) = (idx / ef.num_experts, idx % ef.num_experts);
    thread_local! {
        static BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    BUF.with(|b| {
        let mut buf = b.borrow_mut();
        match store.expert_piece_bytes() {
            Some(piece) => {
                let pieces = (ef.record_bytes as usize).div_ceil(piece);
                buf.resize(256 << 10, 0);
                (0..pieces).try_for_each(|p| store.read_expert_piece_chunked(slot, expert, p, &mut buf, &mut |_, _| {}))
            }
            None => {
                buf.resize(ef.record_bytes as usize, 0);
                store.read_expert(slot, expert, &mut buf)
            }
        }
    })
}

impl Drop for PinnedExperts {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        for &(start, _) in &self.chunks {
            // SAFETY: registered in `pin` at this address, unregistered once, before the unmap.
            unsafe {
                let _ = sys::cuMemHostUnregister(self.map.as_ptr().add(start) as *mut c_void);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::within_one;

    #[test]
    fn a_record_is_pinned_only_inside_one_registered_chunk() {
        let chunks = [(0, 300), (300, 300), (600, 100)];
        assert!(within_one(&chunks, 0, 100) && within_one(&chunks, 200, 300) && within_one(&chunks, 600, 700));
        // Across a chunk boundary, past the end, or with nothing registered: not pinned.
        assert!(!within_one(&chunks, 250, 350));
        assert!(!within_one(&chunks, 650, 750));
        assert!(!within_one(&[], 0, 1));
    }
}
