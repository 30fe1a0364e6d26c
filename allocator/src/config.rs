//! Pool configuration: what a user chooses when creating a pool.

use crate::error::PoolError;

/// The reuse switches of the driver's pools (all on by default, each also
/// changeable at run time through [`crate::MemPool::set_reuse`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReusePolicy {
    /// Reuse memory freed on stream A for stream B when B has waited,
    /// through the pool, on an event recorded on A after the free.
    pub follow_event_dependencies: bool,
    /// Reuse memory whose freeing work is observed complete (event query).
    pub opportunistic: bool,
    /// When nothing else works, make the allocating stream wait for a
    /// pending free instead of failing.
    pub internal_dependencies: bool,
    /// Last resort before out-of-memory: wait on the host, for at most
    /// [`PoolConfig::last_resort_wait`], for pending frees to complete.
    pub wait_for_pending_frees: bool,
}

impl Default for ReusePolicy {
    fn default() -> Self {
        ReusePolicy {
            follow_event_dependencies: true,
            opportunistic: true,
            internal_dependencies: true,
            wait_for_pending_frees: true,
        }
    }
}

/// How a pool is built. Construct with [`PoolConfig::default`] and the
/// `with_*` methods.
///
/// ```
/// use tidepool::PoolConfig;
/// let config = PoolConfig::default()
///     .with_release_threshold(1 << 30)
///     .with_max_size(8 << 30);
/// assert_eq!(config.release_threshold, 1 << 30);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolConfig {
    /// On a pool-aware synchronise, release physical memory down to this
    /// many bytes. Default `u64::MAX`: keep everything (as PyTorch does;
    /// the driver's default of 0 makes every sync a cliff).
    pub release_threshold: u64,
    /// Reuse switches.
    pub reuse: ReusePolicy,
    /// Hard maximum of physical bytes the pool may hold.
    pub max_size: Option<u64>,
    /// Size of each piece of physical memory the pool creates, a multiple
    /// of the device granularity (0 = the granularity). Smaller pieces let
    /// trim and defragmentation work finely; larger ones cost fewer driver
    /// calls per byte.
    pub page_size: usize,
    /// Largest piece of physical memory (one handle, a *unit* of pages)
    /// the pool creates for a block of at least
    /// [`PoolConfig::unit_min_block`] bytes, rounded down to a power of two
    /// times the page size; the page size or less (the default, 0) gives
    /// every block single pages.
    ///
    /// A handle can only be mapped whole, so a unit is created, mapped,
    /// moved, trimmed and released whole: it moves or goes back to the
    /// device only when no block uses any of its pages, and a unit partly
    /// in use keeps its idle pages where they are. Larger units cost fewer
    /// driver calls when the pool grows (creating a handle, mapping it and
    /// giving access cost about the same whatever its size) but let trim
    /// and defragmentation work less finely.
    ///
    /// Why single pages are the default: replaying the GPT-2 traces and
    /// two synthetic ones on the host, 64 MiB units for blocks of 16 MiB
    /// and up cut the fresh pass's handles by about 60 % but raised peak
    /// reserved to 1.026-1.055 of peak live (the idle pages of partly used
    /// units cannot serve other sizes); units of at most 16 MiB for blocks
    /// of 256 MiB and up kept every trace within 1.014 and cut the handles
    /// by about 38 %, but a warm pass of the variable-length trace then
    /// bound 150 pages instead of 8, since a unit comes back to an earlier
    /// place only when all of it is free. `with_max_unit_size(16 << 20)`
    /// with the default [`PoolConfig::unit_min_block`] is the measured
    /// choice for a workload whose first pass matters most.
    pub max_unit_size: usize,
    /// Blocks from this size on get their new physical memory in units
    /// of up to [`PoolConfig::max_unit_size`]. Default 256 MiB: smaller
    /// blocks come and go at more varied sizes and addresses, where a
    /// unit is more often left partly used.
    pub unit_min_block: usize,
    /// Virtual address space to reserve (0 = twice the device's memory,
    /// at least 64 GiB). Reserving costs no memory.
    pub va_size: usize,
    /// Request the POSIX file-descriptor handle type for all physical
    /// memory, so it can be exported to other processes.
    pub exportable: bool,
    /// Upper bound of the host wait of [`ReusePolicy::wait_for_pending_frees`].
    pub last_resort_wait: std::time::Duration,
    /// Bytes a stream may keep in its private cache of same-stream frees
    /// (the lock-free-of-others fast path). 0 disables the cache.
    pub stream_cache_bytes: usize,
    /// Strict capture mode (the default): check, on every allocation and
    /// free, whether the stream is being captured into a graph (one cheap
    /// driver call), and serve a capturing stream with graph memory. Off:
    /// the pool starts in announced mode, where the check runs only while
    /// a capture is announced with `MemPool::begin_announced_capture`; a
    /// capture that is not announced is then not seen. The mode can be
    /// switched later with `MemPool::set_announced_captures`.
    pub check_capture: bool,
    /// Other devices that get read-write access to this pool's memory.
    pub peer_devices: Vec<i32>,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            release_threshold: u64::MAX,
            reuse: ReusePolicy::default(),
            max_size: None,
            page_size: 0,
            max_unit_size: 0,
            unit_min_block: 256 << 20,
            va_size: 0,
            exportable: false,
            last_resort_wait: std::time::Duration::from_secs(1),
            stream_cache_bytes: 256 << 20,
            check_capture: true,
            peer_devices: Vec::new(),
        }
    }
}

impl PoolConfig {
    /// Set the release threshold (bytes kept on synchronise).
    pub fn with_release_threshold(mut self, bytes: u64) -> Self {
        self.release_threshold = bytes;
        self
    }
    /// Set a hard maximum size in bytes.
    pub fn with_max_size(mut self, bytes: u64) -> Self {
        self.max_size = Some(bytes);
        self
    }
    /// Set the reuse switches.
    pub fn with_reuse(mut self, reuse: ReusePolicy) -> Self {
        self.reuse = reuse;
        self
    }
    /// Set the physical page size (a multiple of the device granularity).
    pub fn with_page_size(mut self, bytes: usize) -> Self {
        self.page_size = bytes;
        self
    }
    /// Set the largest physical unit created for a large block (see
    /// [`PoolConfig::max_unit_size`]; the page size or less: single pages).
    pub fn with_max_unit_size(mut self, bytes: usize) -> Self {
        self.max_unit_size = bytes;
        self
    }
    /// Set the smallest block that gets units of several pages (see
    /// [`PoolConfig::unit_min_block`]).
    pub fn with_unit_min_block(mut self, bytes: usize) -> Self {
        self.unit_min_block = bytes;
        self
    }
    /// Set the virtual address space to reserve.
    pub fn with_va_size(mut self, bytes: usize) -> Self {
        self.va_size = bytes;
        self
    }
    /// Create all physical memory exportable (POSIX fd handle type).
    pub fn with_exportable(mut self, exportable: bool) -> Self {
        self.exportable = exportable;
        self
    }
    /// Set the upper bound of the last-resort host wait for pending frees
    /// ([`ReusePolicy::wait_for_pending_frees`]). `Duration::MAX` waits as
    /// long as it takes: the wait polls every pending free and retries the
    /// request as soon as one completes, so only a request that nothing but
    /// a free waiting for work this thread has yet to issue could serve
    /// blocks for good.
    pub fn with_last_resort_wait(mut self, wait: std::time::Duration) -> Self {
        self.last_resort_wait = wait;
        self
    }
    /// Set the per-stream cache size in bytes (0 disables it).
    pub fn with_stream_cache_bytes(mut self, bytes: usize) -> Self {
        self.stream_cache_bytes = bytes;
        self
    }
    /// Check for graph capture on every allocation and free (see
    /// [`PoolConfig::check_capture`]).
    pub fn with_check_capture(mut self, check: bool) -> Self {
        self.check_capture = check;
        self
    }
    /// Give other devices read-write access to the pool's memory.
    pub fn with_peer_devices(mut self, devices: Vec<i32>) -> Self {
        self.peer_devices = devices;
        self
    }

    pub(crate) fn validate(&self, granularity: usize) -> Result<(), PoolError> {
        if granularity == 0 || !granularity.is_power_of_two() {
            return Err(PoolError::InvalidConfig {
                reason: format!("device granularity {granularity} is not a power of two"),
            });
        }
        if self.page_size % granularity != 0 {
            return Err(PoolError::InvalidConfig {
                reason: format!(
                    "page_size {} is not a multiple of the device granularity {granularity}",
                    self.page_size
                ),
            });
        }
        if self.va_size % granularity != 0 {
            return Err(PoolError::InvalidConfig {
                reason: format!(
                    "va_size {} is not a multiple of the device granularity {granularity}",
                    self.va_size
                ),
            });
        }
        Ok(())
    }
}
