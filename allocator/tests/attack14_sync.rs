//! A forgotten stream's frees and host synchronisation: under a reuse
//! policy without opportunistic reuse, a free of a retired stream seen
//! complete only by an event query stays guarded by the stream after it
//! is forgotten (reused by others through a dependency only). A host
//! wait on everything (`MemPool::synchronize`) must still make those
//! bytes free for every stream and releasable, as it does while the
//! retired stream is still in the table.
//!
//! Host backend; work bounded by operation counts.

mod common;

use std::sync::Arc;
use tidepool_sys::Device;

const MIB: usize = 1 << 20;

/// s frees a block of a page full of t's live blocks (a page with live
/// blocks is not remapped), is retired, its work runs, and the pool
/// forgets it (`forget` true) or not yet (the control: s retired, kept in
/// the table by a running event). Then the host waits for everything
/// with `synchronize`: s's block is free for t, and once everything is
/// freed a trim to 0 releases everything.
fn synchronize_frees_a_retired_streams_block(forget: bool) {
    const BLOCK: usize = 64 << 10;
    let dev = Arc::new(common::host_with_capacity(64 * MIB));
    let pool = common::pool(&dev, common::strict_config(1, true, false));
    let (s, t) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let x = pool.alloc_async(BLOCK, s).unwrap();
    let addr = x.ptr();
    let kept = common::fill_page_but_one(&pool, t, BLOCK);
    let mut hold = common::Blocker::on(&*dev, s);
    pool.free_async(x, s).unwrap();
    pool.retire_stream(s).unwrap();
    if forget {
        hold.release();
        dev.synchronize_stream(s).unwrap();
        // The trim sees s's last event complete (a query): s is forgotten.
        pool.trim_to(u64::MAX).unwrap();
        let f = pool.stream_footprint();
        assert_eq!((f.table, f.retired_waiting), (1, 0), "s forgotten: {f:?}");
        assert_eq!(f.lingering, 1, "s's free still guarded: {f:?}");
        match pool.alloc_async(BLOCK, t) {
            Ok(_) => panic!("t got s's block, complete by a query only, with no dependency"),
            Err(e) => assert!(e.is_out_of_memory(), "{e}"),
        }
    } else {
        let f = pool.stream_footprint();
        assert_eq!((f.table, f.retired_waiting), (2, 1), "s kept: {f:?}");
        hold.release();
    }
    pool.synchronize().unwrap();
    dev.destroy_stream(s).unwrap();
    let y = pool
        .alloc_async(BLOCK, t)
        .expect("everything was synchronised: s's block is free for t");
    assert_eq!(y.ptr(), addr);
    pool.free_async(y, t).unwrap();
    for k in kept {
        pool.free_async(k, t).unwrap();
    }
    pool.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    let st = pool.stats();
    assert_eq!(st.reserved_current, 0, "{st:?}");
    assert_eq!(st.used_current, 0, "{st:?}");
    assert_eq!(st.allocs, st.frees, "{st:?}");
    let f = pool.stream_footprint();
    assert_eq!((f.lingering, f.clock_entries), (0, 0), "{f:?}");
}

#[test]
fn synchronize_frees_a_retired_streams_block_before_it_is_forgotten() {
    synchronize_frees_a_retired_streams_block(false);
}

/// After s is forgotten, s is no longer in the stream table that
/// `synchronize` walks; its block, still guarded by s's epoch, must all
/// the same be free for t once everything was synchronised (and not stay
/// reusable only by a stream that waited on an old event of s).
#[test]
fn synchronize_frees_a_forgotten_streams_block() {
    synchronize_frees_a_retired_streams_block(true);
}
