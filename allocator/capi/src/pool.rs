//! Pools, streams, allocation and statistics through the C ABI.

use crate::error::{guard, tidepool_status, Failure};
use crate::streams::RawStreams;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use tidepool_core::{Device, MemPool, OomReport, PoolConfig, PoolError, PoolStats, ReusePolicy};
use tidepool_sys::cuda::CudaDevice;
use tidepool_sys::{HostConfig, HostDevice, Stream};

use tidepool_status::*;

/// Which device a pool draws its memory from.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum tidepool_backend {
    /// A CUDA device, through the driver's virtual memory management API.
    TIDEPOOL_BACKEND_CUDA = 0,
    /// Host memory standing in for a device (tests and CI without a GPU):
    /// pointers are ordinary host addresses, streams are worker threads.
    TIDEPOOL_BACKEND_HOST = 1,
}

/// How a pool is built. Fill it with `tidepool_config_init`, then change
/// what you need.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct tidepool_config {
    /// Device backend (default CUDA).
    pub backend: tidepool_backend,
    /// CUDA device ordinal (default 0).
    pub device: i32,
    /// Hard maximum of physical bytes the pool may hold; 0 = no maximum.
    pub max_size: u64,
    /// On `tidepool_synchronize`, release memory down to this many bytes
    /// (default UINT64_MAX: keep everything).
    pub release_threshold: u64,
    /// Reuse memory freed on another stream once the allocating stream
    /// waited for it through the pool (default true).
    pub follow_event_dependencies: bool,
    /// Reuse memory whose freeing work has completed (default true).
    pub opportunistic: bool,
    /// Make the allocating stream wait for a pending free rather than fail
    /// (default true).
    pub internal_dependencies: bool,
    /// Before out-of-memory, wait a bounded time on the host for pending
    /// frees (default true).
    pub wait_for_pending_frees: bool,
    /// Size of each piece of physical memory; 0 = device granularity.
    pub page_size: u64,
    /// Virtual address space to reserve; 0 = twice the device memory.
    pub va_size: u64,
    /// Bytes each stream may keep in its private cache of same-stream frees.
    pub stream_cache_bytes: u64,
    /// Check on every allocation whether the stream is being captured into
    /// a CUDA graph (default true; turn off only if none ever is).
    pub check_capture: bool,
    /// Host backend only: bytes of "device memory" (default 1 GiB).
    pub host_capacity: u64,
    /// Largest piece of physical memory created at once for a large block,
    /// rounded down to a power of two times the page size; 0 or the page
    /// size (the default) gives every block single pages. Larger pieces
    /// make a pool's first growth cheaper (fewer driver calls) but let it
    /// move and give back memory less finely.
    pub max_unit_size: u64,
    /// Blocks from this many bytes on get their new memory in pieces of up
    /// to `max_unit_size` (default 256 MiB).
    pub unit_min_block: u64,
}

impl tidepool_config {
    fn defaults() -> Self {
        let d = PoolConfig::default();
        tidepool_config {
            backend: tidepool_backend::TIDEPOOL_BACKEND_CUDA,
            device: 0,
            max_size: 0,
            release_threshold: d.release_threshold,
            follow_event_dependencies: d.reuse.follow_event_dependencies,
            opportunistic: d.reuse.opportunistic,
            internal_dependencies: d.reuse.internal_dependencies,
            wait_for_pending_frees: d.reuse.wait_for_pending_frees,
            page_size: d.page_size as u64,
            va_size: d.va_size as u64,
            stream_cache_bytes: d.stream_cache_bytes as u64,
            check_capture: d.check_capture,
            host_capacity: 1 << 30,
            max_unit_size: d.max_unit_size as u64,
            unit_min_block: d.unit_min_block as u64,
        }
    }

    fn pool_config(&self) -> Result<PoolConfig, Failure> {
        let size = |v: u64, what: &str| {
            usize::try_from(v).map_err(|_| {
                Failure::new(
                    TIDEPOOL_ERROR_INVALID_ARGUMENT,
                    format!("{what} {v} does not fit this machine's address size"),
                )
            })
        };
        let mut c = PoolConfig::default()
            .with_release_threshold(self.release_threshold)
            .with_reuse(ReusePolicy {
                follow_event_dependencies: self.follow_event_dependencies,
                opportunistic: self.opportunistic,
                internal_dependencies: self.internal_dependencies,
                wait_for_pending_frees: self.wait_for_pending_frees,
            })
            .with_page_size(size(self.page_size, "page_size")?)
            .with_va_size(size(self.va_size, "va_size")?)
            .with_stream_cache_bytes(size(self.stream_cache_bytes, "stream_cache_bytes")?)
            .with_max_unit_size(size(self.max_unit_size, "max_unit_size")?)
            .with_unit_min_block(size(self.unit_min_block, "unit_min_block")?)
            .with_check_capture(self.check_capture);
        if self.max_size != 0 {
            c = c.with_max_size(self.max_size);
        }
        Ok(c)
    }
}

/// A pool of either backend.
pub(crate) enum AnyPool {
    Cuda(MemPool<CudaDevice>),
    Host(MemPool<HostDevice>),
}

/// Run `$body` with `$p` bound to the pool, whatever its backend.
#[macro_export]
#[doc(hidden)]
macro_rules! with_pool {
    ($pool:expr, |$p:ident| $body:expr) => {
        match $pool {
            $crate::pool::AnyPool::Cuda($p) => $body,
            $crate::pool::AnyPool::Host($p) => $body,
        }
    };
}

/// No runtime maximum.
const NO_CAP: u64 = u64::MAX;

/// An opaque pool handle.
///
/// The handle itself is never freed: `tidepool_pool_destroy` frees the pool
/// behind it and leaves the handle empty, so a call on a destroyed pool
/// (a second destroy included) fails with a message instead of reading freed
/// memory, and a pool created later never answers to an old handle. Each
/// destroyed pool thus leaves one pointer-sized allocation behind.
pub struct tidepool_pool {
    /// The pool; null once destroyed.
    body: AtomicPtr<PoolBody>,
}

/// A pool and what the C ABI keeps with it.
pub(crate) struct PoolBody {
    pub(crate) pool: AnyPool,
    pub(crate) streams: RawStreams,
    /// Runtime maximum of reserved bytes (`tidepool_set_max_size`), on top
    /// of the maximum the pool was created with. `NO_CAP` when unset.
    cap: AtomicU64,
    /// Allocations refused for the runtime maximum (added to `ooms`).
    cap_ooms: AtomicU64,
    /// A per-device default pool: lives for the whole process.
    is_default: bool,
    /// This pool's mark in the top bits of the `tidepool_stream` values it
    /// hands out (never 0). Stream ids are only unique within one device
    /// object, so without it a stream of another pool on the same GPU
    /// could silently name one of this pool's streams.
    tag: u64,
}

/// Bits of a `tidepool_stream` that hold the pool's stream id.
const STREAM_ID_BITS: u32 = 48;

fn next_pool_tag() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    // 1..=0xffff, cycling: pools far apart in time may share a tag.
    NEXT.fetch_add(1, Ordering::Relaxed) % 0xffff + 1
}

impl PoolBody {
    fn create(config: &tidepool_config, is_default: bool) -> Result<Self, Failure> {
        let pc = config.pool_config()?;
        let pool = match config.backend {
            tidepool_backend::TIDEPOOL_BACKEND_CUDA => {
                let dev = CudaDevice::new(config.device)?;
                AnyPool::Cuda(MemPool::new(Arc::new(dev), pc)?)
            }
            tidepool_backend::TIDEPOOL_BACKEND_HOST => {
                let capacity = usize::try_from(config.host_capacity).map_err(|_| {
                    Failure::new(
                        TIDEPOOL_ERROR_INVALID_ARGUMENT,
                        "host_capacity is too large",
                    )
                })?;
                let dev = HostDevice::with_config(HostConfig {
                    capacity,
                    ..HostConfig::default()
                });
                AnyPool::Host(MemPool::new(Arc::new(dev), pc)?)
            }
        };
        Ok(PoolBody {
            pool,
            streams: RawStreams::default(),
            cap: AtomicU64::new(NO_CAP),
            cap_ooms: AtomicU64::new(0),
            is_default,
            tag: next_pool_tag(),
        })
    }

    /// The `tidepool_stream` value of one of this pool's streams.
    fn stream_handle(&self, s: Stream) -> Result<tidepool_stream, Failure> {
        if s.id() >> STREAM_ID_BITS != 0 {
            return Err(Failure::new(
                TIDEPOOL_ERROR_DEVICE,
                format!("stream id {} is too large to hand out", s.id()),
            ));
        }
        Ok(self.tag << STREAM_ID_BITS | s.id())
    }

    /// The stream a `tidepool_stream` value names, if this pool made it.
    fn stream(&self, handle: tidepool_stream) -> Result<Stream, Failure> {
        if handle >> STREAM_ID_BITS != self.tag {
            return Err(Failure::new(
                TIDEPOOL_ERROR_INVALID_STREAM,
                format!(
                    "stream {handle:#x} was not made by this pool (it is another pool's, \
                     or not a tidepool_stream); use one from tidepool_stream_default, \
                     tidepool_stream_create or tidepool_stream_from_raw on this pool"
                ),
            ));
        }
        Ok(Stream(handle & ((1 << STREAM_ID_BITS) - 1)))
    }

    pub(crate) fn stats(&self) -> PoolStats {
        with_pool!(&self.pool, |p| p.stats())
    }

    pub(crate) fn contains(&self, ptr: u64) -> bool {
        with_pool!(&self.pool, |p| p.contains(ptr))
    }

    pub(crate) fn device_ordinal(&self) -> Option<i32> {
        match &self.pool {
            AnyPool::Cuda(p) => Some(p.device().ordinal()),
            AnyPool::Host(_) => None,
        }
    }

    pub(crate) fn reset_peaks(&self) {
        with_pool!(&self.pool, |p| p.reset_peaks())
    }

    pub(crate) fn set_cap(&self, bytes: Option<u64>) {
        self.cap.store(bytes.unwrap_or(NO_CAP), Ordering::Relaxed);
    }

    /// Allocate, holding the runtime maximum: a request that made the pool
    /// grow past it is given back, cached memory is released down to the
    /// maximum, and the request is tried once more before it fails.
    pub(crate) fn alloc(&self, size: usize, stream: Stream) -> Result<u64, PoolError> {
        with_pool!(&self.pool, |p| {
            let ptr = p.alloc_raw(size, stream)?;
            let cap = self.cap.load(Ordering::Relaxed);
            if cap == NO_CAP || size == 0 || p.stats().reserved_current <= cap {
                return Ok(ptr);
            }
            p.free_raw(ptr, stream)?;
            p.synchronize()?;
            p.trim_to(cap)?;
            let ptr = p.alloc_raw(size, stream)?;
            let st = p.stats();
            if st.reserved_current <= cap {
                return Ok(ptr);
            }
            p.free_raw(ptr, stream)?;
            p.synchronize()?;
            p.trim_to(cap)?;
            let st2 = p.stats();
            // The pool counted none of this: the request succeeded there.
            self.cap_ooms.fetch_add(1, Ordering::Relaxed);
            Err(PoolError::OutOfMemory(Box::new(OomReport {
                requested: size,
                reserved: st2.reserved_current,
                used: st2.used_current,
                largest_free_range: 0,
                device_free: p.device().mem_info().ok().map(|m| m.free as u64),
                max_size: Some(cap),
                cause: None,
            })))
        })
    }

    pub(crate) fn free(&self, ptr: u64, stream: Stream) -> Result<(), PoolError> {
        with_pool!(&self.pool, |p| p.free_raw(ptr, stream))
    }

    /// Declare a use of `ptr` on `stream`. The stream is checked first: the
    /// pool itself only notes the stream, and its free would then try to
    /// record an event on a stream that does not exist, fail, and leave the
    /// allocation impossible to free.
    pub(crate) fn record_use(&self, ptr: u64, stream: Stream) -> Result<(), PoolError> {
        with_pool!(&self.pool, |p| {
            p.device().is_capturing(stream)?;
            p.record_use_raw(ptr, stream)
        })
    }

    pub(crate) fn synchronize(&self) -> Result<(), PoolError> {
        with_pool!(&self.pool, |p| p.synchronize())
    }

    pub(crate) fn trim_to(&self, bytes: u64) -> Result<u64, PoolError> {
        with_pool!(&self.pool, |p| p.trim_to(bytes))
    }

    pub(crate) fn total_device_memory(&self) -> Result<u64, Failure> {
        Ok(with_pool!(&self.pool, |p| p.device().mem_info())?.total as u64)
    }
}

/// A stream of a pool: a value the pool never reuses, and which no other
/// pool accepts.
pub type tidepool_stream = u64;

/// A snapshot of a pool's statistics.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct tidepool_stats {
    /// Physical bytes the pool holds now.
    pub reserved_current: u64,
    /// Highest `reserved_current` since creation or the last peak reset.
    pub reserved_high: u64,
    /// Bytes in live allocations now (requested sizes).
    pub used_current: u64,
    /// Highest `used_current` since creation or the last peak reset.
    pub used_high: u64,
    /// Allocations made (size-0 requests, which give NULL, not counted:
    /// `allocs - frees` is the number of live allocations).
    pub allocs: u64,
    /// Frees made (of non-NULL pointers).
    pub frees: u64,
    /// Allocations served from the allocating stream's own cache.
    pub cache_hits: u64,
    /// Pieces of physical memory created.
    pub growths: u64,
    /// Pieces of physical memory released to the device.
    pub releases: u64,
    /// Pieces of physical memory remapped to defragment.
    pub remaps: u64,
    /// Stream waits the pool inserted to reuse pending frees.
    pub internal_dependencies: u64,
    /// Allocations that failed with out-of-memory.
    pub ooms: u64,
    /// Raw stream handles adopted by the pool's stream cache.
    pub raw_streams_adopted: u64,
    /// Raw stream handles found recycled by the driver (and re-adopted).
    pub raw_streams_recycled: u64,
}

pub(crate) fn c_stats(pool: &PoolBody) -> tidepool_stats {
    let s = pool.stats();
    tidepool_stats {
        reserved_current: s.reserved_current,
        reserved_high: s.reserved_high,
        used_current: s.used_current,
        used_high: s.used_high,
        // The pool counts neither size-0 requests (they give NULL) nor
        // frees of NULL: `allocs - frees` is the number of live allocations.
        allocs: s.allocs,
        frees: s.frees,
        cache_hits: s.cache_hits,
        growths: s.growths,
        releases: s.releases,
        remaps: s.remaps,
        internal_dependencies: s.internal_dependencies,
        ooms: s.ooms + pool.cap_ooms.load(Ordering::Relaxed),
        raw_streams_adopted: pool.streams.adopted.load(Ordering::Relaxed),
        raw_streams_recycled: pool.streams.recycled.load(Ordering::Relaxed),
    }
}

// ---------------------------------------------------------------------------
// helpers for entry points

fn destroyed() -> Failure {
    Failure::new(
        TIDEPOOL_ERROR_INVALID_ARGUMENT,
        "the pool was destroyed; create a new one with tidepool_pool_create",
    )
}

pub(crate) fn pool_ref<'a>(pool: *const tidepool_pool) -> Result<&'a PoolBody, Failure> {
    // SAFETY: the C contract: `pool` is NULL or a handle from
    // tidepool_pool_create / tidepool_default_pool. Handles are never
    // freed, so even the handle of a destroyed pool is readable.
    let handle = unsafe { pool.as_ref() }.ok_or_else(|| Failure::null("pool"))?;
    let body = handle.body.load(Ordering::Acquire);
    // SAFETY: a non-null body is live until tidepool_pool_destroy empties
    // the handle, and the C contract forbids destroying a pool while other
    // calls on it are running.
    unsafe { body.as_ref() }.ok_or_else(destroyed)
}

/// Read a C caller's configuration. The backend is checked as a plain int
/// before the struct is read as Rust: C may store any int in an enum field,
/// and a Rust enum holding a value outside its variants is undefined
/// behaviour.
fn read_config(config: *const tidepool_config) -> Result<tidepool_config, Failure> {
    if config.is_null() {
        return Err(Failure::null("config"));
    }
    // SAFETY: non-null and, by the C contract, a readable tidepool_config;
    // the field is read as the C int it is in C (repr(C) enums are ints),
    // through a raw pointer, without making a reference to the struct.
    let backend = unsafe { std::ptr::addr_of!((*config).backend).cast::<c_int>().read() };
    let known = [
        tidepool_backend::TIDEPOOL_BACKEND_CUDA,
        tidepool_backend::TIDEPOOL_BACKEND_HOST,
    ];
    if !known.iter().any(|b| *b as c_int == backend) {
        return Err(Failure::new(
            TIDEPOOL_ERROR_INVALID_ARGUMENT,
            format!(
                "config backend {backend} is not a tidepool_backend; use \
                 TIDEPOOL_BACKEND_CUDA or TIDEPOOL_BACKEND_HOST"
            ),
        ));
    }
    // SAFETY: as above, and every field now holds a valid value (the
    // other fields are integers and C `bool`s).
    Ok(unsafe { config.read() })
}

pub(crate) fn write_out<T>(out: *mut T, value: T, what: &str) -> Result<(), Failure> {
    if out.is_null() {
        return Err(Failure::null(what));
    }
    // SAFETY: non-null, and the C contract makes it valid for a write of T.
    unsafe { out.write(value) };
    Ok(())
}

// ---------------------------------------------------------------------------
// per-device default pools

const MAX_DEVICES: usize = 64;

/// A default pool and the handle C callers get for it.
type DefaultSlot = OnceLock<(&'static tidepool_pool, &'static PoolBody)>;

fn default_slots() -> &'static [DefaultSlot; MAX_DEVICES] {
    static SLOTS: [DefaultSlot; MAX_DEVICES] = [const { OnceLock::new() }; MAX_DEVICES];
    &SLOTS
}

fn default_config() -> &'static Mutex<(tidepool_config, bool)> {
    static CONFIG: OnceLock<Mutex<(tidepool_config, bool)>> = OnceLock::new();
    CONFIG.get_or_init(|| Mutex::new((tidepool_config::defaults(), false)))
}

/// The default pool of CUDA device `device`, created on first use with the
/// configuration of `tidepool_set_default_config` (or the defaults).
pub(crate) fn default_pool(device: i32) -> Result<&'static PoolBody, Failure> {
    default_slot(device).map(|(_, body)| body)
}

fn default_slot(device: i32) -> Result<(&'static tidepool_pool, &'static PoolBody), Failure> {
    let slot = usize::try_from(device)
        .ok()
        .and_then(|d| default_slots().get(d))
        .ok_or_else(|| {
            Failure::new(
                TIDEPOOL_ERROR_INVALID_ARGUMENT,
                format!("device {device} is out of range 0..{MAX_DEVICES}"),
            )
        })?;
    if let Some(p) = slot.get() {
        return Ok(*p);
    }
    let mut cfg = default_config().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = slot.get() {
        return Ok(*p);
    }
    let mut c = cfg.0;
    c.device = device;
    // Both live for the whole process: default pools are never destroyed.
    let body: &'static mut PoolBody = Box::leak(Box::new(PoolBody::create(&c, true)?));
    let handle: &'static tidepool_pool = Box::leak(Box::new(tidepool_pool {
        body: AtomicPtr::new(body as *mut PoolBody),
    }));
    let pair = (handle, &*body);
    cfg.1 = true;
    let _ = slot.set(pair);
    Ok(pair)
}

/// The default pool of CUDA device `device` if it was created.
pub(crate) fn existing_default_pool(device: i32) -> Option<&'static PoolBody> {
    let slot = default_slots().get(usize::try_from(device).ok()?)?;
    slot.get().map(|(_, body)| *body)
}

/// Every default pool created so far.
pub(crate) fn default_pools() -> impl Iterator<Item = &'static PoolBody> {
    default_slots()
        .iter()
        .filter_map(|s| s.get().map(|(_, body)| *body))
}

// ---------------------------------------------------------------------------
// entry points

/// Fill `config` with the defaults (CUDA device 0, no maximum, keep all
/// memory on synchronise, every reuse rule on, capture check on).
#[no_mangle]
pub extern "C" fn tidepool_config_init(config: *mut tidepool_config) -> tidepool_status {
    guard("tidepool_config_init", || {
        write_out(config, tidepool_config::defaults(), "config")
    })
}

/// The size in bytes of `tidepool_config` in this library. The struct
/// gains fields between versions: a program or binding that fills its own
/// copy can compare its size with this one to find out that it was built
/// against another version's header.
#[no_mangle]
pub extern "C" fn tidepool_config_size() -> usize {
    std::mem::size_of::<tidepool_config>()
}

/// Create a pool. Destroy it with `tidepool_pool_destroy`.
#[no_mangle]
pub extern "C" fn tidepool_pool_create(
    config: *const tidepool_config,
    out: *mut *mut tidepool_pool,
) -> tidepool_status {
    guard("tidepool_pool_create", || {
        let c = read_config(config)?;
        if out.is_null() {
            return Err(Failure::null("out"));
        }
        let body = Box::into_raw(Box::new(PoolBody::create(&c, false)?));
        let handle = Box::into_raw(Box::new(tidepool_pool {
            body: AtomicPtr::new(body),
        }));
        write_out(out, handle, "out")
    })
}

/// Destroy a pool made by `tidepool_pool_create`. Its memory goes back to
/// the device; pointers from it must no longer be used (by the host or by
/// queued device work). Default pools cannot be destroyed. Later calls with
/// the handle (a second destroy included) fail with
/// `TIDEPOOL_ERROR_INVALID_ARGUMENT`; no other call on the pool may be
/// running while it is destroyed.
#[no_mangle]
pub extern "C" fn tidepool_pool_destroy(pool: *mut tidepool_pool) -> tidepool_status {
    guard("tidepool_pool_destroy", || {
        let p = pool_ref(pool)?;
        if p.is_default {
            return Err(Failure::new(
                TIDEPOOL_ERROR_INVALID_ARGUMENT,
                "a default pool lives for the whole process and cannot be destroyed",
            ));
        }
        // SAFETY: pool_ref found a live handle (non-null, never freed).
        let handle = unsafe { &*pool };
        let body = handle.body.swap(std::ptr::null_mut(), Ordering::AcqRel);
        if body.is_null() {
            // Another thread destroyed it between the two reads.
            return Err(destroyed());
        }
        // SAFETY: the body was made by Box::into_raw in
        // tidepool_pool_create, and the swap above took it out of the
        // handle, so only this call frees it. The handle stays allocated.
        drop(unsafe { Box::from_raw(body) });
        Ok(())
    })
}

/// Configure the per-device default pools. Only before the first of them
/// is created (by `tidepool_default_pool` or the PyTorch entry points);
/// `config->backend` must be CUDA and `config->device` is ignored.
#[no_mangle]
pub extern "C" fn tidepool_set_default_config(config: *const tidepool_config) -> tidepool_status {
    guard("tidepool_set_default_config", || {
        let c = read_config(config)?;
        if c.backend != tidepool_backend::TIDEPOOL_BACKEND_CUDA {
            return Err(Failure::new(
                TIDEPOOL_ERROR_INVALID_ARGUMENT,
                "default pools are CUDA pools; set backend to TIDEPOOL_BACKEND_CUDA",
            ));
        }
        c.pool_config()?;
        let mut cfg = default_config().lock().unwrap_or_else(|e| e.into_inner());
        if cfg.1 {
            return Err(Failure::new(
                TIDEPOOL_ERROR_INVALID_STATE,
                "a default pool already exists; configure before the first allocation",
            ));
        }
        cfg.0 = c;
        Ok(())
    })
}

/// The default pool of CUDA device `device` (created on first use). It
/// lives for the whole process; never destroy it.
#[no_mangle]
pub extern "C" fn tidepool_default_pool(
    device: i32,
    out: *mut *mut tidepool_pool,
) -> tidepool_status {
    guard("tidepool_default_pool", || {
        if out.is_null() {
            return Err(Failure::null("out"));
        }
        let (handle, _) = default_slot(device)?;
        write_out(
            out,
            handle as *const tidepool_pool as *mut tidepool_pool,
            "out",
        )
    })
}

/// The pool's legacy default (NULL) stream.
#[no_mangle]
pub extern "C" fn tidepool_stream_default(
    pool: *const tidepool_pool,
    out: *mut tidepool_stream,
) -> tidepool_status {
    guard("tidepool_stream_default", || {
        let p = pool_ref(pool)?;
        let s = with_pool!(&p.pool, |x| x.device().default_stream());
        write_out(out, p.stream_handle(s)?, "out")
    })
}

/// Create a new stream on the pool's device (owned by libtidepool; retire
/// it with `tidepool_stream_retire`).
#[no_mangle]
pub extern "C" fn tidepool_stream_create(
    pool: *const tidepool_pool,
    out: *mut tidepool_stream,
) -> tidepool_status {
    guard("tidepool_stream_create", || {
        let p = pool_ref(pool)?;
        if out.is_null() {
            return Err(Failure::null("out"));
        }
        let s = with_pool!(&p.pool, |x| x.device().create_stream())?;
        write_out(out, p.stream_handle(s)?, "out")
    })
}

/// The pool stream for a raw `cudaStream_t`/`CUstream` (0, `cudaStreamLegacy`
/// and `cudaStreamPerThread` included), adopted on first sight and cached.
/// Call `tidepool_stream_retire_raw` before destroying the raw stream.
#[no_mangle]
pub extern "C" fn tidepool_stream_from_raw(
    pool: *const tidepool_pool,
    raw: *mut c_void,
    out: *mut tidepool_stream,
) -> tidepool_status {
    guard("tidepool_stream_from_raw", || {
        let p = pool_ref(pool)?;
        if out.is_null() {
            return Err(Failure::null("out"));
        }
        let s = p.streams.resolve(&p.pool, raw as usize)?;
        write_out(out, p.stream_handle(s)?, "out")
    })
}

/// Retire a stream from `tidepool_stream_create`: its cached frees return
/// to the pool (still guarded by its queued work) and the stream is
/// destroyed once that work is done. Using it afterwards is an error.
#[no_mangle]
pub extern "C" fn tidepool_stream_retire(
    pool: *const tidepool_pool,
    stream: tidepool_stream,
) -> tidepool_status {
    guard("tidepool_stream_retire", || {
        let p = pool_ref(pool)?;
        let s = p.stream(stream)?;
        with_pool!(&p.pool, |x| {
            if s == x.device().default_stream() {
                return Err(Failure::new(
                    TIDEPOOL_ERROR_INVALID_STREAM,
                    "the default stream is never retired",
                ));
            }
            x.retire_stream(s)?;
            x.device().destroy_stream(s)?;
            Ok(())
        })
    })
}

/// Tell the pool that a raw stream is about to be destroyed (call before
/// `cudaStreamDestroy`). Unknown handles are ignored.
#[no_mangle]
pub extern "C" fn tidepool_stream_retire_raw(
    pool: *const tidepool_pool,
    raw: *mut c_void,
) -> tidepool_status {
    guard("tidepool_stream_retire_raw", || {
        let p = pool_ref(pool)?;
        p.streams.retire(&p.pool, raw as usize)
    })
}

/// Allocate `size` bytes in stream order on `stream`. Size 0 gives NULL.
#[no_mangle]
pub extern "C" fn tidepool_alloc_async(
    pool: *const tidepool_pool,
    size: usize,
    stream: tidepool_stream,
    out: *mut *mut c_void,
) -> tidepool_status {
    guard("tidepool_alloc_async", || {
        let p = pool_ref(pool)?;
        if out.is_null() {
            return Err(Failure::null("out"));
        }
        let ptr = p.alloc(size, p.stream(stream)?)?;
        write_out(out, ptr as usize as *mut c_void, "out")
    })
}

/// Free in stream order on `stream`. NULL is a no-op; a pointer freed twice
/// gives `TIDEPOOL_ERROR_DOUBLE_FREE` and changes nothing.
#[no_mangle]
pub extern "C" fn tidepool_free_async(
    pool: *const tidepool_pool,
    ptr: *mut c_void,
    stream: tidepool_stream,
) -> tidepool_status {
    guard("tidepool_free_async", || {
        let p = pool_ref(pool)?;
        p.free(ptr as usize as u64, p.stream(stream)?)?;
        Ok(())
    })
}

/// `tidepool_alloc_async` on a raw `cudaStream_t`.
#[no_mangle]
pub extern "C" fn tidepool_alloc_async_raw(
    pool: *const tidepool_pool,
    size: usize,
    raw_stream: *mut c_void,
    out: *mut *mut c_void,
) -> tidepool_status {
    guard("tidepool_alloc_async_raw", || {
        let p = pool_ref(pool)?;
        if out.is_null() {
            return Err(Failure::null("out"));
        }
        let s = p.streams.resolve(&p.pool, raw_stream as usize)?;
        let ptr = p.alloc(size, s)?;
        write_out(out, ptr as usize as *mut c_void, "out")
    })
}

/// `tidepool_free_async` on a raw `cudaStream_t`.
#[no_mangle]
pub extern "C" fn tidepool_free_async_raw(
    pool: *const tidepool_pool,
    ptr: *mut c_void,
    raw_stream: *mut c_void,
) -> tidepool_status {
    guard("tidepool_free_async_raw", || {
        let p = pool_ref(pool)?;
        let s = p.streams.resolve(&p.pool, raw_stream as usize)?;
        p.free(ptr as usize as u64, s)?;
        Ok(())
    })
}

/// Declare that `ptr` is used on `stream` too (like PyTorch's
/// `record_stream`): its free then waits, in stream order, for that use.
#[no_mangle]
pub extern "C" fn tidepool_record_use(
    pool: *const tidepool_pool,
    ptr: *mut c_void,
    stream: tidepool_stream,
) -> tidepool_status {
    guard("tidepool_record_use", || {
        let p = pool_ref(pool)?;
        p.record_use(ptr as usize as u64, p.stream(stream)?)?;
        Ok(())
    })
}

/// Block until `stream`'s queued work is done.
#[no_mangle]
pub extern "C" fn tidepool_stream_synchronize(
    pool: *const tidepool_pool,
    stream: tidepool_stream,
) -> tidepool_status {
    guard("tidepool_stream_synchronize", || {
        let p = pool_ref(pool)?;
        let s = p.stream(stream)?;
        with_pool!(&p.pool, |x| x.synchronize_stream(s))?;
        Ok(())
    })
}

/// Block until every stream the pool has seen is idle, then release memory
/// down to the release threshold.
#[no_mangle]
pub extern "C" fn tidepool_synchronize(pool: *const tidepool_pool) -> tidepool_status {
    guard("tidepool_synchronize", || {
        pool_ref(pool)?.synchronize()?;
        Ok(())
    })
}

/// Release unused memory now until the pool holds at most `bytes` (memory
/// of live allocations and of frees not known complete is never touched).
/// `released` (may be NULL) receives the bytes released.
#[no_mangle]
pub extern "C" fn tidepool_trim_to(
    pool: *const tidepool_pool,
    bytes: u64,
    released: *mut u64,
) -> tidepool_status {
    guard("tidepool_trim_to", || {
        let n = pool_ref(pool)?.trim_to(bytes)?;
        if !released.is_null() {
            write_out(released, n, "released")?;
        }
        Ok(())
    })
}

/// Set a maximum of reserved bytes at run time (0 = none), on top of the
/// `max_size` the pool was created with. An allocation that would take the
/// pool past it first makes the pool release cached memory, then fails
/// with `TIDEPOOL_ERROR_OUT_OF_MEMORY`. Memory already reserved above a
/// lowered maximum is released as it becomes free (on the next allocation
/// that grows) or by `tidepool_trim_to`.
#[no_mangle]
pub extern "C" fn tidepool_set_max_size(pool: *const tidepool_pool, bytes: u64) -> tidepool_status {
    guard("tidepool_set_max_size", || {
        pool_ref(pool)?.set_cap((bytes != 0).then_some(bytes));
        Ok(())
    })
}

/// Change the release threshold (bytes kept on `tidepool_synchronize`).
#[no_mangle]
pub extern "C" fn tidepool_set_release_threshold(
    pool: *const tidepool_pool,
    bytes: u64,
) -> tidepool_status {
    guard("tidepool_set_release_threshold", || {
        let p = pool_ref(pool)?;
        with_pool!(&p.pool, |x| x.set_release_threshold(bytes));
        Ok(())
    })
}

/// A snapshot of the pool's statistics.
#[no_mangle]
pub extern "C" fn tidepool_get_stats(
    pool: *const tidepool_pool,
    out: *mut tidepool_stats,
) -> tidepool_status {
    guard("tidepool_get_stats", || {
        let p = pool_ref(pool)?;
        write_out(out, c_stats(p), "out")
    })
}

/// Reset `reserved_high` and `used_high` to the current values.
#[no_mangle]
pub extern "C" fn tidepool_reset_peaks(pool: *const tidepool_pool) -> tidepool_status {
    guard("tidepool_reset_peaks", || {
        let p = pool_ref(pool)?;
        with_pool!(&p.pool, |x| x.reset_peaks());
        Ok(())
    })
}

/// Whether a CUDA driver and device are usable here (never fails).
#[no_mangle]
pub extern "C" fn tidepool_cuda_available() -> bool {
    std::panic::catch_unwind(tidepool_sys::cuda::driver_available).unwrap_or(false)
}
