//! [`Timed`]: a device wrapper that counts the driver calls an allocator
//! makes and sums the wall time spent in each kind, so a replay can say
//! how much of a pass is the driver and how much the allocator's own CPU.
//!
//! Every method forwards to the wrapped device. The calls timed are the
//! ones with a cost of their own in the driver: the memory calls (create,
//! map, set access, unmap, release, and the reservation of address space),
//! the event calls and the stream queries. One `Instant::now()` pair per
//! timed call, two relaxed atomic additions; nothing else is added, and
//! the wrapper changes no answer, so an allocator behaves the same with it
//! as without. [`Device::stream_probe`] is forwarded (the probe answers
//! from the wrapped device, untimed): it is one atomic load per question on
//! both backends, not a driver call.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tidepool_sys::{
    AccessDesc, CaptureStatus, Device, DevicePtr, Event, HostTask, MemInfo, Physical,
    PhysicalOptions, Stream, StreamProbe, SysResult,
};

/// The kinds of driver call [`Timed`] counts, in report order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DriverOp {
    /// `create_physical` (`cuMemCreate`).
    Create,
    /// `map` (`cuMemMap`).
    Map,
    /// `set_access` (`cuMemSetAccess`).
    SetAccess,
    /// `unmap` (`cuMemUnmap`).
    Unmap,
    /// `release_physical` (`cuMemRelease`).
    Release,
    /// `reserve_va` and `free_va` (`cuMemAddressReserve` / `Free`).
    Va,
    /// `create_event` and `destroy_event`.
    EventLife,
    /// `record_event` (`cuEventRecord`).
    Record,
    /// `query_event` (`cuEventQuery`).
    Query,
    /// `wait_event` (`cuStreamWaitEvent`).
    Wait,
    /// Synchronisation: `synchronize_stream`, `synchronize_event`,
    /// `synchronize_device`.
    Sync,
    /// Stream questions asked of the device (not through a probe):
    /// `query_stream`, `is_capturing`, `capture_status`, `check_stream`.
    StreamQuery,
    /// `mem_info` (`cuMemGetInfo`).
    MemInfo,
}

impl DriverOp {
    /// Every kind, in report order.
    pub const ALL: [DriverOp; 13] = [
        DriverOp::Create,
        DriverOp::Map,
        DriverOp::SetAccess,
        DriverOp::Unmap,
        DriverOp::Release,
        DriverOp::Va,
        DriverOp::EventLife,
        DriverOp::Record,
        DriverOp::Query,
        DriverOp::Wait,
        DriverOp::Sync,
        DriverOp::StreamQuery,
        DriverOp::MemInfo,
    ];

    /// The name in reports (a JSON key of `driver_calls` / `driver_ms`).
    pub fn name(self) -> &'static str {
        match self {
            DriverOp::Create => "create",
            DriverOp::Map => "map",
            DriverOp::SetAccess => "set_access",
            DriverOp::Unmap => "unmap",
            DriverOp::Release => "release",
            DriverOp::Va => "va",
            DriverOp::EventLife => "event_life",
            DriverOp::Record => "record",
            DriverOp::Query => "query",
            DriverOp::Wait => "wait",
            DriverOp::Sync => "sync",
            DriverOp::StreamQuery => "stream_query",
            DriverOp::MemInfo => "mem_info",
        }
    }

    /// The kinds a pool calls for each page it creates, moves or gives
    /// back: always reported, even at zero calls.
    pub fn per_page(self) -> bool {
        matches!(
            self,
            DriverOp::Create
                | DriverOp::Map
                | DriverOp::SetAccess
                | DriverOp::Unmap
                | DriverOp::Release
        )
    }
}

/// Calls of one kind and the wall time spent in them (cumulative).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DriverStat {
    pub calls: u64,
    pub nanos: u64,
}

#[derive(Default)]
struct Slot {
    calls: AtomicU64,
    nanos: AtomicU64,
}

/// A device that forwards every call to `D` and counts and times the
/// driver calls (see the module documentation).
pub struct Timed<D: Device> {
    inner: Arc<D>,
    slots: [Slot; DriverOp::ALL.len()],
}

impl<D: Device> Timed<D> {
    pub fn new(inner: Arc<D>) -> Self {
        Timed {
            inner,
            slots: Default::default(),
        }
    }

    /// The wrapped device.
    pub fn inner(&self) -> &Arc<D> {
        &self.inner
    }

    /// Calls and time of each kind so far, in [`DriverOp::ALL`] order.
    pub fn stats(&self) -> Vec<(DriverOp, DriverStat)> {
        DriverOp::ALL
            .iter()
            .map(|&op| {
                let s = &self.slots[op as usize];
                (
                    op,
                    DriverStat {
                        calls: s.calls.load(Ordering::Relaxed),
                        nanos: s.nanos.load(Ordering::Relaxed),
                    },
                )
            })
            .collect()
    }

    /// The calls of one kind so far.
    pub fn calls(&self, op: DriverOp) -> u64 {
        self.slots[op as usize].calls.load(Ordering::Relaxed)
    }

    #[inline]
    fn time<R>(&self, op: DriverOp, f: impl FnOnce(&D) -> R) -> R {
        let start = Instant::now();
        let r = f(&self.inner);
        let nanos = start.elapsed().as_nanos() as u64;
        let s = &self.slots[op as usize];
        s.calls.fetch_add(1, Ordering::Relaxed);
        s.nanos.fetch_add(nanos, Ordering::Relaxed);
        r
    }
}

impl<D: Device> Device for Timed<D> {
    fn backend_name(&self) -> &'static str {
        self.inner.backend_name()
    }
    fn ordinal(&self) -> i32 {
        self.inner.ordinal()
    }
    fn granularity(&self) -> usize {
        self.inner.granularity()
    }

    fn reserve_va(&self, size: usize, alignment: usize) -> SysResult<DevicePtr> {
        self.time(DriverOp::Va, |d| d.reserve_va(size, alignment))
    }
    fn free_va(&self, ptr: DevicePtr, size: usize) -> SysResult<()> {
        self.time(DriverOp::Va, |d| d.free_va(ptr, size))
    }

    fn create_physical(&self, size: usize, options: PhysicalOptions) -> SysResult<Physical> {
        self.time(DriverOp::Create, |d| d.create_physical(size, options))
    }
    fn release_physical(&self, handle: Physical) -> SysResult<()> {
        self.time(DriverOp::Release, |d| d.release_physical(handle))
    }
    fn map(&self, ptr: DevicePtr, size: usize, handle: Physical, offset: usize) -> SysResult<()> {
        self.time(DriverOp::Map, |d| d.map(ptr, size, handle, offset))
    }
    fn unmap(&self, ptr: DevicePtr, size: usize) -> SysResult<()> {
        self.time(DriverOp::Unmap, |d| d.unmap(ptr, size))
    }
    fn set_access(&self, ptr: DevicePtr, size: usize, access: &[AccessDesc]) -> SysResult<()> {
        self.time(DriverOp::SetAccess, |d| d.set_access(ptr, size, access))
    }
    fn export_fd(&self, handle: Physical) -> SysResult<std::os::fd::OwnedFd> {
        self.inner.export_fd(handle)
    }
    fn import_fd(&self, fd: std::os::fd::OwnedFd, size: usize) -> SysResult<Physical> {
        self.inner.import_fd(fd, size)
    }
    fn mem_info(&self) -> SysResult<MemInfo> {
        self.time(DriverOp::MemInfo, |d| d.mem_info())
    }

    fn create_stream(&self) -> SysResult<Stream> {
        self.inner.create_stream()
    }
    fn destroy_stream(&self, stream: Stream) -> SysResult<()> {
        self.inner.destroy_stream(stream)
    }
    fn default_stream(&self) -> Stream {
        self.inner.default_stream()
    }
    fn adopt_stream(&self, raw: usize) -> SysResult<Stream> {
        self.inner.adopt_stream(raw)
    }
    fn synchronize_stream(&self, stream: Stream) -> SysResult<()> {
        self.time(DriverOp::Sync, |d| d.synchronize_stream(stream))
    }
    fn synchronize_device(&self) -> SysResult<()> {
        self.time(DriverOp::Sync, |d| d.synchronize_device())
    }
    fn query_stream(&self, stream: Stream) -> SysResult<bool> {
        self.time(DriverOp::StreamQuery, |d| d.query_stream(stream))
    }
    fn is_capturing(&self, stream: Stream) -> SysResult<bool> {
        self.time(DriverOp::StreamQuery, |d| d.is_capturing(stream))
    }
    fn stream_probe(&self, stream: Stream) -> SysResult<Option<Arc<dyn StreamProbe>>> {
        self.inner.stream_probe(stream)
    }
    fn check_stream(&self, stream: Stream) -> SysResult<()> {
        self.time(DriverOp::StreamQuery, |d| d.check_stream(stream))
    }

    fn create_event(&self) -> SysResult<Event> {
        self.time(DriverOp::EventLife, |d| d.create_event())
    }
    fn record_event(&self, event: Event, stream: Stream) -> SysResult<()> {
        self.time(DriverOp::Record, |d| d.record_event(event, stream))
    }
    fn query_event(&self, event: Event) -> SysResult<bool> {
        self.time(DriverOp::Query, |d| d.query_event(event))
    }
    fn synchronize_event(&self, event: Event) -> SysResult<()> {
        self.time(DriverOp::Sync, |d| d.synchronize_event(event))
    }
    fn destroy_event(&self, event: Event) -> SysResult<()> {
        self.time(DriverOp::EventLife, |d| d.destroy_event(event))
    }
    fn wait_event(&self, stream: Stream, event: Event) -> SysResult<()> {
        self.time(DriverOp::Wait, |d| d.wait_event(stream, event))
    }
    fn launch_host(&self, stream: Stream, task: HostTask) -> SysResult<()> {
        self.inner.launch_host(stream, task)
    }

    fn capture_status(&self, stream: Stream) -> SysResult<CaptureStatus> {
        self.time(DriverOp::StreamQuery, |d| d.capture_status(stream))
    }

    super::forward_untouched_device_calls!();
}
