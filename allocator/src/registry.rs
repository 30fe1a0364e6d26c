//! Process-wide knowledge about pools: which address range belongs to which
//! pool, the per-device default pools, and "release your cache" requests
//! between pools of one device (step 6 of the reuse order).
//!
//! This is process-global state, so it uses std's primitives directly (loom
//! models run one pool alone: under loom no pool registers, see
//! `sync::std_weak`).

use tidepool_sys::DevicePtr;

/// What the registry can ask of a pool without knowing its device type
/// (the pool implements it; the registry sits below the pool).
pub(crate) trait CacheHolder: Send + Sync {
    fn release_cached(&self) -> u64;
}

/// The key of a device instance among pools: its address.
pub(crate) fn device_key<D>(device: &D) -> usize {
    device as *const D as *const () as usize
}

/// A pool as the registry knows it.
pub(crate) struct PoolRecord {
    pub id: u64,
    pub base: DevicePtr,
    pub size: u64,
    /// Identifies the pool's device instance (pools of one device release
    /// cache for each other).
    pub device_key: usize,
    pub holder: std::sync::Weak<dyn CacheHolder>,
}

mod imp {
    use super::*;
    use std::any::{Any, TypeId};
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, OnceLock};

    fn pools() -> &'static Mutex<Vec<PoolRecord>> {
        static POOLS: OnceLock<Mutex<Vec<PoolRecord>>> = OnceLock::new();
        POOLS.get_or_init(|| Mutex::new(Vec::new()))
    }

    pub(crate) fn register(entry: PoolRecord) {
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

    /// Ask every other pool on the device `device_key` than `me` to
    /// release its cached, completed memory. Called without `me`'s arena
    /// lock held.
    pub(crate) fn release_other_pools(device_key: usize, me: u64) -> u64 {
        let others: Vec<Arc<dyn CacheHolder>> = pools()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|e| e.device_key == device_key && e.id != me)
            .filter_map(|e| e.holder.upgrade())
            .collect();
        others.iter().map(|h| h.release_cached()).sum()
    }

    /// The value kept for `key` (a device instance and its type), made by
    /// `make` on first use and kept for the life of the process: the
    /// per-device default pools.
    pub(crate) fn default_for<T, E>(
        key: (usize, TypeId),
        make: impl FnOnce() -> Result<T, E>,
    ) -> Result<T, E>
    where
        T: Any + Clone + Send + Sync,
    {
        type Defaults = Mutex<HashMap<(usize, TypeId), Box<dyn Any + Send + Sync>>>;
        static DEFAULTS: OnceLock<Defaults> = OnceLock::new();
        let map = DEFAULTS.get_or_init(|| Mutex::new(HashMap::new()));
        let mut map = map.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(v) = map.get(&key).and_then(|b| b.downcast_ref::<T>()) {
            return Ok(v.clone());
        }
        let v = make()?;
        map.insert(key, Box::new(v.clone()));
        Ok(v)
    }
}

pub(crate) use imp::{default_for, register};
pub(crate) use imp::{owner_of, release_other_pools, unregister};
