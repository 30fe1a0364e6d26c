//! `record_use` with a use stream that is retired, and forgotten, before
//! the allocation is freed. The use stream's driver stream may still be
//! alive and still run work that reads the block: the free must be
//! ordered after it (or wait for it), and must not be refused for ever.
//!
//! Host backend; work bounded by operation counts.

mod common;

use std::sync::Arc;
use tidepool_sys::Device;

const MIB: usize = 1 << 20;

/// A block of `a` used by `u`; `u` is retired (and forgotten once its work
/// ran, when `forget`), its driver stream still alive; then the block is
/// freed on `a`.
fn free_with_a_retired_use_stream(forget: bool) {
    let dev = Arc::new(common::host_with_capacity(64 * MIB));
    let pool = common::pool(&dev, common::config());
    let (a, u) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let mut x = pool.alloc_async(4096, a).unwrap();
    // u works with the pool, then is retired.
    pool.free_async(pool.alloc_async(4096, u).unwrap(), u)
        .unwrap();
    pool.record_use(&mut x, u);
    let mut hold = (!forget).then(|| common::Blocker::on(&*dev, u));
    pool.retire_stream(u).unwrap();
    if forget {
        dev.synchronize_stream(u).unwrap();
        pool.trim_to(u64::MAX).unwrap();
    }
    let f = pool.stream_footprint();
    let expected = if forget { 1 } else { 2 };
    assert_eq!(f.table, expected, "u forgotten: {forget}: {f:?}");
    // Freed from a thread that never used u (one that did may still
    // hold u's entry among its recent ones).
    let r = std::thread::scope(|sc| sc.spawn(|| pool.free_async(x, a)).join().unwrap());
    if let Some(h) = hold.as_mut() {
        // u still runs: the free made a wait for it.
        assert!(
            !dev.query_stream(a).unwrap(),
            "a does not wait for u's work"
        );
        h.release();
    }
    if let Err(e) = r {
        panic!("the free of a block used by a retired stream was refused: {e}");
    }
    pool.synchronize().unwrap();
    let st = pool.stats();
    assert_eq!(st.used_current, 0, "{st:?}");
    assert_eq!((st.allocs, st.frees), (2, 2), "{st:?}");
    dev.destroy_stream(u).unwrap();
}

#[test]
fn free_with_a_retired_use_stream_not_yet_forgotten() {
    free_with_a_retired_use_stream(false);
}

/// The pool keeps no entry of u, so the free cannot order itself after u
/// through the pool's events: it must still succeed (from a thread that
/// does not hold u's entry), not come back with the use still declared
/// and be refused for ever.
#[test]
fn free_with_a_forgotten_use_stream() {
    free_with_a_retired_use_stream(true);
}

/// As above, the use stream destroyed too (the free then waits for it
/// device-wide), the free made from the thread that used `u` (it may
/// still hold u's entry) or from another. Either way the free succeeds,
/// and once the pool waited for everything the block's memory is
/// released by a trim to 0.
fn free_with_a_forgotten_destroyed_use_stream(same_thread: bool) {
    let dev = Arc::new(common::host_with_capacity(64 * MIB));
    let pool = common::pool(&dev, common::config());
    let (a, u) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let mut x = pool.alloc_async(4096, a).unwrap();
    pool.free_async(pool.alloc_async(4096, u).unwrap(), u)
        .unwrap();
    pool.record_use(&mut x, u);
    pool.retire_stream(u).unwrap();
    dev.synchronize_stream(u).unwrap();
    pool.trim_to(u64::MAX).unwrap();
    dev.destroy_stream(u).unwrap();
    let f = pool.stream_footprint();
    assert_eq!((f.table, f.lingering), (1, 0), "u forgotten: {f:?}");
    let r = if same_thread {
        pool.free_async(x, a)
    } else {
        std::thread::scope(|sc| sc.spawn(|| pool.free_async(x, a)).join().unwrap())
    };
    if let Err(e) = r {
        panic!("the free of a block used by a destroyed, forgotten stream was refused: {e}");
    }
    pool.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    let st = pool.stats();
    assert_eq!((st.used_current, st.reserved_current), (0, 0), "{st:?}");
    let f = pool.stream_footprint();
    assert_eq!(f.lingering, 0, "{f:?}");
}

#[test]
fn free_with_a_forgotten_destroyed_use_stream_same_thread() {
    free_with_a_forgotten_destroyed_use_stream(true);
}

#[test]
fn free_with_a_forgotten_destroyed_use_stream_other_thread() {
    free_with_a_forgotten_destroyed_use_stream(false);
}
