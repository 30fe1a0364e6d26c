//! The pool serving streams that are being captured into CUDA graphs, each
//! body run on the host backend and on CUDA (skipped, with the reason
//! printed, where no CUDA driver is usable; a failure instead when
//! `TIDEPOOL_REQUIRE_GPU=1`).
//!
//! Every capture here is begun with the device's own begin-capture call,
//! never announced to the pool (except in the announced-mode test): strict
//! mode must see it by itself.
#![forbid(unsafe_code)]

use std::sync::{Arc, Mutex, MutexGuard};

use tidepool::{MemPool, PoolConfig, PoolError};
use tidepool_kernels::{TagKernels, WithTagKernels};
use tidepool_sys::cuda::CudaDevice;
use tidepool_sys::host::{HostConfig, HostDevice};
use tidepool_sys::{CaptureMode, CaptureStatus, Device, GraphOptions, Stream};

const LEN: usize = 1 << 20;

fn pool<D: Device>(dev: &Arc<D>, config: PoolConfig) -> MemPool<D> {
    MemPool::new(dev.clone(), config.with_va_size(1 << 30)).unwrap()
}

fn strict<D: Device>(dev: &Arc<D>) -> MemPool<D> {
    pool(dev, PoolConfig::default())
}

fn streams<D: Device>(dev: &D, n: usize) -> Vec<Stream> {
    (0..n).map(|_| dev.create_stream().unwrap()).collect()
}

fn active<D: Device>(dev: &D, s: Stream) -> bool {
    matches!(dev.capture_status(s).unwrap(), CaptureStatus::Active { .. })
}

/// Faults of graph memory nodes the backend counts (host), or none (CUDA:
/// a fault is a sticky error the next synchronisation returns).
type Faults<'a> = &'a dyn Fn() -> u64;

// ---------------------------------------------------------------------------
// bodies

/// A graph that allocates through the pool, writes tags, frees, captured
/// once (raw begin-capture, not announced) and launched 100 times, with
/// the tags verified after each launch, while eager work goes on through
/// the same pool on another stream, during the capture and between
/// launches.
fn graph_replays<D: Device>(dev: &Arc<D>, k: &dyn TagKernels, launches: u32, faults: Faults) {
    const TAGS: [u32; 3] = [0x6A11_0001, 0x6A11_0002, 0x6A11_0003];
    let pool = strict(dev);
    let s = streams(&**dev, 3);
    let (cap, run, eager) = (s[0], s[1], s[2]);
    k.reset_counters().unwrap();
    // Warm the eager stream's memory, so that eager work during the
    // capture needs no growth (no VMM call while a global capture runs).
    let warm: Vec<_> = (0..3)
        .map(|_| pool.alloc_async(LEN, eager).unwrap())
        .collect();
    for w in warm {
        pool.free_async(w, eager).unwrap();
    }
    let e = pool.alloc_async(LEN, eager).unwrap();
    let used_before = pool.stats().used_current;
    let reserved_before = pool.stats().reserved_current;

    dev.begin_capture(cap, CaptureMode::Global).unwrap();
    let a = pool.alloc_async(LEN, cap).unwrap();
    assert!(
        a.is_graph_memory(),
        "an allocation in a capture is graph memory"
    );
    assert!(
        !pool.contains(a.ptr()),
        "the pool's own range went to a graph"
    );
    k.fill_tag(cap, a.ptr(), LEN, TAGS[0]).unwrap();
    let b = pool.alloc_async(LEN, cap).unwrap();
    k.fill_tag(cap, b.ptr(), LEN, TAGS[1]).unwrap();
    // Eager work on another stream, through the same pool, during the capture.
    let x = pool.alloc_async(LEN, eager).unwrap();
    assert!(!x.is_graph_memory() && pool.contains(x.ptr()));
    k.fill_tag(eager, x.ptr(), LEN, 0xEA6E).unwrap();
    k.fill_tag(eager, e.ptr(), LEN, 0xEA6F).unwrap();
    k.verify_tag(eager, x.ptr(), LEN, 0xEA6E).unwrap();
    pool.free_async(x, eager).unwrap();
    k.verify_tag(cap, a.ptr(), LEN, TAGS[0]).unwrap();
    k.verify_tag(cap, b.ptr(), LEN, TAGS[1]).unwrap();
    pool.free_async(a, cap).unwrap(); // a free node
    let c = pool.alloc_async(LEN, cap).unwrap();
    k.fill_tag(cap, c.ptr(), LEN, TAGS[2]).unwrap();
    k.verify_tag(cap, b.ptr(), LEN, TAGS[1]).unwrap();
    k.verify_tag(cap, c.ptr(), LEN, TAGS[2]).unwrap();
    pool.free_async(b, cap).unwrap();
    pool.free_async(c, cap).unwrap();
    assert!(active(&**dev, cap), "the pool broke the capture");
    let graph = dev.end_capture(cap).unwrap();
    // Graph memory is not pool memory.
    assert_eq!(pool.stats().used_current, used_before);
    assert_eq!(pool.stats().reserved_current, reserved_before);
    assert_eq!(k.mismatches().unwrap(), 0, "eager work during the capture");

    let exec = dev
        .instantiate_graph(graph, GraphOptions::default())
        .unwrap();
    for i in 0..launches {
        dev.launch_graph(exec, run).unwrap();
        // Eager work interleaved on another stream, through the pool.
        let y = pool.alloc_async(LEN, eager).unwrap();
        k.fill_tag(eager, y.ptr(), LEN, i).unwrap();
        k.verify_tag(eager, y.ptr(), LEN, i).unwrap();
        k.verify_tag(eager, e.ptr(), LEN, 0xEA6F).unwrap();
        pool.free_async(y, eager).unwrap();
        dev.synchronize_stream(run).unwrap();
        dev.synchronize_stream(eager).unwrap();
        assert_eq!(k.mismatches().unwrap(), 0, "launch {i}: tags corrupted");
        assert_eq!(k.access_faults().unwrap(), 0, "launch {i}: access faults");
        assert_eq!(faults(), 0, "launch {i}: graph memory node failed");
    }
    dev.destroy_graph_exec(exec).unwrap();
    dev.destroy_graph(graph).unwrap();
    pool.free_async(e, eager).unwrap();
    pool.synchronize().unwrap();
    assert_eq!(pool.stats().used_current, 0);
    for s in s {
        pool.retire_stream(s).unwrap();
        dev.destroy_stream(s).unwrap();
    }
}

/// (i) A block of the pool freed inside a capture is refused, the
/// allocation comes back, the capture stays valid and the pool unchanged;
/// after the capture the same block frees normally.
fn eager_free_in_capture<D: Device>(dev: &Arc<D>) {
    let pool = strict(dev);
    let s = streams(&**dev, 1)[0];
    let x = pool.alloc_async(LEN, s).unwrap();
    let addr = x.ptr();
    let before = pool.stats();
    dev.begin_capture(s, CaptureMode::Global).unwrap();
    let failed = pool.free_async(x, s).unwrap_err();
    assert_eq!(failed.error, PoolError::EagerFreeInCapture { stream: s });
    assert!(failed.error.to_string().contains("before begin_capture"));
    assert!(active(&**dev, s), "the refusal broke the capture");
    // The block was not freed: an allocation in the capture cannot get it.
    let g = pool.alloc_async(LEN, s).unwrap();
    assert_ne!(g.ptr(), addr);
    assert!(g.is_graph_memory());
    pool.free_async(g, s).unwrap();
    let graph = dev.end_capture(s).unwrap();
    dev.destroy_graph(graph).unwrap();
    assert_eq!(pool.stats(), before, "a refused free changed the pool");
    let x = failed.allocation;
    assert_eq!(x.ptr(), addr);
    pool.free_async(x, s).unwrap();
    assert_eq!(pool.stats().used_current, 0);
    pool.synchronize().unwrap();
    pool.retire_stream(s).unwrap();
    dev.destroy_stream(s).unwrap();
}

/// (ii) Graph memory the graph leaves live is the caller's after each
/// launch: readable with its tag, freed (outside the capture, in stream
/// order) with `free_launch_leftover` before the next launch, which fails
/// without it, and with `free_async` after the last; the pool never hands
/// its address out.
/// (iii) The same allocation left live, with auto-free-on-launch: each
/// launch frees the previous launch's memory.
fn graph_memory_left_live<D: Device>(dev: &Arc<D>, k: &dyn TagKernels, faults: Faults) {
    const TAG: u32 = 0x11FE_0001;
    let pool = strict(dev);
    let s = streams(&**dev, 2);
    let (cap, run) = (s[0], s[1]);
    k.reset_counters().unwrap();
    dev.begin_capture(cap, CaptureMode::Global).unwrap();
    let g = pool.alloc_async(LEN, cap).unwrap();
    k.fill_tag(cap, g.ptr(), LEN, TAG).unwrap();
    let graph = dev.end_capture(cap).unwrap();
    // A block of the pool is not graph memory.
    let p = pool.alloc_async(LEN, run).unwrap();
    assert_eq!(
        pool.free_launch_leftover(&p, run).unwrap_err(),
        PoolError::NotGraphMemory { ptr: p.ptr() }
    );
    pool.free_async(p, run).unwrap();

    // (iii) with auto-free-on-launch: each launch frees the previous
    // launch's memory, no free in between.
    let auto = dev
        .instantiate_graph(
            graph,
            GraphOptions {
                auto_free_on_launch: true,
            },
        )
        .unwrap();
    for i in 0..5 {
        dev.launch_graph(auto, run).unwrap();
        k.verify_tag(run, g.ptr(), LEN, TAG).unwrap();
        dev.synchronize_stream(run).unwrap();
        assert_eq!(k.mismatches().unwrap(), 0, "auto-free launch {i}");
        assert_eq!(faults(), 0, "auto-free launch {i}");
    }
    // The last launch's memory is live: freed before the graph gets
    // another executable graph.
    pool.free_launch_leftover(&g, run).unwrap();
    dev.synchronize_stream(run).unwrap();
    dev.destroy_graph_exec(auto).unwrap();

    // (ii) without it: freed by the caller between launches.
    let exec = dev
        .instantiate_graph(graph, GraphOptions::default())
        .unwrap();
    for i in 0..5 {
        dev.launch_graph(exec, run).unwrap();
        // Live after the launch: work ordered after it sees the tag.
        k.verify_tag(run, g.ptr(), LEN, TAG).unwrap();
        // Pool allocations meanwhile never get its address.
        let y = pool.alloc_async(LEN, run).unwrap();
        assert_ne!(y.ptr(), g.ptr());
        assert!(pool.contains(y.ptr()) && !pool.contains(g.ptr()));
        k.fill_tag(run, y.ptr(), LEN, i).unwrap();
        k.verify_tag(run, y.ptr(), LEN, i).unwrap();
        pool.free_async(y, run).unwrap();
        if i == 0 {
            assert!(
                dev.launch_graph(exec, run).is_err(),
                "a launch while the previous launch's memory is live must fail"
            );
        }
        if i < 4 {
            pool.free_launch_leftover(&g, run).unwrap();
        }
        dev.synchronize_stream(run).unwrap();
        assert_eq!(k.mismatches().unwrap(), 0, "launch {i}");
        assert_eq!(faults(), 0, "launch {i}");
    }
    let used = pool.stats().used_current;
    pool.free_async(g, run).unwrap(); // the last launch's, for good
    assert_eq!(
        pool.stats().used_current,
        used,
        "graph memory is not pool memory"
    );
    dev.synchronize_stream(run).unwrap();
    dev.destroy_graph_exec(exec).unwrap();
    dev.destroy_graph(graph).unwrap();
    assert_eq!(pool.stats().used_current, 0);
    pool.synchronize().unwrap();
    for s in s {
        pool.retire_stream(s).unwrap();
        dev.destroy_stream(s).unwrap();
    }
}

/// (iv) A block of the pool used by captured work: declared with
/// `record_use` on the capturing stream, its plain free is refused (the
/// pool would hand it to the next allocation on the freeing stream while
/// launches still write it); freed with `free_after_graph` on the launch
/// stream after the last launch. A use declared before the stream began
/// capturing is refused the same way (the free would record an event into
/// the capture), and leaves the capture valid.
fn use_in_capture<D: Device>(dev: &Arc<D>, k: &dyn TagKernels, faults: Faults) {
    const GRAPH_TAG: u32 = 0x05E0_0001;
    let pool = strict(dev);
    let s = streams(&**dev, 3);
    let (cap, run, eager) = (s[0], s[1], s[2]);
    k.reset_counters().unwrap();
    let mut x = pool.alloc_async(LEN, eager).unwrap();
    let addr = x.ptr();
    dev.synchronize_stream(eager).unwrap();
    dev.begin_capture(cap, CaptureMode::Global).unwrap();
    pool.record_use(&mut x, cap);
    k.fill_tag(cap, x.ptr(), LEN, GRAPH_TAG).unwrap();
    let graph = dev.end_capture(cap).unwrap();
    let failed = pool.free_async(x, eager).unwrap_err();
    assert_eq!(failed.error, PoolError::CapturedUse { stream: cap });
    assert!(failed.error.to_string().contains("free_after_graph"));
    let x = failed.allocation;
    let exec = dev
        .instantiate_graph(graph, GraphOptions::default())
        .unwrap();
    for i in 0..3u32 {
        dev.launch_graph(exec, run).unwrap();
        // Eager work on the stream the block came from: never gets it.
        let y = pool.alloc_async(LEN, eager).unwrap();
        assert_ne!(
            y.ptr(),
            addr,
            "launch {i}: a block the graph writes was reused"
        );
        k.fill_tag(eager, y.ptr(), LEN, i).unwrap();
        dev.synchronize_stream(run).unwrap();
        k.verify_tag(eager, y.ptr(), LEN, i).unwrap();
        k.verify_tag(eager, addr, LEN, GRAPH_TAG).unwrap();
        pool.free_async(y, eager).unwrap();
        dev.synchronize_stream(eager).unwrap();
        assert_eq!(k.mismatches().unwrap(), 0, "launch {i}");
        assert_eq!(faults(), 0, "launch {i}");
    }
    // After the last launch, on the launch stream.
    pool.free_after_graph(x, run).unwrap();
    dev.synchronize_stream(run).unwrap();
    dev.destroy_graph_exec(exec).unwrap();
    dev.destroy_graph(graph).unwrap();
    assert_eq!(pool.stats().used_current, 0);

    // A use declared before its stream began capturing.
    let mut z = pool.alloc_async(LEN, eager).unwrap();
    pool.record_use(&mut z, cap);
    dev.begin_capture(cap, CaptureMode::Global).unwrap();
    let failed = pool.free_async(z, eager).unwrap_err();
    assert_eq!(failed.error, PoolError::CapturedUse { stream: cap });
    assert!(active(&**dev, cap), "the refused free broke the capture");
    let graph = dev.end_capture(cap).unwrap();
    dev.destroy_graph(graph).unwrap();
    // The capture is over and the graph gone: a plain free now.
    pool.free_async(failed.allocation, eager).unwrap();
    pool.synchronize().unwrap();
    assert_eq!(pool.stats().used_current, 0);
    for s in s {
        pool.retire_stream(s).unwrap();
        dev.destroy_stream(s).unwrap();
    }
}

/// An invalidated capture gets nothing from the pool (`StreamCapturing`),
/// and the raw-pointer API (the C ABI's) does not serve captures: it
/// refuses, leaving the capture valid.
fn refusals<D: Device>(dev: &Arc<D>) {
    let pool = strict(dev);
    let s = streams(&**dev, 1)[0];
    let x = pool.alloc_async(LEN, s).unwrap();
    let p = pool.alloc_raw(LEN, s).unwrap();
    dev.begin_capture(s, CaptureMode::Global).unwrap();
    assert_eq!(
        pool.alloc_raw(LEN, s).unwrap_err(),
        PoolError::StreamCapturing { stream: s }
    );
    assert_eq!(
        pool.record_use_raw(p, s).unwrap_err(),
        PoolError::StreamCapturing { stream: s }
    );
    assert_eq!(
        pool.free_raw(p, s).unwrap_err(),
        PoolError::EagerFreeInCapture { stream: s }
    );
    assert_eq!(pool.raw_size(p), Some(LEN));
    assert!(active(&**dev, s));
    // Invalidate it (a refused call of the user's).
    assert!(dev.synchronize_stream(s).is_err());
    assert!(matches!(
        dev.capture_status(s).unwrap(),
        CaptureStatus::Invalidated { .. }
    ));
    assert_eq!(
        pool.alloc_async(LEN, s).unwrap_err(),
        PoolError::StreamCapturing { stream: s }
    );
    let failed = pool.free_async(x, s).unwrap_err();
    assert_eq!(failed.error, PoolError::StreamCapturing { stream: s });
    assert!(dev.end_capture(s).is_err());
    pool.free_async(failed.allocation, s).unwrap();
    pool.free_raw(p, s).unwrap();
    pool.synchronize().unwrap();
    assert_eq!(pool.stats().used_current, 0);
    pool.retire_stream(s).unwrap();
    dev.destroy_stream(s).unwrap();
}

/// Announced mode: with the capture check off, an announced capture is
/// served as in strict mode; the announcement count comes back to 0.
fn announced_mode<D: Device>(dev: &Arc<D>) {
    let pool = pool(dev, PoolConfig::default().with_check_capture(false));
    let s = streams(&**dev, 1)[0];
    assert_eq!(pool.announced_captures(), 0);
    pool.begin_announced_capture(s);
    dev.begin_capture(s, CaptureMode::Global).unwrap();
    let g = pool.alloc_async(LEN, s).unwrap();
    assert!(g.is_graph_memory());
    pool.free_async(g, s).unwrap();
    assert!(active(&**dev, s));
    let graph = dev.end_capture(s).unwrap();
    assert!(pool.end_announced_capture(s));
    assert!(!pool.end_announced_capture(s), "nothing left to end");
    assert_eq!(pool.announced_captures(), 0);
    dev.destroy_graph(graph).unwrap();
    // No capture announced: an ordinary block.
    let x = pool.alloc_async(LEN, s).unwrap();
    assert!(!x.is_graph_memory() && pool.contains(x.ptr()));
    pool.free_async(x, s).unwrap();
    pool.synchronize().unwrap();
    pool.retire_stream(s).unwrap();
    dev.destroy_stream(s).unwrap();
}

// ---------------------------------------------------------------------------
// backends

fn host_device() -> Arc<HostDevice> {
    Arc::new(HostDevice::with_config(HostConfig {
        capacity: 1 << 30,
        granularity: 2 << 20,
    }))
}

/// The tests of this binary take turns on the GPU.
static GPU: Mutex<()> = Mutex::new(());

struct Gpu {
    dev: Arc<CudaDevice>,
    k: Arc<dyn TagKernels>,
    _lock: MutexGuard<'static, ()>,
}

/// `Some(Gpu)`, or `None` (printing why) when there is no usable driver.
fn gpu(test: &str) -> Option<Gpu> {
    if !tidepool_sys::cuda::driver_available() {
        let reason = tidepool_sys::cuda::driver_unavailable_reason().unwrap_or_default();
        if std::env::var("TIDEPOOL_REQUIRE_GPU").as_deref() == Ok("1") {
            panic!("{test}: TIDEPOOL_REQUIRE_GPU=1 but no CUDA driver is usable: {reason}");
        }
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr().lock(),
            "SKIP {test}: no CUDA driver is usable here: {reason}"
        );
        return None;
    }
    let lock = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let dev = Arc::new(CudaDevice::new(0).expect("CudaDevice::new(0)"));
    let k = dev.clone().tag_kernels().expect("tag kernels");
    Some(Gpu {
        dev,
        k,
        _lock: lock,
    })
}

macro_rules! on_both {
    ($name:ident, |$dev:ident, $k:ident, $faults:ident| $body:expr) => {
        mod $name {
            use super::*;
            #[test]
            fn host() {
                let $dev = host_device();
                let kernels = $dev.clone().tag_kernels().unwrap();
                let $k: &dyn TagKernels = &*kernels;
                let fd = $dev.clone();
                let counted = move || fd.graph_faults();
                let $faults: Faults = &counted;
                $body;
                assert_eq!($dev.live_graph_allocations(), 0);
            }
            #[test]
            fn cuda() {
                let Some(g) = gpu(concat!(stringify!($name), "::cuda")) else {
                    return;
                };
                let $dev = g.dev.clone();
                let $k: &dyn TagKernels = &*g.k;
                let none = || 0;
                let $faults: Faults = &none;
                $body;
            }
        }
    };
}

on_both!(graph_replays_100_times, |dev, k, faults| graph_replays(
    &dev, k, 100, faults
));
on_both!(eager_free_in_capture_is_refused, |dev, _k, _f| {
    eager_free_in_capture(&dev)
});
on_both!(graph_memory_left_live_after_launches, |dev, k, faults| {
    graph_memory_left_live(&dev, k, faults)
});
on_both!(use_in_capture_needs_free_after_graph, |dev, k, faults| {
    use_in_capture(&dev, k, faults)
});
on_both!(
    invalidated_capture_and_raw_api_are_refused,
    |dev, _k, _f| { refusals(&dev) }
);
on_both!(announced_mode_serves_announced_captures, |dev, _k, _f| {
    announced_mode(&dev)
});
