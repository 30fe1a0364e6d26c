//! tidepool's `MemPool` as a [`ReplayAllocator`], on any device backend.

use super::allocators::Streams;
use super::lag::LagClock;
use super::run::{AllocError, ReplayAllocator, ReplayError};
use super::timed::{DriverStat, Timed};
use std::sync::Arc;
use tidepool::{Allocation, MemPool, PoolConfig, PoolError};
use tidepool_sys::Device;

/// A tidepool pool with the default configuration, one device stream per
/// trace stream; tidepool's reserved-high statistic as peak reserved. The
/// pool's device is wrapped in [`Timed`], so each pass reports the driver
/// calls the pool made and the time spent in them. With a [`LagClock`]
/// (for a device wrapped in [`super::lag::Lagged`]), each trace operation
/// ticks the clock before it reaches the pool.
pub struct TidepoolAlloc<D: Device> {
    // Field order: the pool is dropped before the streams.
    pool: MemPool<Timed<D>>,
    streams: Streams<Timed<D>>,
    device: Arc<Timed<D>>,
    clock: Option<Arc<LagClock>>,
}

impl<D: Device> TidepoolAlloc<D> {
    pub fn new(device: Arc<D>, trace_streams: usize) -> Result<Self, ReplayError> {
        Self::with_config(device, trace_streams, PoolConfig::default())
    }

    pub fn with_config(
        device: Arc<D>,
        trace_streams: usize,
        config: PoolConfig,
    ) -> Result<Self, ReplayError> {
        let device = Arc::new(Timed::new(device));
        let streams = Streams::new(device.clone(), trace_streams)?;
        let pool = MemPool::new(device.clone(), config)
            .map_err(|e| ReplayError(format!("creating a tidepool pool: {e}")))?;
        Ok(TidepoolAlloc {
            pool,
            streams,
            device,
            clock: None,
        })
    }

    /// [`Self::with_config`], ticking `clock` once per trace operation
    /// (the clock of the [`super::lag::Lagged`] device `device` is).
    pub fn with_lag_clock(
        device: Arc<D>,
        trace_streams: usize,
        config: PoolConfig,
        clock: Arc<LagClock>,
    ) -> Result<Self, ReplayError> {
        let mut a = Self::with_config(device, trace_streams, config)?;
        a.clock = Some(clock);
        Ok(a)
    }

    #[inline]
    fn tick(&self, stream: usize) {
        if let Some(c) = &self.clock {
            c.tick(self.streams.streams[stream]);
        }
    }

    /// The pool, for statistics beyond the replay's.
    pub fn pool(&self) -> &MemPool<Timed<D>> {
        &self.pool
    }

    /// The pool's device: the wrapper that counts and times its calls.
    pub fn device(&self) -> &Arc<Timed<D>> {
        &self.device
    }

    /// The device streams, one per trace stream (index = the trace's dense
    /// stream index).
    pub fn streams(&self) -> &[tidepool_sys::Stream] {
        &self.streams.streams
    }
}

fn pool_err(what: &'static str) -> impl Fn(PoolError) -> ReplayError {
    move |e| ReplayError(format!("tidepool: {what}: {e}"))
}

impl<D: Device> ReplayAllocator for TidepoolAlloc<D> {
    type Handle = Allocation;

    fn name(&self) -> &'static str {
        "tidepool"
    }

    #[inline]
    fn alloc(&mut self, size: usize, stream: usize) -> Result<Allocation, AllocError> {
        self.tick(stream);
        self.pool
            .alloc_async(size, self.streams.streams[stream])
            .map_err(|e| {
                // A request larger than the pool's address space can never
                // be served: the driver's pool answers it with out-of-memory
                // too, so it is counted as one rather than stopping the run.
                if e.is_out_of_memory() || matches!(e, PoolError::TooLarge { .. }) {
                    AllocError::OutOfMemory
                } else {
                    AllocError::Failed(e.to_string())
                }
            })
    }

    #[inline]
    fn free(&mut self, a: Allocation, stream: usize) -> Result<(), ReplayError> {
        self.tick(stream);
        self.pool
            .free_async(a, self.streams.streams[stream])
            .map_err(|e| ReplayError(format!("tidepool: free_async: {}", e.error)))
    }

    /// Through the pool (`record_event` on `from`, `wait_event` on
    /// `stream`), so that the pool follows the dependency: what `from`
    /// freed before the event becomes reusable on `stream`.
    #[inline]
    fn wait(&mut self, from: usize, stream: usize) -> Result<(), ReplayError> {
        self.tick(stream);
        let event = self
            .pool
            .record_event(self.streams.streams[from])
            .map_err(pool_err("record_event"))?;
        self.pool
            .wait_event(self.streams.streams[stream], &event)
            .map_err(pool_err("wait_event"))
    }

    fn reserved_high(&self) -> Result<u64, ReplayError> {
        Ok(self.pool.stats().reserved_high)
    }

    fn reserved_now(&self) -> Result<u64, ReplayError> {
        Ok(self.pool.stats().reserved_current)
    }

    fn reset_high(&mut self) -> Result<(), ReplayError> {
        self.pool.reset_peaks();
        Ok(())
    }

    fn synchronize(&mut self) -> Result<(), ReplayError> {
        self.pool.synchronize().map_err(pool_err("synchronize"))?;
        self.streams.synchronize()
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        let s = self.pool.stats();
        let (moves, unsafe_unmaps) = self.pool.pending_move_counts();
        vec![
            ("remaps", s.remaps),
            ("rebinds", s.rebinds),
            ("growths", s.growths),
            ("cache_hits", s.cache_hits),
            ("pending_moves", moves),
            ("pending_unmaps", unsafe_unmaps),
        ]
    }

    fn driver_stats(&self) -> Vec<(&'static str, DriverStat)> {
        self.device
            .stats()
            .into_iter()
            .map(|(op, stat)| (op.name(), stat))
            .collect()
    }
}
