//! The expert pool: a bounded set of slots holding routed-expert records read from the store.
//!
//! Every backend uses the same pool; only where a slot's bytes live differs ([`SlotMemory`]:
//! [`HostSlots`] for the CPU, device memory for CUDA later). A decode step asks for the experts one
//! MoE layer routed to ([`ExpertPool::acquire`]) and gets a [`Lease`]: the resident ones are usable
//! at once, the others are read by the pool's IO threads while the step computes the resident ones,
//! and [`Lease::wait`] blocks until a given entry has arrived.
//!
//! # Slot state machine
//!
//! ```text
//!            miss: take a free slot, or evict the lowest-ranked ready+unpinned one
//!   Free ───────────────────────────────────────────────────────────────> Loading
//!    ^                                                                        │
//!    │ read or checksum failed (the record is forgotten; the next acquire     │ read ok
//!    │ of it reads again)                                                     v
//!    └──────────────────────────────── Loading                              Ready
//!                                                                             │
//!   Free <──────── evicted (only when Ready and pins == 0) ───────────────────┘
//! ```
//!
//! Orthogonal to the state, `pins` counts the live leases naming the slot. A slot is evictable only
//! when it is `Ready` with no pins; evictable slots sit in an index ordered by their eviction rank
//! (below), so choosing a victim is O(log slots). The index is a min-heap whose entries go stale
//! instead of being removed ([`Evictable`]): a slot that is pinned or re-ranked leaves its old
//! entry behind, and a victim is the first entry that still describes its slot. Ranks are unique,
//! so the victims are those of an ordered map (a `BTreeMap` until session 28, whose removal and
//! insertion took about 1 us of each acquire and 1 us of each lease's drop for ten hits on the
//! CPU machine, on the streamed block's critical path). A `Loading` slot is never evicted, whether
//! or not a lease still pins it: an IO thread is writing it.
//!
//! # Eviction
//!
//! Every acquire stamps each of its experts with a tick (in request order; a prefetch with one
//! too). The victim is the evictable slot of lowest rank (priority, tick), the priority depending on
//! the [`Eviction`] the pool was built with:
//!
//! - [`Eviction::Adaptive`] (the default): LRFU below, its decay chosen every 16 tokens among four
//!   by ghost caches that replay a sample of the requests under each
//!   ([`crate::policy::Adaptive`]); a change of decay re-ranks every record by its own history
//!   under the new one (a prefetched record that was never used then ranks last). The ghosts
//!   replay a block's request after its misses are queued ([`ExpertPool::replay_ghosts`]: about
//!   3 us per block on average, 10-13 on the blocks they sample, on the CPU machine:
//!   `crates/engine/tests/pool_host_cost.rs`).
//! - [`Eviction::Lrfu`]: LRFU's combined recency-frequency (Lee et al.; the same
//!   arithmetic as the policy simulator, [`crate::policy::Crf`]): each use of an expert adds 1 to a
//!   value that halves every 1/lambda tokens, and the smallest value goes first, ties to the least
//!   recently used. The clock counts tokens: an acquire whose layer is not above the previous
//!   acquire's layer starts a new one. The value of every (layer, expert) is kept, resident or
//!   not, so a popular expert evicted by a burst of others comes back with its history. A
//!   prefetched record ranks as if used when it was queued, but counts as a use only when a step
//!   acquires it.
//! - [`Eviction::Lru`]: the priority is constant, so the tick alone decides: least recently used.
//!
//! Adaptive LRFU is the default because no fixed decay is best on every trace: on the calibrated
//! synthetic traces it is within 0.3 points of the best fixed decay for each trace and cache size
//! (`benchmark/notes-policy.md`). LRFU with a fixed decay of 0.03 beat LRU on every calibrated
//! synthetic routing trace, popularity drift included: by 7-12 points of hit rate with 10% of the
//! experts cached, 3-7 with 17% and 1-5
//! with 27% (`benchmark/notes-policy.md`).
//!
//! # Invariants that must not change
//!
//! - A slot is written only by the IO thread loading it, only in `Loading`, and a slot enters
//!   `Loading` only from `Free` or by eviction of an unpinned `Ready` slot. So a slot a live lease
//!   pins is never written after its load completed; this is what makes [`HostSlots::slot`] and
//!   [`Lease::bytes`] sound, and what a device backend relies on when its kernels read slots.
//! - Every request first pins its hits, then assigns slots to its misses, all under one lock: a miss
//!   can never evict another expert of the same step.
//! - Misses are queued in request order. Callers order experts by importance (e.g. routing weight),
//!   so the reads that unblock the most work start first. Demand reads (a step waits for them) go
//!   ahead of every queued prefetch (lookahead), whenever it was queued: a wrong prediction never
//!   delays a step's own misses; a queued prefetch that a step then asks for becomes a demand read.
//!   The IO threads take jobs from the front.
//! - One record is read at most once at a time: a request for a record already `Loading` joins
//!   that read.
//! - A request the pool cannot serve (more experts than slots, or not enough slots because other
//!   live leases pin them) fails at once with an error: acquire never waits for a lease to be
//!   dropped, so two steps holding slots the other needs cannot deadlock. The only thing acquire
//!   waits for is reads whose leases are already gone (a step dropped its lease before waiting):
//!   those slots are `Loading` and unpinned, they cannot be evicted mid-read, and they become
//!   evictable when the read ends, which depends on nothing but the IO threads.
//!
//! Callers deduplicate: a request naming one expert twice is refused (entries stay index-aligned
//! with the request).

use std::alloc::{self, Layout};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};
use cherenkov_model::store::Store;

use crate::policy::{ADAPTIVE_LAMBDAS, ADAPTIVE_START, Adaptive, Crf, Key, OrdF64};
use crate::stats::{ExpertStats, ForwardStats, LayerInfo, PoolCounters, PoolStats, Residency, Served, SlotGauges};

/// Alignment of host slot memory (a page; records are 4 KiB multiples, so every slot is aligned).
pub const SLOT_ALIGN: usize = 4096;

/// One expert record to load: read whole, or in ranges (from several threads at once) and then
/// checked as a whole against the store's checksum.
pub trait RecordSource: Sync {
    /// Reads bytes `offset..offset + buf.len()` of the record, unchecked.
    fn read_range(&self, offset: usize, buf: &mut [u8]) -> Result<()>;
    /// Checks a whole record (record_bytes long) against the store's checksum.
    fn verify(&self, record: &[u8]) -> Result<()>;
    /// Reads the whole record into `buf` and checks it.
    fn read(&self, buf: &mut [u8]) -> Result<()> {
        self.read_range(0, buf)?;
        self.verify(buf)
    }
    /// Bytes per separately checked piece, when the record has piece checksums (the last piece
    /// may be shorter); None: only the whole record can be checked.
    fn piece_bytes(&self) -> Option<usize> {
        None
    }
    /// Advises the OS that the whole record is about to be read (before its pieces are read in
    /// parallel); a no-op unless the source is a file not in the page cache.
    fn advise(&self) {}
    /// Reads piece `i` (of [`RecordSource::piece_bytes`]) in chunks through `bounce`, handing each
    /// to `put(offset in the piece, bytes)`, and checks the piece; every piece checked is the whole
    /// record checked (the CUDA loader writes the chunks with non-temporal stores; see
    /// `Store::read_expert_piece_chunked`).
    fn read_piece_chunked(&self, i: usize, bounce: &mut [u8], put: &mut dyn FnMut(usize, &[u8])) -> Result<()> {
        let _ = (i, bounce, put);
        bail!("this record has no piece checksums")
    }
    /// Where the record lies: its store's directory and the record's byte offset in the store's
    /// expert file (for a loader that copies straight from the file's pinned pages); None for a
    /// record that is not in a store file.
    fn location(&self) -> Option<(&std::path::Path, u64)> {
        None
    }
}

/// The record of (MoE slot `layer`, `expert`) in a store: what the pool's IO threads load.
pub struct StoreRecord<'a> {
    pub store: &'a Store,
    pub layer: usize,
    pub expert: usize,
}

impl RecordSource for StoreRecord<'_> {
    fn read_range(&self, offset: usize, buf: &mut [u8]) -> Result<()> {
        self.store.read_expert_range(self.layer, self.expert, offset, buf)
    }
    fn verify(&self, record: &[u8]) -> Result<()> {
        self.store.verify_expert(self.layer, self.expert, record)
    }
    fn piece_bytes(&self) -> Option<usize> {
        self.store.expert_piece_bytes()
    }
    fn advise(&self) {
        self.store.advise_expert(self.layer, self.expert);
    }
    fn read_piece_chunked(&self, i: usize, bounce: &mut [u8], put: &mut dyn FnMut(usize, &[u8])) -> Result<()> {
        self.store.read_expert_piece_chunked(self.layer, self.expert, i, bounce, put)
    }
    fn location(&self) -> Option<(&std::path::Path, u64)> {
        let ef = &self.store.manifest.experts;
        Some((&self.store.dir, ef.record_index(self.layer, self.expert) * ef.record_bytes))
    }
}

/// Where loaded expert records live (host memory for the CPU, device memory for CUDA).
pub trait SlotMemory: Send + Sync + 'static {
    fn slot_count(&self) -> usize;
    fn record_bytes(&self) -> usize;
    /// Loads one record into `slot` from `record` (record_bytes long; a load that did not check
    /// the whole record with [`RecordSource::verify`] or [`RecordSource::read`] must not succeed).
    /// Called from IO threads, or from a step's thread through [`ExpertPool::load_queued`]; never
    /// concurrently for the same slot, and never while the slot is leased by a step. A memory may
    /// return once the load is queued on a device, if whatever reads the slot orders itself after
    /// that (the CUDA slots copying from a pinned expert file: `DeviceSlots::await_slot`).
    fn load(&self, slot: usize, record: &dyn RecordSource) -> Result<()>;

    /// Called on a step's thread before it runs the step's queued loads
    /// ([`ExpertPool::load_queued`]), and [`SlotMemory::end_batch`] after them: a memory whose
    /// loads only queue device work may hold that thread's loads in between and queue them
    /// together (the CUDA slots: one batched copy instead of one copy per record). Loads on other
    /// threads are not held.
    fn begin_batch(&self) {}

    /// Queues whatever was held since [`SlotMemory::begin_batch`] on this thread.
    fn end_batch(&self) -> Result<()> {
        Ok(())
    }

    /// The record in `slot` (if any) is being replaced: called on the thread that decided it (a
    /// step's, or a prefetch's caller), under the pool's lock, before the slot's next load is
    /// queued. A memory that lets the device find records by itself (the CUDA slots' hit map)
    /// forgets the slot's record here, so nothing routed later reads the slot while it is
    /// overwritten.
    fn retire(&self, _slot: usize) {}
}

/// Host slots: one page-aligned allocation of `slot_count x record_bytes`, records read straight
/// into their slot (no staging buffer, no copy).
pub struct HostSlots {
    base: NonNull<u8>,
    layout: Layout,
    slot_count: usize,
    record_bytes: usize,
}

// SAFETY: `HostSlots` owns its allocation (a unique raw pointer, freed once in Drop), so moving it
// to another thread is fine. Shared access (`Sync`) hands out `&[u8]` views through `slot` and
// writes through `load`; both act on disjoint per-slot ranges and the pool serializes them per
// slot: `load` runs for a slot only in the pool's `Loading` state, one IO thread at a time, and
// views are only handed out (by `Lease::bytes`, or by an `unsafe` caller of `slot` upholding the
// same rule) for slots that are loaded and pinned, which the pool never loads. So no byte is ever
// written while a reference to it is alive.
unsafe impl Send for HostSlots {}
unsafe impl Sync for HostSlots {}

impl HostSlots {
    /// Allocates `slot_count` zeroed slots of `record_bytes` (zeroed pages are mapped lazily by the
    /// OS, so this costs nothing until slots are filled).
    pub fn new(slot_count: usize, record_bytes: usize) -> Result<HostSlots> {
        if slot_count == 0 {
            bail!("an expert cache needs at least one slot; use a larger --expert-cache");
        }
        if record_bytes == 0 {
            bail!("expert records of 0 bytes: the store has no routed experts to cache");
        }
        let total = slot_count
            .checked_mul(record_bytes)
            .filter(|&t| t <= isize::MAX as usize - SLOT_ALIGN)
            .with_context(|| {
                format!(
                    "an expert cache of {slot_count} slots x {} does not fit in memory",
                    format_bytes(record_bytes as u64)
                )
            })?;
        let layout = Layout::from_size_align(total, SLOT_ALIGN).expect("size checked against isize::MAX above");
        // SAFETY: `layout` has a non-zero size (both factors are non-zero).
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        let base = NonNull::new(ptr).with_context(|| {
            format!(
                "cannot allocate the expert cache: {} of host memory ({slot_count} slots x {}); use a smaller --expert-cache",
                format_bytes(total as u64),
                format_bytes(record_bytes as u64)
            )
        })?;
        Ok(HostSlots { base, layout, slot_count, record_bytes })
    }

    /// Bytes of the whole allocation.
    pub fn bytes(&self) -> usize {
        self.layout.size()
    }

    /// The bytes of `slot`.
    ///
    /// Safe code gets these through [`Lease::bytes`], which ties the view to a lease pinning the
    /// slot.
    ///
    /// # Safety
    ///
    /// The slot must not be written while the returned slice is alive, i.e. no `load` of this slot
    /// may run meanwhile. Inside an [`ExpertPool`] that holds when a live lease pins the slot and
    /// the entry's load has completed ([`Lease::wait`] returned `Ok`): the pool never loads a
    /// pinned or loaded-and-leased slot (see the module docs).
    pub unsafe fn slot(&self, slot: usize) -> &[u8] {
        assert!(slot < self.slot_count, "slot {slot} of a pool of {} slots", self.slot_count);
        // SAFETY: in bounds of the allocation (checked above), initialized (allocated zeroed), and
        // not written meanwhile (the caller's contract).
        unsafe { std::slice::from_raw_parts(self.base.as_ptr().add(slot * self.record_bytes), self.record_bytes) }
    }
}

impl SlotMemory for HostSlots {
    fn slot_count(&self) -> usize {
        self.slot_count
    }

    fn record_bytes(&self) -> usize {
        self.record_bytes
    }

    fn load(&self, slot: usize, record: &dyn RecordSource) -> Result<()> {
        if slot >= self.slot_count {
            bail!("slot {slot} is outside the expert cache of {} slots", self.slot_count);
        }
        // SAFETY: in bounds (checked above). The trait's contract (enforced by the pool) is that no
        // other load of this slot runs concurrently and no lease can see the slot, so this is the
        // only reference to these bytes while it lives; other slots' ranges are disjoint.
        let buf = unsafe {
            std::slice::from_raw_parts_mut(self.base.as_ptr().add(slot * self.record_bytes), self.record_bytes)
        };
        record.read(buf)
    }
}

impl Drop for HostSlots {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this very layout, freed exactly once.
        unsafe { alloc::dealloc(self.base.as_ptr(), self.layout) }
    }
}

/// How many records of `record_bytes` fit in a budget of `bytes` (0 when `record_bytes` is 0).
pub fn slots_for_budget(bytes: u64, record_bytes: usize) -> usize {
    if record_bytes == 0 {
        return 0;
    }
    usize::try_from(bytes / record_bytes as u64).unwrap_or(usize::MAX)
}

/// Parses a size such as `4096`, `512M`, `2G`, `1.5GiB` or `64kb`.
///
/// The suffixes K, M, G and T (case-insensitive, optionally followed by `B` or `iB`) are powers of
/// 1024: `1K` = `1KB` = `1KiB` = 1024 bytes. A bare number or a `B` suffix is bytes and must be
/// whole; fractions of larger units are rounded down to whole bytes.
pub fn parse_size(text: &str) -> Result<u64> {
    let help = "expected bytes or a number with K, M, G or T (powers of 1024), e.g. 4096, 512M, 1.5G";
    let s = text.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, unit) = (&s[..split], s[split..].trim());
    if num.is_empty() {
        bail!("cannot read the size {text:?}: {help}");
    }
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => bail!("cannot read the size {text:?}: unknown unit {unit:?}; {help}"),
    };
    let (int, frac) = num.split_once('.').unwrap_or((num, ""));
    if int.is_empty() && frac.is_empty() || frac.contains('.') {
        bail!("cannot read the size {text:?}: {help}");
    }
    if frac.len() > 20 {
        bail!("cannot read the size {text:?}: too many decimals");
    }
    if shift == 0 && frac.bytes().any(|d| d != b'0') {
        bail!("cannot read the size {text:?}: a size in bytes must be a whole number");
    }
    let too_big = || anyhow!("the size {text:?} is too large");
    let whole: u128 = if int.is_empty() { 0 } else { int.parse::<u128>().map_err(|_| too_big())? };
    let frac_val: u128 = if frac.is_empty() { 0 } else { frac.parse().map_err(|_| too_big())? };
    let unit_bytes = 1u128 << shift;
    let bytes = whole
        .checked_mul(unit_bytes)
        .and_then(|w| w.checked_add(frac_val * unit_bytes / 10u128.pow(frac.len() as u32)))
        .ok_or_else(too_big)?;
    u64::try_from(bytes).map_err(|_| too_big())
}

/// `512 B`, `24 KiB`, `1.5 GiB` (powers of 1024, at most one decimal).
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 || v.fract() == 0.0 { format!("{v:.0} {}", UNITS[u]) } else { format!("{v:.1} {}", UNITS[u]) }
}

// ---- pool state --------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Free,
    Loading,
    Ready,
}

const TICKET_LOADING: u8 = 0;
const TICKET_READY: u8 = 1;
const TICKET_FAILED: u8 = 2;

/// The outcome of one read, shared by every lease entry waiting for it. Written under the pool
/// lock (then `done` is notified), read without it on the fast path.
struct Ticket {
    state: AtomicU8,
    error: OnceLock<String>,
}

impl Ticket {
    fn new() -> Arc<Ticket> {
        Arc::new(Ticket { state: AtomicU8::new(TICKET_LOADING), error: OnceLock::new() })
    }
    fn state(&self) -> u8 {
        self.state.load(Ordering::Acquire)
    }
}

/// How the pool chooses which evictable record to drop for a new one (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub enum Eviction {
    /// Least recently used.
    Lru,
    /// LRFU: a combined recency-frequency value that halves every 1/lambda tokens.
    Lrfu { lambda: f64 },
    /// LRFU whose decay follows whichever candidate's ghost cache hit most lately
    /// ([`crate::policy::Adaptive`]).
    Adaptive,
}

impl Eviction {
    /// The default: adaptive LRFU. On the synthetic traces of `benchmark/notes-policy.md` it hits
    /// within 0.3 points of the best fixed decay on every trace and cache size, where each fixed
    /// decay loses 1.6 points or more on some (0.03 while popularity stays, 0.003 and 0.01 once it
    /// drifts).
    pub const DEFAULT: Eviction = Eviction::Adaptive;

    pub fn label(&self) -> String {
        self.policy().label()
    }

    /// The same policy for the offline simulator.
    pub fn policy(&self) -> crate::policy::Policy {
        match *self {
            Eviction::Lru => crate::policy::Policy::Lru,
            Eviction::Lrfu { lambda } => crate::policy::Policy::Lrfu { lambda },
            Eviction::Adaptive => crate::policy::Policy::Adaptive,
        }
    }

    /// LRFU values kept per (layer, expert): one per decay the policy may rank by.
    fn decays(&self) -> usize {
        match self {
            Eviction::Lru => 0,
            Eviction::Lrfu { .. } => 1,
            Eviction::Adaptive => ADAPTIVE_LAMBDAS.len(),
        }
    }
}

impl Default for Eviction {
    fn default() -> Eviction {
        Eviction::DEFAULT
    }
}

/// A slot's place in the eviction order: (priority, tick of its last use); the smallest goes first.
/// Ticks are unique, so ranks are too.
type Rank = (OrdF64, u64);

/// The evictable slots (`Ready`, no pins) by rank, smallest first: a min-heap of (rank, slot)
/// whose entries go stale rather than being removed. An entry is live while its slot is still
/// evictable under that rank; a slot leaves the index by being pinned or re-ranked (its entry then
/// no longer matches), and re-enters with a new entry. [`Evictable::pop_first`] skips stale
/// entries; [`Evictable::tidy`] drops them where the host has time.
#[derive(Default)]
struct Evictable {
    heap: BinaryHeap<Reverse<(Rank, usize)>>,
    /// Live entries: the evictable slots.
    len: usize,
}

impl Evictable {
    fn live(slots: &[Slot], rank: Rank, s: usize) -> bool {
        let slot = &slots[s];
        slot.state == State::Ready && slot.pins == 0 && slot.rank == rank
    }

    /// Slot `s` became evictable under `rank` (its `rank` field).
    fn insert(&mut self, rank: Rank, s: usize) {
        self.heap.push(Reverse((rank, s)));
        self.len += 1;
    }

    /// An evictable slot stops being evictable (the caller pins or re-ranks it, which makes its
    /// entry stale).
    fn remove(&mut self) {
        self.len -= 1;
    }

    /// The evictable slot of lowest rank, taken out of the index.
    fn pop_first(&mut self, slots: &[Slot]) -> Option<usize> {
        while let Some(Reverse((rank, s))) = self.heap.pop() {
            if Evictable::live(slots, rank, s) {
                self.len -= 1;
                return Some(s);
            }
        }
        None
    }

    fn len(&self) -> usize {
        self.len
    }

    fn clear(&mut self) {
        self.heap.clear();
        self.len = 0;
    }

    /// Drops the stale entries once they outnumber the live ones (a scan of the whole heap, so only
    /// where the host has time to spare: its cost shows in `pool_host_cost`'s ghosts column).
    fn tidy(&mut self, slots: &[Slot]) {
        if self.heap.len() > 2 * self.len + 64 {
            self.heap.retain(|Reverse((rank, s))| Evictable::live(slots, *rank, *s));
        }
    }

    /// [`Evictable::tidy`] where the stale entries have grown far beyond what a caller that tidies
    /// keeps (a bound on the memory for callers that never do).
    fn bound(&mut self, slots: &[Slot]) {
        if self.heap.len() > 8 * self.len + 4096 {
            self.heap.retain(|Reverse((rank, s))| Evictable::live(slots, *rank, *s));
        }
    }
}

struct Slot {
    state: State,
    /// (MoE layer, expert); meaningful unless `Free`.
    key: (usize, usize),
    /// Live leases naming this slot.
    pins: u32,
    /// Its eviction rank, set at every acquire naming it (the evictable index's key).
    rank: Rank,
    /// Identity of the current occupancy: set anew for every load, 0 when free. Leases remember it
    /// so that a lease whose load failed (slot freed, maybe reused) does not unpin a stranger.
    generation: u64,
    /// The read in flight (while `Loading`).
    ticket: Option<Arc<Ticket>>,
    /// A prefetch read the record and no step has used it yet.
    unused: bool,
}

impl Slot {
    fn free() -> Slot {
        Slot {
            state: State::Free,
            key: (0, 0),
            pins: 0,
            rank: (OrdF64(0.0), 0),
            generation: 0,
            ticket: None,
            unused: false,
        }
    }
}

struct Job {
    slot: usize,
    generation: u64,
    layer: usize,
    expert: usize,
    ticket: Arc<Ticket>,
    /// A step waits for it (a miss), as opposed to a prefetch.
    demand: bool,
}

/// Records that are `Loading` or `Ready`, to their slot: a table of every (layer, expert), so a
/// lookup is an index, not a hash (an acquire makes about twenty of them on the path from a router
/// to its copies).
struct SlotIndex {
    num_experts: usize,
    slots: Vec<usize>,
}

impl SlotIndex {
    const NONE: usize = usize::MAX;

    fn new(layers: usize, num_experts: usize) -> SlotIndex {
        SlotIndex { num_experts, slots: vec![Self::NONE; layers * num_experts] }
    }

    /// The table's entry for (layer, expert); an expert past the model's maps to none (past the
    /// table's end), never to another layer's entry.
    fn at(&self, &(layer, expert): &(usize, usize)) -> usize {
        if expert < self.num_experts { layer * self.num_experts + expert } else { usize::MAX }
    }

    fn get(&self, key: &(usize, usize)) -> Option<&usize> {
        self.slots.get(self.at(key)).filter(|&&s| s != Self::NONE)
    }

    fn contains_key(&self, key: &(usize, usize)) -> bool {
        self.get(key).is_some()
    }

    fn insert(&mut self, key: (usize, usize), slot: usize) {
        let at = self.at(&key);
        self.slots[at] = slot;
    }

    fn remove(&mut self, key: &(usize, usize)) {
        let at = self.at(key);
        self.slots[at] = Self::NONE;
    }

    /// Every (layer, expert) with a slot, and the slot.
    fn iter(&self) -> impl Iterator<Item = ((usize, usize), usize)> + '_ {
        let n = self.num_experts;
        self.slots.iter().enumerate().filter(|&(_, &s)| s != Self::NONE).map(move |(i, &s)| ((i / n, i % n), s))
    }
}

struct Inner {
    slots: Vec<Slot>,
    /// Records that are `Loading` or `Ready`, to their slot.
    map: SlotIndex,
    /// Free slots; popped from the end (initially in ascending order).
    free: Vec<usize>,
    /// `Ready` slots with no pins, by rank: the first is the victim.
    evictable: Evictable,
    /// Reads not yet taken by an IO thread, FIFO.
    queue: VecDeque<Job>,
    tick: u64,
    eviction: Eviction,
    /// LRFU's state of every (layer, expert), at `(layer * num_experts + expert) * d + i` for the
    /// policy's `d` decays (`Eviction::decays`).
    crf: Vec<Crf>,
    /// Adaptive LRFU's choice (None for the other policies, and where every record fits), and the
    /// steps its ghost caches have not replayed yet (with their token), replayed off the path from
    /// a router to its copies ([`ExpertPool::replay_ghosts`]).
    adaptive: Option<Adaptive>,
    ghost_steps: Vec<(Vec<Key>, u64)>,
    /// Times adaptive LRFU changed its decay.
    switches: u64,
    num_experts: usize,
    /// Tokens seen (LRFU's clock), and the layer of the last acquire (a new token starts when an
    /// acquire's layer is not above it).
    token: u64,
    last_layer: Option<usize>,
    next_generation: u64,
    /// Acquires waiting for abandoned reads to finish (a gauge for diagnostics and tests).
    blocked: usize,
    shutdown: bool,
}

/// What a request needs and what the pool can give it.
struct Capacity {
    /// Slots the request's misses need.
    needed: usize,
    /// Slots it can take now: free ones and evictable ones not named by the request.
    available: usize,
    /// Slots that will become evictable when their read finishes: loading, no lease pins them,
    /// not named by the request.
    draining: usize,
}

impl Inner {
    /// A slot for a new record: a free one, else the lowest-ranked evictable one (whose record is
    /// forgotten and counted as evicted). None when every slot is pinned or loading.
    fn take_slot(&mut self, counters: &PoolCounters) -> Option<usize> {
        if let Some(s) = self.free.pop() {
            return Some(s);
        }
        let s = self.evictable.pop_first(&self.slots)?;
        let old = self.slots[s].key;
        self.map.remove(&old);
        counters.record_eviction(old.0, old.1);
        if self.slots[s].unused {
            counters.record_prefetch_unused(old.0);
        }
        Some(s)
    }

    /// Moves LRFU's clock for an acquire of `layer`; at adaptive LRFU's window ends, its choice.
    fn start_step(&mut self, layer: usize) {
        if self.last_layer.is_some_and(|l| layer <= l) {
            self.token += 1;
            self.replay_ghosts();
            self.evictable.bound(&self.slots);
            if let Some(now) = self.adaptive.as_mut().and_then(|a| a.new_token(self.token)) {
                self.rerank(now);
                self.switches += 1;
            }
        }
        self.last_layer = Some(layer);
    }

    /// Replays the steps adaptive LRFU's ghost caches have not seen yet.
    fn replay_ghosts(&mut self) {
        if let Some(a) = self.adaptive.as_mut() {
            for (step, token) in self.ghost_steps.drain(..) {
                a.observe(&step, token);
            }
        }
    }

    /// The decay adaptive LRFU ranks by now (its index), or LRFU's one decay (0).
    fn decay(&self) -> (usize, f64) {
        match self.eviction {
            Eviction::Adaptive => {
                let i = self.adaptive.as_ref().map_or(ADAPTIVE_START, Adaptive::current);
                (i, ADAPTIVE_LAMBDAS[i])
            }
            Eviction::Lrfu { lambda } => (0, lambda),
            Eviction::Lru => (0, 0.0),
        }
    }

    /// Adaptive LRFU switched to decay `now`: every record is ranked by its own history under it
    /// (its tick kept), and the evictable order rebuilt.
    fn rerank(&mut self, now: usize) {
        let (d, lambda) = (self.eviction.decays(), ADAPTIVE_LAMBDAS[now]);
        self.evictable.clear();
        for (s, slot) in self.slots.iter_mut().enumerate() {
            if slot.state == State::Free {
                continue;
            }
            let (layer, expert) = slot.key;
            let p = self.crf[(layer * self.num_experts + expert) * d + now].last_priority(lambda);
            slot.rank = (OrdF64(p), slot.rank.1);
            if slot.state == State::Ready && slot.pins == 0 {
                self.evictable.insert(slot.rank, s);
            }
        }
    }

    /// Records a use of (layer, expert) at `tick`; returns its new rank.
    fn use_rank(&mut self, layer: usize, expert: usize, tick: u64) -> Rank {
        let d = self.eviction.decays();
        let p = match self.eviction {
            Eviction::Lru => 0.0,
            Eviction::Lrfu { lambda } => self.crf[layer * self.num_experts + expert].touch(self.token, lambda),
            Eviction::Adaptive => {
                let (now, at) = (self.decay().0, (layer * self.num_experts + expert) * d);
                let mut p = 0.0;
                for (i, c) in self.crf[at..at + d].iter_mut().enumerate() {
                    let q = c.touch(self.token, ADAPTIVE_LAMBDAS[i]);
                    if i == now {
                        p = q;
                    }
                }
                p
            }
        };
        (OrdF64(p), tick)
    }

    /// The rank of a prefetched (layer, expert) at `tick`: as if used now, without counting a use.
    fn prefetch_rank(&self, layer: usize, expert: usize, tick: u64) -> Rank {
        let (i, lambda) = self.decay();
        let d = self.eviction.decays();
        let p =
            if d == 0 { 0.0 } else { self.crf[(layer * self.num_experts + expert) * d + i].peek(self.token, lambda) };
        (OrdF64(p), tick)
    }

    /// Puts slot `s` in `Loading` for (layer, expert) and queues its read; returns its generation
    /// and ticket.
    fn start_load(&mut self, s: usize, layer: usize, expert: usize, pins: u32, rank: Rank) -> (u64, Arc<Ticket>) {
        let generation = self.next_generation;
        self.next_generation += 1;
        let ticket = Ticket::new();
        self.slots[s] = Slot {
            state: State::Loading,
            key: (layer, expert),
            pins,
            rank,
            generation,
            ticket: Some(Arc::clone(&ticket)),
            unused: pins == 0,
        };
        self.map.insert((layer, expert), s);
        let demand = pins > 0;
        self.enqueue(Job { slot: s, generation, layer, expert, ticket: Arc::clone(&ticket), demand });
        (generation, ticket)
    }

    /// Queues a read: a demand read behind the other demand reads but ahead of every queued
    /// prefetch; a prefetch last.
    fn enqueue(&mut self, job: Job) {
        if job.demand {
            let at = self.queue.iter().position(|j| !j.demand).unwrap_or(self.queue.len());
            self.queue.insert(at, job);
        } else {
            self.queue.push_back(job);
        }
    }

    /// A queued prefetch of slot `s` that a step now waits for becomes a demand read.
    fn promote(&mut self, s: usize) {
        if let Some(i) = self.queue.iter().position(|j| j.slot == s && !j.demand) {
            let mut job = self.queue.remove(i).expect("found above");
            job.demand = true;
            self.enqueue(job);
        }
    }

    fn capacity(&self, layer: usize, experts: &[usize]) -> Capacity {
        let (mut needed, mut evictable_hits, mut loading_hits) = (0, 0, 0);
        for &e in experts {
            match self.map.get(&(layer, e)) {
                None => needed += 1,
                Some(&s) => match (self.slots[s].state, self.slots[s].pins) {
                    (State::Ready, 0) => evictable_hits += 1,
                    (State::Loading, 0) => loading_hits += 1,
                    _ => {}
                },
            }
        }
        let available = self.free.len() + self.evictable.len() - evictable_hits;
        if needed <= available {
            return Capacity { needed, available, draining: 0 }; // the common case: no scan
        }
        let loading = self.slots.iter().filter(|s| s.state == State::Loading && s.pins == 0).count();
        Capacity { needed, available, draining: loading - loading_hits }
    }
}

struct Shared<M> {
    store: Arc<Store>,
    memory: Arc<M>,
    inner: Mutex<Inner>,
    /// IO threads wait here for jobs.
    work: Condvar,
    /// Signalled when a read finishes (or a lease drop makes slots evictable while an acquire is
    /// blocked): `Lease::wait` and blocked acquires wait here.
    done: Condvar,
    counters: PoolCounters,
}

impl<M> Shared<M> {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // The critical sections only move bookkeeping between consistent states and do not panic;
        // a poisoned lock means a panic elsewhere in that thread, and the state is still coherent.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The bounded expert cache of one store, with its IO threads. See the module docs.
pub struct ExpertPool<M: SlotMemory> {
    shared: Arc<Shared<M>>,
    /// The steps served, when recording (for offline policy studies, [`crate::policy`]).
    trace: Mutex<Option<Vec<crate::policy::Step>>>,
    threads: Vec<JoinHandle<()>>,
    layers: usize,
    num_experts: usize,
    slot_count: usize,
    record_bytes: usize,
    /// Name and record precision per MoE layer, for statistics.
    info: Vec<LayerInfo>,
}

/// One expert of a lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseEntry {
    pub expert: usize,
    /// The slot holding it (stable for the lease's life).
    pub slot: usize,
    /// Loaded when acquired (no wait needed).
    pub hit: bool,
}

struct Pin {
    generation: u64,
    /// `None` for hits (ready at acquire).
    ticket: Option<Arc<Ticket>>,
}

/// The experts of one MoE layer for one step, pinned in their slots until dropped.
pub struct Lease<'a, M: SlotMemory> {
    pool: &'a ExpertPool<M>,
    layer: usize,
    entries: Vec<LeaseEntry>,
    pins: Vec<Pin>,
    /// Entries that were being read already when acquired (a prefetch, or another lease's miss),
    /// and those whose reads this acquire queued.
    inflight: usize,
    misses: usize,
}

impl<M: SlotMemory> ExpertPool<M> {
    /// A pool over `memory`'s slots reading records of `store`, with `io_threads` reader threads,
    /// evicting with [`Eviction::DEFAULT`].
    pub fn new(store: Arc<Store>, memory: Arc<M>, io_threads: usize) -> Result<ExpertPool<M>> {
        ExpertPool::with_eviction(store, memory, io_threads, Eviction::DEFAULT)
    }

    /// [`ExpertPool::new`] with another eviction policy.
    pub fn with_eviction(
        store: Arc<Store>,
        memory: Arc<M>,
        io_threads: usize,
        eviction: Eviction,
    ) -> Result<ExpertPool<M>> {
        let ef = &store.manifest.experts;
        let (layers, num_experts, record_bytes) = (ef.layers.len(), ef.num_experts, store.record_bytes());
        let slot_count = memory.slot_count();
        if memory.record_bytes() != record_bytes {
            bail!(
                "expert slots of {} bytes cannot hold this store's records of {record_bytes} bytes ({})",
                memory.record_bytes(),
                store.dir.display()
            );
        }
        if slot_count == 0 {
            bail!("an expert cache needs at least one slot; use a larger --expert-cache");
        }
        if io_threads == 0 {
            bail!("the expert pool needs at least one IO thread");
        }
        if let Eviction::Lrfu { lambda } = eviction
            && !(lambda.is_finite() && lambda >= 0.0)
        {
            bail!("LRFU's decay rate must be a finite number >= 0, not {lambda}");
        }
        let inner = Inner {
            slots: (0..slot_count).map(|_| Slot::free()).collect(),
            map: SlotIndex::new(layers, num_experts),
            free: (0..slot_count).rev().collect(),
            evictable: Evictable::default(),
            queue: VecDeque::new(),
            tick: 0,
            eviction,
            crf: vec![Crf::default(); layers * num_experts * eviction.decays()],
            // Ghost caches only where something can be evicted.
            adaptive: (eviction == Eviction::Adaptive && slot_count < layers * num_experts)
                .then(|| Adaptive::new(slot_count, layers)),
            ghost_steps: Vec::new(),
            switches: 0,
            num_experts,
            token: 0,
            last_layer: None,
            next_generation: 1,
            blocked: 0,
            shutdown: false,
        };
        let shared = Arc::new(Shared {
            store,
            memory,
            inner: Mutex::new(inner),
            work: Condvar::new(),
            done: Condvar::new(),
            counters: PoolCounters::new(layers, num_experts),
        });
        let info = layer_info(&shared.store);
        let mut pool = ExpertPool {
            shared,
            trace: Mutex::new(None),
            threads: Vec::new(),
            layers,
            num_experts,
            slot_count,
            record_bytes,
            info,
        };
        for i in 0..io_threads {
            let shared = Arc::clone(&pool.shared);
            // On failure `pool` drops here, which stops and joins the threads already started.
            let handle = std::thread::Builder::new()
                .name(format!("cherenkov-io-{i}"))
                .spawn(move || io_loop(&shared))
                .with_context(|| format!("cannot start expert IO thread {i} of {io_threads}"))?;
            pool.threads.push(handle);
        }
        Ok(pool)
    }

    pub fn store(&self) -> &Arc<Store> {
        &self.shared.store
    }

    /// Starts (or stops, discarding it) recording the steps served.
    pub fn record_trace(&self, on: bool) {
        *self.trace.lock().unwrap_or_else(|e| e.into_inner()) = if on { Some(Vec::new()) } else { None };
    }

    /// The steps recorded so far (recording continues).
    pub fn take_trace(&self) -> Vec<crate::policy::Step> {
        self.trace.lock().unwrap_or_else(|e| e.into_inner()).as_mut().map(std::mem::take).unwrap_or_default()
    }

    pub fn memory(&self) -> &Arc<M> {
        &self.shared.memory
    }

    /// How the pool chooses its victims.
    pub fn eviction(&self) -> Eviction {
        self.shared.lock().eviction
    }

    /// The LRFU decay the pool ranks by now (None under LRU) and how many times adaptive LRFU has
    /// changed it.
    pub fn decay(&self) -> (Option<f64>, u64) {
        let inner = self.shared.lock();
        let lambda = (inner.eviction != Eviction::Lru).then(|| inner.decay().1);
        (lambda, inner.switches)
    }

    pub fn slot_count(&self) -> usize {
        self.slot_count
    }

    pub fn record_bytes(&self) -> usize {
        self.record_bytes
    }

    /// MoE layers of the store (trunk layers, then MTP layers).
    pub fn layers(&self) -> usize {
        self.layers
    }

    pub fn num_experts(&self) -> usize {
        self.num_experts
    }

    /// Pins `experts` of MoE layer `layer` (the store's expert slot index) for one step and queues
    /// reads for the missing ones, in the order given; returns without waiting for them.
    ///
    /// `experts` must be distinct (the caller deduplicates) and ordered by importance.
    pub fn acquire(&self, layer: usize, experts: &[usize]) -> Result<Lease<'_, M>> {
        self.acquire_waking(layer, experts, true)
    }

    /// [`ExpertPool::acquire`], and the misses' reads run on the calling thread
    /// ([`ExpertPool::load_queued`]) without waking an IO thread for them: for a memory whose load
    /// only queues device work (the CUDA slots copying from a pinned expert file), where a dozen
    /// threads woken for nothing cost more than the loads.
    pub fn acquire_loading(&self, layer: usize, experts: &[usize]) -> Result<Lease<'_, M>> {
        let lease = self.acquire_waking(layer, experts, false)?;
        self.load_queued()?;
        Ok(lease)
    }

    /// Lets adaptive LRFU's ghost caches replay the steps acquired since they last did. A caller
    /// of [`ExpertPool::acquire_loading`] calls it where the host has time to spare (the CUDA
    /// backend: once a block's copies and resident experts are queued); otherwise the next token's
    /// first acquire replays them, before its misses are queued.
    pub fn replay_ghosts(&self) {
        let mut guard = self.shared.lock();
        let inner = &mut *guard;
        inner.replay_ghosts();
        // The eviction index's stale entries too, while the host has time.
        inner.evictable.tidy(&inner.slots);
    }

    fn acquire_waking(&self, layer: usize, experts: &[usize], wake: bool) -> Result<Lease<'_, M>> {
        self.check_request(layer, experts)?;
        if let Some(t) = self.trace.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            t.push(crate::policy::Step { layer: layer as u16, experts: experts.iter().map(|&e| e as u16).collect() });
        }
        let n = experts.len();
        let mut entries = vec![LeaseEntry { expert: 0, slot: 0, hit: false }; n];
        let mut pins: Vec<Option<Pin>> = (0..n).map(|_| None).collect();
        let (mut hits, mut inflight, mut misses) = (0u64, 0u64, 0u64);
        let mut blocked: Option<Instant> = None;
        {
            let mut guard = self.shared.lock();
            // Capacity first, so a refused request changes nothing. Reads whose leases are gone
            // finish on their own, so waiting for them cannot deadlock; slots pinned by live
            // leases may never come back, so those refuse the request instead.
            loop {
                let cap = guard.capacity(layer, experts);
                if cap.needed <= cap.available {
                    break;
                }
                if cap.needed > cap.available + cap.draining {
                    let pinned = guard.slots.iter().filter(|s| s.pins > 0).count();
                    drop(guard);
                    self.record_blocked(layer, blocked);
                    bail!(
                        "expert cache is full: layer {layer} needs {} more slots but only {} of {} can take new \
                         experts ({pinned} are pinned by live leases); drop finished leases before acquiring, or \
                         use a larger --expert-cache",
                        cap.needed,
                        cap.available + cap.draining,
                        self.slot_count
                    );
                }
                blocked.get_or_insert_with(Instant::now);
                guard.blocked += 1;
                guard = self.shared.done.wait(guard).unwrap_or_else(|e| e.into_inner());
                guard.blocked -= 1;
            }
            let inner = &mut *guard;
            inner.start_step(layer);
            let base = inner.tick;
            inner.tick += n as u64;

            // Pass 1: pin what is resident or already being read, so no miss below can evict it.
            for (i, &e) in experts.iter().enumerate() {
                let Some(&s) = inner.map.get(&(layer, e)) else { continue };
                let rank = inner.use_rank(layer, e, base + i as u64 + 1);
                let slot = &mut inner.slots[s];
                if slot.state == State::Ready && slot.pins == 0 {
                    inner.evictable.remove();
                }
                slot.pins += 1;
                slot.rank = rank;
                slot.unused = false;
                let ticket = match slot.state {
                    State::Ready => {
                        hits += 1;
                        self.shared.counters.record_routed(layer, e, Served::Hit);
                        None
                    }
                    State::Loading => {
                        inflight += 1;
                        self.shared.counters.record_routed(layer, e, Served::Inflight);
                        slot.ticket.clone()
                    }
                    State::Free => unreachable!("free slots are not in the map"),
                };
                let generation = slot.generation;
                if ticket.is_some() {
                    inner.promote(s);
                }
                entries[i] = LeaseEntry { expert: e, slot: s, hit: ticket.is_none() };
                pins[i] = Some(Pin { generation, ticket });
            }

            if inner.adaptive.is_some() {
                let keys = experts.iter().map(|&e| (layer as u16, e as u16)).collect();
                inner.ghost_steps.push((keys, inner.token));
            }

            // Pass 2: misses, in request order: a free slot, else the lowest-ranked evictable one.
            for (i, &e) in experts.iter().enumerate() {
                if pins[i].is_some() {
                    continue;
                }
                let s = inner.take_slot(&self.shared.counters).expect("capacity was checked above");
                self.shared.memory.retire(s);
                let rank = inner.use_rank(layer, e, base + i as u64 + 1);
                let (generation, ticket) = inner.start_load(s, layer, e, 1, rank);
                misses += 1;
                self.shared.counters.record_routed(layer, e, Served::Miss);
                entries[i] = LeaseEntry { expert: e, slot: s, hit: false };
                pins[i] = Some(Pin { generation, ticket: Some(ticket) });
            }
        }
        if wake {
            self.wake_readers(misses as usize);
            self.replay_ghosts();
        }
        self.record_blocked(layer, blocked);
        self.shared.counters.record_acquire(layer, hits, inflight, misses);
        let pins = pins.into_iter().map(|p| p.expect("every entry was assigned")).collect();
        let (inflight, misses) = (inflight as usize, misses as usize);
        Ok(Lease { pool: self, layer, entries, pins, inflight, misses })
    }

    fn record_blocked(&self, layer: usize, since: Option<Instant>) {
        if let Some(t) = since {
            self.shared.counters.record_wait(layer, u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX));
        }
    }

    fn check_request(&self, layer: usize, experts: &[usize]) -> Result<()> {
        if layer >= self.layers {
            bail!("MoE layer {layer} is outside the store ({} MoE layers)", self.layers);
        }
        if experts.len() > self.slot_count {
            let rb = self.record_bytes as u64;
            bail!(
                "expert cache of {} slots ({} x {}) cannot hold the {} experts one step needs; use --expert-cache \
                 of at least {}",
                self.slot_count,
                self.slot_count,
                format_bytes(rb),
                experts.len(),
                format_bytes(experts.len() as u64 * rb)
            );
        }
        let mut seen = vec![false; self.num_experts];
        for &e in experts {
            if e >= self.num_experts {
                bail!("expert {e} of MoE layer {layer} is outside the store ({} experts per layer)", self.num_experts);
            }
            if std::mem::replace(&mut seen[e], true) {
                bail!("expert {e} appears twice in one request for MoE layer {layer}; the caller must deduplicate");
            }
        }
        Ok(())
    }

    /// Records a step of MoE layer `layer` whose `experts` are all resident (`Ready`) as hits,
    /// exactly as an [`ExpertPool::acquire`] of them and the lease's drop would, under one lock
    /// and without a lease: for callers that only account for a step the device already ran from
    /// resident experts (the CUDA backend's replayed steps); in a cache that holds every record,
    /// which never evicts, without the ranks' upkeep. Returns false, changing nothing,
    /// where one of them is not resident (the caller then acquires them) or the request is not
    /// one an acquire would take.
    pub fn record_hits(&self, layer: usize, experts: &[usize]) -> bool {
        if self.check_request(layer, experts).is_err() {
            return false;
        }
        let mut guard = self.shared.lock();
        let inner = &mut *guard;
        let ready = |s: Option<&usize>| s.is_some_and(|&s| inner.slots[s].state == State::Ready);
        if !experts.iter().all(|&e| ready(inner.map.get(&(layer, e)))) {
            return false;
        }
        if let Some(t) = self.trace.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            t.push(crate::policy::Step { layer: layer as u16, experts: experts.iter().map(|&e| e as u16).collect() });
        }
        inner.start_step(layer);
        let base = inner.tick;
        inner.tick += experts.len() as u64;
        // A cache that holds every record never evicts: its ranks need no upkeep.
        let ranked = self.slot_count < self.layers * self.num_experts;
        for (i, &e) in experts.iter().enumerate() {
            if ranked {
                let s = *inner.map.get(&(layer, e)).expect("every expert was checked ready above");
                let rank = inner.use_rank(layer, e, base + i as u64 + 1);
                let slot = &mut inner.slots[s];
                // Pinned and released again: an unpinned slot goes back under its new rank.
                slot.rank = rank;
                if slot.pins == 0 {
                    inner.evictable.remove();
                    inner.evictable.insert(rank, s);
                }
            }
            self.shared.counters.record_routed(layer, e, Served::Hit);
        }
        if inner.adaptive.is_some() {
            let keys = experts.iter().map(|&e| (layer as u16, e as u16)).collect();
            inner.ghost_steps.push((keys, inner.token));
        }
        drop(guard);
        self.shared.counters.record_acquire(layer, experts.len() as u64, 0, 0);
        true
    }

    /// For each of `experts` of MoE layer `layer`, whether it is absent: neither loaded nor being
    /// loaded (what an acquire would count as a miss now).
    pub fn absent(&self, layer: usize, experts: &[usize]) -> Vec<bool> {
        let inner = self.shared.lock();
        experts.iter().map(|&e| !inner.map.contains_key(&(layer, e))).collect()
    }

    /// Counts `experts` of `layer`, routed by a step and computed elsewhere (on the CPU) instead of
    /// acquired, as misses computed on the CPU; the cache is not changed.
    pub fn record_cpu_computed(&self, layer: usize, experts: &[usize]) {
        if layer >= self.layers || experts.is_empty() {
            return;
        }
        let c = &self.shared.counters;
        c.record_acquire(layer, 0, 0, experts.len() as u64);
        c.record_cpu_computed(layer, experts.len() as u64);
        for &e in experts.iter().filter(|&&e| e < self.num_experts) {
            c.record_routed(layer, e, Served::Miss);
        }
    }

    /// Runs the queued step reads (misses, not prefetches) on the calling thread instead of waiting
    /// for an IO thread to wake for them; returns how many it ran. For a memory whose load only
    /// queues work on a device (the CUDA slots copying from a pinned expert file), where waking a
    /// thread costs more than the load. An IO thread may still take any of them first. The loads
    /// run as one batch ([`SlotMemory::begin_batch`]); an error is the memory's failure to queue
    /// the batch (the slots' readers then meet it again).
    pub fn load_queued(&self) -> Result<usize> {
        let mut ran = 0;
        self.shared.memory.begin_batch();
        loop {
            let job = {
                let mut inner = self.shared.lock();
                match inner.queue.front() {
                    Some(j) if j.demand => inner.queue.pop_front(),
                    _ => None,
                }
            };
            let Some(job) = job else { break };
            run_job(&self.shared, job);
            ran += 1;
        }
        self.shared.memory.end_batch()?;
        Ok(ran)
    }

    /// Lookahead: queues reads for the experts of `layer` that are neither resident nor being read,
    /// behind every read already queued (so a step's required misses always go first). Nothing is
    /// pinned: once loaded, a prefetched record is an ordinary, evictable cache entry, ranked as if
    /// used now (without counting a use). Slots come from the free list, else from the lowest-ranked
    /// evictable records; pinned and loading slots are never taken, and the prefetch stops when none
    /// is left.
    /// Returns the number of reads queued.
    pub fn prefetch(&self, layer: usize, experts: &[usize]) -> usize {
        self.queue_prefetch(layer, experts, true, &mut |_, _| {})
    }

    /// [`ExpertPool::prefetch`] without waking an IO thread: the reads stay queued until the caller
    /// runs them ([`ExpertPool::load_prefetches`]), or a thread already awake takes them first.
    /// For a memory whose load only queues device work (the CUDA slots copying from a pinned
    /// expert file), whose caller would otherwise wait for a sleeping thread to wake before the
    /// copies start.
    pub fn prefetch_unwoken(&self, layer: usize, experts: &[usize]) -> usize {
        self.queue_prefetch(layer, experts, false, &mut |_, _| {})
    }

    /// Runs every queued read on the calling thread, prefetches included, each as a load of its
    /// own (not a step's batch); returns how many it ran. A failed read settles its ticket as on
    /// an IO thread (the record is forgotten; the step that asks for it reads it again).
    pub fn load_prefetches(&self) -> usize {
        let mut ran = 0;
        loop {
            let job = self.shared.lock().queue.pop_front();
            let Some(job) = job else { break };
            run_job(&self.shared, job);
            ran += 1;
        }
        ran
    }

    /// [`ExpertPool::prefetch`], handing each queued read's ticket to `queued_read` while still
    /// holding the lock, i.e. before an IO thread can end the read (a failed read forgets its
    /// record).
    fn queue_prefetch(
        &self,
        layer: usize,
        experts: &[usize],
        wake: bool,
        queued_read: &mut dyn FnMut((usize, usize), &Arc<Ticket>),
    ) -> usize {
        if layer >= self.layers {
            return 0;
        }
        let mut queued = 0;
        {
            let mut guard = self.shared.lock();
            let inner = &mut *guard;
            for &e in experts {
                if e >= self.num_experts || inner.map.contains_key(&(layer, e)) {
                    continue;
                }
                let Some(s) = inner.take_slot(&self.shared.counters) else { break };
                self.shared.memory.retire(s);
                inner.tick += 1;
                let rank = inner.prefetch_rank(layer, e, inner.tick);
                let (_, ticket) = inner.start_load(s, layer, e, 0, rank);
                queued_read((layer, e), &ticket);
                self.shared.counters.record_expert_prefetch(layer, e);
                queued += 1;
            }
        }
        if queued > 0 {
            self.shared.counters.record_prefetch(layer, queued as u64);
            if wake {
                self.wake_readers(queued);
            }
        }
        queued
    }

    /// Wakes one IO thread per newly queued read (all of them for as many reads as threads), not
    /// every thread for one read: those woken for nothing would only contend for the pool's lock
    /// with the step. A thread already awake takes queued reads before it sleeps again, so none
    /// is left behind.
    fn wake_readers(&self, jobs: usize) {
        if jobs >= self.threads.len() {
            self.shared.work.notify_all();
        } else {
            (0..jobs).for_each(|_| self.shared.work.notify_one());
        }
    }

    /// Records how well a lookahead predicted `layer`'s experts (see [`PoolStats`]).
    pub fn record_lookahead(&self, layer: usize, predicted: &[usize], actual: &[usize]) {
        if layer < self.layers {
            let correct = actual.iter().filter(|e| predicted.contains(e)).count();
            let (predicted, actual) = (predicted.len() as u64, actual.len() as u64);
            self.shared.counters.record_lookahead(layer, predicted, actual, correct as u64);
        }
    }

    /// The experts of `layer` currently loaded (ascending); records still loading are not listed.
    pub fn resident(&self, layer: usize) -> Vec<usize> {
        let inner = self.shared.lock();
        let mut v: Vec<usize> =
            inner.slots.iter().filter(|s| s.state == State::Ready && s.key.0 == layer).map(|s| s.key.1).collect();
        v.sort_unstable();
        v
    }

    /// Makes every expert of every layer resident, for a pool whose slots hold the whole store:
    /// queues reads for all records not yet loaded (counted as prefetches) and waits for them.
    /// Returns the slot of each (layer, expert). Such a pool never evicts afterwards (every
    /// request hits), so the slots stay valid for the pool's life. Fails when the slots cannot
    /// hold every record, or a read fails (naming the expert and the error).
    pub fn preload_all(&self) -> Result<Vec<Vec<usize>>> {
        let total = self.layers * self.num_experts;
        if self.slot_count < total {
            bail!(
                "the expert cache has {} slots, fewer than the store's {total} experts: they cannot all be resident",
                self.slot_count
            );
        }
        let all: Vec<usize> = (0..self.num_experts).collect();
        // The reads in flight, so a failed one (whose slot is freed) can still say why: those this
        // call queues, taken as they are queued (a read may end before the next lock), and those
        // already loading before it.
        let mut tickets: HashMap<(usize, usize), Arc<Ticket>> = HashMap::new();
        for layer in 0..self.layers {
            self.queue_prefetch(layer, &all, true, &mut |key, t| {
                tickets.insert(key, Arc::clone(t));
            });
        }
        let mut guard = self.shared.lock();
        for (key, s) in guard.map.iter() {
            if let Some(t) = &guard.slots[s].ticket {
                tickets.entry(key).or_insert_with(|| Arc::clone(t));
            }
        }
        loop {
            let mut loading = 0;
            for layer in 0..self.layers {
                for e in 0..self.num_experts {
                    let failed = || {
                        let why = tickets.get(&(layer, e)).and_then(|t| t.error.get().cloned());
                        why.unwrap_or_else(|| format!("expert {e} of MoE layer {layer} failed to load"))
                    };
                    match guard.map.get(&(layer, e)) {
                        None => bail!("cannot make every expert resident: {}", failed()),
                        Some(&s) if guard.slots[s].state == State::Loading => loading += 1,
                        Some(_) => {}
                    }
                }
            }
            if loading == 0 {
                break;
            }
            guard = self.shared.done.wait(guard).unwrap_or_else(|e| e.into_inner());
        }
        // Every (layer, expert) was found ready above, with the lock held since.
        let slot = |l, e| *guard.map.get(&(l, e)).expect("every expert is resident");
        Ok((0..self.layers).map(|l| (0..self.num_experts).map(|e| slot(l, e)).collect()).collect())
    }

    /// A snapshot of the counters, the resident count per layer and the slot gauges.
    pub fn stats(&self) -> PoolStats {
        let mut resident = vec![0usize; self.layers];
        let mut gauges =
            SlotGauges { slots: self.slot_count, record_bytes: self.record_bytes, ..SlotGauges::default() };
        {
            let inner = self.shared.lock();
            for s in &inner.slots {
                match s.state {
                    State::Free => gauges.free += 1,
                    State::Loading => gauges.loading += 1,
                    State::Ready => resident[s.key.0] += 1,
                }
                if s.pins > 0 {
                    gauges.pinned += 1;
                }
            }
            gauges.blocked_acquires = inner.blocked;
        }
        let mut stats = self.shared.counters.snapshot(&resident, gauges);
        stats.info = self.info.clone();
        stats
    }

    /// Name and record precision of each MoE layer.
    pub fn layer_info(&self) -> &[LayerInfo] {
        &self.info
    }

    /// The counters and residency of every expert of `layer`; `None` when the layer is outside
    /// the store.
    pub fn expert_stats(&self, layer: usize) -> Option<Vec<ExpertStats>> {
        if layer >= self.layers {
            return None;
        }
        let mut state = vec![Residency::Absent; self.num_experts];
        {
            let inner = self.shared.lock();
            for s in inner.slots.iter().filter(|s| s.key.0 == layer) {
                match s.state {
                    State::Free => {}
                    State::Loading => state[s.key.1] = Residency::Loading,
                    State::Ready => state[s.key.1] = Residency::Resident,
                }
            }
        }
        Some(self.shared.counters.expert_snapshot(layer, &state, self.record_bytes as u64))
    }

    /// A backend's step spent `ns` computing routed experts of `layer` (waits excluded).
    pub fn record_compute(&self, layer: usize, ns: u64) {
        if layer < self.layers {
            self.shared.counters.record_compute(layer, ns);
        }
    }

    /// A backend's step waited `ns` for reads of `layer` outside the pool's own waits (a GPU stream
    /// waiting for copies the pool only queued).
    pub fn record_wait(&self, layer: usize, ns: u64) {
        if layer < self.layers {
            self.shared.counters.record_wait(layer, ns);
        }
    }

    /// A backend ran one forward of `tokens` tokens in `ns`.
    pub fn record_forward(&self, tokens: u64, ns: u64) {
        self.shared.counters.record_forward(tokens, ns);
    }

    /// The forwards recorded with [`ExpertPool::record_forward`] and where their time went (no
    /// lock: cheap enough to take around every step).
    pub fn forward_stats(&self) -> ForwardStats {
        self.shared.counters.forward_stats()
    }

    /// Zeroes the counters (what is resident stays).
    pub fn reset_stats(&self) {
        self.shared.counters.reset();
    }
}

impl<M: SlotMemory> Drop for ExpertPool<M> {
    fn drop(&mut self) {
        // No lease is alive (they borrow the pool); queued reads are abandoned, running ones finish.
        self.shared.lock().shutdown = true;
        self.shared.work.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Name and record precision of each MoE layer of `store`.
fn layer_info(store: &Store) -> Vec<LayerInfo> {
    store
        .manifest
        .experts
        .layers
        .iter()
        .map(|l| {
            let [g, u, d] = l.matrices().map(|m| m.precision.label());
            let precision = if g == u && u == d { g } else { format!("gate_proj {g}, up_proj {u}, down_proj {d}") };
            LayerInfo { name: l.layer.clone(), precision }
        })
        .collect()
}

fn io_loop<M: SlotMemory>(shared: &Shared<M>) {
    loop {
        let job = {
            let mut inner = shared.lock();
            loop {
                if inner.shutdown {
                    return;
                }
                if let Some(job) = inner.queue.pop_front() {
                    break job;
                }
                inner = shared.work.wait(inner).unwrap_or_else(|e| e.into_inner());
            }
        };
        run_job(shared, job);
    }
}

/// Loads one queued record into its slot and settles its ticket (an IO thread's work, or a step's
/// through [`ExpertPool::load_queued`]).
fn run_job<M: SlotMemory>(shared: &Shared<M>, job: Job) {
    let record_bytes = shared.store.record_bytes() as u64;
    let start = Instant::now();
    let (store, (layer, expert)) = (&shared.store, (job.layer, job.expert));
    let result = catch_unwind(AssertUnwindSafe(|| shared.memory.load(job.slot, &StoreRecord { store, layer, expert })))
        .unwrap_or_else(|panic| {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            Err(anyhow!("the slot loader panicked: {what}"))
        });
    let ns = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
    shared.counters.record_read(layer, expert, record_bytes, ns, result.is_ok());

    let mut guard = shared.lock();
    let inner = &mut *guard;
    let slot = &mut inner.slots[job.slot];
    debug_assert!(slot.state == State::Loading && slot.generation == job.generation, "a loading slot was reused");
    match result {
        Ok(()) => {
            slot.state = State::Ready;
            slot.ticket = None;
            if slot.pins == 0 {
                inner.evictable.insert(slot.rank, job.slot);
            }
            job.ticket.state.store(TICKET_READY, Ordering::Release);
        }
        Err(e) => {
            let name = &shared.store.manifest.experts.layers[layer].layer;
            let _ =
                job.ticket.error.set(format!("expert {expert} of MoE layer {layer} ({name}) failed to load: {e:#}"));
            job.ticket.state.store(TICKET_FAILED, Ordering::Release);
            // Forget the record and free the slot; leases still naming it see the generation
            // change and leave it alone. The next acquire of the record reads it again.
            inner.map.remove(&(layer, expert));
            *slot = Slot::free();
            inner.free.push(job.slot);
        }
    }
    drop(guard);
    shared.done.notify_all();
}

impl<'a, M: SlotMemory> Lease<'a, M> {
    /// The MoE layer of this lease.
    pub fn layer(&self) -> usize {
        self.layer
    }

    /// The experts in request order.
    pub fn entries(&self) -> &[LeaseEntry] {
        &self.entries
    }

    /// How many entries were being read already when acquired (a prefetch still loading, or
    /// another lease's miss).
    pub fn inflight(&self) -> usize {
        self.inflight
    }

    /// How many entries the acquire found missing and queued reads for.
    pub fn misses(&self) -> usize {
        self.misses
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether entry `i` is loaded (without blocking; a failed read counts as not ready).
    pub fn is_ready(&self, i: usize) -> bool {
        self.pins[i].ticket.as_ref().is_none_or(|t| t.state() == TICKET_READY)
    }

    /// Blocks until entry `i` is loaded; fails (naming the layer and expert) when its read failed.
    pub fn wait(&self, i: usize) -> Result<()> {
        let Some(ticket) = &self.pins[i].ticket else { return Ok(()) };
        let mut state = ticket.state();
        if state == TICKET_LOADING {
            let shared = &self.pool.shared;
            let start = Instant::now();
            let mut inner = shared.lock();
            // The ticket is completed under the lock before `done` is notified: no lost wakeup.
            while ticket.state() == TICKET_LOADING {
                inner = shared.done.wait(inner).unwrap_or_else(|e| e.into_inner());
            }
            drop(inner);
            shared.counters.record_wait(self.layer, u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX));
            state = ticket.state();
        }
        match state {
            TICKET_READY => Ok(()),
            _ => Err(anyhow!("{}", ticket.error.get().map_or("expert read failed", |s| s.as_str()))),
        }
    }

    /// Waits for every entry; returns the first failure (after all reads have settled).
    pub fn wait_all(&self) -> Result<()> {
        let mut first = None;
        let mut failed = 0;
        for i in 0..self.entries.len() {
            if let Err(e) = self.wait(i) {
                failed += 1;
                first.get_or_insert(e);
            }
        }
        match first {
            None => Ok(()),
            Some(e) if failed == 1 => Err(e),
            Some(e) => Err(e.context(format!("{failed} experts of MoE layer {} failed to load", self.layer))),
        }
    }
}

impl<'a> Lease<'a, HostSlots> {
    /// Waits for entry `i` and returns its record's bytes, valid while the lease lives.
    pub fn bytes(&self, i: usize) -> Result<&[u8]> {
        self.wait(i)?;
        // SAFETY: entry i is pinned by this lease and its load completed successfully, so the pool
        // will not load this slot again before the lease drops; the slice borrows the lease.
        Ok(unsafe { self.pool.shared.memory.slot(self.entries[i].slot) })
    }
}

impl<M: SlotMemory> Drop for Lease<'_, M> {
    fn drop(&mut self) {
        let mut guard = self.pool.shared.lock();
        let inner = &mut *guard;
        let mut released = false;
        for (entry, pin) in self.entries.iter().zip(&self.pins) {
            let slot = &mut inner.slots[entry.slot];
            if slot.generation != pin.generation || slot.state == State::Free {
                continue; // its read failed and the slot was freed (maybe reused)
            }
            slot.pins -= 1;
            if slot.pins == 0 && slot.state == State::Ready {
                inner.evictable.insert(slot.rank, entry.slot);
                released = true;
            }
        }
        let wake = released && inner.blocked > 0;
        drop(guard);
        if wake {
            self.pool.shared.done.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Evictable, OrdF64, Rank, Slot, SlotIndex, State};

    #[test]
    fn the_slot_index_keeps_each_layer_and_expert_apart() {
        let mut ix = SlotIndex::new(3, 5);
        assert_eq!(ix.get(&(1, 4)), None);
        ix.insert((1, 4), 7);
        ix.insert((2, 0), 0);
        assert_eq!(ix.get(&(1, 4)), Some(&7));
        assert_eq!(ix.get(&(2, 0)), Some(&0));
        // Expert 5 of layer 1 would be entry 10, layer 2's expert 0: never.
        assert_eq!(ix.get(&(1, 5)), None);
        assert!(!ix.contains_key(&(3, 0)));
        assert_eq!(ix.iter().collect::<Vec<_>>(), [((1, 4), 7), ((2, 0), 0)]);
        ix.remove(&(1, 4));
        assert!(!ix.contains_key(&(1, 4)));
        assert_eq!(ix.iter().count(), 1);
    }

    /// The stale-entry heap takes its victims in rank order among the slots still evictable under
    /// the rank they were entered with, and tidying drops only stale entries.
    #[test]
    fn the_eviction_heap_skips_stale_entries() {
        let rank = |p: f64, t: u64| -> Rank { (OrdF64(p), t) };
        let mut slots: Vec<Slot> = (0..6).map(|_| Slot::free()).collect();
        let mut ev = Evictable::default();
        // Slots 0..6 evictable at priorities 5, 3, 4, 1, 2, 0 (ticks 1..6).
        for (s, p) in [5.0, 3.0, 4.0, 1.0, 2.0, 0.0].into_iter().enumerate() {
            slots[s].state = State::Ready;
            slots[s].rank = rank(p, s as u64 + 1);
            ev.insert(slots[s].rank, s);
        }
        assert_eq!(ev.len(), 6);
        // Slot 5 (the lowest) is pinned and re-ranked by an acquire: its entry goes stale.
        ev.remove();
        slots[5].pins = 1;
        slots[5].rank = rank(9.0, 7);
        // Slot 3 is re-ranked without a pin (a replayed step's hit): stale entry, new entry.
        ev.remove();
        slots[3].rank = rank(8.0, 8);
        ev.insert(slots[3].rank, 3);
        assert_eq!(ev.len(), 5);
        assert_eq!(ev.heap.len(), 7);
        assert_eq!(ev.pop_first(&slots), Some(4)); // priority 2; slots 5 and 3's old entries skipped
        slots[4].state = State::Loading; // reloaded with another record
        assert_eq!(ev.len(), 4);
        // The lease drops: slot 5 evictable again under its new rank.
        slots[5].pins = 0;
        ev.insert(slots[5].rank, 5);
        // Tidying keeps every live entry (here below its threshold, so nothing is scanned).
        ev.tidy(&slots);
        let order: Vec<usize> = std::iter::from_fn(|| ev.pop_first(&slots)).collect();
        assert_eq!(order, [1, 2, 0, 3, 5]);
        assert_eq!(ev.len(), 0);
        assert!(ev.heap.is_empty());
    }

    /// Tidying, once stale entries outnumber live ones, leaves exactly the live ones.
    #[test]
    fn tidying_the_eviction_heap_keeps_the_live_entries() {
        let mut slots: Vec<Slot> = (0..40).map(|_| Slot::free()).collect();
        let mut ev = Evictable::default();
        let mut tick = 0;
        for (s, slot) in slots.iter_mut().enumerate() {
            tick += 1;
            slot.state = State::Ready;
            slot.rank = (OrdF64(s as f64), tick);
            ev.insert(slot.rank, s);
        }
        // 110 re-rankings of slots 0..40 in turn: 110 stale entries against 40 live, past the
        // threshold (2 x 40 + 64 entries).
        for i in 0..110 {
            let s = i % 40;
            tick += 1;
            ev.remove();
            slots[s].rank = (OrdF64(100.0 + i as f64), tick);
            ev.insert(slots[s].rank, s);
        }
        assert_eq!((ev.len(), ev.heap.len()), (40, 150));
        ev.tidy(&slots);
        assert_eq!((ev.len(), ev.heap.len()), (40, 40));
        // The victims: those re-ranked twice (slots 30..40, last at i 70..80) before those re-ranked
        // three times (0..30, at 80..110), each group in the order it was re-ranked.
        let order: Vec<usize> = std::iter::from_fn(|| ev.pop_first(&slots)).collect();
        let want: Vec<usize> = (30..40).chain(0..30).collect();
        assert_eq!(order, want);
    }
}
