//! Contract test of graph capture: the pool never records an event on, nor
//! synchronises, a stream that is being captured (either would break the
//! user's capture on CUDA). A watching device wraps the host backend and
//! notes every such call.

mod common;

use common::*;
use std::sync::{Arc, Mutex};
use tidepool_sys::{Device, Event, HostDevice, Stream, SysResult};

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

impl common::wrap::Hooks for Watch {
    type Inner = HostDevice;
    fn inner(&self) -> &HostDevice {
        &self.inner
    }
    fn synchronize_stream(&self, stream: Stream) -> SysResult<()> {
        self.check("synchronize_stream", stream);
        self.inner.synchronize_stream(stream)
    }
    fn query_stream(&self, stream: Stream) -> SysResult<bool> {
        self.check("query_stream", stream);
        self.inner.query_stream(stream)
    }
    fn record_event(&self, event: Event, stream: Stream) -> SysResult<()> {
        self.check("record_event", stream);
        self.inner.record_event(event, stream)
    }
}

common::wrap::wrapped_device!(Watch);

fn watch() -> Arc<Watch> {
    Arc::new(Watch {
        inner: host(),
        violations: Mutex::new(Vec::new()),
    })
}

/// The watch itself: a call the rules forbid, made on a capturing stream
/// through the wrapped device, is noted (so the empty lists asserted below
/// mean the pool made none, not that the watch saw nothing).
#[test]
fn the_watch_notes_a_forbidden_call() {
    let dev = watch();
    let s = streams(&*dev, 1)[0];
    let e = dev.create_event().unwrap();
    dev.inner.set_capturing(s, true);
    let _ = dev.record_event(e, s);
    let _ = dev.query_stream(s);
    dev.inner.set_capturing(s, false);
    assert_eq!(dev.violations().len(), 2, "{:?}", dev.violations());
    dev.destroy_event(e).unwrap();
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
