//! The host backend's per-thread cache of recently used streams, seen from
//! outside: a stream destroyed by one thread while another thread holds it
//! in its cache is refused by that thread at once, for every call that
//! names a stream; threads cycling through more streams than the cache
//! holds find each live one; a stream of another device instance is never
//! resolved through the cache, whichever slot the two instances' ids pick.
//! Work is bounded by operation counts.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::channel;
use std::sync::Arc;
use tidepool_sys::host::{HostConfig, HostDevice};
use tidepool_sys::{Device, Stream, SysError};

/// More streams than the per-thread cache has slots (64).
const STREAMS: usize = 100;

fn device() -> HostDevice {
    HostDevice::with_config(HostConfig {
        capacity: 64 << 20,
        granularity: 2 << 20,
    })
}

/// Every call that names a stream, made from this thread: each must be
/// refused for a destroyed stream (`Err` count) and served for a live one.
fn refusals(dev: &HostDevice, s: Stream, ran: &Arc<AtomicU64>) -> Vec<(&'static str, bool)> {
    let r = ran.clone();
    let launch = dev
        .launch_host(
            s,
            Box::new(move || {
                r.fetch_add(1, Ordering::SeqCst);
            }),
        )
        .is_err();
    let check = dev.check_stream(s).is_err();
    let query = dev.query_stream(s).is_err();
    let ev = dev.create_event().unwrap();
    let record = dev.record_event(ev, s).is_err();
    dev.destroy_event(ev).unwrap();
    let probe = dev
        .stream_probe(s)
        .ok()
        .flatten()
        .is_none_or(|p| p.check().is_err());
    vec![
        ("launch_host", launch),
        ("check_stream", check),
        ("query_stream", query),
        ("record_event", record),
        ("stream_probe", probe),
    ]
}

/// A worker thread uses each stream (so that it sits in the worker's
/// cache), the main thread destroys it, and the worker's next calls on it
/// are all refused; streams left alive still serve every call, also after
/// the worker cycled through all of them several times.
#[test]
fn a_stream_destroyed_elsewhere_is_refused_by_a_thread_that_cached_it() {
    let dev = Arc::new(device());
    let streams: Vec<Stream> = (0..STREAMS).map(|_| dev.create_stream().unwrap()).collect();
    let ran = Arc::new(AtomicU64::new(0));
    let (to_main, from_worker) = channel::<usize>();
    let (to_worker, from_main) = channel::<()>();
    let worker = {
        let (dev, streams, ran) = (dev.clone(), streams.clone(), ran.clone());
        std::thread::spawn(move || {
            let mut launched = 0u64;
            // Warm: every stream, three times over (more than the slots).
            for _ in 0..3 {
                for &s in &streams {
                    for (call, refused) in refusals(&dev, s, &ran) {
                        assert!(!refused, "live {s}: {call} refused");
                    }
                    launched += 1;
                }
            }
            for (i, &s) in streams.iter().enumerate() {
                // Use it (it is now in this thread's cache) ...
                assert!(dev.check_stream(s).is_ok(), "live {s} refused");
                to_main.send(i).unwrap();
                from_main.recv().unwrap();
                // ... the main thread destroyed every third one.
                let gone = i % 3 == 0;
                for (call, refused) in refusals(&dev, s, &ran) {
                    assert_eq!(
                        refused, gone,
                        "stream {i} ({s}, destroyed: {gone}): {call} refused: {refused}"
                    );
                }
                if !gone {
                    launched += 1;
                }
            }
            // Cycle again: the live ones still serve, the destroyed ones
            // are still refused.
            for (i, &s) in streams.iter().enumerate() {
                let gone = i % 3 == 0;
                for (call, refused) in refusals(&dev, s, &ran) {
                    assert_eq!(
                        refused, gone,
                        "again, stream {i}: {call} refused: {refused}"
                    );
                }
                if !gone {
                    launched += 1;
                }
            }
            launched
        })
    };
    while let Ok(i) = from_worker.recv() {
        if i % 3 == 0 {
            dev.destroy_stream(streams[i]).unwrap();
        }
        if to_worker.send(()).is_err() {
            break;
        }
    }
    let launched = worker.join().expect("worker");
    dev.synchronize_device().unwrap();
    assert_eq!(
        ran.load(Ordering::SeqCst),
        launched,
        "host tasks run: exactly those launched on live streams"
    );
}

/// Many device instances, one stream each, every stream warm in this
/// thread's cache: no instance resolves another's stream, whichever slots
/// their ids pick (with 70 instances some pairs share every slot).
#[test]
fn no_instance_resolves_another_instances_stream_through_the_cache() {
    const DEVICES: usize = 70;
    let devs: Vec<HostDevice> = (0..DEVICES).map(|_| device()).collect();
    let streams: Vec<Stream> = devs.iter().map(|d| d.create_stream().unwrap()).collect();
    for round in 0..2 {
        for (i, d) in devs.iter().enumerate() {
            // Warm: the instance's own stream, in this thread's cache.
            d.check_stream(streams[i]).unwrap();
            for (j, &s) in streams.iter().enumerate() {
                if i == j {
                    continue;
                }
                // And the other instance's, in its own slot.
                devs[j].check_stream(s).unwrap();
                match d.check_stream(s) {
                    Err(SysError::ForeignHandle { .. }) => {}
                    Err(e) => panic!("round {round}: device {i} on {j}'s {s}: {e}"),
                    Ok(()) => panic!("round {round}: device {i} took device {j}'s stream {s}"),
                }
                assert!(
                    d.launch_host(s, Box::new(|| {})).is_err(),
                    "round {round}: device {i} launched on device {j}'s stream {s}"
                );
            }
        }
    }
}
