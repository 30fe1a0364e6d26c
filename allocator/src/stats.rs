//! Pool statistics: a plain snapshot type, and the counters behind it.

use crate::sync::{AtomicU64, Mutex, Ordering};
use std::fmt;

/// A snapshot of a pool's attributes and counters.
///
/// Fields may be added in later versions (hence `#[non_exhaustive]`: read
/// the fields, build none). `Display` gives a one-line summary; with the
/// crate's `serde` feature the snapshot serialises as an object with one
/// field per counter (names as below, byte counts in bytes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
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
    /// Binds of physical memory at an address (a driver map and
    /// set-access each): the first mapping of every piece created by
    /// growth, and every move of a piece from where it was free to where it
    /// was needed (defragmentation).
    pub remaps: u64,
    /// Pages moved back to a place they had been mapped before, with no
    /// driver call (their old mapping was kept).
    pub rebinds: u64,
    /// Stream waits the pool inserted to reuse a pending free.
    pub internal_dependencies: u64,
    /// Allocations that failed with out-of-memory.
    pub ooms: u64,
}

impl fmt::Display for PoolStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        write!(
            f,
            "reserved {:.1} MiB (high {:.1}), used {:.1} MiB (high {:.1}); {} allocs, {} frees, \
             {} cache hits; {} growths, {} releases, {} remaps, {} rebinds, {} internal \
             dependencies, {} out-of-memory",
            mib(self.reserved_current),
            mib(self.reserved_high),
            mib(self.used_current),
            mib(self.used_high),
            self.allocs,
            self.frees,
            self.cache_hits,
            self.growths,
            self.releases,
            self.remaps,
            self.rebinds,
            self.internal_dependencies,
            self.ooms
        )
    }
}

/// Counters kept per stream, under the stream's own lock: the fast path
/// then writes no cache line that other streams' threads also write.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct StreamCounters {
    pub allocs: u64,
    pub frees: u64,
    pub cache_hits: u64,
    /// Bytes this stream may allocate without the pool's used bytes passing
    /// `used_high` (see [`Ledger`]).
    pub headroom: u64,
}

/// Exact `used_current` and `used_high` with no shared write on the fast
/// path. Invariant, whenever no allocation is between its two halves:
/// `used + unassigned + Σ stream headroom = used_high`. A free adds its
/// bytes to its stream's headroom; an allocation spends its stream's
/// headroom and only when that falls short takes the rest here — from
/// `unassigned`, then from every stream's headroom (collected), and what is
/// still missing is a new peak. So a loop that frees what it allocates on
/// its own stream never touches the ledger, and a peak is never counted
/// that did not happen (each allocation is ordered, for the count, at its
/// claim here).
///
/// Collecting visits only the streams that hold headroom: a free that
/// gives its stream headroom lists the stream in `donors` (once: the
/// stream's `donor` flag, set under the stream's lock, says it is listed or
/// about to be), and a collection empties the list and clears the flags of
/// the streams it took from. An allocation short of headroom therefore
/// costs what the streams freed since the last collection cost, not what
/// every stream the pool ever met costs.
#[derive(Debug, Default)]
pub(crate) struct Ledger {
    pub used_high: u64,
    pub unassigned: u64,
    /// Ids of streams that may hold headroom.
    pub donors: Vec<u64>,
    /// The counts of streams retired and dropped from the stream table
    /// (their headroom went to `unassigned`).
    pub forgotten: StreamCounters,
}

/// Pool-wide counters, updated outside the arena lock.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub ledger: Mutex<Ledger>,
    /// Size-0 allocations and frees (they touch no stream state).
    pub zero_allocs: AtomicU64,
    pub zero_frees: AtomicU64,
    pub internal_dependencies: AtomicU64,
    pub ooms: AtomicU64,
}

impl Counters {
    /// Count an allocation of `size` bytes on the stream; returns the bytes
    /// of headroom it lacked, to be claimed from the ledger (by
    /// `PoolInner::claim_headroom`) once the stream's lock is released.
    #[must_use]
    #[inline]
    pub fn on_alloc(&self, local: &mut StreamCounters, size: u64, cache_hit: bool) -> u64 {
        local.allocs += 1;
        local.cache_hits += u64::from(cache_hit);
        let spent = local.headroom.min(size);
        local.headroom -= spent;
        size - spent
    }

    #[inline]
    pub fn on_free(&self, local: &mut StreamCounters, size: u64) {
        local.frees += 1;
        local.headroom += size;
    }

    pub fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::PoolStats;

    fn sample() -> PoolStats {
        PoolStats {
            reserved_current: 3 << 20,
            reserved_high: 5 << 20,
            used_current: 1 << 20,
            allocs: 7,
            remaps: 2,
            ooms: 1,
            ..PoolStats::default()
        }
    }

    #[test]
    fn display_is_one_line_with_the_figures() {
        let s = sample().to_string();
        assert!(!s.contains('\n'), "{s}");
        for part in [
            "reserved 3.0 MiB (high 5.0)",
            "used 1.0 MiB",
            "7 allocs",
            "2 remaps",
            "1 out-of-memory",
        ] {
            assert!(s.contains(part), "{part:?} missing in {s}");
        }
    }

    #[cfg(feature = "serde")]
    #[test]
    fn serde_round_trip_keeps_every_field() {
        let stats = sample();
        let json = serde_json::to_string(&stats).unwrap();
        assert!(json.contains("\"reserved_high\":5242880"), "{json}");
        let back: PoolStats = serde_json::from_str(&json).unwrap();
        assert_eq!(back, stats);
    }
}
