//! The table behind the raw-pointer API for foreign callers (the C ABI):
//! which pointers are live, which were freed lately, and what to tell a
//! caller who hands in a pointer that is not live. Generic over the handle
//! it keeps, so that it sits below the pool: the pool's `alloc_raw`,
//! `free_raw` and `record_use_raw` keep their allocations here.

use crate::error::PoolError;
use crate::sync::{lock, Mutex};
use std::collections::{BTreeMap, HashSet};
use tidepool_sys::DevicePtr;

/// Bound on remembered freed addresses (beyond it, a double free is
/// reported as an unknown pointer).
const FREED_MEMORY: usize = 1 << 20;

/// What the table needs to know of a handle: its size in bytes.
pub(crate) trait RawSize {
    fn bytes(&self) -> usize;
}

pub(crate) struct RawTable<A> {
    live: Mutex<BTreeMap<DevicePtr, A>>,
    freed: Mutex<HashSet<DevicePtr>>,
}

impl<A> Default for RawTable<A> {
    fn default() -> Self {
        RawTable {
            live: Mutex::new(BTreeMap::new()),
            freed: Mutex::new(HashSet::new()),
        }
    }
}

impl<A: RawSize> RawTable<A> {
    /// `ptr` is live now (handed out, or back after a failed free).
    pub fn insert(&self, ptr: DevicePtr, a: A) {
        let mut live = lock(&self.live);
        lock(&self.freed).remove(&ptr);
        live.insert(ptr, a);
    }

    /// Take the live handle at `ptr` out, to be freed; `ptr` is remembered
    /// as freed. A pointer that is not live gets the error that says why
    /// (`in_pool`: whether an address lies in this pool's range).
    pub fn take(
        &self,
        ptr: DevicePtr,
        in_pool: impl Fn(DevicePtr) -> bool,
    ) -> Result<A, PoolError> {
        let mut live = lock(&self.live);
        match live.remove(&ptr) {
            Some(a) => {
                let mut freed = lock(&self.freed);
                if freed.len() >= FREED_MEMORY {
                    freed.clear();
                }
                freed.insert(ptr);
                Ok(a)
            }
            None => Err(self.diagnose(&live, ptr, in_pool)),
        }
    }

    /// Run `f` on the live handle at `ptr`.
    pub fn with_live(
        &self,
        ptr: DevicePtr,
        in_pool: impl Fn(DevicePtr) -> bool,
        f: impl FnOnce(&mut A),
    ) -> Result<(), PoolError> {
        let mut live = lock(&self.live);
        match live.get_mut(&ptr) {
            Some(a) => {
                f(a);
                Ok(())
            }
            None => Err(self.diagnose(&live, ptr, in_pool)),
        }
    }

    /// Size in bytes of the live handle at `ptr`.
    pub fn size(&self, ptr: DevicePtr) -> Option<usize> {
        lock(&self.live).get(&ptr).map(RawSize::bytes)
    }

    fn diagnose(
        &self,
        live: &BTreeMap<DevicePtr, A>,
        ptr: DevicePtr,
        in_pool: impl Fn(DevicePtr) -> bool,
    ) -> PoolError {
        if let Some((&base, a)) = live.range(..ptr).next_back() {
            if ptr < base + a.bytes().max(1) as u64 {
                return PoolError::InteriorPointer { ptr, base };
            }
        }
        if lock(&self.freed).contains(&ptr) {
            return PoolError::DoubleFree { ptr };
        }
        if !in_pool(ptr) {
            if let Some(owner_pool) = crate::registry::owner_of(ptr) {
                return PoolError::ForeignPointer { ptr, owner_pool };
            }
        }
        PoolError::UnknownPointer { ptr }
    }
}
