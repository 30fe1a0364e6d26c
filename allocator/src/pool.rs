//! The public pool: `MemPool`, its allocations and events, the public
//! calls, and the fast path (a free into the stream's own cache, an
//! allocation out of it). Everything slower goes down a layer: the reuse
//! decision to `policy`, page mapping to `pages`, events and what is known
//! complete to `ordering`. Nothing below calls back up here: the registry
//! reaches the pool through its `CacheHolder` trait, the raw-pointer table
//! is generic over the handle it keeps.

use crate::arena::{Arena, Guard};
use crate::capture::{AllocRoute, CaptureTag};
use crate::config::{PoolConfig, ReusePolicy};
use crate::error::PoolError;
use crate::ordering::{
    CachedBlock, EntryRef, EventRecord, Reach, StreamEntry, StreamOrder, VectorClock,
};
use crate::pages::Pages;
use crate::placement::ArenaState;
use crate::raw::{RawSize, RawTable};
use crate::registry::{CacheHolder, PoolRecord};
use crate::share_state::ShareState;
use crate::stats::{Counters, PoolStats};
use crate::sync::{lock, Arc, AtomicU64, AtomicU8, Mutex, Ordering, SlotRef};
use std::fmt;
use tidepool_sys::{Device, DevicePtr, Event, Stream, SysError};

/// Alignment of every pointer the pool hands out (CUDA guarantees 256).
pub const ALIGNMENT: usize = 512;

/// The strict-mode bit of the capture gate (far above any count of
/// announced captures).
const STRICT: u64 = 1 << 63;

static NEXT_POOL_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// Memory handed out by [`MemPool::alloc_async`].
///
/// Give it back with [`MemPool::free_async`], which takes it by value, so a
/// double free does not compile. Dropping it without freeing leaks the
/// memory until the pool is dropped (the pool cannot know when device work
/// on it ends).
#[must_use = "an allocation that is dropped without free_async leaks until the pool is dropped"]
pub struct Allocation {
    pub(crate) ptr: DevicePtr,
    pub(crate) size: usize,
    pub(crate) stream: Stream,
    pub(crate) pool: u64,
    /// Declared uses and the capture tag; `None` for an eager block with
    /// no declared uses (nearly every allocation: the handle is then five
    /// words, built and moved in registers on the fast paths).
    pub(crate) extra: Option<Box<Extra>>,
}

/// What few allocations carry (see [`Allocation::extra`]).
#[derive(Debug, Default)]
pub(crate) struct Extra {
    uses: Vec<Stream>,
    /// Graph memory, or a block used by captured work (see `capture.rs`).
    capture: CaptureTag,
}

impl Allocation {
    /// An eager block of the pool (or the null allocation of size 0).
    #[inline(always)]
    pub(crate) fn eager(ptr: DevicePtr, size: usize, stream: Stream, pool: u64) -> Self {
        Allocation {
            ptr,
            size,
            stream,
            pool,
            extra: None,
        }
    }

    /// Bytes of the block: the size rounded up to [`ALIGNMENT`] (0 for
    /// size 0). No overflow: an allocation's size is at most the pool's
    /// address range.
    #[inline(always)]
    pub(crate) fn len(&self) -> usize {
        (self.size + (ALIGNMENT - 1)) & !(ALIGNMENT - 1)
    }

    /// What the allocation has to do with graph capture.
    #[inline]
    pub(crate) fn capture(&self) -> CaptureTag {
        self.extra.as_ref().map_or(CaptureTag::Eager, |x| x.capture)
    }

    pub(crate) fn set_capture(&mut self, tag: CaptureTag) {
        if tag != self.capture() {
            self.extra.get_or_insert_with(Default::default).capture = tag;
        }
    }

    /// Whether the fast free may take it: an eager block with no declared
    /// uses (one load).
    #[inline(always)]
    pub(crate) fn is_plain(&self) -> bool {
        self.extra.is_none()
    }

    /// Device address (aligned to [`ALIGNMENT`]; 0 for a zero-size allocation).
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }
    /// Bytes requested.
    pub fn size(&self) -> usize {
        self.size
    }
    /// The stream it was allocated on.
    pub fn stream(&self) -> Stream {
        self.stream
    }
    /// Streams declared with [`MemPool::record_use`].
    pub fn uses(&self) -> &[Stream] {
        self.extra.as_ref().map_or(&[], |x| &x.uses)
    }
    /// Whether this is graph memory: allocated on a stream that was being
    /// captured into a CUDA graph (an allocation node of that graph, not a
    /// block of the pool; see [`MemPool::alloc_async`]).
    pub fn is_graph_memory(&self) -> bool {
        matches!(self.capture(), CaptureTag::Graph { .. })
    }
}

impl fmt::Debug for Allocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Allocation")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("size", &self.size)
            .field("stream", &self.stream)
            .finish()
    }
}

/// A failed [`MemPool::free_async`]: the allocation comes back untouched,
/// so nothing is lost and the free can be retried.
#[derive(Debug)]
pub struct FreeError {
    /// Why the free was refused.
    pub error: PoolError,
    /// The allocation, still live and owned by the caller.
    pub allocation: Allocation,
}

impl fmt::Display for FreeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "free of {:#x} failed: {}",
            self.allocation.ptr, self.error
        )
    }
}

impl std::error::Error for FreeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl From<FreeError> for PoolError {
    fn from(e: FreeError) -> Self {
        e.error
    }
}

/// An event recorded through the pool ([`MemPool::record_event`]). Waiting
/// on it through the pool ([`MemPool::wait_event`]) is what lets the pool
/// follow the dependency.
#[derive(Clone)]
pub struct PoolEvent {
    pub(crate) record: Arc<EventRecord>,
    pub(crate) pool: u64,
}

impl PoolEvent {
    /// The stream the event was recorded on.
    pub fn stream(&self) -> Stream {
        self.record.stream
    }
    /// The device event (for waits the pool need not see).
    pub fn raw(&self) -> Event {
        self.record.event
    }
}

impl fmt::Debug for PoolEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolEvent")
            .field("stream", &self.record.stream)
            .field("epoch", &self.record.epoch)
            .finish()
    }
}

pub(crate) struct PoolInner<D: Device> {
    pub id: u64,
    pub device: Arc<D>,
    pub base: DevicePtr,
    pub va_size: usize,
    pub config: PoolConfig,
    /// Peer access list, exports and imports.
    pub share: ShareState,
    /// The reuse switches, one bit each ([`reuse_bits`]): one load gives
    /// an allocation all four, as one `set_reuse` left them.
    reuse: AtomicU8,
    release_threshold: AtomicU64,
    /// The capture gate, read once (relaxed) per allocation and free: the
    /// number of captures announced and not yet ended, plus [`STRICT`]
    /// while the pool is in strict mode. Zero means "announced mode and no
    /// capture underway": no capture query is needed.
    capture_gate: AtomicU64,
    /// The arena and what is known complete, under one lock.
    pub arena: Mutex<ArenaState>,
    /// The stream table, events and completion.
    pub order: StreamOrder<D>,
    pub counters: Counters,
    pub raw: RawTable<Allocation>,
}

/// Sizes of what a pool keeps per stream ([`MemPool::stream_footprint`]).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StreamFootprint {
    /// Streams in the stream table.
    pub table: usize,
    /// Runs of consecutive ids of forgotten streams, kept to refuse them.
    pub forgotten: usize,
    /// Forgotten streams whose completion is still kept, because free
    /// ranges or held mappings are still guarded by their epochs.
    pub lingering: usize,
    /// Streams with an epoch observed complete.
    pub observed: usize,
    /// Streams with an epoch the host synchronised with.
    pub synced: usize,
    /// Vector-clock entries, summed over the table's streams.
    pub clock_entries: usize,
    /// Streams in the busy list.
    pub busy: usize,
    /// Streams in the watch list.
    pub watched: usize,
    /// Retired streams waiting to be forgotten.
    pub retired_waiting: usize,
    /// Streams listed as holding headroom.
    pub donors: usize,
    /// Streams with free ranges pending in the arena.
    pub pending_streams: usize,
    /// Mappings held by a guard.
    pub holds: usize,
}

/// A stream-ordered memory pool over a [`Device`].
///
/// Cheap to clone (all clones are the same pool) and safe to share between
/// threads. See the crate documentation for the contract.
///
/// ```
/// use std::sync::Arc;
/// use tidepool::{MemPool, PoolConfig};
/// use tidepool_sys::{Device, host::{HostConfig, HostDevice}};
///
/// let device = Arc::new(HostDevice::with_config(HostConfig { capacity: 64 << 20, ..Default::default() }));
/// let pool = MemPool::new(device.clone(), PoolConfig::default().with_va_size(1 << 30))?;
/// let stream = device.create_stream()?;
/// let a = pool.alloc_async(1000, stream)?;
/// assert_eq!(a.ptr() % 512, 0);
/// pool.free_async(a, stream)?;
/// let b = pool.alloc_async(1000, stream)?; // same-stream reuse, no event needed
/// pool.free_async(b, stream)?;
/// assert_eq!(pool.stats().used_current, 0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct MemPool<D: Device> {
    pub(crate) inner: Arc<PoolInner<D>>,
}

impl<D: Device> Clone for MemPool<D> {
    fn clone(&self) -> Self {
        MemPool {
            inner: self.inner.clone(),
        }
    }
}

impl<D: Device> fmt::Debug for MemPool<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemPool")
            .field("id", &self.inner.id)
            .field("backend", &self.inner.device.backend_name())
            .field("base", &format_args!("{:#x}", self.inner.base))
            .finish()
    }
}

/// The reuse switches as the bits of one byte (see [`PoolInner::reuse`]).
fn reuse_bits(r: ReusePolicy) -> u8 {
    u8::from(r.follow_event_dependencies)
        | u8::from(r.opportunistic) << 1
        | u8::from(r.internal_dependencies) << 2
        | u8::from(r.wait_for_pending_frees) << 3
}

/// The switches of [`reuse_bits`]'s byte.
#[inline]
fn reuse_of_bits(b: u8) -> ReusePolicy {
    ReusePolicy {
        follow_event_dependencies: b & 1 != 0,
        opportunistic: b & 2 != 0,
        internal_dependencies: b & 4 != 0,
        wait_for_pending_frees: b & 8 != 0,
    }
}

fn round_up(n: usize, to: usize) -> Option<usize> {
    n.checked_add(to - 1).map(|v| v / to * to)
}

impl<D: Device> MemPool<D> {
    /// Create a pool on `device`: reserves its virtual address space (no
    /// memory yet).
    pub fn new(device: Arc<D>, config: PoolConfig) -> Result<Self, PoolError> {
        let gran = device.granularity();
        config.validate(gran)?;
        let page = if config.page_size == 0 {
            gran
        } else {
            config.page_size
        };
        let va_size = if config.va_size == 0 {
            let total = device.mem_info().map(|m| m.total).unwrap_or(0);
            round_up(total.saturating_mul(2).max(64 << 30), page).unwrap_or(64 << 30)
        } else {
            round_up(config.va_size, page).ok_or_else(|| PoolError::InvalidConfig {
                reason: "va_size overflows".into(),
            })?
        };
        // Peer devices are checked before anything is reserved.
        let access = crate::share_state::initial_access(&*device, &config.peer_devices)?;
        let base = device.reserve_va(va_size, page)?;
        let id = NEXT_POOL_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let reuse = config.reuse;
        let inner = Arc::new(PoolInner {
            id,
            base,
            va_size,
            share: ShareState::new(access),
            reuse: AtomicU8::new(reuse_bits(reuse)),
            release_threshold: AtomicU64::new(config.release_threshold),
            capture_gate: AtomicU64::new(if config.check_capture { STRICT } else { 0 }),
            arena: Mutex::new(ArenaState::new(Arena::new(va_size, page))),
            order: StreamOrder::new(id, device.clone()),
            counters: Counters::default(),
            raw: RawTable::default(),
            device,
            config,
        });
        // In the process-wide registry (not under loom: see `std_weak`).
        let holder = crate::sync::std_weak(&inner, |a| -> std::sync::Arc<dyn CacheHolder> { a });
        if let Some(holder) = holder {
            crate::registry::register(PoolRecord {
                id,
                base,
                size: va_size as u64,
                device_key: crate::registry::device_key(&*inner.device),
                holder,
            });
        }
        tracing::debug!(pool = id, base, va_size, page, "pool created");
        Ok(MemPool { inner })
    }

    /// This pool's id (unique in the process).
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// The device the pool allocates on.
    pub fn device(&self) -> &Arc<D> {
        &self.inner.device
    }

    /// Whether `ptr` lies in this pool's address range.
    pub fn contains(&self, ptr: DevicePtr) -> bool {
        ptr >= self.inner.base && ptr < self.inner.base + self.inner.va_size as u64
    }

    /// Allocate `size` bytes for work ordered after this call on `stream`.
    ///
    /// Returns at once; the memory may still be in use by work ordered
    /// before this call on `stream` (that is the point), never by work that
    /// could overlap with later work on `stream`. Out-of-memory is reported
    /// here, never later. Size 0 succeeds with a null pointer, which
    /// [`free_async`](Self::free_async) accepts.
    ///
    /// On a stream that is being captured into a CUDA graph the allocation
    /// is *graph memory*: an allocation node of the graph (the driver's
    /// `cuMemAllocAsync` during capture), valid for the graph's work
    /// between this node and its free, at every launch; it is not a block
    /// of the pool and does not count in [`stats`](Self::stats). The
    /// capture is detected on every call in strict mode (the default),
    /// only while a capture is announced otherwise
    /// ([`begin_announced_capture`](Self::begin_announced_capture)). The
    /// rules for its lifetime are in `docs/capture.md`.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tidepool::{MemPool, PoolConfig};
    /// use tidepool_sys::{Device, host::{HostConfig, HostDevice}};
    ///
    /// let device = Arc::new(HostDevice::with_config(HostConfig { capacity: 64 << 20, ..Default::default() }));
    /// let page = device.granularity(); // the pool's default page size
    /// let pool = MemPool::new(
    ///     device.clone(),
    ///     PoolConfig::default().with_va_size(1 << 30).with_max_size(2 * page as u64),
    /// )?;
    /// let s = device.create_stream()?;
    /// let x = pool.alloc_async(1000, s)?;
    /// assert_eq!(x.size(), 1000);
    /// assert_eq!(pool.stats().reserved_current, page as u64); // grew by one page
    /// // Out-of-memory is the call's result, with a report of the pool's state.
    /// let err = pool.alloc_async(2 * page, s).unwrap_err();
    /// assert!(err.is_out_of_memory());
    /// // Size 0 is a null allocation.
    /// let z = pool.alloc_async(0, s)?;
    /// assert_eq!(z.ptr(), 0);
    /// pool.free_async(z, s)?;
    /// pool.free_async(x, s)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[inline(always)]
    pub fn alloc_async(&self, size: usize, stream: Stream) -> Result<Allocation, PoolError> {
        self.alloc_in(size, stream, true)
    }

    /// [`alloc_async`](Self::alloc_async); a capturing stream gets graph
    /// memory only when `serve_capture` (the raw-pointer API refuses it).
    #[inline(always)]
    fn alloc_in(
        &self,
        size: usize,
        stream: Stream,
        serve_capture: bool,
    ) -> Result<Allocation, PoolError> {
        // Fast path: a same-size block from the stream's own cache, the
        // entry found in this thread's recent entries. It changes nothing
        // unless it returns a block, so everything else (sizes 0 and too
        // large, errors, capture) is the slow path's, from the start.
        let checked = match self.inner.alloc_hit(size, stream) {
            Hit::Block { offset } => return Ok(self.allocation_at(offset, size, stream)),
            Hit::Marked(clock, slot) => return self.alloc_marked(size, stream, clock, slot),
            Hit::Miss => true,
            Hit::Other => false,
        };
        self.alloc_slow(size, stream, serve_capture, checked)
    }

    /// The handle of a pool block at `offset`.
    #[inline(always)]
    fn allocation_at(&self, offset: usize, size: usize, stream: Stream) -> Allocation {
        Allocation::eager(self.inner.base + offset as u64, size, stream, self.inner.id)
    }

    /// The slow path after the fast path missed on the stream's slot
    /// entry ([`Hit::Marked`]): the size is one the fast path takes
    /// (1 ..= va_size), the stream runs its work and is not retired, its
    /// cache has no block of the size, and the allocation is marked in
    /// flight there. What is left is the reuse policy's.
    #[cold]
    #[inline(never)]
    fn alloc_marked(
        &self,
        size: usize,
        stream: Stream,
        clock: VectorClock,
        slot: SlotRef<'_, Arc<StreamEntry>>,
    ) -> Result<Allocation, PoolError> {
        debug_assert!((1..=self.inner.va_size).contains(&size));
        // No overflow: size <= va_size, itself a rounded usize.
        let len = (size + (ALIGNMENT - 1)) & !(ALIGNMENT - 1);
        // The mark keeps the slot's entry from being forgotten.
        let entry = EntryRef::Slot(slot);
        let in_flight = crate::ordering::AllocInFlight::adopt(&entry);
        self.alloc_by_policy(size, len, stream, &entry, in_flight, clock)
    }

    /// Everything but a hit or a marked miss in the stream's own cache
    /// found through this thread's recent entries: graph memory for a
    /// capturing stream, the table lookup, then as
    /// [`alloc_marked`](Self::alloc_marked). `checked`: whether the fast
    /// path already found the stream running its work and its cache
    /// without a block of this size.
    #[cold]
    #[inline(never)]
    fn alloc_slow(
        &self,
        size: usize,
        stream: Stream,
        serve_capture: bool,
        checked: bool,
    ) -> Result<Allocation, PoolError> {
        let inner = &*self.inner;
        if size == 0 {
            // No memory, but the stream is named all the same: refuse a
            // destroyed stream, another device's or a retired one as for
            // any size.
            inner.device.check_stream(stream)?;
            if inner.order.is_retired(stream) {
                return Err(PoolError::StreamRetired { stream });
            }
            Counters::bump(&inner.counters.zero_allocs);
            return Ok(Allocation::eager(0, 0, stream, inner.id));
        }
        let len = match round_up(size, ALIGNMENT) {
            Some(len) if len <= inner.va_size => len,
            _ => {
                return Err(PoolError::TooLarge {
                    requested: size,
                    limit: inner.va_size,
                })
            }
        };
        let check = inner.capture_check_needed();
        if !checked && check {
            // A capturing stream gets graph memory (see `capture.rs`).
            if let AllocRoute::Graph(id) = crate::capture::alloc_route(&*inner.device, stream)? {
                if !serve_capture {
                    return Err(PoolError::StreamCapturing { stream });
                }
                let ptr = crate::capture::graph_alloc(&*inner.device, stream, len, id)?;
                let mut a = Allocation::eager(ptr, size, stream, inner.id);
                a.set_capture(CaptureTag::Graph { capture: id });
                return Ok(a);
            }
        } else if !checked {
            // No capture check, but still no destroyed or foreign stream.
            inner.device.check_stream(stream)?;
        }
        // A retire racing this allocation cannot have the entry forgotten
        // (its counters folded) before the allocation is counted there.
        let entry = inner.order.entry_ref(stream)?;
        let (in_flight, clock) = crate::ordering::AllocInFlight::mark(&entry, stream)?;
        if !checked {
            if let Some(offset) = inner.take_cached(&entry, stream, size, len)? {
                return Ok(self.allocation_at(offset, size, stream));
            }
        }
        self.alloc_by_policy(size, len, stream, &entry, in_flight, clock)
    }

    /// The end of every slow allocation: a block from the cache of a
    /// stream waited on, else the reuse policy's; counted on the stream,
    /// where `in_flight` marks it.
    #[inline(always)]
    fn alloc_by_policy(
        &self,
        size: usize,
        len: usize,
        stream: Stream,
        entry: &Arc<StreamEntry>,
        in_flight: crate::ordering::AllocInFlight<'_>,
        clock: VectorClock,
    ) -> Result<Allocation, PoolError> {
        let inner = &*self.inner;
        let reuse = inner.reuse();
        if reuse.follow_event_dependencies && !clock.is_empty() {
            if let Some(offset) = inner.take_followed(entry, stream, size, len, &clock) {
                return Ok(self.allocation_at(offset, size, stream));
            }
        }
        let offset = match crate::policy::acquire(inner.parts(), len, stream, entry, reuse, clock) {
            Ok(off) => off,
            Err(mut e) => {
                if let PoolError::OutOfMemory(report) = &mut e {
                    report.requested = size;
                    report.used = inner.used_current();
                }
                if e.is_out_of_memory() {
                    Counters::bump(&inner.counters.ooms);
                    tracing::warn!(pool = inner.id, size, stream = stream.id(), error = %e, "allocation failed");
                }
                return Err(e);
            }
        };
        // Counted, and the mark ended, under one lock of the stream.
        let missing = in_flight.finish(|st| {
            inner
                .counters
                .on_alloc(&mut st.counters, size as u64, false)
        });
        inner.claim_headroom(missing);
        if inner.order.retired_waiting() {
            // The policy may have seen their last events complete.
            inner.forget_retired();
        }
        tracing::trace!(pool = inner.id, size, stream = stream.id(), offset, "alloc");
        Ok(self.allocation_at(offset, size, stream))
    }

    /// Free in stream order: the memory is reused only by work that cannot
    /// overlap with work ordered before this call on `stream` (and on every
    /// stream declared with [`record_use`](Self::record_use)). `stream` may
    /// differ from the allocation's stream when the caller ordered it after
    /// the allocation and after every use: the free is itself work on the
    /// memory, which exists for a stream only from the allocation on (the
    /// driver's pool asks the same). The block may have been carved from
    /// memory whose earlier frees are still pending on the allocating
    /// stream; a free on a stream not ordered after the allocation can hand
    /// that memory out while those frees' work still runs. On error the
    /// allocation comes back in the [`FreeError`].
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tidepool::{MemPool, PoolConfig};
    /// use tidepool_sys::{Device, host::{HostConfig, HostDevice}};
    ///
    /// let device = Arc::new(HostDevice::with_config(HostConfig { capacity: 64 << 20, ..Default::default() }));
    /// let pool = MemPool::new(device.clone(), PoolConfig::default().with_va_size(1 << 30))?;
    /// let s = device.create_stream()?;
    /// let x = pool.alloc_async(4096, s)?;
    /// let addr = x.ptr();
    /// pool.free_async(x, s)?;
    /// assert_eq!(pool.stats().used_current, 0);
    /// // Work queued later on the same stream runs after the free: the
    /// // memory is handed out again at once, with no growth and no wait.
    /// let y = pool.alloc_async(4096, s)?;
    /// assert_eq!(y.ptr(), addr);
    /// assert_eq!(pool.stats().growths, 1);
    /// pool.free_async(y, s)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[inline(always)]
    pub fn free_async(&self, allocation: Allocation, stream: Stream) -> Result<(), FreeError> {
        // Fast path: an eager block with no declared uses, into the
        // cache (or to the arena) of a running stream this thread used
        // recently. It changes nothing unless it frees, so everything else
        // is the slow path's, from the start.
        if self.inner.free_hit(&allocation, stream) {
            // Nothing to drop: a plain allocation owns no heap memory.
            std::mem::forget(allocation);
            return Ok(());
        }
        self.free_slow(allocation, stream)
    }

    /// Every free but an eager block with no declared uses, on a running
    /// stream this thread used recently: another pool's allocation, size
    /// 0, graph memory, a capture check that refuses, declared uses,
    /// exported memory, the table lookup.
    #[cold]
    #[inline(never)]
    fn free_slow(&self, mut allocation: Allocation, stream: Stream) -> Result<(), FreeError> {
        let inner = &*self.inner;
        let fail = |error, allocation| Err(FreeError { error, allocation });
        if allocation.pool != inner.id {
            let ptr = allocation.ptr;
            return fail(PoolError::WrongPool { ptr }, allocation);
        }
        if allocation.size == 0 {
            if let Err(e) = inner.device.check_stream(stream) {
                return fail(e.into(), allocation);
            }
            Counters::bump(&inner.counters.zero_frees);
            return Ok(());
        }
        if allocation.is_graph_memory() {
            // Graph memory: a free node inside a capture, a stream-ordered
            // free of what a launch left live outside one.
            return match crate::capture::graph_free(&*inner.device, stream, allocation.ptr) {
                Ok(()) => Ok(()),
                Err(e) => fail(e, allocation),
            };
        }
        let check = inner.capture_check_needed();
        if check {
            // No pool block is freed inside a capture (see `capture.rs`).
            if let Err(e) = crate::capture::check_eager_free(&*inner.device, stream) {
                return fail(e, allocation);
            }
        } else if let Err(e) = inner.device.check_stream(stream) {
            return fail(e.into(), allocation);
        }
        if !allocation.is_plain() {
            let uses = allocation.uses();
            let tag = allocation.capture();
            if let Err(e) = crate::capture::check_uses(&*inner.device, tag, uses, stream, check) {
                return fail(e, allocation);
            }
        }
        // Declared uses on other streams: the freeing stream waits for them,
        // so the free's own epoch covers them. A user stream destroyed
        // since (without retirement) can no longer be waited for by event:
        // its queued work still runs, and only a device-wide wait sees it
        // end, as for the frees of such a stream.
        let mut gone_user = None;
        for user in allocation.uses().to_vec() {
            if user == stream {
                continue;
            }
            if inner.order.reach(user) == Reach::Gone {
                gone_user = Some(user);
                continue;
            }
            let ordered = match self.record_event(user) {
                Ok(ev) => self.wait_event(stream, &ev),
                // Retired and forgotten by the pool, but still running
                // (its entry is gone, not its driver stream): ordered
                // after it by a device event of its own.
                Err(PoolError::StreamRetired { .. }) if inner.order.is_forgotten(user) => {
                    inner.order.wait_for_stateless(stream, user)
                }
                Err(e) => Err(e),
            };
            if let Err(e) = ordered {
                // Another device's stream can never be ordered before this
                // free: report it, and hand the allocation back without it
                // so that it can still be freed.
                if let PoolError::Device(SysError::ForeignHandle { .. }) = e {
                    if let Some(x) = allocation.extra.as_mut() {
                        x.uses.retain(|&u| u != user);
                    }
                }
                return fail(e, allocation);
            }
        }
        // Exported: refused while another process maps it; the close is
        // undone if the free fails below (see share.rs).
        let closed = match inner.share.check_free(allocation.ptr) {
            Ok(c) => c,
            Err(e) => return fail(e, allocation),
        };
        let offset = (allocation.ptr - inner.base) as usize;
        let (len, size) = (allocation.len(), allocation.size as u64);
        if let Some(user) = gone_user {
            if let Err(e) = inner.free_after_gone_user(stream, user, offset, len, size) {
                inner.share.reopen(closed);
                return fail(e, allocation);
            }
            return Ok(());
        }
        let stashed = match inner.order.entry(stream) {
            Ok(e) => match inner.stash_free(&e, offset, len, size) {
                Stashed::Cached => Ok(None),
                Stashed::Spill(epoch) => Ok(Some(epoch)),
                Stashed::Retired => Err(PoolError::StreamRetired { stream }),
            },
            Err(e) => Err(e),
        };
        let spill_epoch = match stashed {
            Ok(spill) => spill,
            Err(e) => {
                inner.share.reopen(closed);
                return fail(e, allocation);
            }
        };
        if let Some(epoch) = spill_epoch {
            inner.spill(stream, offset, len, epoch);
        }
        tracing::trace!(
            pool = inner.id,
            size = allocation.size,
            stream = stream.id(),
            "free"
        );
        Ok(())
    }

    /// Declare that work on `stream` uses the allocation (as PyTorch's
    /// `record_stream`): the free will wait, in stream order, for the work
    /// issued on `stream` up to the free.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tidepool::{MemPool, PoolConfig};
    /// use tidepool_sys::{Device, host::{HostConfig, HostDevice}};
    ///
    /// let device = Arc::new(HostDevice::with_config(HostConfig { capacity: 64 << 20, ..Default::default() }));
    /// // No per-stream cache, so a completed free is open to every stream.
    /// let config = PoolConfig::default().with_va_size(1 << 30).with_stream_cache_bytes(0);
    /// let pool = MemPool::new(device.clone(), config)?;
    /// let (a, u, c) = (device.create_stream()?, device.create_stream()?, device.create_stream()?);
    /// let mut x = pool.alloc_async(4096, a)?;
    /// let addr = x.ptr();
    /// // Work on `u` reads x and is still running (a host task that waits).
    /// let (done, wait) = std::sync::mpsc::channel::<()>();
    /// device.launch_host(u, Box::new(move || { let _ = wait.recv(); }))?;
    /// pool.record_use(&mut x, u);
    /// pool.free_async(x, a)?;
    /// // The free is ordered after u's work: `a` itself now waits for `u`,
    /// // so whatever `a` runs next (e.g. the next user of x's memory)
    /// // cannot overwrite what `u` still reads ...
    /// assert!(!device.query_stream(a)?);
    /// // ... and another stream does not get the memory either.
    /// let y = pool.alloc_async(4096, c)?;
    /// assert_ne!(y.ptr(), addr);
    /// done.send(())?;
    /// pool.free_async(y, c)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// A use on a stream that is being captured into a graph is a use at
    /// every launch of that graph: the allocation's free is then refused
    /// ([`PoolError::CapturedUse`]) until the caller frees it with
    /// [`free_after_graph`](Self::free_after_graph). Uses of graph memory
    /// are the graph's business (order its free node after them) and are
    /// not recorded.
    pub fn record_use(&self, allocation: &mut Allocation, stream: Stream) {
        if allocation.is_graph_memory() {
            return;
        }
        let before = allocation.capture();
        let tag = crate::capture::tag_after_use(&*self.inner.device, before, stream);
        if tag != before {
            allocation.set_capture(tag);
            return;
        }
        if stream != allocation.stream && !allocation.uses().contains(&stream) {
            let extra = allocation.extra.get_or_insert_with(Default::default);
            extra.uses.push(stream);
        }
    }

    /// Record an event on `stream` through the pool.
    pub fn record_event(&self, stream: Stream) -> Result<PoolEvent, PoolError> {
        let inner = &*self.inner;
        let entry = inner.order.entry(stream)?;
        let record = inner.order.record_closing(&mut lock(&entry.state))?;
        Ok(PoolEvent {
            record,
            pool: inner.id,
        })
    }

    /// Make `stream` wait for `event`, and let the pool follow the
    /// dependency: memory freed on the event's stream before the event
    /// becomes reusable on `stream` with no further synchronisation.
    pub fn wait_event(&self, stream: Stream, event: &PoolEvent) -> Result<(), PoolError> {
        let inner = &*self.inner;
        let entry = inner.order.entry(stream)?;
        inner.device.wait_event(stream, event.record.event)?;
        if event.pool == inner.id {
            inner
                .order
                .merge_clock(&mut lock(&entry.state), &event.record.clock);
        }
        Ok(())
    }

    /// Block until `stream`'s work is done; then release memory down to
    /// the release threshold.
    pub fn synchronize_stream(&self, stream: Stream) -> Result<(), PoolError> {
        let inner = &*self.inner;
        let entry = inner.order.entry(stream)?;
        let epoch = lock(&entry.state).close_epoch_synced();
        inner.device.synchronize_stream(stream)?;
        inner.mark_synced(stream.id(), epoch);
        inner.release_to_threshold()
    }

    /// Block until `event` has completed; then release down to the threshold.
    pub fn synchronize_event(&self, event: &PoolEvent) -> Result<(), PoolError> {
        let inner = &*self.inner;
        inner.device.synchronize_event(event.record.event)?;
        if event.pool == inner.id {
            inner.mark_synced(event.record.stream.id(), event.record.epoch);
        }
        inner.release_to_threshold()
    }

    /// Block until every stream the pool has seen is idle (a retired
    /// stream: until its last frees are complete); then release down to
    /// the threshold.
    pub fn synchronize(&self) -> Result<(), PoolError> {
        let inner = &*self.inner;
        for (id, entry) in inner.order.all_streams() {
            let (stream, retired, last) = {
                let st = lock(&entry.state);
                (st.stream, st.retired, st.recorded.back().cloned())
            };
            if retired {
                // Its driver stream may be gone, but the event that closed
                // its last epoch can still be waited for (an epoch it left
                // open with no event is settled by the device-wide wait
                // below, or belongs to a capture and stays pending).
                if let Some(last) = last {
                    inner.device.synchronize_event(last.event)?;
                    inner.mark_synced(id, last.epoch);
                    // Its events up to that one are done (stream order):
                    // none is left to query, so the stream can be
                    // forgotten below rather than at a later slow path.
                    lock(&entry.state).recorded.retain(|r| r.epoch > last.epoch);
                }
                continue;
            }
            // A stream whose state cannot be learned is an error: returning
            // Ok would claim a wait that did not happen.
            match inner.order.reach_checked(stream)? {
                Reach::Live => {
                    let epoch = lock(&entry.state).close_epoch_synced();
                    inner.device.synchronize_stream(stream)?;
                    inner.mark_synced(id, epoch);
                }
                // Destroyed without retire: waited for device-wide below.
                Reach::Gone => lock(&entry.state).close_epoch_orphaned(),
                // Synchronising a stream that is being captured would break
                // the user's capture: skip it (its frees stay pending).
                Reach::Untouchable => {}
            }
        }
        inner.settle_orphans()?;
        if inner.order.retired_waiting() {
            inner.forget_retired();
        }
        inner.purge_forgotten(true);
        inner.release_to_threshold()
    }

    /// Release unused physical memory now until the pool holds at most
    /// `bytes` (or nothing more can be released). Never touches memory of a
    /// live allocation or of a free not known complete. Returns bytes released.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tidepool::{MemPool, PoolConfig};
    /// use tidepool_sys::{Device, host::{HostConfig, HostDevice}};
    ///
    /// let device = Arc::new(HostDevice::with_config(HostConfig { capacity: 64 << 20, ..Default::default() }));
    /// let page = device.granularity() as u64;
    /// // The default release threshold keeps freed memory cached.
    /// let pool = MemPool::new(device.clone(), PoolConfig::default().with_va_size(1 << 30))?;
    /// let s = device.create_stream()?;
    /// let (x, y) = (pool.alloc_async(page as usize, s)?, pool.alloc_async(page as usize, s)?);
    /// pool.free_async(x, s)?;
    /// pool.synchronize_stream(s)?; // the free is now known complete
    /// assert_eq!(pool.stats().reserved_current, 2 * page);
    /// // y is live: only x's page can go back to the device.
    /// assert_eq!(pool.trim_to(0)?, page);
    /// assert_eq!(pool.stats().reserved_current, page);
    /// assert_eq!(device.mem_info()?.free, (64 << 20) - page as usize);
    /// pool.free_async(y, s)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn trim_to(&self, bytes: u64) -> Result<u64, PoolError> {
        self.inner.trim_to(bytes)
    }

    /// A snapshot of the pool's attributes and counters.
    pub fn stats(&self) -> PoolStats {
        let inner = &*self.inner;
        let c = &inner.counters;
        let (streams, used_current, used_high) = inner.counts();
        let st = lock(&inner.arena);
        PoolStats {
            reserved_current: st.arena.reserved(),
            reserved_high: st.arena.reserved_high(),
            used_current,
            used_high,
            allocs: streams.allocs + c.zero_allocs.load(Ordering::Relaxed),
            frees: streams.frees + c.zero_frees.load(Ordering::Relaxed),
            cache_hits: streams.cache_hits,
            growths: st.arena.growths(),
            releases: st.arena.releases(),
            remaps: st.arena.remaps(),
            rebinds: st.arena.rebinds(),
            internal_dependencies: c.internal_dependencies.load(Ordering::Relaxed),
            ooms: c.ooms.load(Ordering::Relaxed),
        }
    }

    /// Two counters of how pages move while frees on them are pending on
    /// the allocating stream, for tests and the trace replayer: pages so
    /// moved, and unmaps of a place such a page moved from made while its
    /// frees were not known complete (a broken rule: always 0).
    #[doc(hidden)]
    pub fn pending_move_counts(&self) -> (u64, u64) {
        let st = lock(&self.inner.arena);
        (st.arena.pending_moves(), st.arena.pending_unmaps())
    }

    /// What the pool keeps per stream now, for tests of stream churn:
    /// these sizes should follow the streams alive (and the frees still
    /// pending), not every stream the pool ever met.
    #[doc(hidden)]
    pub fn stream_footprint(&self) -> StreamFootprint {
        let inner = &*self.inner;
        let [table, forgotten, lingering, clock_entries, busy, watched, retired_waiting] =
            inner.order.footprint();
        let donors = lock(&inner.counters.ledger).donors.len();
        let st = lock(&inner.arena);
        let (observed, synced) = st.done.sizes();
        StreamFootprint {
            table,
            forgotten,
            lingering,
            observed,
            synced,
            clock_entries,
            busy,
            watched,
            retired_waiting,
            donors,
            pending_streams: st.arena.pending_streams(),
            holds: st.arena.holds().count(),
        }
    }

    /// Reset the high-water marks to the current values.
    pub fn reset_peaks(&self) {
        let inner = &*self.inner;
        {
            let mut ledger = lock(&inner.counters.ledger);
            inner.collect_headroom(&mut ledger);
            ledger.used_high -= ledger.unassigned;
            ledger.unassigned = 0;
        }
        let mut st = lock(&inner.arena);
        st.arena.reset_reserved_high();
    }

    /// The reuse switches in force.
    pub fn reuse(&self) -> ReusePolicy {
        self.inner.reuse()
    }

    /// Change the reuse switches (takes effect for later allocations).
    pub fn set_reuse(&self, reuse: ReusePolicy) {
        self.inner.reuse.store(reuse_bits(reuse), Ordering::Relaxed);
    }

    /// The release threshold in force.
    pub fn release_threshold(&self) -> u64 {
        self.inner.release_threshold.load(Ordering::Relaxed)
    }

    /// Change the release threshold.
    pub fn set_release_threshold(&self, bytes: u64) {
        self.inner.release_threshold.store(bytes, Ordering::Relaxed);
    }

    /// Switch between strict capture checking (the default: every
    /// allocation and free asks the driver whether its stream is being
    /// captured, which also sees captures begun by anyone with the raw
    /// driver call) and announced mode (`true`): the caller announces each
    /// capture with [`begin_announced_capture`](Self::begin_announced_capture)
    /// before issuing work on the capturing stream and ends it with
    /// [`end_announced_capture`](Self::end_announced_capture); while no
    /// capture is announced, allocations and frees ask the driver nothing
    /// (one relaxed atomic load). A capture begun without an announcement
    /// is not seen in announced mode. A pool created with
    /// [`PoolConfig::check_capture`] off starts in announced mode.
    pub fn set_announced_captures(&self, announced: bool) {
        let gate = &self.inner.capture_gate;
        if announced {
            gate.fetch_and(!STRICT, Ordering::Relaxed);
        } else {
            gate.fetch_or(STRICT, Ordering::Relaxed);
        }
    }

    /// Announce a capture about to begin on `stream` (announced mode: see
    /// [`set_announced_captures`](Self::set_announced_captures)). While any
    /// announced capture is underway, every allocation and free asks the
    /// driver about its stream, as in strict mode. Announcements nest and
    /// count: each needs its [`end_announced_capture`](Self::end_announced_capture).
    pub fn begin_announced_capture(&self, stream: Stream) {
        let n = self.inner.capture_gate.fetch_add(1, Ordering::Relaxed) & !STRICT;
        tracing::debug!(pool = self.inner.id, %stream, underway = n + 1, "capture announced");
    }

    /// The capture announced on `stream` has ended. An end with no
    /// announcement underway is ignored (logged, and false is returned).
    pub fn end_announced_capture(&self, stream: Stream) -> bool {
        let ended =
            self.inner
                .capture_gate
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |g| {
                    (g & !STRICT > 0).then(|| g - 1)
                });
        if ended.is_err() {
            tracing::warn!(
                pool = self.inner.id,
                %stream,
                "end_announced_capture without a capture announced: ignored"
            );
        }
        ended.is_ok()
    }

    /// Announced captures not yet ended.
    pub fn announced_captures(&self) -> u64 {
        self.inner.capture_gate.load(Ordering::Relaxed) & !STRICT
    }

    /// Forget a stream (before destroying it, or when an adopted raw stream
    /// is retired). Its cached frees go back to the pool, still guarded by
    /// the stream's work; allocating or freeing on it afterwards is an error.
    pub fn retire_stream(&self, stream: Stream) -> Result<(), PoolError> {
        let inner = &*self.inner;
        let entry = match inner.order.entry(stream) {
            // Retired and already forgotten.
            Err(PoolError::StreamRetired { .. }) => return Ok(()),
            r => r?,
        };
        let (drained, orphaned) = {
            let mut st = lock(&entry.state);
            if st.retired {
                return Ok(());
            }
            // Close the epoch, so the pool can still learn when the stream's
            // last frees complete after it is retired (and the driver stream
            // perhaps destroyed): with an event, or — when the driver stream
            // is already gone — by a device-wide wait below.
            if st.frees_in_epoch {
                // State unknown: retiring anyway would strand the frees under
                // an epoch nothing closes; the caller may retry.
                match inner.order.reach_checked(stream)? {
                    Reach::Live => {
                        inner.order.record_closing(&mut st)?;
                    }
                    Reach::Gone => st.close_epoch_orphaned(),
                    Reach::Untouchable => {}
                }
            }
            st.retired = true;
            (st.drain_cache(), st.orphaned.is_some())
        };
        {
            let opportunistic = inner.reuse().opportunistic;
            let mut arena = lock(&inner.arena);
            let ArenaState { arena, done, .. } = &mut *arena;
            for (len, b) in drained {
                arena.give_back_settling(
                    b.offset,
                    len,
                    Guard::After {
                        stream: stream.id(),
                        epoch: b.epoch,
                    },
                    |s| done.settled(s, opportunistic),
                );
            }
        }
        inner.order.note_retired(stream);
        if orphaned {
            inner.settle_orphans()?;
        }
        // This stream, once its last events are seen complete, and those
        // retired before it that are done by now leave the stream table.
        inner.forget_retired();
        Ok(())
    }
}

/// The raw-pointer API for foreign callers (the C ABI): pointers instead
/// of [`Allocation`] handles, with double frees and stray pointers
/// detected.
impl<D: Device> MemPool<D> {
    /// [`alloc_async`](Self::alloc_async) for callers that keep pointers.
    /// Size 0 returns 0 (null) and is not counted as an allocation, just as
    /// freeing null is not counted as a free: a caller cannot tell the
    /// null of a size-0 allocation from any other null, so only counting
    /// neither keeps allocations minus frees equal to the live allocations.
    pub fn alloc_raw(&self, size: usize, stream: Stream) -> Result<DevicePtr, PoolError> {
        if size == 0 {
            return Ok(0);
        }
        let a = self.alloc_in(size, stream, false)?;
        let ptr = a.ptr();
        if ptr == 0 {
            return Ok(0);
        }
        self.inner.raw.insert(ptr, a);
        Ok(ptr)
    }

    /// [`free_async`](Self::free_async) by pointer. Freeing 0 is a no-op.
    /// A pointer that is not live gets a typed error and changes nothing.
    pub fn free_raw(&self, ptr: DevicePtr, stream: Stream) -> Result<(), PoolError> {
        if ptr == 0 {
            return Ok(());
        }
        let allocation = self.inner.raw.take(ptr, |p| self.contains(p))?;
        match self.free_async(allocation, stream) {
            Ok(()) => Ok(()),
            Err(failed) => {
                self.inner.raw.insert(ptr, failed.allocation);
                Err(failed.error)
            }
        }
    }

    /// [`record_use`](Self::record_use) by pointer.
    ///
    /// The raw-pointer API does not serve captures: a use on a stream being
    /// captured is refused ([`PoolError::StreamCapturing`]) and not recorded.
    pub fn record_use_raw(&self, ptr: DevicePtr, stream: Stream) -> Result<(), PoolError> {
        let mut refused = false;
        self.inner.raw.with_live(
            ptr,
            |p| self.contains(p),
            |a| {
                let before = a.capture();
                self.record_use(a, stream);
                if a.capture() != before {
                    a.set_capture(before);
                    refused = true;
                }
            },
        )?;
        if refused {
            return Err(PoolError::StreamCapturing { stream });
        }
        Ok(())
    }

    /// Size in bytes of the live raw allocation at `ptr`.
    pub fn raw_size(&self, ptr: DevicePtr) -> Option<usize> {
        self.inner.raw.size(ptr)
    }
}

impl RawSize for Allocation {
    fn bytes(&self) -> usize {
        self.size
    }
}

/// The device's default pool (created on first use with the default
/// configuration and kept for the life of the process), as
/// `cudaDeviceGetDefaultMemPool` gives.
///
/// ```
/// use std::sync::Arc;
/// use tidepool::default_pool;
/// use tidepool_sys::{Device, host::{HostConfig, HostDevice}};
///
/// let device = Arc::new(HostDevice::with_config(HostConfig { capacity: 64 << 20, ..Default::default() }));
/// let s = device.create_stream()?;
/// let x = default_pool(&device)?.alloc_async(4096, s)?;
/// // Every call gives the same pool: it knows the allocation.
/// let pool = default_pool(&device)?;
/// assert_eq!(pool.stats().used_current, 4096);
/// pool.free_async(x, s)?;
/// // Another device gets a pool of its own.
/// let other = Arc::new(HostDevice::with_config(HostConfig { capacity: 64 << 20, ..Default::default() }));
/// assert_ne!(default_pool(&other)?.id(), pool.id());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn default_pool<D: Device>(device: &Arc<D>) -> Result<MemPool<D>, PoolError> {
    let key = (
        crate::registry::device_key(&**device),
        std::any::TypeId::of::<D>(),
    );
    crate::registry::default_for(key, || MemPool::new(device.clone(), PoolConfig::default()))
}

/// Where a free went (see `PoolInner::stash_free`).
enum Stashed {
    /// Into the stream's cache.
    Cached,
    /// Not cached: to the arena, guarded by this epoch of the stream.
    Spill(u64),
    /// Nowhere: the stream is retired.
    Retired,
}

/// What the fast path of an allocation found.
enum Hit<'a> {
    /// A block at `offset`.
    Block { offset: usize },
    /// The stream runs its work, is not retired, and its cache has no
    /// block of the size: the slow path need not ask again.
    Miss,
    /// [`Hit::Miss`] on the entry in the stream's slot, with the
    /// allocation marked in flight there under the same lock (see
    /// `AllocInFlight`), what the stream has waited on, and the entry (so
    /// that the slow path need not look it up again).
    Marked(VectorClock, SlotRef<'a, Arc<StreamEntry>>),
    /// Anything else (size 0 or too large, the entry not at hand, a
    /// stream that is captured, destroyed or retired): nothing was done.
    Other,
}

impl<D: Device> PoolInner<D> {
    /// Whether allocations and frees must ask the device about capture
    /// now (see [`MemPool::set_announced_captures`]): always in strict
    /// mode; in announced mode only while a capture is announced. One
    /// relaxed load of the capture gate.
    #[inline]
    pub(crate) fn capture_check_needed(&self) -> bool {
        self.capture_gate.load(Ordering::Relaxed) != 0
    }

    /// The fast path of an allocation: on the entry this thread has at
    /// hand, ask whether the stream runs its work (through the entry's
    /// probe: the capture query while the capture gate is set, only the
    /// liveness flag otherwise), then take a block of exactly the rounded
    /// length from its cache. Changes nothing unless it returns a block.
    #[inline(always)]
    fn alloc_hit(&self, size: usize, stream: Stream) -> Hit<'_> {
        // Sizes 1 ..= va_size; the rest (0, too large) is the slow path's.
        if size.wrapping_sub(1) >= self.va_size {
            return Hit::Other;
        }
        // No overflow: size <= va_size, itself a rounded usize.
        let len = (size + (ALIGNMENT - 1)) & !(ALIGNMENT - 1);
        let check = self.capture_check_needed();
        match self.order.direct_entry(stream) {
            Some(slot) => self.alloc_on(Some(slot), None, stream, size, len, check),
            None => self.alloc_on_recent(stream, size, len, check),
        }
    }

    /// [`PoolInner::alloc_hit`] for a stream without a slot of its own.
    #[inline(never)]
    fn alloc_on_recent(&self, stream: Stream, size: usize, len: usize, check: bool) -> Hit<'_> {
        match self.order.recent_entry(stream) {
            Some(e) => self.alloc_on(None, Some(&e), stream, size, len, check),
            None => Hit::Other,
        }
    }

    /// [`PoolInner::alloc_hit`] on the stream's entry: the one in the
    /// stream's slot (`slot`), else `recent`. On the slot's entry a miss
    /// marks the allocation in flight there under the lock already held
    /// ([`Hit::Marked`]), so that the slow path does not lock the stream
    /// again to do it.
    #[inline(always)]
    fn alloc_on<'a>(
        &self,
        slot: Option<SlotRef<'a, Arc<StreamEntry>>>,
        recent: Option<&StreamEntry>,
        stream: Stream,
        size: usize,
        len: usize,
        check: bool,
    ) -> Hit<'a> {
        let e: &StreamEntry = match (&slot, recent) {
            (Some(s), _) => s,
            (None, Some(r)) => r,
            (None, None) => return Hit::Other,
        };
        if !e.runs_now(&*self.device, stream, check) {
            return Hit::Other;
        }
        let mut st = lock(&e.state);
        if st.retired {
            return Hit::Other;
        }
        let Some(block) = st.cache.pop(len) else {
            if slot.is_none() {
                return Hit::Miss;
            }
            let clock = crate::ordering::AllocInFlight::mark_held(&mut st);
            drop(st);
            return Hit::Marked(clock, slot.expect("checked"));
        };
        st.cached_bytes -= len;
        let missing = self.counters.on_alloc(&mut st.counters, size as u64, true);
        drop(st);
        self.claim_headroom(missing);
        Hit::Block {
            offset: block.offset,
        }
    }

    /// The fast path of a free: an eager block of this pool with no
    /// declared uses, while the pool exports nothing, on a running stream
    /// whose entry is at hand: into the stream's cache (or to the arena
    /// when the cache is full). `true` when done; otherwise nothing was
    /// done and the slow path takes the free from the start.
    #[inline(always)]
    fn free_hit(&self, a: &Allocation, stream: Stream) -> bool {
        if a.pool != self.id || a.size == 0 || !a.is_plain() || self.share.exports_any() {
            return false;
        }
        let check = self.capture_check_needed();
        // `as_deref`: an `Option<&Arc<_>>` already in std, a clone under loom.
        #[allow(clippy::needless_option_as_deref)]
        match self.order.direct_entry(stream).as_deref() {
            Some(e) => self.free_on(e, a, stream, check),
            None => self.free_on_recent(a, stream, check),
        }
    }

    /// [`PoolInner::free_hit`] for a stream without a slot of its own.
    #[inline(never)]
    fn free_on_recent(&self, a: &Allocation, stream: Stream, check: bool) -> bool {
        match self.order.recent_entry(stream) {
            Some(e) => self.free_on(&e, a, stream, check),
            None => false,
        }
    }

    /// [`PoolInner::free_hit`] on the stream's entry.
    #[inline(always)]
    fn free_on(&self, e: &StreamEntry, a: &Allocation, stream: Stream, check: bool) -> bool {
        if !e.runs_now(&*self.device, stream, check) {
            return false;
        }
        let offset = (a.ptr - self.base) as usize;
        let len = a.len();
        match self.stash_free(e, offset, len, a.size as u64) {
            Stashed::Cached => {}
            Stashed::Spill(epoch) => self.spill(stream, offset, len, epoch),
            // The slow path reports it.
            Stashed::Retired => return false,
        }
        true
    }

    /// A free that does not go to the stream's cache goes to the arena;
    /// other streams' next slow allocation learns when it completes.
    #[cold]
    fn spill(&self, stream: Stream, offset: usize, len: usize, epoch: u64) {
        let opportunistic = self.reuse().opportunistic;
        let mut st = lock(&self.arena);
        let ArenaState { arena, done, .. } = &mut *st;
        arena.give_back_settling(
            offset,
            len,
            Guard::After {
                stream: stream.id(),
                epoch,
            },
            |s| done.settled(s, opportunistic),
        );
        drop(st);
        self.order.watch_stream(stream);
    }

    /// Step 0 of an allocation: a block of exactly `len` bytes from the
    /// stream's own cache (freed on this stream, so no event is needed).
    #[inline]
    fn take_cached(
        &self,
        entry: &StreamEntry,
        stream: Stream,
        size: usize,
        len: usize,
    ) -> Result<Option<usize>, PoolError> {
        let mut st = lock(&entry.state);
        if st.retired {
            return Err(PoolError::StreamRetired { stream });
        }
        let Some(block) = st.cache.pop(len) else {
            return Ok(None);
        };
        st.cached_bytes -= len;
        let missing = self.counters.on_alloc(&mut st.counters, size as u64, true);
        drop(st);
        self.claim_headroom(missing);
        tracing::trace!(
            pool = self.id,
            size,
            stream = stream.id(),
            "alloc (stream cache)"
        );
        Ok(Some(block.offset))
    }

    /// A block of exactly `len` bytes from the private cache of a stream
    /// this one has waited on through the pool, freed there no later than
    /// the epoch the wait covers: all the work before that free is ordered
    /// before this stream's later work, so the block is this stream's at
    /// once (the "follow event dependencies" rule), without moving any
    /// cache into the arena. Visits only the streams in this stream's
    /// clock. The stream's own lock is not held while another's is taken.
    fn take_followed(
        &self,
        entry: &StreamEntry,
        stream: Stream,
        size: usize,
        len: usize,
        clock: &VectorClock,
    ) -> Option<usize> {
        let me = stream.id();
        let (block, from) = clock
            .iter()
            .filter(|&(s, _)| s != me)
            .find_map(|(s, covered)| {
                let other = self.order.entry_by_id(s)?;
                let mut o = lock(&other.state);
                let b = o.cache.take_covered(len, covered)?;
                o.cached_bytes -= len;
                Some((b, s))
            })?;
        let missing = {
            let mut st = lock(&entry.state);
            self.counters.on_alloc(&mut st.counters, size as u64, false)
        };
        self.claim_headroom(missing);
        tracing::trace!(
            pool = self.id,
            size,
            stream = me,
            from,
            epoch = block.epoch,
            "alloc (cache of a stream waited on)"
        );
        Some(block.offset)
    }

    /// Record a free in the stream's state: into its cache while the cache
    /// has room (one block of any size may always stay: a stream that frees
    /// and reallocates 1 GiB would otherwise pay the arena's page
    /// bookkeeping each time; caches join the arena before any growth, so
    /// this never costs footprint). A stream that has never allocated (a
    /// consumer that frees what a producer allocated) caches nothing: its
    /// cache would only be flushed, all of it, by someone else's slow
    /// allocation, so its frees go to the arena at once, where the
    /// producer's next allocation can see them complete. Returns the epoch
    /// to guard the range with when it goes to the arena instead.
    #[inline(always)]
    fn stash_free(&self, entry: &StreamEntry, offset: usize, len: usize, size: u64) -> Stashed {
        let mut st = lock(&entry.state);
        if st.retired {
            return Stashed::Retired;
        }
        st.frees_in_epoch = true;
        self.order.note_busy(&mut st);
        self.counters.on_free(&mut st.counters, size);
        let new_donor = !std::mem::replace(&mut st.donor, true);
        let epoch = st.epoch;
        let limit = self.config.stream_cache_bytes;
        let stashed = if limit > 0
            && st.counters.allocs > 0
            && (st.cached_bytes + len <= limit || st.cached_bytes == 0)
        {
            st.cached_bytes += len;
            st.cache.push(len, CachedBlock { offset, epoch });
            Stashed::Cached
        } else {
            Stashed::Spill(epoch)
        };
        let id = st.stream.id();
        drop(st);
        if new_donor {
            self.list_donor(id);
        }
        stashed
    }

    /// List `stream` as holding headroom (its `donor` flag was just set).
    /// Called with no stream lock held: the ledger is locked before stream
    /// locks.
    #[cold]
    fn list_donor(&self, id: u64) {
        lock(&self.counters.ledger).donors.push(id);
    }

    /// A free whose declared user stream `user` was destroyed without
    /// retirement: counted on the freeing stream, and guarded by an epoch
    /// of `user` closed with no event, which completes only by a
    /// device-wide wait ([`Self::settle_orphans`]). That wait also covers
    /// the freeing stream's work before the free, so the one guard is
    /// enough.
    fn free_after_gone_user(
        &self,
        stream: Stream,
        user: Stream,
        offset: usize,
        len: usize,
        size: u64,
    ) -> Result<(), PoolError> {
        let entry = self.order.entry(stream)?;
        // A user the pool has forgotten has no entry to hold the epoch.
        let user_entry = match self.order.entry(user) {
            Ok(e) => Some(e),
            Err(PoolError::StreamRetired { .. }) if self.order.is_forgotten(user) => None,
            Err(e) => return Err(e),
        };
        let mut arena = lock(&self.arena);
        let new_donor = {
            let mut st = lock(&entry.state);
            if st.retired {
                return Err(PoolError::StreamRetired { stream });
            }
            self.counters.on_free(&mut st.counters, size);
            !std::mem::replace(&mut st.donor, true)
        };
        let epoch = match &user_entry {
            Some(user_entry) => {
                let mut u = lock(&user_entry.state);
                u.frees_in_epoch = true;
                u.close_epoch_orphaned();
                u.orphaned.expect("an epoch with a free was just closed")
            }
            None => self.order.orphan_forgotten(user.id()),
        };
        let opportunistic = self.reuse().opportunistic;
        let ArenaState { arena: a, done, .. } = &mut *arena;
        a.give_back_settling(
            offset,
            len,
            Guard::After {
                stream: user.id(),
                epoch,
            },
            |s| done.settled(s, opportunistic),
        );
        drop(arena);
        if new_donor {
            self.list_donor(stream.id());
        }
        tracing::debug!(
            pool = self.id,
            %user,
            "free after its declared user stream was destroyed: reusable after a device-wide wait"
        );
        Ok(())
    }

    /// Wait device-wide for the frees of streams destroyed before an
    /// event could be recorded on them (see
    /// [`StreamOrder::settle_orphans`]); each settled epoch is recorded as
    /// synchronised under the arena's lock, which the wait does not hold.
    pub(crate) fn settle_orphans(&self) -> Result<bool, PoolError> {
        self.order
            .settle_orphans(|id, epoch| self.mark_synced(id, epoch))
    }

    /// Host-synchronised up to `epoch` on stream `id`.
    /// A stream forgotten since (the wait held no lock) and that no guard
    /// names any more gets no entry back.
    pub(crate) fn mark_synced(&self, id: u64, epoch: u64) {
        let mut st = lock(&self.arena);
        if self.order.is_known(id) {
            st.done.mark_synced(id, epoch);
        }
    }

    /// Finish counting an allocation whose stream lacked `missing` bytes of
    /// headroom (see [`crate::stats::Ledger`]). Called with no stream lock
    /// held (the ledger is locked before stream locks).
    #[inline]
    pub(crate) fn claim_headroom(&self, missing: u64) {
        if missing != 0 {
            self.claim_headroom_from_ledger(missing);
        }
    }

    /// [`Self::claim_headroom`] of a stream short of headroom: the one
    /// pool-wide lock an allocation may take outside the slow path.
    #[cold]
    fn claim_headroom_from_ledger(&self, missing: u64) {
        let mut ledger = lock(&self.counters.ledger);
        if ledger.unassigned < missing {
            self.collect_donors(&mut ledger);
        }
        if ledger.unassigned >= missing {
            ledger.unassigned -= missing;
        } else {
            ledger.used_high += missing - ledger.unassigned;
            ledger.unassigned = 0;
        }
    }

    /// Move the headroom of the listed donors into the ledger (every
    /// stream with headroom is listed, except one whose free is between
    /// taking headroom and listing itself: that free is ordered, for the
    /// count, after this collection).
    fn collect_donors(&self, ledger: &mut crate::stats::Ledger) {
        for id in std::mem::take(&mut ledger.donors) {
            if let Some(e) = self.order.entry_by_id(id) {
                let mut st = lock(&e.state);
                st.donor = false;
                ledger.unassigned += std::mem::take(&mut st.counters.headroom);
            }
        }
    }

    /// Move every stream's headroom into the ledger.
    pub(crate) fn collect_headroom(&self, ledger: &mut crate::stats::Ledger) {
        ledger.donors.clear();
        for (_, e) in self.order.all_streams() {
            let mut st = lock(&e.state);
            st.donor = false;
            ledger.unassigned += std::mem::take(&mut st.counters.headroom);
        }
    }

    /// The streams' counters summed, `used_current` and `used_high`.
    pub(crate) fn counts(&self) -> (crate::stats::StreamCounters, u64, u64) {
        let ledger = lock(&self.counters.ledger);
        let mut sum = crate::stats::StreamCounters {
            headroom: 0,
            ..ledger.forgotten
        };
        for (_, e) in self.order.all_streams() {
            let c = lock(&e.state).counters;
            sum.allocs += c.allocs;
            sum.frees += c.frees;
            sum.cache_hits += c.cache_hits;
            sum.headroom += c.headroom;
        }
        let used = ledger
            .used_high
            .saturating_sub(ledger.unassigned)
            .saturating_sub(sum.headroom);
        (sum, used, ledger.used_high)
    }

    /// Drop from the stream table the retired streams nothing needs any
    /// more, keeping their counts (headroom to the ledger's unassigned
    /// bytes, the rest summed). Called with no lock held.
    /// Then drop what is known of the forgotten streams that no guard
    /// names any more ([`StreamOrder::purge_forgotten`]).
    #[cold]
    pub(crate) fn forget_retired(&self) {
        {
            let mut ledger = lock(&self.counters.ledger);
            let ledger = &mut *ledger;
            self.order.forget_retired(|st| {
                let c = std::mem::take(&mut st.counters);
                ledger.unassigned += c.headroom;
                ledger.forgotten.allocs += c.allocs;
                ledger.forgotten.frees += c.frees;
                ledger.forgotten.cache_hits += c.cache_hits;
                if std::mem::take(&mut st.donor) {
                    // Its headroom was just taken: off the donor list.
                    let id = st.stream.id();
                    ledger.donors.retain(|&d| d != id);
                }
            });
        }
        self.purge_forgotten(false);
    }

    /// Drop what is known of the forgotten streams that no guard names
    /// any more ([`StreamOrder::purge_forgotten`]). `synced`: the host
    /// has just waited for all the device's work (a pool-wide
    /// synchronise), so the frees still guarded by a forgotten stream's
    /// epochs, whose work was seen complete before it was forgotten, are
    /// synchronised too: reusable by every stream, whatever the policy.
    fn purge_forgotten(&self, synced: bool) {
        if !self.order.any_unpurged() {
            return;
        }
        let opportunistic = self.reuse().opportunistic;
        let purged = {
            let mut st = lock(&self.arena);
            let ArenaState { arena, done, .. } = &mut *st;
            if synced {
                for id in self.order.unpurged_ids() {
                    let seen = done.observed(id);
                    done.mark_synced(id, seen);
                }
            }
            self.order.purge_forgotten(arena, done, opportunistic)
        };
        self.order.prune_clocks(&purged);
    }

    /// Bytes in live allocations now.
    pub(crate) fn used_current(&self) -> u64 {
        self.counts().1
    }

    #[inline]
    pub fn reuse(&self) -> ReusePolicy {
        reuse_of_bits(self.reuse.load(Ordering::Relaxed))
    }

    /// The parts of the pool the reuse policy works with.
    fn parts(&self) -> crate::policy::Parts<'_, D> {
        crate::policy::Parts {
            order: &self.order,
            arena: &self.arena,
            pages: self.pages(),
            counters: &self.counters,
        }
    }

    /// The page mapper over this pool's address range.
    fn pages(&self) -> Pages<'_, D> {
        Pages {
            pool: self.id,
            device: &*self.device,
            base: self.base,
            config: &self.config,
            share: &self.share,
        }
    }

    /// Release physical memory until at most `target` bytes are held
    /// (every stream's cache joins the arena and completions are observed
    /// first, so that everything releasable is known).
    pub(crate) fn trim_to(&self, target: u64) -> Result<u64, PoolError> {
        let mut st = lock(&self.arena);
        {
            let ArenaState { arena, done, .. } = &mut *st;
            let opportunistic = self.reuse().opportunistic;
            self.order.flush_caches(arena, done, opportunistic);
            self.order.observe_completions(arena, done, opportunistic);
        }
        let released = self.pages().trim(&mut st, target)?;
        drop(st);
        if self.order.retired_waiting() {
            // Completions were just observed: retired streams may be done.
            self.forget_retired();
        } else {
            // The trim may have dropped the last ranges or held mappings
            // guarded by a forgotten stream's epochs.
            self.purge_forgotten(false);
        }
        if released > 0 {
            tracing::debug!(pool = self.id, released, target, "trimmed");
        }
        Ok(released)
    }

    fn release_to_threshold(&self) -> Result<(), PoolError> {
        let threshold = self.release_threshold.load(Ordering::Relaxed);
        if threshold == u64::MAX {
            return Ok(());
        }
        if lock(&self.arena).arena.reserved() > threshold {
            self.trim_to(threshold)?;
        }
        Ok(())
    }
}

impl<D: Device> CacheHolder for PoolInner<D> {
    fn release_cached(&self) -> u64 {
        self.trim_to(0).unwrap_or(0)
    }
}

impl<D: Device> Drop for PoolInner<D> {
    fn drop(&mut self) {
        crate::registry::unregister(self.id);
        // Imports of other pools' memory.
        self.share.release_all_imports(&*self.device);
        // Map, unmap and release act at once: wait for every free's device
        // work before taking the memory away (no arena lock is held while
        // waiting).
        self.order.wait_all_for_drop();
        // Streams destroyed with frees pending: their work may still use the
        // memory about to be unmapped.
        match self.settle_orphans() {
            Ok(true) => {}
            Ok(false) => tracing::warn!(
                pool = self.id,
                "pool dropped while frees of destroyed streams may still run"
            ),
            Err(e) => {
                tracing::warn!(error = %e, "waiting for destroyed streams while dropping the pool failed")
            }
        }
        let used = self.used_current();
        if used > 0 {
            tracing::warn!(
                pool = self.id,
                used,
                "pool dropped with live allocations; their memory is released"
            );
        }
        let mut st = lock(&self.arena);
        self.pages().unmap_all(&mut st);
        drop(st);
        if let Err(e) = self.device.free_va(self.base, self.va_size) {
            tracing::warn!(error = %e, "freeing the pool's address range failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tidepool_sys::{HostConfig, HostDevice};

    /// Two streams whose ids share a slot of the table of entries found
    /// with no lookup: each is served from its own entry. The second must
    /// not get the block the first one cached (its work may still use it,
    /// and nothing orders the two streams), and each stream's next
    /// allocation is a hit in its own cache.
    #[test]
    fn streams_sharing_a_direct_slot_keep_their_own_entries() {
        crate::sync::model(shared_slot_body);
    }

    fn shared_slot_body() {
        let len = crate::sync::OnceSlots::<()>::LEN as u64;
        let dev = Arc::new(HostDevice::with_config(HostConfig {
            capacity: 16 << 20,
            granularity: 2 << 20,
        }));
        let pool = MemPool::new(dev.clone(), PoolConfig::default().with_va_size(64 << 20)).unwrap();
        let a = dev.create_stream().unwrap();
        // Stream ids count up (shared with other tests' devices): the
        // first one of the same residue.
        let b = (0..64 * len)
            .map(|_| dev.create_stream().unwrap())
            .find(|b| b.id() % len == a.id() % len)
            .expect("a stream id of the same residue");
        let x = pool.alloc_async(4096, a).unwrap();
        let px = x.ptr();
        pool.free_async(x, a).unwrap();
        let y = pool.alloc_async(4096, b).unwrap();
        let py = y.ptr();
        assert_ne!(py, px, "b got the block cached on a");
        assert_eq!(pool.stats().cache_hits, 0);
        pool.free_async(y, b).unwrap();
        let x = pool.alloc_async(4096, a).unwrap();
        let y = pool.alloc_async(4096, b).unwrap();
        assert_eq!((x.ptr(), y.ptr()), (px, py));
        assert_eq!(pool.stats().cache_hits, 2);
        pool.free_async(x, a).unwrap();
        pool.free_async(y, b).unwrap();
        pool.synchronize().unwrap();
    }

    /// Retired streams leave the stream table once nothing needs their
    /// entries (here: after a trim observed their last events complete),
    /// the pool's counts stay exact, and a forgotten stream is refused as
    /// retired, not met anew.
    #[test]
    fn retired_streams_are_forgotten_and_stay_refused() {
        crate::sync::model(retired_streams_body);
    }

    fn retired_streams_body() {
        let dev = Arc::new(HostDevice::with_config(HostConfig {
            capacity: 16 << 20,
            granularity: 2 << 20,
        }));
        let pool = MemPool::new(dev.clone(), PoolConfig::default().with_va_size(64 << 20)).unwrap();
        let order = &pool.inner.order;
        let keep = dev.create_stream().unwrap();
        let kept = pool.alloc_async(4096, keep).unwrap();
        let mut retired = Vec::new();
        for round in 0..40 {
            let s = dev.create_stream().unwrap();
            let a = pool.alloc_async(4096 + 512 * (round % 3), s).unwrap();
            pool.free_async(a, s).unwrap();
            pool.retire_stream(s).unwrap();
            pool.synchronize_stream(keep).unwrap();
            dev.synchronize_stream(s).unwrap();
            pool.trim_to(u64::MAX).unwrap();
            retired.push(s);
            // This round's stream may wait for the next pass; no more.
            assert!(
                order.table_len() <= 3,
                "round {round}: {}",
                order.table_len()
            );
        }
        pool.trim_to(u64::MAX).unwrap();
        pool.retire_stream(keep).unwrap_or(());
        let stats = pool.stats();
        assert_eq!((stats.allocs, stats.frees), (41, 40));
        assert_eq!(stats.used_current, 4096);
        for s in retired {
            assert!(matches!(
                pool.alloc_async(4096, s),
                Err(PoolError::StreamRetired { .. })
            ));
            pool.retire_stream(s).expect("retiring again is a no-op");
        }
        let k2 = dev.create_stream().unwrap();
        pool.free_async(kept, k2).unwrap();
        assert_eq!(pool.stats().used_current, 0);
    }

    /// An allocation that the fast path found no cached block for is
    /// marked in flight by the fast path and ended by the slow path: once
    /// done, nothing keeps the retired stream's entry from being
    /// forgotten.
    #[test]
    fn a_stream_whose_fast_path_missed_is_forgotten_once_retired() {
        crate::sync::model(fast_path_missed_body);
    }

    fn fast_path_missed_body() {
        let dev = Arc::new(HostDevice::with_config(HostConfig {
            capacity: 16 << 20,
            granularity: 2 << 20,
        }));
        let pool = MemPool::new(dev.clone(), PoolConfig::default().with_va_size(64 << 20)).unwrap();
        let order = &pool.inner.order;
        let keep = dev.create_stream().unwrap();
        let kept = pool.alloc_async(4096, keep).unwrap();
        for round in 0..40 {
            let s = dev.create_stream().unwrap();
            // The first allocation makes the stream's entry (and slot);
            // the second, of a size the cache does not hold, misses on
            // the fast path and is served by the slow path.
            let a = pool.alloc_async(4096, s).unwrap();
            let b = pool.alloc_async(8192, s).unwrap();
            pool.free_async(a, s).unwrap();
            pool.free_async(b, s).unwrap();
            pool.retire_stream(s).unwrap();
            pool.synchronize_stream(keep).unwrap();
            dev.synchronize_stream(s).unwrap();
            pool.trim_to(u64::MAX).unwrap();
            assert!(
                order.table_len() <= 3,
                "round {round}: {} entries kept",
                order.table_len()
            );
        }
        let stats = pool.stats();
        assert_eq!((stats.allocs, stats.frees), (81, 80));
        pool.free_async(kept, keep).unwrap();
    }
}
