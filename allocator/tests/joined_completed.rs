//! A free the host has waited for stays usable by every stream when a
//! later free of the same stream, still pending, is given back next to
//! it. Stream `a` frees x0, closes the epoch with an event, and queues
//! more work behind a blocker; the host waits for the event (so x0 is
//! known complete, though no settle has run since), then `a` frees x1,
//! adjacent to x0, whose epoch is still pending. Stream `b` then asks for
//! x0's size and must be handed x0: joining the two frees under x1's
//! epoch would refuse x0 to `b` until `a`'s held work completes. Checked
//! with x1 above and below x0, with the frees going straight to the arena
//! (no stream cache) and through `a`'s cache flushed by a trim (both
//! frees reach the arena together). A control run without x1's free
//! shows that `b` gets x0 in this layout at all. Work is bounded by
//! operation counts.

mod common;

use common::Blocker;
use std::sync::Arc;
use tidepool::{Allocation, MemPool};
use tidepool_sys::{Device, HostDevice};

const MIB: usize = 1 << 20;
const BLOCK: usize = MIB;

/// A host device of 1 GiB (the shared test helper's).
fn device() -> Arc<HostDevice> {
    Arc::new(common::host())
}

fn pool(dev: &Arc<HostDevice>, cache: usize) -> MemPool<HostDevice> {
    common::pool(dev, common::config().with_stream_cache_bytes(cache))
}

/// Where x1 lies with respect to x0.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Side {
    Above,
    Below,
}

/// How the frees of `a` reach the arena.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Route {
    /// No stream cache: each free goes to the arena at once.
    Direct,
    /// A stream cache: both frees wait in `a`'s cache, and a trim (which
    /// flushes every busy stream's cache) gives them back together.
    CacheTrim,
}

/// One run; returns (x0's address, x1's address, where `b`'s block of
/// x0's size landed). `free_x1`: false for the control run.
fn run(side: Side, route: Route, free_x1: bool) -> (u64, u64, u64) {
    let what = format!("{side:?}, {route:?}, x1 freed: {free_x1}");
    let dev = device();
    let cache = match route {
        Route::Direct => 0,
        Route::CacheTrim => 64 * MIB,
    };
    let pool = pool(&dev, cache);
    let (a, b) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());

    // Three blocks side by side: two of `a`, then one of `b`.
    let p = pool.alloc_async(BLOCK, a).unwrap();
    let q = pool.alloc_async(BLOCK, a).unwrap();
    let x2 = pool.alloc_async(BLOCK, b).unwrap();
    assert_eq!(
        q.ptr(),
        p.ptr() + BLOCK as u64,
        "{what}: blocks side by side"
    );
    assert_eq!(
        x2.ptr(),
        q.ptr() + BLOCK as u64,
        "{what}: blocks side by side"
    );
    let (x0, x1): (Allocation, Allocation) = match side {
        Side::Above => (p, q),
        Side::Below => (q, p),
    };
    let (x0_at, x1_at) = (x0.ptr(), x1.ptr());

    let mut hold1 = Blocker::on(&*dev, a);
    pool.free_async(x0, a).unwrap();
    let ev = pool.record_event(a).unwrap();
    let mut hold2 = Blocker::on(&*dev, a);
    hold1.release();
    pool.synchronize_event(&ev).unwrap();
    assert!(!hold2.done(), "{what}: a's later work is still held");

    let mut x1 = Some(x1);
    if free_x1 {
        pool.free_async(x1.take().unwrap(), a).unwrap();
    }
    if route == Route::CacheTrim {
        pool.trim_to(u64::MAX).unwrap();
    }

    let y = pool.alloc_async(BLOCK, b).unwrap();
    let got = y.ptr();
    assert!(
        !(got < x1_at + BLOCK as u64 && x1_at < got + BLOCK as u64),
        "{what}: b got {got:#x}, over x1 {x1_at:#x}, whose free is still pending"
    );

    hold2.release();
    pool.synchronize().unwrap();
    for x in [Some(y), Some(x2), x1].into_iter().flatten() {
        pool.free_async(x, b).unwrap();
    }
    pool.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    let s = pool.stats();
    assert_eq!((s.used_current, s.reserved_current), (0, 0), "{what}");
    (x0_at, x1_at, got)
}

fn check(side: Side, route: Route) {
    let (x0, _, control) = run(side, route, false);
    assert_eq!(
        control, x0,
        "{side:?}, {route:?}: with x1 still in use, b is handed the completed x0"
    );
    let (x0, x1, got) = run(side, route, true);
    assert_eq!(
        got, x0,
        "{side:?}, {route:?}: b got {got:#x}, not the completed free x0 {x0:#x}: \
         x0 took the epoch of the pending free x1 {x1:#x} next to it"
    );
}

#[test]
fn completed_free_is_not_joined_to_a_later_pending_one_above() {
    check(Side::Above, Route::Direct);
}

#[test]
fn completed_free_is_not_joined_to_a_later_pending_one_below() {
    check(Side::Below, Route::Direct);
}

#[test]
fn cached_completed_free_is_not_joined_to_a_later_pending_one_above() {
    check(Side::Above, Route::CacheTrim);
}

#[test]
fn cached_completed_free_is_not_joined_to_a_later_pending_one_below() {
    check(Side::Below, Route::CacheTrim);
}
