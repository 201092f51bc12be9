//! Device expert slots: the residency manager's [`SlotMemory`] in GPU memory.
//!
//! One device allocation of `slots x record_bytes`. An IO thread reads a record into a pinned host
//! staging buffer ([`stage_record`]: positioned reads of its pieces in parallel on the rayon pool
//! through small bounce buffers, streamed into the staging buffer with non-temporal stores, each
//! piece checked against its own checksum when the store has them, else the whole record checked
//! while the copy runs), copies it into its slot on its own stream, and waits for the copy before
//! it reports the slot loaded; the pool never loads a slot that a step is using, so kernels never
//! see a half-written record.
//!
//! With the store's expert file pinned ([`PinnedExperts`], `--pin-experts`), there is no staging:
//! the copy engine copies the record straight from its page-cache pages into the slot, and the
//! load returns as soon as the copy is queued. The pool then counts the slot as loaded while the
//! copy may still be running, so whatever reads the slot first calls [`DeviceSlots::await_slot`],
//! which makes its stream wait for the slot's copy (no host wait). A later copy into the same slot
//! is queued behind the earlier one. The loads a step runs itself (`ExpertPool::load_queued`) are
//! held until the last of them and queued as one `cuMemcpyBatchAsync`, their down projections as a
//! second: on the H200 host a batch of 2 records copied in 104.5 us against 107.4 for two copies,
//! 4 in 205.5 against 212.9 (`crates/cuda/tests/zero_copy_probe.rs`). The batch's first copy is
//! queued at once, so the link starts while the host decides the rest: a streamed block's first
//! copy then started 0.014-0.018 ms after its router instead of 0.018-0.027 with the first held
//! too. `CHERENKOV_NO_COPY_BATCH=1` queues each copy at once.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Result, anyhow, bail};
use cherenkov_engine::residency::{RecordSource, SlotMemory};
use cudarc::driver::result as cu;
use cudarc::driver::sys;
use rayon::prelude::*;

use crate::gpu::{DevBuf, Event, Gpu};
use crate::pinned::PinnedExperts;

/// A page-locked host buffer (so the copy engine can read it directly).
struct Pinned {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is owned and used by one IO thread at a time (taken from and returned to a pool).
unsafe impl Send for Pinned {}

/// Pieces one record is read in, in parallel (when the store has no piece checksums that set them).
const READ_PIECES: usize = 16;

/// Bytes a reading thread reads at a time through its bounce buffer (small enough to stay in its
/// core's L2 while the chunk is checked and streamed into the staging buffer).
const BOUNCE_BYTES: usize = 256 << 10;

thread_local! {
    /// Whether this thread is inside a step's batch of loads (`SlotMemory::begin_batch`): 0 no,
    /// 1 yes and nothing copied yet, 2 yes and the first copy queued.
    static BATCHING: std::cell::Cell<u8> = const { std::cell::Cell::new(0) };
    /// When this thread's batch began (its host time goes to [`DeviceSlots::batch_ns`]).
    static BATCH_START: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
    /// When this thread's batch queued its first copy, and this thread's last batch's start and
    /// first copy (see [`last_batch`]).
    static FIRST_COPY: std::cell::Cell<Option<Instant>> = const { std::cell::Cell::new(None) };
    static LAST_BATCH: std::cell::Cell<(Option<Instant>, Option<Instant>)> =
        const { std::cell::Cell::new((None, None)) };
    /// Each reading thread's bounce buffer (see [`stage_record`]).
    static BOUNCE: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Reads `record` into the staging buffer `host` (its whole length), its pieces in parallel on the
/// rayon pool, each piece checked against its own checksum when the store has them (otherwise the
/// caller must check the whole record).
///
/// The bytes do not go straight from the read into `host`: each thread reads a chunk into its
/// small bounce buffer, checks it there, and streams it into `host` with non-temporal stores
/// ([`copy_streaming`]). Read straight into `host`, the record sits dirty in the reading cores'
/// caches, and the copy engine that reads it next must fetch every line from them: on the H200
/// host a 2.64 MiB copy ran at 16 GB/s after four threads had read into its buffer and at 44-48
/// GB/s from memory no core had just written (`tools/gpu/copy_probe.py`).
///
/// First the record is offered to [`RecordSource::advise`], which asks the OS to read a record
/// that is not in the page cache in large requests while the pieces' reads wait for it.
///
/// Tried and dropped (2026-11-30): each thread queueing its piece's copy to the GPU as soon as the
/// piece was staged. The driver calls serialize on the stream, and warm loads took 0.42-0.55 ms
/// instead of 0.28.
pub fn stage_record(record: &dyn RecordSource, host: &mut [u8]) -> Result<()> {
    let checked = record.piece_bytes();
    let piece = checked.unwrap_or_else(|| host.len().div_ceil(READ_PIECES).next_multiple_of(4096));
    record.advise();
    host.par_chunks_mut(piece).enumerate().try_for_each(|(i, dst)| {
        BOUNCE.with(|b| {
            let mut bounce = b.borrow_mut();
            if bounce.len() < BOUNCE_BYTES {
                bounce.resize(BOUNCE_BYTES, 0);
            }
            match checked {
                Some(_) => record.read_piece_chunked(i, &mut bounce, &mut |at, bytes| {
                    copy_streaming(&mut dst[at..at + bytes.len()], bytes)
                }),
                None => {
                    for (k, d) in dst.chunks_mut(BOUNCE_BYTES).enumerate() {
                        let chunk = &mut bounce[..d.len()];
                        record.read_range(i * piece + k * BOUNCE_BYTES, chunk)?;
                        copy_streaming(d, chunk);
                    }
                    Ok(())
                }
            }
        })
    })
}

/// `dst.copy_from_slice(src)`, written with non-temporal (cache-bypassing) stores where the CPU
/// has them (x86-64: SSE2, part of the base instruction set), so the bytes end in memory and not
/// dirty in this core's caches; elsewhere an ordinary copy.
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy_streaming of {} bytes into {}", src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        let head = dst.as_ptr().align_offset(16).min(dst.len());
        let lines = (dst.len() - head) / 64;
        let tail = head + lines * 64;
        dst[..head].copy_from_slice(&src[..head]);
        // SAFETY: dst[head..tail] is 16-byte aligned and in bounds, as is src[head..tail] (read
        // unaligned); SSE2 is always present on x86-64; the fence orders the streamed stores
        // before whatever this thread does next (the copy to the GPU is queued after it).
        unsafe {
            let d = dst.as_mut_ptr().add(head) as *mut __m128i;
            let s = src.as_ptr().add(head) as *const __m128i;
            for l in 0..lines {
                let (d, s) = (d.add(4 * l), s.add(4 * l));
                let (a, b, c, e) = (
                    _mm_loadu_si128(s),
                    _mm_loadu_si128(s.add(1)),
                    _mm_loadu_si128(s.add(2)),
                    _mm_loadu_si128(s.add(3)),
                );
                _mm_stream_si128(d, a);
                _mm_stream_si128(d.add(1), b);
                _mm_stream_si128(d.add(2), c);
                _mm_stream_si128(d.add(3), e);
            }
            _mm_sfence();
        }
        dst[tail..].copy_from_slice(&src[tail..]);
    }
    #[cfg(not(target_arch = "x86_64"))]
    dst.copy_from_slice(src);
}

pub struct DeviceSlots {
    gpu: Arc<Gpu>,
    buf: DevBuf,
    slot_count: usize,
    record_bytes: usize,
    /// Staging buffers and copy streams (with two timing events around the copy), one per
    /// concurrent load.
    staging: Mutex<Vec<Staging>>,
    /// Where load time goes (see [`LoadSplit`]).
    split: [AtomicU64; 8],
    /// Host time inside steps' batches of loads, from `begin_batch` to the end of `end_batch`
    /// (ns): a step's misses leased and their copies queued.
    batch_ns: AtomicU64,
    /// The store's expert file pinned for the copy engine, if it is.
    pinned: Option<PinnedExperts>,
    /// Per slot, the last copy from the pinned file, while it may still be running.
    copies: Vec<Mutex<SlotCopy>>,
    /// The copy stream of copies from the pinned file (made at first use). One stream: copies
    /// run one after another in the order they were queued (four streams taken in turn copied a
    /// block's misses no sooner on the H200 host: the link was the limit).
    copy_stream: Mutex<Option<sys::CUstream>>,
    /// Bytes at the head of a record that hold everything but the down projection (0: records are
    /// copied whole), and the slots whose back part waits to be queued, oldest first.
    front_bytes: AtomicUsize,
    backs: Mutex<Vec<usize>>,
    /// The slots whose front part (or whole record) waits to be queued with the rest of a step's
    /// batch, oldest first; and whether loads are batched at all (`CHERENKOV_NO_COPY_BATCH` unset).
    fronts: Mutex<Vec<usize>>,
    batch: bool,
    /// Hold a batch's first copy too (`CHERENKOV_HOLD_FIRST_COPY=1`, for measurements).
    hold_first: bool,
    /// Time the copies from the pinned file on the GPU ([`DeviceSlots::set_copy_timing`]).
    time_copies: bool,
    /// Where the device finds landed records by itself ([`DeviceSlots::enable_hit_map`]).
    hits: std::sync::OnceLock<HitMap>,
}

/// The hit map: per record of the store (MoE layer x expert), its slot's address with the
/// layer's tag where the record has landed in a slot copied from the pinned file, else 0. It lives
/// in mapped host memory, written by the host only while no router that reads it is queued (the
/// pool decides evictions on a step's thread between its blocks), and read by a streamed block's
/// router (`route_topk`'s `map`), which writes the block's experts found there into their table
/// entries itself, so their kernels need no host turn. A record enters the map once its copy is
/// seen complete ([`DeviceSlots::publish_landed`]) and leaves it when the pool replaces the
/// slot's record ([`SlotMemory::retire`]), before the new copy is queued.
struct HitMap {
    map: crate::gpu::Pinned,
    /// Per MoE layer, the tag its table entries carry (`layer_tag`).
    tags: Vec<u64>,
    experts: usize,
    /// Slots whose record is not in the map yet (their copy may still be running).
    unpublished: Mutex<Vec<usize>>,
}

impl HitMap {
    fn set(&self, record: usize, value: u64) {
        assert!(record < self.map.bytes / 8, "record {record} is outside the hit map");
        // SAFETY: inside the mapping (checked); a plain store the device reads after a later launch.
        unsafe { (self.map.host as *mut u64).add(record).write_volatile(value) };
    }

    fn get(&self, record: usize) -> u64 {
        assert!(record < self.map.bytes / 8, "record {record} is outside the hit map");
        // SAFETY: inside the mapping (checked); only the host writes it.
        unsafe { (self.map.host as *const u64).add(record).read_volatile() }
    }
}

/// A slot's copy events (made at its first copy from the pinned file: start, front landed, end;
/// the start recorded only where copies are timed, [`DeviceSlots::set_copy_timing`]),
/// whether the last copy has not yet been seen complete, and the record's parts while their copies
/// are not queued yet: the front (or the whole record) while its step's batch is open, the back
/// until [`DeviceSlots::queue_backs`] (see [`DeviceSlots::set_front_bytes`]).
#[derive(Default)]
struct SlotCopy {
    /// The store's record index of what the slot holds or is being loaded with (hit map only).
    record: Option<usize>,
    events: Option<[sys::CUevent; 3]>,
    pending: bool,
    front: Option<Part>,
    back: Option<Part>,
}

/// A part of a record copied from the pinned file, not queued yet: its source in the pinned
/// mapping (which lives as long as the slots) and its place in the slot.
#[derive(Clone, Copy)]
struct Part {
    src: *const u8,
    len: usize,
    dst: u64,
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
/// which includes any wait for the copy engine behind other loads' copies, to its end; for a copy
/// in two parts, from the front's start to the back's end, which includes the other copies queued
/// in between). `direct`
/// counts the loads copied straight from the pinned expert file: no reading, no checksum, and no
/// host wait (the copy runs in the background; its GPU time counts once it is seen complete).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadSplit {
    pub loads: u64,
    pub direct: u64,
    pub read_ns: u64,
    pub queue_ns: u64,
    pub verify_ns: u64,
    pub copy_wait_ns: u64,
    pub copy_gpu_ns: u64,
    /// The copies `copy_gpu_ns` sums (copies from the pinned file are timed only where
    /// [`DeviceSlots::set_copy_timing`] asked for it).
    pub copies_timed: u64,
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
            batch_ns: AtomicU64::new(0),
            pinned: None,
            copies: (0..slot_count).map(|_| Mutex::new(SlotCopy::default())).collect(),
            copy_stream: Mutex::new(None),
            front_bytes: AtomicUsize::new(0),
            backs: Mutex::new(Vec::new()),
            fronts: Mutex::new(Vec::new()),
            batch: std::env::var_os("CHERENKOV_NO_COPY_BATCH").is_none(),
            hold_first: std::env::var_os("CHERENKOV_HOLD_FIRST_COPY").is_some(),
            time_copies: std::env::var_os("CHERENKOV_TIME_COPIES").is_some(),
            hits: std::sync::OnceLock::new(),
        })
    }

    /// Keeps a hit map from now on (see [`HitMap`]; before the first load): `tags` per MoE layer,
    /// `experts` per layer. Records copied from the pinned file only enter it. A second model on
    /// the same slots shares the map, if it is the same shape.
    pub fn enable_hit_map(&self, tags: Vec<u64>, experts: usize) -> Result<()> {
        if let Some(h) = self.hits.get() {
            if h.tags == tags && h.experts == experts {
                return Ok(());
            }
            bail!(
                "the expert slots already keep a hit map of {} MoE layers x {} experts, not {} x {experts}",
                h.tags.len(),
                h.experts,
                tags.len()
            );
        }
        let records = tags.len() * experts;
        // (Zeroed: nothing in it.)
        let map = self.gpu.pinned(records * 8, "the expert hit map")?;
        let hm = HitMap { map, tags, experts, unpublished: Mutex::new(Vec::new()) };
        self.hits.set(hm).map_err(|_| anyhow!("the expert hit map was enabled twice"))
    }

    /// The device address of MoE layer `layer`'s row of the hit map (one u64 per expert), if kept.
    pub fn hit_map_at(&self, layer: usize) -> Option<u64> {
        self.hits.get().map(|h| h.map.dev + (layer * h.experts * 8) as u64)
    }

    /// The hit map's entry for expert `expert` of MoE layer `layer` now (what a router queued
    /// since the map last changed finds there): its slot's address with the layer's tag, or 0.
    pub fn hit_map_entry(&self, layer: usize, expert: usize) -> u64 {
        self.hits.get().map_or(0, |h| h.get(layer * h.experts + expert))
    }

    /// Enters the records whose copies are seen complete into the hit map. Call on the step's
    /// thread where no router that reads the map is queued.
    pub fn publish_landed(&self) -> Result<()> {
        let Some(h) = self.hits.get() else { return Ok(()) };
        let mut waiting = h.unpublished.lock().unwrap();
        let mut keep = Vec::with_capacity(waiting.len());
        for &slot in waiting.iter() {
            let mut c = self.copies[slot].lock().unwrap();
            let Some(record) = c.record else { continue };
            if self.settle(&mut c)? {
                keep.push(slot);
                continue;
            }
            h.set(record, self.slot_ptr(slot) | h.tags[record / h.experts]);
        }
        *waiting = keep;
        Ok(())
    }

    /// Times each copy from the pinned file on the GPU from now on (set before the first copy):
    /// a start event before it, and timing events around it, for [`LoadSplit::copy_gpu_ns`] and
    /// [`DeviceSlots::copy_window`]. Off by default: with the copies timed a streamed step was
    /// about 4% slower on the H200 (session 17: 300.7 tok/s against 313.7 at 16 layers, five
    /// rounds alternating in one call; `benchmark/notes-cuda.md`). `CHERENKOV_TIME_COPIES=1` times
    /// them everywhere (for measurements).
    pub fn set_copy_timing(&mut self, on: bool) {
        self.time_copies = on || std::env::var_os("CHERENKOV_TIME_COPIES").is_some();
    }

    /// Copies from the pinned file in two parts from now on: the first `front` bytes of a record
    /// (its gate and up projections) when it is loaded, the rest (its down projection) when
    /// [`DeviceSlots::queue_backs`] is called, or when something waits for the whole record. A
    /// block's fronts then land before any of its backs, and its gate/up kernel can run while the
    /// backs are copied ([`DeviceSlots::await_front`]). 0 (or the record's size) copies records
    /// whole.
    pub fn set_front_bytes(&self, front: usize) {
        let front = if front >= self.record_bytes { 0 } else { front };
        self.front_bytes.store(front, Ordering::Relaxed);
    }

    /// Queues the copies of every front part waiting (a step's batch), then of every back part
    /// waiting, each in one batch, oldest first (behind every copy queued so far, on the one copy
    /// stream).
    pub fn queue_backs(&self) -> Result<()> {
        self.queue_fronts()?;
        let t0 = Instant::now();
        let slots = std::mem::take(&mut *self.backs.lock().unwrap());
        self.queue_parts(
            &slots,
            &self.backs,
            false,
            |c| c.back.take().map(|p| (p, true)),
            |[_, _, end], _| vec![end],
            |c, p| c.back = Some(p),
        )?;
        self.split[4].fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Queues the copies of every front part (or whole record) waiting, in one batch.
    fn queue_fronts(&self) -> Result<()> {
        let t0 = Instant::now();
        let slots = std::mem::take(&mut *self.fronts.lock().unwrap());
        if slots.is_empty() {
            return Ok(());
        }
        // Where no back part waits the front is the whole record: its end is the record's end.
        self.queue_parts(
            &slots,
            &self.fronts,
            true,
            |c| c.front.take().map(|p| (p, c.back.is_none())),
            |[_, landed, end], whole| if whole { vec![landed, end] } else { vec![landed] },
            |c, p| c.front = Some(p),
        )?;
        self.split[4].fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Queues the parts `take` gives for `slots` (each with whether it ends its record) as one
    /// batch on the copy stream, holding every slot's lock (in slot order) until it is queued, so
    /// nothing waits on a slot's events before they are recorded: with `starts` (where copies are
    /// timed), every slot's start event before the batch; after it, the events `after` picks.
    /// Where the batch cannot be queued, `restore` puts each part back and its slot back on
    /// `list`, so a reader of the slot tries again (and meets the error) instead of reading it
    /// unwritten.
    fn queue_parts(
        &self,
        slots: &[usize],
        list: &Mutex<Vec<usize>>,
        starts: bool,
        mut take: impl FnMut(&mut SlotCopy) -> Option<(Part, bool)>,
        after: impl Fn([sys::CUevent; 3], bool) -> Vec<sys::CUevent>,
        mut restore: impl FnMut(&mut SlotCopy, Part),
    ) -> Result<()> {
        let starts = starts && self.time_copies;
        let mut order = slots.to_vec();
        order.sort_unstable();
        order.dedup();
        let mut locked: Vec<_> = order.iter().map(|&s| self.copies[s].lock().unwrap()).collect();
        let mut parts = Vec::new();
        let mut marks = Vec::new();
        let mut taken = Vec::new();
        for (i, c) in locked.iter_mut().enumerate() {
            if let Some((part, ends)) = take(c) {
                taken.push(i);
                parts.push(part);
                marks.push(after(c.events.expect("a slot with a part waiting has events"), ends));
                if starts {
                    marks.last_mut().expect("pushed above").insert(0, c.events.expect("checked")[0]);
                }
            }
        }
        if parts.is_empty() {
            return Ok(());
        }
        let stream = self.copy_stream()?;
        let record = |e: sys::CUevent| {
            // SAFETY: an event of this context, recorded on its copy stream.
            unsafe { cu::event::record(e, stream) }.map_err(|e| anyhow!("cannot record an event: {e}"))
        };
        if starts {
            marks.iter().try_for_each(|m| record(m[0]))?;
        }
        if let Err(e) = copy_batch(stream, &parts) {
            // The parts wait again, so whatever reads their slots tries again (and meets the
            // error) instead of reading them unwritten.
            for (&i, &part) in taken.iter().zip(&parts) {
                restore(&mut locked[i], part);
                list.lock().unwrap().push(order[i]);
            }
            return Err(e);
        }
        let skip = usize::from(starts);
        marks.iter().try_for_each(|m| m[skip..].iter().try_for_each(|&e| record(e)))
    }

    /// Queues the slot's back part, if it waits, and records the copy's end.
    fn queue_back(&self, c: &mut SlotCopy) -> Result<()> {
        let Some(b) = c.back else { return Ok(()) };
        let [_, _, end] = c.events.expect("a slot with a back part has events");
        let stream = self.copy_stream()?;
        // Taken only once queued: a part that failed to queue still waits, so whatever reads the
        // slot tries again (and meets the error) instead of reading it unwritten.
        copy_batch(stream, &[b])?;
        c.back = None;
        // SAFETY: an event of this context, recorded on its copy stream.
        unsafe { cu::event::record(end, stream) }.map_err(|e| anyhow!("cannot record an event: {e}"))?;
        Ok(())
    }

    /// Whether a copy into `slot` from the pinned file is still waiting to be queued or running
    /// (a front waiting in a batch is queued first, with the rest of the batch).
    pub fn still_copying(&self, slot: usize) -> Result<bool> {
        let mut c = self.lock_queued(slot)?;
        self.settle(&mut c)
    }

    /// Sets the u32 at `flag` (the device's address of host-mapped memory) to 1 behind every copy
    /// queued on the copy stream so far (`cuStreamWriteValue32`): a replayed streamed step's read
    /// experts wait for it in their kernels (`flag_wait`) instead of the compute stream waiting for
    /// the copies' events.
    pub fn signal_after_copies(&self, flag: u64) -> Result<()> {
        self.queue_fronts()?;
        let stream = self.copy_stream()?;
        // SAFETY: a stream of this context; flag is a mapped u32 that outlives the copies.
        unsafe { sys::cuStreamWriteValue32_v2(stream, flag, 1, 0) }
            .result()
            .map_err(|e| anyhow!("cannot queue a flag behind the expert copies: {e}"))
    }

    /// Makes the GPU's compute stream wait for the front part of the copy into `slot` (its gate
    /// and up projections), if it may still be running; otherwise as [`DeviceSlots::await_slot`].
    pub fn await_front(&self, slot: usize) -> Result<bool> {
        let mut c = self.lock_queued(slot)?;
        if !self.settle(&mut c)? {
            return Ok(false);
        }
        let [_, front, _] = c.events.expect("a pending copy has events");
        self.stream_waits_for(front)?;
        Ok(true)
    }

    /// The slot's copy state, locked, with its front part queued if it was waiting in a batch
    /// (with the rest of the batch, so their order stays).
    fn lock_queued(&self, slot: usize) -> Result<std::sync::MutexGuard<'_, SlotCopy>> {
        let c = self.copies[slot].lock().unwrap();
        if c.front.is_none() {
            return Ok(c);
        }
        drop(c);
        self.queue_fronts()?;
        Ok(self.copies[slot].lock().unwrap())
    }

    /// Queues a wait of the compute stream for `event` (recorded on the copy stream).
    fn stream_waits_for(&self, event: sys::CUevent) -> Result<()> {
        // SAFETY: the event was recorded on a copy stream of this context; the wait is queued.
        unsafe { cu::stream::wait_event(self.gpu.stream, event, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
            .map_err(|e| anyhow!("cannot make the stream wait for an expert copy: {e}"))
    }

    /// Makes the GPU's compute stream wait for the copy into `slot`, if it may still be running (a
    /// load from the pinned expert file returns once the copy is queued). Call before queueing work
    /// that reads the slot. Returns whether the stream has to wait.
    pub fn await_slot(&self, slot: usize) -> Result<bool> {
        let mut c = self.lock_queued(slot)?;
        if c.back.is_some() {
            // Every back part queued before this one first, so backs keep their order.
            drop(c);
            self.queue_backs()?;
            c = self.copies[slot].lock().unwrap();
            self.queue_back(&mut c)?;
        }
        if !self.settle(&mut c)? {
            return Ok(false);
        }
        let [_, _, end] = c.events.expect("a pending copy has events");
        self.stream_waits_for(end)?;
        Ok(true)
    }

    /// When the last copy into `slot` from the pinned file started and ended, in ms after `since`
    /// (an event with timing on the compute stream); None where the slot has no copy events, the
    /// copy has not finished or copies are not timed ([`DeviceSlots::set_copy_timing`]).
    pub fn copy_window(&self, slot: usize, since: &Event) -> Option<(f32, f32)> {
        if !self.time_copies {
            return None;
        }
        let c = self.copies[slot].lock().unwrap();
        let [start, _, end] = c.events?;
        // SAFETY: events of this context; elapsed fails (None) unless both have completed.
        unsafe {
            let a = cu::event::elapsed(since.raw(), start).ok()?;
            let b = cu::event::elapsed(since.raw(), end).ok()?;
            Some((a, b))
        }
    }

    /// Whether the record in `slot` is on the GPU (no copy into it still running).
    pub fn landed(&self, slot: usize) -> Result<bool> {
        let mut c = self.copies[slot].lock().unwrap();
        Ok(!self.settle(&mut c)?)
    }

    /// Waits for every copy still running (before work that reads slots without
    /// [`DeviceSlots::await_slot`], such as a replayed graph).
    pub fn sync_copies(&self) -> Result<()> {
        self.gpu.bind()?;
        self.queue_backs()?;
        for c in &self.copies {
            let mut c = c.lock().unwrap();
            if let (true, Some([_, _, end])) = (c.pending, c.events) {
                // SAFETY: an event of this context.
                unsafe { cu::event::synchronize(end) }.map_err(|e| anyhow!("an expert copy to the GPU failed: {e}"))?;
                self.settle(&mut c)?;
            }
        }
        Ok(())
    }

    /// Whether the slot's last copy may still be running (or its back part is not queued yet): a
    /// copy seen complete is accounted (its GPU time) and no longer pending; a failed copy is an
    /// error.
    fn settle(&self, c: &mut SlotCopy) -> Result<bool> {
        if c.front.is_some() || c.back.is_some() {
            return Ok(true);
        }
        let (true, Some([start, _, end])) = (c.pending, c.events) else { return Ok(false) };
        // SAFETY: an event of this context.
        match unsafe { sys::cuEventQuery(end) } {
            sys::CUresult::CUDA_SUCCESS => {
                if self.time_copies {
                    // SAFETY: both events were recorded with timing and have completed.
                    if let Ok(ms) = unsafe { cu::event::elapsed(start, end) } {
                        self.split[5].fetch_add((ms as f64 * 1e6) as u64, Ordering::Relaxed);
                        self.split[7].fetch_add(1, Ordering::Relaxed);
                    }
                }
                c.pending = false;
                Ok(false)
            }
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(true),
            e => bail!("an expert copy to the GPU failed: {e:?}"),
        }
    }

    /// Host time spent in steps' batches of loads so far (ns; see `batch_ns`).
    pub fn batch_ns(&self) -> u64 {
        self.batch_ns.load(Ordering::Relaxed)
    }

    /// The GPU the slots live on (whose compute stream [`DeviceSlots::await_slot`] makes wait).
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Whether loads from the pinned file return before their copy ends (see the module docs).
    pub fn copies_in_background(&self) -> bool {
        self.pinned.is_some()
    }

    /// Loads records from now on straight from `pinned` (the pool's store's expert file).
    pub fn set_pinned(&mut self, pinned: PinnedExperts) {
        self.pinned = Some(pinned);
    }

    /// Bytes of the expert file pinned for the copy engine (0: records are read by the CPU).
    pub fn pinned_bytes(&self) -> u64 {
        self.pinned.as_ref().map_or(0, PinnedExperts::bytes)
    }

    /// The record at byte `offset` of store `dir`'s expert file in host memory, if that file is
    /// pinned here (the CPU computes experts from these bytes: `--cpu-experts`).
    pub fn host_record(&self, dir: &std::path::Path, offset: u64) -> Option<&[u8]> {
        self.pinned.as_ref()?.record(dir, offset, self.record_bytes)
    }

    /// Measures how long one record takes to copy from the pinned expert file to the GPU with
    /// nothing else copying: the median of 5 copies of `src` (a pinned record) into a scratch
    /// buffer, timed by GPU events, in ns. What a miss's copy costs when it has the link alone.
    pub fn lone_copy_ns(&self, src: &[u8]) -> Result<u64> {
        self.gpu.bind()?;
        let scratch = self.gpu.alloc(src.len(), "measuring an expert copy")?;
        let staging = self.take_staging()?;
        let mut times = Vec::with_capacity(5);
        let result = (|| -> Result<()> {
            for _ in 0..5 {
                // SAFETY: scratch holds src.len() bytes; src is registered host memory; the events
                // and stream belong to this context, and the stream is synchronised before reuse.
                unsafe {
                    cu::event::record(staging.start, staging.stream)
                        .map_err(|e| anyhow!("cannot record an event: {e}"))?;
                    cu::memcpy_htod_async(scratch.ptr, src, staging.stream)
                        .map_err(|e| anyhow!("copy of an expert record to the GPU failed: {e}"))?;
                    cu::event::record(staging.end, staging.stream)
                        .map_err(|e| anyhow!("cannot record an event: {e}"))?;
                    cu::stream::synchronize(staging.stream)
                        .map_err(|e| anyhow!("copy of an expert record to the GPU failed: {e}"))?;
                    let ms = cu::event::elapsed(staging.start, staging.end)
                        .map_err(|e| anyhow!("cannot time an expert copy: {e}"))?;
                    times.push((ms as f64 * 1e6) as u64);
                }
            }
            Ok(())
        })();
        self.staging.lock().unwrap().push(staging);
        result?;
        times.sort_unstable();
        Ok(times[times.len() / 2].max(1))
    }

    /// Measures what one miss costs when the expert file is not pinned: the record read by the CPU
    /// into pinned memory ([`stage_record`]) and copied to the GPU, with nothing else loading; the
    /// median of 5 loads of `record` into a scratch buffer, wall time, in ns.
    pub fn lone_load_ns(&self, record: &dyn RecordSource) -> Result<u64> {
        self.gpu.bind()?;
        let scratch = self.gpu.alloc(self.record_bytes, "measuring an expert load")?;
        let staging = self.take_staging()?;
        let mut times = Vec::with_capacity(5);
        let result = (|| -> Result<()> {
            for _ in 0..5 {
                let t = Instant::now();
                // SAFETY: the pinned buffer is record_bytes, owned by this call until returned below.
                let host = unsafe { std::slice::from_raw_parts_mut(staging.pinned.ptr, staging.pinned.len) };
                stage_record(record, host)?;
                // SAFETY: scratch holds record_bytes; the stream is synchronised before the buffer
                // is written again.
                unsafe {
                    cu::memcpy_htod_async(scratch.ptr, &*host, staging.stream)
                        .map_err(|e| anyhow!("copy of an expert record to the GPU failed: {e}"))?;
                    cu::stream::synchronize(staging.stream)
                        .map_err(|e| anyhow!("copy of an expert record to the GPU failed: {e}"))?;
                }
                times.push(t.elapsed().as_nanos() as u64);
            }
            Ok(())
        })();
        self.staging.lock().unwrap().push(staging);
        result?;
        times.sort_unstable();
        Ok(times[times.len() / 2].max(1))
    }

    /// Where the loads' time went so far.
    pub fn load_split(&self) -> LoadSplit {
        let g = |i: usize| self.split[i].load(Ordering::Relaxed);
        LoadSplit {
            loads: g(0),
            direct: g(6),
            read_ns: g(1),
            queue_ns: g(4),
            verify_ns: g(2),
            copy_wait_ns: g(3),
            copy_gpu_ns: g(5),
            copies_timed: g(7),
        }
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

    /// The copy stream of copies from the pinned file (made at first use).
    fn copy_stream(&self) -> Result<sys::CUstream> {
        let mut stream = self.copy_stream.lock().unwrap();
        if let Some(s) = *stream {
            return Ok(s);
        }
        self.gpu.bind()?;
        let s = cu::stream::create(cu::stream::StreamKind::NonBlocking)
            .map_err(|e| anyhow!("cannot create a copy stream: {e}"))?;
        *stream = Some(s);
        Ok(s)
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

impl DeviceSlots {
    /// Queues the copy of a record from the pinned expert file (checked when it was pinned) into
    /// `slot` on the copy stream, behind any earlier copy into the slot, and returns; readers of
    /// the slot wait for it with [`DeviceSlots::await_slot`]. Inside a step's batch
    /// (`SlotMemory::begin_batch` on this thread) the copy waits in the list until the batch ends
    /// (or something waits for the slot); its back part, if split, until
    /// [`DeviceSlots::queue_backs`].
    fn copy_pinned(&self, slot: usize, src: &[u8], record: Option<usize>) -> Result<()> {
        let stream = self.copy_stream()?;
        let t0 = Instant::now();
        // An earlier copy's parts still waiting go first (its end is then recorded).
        let mut c = self.lock_queued(slot)?;
        // The hit map's record, entered once this copy is seen complete.
        let publish = self.hits.get().is_some() && record.is_some();
        if publish {
            c.record = record;
        }
        self.queue_back(&mut c)?;
        let [_, _, end] = match c.events {
            Some(e) => e,
            None => {
                let flags = if self.time_copies {
                    sys::CUevent_flags::CU_EVENT_DEFAULT
                } else {
                    sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
                };
                let event = || cu::event::create(flags).map_err(|e| anyhow!("cannot create a copy event: {e}"));
                let e = [event()?, event()?, event()?];
                c.events = Some(e);
                e
            }
        };
        if self.settle(&mut c)? {
            // SAFETY: events and streams of this context; the wait is queued.
            unsafe { cu::stream::wait_event(stream, end, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
                .map_err(|e| anyhow!("cannot order two copies into one slot: {e}"))?;
        }
        // A step's batch splits each record so the read experts' gate/up kernel can start once
        // every front landed. A load outside a step's batch (a prefetch, on an IO thread) copies
        // its record whole at once: nothing waits for its front alone, and a back part left
        // waiting would be queued only with a later step's batch, behind that step's own copies,
        // delaying both.
        let front = self.front_bytes.load(Ordering::Relaxed);
        let split = front > 0 && front < src.len() && BATCHING.get() != 0;
        // The front (or the whole record) waits in the list until the batch ends, or goes now.
        let head = if split { &src[..front] } else { src };
        c.front = Some(Part { src: head.as_ptr(), len: head.len(), dst: self.slot_ptr(slot) });
        if split {
            let rest = &src[front..];
            c.back = Some(Part { src: rest.as_ptr(), len: rest.len(), dst: self.slot_ptr(slot) + front as u64 });
        }
        c.pending = true;
        // Slot lock, then the lists': nothing takes them the other way round.
        self.fronts.lock().unwrap().push(slot);
        if split {
            self.backs.lock().unwrap().push(slot);
        }
        drop(c);
        if let (true, Some(h)) = (publish, self.hits.get()) {
            h.unpublished.lock().unwrap().push(slot);
        }
        self.split[0].fetch_add(1, Ordering::Relaxed);
        self.split[6].fetch_add(1, Ordering::Relaxed);
        self.split[4].fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        // A batch's first copy goes at once, so the link starts while the host decides the rest.
        let held = match BATCHING.get() {
            1 => {
                BATCHING.set(2);
                self.batch && self.hold_first
            }
            2 => self.batch,
            _ => false,
        };
        if !held {
            self.queue_fronts()?;
            if BATCHING.get() != 0 && FIRST_COPY.get().is_none() {
                FIRST_COPY.set(Some(Instant::now()));
            }
        }
        Ok(())
    }
}

/// When this thread's last batch of loads began and queued its first copy (None where it queued
/// none): the anatomy's split of a block's host turn.
pub fn last_batch() -> (Option<Instant>, Option<Instant>) {
    LAST_BATCH.get()
}

impl SlotMemory for DeviceSlots {
    fn slot_count(&self) -> usize {
        self.slot_count
    }

    fn record_bytes(&self) -> usize {
        self.record_bytes
    }

    fn begin_batch(&self) {
        BATCHING.set(1);
        BATCH_START.set(Some(Instant::now()));
    }

    fn retire(&self, slot: usize) {
        let Some(h) = self.hits.get() else { return };
        let mut c = self.copies[slot].lock().unwrap();
        if let Some(record) = c.record.take() {
            h.set(record, 0);
        }
    }

    fn end_batch(&self) -> Result<()> {
        BATCHING.set(0);
        self.gpu.bind()?;
        let queued = self.queue_fronts();
        let start = BATCH_START.take();
        let first = FIRST_COPY.take().or_else(|| Some(Instant::now()).filter(|_| queued.is_ok()));
        LAST_BATCH.set((start, first));
        if let Some(t0) = start {
            self.batch_ns.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
        queued
    }

    fn load(&self, slot: usize, record: &dyn RecordSource) -> Result<()> {
        self.gpu.bind()?;
        let location = record.location();
        let direct = self.pinned.as_ref().zip(location).and_then(|(p, (dir, at))| p.record(dir, at, self.record_bytes));
        if let Some(src) = direct {
            let index = location.map(|(_, at)| (at / self.record_bytes as u64) as usize);
            return self.copy_pinned(slot, src, index);
        }
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
        let checked = record.piece_bytes().is_some();
        let t0 = Instant::now();
        let result = stage_record(record, host).and_then(|()| {
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
            let verified = if checked { Ok(()) } else { record.verify(host) };
            let t2 = Instant::now();
            // SAFETY: the stream belongs to this context.
            unsafe { cu::stream::synchronize(stream) }
                .map_err(|e| anyhow!("copy of an expert record to the GPU failed: {e}"))?;
            let done = Instant::now();
            // SAFETY: both events were recorded on this stream and have completed.
            let gpu_ms = unsafe { cu::event::elapsed(staging.start, staging.end) }.unwrap_or(0.0);
            let ns = |a: Instant, b: Instant| b.duration_since(a).as_nanos() as u64;
            self.split[5].fetch_add((gpu_ms as f64 * 1e6) as u64, Ordering::Relaxed);
            self.split[7].fetch_add(1, Ordering::Relaxed);
            self.split[0].fetch_add(1, Ordering::Relaxed);
            self.split[1].fetch_add(ns(t0, t1), Ordering::Relaxed);
            self.split[4].fetch_add(ns(t1, queued), Ordering::Relaxed);
            self.split[2].fetch_add(ns(queued, t2), Ordering::Relaxed);
            self.split[3].fetch_add(ns(t2, done), Ordering::Relaxed);
            verified
        });
        if result.is_err() {
            // A copy queued before the failure may still be reading the staging buffer.
            // SAFETY: the stream belongs to this context.
            let _ = unsafe { cu::stream::synchronize(stream) };
        }
        self.staging.lock().unwrap().push(staging);
        result
    }
}

/// Queues the copies of `parts` (from the registered pinned mapping into slots) on `stream`: one
/// `cuMemcpyBatchAsync` for several, one copy for one, and one copy each where the driver has no
/// batched copies.
fn copy_batch(stream: sys::CUstream, parts: &[Part]) -> Result<()> {
    let each = |parts: &[Part]| -> Result<()> {
        for p in parts {
            // SAFETY: p.src..p.src + p.len lies in the registered pinned mapping, which outlives
            // the slots; p.dst has p.len bytes of a slot.
            unsafe { cu::memcpy_htod_async(p.dst, std::slice::from_raw_parts(p.src, p.len), stream) }
                .map_err(|e| anyhow!("copy of a pinned expert record to the GPU failed: {e}"))?;
        }
        Ok(())
    };
    if parts.len() < 2 {
        return each(parts);
    }
    let mut dsts: Vec<sys::CUdeviceptr> = parts.iter().map(|p| p.dst).collect();
    let mut srcs: Vec<sys::CUdeviceptr> = parts.iter().map(|p| p.src as u64).collect();
    let mut sizes: Vec<usize> = parts.iter().map(|p| p.len).collect();
    // SAFETY: a zeroed attribute is a valid value of this plain C struct.
    let mut attr: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
    // The copies read their sources in stream order, from host memory, into device memory.
    attr.srcAccessOrder = sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
    attr.srcLocHint.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST;
    attr.dstLocHint.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
    let mut first = 0usize;
    // SAFETY: every range lies in the registered mapping or a slot (as above); one attribute for
    // every copy, from index 0; the arrays outlive the call.
    let r = unsafe {
        sys::cuMemcpyBatchAsync_v2(
            dsts.as_mut_ptr(),
            srcs.as_mut_ptr(),
            sizes.as_mut_ptr(),
            parts.len(),
            &mut attr,
            &mut first,
            1,
            stream,
        )
    };
    match r {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        sys::CUresult::CUDA_ERROR_NOT_SUPPORTED | sys::CUresult::CUDA_ERROR_NOT_FOUND => each(parts),
        e => bail!("a batched copy of pinned expert records to the GPU failed: {e:?}"),
    }
}

impl Drop for DeviceSlots {
    fn drop(&mut self) {
        // Copies still reading the pinned file end before it is unregistered.
        let _ = self.sync_copies();
        let _ = self.gpu.bind();
        for c in &self.copies {
            if let Some(events) = c.lock().unwrap().events {
                // SAFETY: created in copy_pinned, destroyed once; their copies have ended.
                unsafe {
                    for e in events {
                        let _ = cu::event::destroy(e);
                    }
                }
            }
        }
        if let Some(stream) = self.copy_stream.lock().unwrap().take() {
            // SAFETY: made in copy_stream, destroyed once; its copies have ended (sync_copies).
            unsafe {
                let _ = cu::stream::destroy(stream);
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_streaming_copies_every_byte_at_any_alignment() {
        let src: Vec<u8> = (0..5000u32).map(|i| (i * 7 + i / 255) as u8).collect();
        for (off, len) in [(0, 0), (0, 5000), (1, 4000), (3, 63), (15, 64), (16, 65), (7, 129), (9, 4991)] {
            let mut dst = vec![0xAAu8; 5000 + 32];
            copy_streaming(&mut dst[off..off + len], &src[..len]);
            assert_eq!(&dst[off..off + len], &src[..len], "offset {off} length {len}");
            assert!(dst[..off].iter().all(|&b| b == 0xAA) && dst[off + len..].iter().all(|&b| b == 0xAA));
        }
    }

    /// An in-memory record; pieces of `piece` bytes checked by a byte sum, one of them corrupted on
    /// request.
    struct Mem {
        bytes: Vec<u8>,
        piece: Option<usize>,
        bad_piece: Option<usize>,
    }

    impl RecordSource for Mem {
        fn read_range(&self, offset: usize, buf: &mut [u8]) -> Result<()> {
            buf.copy_from_slice(&self.bytes[offset..offset + buf.len()]);
            Ok(())
        }
        fn verify(&self, _: &[u8]) -> Result<()> {
            Ok(())
        }
        fn piece_bytes(&self) -> Option<usize> {
            self.piece
        }
        fn read_piece_chunked(&self, i: usize, bounce: &mut [u8], put: &mut dyn FnMut(usize, &[u8])) -> Result<()> {
            let p = self.piece.unwrap();
            let (start, end) = (i * p, ((i + 1) * p).min(self.bytes.len()));
            let mut at = start;
            while at < end {
                let n = (end - at).min(bounce.len());
                self.read_range(at, &mut bounce[..n])?;
                put(at - start, &bounce[..n]);
                at += n;
            }
            anyhow::ensure!(self.bad_piece != Some(i), "piece {i} corrupted");
            Ok(())
        }
    }

    #[test]
    fn stage_record_reads_every_piece_through_the_bounce_buffers() {
        // Pieces larger than the bounce buffer, a short last piece, and the no-piece-sum path.
        let len = 3 * BOUNCE_BYTES + 12288;
        let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8 ^ (i >> 12) as u8).collect();
        for piece in [Some(BOUNCE_BYTES + 4096), Some(len), None] {
            let rec = Mem { bytes: bytes.clone(), piece, bad_piece: None };
            let mut host = vec![0u8; len];
            stage_record(&rec, &mut host).unwrap();
            assert!(host == bytes, "pieces of {piece:?}");
        }
        let rec = Mem { bytes, piece: Some(BOUNCE_BYTES), bad_piece: Some(2) };
        let e = stage_record(&rec, &mut vec![0u8; len]).unwrap_err();
        assert!(format!("{e:#}").contains("piece 2 corrupted"), "{e:#}");
    }
}
