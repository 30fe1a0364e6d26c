//! Contract tests of errors: out-of-memory reports, the hard maximum, graph
//! capture, retired streams, wrong pool, the raw-pointer API's typed errors
//! (and that every error leaves the pool unchanged), and device faults.

mod common;

use common::*;
use std::sync::{Arc, Barrier};
use tidepool::{MemPool, PoolError};
use tidepool_sys::{Device, FaultInjector, HostDevice, Op, SysError};

/// Rule: out-of-memory is reported by the call, stating requested,
/// reserved, used, largest free range and device free memory, in the
/// fields and in the message; the pool is usable afterwards.
#[test]
fn out_of_memory_report_states_the_pool() {
    let dev = Arc::new(host());
    let pool = pool(&dev, config().with_max_size(2 * PAGE as u64));
    let s = dev.create_stream().unwrap();
    let x = pool.alloc_async(PAGE + PAGE / 2, s).unwrap();
    let err = pool.alloc_async(3 * PAGE, s).unwrap_err();
    let PoolError::OutOfMemory(r) = &err else {
        panic!("expected OutOfMemory, got {err:?}")
    };
    assert_eq!(r.requested, 3 * PAGE);
    assert_eq!(r.used, (PAGE + PAGE / 2) as u64);
    assert!(r.reserved >= r.used && r.reserved <= 2 * PAGE as u64);
    assert!(r.largest_free_range >= (PAGE / 2) as u64, "{r:?}");
    assert!(r.largest_free_range < 3 * PAGE as u64);
    assert_eq!(r.max_size, Some(2 * PAGE as u64));
    assert_eq!(r.device_free, Some(dev.mem_info().unwrap().free as u64));
    assert!(r.cause.is_none(), "the cap, not the device, stopped growth");
    let text = err.to_string();
    for needle in [
        "out of memory",
        "requested 6291456 bytes",
        "6.0 MiB",
        "used 3.0 MiB",
        "largest free range",
        "device free",
        "pool maximum 4.0 MiB",
    ] {
        assert!(text.contains(needle), "{needle:?} missing from {text:?}");
    }
    assert!(err.is_out_of_memory());
    // Usable afterwards: the rest of the cap can still be allocated.
    let y = pool.alloc_async(PAGE / 2, s).unwrap();
    pool.free_async(y, s).unwrap();
    pool.free_async(x, s).unwrap();
    let z = pool.alloc_async(2 * PAGE, s).unwrap();
    pool.free_async(z, s).unwrap();
}

/// Rule: the report's `requested` is the size the caller asked for.
#[test]
fn out_of_memory_report_states_the_callers_size() {
    let dev = Arc::new(host());
    let pool = pool(&dev, config().with_max_size(PAGE as u64));
    let s = dev.create_stream().unwrap();
    let err = pool.alloc_async(3 * PAGE + 1, s).unwrap_err();
    let PoolError::OutOfMemory(r) = &err else {
        panic!("{err:?}")
    };
    assert_eq!(r.requested, 3 * PAGE + 1);
}

/// Rule: the hard maximum is never exceeded; the request that would exceed
/// it fails and leaves the pool as it was (no partial growth).
#[test]
fn max_size_is_respected() {
    let dev = Arc::new(host());
    let pool = pool(&dev, config().with_max_size(5 * PAGE as u64));
    let s = dev.create_stream().unwrap();
    let mut live = Vec::new();
    loop {
        match pool.alloc_async(PAGE, s) {
            Ok(a) => live.push(a),
            Err(e) => {
                assert!(e.is_out_of_memory(), "{e:?}");
                break;
            }
        }
        assert!(pool.stats().reserved_current <= 5 * PAGE as u64);
        assert!(live.len() <= 5, "allocated past the cap");
    }
    assert_eq!(live.len(), 5);
    assert_eq!(pool.stats().reserved_high, 5 * PAGE as u64);
    for a in live {
        pool.free_async(a, s).unwrap();
    }
}

/// Rule: a failed allocation changes nothing — in particular a request the
/// cap cannot satisfy does not leave the pool grown.
#[test]
fn capped_failure_does_not_grow_the_pool() {
    let dev = Arc::new(host());
    let pool = pool(&dev, config().with_max_size(4 * PAGE as u64));
    let s = dev.create_stream().unwrap();
    let x = pool.alloc_async(PAGE, s).unwrap();
    let before = pool.stats();
    let err = pool.alloc_async(4 * PAGE, s).unwrap_err();
    assert!(err.is_out_of_memory());
    let after = pool.stats();
    assert_eq!(after.reserved_current, before.reserved_current, "{after:?}");
    assert_eq!(after.growths, before.growths);
    pool.free_async(x, s).unwrap();
}

/// Rule: the device running out is out-of-memory with the device's error
/// as the cause.
#[test]
fn device_out_of_memory_names_the_cause() {
    let dev = Arc::new(host_with_capacity(4 * PAGE));
    let pool = pool(&dev, config());
    let s = dev.create_stream().unwrap();
    let x = pool.alloc_async(PAGE, s).unwrap();
    let err = pool.alloc_async(8 * PAGE, s).unwrap_err();
    let PoolError::OutOfMemory(r) = &err else {
        panic!("{err:?}")
    };
    assert!(
        matches!(r.cause, Some(SysError::OutOfMemory { .. })),
        "{r:?}"
    );
    assert_eq!(r.max_size, None);
    assert!(err.to_string().contains("growth failed"), "{err}");
    assert!(std::error::Error::source(&err).is_some());
    pool.free_async(x, s).unwrap();
    let y = pool.alloc_async(4 * PAGE, s).unwrap();
    pool.free_async(y, s).unwrap();
}

/// Rule: a request larger than the address space is a typed error.
#[test]
fn too_large_is_a_typed_error() {
    let dev = Arc::new(host());
    let pool = pool(&dev, config());
    let s = dev.create_stream().unwrap();
    for size in [(4 << 30) + 1, usize::MAX] {
        match pool.alloc_async(size, s) {
            Err(PoolError::TooLarge { requested, .. }) => assert_eq!(requested, size),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(pool.stats().reserved_current, 0);
}

/// Rule: a capturing stream — an invalidated capture gets
/// `StreamCapturing` for alloc and free; in a valid capture a block of the
/// pool cannot be freed (`EagerFreeInCapture`) and the raw-pointer API
/// refuses; every refusal gives the allocation back and changes nothing;
/// after capture ends the same allocation frees normally.
#[test]
fn capturing_stream_is_a_typed_error_and_changes_nothing() {
    use tidepool_sys::{CaptureMode, CaptureStatus};
    let dev = Arc::new(host());
    let pool = pool(&dev, config());
    let s = dev.create_stream().unwrap();
    let x = pool.alloc_async(4096, s).unwrap();
    let addr = x.ptr();
    let p = pool.alloc_raw(4096, s).unwrap();
    let before = pool.stats();
    dev.begin_capture(s, CaptureMode::Global).unwrap();
    let failed = pool.free_async(x, s).unwrap_err();
    assert_eq!(failed.error, PoolError::EagerFreeInCapture { stream: s });
    assert_eq!(
        pool.alloc_raw(4096, s).unwrap_err(),
        PoolError::StreamCapturing { stream: s }
    );
    assert_eq!(
        pool.free_raw(p, s).unwrap_err(),
        PoolError::EagerFreeInCapture { stream: s }
    );
    assert_eq!(pool.raw_size(p), Some(4096));
    // A refused call of the user's invalidates the capture.
    assert!(dev.synchronize_stream(s).is_err());
    assert!(matches!(
        dev.capture_status(s).unwrap(),
        CaptureStatus::Invalidated { .. }
    ));
    assert_eq!(
        pool.alloc_async(4096, s).unwrap_err(),
        PoolError::StreamCapturing { stream: s }
    );
    let failed = pool.free_async(failed.allocation, s).unwrap_err();
    assert_eq!(failed.error, PoolError::StreamCapturing { stream: s });
    assert!(failed.to_string().contains("captured"));
    assert_eq!(pool.stats(), before, "a failed call changed the pool");
    let x = failed.allocation;
    assert_eq!((x.ptr(), x.size()), (addr, 4096));
    assert!(dev.end_capture(s).is_err());
    pool.free_raw(p, s).unwrap();
    pool.free_async(x, s).unwrap();
    assert_eq!(pool.stats().used_current, 0);
    // The freed memory is still handed out correctly.
    let y = pool.alloc_async(4096, s).unwrap();
    assert!(y.ptr() == addr || y.ptr() == p);
    pool.free_async(y, s).unwrap();
}

/// Rule: a retired stream — alloc and free on it are `StreamRetired`.
#[test]
fn retired_stream_is_a_typed_error() {
    let dev = Arc::new(host());
    let pool = pool(&dev, config());
    let s = streams(&*dev, 2);
    let x = pool.alloc_async(4096, s[0]).unwrap();
    let cached = pool.alloc_async(8192, s[0]).unwrap();
    pool.free_async(cached, s[0]).unwrap();
    pool.retire_stream(s[0]).unwrap();
    assert_eq!(
        pool.alloc_async(4096, s[0]).unwrap_err(),
        PoolError::StreamRetired { stream: s[0] }
    );
    // No memory, but the stream is named all the same.
    assert_eq!(
        pool.alloc_async(0, s[0]).unwrap_err(),
        PoolError::StreamRetired { stream: s[0] }
    );
    let failed = pool.free_async(x, s[0]).unwrap_err();
    assert_eq!(failed.error, PoolError::StreamRetired { stream: s[0] });
    let before = pool.stats();
    pool.free_async(failed.allocation, s[1]).unwrap();
    assert_eq!(pool.stats().frees, before.frees + 1);
    assert_eq!(pool.stats().used_current, 0);
    dev.destroy_stream(s[0]).unwrap();
    // The retired stream's cached free went back to the pool.
    let y = pool.alloc_async(8192, s[1]).unwrap();
    pool.free_async(y, s[1]).unwrap();
}

/// Rule: an allocation freed through another pool is `WrongPool`, comes
/// back, changes neither pool, and frees through its own pool.
#[test]
fn wrong_pool_gives_the_allocation_back() {
    let dev = Arc::new(host());
    let p1 = pool(&dev, config());
    let p2 = pool(&dev, config());
    let s = dev.create_stream().unwrap();
    let x = p1.alloc_async(4096, s).unwrap();
    let addr = x.ptr();
    let (b1, b2) = (p1.stats(), p2.stats());
    let failed = p2.free_async(x, s).unwrap_err();
    assert_eq!(failed.error, PoolError::WrongPool { ptr: addr });
    assert_eq!((p1.stats(), p2.stats()), (b1, b2));
    p1.free_async(failed.allocation, s).unwrap();
    assert_eq!(p1.stats().used_current, 0);
}

/// Rule: raw API — double free, unknown pointer, interior pointer, another
/// pool's pointer: each a typed error that changes nothing, the memory
/// still freeable correctly afterwards.
#[test]
fn raw_api_errors_change_nothing() {
    let dev = Arc::new(host());
    let pool = pool(&dev, config());
    let other = pool_other(&dev);
    let s = dev.create_stream().unwrap();
    let p = pool.alloc_raw(4096, s).unwrap();
    let q = pool.alloc_raw(8192, s).unwrap();
    let before = pool.stats();

    let interior = q + 512;
    assert_eq!(
        pool.free_raw(interior, s).unwrap_err(),
        PoolError::InteriorPointer {
            ptr: interior,
            base: q
        }
    );
    let far = q + (64 << 20);
    assert!(pool.contains(far));
    assert_eq!(
        pool.free_raw(far, s).unwrap_err(),
        PoolError::UnknownPointer { ptr: far }
    );
    assert_eq!(
        pool.free_raw(0x1000, s).unwrap_err(),
        PoolError::UnknownPointer { ptr: 0x1000 }
    );
    let foreign = other.alloc_raw(4096, s).unwrap();
    assert_eq!(
        pool.free_raw(foreign, s).unwrap_err(),
        PoolError::ForeignPointer {
            ptr: foreign,
            owner_pool: other.id()
        }
    );
    assert_eq!(
        pool.record_use_raw(foreign, s).unwrap_err(),
        PoolError::ForeignPointer {
            ptr: foreign,
            owner_pool: other.id()
        }
    );
    assert_eq!(pool.stats(), before, "an error changed the pool");
    assert_eq!(
        (pool.raw_size(p), pool.raw_size(q)),
        (Some(4096), Some(8192))
    );

    pool.free_raw(p, s).unwrap();
    let after_free = pool.stats();
    assert_eq!(
        pool.free_raw(p, s).unwrap_err(),
        PoolError::DoubleFree { ptr: p }
    );
    assert_eq!(pool.stats(), after_free, "a double free changed the pool");
    assert_eq!(pool.raw_size(p), None);
    // Allocated again at the same address: live again, freeable once.
    let p2 = pool.alloc_raw(4096, s).unwrap();
    assert_eq!(p2, p, "same-stream reuse");
    pool.free_raw(p2, s).unwrap();
    pool.free_raw(q, s).unwrap();
    other.free_raw(foreign, s).unwrap();
    assert_eq!(pool.stats().used_current, 0);
    assert_eq!(other.stats().used_current, 0);
    for e in [
        PoolError::DoubleFree { ptr: p },
        PoolError::UnknownPointer { ptr: far },
        PoolError::InteriorPointer {
            ptr: interior,
            base: q,
        },
        PoolError::ForeignPointer {
            ptr: foreign,
            owner_pool: other.id(),
        },
    ] {
        assert!(e.to_string().contains("0x"), "{e}");
    }
}

fn pool_other(dev: &Arc<HostDevice>) -> MemPool<HostDevice> {
    pool(dev, config())
}

/// Rule: two threads racing to free the same raw pointer: exactly one
/// succeeds, the other gets `DoubleFree`; the pool stays consistent.
#[test]
fn racing_raw_frees_exactly_one_wins() {
    let dev = Arc::new(host());
    let pool = pool(&dev, config());
    let s = streams(&*dev, 2);
    for i in 0..400 {
        let p = pool.alloc_raw(4096 + (i % 4) * 512, s[0]).unwrap();
        let barrier = Barrier::new(2);
        let results: Vec<Result<(), PoolError>> = std::thread::scope(|sc| {
            let h: Vec<_> = s
                .iter()
                .map(|&st| {
                    let (pool, barrier) = (&pool, &barrier);
                    sc.spawn(move || {
                        barrier.wait();
                        pool.free_raw(p, st)
                    })
                })
                .collect();
            h.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let oks = results.iter().filter(|r| r.is_ok()).count();
        assert_eq!(oks, 1, "iteration {i}: {results:?}");
        assert!(
            results.contains(&Err(PoolError::DoubleFree { ptr: p })),
            "{results:?}"
        );
    }
    let st = pool.stats();
    assert_eq!((st.used_current, st.allocs, st.frees), (0, 400, 400));
}

// ----- fault injection -----

type Faulty = FaultInjector<HostDevice>;

fn faulty() -> Arc<Faulty> {
    Arc::new(FaultInjector::new(host()))
}

fn oom_error() -> SysError {
    SysError::OutOfMemory {
        op: Op::CreatePhysical,
        requested: PAGE,
        available: 0,
    }
}

/// Rule: a device out-of-memory on growth is the pool's OutOfMemory with
/// the cause; nothing is corrupted, and the next allocation works.
#[test]
fn failed_create_physical_is_out_of_memory_and_recoverable() {
    let dev = faulty();
    let pool = pool(&dev, config());
    let s = dev.create_stream().unwrap();
    let x = pool.alloc_async(PAGE, s).unwrap();
    dev.inner().write_words(x.ptr(), &[1, 2, 3]).unwrap();
    let before = pool.stats();
    dev.fail_from(Op::CreatePhysical, 1, oom_error());
    let err = pool.alloc_async(PAGE, s).unwrap_err();
    let PoolError::OutOfMemory(r) = &err else {
        panic!("{err:?}")
    };
    assert_eq!(r.cause, Some(oom_error()));
    let st = pool.stats();
    assert_eq!(st.reserved_current, before.reserved_current);
    assert_eq!(st.growths, before.growths);
    assert_eq!(st.used_current, before.used_current);
    assert_eq!(st.ooms, 1);
    dev.clear();
    let y = pool.alloc_async(PAGE, s).unwrap();
    assert_ne!(y.ptr(), x.ptr());
    dev.inner().write_words(y.ptr(), &[7; 16]).unwrap();
    for a in [x, y] {
        pool.free_async(a, s).unwrap();
    }
    pool.trim_to(0).unwrap();
    assert_eq!(pool.stats().reserved_current, 0);
    assert_eq!(dev.inner().live_handles(), 0);
}

/// Rule (step 6): a single transient device out-of-memory is retried after
/// other pools release their cache, so the allocation succeeds.
#[test]
fn transient_create_physical_failure_is_retried() {
    let dev = faulty();
    let pool = pool(&dev, config());
    let s = dev.create_stream().unwrap();
    dev.fail_nth(Op::CreatePhysical, 1, oom_error());
    let x = pool.alloc_async(PAGE, s).unwrap();
    assert_eq!(pool.stats().ooms, 0);
    pool.free_async(x, s).unwrap();
}

/// Rule: a failed map (or set-access) is a Device error; the pool's
/// bookkeeping stays true (reserved = pages held), later allocations work
/// and every page is accounted for at trim.
#[test]
fn failed_map_or_set_access_is_a_device_error_and_recoverable() {
    for op in [Op::Map, Op::SetAccess] {
        let dev = faulty();
        let pool = pool(&dev, config());
        let s = dev.create_stream().unwrap();
        let injected = SysError::Injected { op, call: 1 };
        dev.fail_nth(op, 1, injected.clone());
        let err = pool.alloc_async(PAGE, s).unwrap_err();
        assert_eq!(err, PoolError::Device(injected), "{op}");
        let st = pool.stats();
        assert_eq!(st.used_current, 0);
        assert_eq!(st.allocs, 0);
        assert_eq!(
            st.reserved_current,
            (st.growths - st.releases) * PAGE as u64
        );
        assert_eq!(
            dev.inner().live_mappings(),
            0,
            "{op}: a failed mapping stayed"
        );
        let x = pool.alloc_async(PAGE, s).unwrap();
        let y = pool.alloc_async(3 * PAGE, s).unwrap();
        dev.inner().write_words(x.ptr(), &[1; 8]).unwrap();
        dev.inner()
            .write_words(y.ptr() + 2 * PAGE as u64, &[2; 8])
            .unwrap();
        let st = pool.stats();
        assert_eq!(
            st.reserved_current,
            (st.growths - st.releases) * PAGE as u64
        );
        assert!(st.reserved_current >= 4 * PAGE as u64);
        pool.free_async(x, s).unwrap();
        pool.free_async(y, s).unwrap();
        pool.trim_to(0).unwrap();
        assert_eq!(pool.stats().reserved_current, 0, "{op}");
        assert_eq!(
            dev.inner().live_handles(),
            0,
            "{op}: leaked a physical page"
        );
    }
}

/// Rule: a failed unmap or release during trim is a Device error that
/// keeps the page (reserved unchanged, data intact where live); the next
/// trim releases it.
#[test]
fn failed_trim_keeps_bookkeeping_true() {
    for op in [Op::Unmap, Op::ReleasePhysical] {
        let dev = faulty();
        let pool = pool(&dev, config());
        let s = dev.create_stream().unwrap();
        let keep = pool.alloc_async(PAGE, s).unwrap();
        let gone = pool.alloc_async(PAGE, s).unwrap();
        dev.inner().write_words(keep.ptr(), &[9; 32]).unwrap();
        pool.free_async(gone, s).unwrap();
        dev.synchronize_stream(s).unwrap();
        let before = pool.stats().reserved_current;
        dev.fail_nth(op, 1, SysError::Injected { op, call: 1 });
        let err = pool.trim_to(0).unwrap_err();
        assert!(matches!(err, PoolError::Device(_)), "{op}: {err:?}");
        assert_eq!(pool.stats().reserved_current, before, "{op}");
        pool.trim_to(0).unwrap();
        assert_eq!(pool.stats().reserved_current, PAGE as u64, "{op}");
        assert_eq!(dev.inner().read_words(keep.ptr(), 32).unwrap(), vec![9; 32]);
        pool.free_async(keep, s).unwrap();
        pool.trim_to(0).unwrap();
        assert_eq!(dev.inner().live_handles(), 0, "{op}");
    }
}

/// Rule: a failed event record (through the pool) is a Device error; the
/// pool keeps working and its reuse stays correct.
#[test]
fn failed_record_event_is_a_device_error() {
    let dev = faulty();
    let pool = pool(&dev, config());
    let s = streams(&*dev, 2);
    let x = pool.alloc_async(PAGE, s[0]).unwrap();
    pool.free_async(x, s[0]).unwrap();
    dev.fail_nth(
        Op::RecordEvent,
        1,
        SysError::Injected {
            op: Op::RecordEvent,
            call: 1,
        },
    );
    assert!(matches!(pool.record_event(s[0]), Err(PoolError::Device(_))));
    let ev = pool.record_event(s[0]).unwrap();
    pool.wait_event(s[1], &ev).unwrap();
    let y = pool.alloc_async(PAGE, s[1]).unwrap();
    pool.free_async(y, s[1]).unwrap();
}
