//! Host backend: streams run their work in order on worker threads, events
//! mark points in that work, and bad handles are errors, not crashes.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};
use tidepool_sys::host::{HostConfig, HostDevice};
use tidepool_sys::{Device, Event, Op, Stream, SysError};

fn device() -> HostDevice {
    HostDevice::with_config(HostConfig {
        capacity: 256 << 20,
        granularity: 2 << 20,
    })
}

fn sleep_ms(ms: u64) -> Box<dyn FnOnce() + Send> {
    Box::new(move || std::thread::sleep(Duration::from_millis(ms)))
}

fn invalid_handle<T: std::fmt::Debug>(r: Result<T, SysError>, op: Op, what: &str) -> bool {
    matches!(r, Err(SysError::InvalidHandle { op: o, what: w, .. }) if o == op && w == what)
}

#[test]
fn tasks_on_one_stream_run_in_order() {
    let d = device();
    let s = d.create_stream().unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    for i in 0..200u32 {
        let log = Arc::clone(&log);
        // Early tasks are slower, so a reordering would show.
        let delay = if i < 5 { 5 } else { 0 };
        d.launch_host(
            s,
            Box::new(move || {
                std::thread::sleep(Duration::from_millis(delay));
                log.lock().unwrap().push(i);
            }),
        )
        .unwrap();
    }
    d.synchronize_stream(s).unwrap();
    assert!(d.query_stream(s).unwrap());
    assert_eq!(*log.lock().unwrap(), (0..200).collect::<Vec<_>>());
    d.destroy_stream(s).unwrap();
}

#[test]
fn event_completes_only_after_the_work_before_it() {
    let d = device();
    let s = d.create_stream().unwrap();
    let e = d.create_event().unwrap();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    // The task blocks until the test lets it go: no timing assumption.
    d.launch_host(s, Box::new(move || go_rx.recv().unwrap()))
        .unwrap();
    d.record_event(e, s).unwrap();
    // Work issued after the record does not delay the event.
    let (late_tx, late_rx) = mpsc::channel::<()>();
    d.launch_host(s, Box::new(move || late_rx.recv().unwrap()))
        .unwrap();
    assert!(!d.query_event(e).unwrap());
    assert!(!d.query_stream(s).unwrap());
    go_tx.send(()).unwrap();
    d.synchronize_event(e).unwrap();
    assert!(d.query_event(e).unwrap());
    assert!(!d.query_stream(s).unwrap(), "later work is still blocked");
    late_tx.send(()).unwrap();
    d.synchronize_stream(s).unwrap();
    assert!(d.query_stream(s).unwrap());
}

#[test]
fn event_recorded_on_idle_stream_is_complete_at_once() {
    let d = device();
    let s = d.create_stream().unwrap();
    let e = d.create_event().unwrap();
    d.record_event(e, s).unwrap();
    assert!(d.query_event(e).unwrap());
    // Re-recording moves the event to the new end of the stream.
    let (tx, rx) = mpsc::channel::<()>();
    d.launch_host(s, Box::new(move || rx.recv().unwrap()))
        .unwrap();
    d.record_event(e, s).unwrap();
    assert!(!d.query_event(e).unwrap());
    tx.send(()).unwrap();
    d.synchronize_event(e).unwrap();
    assert!(d.query_event(e).unwrap());
}

#[test]
fn stream_waiting_on_another_streams_event_does_not_run_ahead() {
    let d = device();
    let a = d.create_stream().unwrap();
    let b = d.create_stream().unwrap();
    let e = d.create_event().unwrap();
    // A global ticket counter orders what happened: A's slow task takes a
    // ticket when it finishes, B's task when it starts.
    let ticket = Arc::new(AtomicU32::new(0));
    let a_ticket = Arc::new(AtomicU32::new(u32::MAX));
    let b_ticket = Arc::new(AtomicU32::new(u32::MAX));
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let start = Instant::now();
    {
        let (ticket, a_ticket) = (Arc::clone(&ticket), Arc::clone(&a_ticket));
        d.launch_host(
            a,
            Box::new(move || {
                go_rx.recv().unwrap();
                std::thread::sleep(Duration::from_millis(100));
                a_ticket.store(ticket.fetch_add(1, Ordering::SeqCst), Ordering::SeqCst);
            }),
        )
        .unwrap();
    }
    d.record_event(e, a).unwrap();
    d.wait_event(b, e).unwrap();
    let b_started = Arc::new(Mutex::new(None::<Instant>));
    {
        let (ticket, b_ticket) = (Arc::clone(&ticket), Arc::clone(&b_ticket));
        let b_started = Arc::clone(&b_started);
        d.launch_host(
            b,
            Box::new(move || {
                *b_started.lock().unwrap() = Some(Instant::now());
                b_ticket.store(ticket.fetch_add(1, Ordering::SeqCst), Ordering::SeqCst);
            }),
        )
        .unwrap();
    }
    // A is held back by the test: B must not have run, however long we wait.
    std::thread::sleep(Duration::from_millis(50));
    assert!(!d.query_stream(b).unwrap());
    assert!(!d.query_event(e).unwrap());
    assert_eq!(
        b_ticket.load(Ordering::SeqCst),
        u32::MAX,
        "B ran ahead of A"
    );
    go_tx.send(()).unwrap();
    d.synchronize_stream(b).unwrap();
    assert!(
        d.query_event(e).unwrap(),
        "B finished, so the event it waited on has"
    );
    assert_eq!(a_ticket.load(Ordering::SeqCst), 0, "A finished first");
    assert_eq!(b_ticket.load(Ordering::SeqCst), 1, "B's task ran after A's");
    let at = b_started.lock().unwrap().expect("B's task ran");
    assert!(at.duration_since(start) >= Duration::from_millis(150));
}

#[test]
fn waits_chain_transitively_across_streams() {
    let d = device();
    let [a, b, c] = [(); 3].map(|_| d.create_stream().unwrap());
    let [ea, eb] = [(); 2].map(|_| d.create_event().unwrap());
    let flag = Arc::new(AtomicBool::new(false));
    let f = Arc::clone(&flag);
    d.launch_host(
        a,
        Box::new(move || {
            std::thread::sleep(Duration::from_millis(80));
            f.store(true, Ordering::SeqCst);
        }),
    )
    .unwrap();
    d.record_event(ea, a).unwrap();
    d.wait_event(b, ea).unwrap();
    d.record_event(eb, b).unwrap();
    d.wait_event(c, eb).unwrap();
    let (tx, rx) = mpsc::channel();
    let f = Arc::clone(&flag);
    d.launch_host(
        c,
        Box::new(move || tx.send(f.load(Ordering::SeqCst)).unwrap()),
    )
    .unwrap();
    assert!(rx.recv().unwrap(), "C ran before A's work through B");
}

#[test]
fn never_recorded_event_is_complete_and_waiting_on_it_is_a_no_op() {
    let d = device();
    let s = d.create_stream().unwrap();
    let e = d.create_event().unwrap();
    assert!(d.query_event(e).unwrap());
    d.synchronize_event(e).unwrap();
    d.wait_event(s, e).unwrap();
    let (tx, rx) = mpsc::channel();
    d.launch_host(s, Box::new(move || tx.send(()).unwrap()))
        .unwrap();
    rx.recv_timeout(Duration::from_secs(60))
        .expect("work after a wait on a never-recorded event runs");
}

#[test]
fn destroyed_event_is_an_invalid_handle_everywhere() {
    let d = device();
    let s = d.create_stream().unwrap();
    let e = d.create_event().unwrap();
    d.record_event(e, s).unwrap();
    d.destroy_event(e).unwrap();
    assert!(invalid_handle(
        d.record_event(e, s),
        Op::RecordEvent,
        "event"
    ));
    assert!(invalid_handle(d.wait_event(s, e), Op::WaitEvent, "event"));
    assert!(invalid_handle(d.query_event(e), Op::QueryEvent, "event"));
    assert!(invalid_handle(
        d.synchronize_event(e),
        Op::SynchronizeEvent,
        "event"
    ));
    assert!(invalid_handle(
        d.destroy_event(e),
        Op::DestroyEvent,
        "event"
    ));
    assert!(invalid_handle(
        d.destroy_event(Event(u64::MAX)),
        Op::DestroyEvent,
        "event"
    ));
}

#[test]
fn destroyed_stream_still_finishes_queued_work() {
    let d = device();
    let s = d.create_stream().unwrap();
    let e = d.create_event().unwrap();
    let (tx, rx) = mpsc::channel();
    for i in 0..10 {
        let tx = tx.clone();
        d.launch_host(
            s,
            Box::new(move || {
                std::thread::sleep(Duration::from_millis(5));
                tx.send(i).unwrap();
            }),
        )
        .unwrap();
    }
    d.record_event(e, s).unwrap();
    d.destroy_stream(s).unwrap(); // returns at once
                                  // The stream is gone for new calls...
    assert!(invalid_handle(
        d.launch_host(s, sleep_ms(0)),
        Op::LaunchHost,
        "stream"
    ));
    assert!(invalid_handle(
        d.synchronize_stream(s),
        Op::SynchronizeStream,
        "stream"
    ));
    assert!(invalid_handle(d.query_stream(s), Op::QueryStream, "stream"));
    assert!(invalid_handle(
        d.record_event(e, s),
        Op::RecordEvent,
        "stream"
    ));
    assert!(invalid_handle(
        d.destroy_stream(s),
        Op::DestroyStream,
        "stream"
    ));
    // ...but its queued work runs to the end, and an event recorded on it
    // before the destroy still completes.
    d.synchronize_event(e).unwrap();
    let got: Vec<i32> = (0..10).map(|_| rx.recv().unwrap()).collect();
    assert_eq!(got, (0..10).collect::<Vec<_>>());
    assert!(d.query_event(e).unwrap());
}

#[test]
fn ids_are_never_reused_after_destroy() {
    let d = device();
    let d2 = device();
    let mut seen = std::collections::HashSet::new();
    assert!(seen.insert(d.default_stream().id()));
    assert!(seen.insert(d2.default_stream().id()));
    for _ in 0..50 {
        let s = d.create_stream().unwrap();
        let e = d.create_event().unwrap();
        let s2 = d2.create_stream().unwrap();
        assert!(seen.insert(s.id()), "stream id {s} reused");
        assert!(seen.insert(e.id()), "event id {e} reused");
        assert!(seen.insert(s2.id()), "stream id {s2} reused");
        d.destroy_stream(s).unwrap();
        d.destroy_event(e).unwrap();
        d2.destroy_stream(s2).unwrap();
    }
}

#[test]
fn default_stream_is_always_valid_and_cannot_be_destroyed() {
    let d = device();
    let s = d.default_stream();
    assert_eq!(s, d.default_stream());
    assert!(matches!(
        d.destroy_stream(s),
        Err(SysError::InvalidArgument {
            op: Op::DestroyStream,
            ..
        })
    ));
    let (tx, rx) = mpsc::channel();
    d.launch_host(s, Box::new(move || tx.send(()).unwrap()))
        .unwrap();
    d.synchronize_stream(s).unwrap();
    rx.try_recv()
        .expect("synchronize_stream waited for the task");
}

#[test]
fn adopt_is_unsupported_and_capture_is_a_test_hook() {
    let d = device();
    assert!(matches!(
        d.adopt_stream(0x1234),
        Err(SysError::Unsupported {
            op: Op::AdoptStream,
            ..
        })
    ));
    let s = d.create_stream().unwrap();
    assert!(!d.is_capturing(s).unwrap());
    d.set_capturing(s, true);
    assert!(d.is_capturing(s).unwrap());
    assert!(!d.is_capturing(d.default_stream()).unwrap());
    d.set_capturing(s, false);
    assert!(!d.is_capturing(s).unwrap());
    d.destroy_stream(s).unwrap();
    assert!(invalid_handle(d.is_capturing(s), Op::IsCapturing, "stream"));
    assert!(invalid_handle(
        d.is_capturing(Stream(u64::MAX)),
        Op::IsCapturing,
        "stream"
    ));
}

#[test]
fn a_panicking_task_does_not_stall_the_stream() {
    let d = device();
    let s = d.create_stream().unwrap();
    d.launch_host(s, Box::new(|| panic!("task panics on purpose")))
        .unwrap();
    let (tx, rx) = mpsc::channel();
    d.launch_host(s, Box::new(move || tx.send(()).unwrap()))
        .unwrap();
    d.synchronize_stream(s).unwrap();
    rx.try_recv().expect("the task after the panic ran");
}

#[test]
fn drop_drains_queued_work() {
    let d = device();
    let s = d.create_stream().unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let f = Arc::clone(&done);
    d.launch_host(
        s,
        Box::new(move || {
            std::thread::sleep(Duration::from_millis(50));
            f.store(true, Ordering::SeqCst);
        }),
    )
    .unwrap();
    drop(d);
    assert!(
        done.load(Ordering::SeqCst),
        "drop returned before the work ran"
    );
}

#[test]
fn synchronize_device_waits_for_live_and_destroyed_streams() {
    let d = device();
    let live = d.create_stream().unwrap();
    let gone = d.create_stream().unwrap();
    let done = Arc::new(AtomicU32::new(0));
    for (s, ms) in [(live, 10), (gone, 300)] {
        d.launch_host(s, sleep_ms(ms)).unwrap();
        let done = done.clone();
        d.launch_host(
            s,
            Box::new(move || {
                done.fetch_add(1, Ordering::SeqCst);
            }),
        )
        .unwrap();
    }
    d.destroy_stream(gone).unwrap();
    d.synchronize_device().unwrap();
    assert_eq!(
        done.load(Ordering::SeqCst),
        2,
        "synchronize_device returned before a (destroyed) stream's work finished"
    );
    d.destroy_stream(live).unwrap();
}

#[test]
fn synchronize_device_is_refused_while_a_stream_is_captured() {
    let d = device();
    let s = d.create_stream().unwrap();
    d.set_capturing(s, true);
    assert!(matches!(
        d.synchronize_device(),
        Err(SysError::CaptureViolation {
            op: Op::SynchronizeDevice,
            ..
        })
    ));
    d.set_capturing(s, false);
    d.synchronize_device().unwrap();
    d.destroy_stream(s).unwrap();
}

#[test]
fn capture_status_follows_the_hook_and_destroy_on_a_thread_that_cached_it() {
    let d = device();
    let s = d.create_stream().unwrap();
    assert!(!d.is_capturing(s).unwrap()); // resolved and cached here
    d.set_capturing(s, true);
    assert!(d.is_capturing(s).unwrap());
    d.set_capturing(s, false);
    assert!(!d.is_capturing(s).unwrap());
    d.destroy_stream(s).unwrap();
    assert!(invalid_handle(d.is_capturing(s), Op::IsCapturing, "stream"));
}

/// Streams carry their device instance: another `HostDevice`'s stream is a
/// typed error, also once this thread has used it on its own device (the
/// thread's cache of recent streams is per instance).
#[test]
fn a_stream_of_another_device_is_refused() {
    let (d1, d2) = (HostDevice::new(), HostDevice::new());
    let s2 = d2.create_stream().unwrap();
    assert!(!d2.is_capturing(s2).unwrap());
    d2.check_stream(s2).unwrap();
    for result in [
        d1.is_capturing(s2).map(|_| ()),
        d1.check_stream(s2),
        d1.query_stream(s2).map(|_| ()),
        d1.synchronize_stream(s2),
        d1.launch_host(s2, Box::new(|| {})),
        d1.is_capturing(d2.default_stream()).map(|_| ()),
        d1.destroy_stream(s2),
    ] {
        assert!(
            matches!(
                result,
                Err(tidepool_sys::SysError::ForeignHandle { what: "stream", .. })
            ),
            "{result:?}"
        );
    }
    let e = d1.create_event().unwrap();
    assert!(matches!(
        d1.record_event(e, s2),
        Err(tidepool_sys::SysError::ForeignHandle { .. })
    ));
    // A destroyed stream of the device itself stays an invalid handle.
    let s1 = d1.create_stream().unwrap();
    d1.check_stream(s1).unwrap();
    d1.destroy_stream(s1).unwrap();
    assert!(matches!(
        d1.check_stream(s1),
        Err(tidepool_sys::SysError::InvalidHandle { what: "stream", .. })
    ));
    let msg = d1.check_stream(s2).unwrap_err().to_string();
    assert!(msg.contains("another device instance"), "{msg}");
    d2.destroy_stream(s2).unwrap();
}
