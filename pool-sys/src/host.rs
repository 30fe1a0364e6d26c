//! The host backend: a [`Device`] made of ordinary OS objects, as strict as
//! the CUDA driver's VMM API so that a design that passes here does not fail
//! on the GPU.
//!
//! | device concept | host stand-in |
//! |---|---|
//! | physical memory handle | one `memfd` per handle, sized with `ftruncate` (no page is touched) |
//! | VA reservation | `mmap(NULL, size, PROT_NONE, MAP_PRIVATE\|MAP_ANONYMOUS\|MAP_NORESERVE)` |
//! | map | `mmap(ptr, size, PROT_NONE, MAP_SHARED\|MAP_FIXED, memfd, offset)` (no access yet) |
//! | set access | `mprotect` |
//! | unmap | `mmap(PROT_NONE, MAP_PRIVATE\|MAP_ANONYMOUS\|MAP_FIXED\|MAP_NORESERVE)` over the range (never `munmap`, which would hand the addresses to others) |
//! | stream | a worker thread running [`HostTask`]s in FIFO order |
//! | event | a (stream, sequence number) pair; complete when the stream has run that many tasks |
//!
//! Rules enforced like the driver: sizes, offsets and pointers are multiples
//! of the granularity; maps only land on unmapped pages inside a reservation
//! of this device; `unmap` covers exactly one earlier `map`; a fresh mapping
//! has no access until `set_access`; a released handle lives on while it is
//! still mapped (like `cuMemRelease`); waiting on a never-recorded event is a
//! no-op; a destroyed stream still runs its queued work.
//!
//! [`Device::mem_info`] reports `total` = the configured capacity and
//! `free` = capacity minus the bytes of physical memory created and still
//! alive: a handle released while still mapped counts until its last
//! mapping goes, as on the GPU. Imported handles ([`Device::import_fd`])
//! belong to their exporter's budget and do not count.
//!
//! Device memory is reached from the host only through the checked paths
//! [`HostDevice::launch_on_words`], [`HostDevice::write_words`] and
//! [`HostDevice::read_words`], which verify under a read lock of the mapping
//! table that the range is mapped with the needed access; map, unmap and
//! set-access take the write lock, so no access races an unmap.

use crate::device::{
    Access, AccessDesc, CaptureMode, CaptureStatus, Device, DevicePtr, Event, Graph, GraphExec,
    GraphOptions, HostTask, MemInfo, Physical, PhysicalOptions, Stream, StreamProbe,
};
use crate::error::{Op, SysError, SysResult};
use crate::validate::{check_granular, check_size, invalid, missing_stream, stream_id};
use rustix::fs::{fstat, ftruncate, memfd_create, MemfdFlags};
use rustix::io::Errno;
use rustix::mm::{MapFlags, MprotectFlags, ProtFlags};
use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Once, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::thread::JoinHandle;

mod graph;
mod share;

use graph::{CaptureEntry, Task};

/// One process-wide counter for every id the host backend issues but
/// streams' (events, physical handles, graphs, captures), so that no such id
/// is ever issued twice, even across devices and after a destroy. Streams
/// count apart, per instance (see `HostDevice::next_stream`).
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn next_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

/// Default capacity of a [`HostDevice`]: 64 GiB.
///
/// This is a budget, not an allocation: the bundled GPT-2 traces reserve up
/// to ~15 GB of physical memory but never touch the pages, and a memfd that
/// is never written costs no RAM. Tests that run in parallel should use a
/// smaller capacity (~1 GiB) through [`HostDevice::with_config`].
pub const DEFAULT_CAPACITY: usize = 64 << 30;

/// Default granularity of a [`HostDevice`]: 2 MiB, the value
/// `cuMemGetAllocationGranularity` reports on the H200.
pub const DEFAULT_GRANULARITY: usize = 2 << 20;

/// The one device ordinal that exists on the host backend.
const HOST_ORDINAL: i32 = 0;

/// Configuration of a [`HostDevice`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostConfig {
    /// Total "device memory" in bytes: physical memory created beyond it
    /// fails with [`SysError::OutOfMemory`]. Default [`DEFAULT_CAPACITY`].
    pub capacity: usize,
    /// Granularity of physical memory and mappings in bytes; a power of two
    /// and a multiple of the OS page size. Default [`DEFAULT_GRANULARITY`].
    pub granularity: usize,
}

impl Default for HostConfig {
    fn default() -> Self {
        HostConfig {
            capacity: DEFAULT_CAPACITY,
            granularity: DEFAULT_GRANULARITY,
        }
    }
}

// ---------------------------------------------------------------------------
// helpers

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn read<T>(m: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(|e| e.into_inner())
}

fn write<T>(m: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(|e| e.into_inner())
}

fn os_err(op: Op, e: Errno) -> SysError {
    SysError::Os {
        op,
        errno: e.raw_os_error(),
        message: e.to_string(),
    }
}

fn as_void(ptr: DevicePtr) -> *mut c_void {
    ptr as usize as *mut c_void
}

/// Raise the soft RLIMIT_NOFILE to the hard limit, once per process: every
/// physical handle is a file descriptor, and a GPT-2 replay holds ~5,000.
fn raise_fd_limit() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        use rustix::process::{Resource, getrlimit, setrlimit};
        let lim = getrlimit(Resource::Nofile);
        if lim.current == lim.maximum {
            return;
        }
        let new = rustix::process::Rlimit {
            current: lim.maximum,
            maximum: lim.maximum,
        };
        match setrlimit(Resource::Nofile, new) {
            Ok(()) => tracing::debug!(
                from = ?lim.current,
                to = ?lim.maximum,
                "host backend: raised RLIMIT_NOFILE soft limit"
            ),
            Err(e) => tracing::warn!(
                error = %e,
                "host backend: could not raise RLIMIT_NOFILE; many physical handles may fail with EMFILE"
            ),
        }
    });
}

// ---------------------------------------------------------------------------
// physical memory

/// One physical handle: a memfd. Shared (`Arc`) by the handle table and by
/// every mapping of it, so that a released handle lives on while mapped; the
/// bytes go back to the capacity when the last reference goes.
#[derive(Debug)]
struct PhysMem {
    fd: OwnedFd,
    size: usize,
    exportable: bool,
    /// Whether `size` counts against the capacity (created here, not imported).
    counted: bool,
    used: Arc<AtomicUsize>,
}

impl Drop for PhysMem {
    fn drop(&mut self) {
        if self.counted {
            self.used.fetch_sub(self.size, Ordering::AcqRel);
        }
    }
}

// ---------------------------------------------------------------------------
// virtual memory

#[derive(Debug)]
struct Mapping {
    size: usize,
    /// Keeps the memfd alive while mapped, even after release.
    #[allow(dead_code)]
    phys: Arc<PhysMem>,
    access: Access,
}

#[derive(Debug, Default)]
struct Vm {
    /// start → size of each reservation.
    reservations: BTreeMap<u64, usize>,
    /// start → mapping, one entry per `map` call.
    mappings: BTreeMap<u64, Mapping>,
}

impl Vm {
    /// The reservation that contains `[ptr, ptr+size)` entirely, if any.
    fn reservation_containing(&self, ptr: u64, size: usize) -> Option<(u64, usize)> {
        let (&start, &len) = self.reservations.range(..=ptr).next_back()?;
        let end = ptr.checked_add(size as u64)?;
        (end <= start + len as u64).then_some((start, len))
    }

    /// Whether any mapping overlaps `[ptr, ptr+size)`.
    fn any_mapping_overlaps(&self, ptr: u64, size: usize) -> bool {
        let end = ptr.saturating_add(size as u64);
        match self.mappings.range(..end).next_back() {
            Some((&start, m)) => start + m.size as u64 > ptr,
            None => false,
        }
    }

    /// The mappings that exactly tile `[ptr, ptr+size)` (contiguous, whole
    /// mappings, no gap), or why not.
    fn tiling_mappings(&self, ptr: u64, size: usize) -> Result<Vec<u64>, String> {
        let end = ptr
            .checked_add(size as u64)
            .ok_or_else(|| "range overflows".to_string())?;
        let mut starts = Vec::new();
        let mut cursor = ptr;
        for (&start, m) in self.mappings.range(ptr..end) {
            if start != cursor {
                return Err(format!(
                    "range [{ptr:#x}, {end:#x}) has an unmapped gap at {cursor:#x}"
                ));
            }
            starts.push(start);
            cursor = start + m.size as u64;
        }
        if cursor != end {
            if cursor > end {
                return Err(format!(
                    "range [{ptr:#x}, {end:#x}) ends inside the mapping that ends at {cursor:#x}"
                ));
            }
            return Err(format!(
                "range [{ptr:#x}, {end:#x}) is not fully mapped from {cursor:#x}"
            ));
        }
        if starts.is_empty() {
            return Err(format!("range [{ptr:#x}, {end:#x}) is not mapped"));
        }
        Ok(starts)
    }

    /// Whether `[ptr, ptr+len)` lies entirely in mappings (not necessarily
    /// whole ones) that all grant at least `need`.
    fn accessible(&self, ptr: u64, len: usize, need: Access) -> Result<(), String> {
        let end = ptr
            .checked_add(len as u64)
            .ok_or_else(|| "range overflows".to_string())?;
        let mut cursor = ptr;
        // The mapping that contains `ptr` may start before it.
        let first = self
            .mappings
            .range(..=ptr)
            .next_back()
            .map(|(&s, _)| s)
            .unwrap_or(ptr);
        for (&start, m) in self.mappings.range(first..end) {
            let m_end = start + m.size as u64;
            if m_end <= cursor {
                continue;
            }
            if start > cursor {
                break;
            }
            let ok = match need {
                Access::None => true,
                Access::Read => matches!(m.access, Access::Read | Access::ReadWrite),
                Access::ReadWrite => m.access == Access::ReadWrite,
            };
            if !ok {
                return Err(format!(
                    "mapping at {start:#x} has access {:?}, {need:?} needed",
                    m.access
                ));
            }
            cursor = m_end;
            if cursor >= end {
                return Ok(());
            }
        }
        Err(format!(
            "range [{ptr:#x}, {end:#x}) is not mapped at {cursor:#x}"
        ))
    }
}

/// Run `f` on the words of `[ptr, ptr+len)` if that range is mapped with at
/// least `need` access, holding the mapping table's read lock throughout.
fn with_words<R>(
    vm: &RwLock<Vm>,
    op: Op,
    ptr: DevicePtr,
    len: usize,
    need: Access,
    f: impl FnOnce(Result<&[AtomicU32], SysError>) -> R,
) -> R {
    if len == 0 {
        return f(Ok(&[]));
    }
    if ptr % 4 != 0 || len % 4 != 0 {
        return f(Err(invalid(
            op,
            format!(
                "word access at {ptr:#x}, {len} bytes: pointer and length must be multiples of 4"
            ),
        )));
    }
    let guard = read(vm);
    if let Err(reason) = guard.accessible(ptr, len, need) {
        drop(guard);
        return f(Err(invalid(op, reason)));
    }
    // SAFETY: `[ptr, ptr+len)` lies entirely inside mappings of this device
    // (MAP_SHARED memfd mappings in this process's address space) whose
    // protection grants at least `need` (checked just above under the read
    // lock). Those mappings cannot be unmapped or re-protected while `guard`
    // is held, because map/unmap/set_access take the write lock, and `guard`
    // outlives every use of the slice (the slice's lifetime is bounded by
    // this call, which drops `guard` only after `f` returns). `ptr` is
    // 4-aligned and non-null (mappings never start at 0); `AtomicU32` has
    // the size and alignment of `u32` and every bit pattern is valid, so the
    // memfd's bytes are valid `AtomicU32`s. All access goes through atomics,
    // so concurrent tasks, and two virtual ranges aliasing one physical
    // page, are data-race free. When `need` is `Read` the callers only load.
    let words = unsafe { std::slice::from_raw_parts(ptr as usize as *const AtomicU32, len / 4) };
    let r = f(Ok(words));
    drop(guard);
    r
}

// ---------------------------------------------------------------------------
// streams and events

#[derive(Debug, Default)]
struct Progress {
    submitted: u64,
    completed: u64,
}

struct StreamState {
    id: u64,
    /// `None` once the stream is destroyed: the worker then drains and exits.
    sender: Mutex<Option<mpsc::Sender<HostTask>>>,
    progress: Mutex<Progress>,
    done: Condvar,
    /// The id of the stream's capture, 0 when it is not capturing: the
    /// lock-free `is_capturing`/`capture_status` through `crate::recent`.
    capture_id: AtomicU64,
    /// Set when a refused call invalidated the capture.
    capture_invalid: AtomicBool,
    /// The capture recording this stream's work (`None` outside a capture,
    /// and for the `set_capturing` test aid, under which work still runs).
    recording: Mutex<Option<Arc<graph::Recording>>>,
    /// Set on destroy, before the table forgets the stream.
    destroyed: AtomicBool,
}

impl crate::recent::Retirable for StreamState {
    fn retired(&self) -> bool {
        self.destroyed.load(Ordering::Acquire)
    }
}

/// The host backend's [`StreamProbe`]: the stream's state itself (the
/// worker exits on destroy whoever still holds the state, so holding it
/// keeps nothing running).
struct HostProbe {
    state: Arc<StreamState>,
    owner: u64,
}

impl HostProbe {
    #[inline]
    fn live(&self, op: Op) -> SysResult<&StreamState> {
        if self.state.destroyed.load(Ordering::Acquire) {
            return Err(missing_stream(op, self.owner, self.state.id));
        }
        Ok(&self.state)
    }
}

impl StreamProbe for HostProbe {
    #[inline]
    fn is_capturing(&self) -> SysResult<bool> {
        Ok(self
            .live(Op::IsCapturing)?
            .capture_id
            .load(Ordering::Acquire)
            != 0)
    }
    #[inline]
    fn check(&self) -> SysResult<()> {
        self.live(Op::CheckStream).map(|_| ())
    }
}

impl StreamState {
    fn enqueue(&self, op: Op, task: HostTask) -> SysResult<()> {
        let sender = lock(&self.sender);
        let Some(tx) = sender.as_ref() else {
            return Err(SysError::InvalidHandle {
                op,
                what: "stream",
                id: self.id,
            });
        };
        // Bump `submitted` before the task can run (it bumps `completed`),
        // and under the sender lock so that sequence numbers follow the
        // channel's order when several threads enqueue at once.
        lock(&self.progress).submitted += 1;
        if tx.send(task).is_err() {
            // The worker is gone (it only exits after the sender is dropped,
            // so this is unreachable); undo the count.
            lock(&self.progress).submitted -= 1;
            return Err(invalid(op, format!("stream {} has no worker", self.id)));
        }
        Ok(())
    }

    fn submitted(&self) -> u64 {
        lock(&self.progress).submitted
    }

    fn is_done(&self, target: u64) -> bool {
        lock(&self.progress).completed >= target
    }

    fn wait_for(&self, target: u64) {
        let mut p = lock(&self.progress);
        while p.completed < target {
            p = self.done.wait(p).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn worker(self: Arc<Self>, rx: mpsc::Receiver<HostTask>) {
        while let Ok(task) = rx.recv() {
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(task)).is_err() {
                tracing::warn!(
                    stream = self.id,
                    "host backend: a task on the stream panicked"
                );
            }
            let mut p = lock(&self.progress);
            p.completed += 1;
            drop(p);
            self.done.notify_all();
        }
        tracing::trace!(stream = self.id, "host backend: stream worker exits");
    }
}

/// Where an event was last recorded: complete when `stream` has completed
/// `target` tasks.
#[derive(Clone)]
struct Recorded {
    stream: Arc<StreamState>,
    target: u64,
}

#[derive(Default)]
struct EventState {
    recorded: Option<Recorded>,
    /// The capture the event was last recorded into (then `recorded` is
    /// `None`): querying or synchronising it is refused.
    captured: Option<u64>,
    /// The stream whose capture recorded it: a refused query or
    /// synchronisation invalidates that capture, as the driver does.
    captured_on: Option<std::sync::Weak<StreamState>>,
}

// ---------------------------------------------------------------------------
// the device

/// The host backend: memfd physical memory, `mmap` address space, worker
/// thread streams. See the [module documentation](self).
///
/// Dropping it drains every stream's queued work, joins the workers, unmaps
/// every mapping, frees every reservation and closes every memfd.
pub struct HostDevice {
    config: HostConfig,
    /// Bytes of physical memory created and still alive (shared with each
    /// [`PhysMem`], which gives its bytes back when dropped).
    used: Arc<AtomicUsize>,
    vm: Arc<RwLock<Vm>>,
    physical: Mutex<HashMap<u64, Arc<PhysMem>>>,
    streams: Mutex<HashMap<u64, Arc<StreamState>>>,
    /// Worker threads of all streams, live or destroyed, joined on drop.
    workers: Mutex<Vec<JoinHandle<()>>>,
    /// Destroyed streams whose queued work may still run, for
    /// `synchronize_device` (dropped from the list once drained).
    draining: Mutex<Vec<Arc<StreamState>>>,
    events: Mutex<HashMap<u64, EventState>>,
    /// Streams being captured (for real, or through `set_capturing`).
    captures: Mutex<HashMap<u64, CaptureEntry>>,
    graphs: Mutex<HashMap<u64, Arc<graph::HostGraph>>>,
    execs: Mutex<HashMap<u64, Arc<graph::HostExec>>>,
    /// Graph allocations live outside a launch, by address.
    graph_live: Mutex<HashMap<u64, Arc<graph::GraphMem>>>,
    /// Failed graph memory nodes (see `HostDevice::graph_faults`).
    graph_faults: Arc<AtomicU64>,
    default_stream: Stream,
    /// Process-unique id of this instance: the high bits of its stream ids
    /// and its key in `crate::recent`.
    owner: u64,
    /// The low bits of its stream ids, counted apart from every other id
    /// so that streams made one after another get consecutive ids (a pool
    /// keeps the ids of streams it forgot as runs of consecutive ids).
    next_stream: AtomicU64,
}

impl std::fmt::Debug for HostDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostDevice")
            .field("config", &self.config)
            .field("used", &self.used.load(Ordering::Relaxed))
            .field("default_stream", &self.default_stream)
            .finish_non_exhaustive()
    }
}

impl Default for HostDevice {
    fn default() -> Self {
        Self::new()
    }
}

impl HostDevice {
    /// A host device with the default configuration (64 GiB capacity, 2 MiB
    /// granularity; see [`HostConfig`]).
    pub fn new() -> Self {
        Self::with_config(HostConfig::default())
    }

    /// A host device with the given configuration.
    ///
    /// Raises the process's soft `RLIMIT_NOFILE` to its hard limit (once per
    /// process), since every physical handle is a file descriptor.
    ///
    /// # Panics
    /// If `granularity` is not a power of two that is a multiple of the OS
    /// page size, or the default stream's worker thread cannot be spawned.
    pub fn with_config(config: HostConfig) -> Self {
        let page = rustix::param::page_size();
        assert!(
            config.granularity.is_power_of_two() && config.granularity % page == 0,
            "HostConfig::granularity ({}) must be a power of two and a multiple of the page size ({page})",
            config.granularity
        );
        raise_fd_limit();
        let mut dev = HostDevice {
            config,
            used: Arc::new(AtomicUsize::new(0)),
            vm: Arc::new(RwLock::new(Vm::default())),
            physical: Mutex::new(HashMap::new()),
            streams: Mutex::new(HashMap::new()),
            workers: Mutex::new(Vec::new()),
            draining: Mutex::new(Vec::new()),
            events: Mutex::new(HashMap::new()),
            captures: Mutex::new(HashMap::new()),
            graphs: Mutex::new(HashMap::new()),
            execs: Mutex::new(HashMap::new()),
            graph_live: Mutex::new(HashMap::new()),
            graph_faults: Arc::new(AtomicU64::new(0)),
            default_stream: Stream(0),
            owner: crate::recent::new_owner(),
            next_stream: AtomicU64::new(1),
        };
        dev.default_stream = dev
            .spawn_stream()
            .expect("host backend: cannot spawn the default stream's worker thread");
        dev
    }

    /// The configuration this device was made with.
    pub fn config(&self) -> HostConfig {
        self.config
    }

    /// Test aid simulating CUDA graph capture: while set, [`Device::is_capturing`]
    /// returns true for `stream` and [`Device::capture_status`] reports an
    /// active capture (a fresh id each time it is set), and
    /// `synchronize_device` is refused as in a global-mode capture. Nothing
    /// else changes (work still runs). Unknown streams, and streams in a
    /// real capture ([`Device::begin_capture`]), are ignored.
    pub fn set_capturing(&self, stream: Stream, capturing: bool) {
        let Some(s) = lock(&self.streams).get(&stream.0).cloned() else {
            return;
        };
        let mut captures = lock(&self.captures);
        if captures
            .get(&stream.0)
            .is_some_and(|e| e.recording.is_some())
        {
            return;
        }
        if capturing {
            if let std::collections::hash_map::Entry::Vacant(e) = captures.entry(stream.0) {
                e.insert(CaptureEntry {
                    mode: CaptureMode::Global,
                    recording: None,
                });
                s.capture_id.store(next_id(), Ordering::Release);
            }
        } else if captures.remove(&stream.0).is_some() {
            s.capture_id.store(0, Ordering::Release);
        }
    }

    /// Enqueue on `stream` a task that hands `f` the memory `[ptr, ptr+len)`
    /// as 32-bit words: the host twin of a kernel launch.
    ///
    /// When the task runs, it checks under a read lock of the mapping table
    /// that the range lies in mappings of this device with
    /// [`Access::ReadWrite`], that `ptr` is 4-aligned and `len` a multiple of
    /// 4; then it calls `f(Ok(words))`, holding the lock so that no unmap,
    /// map or set-access can race the access. Otherwise it calls `f(Err(..))`
    /// ([`SysError::InvalidArgument`] with op [`Op::LaunchHost`]). `len == 0`
    /// gives an empty slice without checks.
    ///
    /// `f` should not call map/unmap/set_access of this device (they would
    /// wait for the lock it holds).
    pub fn launch_on_words(
        &self,
        stream: Stream,
        ptr: DevicePtr,
        len: usize,
        f: impl FnOnce(Result<&[AtomicU32], SysError>) + Send + 'static,
    ) -> SysResult<()> {
        let vm = Arc::clone(&self.vm);
        self.launch_host(
            stream,
            Box::new(move || with_words(&vm, Op::LaunchHost, ptr, len, Access::ReadWrite, f)),
        )
    }

    /// Write `words` at `ptr` now (not in stream order), through the same
    /// checked path as [`HostDevice::launch_on_words`]: the range must be
    /// mapped with [`Access::ReadWrite`]. A test and debugging aid.
    pub fn write_words(&self, ptr: DevicePtr, words: &[u32]) -> SysResult<()> {
        with_words(
            &self.vm,
            Op::LaunchHost,
            ptr,
            words.len() * 4,
            Access::ReadWrite,
            |r| {
                for (dst, &src) in r?.iter().zip(words) {
                    dst.store(src, Ordering::Relaxed);
                }
                Ok(())
            },
        )
    }

    /// Read `count` words at `ptr` now (not in stream order), through the
    /// same checked path as [`HostDevice::launch_on_words`]: the range must
    /// be mapped with at least [`Access::Read`]. A test and debugging aid.
    pub fn read_words(&self, ptr: DevicePtr, count: usize) -> SysResult<Vec<u32>> {
        with_words(
            &self.vm,
            Op::LaunchHost,
            ptr,
            count * 4,
            Access::Read,
            |r| Ok(r?.iter().map(|w| w.load(Ordering::Relaxed)).collect()),
        )
    }

    /// Physical handles currently in the handle table (created or imported,
    /// not yet released). Released handles still mapped are not counted.
    pub fn live_handles(&self) -> usize {
        lock(&self.physical).len()
    }

    /// Number of live mappings (one per successful `map` not yet unmapped).
    pub fn live_mappings(&self) -> usize {
        read(&self.vm).mappings.len()
    }

    /// Number of live VA reservations.
    pub fn live_reservations(&self) -> usize {
        read(&self.vm).reservations.len()
    }

    // --- internals ---

    /// New physical memory counted against the capacity (a memfd of `size`
    /// bytes, no page touched).
    fn new_phys(&self, op: Op, size: usize, exportable: bool) -> SysResult<Arc<PhysMem>> {
        self.check_size(op, size)?;
        let capacity = self.config.capacity;
        // Claim the bytes first, atomically against concurrent creators.
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(size).filter(|&n| n <= capacity)
            })
            .map_err(|used| SysError::OutOfMemory {
                op,
                requested: size,
                available: capacity.saturating_sub(used),
            })?;
        let fd = match memfd_create("tidepool-physical", MemfdFlags::CLOEXEC) {
            Ok(fd) => fd,
            Err(e) => {
                self.used.fetch_sub(size, Ordering::AcqRel);
                return Err(match e {
                    Errno::MFILE | Errno::NFILE => SysError::Os {
                        op,
                        errno: e.raw_os_error(),
                        message: format!(
                            "{e}: out of file descriptors; every host physical handle is a \
                             memfd (raise `ulimit -n`, or use larger physical handles)"
                        ),
                    },
                    e => os_err(op, e),
                });
            }
        };
        // From here on, `PhysMem`'s drop gives the bytes back.
        let phys = Arc::new(PhysMem {
            fd,
            size,
            exportable,
            counted: true,
            used: Arc::clone(&self.used),
        });
        ftruncate(&phys.fd, size as u64).map_err(|e| os_err(op, e))?;
        Ok(phys)
    }

    fn check_granular(&self, op: Op, what: &str, value: u64) -> SysResult<()> {
        check_granular(op, what, value, self.config.granularity)
    }

    fn check_size(&self, op: Op, size: usize) -> SysResult<()> {
        check_size(op, size, self.config.granularity)
    }

    fn spawn_stream(&self) -> SysResult<Stream> {
        let id = stream_id(self.owner, self.next_stream.fetch_add(1, Ordering::Relaxed));
        let (tx, rx) = mpsc::channel::<HostTask>();
        let state = Arc::new(StreamState {
            id,
            sender: Mutex::new(Some(tx)),
            progress: Mutex::new(Progress::default()),
            done: Condvar::new(),
            capture_id: AtomicU64::new(0),
            capture_invalid: AtomicBool::new(false),
            recording: Mutex::new(None),
            destroyed: AtomicBool::new(false),
        });
        let worker_state = Arc::clone(&state);
        let handle = std::thread::Builder::new()
            .name(format!("tidepool-host-stream-{id}"))
            .spawn(move || worker_state.worker(rx))
            .map_err(|e| SysError::Os {
                op: Op::CreateStream,
                errno: e.raw_os_error().unwrap_or(0),
                message: format!("cannot spawn a stream worker thread: {e}"),
            })?;
        {
            let mut workers = lock(&self.workers);
            workers.retain(|h| !h.is_finished());
            workers.push(handle);
        }
        lock(&self.streams).insert(id, state);
        Ok(Stream(id))
    }

    fn stream(&self, op: Op, stream: Stream) -> SysResult<Arc<StreamState>> {
        lock(&self.streams)
            .get(&stream.0)
            .cloned()
            .ok_or_else(|| missing_stream(op, self.owner, stream.0))
    }

    /// The live stream `stream` of this device, through this thread's cache
    /// of recently used streams (keyed by this instance, so another
    /// device's stream is never resolved here).
    fn resolve(&self, op: Op, stream: Stream) -> SysResult<Arc<StreamState>> {
        if let Some(s) = crate::recent::get::<StreamState>(self.owner, stream.0) {
            return Ok(s);
        }
        let s = self.stream(op, stream)?;
        crate::recent::put(self.owner, stream.0, &s);
        Ok(s)
    }

    /// Refuse to query or synchronise an event last recorded into a
    /// capture, and invalidate that capture if it is still in progress (the
    /// driver does: the refused call breaks the capture).
    fn refuse_captured_event(&self, op: Op, event: Event) -> SysResult<()> {
        let (captured, on) = lock(&self.events)
            .get(&event.0)
            .map(|e| (e.captured, e.captured_on.as_ref().and_then(|w| w.upgrade())))
            .unwrap_or((None, None));
        match captured {
            Some(id) => {
                if let Some(s) = on {
                    if s.capture_id.load(Ordering::Acquire) == id {
                        s.invalidate();
                    }
                }
                Err(SysError::CaptureViolation {
                    op,
                    reason: "the event was last recorded in a capturing stream; record it again \
                             outside the capture"
                        .into(),
                })
            }
            None => Ok(()),
        }
    }

    /// Where `event` was last recorded (`None`: never), or InvalidHandle.
    fn recorded(&self, op: Op, event: Event) -> SysResult<Option<Recorded>> {
        lock(&self.events)
            .get(&event.0)
            .map(|e| e.recorded.clone())
            .ok_or(SysError::InvalidHandle {
                op,
                what: "event",
                id: event.0,
            })
    }

    /// Overlay `[ptr, ptr+size)` with fresh PROT_NONE anonymous memory: the
    /// host's unmap, which keeps the addresses reserved.
    fn overlay_none(ptr: DevicePtr, size: usize) -> Result<(), Errno> {
        // SAFETY: `[ptr, ptr+size)` is a range of one of this device's
        // reservations (callers check it is exactly a live mapping), so
        // replacing it with MAP_FIXED touches no memory owned by anyone else;
        // Rust code reaches that memory only through `with_words`, which
        // holds the read lock that our caller's write lock excludes.
        unsafe {
            rustix::mm::mmap_anonymous(
                as_void(ptr),
                size,
                ProtFlags::empty(),
                MapFlags::PRIVATE | MapFlags::FIXED | MapFlags::NORESERVE,
            )
        }
        .map(|_| ())
    }
}

impl Device for HostDevice {
    fn backend_name(&self) -> &'static str {
        "host"
    }

    fn ordinal(&self) -> i32 {
        HOST_ORDINAL
    }

    fn granularity(&self) -> usize {
        self.config.granularity
    }

    fn reserve_va(&self, size: usize, alignment: usize) -> SysResult<DevicePtr> {
        let op = Op::ReserveVa;
        self.check_size(op, size)?;
        if alignment != 0 && !alignment.is_power_of_two() {
            return Err(invalid(
                op,
                format!("alignment {alignment:#x} is not a power of two"),
            ));
        }
        let align = alignment.max(self.config.granularity);
        let total = size
            .checked_add(align)
            .ok_or_else(|| invalid(op, format!("size {size:#x} too large")))?;
        // SAFETY: a fresh anonymous PROT_NONE mapping at an address the
        // kernel picks (ptr null, no MAP_FIXED): it replaces nothing.
        let base = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                total,
                ProtFlags::empty(),
                MapFlags::PRIVATE | MapFlags::NORESERVE,
            )
        }
        .map_err(|e| match e {
            Errno::NOMEM => SysError::OutOfMemory {
                op,
                requested: size,
                available: 0,
            },
            e => os_err(op, e),
        })? as usize;
        let start = base.next_multiple_of(align);
        let head = start - base;
        let tail = total - head - size;
        // Trim the over-reservation so that the reservation is exactly
        // `[start, start+size)`.
        for (p, len) in [(base, head), (start + size, tail)] {
            if len == 0 {
                continue;
            }
            // SAFETY: `[p, p+len)` is part of the mapping made just above and
            // outside `[start, start+size)`; nothing else refers to it.
            if let Err(e) = unsafe { rustix::mm::munmap(p as *mut c_void, len) } {
                tracing::warn!(error = %e, "host backend: trimming a reservation failed");
            }
        }
        write(&self.vm).reservations.insert(start as u64, size);
        Ok(start as u64)
    }

    fn free_va(&self, ptr: DevicePtr, size: usize) -> SysResult<()> {
        let op = Op::FreeVa;
        let mut vm = write(&self.vm);
        match vm.reservations.get(&ptr) {
            Some(&len) if len == size => {}
            Some(&len) => {
                return Err(invalid(
                    op,
                    format!("reservation at {ptr:#x} has size {len:#x}, not {size:#x}"),
                ));
            }
            None => {
                return Err(invalid(op, format!("no reservation starts at {ptr:#x}")));
            }
        }
        if vm.any_mapping_overlaps(ptr, size) {
            return Err(invalid(
                op,
                format!("reservation at {ptr:#x} still holds mappings"),
            ));
        }
        // SAFETY: `[ptr, ptr+size)` is exactly one of this device's
        // reservations and holds no mapping, so no Rust code can refer to it
        // (the checked paths need a mapping).
        unsafe { rustix::mm::munmap(as_void(ptr), size) }.map_err(|e| os_err(op, e))?;
        vm.reservations.remove(&ptr);
        Ok(())
    }

    fn create_physical(&self, size: usize, options: PhysicalOptions) -> SysResult<Physical> {
        let phys = self.new_phys(Op::CreatePhysical, size, options.exportable)?;
        let id = next_id();
        lock(&self.physical).insert(id, phys);
        Ok(Physical(id))
    }

    fn release_physical(&self, handle: Physical) -> SysResult<()> {
        // Dropping the table's reference: a mapping keeps the memory alive.
        lock(&self.physical)
            .remove(&handle.0)
            .map(drop)
            .ok_or(SysError::InvalidHandle {
                op: Op::ReleasePhysical,
                what: "physical memory",
                id: handle.0,
            })
    }

    fn map(&self, ptr: DevicePtr, size: usize, handle: Physical, offset: usize) -> SysResult<()> {
        let op = Op::Map;
        self.check_size(op, size)?;
        self.check_granular(op, "pointer", ptr)?;
        self.check_granular(op, "offset", offset as u64)?;
        let phys = lock(&self.physical)
            .get(&handle.0)
            .cloned()
            .ok_or(SysError::InvalidHandle {
                op,
                what: "physical memory",
                id: handle.0,
            })?;
        if offset.checked_add(size).is_none_or(|end| end > phys.size) {
            return Err(invalid(
                op,
                format!(
                    "offset {offset:#x} + size {size:#x} exceeds the handle's size {:#x}",
                    phys.size
                ),
            ));
        }
        crate::validate::check_whole_handle(op, offset, size, phys.size)?;
        let mut vm = write(&self.vm);
        if vm.reservation_containing(ptr, size).is_none() {
            return Err(invalid(
                op,
                format!("[{ptr:#x}, +{size:#x}) is not inside a reservation of this device"),
            ));
        }
        if vm.any_mapping_overlaps(ptr, size) {
            return Err(invalid(
                op,
                format!("[{ptr:#x}, +{size:#x}) overlaps an existing mapping"),
            ));
        }
        // SAFETY: `[ptr, ptr+size)` lies inside one of this device's
        // reservations and overlaps no mapping (checked above under the write
        // lock), so MAP_FIXED replaces only our own PROT_NONE placeholder
        // pages, which no Rust code refers to. `offset + size` is within the
        // memfd's size, so the mapping cannot SIGBUS.
        unsafe {
            rustix::mm::mmap(
                as_void(ptr),
                size,
                ProtFlags::empty(),
                MapFlags::SHARED | MapFlags::FIXED,
                &phys.fd,
                offset as u64,
            )
        }
        .map_err(|e| os_err(op, e))?;
        vm.mappings.insert(
            ptr,
            Mapping {
                size,
                phys,
                access: Access::None,
            },
        );
        Ok(())
    }

    fn unmap(&self, ptr: DevicePtr, size: usize) -> SysResult<()> {
        let op = Op::Unmap;
        let mut vm = write(&self.vm);
        match vm.mappings.get(&ptr) {
            Some(m) if m.size == size => {}
            Some(m) => {
                return Err(invalid(
                    op,
                    format!(
                        "the mapping at {ptr:#x} has size {:#x}; unmap must cover exactly one mapping, not {size:#x}",
                        m.size
                    ),
                ));
            }
            None => {
                return Err(invalid(op, format!("no mapping starts at {ptr:#x}")));
            }
        }
        Self::overlay_none(ptr, size).map_err(|e| os_err(op, e))?;
        // Dropping the mapping's reference may free a released handle.
        vm.mappings.remove(&ptr);
        Ok(())
    }

    fn set_access(&self, ptr: DevicePtr, size: usize, access: &[AccessDesc]) -> SysResult<()> {
        let op = Op::SetAccess;
        let Some(last) = access.last() else {
            return Err(invalid(op, "no access descriptor"));
        };
        if let Some(bad) = access.iter().find(|d| d.device != HOST_ORDINAL) {
            return Err(invalid(
                op,
                format!(
                    "device {} does not exist on the host backend (only device 0)",
                    bad.device
                ),
            ));
        }
        let acc = last.access;
        self.check_size(op, size)?;
        self.check_granular(op, "pointer", ptr)?;
        let mut vm = write(&self.vm);
        let starts = vm.tiling_mappings(ptr, size).map_err(|r| invalid(op, r))?;
        let prot = match acc {
            Access::None => MprotectFlags::empty(),
            Access::Read => MprotectFlags::READ,
            Access::ReadWrite => MprotectFlags::READ | MprotectFlags::WRITE,
        };
        // SAFETY: `[ptr, ptr+size)` is exactly tiled by live mappings of this
        // device (checked above under the write lock); changing their
        // protection cannot invalidate Rust references, since the checked
        // paths hold the read lock while they access this memory.
        unsafe { rustix::mm::mprotect(as_void(ptr), size, prot) }.map_err(|e| os_err(op, e))?;
        for s in starts {
            if let Some(m) = vm.mappings.get_mut(&s) {
                m.access = acc;
            }
        }
        Ok(())
    }

    fn export_fd(&self, handle: Physical) -> SysResult<OwnedFd> {
        let op = Op::ExportHandle;
        let phys = lock(&self.physical)
            .get(&handle.0)
            .cloned()
            .ok_or(SysError::InvalidHandle {
                op,
                what: "physical memory",
                id: handle.0,
            })?;
        if !phys.exportable {
            return Err(invalid(
                op,
                format!("{handle} was not created with `exportable: true`"),
            ));
        }
        rustix::io::fcntl_dupfd_cloexec(&phys.fd, 0).map_err(|e| os_err(op, e))
    }

    fn import_fd(&self, fd: OwnedFd, size: usize) -> SysResult<Physical> {
        let op = Op::ImportHandle;
        self.check_size(op, size)?;
        let st = fstat(&fd).map_err(|e| os_err(op, e))?;
        let file_size = usize::try_from(st.st_size).unwrap_or(0);
        if file_size < size {
            return Err(invalid(
                op,
                format!("the file descriptor holds {file_size:#x} bytes, fewer than {size:#x}"),
            ));
        }
        // Imported memory belongs to its exporter's budget: it does not count
        // against this device's capacity.
        let phys = Arc::new(PhysMem {
            fd,
            size,
            exportable: true,
            counted: false,
            used: Arc::clone(&self.used),
        });
        let id = next_id();
        lock(&self.physical).insert(id, phys);
        Ok(Physical(id))
    }

    fn mem_info(&self) -> SysResult<MemInfo> {
        let used = self.used.load(Ordering::Acquire);
        Ok(MemInfo {
            free: self.config.capacity.saturating_sub(used),
            total: self.config.capacity,
        })
    }

    fn create_stream(&self) -> SysResult<Stream> {
        self.spawn_stream()
    }

    fn destroy_stream(&self, stream: Stream) -> SysResult<()> {
        let op = Op::DestroyStream;
        if stream == self.default_stream {
            return Err(invalid(op, "the default stream cannot be destroyed"));
        }
        {
            let mut captures = lock(&self.captures);
            if captures
                .get(&stream.0)
                .is_some_and(|e| e.recording.is_some())
            {
                return Err(SysError::CaptureViolation {
                    op,
                    reason: "the stream is being captured; end the capture before destroying it"
                        .into(),
                });
            }
            captures.remove(&stream.0);
        }
        let state = lock(&self.streams)
            .remove(&stream.0)
            .ok_or_else(|| missing_stream(op, self.owner, stream.0))?;
        state.destroyed.store(true, Ordering::Release);
        // Dropping the sender lets the worker drain the queue and exit; it is
        // joined when the device drops.
        lock(&state.sender).take();
        let mut draining = lock(&self.draining);
        draining.retain(|s| !s.is_done(s.submitted()));
        draining.push(state);
        Ok(())
    }

    fn default_stream(&self) -> Stream {
        self.default_stream
    }

    fn adopt_stream(&self, _raw: usize) -> SysResult<Stream> {
        Err(SysError::Unsupported {
            op: Op::AdoptStream,
            reason: "the host backend has no driver streams to adopt".into(),
        })
    }

    fn synchronize_stream(&self, stream: Stream) -> SysResult<()> {
        let s = self.stream(Op::SynchronizeStream, stream)?;
        s.refuse_if_recording(Op::SynchronizeStream)?;
        let target = s.submitted();
        s.wait_for(target);
        Ok(())
    }

    fn synchronize_device(&self) -> SysResult<()> {
        let op = Op::SynchronizeDevice;
        // As strict as the driver: a device-wide wait is illegal while a
        // stream is being captured (depending on the capture's mode).
        self.refuse_unsafe_call(op)?;
        let mut all: Vec<Arc<StreamState>> = lock(&self.streams).values().cloned().collect();
        all.extend(lock(&self.draining).iter().cloned());
        // Streams may wait on each other's events; waiting for each stream's
        // submitted count in turn still ends with all of them drained.
        for s in &all {
            s.wait_for(s.submitted());
        }
        lock(&self.draining).retain(|s| !s.is_done(s.submitted()));
        Ok(())
    }

    fn query_stream(&self, stream: Stream) -> SysResult<bool> {
        let s = self.stream(Op::QueryStream, stream)?;
        s.refuse_if_recording(Op::QueryStream)?;
        let target = s.submitted();
        Ok(s.is_done(target))
    }

    fn is_capturing(&self, stream: Stream) -> SysResult<bool> {
        Ok(self
            .resolve(Op::IsCapturing, stream)?
            .capture_id
            .load(Ordering::Acquire)
            != 0)
    }

    fn check_stream(&self, stream: Stream) -> SysResult<()> {
        self.resolve(Op::CheckStream, stream).map(|_| ())
    }

    fn stream_probe(&self, stream: Stream) -> SysResult<Option<Arc<dyn StreamProbe>>> {
        let state = self.stream(Op::CheckStream, stream)?;
        Ok(Some(Arc::new(HostProbe {
            state,
            owner: self.owner,
        })))
    }

    fn create_event(&self) -> SysResult<Event> {
        let id = next_id();
        lock(&self.events).insert(id, EventState::default());
        Ok(Event(id))
    }

    fn record_event(&self, event: Event, stream: Stream) -> SysResult<()> {
        let op = Op::RecordEvent;
        let s = self.stream(op, stream)?;
        let mut events = lock(&self.events);
        let e = events.get_mut(&event.0).ok_or(SysError::InvalidHandle {
            op,
            what: "event",
            id: event.0,
        })?;
        if let Some(rec) = s.recording() {
            // Recorded into the capture: it marks a point of the graph, not
            // of work that runs now.
            e.recorded = None;
            e.captured = Some(rec.id);
            e.captured_on = Some(Arc::downgrade(&s));
            return Ok(());
        }
        let target = s.submitted();
        e.recorded = Some(Recorded { stream: s, target });
        e.captured = None;
        e.captured_on = None;
        Ok(())
    }

    fn query_event(&self, event: Event) -> SysResult<bool> {
        self.refuse_captured_event(Op::QueryEvent, event)?;
        Ok(match self.recorded(Op::QueryEvent, event)? {
            Some(r) => r.stream.is_done(r.target),
            None => true,
        })
    }

    fn synchronize_event(&self, event: Event) -> SysResult<()> {
        self.refuse_captured_event(Op::SynchronizeEvent, event)?;
        if let Some(r) = self.recorded(Op::SynchronizeEvent, event)? {
            r.stream.wait_for(r.target);
        }
        Ok(())
    }

    fn destroy_event(&self, event: Event) -> SysResult<()> {
        lock(&self.events)
            .remove(&event.0)
            .map(drop)
            .ok_or(SysError::InvalidHandle {
                op: Op::DestroyEvent,
                what: "event",
                id: event.0,
            })
    }

    fn wait_event(&self, stream: Stream, event: Event) -> SysResult<()> {
        let op = Op::WaitEvent;
        let s = self.stream(op, stream)?;
        let captured = lock(&self.events)
            .get(&event.0)
            .ok_or(SysError::InvalidHandle {
                op,
                what: "event",
                id: event.0,
            })?
            .captured;
        if let Some(rec) = s.recording() {
            return match captured {
                // A point earlier in the same (linear) recording: ordered.
                Some(id) if id == rec.id => Ok(()),
                Some(_) => {
                    s.invalidate();
                    Err(SysError::CaptureViolation {
                        op,
                        reason: "the event belongs to another capture (captures cannot merge)"
                            .into(),
                    })
                }
                None if self.recorded(op, event)?.is_none() => Ok(()),
                None => {
                    s.invalidate();
                    Err(SysError::CaptureViolation {
                        op,
                        reason: "a capturing stream cannot wait on an event recorded outside \
                                 the capture"
                            .into(),
                    })
                }
            };
        }
        if captured.is_some() {
            return Err(SysError::Unsupported {
                op,
                reason: "waiting on an event recorded into a capture joins the stream into \
                         that capture, which the host backend does not simulate"
                    .into(),
            });
        }
        let Some(r) = self.recorded(op, event)? else {
            return Ok(()); // never recorded: no-op, like the driver
        };
        if Arc::ptr_eq(&r.stream, &s) || r.stream.is_done(r.target) {
            return Ok(()); // already ordered or already complete
        }
        // The target is work submitted before this wait, so the wait can
        // never take part in a cycle.
        s.enqueue(op, Box::new(move || r.stream.wait_for(r.target)))
    }

    fn launch_host(&self, stream: Stream, task: HostTask) -> SysResult<()> {
        self.stream(Op::LaunchHost, stream)?
            .submit(Op::LaunchHost, Task::Once(task))
    }

    // --- graph capture (see `host/graph.rs`) ---

    fn capture_status(&self, stream: Stream) -> SysResult<CaptureStatus> {
        self.capture_status_impl(stream)
    }

    fn graph_alloc(&self, stream: Stream, size: usize) -> SysResult<DevicePtr> {
        self.graph_alloc_impl(stream, size)
    }

    fn graph_free(&self, stream: Stream, ptr: DevicePtr) -> SysResult<()> {
        self.graph_free_impl(stream, ptr)
    }

    fn begin_capture(&self, stream: Stream, mode: CaptureMode) -> SysResult<()> {
        self.begin_capture_impl(stream, mode)
    }

    fn end_capture(&self, stream: Stream) -> SysResult<Graph> {
        self.end_capture_impl(stream)
    }

    fn instantiate_graph(&self, graph: Graph, options: GraphOptions) -> SysResult<GraphExec> {
        self.instantiate_graph_impl(graph, options)
    }

    fn launch_graph(&self, exec: GraphExec, stream: Stream) -> SysResult<()> {
        self.launch_graph_impl(exec, stream)
    }

    fn destroy_graph(&self, graph: Graph) -> SysResult<()> {
        self.destroy_graph_impl(graph)
    }

    fn destroy_graph_exec(&self, exec: GraphExec) -> SysResult<()> {
        self.destroy_graph_exec_impl(exec)
    }

    // --- sharing (see `host/share.rs`) ---

    fn get_access(&self, ptr: DevicePtr, device: i32) -> SysResult<Access> {
        self.get_access_impl(ptr, device)
    }

    fn create_ipc_event(&self) -> SysResult<(crate::IpcEvent, crate::IpcEventHandle)> {
        self.create_ipc_event_impl()
    }

    fn open_ipc_event(&self, handle: crate::IpcEventHandle) -> SysResult<crate::IpcEvent> {
        self.open_ipc_event_impl(handle)
    }

    fn record_ipc_event(&self, event: crate::IpcEvent, stream: Stream) -> SysResult<()> {
        self.record_ipc_event_impl(event, stream)
    }

    fn query_ipc_event(&self, event: crate::IpcEvent) -> SysResult<bool> {
        self.query_ipc_event_impl(event)
    }

    fn synchronize_ipc_event(&self, event: crate::IpcEvent) -> SysResult<()> {
        self.synchronize_ipc_event_impl(event)
    }

    fn wait_ipc_event(&self, stream: Stream, event: crate::IpcEvent) -> SysResult<()> {
        self.wait_ipc_event_impl(stream, event)
    }

    fn destroy_ipc_event(&self, event: crate::IpcEvent) -> SysResult<()> {
        self.destroy_ipc_event_impl(event)
    }
}

impl Drop for HostDevice {
    fn drop(&mut self) {
        // 1. Stop every stream: drop the senders, then join the workers once
        //    they have drained their queues.
        let streams: Vec<_> = lock(&self.streams).drain().map(|(_, s)| s).collect();
        for s in &streams {
            lock(&s.sender).take();
        }
        drop(streams);
        let me = std::thread::current().id();
        for h in lock(&self.workers).drain(..) {
            if h.thread().id() == me {
                // Dropped from a task of our own stream: it cannot join itself.
                continue;
            }
            if h.join().is_err() {
                tracing::warn!("host backend: a stream worker panicked");
            }
        }
        lock(&self.events).clear();
        // 2. Unmap every mapping, then free every reservation.
        let mut vm = write(&self.vm);
        for (ptr, m) in std::mem::take(&mut vm.mappings) {
            if let Err(e) = Self::overlay_none(ptr, m.size) {
                tracing::warn!(ptr, size = m.size, error = %e, "host backend: unmap on drop failed");
            }
        }
        for (ptr, size) in std::mem::take(&mut vm.reservations) {
            // SAFETY: the reservation is ours and holds no mapping any more;
            // no stream task runs (workers joined above) and the checked
            // paths need `&self`, which is being dropped.
            if let Err(e) = unsafe { rustix::mm::munmap(as_void(ptr), size) } {
                tracing::warn!(ptr, size, error = %e, "host backend: freeing a reservation on drop failed");
            }
        }
        drop(vm);
        // 3. Close every memfd.
        lock(&self.physical).clear();
    }
}
