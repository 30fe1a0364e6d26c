//! The CUDA backend: the driver's VMM API, streams and events, loaded at run
//! time through cudarc's `driver::sys` (`dynamic-loading`), so nothing CUDA
//! is needed to build and a machine without a driver gets
//! [`SysError::DriverUnavailable`] instead of a panic.
//!
//! - [`CudaDevice`] implements [`Device`] on one device's primary context.
//! - [`baseline`]: the driver's own allocators ([`DriverPool`],
//!   [`mem_alloc`]/[`mem_free`]) for benchmarks.
//! - [`module`]: a small kernel-launch facility ([`CudaModule`],
//!   [`CudaFunction`], [`KernelArg`]) for tests and stress kernels.
//!
//! Handles are ids from one monotonic counter, never raw driver pointers:
//! the tables below map them to RAII objects whose `Drop` destroys the
//! driver object (failures logged with `tracing::warn!`, never panicked).
//! Every RAII object holds the retained primary context, so the context is
//! released after the last of them.

pub mod baseline;
mod driver;
pub mod module;
mod share;

pub use baseline::{mem_alloc, mem_free, DriverPool};
pub use module::{CudaFunction, CudaModule, KernelArg};

use crate::device::{
    Access, AccessDesc, CaptureMode, CaptureStatus, Device, DevicePtr, Event, Graph, GraphExec,
    GraphOptions, HostTask, MemInfo, Physical, PhysicalOptions, Stream, StreamProbe,
};
use crate::error::{Op, SysError, SysResult};
use crate::validate::{
    check_granular, check_size, invalid, lookup, missing_stream, remove, stream_id,
};
use cudarc::driver::sys;
use driver::{check, check_capture, check_sized, driver_error, warn_drop, Ctx};
use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard};

/// The number of the legacy default (NULL) stream among a device
/// instance's streams, registered at construction. A stream id carries
/// its instance in its high bits, so the default stream's id is
/// `dev.default_stream()`, not this number.
pub const DEFAULT_STREAM_ID: u64 = 0;

/// `CU_STREAM_LEGACY`: the legacy default stream, as a handle value.
pub const RAW_STREAM_LEGACY: usize = 1;
/// `CU_STREAM_PER_THREAD`: the per-thread default stream, as a handle value.
pub const RAW_STREAM_PER_THREAD: usize = 2;

/// Whether a CUDA driver can be used here: the library loads, has every
/// entry point this backend calls, `cuInit` succeeds and at least one device
/// exists. Computed once per process; never panics.
pub fn driver_available() -> bool {
    driver::probe_cached().is_ok()
}

/// Why [`driver_available`] is false (`None` when it is true).
pub fn driver_unavailable_reason() -> Option<String> {
    driver::probe_cached().err()
}

// ---------------------------------------------------------------------------
// RAII driver objects
// ---------------------------------------------------------------------------

/// A stream in the table: created by us (destroyed on drop) or adopted.
struct StreamObj {
    raw: sys::CUstream,
    owned: bool,
    ctx: Arc<Ctx>,
    /// The handle an allocator keeps ([`Device::stream_probe`]); its
    /// `destroyed` flag is set by `destroy_stream` before the table forgets
    /// the object, so that a thread's cached reference (see
    /// `crate::recent`) and every probe stop resolving.
    probe: Arc<CudaProbe>,
}

/// The CUDA backend's [`StreamProbe`]: the raw handle, its context and a
/// destroyed flag, and no reference to the stream object, so that holding
/// it does not delay the driver stream's destruction.
struct CudaProbe {
    raw: sys::CUstream,
    ctx: Arc<Ctx>,
    destroyed: AtomicBool,
    instance: u64,
    id: u64,
}

// SAFETY: a CUstream is a driver handle usable from any thread.
unsafe impl Send for CudaProbe {}
// SAFETY: as above; only `destroyed` changes, and it is atomic.
unsafe impl Sync for CudaProbe {}

impl StreamProbe for CudaProbe {
    #[inline]
    fn is_capturing(&self) -> SysResult<bool> {
        let op = Op::IsCapturing;
        if self.destroyed.load(Ordering::Acquire) {
            return Err(missing_stream(op, self.instance, self.id));
        }
        // The stream was live just now; a destroy racing with this call is
        // the caller's race (see `StreamProbe`).
        ask_is_capturing(&self.ctx, self.raw, op)
    }
    #[inline]
    fn check(&self) -> SysResult<()> {
        if self.destroyed.load(Ordering::Acquire) {
            return Err(missing_stream(Op::CheckStream, self.instance, self.id));
        }
        Ok(())
    }
}

/// `cuStreamIsCapturing` on `raw`, which must be a live stream of `ctx`'s
/// context (or null, the legacy stream). A created stream names its
/// context, so the context is bound only for the legacy stream, or when
/// the driver asks for one.
#[inline]
fn ask_is_capturing(ctx: &Ctx, raw: sys::CUstream, op: Op) -> SysResult<bool> {
    let ask = |raw: sys::CUstream| {
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: the caller passes a live stream; valid out pointer.
        let r = unsafe { sys::cuStreamIsCapturing(raw, &mut status) };
        (r, status)
    };
    let (mut r, mut status) = if raw.is_null() {
        (
            sys::CUresult::CUDA_ERROR_INVALID_CONTEXT,
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE,
        )
    } else {
        ask(raw)
    };
    if r == sys::CUresult::CUDA_ERROR_INVALID_CONTEXT {
        ctx.bind(op)?;
        (r, status) = ask(raw);
    }
    match r {
        sys::CUresult::CUDA_SUCCESS => {
            Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
        }
        // Asking about the legacy stream while another stream captures in
        // global mode: touching it would break that capture.
        sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT => Ok(true),
        r => Err(driver_error(op, r)),
    }
}

impl crate::recent::Retirable for StreamObj {
    fn retired(&self) -> bool {
        self.probe.destroyed.load(Ordering::Acquire)
    }
}

// SAFETY: a CUstream is a driver handle usable from any thread.
unsafe impl Send for StreamObj {}
// SAFETY: as above; the object is immutable after construction.
unsafe impl Sync for StreamObj {}

impl Drop for StreamObj {
    fn drop(&mut self) {
        if self.owned && self.ctx.bind_in_drop("a stream") {
            // SAFETY: we created this stream and drop it once; the driver
            // lets queued work finish before it frees the stream.
            warn_drop("cuStreamDestroy", unsafe {
                sys::cuStreamDestroy_v2(self.raw)
            });
        }
    }
}

struct EventObj {
    raw: sys::CUevent,
    ctx: Arc<Ctx>,
}

// SAFETY: a CUevent is a driver handle usable from any thread.
unsafe impl Send for EventObj {}
// SAFETY: as above; immutable after construction.
unsafe impl Sync for EventObj {}

impl Drop for EventObj {
    fn drop(&mut self) {
        if self.ctx.bind_in_drop("an event") {
            // SAFETY: we created this event and destroy it once.
            warn_drop("cuEventDestroy", unsafe {
                sys::cuEventDestroy_v2(self.raw)
            });
        }
    }
}

struct PhysObj {
    handle: sys::CUmemGenericAllocationHandle,
    size: usize,
    exportable: bool,
    /// Cleared once `release_physical` has released the handle itself.
    live: AtomicBool,
    ctx: Arc<Ctx>,
}

impl Drop for PhysObj {
    fn drop(&mut self) {
        if *self.live.get_mut() && self.ctx.bind_in_drop("physical memory") {
            // SAFETY: the handle came from cuMemCreate/cuMemImport and is
            // released once; memory still mapped lives on until unmapped.
            warn_drop("cuMemRelease", unsafe { sys::cuMemRelease(self.handle) });
        }
    }
}

/// A graph from `end_capture`, destroyed on drop.
struct GraphObj {
    raw: sys::CUgraph,
    ctx: Arc<Ctx>,
}

// SAFETY: a CUgraph is a driver handle usable from any thread; the driver
// does not synchronise calls on one graph, and this object only destroys it.
unsafe impl Send for GraphObj {}
// SAFETY: as above; immutable after construction.
unsafe impl Sync for GraphObj {}

impl Drop for GraphObj {
    fn drop(&mut self) {
        if self.ctx.bind_in_drop("a graph") {
            // SAFETY: we got this graph from cuStreamEndCapture and destroy it once.
            warn_drop("cuGraphDestroy", unsafe { sys::cuGraphDestroy(self.raw) });
        }
    }
}

/// An executable graph, destroyed on drop.
struct ExecObj {
    raw: sys::CUgraphExec,
    ctx: Arc<Ctx>,
}

// SAFETY: a CUgraphExec is a driver handle usable from any thread; the
// driver serialises launches of one executable graph itself.
unsafe impl Send for ExecObj {}
// SAFETY: as above; immutable after construction.
unsafe impl Sync for ExecObj {}

impl Drop for ExecObj {
    fn drop(&mut self) {
        if self.ctx.bind_in_drop("an executable graph") {
            // SAFETY: we instantiated this executable graph and destroy it once;
            // launches already issued still complete.
            warn_drop("cuGraphExecDestroy", unsafe {
                sys::cuGraphExecDestroy(self.raw)
            });
        }
    }
}

/// Reservations and mappings, kept to reject what the driver would not
/// check (or would check with a less helpful error).
#[derive(Default)]
struct VmState {
    /// start → size
    reservations: BTreeMap<u64, usize>,
    /// start → (size, physical id)
    mappings: BTreeMap<u64, (usize, u64)>,
}

impl VmState {
    /// The reservation containing `[ptr, ptr+size)`, if one does.
    fn reservation_containing(&self, ptr: u64, size: usize) -> Option<(u64, usize)> {
        let (&start, &len) = self.reservations.range(..=ptr).next_back()?;
        let end = ptr.checked_add(size as u64)?;
        (end <= start + len as u64).then_some((start, len))
    }

    /// Whether any mapping overlaps `[ptr, ptr+size)`.
    fn overlaps_mapping(&self, ptr: u64, size: usize) -> bool {
        let end = ptr + size as u64;
        if let Some((&s, &(len, _))) = self.mappings.range(..=ptr).next_back() {
            if s + len as u64 > ptr {
                return true;
            }
        }
        self.mappings.range(ptr..end).next().is_some()
    }

    /// Whether `[ptr, ptr+size)` is covered by mappings with no gap.
    fn fully_mapped(&self, ptr: u64, size: usize) -> bool {
        let end = ptr + size as u64;
        let mut at = ptr;
        while at < end {
            match self.mappings.range(..=at).next_back() {
                Some((&s, &(len, _))) if s + len as u64 > at => at = s + len as u64,
                _ => return false,
            }
        }
        true
    }
}

// ---------------------------------------------------------------------------
// The device
// ---------------------------------------------------------------------------

pub(crate) struct Inner {
    /// Process-unique id of this instance, for `crate::recent`.
    instance: u64,
    pub(crate) ctx: Arc<Ctx>,
    granularity: usize,
    /// Ids of events, physical handles and graphs.
    next_id: AtomicU64,
    /// Local ids of streams, counted apart from every other id so that
    /// streams made one after another get consecutive ids (a pool keeps
    /// the ids of streams it forgot as runs of consecutive ids).
    next_stream: AtomicU64,
    streams: RwLock<HashMap<u64, Arc<StreamObj>>>,
    events: RwLock<HashMap<u64, Arc<EventObj>>>,
    physical: RwLock<HashMap<u64, Arc<PhysObj>>>,
    graphs: RwLock<HashMap<u64, Arc<GraphObj>>>,
    execs: RwLock<HashMap<u64, Arc<ExecObj>>>,
    vm: Mutex<VmState>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Tables drop after this body (each object destroys itself); first
        // undo what has no RAII object of its own: mappings and reservations.
        let vm = std::mem::take(self.vm.get_mut().unwrap_or_else(|e| e.into_inner()));
        if (vm.mappings.is_empty() && vm.reservations.is_empty())
            || !self.ctx.bind_in_drop("mappings")
        {
            return;
        }
        if !vm.mappings.is_empty() {
            tracing::warn!(
                count = vm.mappings.len(),
                "tidepool cuda: device dropped with live mappings; unmapping them"
            );
        }
        for (&ptr, &(size, _)) in &vm.mappings {
            // SAFETY: this exact range was mapped by `map` and never unmapped.
            warn_drop("cuMemUnmap", unsafe { sys::cuMemUnmap(ptr, size) });
        }
        for (&ptr, &size) in &vm.reservations {
            // SAFETY: this exact range was reserved by `reserve_va`; its
            // mappings were removed just above.
            warn_drop("cuMemAddressFree", unsafe {
                sys::cuMemAddressFree(ptr, size)
            });
        }
    }
}

/// One CUDA device, driven through its primary context.
///
/// `CudaDevice::new` returns the device by value; it is a cheap handle
/// (`Clone` shares the same tables and context), so wrap it in an `Arc` or
/// clone it as you like. Every method makes the primary context current on
/// the calling thread if it is not already.
#[derive(Clone)]
pub struct CudaDevice {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.inner.ctx.ordinal)
            .field("granularity", &self.inner.granularity)
            .finish_non_exhaustive()
    }
}

fn poisoned<T>(e: std::sync::PoisonError<T>) -> T {
    e.into_inner()
}

fn mem_location(ordinal: i32) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ordinal,
    }
}

fn allocation_prop(ordinal: i32, exportable: bool) -> sys::CUmemAllocationProp {
    // SAFETY: CUmemAllocationProp is a plain C struct for which all-zero
    // bytes are valid (null pointer, zero enums = INVALID/NONE).
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location = mem_location(ordinal);
    prop.requestedHandleTypes = if exportable {
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    } else {
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE
    };
    prop
}

/// Trampoline of `launch_host`: `data` is a `Box<HostTask>` leaked by
/// `launch_host`; the driver calls this exactly once.
unsafe extern "C" fn host_task_trampoline(data: *mut c_void) {
    // SAFETY: `data` is the pointer from `Box::into_raw` in `launch_host`,
    // passed to the driver once and called once.
    let task: Box<HostTask> = unsafe { Box::from_raw(data.cast::<HostTask>()) };
    if let Err(p) = catch_unwind(AssertUnwindSafe(move || (*task)())) {
        let msg = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        tracing::error!(panic = %msg, "tidepool cuda: a host task panicked");
    }
}

impl CudaDevice {
    /// Open device `ordinal`: check the driver, `cuInit`, retain the primary
    /// context, read the granularity, register the legacy default stream.
    ///
    /// Returns [`SysError::DriverUnavailable`] (never panics) when no CUDA
    /// driver can be loaded or initialised on this machine.
    pub fn new(ordinal: i32) -> SysResult<CudaDevice> {
        driver::probe_cached().map_err(|reason| SysError::DriverUnavailable { reason })?;
        let ctx = Arc::new(Ctx::retain(ordinal)?);
        ctx.bind(Op::Init)?;

        let prop = allocation_prop(ordinal, false);
        let mut granularity = 0usize;
        // SAFETY: valid out pointer and a fully initialised property struct.
        check(Op::Granularity, unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        })?;
        if granularity == 0 || !granularity.is_power_of_two() {
            return Err(SysError::Unsupported {
                op: Op::Granularity,
                reason: format!("the driver reports granularity {granularity}"),
            });
        }

        let instance = crate::recent::new_owner();
        let mut streams = HashMap::new();
        streams.insert(
            stream_id(instance, DEFAULT_STREAM_ID),
            Arc::new(StreamObj {
                raw: std::ptr::null_mut(),
                owned: false,
                ctx: ctx.clone(),
                probe: Arc::new(CudaProbe {
                    raw: std::ptr::null_mut(),
                    ctx: ctx.clone(),
                    destroyed: AtomicBool::new(false),
                    instance,
                    id: stream_id(instance, DEFAULT_STREAM_ID),
                }),
            }),
        );
        tracing::debug!(ordinal, granularity, "tidepool cuda: device opened");
        Ok(CudaDevice {
            inner: Arc::new(Inner {
                instance,
                ctx,
                granularity,
                next_id: AtomicU64::new(DEFAULT_STREAM_ID + 1),
                next_stream: AtomicU64::new(DEFAULT_STREAM_ID + 1),
                streams: RwLock::new(streams),
                events: RwLock::new(HashMap::new()),
                physical: RwLock::new(HashMap::new()),
                graphs: RwLock::new(HashMap::new()),
                execs: RwLock::new(HashMap::new()),
                vm: Mutex::new(VmState::default()),
            }),
        })
    }

    #[inline]
    pub(crate) fn bind(&self, op: Op) -> SysResult<()> {
        self.inner.ctx.bind(op)
    }

    fn new_id(&self) -> u64 {
        self.inner.next_id.fetch_add(1, Ordering::Relaxed)
    }

    fn vm(&self) -> MutexGuard<'_, VmState> {
        self.inner.vm.lock().unwrap_or_else(poisoned)
    }

    fn streams(&self) -> RwLockReadGuard<'_, HashMap<u64, Arc<StreamObj>>> {
        self.inner.streams.read().unwrap_or_else(poisoned)
    }

    /// Run `f` on the raw stream while holding a reference to its object
    /// (so a concurrent destroy cannot free the driver stream under `f`).
    /// For short, non-blocking driver calls.
    #[inline]
    pub(crate) fn with_stream<R>(
        &self,
        op: Op,
        stream: Stream,
        f: impl FnOnce(sys::CUstream) -> SysResult<R>,
    ) -> SysResult<R> {
        // A cached strong reference keeps the driver stream alive during
        // `f` even if another thread destroys it meanwhile (the object's
        // drop destroys the driver stream after the last user).
        if let Some(obj) = crate::recent::get::<StreamObj>(self.inner.instance, stream.0) {
            return f(obj.raw);
        }
        let table = self.streams();
        match table.get(&stream.0) {
            Some(obj) => {
                crate::recent::put(self.inner.instance, stream.0, obj);
                f(obj.raw)
            }
            None => Err(missing_stream(op, self.inner.instance, stream.0)),
        }
    }

    /// The stream object itself, for blocking calls (no lock held during them).
    fn stream_obj(&self, op: Op, stream: Stream) -> SysResult<Arc<StreamObj>> {
        lookup(&self.inner.streams, op, "stream", stream.0)
            .map_err(|_| missing_stream(op, self.inner.instance, stream.0))
    }

    fn event_obj(&self, op: Op, event: Event) -> SysResult<Arc<EventObj>> {
        lookup(&self.inner.events, op, "event", event.0)
    }

    fn phys_obj(&self, op: Op, handle: Physical) -> SysResult<Arc<PhysObj>> {
        lookup(&self.inner.physical, op, "physical memory", handle.0)
    }

    fn check_granular(&self, op: Op, what: &str, value: u64) -> SysResult<()> {
        check_granular(op, what, value, self.inner.granularity)
    }

    fn check_size(&self, op: Op, size: usize) -> SysResult<()> {
        check_size(op, size, self.inner.granularity)
    }

    fn register_stream(&self, raw: sys::CUstream, owned: bool) -> Stream {
        let local = self.inner.next_stream.fetch_add(1, Ordering::Relaxed);
        let id = stream_id(self.inner.instance, local);
        let obj = Arc::new(StreamObj {
            raw,
            owned,
            ctx: self.inner.ctx.clone(),
            probe: Arc::new(CudaProbe {
                raw,
                ctx: self.inner.ctx.clone(),
                destroyed: AtomicBool::new(false),
                instance: self.inner.instance,
                id,
            }),
        });
        self.inner
            .streams
            .write()
            .unwrap_or_else(poisoned)
            .insert(id, obj);
        Stream(id)
    }

    /// The raw `CUstream` behind a stream id, as an integer (0 for the
    /// legacy default stream), for adapters that call the driver themselves.
    pub fn raw_stream(&self, stream: Stream) -> SysResult<usize> {
        self.with_stream(Op::AdoptStream, stream, |raw| Ok(raw as usize))
    }

    /// Create a non-blocking stream with a priority. Lower numbers are higher
    /// priorities; see [`CudaDevice::stream_priority_range`]. Out-of-range
    /// values are clamped by the driver.
    pub fn create_stream_with_priority(&self, priority: i32) -> SysResult<Stream> {
        self.bind(Op::CreateStream)?;
        let mut raw: sys::CUstream = std::ptr::null_mut();
        // SAFETY: valid out pointer; the context is current.
        check(Op::CreateStream, unsafe {
            sys::cuStreamCreateWithPriority(
                &mut raw,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                priority,
            )
        })?;
        Ok(self.register_stream(raw, true))
    }

    /// `(least, greatest)` stream priority: `least` is the lowest priority
    /// (numerically largest, usually 0), `greatest` the highest (numerically
    /// smallest, e.g. -5).
    pub fn stream_priority_range(&self) -> SysResult<(i32, i32)> {
        self.bind(Op::CreateStream)?;
        let (mut least, mut greatest) = (0i32, 0i32);
        // SAFETY: valid out pointers; the context is current.
        check(Op::CreateStream, unsafe {
            sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest)
        })?;
        Ok((least, greatest))
    }

    /// Free and total memory of this device.
    fn mem_info_impl(&self) -> SysResult<MemInfo> {
        self.bind(Op::MemInfo)?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out pointers; the context is current.
        check(Op::MemInfo, unsafe {
            sys::cuMemGetInfo_v2(&mut free, &mut total)
        })?;
        Ok(MemInfo { free, total })
    }
}

impl Device for CudaDevice {
    fn backend_name(&self) -> &'static str {
        "cuda"
    }

    fn ordinal(&self) -> i32 {
        self.inner.ctx.ordinal
    }

    fn granularity(&self) -> usize {
        self.inner.granularity
    }

    fn reserve_va(&self, size: usize, alignment: usize) -> SysResult<DevicePtr> {
        let op = Op::ReserveVa;
        self.check_size(op, size)?;
        if alignment != 0 && !alignment.is_power_of_two() {
            return Err(invalid(
                op,
                format!("alignment {alignment} is not a power of two"),
            ));
        }
        self.bind(op)?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: valid out pointer; no fixed address requested (0), flags 0.
        let r = unsafe { sys::cuMemAddressReserve(&mut ptr, size, alignment, 0, 0) };
        check_sized(op, r, size)?;
        self.vm().reservations.insert(ptr, size);
        Ok(ptr)
    }

    fn free_va(&self, ptr: DevicePtr, size: usize) -> SysResult<()> {
        let op = Op::FreeVa;
        let mut vm = self.vm();
        match vm.reservations.get(&ptr) {
            Some(&s) if s == size => {}
            Some(&s) => {
                return Err(invalid(
                    op,
                    format!("reservation at {ptr:#x} has size {s:#x}, not {size:#x}"),
                ))
            }
            None => return Err(invalid(op, format!("no reservation starts at {ptr:#x}"))),
        }
        if vm.overlaps_mapping(ptr, size) {
            return Err(invalid(
                op,
                format!("reservation at {ptr:#x} still holds mappings"),
            ));
        }
        self.bind(op)?;
        // SAFETY: exactly a range reserved by `reserve_va`, holding no mappings.
        check(op, unsafe { sys::cuMemAddressFree(ptr, size) })?;
        vm.reservations.remove(&ptr);
        Ok(())
    }

    fn create_physical(&self, size: usize, options: PhysicalOptions) -> SysResult<Physical> {
        let op = Op::CreatePhysical;
        self.check_size(op, size)?;
        self.bind(op)?;
        let prop = allocation_prop(self.inner.ctx.ordinal, options.exportable);
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: valid out pointer and a fully initialised property struct.
        let r = unsafe { sys::cuMemCreate(&mut handle, size, &prop, 0) };
        check_sized(op, r, size)?;
        let obj = Arc::new(PhysObj {
            handle,
            size,
            exportable: options.exportable,
            live: AtomicBool::new(true),
            ctx: self.inner.ctx.clone(),
        });
        let id = self.new_id();
        self.inner
            .physical
            .write()
            .unwrap_or_else(poisoned)
            .insert(id, obj);
        Ok(Physical(id))
    }

    fn release_physical(&self, handle: Physical) -> SysResult<()> {
        let obj = remove(
            &self.inner.physical,
            Op::ReleasePhysical,
            "physical memory",
            handle.0,
        )?;
        // Release now, reporting the driver's answer. (A concurrent `map`
        // may still hold a clone: then the clone's drop releases it.)
        if let Some(obj) = Arc::into_inner(obj) {
            self.bind(Op::ReleasePhysical)?;
            obj.live.store(false, Ordering::Relaxed);
            // SAFETY: the handle is out of the table and `live` is cleared,
            // so neither this nor the destructor can release it again.
            check(Op::ReleasePhysical, unsafe {
                sys::cuMemRelease(obj.handle)
            })?;
        }
        Ok(())
    }

    fn map(&self, ptr: DevicePtr, size: usize, handle: Physical, offset: usize) -> SysResult<()> {
        let op = Op::Map;
        self.check_size(op, size)?;
        self.check_granular(op, "address", ptr)?;
        self.check_granular(op, "offset", offset as u64)?;
        let phys = self.phys_obj(op, handle)?;
        if offset.checked_add(size).is_none_or(|end| end > phys.size) {
            return Err(invalid(
                op,
                format!(
                    "offset {offset:#x} + size {size:#x} exceeds the physical size {:#x}",
                    phys.size
                ),
            ));
        }
        crate::validate::check_whole_handle(op, offset, size, phys.size)?;
        let mut vm = self.vm();
        if vm.reservation_containing(ptr, size).is_none() {
            return Err(invalid(
                op,
                format!("[{ptr:#x}, +{size:#x}) is not inside one reservation"),
            ));
        }
        if vm.overlaps_mapping(ptr, size) {
            return Err(invalid(
                op,
                format!("[{ptr:#x}, +{size:#x}) overlaps an existing mapping"),
            ));
        }
        self.bind(op)?;
        // SAFETY: the range lies in our reservation and is unmapped, the
        // handle is live and `offset + size` fits in it.
        let r = unsafe { sys::cuMemMap(ptr, size, offset, phys.handle, 0) };
        check_sized(op, r, size)?;
        vm.mappings.insert(ptr, (size, handle.0));
        Ok(())
    }

    fn unmap(&self, ptr: DevicePtr, size: usize) -> SysResult<()> {
        let op = Op::Unmap;
        let mut vm = self.vm();
        match vm.mappings.get(&ptr) {
            Some(&(s, _)) if s == size => {}
            Some(&(s, _)) => {
                return Err(invalid(
                    op,
                    format!("the mapping at {ptr:#x} has size {s:#x}, not {size:#x}"),
                ))
            }
            None => return Err(invalid(op, format!("no mapping starts at {ptr:#x}"))),
        }
        self.bind(op)?;
        // SAFETY: exactly a range mapped by one `map` call.
        check(op, unsafe { sys::cuMemUnmap(ptr, size) })?;
        vm.mappings.remove(&ptr);
        Ok(())
    }

    fn set_access(&self, ptr: DevicePtr, size: usize, access: &[AccessDesc]) -> SysResult<()> {
        let op = Op::SetAccess;
        self.check_size(op, size)?;
        self.check_granular(op, "address", ptr)?;
        if access.is_empty() {
            return Err(invalid(op, "no access descriptor given"));
        }
        let descs: Vec<sys::CUmemAccessDesc> = access
            .iter()
            .map(|a| sys::CUmemAccessDesc {
                location: mem_location(a.device),
                flags: match a.access {
                    Access::None => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE,
                    Access::Read => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ,
                    Access::ReadWrite => sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                },
            })
            .collect();
        let vm = self.vm();
        if !vm.fully_mapped(ptr, size) {
            return Err(invalid(
                op,
                format!("[{ptr:#x}, +{size:#x}) is not entirely mapped"),
            ));
        }
        self.bind(op)?;
        // SAFETY: the range is mapped (checked above, under the lock that
        // `unmap` takes); `descs` outlives the call.
        check(op, unsafe {
            sys::cuMemSetAccess(ptr, size, descs.as_ptr(), descs.len())
        })
    }

    fn export_fd(&self, handle: Physical) -> SysResult<OwnedFd> {
        let op = Op::ExportHandle;
        let phys = self.phys_obj(op, handle)?;
        if !phys.exportable {
            return Err(invalid(
                op,
                "physical memory was not created with PhysicalOptions { exportable: true }",
            ));
        }
        self.bind(op)?;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: for the POSIX fd handle type the out parameter is an int.
        check(op, unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut std::ffi::c_int).cast::<c_void>(),
                phys.handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        if fd < 0 {
            return Err(invalid(op, "the driver returned no file descriptor"));
        }
        // SAFETY: the driver hands us a fresh fd that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    fn import_fd(&self, fd: OwnedFd, size: usize) -> SysResult<Physical> {
        let op = Op::ImportHandle;
        self.check_size(op, size)?;
        self.bind(op)?;
        let raw = fd.into_raw_fd();
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: for the POSIX fd type the fd is passed by value cast to a
        // pointer; `handle` is a valid out pointer.
        let r = unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                raw as isize as *mut c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        };
        // The import holds its own reference; our fd is closed either way.
        // SAFETY: `raw` came from `into_raw_fd` above and is owned here.
        drop(unsafe { OwnedFd::from_raw_fd(raw) });
        check(op, r)?;
        let obj = Arc::new(PhysObj {
            handle,
            size,
            exportable: true,
            live: AtomicBool::new(true),
            ctx: self.inner.ctx.clone(),
        });
        let id = self.new_id();
        self.inner
            .physical
            .write()
            .unwrap_or_else(poisoned)
            .insert(id, obj);
        Ok(Physical(id))
    }

    fn mem_info(&self) -> SysResult<MemInfo> {
        self.mem_info_impl()
    }

    fn create_stream(&self) -> SysResult<Stream> {
        self.bind(Op::CreateStream)?;
        let mut raw: sys::CUstream = std::ptr::null_mut();
        // SAFETY: valid out pointer; the context is current.
        check(Op::CreateStream, unsafe {
            sys::cuStreamCreate(&mut raw, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        })?;
        Ok(self.register_stream(raw, true))
    }

    fn destroy_stream(&self, stream: Stream) -> SysResult<()> {
        let op = Op::DestroyStream;
        if stream == self.default_stream() {
            return Err(invalid(op, "the default stream is never destroyed"));
        }
        let obj = remove(&self.inner.streams, op, "stream", stream.0)
            .map_err(|_| missing_stream(op, self.inner.instance, stream.0))?;
        obj.probe.destroyed.store(true, Ordering::Release);
        // Dropped here, or by the last in-flight user (RAII destroys it).
        drop(obj);
        Ok(())
    }

    fn default_stream(&self) -> Stream {
        Stream(stream_id(self.inner.instance, DEFAULT_STREAM_ID))
    }

    fn adopt_stream(&self, raw: usize) -> SysResult<Stream> {
        // 0 = legacy NULL stream, 1 = CU_STREAM_LEGACY, 2 = CU_STREAM_PER_THREAD,
        // else a CUstream owned by the caller, which must outlive the id.
        Ok(self.register_stream(raw as sys::CUstream, false))
    }

    fn synchronize_stream(&self, stream: Stream) -> SysResult<()> {
        let op = Op::SynchronizeStream;
        let obj = self.stream_obj(op, stream)?;
        self.bind(op)?;
        // SAFETY: the stream is live while we hold `obj`.
        check(op, unsafe { sys::cuStreamSynchronize(obj.raw) })
    }

    fn synchronize_device(&self) -> SysResult<()> {
        let op = Op::SynchronizeDevice;
        self.bind(op)?;
        // SAFETY: the context is current (bind); no arguments.
        check(op, unsafe { sys::cuCtxSynchronize() })
    }

    fn query_stream(&self, stream: Stream) -> SysResult<bool> {
        let op = Op::QueryStream;
        self.bind(op)?;
        self.with_stream(op, stream, |raw| {
            // SAFETY: the stream is live while the table lock is held.
            match unsafe { sys::cuStreamQuery(raw) } {
                sys::CUresult::CUDA_SUCCESS => Ok(true),
                sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
                r => Err(driver_error(op, r)),
            }
        })
    }

    fn is_capturing(&self, stream: Stream) -> SysResult<bool> {
        // The stream object is held during the call (with_stream).
        let op = Op::IsCapturing;
        self.with_stream(op, stream, |raw| ask_is_capturing(&self.inner.ctx, raw, op))
    }

    fn check_stream(&self, stream: Stream) -> SysResult<()> {
        // A table lookup (through this thread's cache): no driver call.
        self.with_stream(Op::CheckStream, stream, |_| Ok(()))
    }

    fn stream_probe(&self, stream: Stream) -> SysResult<Option<Arc<dyn StreamProbe>>> {
        let obj = self.stream_obj(Op::CheckStream, stream)?;
        let probe: Arc<dyn StreamProbe> = obj.probe.clone();
        Ok(Some(probe))
    }

    fn create_event(&self) -> SysResult<Event> {
        let op = Op::CreateEvent;
        self.bind(op)?;
        let mut raw: sys::CUevent = std::ptr::null_mut();
        // SAFETY: valid out pointer; the context is current.
        check(op, unsafe {
            sys::cuEventCreate(&mut raw, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
        })?;
        let obj = Arc::new(EventObj {
            raw,
            ctx: self.inner.ctx.clone(),
        });
        let id = self.new_id();
        self.inner
            .events
            .write()
            .unwrap_or_else(poisoned)
            .insert(id, obj);
        Ok(Event(id))
    }

    fn record_event(&self, event: Event, stream: Stream) -> SysResult<()> {
        let op = Op::RecordEvent;
        let ev = self.event_obj(op, event)?;
        self.bind(op)?;
        self.with_stream(op, stream, |raw| {
            // SAFETY: event and stream are live (Arc / table lock held).
            check(op, unsafe { sys::cuEventRecord(ev.raw, raw) })
        })
    }

    fn query_event(&self, event: Event) -> SysResult<bool> {
        let op = Op::QueryEvent;
        let ev = self.event_obj(op, event)?;
        self.bind(op)?;
        // SAFETY: the event is live while we hold `ev`.
        match unsafe { sys::cuEventQuery(ev.raw) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => Err(driver_error(op, r)),
        }
    }

    fn synchronize_event(&self, event: Event) -> SysResult<()> {
        let op = Op::SynchronizeEvent;
        let ev = self.event_obj(op, event)?;
        self.bind(op)?;
        // SAFETY: the event is live while we hold `ev`.
        check(op, unsafe { sys::cuEventSynchronize(ev.raw) })
    }

    fn destroy_event(&self, event: Event) -> SysResult<()> {
        let obj = remove(&self.inner.events, Op::DestroyEvent, "event", event.0)?;
        drop(obj);
        Ok(())
    }

    fn wait_event(&self, stream: Stream, event: Event) -> SysResult<()> {
        let op = Op::WaitEvent;
        let ev = self.event_obj(op, event)?;
        self.bind(op)?;
        self.with_stream(op, stream, |raw| {
            // SAFETY: event and stream are live; flags 0 (CU_EVENT_WAIT_DEFAULT).
            check(op, unsafe { sys::cuStreamWaitEvent(raw, ev.raw, 0) })
        })
    }

    fn launch_host(&self, stream: Stream, task: HostTask) -> SysResult<()> {
        let op = Op::LaunchHost;
        self.bind(op)?;
        // A captured host node runs once per launch, but the trampoline
        // frees its task on the first call: never let one be captured.
        if self.capture_status(stream)?.is_capturing() {
            return Err(SysError::CaptureViolation {
                op,
                reason: "a one-shot host task cannot be captured into a graph".into(),
            });
        }
        self.with_stream(op, stream, move |raw| {
            let data = Box::into_raw(Box::new(task)).cast::<c_void>();
            // SAFETY: the trampoline takes ownership of `data` when called;
            // the stream is live. Host functions must not call CUDA.
            let r = unsafe { sys::cuLaunchHostFunc(raw, Some(host_task_trampoline), data) };
            if r != sys::CUresult::CUDA_SUCCESS {
                // SAFETY: the driver refused the call, so it will never run
                // the trampoline: reclaim the box to drop the task.
                drop(unsafe { Box::from_raw(data.cast::<HostTask>()) });
                return Err(driver_error(op, r));
            }
            Ok(())
        })
    }

    // --- graph capture ---

    fn capture_status(&self, stream: Stream) -> SysResult<CaptureStatus> {
        // Like `is_capturing`: the context is bound only for the legacy
        // NULL stream, or when the driver asks for one.
        let op = Op::CaptureStatus;
        let ask = |raw: sys::CUstream| {
            // SAFETY: the stream is live (with_stream).
            unsafe { driver::capture_info(raw) }.ok_or_else(|| SysError::Unsupported {
                op,
                reason:
                    "the driver exports no cuStreamGetCaptureInfo (driver older than CUDA 11.3)"
                        .into(),
            })
        };
        self.with_stream(op, stream, |raw| {
            let (mut r, mut status, mut id) = if raw.is_null() {
                (
                    sys::CUresult::CUDA_ERROR_INVALID_CONTEXT,
                    sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE,
                    0,
                )
            } else {
                ask(raw)?
            };
            if r == sys::CUresult::CUDA_ERROR_INVALID_CONTEXT {
                self.bind(op)?;
                (r, status, id) = ask(raw)?;
            }
            check_capture(op, r)?;
            use sys::CUstreamCaptureStatus as S;
            Ok(match status {
                S::CU_STREAM_CAPTURE_STATUS_NONE => CaptureStatus::None,
                S::CU_STREAM_CAPTURE_STATUS_ACTIVE => CaptureStatus::Active { id },
                S::CU_STREAM_CAPTURE_STATUS_INVALIDATED => CaptureStatus::Invalidated { id },
            })
        })
    }

    fn graph_alloc(&self, stream: Stream, size: usize) -> SysResult<DevicePtr> {
        let op = Op::GraphAlloc;
        if size == 0 {
            return Err(invalid(op, "size 0"));
        }
        self.bind(op)?;
        self.with_stream(op, stream, |raw| {
            let mut ptr: sys::CUdeviceptr = 0;
            // SAFETY: valid out pointer; the stream is live; the context is current.
            let r = unsafe { sys::cuMemAllocAsync(&mut ptr, size, raw) };
            if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                check_sized(op, r, size)?;
            }
            check_capture(op, r)?;
            Ok(ptr)
        })
    }

    fn graph_free(&self, stream: Stream, ptr: DevicePtr) -> SysResult<()> {
        let op = Op::GraphFree;
        self.bind(op)?;
        self.with_stream(op, stream, |raw| {
            // SAFETY: the stream is live; the driver checks that `ptr` came
            // from a stream-ordered or graph allocation.
            check_capture(op, unsafe { sys::cuMemFreeAsync(ptr, raw) })
        })
    }

    fn begin_capture(&self, stream: Stream, mode: CaptureMode) -> SysResult<()> {
        let op = Op::Graph;
        self.bind(op)?;
        let mode = match mode {
            CaptureMode::Global => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
            CaptureMode::ThreadLocal => {
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
            }
            CaptureMode::Relaxed => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        };
        self.with_stream(op, stream, |raw| {
            if raw.is_null() {
                return Err(invalid(op, "the legacy default stream cannot be captured"));
            }
            // SAFETY: the stream is live; the context is current.
            check_capture(op, unsafe { sys::cuStreamBeginCapture_v2(raw, mode) })
        })
    }

    fn end_capture(&self, stream: Stream) -> SysResult<Graph> {
        let op = Op::Graph;
        self.bind(op)?;
        let raw_graph = self.with_stream(op, stream, |raw| {
            let mut graph: sys::CUgraph = std::ptr::null_mut();
            // SAFETY: the stream is live; valid out pointer.
            check_capture(op, unsafe { sys::cuStreamEndCapture(raw, &mut graph) })?;
            Ok(graph)
        })?;
        let obj = Arc::new(GraphObj {
            raw: raw_graph,
            ctx: self.inner.ctx.clone(),
        });
        let id = self.new_id();
        self.inner
            .graphs
            .write()
            .unwrap_or_else(poisoned)
            .insert(id, obj);
        Ok(Graph(id))
    }

    fn instantiate_graph(&self, graph: Graph, options: GraphOptions) -> SysResult<GraphExec> {
        let op = Op::Graph;
        let g = lookup(&self.inner.graphs, op, "graph", graph.0)?;
        self.bind(op)?;
        // CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH (its binding's
        // type differs between CUDA versions; the value does not).
        let flags = if options.auto_free_on_launch { 1u64 } else { 0 };
        let mut raw: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: the graph is live while we hold `g`; valid out pointer.
        check_capture(op, unsafe {
            sys::cuGraphInstantiateWithFlags(&mut raw, g.raw, flags)
        })?;
        let obj = Arc::new(ExecObj {
            raw,
            ctx: self.inner.ctx.clone(),
        });
        let id = self.new_id();
        self.inner
            .execs
            .write()
            .unwrap_or_else(poisoned)
            .insert(id, obj);
        Ok(GraphExec(id))
    }

    fn launch_graph(&self, exec: GraphExec, stream: Stream) -> SysResult<()> {
        let op = Op::Graph;
        let e = lookup(&self.inner.execs, op, "executable graph", exec.0)?;
        self.bind(op)?;
        self.with_stream(op, stream, |raw| {
            // SAFETY: the executable graph (held by `e`) and the stream are live.
            check_capture(op, unsafe { sys::cuGraphLaunch(e.raw, raw) })
        })
    }

    fn destroy_graph(&self, graph: Graph) -> SysResult<()> {
        let obj = remove(&self.inner.graphs, Op::Graph, "graph", graph.0)?;
        drop(obj);
        Ok(())
    }

    fn destroy_graph_exec(&self, exec: GraphExec) -> SysResult<()> {
        let obj = remove(&self.inner.execs, Op::Graph, "executable graph", exec.0)?;
        drop(obj);
        Ok(())
    }

    // --- sharing (see `cuda/share.rs`) ---

    fn device_count(&self) -> SysResult<i32> {
        self.device_count_impl()
    }

    fn can_access_peer(&self, peer: i32) -> SysResult<bool> {
        self.can_access_peer_impl(peer)
    }

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
