//! Events of a stream recorded before it is forgotten and waited on
//! after: the wait orders the waiter after the stream's frees up to the
//! event, and only those; a free after the event stays out of the
//! waiter's reach. One page full of live blocks but the freed one (a page
//! with live blocks is not remapped), reuse without opportunistic reuse
//! and without the cache: a block is reused by the rules or not at all.
//!
//! Host backend; work bounded by operation counts.

mod common;

use std::sync::Arc;
use tidepool::{MemPool, PoolEvent, ReusePolicy};
use tidepool_sys::{Device, DevicePtr, HostDevice, Stream};

const MIB: usize = 1 << 20;
const PAGE: usize = common::PAGE;
const BLOCK: usize = 64 << 10;

fn pool(dev: &Arc<HostDevice>, follow: bool, internal: bool) -> MemPool<HostDevice> {
    common::pool(
        dev,
        common::config()
            .with_max_size(PAGE as u64)
            .with_stream_cache_bytes(0)
            .with_reuse(ReusePolicy {
                follow_event_dependencies: follow,
                opportunistic: false,
                internal_dependencies: internal,
                wait_for_pending_frees: false,
            }),
    )
}

struct Setup {
    dev: Arc<HostDevice>,
    pool: MemPool<HostDevice>,
    t: Stream,
    kept: Vec<tidepool::Allocation>,
    addr: DevicePtr,
    before: PoolEvent,
    after: PoolEvent,
}

/// s frees one block of the full page between two events it records;
/// then s is retired, its work runs, and it is forgotten.
fn setup(follow: bool, internal: bool) -> Setup {
    let dev = Arc::new(common::host_with_capacity(64 * MIB));
    let pool = pool(&dev, follow, internal);
    let (s, t) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let x = pool.alloc_async(BLOCK, s).unwrap();
    let addr = x.ptr();
    let kept = common::fill_page_but_one(&pool, t, BLOCK);
    let before = pool.record_event(s).unwrap();
    pool.free_async(x, s).unwrap();
    let after = pool.record_event(s).unwrap();
    pool.retire_stream(s).unwrap();
    dev.synchronize_stream(s).unwrap();
    dev.destroy_stream(s).unwrap();
    pool.trim_to(u64::MAX).unwrap();
    let f = pool.stream_footprint();
    assert_eq!((f.table, f.retired_waiting), (1, 0), "s forgotten: {f:?}");
    Setup {
        dev,
        pool,
        t,
        kept,
        addr,
        before,
        after,
    }
}

fn teardown(su: Setup) {
    for k in su.kept {
        su.pool.free_async(k, su.t).unwrap();
    }
    drop((su.before, su.after));
    su.pool.synchronize().unwrap();
    let st = su.pool.stats();
    assert_eq!(st.used_current, 0, "{st:?}");
    drop(su.pool);
    drop(su.dev);
}

fn oom(r: Result<tidepool::Allocation, tidepool::PoolError>, what: &str) {
    match r {
        Ok(a) => panic!("{what}: got {:#x}", a.ptr()),
        Err(e) => assert!(e.is_out_of_memory(), "{what}: {e}"),
    }
}

/// Following event dependencies: a stream that waits, after s is
/// forgotten, on s's event recorded before the free does not get the
/// block; one that waits on the event after the free does.
#[test]
fn an_old_event_orders_its_waiter_after_the_frees_before_it_only() {
    let su = setup(true, false);
    let (u, v) = (
        su.dev.create_stream().unwrap(),
        su.dev.create_stream().unwrap(),
    );
    oom(su.pool.alloc_async(BLOCK, su.t), "t, no dependency");
    su.pool.wait_event(u, &su.before).unwrap();
    oom(su.pool.alloc_async(BLOCK, u), "u waited before the free");
    su.pool.wait_event(v, &su.after).unwrap();
    let z = su
        .pool
        .alloc_async(BLOCK, v)
        .expect("v waited on s after the free");
    assert_eq!(z.ptr(), su.addr);
    su.pool.free_async(z, v).unwrap();
    teardown(su);
}

/// Not following event dependencies: waiting on the event after the free
/// gives no claim on the block.
#[test]
fn an_old_event_gives_nothing_when_dependencies_are_not_followed() {
    let su = setup(false, false);
    let v = su.dev.create_stream().unwrap();
    su.pool.wait_event(v, &su.after).unwrap();
    oom(
        su.pool.alloc_async(BLOCK, v),
        "v, dependencies not followed",
    );
    oom(su.pool.alloc_async(BLOCK, su.t), "t, no dependency");
    teardown(su);
}

/// Internal dependencies, dependencies not followed: s was forgotten
/// only once its events were seen complete, so its free is complete on
/// the device and another stream may take it with no wait; it must not
/// stay out of reach (out of memory with the block free and complete).
#[test]
fn internal_dependencies_reach_a_forgotten_streams_complete_free() {
    let su = setup(false, true);
    let a = su
        .pool
        .alloc_async(BLOCK, su.t)
        .expect("s's free is complete: t may take it");
    assert_eq!(a.ptr(), su.addr);
    su.pool.free_async(a, su.t).unwrap();
    teardown(su);
}

/// A host wait on an old event of the forgotten stream: the one from
/// before the free gives nobody the block, the one after it makes it free
/// for every stream.
#[test]
fn a_host_wait_on_an_old_event_settles_the_frees_before_it_only() {
    let su = setup(true, false);
    su.pool.synchronize_event(&su.before).unwrap();
    oom(
        su.pool.alloc_async(BLOCK, su.t),
        "t after a wait before the free",
    );
    su.pool.synchronize_event(&su.after).unwrap();
    let z = su
        .pool
        .alloc_async(BLOCK, su.t)
        .expect("the host waited for s's free");
    assert_eq!(z.ptr(), su.addr);
    su.pool.free_async(z, su.t).unwrap();
    teardown(su);
}
