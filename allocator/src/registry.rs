//! Process-wide knowledge about pools: which address range belongs to which
//! pool, the per-device default pools, and "release your cache" requests
//! between pools of one device (step 6 of the reuse order).
//!
//! This is process-global state, so it uses std's primitives directly and is
//! compiled out under `cfg(loom)` (loom models run one pool in isolation).

use crate::pool::PoolInner;
use tidepool_sys::{Device, DevicePtr};

/// What the registry can ask of a pool without knowing its device type.
#[cfg_attr(loom, allow(dead_code))]
pub(crate) trait CacheHolder: Send + Sync {
    fn release_cached(&self) -> u64;
}

impl<D: Device> CacheHolder for PoolInner<D> {
    fn release_cached(&self) -> u64 {
        self.trim_to(0).unwrap_or(0)
    }
}

#[cfg(not(loom))]
mod imp {
    use super::*;
    use crate::error::PoolError;
    use crate::pool::MemPool;
    use crate::PoolConfig;
    use std::any::{Any, TypeId};
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, OnceLock, Weak};

    struct Entry {
        id: u64,
        base: DevicePtr,
        size: u64,
        device_key: usize,
        holder: Weak<dyn CacheHolder>,
    }

    fn pools() -> &'static Mutex<Vec<Entry>> {
        static POOLS: OnceLock<Mutex<Vec<Entry>>> = OnceLock::new();
        POOLS.get_or_init(|| Mutex::new(Vec::new()))
    }

    fn device_key<D>(device: &Arc<D>) -> usize {
        Arc::as_ptr(device) as *const () as usize
    }

    pub(crate) fn register<D: Device>(inner: &Arc<PoolInner<D>>) {
        let holder: Arc<dyn CacheHolder> = inner.clone();
        let entry = Entry {
            id: inner.id,
            base: inner.base,
            size: inner.va_size as u64,
            device_key: device_key(&inner.device),
            holder: Arc::downgrade(&holder),
        };
        pools()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(entry);
    }

    pub(crate) fn unregister(id: u64) {
        pools()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|e| e.id != id);
    }

    pub(crate) fn owner_of(ptr: DevicePtr) -> Option<u64> {
        pools()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|e| ptr >= e.base && ptr < e.base + e.size)
            .map(|e| e.id)
    }

    /// Ask every other pool on `me`'s device to release its cached,
    /// completed memory. Called without `me`'s arena lock held.
    pub(crate) fn release_other_pools<D: Device>(me: &PoolInner<D>) -> u64 {
        let key = Arc::as_ptr(&me.device) as *const () as usize;
        let others: Vec<Arc<dyn CacheHolder>> = pools()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|e| e.device_key == key && e.id != me.id)
            .filter_map(|e| e.holder.upgrade())
            .collect();
        others.iter().map(|h| h.release_cached()).sum()
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
        type Defaults = Mutex<HashMap<(usize, TypeId), Box<dyn Any + Send + Sync>>>;
        static DEFAULTS: OnceLock<Defaults> = OnceLock::new();
        let map = DEFAULTS.get_or_init(|| Mutex::new(HashMap::new()));
        let mut map = map.lock().unwrap_or_else(|p| p.into_inner());
        let key = (device_key(device), TypeId::of::<D>());
        if let Some(pool) = map.get(&key).and_then(|b| b.downcast_ref::<MemPool<D>>()) {
            return Ok(pool.clone());
        }
        let pool = MemPool::new(device.clone(), PoolConfig::default())?;
        map.insert(key, Box::new(pool.clone()));
        Ok(pool)
    }
}

#[cfg(loom)]
mod imp {
    use super::*;
    pub(crate) fn register<D: Device>(_: &crate::sync::Arc<PoolInner<D>>) {}
    pub(crate) fn unregister(_: u64) {}
    pub(crate) fn owner_of(_: DevicePtr) -> Option<u64> {
        None
    }
    pub(crate) fn release_other_pools<D: Device>(_: &PoolInner<D>) -> u64 {
        0
    }
}

#[cfg(not(loom))]
pub use imp::default_pool;
pub(crate) use imp::{owner_of, register, release_other_pools, unregister};
