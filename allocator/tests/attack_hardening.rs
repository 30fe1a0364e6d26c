//! Attacks from outside on the pool's contract: false out-of-memory
//! errors, reuse while earlier work may still run, exact statistics, and
//! streams the pool must refuse (another device's, destroyed, retired).
//! Streams are held busy by host tasks that block until the test releases
//! them, so no outcome depends on the speed of the machine.

mod common;

use common::*;
use std::sync::Arc;
use std::time::Duration;
use tidepool::{MemPool, PoolError, ReusePolicy};
use tidepool_sys::{Device, SysError};

const MIB: usize = 1 << 20;

fn policies() -> Vec<ReusePolicy> {
    let mut out = Vec::new();
    for bits in 0..16u8 {
        out.push(ReusePolicy {
            follow_event_dependencies: bits & 1 != 0,
            opportunistic: bits & 2 != 0,
            internal_dependencies: bits & 4 != 0,
            wait_for_pending_frees: bits & 8 != 0,
        });
    }
    out
}

fn is_foreign(e: &PoolError) -> bool {
    matches!(e, PoolError::Device(SysError::ForeignHandle { .. }))
}

/// Rule: a request of exactly the cap succeeds once every earlier free
/// is known complete, whatever the reuse switches, page size, stream cache
/// and the layout the frees of several streams left behind.
#[test]
fn whole_cap_after_fragmented_frees_of_several_streams() {
    for policy in policies() {
        for page in [PAGE, 2 * PAGE] {
            for cache in [0usize, 1 << 20, 256 << 20] {
                let cap = 8 * page;
                let dev = Arc::new(host());
                let pool = pool(
                    &dev,
                    config()
                        .with_max_size(cap as u64)
                        .with_page_size(page)
                        .with_stream_cache_bytes(cache)
                        .with_reuse(policy)
                        .with_last_resort_wait(Duration::ZERO),
                );
                let ss = streams(&*dev, 3);
                let mut rng = Rng(0x9e37 ^ page as u64 ^ cache as u64);
                let mut live = Vec::new();
                let mut total = 0usize;
                loop {
                    let size = rng.range(1, (page * 3 / 2) as u64) as usize;
                    let s = ss[rng.range(0, 2) as usize];
                    match pool.alloc_async(size, s) {
                        Ok(a) => {
                            total += size;
                            live.push(a)
                        }
                        Err(e) if e.is_out_of_memory() => break,
                        Err(e) => panic!("{e}"),
                    }
                }
                assert!(total > 0);
                // Free interleaved, each on a stream other than its own half
                // the time (after ordering that stream after the owner).
                let mut i = 0;
                while !live.is_empty() {
                    let a = live.remove((i * 7) % live.len());
                    let own = a.stream();
                    let s = if i % 2 == 0 { own } else { ss[(i / 2) % 3] };
                    if s != own {
                        let ev = pool.record_event(own).unwrap();
                        pool.wait_event(s, &ev).unwrap();
                    }
                    pool.free_async(a, s).unwrap();
                    i += 1;
                }
                pool.synchronize().unwrap();
                let st = pool.stats();
                assert!(st.reserved_current <= cap as u64);
                assert_eq!(st.used_current, 0);
                for size in [cap, cap - 1, cap - 4096] {
                    let a = pool.alloc_async(size, ss[size % 3]).unwrap_or_else(|e| {
                        panic!("false OOM: {policy:?} page {page} cache {cache} size {size}: {e}")
                    });
                    pool.free_async(a, ss[size % 3]).unwrap();
                    pool.synchronize().unwrap();
                }
                assert!(pool.stats().reserved_current <= cap as u64);
            }
        }
    }
}

/// Rule: with the host wait on, pending frees whose work ends later serve a
/// request of the whole cap; `Duration::MAX` waits as long as it takes.
/// The work is released from another thread at a point the test does not
/// control, so the request may find it pending or done: both must succeed.
#[test]
fn unbounded_last_resort_wait_serves_the_whole_cap() {
    for internal in [false, true] {
        let dev = Arc::new(host());
        let reuse = ReusePolicy {
            internal_dependencies: internal,
            ..ReusePolicy::default()
        };
        let pool = pool(
            &dev,
            config()
                .with_max_size(4 * MIB as u64)
                .with_reuse(reuse)
                .with_stream_cache_bytes(0)
                .with_last_resort_wait(Duration::MAX),
        );
        let ss = streams(&*dev, 3);
        let a = pool.alloc_async(MIB, ss[0]).unwrap();
        let b = pool.alloc_async(3 * MIB, ss[1]).unwrap();
        let mut b0 = Blocker::on(&*dev, ss[0]);
        let mut b1 = Blocker::on(&*dev, ss[1]);
        pool.free_async(a, ss[0]).unwrap();
        pool.free_async(b, ss[1]).unwrap();
        let t = std::thread::spawn(move || {
            b0.release();
            b1.release();
        });
        let c = pool.alloc_async(4 * MIB, ss[2]).unwrap();
        t.join().unwrap();
        pool.free_async(c, ss[2]).unwrap();
        assert_eq!(pool.stats().reserved_current, 4 * MIB as u64);
    }
}

/// Rule: a zero wait never blocks on work that cannot end before the
/// request returns (the stream of the pending free waits on work the
/// caller issues only afterwards): the request fails with out-of-memory
/// at once, counted once, and succeeds after the work is released.
#[test]
fn zero_wait_with_a_free_waiting_on_unissued_work() {
    for wait in [Duration::ZERO, Duration::from_millis(1)] {
        let dev = Arc::new(host());
        let reuse = ReusePolicy {
            internal_dependencies: false,
            ..ReusePolicy::default()
        };
        let pool = pool(
            &dev,
            config()
                .with_max_size(2 * MIB as u64)
                .with_reuse(reuse)
                .with_stream_cache_bytes(0)
                .with_last_resort_wait(wait),
        );
        let ss = streams(&*dev, 3);
        let a = pool.alloc_async(2 * MIB, ss[0]).unwrap();
        // ss[0]'s free waits on ss[1], which waits for the caller.
        let mut gate = Blocker::on(&*dev, ss[1]);
        let ev = pool.record_event(ss[1]).unwrap();
        pool.wait_event(ss[0], &ev).unwrap();
        pool.free_async(a, ss[0]).unwrap();
        for round in 1..=3u64 {
            let e = pool.alloc_async(2 * MIB, ss[2]).unwrap_err();
            assert!(e.is_out_of_memory(), "{e}");
            assert_eq!(pool.stats().ooms, round);
        }
        gate.release();
        pool.synchronize_stream(ss[0]).unwrap();
        let c = pool.alloc_async(2 * MIB, ss[2]).unwrap();
        pool.free_async(c, ss[2]).unwrap();
        let st = pool.stats();
        assert_eq!((st.allocs, st.frees, st.ooms), (2, 2, 3));
    }
}

/// Rule: memory freed on a stream whose work is still running is never
/// handed to another stream's work that could overlap it: tags written by
/// the new owner appear only after the old owner's work ran.
#[test]
fn tags_show_no_reuse_while_earlier_work_runs() {
    for policy in policies() {
        let dev = Arc::new(host());
        let pool = pool(
            &dev,
            config()
                .with_max_size(4 * MIB as u64)
                .with_reuse(policy)
                .with_stream_cache_bytes(0)
                .with_last_resort_wait(Duration::ZERO),
        );
        let ss = streams(&*dev, 3);
        let a = pool.alloc_async(4 * MIB, ss[0]).unwrap();
        let words = 4 * MIB / 4;
        let mut busy = Blocker::on(&*dev, ss[0]);
        // Old owner: writes tag 1 after the blocker, then checks it.
        let w = tag_kernel(&dev, ss[0], a.ptr(), words, 1);
        let (tx, old_saw) = std::sync::mpsc::channel();
        let ptr = a.ptr();
        dev.launch_on_words(ss[0], ptr, words * 4, move |r| {
            let ok = r.map(|w| {
                w.iter()
                    .all(|x| x.load(std::sync::atomic::Ordering::Relaxed) == 1)
            });
            let _ = tx.send(ok.unwrap_or(false));
        })
        .unwrap();
        pool.free_async(a, ss[0]).unwrap();
        match pool.alloc_async(4 * MIB, ss[1]) {
            Ok(b) => {
                // Only through an internal dependency: ss[1]'s work after ss[0]'s.
                assert!(policy.internal_dependencies, "{policy:?}");
                let w2 = tag_kernel(&dev, ss[1], b.ptr(), words, 2);
                busy.release();
                assert!(w.recv().unwrap());
                assert!(old_saw.recv().unwrap(), "{policy:?}: new owner wrote first");
                assert!(w2.recv().unwrap());
                // The new owner's tag is the last one written.
                pool.synchronize().unwrap();
                let seen = dev.read_words(b.ptr(), words).unwrap();
                assert!(
                    seen.iter().all(|&x| x == 2),
                    "{policy:?}: old owner wrote last"
                );
                pool.free_async(b, ss[1]).unwrap();
            }
            Err(e) => {
                assert!(e.is_out_of_memory(), "{e}");
                assert!(!policy.internal_dependencies, "{policy:?}: false OOM {e}");
                busy.release();
                assert!(w.recv().unwrap());
                assert!(old_saw.recv().unwrap());
            }
        }
        pool.synchronize().unwrap();
        assert_eq!(pool.stats().used_current, 0);
    }
}

/// Rule: a stream of another device instance is refused with a typed
/// error by every call that takes a stream, and nothing is lost: the
/// allocation comes back and frees normally on a stream of the device.
#[test]
fn foreign_stream_everywhere() {
    let dev = Arc::new(host());
    let other = Arc::new(host());
    let pool = pool(&dev, config().with_max_size(8 * MIB as u64));
    let s = dev.create_stream().unwrap();
    let f = other.create_stream().unwrap();
    // Let this thread's caches see the foreign stream id first.
    let other_pool = MemPool::new(other.clone(), config()).unwrap();
    let x = other_pool.alloc_async(4096, f).unwrap();
    other_pool.free_async(x, f).unwrap();

    let e = pool.alloc_async(4096, f).unwrap_err();
    assert!(is_foreign(&e), "alloc: {e}");
    let a = pool.alloc_async(4096, s).unwrap();
    let fe = pool.free_async(a, f).unwrap_err();
    assert!(is_foreign(&fe.error), "free: {}", fe.error);
    let a = fe.allocation;
    assert!(is_foreign(&pool.record_event(f).unwrap_err()));
    let ev = pool.record_event(s).unwrap();
    assert!(is_foreign(&pool.wait_event(f, &ev).unwrap_err()));
    assert!(is_foreign(&pool.synchronize_stream(f).unwrap_err()));
    assert!(is_foreign(&pool.retire_stream(f).unwrap_err()));
    pool.free_async(a, s).unwrap();
    pool.synchronize().unwrap();
    let st = pool.stats();
    assert_eq!((st.allocs, st.frees, st.used_current), (1, 1, 0));
}

/// Rule: a foreign stream declared with `record_use` does not make the
/// allocation impossible to free: either `record_use` refuses it, or the
/// free reports a typed error and a later free (on a stream of the
/// device) succeeds. Nothing leaks.
#[test]
fn foreign_stream_in_record_use_loses_nothing() {
    let dev = Arc::new(host());
    let other = Arc::new(host());
    let pool = pool(&dev, config().with_max_size(2 * MIB as u64));
    let s = dev.create_stream().unwrap();
    let f = other.create_stream().unwrap();
    let mut a = pool.alloc_async(2 * MIB, s).unwrap();
    pool.record_use(&mut a, f);
    // The free refuses the foreign user stream with a typed error; the
    // allocation comes back without it, so a second free succeeds.
    let fe = pool.free_async(a, s).unwrap_err();
    assert!(is_foreign(&fe.error), "{}", fe.error);
    let a = fe.allocation;
    assert!(!a.uses().contains(&f));
    pool.free_async(a, s).unwrap();
    pool.synchronize().unwrap();
    let b = pool.alloc_async(2 * MIB, s).unwrap();
    pool.free_async(b, s).unwrap();
    let st = pool.stats();
    assert_eq!((st.allocs, st.frees, st.used_current), (2, 2, 0));
}

/// Rule: retired and destroyed streams are refused with typed errors by
/// alloc, free, record_event, wait_event and synchronize_stream; the
/// allocation survives a refused free.
#[test]
fn retired_and_destroyed_streams_everywhere() {
    for check_capture in [true, false] {
        let dev = Arc::new(host());
        let pool = pool(&dev, config().with_check_capture(check_capture));
        let s = dev.create_stream().unwrap();
        let r = dev.create_stream().unwrap();
        let d = dev.create_stream().unwrap();
        let x = pool.alloc_async(4096, r).unwrap();
        pool.free_async(x, r).unwrap();
        pool.retire_stream(r).unwrap();
        let y = pool.alloc_async(4096, d).unwrap();
        pool.free_async(y, d).unwrap();
        pool.synchronize_stream(d).unwrap();
        dev.destroy_stream(d).unwrap();
        for bad in [r, d] {
            assert!(pool.alloc_async(4096, bad).is_err(), "alloc on {bad}");
            let a = pool.alloc_async(4096, s).unwrap();
            let fe = pool.free_async(a, bad).unwrap_err();
            let a = fe.allocation;
            if bad == d {
                assert!(pool.record_event(bad).is_err());
                assert!(pool.synchronize_stream(bad).is_err());
                let ev = pool.record_event(s).unwrap();
                assert!(pool.wait_event(bad, &ev).is_err());
            }
            pool.free_async(a, s).unwrap();
        }
        pool.synchronize().unwrap();
        let st = pool.stats();
        assert_eq!(st.used_current, 0);
        assert_eq!(st.allocs, st.frees);
        assert_eq!(st.allocs, 4);
    }
}

/// Rule: a stream declared with `record_use` and retired (not destroyed)
/// before the free does not make the allocation unfreeable.
#[test]
fn record_use_then_retire_loses_nothing() {
    let dev = Arc::new(host());
    let pool = pool(&dev, config().with_max_size(2 * MIB as u64));
    let s = dev.create_stream().unwrap();
    let u = dev.create_stream().unwrap();
    let mut a = pool.alloc_async(2 * MIB, s).unwrap();
    pool.record_use(&mut a, u);
    let mut busy = Blocker::on(&*dev, u);
    let flag = busy.flag();
    pool.retire_stream(u).unwrap();
    pool.free_async(a, s)
        .unwrap_or_else(|e| panic!("free after retiring a user stream: {}", e.error));
    // The memory is not reused before u's work ends.
    let other = dev.create_stream().unwrap();
    match pool.alloc_async(2 * MIB, other) {
        Ok(b) => {
            let seen = probe(&*dev, other, flag);
            // A correct pool cannot run the probe before the release, however
            // long this wait is; the wait only gives a broken one time to show.
            assert!(
                seen.recv_timeout(Duration::from_millis(200)).is_err(),
                "the new owner's work ran while the user stream was busy"
            );
            busy.release();
            assert!(
                seen.recv().unwrap(),
                "reused before the user stream's work ended"
            );
            pool.free_async(b, other).unwrap();
        }
        Err(e) => {
            assert!(e.is_out_of_memory(), "{e}");
            busy.release();
        }
    }
    pool.synchronize().unwrap();
    let c = pool.alloc_async(2 * MIB, other).unwrap();
    pool.free_async(c, other).unwrap();
    assert_eq!(pool.stats().used_current, 0);
}

/// Rule: statistics are exact after a known sequence, and reserved never
/// exceeds the cap, also after refused requests of cap + 1 and a
/// device out-of-memory.
#[test]
fn exact_statistics_and_reserved_within_cap() {
    let dev = Arc::new(host_with_capacity(6 * MIB));
    let cap = 8 * MIB as u64;
    let pool = pool(
        &dev,
        config()
            .with_max_size(cap)
            .with_last_resort_wait(Duration::ZERO),
    );
    let s = streams(&*dev, 2);
    let a = pool.alloc_async(3 * MIB, s[0]).unwrap();
    let z = pool.alloc_async(0, s[1]).unwrap();
    let e = pool.alloc_async(8 * MIB + 1, s[1]).unwrap_err();
    assert!(e.is_out_of_memory(), "{e}");
    let e = pool.alloc_async(5 * MIB, s[1]).unwrap_err(); // device has 6 MiB
    assert!(e.is_out_of_memory(), "{e}");
    let st = pool.stats();
    assert_eq!(st.reserved_current, 4 * MIB as u64);
    assert_eq!((st.allocs, st.frees, st.ooms), (2, 0, 2));
    assert_eq!(st.used_current, 3 * MIB as u64);
    let b = pool.alloc_async(MIB, s[1]).unwrap();
    pool.free_async(z, s[0]).unwrap();
    pool.free_async(a, s[0]).unwrap();
    let st = pool.stats();
    assert_eq!((st.allocs, st.frees), (3, 2));
    assert_eq!(st.used_current, MIB as u64);
    pool.free_async(b, s[1]).unwrap();
    pool.synchronize().unwrap();
    let st = pool.stats();
    assert_eq!(
        (st.allocs, st.frees, st.ooms, st.used_current),
        (3, 3, 2, 0)
    );
    assert!(st.reserved_current <= cap && st.reserved_high <= cap);
}

/// Rule: with the query-only reuse off but the host wait on, a free whose
/// work is already complete serves another stream: the wait would return
/// at once, so refusing the request is a false out-of-memory.
#[test]
fn completed_free_serves_with_host_wait_and_no_opportunistic_reuse() {
    for cache in [0usize, 256 << 20] {
        let dev = Arc::new(host());
        let reuse = ReusePolicy {
            opportunistic: false,
            internal_dependencies: false,
            wait_for_pending_frees: true,
            ..ReusePolicy::default()
        };
        let pool = pool(
            &dev,
            config()
                .with_max_size(4 * MIB as u64)
                .with_reuse(reuse)
                .with_stream_cache_bytes(cache)
                .with_last_resort_wait(Duration::ZERO),
        );
        let ss = streams(&*dev, 2);
        let a = pool.alloc_async(4 * MIB, ss[0]).unwrap();
        pool.free_async(a, ss[0]).unwrap();
        // The free's work is done (the device says so, not the pool).
        dev.synchronize_stream(ss[0]).unwrap();
        for round in 0..2 {
            let b = pool
                .alloc_async(4 * MIB, ss[1])
                .unwrap_or_else(|e| panic!("cache {cache} round {round}: false OOM: {e}"));
            pool.free_async(b, ss[1]).unwrap();
            dev.synchronize_stream(ss[1]).unwrap();
        }
        assert_eq!(pool.stats().ooms, 0);
    }
}

/// Rule: with an unbounded host wait, a pending free that will complete
/// serves the request even while other pending frees wait on work the
/// caller has not released yet (their streams wait on a gate that the
/// caller opens only after the request returns). The wait must not block
/// on the frees that cannot complete. The free that can complete is
/// released by a helper thread once the pool is seen polling (by its
/// count of event queries), so the request surely reaches the host wait.
/// The timeout only catches a hang; a correct pool passes at any speed.
#[test]
fn unbounded_wait_is_not_stuck_behind_a_free_that_waits_on_the_caller() {
    use std::sync::mpsc::channel;
    use tidepool_sys::{FaultInjector, Op};
    let dev = Arc::new(FaultInjector::new(host()));
    let reuse = ReusePolicy {
        internal_dependencies: false,
        ..ReusePolicy::default()
    };
    let pool = pool(
        &dev,
        config()
            .with_max_size(4 * MIB as u64)
            .with_reuse(reuse)
            .with_stream_cache_bytes(0)
            .with_last_resort_wait(Duration::MAX),
    );
    let ss = streams(&*dev, 6);
    let (gate_stream, served, req) = (ss[0], ss[4], ss[5]);
    let blocks: Vec<_> = (1..=4)
        .map(|i| pool.alloc_async(MIB, ss[i]).unwrap())
        .collect();
    let mut gate = Blocker::on(&*dev, gate_stream);
    let ev = pool.record_event(gate_stream).unwrap();
    for &s in &ss[1..=3] {
        pool.wait_event(s, &ev).unwrap();
    }
    let busy = Blocker::on(&*dev, served);
    for (i, a) in blocks.into_iter().enumerate() {
        pool.free_async(a, ss[i + 1]).unwrap();
    }
    let start = dev.calls(Op::QueryEvent);
    let watcher = {
        let dev = dev.clone();
        std::thread::spawn(move || {
            let mut busy = busy;
            while dev.calls(Op::QueryEvent) < start + 64 {
                std::thread::yield_now();
            }
            busy.release();
        })
    };
    let (tx, rx) = channel();
    let worker = {
        let pool = pool.clone();
        std::thread::spawn(move || {
            let _ = tx.send(pool.alloc_async(MIB, req));
        })
    };
    let got = rx.recv_timeout(Duration::from_secs(120));
    gate.release();
    worker.join().unwrap();
    watcher.join().unwrap();
    let b = got
        .expect("the request hung behind frees that wait on the caller")
        .unwrap();
    pool.free_async(b, req).unwrap();
    pool.synchronize().unwrap();
    assert_eq!(pool.stats().used_current, 0);
}

/// Rule: statistics stay exact on the stream-cache fast path.
#[test]
fn exact_statistics_on_the_cache_path() {
    let dev = Arc::new(host());
    let pool = pool(&dev, config().with_max_size(4 * MIB as u64));
    let s = dev.create_stream().unwrap();
    for _ in 0..100 {
        let a = pool.alloc_async(12_345, s).unwrap();
        pool.free_async(a, s).unwrap();
    }
    let st = pool.stats();
    assert_eq!((st.allocs, st.frees, st.used_current), (100, 100, 0));
    assert_eq!(st.used_high, 12_345);
    assert!(st.cache_hits >= 99, "{st:?}");
    assert_eq!(st.reserved_current, PAGE as u64);
}

/// Rule: a size-0 request names a stream too: another device's stream or
/// a destroyed one is refused as for any other size.
#[test]
fn size_zero_on_a_bad_stream() {
    let dev = Arc::new(host());
    let other = Arc::new(host());
    let pool = pool(&dev, config());
    let f = other.create_stream().unwrap();
    let d = dev.create_stream().unwrap();
    dev.destroy_stream(d).unwrap();
    let s = dev.create_stream().unwrap();
    for bad in [f, d] {
        assert!(
            pool.alloc_async(0, bad).is_err(),
            "size 0 on {bad} accepted"
        );
        let z = pool.alloc_async(0, s).unwrap();
        let fe = pool.free_async(z, bad).unwrap_err();
        pool.free_async(fe.allocation, s).unwrap();
    }
    let st = pool.stats();
    assert_eq!((st.allocs, st.frees), (2, 2));
}
