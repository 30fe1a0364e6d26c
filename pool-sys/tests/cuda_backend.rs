//! Behavioural tests of the CUDA backend (the same rules as the host
//! backend's tests, against the driver). Each test skips without a driver;
//! `TIDEPOOL_REQUIRE_GPU=1` makes a missing driver a failure.

mod cuda_common;

use cuda_common::{device_or_skip, pattern, rw};
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tidepool_sys::cuda::{driver_available, CudaDevice};
use tidepool_sys::{Device, PhysicalOptions, SysError};

#[test]
fn new_reports_driver_unavailable_without_a_driver() {
    match CudaDevice::new(0) {
        Err(SysError::DriverUnavailable { reason }) => {
            assert!(!driver_available());
            assert!(!reason.is_empty());
            if std::env::var("TIDEPOOL_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("TIDEPOOL_REQUIRE_GPU=1 but no CUDA driver: {reason}");
            }
            println!("no CUDA driver here, as expected: {reason}");
        }
        Ok(dev) => {
            assert!(driver_available());
            assert_eq!(dev.backend_name(), "cuda");
            assert_eq!(dev.ordinal(), 0);
            assert!(dev.granularity().is_power_of_two());
        }
        Err(e) => panic!("CudaDevice::new(0) failed otherwise: {e}"),
    }
    // A second call gives the same answer (the probe is cached).
    assert_eq!(CudaDevice::new(0).is_ok(), driver_available());
}

#[test]
fn invalid_ordinal_is_an_error() {
    let Some(_dev) = device_or_skip() else { return };
    assert!(matches!(
        CudaDevice::new(10_000),
        Err(SysError::Driver { .. })
    ));
}

#[test]
fn reserve_create_map_set_access_round_trip() {
    let Some(dev) = device_or_skip() else { return };
    let g = dev.granularity();
    let va = dev.reserve_va(4 * g, 0).unwrap();
    assert_eq!(va % g as u64, 0);
    let h = dev
        .create_physical(2 * g, PhysicalOptions::default())
        .unwrap();
    dev.map(va + g as u64, 2 * g, h, 0).unwrap();
    dev.set_access(va + g as u64, 2 * g, &rw(&dev)).unwrap();

    let data = pattern(2 * g, 7);
    dev.copy_htod(va + g as u64, &data).unwrap();
    let mut back = vec![0u8; 2 * g];
    dev.copy_dtoh(&mut back, va + g as u64).unwrap();
    assert_eq!(back, data);

    // Release while mapped: the memory lives on until unmapped.
    dev.release_physical(h).unwrap();
    let mut again = vec![0u8; 16];
    dev.copy_dtoh(&mut again, va + g as u64).unwrap();
    assert_eq!(&again[..], &data[..16]);

    dev.unmap(va + g as u64, 2 * g).unwrap();
    dev.free_va(va, 4 * g).unwrap();
    let info = dev.mem_info().unwrap();
    assert!(info.total > 0 && info.free <= info.total);
}

#[test]
fn two_ranges_mapped_to_one_handle_see_each_others_writes() {
    let Some(dev) = device_or_skip() else { return };
    let g = dev.granularity();
    let a = dev.reserve_va(g, 0).unwrap();
    let b = dev.reserve_va(g, 0).unwrap();
    assert_ne!(a, b);
    let h = dev.create_physical(g, PhysicalOptions::default()).unwrap();
    dev.map(a, g, h, 0).unwrap();
    dev.map(b, g, h, 0).unwrap();
    dev.set_access(a, g, &rw(&dev)).unwrap();
    dev.set_access(b, g, &rw(&dev)).unwrap();

    let data = pattern(g, 3);
    dev.copy_htod(a, &data).unwrap();
    let mut back = vec![0u8; g];
    dev.copy_dtoh(&mut back, b).unwrap();
    assert_eq!(back, data);

    let data2 = pattern(4096, 99);
    dev.copy_htod(b + 4096, &data2).unwrap();
    let mut back2 = vec![0u8; 4096];
    dev.copy_dtoh(&mut back2, a + 4096).unwrap();
    assert_eq!(back2, data2);

    dev.unmap(a, g).unwrap();
    dev.unmap(b, g).unwrap();
    dev.release_physical(h).unwrap();
    dev.free_va(a, g).unwrap();
    dev.free_va(b, g).unwrap();
}

#[test]
fn bad_vmm_calls_are_errors_not_crashes() {
    let Some(dev) = device_or_skip() else { return };
    let g = dev.granularity();
    let va = dev.reserve_va(4 * g, 0).unwrap();
    let h = dev
        .create_physical(2 * g, PhysicalOptions::default())
        .unwrap();

    // Unmap of a range that was never mapped.
    assert!(matches!(
        dev.unmap(va, g),
        Err(SysError::InvalidArgument { .. })
    ));
    // Set access before any mapping.
    assert!(matches!(
        dev.set_access(va, g, &rw(&dev)),
        Err(SysError::InvalidArgument { .. })
    ));
    // Misaligned size / address / offset, offset past the handle.
    assert!(matches!(
        dev.map(va, g / 2, h, 0),
        Err(SysError::InvalidArgument { .. })
    ));
    assert!(matches!(
        dev.map(va + 1, g, h, 0),
        Err(SysError::InvalidArgument { .. })
    ));
    assert!(matches!(
        dev.map(va, g, h, 4096),
        Err(SysError::InvalidArgument { .. })
    ));
    assert!(matches!(
        dev.map(va, 2 * g, h, g),
        Err(SysError::InvalidArgument { .. })
    ));
    // Outside any reservation.
    assert!(matches!(
        dev.map(va + 4 * g as u64, 2 * g, h, 0),
        Err(SysError::InvalidArgument { .. })
    ));
    // A part of the handle: the driver maps handles only whole.
    assert!(matches!(
        dev.map(va, g, h, 0),
        Err(SysError::Unsupported { .. })
    ));

    dev.map(va, 2 * g, h, 0).unwrap();
    // Overlapping map, partial unmap, wrong-size unmap, unmap in the middle.
    assert!(matches!(
        dev.map(va + g as u64, 2 * g, h, 0),
        Err(SysError::InvalidArgument { .. })
    ));
    assert!(matches!(
        dev.unmap(va, g),
        Err(SysError::InvalidArgument { .. })
    ));
    assert!(matches!(
        dev.unmap(va + g as u64, g),
        Err(SysError::InvalidArgument { .. })
    ));
    // Set access beyond the mapping.
    assert!(matches!(
        dev.set_access(va, 3 * g, &rw(&dev)),
        Err(SysError::InvalidArgument { .. })
    ));
    // Free of a reservation that still holds a mapping / of a wrong size.
    assert!(matches!(
        dev.free_va(va, 4 * g),
        Err(SysError::InvalidArgument { .. })
    ));
    assert!(matches!(
        dev.free_va(va, 2 * g),
        Err(SysError::InvalidArgument { .. })
    ));

    dev.unmap(va, 2 * g).unwrap();
    // Unmapping twice.
    assert!(matches!(
        dev.unmap(va, 2 * g),
        Err(SysError::InvalidArgument { .. })
    ));

    dev.release_physical(h).unwrap();
    // Double release, map of a released handle, export of a released handle.
    assert!(matches!(
        dev.release_physical(h),
        Err(SysError::InvalidHandle { .. })
    ));
    assert!(matches!(
        dev.map(va, g, h, 0),
        Err(SysError::InvalidHandle { .. })
    ));
    assert!(matches!(
        dev.export_fd(h),
        Err(SysError::InvalidHandle { .. })
    ));
    dev.free_va(va, 4 * g).unwrap();
    // Double free of the reservation.
    assert!(matches!(
        dev.free_va(va, 4 * g),
        Err(SysError::InvalidArgument { .. })
    ));
    // Zero sizes.
    assert!(dev.reserve_va(0, 0).is_err());
    assert!(dev.create_physical(0, PhysicalOptions::default()).is_err());
}

#[test]
fn absurd_create_is_out_of_memory() {
    let Some(dev) = device_or_skip() else { return };
    let g = dev.granularity();
    let total = dev.mem_info().unwrap().total;
    let absurd = (total * 4).div_ceil(g) * g;
    let err = dev
        .create_physical(absurd, PhysicalOptions::default())
        .unwrap_err();
    assert!(err.is_out_of_memory(), "got {err}");
    if let SysError::OutOfMemory {
        requested,
        available,
        ..
    } = err
    {
        assert_eq!(requested, absurd);
        assert!(available <= total);
    }
    // The device still works afterwards.
    let h = dev.create_physical(g, PhysicalOptions::default()).unwrap();
    dev.release_physical(h).unwrap();
}

#[test]
fn export_and_import_a_posix_fd() {
    let Some(dev) = device_or_skip() else { return };
    let g = dev.granularity();
    let plain = dev.create_physical(g, PhysicalOptions::default()).unwrap();
    assert!(matches!(
        dev.export_fd(plain),
        Err(SysError::InvalidArgument { .. })
    ));
    dev.release_physical(plain).unwrap();

    let h = dev
        .create_physical(g, PhysicalOptions { exportable: true })
        .unwrap();
    let fd = dev.export_fd(h).unwrap();
    let h2 = dev.import_fd(fd, g).unwrap();
    assert_ne!(h, h2);
    let a = dev.reserve_va(g, 0).unwrap();
    let b = dev.reserve_va(g, 0).unwrap();
    dev.map(a, g, h, 0).unwrap();
    dev.map(b, g, h2, 0).unwrap();
    dev.set_access(a, g, &rw(&dev)).unwrap();
    dev.set_access(b, g, &rw(&dev)).unwrap();
    let data = pattern(8192, 42);
    dev.copy_htod(a, &data).unwrap();
    let mut back = vec![0u8; 8192];
    dev.copy_dtoh(&mut back, b).unwrap();
    assert_eq!(back, data);
    dev.unmap(a, g).unwrap();
    dev.unmap(b, g).unwrap();
    dev.release_physical(h).unwrap();
    dev.release_physical(h2).unwrap();
    dev.free_va(a, g).unwrap();
    dev.free_va(b, g).unwrap();
}

#[test]
fn host_tasks_run_in_stream_order() {
    let Some(dev) = device_or_skip() else { return };
    let s = dev.create_stream().unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    for i in 0..200 {
        let log = log.clone();
        dev.launch_host(
            s,
            Box::new(move || {
                if i % 50 == 0 {
                    std::thread::sleep(Duration::from_millis(5));
                }
                log.lock().unwrap().push(i);
            }),
        )
        .unwrap();
    }
    dev.synchronize_stream(s).unwrap();
    assert!(dev.query_stream(s).unwrap());
    assert_eq!(*log.lock().unwrap(), (0..200).collect::<Vec<_>>());
    dev.destroy_stream(s).unwrap();
}

#[test]
fn a_panicking_host_task_does_not_break_the_stream() {
    let Some(dev) = device_or_skip() else { return };
    let s = dev.create_stream().unwrap();
    dev.launch_host(s, Box::new(|| panic!("deliberate panic in a host task")))
        .unwrap();
    let ran = Arc::new(AtomicBool::new(false));
    let r = ran.clone();
    dev.launch_host(s, Box::new(move || r.store(true, Ordering::SeqCst)))
        .unwrap();
    dev.synchronize_stream(s).unwrap();
    assert!(ran.load(Ordering::SeqCst));
    dev.destroy_stream(s).unwrap();
}

#[test]
fn event_completes_only_after_the_work_before_it() {
    let Some(dev) = device_or_skip() else { return };
    let s = dev.create_stream().unwrap();
    let e = dev.create_event().unwrap();
    // Never recorded: complete.
    assert!(dev.query_event(e).unwrap());
    let done = Arc::new(AtomicBool::new(false));
    let d = done.clone();
    dev.launch_host(
        s,
        Box::new(move || {
            std::thread::sleep(Duration::from_millis(300));
            d.store(true, Ordering::SeqCst);
        }),
    )
    .unwrap();
    dev.record_event(e, s).unwrap();
    assert!(!dev.query_event(e).unwrap());
    assert!(!dev.query_stream(s).unwrap());
    dev.synchronize_event(e).unwrap();
    assert!(done.load(Ordering::SeqCst));
    assert!(dev.query_event(e).unwrap());
    dev.destroy_event(e).unwrap();
    assert!(matches!(
        dev.query_event(e),
        Err(SysError::InvalidHandle { .. })
    ));
    assert!(matches!(
        dev.destroy_event(e),
        Err(SysError::InvalidHandle { .. })
    ));
    dev.destroy_stream(s).unwrap();
}

#[test]
fn stream_waiting_on_an_event_does_not_run_ahead() {
    let Some(dev) = device_or_skip() else { return };
    let a = dev.create_stream().unwrap();
    let b = dev.create_stream().unwrap();
    let e = dev.create_event().unwrap();
    // Waiting on a never-recorded event is a no-op.
    dev.wait_event(b, e).unwrap();

    let a_done = Arc::new(AtomicBool::new(false));
    let seen_by_b = Arc::new(Mutex::new(None));
    let ad = a_done.clone();
    dev.launch_host(
        a,
        Box::new(move || {
            std::thread::sleep(Duration::from_millis(300));
            ad.store(true, Ordering::SeqCst);
        }),
    )
    .unwrap();
    dev.record_event(e, a).unwrap();
    dev.wait_event(b, e).unwrap();
    let ad = a_done.clone();
    let seen = seen_by_b.clone();
    dev.launch_host(
        b,
        Box::new(move || *seen.lock().unwrap() = Some(ad.load(Ordering::SeqCst))),
    )
    .unwrap();
    dev.synchronize_stream(b).unwrap();
    assert_eq!(*seen_by_b.lock().unwrap(), Some(true));
    dev.destroy_event(e).unwrap();
    dev.destroy_stream(a).unwrap();
    dev.destroy_stream(b).unwrap();
}

#[test]
fn destroyed_stream_finishes_its_queued_work() {
    let Some(dev) = device_or_skip() else { return };
    let s = dev.create_stream().unwrap();
    let done = Arc::new(AtomicBool::new(false));
    let d = done.clone();
    dev.launch_host(
        s,
        Box::new(move || {
            std::thread::sleep(Duration::from_millis(100));
            d.store(true, Ordering::SeqCst);
        }),
    )
    .unwrap();
    dev.destroy_stream(s).unwrap();
    let start = std::time::Instant::now();
    while !done.load(Ordering::SeqCst) {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "queued work lost"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn stream_ids_are_never_reused() {
    let Some(dev) = device_or_skip() else { return };
    let mut seen = HashSet::new();
    seen.insert(dev.default_stream());
    assert_eq!(dev.default_stream(), dev.default_stream());
    assert_eq!(dev.raw_stream(dev.default_stream()).unwrap(), 0);
    let mut last = None;
    for _ in 0..100 {
        let s = dev.create_stream().unwrap();
        assert!(seen.insert(s), "stream id {s} issued twice");
        // Resolve it on this thread first (the thread's cache of recently
        // used streams must forget it on destroy).
        assert!(!dev.is_capturing(s).unwrap());
        dev.destroy_stream(s).unwrap();
        assert!(matches!(
            dev.is_capturing(s),
            Err(SysError::InvalidHandle { .. })
        ));
        assert!(matches!(
            dev.query_stream(s),
            Err(SysError::InvalidHandle { .. })
        ));
        last = Some(s);
    }
    let last = last.unwrap();
    assert!(matches!(
        dev.destroy_stream(last),
        Err(SysError::InvalidHandle { .. })
    ));
    assert!(matches!(
        dev.synchronize_stream(last),
        Err(SysError::InvalidHandle { .. })
    ));
    assert!(matches!(
        dev.launch_host(last, Box::new(|| {})),
        Err(SysError::InvalidHandle { .. })
    ));
    assert!(matches!(
        dev.raw_stream(last),
        Err(SysError::InvalidHandle { .. })
    ));
    // The default stream is always valid and never destroyed.
    dev.synchronize_stream(dev.default_stream()).unwrap();
    assert!(dev.destroy_stream(dev.default_stream()).is_err());
    assert_eq!(dev.raw_stream(dev.default_stream()).unwrap(), 0);
}

#[test]
fn adopted_streams_get_fresh_ids_and_are_only_forgotten() {
    let Some(dev) = device_or_skip() else { return };
    let owned = dev.create_stream().unwrap();
    let raw = dev.raw_stream(owned).unwrap();
    assert_ne!(raw, 0);
    let x = dev.adopt_stream(raw).unwrap();
    let y = dev.adopt_stream(raw).unwrap();
    assert_ne!(x, y);
    assert_ne!(x, owned);
    assert_eq!(dev.raw_stream(x).unwrap(), raw);
    dev.destroy_stream(x).unwrap();
    // The driver stream is still alive: usable through the other ids.
    let ran = Arc::new(AtomicBool::new(false));
    let r = ran.clone();
    dev.launch_host(y, Box::new(move || r.store(true, Ordering::SeqCst)))
        .unwrap();
    dev.synchronize_stream(owned).unwrap();
    assert!(ran.load(Ordering::SeqCst));
    dev.destroy_stream(y).unwrap();
    dev.destroy_stream(owned).unwrap();

    // The legacy NULL stream and the per-thread default stream.
    for raw in [0usize, 2usize] {
        let s = dev.adopt_stream(raw).unwrap();
        dev.launch_host(s, Box::new(|| {})).unwrap();
        dev.synchronize_stream(s).unwrap();
        assert!(!dev.is_capturing(s).unwrap());
        dev.destroy_stream(s).unwrap();
    }
}

#[test]
fn priority_streams_and_capture_status() {
    let Some(dev) = device_or_skip() else { return };
    let (least, greatest) = dev.stream_priority_range().unwrap();
    assert!(greatest <= least);
    let lo = dev.create_stream_with_priority(least).unwrap();
    let hi = dev.create_stream_with_priority(greatest).unwrap();
    assert_ne!(lo, hi);
    assert!(!dev.is_capturing(lo).unwrap());
    assert!(!dev.is_capturing(hi).unwrap());
    assert!(!dev.is_capturing(dev.default_stream()).unwrap());
    dev.synchronize_stream(hi).unwrap();
    dev.destroy_stream(lo).unwrap();
    dev.destroy_stream(hi).unwrap();
}

/// `is_capturing` binds no context for a created stream; a thread with no
/// current context must still get answers (also for the NULL stream).
#[test]
fn capture_status_from_a_thread_with_no_current_context() {
    let Some(dev) = device_or_skip() else { return };
    let dev = Arc::new(dev);
    let s = dev.create_stream().unwrap();
    let d = dev.clone();
    std::thread::spawn(move || {
        assert!(!d.is_capturing(s).unwrap());
        assert!(!d.is_capturing(d.default_stream()).unwrap());
        assert!(!d.is_capturing(s).unwrap());
    })
    .join()
    .unwrap();
    dev.destroy_stream(s).unwrap();
}

#[test]
fn device_is_shared_across_threads() {
    let Some(dev) = device_or_skip() else { return };
    let dev = Arc::new(dev);
    let g = dev.granularity();
    let handles: Vec<_> = (0..4)
        .map(|t| {
            let dev = dev.clone();
            std::thread::spawn(move || {
                let s = dev.create_stream().unwrap();
                let va = dev.reserve_va(g, 0).unwrap();
                let h = dev.create_physical(g, PhysicalOptions::default()).unwrap();
                dev.map(va, g, h, 0).unwrap();
                dev.set_access(va, g, &rw(&dev)).unwrap();
                let data = pattern(4096, t);
                dev.copy_htod(va, &data).unwrap();
                let mut back = vec![0u8; 4096];
                dev.copy_dtoh(&mut back, va).unwrap();
                assert_eq!(back, data);
                dev.unmap(va, g).unwrap();
                dev.release_physical(h).unwrap();
                dev.free_va(va, g).unwrap();
                dev.destroy_stream(s).unwrap();
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

#[test]
fn dropping_the_device_cleans_up_live_objects() {
    let Some(dev) = device_or_skip() else { return };
    let g = dev.granularity();
    let va = dev.reserve_va(g, 0).unwrap();
    let h = dev.create_physical(g, PhysicalOptions::default()).unwrap();
    dev.map(va, g, h, 0).unwrap();
    let _s = dev.create_stream().unwrap();
    let _e = dev.create_event().unwrap();
    drop(dev);
    // A fresh device still works.
    let dev = CudaDevice::new(0).unwrap();
    let h = dev.create_physical(g, PhysicalOptions::default()).unwrap();
    dev.release_physical(h).unwrap();
}

/// Streams carry their device instance: another `CudaDevice` object's
/// stream (even one with the same number within its instance, and one
/// this thread has already used) is a typed error, never another stream.
#[test]
fn a_stream_of_another_instance_is_refused() {
    let Some(d1) = device_or_skip() else { return };
    let d2 = CudaDevice::new(0).unwrap();
    let (s1, s2) = (d1.create_stream().unwrap(), d2.create_stream().unwrap());
    assert_ne!(s1, s2);
    assert_ne!(d1.default_stream(), d2.default_stream());
    // Resolved on this thread through its own device first.
    assert!(!d2.is_capturing(s2).unwrap());
    d2.check_stream(s2).unwrap();
    for result in [
        d1.is_capturing(s2).map(|_| ()),
        d1.check_stream(s2),
        d1.query_stream(s2).map(|_| ()),
        d1.synchronize_stream(s2),
        d1.is_capturing(d2.default_stream()).map(|_| ()),
    ] {
        assert!(
            matches!(result, Err(SysError::ForeignHandle { what: "stream", .. })),
            "{result:?}"
        );
    }
    assert!(matches!(
        d1.destroy_stream(s2),
        Err(SysError::ForeignHandle { .. })
    ));
    d1.check_stream(s1).unwrap();
    d2.destroy_stream(s2).unwrap();
    assert!(matches!(
        d2.check_stream(s2),
        Err(SysError::InvalidHandle { what: "stream", .. })
    ));
    d1.destroy_stream(s1).unwrap();
}
