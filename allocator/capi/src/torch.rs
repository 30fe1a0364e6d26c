//! The entry points of PyTorch's pluggable CUDA allocator
//! (`torch.cuda.memory.CUDAPluggableAllocator`).
//!
//! PyTorch calls `malloc(size, device, stream)` and `free(ptr, size,
//! device, stream)`, where `free` gets the stream of the allocation, plus
//! optional hooks: `record_stream(ptr, stream)`, `reset()` (from
//! `torch.cuda.empty_cache`) and `memory_fraction(fraction, device)`.
//!
//! `malloc` itself is the C++ function `tidepool_torch_malloc` in
//! `shim.cpp`: PyTorch treats a NULL result as success (the tensor gets
//! address 0), so a failure must be a C++ exception, which Rust cannot
//! throw. The shim calls [`tidepool_torch_try_malloc`] and throws
//! `std::runtime_error` ("CUDA out of memory. Tried to allocate ...") on
//! failure; PyTorch turns that into a Python `RuntimeError`.
//!
//! Each device has its own default pool, created on the first `malloc`
//! with the configuration given to `tidepool_set_default_config`. The CUDA
//! backend makes the device's primary context current on the calling
//! thread before each driver call, so a `malloc` that arrives on a thread
//! with no current context works. Raw streams are cached per pool (see the
//! stream cache's documentation for recycled handles).
//!
//! Graph capture: allocating or freeing on a stream that is being captured
//! into a CUDA graph fails with `TIDEPOOL_ERROR_STREAM_CAPTURING`, which the
//! shim throws as a `RuntimeError` naming the cause; it never returns NULL.

use crate::error::{guard, tidepool_status, Failure};
use crate::pool::{
    c_stats, default_pool, default_pools, existing_default_pool, tidepool_stats, write_out,
};
use std::ffi::c_void;
use tidepool_core::PoolError;

use tidepool_status::*;

extern "C-unwind" {
    /// In `shim.cpp`: [`tidepool_torch_try_malloc`], then a throw on failure.
    fn tidepool_shim_torch_malloc(size: isize, device: i32, stream: *mut c_void) -> *mut c_void;
}

/// The `malloc` of the PyTorch pluggable allocator
/// (`void* malloc(ssize_t size, int device, cudaStream_t stream)`). Never
/// returns NULL for size > 0: a failure throws a C++ `std::runtime_error`
/// whose text begins "CUDA out of memory. Tried to allocate" when memory
/// ran out. Call it only from C++ code prepared for exceptions (PyTorch is).
///
/// # Safety
/// `stream` is NULL, a special stream handle, or a live `cudaStream_t`.
#[no_mangle]
pub unsafe extern "C-unwind" fn tidepool_torch_malloc(
    size: isize,
    device: i32,
    stream: *mut c_void,
) -> *mut c_void {
    // No catch_unwind here: the only thing that unwinds through this frame
    // is the C++ exception the shim throws on purpose, towards PyTorch.
    // SAFETY: the shim takes the same arguments and is sound for any
    // values (it validates them through tidepool_torch_try_malloc).
    unsafe { tidepool_shim_torch_malloc(size, device, stream) }
}

/// The `malloc` of the PyTorch pluggable allocator, without the throw:
/// `*out` receives the pointer (NULL for size 0). On out-of-memory the pool
/// is synchronised, its cached memory released, and the request retried
/// once before failing. Used by the C++ `tidepool_torch_malloc`.
#[no_mangle]
pub extern "C" fn tidepool_torch_try_malloc(
    size: isize,
    device: i32,
    stream: *mut c_void,
    out: *mut *mut c_void,
) -> tidepool_status {
    guard("tidepool_torch_malloc", || {
        if out.is_null() {
            return Err(Failure::null("out"));
        }
        let size = usize::try_from(size).map_err(|_| {
            Failure::new(
                TIDEPOOL_ERROR_INVALID_ARGUMENT,
                format!("negative allocation size {size}"),
            )
        })?;
        let pool = default_pool(device)?;
        let s = pool.streams.resolve(&pool.pool, stream as usize)?;
        let ptr = match pool.alloc(size, s) {
            Ok(p) => p,
            Err(e) if e.is_out_of_memory() => {
                tracing::info!(
                    size,
                    device,
                    "tidepool: out of memory; synchronising, trimming, retrying once"
                );
                pool.synchronize()?;
                pool.trim_to(0)?;
                pool.alloc(size, s)?
            }
            Err(e) => return Err(e.into()),
        };
        write_out(out, ptr as usize as *mut c_void, "out")
    })
}

/// The `free` of the PyTorch pluggable allocator. It cannot report failure
/// to PyTorch (a throw from a deleter ends the process), so a failure is
/// logged (`tracing`) and left in `tidepool_last_error()`.
#[no_mangle]
pub extern "C" fn tidepool_torch_free(
    ptr: *mut c_void,
    size: usize,
    device: i32,
    stream: *mut c_void,
) {
    let status = guard("tidepool_torch_free", || {
        if ptr.is_null() {
            return Ok(());
        }
        // Never create a pool to free into: that would reserve address
        // space and fix the default configuration for a pointer that
        // cannot be one of its allocations.
        let pool = existing_default_pool(device).ok_or_else(|| {
            Failure::new(
                TIDEPOOL_ERROR_INVALID_POINTER,
                format!(
                    "{:#x} was not allocated by tidepool: device {device} has no pool yet",
                    ptr as usize
                ),
            )
        })?;
        let s = pool.streams.resolve(&pool.pool, stream as usize)?;
        pool.free(ptr as usize as u64, s)?;
        Ok(())
    });
    if status != TIDEPOOL_OK {
        tracing::error!(
            ptr = ptr as usize,
            size,
            device,
            ?status,
            "tidepool: free failed"
        );
    }
}

/// The `record_stream` hook: declare a use of `ptr` on `stream`, so its
/// free waits for that use.
#[no_mangle]
pub extern "C" fn tidepool_torch_record_stream(ptr: *mut c_void, stream: *mut c_void) {
    let status = guard("tidepool_torch_record_stream", || {
        let addr = ptr as usize as u64;
        let pool = default_pools()
            .find(|p| p.contains(addr))
            .ok_or_else(|| Failure::from(PoolError::UnknownPointer { ptr: addr }))?;
        let s = pool.streams.resolve(&pool.pool, stream as usize)?;
        pool.record_use(addr, s)?;
        Ok(())
    });
    if status != TIDEPOOL_OK {
        tracing::error!(
            ptr = ptr as usize,
            ?status,
            "tidepool: record_stream failed"
        );
    }
}

/// The `reset` hook (`torch.cuda.empty_cache`): synchronise every default
/// pool and release all memory not in use.
#[no_mangle]
pub extern "C" fn tidepool_torch_reset() {
    let status = tidepool_torch_empty_cache();
    if status != TIDEPOOL_OK {
        tracing::error!(?status, "tidepool: empty_cache failed");
    }
}

/// `empty_cache` with a status: synchronise every default pool, then
/// release all memory not in use.
#[no_mangle]
pub extern "C" fn tidepool_torch_empty_cache() -> tidepool_status {
    guard("tidepool_torch_empty_cache", || {
        for pool in default_pools() {
            pool.synchronize()?;
            pool.trim_to(0)?;
        }
        Ok(())
    })
}

/// The `memory_fraction` hook (`torch.cuda.set_per_process_memory_fraction`):
/// cap device `device`'s pool at `fraction` of the device's memory.
#[no_mangle]
pub extern "C" fn tidepool_torch_memory_fraction(fraction: f64, device: i32) {
    let status = guard("tidepool_torch_memory_fraction", || {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(Failure::new(
                TIDEPOOL_ERROR_INVALID_ARGUMENT,
                format!("memory fraction {fraction} is not within 0..=1"),
            ));
        }
        let pool = default_pool(device)?;
        let total = pool.total_device_memory()?;
        let cap = (total as f64 * fraction) as u64;
        pool.set_cap((fraction < 1.0).then_some(cap));
        Ok(())
    });
    if status != TIDEPOOL_OK {
        tracing::error!(
            fraction,
            device,
            ?status,
            "tidepool: memory_fraction failed"
        );
    }
}

/// Statistics of device `device`'s default pool (all zero if it was not
/// created yet: nothing was allocated on that device).
#[no_mangle]
pub extern "C" fn tidepool_torch_get_stats(
    device: i32,
    out: *mut tidepool_stats,
) -> tidepool_status {
    guard("tidepool_torch_get_stats", || {
        let stats = match default_pools().find(|p| p.device_ordinal() == Some(device)) {
            Some(p) => c_stats(p),
            None => tidepool_stats::default(),
        };
        write_out(out, stats, "out")
    })
}

/// Reset the high-water marks of device `device`'s default pool.
#[no_mangle]
pub extern "C" fn tidepool_torch_reset_peaks(device: i32) -> tidepool_status {
    guard("tidepool_torch_reset_peaks", || {
        if let Some(p) = default_pools().find(|p| p.device_ordinal() == Some(device)) {
            p.reset_peaks();
        }
        Ok(())
    })
}

/// Whether `ptr` lies in the address range of one of the default pools
/// (for tests and diagnostics: "is this tensor's memory tidepool's?").
#[no_mangle]
pub extern "C" fn tidepool_torch_owns(ptr: *const c_void) -> bool {
    std::panic::catch_unwind(|| default_pools().any(|p| p.contains(ptr as usize as u64)))
        .unwrap_or(false)
}
