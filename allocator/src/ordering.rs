//! Stream ordering: everything the pool knows about the order of work on
//! streams, and the one place that records, queries and waits on events.
//!
//! Every free on a stream gets the stream's current *epoch*. Recording an
//! event on the stream closes the epoch: once that event completes, every
//! free of that epoch and earlier is done on the device. A stream's vector
//! clock says, for each other stream, up to which epoch it has waited (through
//! the pool) — transitively, because waiting on an event merges the clock the
//! recording stream had. "Follow event dependencies" is then a comparison.
//!
//! Here live, and only here:
//! - vector clocks, epochs and the records of events the pool recorded;
//! - the event recycler;
//! - the stream table (one [`StreamEntry`] per stream met, dropped once
//!   the stream is retired and nothing needs it any more) and each
//!   stream's state, its private cache of frees included;
//! - the list of busy streams ([`StreamOrder::for_busy`]), so that the
//!   slow path's passes cost what the busy streams cost, not what every
//!   stream the pool ever met costs;
//! - the watch list ([`StreamOrder::poll_completions`]): the streams whose
//!   frees in the arena or recorded events are not yet seen complete,
//!   polled by every slow allocation (a consumer's free is then reusable by
//!   its producer as soon as it is done);
//! - what the pool may still do with a stream's driver handle ([`Reach`]);
//! - what is known complete ([`Completion`]), learnt by querying events
//!   ([`StreamOrder::observe_completions`]), by host synchronisation, or —
//!   for streams destroyed with frees pending — by a device-wide wait
//!   ([`StreamOrder::settle_orphans`]);
//! - the one way to close an epoch with an event
//!   ([`StreamOrder::record_closing`]): acquire an event, record it, close
//!   the epoch, or give the event back if the record fails.
//!
//! It knows nothing of placement or page mapping: the arena is touched only
//! to hand it cached frees and to upgrade guards that completed.

use crate::arena::{Arena, Guard};
use crate::error::PoolError;
use crate::inthash::BuildIntHasher;
use crate::sync::{
    lock, slot_ref, Arc, AtomicBool, AtomicU64, LeanMutex, Mutex, OnceSlots, Ordering, RwLock,
    SlotRef,
};
use std::collections::{HashMap, VecDeque};
use std::time::Instant;
use tidepool_sys::{Device, Event, Stream, StreamProbe, SysError, SysResult};

/// For each stream id, the highest epoch known to be ordered before.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct VectorClock {
    entries: Vec<(u64, u64)>,
}

impl Clone for VectorClock {
    /// Every slow allocation copies its stream's clock, most often empty
    /// (a stream that never waited through the pool): that copy is a few
    /// stores, not a vector's allocation path.
    #[inline]
    fn clone(&self) -> Self {
        if self.entries.is_empty() {
            return VectorClock::default();
        }
        VectorClock {
            entries: self.entries.clone(),
        }
    }
}

impl VectorClock {
    pub fn get(&self, stream: u64) -> u64 {
        self.entries
            .iter()
            .find(|(s, _)| *s == stream)
            .map_or(0, |(_, e)| *e)
    }

    pub fn raise(&mut self, stream: u64, epoch: u64) {
        match self.entries.iter_mut().find(|(s, _)| *s == stream) {
            Some((_, e)) => *e = (*e).max(epoch),
            None => self.entries.push((stream, epoch)),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// How many streams the clock names.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Every (stream, epoch) pair, in the order first raised.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.entries.iter().copied()
    }

    pub fn merge(&mut self, other: &VectorClock) {
        self.merge_where(other, |_| true);
    }

    /// [`merge`](Self::merge), but a stream this clock does not name yet
    /// joins it only if `keep` says so (asked once per such stream).
    pub fn merge_where(&mut self, other: &VectorClock, mut keep: impl FnMut(u64) -> bool) {
        for &(s, e) in &other.entries {
            match self.entries.iter_mut().find(|(t, _)| *t == s) {
                Some((_, x)) => *x = (*x).max(e),
                None if keep(s) => self.entries.push((s, e)),
                None => {}
            }
        }
    }

    /// Drop the entries of the streams `gone` says are gone.
    pub fn forget(&mut self, mut gone: impl FnMut(u64) -> bool) {
        self.entries.retain(|&(s, _)| !gone(s));
    }
}

/// Where an event goes when nobody needs it any more (recycled or destroyed
/// by the pool that owns the device).
pub(crate) trait EventSink: Send + Sync {
    fn release(&self, event: Event);
}

/// An event the pool recorded on a stream, closing `epoch` on it.
pub(crate) struct EventRecord {
    pub event: Event,
    pub stream: Stream,
    pub epoch: u64,
    /// The recording stream's clock at the record, including itself at `epoch`.
    pub clock: VectorClock,
    /// A std `Arc` under loom too: loom's cannot become a trait object,
    /// and the sink is the pool's event recycler, which outlives every
    /// record but the last (loom still sees the recycler's own lock).
    pub sink: std::sync::Arc<dyn EventSink>,
}

impl Drop for EventRecord {
    fn drop(&mut self) {
        self.sink.release(self.event);
    }
}

impl std::fmt::Debug for EventRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventRecord")
            .field("event", &self.event)
            .field("stream", &self.stream)
            .field("epoch", &self.epoch)
            .finish()
    }
}

/// A block freed on a stream and kept in that stream's private cache.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CachedBlock {
    pub offset: usize,
    pub epoch: u64,
}

/// Block lengths are multiples of this (the pool's alignment).
const CACHE_GRAIN: usize = 512;

/// Block lengths up to this many bytes have a slot of their own in a
/// [`SizeCache`] (one slot per multiple of 512 bytes: 128 slots).
const SMALL_CACHE_MAX: usize = 64 << 10;

/// A stream's private cache: same-stream frees by exact block length.
/// The length cached last has a slot of its own, `last`: a stream that
/// frees and reallocates blocks of one length, whatever it is, finds them
/// with one comparison. Other lengths up to 64 KiB are found by indexing
/// an array with `len / 512` (no hashing), longer ones in a map keyed by
/// length.
///
/// The array is one allocation aligned to and sized in whole 128-byte
/// pairs of cache lines, and each length's most recent block sits in it
/// (older ones in a list beside it): a stream whose thread frees and
/// reallocates blocks of several sizes writes only into its own lines,
/// even when another thread made the cache (the first free on each
/// stream, say) and the allocator placed the caches of several streams
/// side by side.
#[derive(Debug, Default)]
pub(crate) struct SizeCache {
    /// The length of the blocks in `last` (meaningless while it is
    /// empty). Blocks in `last` are newer than those of the same length
    /// elsewhere: once `last` holds a length, every block of that length
    /// cached goes there, and `last` takes another length only when empty.
    last_len: usize,
    last: Slot,
    small: Option<Box<SmallSlots>>,
    /// Bit `i` set: small slot `i` got a block since the last drain (it
    /// may have been taken since), so a drain visits only these slots.
    small_pushed: u128,
    /// Where the list of each length above [`SMALL_CACHE_MAX`] is in
    /// `large_lists`.
    large: HashMap<usize, usize, BuildIntHasher>,
    large_lists: Vec<LargeList>,
    /// The places in `large_lists` of the lists that got a block since
    /// the last drain (each once), so that a drain visits only these
    /// lists, not every length the stream ever cached, and finds them
    /// with no hashing.
    large_pushed: Vec<usize>,
}

/// The blocks of one length above [`SMALL_CACHE_MAX`] (oldest first), and
/// whether the length is in [`SizeCache::large_pushed`].
#[derive(Debug, Default)]
struct LargeList {
    len: usize,
    blocks: Vec<CachedBlock>,
    listed: bool,
}

/// Most lengths above [`SMALL_CACHE_MAX`] whose lists a flush of the cache
/// keeps (empty) for the next frees of those lengths; beyond that many the
/// lists go, so that a stream freeing ever new lengths does not keep a
/// list for each.
const LARGE_KEPT: usize = 64;

/// One slot per multiple of 512 bytes up to [`SMALL_CACHE_MAX`].
const SMALL_SLOTS: usize = SMALL_CACHE_MAX / CACHE_GRAIN;
const _: () = assert!(
    SMALL_SLOTS <= 128,
    "one bit of SizeCache::small_pushed per slot"
);

#[derive(Debug)]
#[repr(C, align(128))]
struct SmallSlots([Slot; SMALL_SLOTS]);

/// The blocks of one length: the most recent in place, older ones in
/// `older` (oldest first).
#[derive(Debug, Default)]
struct Slot {
    top: Option<CachedBlock>,
    older: Vec<CachedBlock>,
}

impl Slot {
    #[inline(always)]
    fn pop(&mut self) -> Option<CachedBlock> {
        self.top.take().or_else(|| self.older.pop())
    }

    #[inline(always)]
    fn push(&mut self, block: CachedBlock) {
        if let Some(prev) = self.top.replace(block) {
            self.older.push(prev);
        }
    }

    #[inline]
    fn is_empty(&self) -> bool {
        self.top.is_none() && self.older.is_empty()
    }

    /// The most recent block freed in epoch `epoch` or earlier.
    fn take_covered(&mut self, epoch: u64) -> Option<CachedBlock> {
        if self.top.is_some_and(|b| b.epoch <= epoch) {
            let b = self.top.take();
            self.top = self.older.pop();
            return b;
        }
        let at = self.older.iter().rposition(|b| b.epoch <= epoch)?;
        Some(self.older.remove(at))
    }

    /// Hand every block to `f`, oldest first (the list keeps its capacity).
    fn drain(&mut self, mut f: impl FnMut(CachedBlock)) {
        for b in self.older.drain(..) {
            f(b);
        }
        if let Some(b) = self.top.take() {
            f(b);
        }
    }
}

impl SizeCache {
    #[inline(always)]
    fn small_slot(len: usize) -> Option<usize> {
        // `len` is a multiple of the grain, at least one grain: the slot
        // is len / grain - 1, written so that the index is visibly in
        // bounds (no check on the hot path).
        (len <= SMALL_CACHE_MAX).then(|| (len.wrapping_sub(1) / CACHE_GRAIN) % SMALL_SLOTS)
    }

    /// The most recently cached block of exactly `len` bytes.
    #[inline(always)]
    pub fn pop(&mut self, len: usize) -> Option<CachedBlock> {
        if len == self.last_len {
            if let Some(b) = self.last.pop() {
                return Some(b);
            }
        }
        self.pop_other(len)
    }

    /// [`SizeCache::pop`] past the `last` slot.
    #[inline(never)]
    fn pop_other(&mut self, len: usize) -> Option<CachedBlock> {
        // Only a slot pushed to since the last drain, and only a listed
        // length, can hold a block: a miss on an emptied cache costs no
        // slot load and no hashing.
        match Self::small_slot(len) {
            Some(i) if self.small_pushed & (1 << i) != 0 => self.small.as_mut()?.0[i].pop(),
            None if !self.large_pushed.is_empty() => {
                let k = *self.large.get(&len)?;
                self.large_lists[k].blocks.pop()
            }
            _ => None,
        }
    }

    #[inline(always)]
    pub fn push(&mut self, len: usize, block: CachedBlock) {
        if len == self.last_len {
            self.last.push(block);
        } else if self.last.is_empty() {
            // `last` takes this length (a drain leaves it empty, so the
            // first free after one lands here).
            self.last_len = len;
            self.last.push(block);
        } else {
            self.push_other(len, block);
        }
    }

    /// A block of another length than `last`'s, `last` holding some: into
    /// the array or the map.
    #[inline(never)]
    fn push_other(&mut self, len: usize, block: CachedBlock) {
        match Self::small_slot(len) {
            Some(i) => {
                self.small_pushed |= 1 << i;
                match &mut self.small {
                    Some(small) => small.0[i].push(block),
                    None => self.first_small(i, block),
                }
            }
            None => {
                let lists = &mut self.large_lists;
                let k = *self.large.entry(len).or_insert_with(|| {
                    lists.push(LargeList {
                        len,
                        ..Default::default()
                    });
                    lists.len() - 1
                });
                let list = &mut self.large_lists[k];
                if !list.listed {
                    list.listed = true;
                    self.large_pushed.push(k);
                }
                list.blocks.push(block);
            }
        }
    }

    /// The first small block: the slots are made (out of line: a 6 KiB
    /// array the hot path should not carry in its frame).
    #[cold]
    #[inline(never)]
    fn first_small(&mut self, i: usize, block: CachedBlock) {
        let mut small = Box::new(SmallSlots(std::array::from_fn(|_| Slot::default())));
        small.0[i].push(block);
        self.small = Some(small);
    }

    /// The most recently cached block of exactly `len` bytes freed in
    /// epoch `epoch` or earlier.
    pub fn take_covered(&mut self, len: usize, epoch: u64) -> Option<CachedBlock> {
        if len == self.last_len {
            if let Some(b) = self.last.take_covered(epoch) {
                return Some(b);
            }
        }
        match Self::small_slot(len) {
            Some(i) => self.small.as_mut()?.0[i].take_covered(epoch),
            None => {
                let list = &mut self.large_lists[*self.large.get(&len)?].blocks;
                let at = list.iter().rposition(|b| b.epoch <= epoch)?;
                Some(list.remove(at))
            }
        }
    }

    /// Hand every block to `f` (length, block), emptying the cache (the
    /// lists keep their capacity), oldest first within a length.
    fn drain(&mut self, mut f: impl FnMut(usize, CachedBlock)) {
        if let Some(small) = self.small.as_mut() {
            let mut pushed = std::mem::take(&mut self.small_pushed);
            while pushed != 0 {
                let i = pushed.trailing_zeros() as usize;
                pushed &= pushed - 1;
                let slot = &mut small.0[i];
                let len = (i + 1) * CACHE_GRAIN;
                slot.drain(|b| f(len, b));
            }
        }
        // Only the lists pushed to since the last drain can hold blocks.
        for k in self.large_pushed.drain(..) {
            let list = &mut self.large_lists[k];
            list.listed = false;
            let len = list.len;
            for b in list.blocks.drain(..) {
                f(len, b);
            }
        }
        if self.large.len() > LARGE_KEPT {
            // All empty now: past this many lengths the lists go rather
            // than each keeping its capacity.
            self.large.clear();
            self.large_lists.clear();
        }
        let len = self.last_len;
        self.last.drain(|b| f(len, b));
    }
}

/// Per-stream state, behind the stream's own lock (never the arena's).
#[derive(Debug)]
pub(crate) struct StreamState {
    pub stream: Stream,
    pub retired: bool,
    /// Frees made now belong to this epoch.
    pub epoch: u64,
    /// Whether a free happened in the current epoch (an event must be
    /// recorded to learn when it completes).
    pub frees_in_epoch: bool,
    /// What this stream has waited on through the pool.
    pub clock: VectorClock,
    /// Events recorded on this stream, not yet observed complete, oldest first.
    pub recorded: VecDeque<Arc<EventRecord>>,
    /// Same-stream frees kept for reuse by this stream, by block length.
    pub cache: SizeCache,
    pub cached_bytes: usize,
    /// In the pool's list of busy streams ([`StreamOrder::note_busy`]):
    /// set and cleared under this stream's lock only.
    pub listed: bool,
    /// In the pool's watch list ([`StreamOrder::watch`]): set and cleared
    /// under this stream's lock only.
    pub watched: bool,
    /// In the ledger's list of streams holding headroom (see
    /// `stats::Ledger`): set under this stream's lock when a free gives it
    /// headroom, cleared by whoever collects that headroom.
    pub donor: bool,
    /// This stream's share of the pool's counters.
    pub counters: crate::stats::StreamCounters,
    /// The last epoch closed with no event because the driver stream was
    /// already destroyed: its frees complete only by a device-wide wait.
    pub orphaned: Option<u64>,
    /// Slow allocations in flight on this stream ([`AllocInFlight`]): the
    /// entry is not forgotten while any is, so that their counts land on
    /// counters the ledger still folds.
    pub allocating: u32,
}

/// A stream's entry as [`StreamOrder::entry_ref`] gives it: borrowed from
/// the stream's slot (set once for the pool's life), or owned.
pub(crate) enum EntryRef<'a> {
    Slot(SlotRef<'a, Arc<StreamEntry>>),
    Owned(Arc<StreamEntry>),
}

impl std::ops::Deref for EntryRef<'_> {
    type Target = Arc<StreamEntry>;

    #[inline(always)]
    fn deref(&self) -> &Arc<StreamEntry> {
        match self {
            EntryRef::Slot(e) => std::ops::Deref::deref(e),
            EntryRef::Owned(e) => e,
        }
    }
}

/// A slow allocation in flight on a stream, from the moment it found the
/// stream's entry until it has counted itself there (or failed): while it
/// lives the entry is not forgotten, even if the stream is retired
/// meanwhile. Made only for a stream not retired yet.
pub(crate) struct AllocInFlight<'a> {
    entry: &'a StreamEntry,
}

impl<'a> AllocInFlight<'a> {
    /// Mark an allocation in flight on `entry`, or refuse a retired stream.
    /// Also returns what the stream has waited on through the pool (read
    /// under the same lock).
    pub fn mark(entry: &'a StreamEntry, stream: Stream) -> Result<(Self, VectorClock), PoolError> {
        let mut st = lock(&entry.state);
        if st.retired {
            return Err(PoolError::StreamRetired { stream });
        }
        st.allocating += 1;
        Ok((AllocInFlight { entry }, st.clock.clone()))
    }

    /// [`mark`](Self::mark) under the stream's lock, already held, and
    /// found not retired; the caller turns it into an `AllocInFlight`
    /// with [`adopt`](Self::adopt).
    #[inline(always)]
    pub fn mark_held(st: &mut StreamState) -> VectorClock {
        debug_assert!(!st.retired, "a retired stream is refused");
        st.allocating += 1;
        st.clock.clone()
    }

    /// The allocation marked by [`mark_held`](Self::mark_held) on `entry`.
    pub fn adopt(entry: &'a StreamEntry) -> Self {
        AllocInFlight { entry }
    }

    /// The allocation is done: `count` runs on the stream's state under
    /// the same lock that ends the mark.
    pub fn finish<R>(self, count: impl FnOnce(&mut StreamState) -> R) -> R {
        let r = {
            let mut st = lock(&self.entry.state);
            st.allocating -= 1;
            count(&mut st)
        };
        std::mem::forget(self);
        r
    }
}

impl Drop for AllocInFlight<'_> {
    fn drop(&mut self) {
        lock(&self.entry.state).allocating -= 1;
    }
}

impl StreamState {
    pub fn new(stream: Stream) -> Self {
        StreamState {
            stream,
            retired: false,
            epoch: 1,
            frees_in_epoch: false,
            clock: VectorClock::default(),
            recorded: VecDeque::new(),
            cache: SizeCache::default(),
            cached_bytes: 0,
            listed: false,
            watched: false,
            donor: false,
            counters: Default::default(),
            orphaned: None,
            allocating: 0,
        }
    }

    /// Close the current epoch with a freshly recorded event.
    pub fn close_epoch(
        &mut self,
        event: Event,
        sink: std::sync::Arc<dyn EventSink>,
    ) -> Arc<EventRecord> {
        let epoch = self.epoch;
        let mut clock = self.clock.clone();
        clock.raise(self.stream.id(), epoch);
        let record = Arc::new(EventRecord {
            event,
            stream: self.stream,
            epoch,
            clock,
            sink,
        });
        self.recorded.push_back(record.clone());
        self.epoch += 1;
        self.frees_in_epoch = false;
        record
    }

    /// Close the current epoch because the host is about to synchronise
    /// the stream: every free of the returned epoch and earlier will be done
    /// when the synchronisation returns.
    pub fn close_epoch_synced(&mut self) -> u64 {
        let epoch = self.epoch;
        self.epoch += 1;
        self.frees_in_epoch = false;
        epoch
    }

    /// Close the current epoch of a stream whose driver stream is gone (no
    /// event can be recorded on it any more): the epoch's frees wait for a
    /// device-wide synchronisation.
    pub fn close_epoch_orphaned(&mut self) {
        if self.frees_in_epoch {
            let epoch = self.close_epoch_synced();
            self.orphaned = Some(epoch);
        }
    }

    /// The first recorded, not-yet-complete event that covers `epoch`.
    pub fn event_covering(&self, epoch: u64) -> Option<Arc<EventRecord>> {
        self.recorded.iter().find(|r| r.epoch >= epoch).cloned()
    }

    /// Whether the slow path's passes over streams must visit this stream:
    /// it has cached frees (to flush), frees not yet covered by an event (to
    /// record one), or recorded events not yet seen complete (to query).
    pub fn busy(&self) -> bool {
        self.frees_in_epoch || self.cached_bytes > 0 || !self.recorded.is_empty()
    }

    /// Take every cached block out (for the arena).
    pub fn drain_cache(&mut self) -> Vec<(usize, CachedBlock)> {
        let mut out = Vec::new();
        self.drain_cache_with(|len, b| out.push((len, b)));
        out
    }

    /// Take every cached block out, handing each to `f` (length, block) in
    /// the order [`StreamState::drain_cache`] returns them, with no list
    /// built in between. Returns how many there were.
    pub fn drain_cache_with(&mut self, mut f: impl FnMut(usize, CachedBlock)) -> usize {
        let mut n = 0;
        if self.cached_bytes == 0 {
            return 0;
        }
        self.cache.drain(|len, b| {
            n += 1;
            f(len, b)
        });
        self.cached_bytes = 0;
        n
    }
}

/// Recycles the pool's device events (an event create+destroy costs about
/// as much as a record).
pub(crate) struct EventRecycler<D: Device> {
    device: Arc<D>,
    free: Mutex<Vec<Event>>,
}

impl<D: Device> EventRecycler<D> {
    fn new(device: Arc<D>) -> Self {
        EventRecycler {
            device,
            free: Mutex::new(Vec::new()),
        }
    }

    fn acquire(&self) -> SysResult<Event> {
        if let Some(e) = lock(&self.free).pop() {
            return Ok(e);
        }
        self.device.create_event()
    }
}

impl<D: Device> EventSink for EventRecycler<D> {
    fn release(&self, event: Event) {
        let mut free = lock(&self.free);
        if free.len() < 256 {
            free.push(event);
            return;
        }
        drop(free);
        if let Err(e) = self.device.destroy_event(event) {
            tracing::warn!(error = %e, "destroying a pool event failed");
        }
    }
}

impl<D: Device> Drop for EventRecycler<D> {
    fn drop(&mut self) {
        for e in lock(&self.free).drain(..) {
            if let Err(err) = self.device.destroy_event(e) {
                tracing::warn!(error = %err, "destroying a pool event failed");
            }
        }
    }
}

/// One stream's state in the table, behind its own lock, and the device's
/// handle on the stream for the questions of every allocation and free.
///
/// Aligned to two cache lines (the adjacent-line prefetcher pairs lines):
/// threads that each work on their own stream then write no line another
/// thread writes, however the entries land on the heap.
#[repr(align(128))]
pub(crate) struct StreamEntry {
    /// The stream's id (as in `state`, readable without the lock).
    pub id: u64,
    /// Set when the table forgets the (retired) stream: a lookup by
    /// stream then refuses it as the table does, though the entry stays in
    /// its slot of [`StreamOrder::direct`].
    pub forgotten: AtomicBool,
    pub state: LeanMutex<StreamState>,
    /// The device's [`StreamProbe`] for the stream, taken when the entry
    /// is made (`None` when the device has none, or the stream was already
    /// destroyed: the device is then asked by stream id).
    probe: Option<std::sync::Arc<dyn StreamProbe>>,
}

impl StreamEntry {
    pub fn new(stream: Stream, probe: Option<std::sync::Arc<dyn StreamProbe>>) -> Self {
        StreamEntry {
            id: stream.id(),
            forgotten: AtomicBool::new(false),
            state: LeanMutex::new(StreamState::new(stream)),
            probe,
        }
    }

    /// [`StreamEntry::runs`] as a plain answer, for the fast paths: `true`
    /// when the stream runs its work; `false` when it is captured,
    /// destroyed, or the question failed (the slow path asks again and
    /// says which).
    #[inline(always)]
    pub fn runs_now<D: Device>(&self, device: &D, stream: Stream, check_capture: bool) -> bool {
        match &self.probe {
            Some(p) => p.runs(check_capture),
            None => matches!(self.runs(device, stream, check_capture), Ok(true)),
        }
    }

    /// Whether `stream` (this entry's) runs its work now: `Ok(false)` when
    /// it is being captured; an error when it is destroyed. Asks the
    /// device about capture only when `check_capture`; otherwise only
    /// whether the stream is still live. Through the probe (no lookup, no
    /// reference counting) when the device gave one.
    #[inline]
    pub fn runs<D: Device>(
        &self,
        device: &D,
        stream: Stream,
        check_capture: bool,
    ) -> Result<bool, SysError> {
        match (&self.probe, check_capture) {
            (Some(p), true) => p.is_capturing().map(|c| !c),
            (Some(p), false) => p.check().map(|()| true),
            (None, true) => device.is_capturing(stream).map(|c| !c),
            (None, false) => device.check_stream(stream).map(|()| true),
        }
    }
}

/// The stream entries this thread used last, keyed by pool id and stream
/// id (both never reused, so a hit is always the right entry: a retired
/// stream's entry stays retired after the table drops it), for the
/// streams without a slot in [`StreamOrder::direct`]: spares them the
/// stream table's shared lock and hashing. A fixed table of slots, each
/// (pool, stream) pair in the one slot its ids pick: a lookup is one
/// comparison and a miss replaces that slot, whatever the number of
/// streams a thread cycles through (consecutive stream ids of one pool
/// never share a slot). An entry of a dropped pool lingers here until
/// replaced; it holds no device resources by then (the pool's drop
/// drained its events).
mod recent_entries {
    use super::StreamEntry;
    use crate::sync::Arc;
    use std::cell::RefCell;

    const SLOTS: usize = 16;

    type Slot = Option<(u64, u64, Arc<StreamEntry>)>;

    crate::sync::thread_local! {
        static RECENT: RefCell<[Slot; SLOTS]> = RefCell::new(Default::default());
    }

    #[inline]
    fn slot(pool: u64, stream: u64) -> usize {
        (stream ^ pool.wrapping_mul(7)) as usize % SLOTS
    }

    /// The entry, if this thread has it.
    pub(super) fn get(pool: u64, stream: u64) -> Option<Arc<StreamEntry>> {
        RECENT
            .try_with(|r| {
                let r = r.try_borrow().ok()?;
                match &r[slot(pool, stream)] {
                    Some((p, s, e)) if *p == pool && *s == stream => Some(e.clone()),
                    _ => None,
                }
            })
            .ok()
            .flatten()
    }

    pub(super) fn put(pool: u64, stream: u64, entry: &Arc<StreamEntry>) {
        let _ = RECENT.try_with(|r| {
            if let Ok(mut r) = r.try_borrow_mut() {
                r[slot(pool, stream)] = Some((pool, stream, entry.clone()));
            }
        });
    }
}

/// What the pool may still do with a stream's driver handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reach {
    /// Record events on it, synchronise it.
    Live,
    /// Destroyed (without `retire_stream` first): work it had queued still
    /// runs, but only a device-wide synchronisation can wait for it.
    Gone,
    /// Being captured into a graph, or its state cannot be learned: touching
    /// it could break a capture, so the pool leaves it alone.
    Untouchable,
}

/// Why closing an epoch with an event failed (the event, if one was
/// taken, is back in the recycler either way).
#[derive(Debug)]
pub(crate) enum RecordFailure {
    /// No event could be had (creating one failed).
    Acquire(SysError),
    /// The driver refused to record the event on the stream.
    Record(SysError),
}

impl From<RecordFailure> for PoolError {
    fn from(f: RecordFailure) -> Self {
        match f {
            RecordFailure::Acquire(e) | RecordFailure::Record(e) => e.into(),
        }
    }
}

/// What is known complete, per stream id, under the arena's lock (guards
/// are judged against it while placing a block).
#[derive(Debug, Default)]
pub(crate) struct Completion {
    /// Highest epoch whose frees were observed complete by an event query.
    completed: HashMap<u64, u64, BuildIntHasher>,
    /// Highest epoch the host synchronised with (everything issued
    /// afterwards, on any stream, is ordered after it).
    synced: HashMap<u64, u64, BuildIntHasher>,
}

impl Completion {
    /// How many streams each map names (observed, synchronised).
    pub fn sizes(&self) -> (usize, usize) {
        (self.completed.len(), self.synced.len())
    }

    /// Drop what is known of `stream` (forgotten, and no guard names it
    /// any more: nothing will ask).
    fn forget(&mut self, stream: u64) {
        self.completed.remove(&stream);
        self.synced.remove(&stream);
    }

    /// Highest epoch of `stream` observed complete by an event query.
    pub fn observed(&self, stream: u64) -> u64 {
        self.completed.get(&stream).copied().unwrap_or(0)
    }

    /// Highest epoch of `stream` the host synchronised with.
    pub fn synced(&self, stream: u64) -> u64 {
        self.synced.get(&stream).copied().unwrap_or(0)
    }

    /// The host synchronised with `stream` up to `epoch`.
    pub fn mark_synced(&mut self, stream: u64, epoch: u64) {
        let e = self.synced.entry(stream).or_insert(0);
        *e = (*e).max(epoch);
    }

    /// An event query saw `stream`'s work up to `epoch` complete.
    fn mark_observed(&mut self, stream: u64, epoch: u64) {
        let e = self.completed.entry(stream).or_insert(0);
        *e = (*e).max(epoch);
    }

    /// The highest epoch of `stream` whose frees may be settled to
    /// `Complete`, reusable by every stream: the host synchronised with
    /// it, or (under opportunistic reuse) an event query saw it complete.
    /// What [`StreamOrder::observe_completions`] settles.
    pub fn settled(&self, stream: u64, opportunistic: bool) -> u64 {
        let synced = self.synced(stream);
        if opportunistic {
            synced.max(self.observed(stream))
        } else {
            synced
        }
    }

    /// Whether the device work before a free is known to be done (the only
    /// condition under which its memory may be unmapped or released).
    pub fn is_complete(&self, guard: Guard) -> bool {
        match guard {
            Guard::Complete => true,
            Guard::After { stream, epoch } => {
                self.observed(stream) >= epoch || self.synced(stream) >= epoch
            }
        }
    }
}

/// Events recorded on the allocating stream that its own slow allocations
/// let pile up before they query them (see
/// [`StreamOrder::poll_completions`]): a stream that records an event per
/// allocation, as a producer does, pays one query per this many.
const OWN_BACKLOG: usize = 8;

/// [`StreamOrder::watch_hint`] of an empty watch list.
const WATCH_NONE: u64 = 0;
/// [`StreamOrder::watch_hint`] of a list of several streams (or of one
/// whose id plus one does not fit).
const WATCH_MANY: u64 = u64::MAX;

/// What [`StreamOrder::watch_hint`] says of `list`.
fn watch_hint_of(list: &[u64]) -> u64 {
    match list {
        [] => WATCH_NONE,
        [id] if *id < WATCH_MANY - 1 => id + 1,
        _ => WATCH_MANY,
    }
}

/// The stream table and the device calls of stream ordering.
pub(crate) struct StreamOrder<D: Device> {
    pool: u64,
    device: Arc<D>,
    events: std::sync::Arc<EventRecycler<D>>,
    streams: RwLock<StreamTable>,
    /// Entries found with no lock, no hash and no write: slot `id % LEN`
    /// holds the first entry made for a stream id of that residue, for the
    /// pool's life (stream ids count up, so the first 256 streams of a
    /// device each get a slot). A retired entry stays in its slot after
    /// the table forgets it, still marked retired, so the stream is still
    /// refused; it holds nothing by then (no cached frees, no events).
    /// The other streams are found through this thread's recent entries,
    /// then the table.
    direct: OnceSlots<Arc<StreamEntry>>,
    /// Ids of the streams that may be [`StreamState::busy`] (each at most
    /// once: a stream's `listed` flag says whether it is here).
    busy: Mutex<Vec<u64>>,
    /// Ids of the streams whose completion can move and matters to other
    /// streams: frees of a stream that never allocated, gone to the arena
    /// and not yet known complete, or recorded events not yet seen
    /// complete (each at most once: the stream's `watched` flag says
    /// whether it is here). Every slow allocation polls them
    /// ([`StreamOrder::poll_completions`]).
    watch: Mutex<Vec<u64>>,
    /// The watch list in one word, written under its lock whenever the
    /// list changes ([`StreamOrder::with_watch`]) and read with no lock:
    /// [`WATCH_NONE`] when it is empty, the id plus one when it holds that
    /// stream alone, else [`WATCH_MANY`]. A slow allocation whose stream
    /// is the only one watched (a stream that records events for itself)
    /// or that finds nobody watched takes neither of the list's locks.
    watch_hint: AtomicU64,
    /// Retired streams still in the table, and the ids of those forgotten.
    retired: Mutex<Retired>,
    /// Whether `retired` lists a stream still in the table (one load on
    /// the paths that offer to forget them).
    retired_waiting: AtomicBool,
}

/// Retired streams still in the table because something may still need
/// their entry (cached frees or events not yet seen complete, an epoch
/// closed without an event).
#[derive(Default)]
struct Retired {
    waiting: Vec<u64>,
}

/// The stream table: an entry per stream met and not forgotten, and the
/// ids of the retired streams dropped from it, under one lock (a stream
/// leaves the map and joins `forgotten` at once, so a lookup never misses
/// both). Reads as the map.
///
/// Ids are never reused, so a forgotten id only ever means "retired": a
/// caller still using a stream it retired. It is refused rather than met
/// anew, and that refusal is what makes forgetting safe: a stream met anew
/// would start again at epoch 1, while events recorded before it was
/// forgotten (a user may still hold them and wait on them) carry clocks
/// that name its old epochs, which would then claim its new frees done.
/// So the id stays: the one thing the pool keeps of a forgotten stream
/// for its whole life. Kept as runs of consecutive ids ([`IdRuns`]):
/// streams are made with ids counting up, so a process that creates and
/// retires streams one after another leaves one run, not an id per stream
/// (ids of streams this pool never met split the runs).
#[derive(Default)]
pub(crate) struct StreamTable {
    map: HashMap<u64, Arc<StreamEntry>>,
    forgotten: IdRuns,
    /// Forgotten streams whose completion and clock entries are still
    /// kept: until free ranges or held mappings guarded by their epochs
    /// are gone (see [`StreamOrder::purge_forgotten`]).
    unpurged: Vec<u64>,
    /// Forgotten streams destroyed since, with a free that declared them
    /// as users: the epoch guarding those frees ([`ORPHAN_EPOCH`]), complete only once a
    /// device-wide wait saw the work queued on them end
    /// ([`StreamOrder::orphan_forgotten`], [`StreamOrder::settle_orphans`]).
    forgotten_orphans: Vec<(u64, u64)>,
}

/// The epoch guarding frees whose declared user was forgotten by the
/// pool and destroyed since ([`StreamOrder::orphan_forgotten`]): above any
/// epoch a stream reaches, so that no clock of an event recorded on it
/// before it was forgotten (a caller may still wait on one) covers it.
/// The pool may have dropped what it knew of the stream's epochs, so
/// "one past its last" cannot be worked out.
const ORPHAN_EPOCH: u64 = u64::MAX / 2;

/// A set of ids as runs of consecutive ids: first id of a run to its last.
#[derive(Default, Debug)]
pub(crate) struct IdRuns {
    runs: std::collections::BTreeMap<u64, u64>,
}

impl IdRuns {
    /// The run holding `id`, if any (first, last).
    fn run_of(&self, id: u64) -> Option<(u64, u64)> {
        self.runs
            .range(..=id)
            .next_back()
            .filter(|(_, &last)| last >= id)
            .map(|(&first, &last)| (first, last))
    }

    pub fn contains(&self, id: u64) -> bool {
        self.run_of(id).is_some()
    }

    pub fn insert(&mut self, id: u64) {
        if self.contains(id) {
            return;
        }
        // The run ending just below `id` grows; the one starting just
        // above it joins.
        let below = id
            .checked_sub(1)
            .and_then(|b| self.run_of(b))
            .map(|(first, _)| first);
        let above = id
            .checked_add(1)
            .and_then(|a| self.runs.remove(&a).map(|last| (a, last)))
            .map_or(id, |(_, last)| last);
        self.runs.insert(below.unwrap_or(id), above);
    }

    /// How many runs.
    pub fn runs(&self) -> usize {
        self.runs.len()
    }
}

impl std::ops::Deref for StreamTable {
    type Target = HashMap<u64, Arc<StreamEntry>>;
    fn deref(&self) -> &Self::Target {
        &self.map
    }
}

impl<D: Device> StreamOrder<D> {
    /// Pop the stream's recorded events that the device reports complete,
    /// oldest first, marking their epochs observed; stops at the first
    /// still running (or failing to answer: asked again next time).
    fn observe_recorded(&self, id: u64, s: &mut StreamState, done: &mut Completion) {
        while let Some(front) = s.recorded.front() {
            match self.device.query_event(front.event) {
                Ok(true) => {
                    let epoch = front.epoch;
                    s.recorded.pop_front();
                    done.mark_observed(id, epoch);
                }
                _ => break,
            }
        }
    }

    pub fn new(pool: u64, device: Arc<D>) -> Self {
        StreamOrder {
            pool,
            events: std::sync::Arc::new(EventRecycler::new(device.clone())),
            device,
            streams: RwLock::new(StreamTable::default()),
            direct: OnceSlots::new(),
            busy: Mutex::new(Vec::new()),
            watch: Mutex::new(Vec::new()),
            watch_hint: AtomicU64::new(WATCH_NONE),
            retired: Mutex::new(Retired::default()),
            retired_waiting: AtomicBool::new(false),
        }
    }

    /// The one way the pool closes an epoch with an event: acquire an
    /// event, record it on the stream, close the epoch with it; when the
    /// record fails the event goes back to the recycler and the epoch stays
    /// open. The caller holds the stream's lock, so no free can slip in
    /// between the record and the close.
    pub fn record_closing(&self, st: &mut StreamState) -> Result<Arc<EventRecord>, RecordFailure> {
        let event = self.events.acquire().map_err(RecordFailure::Acquire)?;
        if let Err(e) = self.device.record_event(event, st.stream) {
            self.events.release(event);
            return Err(RecordFailure::Record(e));
        }
        let record = st.close_epoch(event, self.events.clone());
        // A recorded event is watched until it is seen complete.
        self.note_busy(st);
        self.note_watch(st);
        Ok(record)
    }

    /// Run `f` on `stream`'s entry when it is at hand with no table
    /// lookup (see [`StreamOrder::direct_entry`] and
    /// [`StreamOrder::recent_entry`]); `None` otherwise.
    #[inline]
    pub fn with_recent_entry<R>(
        &self,
        stream: Stream,
        f: impl FnOnce(&Arc<StreamEntry>) -> R,
    ) -> Option<R> {
        let direct = self.direct_entry(stream);
        let recent;
        let e = match slot_ref(&direct) {
            Some(e) => e,
            None => {
                recent = self.recent_entry(stream)?;
                &recent
            }
        };
        Some(f(e))
    }

    /// `stream`'s entry in its slot of [`StreamOrder::direct`], if it has
    /// one: no lock, no write, no hash (read it with
    /// [`crate::sync::slot_ref`]).
    #[inline(always)]
    pub fn direct_entry(&self, stream: Stream) -> Option<SlotRef<'_, Arc<StreamEntry>>> {
        let id = stream.id();
        self.direct.get(id).filter(|e| e.id == id)
    }

    /// `stream`'s entry among this thread's recent entries (for the
    /// streams without a slot of their own: a reference count taken and
    /// dropped, no table lookup).
    #[inline(never)]
    pub fn recent_entry(&self, stream: Stream) -> Option<Arc<StreamEntry>> {
        recent_entries::get(self.pool, stream.id())
    }

    /// [`entry`](Self::entry), borrowed from the stream's slot where it
    /// has one: no reference count taken and dropped (two atomic
    /// read-modify-writes on every slow allocation).
    #[inline]
    pub fn entry_ref(&self, stream: Stream) -> Result<EntryRef<'_>, PoolError> {
        let id = stream.id();
        if let Some(e) = self.direct.get(id) {
            if e.id == id && !e.forgotten.load(Ordering::Acquire) {
                return Ok(EntryRef::Slot(e));
            }
        }
        self.entry(stream).map(EntryRef::Owned)
    }

    /// The pool's state for `stream`, created on first use. Ids are never
    /// reused by the backend, so a stream's state is never confused with
    /// that of a destroyed stream whose driver handle was recycled. A
    /// stream of another device instance gets no state: it is refused
    /// ([`SysError::ForeignHandle`]) the first time the pool meets it, so
    /// no later pass over the pool's streams has to deal with it.
    pub fn entry(&self, stream: Stream) -> Result<Arc<StreamEntry>, PoolError> {
        let id = stream.id();
        if let Some(e) = slot_ref(&self.direct.get(id)) {
            if e.id == id && !e.forgotten.load(Ordering::Acquire) {
                return Ok(e.clone());
            }
        }
        if let Some(e) = recent_entries::get(self.pool, stream.id()) {
            // A thread keeps the entry of a stream forgotten since: the
            // table refuses that stream, and so must this.
            if !e.forgotten.load(Ordering::Acquire) {
                return Ok(e);
            }
        }
        let e = self.entry_from_table(stream)?;
        recent_entries::put(self.pool, stream.id(), &e);
        Ok(e)
    }

    fn entry_from_table(&self, stream: Stream) -> Result<Arc<StreamEntry>, PoolError> {
        if let Some(e) = self
            .streams
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&stream.id())
        {
            return Ok(e.clone());
        }
        // Once per stream and pool (not on the hot path). A destroyed
        // stream still gets its state (the rules for streams destroyed
        // without retirement need it), with no probe; another device's
        // stream does not.
        let probe = match self.device.stream_probe(stream) {
            Ok(p) => p,
            Err(e @ SysError::ForeignHandle { .. }) => return Err(e.into()),
            Err(_) => None,
        };
        let mut table = self.streams.write().unwrap_or_else(|p| p.into_inner());
        // A forgotten stream was retired: refused, not met anew.
        if table.forgotten.contains(stream.id()) {
            return Err(PoolError::StreamRetired { stream });
        }
        let e = table
            .map
            .entry(stream.id())
            .or_insert_with(|| Arc::new(StreamEntry::new(stream, probe)))
            .clone();
        drop(table);
        self.direct.set(stream.id(), e.clone());
        Ok(e)
    }

    /// Whether `stream` was retired from the pool: its entry marked so, or
    /// already forgotten. Creates no state for a stream the pool has not
    /// met (a request of no memory names a stream but needs none).
    pub fn is_retired(&self, stream: Stream) -> bool {
        let entry = {
            let table = self.streams.read().unwrap_or_else(|p| p.into_inner());
            if table.forgotten.contains(stream.id()) {
                return true;
            }
            table.get(&stream.id()).cloned()
        };
        entry.is_some_and(|e| lock(&e.state).retired)
    }

    /// Every stream's entry (a snapshot of the table), in id order. For
    /// the rare passes that must see every stream (synchronising all of
    /// them, statistics, the pool's drop); the allocation paths visit only
    /// the busy streams ([`StreamOrder::for_busy`]).
    pub fn all_streams(&self) -> Vec<(u64, Arc<StreamEntry>)> {
        let mut all: Vec<_> = self
            .streams
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(k, v)| (*k, v.clone()))
            .collect();
        // The same order every time (a HashMap's changes with its random
        // seed): loom replays executions and needs the same lock order.
        all.sort_unstable_by_key(|(k, _)| *k);
        all
    }

    /// The entry of the stream with id `id`, if the pool has met it (one
    /// table lookup, nothing cloned but the entry's reference).
    pub fn entry_by_id(&self, id: u64) -> Option<Arc<StreamEntry>> {
        self.streams
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)
            .cloned()
    }

    /// `stream` was just retired (its entry marked so): list it, to be
    /// dropped from the table once nothing needs its entry.
    pub fn note_retired(&self, stream: Stream) {
        lock(&self.retired).waiting.push(stream.id());
        self.retired_waiting.store(true, Ordering::Release);
    }

    /// Whether retired streams wait to be forgotten (one load).
    #[inline]
    pub fn retired_waiting(&self) -> bool {
        self.retired_waiting.load(Ordering::Acquire)
    }

    /// Drop from the table the retired streams whose entries nothing
    /// needs any more: no cached frees, no frees without an event, no
    /// event not yet seen complete, no epoch waiting for a device-wide
    /// wait. `fold` gets each one's state, under its lock, just before it
    /// goes (the caller keeps its counters). Lock order: the caller's
    /// (the ledger), this list, then each stream, then the table (a leaf:
    /// nothing is locked under it). Threads
    /// that still hold the entry in their recent entries see it retired;
    /// the others are refused by its id.
    pub fn forget_retired(&self, mut fold: impl FnMut(&mut StreamState)) -> usize {
        let mut retired = lock(&self.retired);
        let mut forgotten = 0;
        let mut i = 0;
        while i < retired.waiting.len() {
            let id = retired.waiting[i];
            let Some(entry) = self.entry_by_id(id) else {
                retired.waiting.swap_remove(i);
                continue;
            };
            let mut st = lock(&entry.state);
            if !st.retired || st.busy() || st.orphaned.is_some() || st.allocating > 0 {
                i += 1;
                continue;
            }
            fold(&mut st);
            let mut table = self.streams.write().unwrap_or_else(|p| p.into_inner());
            table.map.remove(&id);
            table.forgotten.insert(id);
            table.unpurged.push(id);
            entry.forgotten.store(true, Ordering::Release);
            drop(table);
            // Off the lists now rather than at their next pass: in a pool
            // whose slow path seldom runs (or that never polls the watch
            // list: no opportunistic reuse) they would keep every
            // forgotten id.
            if st.watched {
                st.watched = false;
                self.with_watch(|list| list.retain(|&s| s != id));
            }
            if st.listed {
                st.listed = false;
                lock(&self.busy).retain(|&s| s != id);
            }
            drop(st);
            retired.waiting.swap_remove(i);
            forgotten += 1;
        }
        self.retired_waiting
            .store(!retired.waiting.is_empty(), Ordering::Release);
        forgotten
    }

    /// The epoch that guards a free whose declared user `id`, a stream
    /// the pool has forgotten, was destroyed since: its queued work still
    /// runs, and only a device-wide wait sees it end, as for the frees of
    /// a stream destroyed without retirement. The epoch is
    /// [`ORPHAN_EPOCH`] for every such free until
    /// [`StreamOrder::settle_orphans`] settles it; the stream is kept
    /// among the forgotten streams the pool still knows of until then.
    /// Caller holds the arena's lock.
    pub fn orphan_forgotten(&self, id: u64) -> u64 {
        let mut t = self.streams.write().unwrap_or_else(|p| p.into_inner());
        let epoch = ORPHAN_EPOCH;
        if !t.forgotten_orphans.contains(&(id, epoch)) {
            t.forgotten_orphans.push((id, epoch));
        }
        if !t.unpurged.contains(&id) {
            t.unpurged.push(id);
        }
        epoch
    }

    /// Make `stream` wait for the work queued so far on `other`, a stream
    /// the pool keeps no state of (forgotten: retired, all its frees
    /// complete) but whose driver stream still runs: an event of the
    /// pool's recycler recorded on it directly, no epoch closed.
    pub fn wait_for_stateless(&self, stream: Stream, other: Stream) -> Result<(), PoolError> {
        let event = self.events.acquire()?;
        let waited = self
            .device
            .record_event(event, other)
            .and_then(|()| self.device.wait_event(stream, event));
        // The wait holds what it needs of the event: it may be reused.
        self.events.release(event);
        Ok(waited?)
    }

    /// Whether `stream` was retired and then forgotten by the pool.
    pub fn is_forgotten(&self, stream: Stream) -> bool {
        self.streams
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .forgotten
            .contains(stream.id())
    }

    /// Whether the pool still needs to know of stream `id`: in the table,
    /// or forgotten with guards still naming it. Takes the table's lock
    /// (a leaf).
    pub fn is_known(&self, id: u64) -> bool {
        let t = self.streams.read().unwrap_or_else(|p| p.into_inner());
        t.map.contains_key(&id) || t.unpurged.contains(&id)
    }

    /// Merge `other` into the clock of `st` (its stream's lock held): a
    /// stream the clock does not name yet joins it only if the pool still
    /// needs to know of it, so that an event recorded before a stream was
    /// forgotten does not bring it back into clocks.
    pub fn merge_clock(&self, st: &mut StreamState, other: &VectorClock) {
        st.clock.merge_where(other, |id| self.is_known(id));
    }

    /// The forgotten streams whose completion and clock entries are still
    /// kept (free ranges or held mappings guarded by their epochs).
    pub fn unpurged_ids(&self) -> Vec<u64> {
        self.streams
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .unpurged
            .clone()
    }

    /// Whether forgotten streams still have completion or clock entries.
    pub fn any_unpurged(&self) -> bool {
        !self
            .streams
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .unpurged
            .is_empty()
    }

    /// Drop what is known of the forgotten streams that no guard names
    /// any more; returns their ids, whose clock entries then go too
    /// ([`StreamOrder::prune_clocks`], with no arena lock held). Caller
    /// holds the arena's lock.
    ///
    /// A stream is forgotten only once all of its work was seen complete
    /// (no frees without an event, every recorded event observed complete
    /// or synchronised, no epoch waiting for a device-wide wait), so its
    /// pending ranges are settled to `Complete` here by the same rule as
    /// any completion ([`Completion::settled`]). What is left guarded by
    /// its epochs (under a reuse policy without opportunistic reuse, a
    /// free seen complete by an event query only: reused by others only
    /// through a dependency) keeps its completion and the clock entries
    /// that follow it, until those ranges are taken or settled; no new
    /// guard can name a forgotten stream, since it can no longer free.
    pub fn purge_forgotten(
        &self,
        arena: &mut Arena,
        done: &mut Completion,
        opportunistic: bool,
    ) -> Vec<u64> {
        let ids = {
            let t = self.streams.read().unwrap_or_else(|p| p.into_inner());
            if t.unpurged.is_empty() {
                return Vec::new();
            }
            t.unpurged.clone()
        };
        let mut purged = Vec::new();
        for id in ids {
            let settled = done.settled(id, opportunistic);
            arena.settle_streams(&[id], |g| match g {
                Guard::After { stream, epoch } if stream == id && settled >= epoch => {
                    Some(Guard::Complete)
                }
                _ => None,
            });
            if arena.names_stream(id) {
                continue;
            }
            done.forget(id);
            purged.push(id);
        }
        if !purged.is_empty() {
            self.streams
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .unpurged
                .retain(|id| !purged.contains(id));
        }
        purged
    }

    /// Drop the clock entries of the streams `purged` (see
    /// [`StreamOrder::purge_forgotten`]) from every stream's clock.
    pub fn prune_clocks(&self, purged: &[u64]) {
        if purged.is_empty() {
            return;
        }
        for (_, e) in self.all_streams() {
            lock(&e.state).clock.forget(|s| purged.contains(&s));
        }
    }

    /// What the stream table and its lists hold now, for
    /// [`crate::MemPool::stream_footprint`]: entries in the table, runs of
    /// ids refused as forgotten, forgotten streams whose ids guards still name,
    /// clock entries summed over the table's streams, and the lengths of
    /// the busy, watch and retired lists.
    pub fn footprint(&self) -> [usize; 7] {
        let (table, forgotten, unpurged) = {
            let t = self.streams.read().unwrap_or_else(|p| p.into_inner());
            (t.map.len(), t.forgotten.runs(), t.unpurged.len())
        };
        let clocks = self
            .all_streams()
            .iter()
            .map(|(_, e)| lock(&e.state).clock.len())
            .sum();
        [
            table,
            forgotten,
            unpurged,
            clocks,
            lock(&self.busy).len(),
            lock(&self.watch).len(),
            lock(&self.retired).waiting.len(),
        ]
    }

    /// Streams in the table (tests: retired streams do not pile up).
    #[cfg(test)]
    pub fn table_len(&self) -> usize {
        self.streams.read().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Put the stream in the list of busy streams, if it is not there yet
    /// (call with its lock held, after making it [`StreamState::busy`]).
    /// The list lock is a leaf: nothing is locked under it.
    #[inline]
    pub fn note_busy(&self, st: &mut StreamState) {
        if !st.listed {
            self.list_busy(st);
        }
    }

    #[cold]
    fn list_busy(&self, st: &mut StreamState) {
        st.listed = true;
        lock(&self.busy).push(st.stream.id());
    }

    /// Run `f` on every busy stream (id, state under its lock), and drop
    /// from the list those `f` leaves idle. Costs what the busy streams
    /// cost, however many streams the pool has met. Callers hold the
    /// arena's lock (the lock order is arena, then stream, then the list),
    /// so two passes never run at once; a stream that becomes busy during
    /// the pass is either visited or listed again by its own
    /// [`note_busy`](Self::note_busy), since both decide under its lock.
    pub fn for_busy(&self, mut f: impl FnMut(u64, &mut StreamState)) {
        let mut ids = {
            let mut busy = lock(&self.busy);
            if busy.is_empty() {
                return;
            }
            std::mem::take(&mut *busy)
        };
        // The streams still busy go back to the list in the vector the
        // list was taken in (`kept`), which keeps its room for the next
        // pass.
        let mut visit = |id: u64, entry: &StreamEntry, kept: &mut Vec<u64>| {
            let mut st = lock(&entry.state);
            f(id, &mut st);
            if st.busy() {
                kept.push(id);
            } else {
                st.listed = false;
            }
        };
        if let [id] = ids[..] {
            // One busy stream (as in a single-stream program): no vector
            // of entries to allocate.
            let entry = (self.streams.read().unwrap_or_else(|p| p.into_inner()))
                .get(&id)
                .cloned();
            ids.clear();
            if let Some(entry) = entry {
                visit(id, &entry, &mut ids);
            }
        } else {
            let entries: Vec<(u64, Arc<StreamEntry>)> = {
                let table = self.streams.read().unwrap_or_else(|p| p.into_inner());
                ids.iter()
                    .filter_map(|id| table.get(id).map(|e| (*id, e.clone())))
                    .collect()
            };
            ids.clear();
            for (id, entry) in entries {
                visit(id, &entry, &mut ids);
            }
        }
        let mut busy = lock(&self.busy);
        if busy.is_empty() {
            // Nothing was listed during the pass: the kept streams, in
            // the vector with room, become the list.
            std::mem::swap(&mut *busy, &mut ids);
        } else {
            busy.append(&mut ids);
        }
    }

    /// Put the stream in the watch list, if it is not there yet (call
    /// with its lock held). The list lock is a leaf.
    #[inline]
    pub fn note_watch(&self, st: &mut StreamState) {
        if !st.watched {
            st.watched = true;
            let id = st.stream.id();
            self.with_watch(|list| list.push(id));
        }
    }

    /// Change the watch list under its lock; [`StreamOrder::watch_hint`]
    /// follows before the lock is let go, so that it always says what the
    /// list held at some moment, and the last change's hint is the one
    /// that stays.
    fn with_watch<R>(&self, f: impl FnOnce(&mut Vec<u64>) -> R) -> R {
        let mut list = lock(&self.watch);
        let r = f(&mut list);
        self.watch_hint
            .store(watch_hint_of(&list), Ordering::Release);
        r
    }

    /// Watch `stream` (a free of it just went to the arena, guarded by its
    /// epoch) if it has never allocated: the next slow allocation of any
    /// stream learns whether that free completed. A stream that allocates
    /// reuses its own frees by stream order and its spills are found by
    /// the busy pass, as before. Takes the stream's lock, after the
    /// arena's if the caller holds it.
    pub fn watch_stream(&self, stream: Stream) {
        let note = |e: &Arc<StreamEntry>| {
            let mut st = lock(&e.state);
            if st.counters.allocs == 0 {
                self.note_watch(&mut st);
            }
        };
        if self.with_recent_entry(stream, note).is_none() {
            if let Ok(e) = self.entry(stream) {
                note(&e);
            }
        }
    }

    /// Learn, for the watched streams only, what completed since the last
    /// look, and upgrade those streams' pending free ranges: the front
    /// recorded events are queried, and a stream with frees that no event
    /// covers is asked whether all its work is done (one query, no event
    /// recorded; every free made so far is then complete and its epoch is
    /// closed). A stream leaves the list once nothing of it is pending.
    /// Costs one look per watched stream: in a producer/consumer pipeline,
    /// the consumers that freed since the last allocation, not every
    /// stream the pool has met. `me`'s own uncovered frees are not asked
    /// about (stream order already lets `me` reuse them). Does nothing
    /// unless observed completion may be used (`opportunistic`). `own`:
    /// `me`'s entry where the caller has it at hand (no table lookup).
    #[inline]
    pub fn poll_completions(
        &self,
        arena: &mut Arena,
        done: &mut Completion,
        opportunistic: bool,
        me: u64,
        own: Option<&StreamEntry>,
    ) {
        if !opportunistic {
            return;
        }
        // Read with no lock: a stream that joins the list after this load
        // is polled by the next slow allocation (as it would be had it
        // joined after the list was taken below).
        match self.watch_hint.load(Ordering::Acquire) {
            WATCH_NONE => return,
            WATCH_MANY => {}
            hint if hint - 1 == me && own.is_some() => {
                // `me` alone: what the loop below does for it, with no lock
                // of the list (its state's lock only).
                let e = own.expect("checked");
                if lock(&e.state).recorded.len() < OWN_BACKLOG {
                    return;
                }
            }
            _ => {}
        }
        self.poll_watched(arena, done, me, own);
    }

    /// [`poll_completions`](Self::poll_completions) past its quick
    /// answers (out of line: most slow allocations stop before it).
    #[inline(never)]
    fn poll_watched(
        &self,
        arena: &mut Arena,
        done: &mut Completion,
        me: u64,
        own: Option<&StreamEntry>,
    ) {
        let mut ids = self.with_watch(std::mem::take);
        if ids.is_empty() {
            return;
        }
        // The streams kept are written back over the front of `ids`, whose
        // allocation goes back to the list (no allocation per poll).
        let mut kept = 0;
        for i in 0..ids.len() {
            let id = ids[i];
            let found;
            let entry: &StreamEntry = match own {
                Some(e) if id == me => e,
                _ => {
                    found = self.entry_by_id(id);
                    match &found {
                        Some(e) => e,
                        None => continue,
                    }
                }
            };
            let mut s = lock(&entry.state);
            if id == me && s.recorded.len() < OWN_BACKLOG {
                // The allocating stream's own events tell it nothing it may
                // not already do: they are queried only to keep their list
                // short (the busy pass queries them when it runs).
                ids[kept] = id;
                kept += 1;
                continue;
            }
            let before = done.observed(id);
            self.observe_recorded(id, &mut s, done);
            let mut forget = false;
            if s.frees_in_epoch && s.recorded.is_empty() && id != me && !s.retired {
                // Through the entry's probe: no lookup by stream id.
                match entry.runs(&*self.device, s.stream, true) {
                    Ok(true) => match self.device.query_stream(s.stream) {
                        Ok(true) => {
                            let epoch = s.close_epoch_synced();
                            done.mark_observed(id, epoch);
                        }
                        Ok(false) => {}
                        Err(_) => forget = true,
                    },
                    Ok(false) => {}
                    Err(_) => forget = true,
                }
            }
            let now = done.observed(id);
            if now > before {
                arena.settle_streams(&[id], |g| match g {
                    Guard::After { stream, epoch } if stream == id && now >= epoch => {
                        Some(Guard::Complete)
                    }
                    _ => None,
                });
            }
            // The busy pass (and, for a stream whose state cannot be
            // learnt, the host wait) still sees what is left.
            if !forget && (s.frees_in_epoch || !s.recorded.is_empty()) && !s.retired {
                ids[kept] = id;
                kept += 1;
            } else {
                s.watched = false;
            }
        }
        ids.truncate(kept);
        self.with_watch(|list| {
            if list.is_empty() {
                *list = ids;
            } else {
                list.extend_from_slice(&ids);
            }
        });
    }

    /// How many streams are watched now (tests only).
    #[cfg(test)]
    fn watched_len(&self) -> usize {
        lock(&self.watch).len()
    }

    /// What the pool may still do with `stream`'s driver handle.
    pub fn reach(&self, stream: Stream) -> Reach {
        match self.device.is_capturing(stream) {
            Ok(false) => Reach::Live,
            Err(SysError::InvalidHandle { what: "stream", .. }) => Reach::Gone,
            Ok(true) | Err(_) => Reach::Untouchable,
        }
    }

    /// Like [`StreamOrder::reach`], but a failed query is an error rather
    /// than `Untouchable`, for callers that must not return as if they had
    /// dealt with the stream.
    pub fn reach_checked(&self, stream: Stream) -> Result<Reach, PoolError> {
        match self.device.is_capturing(stream) {
            Ok(false) => Ok(Reach::Live),
            Err(SysError::InvalidHandle { what: "stream", .. }) => Ok(Reach::Gone),
            Ok(true) => Ok(Reach::Untouchable),
            Err(e) => Err(e.into()),
        }
    }

    /// Move the privately cached frees of the stream `me` (its entry) into
    /// the arena, straight from the cache under the stream's lock (taken
    /// after the arena's, as everywhere).
    pub fn flush_own_cache(
        &self,
        arena: &mut Arena,
        done: &Completion,
        opportunistic: bool,
        me: u64,
        entry: &StreamEntry,
    ) {
        let mut st = lock(&entry.state);
        // Most slow allocations find their stream's cache empty: nothing
        // to hand over, and no batch to set up for it.
        if st.cached_bytes == 0 {
            return;
        }
        let settled = |s| done.settled(s, opportunistic);
        arena.give_back_stream(me, settled, |blocks| {
            st.drain_cache_with(|len, b| blocks.push((b.offset, len, b.epoch)));
        });
    }

    /// Move every stream's privately cached frees into the arena (only
    /// busy streams have any). Cached frees known complete (`done`, as
    /// the settle judges it) are not joined to later ones.
    pub fn flush_caches(&self, arena: &mut Arena, done: &Completion, opportunistic: bool) -> usize {
        let mut moved = 0;
        self.for_busy(|id, st| {
            let settled = |s| done.settled(s, opportunistic);
            moved += arena.give_back_stream(id, settled, |blocks| {
                st.drain_cache_with(|len, b| blocks.push((b.offset, len, b.epoch)));
            });
        });
        moved
    }

    /// Record events lazily on streams with uncovered frees (a stream with
    /// no event pending is asked first whether all its work is done: then
    /// its open epoch is complete at once, where an event recorded now
    /// would complete only after the stream's next work), query the
    /// recorded events, and upgrade guards that are now known complete
    /// (observed ones only under opportunistic reuse: otherwise a free
    /// observed complete is still reused only through a dependency).
    pub fn observe_completions(
        &self,
        arena: &mut Arena,
        done: &mut Completion,
        opportunistic: bool,
    ) {
        // Only busy streams have uncovered frees or unobserved events.
        self.for_busy(|id, s| {
            if s.frees_in_epoch && !s.retired && !self.device.is_capturing(s.stream).unwrap_or(true)
            {
                if s.recorded.is_empty() && matches!(self.device.query_stream(s.stream), Ok(true)) {
                    // All the stream's work is done: its open epoch is
                    // complete now, with no event to record and wait for.
                    let epoch = s.close_epoch_synced();
                    done.mark_observed(id, epoch);
                } else {
                    // A failure leaves the epoch open: the next pass tries
                    // again.
                    let _ = self.record_closing(s);
                }
            }
            self.observe_recorded(id, s, done);
        });
        arena.settle(|g| match g {
            Guard::After { stream, epoch } if done.settled(stream, opportunistic) >= epoch => {
                Some(Guard::Complete)
            }
            _ => None,
        });
    }

    /// Wait on the host, device-wide, for the frees of streams destroyed
    /// before the pool could record an event on them; `mark(stream, epoch)`
    /// is told of each such epoch once it is complete (the caller records
    /// it under the arena's lock, which is not held during the wait).
    /// Returns whether every orphaned free is now complete; it waits for
    /// nothing (false) while a stream known to the pool is being captured,
    /// since a device-wide wait would break that capture.
    pub fn settle_orphans(&self, mut mark: impl FnMut(u64, u64)) -> Result<bool, PoolError> {
        let all = self.all_streams();
        let mut orphans: Vec<(u64, u64)> = all
            .iter()
            .filter_map(|(id, e)| lock(&e.state).orphaned.map(|epoch| (*id, epoch)))
            .collect();
        let forgotten_orphans = self
            .streams
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .forgotten_orphans
            .clone();
        orphans.extend(forgotten_orphans.iter().copied());
        if orphans.is_empty() {
            return Ok(true);
        }
        for (_, e) in &all {
            let stream = lock(&e.state).stream;
            // A stream whose state cannot be learned is an error, not a
            // reason to report the orphans as still pending and succeed.
            if self.reach_checked(stream)? == Reach::Untouchable {
                tracing::warn!(
                    pool = self.pool,
                    %stream,
                    "frees of destroyed streams stay pending: a stream is being captured"
                );
                return Ok(false);
            }
        }
        tracing::warn!(
            pool = self.pool,
            streams = orphans.len(),
            "streams were destroyed with frees pending and no retire_stream: \
             synchronising the device to learn when those frees complete"
        );
        self.device.synchronize_device()?;
        if !forgotten_orphans.is_empty() {
            self.streams
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .forgotten_orphans
                .retain(|o| !forgotten_orphans.contains(o));
        }
        for (id, epoch) in orphans {
            mark(id, epoch);
            if let Some((_, e)) = all.iter().find(|(i, _)| *i == id) {
                let mut st = lock(&e.state);
                if st.orphaned == Some(epoch) {
                    st.orphaned = None;
                }
            }
        }
        Ok(true)
    }

    /// The events recorded on every stream and not yet observed complete
    /// (only busy streams have any).
    pub fn pending_records(&self) -> Vec<Arc<EventRecord>> {
        let mut out = Vec::new();
        self.for_busy(|_, st| out.extend(st.recorded.iter().cloned()));
        out
    }

    /// Wait on the host, until `deadline` at most (none: no bound), for
    /// the work before some of the records to complete, polling them all in
    /// turn. Must be called with no lock held. Returns the records seen
    /// complete (after the first completion, one pass more collects the
    /// others already done), and whether waiting longer may help (some
    /// completed, others are still pending, and time is left).
    pub fn wait_records(
        &self,
        pending: &[Arc<EventRecord>],
        deadline: Option<Instant>,
    ) -> (Vec<Arc<EventRecord>>, bool) {
        let mut done = Vec::new();
        let mut nap = std::time::Duration::from_micros(20);
        let mut left: Vec<&Arc<EventRecord>> = pending.iter().collect();
        while !left.is_empty() {
            let mut still = Vec::with_capacity(left.len());
            for rec in left {
                match self.device.query_event(rec.event) {
                    Ok(true) => done.push(rec.clone()),
                    Ok(false) => still.push(rec),
                    // A failed query: this record cannot be waited for.
                    Err(_) => {}
                }
            }
            left = still;
            if !done.is_empty() || deadline.is_some_and(|d| Instant::now() >= d) {
                break;
            }
            if !left.is_empty() {
                std::thread::sleep(nap);
                nap = (nap * 2).min(std::time::Duration::from_millis(1));
            }
        }
        if !done.is_empty() {
            tracing::debug!(
                pool = self.pool,
                completed = done.len(),
                "host wait let pending frees complete"
            );
        }
        let more =
            !done.is_empty() && !left.is_empty() && deadline.is_none_or(|d| Instant::now() < d);
        (done, more)
    }

    /// The pool is going away and is about to unmap everything: close
    /// every open epoch (with an event, or as orphaned where the driver
    /// stream is gone) and wait on the host for every recorded event. Takes
    /// no lock but each stream's own, one at a time.
    pub fn wait_all_for_drop(&self) {
        for (_, entry) in self.all_streams() {
            let mut st = lock(&entry.state);
            if st.frees_in_epoch && !st.retired {
                match self.reach(st.stream) {
                    Reach::Live => {
                        // Nothing to wait for if no event can be recorded.
                        let _ = self.record_closing(&mut st);
                    }
                    Reach::Gone => st.close_epoch_orphaned(),
                    Reach::Untouchable => {}
                }
            }
            for rec in st.recorded.drain(..) {
                if let Err(e) = self.device.synchronize_event(rec.event) {
                    tracing::warn!(error = %e, "waiting for a pending free while dropping the pool failed");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidepool_sys::{FaultInjector, HostConfig, HostDevice, Op};

    /// The runs hold exactly the ids inserted, whatever the order, and
    /// consecutive ids make one run.
    #[test]
    fn id_runs_hold_what_was_inserted() {
        let mut x = 0x2545_f491_4f6c_dd1d_u64;
        for _ in 0..50 {
            let mut runs = IdRuns::default();
            let mut set = std::collections::HashSet::new();
            for _ in 0..60 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let id = x % 40;
                runs.insert(id);
                set.insert(id);
            }
            for id in 0..45 {
                assert_eq!(runs.contains(id), set.contains(&id), "id {id}");
            }
            let starts = (0..45)
                .filter(|&i| set.contains(&i) && (i == 0 || !set.contains(&(i - 1))))
                .count();
            assert_eq!(runs.runs(), starts, "one run per stretch of ids");
        }
        let mut edge = IdRuns::default();
        edge.insert(u64::MAX);
        edge.insert(0);
        assert!(edge.contains(u64::MAX) && edge.contains(0) && !edge.contains(1));
    }

    /// The slot of the last length cached and the map (long lengths) or
    /// the array (short ones) together hand out every block once, the
    /// newest first within a length, and `take_covered` and `drain` see
    /// both.
    #[test]
    fn size_cache_keeps_every_block() {
        for (a, b) in [(2 << 20, 16 << 20), (512, 64 << 10), (1024, 1 << 30)] {
            size_cache_keeps_every_block_of(a, b);
        }
    }

    fn size_cache_keeps_every_block_of(a: usize, b: usize) {
        let blk = |offset, epoch| CachedBlock { offset, epoch };
        let off = |x: Option<CachedBlock>| x.map(|x| x.offset);
        let mut c = SizeCache::default();
        c.push(a, blk(1, 1)); // the slot takes a
        c.push(b, blk(2, 1)); // the array or the map
        c.push(a, blk(3, 2)); // the slot
        assert_eq!(off(c.pop(a)), Some(3));
        assert_eq!(off(c.pop(a)), Some(1));
        assert_eq!(off(c.pop(a)), None);
        // The slot is empty: it takes b, newer than the map's b.
        c.push(b, blk(4, 3));
        assert_eq!(off(c.pop(b)), Some(4));
        c.push(b, blk(5, 4)); // the slot
        c.push(a, blk(6, 5)); // the map (the slot holds b)
                              // Only the map's b is from epoch 1 or earlier.
        assert_eq!(off(c.take_covered(b, 1)), Some(2));
        assert_eq!(off(c.take_covered(b, 3)), None);
        let mut all = Vec::new();
        c.drain(|len, x| all.push((len, x.offset)));
        all.sort_unstable();
        assert_eq!(all, [(a, 6), (b, 5)]);
        assert_eq!((off(c.pop(a)), off(c.pop(b))), (None, None));
        // An older block of the slot's length elsewhere is found once the
        // slot's are gone.
        c.push(b, blk(7, 6)); // the slot takes b
        c.push(a, blk(8, 6)); // the array or the map
        assert_eq!(off(c.pop(b)), Some(7));
        c.push(a, blk(9, 7)); // the slot takes a
        assert_eq!(off(c.pop(a)), Some(9));
        assert_eq!(off(c.pop(a)), Some(8));
        assert_eq!(off(c.pop(a)), None);
    }

    /// A failed record leaves the epoch open (its frees stay uncovered, so
    /// a later pass records again) and gives the event back: the next
    /// record reuses it instead of creating another (no event leaks).
    #[test]
    fn record_closing_gives_the_event_back_when_the_record_fails() {
        crate::sync::model(record_closing_body);
    }

    fn record_closing_body() {
        let dev = Arc::new(FaultInjector::new(HostDevice::with_config(HostConfig {
            capacity: 8 << 20,
            granularity: 2 << 20,
        })));
        let order = StreamOrder::new(1, dev.clone());
        let s = dev.create_stream().unwrap();
        let entry = order.entry(s).unwrap();
        let mut st = lock(&entry.state);
        st.frees_in_epoch = true;
        dev.fail_nth(
            Op::RecordEvent,
            1,
            SysError::Injected {
                op: Op::RecordEvent,
                call: 1,
            },
        );
        let created = dev.calls(Op::CreateEvent);
        assert!(matches!(
            order.record_closing(&mut st),
            Err(RecordFailure::Record(_))
        ));
        assert_eq!((st.epoch, st.frees_in_epoch), (1, true), "epoch left open");
        assert!(st.recorded.is_empty());
        let rec = order
            .record_closing(&mut st)
            .expect("the second record works");
        assert_eq!(rec.epoch, 1);
        assert_eq!((st.epoch, st.frees_in_epoch), (2, false));
        assert_eq!(
            dev.calls(Op::CreateEvent),
            created + 1,
            "the event of the failed record was reused"
        );
        dev.synchronize_stream(s).unwrap();
    }

    /// The watch list's one-word summary: with the allocating stream
    /// alone watched a poll asks nothing and keeps it; with another stream
    /// alone watched, or several, the poll asks that stream.
    #[test]
    fn a_poll_skips_the_list_only_when_the_allocating_stream_is_alone_in_it() {
        crate::sync::model(watch_hint_body);
    }

    fn watch_hint_body() {
        const PAGE: usize = 2 << 20;
        let dev = Arc::new(FaultInjector::new(HostDevice::with_config(HostConfig {
            capacity: 8 << 20,
            granularity: PAGE,
        })));
        let order = StreamOrder::new(1, dev.clone());
        let (me, consumer) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
        let own = order.entry(me).unwrap();
        let mut arena = Arena::new(64 * PAGE, PAGE);
        let mut done = Completion::default();
        assert_eq!(order.watch_hint.load(Ordering::Relaxed), WATCH_NONE);
        // The consumer alone (a free with no event): asked.
        lock(&order.entry(consumer).unwrap().state).frees_in_epoch = true;
        order.watch_stream(consumer);
        assert_eq!(order.watch_hint.load(Ordering::Relaxed), consumer.id() + 1);
        let queries = dev.calls(Op::QueryStream);
        order.poll_completions(&mut arena, &mut done, true, me.id(), Some(&own));
        assert_eq!(
            dev.calls(Op::QueryStream),
            queries + 1,
            "the consumer is asked"
        );
        assert_eq!(done.observed(consumer.id()), 1);
        assert_eq!(order.watched_len(), 0, "the consumer is forgotten");
        assert_eq!(order.watch_hint.load(Ordering::Relaxed), WATCH_NONE);
        // `me` alone (an event recorded on it): kept, nothing asked.
        order.record_closing(&mut lock(&own.state)).unwrap();
        assert_eq!(order.watch_hint.load(Ordering::Relaxed), me.id() + 1);
        order.poll_completions(&mut arena, &mut done, true, me.id(), Some(&own));
        assert_eq!(dev.calls(Op::QueryStream), queries + 1);
        assert_eq!(order.watched_len(), 1, "`me` stays watched");
        // Both: the consumer is asked again.
        lock(&order.entry(consumer).unwrap().state).frees_in_epoch = true;
        order.watch_stream(consumer);
        assert_eq!(order.watch_hint.load(Ordering::Relaxed), WATCH_MANY);
        order.poll_completions(&mut arena, &mut done, true, me.id(), Some(&own));
        assert_eq!(
            dev.calls(Op::QueryStream),
            queries + 2,
            "the consumer is asked"
        );
        assert_eq!(
            order.watched_len(),
            1,
            "`me` stays watched, the consumer goes"
        );
        assert_eq!(order.watch_hint.load(Ordering::Relaxed), me.id() + 1);
        for s in [me, consumer] {
            dev.synchronize_stream(s).unwrap();
        }
    }

    /// The poll asks only the watched streams, each once, forgets those
    /// whose frees it saw complete, and never asks about the allocating
    /// stream's own frees; what it learns upgrades that stream's ranges.
    #[test]
    fn poll_asks_only_watched_streams_and_forgets_the_settled() {
        crate::sync::model(poll_body);
    }

    fn poll_body() {
        const PAGE: usize = 2 << 20;
        let dev = Arc::new(FaultInjector::new(HostDevice::with_config(HostConfig {
            capacity: 8 << 20,
            granularity: PAGE,
        })));
        let order = StreamOrder::new(1, dev.clone());
        let streams: Vec<Stream> = (0..64).map(|_| dev.create_stream().unwrap()).collect();
        for &s in &streams {
            order.entry(s).unwrap();
        }
        let mut arena = Arena::new(64 * PAGE, PAGE);
        let mut done = Completion::default();
        let (me, consumer) = (streams[0], streams[37]);
        // A free of the consumer (guarded by its epoch 1) and one of `me`,
        // both watched.
        for &s in &[consumer, me] {
            lock(&order.entry(s).unwrap().state).frees_in_epoch = true;
            order.watch_stream(s);
        }
        let queries = dev.calls(Op::QueryStream);
        order.poll_completions(&mut arena, &mut done, true, me.id(), None);
        assert_eq!(
            dev.calls(Op::QueryStream),
            queries + 1,
            "one query: the consumer (not `me`, not the 62 idle streams)"
        );
        assert_eq!(done.observed(consumer.id()), 1, "its epoch 1 is complete");
        assert_eq!(
            order.watched_len(),
            1,
            "the consumer is forgotten, `me` kept"
        );
        order.poll_completions(&mut arena, &mut done, true, me.id(), None);
        assert_eq!(
            dev.calls(Op::QueryStream),
            queries + 1,
            "nothing new to ask"
        );
        // A stream that allocates is not watched for its spills (its own
        // allocations reuse them by stream order).
        let alloc_stream = streams[5];
        {
            let e = order.entry(alloc_stream).unwrap();
            let mut st = lock(&e.state);
            st.counters.allocs = 1;
            st.frees_in_epoch = true;
        }
        order.watch_stream(alloc_stream);
        assert_eq!(
            order.watched_len(),
            1,
            "an allocating stream is not watched"
        );
        // Without opportunistic reuse what it would learn is of no use.
        lock(&order.entry(consumer).unwrap().state).frees_in_epoch = true;
        order.watch_stream(consumer);
        order.poll_completions(&mut arena, &mut done, false, me.id(), None);
        assert_eq!(dev.calls(Op::QueryStream), queries + 1);
        for &s in &streams {
            dev.synchronize_stream(s).unwrap();
        }
    }

    #[test]
    fn a_cache_drain_hands_over_every_block_left_oldest_first_per_length() {
        let mut cache = SizeCache::default();
        // The model: per length, the blocks in the order they were pushed.
        let mut model: std::collections::BTreeMap<usize, Vec<CachedBlock>> = Default::default();
        let mut x: u64 = 0x243f_6a88_85a3_08d3;
        let mut next = 0usize;
        for round in 0..200 {
            for _ in 0..(round % 7) * 5 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                // Small lengths (every slot, both ends) and large ones.
                let len = match x % 4 {
                    0 => 512,
                    1 => SMALL_CACHE_MAX,
                    2 => ((x >> 8) as usize % SMALL_SLOTS + 1) * CACHE_GRAIN,
                    _ => SMALL_CACHE_MAX + ((x >> 8) as usize % 90 + 1) * CACHE_GRAIN,
                };
                if (x >> 40) % 3 == 0 {
                    let got = cache.pop(len).map(|b| b.offset);
                    let want = model.get_mut(&len).and_then(|v| v.pop()).map(|b| b.offset);
                    assert_eq!(got, want, "pop {len}");
                } else {
                    next += 1;
                    let b = CachedBlock {
                        offset: next * 512,
                        epoch: round,
                    };
                    cache.push(len, b);
                    model.entry(len).or_default().push(b);
                }
            }
            if round % 3 == 0 {
                let mut drained: std::collections::BTreeMap<usize, Vec<usize>> = Default::default();
                cache.drain(|len, b| drained.entry(len).or_default().push(b.offset));
                let want: std::collections::BTreeMap<usize, Vec<usize>> =
                    std::mem::take(&mut model)
                        .into_iter()
                        .filter(|(_, v)| !v.is_empty())
                        .map(|(len, v)| (len, v.iter().map(|b| b.offset).collect()))
                        .collect();
                assert_eq!(drained, want, "round {round}");
                let mut again = 0;
                cache.drain(|_, _| again += 1);
                assert_eq!(again, 0, "a drained cache is empty");
            }
        }
    }

    #[test]
    fn vector_clock_merge_takes_maximum_per_stream() {
        let mut a = VectorClock::default();
        a.raise(1, 5);
        a.raise(2, 1);
        let mut b = VectorClock::default();
        b.raise(2, 7);
        b.raise(3, 2);
        a.merge(&b);
        assert_eq!((a.get(1), a.get(2), a.get(3), a.get(4)), (5, 7, 2, 0));
        a.raise(1, 3);
        assert_eq!(a.get(1), 5, "raise never lowers");
    }
}
