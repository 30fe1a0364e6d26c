//! Contract tests of the reuse rules (docs/design.md, "The contract and where
//! each rule comes from"): same stream, follow event dependencies,
//! opportunistic, internal dependencies, never too early, cross-stream frees
//! and declared uses. Each test keeps the freeing stream busy where it
//! matters, so that no other rule can explain a reuse.

mod common;

use common::*;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tidepool::ReusePolicy;
use tidepool_sys::{Device, FaultInjector, Op};

fn only(reuse: impl FnOnce(&mut ReusePolicy)) -> ReusePolicy {
    let mut r = ReusePolicy::default();
    reuse(&mut r);
    r
}

/// Rule: memory freed on S is reusable by S at once, with no event.
/// Catches: dropping the own-stream arm of `classify` (cache off: the pool
/// records/queries events and grows), or a stream cache that misses.
#[test]
fn same_stream_reuse_is_immediate_and_needs_no_event() {
    for cache in [256 << 20, 0] {
        for size in [4096, PAGE] {
            let dev = Arc::new(FaultInjector::new(host()));
            let pool = pool(&dev, config().with_stream_cache_bytes(cache));
            let s = dev.create_stream().unwrap();
            // s's earlier work never completes during the test: only stream
            // order can justify the reuse.
            let busy = Blocker::on(&*dev, s);
            let x = pool.alloc_async(size, s).unwrap();
            let addr = x.ptr();
            pool.free_async(x, s).unwrap();
            let before = pool.stats();
            let records = dev.calls(Op::RecordEvent);
            let queries = dev.calls(Op::QueryEvent);
            let y = pool.alloc_async(size, s).unwrap();
            assert_eq!(
                y.ptr(),
                addr,
                "cache {cache}, size {size}: own free not reused"
            );
            let after = pool.stats();
            assert_eq!(after.growths, before.growths, "cache {cache}: grew");
            assert_eq!(after.reserved_current, before.reserved_current);
            assert_eq!(after.internal_dependencies, 0);
            assert_eq!(
                dev.calls(Op::RecordEvent),
                records,
                "cache {cache}: recorded an event"
            );
            assert_eq!(
                dev.calls(Op::QueryEvent),
                queries,
                "cache {cache}: queried an event"
            );
            assert!(!busy.done());
            pool.free_async(y, s).unwrap();
            drop(busy);
        }
    }
}

/// Rule: one block larger than the whole stream cache still stays on the
/// stream's fast path (a cache hit), and costs no footprint: under a cap,
/// another stream ordered after the free still gets that memory.
/// Catches: a cache that refuses blocks above its limit (the 1 GiB pair took
/// the arena path, 45 µs on the H200), or cached memory that the other
/// streams cannot reach before growing.
#[test]
fn a_block_larger_than_the_cache_stays_on_the_fast_path_without_footprint() {
    let dev = Arc::new(host());
    let big = 4 * PAGE;
    let pool = pool(
        &dev,
        config()
            .with_stream_cache_bytes(PAGE)
            .with_max_size(big as u64),
    );
    let s = streams(&*dev, 2);
    let x = pool.alloc_async(big, s[0]).unwrap();
    let addr = x.ptr();
    pool.free_async(x, s[0]).unwrap();
    let before = pool.stats();
    let y = pool.alloc_async(big, s[0]).unwrap();
    let after = pool.stats();
    assert_eq!(y.ptr(), addr);
    assert_eq!(after.cache_hits, before.cache_hits + 1, "not a cache hit");
    pool.free_async(y, s[0]).unwrap();
    let ev = pool.record_event(s[0]).unwrap();
    pool.wait_event(s[1], &ev).unwrap();
    let z = pool
        .alloc_async(big, s[1])
        .expect("the cached block must be reachable from another stream under the cap");
    assert_eq!(z.ptr(), addr);
    assert_eq!(pool.stats().reserved_current, big as u64);
    pool.free_async(z, s[1]).unwrap();
}

/// Rule: B waited (through the pool) on an event recorded on A after the
/// free: B reuses A's memory with no internal dependency, while A is still
/// busy (so opportunistic reuse cannot explain it).
/// Catches: dropping the follow-event-dependencies arm of `classify`
/// (B grows instead), or a clock merge that is not made on `wait_event`.
#[test]
fn follow_event_dependencies_reuses_while_freeing_stream_is_busy() {
    for cache in [256 << 20, 0] {
        let dev = Arc::new(host());
        let pool = pool(&dev, config().with_stream_cache_bytes(cache));
        let s = streams(&*dev, 2);
        let (a, b) = (s[0], s[1]);
        let busy = Blocker::on(&*dev, a);
        let x = pool.alloc_async(PAGE, a).unwrap();
        let addr = x.ptr();
        pool.free_async(x, a).unwrap();
        let ev = pool.record_event(a).unwrap();
        pool.wait_event(b, &ev).unwrap();
        let before = pool.stats();
        let y = pool.alloc_async(PAGE, b).unwrap();
        assert_eq!(
            y.ptr(),
            addr,
            "cache {cache}: B did not follow the event dependency"
        );
        let after = pool.stats();
        assert_eq!(after.internal_dependencies, 0);
        assert_eq!(after.growths, before.growths);
        assert_eq!(after.remaps, before.remaps);
        assert!(
            !busy.done(),
            "A must still be busy: no opportunistic explanation"
        );
        pool.free_async(y, b).unwrap();
    }
}

/// Rule: followed transitively through any chain of streams (100 streams,
/// each waiting on the previous one's event).
/// Catches: a wait that merges only the event's own stream, not its clock.
#[test]
fn follow_event_dependencies_is_transitive_over_100_streams() {
    let dev = Arc::new(host());
    let pool = pool(&dev, config());
    let s = streams(&*dev, 101);
    let busy = Blocker::on(&*dev, s[0]);
    let x = pool.alloc_async(PAGE, s[0]).unwrap();
    let addr = x.ptr();
    pool.free_async(x, s[0]).unwrap();
    for i in 1..s.len() {
        let ev = pool.record_event(s[i - 1]).unwrap();
        pool.wait_event(s[i], &ev).unwrap();
    }
    let y = pool.alloc_async(PAGE, s[100]).unwrap();
    assert_eq!(y.ptr(), addr);
    assert_eq!(pool.stats().internal_dependencies, 0);
    assert!(!busy.done());
    pool.free_async(y, s[100]).unwrap();
}

/// Rule: only an event recorded *after* the free orders it. A wait on an
/// event recorded before the free, or a chain with one link missing, does
/// not let B reuse A's memory while A is busy.
/// Catches: ignoring the epoch in the clock comparison (`>= epoch`).
#[test]
fn event_recorded_before_the_free_or_broken_chain_does_not_order_it() {
    let dev = Arc::new(host());
    let pool = pool(&dev, config());
    let s = streams(&*dev, 4);
    let (a, b) = (s[0], s[1]);
    let busy = Blocker::on(&*dev, a);
    let x = pool.alloc_async(PAGE, a).unwrap();
    let addr = x.ptr();
    let early = pool.record_event(a).unwrap();
    pool.free_async(x, a).unwrap();
    pool.wait_event(b, &early).unwrap();
    let y = pool.alloc_async(PAGE, b).unwrap();
    assert_ne!(
        y.ptr(),
        addr,
        "an event recorded before the free ordered it"
    );

    // Chain a -> s2, then s3 waits on an event of s2 recorded *before*
    // s2's wait: the link is missing.
    let (c, d) = (s[2], s[3]);
    let ev_c_early = pool.record_event(c).unwrap();
    let ev_a = pool.record_event(a).unwrap();
    pool.wait_event(c, &ev_a).unwrap();
    pool.wait_event(d, &ev_c_early).unwrap();
    let z = pool.alloc_async(PAGE, d).unwrap();
    assert_ne!(z.ptr(), addr, "a broken chain was followed");
    assert_eq!(pool.stats().internal_dependencies, 0);
    assert!(!busy.done());
    pool.free_async(y, b).unwrap();
    pool.free_async(z, d).unwrap();
}

/// Rule: with follow-event-dependencies off, B does not get A's memory
/// while A is busy, even after waiting on A's event.
/// Catches: a `classify` that ignores the switch.
#[test]
fn follow_event_dependencies_off_does_not_reuse() {
    let dev = Arc::new(host());
    let reuse = only(|r| r.follow_event_dependencies = false);
    let pool = pool(&dev, config().with_reuse(reuse));
    let s = streams(&*dev, 2);
    let (a, b) = (s[0], s[1]);
    let busy = Blocker::on(&*dev, a);
    let x = pool.alloc_async(PAGE, a).unwrap();
    let addr = x.ptr();
    pool.free_async(x, a).unwrap();
    let ev = pool.record_event(a).unwrap();
    pool.wait_event(b, &ev).unwrap();
    let before = pool.stats();
    let y = pool.alloc_async(PAGE, b).unwrap();
    assert_ne!(y.ptr(), addr);
    assert_eq!(pool.stats().growths, before.growths + 1);
    assert_eq!(pool.stats().internal_dependencies, 0);
    assert!(!busy.done());
    pool.free_async(y, b).unwrap();
    // The switch is also changeable at run time.
    pool.set_reuse(ReusePolicy::default());
    assert_eq!(pool.reuse(), ReusePolicy::default());
}

/// Rule: opportunistic — A's freeing work has completed; B (no dependency)
/// reuses the memory without a stream wait.
/// Catches: dropping the opportunistic arm of `classify`.
#[test]
fn opportunistic_reuse_of_completed_free() {
    let dev = Arc::new(host());
    let pool = pool(&dev, config());
    let s = streams(&*dev, 2);
    let (a, b) = (s[0], s[1]);
    let x = pool.alloc_async(PAGE, a).unwrap();
    let addr = x.ptr();
    pool.free_async(x, a).unwrap();
    // A is idle: its work before the free is complete. (No pool sync: that
    // would make it a host-synchronisation reuse instead.)
    dev.synchronize_stream(a).unwrap();
    let before = pool.stats();
    let y = pool.alloc_async(PAGE, b).unwrap();
    assert_eq!(y.ptr(), addr);
    let after = pool.stats();
    assert_eq!(after.growths, before.growths);
    assert_eq!(after.remaps, before.remaps);
    assert_eq!(after.internal_dependencies, 0);
    pool.free_async(y, b).unwrap();
}

/// Rule: opportunistic off — B, with no dependency, does not get A's
/// completed free at its address (it grows, or stitches the completed page
/// elsewhere).
/// Catches: a `classify` that ignores the opportunistic switch.
#[test]
fn opportunistic_off_does_not_reuse() {
    let dev = Arc::new(host());
    let reuse = only(|r| r.opportunistic = false);
    let pool = pool(&dev, config().with_reuse(reuse));
    let s = streams(&*dev, 2);
    let (a, b) = (s[0], s[1]);
    let x = pool.alloc_async(PAGE, a).unwrap();
    let addr = x.ptr();
    pool.free_async(x, a).unwrap();
    dev.synchronize_stream(a).unwrap();
    let y = pool.alloc_async(PAGE, b).unwrap();
    assert_ne!(y.ptr(), addr, "opportunistic reuse with the switch off");
    assert_eq!(pool.stats().internal_dependencies, 0);
    pool.free_async(y, b).unwrap();
}

/// Rule: internal dependency — nothing else works (pool capped at one
/// page, A busy): B gets A's memory, the pool inserted exactly one stream
/// wait, and B's later work runs only after A's blocked work.
/// Catches: taking the pending free without `wait_event` (the probe sees
/// A unfinished), or not counting it.
#[test]
fn internal_dependency_orders_allocating_stream_after_pending_free() {
    let dev = Arc::new(host());
    let pool = pool(&dev, config().with_max_size(PAGE as u64));
    let s = streams(&*dev, 2);
    let (a, b) = (s[0], s[1]);
    let mut busy = Blocker::on(&*dev, a);
    let x = pool.alloc_async(PAGE, a).unwrap();
    let addr = x.ptr();
    pool.free_async(x, a).unwrap();
    let y = pool.alloc_async(PAGE, b).unwrap();
    assert_eq!(y.ptr(), addr);
    let st = pool.stats();
    assert_eq!(st.internal_dependencies, 1);
    assert_eq!(st.reserved_current, PAGE as u64);
    let seen = probe(&*dev, b, busy.flag());
    std::thread::sleep(Duration::from_millis(20));
    assert!(
        seen.try_recv().is_err(),
        "B's work ran while A's free is pending"
    );
    busy.release();
    assert!(
        seen.recv().unwrap(),
        "B's work ran before A's earlier work finished"
    );
    pool.free_async(y, b).unwrap();
}

/// Rule: internal dependencies off (and no host wait) — the same situation
/// is out-of-memory, not a silent reuse.
/// Catches: `take_with_dependency` run regardless of the switch.
#[test]
fn internal_dependency_off_is_out_of_memory() {
    let dev = Arc::new(host());
    let reuse = only(|r| {
        r.internal_dependencies = false;
        r.wait_for_pending_frees = false;
    });
    let pool = pool(&dev, config().with_max_size(PAGE as u64).with_reuse(reuse));
    let s = streams(&*dev, 2);
    let (a, b) = (s[0], s[1]);
    let mut busy = Blocker::on(&*dev, a);
    let x = pool.alloc_async(PAGE, a).unwrap();
    pool.free_async(x, a).unwrap();
    let err = pool.alloc_async(PAGE, b).unwrap_err();
    assert!(err.is_out_of_memory(), "{err:?}");
    let st = pool.stats();
    assert_eq!((st.internal_dependencies, st.ooms), (0, 1));
    // Once A's work completes the memory is reusable (opportunistic).
    busy.release();
    dev.synchronize_stream(a).unwrap();
    let y = pool.alloc_async(PAGE, b).unwrap();
    pool.free_async(y, b).unwrap();
}

/// Rule: last resort — host wait for pending frees, bounded. With internal
/// dependencies off, an allocation waits for A's free to complete (the
/// blocker is released from another thread) and then succeeds; when the
/// free never completes it fails after about `last_resort_wait`.
#[test]
fn wait_for_pending_frees_is_a_bounded_last_resort() {
    let dev = Arc::new(host());
    let make = |bound: Duration| {
        let mut cfg = config()
            .with_max_size(PAGE as u64)
            .with_reuse(only(|r| r.internal_dependencies = false));
        cfg.last_resort_wait = bound;
        pool(&dev, cfg)
    };
    let s = streams(&*dev, 4);

    // Never completes within the bound: OOM, in bounded time.
    let short = make(Duration::from_millis(100));
    let (a, b) = (s[0], s[1]);
    let _busy = Blocker::on(&*dev, a);
    let x = short.alloc_async(PAGE, a).unwrap();
    short.free_async(x, a).unwrap();
    let t = Instant::now();
    let err = short.alloc_async(PAGE, b).unwrap_err();
    assert!(err.is_out_of_memory());
    // Only a bound against an unbounded wait (the bound is 100 ms), wide
    // enough for any loaded machine.
    assert!(t.elapsed() < Duration::from_secs(60), "unbounded wait");

    // Completes during the wait (released by another thread): success.
    let long = make(Duration::from_secs(20));
    let (a, b) = (s[2], s[3]);
    let mut busy = Blocker::on(&*dev, a);
    let x = long.alloc_async(PAGE, a).unwrap();
    let addr = x.ptr();
    long.free_async(x, a).unwrap();
    let releaser = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30));
        busy.release();
        busy
    });
    let y = long.alloc_async(PAGE, b).unwrap();
    let busy = releaser.join().unwrap();
    assert!(busy.done());
    assert_eq!(y.ptr(), addr);
    assert_eq!(long.stats().internal_dependencies, 0);
    long.free_async(y, b).unwrap();
}

/// Rule: never too early — a free on busy A is not handed to B (no
/// dependency) while A's work (a "kernel" writing a tag) is pending; B's
/// data survives A's late write.
/// Catches: `classify` accepting a pending guard of another stream.
#[test]
fn pending_free_is_not_handed_to_an_unordered_stream() {
    let dev = Arc::new(host());
    let pool = pool(&dev, config());
    let s = streams(&*dev, 2);
    let (a, b) = (s[0], s[1]);
    let mut busy = Blocker::on(&*dev, a);
    let x = pool.alloc_async(PAGE, a).unwrap();
    let addr = x.ptr();
    let kernel = tag_kernel(&dev, a, addr, PAGE / 4, 0xAAAA_AAAA);
    pool.free_async(x, a).unwrap();
    let y = pool.alloc_async(PAGE, b).unwrap();
    assert_ne!(y.ptr(), addr, "B got memory A's pending work still writes");
    assert_eq!(pool.stats().internal_dependencies, 0);
    let mine = pattern(7, 64);
    dev.write_words(y.ptr(), &mine).unwrap();
    busy.release();
    assert!(
        kernel.recv().unwrap(),
        "A's kernel found its memory unmapped"
    );
    dev.synchronize_stream(a).unwrap();
    assert_eq!(
        dev.read_words(y.ptr(), 64).unwrap(),
        mine,
        "A's late write hit B's data"
    );
    pool.free_async(y, b).unwrap();
}

/// Rule: a free on another stream than the allocation's is legal; the
/// memory then follows the freeing stream (reusable there at once), and a
/// third, unordered stream does not get it while the freeing stream is busy.
/// Catches: guarding a cross-stream free by the allocation's stream.
#[test]
fn cross_stream_free_is_guarded_by_the_freeing_stream() {
    let dev = Arc::new(host());
    let pool = pool(&dev, config());
    let s = streams(&*dev, 3);
    let (a, b, c) = (s[0], s[1], s[2]);
    let x = pool.alloc_async(PAGE, a).unwrap();
    let addr = x.ptr();
    let busy = Blocker::on(&*dev, b);
    pool.free_async(x, b).unwrap();
    // a is idle; the free is ordered on b, which is busy.
    let y = pool.alloc_async(PAGE, c).unwrap();
    assert_ne!(y.ptr(), addr, "C reused a free whose stream is still busy");
    let z = pool.alloc_async(PAGE, a).unwrap();
    assert_ne!(
        z.ptr(),
        addr,
        "the allocation's stream reused a free ordered on another"
    );
    let w = pool.alloc_async(PAGE, b).unwrap();
    assert_eq!(w.ptr(), addr, "the freeing stream reuses at once");
    assert_eq!(pool.stats().internal_dependencies, 0);
    assert!(!busy.done());
    for (m, st) in [(y, c), (z, a), (w, b)] {
        pool.free_async(m, st).unwrap();
    }
    assert_eq!(pool.stats().used_current, 0);
}

/// Rule: `record_use` — the free waits for the declared use: while the use
/// stream is busy a third stream does not get the memory (even though the
/// allocation's own stream is idle); the allocation's stream may reuse it,
/// and its later work runs after the use.
/// Catches: a `free_async` that ignores `uses` (the free would complete at
/// once on the idle stream and C would take it opportunistically).
#[test]
fn record_use_makes_the_free_wait_for_the_use() {
    let dev = Arc::new(host());
    let pool = pool(&dev, config());
    let s = streams(&*dev, 3);
    let (a, u, c) = (s[0], s[1], s[2]);
    let mut x = pool.alloc_async(PAGE, a).unwrap();
    let addr = x.ptr();
    pool.record_use(&mut x, u);
    pool.record_use(&mut x, a); // the own stream is not a "use"
    assert_eq!(x.uses(), &[u]);
    let mut busy = Blocker::on(&*dev, u);
    let kernel = tag_kernel(&dev, u, addr, 1024, 0x5555_5555);
    pool.free_async(x, a).unwrap();
    let y = pool.alloc_async(PAGE, c).unwrap();
    assert_ne!(y.ptr(), addr, "C got memory a declared use still works on");
    let z = pool.alloc_async(PAGE, a).unwrap();
    assert_eq!(
        z.ptr(),
        addr,
        "the freeing stream (ordered after the use) reuses"
    );
    let seen = probe(&*dev, a, busy.flag());
    busy.release();
    assert!(kernel.recv().unwrap());
    assert!(
        seen.recv().unwrap(),
        "a's work after the reuse ran before the use finished"
    );
    pool.free_async(y, c).unwrap();
    pool.free_async(z, a).unwrap();
}
