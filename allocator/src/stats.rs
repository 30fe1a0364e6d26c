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
    /// Highest `used_current` since creation or the last reset. Exact by
    /// default; with [`PoolConfig::exact_used_high`](crate::PoolConfig::exact_used_high)
    /// off, the highest value seen by a `stats()` call or reset (a lower bound).
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

/// Counters kept per stream, under the stream's own lock: the fast path
/// then writes no cache line that other streams' threads also write.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct StreamCounters {
    pub allocs: u64,
    pub frees: u64,
    pub cache_hits: u64,
    /// Bytes allocated on the stream minus bytes freed on it (may be
    /// negative: frees on another stream than the allocation's). Used only
    /// when the pool does not track `used_high` exactly.
    pub used: i64,
}

/// Pool-wide counters, updated outside the arena lock.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    /// Whether `used_current`/`used_high` are kept exactly in the shared
    /// atomics below (one shared read-modify-write per allocation and free)
    /// or summed from the streams' counters when read.
    pub exact_used: bool,
    pub used_current: AtomicU64,
    pub used_high: AtomicU64,
    /// Size-0 allocations and frees (they touch no stream state).
    pub zero_allocs: AtomicU64,
    pub zero_frees: AtomicU64,
    pub internal_dependencies: AtomicU64,
    pub ooms: AtomicU64,
}

impl Counters {
    pub fn new(exact_used: bool) -> Self {
        Counters {
            exact_used,
            ..Default::default()
        }
    }

    pub fn on_alloc(&self, local: &mut StreamCounters, size: u64, cache_hit: bool) {
        local.allocs += 1;
        local.cache_hits += u64::from(cache_hit);
        if self.exact_used {
            let now = self.used_current.fetch_add(size, Ordering::Relaxed) + size;
            // A read first: the shared line is written only at a new high.
            if now > self.used_high.load(Ordering::Relaxed) {
                self.used_high.fetch_max(now, Ordering::Relaxed);
            }
        } else {
            local.used += size as i64;
        }
    }

    pub fn on_free(&self, local: &mut StreamCounters, size: u64) {
        local.frees += 1;
        if self.exact_used {
            self.used_current.fetch_sub(size, Ordering::Relaxed);
        } else {
            local.used -= size as i64;
        }
    }

    pub fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}
