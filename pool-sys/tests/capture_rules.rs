//! The capture rules, checked by one body on both backends: what the host
//! backend refuses during a capture must be what the driver refuses, or a
//! design passes on the CPU and fails on the GPU. The CUDA test skips
//! (saying why) without a driver, unless TIDEPOOL_REQUIRE_GPU=1.

mod cuda_common;

use std::io::Write;
use tidepool_sys::host::{HostConfig, HostDevice};
use tidepool_sys::{CaptureMode, CaptureStatus, Device, GraphOptions, SysResult};

/// Checks each rule, printing one line per rule (outside libtest's capture,
/// so a GPU run shows which rule differs), then fails if any did not hold.
fn capture_rules(dev: &dyn Device) {
    let mut broken = Vec::new();
    let mut check = |rule: &str, held: bool, detail: String| {
        let _ = writeln!(
            std::io::stderr().lock(),
            "RULE {} [{}] {rule}: {detail}",
            if held { "ok" } else { "BROKEN" },
            dev.backend_name()
        );
        if !held {
            broken.push(rule.to_string());
        }
    };
    fn refused<T: std::fmt::Debug>(r: &SysResult<T>) -> bool {
        r.is_err()
    }
    let cap = dev.create_stream().unwrap();
    let other = dev.create_stream().unwrap();
    let ev = dev.create_event().unwrap();
    let outside = dev.create_event().unwrap();
    dev.record_event(outside, other).unwrap();
    dev.synchronize_stream(other).unwrap();

    // 1. Querying an event recorded into the capture.
    dev.begin_capture(cap, CaptureMode::Global).unwrap();
    dev.record_event(ev, cap).unwrap();
    let r = dev.query_event(ev);
    check(
        "query of an event recorded in the capture is refused",
        refused(&r),
        format!("{r:?}"),
    );
    let status = dev.capture_status(cap).unwrap();
    check(
        "refusing that query invalidates the capture",
        matches!(status, CaptureStatus::Invalidated { .. }),
        format!("{status:?}"),
    );
    let r = dev.end_capture(cap);
    check(
        "ending the capture the refused query invalidated fails",
        refused(&r),
        format!("{r:?}"),
    );
    if let Ok(g) = &r {
        dev.destroy_graph(*g).unwrap();
    }

    // 2. Synchronising the capturing stream invalidates the capture.
    dev.begin_capture(cap, CaptureMode::Global).unwrap();
    let r = dev.synchronize_stream(cap);
    check(
        "synchronising the capturing stream is refused",
        refused(&r),
        format!("{r:?}"),
    );
    let status = dev.capture_status(cap).unwrap();
    check(
        "and it invalidates the capture",
        matches!(status, CaptureStatus::Invalidated { .. }),
        format!("{status:?}"),
    );
    let r = dev.end_capture(cap);
    check(
        "ending an invalidated capture fails",
        refused(&r),
        format!("{r:?}"),
    );
    check(
        "the stream is out of capture afterwards",
        dev.capture_status(cap).unwrap() == CaptureStatus::None,
        format!("{:?}", dev.capture_status(cap)),
    );

    // 3. A capturing stream waiting on an event recorded outside it.
    dev.begin_capture(cap, CaptureMode::Global).unwrap();
    let r = dev.wait_event(cap, outside);
    check(
        "a capturing stream waiting on an outside event is refused",
        refused(&r),
        format!("{r:?}"),
    );
    let r = dev.end_capture(cap);
    if let Ok(g) = &r {
        dev.destroy_graph(*g).unwrap();
    }

    // 4. A one-shot host task on a capturing stream.
    dev.begin_capture(cap, CaptureMode::Global).unwrap();
    let r = dev.launch_host(cap, Box::new(|| ()));
    check(
        "a one-shot host task on a capturing stream is refused",
        refused(&r),
        format!("{r:?}"),
    );
    let r = dev.end_capture(cap);
    if let Ok(g) = &r {
        dev.destroy_graph(*g).unwrap();
    }

    // 5. Device-wide synchronisation from another thread, global mode.
    dev.begin_capture(cap, CaptureMode::Global).unwrap();
    let r = std::thread::scope(|t| t.spawn(|| dev.synchronize_device()).join().unwrap());
    check(
        "device synchronisation from another thread during a global capture is refused",
        refused(&r),
        format!("{r:?}"),
    );
    let r = dev.end_capture(cap);
    if let Ok(g) = &r {
        dev.destroy_graph(*g).unwrap();
    }
    // Thread-local mode does not let another thread synchronise the device
    // either: the device-wide wait would wait for the capturing stream.
    dev.begin_capture(cap, CaptureMode::ThreadLocal).unwrap();
    let r = std::thread::scope(|t| t.spawn(|| dev.synchronize_device()).join().unwrap());
    check(
        "device synchronisation from another thread during a thread-local capture is refused",
        refused(&r),
        format!("{r:?}"),
    );
    let status = dev.capture_status(cap).unwrap();
    check(
        "and it invalidates the thread-local capture",
        matches!(status, CaptureStatus::Invalidated { .. }),
        format!("{status:?}"),
    );
    let r = dev.end_capture(cap);
    if let Ok(g) = &r {
        dev.destroy_graph(*g).unwrap();
    }

    // 6. Graph memory: an allocation left live blocks the next launch; a
    // graph with memory nodes has one executable graph at a time.
    dev.begin_capture(cap, CaptureMode::Global).unwrap();
    let p = dev.graph_alloc(cap, 1 << 20).unwrap();
    let g = dev.end_capture(cap).unwrap();
    let exec = dev.instantiate_graph(g, GraphOptions::default()).unwrap();
    let r = dev.instantiate_graph(g, GraphOptions::default());
    check(
        "a second executable graph of a graph with memory nodes is refused",
        refused(&r),
        format!("{r:?}"),
    );
    dev.launch_graph(exec, other).unwrap();
    let r = dev.launch_graph(exec, other);
    check(
        "relaunching while the previous launch's allocation is live is refused",
        refused(&r),
        format!("{r:?}"),
    );
    dev.graph_free(other, p).unwrap();
    let r = dev.launch_graph(exec, other);
    check(
        "relaunching after the allocation was freed works",
        r.is_ok(),
        format!("{r:?}"),
    );
    dev.graph_free(other, p).unwrap();
    dev.synchronize_stream(other).unwrap();
    dev.destroy_graph_exec(exec).unwrap();
    let auto = dev
        .instantiate_graph(
            g,
            GraphOptions {
                auto_free_on_launch: true,
            },
        )
        .unwrap();
    let r = dev
        .launch_graph(auto, other)
        .and_then(|()| dev.launch_graph(auto, other));
    check(
        "with auto-free-on-launch, relaunching frees the live allocation",
        r.is_ok(),
        format!("{r:?}"),
    );
    dev.graph_free(other, p).unwrap();
    dev.synchronize_stream(other).unwrap();
    dev.destroy_graph_exec(auto).unwrap();
    dev.destroy_graph(g).unwrap();

    dev.destroy_event(ev).unwrap();
    dev.destroy_event(outside).unwrap();
    dev.destroy_stream(cap).unwrap();
    dev.destroy_stream(other).unwrap();
    assert!(
        broken.is_empty(),
        "capture rules that did not hold: {broken:?}"
    );
}

/// Prints (never asserts: machine speed varies) what the capture-state
/// queries cost per call, averaged over 200,000 calls on one stream.
fn print_query_costs(dev: &dyn Device) {
    const CALLS: u32 = 200_000;
    let s = dev.create_stream().unwrap();
    let time = |f: &dyn Fn() -> bool| {
        let start = std::time::Instant::now();
        let mut capturing = 0u32;
        for _ in 0..CALLS {
            capturing += u32::from(std::hint::black_box(f()));
        }
        assert_eq!(capturing, 0, "the stream is not capturing");
        start.elapsed().as_nanos() as f64 / f64::from(CALLS)
    };
    let status = time(&|| dev.capture_status(s).unwrap().is_capturing());
    let is = time(&|| dev.is_capturing(s).unwrap());
    let _ = writeln!(
        std::io::stderr().lock(),
        "COST [{}] capture_status {status:.1} ns/call, is_capturing {is:.1} ns/call ({CALLS} calls each)",
        dev.backend_name()
    );
    dev.destroy_stream(s).unwrap();
}

#[test]
fn capture_rules_host() {
    let dev = HostDevice::with_config(HostConfig {
        capacity: 256 << 20,
        granularity: 2 << 20,
    });
    capture_rules(&dev);
    print_query_costs(&dev);
}

#[test]
fn capture_rules_cuda() {
    let Some(dev) = cuda_common::device_or_skip() else {
        return;
    };
    capture_rules(&dev);
    print_query_costs(&dev);
}
