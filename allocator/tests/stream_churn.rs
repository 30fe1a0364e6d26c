//! Stream churn: a process that creates and retires streams for its whole
//! life (a stream per request, per worker, per replay) must not make the
//! pool keep something per stream it ever met. Rounds of: create a
//! stream, allocate and free on it, hand a block of a long-lived stream
//! to it with `record_use`, make a long-lived stream wait on it through
//! the pool, retire it, destroy it; three long-lived streams work
//! throughout. What the pool keeps per stream
//! ([`MemPool::stream_footprint`]) must stay under a bound that does not
//! depend on the number of rounds.
//!
//! Host backend; work bounded by round counts. Caught: completion and
//! clock entries kept for every forgotten stream (both maps and the
//! clocks grew by one entry per round), the ledger's donor list keeping
//! forgotten ids.

mod common;

use std::sync::Arc;
use tidepool::{MemPool, ReusePolicy, StreamFootprint};
use tidepool_sys::{Device, HostDevice, Stream};

const MIB: usize = 1 << 20;

/// One round on a fresh stream `s`, with long-lived stream `l` as its
/// partner.
fn round(pool: &MemPool<HostDevice>, dev: &HostDevice, l: Stream, i: usize) {
    let s = dev.create_stream().unwrap();
    let size = 4096 << (i % 5);
    let a = pool.alloc_async(size, s).unwrap();
    let b = pool.alloc_async(3 * size, s).unwrap();
    pool.free_async(a, s).unwrap();
    if i % 3 == 0 {
        // A block of the long-lived stream, used by `s` too.
        let mut x = pool.alloc_async(2 * size, l).unwrap();
        pool.record_use(&mut x, s);
        pool.free_async(x, l).unwrap();
    }
    let ev = pool.record_event(s).unwrap();
    pool.wait_event(l, &ev).unwrap();
    drop(ev);
    pool.free_async(b, s).unwrap();
    // The long-lived stream works (sizes that miss its cache now and then,
    // so that slow allocations observe what completed).
    let y = pool.alloc_async(size * (1 + i % 7), l).unwrap();
    pool.free_async(y, l).unwrap();
    pool.retire_stream(s).unwrap();
    // The stream's work is done before it goes (on the device: the pool
    // learns it by querying its events), so that what the pool keeps does
    // not depend on how fast the host streams run.
    dev.synchronize_stream(s).unwrap();
    dev.destroy_stream(s).unwrap();
}

/// The largest of each size over the rounds after `warm` of `rounds`.
fn churn(reuse: ReusePolicy, rounds: usize, warm: usize) -> StreamFootprint {
    let dev = Arc::new(common::host_with_capacity(256 * MIB));
    let pool = common::pool(&dev, common::config().with_reuse(reuse));
    let long = common::streams(&*dev, 3);
    let mut max = StreamFootprint::default();
    for i in 0..rounds {
        round(&pool, &dev, long[i % 3], i);
        if i % 97 == 0 {
            // Now and then the host waits for a long-lived stream.
            pool.synchronize_stream(long[i % 3]).unwrap();
        }
        let f = pool.stream_footprint();
        if i >= warm {
            max = StreamFootprint {
                table: max.table.max(f.table),
                forgotten: max.forgotten.max(f.forgotten),
                lingering: max.lingering.max(f.lingering),
                observed: max.observed.max(f.observed),
                synced: max.synced.max(f.synced),
                clock_entries: max.clock_entries.max(f.clock_entries),
                busy: max.busy.max(f.busy),
                watched: max.watched.max(f.watched),
                retired_waiting: max.retired_waiting.max(f.retired_waiting),
                donors: max.donors.max(f.donors),
                pending_streams: max.pending_streams.max(f.pending_streams),
                holds: max.holds.max(f.holds),
            };
        }
    }
    pool.synchronize().unwrap();
    let end = pool.stream_footprint();
    eprintln!("{reuse:?}: largest after round {warm}: {max:?}\nat the end: {end:?}");
    for s in long {
        pool.retire_stream(s).unwrap();
        dev.destroy_stream(s).unwrap();
    }
    max
}

/// `live`: streams in the table at most (three long-lived ones, the
/// churned one, retired ones whose last events are not seen complete
/// yet); `pending`: streams with frees pending at most (forgotten ones
/// included). Neither depends on the number of rounds: 1000, 3000 and
/// 6000 rounds gave the same largest sizes.
fn assert_bounded(f: StreamFootprint, live: usize, pending: usize) {
    assert!(f.table <= live, "stream table: {f:?}");
    assert!(f.busy <= live, "busy list: {f:?}");
    assert!(f.watched <= live, "watch list: {f:?}");
    assert!(f.retired_waiting <= live, "retired list: {f:?}");
    assert!(f.donors <= live, "donor list: {f:?}");
    // Runs of consecutive ids: split only by streams not forgotten yet.
    assert!(f.forgotten <= live, "forgotten ids: {f:?}");
    assert!(f.pending_streams <= pending, "pending index: {f:?}");
    assert!(f.lingering <= pending, "lingering completion: {f:?}");
    assert!(f.observed <= live + pending, "observed completion: {f:?}");
    assert!(f.synced <= live + pending, "synchronised completion: {f:?}");
    assert!(
        f.clock_entries <= live * (live + pending),
        "clock entries: {f:?}"
    );
}

/// Both policies in one test, one after the other, each on a device of
/// its own: a device's stream ids count up one per stream, so the ids of
/// the streams churned and forgotten form one run.
#[test]
fn churned_streams_leave_nothing_behind() {
    assert_bounded(churn(ReusePolicy::default(), 3000, 100), 8, 8);
    let reuse = ReusePolicy {
        opportunistic: false,
        ..ReusePolicy::default()
    };
    // Events are not polled between slow passes, and frees seen complete
    // only by a query stay guarded (reused by others through a dependency):
    // more retired streams wait, more forgotten ones are still named.
    assert_bounded(churn(reuse, 3000, 100), 32, 96);
}

const PAGE: usize = common::PAGE;

/// A page freed on a retired stream whose work is still running is not
/// handed to another stream, and the stream is not forgotten meanwhile;
/// once its work ran, the stream is forgotten, nothing of it is kept, and
/// the page is reused. Caught: a retired stream forgotten with an event
/// not seen complete (its free stayed guarded for ever: t never got the
/// page, and s's entries never went).
#[test]
fn a_retired_streams_running_free_waits_then_nothing_is_kept() {
    let dev = Arc::new(common::host_with_capacity(64 * MIB));
    let pool = common::pool(&dev, common::strict_config(2, true, true));
    let (s, t) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let kt = pool.alloc_async(PAGE, t).unwrap();
    let mut hold = common::Blocker::on(&*dev, s);
    let x = pool.alloc_async(PAGE, s).unwrap();
    pool.free_async(x, s).unwrap();
    pool.retire_stream(s).unwrap();
    match pool.alloc_async(PAGE, t) {
        Ok(_) => panic!("t got the page s's running work may still use"),
        Err(e) => assert!(e.is_out_of_memory(), "{e}"),
    }
    pool.trim_to(u64::MAX).unwrap();
    let f = pool.stream_footprint();
    assert_eq!((f.table, f.retired_waiting), (2, 1), "s is kept: {f:?}");

    hold.release();
    dev.synchronize_stream(s).unwrap();
    dev.destroy_stream(s).unwrap();
    // The trim sees s's last event complete, and s is forgotten.
    pool.trim_to(u64::MAX).unwrap();
    let f = pool.stream_footprint();
    assert_eq!(
        (f.table, f.retired_waiting, f.lingering),
        (1, 0, 0),
        "{f:?}"
    );
    assert_eq!((f.observed, f.synced, f.clock_entries), (0, 0, 0), "{f:?}");
    assert_eq!(f.pending_streams, 0, "{f:?}");
    let w = pool
        .alloc_async(PAGE, t)
        .expect("s's free is complete: reused");
    pool.free_async(w, t).unwrap();
    pool.free_async(kt, t).unwrap();
    pool.synchronize().unwrap();
}

/// Without opportunistic reuse, a free of a forgotten stream seen complete
/// only by an event query stays reusable only through a dependency: by
/// the stream that waited on an event of it (its clock entry is kept
/// while the free is guarded), not by one that did not; once the block is
/// reused, the next forget drops what was kept. One page, full of live
/// blocks but the freed one (a page with live blocks is not remapped).
/// Caught: a forgotten stream's frees settled complete whatever the policy
/// (t got the block); its completion and clock entries dropped while a
/// free still named it (u found no block).
#[test]
fn a_forgotten_streams_free_is_reused_by_the_rules() {
    const BLOCK: usize = 64 << 10;
    let dev = Arc::new(common::host_with_capacity(64 * MIB));
    let pool = common::pool(&dev, common::strict_config(1, true, false));
    let (s, t, u) = (
        dev.create_stream().unwrap(),
        dev.create_stream().unwrap(),
        dev.create_stream().unwrap(),
    );
    let ku = pool.alloc_async(BLOCK, u).unwrap();
    let x = pool.alloc_async(BLOCK, s).unwrap();
    let addr = x.ptr();
    let mut kept = vec![];
    while let Ok(k) = pool.alloc_async(BLOCK, t) {
        kept.push(k);
    }
    assert_eq!(kept.len(), PAGE / BLOCK - 2, "the page is full");
    pool.free_async(x, s).unwrap();
    let ev = pool.record_event(s).unwrap();
    pool.wait_event(u, &ev).unwrap();
    drop(ev);
    pool.retire_stream(s).unwrap();
    dev.synchronize_stream(s).unwrap();
    dev.destroy_stream(s).unwrap();
    // The trim sees s's events complete; s is forgotten.
    pool.trim_to(u64::MAX).unwrap();
    let f = pool.stream_footprint();
    assert_eq!((f.table, f.retired_waiting), (2, 0), "s forgotten: {f:?}");

    match pool.alloc_async(BLOCK, t) {
        Ok(_) => panic!("t got s's block with no dependency on s"),
        Err(e) => assert!(e.is_out_of_memory(), "{e}"),
    }
    let z = pool
        .alloc_async(BLOCK, u)
        .expect("u waited on s after the free: s's block is u's");
    assert_eq!(z.ptr(), addr);
    let f = pool.stream_footprint();
    assert_eq!(f.lingering, 1, "kept until the next forget: {f:?}");

    // Nothing names s now: the next forget drops what was kept of it.
    pool.free_async(z, u).unwrap();
    let v = dev.create_stream().unwrap();
    pool.retire_stream(v).unwrap();
    pool.synchronize().unwrap();
    let f = pool.stream_footprint();
    assert_eq!((f.table, f.lingering), (2, 0), "{f:?}");
    assert_eq!(f.clock_entries, 0, "{f:?}");
    dev.destroy_stream(v).unwrap();
    pool.free_async(ku, u).unwrap();
    for k in kept {
        pool.free_async(k, t).unwrap();
    }
    pool.synchronize().unwrap();
}

/// Events recorded while a stream was alive, held by the caller and used
/// after the stream is forgotten, bring it back neither into clocks nor
/// into what is known complete. Caught: `wait_event` merging the event's
/// whole clock (m's clock named s again); a host synchronisation with an
/// event of s marking s synchronised again.
#[test]
fn old_events_bring_back_no_forgotten_stream() {
    let dev = Arc::new(common::host_with_capacity(64 * MIB));
    let pool = common::pool(&dev, common::config());
    let (l, m) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    pool.free_async(pool.alloc_async(4096, m).unwrap(), m)
        .unwrap();
    let s = dev.create_stream().unwrap();
    pool.free_async(pool.alloc_async(4096, s).unwrap(), s)
        .unwrap();
    let ev_s = pool.record_event(s).unwrap();
    pool.wait_event(l, &ev_s).unwrap();
    // l's event carries l's clock, which names s.
    let ev_l = pool.record_event(l).unwrap();
    pool.retire_stream(s).unwrap();
    dev.synchronize_stream(s).unwrap();
    dev.synchronize_stream(l).unwrap();
    pool.trim_to(u64::MAX).unwrap();
    let f = pool.stream_footprint();
    assert_eq!((f.table, f.lingering, f.clock_entries), (2, 0, 0), "{f:?}");
    assert_eq!(f.synced, 0, "{f:?}");

    pool.wait_event(m, &ev_l).unwrap();
    let f = pool.stream_footprint();
    assert_eq!(f.clock_entries, 1, "m's clock names l only: {f:?}");
    pool.synchronize_event(&ev_s).unwrap();
    let f = pool.stream_footprint();
    assert_eq!(f.synced, 0, "s is not known again: {f:?}");
    pool.synchronize_event(&ev_l).unwrap();
    let f = pool.stream_footprint();
    assert_eq!(f.synced, 1, "l is: {f:?}");
    drop((ev_s, ev_l));
    dev.destroy_stream(s).unwrap();
    pool.synchronize().unwrap();
}
