//! The public calls of graph capture, built on the public pool (the
//! announced-mode calls are beside the fast path in `pool.rs`): the free of a block that captured work used, and the free of
//! graph memory that a launch left live. The rules behind them are in
//! `capture.rs` (and, for users, `docs/capture.md`).

use crate::capture::CaptureTag;
use crate::error::PoolError;
use crate::pool::{Allocation, FreeError, MemPool};
use tidepool_sys::{Device, Stream};

impl<D: Device> MemPool<D> {
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
        let tag = allocation.capture();
        if let CaptureTag::UsedInCapture { .. } = tag {
            allocation.set_capture(CaptureTag::Eager);
        }
        self.free_async(allocation, stream).map_err(|mut e| {
            e.allocation.set_capture(tag);
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
