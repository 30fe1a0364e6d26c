//! False out-of-memory errors and other defects found from outside the
//! pool: each test states the rule, and keeps streams busy with host tasks
//! that block until the test releases them, so that "pending" is certain
//! and no outcome depends on the speed of the machine.

mod common;

use common::*;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tidepool::{PoolError, ReusePolicy};
use tidepool_sys::{Device, DevicePtr, Event, HostDevice, Stream, SysError, SysResult};

const MIB: usize = 1 << 20;

/// Whether `[a, a+la)` and `[b, b+lb)` overlap.
fn overlaps(a: DevicePtr, la: usize, b: DevicePtr, lb: usize) -> bool {
    a < b + lb as u64 && b < a + la as u64
}

/// Rule: memory that no work ever touched is usable by any stream at once,
/// even when it lies next to a pending free of another stream (merging the
/// two ranges must not give the fresh bytes the free's guard).
#[test]
fn fresh_memory_next_to_a_pending_free_stays_usable() {
    let dev = Arc::new(host());
    let strict = ReusePolicy {
        internal_dependencies: false,
        wait_for_pending_frees: false,
        ..ReusePolicy::default()
    };
    let pool = pool(
        &dev,
        config()
            .with_max_size(2 * MIB as u64)
            .with_stream_cache_bytes(0)
            .with_reuse(strict),
    );
    let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let a = pool.alloc_async(700_000, s1).unwrap();
    let (a_ptr, a_len) = (a.ptr(), 700_416);
    let _busy = Blocker::on(&*dev, s1);
    pool.free_async(a, s1).unwrap();
    // Bytes 700,416 .. 2 MiB were never used: s2 gets them, no wait needed.
    let b = pool
        .alloc_async(900_000, s2)
        .unwrap_or_else(|e| panic!("false out-of-memory: {e}"));
    assert!(!overlaps(a_ptr, a_len, b.ptr(), 900_000));
    assert_eq!(pool.stats().growths, 1);
    pool.free_async(b, s2).unwrap();
}

/// Rule: with the default policy the same request needs no internal
/// dependency (s2 must not be made to wait for s1 for no reason).
#[test]
fn fresh_memory_next_to_a_pending_free_needs_no_dependency() {
    for cache in [0, 256 << 20] {
        let dev = Arc::new(host());
        let pool = pool(
            &dev,
            config()
                .with_max_size(2 * MIB as u64)
                .with_stream_cache_bytes(cache),
        );
        let (s1, s2) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
        let a = pool.alloc_async(700_000, s1).unwrap();
        let a_ptr = a.ptr();
        let busy = Blocker::on(&*dev, s1);
        pool.free_async(a, s1).unwrap();
        let b = pool.alloc_async(900_000, s2).unwrap();
        assert!(!overlaps(a_ptr, 700_416, b.ptr(), 900_000));
        assert_eq!(
            pool.stats().internal_dependencies,
            0,
            "stream cache {cache}: s2 was made to wait for s1"
        );
        // And s2's work really does not wait for s1's.
        let ran = probe(&*dev, s2, Arc::new(AtomicBool::new(true)));
        assert!(ran.recv().unwrap());
        assert!(!busy.done());
        pool.free_async(b, s2).unwrap();
    }
}

/// Rule: internal dependencies may make the allocating stream wait on
/// several streams: two adjacent pending frees of two streams serve one
/// request, and the request's work runs after both frees' work.
#[test]
fn adjacent_pending_frees_of_two_streams_serve_one_request() {
    let dev = Arc::new(host());
    let pool = pool(&dev, config().with_max_size(8 * MIB as u64));
    let (a, b, c) = (
        dev.create_stream().unwrap(),
        dev.create_stream().unwrap(),
        dev.create_stream().unwrap(),
    );
    let x = pool.alloc_async(3 * MIB, a).unwrap();
    let y = pool.alloc_async(5 * MIB, b).unwrap();
    assert_eq!(x.ptr() + 3 * MIB as u64, y.ptr(), "the blocks are adjacent");
    let mut busy_a = Blocker::on(&*dev, a);
    let mut busy_b = Blocker::on(&*dev, b);
    pool.free_async(x, a).unwrap();
    pool.free_async(y, b).unwrap();
    let z = pool
        .alloc_async(7 * MIB, c)
        .unwrap_or_else(|e| panic!("false out-of-memory: {e}"));
    assert!(pool.stats().internal_dependencies >= 2);
    assert_eq!(pool.stats().reserved_current, 8 * MIB as u64);
    // Work on c runs after the work of a and of b.
    let after_a = probe(&*dev, c, busy_a.flag());
    let after_b = probe(&*dev, c, busy_b.flag());
    busy_a.release();
    // c must still wait for b: no probe may have run yet. (A correct pool
    // passes however long this wait is; it only bounds how long a broken
    // one gets to show itself.)
    assert!(
        after_a.recv_timeout(Duration::from_millis(200)).is_err(),
        "work on c ran while b's free was pending"
    );
    busy_b.release();
    assert!(after_a.recv().unwrap(), "c ran before a's free completed");
    assert!(after_b.recv().unwrap(), "c ran before b's free completed");
    pool.free_async(z, c).unwrap();
}

/// A device that forwards every call to a host device and, the first time
/// the pool asks a second time whether an event completed (or waits for
/// one on the host), releases a blocked stream and lets its work finish
/// first. It reproduces, deterministically, a GPU finishing a free's work
/// between two questions of the pool.
struct FinishesWhenAsked {
    inner: HostDevice,
    queries: AtomicU64,
    gate: Mutex<Option<(Blocker, Stream)>>,
}

impl FinishesWhenAsked {
    fn finish(&self) {
        let held = self.gate.lock().unwrap().take();
        if let Some((mut blocker, stream)) = held {
            blocker.release();
            self.inner.synchronize_stream(stream).unwrap();
        }
    }
}

impl common::wrap::Hooks for FinishesWhenAsked {
    type Inner = HostDevice;
    fn inner(&self) -> &HostDevice {
        &self.inner
    }
    fn synchronize_stream(&self, stream: Stream) -> SysResult<()> {
        self.finish();
        self.inner.synchronize_stream(stream)
    }
    fn synchronize_device(&self) -> SysResult<()> {
        self.finish();
        self.inner.synchronize_device()
    }
    fn query_event(&self, event: Event) -> SysResult<bool> {
        if self.queries.fetch_add(1, Ordering::SeqCst) >= 1 {
            self.finish();
        }
        self.inner.query_event(event)
    }
    fn synchronize_event(&self, event: Event) -> SysResult<()> {
        self.finish();
        self.inner.synchronize_event(event)
    }
}

common::wrap::wrapped_device!(FinishesWhenAsked);

/// Rule: a request for the whole cap after same-stream frees succeeds.
/// The frees are safe for the stream in stream order; joining their pages
/// into one range maps them at new places at once: either their work is
/// complete (the last-resort host wait covers it, also when the work
/// completes while the pool is on its way to that wait), or the pages
/// move while it is pending and their old places stay mapped until it is
/// done.
#[test]
fn whole_cap_request_after_same_stream_frees_waits_for_them() {
    let dev = Arc::new(FinishesWhenAsked {
        inner: host(),
        queries: AtomicU64::new(0),
        gate: Mutex::new(None),
    });
    let pool = pool(
        &dev,
        config()
            .with_max_size(32 * MIB as u64)
            .with_last_resort_wait(Duration::from_secs(3600)),
    );
    let s = dev.create_stream().unwrap();
    let x = pool.alloc_async(20 * MIB, s).unwrap();
    let y = pool.alloc_async(12 * MIB, s).unwrap();
    // The stream's work before the frees is still running when the whole
    // cap is asked for.
    *dev.gate.lock().unwrap() = Some((Blocker::on(&dev.inner, s), s));
    let (xp, yp) = (x.ptr(), y.ptr());
    pool.free_async(x, s).unwrap();
    pool.free_async(y, s).unwrap();
    let z = pool
        .alloc_async(32 * MIB, s)
        .unwrap_or_else(|e| panic!("false out-of-memory: {e}"));
    let (moved, unsafe_unmaps) = pool.pending_move_counts();
    assert!(
        dev.gate.lock().unwrap().is_none() || moved > 0,
        "the pages neither waited for nor moved by stream order"
    );
    assert_eq!(unsafe_unmaps, 0);
    assert_eq!(pool.stats().reserved_current, 32 * MIB as u64);
    assert!(xp != z.ptr() || yp != z.ptr());
    pool.free_async(z, s).unwrap();
}

/// Rule: an unbounded last-resort wait is a valid setting.
#[test]
fn unbounded_last_resort_wait_is_accepted() {
    let dev = Arc::new(host());
    let pool = pool(
        &dev,
        config()
            .with_max_size(2 * MIB as u64)
            .with_last_resort_wait(Duration::MAX),
    );
    let (a, b) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let x = pool.alloc_async(2 * MIB, a).unwrap();
    pool.free_async(x, a).unwrap();
    let mut on = pool.reuse();
    on.internal_dependencies = false;
    pool.set_reuse(on);
    // Nothing pending blocks: the wait ends when a's work completes.
    let y = pool.alloc_async(2 * MIB, b).unwrap();
    pool.free_async(y, b).unwrap();
    // Nothing at all can free memory: out of memory, not a hang or panic.
    let z = pool.alloc_async(2 * MIB, b).unwrap();
    let err = pool.alloc_async(MIB, a).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    pool.free_async(z, b).unwrap();
}

/// Rule: an allocation whose declared user stream was destroyed (without
/// retirement) can still be freed; its memory is reused only once that
/// stream's queued work is known complete (a device-wide wait).
#[test]
fn free_after_the_declared_user_stream_was_destroyed() {
    let dev = Arc::new(host());
    let pool = pool(&dev, config().with_max_size(2 * MIB as u64));
    let (s, u) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let mut x = pool.alloc_async(2 * MIB, s).unwrap();
    pool.record_use(&mut x, u);
    let mut busy = Blocker::on(&*dev, u);
    let flag = busy.flag();
    dev.destroy_stream(u).unwrap();
    pool.free_async(x, s)
        .unwrap_or_else(|e| panic!("free after the user stream was destroyed: {e}"));
    assert_eq!(pool.stats().used_current, 0);
    assert_eq!(pool.stats().frees, 1);
    // Not reusable while the destroyed stream's work runs, on s or elsewhere.
    let t = dev.create_stream().unwrap();
    let mut off = pool.reuse();
    off.internal_dependencies = false;
    off.wait_for_pending_frees = false;
    pool.set_reuse(off);
    assert!(pool.alloc_async(2 * MIB, s).unwrap_err().is_out_of_memory());
    assert!(pool.alloc_async(2 * MIB, t).unwrap_err().is_out_of_memory());
    // After a synchronisation (device-wide for the destroyed stream) it is.
    busy.release();
    pool.synchronize().unwrap();
    assert!(flag.load(Ordering::SeqCst));
    let y = pool.alloc_async(2 * MIB, t).unwrap();
    pool.free_async(y, t).unwrap();
}

/// Rule: `alloc_raw(0)` and `free_raw(0)` are counted alike: neither is
/// (a null pointer may be freed any number of times, so allocations minus
/// frees stay the live allocations only if neither counts). Handles of
/// size 0 pair their allocation and free, and count both.
#[test]
fn zero_size_raw_allocations_are_counted_like_their_frees() {
    let dev = Arc::new(host());
    let pool = pool(&dev, config());
    let s = dev.create_stream().unwrap();
    let p = pool.alloc_raw(0, s).unwrap();
    assert_eq!(p, 0);
    pool.free_raw(p, s).unwrap();
    pool.free_raw(0, s).unwrap();
    let st = pool.stats();
    assert_eq!((st.allocs, st.frees), (0, 0));
    let q = pool.alloc_raw(4096, s).unwrap();
    pool.free_raw(q, s).unwrap();
    let a = pool.alloc_async(0, s).unwrap();
    pool.free_async(a, s).unwrap();
    let st = pool.stats();
    assert_eq!((st.allocs, st.frees, st.used_current), (2, 2, 0));
}

/// Rule: turning off the capture check keeps stream validation: a
/// destroyed stream is refused (typed error) and nothing changes.
#[test]
fn destroyed_streams_are_refused_without_the_capture_check() {
    let dev = Arc::new(host());
    let pool = pool(&dev, config().with_check_capture(false));
    let (s, gone) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let x = pool.alloc_async(4096, s).unwrap();
    dev.destroy_stream(gone).unwrap();
    let err = pool.alloc_async(4096, gone).unwrap_err();
    assert!(
        matches!(
            err,
            PoolError::Device(SysError::InvalidHandle { what: "stream", .. })
        ),
        "{err:?}"
    );
    let failed = pool.free_async(x, gone).unwrap_err();
    assert!(
        matches!(
            failed.error,
            PoolError::Device(SysError::InvalidHandle { what: "stream", .. })
        ),
        "{:?}",
        failed.error
    );
    let st = pool.stats();
    assert_eq!((st.allocs, st.frees, st.used_current), (1, 0, 4096));
    pool.free_async(failed.allocation, s).unwrap();
    assert_eq!(pool.stats().used_current, 0);
}

/// Rule: an out-of-memory of the device does not grow the pool: pages
/// created for a request that then failed are given back.
#[test]
fn device_out_of_memory_does_not_grow_the_pool() {
    let dev = Arc::new(host_with_capacity(8 * MIB));
    let pool = pool(&dev, config());
    let s = dev.create_stream().unwrap();
    let err = pool.alloc_async(16 * MIB, s).unwrap_err();
    let PoolError::OutOfMemory(r) = &err else {
        panic!("expected out of memory, got {err:?}")
    };
    assert!(r.cause.is_some(), "the device stopped growth: {r:?}");
    assert_eq!(pool.stats().reserved_current, 0, "{err}");
    assert_eq!(dev.mem_info().unwrap().free, 8 * MIB);
    assert_eq!(dev.live_handles(), 0);
    // The pool still works, and still keeps what it had before a failure.
    let x = pool.alloc_async(4 * MIB, s).unwrap();
    assert!(pool.alloc_async(6 * MIB, s).unwrap_err().is_out_of_memory());
    assert_eq!(pool.stats().reserved_current, 4 * MIB as u64);
    pool.free_async(x, s).unwrap();
}

/// Rule: a stream of another device is refused with a typed error, also
/// after this thread used it on its own device.
#[test]
fn a_stream_of_another_device_is_refused() {
    for check_capture in [true, false] {
        let (d1, d2) = (Arc::new(host()), Arc::new(host()));
        let pool = pool(&d1, config().with_check_capture(check_capture));
        let foreign = d2.create_stream().unwrap();
        // This thread has seen the stream (on its own device).
        assert!(!d2.is_capturing(foreign).unwrap());
        let err = pool.alloc_async(4096, foreign).unwrap_err();
        assert!(
            matches!(
                err,
                PoolError::Device(SysError::ForeignHandle { what: "stream", .. })
            ),
            "check_capture {check_capture}: {err:?}"
        );
        let s = d1.create_stream().unwrap();
        let x = pool.alloc_async(4096, s).unwrap();
        let failed = pool.free_async(x, foreign).unwrap_err();
        assert!(
            matches!(
                failed.error,
                PoolError::Device(SysError::ForeignHandle { .. })
            ),
            "{:?}",
            failed.error
        );
        pool.free_async(failed.allocation, s).unwrap();
        assert_eq!(pool.stats().allocs, 1);
    }
}

/// Rule: a failed call on another device's stream leaves nothing behind
/// that holds up the pool: synchronising, and settling the frees of a
/// stream destroyed without retirement, still work.
#[test]
fn a_failed_call_on_a_foreign_stream_does_not_hold_up_the_pool() {
    let (d1, d2) = (Arc::new(host()), Arc::new(host()));
    let pool = pool(&d1, config().with_max_size(2 * MIB as u64));
    let foreign = d2.create_stream().unwrap();
    let err = pool.record_event(foreign).unwrap_err();
    assert!(
        matches!(err, PoolError::Device(SysError::ForeignHandle { .. })),
        "{err:?}"
    );
    // A stream destroyed with a free pending: its memory comes back after
    // the device-wide wait of a synchronisation.
    let s = d1.create_stream().unwrap();
    let x = pool.alloc_async(2 * MIB, s).unwrap();
    pool.free_async(x, s).unwrap();
    d1.destroy_stream(s).unwrap();
    pool.synchronize().unwrap();
    let t = d1.create_stream().unwrap();
    let mut off = pool.reuse();
    off.internal_dependencies = false;
    off.wait_for_pending_frees = false;
    off.opportunistic = false;
    pool.set_reuse(off);
    let y = pool.alloc_async(2 * MIB, t).unwrap();
    pool.free_async(y, t).unwrap();
}
