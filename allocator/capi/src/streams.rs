//! Raw driver stream handles (`cudaStream_t` / `CUstream`) to pool streams.
//!
//! The pool keys its per-stream state by ids it never reuses. A raw handle
//! is not such an id: after `cudaStreamDestroy` the driver may hand the same
//! pointer value to a new stream. Treating the new stream as the old one
//! would let it reuse, with no ordering at all, memory the old stream freed
//! while its last work may still be running. So each cached handle also
//! stores the driver's own unique stream id (`cuStreamGetId`, never reused
//! within a process); when a handle comes back with a different id, the old
//! pool stream is forgotten by the device and retired from the pool (its
//! pending frees then complete only once a device-wide wait observes them)
//! and the handle is adopted afresh.
//!
//! Special handles: 0 and `CU_STREAM_LEGACY` (1) are the legacy NULL stream,
//! the pool's default stream. `CU_STREAM_PER_THREAD` (2) names a different
//! stream on every thread, so it is adopted once per thread and cached in a
//! thread-local map (those per-thread entries are not retired when a thread
//! ends; each holds a few hundred bytes of bookkeeping).

use crate::error::Failure;
use crate::pool::AnyPool;
use cudarc::driver::sys;
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;
use tidepool_core::Device;
use tidepool_sys::cuda::{RAW_STREAM_LEGACY, RAW_STREAM_PER_THREAD};
use tidepool_sys::Stream;

#[derive(Default)]
pub(crate) struct RawStreams {
    /// raw handle -> (driver stream id, pool stream)
    map: RwLock<HashMap<usize, (u64, Stream)>>,
    /// Handles adopted (first sight, or again after recycling).
    pub adopted: AtomicU64,
    /// Handles found recycled by the driver (old pool stream retired).
    pub recycled: AtomicU64,
}

thread_local! {
    /// (pool id) -> this thread's per-thread default stream in that pool.
    static PER_THREAD: RefCell<HashMap<u64, Stream>> = RefCell::new(HashMap::new());
}

/// The driver's unique id of a stream (`None` if the driver cannot say).
fn driver_stream_id(raw: usize) -> Option<u64> {
    let mut id: std::ffi::c_ulonglong = 0;
    // SAFETY: `raw` is a live stream handle the caller gave us for this call
    // (the C contract of every raw-stream entry point); the out pointer is
    // valid. The driver library is loaded: a CUDA pool exists.
    let r = unsafe { sys::cuStreamGetId(raw as sys::CUstream, &mut id) };
    (r == sys::CUresult::CUDA_SUCCESS).then_some(id)
}

impl RawStreams {
    /// The pool stream for a raw handle, adopting it on first sight.
    pub fn resolve(&self, pool: &AnyPool, raw: usize) -> Result<Stream, Failure> {
        if raw == 0 || raw == RAW_STREAM_LEGACY {
            return Ok(crate::with_pool!(pool, |p| p.device().default_stream()));
        }
        if raw == RAW_STREAM_PER_THREAD {
            let key = crate::with_pool!(pool, |p| p.id());
            if let Some(s) = PER_THREAD.with(|m| m.borrow().get(&key).copied()) {
                return Ok(s);
            }
            let s = crate::with_pool!(pool, |p| p.device().adopt_stream(raw))?;
            self.adopted.fetch_add(1, Ordering::Relaxed);
            PER_THREAD.with(|m| m.borrow_mut().insert(key, s));
            return Ok(s);
        }
        let driver_id = match pool {
            AnyPool::Cuda(_) => driver_stream_id(raw).unwrap_or(0),
            AnyPool::Host(_) => 0,
        };
        self.resolve_with(pool, raw, driver_id, |raw| {
            crate::with_pool!(pool, |p| p.device().adopt_stream(raw))
        })
    }

    /// The cache itself: `driver_id` is the driver's unique id of the
    /// stream behind `raw` now, `adopt` registers a handle with the device.
    pub(crate) fn resolve_with(
        &self,
        pool: &AnyPool,
        raw: usize,
        driver_id: u64,
        adopt: impl FnOnce(usize) -> tidepool_sys::SysResult<Stream>,
    ) -> Result<Stream, Failure> {
        {
            let map = self.map.read().unwrap_or_else(|e| e.into_inner());
            if let Some(&(id, s)) = map.get(&raw) {
                if id == driver_id {
                    return Ok(s);
                }
            }
        }
        let mut map = self.map.write().unwrap_or_else(|e| e.into_inner());
        if let Some(&(id, old)) = map.get(&raw) {
            if id == driver_id {
                return Ok(old);
            }
            // The handle was recycled: forget the old stream in the device
            // first, so the pool sees it as gone and never records on the
            // new stream on the old one's behalf.
            self.recycled.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(raw, old = %old, "tidepool: raw stream handle recycled by the driver");
            crate::with_pool!(pool, |p| {
                if let Err(e) = p.device().destroy_stream(old) {
                    tracing::warn!(error = %e, "tidepool: forgetting a recycled stream failed");
                }
                if let Err(e) = p.retire_stream(old) {
                    tracing::warn!(error = %e, "tidepool: retiring a recycled stream failed");
                }
            });
            map.remove(&raw);
        }
        let s = adopt(raw)?;
        self.adopted.fetch_add(1, Ordering::Relaxed);
        map.insert(raw, (driver_id, s));
        Ok(s)
    }

    /// Forget a raw handle the caller is about to destroy: retire its pool
    /// stream (its pending frees stay guarded by its work) and drop it.
    pub fn retire(&self, pool: &AnyPool, raw: usize) -> Result<(), Failure> {
        let removed = self
            .map
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&raw);
        if let Some((_, s)) = removed {
            crate::with_pool!(pool, |p| {
                p.retire_stream(s)?;
                p.device().destroy_stream(s)?;
                Ok::<(), Failure>(())
            })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use tidepool_core::{MemPool, PoolConfig, PoolError};
    use tidepool_sys::{HostConfig, HostDevice};

    fn host_pool() -> AnyPool {
        let dev = Arc::new(HostDevice::with_config(HostConfig {
            capacity: 64 << 20,
            ..HostConfig::default()
        }));
        AnyPool::Host(MemPool::new(dev, PoolConfig::default().with_va_size(256 << 20)).unwrap())
    }

    /// A handle that comes back with another driver id is another stream:
    /// the old pool stream is retired, the handle adopted afresh.
    #[test]
    fn a_recycled_handle_is_a_new_stream() {
        let pool = host_pool();
        let AnyPool::Host(p) = &pool else {
            unreachable!()
        };
        let cache = RawStreams::default();
        // On the host backend, created streams stand in for adopted ones.
        let adopt = |_raw: usize| p.device().create_stream();
        let raw = 0x7f00_1000;
        let s1 = cache.resolve_with(&pool, raw, 41, adopt).unwrap();
        assert_eq!(cache.resolve_with(&pool, raw, 41, adopt).unwrap(), s1);
        let a = p.alloc_raw(2 << 20, s1).unwrap();
        p.free_raw(a, s1).unwrap();

        let s2 = cache.resolve_with(&pool, raw, 42, adopt).unwrap();
        assert_ne!(s2, s1, "a recycled handle must not map to the old stream");
        assert_eq!(cache.recycled.load(Ordering::Relaxed), 1);
        assert_eq!(cache.adopted.load(Ordering::Relaxed), 2);
        assert!(matches!(
            p.alloc_raw(4096, s1),
            Err(PoolError::StreamRetired { .. }) | Err(PoolError::Device(_))
        ));
        let b = p.alloc_raw(2 << 20, s2).unwrap();
        p.free_raw(b, s2).unwrap();
        assert_eq!(cache.resolve_with(&pool, raw, 42, adopt).unwrap(), s2);
    }

    #[test]
    fn null_and_legacy_handles_are_the_default_stream() {
        let pool = host_pool();
        let AnyPool::Host(p) = &pool else {
            unreachable!()
        };
        let cache = RawStreams::default();
        let d = p.device().default_stream();
        assert_eq!(cache.resolve(&pool, 0).unwrap(), d);
        assert_eq!(cache.resolve(&pool, RAW_STREAM_LEGACY).unwrap(), d);
        assert_eq!(cache.adopted.load(Ordering::Relaxed), 0);
    }
}
