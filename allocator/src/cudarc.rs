//! The cudarc drop-in: [`PoolStream`] and [`PoolBuffer<T>`].
//!
//! A cudarc program moves its allocations into a tidepool pool by wrapping
//! its stream:
//!
//! ```no_run
//! use tidepool::cudarc::driver::CudaContext;
//! use tidepool::cudarc::PoolStream;
//!
//! let ctx = CudaContext::new(0)?;
//! let stream = PoolStream::new(ctx.default_stream())?; // was: ctx.default_stream()
//! let x = stream.clone_htod(&[1.0f32, 2.0, 3.0])?; // a PoolBuffer<f32>
//! let back = stream.clone_dtoh(&x)?; // every cudarc API takes it
//! assert_eq!(back, [1.0, 2.0, 3.0]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! [`PoolStream`] dereferences to the `Arc<CudaStream>` it wraps, so every
//! cudarc stream method (memcpy, memset, launches, `CudaBlas::new`) still
//! works; only the allocating methods (`alloc`, `alloc_zeros`, `null`,
//! `clone_htod`, `clone_dtod`) are its own and return [`PoolBuffer<T>`].
//! A [`PoolBuffer<T>`] dereferences to a `CudaSlice<T>` (read-only: there is
//! no `DerefMut`, so pool memory can never be swapped into a `CudaSlice`
//! that cudarc would free) and implements cudarc's `DeviceSlice`,
//! `DevicePtr`, `DevicePtrMut` and `PushKernelArg` by forwarding to that
//! slice, so cudarc's event tracking across streams sees it as its own.
//!
//! ## Drop order
//! Dropping a buffer (1) makes its stream wait for the read and write events
//! cudarc recorded for it on other streams (when the context tracks events),
//! then (2) frees the block to the pool on its stream, after the uses
//! declared with [`PoolBuffer::record_stream`]. So memory is reused only by
//! work ordered after every tracked or declared use. A free that fails is
//! logged with `tracing` and the block leaks; a drop never panics.
//!
//! ## Streams
//! Each distinct cudarc stream is registered with the pool once, shared by
//! every [`PoolStream`] and live [`PoolBuffer`] on it, and retired from the
//! pool when the last of them goes; a driver stream handle that is recycled
//! after that is a new stream to the pool. cudarc's per-thread default
//! stream (`per_thread_stream()`) is refused with
//! [`CudarcError::PerThreadStream`]: its handle names a different stream on
//! each thread, while a [`PoolStream`] or [`PoolBuffer`] may be used and
//! dropped on any thread. Only the device's primary context
//! (what `CudaContext::new` gives) shares memory with the pool's device;
//! other contexts are refused with [`CudarcError::NonPrimaryContext`].
//!
//! ## What still allocates outside the pool
//! `CudaSlice::try_clone` (reached through `Deref`), `CudaStream::fork`
//! (a new stream, not memory: wrap it in a [`PoolStream`]) and cuBLASLt
//! workspaces allocate with cudarc's own allocator; [`PoolBuffer::clone`]
//! allocates from the pool.

use crate::error::PoolError;
use crate::pool::default_pool;
use crate::pool::{Allocation, MemPool};
use ::cudarc::driver::{
    sys, CudaContext, CudaSlice, CudaStream, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr,
    DeviceSlice, DriverError, HostSlice, LaunchArgs, PushKernelArg, SyncOnDrop, ValidAsZeroBits,
};
use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::fmt;
use std::mem::ManuallyDrop;
use std::ops::{Deref, RangeBounds};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use tidepool_sys::cuda::CudaDevice;
use tidepool_sys::{Device, Stream, SysError};

/// The cudarc crate this adapter is built against (its `driver` module), so
/// a program can name exactly the types [`PoolStream`] and [`PoolBuffer`]
/// work with.
pub use ::cudarc::driver;

/// `CU_STREAM_PER_THREAD` as a handle value: a different stream on each
/// thread, so never registered (see [`CudarcError::PerThreadStream`]).
const PER_THREAD_STREAM: usize = 2;

/// Errors of the cudarc adapter.
#[derive(Debug)]
#[non_exhaustive]
pub enum CudarcError {
    /// The stream belongs to a context that is not the device's primary
    /// context (`CudaContext::new_non_primary`, `from_raw_context`, green
    /// contexts). The pool's memory is mapped in the primary context.
    NonPrimaryContext {
        /// The ordinal of the stream's device.
        ordinal: usize,
    },
    /// The stream is cudarc's per-thread default stream
    /// (`CudaContext::per_thread_stream`). Its handle is a different stream
    /// on each thread, but a `PoolStream` and its buffers can move between
    /// threads: a buffer dropped on another thread would be freed in the
    /// order of that thread's stream, not of the stream its work ran on.
    PerThreadStream {
        /// The ordinal of the stream's device.
        ordinal: usize,
    },
    /// The pool drives another device than the stream's context.
    WrongDevice {
        /// The device the pool allocates on.
        pool_ordinal: i32,
        /// The device of the stream's context.
        stream_ordinal: usize,
    },
    /// `len` elements of the type do not fit in the address space.
    SizeOverflow {
        /// Elements asked for.
        len: usize,
        /// Bytes per element.
        elem_size: usize,
    },
    /// The pool refused (out of memory, a capturing stream, ...).
    Pool(PoolError),
    /// Opening the device or registering a stream with it failed.
    Device(SysError),
    /// A cudarc call (memcpy, memset, event creation) failed.
    Driver(DriverError),
}

impl fmt::Display for CudarcError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CudarcError::NonPrimaryContext { ordinal } => write!(
                f,
                "the stream's context on device {ordinal} is not the primary context; create it \
                 with CudaContext::new({ordinal}) to allocate from a tidepool pool"
            ),
            CudarcError::PerThreadStream { ordinal } => write!(
                f,
                "cudarc's per-thread default stream on device {ordinal} is a different stream on \
                 each thread and cannot back a PoolStream, which may move between threads; \
                 use ctx.new_stream() or ctx.default_stream()"
            ),
            CudarcError::WrongDevice {
                pool_ordinal,
                stream_ordinal,
            } => write!(
                f,
                "the pool drives device {pool_ordinal} but the stream belongs to device \
                 {stream_ordinal}; use a pool of the stream's device \
                 (tidepool::cudarc::cuda_device and MemPool::new, or PoolStream::new)"
            ),
            CudarcError::SizeOverflow { len, elem_size } => write!(
                f,
                "{len} elements of {elem_size} bytes overflow the address space; ask for fewer"
            ),
            CudarcError::Pool(e) => write!(f, "tidepool: {e}"),
            CudarcError::Device(e) => write!(f, "tidepool device: {e}"),
            CudarcError::Driver(e) => write!(f, "cudarc: {e:?}"),
        }
    }
}

impl std::error::Error for CudarcError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            CudarcError::Pool(e) => Some(e),
            CudarcError::Device(e) => Some(e),
            CudarcError::Driver(e) => Some(e),
            _ => None,
        }
    }
}

impl From<PoolError> for CudarcError {
    fn from(e: PoolError) -> Self {
        CudarcError::Pool(e)
    }
}

impl From<SysError> for CudarcError {
    fn from(e: SysError) -> Self {
        CudarcError::Device(e)
    }
}

impl From<DriverError> for CudarcError {
    fn from(e: DriverError) -> Self {
        CudarcError::Driver(e)
    }
}

/// So that `?` keeps working in code that returns cudarc's `DriverError`.
/// The code says only the kind of failure (out-of-memory, invalid context,
/// ...); the full message is logged at `debug`.
impl From<CudarcError> for DriverError {
    fn from(e: CudarcError) -> Self {
        use sys::CUresult as R;
        tracing::debug!(error = %e, "tidepool cudarc error converted to a DriverError");
        DriverError(match e {
            CudarcError::Driver(d) => return d,
            CudarcError::NonPrimaryContext { .. } => R::CUDA_ERROR_INVALID_CONTEXT,
            CudarcError::PerThreadStream { .. } => R::CUDA_ERROR_INVALID_HANDLE,
            CudarcError::WrongDevice { .. } => R::CUDA_ERROR_INVALID_DEVICE,
            CudarcError::SizeOverflow { .. } => R::CUDA_ERROR_INVALID_VALUE,
            CudarcError::Pool(p) if p.is_out_of_memory() => R::CUDA_ERROR_OUT_OF_MEMORY,
            CudarcError::Pool(PoolError::TooLarge { .. }) => R::CUDA_ERROR_OUT_OF_MEMORY,
            CudarcError::Pool(
                PoolError::StreamCapturing { .. }
                | PoolError::EagerFreeInCapture { .. }
                | PoolError::CapturedUse { .. },
            ) => R::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
            CudarcError::Device(SysError::DriverUnavailable { .. }) => {
                R::CUDA_ERROR_NOT_INITIALIZED
            }
            _ => R::CUDA_ERROR_UNKNOWN,
        })
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The tidepool device of `ctx`'s device: one [`CudaDevice`] per ordinal for
/// the process, on the same primary context as `CudaContext::new`, so its
/// default pool is one pool however many streams use it. Use it to build an
/// explicit pool (`MemPool::new(cuda_device(&ctx)?, config)`) for
/// [`PoolStream::with_pool`].
pub fn cuda_device(ctx: &Arc<CudaContext>) -> Result<Arc<CudaDevice>, CudarcError> {
    let ordinal = ctx.ordinal();
    if !ctx.is_primary() {
        return Err(CudarcError::NonPrimaryContext { ordinal });
    }
    static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<CudaDevice>>>> = OnceLock::new();
    let mut devices = lock(DEVICES.get_or_init(Default::default));
    if let Some(device) = devices.get(&ordinal) {
        return Ok(device.clone());
    }
    let device = Arc::new(CudaDevice::new(ordinal as i32)?);
    devices.insert(ordinal, device.clone());
    Ok(device)
}

/// Identity of a stream in the registry: the pool and the raw `CUstream`
/// (the per-thread default stream, whose handle means a different stream on
/// each thread, is never registered).
type StreamKey = (u64, usize);

fn registry() -> MutexGuard<'static, HashMap<StreamKey, Weak<StreamHandle>>> {
    static REGISTRY: OnceLock<Mutex<HashMap<StreamKey, Weak<StreamHandle>>>> = OnceLock::new();
    lock(REGISTRY.get_or_init(Default::default))
}

/// One cudarc stream registered with one pool. Shared by the
/// [`PoolStream`]s and live [`PoolBuffer`]s on that stream; dropping the
/// last retires the stream from the pool. Holds the `CudaStream`, so the
/// driver cannot recycle the handle while the pool knows it by this id.
struct StreamHandle {
    key: StreamKey,
    id: Stream,
    pool: MemPool<CudaDevice>,
    stream: Arc<CudaStream>,
    /// Slices of dropped buffers, kept for the next buffer at the same
    /// address (see [`Parked`]).
    parked: Mutex<Vec<Parked>>,
}

/// Most slices parked per stream.
const PARK_LIMIT: usize = 32;

/// The `CudaSlice` of a dropped buffer, kept so that the next buffer of the
/// same address, length and type on the same stream reuses it instead of
/// `upgrade_device_ptr`, which creates two tracking events (and the drop
/// destroys them): with tracking on, that event churn costs more than the
/// pool's own alloc+free. Reusing the slice reuses its events; their last
/// records lie before the free, so a later wait on them only orders after
/// work that is already ordered before the reuse.
struct Parked {
    ptr: u64,
    len: usize,
    type_id: TypeId,
    /// Whether the slice has tracking events (tracking was on when it was
    /// made); reused only while that is still the context's setting, so a
    /// slice without events never serves a tracked buffer.
    tracked: bool,
    slice: Box<dyn Any + Send>,
}

/// A parked slice: taken out for reuse, or `leak`ed, never dropped
/// normally (its drop would free pool memory with `cuMemFreeAsync`).
struct ParkedSlice<T>(Option<CudaSlice<T>>);

impl<T> Drop for ParkedSlice<T> {
    fn drop(&mut self) {
        if let Some(slice) = self.0.take() {
            let _ = slice.leak();
        }
    }
}

impl StreamHandle {
    fn get(pool: &MemPool<CudaDevice>, stream: &Arc<CudaStream>) -> Result<Arc<Self>, CudarcError> {
        let ctx = stream.context();
        if !ctx.is_primary() {
            return Err(CudarcError::NonPrimaryContext {
                ordinal: ctx.ordinal(),
            });
        }
        let pool_ordinal = pool.device().ordinal();
        if pool_ordinal as usize != ctx.ordinal() {
            return Err(CudarcError::WrongDevice {
                pool_ordinal,
                stream_ordinal: ctx.ordinal(),
            });
        }
        let raw = stream.cu_stream() as usize;
        if raw == PER_THREAD_STREAM {
            return Err(CudarcError::PerThreadStream {
                ordinal: ctx.ordinal(),
            });
        }
        let key = (pool.id(), raw);
        let mut map = registry();
        if let Some(handle) = map.get(&key).and_then(Weak::upgrade) {
            return Ok(handle);
        }
        let id = pool.device().adopt_stream(raw)?;
        let handle = Arc::new(StreamHandle {
            key,
            id,
            pool: pool.clone(),
            stream: stream.clone(),
            parked: Mutex::new(Vec::new()),
        });
        map.insert(key, Arc::downgrade(&handle));
        tracing::debug!(
            pool = pool.id(),
            stream = id.id(),
            raw,
            "cudarc stream registered"
        );
        Ok(handle)
    }
}

impl StreamHandle {
    fn take_parked<T: 'static>(&self, ptr: u64, len: usize) -> Option<CudaSlice<T>> {
        let tracked = self.stream.context().is_event_tracking();
        let type_id = TypeId::of::<ParkedSlice<T>>();
        let mut parked = lock(&self.parked);
        let at = parked.iter().rposition(|p| {
            p.ptr == ptr && p.len == len && p.type_id == type_id && p.tracked == tracked
        })?;
        let entry = parked.swap_remove(at);
        drop(parked);
        let mut boxed = entry.slice.downcast::<ParkedSlice<T>>().ok()?;
        boxed.0.take()
    }

    fn park<T: 'static>(&self, ptr: u64, tracked: bool, slice: ParkedSlice<T>) {
        let entry = Parked {
            ptr,
            len: slice.0.as_ref().map_or(0, |s| s.len()),
            type_id: TypeId::of::<ParkedSlice<T>>(),
            tracked,
            slice: Box::new(slice),
        };
        let evicted = {
            let mut parked = lock(&self.parked);
            let evicted = (parked.len() >= PARK_LIMIT).then(|| parked.remove(0));
            parked.push(entry);
            evicted
        };
        // Leaked outside the lock (it may wait on its events).
        drop(evicted);
    }
}

impl Drop for StreamHandle {
    fn drop(&mut self) {
        {
            let mut map = registry();
            // A new handle for the same key may already be in place (made
            // after this one's count reached zero): leave it.
            if map.get(&self.key).is_some_and(|w| w.strong_count() == 0) {
                map.remove(&self.key);
            }
        }
        if let Err(e) = self.pool.retire_stream(self.id) {
            tracing::warn!(stream = self.id.id(), error = %e, "retiring a cudarc stream failed");
        }
        if let Err(e) = self.pool.device().destroy_stream(self.id) {
            tracing::warn!(stream = self.id.id(), error = %e, "forgetting a cudarc stream failed");
        }
        tracing::debug!(
            pool = self.pool.id(),
            stream = self.id.id(),
            "cudarc stream retired"
        );
    }
}

/// A cudarc stream whose allocations come from a tidepool pool.
///
/// Dereferences to the wrapped `Arc<CudaStream>`, so cudarc's stream API
/// (memcpy, memset, `launch_builder`, `join`, `CudaBlas::new(stream.clone())`,
/// ...) works unchanged. `PoolStream` is
/// deliberately not `Clone`: `stream.clone()` reaches the `Arc<CudaStream>`
/// as it does in a plain cudarc program; [`PoolStream::share`] gives a
/// second `PoolStream`.
pub struct PoolStream {
    handle: Arc<StreamHandle>,
}

impl fmt::Debug for PoolStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolStream")
            .field("pool", &self.handle.pool.id())
            .field("stream", &self.handle.id)
            .field("cu_stream", &self.handle.stream.cu_stream())
            .finish()
    }
}

impl Deref for PoolStream {
    type Target = Arc<CudaStream>;
    fn deref(&self) -> &Arc<CudaStream> {
        &self.handle.stream
    }
}

impl PoolStream {
    /// Wrap `stream`; allocations come from its device's default pool
    /// ([`default_pool`] of [`cuda_device`]).
    pub fn new(stream: Arc<CudaStream>) -> Result<Self, CudarcError> {
        let device = cuda_device(stream.context())?;
        let pool = default_pool(&device)?;
        Self::with_pool(stream, &pool)
    }

    /// Wrap `stream`; allocations come from `pool`, which must drive the
    /// stream's device.
    pub fn with_pool(
        stream: Arc<CudaStream>,
        pool: &MemPool<CudaDevice>,
    ) -> Result<Self, CudarcError> {
        Ok(PoolStream {
            handle: StreamHandle::get(pool, &stream)?,
        })
    }

    /// Another `PoolStream` on the same stream and pool (cheap: shares the
    /// registration).
    pub fn share(&self) -> PoolStream {
        PoolStream {
            handle: self.handle.clone(),
        }
    }

    /// The pool allocations come from.
    pub fn pool(&self) -> &MemPool<CudaDevice> {
        &self.handle.pool
    }

    /// The pool's id of this stream (a new one whenever the stream is
    /// registered again after being retired).
    pub fn pool_stream(&self) -> Stream {
        self.handle.id
    }

    /// The wrapped cudarc stream.
    pub fn cuda_stream(&self) -> &Arc<CudaStream> {
        &self.handle.stream
    }

    fn bytes_of<T>(len: usize) -> Result<usize, CudarcError> {
        let elem_size = std::mem::size_of::<T>();
        len.checked_mul(elem_size)
            .ok_or(CudarcError::SizeOverflow { len, elem_size })
    }

    fn buffer<T: 'static>(&self, len: usize) -> Result<PoolBuffer<T>, CudarcError> {
        let handle = &self.handle;
        let allocation = handle
            .pool
            .alloc_async(Self::bytes_of::<T>(len)?, handle.id)?;
        let ptr = allocation.ptr() as sys::CUdeviceptr;
        let tracked = handle.stream.context().is_event_tracking();
        // Graph memory (the stream is being captured) never reuses a parked
        // slice: its events would be recorded into the graph.
        let parked = if allocation.is_graph_memory() {
            None
        } else {
            handle.take_parked::<T>(ptr, len)
        };
        let slice = match parked {
            Some(slice) => slice,
            // `upgrade_device_ptr` unwraps the creation of its tracking
            // events; a failure there comes back as an error, the block freed.
            None => match catch_unwind(AssertUnwindSafe(|| {
                // SAFETY: `ptr` is `len * size_of::<T>()` bytes of this
                // pool's memory, mapped in the primary context the stream
                // belongs to, usable by work ordered after the allocation on
                // this stream. The slice is kept in `ManuallyDrop` (or
                // parked) and only ever `leak`ed, so cudarc never frees it.
                unsafe { handle.stream.upgrade_device_ptr::<T>(ptr, len) }
            })) {
                Ok(slice) => slice,
                Err(_) => {
                    if let Err(e) = handle.pool.free_async(allocation, handle.id) {
                        tracing::error!(error = %e, "freeing a block after a failed upgrade failed; it leaks");
                    }
                    return Err(CudarcError::Driver(DriverError(
                        sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY,
                    )));
                }
            },
        };
        Ok(PoolBuffer {
            slice: ManuallyDrop::new(slice),
            allocation: Some(allocation),
            tracked,
            home: handle.clone(),
            uses: Mutex::new(Vec::new()),
        })
    }

    /// An empty buffer (length 0), as `CudaStream::null`.
    pub fn null<T: 'static>(&self) -> Result<PoolBuffer<T>, CudarcError> {
        self.buffer(0)
    }

    /// `len` uninitialised elements from the pool, as `CudaStream::alloc`.
    ///
    /// # Safety
    /// The memory is not initialised: write it before reading it.
    pub unsafe fn alloc<T: DeviceRepr + 'static>(
        &self,
        len: usize,
    ) -> Result<PoolBuffer<T>, CudarcError> {
        self.buffer(len)
    }

    /// `len` zeroed elements from the pool, as `CudaStream::alloc_zeros`.
    pub fn alloc_zeros<T: DeviceRepr + ValidAsZeroBits + 'static>(
        &self,
        len: usize,
    ) -> Result<PoolBuffer<T>, CudarcError> {
        let mut buf = self.buffer::<T>(len)?;
        self.handle.stream.memset_zeros(&mut buf)?;
        Ok(buf)
    }

    /// A pool buffer holding a copy of host data, as `CudaStream::clone_htod`.
    pub fn clone_htod<T: DeviceRepr + 'static, Src: HostSlice<T> + ?Sized>(
        &self,
        src: &Src,
    ) -> Result<PoolBuffer<T>, CudarcError> {
        let mut buf = self.buffer::<T>(src.len())?;
        self.handle.stream.memcpy_htod(src, &mut buf)?;
        Ok(buf)
    }

    /// A pool buffer holding a copy of device data, as `CudaStream::clone_dtod`.
    pub fn clone_dtod<T: DeviceRepr + 'static, Src: DevicePtr<T>>(
        &self,
        src: &Src,
    ) -> Result<PoolBuffer<T>, CudarcError> {
        let mut buf = self.buffer::<T>(src.len())?;
        self.handle.stream.memcpy_dtod(src, &mut buf)?;
        Ok(buf)
    }
}

/// Pool memory seen by cudarc as a `CudaSlice<T>`.
///
/// Dereferences to `CudaSlice<T>` (read-only) and implements cudarc's
/// `DeviceSlice`, `DevicePtr`, `DevicePtrMut` and `PushKernelArg` by
/// forwarding, so memcpy, memset, launches and cuBLAS take it as they take a
/// slice, and cudarc's event tracking covers it. See the module docs for the
/// drop order.
pub struct PoolBuffer<T: 'static> {
    /// A slice over pool memory: never dropped normally (its drop would
    /// `cuMemFreeAsync` it), only `leak`ed in [`PoolBuffer`]'s drop.
    slice: ManuallyDrop<CudaSlice<T>>,
    /// `None` only during drop.
    allocation: Option<Allocation>,
    /// Whether the slice has tracking events (tracking was on at creation).
    tracked: bool,
    /// The stream the buffer lives and is freed on.
    home: Arc<StreamHandle>,
    /// Streams declared with [`PoolBuffer::record_stream`].
    uses: Mutex<Vec<Arc<StreamHandle>>>,
}

impl<T: 'static> fmt::Debug for PoolBuffer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolBuffer")
            .field("ptr", &format_args!("{:#x}", self.slice_ptr()))
            .field("len", &self.slice.len())
            .field("stream", &self.home.id)
            .finish()
    }
}

impl<T: 'static> Deref for PoolBuffer<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.slice
    }
}

impl<T: 'static> PoolBuffer<T> {
    fn slice_ptr(&self) -> u64 {
        self.allocation.as_ref().map_or(0, |a| a.ptr())
    }

    /// The device address of the first element.
    pub fn ptr(&self) -> u64 {
        self.slice_ptr()
    }

    /// The pool the buffer came from.
    pub fn pool(&self) -> &MemPool<CudaDevice> {
        &self.home.pool
    }

    /// The pool's id of the buffer's stream.
    pub fn pool_stream(&self) -> Stream {
        self.home.id
    }

    /// Declare that work on `stream` uses the buffer in a way cudarc's
    /// event tracking does not see (tracking off, raw launches, other
    /// libraries), like PyTorch's `record_stream`: the free then waits, in
    /// stream order, for the work issued on `stream` up to the drop.
    /// Accepts a [`PoolStream`] (through `Deref`) or any `Arc<CudaStream>`
    /// of the same device.
    pub fn record_stream(&self, stream: &Arc<CudaStream>) -> Result<(), CudarcError> {
        if stream.cu_stream() == self.home.stream.cu_stream()
            && stream.context() == self.home.stream.context()
        {
            return Ok(());
        }
        let handle = StreamHandle::get(&self.home.pool, stream)?;
        let mut uses = lock(&self.uses);
        if !uses.iter().any(|u| Arc::ptr_eq(u, &handle)) {
            uses.push(handle);
        }
        Ok(())
    }

    /// A mutable view, as `CudaSlice::slice_mut`.
    pub fn slice_mut(&mut self, bounds: impl RangeBounds<usize>) -> CudaViewMut<'_, T> {
        self.slice.slice_mut(bounds)
    }

    /// A mutable view, or `None` out of bounds, as `CudaSlice::try_slice_mut`.
    pub fn try_slice_mut(&mut self, bounds: impl RangeBounds<usize>) -> Option<CudaViewMut<'_, T>> {
        self.slice.try_slice_mut(bounds)
    }

    /// The whole buffer as a mutable view, as `CudaSlice::as_view_mut`.
    pub fn as_view_mut(&mut self) -> CudaViewMut<'_, T> {
        self.slice.as_view_mut()
    }

    /// Two mutable views, as `CudaSlice::split_at_mut`.
    pub fn split_at_mut(&mut self, mid: usize) -> (CudaViewMut<'_, T>, CudaViewMut<'_, T>) {
        self.slice.split_at_mut(mid)
    }

    /// Two mutable views, or `None` out of bounds, as `CudaSlice::try_split_at_mut`.
    pub fn try_split_at_mut(
        &mut self,
        mid: usize,
    ) -> Option<(CudaViewMut<'_, T>, CudaViewMut<'_, T>)> {
        self.slice.try_split_at_mut(mid)
    }

    /// The buffer as another element type, as `CudaSlice::transmute_mut`.
    ///
    /// # Safety
    /// As for `CudaSlice::transmute_mut`: the bytes must be valid values of `S`.
    pub unsafe fn transmute_mut<S>(&mut self, len: usize) -> Option<CudaViewMut<'_, S>> {
        // SAFETY: forwarded; the caller upholds `transmute_mut`'s contract.
        unsafe { self.slice.transmute_mut(len) }
    }

    /// A copy from the pool on `stream` (which need not be the buffer's).
    pub fn clone_on(&self, stream: &PoolStream) -> Result<PoolBuffer<T>, CudarcError>
    where
        T: DeviceRepr + 'static,
    {
        stream.clone_dtod(self)
    }
}

/// Allocates the copy from the pool, on the buffer's stream (cudarc's
/// `CudaSlice::clone` would allocate from the driver). Panics when the pool
/// is out of memory, as `CudaSlice::clone` does; [`PoolBuffer::clone_on`]
/// returns the error instead.
impl<T: DeviceRepr + 'static> Clone for PoolBuffer<T> {
    fn clone(&self) -> Self {
        let home = PoolStream {
            handle: self.home.clone(),
        };
        match home.clone_dtod(self) {
            Ok(copy) => copy,
            Err(e) => panic!("PoolBuffer::clone: {e}"),
        }
    }
}

impl<T: 'static> Drop for PoolBuffer<T> {
    fn drop(&mut self) {
        // SAFETY: the slice is taken exactly once, here, and goes straight
        // into a `ParkedSlice`, which parks it or `leak`s it, also when
        // something below panics: it is never dropped as a `CudaSlice`
        // (which would free pool memory with cuMemFreeAsync).
        let mut slice = ParkedSlice(Some(unsafe { ManuallyDrop::take(&mut self.slice) }));
        let Some(mut allocation) = self.allocation.take() else {
            return;
        };
        // (1) The buffer's stream waits for the read and write events cudarc
        // recorded on other streams (when the context manages stream
        // synchronisation), exactly as `CudaSlice`'s own drop does. The
        // returned recorder would record a new write: it is not needed.
        let home = self.home.clone();
        if let Some(s) = slice.0.as_mut() {
            let (_, record) = s.device_ptr_mut(&home.stream);
            std::mem::forget(record);
        }
        // (2) Declared uses: the pool orders the free after them.
        let uses = std::mem::take(&mut *lock(&self.uses));
        for user in &uses {
            home.pool.record_use(&mut allocation, user.id);
        }
        // (3) The free, in the buffer's stream's order.
        let ptr = allocation.ptr();
        let graph_memory = allocation.is_graph_memory();
        match home.pool.free_async(allocation, home.id) {
            // (4) Graph memory's slice goes now, while its events can still
            // be waited on in the capture that recorded them (after the
            // capture ends, a wait on them fails with
            // `CUDA_ERROR_CAPTURED_EVENT`); any other slice waits, with its
            // events, for the next buffer at this address on this stream.
            Ok(()) if graph_memory => drop(slice),
            Ok(()) => home.park(ptr, self.tracked, slice),
            Err(e) => {
                tracing::error!(
                    error = %e.error,
                    ptr = e.allocation.ptr(),
                    size = e.allocation.size(),
                    "tidepool: freeing a PoolBuffer failed; its memory leaks until the pool is dropped"
                );
                // `slice` leaks its `CudaSlice` as it goes out of scope.
                drop(slice);
            }
        }
        // The use handles go after the free (their stream ids stay valid
        // through it).
        drop(uses);
    }
}

impl<T: 'static> DeviceSlice<T> for PoolBuffer<T> {
    fn len(&self) -> usize {
        self.slice.len()
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.slice.stream()
    }
}

impl<T: 'static> DevicePtr<T> for PoolBuffer<T> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.slice.device_ptr(stream)
    }
}

impl<T: 'static> DevicePtrMut<T> for PoolBuffer<T> {
    fn device_ptr_mut<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.slice.device_ptr_mut(stream)
    }
}

// SAFETY: forwards to cudarc's own impl for `&CudaSlice<T>`, which pushes a
// pointer to the slice's device pointer (alive for 'b, as the buffer is)
// and the slice's events for tracking.
unsafe impl<'a, 'b: 'a, T: 'static> PushKernelArg<&'b PoolBuffer<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b PoolBuffer<T>) -> &mut Self {
        let slice: &'b CudaSlice<T> = &arg.slice;
        self.arg(slice)
    }
}

// SAFETY: forwards to cudarc's own impl for `&mut CudaSlice<T>` (see above).
unsafe impl<'a, 'b: 'a, T: 'static> PushKernelArg<&'b mut PoolBuffer<T>> for LaunchArgs<'a> {
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut PoolBuffer<T>) -> &mut Self {
        let slice: &'b mut CudaSlice<T> = &mut arg.slice;
        self.arg(slice)
    }
}
