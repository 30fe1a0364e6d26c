//! The public calls of graph capture, built on the public pool: announced
//! captures, the free of a block that captured work used, and the free of
//! graph memory that a launch left live. The rules behind them are in
//! `capture.rs` (and, for users, `docs/capture.md`).

use crate::capture::CaptureTag;
use crate::error::PoolError;
use crate::pool::{Allocation, FreeError, MemPool};
use tidepool_sys::{Device, Stream};

impl<D: Device> MemPool<D> {
    /// Announce that the caller is about to capture a stream into a CUDA
    /// graph (call it before the capture begins and before any work is
    /// issued to the stream). Matters in announced mode
    /// ([`PoolConfig::check_capture`](crate::PoolConfig::check_capture)
    /// off): allocations and frees ask the device about capture only while
    /// a capture is announced, and serve the capturing stream as strict
    /// mode does. A capture that is not announced is not seen in that
    /// mode. End it with
    /// [`end_announced_capture`](Self::end_announced_capture).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use tidepool::{MemPool, PoolConfig};
    /// use tidepool_sys::{CaptureMode, Device, host::{HostConfig, HostDevice}};
    ///
    /// let device = Arc::new(HostDevice::with_config(HostConfig { capacity: 64 << 20, ..Default::default() }));
    /// let config = PoolConfig::default().with_va_size(1 << 30).with_check_capture(false);
    /// let pool = MemPool::new(device.clone(), config)?;
    /// let s = device.create_stream()?;
    /// pool.begin_announced_capture(s);
    /// device.begin_capture(s, CaptureMode::Global)?;
    /// let x = pool.alloc_async(4096, s)?;
    /// assert!(x.is_graph_memory());
    /// pool.free_async(x, s)?; // a free node of the graph
    /// let graph = device.end_capture(s)?;
    /// assert!(pool.end_announced_capture(s));
    /// device.destroy_graph(graph)?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn begin_announced_capture(&self, stream: Stream) {
        self.inner.capture.announce();
        tracing::debug!(
            pool = self.inner.id,
            stream = stream.id(),
            "capture announced"
        );
    }

    /// End a capture announced with
    /// [`begin_announced_capture`](Self::begin_announced_capture) (after
    /// the capture ended). False, and nothing changes, when no capture is
    /// announced.
    pub fn end_announced_capture(&self, stream: Stream) -> bool {
        let ended = self.inner.capture.end_announced();
        if !ended {
            tracing::warn!(
                pool = self.inner.id,
                stream = stream.id(),
                "end_announced_capture without a matching begin_announced_capture"
            );
        }
        ended
    }

    /// Captures announced and not yet ended.
    pub fn announced_captures(&self) -> u64 {
        self.inner.capture.announced()
    }

    /// Free a block of the pool that captured work used (declared with
    /// [`record_use`](Self::record_use) on a capturing stream, whose plain
    /// free is refused with [`PoolError::CapturedUse`]).
    ///
    /// The caller states that `stream` is ordered after the last launch of
    /// every graph that uses the block (for instance: the stream the graph
    /// is launched on, after its last launch; or any stream after a
    /// synchronisation with that launch). From then on the block is freed
    /// as by [`free_async`](Self::free_async) on `stream`, with the same
    /// refusals (no free inside a capture). On error the allocation comes
    /// back unchanged.
    pub fn free_after_graph(
        &self,
        mut allocation: Allocation,
        stream: Stream,
    ) -> Result<(), FreeError> {
        let tag = allocation.capture;
        if let CaptureTag::UsedInCapture { .. } = tag {
            allocation.capture = CaptureTag::Eager;
        }
        self.free_async(allocation, stream).map_err(|mut e| {
            e.allocation.capture = tag;
            e
        })
    }

    /// Free, in order on `stream`, the graph memory that the last launch of
    /// its graph left live (the graph allocated it and did not free it),
    /// keeping `allocation` for the next launch, which allocates it again
    /// at the same address. Without it (or instantiation with
    /// auto-free-on-launch) the next launch fails. The last such memory is
    /// freed with [`free_async`](Self::free_async), which consumes the
    /// allocation. Refused with [`PoolError::NotGraphMemory`] for a block
    /// of the pool.
    pub fn free_launch_leftover(
        &self,
        allocation: &Allocation,
        stream: Stream,
    ) -> Result<(), PoolError> {
        if allocation.pool != self.inner.id {
            return Err(PoolError::WrongPool {
                ptr: allocation.ptr,
            });
        }
        if !allocation.is_graph_memory() {
            return Err(PoolError::NotGraphMemory {
                ptr: allocation.ptr,
            });
        }
        crate::capture::graph_free(&*self.inner.device, stream, allocation.ptr)
    }
}
