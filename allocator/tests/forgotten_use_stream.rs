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
