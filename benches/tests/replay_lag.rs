//! The replayer's completion lag ([`Lagged`]): on the host backend, an
//! event or stream query answers "not done" until the lag's number of
//! trace operations have been issued after the work; a host wait
//! completes it at once; with no lag every answer is the device's. Then,
//! through tidepool: the lag keeps a free of one stream from another
//! stream until the lag has passed, and a replay with a lag of 0 counts
//! what the plain replay counts while a real lag changes the counters.

use std::path::PathBuf;
use std::sync::Arc;
use tidepool::PoolConfig;
use tidepool_benches::replay::lag::{LagClock, Lagged};
use tidepool_benches::replay::tidepool_alloc::TidepoolAlloc;
use tidepool_benches::replay::{PassOptions, PassResult, ReplayAllocator, Replayer, Trace};
use tidepool_sys::host::HostDevice;
use tidepool_sys::Device;

fn lagged(lag: u64) -> (Arc<LagClock>, Lagged<HostDevice>) {
    let clock = Arc::new(LagClock::new());
    let dev = Lagged::new(Arc::new(HostDevice::new()), clock.clone(), lag);
    (clock, dev)
}

#[test]
fn an_event_completes_lag_operations_after_its_record() {
    let (clock, dev) = lagged(3);
    let (a, b) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let ev = dev.create_event().unwrap();
    clock.tick(a);
    dev.record_event(ev, a).unwrap();
    for _ in 0..2 {
        assert!(!dev.query_event(ev).unwrap());
        // Operations on any stream move the clock.
        clock.tick(b);
    }
    assert!(!dev.query_event(ev).unwrap());
    clock.tick(b);
    assert!(dev.query_event(ev).unwrap());
    // Recorded again: pending again, for the lag.
    dev.record_event(ev, a).unwrap();
    assert!(!dev.query_event(ev).unwrap());
    dev.destroy_event(ev).unwrap();
}

#[test]
fn a_stream_is_idle_lag_operations_after_its_last_one() {
    let (clock, dev) = lagged(2);
    let (a, b) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    assert!(dev.query_stream(a).unwrap(), "no work issued yet");
    clock.tick(a);
    assert!(!dev.query_stream(a).unwrap());
    assert!(dev.query_stream(b).unwrap(), "b has no work");
    clock.tick(b);
    assert!(!dev.query_stream(a).unwrap());
    assert!(!dev.query_stream(b).unwrap());
    clock.tick(b);
    assert!(dev.query_stream(a).unwrap());
    assert!(!dev.query_stream(b).unwrap());
    // A stream that waits for another's event is busy until that work is.
    let ev = dev.create_event().unwrap();
    clock.tick(a);
    dev.record_event(ev, a).unwrap();
    dev.wait_event(b, ev).unwrap();
    clock.tick(a);
    assert!(!dev.query_stream(b).unwrap());
    clock.tick(a);
    assert!(dev.query_event(ev).unwrap());
    assert!(dev.query_stream(b).unwrap());
}

#[test]
fn a_stream_with_a_pending_event_is_not_idle() {
    let (clock, dev) = lagged(2);
    let (a, b) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    clock.tick(a);
    clock.tick(b);
    let ev = dev.create_event().unwrap();
    // Recorded after a's last operation: a is busy as long as the event is.
    dev.record_event(ev, a).unwrap();
    clock.tick(b);
    assert!(!dev.query_event(ev).unwrap());
    assert!(
        !dev.query_stream(a).unwrap(),
        "a stream whose recorded event is pending is not idle"
    );
    clock.tick(b);
    assert!(dev.query_event(ev).unwrap());
    assert!(dev.query_stream(a).unwrap());
    dev.destroy_event(ev).unwrap();
}

#[test]
fn host_waits_complete_at_once() {
    let (clock, dev) = lagged(1000);
    let (a, b) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let (e1, e2) = (dev.create_event().unwrap(), dev.create_event().unwrap());
    clock.tick(a);
    dev.record_event(e1, a).unwrap();
    clock.tick(a);
    dev.record_event(e2, a).unwrap();
    assert!(!dev.query_event(e1).unwrap());
    // Waiting for the later record completes the earlier one too, and
    // not the stream's work issued after it.
    dev.synchronize_event(e2).unwrap();
    assert!(dev.query_event(e1).unwrap());
    assert!(dev.query_event(e2).unwrap());
    clock.tick(a);
    assert!(!dev.query_stream(a).unwrap());
    dev.synchronize_stream(a).unwrap();
    assert!(dev.query_stream(a).unwrap());
    clock.tick(a);
    clock.tick(b);
    dev.record_event(e1, b).unwrap();
    assert!(!dev.query_stream(a).unwrap());
    assert!(!dev.query_stream(b).unwrap());
    assert!(!dev.query_event(e1).unwrap());
    dev.synchronize_device().unwrap();
    assert!(dev.query_stream(a).unwrap());
    assert!(dev.query_stream(b).unwrap());
    assert!(dev.query_event(e1).unwrap());
}

#[test]
fn with_no_lag_every_answer_is_the_device_s() {
    let (clock, dev) = lagged(0);
    let a = dev.create_stream().unwrap();
    let ev = dev.create_event().unwrap();
    clock.tick(a);
    dev.record_event(ev, a).unwrap();
    dev.synchronize_stream(a).unwrap();
    assert!(dev.query_event(ev).unwrap());
    assert!(dev.query_stream(a).unwrap());
}

/// One whole page of the host backend: B gets A's block or new memory.
const SIZE: usize = 2 << 20;

/// Allocate and free a page on stream A (operations 1 and 2), then
/// `pairs` small allocations and frees on a third stream, then allocate a
/// page on B (operation `3 + 2 * pairs`); returns whether B got A's page.
fn b_gets_a_page(lag: u64, pairs: usize) -> bool {
    let clock = Arc::new(LagClock::new());
    let dev = Arc::new(Lagged::new(Arc::new(HostDevice::new()), clock.clone(), lag));
    let mut alloc =
        TidepoolAlloc::with_lag_clock(dev, 3, PoolConfig::default(), clock.clone()).unwrap();
    let x = alloc.alloc(SIZE, 0).unwrap();
    let freed = x.ptr();
    alloc.free(x, 0).unwrap();
    for _ in 0..pairs {
        let s = alloc.alloc(256, 2).unwrap();
        alloc.free(s, 2).unwrap();
    }
    let y = alloc.alloc(SIZE, 1).unwrap();
    assert_eq!(clock.now() as usize, 3 + 2 * pairs);
    let got = y.ptr();
    alloc.free(y, 1).unwrap();
    alloc.synchronize().unwrap();
    got == freed
}

#[test]
fn a_free_reaches_another_stream_only_after_the_lag() {
    assert!(b_gets_a_page(0, 0), "no lag: A's free is complete at once");
    assert!(!b_gets_a_page(9, 0));
    // The pool records the event that closes A's free at the next
    // allocation that looks for completed frees (operation 3), so the
    // free is done from operation 3 + lag on: B's allocation is operation
    // 11 when `pairs` is 4, 13 when it is 5.
    assert!(b_gets_a_page(8, 4));
    assert!(!b_gets_a_page(9, 4));
    assert!(b_gets_a_page(9, 5));
}

fn trace_path(name: &str) -> PathBuf {
    let dir = std::env::var("CARGO_MANIFEST_DIR")
        .unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").to_string());
    PathBuf::from(dir).join("traces").join(name)
}

/// Two passes of the first 12,000 operations of the pipeline trace (four
/// streams), through tidepool on a lagged host device (`None`: the plain
/// device, as the replayer runs with no lag).
fn replay(trace: &Trace, lag: Option<u64>) -> Vec<PassResult> {
    let host = Arc::new(HostDevice::new());
    let streams = trace.streams.len();
    let passes = |alloc: &mut dyn FnMut() -> PassResult| vec![alloc(), alloc()];
    match lag {
        None => {
            let alloc = TidepoolAlloc::new(host, streams).unwrap();
            let mut r = Replayer::new(alloc, trace);
            passes(&mut || r.pass(PassOptions::default(), |_| {}).unwrap())
        }
        Some(lag) => {
            let clock = Arc::new(LagClock::new());
            let dev = Arc::new(Lagged::new(host, clock.clone(), lag));
            let alloc =
                TidepoolAlloc::with_lag_clock(dev, streams, PoolConfig::default(), clock).unwrap();
            let mut r = Replayer::new(alloc, trace);
            passes(&mut || r.pass(PassOptions::default(), |_| {}).unwrap())
        }
    }
}

/// What a pass decides: peak reserved, out-of-memory failures, counters.
type Outcome = (u64, u64, Vec<(&'static str, u64)>);

/// What each pass decided, not its speed.
fn outcome(r: &[PassResult]) -> Vec<Outcome> {
    r.iter()
        .map(|p| (p.peak_reserved_bytes, p.ooms, p.counters.clone()))
        .collect()
}

#[test]
fn lag_zero_replays_as_today_and_a_lag_changes_reuse() {
    let trace = Trace::load(&trace_path("pipeline.csv.gz"), Some(12_000)).unwrap();
    let plain = outcome(&replay(&trace, None));
    let zero = outcome(&replay(&trace, Some(0)));
    assert_eq!(plain, zero, "a lag of 0 must change nothing");
    let lagged = replay(&trace, Some(64));
    assert!(lagged.iter().all(|p| p.ooms == 0));
    assert_ne!(plain, outcome(&lagged), "a lag of 64 must change reuse");
    // Pending frees that cannot move or pass to another stream make the
    // pool grow more (the first pass holds its growth).
    assert!(
        lagged[0].peak_reserved_bytes > plain[0].0,
        "lag 64: {} B reserved, no lag: {} B",
        lagged[0].peak_reserved_bytes,
        plain[0].0
    );
}

/// A stream whose work is all done needs no event: at a lag of 1, B's
/// allocation one operation after A's free finds A idle and takes its
/// page. An event recorded then, at the allocation, would complete only
/// one operation later, and B would get new memory.
#[test]
fn an_idle_stream_s_free_needs_no_event() {
    assert!(b_gets_a_page(1, 0), "A is idle: its free is complete");
    assert!(
        !b_gets_a_page(2, 0),
        "at a lag of 2 A's free, one operation old, is still running"
    );
}
