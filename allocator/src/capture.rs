//! CUDA graph capture, the pool's side: what an allocation, a free or a
//! declared use does when its stream is being captured into a graph.
//!
//! A capture records work instead of running it; every launch of the
//! graph runs it again, at times the pool does not see (a launch is not an
//! event the pool records). So the pool never hands one of its own blocks
//! to a capture: memory allocated on a capturing stream is *graph memory*,
//! an allocation node of the driver's (`Device::graph_alloc`), whose
//! lifetime the driver ties to the graph's launches; its free inside the
//! capture is a free node (`Device::graph_free`). What the pool cannot make
//! safe it refuses with a typed error that says what to do instead:
//!
//! - a pool block freed inside a capture ([`PoolError::EagerFreeInCapture`]):
//!   the free would have to take effect at each launch;
//! - a pool block declared in use on a capturing stream
//!   ([`PoolError::CapturedUse`]): its free must wait for the graph's last
//!   launch, which only the caller knows (`MemPool::free_after_graph`);
//! - a capture already invalidated by a refused call
//!   ([`PoolError::StreamCapturing`]): nothing may be added to it.
//!
//! Two ways of detecting a capture: *strict* (the default,
//! `PoolConfig::check_capture`): every allocation and free asks the device
//! for the stream's capture status (one lock-free driver call); *announced*
//! (`check_capture` off): the caller brackets its captures with
//! `MemPool::begin_announced_capture` / `end_announced_capture`, and the
//! fast path reads one relaxed counter, asking the device only while a
//! capture is announced. This module is below the public pool: the pool's
//! calls use its decisions, and `capture_api` builds the public calls on
//! the pool.

use crate::error::PoolError;
use tidepool_sys::{CaptureStatus, Device, DevicePtr, Stream};

/// What an allocation has to do with graph capture.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum CaptureTag {
    /// A block of the pool, never used by captured work the pool knows of.
    #[default]
    Eager,
    /// Graph memory: an allocation node of the capture with this id. Its
    /// address is outside the pool's range; the driver's graph memory pool
    /// backs it.
    Graph {
        /// The capture that allocated it.
        capture: u64,
    },
    /// A block of the pool declared in use ([`MemPool::record_use`]) on a
    /// stream while that stream was being captured: every launch of that
    /// graph may touch it.
    ///
    /// [`MemPool::record_use`]: crate::MemPool::record_use
    UsedInCapture {
        /// The capturing stream of the declaration.
        stream: Stream,
    },
}

/// What an allocation on `stream` becomes, from its capture status.
pub(crate) enum AllocRoute {
    /// Not capturing: the pool serves it.
    Pool,
    /// Capturing (capture id): graph memory.
    Graph(u64),
}

/// Decide how to serve an allocation on `stream`: `Pool` when the stream
/// runs its work, `Graph` during a valid capture, an error when the
/// capture was invalidated (adding a node to it could hide the cause).
#[inline]
pub(crate) fn alloc_route<D: Device + ?Sized>(
    device: &D,
    stream: Stream,
) -> Result<AllocRoute, PoolError> {
    match capturing(device, stream)? {
        CaptureStatus::None => Ok(AllocRoute::Pool),
        CaptureStatus::Active { id } => Ok(AllocRoute::Graph(id)),
        CaptureStatus::Invalidated { .. } => Err(PoolError::StreamCapturing { stream }),
    }
}

/// The stream's capture status, asked the cheap way first: the plain
/// capture query (the one call of a stream that is not capturing, as
/// before capture was served), then, only when it says yes, the status
/// with the capture's id. A stream the driver will not describe (the
/// legacy stream while another stream captures in global mode) is
/// refused as capturing.
#[inline]
fn capturing<D: Device + ?Sized>(device: &D, stream: Stream) -> Result<CaptureStatus, PoolError> {
    if !device.is_capturing(stream)? {
        return Ok(CaptureStatus::None);
    }
    device
        .capture_status(stream)
        .map_err(|_| PoolError::StreamCapturing { stream })
}

/// An allocation node of `len` bytes on the capturing `stream`.
#[cold]
pub(crate) fn graph_alloc<D: Device + ?Sized>(
    device: &D,
    stream: Stream,
    len: usize,
    capture: u64,
) -> Result<DevicePtr, PoolError> {
    let ptr = device.graph_alloc(stream, len)?;
    tracing::trace!(stream = stream.id(), len, capture, ptr, "graph alloc node");
    Ok(ptr)
}

/// Free graph memory on `stream`: a free node inside a capture, a
/// stream-ordered free of the memory a launch left live outside one. The
/// driver checks the rest (freeing what no launch left live fails there).
#[cold]
pub(crate) fn graph_free<D: Device + ?Sized>(
    device: &D,
    stream: Stream,
    ptr: DevicePtr,
) -> Result<(), PoolError> {
    device.graph_free(stream, ptr)?;
    tracing::trace!(stream = stream.id(), ptr, "graph free");
    Ok(())
}

/// May a block of the pool be freed on `stream` now? Refused inside a
/// valid capture ([`PoolError::EagerFreeInCapture`]) and on an invalidated
/// one ([`PoolError::StreamCapturing`]). Refusing touches nothing, so the
/// user's capture stays valid.
#[inline]
pub(crate) fn check_eager_free<D: Device + ?Sized>(
    device: &D,
    stream: Stream,
) -> Result<(), PoolError> {
    match capturing(device, stream)? {
        CaptureStatus::None => Ok(()),
        CaptureStatus::Active { .. } => Err(PoolError::EagerFreeInCapture { stream }),
        CaptureStatus::Invalidated { .. } => Err(PoolError::StreamCapturing { stream }),
    }
}

/// The declared uses of a pool block before its free: refused when the
/// block was declared in use inside a capture, or when a stream it was
/// declared on is being captured now (recording an event there for the
/// free to wait on would put the event into the graph, and a stream
/// outside the capture that waited on it would be pulled into the
/// capture).
#[cold]
pub(crate) fn check_uses<D: Device + ?Sized>(
    device: &D,
    tag: CaptureTag,
    uses: &[Stream],
    free_stream: Stream,
    query: bool,
) -> Result<(), PoolError> {
    if let CaptureTag::UsedInCapture { stream } = tag {
        return Err(PoolError::CapturedUse { stream });
    }
    if !query {
        return Ok(());
    }
    for &user in uses {
        // A stream whose status cannot be learned (destroyed since) is
        // left to the free's own handling of such streams.
        if user != free_stream
            && matches!(
                device.capture_status(user),
                Ok(CaptureStatus::Active { .. } | CaptureStatus::Invalidated { .. })
            )
        {
            return Err(PoolError::CapturedUse { stream: user });
        }
    }
    Ok(())
}

/// The tag of a pool block after `record_use(allocation, stream)`: in use
/// inside a capture when `stream` is capturing (valid or invalidated); a
/// stream whose status cannot be learned (destroyed, another device's) is
/// left to the free, which handles such streams.
pub(crate) fn tag_after_use<D: Device + ?Sized>(
    device: &D,
    tag: CaptureTag,
    stream: Stream,
) -> CaptureTag {
    match (tag, device.capture_status(stream)) {
        (
            CaptureTag::Eager,
            Ok(CaptureStatus::Active { .. } | CaptureStatus::Invalidated { .. }),
        ) => CaptureTag::UsedInCapture { stream },
        (other, _) => other,
    }
}
