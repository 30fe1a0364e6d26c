//! Contract test of graph capture: the pool never records an event on, nor
//! synchronises, a stream that is being captured (either would break the
//! user's capture on CUDA). A watching device wraps the host backend and
//! notes every such call.

mod common;

use common::*;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};
use tidepool_sys::{
    AccessDesc, Device, DevicePtr, Event, HostDevice, HostTask, MemInfo, Physical, PhysicalOptions,
    Stream, SysResult,
};

struct Watch {
    inner: HostDevice,
    violations: Mutex<Vec<String>>,
}

impl Watch {
    fn check(&self, what: &str, s: Stream) {
        if self.inner.is_capturing(s).unwrap_or(false) {
            self.violations
                .lock()
                .unwrap()
                .push(format!("{what} on capturing {s}"));
        }
    }
    fn violations(&self) -> Vec<String> {
        self.violations.lock().unwrap().clone()
    }
}

impl Device for Watch {
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
    fn export_fd(&self, handle: Physical) -> SysResult<OwnedFd> {
        self.inner.export_fd(handle)
    }
    fn import_fd(&self, fd: OwnedFd, size: usize) -> SysResult<Physical> {
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
        self.check("synchronize_stream", stream);
        self.inner.synchronize_stream(stream)
    }
    fn synchronize_device(&self) -> SysResult<()> {
        self.inner.synchronize_device()
    }
    fn query_stream(&self, stream: Stream) -> SysResult<bool> {
        self.check("query_stream", stream);
        self.inner.query_stream(stream)
    }
    fn is_capturing(&self, stream: Stream) -> SysResult<bool> {
        self.inner.is_capturing(stream)
    }
    fn stream_probe(
        &self,
        stream: Stream,
    ) -> SysResult<Option<std::sync::Arc<dyn tidepool_sys::StreamProbe>>> {
        self.inner.stream_probe(stream)
    }
    fn create_event(&self) -> SysResult<Event> {
        self.inner.create_event()
    }
    fn record_event(&self, event: Event, stream: Stream) -> SysResult<()> {
        self.check("record_event", stream);
        self.inner.record_event(event, stream)
    }
    fn query_event(&self, event: Event) -> SysResult<bool> {
        self.inner.query_event(event)
    }
    fn synchronize_event(&self, event: Event) -> SysResult<()> {
        self.inner.synchronize_event(event)
    }
    fn destroy_event(&self, event: Event) -> SysResult<()> {
        self.inner.destroy_event(event)
    }
    fn wait_event(&self, stream: Stream, event: Event) -> SysResult<()> {
        self.inner.wait_event(stream, event)
    }
    fn launch_host(&self, stream: Stream, task: HostTask) -> SysResult<()> {
        self.inner.launch_host(stream, task)
    }

    fn capture_status(&self, stream: Stream) -> SysResult<tidepool_sys::CaptureStatus> {
        self.inner.capture_status(stream)
    }
    fn graph_alloc(&self, stream: Stream, size: usize) -> SysResult<tidepool_sys::DevicePtr> {
        self.inner.graph_alloc(stream, size)
    }
    fn graph_free(&self, stream: Stream, ptr: tidepool_sys::DevicePtr) -> SysResult<()> {
        self.inner.graph_free(stream, ptr)
    }
    fn begin_capture(&self, stream: Stream, mode: tidepool_sys::CaptureMode) -> SysResult<()> {
        self.inner.begin_capture(stream, mode)
    }
    fn end_capture(&self, stream: Stream) -> SysResult<tidepool_sys::Graph> {
        self.inner.end_capture(stream)
    }
    fn instantiate_graph(
        &self,
        graph: tidepool_sys::Graph,
        options: tidepool_sys::GraphOptions,
    ) -> SysResult<tidepool_sys::GraphExec> {
        self.inner.instantiate_graph(graph, options)
    }
    fn launch_graph(&self, exec: tidepool_sys::GraphExec, stream: Stream) -> SysResult<()> {
        self.inner.launch_graph(exec, stream)
    }
    fn destroy_graph(&self, graph: tidepool_sys::Graph) -> SysResult<()> {
        self.inner.destroy_graph(graph)
    }
    fn destroy_graph_exec(&self, exec: tidepool_sys::GraphExec) -> SysResult<()> {
        self.inner.destroy_graph_exec(exec)
    }
}

fn watch() -> Arc<Watch> {
    Arc::new(Watch {
        inner: host(),
        violations: Mutex::new(Vec::new()),
    })
}

/// Rule: while S is captured, other streams' allocations (which look for
/// completed frees everywhere, including S's), trims, internal
/// dependencies and stream synchronisations never record an event on S
/// nor synchronise it.
/// Catches: `observe_completions` / `take_with_dependency` / trim without
/// their capture checks.
#[test]
fn pool_never_touches_a_capturing_stream() {
    let dev = watch();
    let pool = pool(&dev, config().with_max_size(4 * PAGE as u64));
    let s = streams(&*dev, 2);
    let (cap, t) = (s[0], s[1]);
    // Frees on `cap` whose epoch is still open (no event recorded yet).
    let xs: Vec<_> = (0..4)
        .map(|_| pool.alloc_async(PAGE, cap).unwrap())
        .collect();
    for x in xs {
        pool.free_async(x, cap).unwrap();
    }
    dev.inner.set_capturing(cap, true);
    // Capped and everything pending on `cap`: every step of the order runs.
    let r = pool.alloc_async(PAGE, t);
    pool.trim_to(0).unwrap();
    pool.synchronize_stream(t).unwrap();
    assert_eq!(dev.violations(), Vec::<String>::new());
    dev.inner.set_capturing(cap, false);
    if let Ok(a) = r {
        pool.free_async(a, t).unwrap();
    }
}

/// Rule: the same for a whole-pool synchronisation.
#[test]
fn pool_synchronize_skips_a_capturing_stream() {
    let dev = watch();
    let pool = pool(&dev, config());
    let s = streams(&*dev, 2);
    let x = pool.alloc_async(PAGE, s[0]).unwrap();
    pool.free_async(x, s[0]).unwrap();
    let y = pool.alloc_async(PAGE, s[1]).unwrap();
    pool.free_async(y, s[1]).unwrap();
    dev.inner.set_capturing(s[0], true);
    let _ = pool.synchronize();
    assert_eq!(dev.violations(), Vec::<String>::new());
    dev.inner.set_capturing(s[0], false);
}

/// Rule: serving a capturing stream (graph memory in, free nodes out, a
/// refused eager free, a refused free whose declared use is on the
/// capturing stream) never records an event on it nor synchronises it,
/// and leaves the capture valid.
/// Catches: a free that records its declared uses' events before checking
/// their capture state; an eager free inside a capture taken as a free.
#[test]
fn serving_a_capture_never_touches_the_capturing_stream() {
    use tidepool::PoolError;
    use tidepool_sys::{CaptureMode, CaptureStatus};
    let dev = watch();
    let pool = pool(&dev, config());
    let s = streams(&*dev, 2);
    let (cap, t) = (s[0], s[1]);
    let eager = pool.alloc_async(PAGE, cap).unwrap();
    let mut used = pool.alloc_async(PAGE, t).unwrap();
    pool.record_use(&mut used, cap);
    dev.begin_capture(cap, CaptureMode::Global).unwrap();
    let g = pool.alloc_async(PAGE, cap).unwrap();
    assert!(g.is_graph_memory());
    pool.free_async(g, cap).unwrap();
    let failed = pool.free_async(eager, cap).unwrap_err();
    assert_eq!(failed.error, PoolError::EagerFreeInCapture { stream: cap });
    let eager = failed.allocation;
    let failed = pool.free_async(used, t).unwrap_err();
    assert_eq!(failed.error, PoolError::CapturedUse { stream: cap });
    let used = failed.allocation;
    assert_eq!(dev.violations(), Vec::<String>::new());
    assert!(matches!(
        dev.capture_status(cap).unwrap(),
        CaptureStatus::Active { .. }
    ));
    let graph = dev.end_capture(cap).unwrap();
    dev.destroy_graph(graph).unwrap();
    pool.free_async(eager, cap).unwrap();
    pool.free_async(used, t).unwrap();
    assert_eq!(pool.stats().used_current, 0);
}

/// Rule: graph memory is not the pool's, so it cannot be exported (its
/// address is outside the pool's range: an export would read the books of
/// pages it does not have).
#[test]
fn graph_memory_is_not_exportable() {
    use tidepool::PoolError;
    use tidepool_sys::CaptureMode;
    let dev = watch();
    let pool = pool(&dev, config().with_exportable(true));
    let s = streams(&*dev, 1)[0];
    dev.begin_capture(s, CaptureMode::Global).unwrap();
    let g = pool.alloc_async(PAGE, s).unwrap();
    assert!(g.is_graph_memory());
    match pool.export(&g) {
        Err(PoolError::NotExportable { reason }) => assert!(reason.contains("graph memory")),
        other => panic!("export of graph memory: {other:?}"),
    }
    pool.free_async(g, s).unwrap();
    let graph = dev.end_capture(s).unwrap();
    dev.destroy_graph(graph).unwrap();
}
