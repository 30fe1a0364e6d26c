//! The slow path's pass over busy streams asks a stream with uncovered
//! frees and no event pending whether its work is all done, and closes its
//! open epoch as complete when it is. Attacked through `MemPool` on the
//! host backend (real memory, worker-thread streams):
//! - a stream held busy (by this thread or by work another thread queued)
//!   must never see its frees handed to another stream, neither before an
//!   event is recorded on it nor while one is pending and more frees come;
//! - a free with a declared use on a busy stream, made on an idle stream,
//!   waits for that use;
//! - with opportunistic reuse off an idle stream's free still goes to
//!   another stream only through a dependency;
//! - with it on, an idle stream's free is taken at once (no growth).
//!
//! Safety is checked both by offsets (no byte of a pending free handed
//! out) and by data: blocks the other stream got are filled at once, and
//! the held stream's queued "kernel" writes the freed block after its
//! hold; the other stream's words must survive.
//! Work is bounded by operation counts.

mod common;

use common::{tag_kernel, Blocker};
use std::sync::Arc;
use tidepool::{Allocation, MemPool, PoolConfig, ReusePolicy};
use tidepool_sys::{Device, DevicePtr, FaultInjector, HostDevice, Op, Stream};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const SIZES: [usize; 6] = [4 * KIB, 64 * KIB, MIB, 2 * MIB, 8 * MIB, 34 * MIB];

fn config(opportunistic: bool, deps: bool, cache: bool) -> PoolConfig {
    let cfg = common::config().with_reuse(ReusePolicy {
        follow_event_dependencies: deps,
        opportunistic,
        // No stream waits for another's pending free: a block handed out
        // must be free of pending work outright.
        internal_dependencies: false,
        wait_for_pending_frees: false,
    });
    if cache {
        cfg
    } else {
        cfg.with_stream_cache_bytes(0)
    }
}

fn overlaps(a: &Allocation, ptr: DevicePtr, len: usize) -> bool {
    a.ptr() < ptr + len as u64 && ptr < a.ptr() + a.size() as u64
}

fn words(size: usize) -> usize {
    size.min(64 * KIB) / 4
}

/// `t` allocates `n` blocks of `size`, none touching any of `pending`;
/// each is filled at once with its own tag (as a kernel on an idle `t`
/// would), and returned with the tag.
fn take_on(
    dev: &HostDevice,
    pool: &MemPool<HostDevice>,
    t: Stream,
    size: usize,
    n: usize,
    pending: &[(DevicePtr, usize)],
    tag: &mut u32,
) -> Vec<(Allocation, u32)> {
    let mut got = Vec::new();
    for _ in 0..n {
        let a = pool.alloc_async(size, t).expect("alloc on t");
        for &(p, len) in pending {
            assert!(
                !overlaps(&a, p, len),
                "t got {:#x}+{} inside a free still pending at {p:#x}+{len}",
                a.ptr(),
                a.size()
            );
        }
        *tag += 1;
        dev.write_words(a.ptr(), &vec![*tag; words(size)])
            .expect("fill");
        got.push((a, *tag));
    }
    got
}

fn check_and_free(
    dev: &HostDevice,
    pool: &MemPool<HostDevice>,
    t: Stream,
    got: Vec<(Allocation, u32)>,
) {
    for (a, tag) in got {
        let w = dev.read_words(a.ptr(), words(a.size())).expect("read");
        assert!(
            w.iter().all(|&x| x == tag),
            "t's block at {:#x} was overwritten by work on a freeing stream",
            a.ptr()
        );
        pool.free_async(a, t).expect("free on t");
    }
}

/// Stream `s` frees blocks its held work still writes; `t` allocates the
/// same sizes. The hold is put on `s` by this thread or by another
/// (`other_thread`), as is the writing kernel.
fn held_stream(cache: bool, other_thread: bool) {
    let dev = Arc::new(common::host());
    let pool = common::pool(&dev, config(true, true, cache));
    let st = common::streams(&*dev, 2);
    let (s, t) = (st[0], st[1]);
    let mut tag = 0u32;
    for round in 0..3 {
        for &size in &SIZES {
            let x = pool.alloc_async(size, s).expect("alloc on s");
            let (xp, xl) = (x.ptr(), x.size());
            let (mut hold, wrote) = if other_thread {
                let d = dev.clone();
                std::thread::spawn(move || {
                    let h = Blocker::on(&*d, s);
                    let r = tag_kernel(&d, s, xp, words(xl), 0xdead_0000 + round);
                    (h, r)
                })
                .join()
                .expect("thread")
            } else {
                let h = Blocker::on(&*dev, s);
                let r = tag_kernel(&dev, s, xp, words(xl), 0xdead_0000 + round);
                (h, r)
            };
            pool.free_async(x, s).expect("free on s");
            let got = take_on(&dev, &pool, t, size, 3, &[(xp, xl)], &mut tag);
            assert!(!hold.done(), "the hold is still in place");
            hold.release();
            assert!(
                wrote.recv().expect("kernel ran"),
                "s's kernel saw its block mapped"
            );
            check_and_free(&dev, &pool, t, got);
        }
    }
    pool.synchronize().expect("sync");
}

#[test]
fn a_held_stream_s_free_is_not_handed_to_another_stream() {
    held_stream(false, false);
    held_stream(true, false);
}

#[test]
fn work_queued_by_another_thread_keeps_the_stream_busy() {
    held_stream(false, true);
    held_stream(true, true);
}

/// An event is pending on `s` (recorded by `t`'s slow allocation while
/// `s` is held); more frees come on `s`, in the next epoch; `t` keeps
/// allocating: none of the frees may reach `t` before the hold ends.
#[test]
fn new_frees_behind_a_pending_event_stay_pending() {
    for cache in [false, true] {
        let dev = Arc::new(common::host());
        let pool = common::pool(&dev, config(true, true, cache));
        let st = common::streams(&*dev, 2);
        let (s, t) = (st[0], st[1]);
        let mut tag = 0u32;
        for &size in &SIZES {
            let x1 = pool.alloc_async(size, s).expect("alloc");
            let x2 = pool.alloc_async(size, s).expect("alloc");
            let mut hold = Blocker::on(&*dev, s);
            let w1 = tag_kernel(&dev, s, x1.ptr(), words(size), 0xaaaa);
            let w2 = tag_kernel(&dev, s, x2.ptr(), words(size), 0xbbbb);
            let mut pending = vec![(x1.ptr(), x1.size())];
            pool.free_async(x1, s).expect("free");
            // t's slow allocation records an event on s (its epoch closes
            // behind the hold).
            let mut got = take_on(&dev, &pool, t, size, 2, &pending, &mut tag);
            pending.push((x2.ptr(), x2.size()));
            pool.free_async(x2, s).expect("free");
            got.extend(take_on(&dev, &pool, t, size, 3, &pending, &mut tag));
            assert!(!hold.done());
            hold.release();
            assert!(w1.recv().expect("ran") && w2.recv().expect("ran"));
            check_and_free(&dev, &pool, t, got);
        }
        pool.synchronize().expect("sync");
    }
}

/// A block allocated on `s`, used by work on `u` behind a hold, freed on
/// idle `s` with the use declared: `t` must not get it while `u` holds.
#[test]
fn a_declared_use_on_a_held_stream_keeps_an_idle_stream_s_free_pending() {
    for cache in [false, true] {
        let dev = Arc::new(common::host());
        let pool = common::pool(&dev, config(true, true, cache));
        let st = common::streams(&*dev, 3);
        let (s, t, u) = (st[0], st[1], st[2]);
        let mut tag = 0u32;
        for &size in &SIZES {
            let mut x = pool.alloc_async(size, s).expect("alloc");
            let (xp, xl) = (x.ptr(), x.size());
            let mut hold = Blocker::on(&*dev, u);
            let wrote = tag_kernel(&dev, u, xp, words(xl), 0xcccc);
            pool.record_use(&mut x, u);
            // s has nothing queued of its own.
            pool.free_async(x, s).expect("free");
            let got = take_on(&dev, &pool, t, size, 3, &[(xp, xl)], &mut tag);
            assert!(!hold.done());
            hold.release();
            assert!(
                wrote.recv().expect("ran"),
                "u's kernel saw the block mapped"
            );
            check_and_free(&dev, &pool, t, got);
        }
        pool.synchronize().expect("sync");
    }
}

/// `s` is idle when it frees (its kernel finished, waited for on the
/// device behind the pool's back); `t` allocates the same
/// size. Opportunistic reuse on: `t` gets the block at once, with no
/// growth. Off: `t` must not get it until it waits on an event recorded
/// on `s` after the free (with event dependencies followed).
#[test]
fn an_idle_stream_s_free_follows_the_reuse_policy() {
    for &size in &SIZES[2..] {
        for (opportunistic, cache) in [(true, false), (false, false), (true, true), (false, true)] {
            let dev = Arc::new(FaultInjector::new(common::host()));
            let pool = MemPool::new(dev.clone(), config(opportunistic, true, cache)).expect("pool");
            let st = common::streams(&*dev, 2);
            let (s, t) = (st[0], st[1]);
            let what = format!("{size} B, opportunistic {opportunistic}, cache {cache}");
            // Keep t's stream state known to the pool.
            let warm = pool.alloc_async(size, t).expect("alloc");
            pool.free_async(warm, t).expect("free");
            pool.synchronize().expect("sync");
            let keep = pool.alloc_async(size, t).expect("alloc");
            let x = pool.alloc_async(size, s).expect("alloc");
            let (xp, xl) = (x.ptr(), x.size());
            assert!(tag_kernel(dev.inner(), s, xp, words(xl), 7)
                .recv()
                .expect("ran"));
            // Idle, and the pool is not told: only a query can see it.
            dev.inner().synchronize_stream(s).expect("device sync");
            pool.free_async(x, s).expect("free");
            let reserved = pool.stats().reserved_current;
            let events = dev.calls(Op::RecordEvent);
            let y = pool.alloc_async(size, t).expect("alloc");
            if opportunistic {
                assert_eq!(
                    (y.ptr(), pool.stats().reserved_current),
                    (xp, reserved),
                    "{what}: s is idle, its free is complete"
                );
                assert_eq!(
                    dev.calls(Op::RecordEvent),
                    events,
                    "{what}: an idle stream needs no event"
                );
                pool.free_async(y, t).expect("free");
            } else {
                assert!(
                    !overlaps(&y, xp, xl),
                    "{what}: opportunistic reuse is off, t has not waited on s"
                );
                let ev = pool.record_event(s).expect("record");
                pool.wait_event(t, &ev).expect("wait");
                let z = pool.alloc_async(size, t).expect("alloc");
                assert!(overlaps(&z, xp, xl), "{what}: t waited on s after its free");
                pool.free_async(z, t).expect("free");
                pool.free_async(y, t).expect("free");
            }
            pool.free_async(keep, t).expect("free");
            pool.synchronize().expect("sync");
        }
    }
}
