//! Host backend: graph capture. Work issued to a capturing stream is
//! recorded, not run; a launch replays it in order; graph memory is mapped
//! only between its allocation and free nodes; the calls the driver refuses
//! during a capture are refused here too.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tidepool_sys::host::{HostConfig, HostDevice};
use tidepool_sys::{CaptureMode, CaptureStatus, Device, GraphOptions, Stream, SysError};

const G: usize = 2 << 20;

fn device() -> HostDevice {
    HostDevice::with_config(HostConfig {
        capacity: 256 << 20,
        granularity: G,
    })
}

fn violation<T: std::fmt::Debug>(r: Result<T, SysError>) -> bool {
    matches!(r, Err(SysError::CaptureViolation { .. }))
}

/// A replayable task that appends `tag` to `log`.
fn log_task(d: &HostDevice, s: Stream, log: &Arc<Mutex<Vec<u32>>>, tag: u32) {
    let log = Arc::clone(log);
    d.launch_host_repeatable(s, Arc::new(move || log.lock().unwrap().push(tag)))
        .unwrap();
}

#[test]
fn capture_status_tells_captures_apart() {
    let d = device();
    let s = d.create_stream().unwrap();
    assert_eq!(d.capture_status(s).unwrap(), CaptureStatus::None);
    d.begin_capture(s, CaptureMode::Global).unwrap();
    let first = d.capture_status(s).unwrap();
    let CaptureStatus::Active { id: id1 } = first else {
        panic!("expected an active capture, got {first:?}");
    };
    assert!(d.is_capturing(s).unwrap());
    // A second begin on a capturing stream is refused.
    assert!(violation(d.begin_capture(s, CaptureMode::Global)));
    let g = d.end_capture(s).unwrap();
    assert_eq!(d.capture_status(s).unwrap(), CaptureStatus::None);
    assert!(!d.is_capturing(s).unwrap());
    d.begin_capture(s, CaptureMode::Relaxed).unwrap();
    let id2 = d.capture_status(s).unwrap().id().unwrap();
    assert_ne!(id1, id2, "two captures of one stream have different ids");
    let g2 = d.end_capture(s).unwrap();
    d.destroy_graph(g).unwrap();
    d.destroy_graph(g2).unwrap();
    // The test aid reports a capture too, with its own id.
    d.set_capturing(s, true);
    let id3 = d.capture_status(s).unwrap().id().unwrap();
    assert!(id3 != id1 && id3 != id2);
    d.set_capturing(s, false);
    assert_eq!(d.capture_status(s).unwrap(), CaptureStatus::None);
    // The default stream cannot be captured.
    assert!(d
        .begin_capture(d.default_stream(), CaptureMode::Global)
        .is_err());
}

#[test]
fn captured_work_runs_only_when_launched_and_in_order() {
    let d = device();
    let (cap, run) = (d.create_stream().unwrap(), d.create_stream().unwrap());
    let log = Arc::new(Mutex::new(Vec::new()));
    log_task(&d, cap, &log, 0); // before the capture: runs
    d.synchronize_stream(cap).unwrap();
    d.begin_capture(cap, CaptureMode::Global).unwrap();
    for tag in 1..=3 {
        log_task(&d, cap, &log, tag);
    }
    let g = d.end_capture(cap).unwrap();
    d.synchronize_stream(cap).unwrap();
    assert_eq!(*log.lock().unwrap(), [0], "captured work must not run");
    let exec = d.instantiate_graph(g, GraphOptions::default()).unwrap();
    for _ in 0..3 {
        d.launch_graph(exec, run).unwrap();
    }
    d.synchronize_stream(run).unwrap();
    assert_eq!(*log.lock().unwrap(), [0, 1, 2, 3, 1, 2, 3, 1, 2, 3]);
    // After the capture, work on the stream runs again.
    log_task(&d, cap, &log, 9);
    d.synchronize_stream(cap).unwrap();
    assert_eq!(log.lock().unwrap().last(), Some(&9));
    d.destroy_graph_exec(exec).unwrap();
    d.destroy_graph(g).unwrap();
}

/// Writes `value` into the first word at `ptr`, or counts a fault.
fn write_word(d: &HostDevice, s: Stream, ptr: u64, value: u32, faults: &Arc<AtomicU64>) {
    let faults = Arc::clone(faults);
    d.launch_on_words_repeatable(s, ptr, 4, move |w| match w {
        Ok(w) => w[0].store(value, Ordering::Relaxed),
        Err(_) => {
            faults.fetch_add(1, Ordering::Relaxed);
        }
    })
    .unwrap();
}

/// Reads the first word at `ptr` into `out`, or counts a fault.
fn read_word(d: &HostDevice, s: Stream, ptr: u64, out: &Arc<AtomicU32>, faults: &Arc<AtomicU64>) {
    let (out, faults) = (Arc::clone(out), Arc::clone(faults));
    d.launch_on_words_repeatable(s, ptr, 4, move |w| match w {
        Ok(w) => out.store(w[0].load(Ordering::Relaxed), Ordering::Relaxed),
        Err(_) => {
            faults.fetch_add(1, Ordering::Relaxed);
        }
    })
    .unwrap();
}

#[test]
fn graph_memory_is_mapped_between_its_alloc_and_free_nodes() {
    let d = device();
    let (cap, run) = (d.create_stream().unwrap(), d.create_stream().unwrap());
    let faults = Arc::new(AtomicU64::new(0));
    let seen = Arc::new(AtomicU32::new(0));
    d.begin_capture(cap, CaptureMode::ThreadLocal).unwrap();
    let p = d.graph_alloc(cap, 4096).unwrap();
    write_word(&d, cap, p, 0xC0FFEE, &faults);
    read_word(&d, cap, p, &seen, &faults);
    d.graph_free(cap, p).unwrap();
    // Use after the graph's free: faults in every launch.
    write_word(&d, cap, p, 1, &faults);
    let g = d.end_capture(cap).unwrap();
    // Not mapped at capture time, nor after instantiation.
    assert!(d.read_words(p, 1).is_err());
    let exec = d.instantiate_graph(g, GraphOptions::default()).unwrap();
    assert!(d.read_words(p, 1).is_err());
    for launch in 1..=5u64 {
        d.launch_graph(exec, run).unwrap();
        d.synchronize_stream(run).unwrap();
        assert_eq!(seen.load(Ordering::Relaxed), 0xC0FFEE);
        assert_eq!(
            faults.load(Ordering::Relaxed),
            launch,
            "one use after free per launch"
        );
        assert!(d.read_words(p, 1).is_err(), "unmapped between launches");
    }
    assert_eq!(d.graph_faults(), 0);
    assert_eq!(d.live_graph_allocations(), 0);
    d.destroy_graph_exec(exec).unwrap();
    d.destroy_graph(g).unwrap();
    // The reservation goes with the graph.
    assert_eq!(d.live_reservations(), 0);
    assert_eq!(d.live_mappings(), 0);
}

#[test]
fn an_allocation_left_live_must_be_freed_before_the_next_launch() {
    let d = device();
    let (cap, run) = (d.create_stream().unwrap(), d.create_stream().unwrap());
    let faults = Arc::new(AtomicU64::new(0));
    d.begin_capture(cap, CaptureMode::Global).unwrap();
    let p = d.graph_alloc(cap, G).unwrap();
    write_word(&d, cap, p, 77, &faults);
    let g = d.end_capture(cap).unwrap();
    let exec = d.instantiate_graph(g, GraphOptions::default()).unwrap();
    // One executable graph at a time for a graph with memory nodes.
    assert!(d.instantiate_graph(g, GraphOptions::default()).is_err());
    d.launch_graph(exec, run).unwrap();
    d.synchronize_stream(run).unwrap();
    // Live after the launch: the user owns it now.
    assert_eq!(d.read_words(p, 1).unwrap(), [77]);
    assert_eq!(d.live_graph_allocations(), 1);
    let e = d.launch_graph(exec, run).unwrap_err();
    assert!(e.to_string().contains("still live"), "{e}");
    d.graph_free(run, p).unwrap();
    d.synchronize_stream(run).unwrap();
    assert!(d.read_words(p, 1).is_err());
    d.launch_graph(exec, run).unwrap();
    d.synchronize_stream(run).unwrap();
    assert_eq!(d.read_words(p, 1).unwrap(), [77]);
    d.destroy_graph_exec(exec).unwrap();
    // Auto-free on launch frees the previous launch's allocation first.
    let auto = d
        .instantiate_graph(
            g,
            GraphOptions {
                auto_free_on_launch: true,
            },
        )
        .unwrap();
    d.graph_free(run, p).unwrap();
    for _ in 0..3 {
        d.launch_graph(auto, run).unwrap();
    }
    d.synchronize_stream(run).unwrap();
    assert_eq!(d.read_words(p, 1).unwrap(), [77]);
    assert_eq!(faults.load(Ordering::Relaxed), 0);
    assert_eq!(d.graph_faults(), 0);
    d.graph_free(run, p).unwrap();
    d.synchronize_stream(run).unwrap();
    d.destroy_graph_exec(auto).unwrap();
    d.destroy_graph(g).unwrap();
    assert_eq!((d.live_mappings(), d.live_reservations()), (0, 0));
}

#[test]
fn stream_ordered_graph_alloc_outside_a_capture() {
    let d = device();
    let s = d.create_stream().unwrap();
    let p = d.graph_alloc(s, 100).unwrap();
    d.synchronize_stream(s).unwrap();
    d.write_words(p, &[5]).unwrap();
    assert_eq!(d.read_words(p, 1).unwrap(), [5]);
    d.graph_free(s, p).unwrap();
    assert!(d.graph_free(s, p).is_err(), "double free");
    d.synchronize_stream(s).unwrap();
    assert!(d.read_words(p, 1).is_err());
    assert_eq!((d.live_mappings(), d.live_reservations()), (0, 0));
}

#[test]
fn calls_the_driver_refuses_during_capture() {
    let d = device();
    let (cap, other) = (d.create_stream().unwrap(), d.create_stream().unwrap());

    // Synchronising or querying the capturing stream invalidates the capture.
    d.begin_capture(cap, CaptureMode::Relaxed).unwrap();
    assert!(violation(d.synchronize_stream(cap)));
    assert!(matches!(
        d.capture_status(cap).unwrap(),
        CaptureStatus::Invalidated { .. }
    ));
    assert!(violation(d.end_capture(cap)));
    assert_eq!(d.capture_status(cap).unwrap(), CaptureStatus::None);
    d.begin_capture(cap, CaptureMode::Relaxed).unwrap();
    assert!(violation(d.query_stream(cap)));
    assert!(violation(d.end_capture(cap)));

    // A one-shot task cannot be captured.
    d.begin_capture(cap, CaptureMode::Relaxed).unwrap();
    assert!(violation(d.launch_host(cap, Box::new(|| ()))));
    assert!(violation(d.end_capture(cap)));

    // Events: one recorded into a capture cannot be queried or
    // synchronised; a capturing stream cannot wait on an outside event.
    let ev = d.create_event().unwrap();
    let outside = d.create_event().unwrap();
    d.record_event(outside, other).unwrap();
    d.begin_capture(cap, CaptureMode::Relaxed).unwrap();
    d.record_event(ev, cap).unwrap();
    assert!(violation(d.query_event(ev)));
    // The refused query invalidated the capture, as on the driver.
    assert!(matches!(
        d.capture_status(cap).unwrap(),
        CaptureStatus::Invalidated { .. }
    ));
    assert!(violation(d.end_capture(cap)));
    d.begin_capture(cap, CaptureMode::Relaxed).unwrap();
    d.record_event(ev, cap).unwrap();
    assert!(violation(d.synchronize_event(ev)));
    assert!(violation(d.end_capture(cap)), "invalidated it too");
    d.begin_capture(cap, CaptureMode::Relaxed).unwrap();
    d.record_event(ev, cap).unwrap();
    d.wait_event(cap, ev).unwrap(); // same capture: fine
    assert!(matches!(
        d.capture_status(cap).unwrap(),
        CaptureStatus::Active { .. }
    ));
    assert!(violation(d.wait_event(cap, outside)));
    assert!(violation(d.end_capture(cap)));
    // Recording it again outside a capture makes it usable.
    d.record_event(ev, other).unwrap();
    d.synchronize_event(ev).unwrap();

    // Device-wide synchronisation, by mode.
    d.begin_capture(cap, CaptureMode::Global).unwrap();
    let from_other_thread = std::thread::scope(|t| t.spawn(|| d.synchronize_device()).join());
    assert!(violation(from_other_thread.unwrap()));
    assert!(
        violation(d.end_capture(cap)),
        "the refused call invalidated it"
    );
    d.begin_capture(cap, CaptureMode::ThreadLocal).unwrap();
    let from_other_thread = std::thread::scope(|t| t.spawn(|| d.synchronize_device()).join());
    assert!(
        violation(from_other_thread.unwrap()),
        "the driver refuses it from every thread in thread-local mode too"
    );
    assert!(violation(d.end_capture(cap)), "and it invalidated it");
    d.begin_capture(cap, CaptureMode::ThreadLocal).unwrap();
    assert!(violation(d.synchronize_device()));
    assert!(violation(d.end_capture(cap)));
    d.begin_capture(cap, CaptureMode::Relaxed).unwrap();
    d.synchronize_device().unwrap();
    d.end_capture(cap)
        .map(|g| d.destroy_graph(g))
        .unwrap()
        .unwrap();

    // The capture ends on the thread that began it, unless relaxed.
    d.begin_capture(cap, CaptureMode::Global).unwrap();
    let ended_elsewhere = std::thread::scope(|t| t.spawn(|| d.end_capture(cap)).join());
    assert!(violation(ended_elsewhere.unwrap()));
    // A capturing stream cannot be destroyed.
    assert!(violation(d.destroy_stream(cap)));
    let g = d.end_capture(cap).unwrap();
    d.destroy_graph(g).unwrap();
    // Work on other streams runs during a capture.
    d.begin_capture(cap, CaptureMode::Global).unwrap();
    let ran = Arc::new(AtomicU64::new(0));
    let r = Arc::clone(&ran);
    d.launch_host(
        other,
        Box::new(move || {
            r.fetch_add(1, Ordering::Relaxed);
        }),
    )
    .unwrap();
    d.synchronize_stream(other).unwrap();
    assert_eq!(ran.load(Ordering::Relaxed), 1);
    d.destroy_graph(d.end_capture(cap).unwrap()).unwrap();
    d.destroy_stream(cap).unwrap();
}
