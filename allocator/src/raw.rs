//! The raw-pointer API for foreign callers (the C ABI): pointers instead of
//! [`Allocation`] handles, with double frees and stray pointers detected.

use crate::error::PoolError;
use crate::pool::{Allocation, MemPool};
use crate::sync::{lock, Mutex};
use std::collections::{BTreeMap, HashSet};
use tidepool_sys::{Device, DevicePtr, Stream};

/// Bound on remembered freed addresses (beyond it, a double free is
/// reported as an unknown pointer).
const FREED_MEMORY: usize = 1 << 20;

#[derive(Default)]
pub(crate) struct RawTable {
    live: Mutex<BTreeMap<DevicePtr, Allocation>>,
    freed: Mutex<HashSet<DevicePtr>>,
}

impl<D: Device> MemPool<D> {
    /// [`alloc_async`](Self::alloc_async) for callers that keep pointers.
    /// Size 0 returns 0 (null) and is not counted as an allocation, just as
    /// freeing null is not counted as a free: a caller cannot tell the
    /// null of a size-0 allocation from any other null, so only counting
    /// neither keeps allocations minus frees equal to the live allocations.
    pub fn alloc_raw(&self, size: usize, stream: Stream) -> Result<DevicePtr, PoolError> {
        if size == 0 {
            return Ok(0);
        }
        let a = self.alloc_async(size, stream)?;
        let ptr = a.ptr();
        if ptr == 0 {
            return Ok(0);
        }
        let table = &self.inner.raw;
        let mut live = lock(&table.live);
        lock(&table.freed).remove(&ptr);
        live.insert(ptr, a);
        Ok(ptr)
    }

    /// [`free_async`](Self::free_async) by pointer. Freeing 0 is a no-op.
    /// A pointer that is not live gets a typed error and changes nothing.
    pub fn free_raw(&self, ptr: DevicePtr, stream: Stream) -> Result<(), PoolError> {
        if ptr == 0 {
            return Ok(());
        }
        let table = &self.inner.raw;
        let allocation = {
            let mut live = lock(&table.live);
            match live.remove(&ptr) {
                Some(a) => {
                    let mut freed = lock(&table.freed);
                    if freed.len() >= FREED_MEMORY {
                        freed.clear();
                    }
                    freed.insert(ptr);
                    a
                }
                None => return Err(self.diagnose(&live, ptr)),
            }
        };
        match self.free_async(allocation, stream) {
            Ok(()) => Ok(()),
            Err(failed) => {
                let mut live = lock(&table.live);
                lock(&table.freed).remove(&ptr);
                live.insert(ptr, failed.allocation);
                Err(failed.error)
            }
        }
    }

    /// [`record_use`](Self::record_use) by pointer.
    pub fn record_use_raw(&self, ptr: DevicePtr, stream: Stream) -> Result<(), PoolError> {
        let mut live = lock(&self.inner.raw.live);
        match live.get_mut(&ptr) {
            Some(a) => {
                self.record_use(a, stream);
                Ok(())
            }
            None => Err(self.diagnose(&live, ptr)),
        }
    }

    /// Size in bytes of the live raw allocation at `ptr`.
    pub fn raw_size(&self, ptr: DevicePtr) -> Option<usize> {
        lock(&self.inner.raw.live).get(&ptr).map(Allocation::size)
    }

    fn diagnose(&self, live: &BTreeMap<DevicePtr, Allocation>, ptr: DevicePtr) -> PoolError {
        if let Some((&base, a)) = live.range(..ptr).next_back() {
            if ptr < base + a.size().max(1) as u64 {
                return PoolError::InteriorPointer { ptr, base };
            }
        }
        if lock(&self.inner.raw.freed).contains(&ptr) {
            return PoolError::DoubleFree { ptr };
        }
        if !self.contains(ptr) {
            if let Some(owner_pool) = crate::registry::owner_of(ptr) {
                return PoolError::ForeignPointer { ptr, owner_pool };
            }
        }
        PoolError::UnknownPointer { ptr }
    }
}
