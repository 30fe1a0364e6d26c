//! A use stream the pool has forgotten (retired, its work known to the
//! pool complete) whose driver stream still runs: a free of a block that
//! declared it as a user waits for the work queued on it since.
//!
//! Host backend; work bounded by operation counts.

mod common;

use std::sync::Arc;
use tidepool_sys::Device;

const MIB: usize = 1 << 20;

/// The pool forgets `u` once its work known to the pool is done, but the
/// caller may queue more work on `u`'s driver stream afterwards (here a
/// blocked task standing for a kernel that reads the block it declared):
/// the free on `a` waits for that work, in stream order, and the block
/// goes to no other stream before it ends.
#[test]
fn a_free_waits_for_work_queued_on_a_forgotten_use_stream() {
    let dev = Arc::new(common::host_with_capacity(64 * MIB));
    let pool = common::pool(&dev, common::config().with_stream_cache_bytes(0));
    let (a, u, t) = (
        dev.create_stream().unwrap(),
        dev.create_stream().unwrap(),
        dev.create_stream().unwrap(),
    );
    let mut x = pool.alloc_async(4096, a).unwrap();
    pool.free_async(pool.alloc_async(4096, u).unwrap(), u)
        .unwrap();
    pool.record_use(&mut x, u);
    pool.retire_stream(u).unwrap();
    dev.synchronize_stream(u).unwrap();
    pool.trim_to(u64::MAX).unwrap();
    assert_eq!(pool.stream_footprint().table, 1, "u forgotten");
    // Work on u after the pool forgot it: still running at the free.
    let mut late = common::Blocker::on(&*dev, u);
    let ptr = x.ptr();
    pool.free_async(x, a).unwrap();
    assert!(
        !dev.query_stream(a).unwrap(),
        "a does not wait for the work queued on u"
    );
    // Another stream must not get the block while u's work runs.
    let y = pool.alloc_async(4096, t).unwrap();
    assert_ne!(y.ptr(), ptr, "t got the block u still uses");
    late.release();
    pool.free_async(y, t).unwrap();
    pool.synchronize().unwrap();
    let st = pool.stats();
    assert_eq!(st.used_current, 0, "{st:?}");
    dev.destroy_stream(u).unwrap();
}

/// The use stream forgotten and then destroyed with work still queued on
/// it: the free succeeds, and the block goes to no other stream until a
/// device-wide wait saw that work end, not even to one that waited on an
/// event the pool recorded on the use stream before it forgot it. The
/// pool has one page, the rest of it full of t's blocks, and neither
/// internal dependencies nor host waits: t either reuses the block or
/// runs out of memory.
#[test]
fn a_destroyed_forgotten_use_stream_holds_the_block_until_a_device_wide_wait() {
    const BLOCK: usize = 64 << 10;
    let dev = Arc::new(common::host_with_capacity(64 * MIB));
    let pool = common::pool(&dev, common::strict_config(1, true, true));
    let (a, u, t) = (
        dev.create_stream().unwrap(),
        dev.create_stream().unwrap(),
        dev.create_stream().unwrap(),
    );
    let mut x = pool.alloc_async(BLOCK, a).unwrap();
    pool.free_async(pool.alloc_async(BLOCK, u).unwrap(), u)
        .unwrap();
    pool.record_use(&mut x, u);
    let old = pool.record_event(u).unwrap();
    pool.retire_stream(u).unwrap();
    dev.synchronize_stream(u).unwrap();
    pool.trim_to(u64::MAX).unwrap();
    assert_eq!(
        pool.stream_footprint().table,
        1,
        "u forgotten (a alone left)"
    );
    let kept = common::fill_page_but_one(&pool, t, BLOCK);
    // Work on u after the pool forgot it, still queued when u is destroyed.
    let mut late = common::Blocker::on(&*dev, u);
    dev.destroy_stream(u).unwrap();
    let ptr = x.ptr();
    pool.free_async(x, a).unwrap();
    pool.synchronize_stream(a).unwrap();
    // t waits on the event of u recorded before u was forgotten: that
    // orders t after u's work then, not after the work queued since.
    pool.wait_event(t, &old).unwrap();
    match pool.alloc_async(BLOCK, t) {
        Ok(y) => panic!(
            "t got a block at {:#x} (the freed one: {ptr:#x}) while the destroyed u still uses it",
            y.ptr()
        ),
        Err(e) => assert!(e.is_out_of_memory(), "{e}"),
    }
    assert!(!late.done(), "u's queued work ran early");
    late.release();
    // A device-wide wait (synchronize) sees u's work end.
    pool.synchronize().unwrap();
    let y = pool
        .alloc_async(BLOCK, t)
        .expect("after a device-wide wait the block is t's");
    assert_eq!(y.ptr(), ptr);
    pool.free_async(y, t).unwrap();
    for k in kept {
        pool.free_async(k, t).unwrap();
    }
    pool.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    let st = pool.stats();
    assert_eq!((st.used_current, st.reserved_current), (0, 0), "{st:?}");
    assert_eq!(
        pool.stream_footprint().lingering,
        0,
        "u is purged after the wait"
    );
}
