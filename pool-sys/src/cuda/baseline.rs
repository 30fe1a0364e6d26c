//! The driver's own allocators, as baselines for the benchmarks: a fresh
//! explicit stream-ordered pool ([`DriverPool`]) and plain
//! `cuMemAlloc`/`cuMemFree` ([`mem_alloc`], [`mem_free`]).
//!
//! The hot path (`alloc_async`/`free_async`) does what the benches time
//! against tidepool and nothing more: a context check, the stream-id →
//! `CUstream` lookup (a read lock on the stream table) and the driver call.
//!
//! Error ops: the device boundary's [`Op`] has no names for these calls, so
//! pool creation and attributes report `Op::Init`/`Op::MemInfo`, allocation
//! `Op::CreatePhysical`, freeing and trimming `Op::ReleasePhysical`.

use super::driver::{check, check_sized, warn_drop, Ctx};
use super::CudaDevice;
use crate::device::{DevicePtr, Stream};
use crate::error::{Op, SysResult};
use cudarc::driver::sys;
use std::ffi::c_void;
use std::sync::Arc;

/// A fresh explicit driver pool (`cuMemPoolCreate`) on one device: pinned
/// device memory, no export handle type. `Drop` destroys it
/// (`cuMemPoolDestroy`; memory still allocated from it is released by the
/// driver once freed).
pub struct DriverPool {
    pool: sys::CUmemoryPool,
    dev: CudaDevice,
}

// SAFETY: a CUmemoryPool is a driver handle usable from any thread; the
// driver's pool functions are thread-safe.
unsafe impl Send for DriverPool {}
// SAFETY: as above; `DriverPool` has no interior mutability of its own.
unsafe impl Sync for DriverPool {}

impl std::fmt::Debug for DriverPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DriverPool")
            .field("pool", &self.pool)
            .field("ordinal", &self.dev.inner.ctx.ordinal)
            .finish()
    }
}

impl DriverPool {
    /// Create a pool on `dev` and set its release threshold
    /// (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`; `u64::MAX` keeps everything).
    pub fn new(dev: &CudaDevice, release_threshold: u64) -> SysResult<DriverPool> {
        dev.bind(Op::Init)?;
        // SAFETY: CUmemPoolProps is a plain C struct for which all-zero bytes
        // are valid (null pointer, zero sizes, INVALID/NONE enums).
        let mut props: sys::CUmemPoolProps = unsafe { std::mem::zeroed() };
        props.allocType = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        props.handleTypes = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE;
        props.location = super::mem_location(dev.inner.ctx.ordinal);
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: valid out pointer and a fully initialised props struct.
        check(Op::Init, unsafe { sys::cuMemPoolCreate(&mut pool, &props) })?;
        let this = DriverPool {
            pool,
            dev: dev.clone(),
        };
        this.set_u64(
            Op::Init,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            release_threshold,
        )?;
        Ok(this)
    }

    /// The raw `CUmemoryPool`, for benches that call the driver themselves.
    pub fn raw(&self) -> usize {
        self.pool as usize
    }

    /// `cuMemAllocFromPoolAsync` on `stream`.
    #[inline]
    pub fn alloc_async(&self, size: usize, stream: Stream) -> SysResult<DevicePtr> {
        let op = Op::CreatePhysical;
        self.dev.bind(op)?;
        self.dev.with_stream(op, stream, |raw| {
            let mut ptr: sys::CUdeviceptr = 0;
            // SAFETY: valid out pointer; the pool lives as long as `self`,
            // the stream while the table lock is held.
            let r = unsafe { sys::cuMemAllocFromPoolAsync(&mut ptr, size, self.pool, raw) };
            check_sized(op, r, size)?;
            Ok(ptr)
        })
    }

    /// `cuMemFreeAsync` on `stream`.
    #[inline]
    pub fn free_async(&self, ptr: DevicePtr, stream: Stream) -> SysResult<()> {
        let op = Op::ReleasePhysical;
        self.dev.bind(op)?;
        self.dev.with_stream(op, stream, |raw| {
            // SAFETY: the driver validates `ptr`; the stream is live while
            // the table lock is held.
            check(op, unsafe { sys::cuMemFreeAsync(ptr, raw) })
        })
    }

    fn get_u64(&self, attr: sys::CUmemPool_attribute) -> SysResult<u64> {
        self.dev.bind(Op::MemInfo)?;
        let mut v: u64 = 0;
        // SAFETY: these attributes are cuuint64_t; `v` is a valid out pointer.
        check(Op::MemInfo, unsafe {
            sys::cuMemPoolGetAttribute(self.pool, attr, (&mut v as *mut u64).cast::<c_void>())
        })?;
        Ok(v)
    }

    fn set_u64(&self, op: Op, attr: sys::CUmemPool_attribute, mut v: u64) -> SysResult<()> {
        self.dev.bind(op)?;
        // SAFETY: these attributes are cuuint64_t; the driver reads `v`.
        check(op, unsafe {
            sys::cuMemPoolSetAttribute(self.pool, attr, (&mut v as *mut u64).cast::<c_void>())
        })
    }

    /// `CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`.
    pub fn reserved_current(&self) -> SysResult<u64> {
        self.get_u64(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)
    }

    /// `CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH`.
    pub fn reserved_high(&self) -> SysResult<u64> {
        self.get_u64(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)
    }

    /// `CU_MEMPOOL_ATTR_USED_MEM_CURRENT`.
    pub fn used_current(&self) -> SysResult<u64> {
        self.get_u64(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
    }

    /// `CU_MEMPOOL_ATTR_USED_MEM_HIGH`.
    pub fn used_high(&self) -> SysResult<u64> {
        self.get_u64(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH)
    }

    /// Reset both high-water marks (the driver accepts only 0).
    pub fn reset_highs(&self) -> SysResult<()> {
        self.set_u64(
            Op::MemInfo,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
            0,
        )?;
        self.set_u64(
            Op::MemInfo,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            0,
        )
    }

    /// `cuMemPoolTrimTo`: release unused memory until the pool holds at most
    /// `keep` bytes (memory of pending frees is not released).
    pub fn trim_to(&self, keep: usize) -> SysResult<()> {
        self.dev.bind(Op::ReleasePhysical)?;
        // SAFETY: the pool lives as long as `self`.
        check(Op::ReleasePhysical, unsafe {
            sys::cuMemPoolTrimTo(self.pool, keep)
        })
    }
}

impl Drop for DriverPool {
    fn drop(&mut self) {
        let ctx: &Arc<Ctx> = &self.dev.inner.ctx;
        if ctx.bind_in_drop("a driver pool") {
            // SAFETY: created by cuMemPoolCreate, destroyed once.
            warn_drop("cuMemPoolDestroy", unsafe {
                sys::cuMemPoolDestroy(self.pool)
            });
        }
    }
}

/// `cuMemAlloc_v2` on `dev`'s context. Out-of-memory gives
/// `SysError::OutOfMemory { op: CreatePhysical, .. }`.
pub fn mem_alloc(dev: &CudaDevice, size: usize) -> SysResult<DevicePtr> {
    let op = Op::CreatePhysical;
    dev.bind(op)?;
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: valid out pointer; the context is current.
    check_sized(op, unsafe { sys::cuMemAlloc_v2(&mut ptr, size) }, size)?;
    Ok(ptr)
}

/// `cuMemFree_v2` of a pointer from [`mem_alloc`].
pub fn mem_free(dev: &CudaDevice, ptr: DevicePtr) -> SysResult<()> {
    let op = Op::ReleasePhysical;
    dev.bind(op)?;
    // SAFETY: the driver validates `ptr` (an unknown pointer is an error).
    check(op, unsafe { sys::cuMemFree_v2(ptr) })
}
