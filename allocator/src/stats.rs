//! Pool statistics: a plain snapshot type, and the counters behind it.

use crate::sync::{AtomicU64, Ordering};

/// A snapshot of a pool's attributes and counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Physical bytes the pool holds now.
    pub reserved_current: u64,
    /// Highest `reserved_current` since creation or the last reset.
    pub reserved_high: u64,
    /// Bytes in live allocations now (requested sizes).
    pub used_current: u64,
    /// Highest `used_current` since creation or the last reset.
    pub used_high: u64,
    /// Allocations made.
    pub allocs: u64,
    /// Frees made.
    pub frees: u64,
    /// Allocations served from the allocating stream's private cache.
    pub cache_hits: u64,
    /// Pieces of physical memory created (growth).
    pub growths: u64,
    /// Pieces of physical memory released to the device.
    pub releases: u64,
    /// Pieces of physical memory moved from where they were free to where
    /// they were needed (defragmentation).
    pub remaps: u64,
    /// Pages moved back to a place they had been mapped before, with no
    /// driver call (their old mapping was kept).
    pub rebinds: u64,
    /// Stream waits the pool inserted to reuse a pending free.
    pub internal_dependencies: u64,
    /// Allocations that failed with out-of-memory.
    pub ooms: u64,
}

/// Counters updated outside the arena lock.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub used_current: AtomicU64,
    pub used_high: AtomicU64,
    pub allocs: AtomicU64,
    pub frees: AtomicU64,
    pub cache_hits: AtomicU64,
    pub internal_dependencies: AtomicU64,
    pub ooms: AtomicU64,
}

impl Counters {
    pub fn on_alloc(&self, size: u64, cache_hit: bool) {
        self.allocs.fetch_add(1, Ordering::Relaxed);
        if cache_hit {
            self.cache_hits.fetch_add(1, Ordering::Relaxed);
        }
        let now = self.used_current.fetch_add(size, Ordering::Relaxed) + size;
        self.used_high.fetch_max(now, Ordering::Relaxed);
    }

    pub fn on_free(&self, size: u64) {
        self.frees.fetch_add(1, Ordering::Relaxed);
        self.used_current.fetch_sub(size, Ordering::Relaxed);
    }

    pub fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}
