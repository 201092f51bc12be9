//! Device expert slots: the residency manager's [`SlotMemory`] in GPU memory.
//!
//! One device allocation of `slots x record_bytes`. An IO thread reads a record into a pinned host
//! staging buffer (positioned reads of its pieces in parallel on the rayon pool, each piece checked
//! against its own checksum when the store has them, else the whole record checked while the copy
//! runs), copies it into its slot on its own stream, and waits for the copy before it reports the
//! slot loaded; the pool never loads a slot that a step is using, so kernels never see a
//! half-written record.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Result, anyhow};
use cherenkov_engine::residency::{RecordSource, SlotMemory};
use cudarc::driver::result as cu;
use cudarc::driver::sys;
use rayon::prelude::*;

use crate::gpu::{DevBuf, Gpu};

/// A page-locked host buffer (so the copy engine can read it directly).
struct Pinned {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is owned and used by one IO thread at a time (taken from and returned to a pool).
unsafe impl Send for Pinned {}

/// Pieces one record is read in, in parallel.
const READ_PIECES: usize = 4;

pub struct DeviceSlots {
    gpu: Arc<Gpu>,
    buf: DevBuf,
    slot_count: usize,
    record_bytes: usize,
    /// Staging buffers and copy streams (with two timing events around the copy), one per
    /// concurrent load.
    staging: Mutex<Vec<Staging>>,
    /// Where load time goes (see [`LoadSplit`]).
    split: [AtomicU64; 6],
}

/// One concurrent load's staging buffer, copy stream and copy timing events.
struct Staging {
    pinned: Pinned,
    stream: sys::CUstream,
    start: sys::CUevent,
    end: sys::CUevent,
}

/// Where the loads' time went, summed over loads (ns): reading the pieces into pinned memory,
/// queueing the copy (the driver call), checking the sum (while the copy runs), and waiting for the
/// copy after that; and the copy as the GPU's events time it (from the point its stream reached it,
/// which includes any wait for the copy engine behind other loads' copies, to its end).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadSplit {
    pub loads: u64,
    pub read_ns: u64,
    pub queue_ns: u64,
    pub verify_ns: u64,
    pub copy_wait_ns: u64,
    pub copy_gpu_ns: u64,
}

// SAFETY: raw handles are used with the context bound; the pool serialises loads per slot.
unsafe impl Send for DeviceSlots {}
unsafe impl Sync for DeviceSlots {}

impl DeviceSlots {
    pub fn new(gpu: Arc<Gpu>, slot_count: usize, record_bytes: usize) -> Result<DeviceSlots> {
        let buf = gpu.alloc(slot_count * record_bytes, &format!("the expert cache ({slot_count} slots)"))?;
        Ok(DeviceSlots {
            gpu,
            buf,
            slot_count,
            record_bytes,
            staging: Mutex::new(Vec::new()),
            split: Default::default(),
        })
    }

    /// Where the loads' time went so far.
    pub fn load_split(&self) -> LoadSplit {
        let g = |i: usize| self.split[i].load(Ordering::Relaxed);
        LoadSplit { loads: g(0), read_ns: g(1), queue_ns: g(4), verify_ns: g(2), copy_wait_ns: g(3), copy_gpu_ns: g(5) }
    }

    /// Zeroes [`DeviceSlots::load_split`].
    pub fn reset_load_split(&self) {
        self.split.iter().for_each(|a| a.store(0, Ordering::Relaxed));
    }

    /// Device address of a slot's record.
    pub fn slot_ptr(&self, slot: usize) -> u64 {
        self.buf.at(slot * self.record_bytes)
    }

    pub fn bytes(&self) -> usize {
        self.buf.bytes
    }

    fn take_staging(&self) -> Result<Staging> {
        if let Some(s) = self.staging.lock().unwrap().pop() {
            return Ok(s);
        }
        self.gpu.bind()?;
        // SAFETY: plain pinned allocation of record_bytes.
        let ptr = unsafe { cu::malloc_host(self.record_bytes, 0) }
            .map_err(|e| anyhow!("cannot allocate {} bytes of pinned host memory: {e}", self.record_bytes))?
            as *mut u8;
        let stream = cu::stream::create(cu::stream::StreamKind::NonBlocking)
            .map_err(|e| anyhow!("cannot create a copy stream: {e}"))?;
        let event = || {
            cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
                .map_err(|e| anyhow!("cannot create a copy timing event: {e}"))
        };
        Ok(Staging { pinned: Pinned { ptr, len: self.record_bytes }, stream, start: event()?, end: event()? })
    }
}

impl SlotMemory for DeviceSlots {
    fn slot_count(&self) -> usize {
        self.slot_count
    }

    fn record_bytes(&self) -> usize {
        self.record_bytes
    }

    fn load(&self, slot: usize, record: &dyn RecordSource) -> Result<()> {
        self.gpu.bind()?;
        let staging = self.take_staging()?;
        let (pinned, stream) = (&staging.pinned, staging.stream);
        // SAFETY: the pinned buffer is len bytes, owned by this call until returned below.
        let host = unsafe { std::slice::from_raw_parts_mut(pinned.ptr, pinned.len) };
        // The pieces are read in parallel (a record read from the page cache is a memory copy that
        // one thread does at a fraction of the host's bandwidth); the copy to the GPU starts when
        // all are in, and the checksum is computed while it runs. The slot is reported loaded only
        // after both, so a corrupted record never counts as loaded.
        // With piece checksums each piece is checked as it is read, in parallel, and nothing is
        // left to check after the copy is queued.
        let checked = record.piece_bytes();
        let piece = checked.unwrap_or_else(|| self.record_bytes.div_ceil(READ_PIECES).next_multiple_of(4096));
        let t0 = Instant::now();
        let result = host
            .par_chunks_mut(piece)
            .enumerate()
            .try_for_each(|(i, chunk)| match checked {
                Some(_) => record.read_piece(i, chunk),
                None => record.read_range(i * piece, chunk),
            })
            .and_then(|()| {
                let t1 = Instant::now();
                // SAFETY: the slot holds record_bytes; the copy is waited for before returning; the
                // events belong to this context.
                unsafe {
                    cu::event::record(staging.start, stream).map_err(|e| anyhow!("cannot record an event: {e}"))?;
                    cu::memcpy_htod_async(self.slot_ptr(slot), &*host, stream)
                        .map_err(|e| anyhow!("copy of an expert record to the GPU failed: {e}"))?;
                    cu::event::record(staging.end, stream).map_err(|e| anyhow!("cannot record an event: {e}"))?;
                }
                let queued = Instant::now();
                let verified = if checked.is_some() { Ok(()) } else { record.verify(host) };
                let t2 = Instant::now();
                // SAFETY: the stream belongs to this context.
                unsafe { cu::stream::synchronize(stream) }
                    .map_err(|e| anyhow!("copy of an expert record to the GPU failed: {e}"))?;
                let done = Instant::now();
                // SAFETY: both events were recorded on this stream and have completed.
                let gpu_ms = unsafe { cu::event::elapsed(staging.start, staging.end) }.unwrap_or(0.0);
                let ns = |a: Instant, b: Instant| b.duration_since(a).as_nanos() as u64;
                self.split[5].fetch_add((gpu_ms as f64 * 1e6) as u64, Ordering::Relaxed);
                self.split[0].fetch_add(1, Ordering::Relaxed);
                self.split[1].fetch_add(ns(t0, t1), Ordering::Relaxed);
                self.split[4].fetch_add(ns(t1, queued), Ordering::Relaxed);
                self.split[2].fetch_add(ns(queued, t2), Ordering::Relaxed);
                self.split[3].fetch_add(ns(t2, done), Ordering::Relaxed);
                verified
            });
        self.staging.lock().unwrap().push(staging);
        result
    }
}

impl Drop for DeviceSlots {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        for st in self.staging.lock().unwrap().drain(..) {
            // SAFETY: allocated above, freed once.
            unsafe {
                let _ = cu::free_host(st.pinned.ptr as *mut c_void);
                let _ = cu::stream::destroy(st.stream);
                let _ = cu::event::destroy(st.start);
                let _ = cu::event::destroy(st.end);
            }
        }
    }
}
