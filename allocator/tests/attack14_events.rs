//! An event recorded through the pool on a forgotten stream, from the
//! thread that used the stream before it was forgotten.

mod common;

use std::sync::Arc;
use tidepool::PoolError;
use tidepool_sys::Device;

const MIB: usize = 1 << 20;

/// A thread that used a stream before it was forgotten may still hold its
/// entry among its recent ones; an event recorded through the pool on the
/// forgotten stream from that thread must be refused, as it is from any
/// other thread, and must not put the stream back on the pool's lists.
#[test]
fn an_event_on_a_forgotten_stream_is_refused_from_the_thread_that_used_it() {
    let dev = Arc::new(common::host_with_capacity(64 * MIB));
    let pool = common::pool(&dev, common::config());
    let s = dev.create_stream().unwrap();
    pool.free_async(pool.alloc_async(4096, s).unwrap(), s)
        .unwrap();
    pool.retire_stream(s).unwrap();
    dev.synchronize_stream(s).unwrap();
    pool.trim_to(u64::MAX).unwrap();
    let f = pool.stream_footprint();
    assert_eq!(
        (f.table, f.busy, f.watched),
        (0, 0, 0),
        "s forgotten: {f:?}"
    );
    let other = std::thread::scope(|sc| sc.spawn(|| pool.record_event(s).is_err()).join().unwrap());
    assert!(other, "refused from another thread");
    let here = pool.record_event(s);
    let f = pool.stream_footprint();
    assert!(
        matches!(here, Err(PoolError::StreamRetired { .. })),
        "event recorded on the forgotten stream; footprint now {f:?}"
    );
    assert_eq!((f.busy, f.watched), (0, 0), "{f:?}");
    dev.destroy_stream(s).unwrap();
}

/// Whatever the thread that still holds a forgotten stream's entry can
/// record on it, the pool's lists drop the forgotten id again once the
/// pool waits for everything; many such events keep nothing.
#[test]
fn events_on_a_forgotten_stream_leave_nothing_on_the_lists() {
    let dev = Arc::new(common::host_with_capacity(64 * MIB));
    let pool = common::pool(&dev, common::config());
    let l = dev.create_stream().unwrap();
    let s = dev.create_stream().unwrap();
    pool.free_async(pool.alloc_async(4096, s).unwrap(), s)
        .unwrap();
    pool.retire_stream(s).unwrap();
    dev.synchronize_stream(s).unwrap();
    pool.trim_to(u64::MAX).unwrap();
    let mut recorded = 0;
    let mut most = 0;
    for _ in 0..100 {
        if let Ok(ev) = pool.record_event(s) {
            recorded += 1;
            pool.wait_event(l, &ev).unwrap();
        }
        pool.free_async(pool.alloc_async(1 << 20, l).unwrap(), l)
            .unwrap();
        let f = pool.stream_footprint();
        most = most.max(f.busy + f.watched);
    }
    eprintln!("{recorded} events recorded on the forgotten stream; busy + watched at most {most}");
    assert!(most <= 4, "lists grow: {most}");
    dev.synchronize_stream(s).unwrap();
    pool.synchronize().unwrap();
    pool.trim_to(u64::MAX).unwrap();
    let f = pool.stream_footprint();
    assert_eq!((f.table, f.busy, f.watched), (1, 0, 0), "{f:?}");
    assert_eq!((f.observed, f.synced, f.clock_entries), (0, 1, 0), "{f:?}");
    dev.destroy_stream(s).unwrap();
}
