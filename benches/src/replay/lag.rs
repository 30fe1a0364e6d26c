//! [`Lagged`]: a device wrapper under which the device's work completes a
//! fixed number of trace operations after it was issued, so that a replay
//! on the host backend sees frees pending for a while, as a GPU running
//! real kernels shows them.
//!
//! A replay issues no kernels: on the host backend every stream is idle,
//! and every event complete, as soon as it is asked. A pool then never
//! sees a free of another stream still pending, nor a page it cannot move
//! because the work before its free is still running. With a lag of `N`
//! operations, the wrapper answers "not done" to an event query until `N`
//! more trace operations have been issued after the event's record, and to
//! a stream query until `N` more have been issued after the stream's last
//! operation or event record. A host wait (`synchronize_event`,
//! `synchronize_stream`, `synchronize_device`) makes what it waited for
//! done at once, as on a GPU. Every answer is also the wrapped device's:
//! the wrapper only ever turns a "done" into "not done", which is always
//! safe for a pool (it waits or grows; it never reuses too early).
//!
//! The clock is a count of trace operations ([`LagClock::tick`], called
//! by the replayer's allocator once per operation), never time: the same
//! trace and lag give the same answers on any machine. With a lag of 0
//! every answer is the wrapped device's.
//!
//! A pool that polls an event in a loop on the host, with no trace
//! operation issued meanwhile (tidepool's last-resort wait under a tight
//! `--capacity`), sees it stay pending until that wait's own deadline.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use tidepool_sys::{
    AccessDesc, CaptureStatus, Device, DevicePtr, Event, HostTask, MemInfo, Physical,
    PhysicalOptions, Stream, StreamProbe, SysResult,
};

/// The replay's clock: trace operations issued so far, and the last
/// operation issued on each stream.
#[derive(Debug, Default)]
pub struct LagClock {
    now: AtomicU64,
    last: Mutex<HashMap<u64, u64>>,
}

impl LagClock {
    pub fn new() -> Self {
        Self::default()
    }

    /// One trace operation issued on `stream`: the clock moves on by one
    /// and the stream's last operation is this one.
    pub fn tick(&self, stream: Stream) {
        let now = self.now.fetch_add(1, Ordering::Relaxed) + 1;
        lock(&self.last).insert(stream.id(), now);
    }

    /// Trace operations issued so far.
    pub fn now(&self) -> u64 {
        self.now.load(Ordering::Relaxed)
    }

    fn last_on(&self, stream: Stream) -> u64 {
        lock(&self.last).get(&stream.id()).copied().unwrap_or(0)
    }

    /// `stream`'s later work waits for work issued up to `at` elsewhere.
    fn extend(&self, stream: Stream, at: u64) {
        let mut last = lock(&self.last);
        let e = last.entry(stream.id()).or_insert(0);
        *e = (*e).max(at);
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What host waits have made done, in clock values.
#[derive(Default)]
struct Waited {
    /// Events recorded and not destroyed: (stream, clock at the record).
    events: HashMap<u64, (u64, u64)>,
    /// Per stream: its work issued up to this clock value is done.
    synced: HashMap<u64, u64>,
    /// Every stream's work issued up to this clock value is done.
    device: u64,
}

impl Waited {
    fn done_before(&self, stream: u64) -> u64 {
        self.synced
            .get(&stream)
            .copied()
            .unwrap_or(0)
            .max(self.device)
    }
}

/// A device that forwards every call to `D` and holds back completion by
/// a lag counted in trace operations (see the module documentation).
pub struct Lagged<D: Device> {
    inner: Arc<D>,
    clock: Arc<LagClock>,
    lag: u64,
    waited: Mutex<Waited>,
}

impl<D: Device> Lagged<D> {
    /// `inner`, with its work completing `lag` operations of `clock` after
    /// it was issued.
    pub fn new(inner: Arc<D>, clock: Arc<LagClock>, lag: u64) -> Self {
        Lagged {
            inner,
            clock,
            lag,
            waited: Mutex::new(Waited::default()),
        }
    }

    /// The wrapped device.
    pub fn inner(&self) -> &Arc<D> {
        &self.inner
    }

    /// The clock the lag counts on.
    pub fn clock(&self) -> &Arc<LagClock> {
        &self.clock
    }

    /// Whether work issued on `stream` up to clock value `at` is done by
    /// the lag's rule (the wrapped device's answer aside).
    fn lag_done(&self, w: &Waited, stream: u64, at: u64) -> bool {
        at.saturating_add(self.lag) <= self.clock.now() || at <= w.done_before(stream)
    }
}

impl<D: Device> Device for Lagged<D> {
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
        self.inner.reserve_va(size, alignment)
    }
    fn free_va(&self, ptr: DevicePtr, size: usize) -> SysResult<()> {
        self.inner.free_va(ptr, size)
    }
    fn create_physical(&self, size: usize, options: PhysicalOptions) -> SysResult<Physical> {
        self.inner.create_physical(size, options)
    }
    fn release_physical(&self, handle: Physical) -> SysResult<()> {
        self.inner.release_physical(handle)
    }
    fn map(&self, ptr: DevicePtr, size: usize, handle: Physical, offset: usize) -> SysResult<()> {
        self.inner.map(ptr, size, handle, offset)
    }
    fn unmap(&self, ptr: DevicePtr, size: usize) -> SysResult<()> {
        self.inner.unmap(ptr, size)
    }
    fn set_access(&self, ptr: DevicePtr, size: usize, access: &[AccessDesc]) -> SysResult<()> {
        self.inner.set_access(ptr, size, access)
    }
    fn export_fd(&self, handle: Physical) -> SysResult<std::os::fd::OwnedFd> {
        self.inner.export_fd(handle)
    }
    fn import_fd(&self, fd: std::os::fd::OwnedFd, size: usize) -> SysResult<Physical> {
        self.inner.import_fd(fd, size)
    }
    fn mem_info(&self) -> SysResult<MemInfo> {
        self.inner.mem_info()
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
        self.inner.synchronize_stream(stream)?;
        let now = self.clock.now();
        let mut w = lock(&self.waited);
        let e = w.synced.entry(stream.id()).or_insert(0);
        *e = (*e).max(now);
        Ok(())
    }
    fn synchronize_device(&self) -> SysResult<()> {
        self.inner.synchronize_device()?;
        let now = self.clock.now();
        let mut w = lock(&self.waited);
        w.device = w.device.max(now);
        Ok(())
    }
    fn query_stream(&self, stream: Stream) -> SysResult<bool> {
        if !self.inner.query_stream(stream)? {
            return Ok(false);
        }
        let at = self.clock.last_on(stream);
        Ok(self.lag_done(&lock(&self.waited), stream.id(), at))
    }
    fn is_capturing(&self, stream: Stream) -> SysResult<bool> {
        self.inner.is_capturing(stream)
    }
    // A probe answers capture and liveness only, never completion: the
    // wrapped device's may be handed out as it is.
    fn stream_probe(&self, stream: Stream) -> SysResult<Option<Arc<dyn StreamProbe>>> {
        self.inner.stream_probe(stream)
    }
    fn check_stream(&self, stream: Stream) -> SysResult<()> {
        self.inner.check_stream(stream)
    }

    fn create_event(&self) -> SysResult<Event> {
        self.inner.create_event()
    }
    fn record_event(&self, event: Event, stream: Stream) -> SysResult<()> {
        self.inner.record_event(event, stream)?;
        let now = self.clock.now();
        lock(&self.waited)
            .events
            .insert(event.id(), (stream.id(), now));
        // A record is work of the stream: the stream is idle no earlier
        // than its event is done (on a GPU an idle stream has no pending
        // event).
        self.clock.extend(stream, now);
        Ok(())
    }
    fn query_event(&self, event: Event) -> SysResult<bool> {
        if !self.inner.query_event(event)? {
            return Ok(false);
        }
        let w = lock(&self.waited);
        Ok(match w.events.get(&event.id()) {
            Some(&(stream, at)) => self.lag_done(&w, stream, at),
            None => true,
        })
    }
    fn synchronize_event(&self, event: Event) -> SysResult<()> {
        self.inner.synchronize_event(event)?;
        let mut w = lock(&self.waited);
        if let Some(&(stream, at)) = w.events.get(&event.id()) {
            // The stream's work up to the record is done (and with it
            // every earlier record of the stream).
            let e = w.synced.entry(stream).or_insert(0);
            *e = (*e).max(at);
        }
        Ok(())
    }
    fn destroy_event(&self, event: Event) -> SysResult<()> {
        self.inner.destroy_event(event)?;
        lock(&self.waited).events.remove(&event.id());
        Ok(())
    }
    fn wait_event(&self, stream: Stream, event: Event) -> SysResult<()> {
        self.inner.wait_event(stream, event)?;
        let recorded = lock(&self.waited).events.get(&event.id()).copied();
        if let Some((_, at)) = recorded {
            // The stream's later work completes no earlier than the work
            // it now waits for.
            self.clock.extend(stream, at);
        }
        Ok(())
    }
    fn launch_host(&self, stream: Stream, task: HostTask) -> SysResult<()> {
        self.inner.launch_host(stream, task)
    }

    fn capture_status(&self, stream: Stream) -> SysResult<CaptureStatus> {
        self.inner.capture_status(stream)
    }

    super::forward_untouched_device_calls!();
}
