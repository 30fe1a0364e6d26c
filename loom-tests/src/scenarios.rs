//! The models: each function is one execution (two threads, a few pool
//! operations each). Under `cfg(loom)` `tests/models.rs` hands them to
//! `loom::model`, which runs them once per interleaving; without loom the
//! unit tests run them on std threads. Every scenario ends by dropping the
//! pool and checking the model device for leaks (physical pages, mappings,
//! the reservation, events).

use crate::device::{ModelDevice, GRANULARITY};
use crate::sync::{thread, Arc, AtomicBool, Ordering};
use tidepool::{Allocation, MemPool, PoolConfig, PoolError, PoolEvent, ReusePolicy, Stream};
use tidepool_sys::Device;

/// Pages of the model device (the pools below never need more).
const CAPACITY_PAGES: usize = 4;
/// Pages of the pool's address space (the pool puts small blocks in the
/// first quarter, so that quarter holds `CAPACITY_PAGES`).
const VA_PAGES: usize = 4 * CAPACITY_PAGES;

fn config(stream_cache_bytes: usize) -> PoolConfig {
    let mut c = PoolConfig::default()
        .with_page_size(GRANULARITY)
        .with_va_size(VA_PAGES * GRANULARITY)
        .with_stream_cache_bytes(stream_cache_bytes);
    c.check_capture = false;
    // Step 8 (host wait for pending frees) polls until a deadline; in a
    // model, nothing completes while the thread polls, so poll once.
    c.last_resort_wait = std::time::Duration::ZERO;
    c
}

fn setup(stream_cache_bytes: usize) -> (Arc<ModelDevice>, MemPool<ModelDevice>) {
    let dev = Arc::new(ModelDevice::new(CAPACITY_PAGES));
    let pool = MemPool::new(dev.clone(), config(stream_cache_bytes)).expect("pool");
    (dev, pool)
}

fn alloc(dev: &ModelDevice, pool: &MemPool<ModelDevice>, size: usize, s: Stream) -> Allocation {
    let a = pool.alloc_async(size, s).expect("alloc");
    dev.claim(a.ptr(), a.size(), s);
    a
}

fn free(dev: &ModelDevice, pool: &MemPool<ModelDevice>, a: Allocation, s: Stream) {
    dev.unclaim(a.ptr(), s);
    pool.free_async(a, s).expect("free");
}

/// Drop the pool and check that the device got everything back.
fn teardown(dev: Arc<ModelDevice>, pool: MemPool<ModelDevice>) {
    let live = pool.stats().used_current;
    assert_eq!(live, 0, "scenario left live allocations");
    drop(pool);
    dev.assert_clean();
}

/// (a) Two threads allocate and free on one stream: the stream's private
/// cache (its shard, behind the stream's mutex) and the arena behind it.
/// The device checks that no two live allocations overlap and that all are
/// mapped; the end checks the counters.
pub fn shard_alloc_free() {
    let (dev, pool) = setup(1024);
    let s = dev.create_stream().unwrap();
    let worker = |dev: Arc<ModelDevice>, pool: MemPool<ModelDevice>| {
        move || {
            let x = alloc(&dev, &pool, 1000, s);
            free(&dev, &pool, x, s);
            alloc(&dev, &pool, 1000, s)
        }
    };
    let t1 = thread::spawn(worker(dev.clone(), pool.clone()));
    let t2 = thread::spawn(worker(dev.clone(), pool.clone()));
    let (y1, y2) = (t1.join().unwrap(), t2.join().unwrap());
    assert_ne!(y1.ptr(), y2.ptr());
    let st = pool.stats();
    assert_eq!((st.allocs, st.frees), (4, 2), "{st:?}");
    assert_eq!(st.used_current, 2000, "{st:?}");
    assert!(st.used_high >= 2000 && st.used_high <= 3000, "{st:?}");
    assert!(st.cache_hits <= 2, "{st:?}");
    free(&dev, &pool, y1, s);
    free(&dev, &pool, y2, s);
    teardown(dev, pool);
}

/// (b) Thread 1 frees a block on stream A (busy: its work never completes
/// on its own) while thread 2 records an event on A, makes B wait on it
/// through the pool and allocates on B. The device checks that B gets the
/// block only when B is ordered after the free's work (the event was
/// recorded after the free). Returns whether B reused the block.
pub fn cross_stream_event() -> bool {
    let (dev, pool) = setup(0);
    let a = dev.create_stream().unwrap();
    let b = dev.create_stream().unwrap();
    dev.set_busy(a, true);
    let x = alloc(&dev, &pool, GRANULARITY, a);
    let x_ptr = x.ptr();
    let t1 = {
        let (dev, pool) = (dev.clone(), pool.clone());
        thread::spawn(move || {
            dev.launch(a); // the kernel that uses x
            free(&dev, &pool, x, a);
        })
    };
    let t2 = {
        let (dev, pool) = (dev.clone(), pool.clone());
        thread::spawn(move || {
            let ev = pool.record_event(a).unwrap();
            pool.wait_event(b, &ev).unwrap();
            alloc(&dev, &pool, GRANULARITY, b)
        })
    };
    t1.join().unwrap();
    let y = t2.join().unwrap();
    let reused = y.ptr() == x_ptr;
    free(&dev, &pool, y, b);
    dev.complete_all();
    teardown(dev, pool);
    reused
}

/// (c) Thread 1 frees a block on busy stream A, then A's work completes;
/// thread 2 trims the pool to 0 meanwhile. Trim must never unmap a page of
/// the live block nor of the free while A's work on it is pending (the
/// device panics on such an unmap); once A is idle, a trim releases the
/// freed page. Returns the bytes the concurrent trim released.
pub fn trim_vs_pending() -> u64 {
    let (dev, pool) = setup(0);
    let a = dev.create_stream().unwrap();
    dev.set_busy(a, true);
    let x1 = alloc(&dev, &pool, GRANULARITY, a);
    let x2 = alloc(&dev, &pool, GRANULARITY, a);
    dev.launch(a); // work using both
    let t1 = {
        let (dev, pool) = (dev.clone(), pool.clone());
        thread::spawn(move || {
            free(&dev, &pool, x1, a);
            dev.set_busy(a, false);
        })
    };
    let t2 = {
        let pool = pool.clone();
        thread::spawn(move || pool.trim_to(0).unwrap())
    };
    t1.join().unwrap();
    let released = t2.join().unwrap();
    assert!(
        released <= GRANULARITY as u64,
        "trim released the live page"
    );
    assert!(dev.is_mapped(x2.ptr(), x2.size()));
    // A is idle now: the freed page goes, the live one stays.
    pool.trim_to(0).unwrap();
    let st = pool.stats();
    assert_eq!(st.reserved_current, GRANULARITY as u64, "{st:?}");
    assert_eq!(st.releases, 1, "{st:?}");
    free(&dev, &pool, x2, a);
    teardown(dev, pool);
    released
}

/// (d) Two threads free the same raw pointer: exactly one succeeds, the
/// other gets `DoubleFree`, and the pool counts one free.
pub fn raw_double_free() {
    let (dev, pool) = setup(1024);
    let s = dev.create_stream().unwrap();
    let p = pool.alloc_raw(1000, s).unwrap();
    let racer = |pool: MemPool<ModelDevice>| move || pool.free_raw(p, s);
    let t1 = thread::spawn(racer(pool.clone()));
    let t2 = thread::spawn(racer(pool.clone()));
    let (r1, r2) = (t1.join().unwrap(), t2.join().unwrap());
    match (&r1, &r2) {
        (Ok(()), Err(PoolError::DoubleFree { ptr }))
        | (Err(PoolError::DoubleFree { ptr }), Ok(())) => {
            assert_eq!(*ptr, p)
        }
        _ => panic!("racing free_raw: {r1:?} / {r2:?}"),
    }
    let st = pool.stats();
    assert_eq!((st.allocs, st.frees, st.used_current), (1, 1, 0), "{st:?}");
    assert_eq!(pool.raw_size(p), None);
    teardown(dev, pool);
}

/// (e) Each thread allocates, frees and allocates again on its own stream
/// (cache hits and arena fits); at the end the statistics match the live
/// set exactly.
pub fn stats_live_set() {
    let (dev, pool) = setup(1024);
    let s1 = dev.create_stream().unwrap();
    let s2 = dev.create_stream().unwrap();
    let worker = |dev: Arc<ModelDevice>, pool: MemPool<ModelDevice>, s: Stream, n: usize| {
        move || {
            let x = alloc(&dev, &pool, n, s);
            free(&dev, &pool, x, s);
            alloc(&dev, &pool, 2 * n, s)
        }
    };
    let t1 = thread::spawn(worker(dev.clone(), pool.clone(), s1, 500));
    let t2 = thread::spawn(worker(dev.clone(), pool.clone(), s2, 700));
    let (y1, y2) = (t1.join().unwrap(), t2.join().unwrap());
    let live = [&y1, &y2];
    let st = pool.stats();
    let sum: u64 = live.iter().map(|a| a.size() as u64).sum();
    assert_eq!(st.used_current, sum, "{st:?}");
    assert_eq!(st.allocs - st.frees, live.len() as u64, "{st:?}");
    assert!(st.used_high >= st.used_current, "{st:?}");
    // The peak is at least the larger of the two threads' own peaks and at
    // most everything at once.
    assert!(
        st.used_high >= 1400 && st.used_high <= 500 + 700 + 1000 + 1400,
        "{st:?}"
    );
    free(&dev, &pool, y1, s1);
    free(&dev, &pool, y2, s2);
    let st = pool.stats();
    assert_eq!((st.used_current, st.allocs, st.frees), (0, 4, 4), "{st:?}");
    teardown(dev, pool);
}

/// (f) The lock-free switches: `set_reuse` stores `Relaxed` atomics that
/// publish no other data. Thread 1 turns every reuse switch off and then
/// tells thread 2 (Release/Acquire on the test's own flag); thread 2
/// allocates on B, which has waited on an event covering a free on A. An
/// allocation that happens after the switch (it saw the flag) must not
/// follow the dependency; one that does not may do either. Returns
/// (flag seen, block reused).
pub fn reuse_switch_publication() -> (bool, bool) {
    let (dev, pool) = setup(0);
    let a = dev.create_stream().unwrap();
    let b = dev.create_stream().unwrap();
    dev.set_busy(a, true);
    let x = alloc(&dev, &pool, GRANULARITY, a);
    let x_ptr = x.ptr();
    dev.launch(a);
    free(&dev, &pool, x, a);
    let ev: PoolEvent = pool.record_event(a).unwrap();
    pool.wait_event(b, &ev).unwrap();
    drop(ev);
    let flag = Arc::new(AtomicBool::new(false));
    let t1 = {
        let (pool, flag) = (pool.clone(), flag.clone());
        thread::spawn(move || {
            pool.set_reuse(ReusePolicy {
                follow_event_dependencies: false,
                opportunistic: false,
                internal_dependencies: false,
                wait_for_pending_frees: false,
            });
            flag.store(true, Ordering::Release);
        })
    };
    let t2 = {
        let (dev, pool, flag) = (dev.clone(), pool.clone(), flag.clone());
        thread::spawn(move || {
            let seen = flag.load(Ordering::Acquire);
            let y = alloc(&dev, &pool, GRANULARITY, b);
            let reused = y.ptr() == x_ptr;
            assert!(
                !(seen && reused),
                "an allocation ordered after set_reuse(off) followed an event dependency"
            );
            (seen, reused, y)
        })
    };
    t1.join().unwrap();
    let (seen, reused, y) = t2.join().unwrap();
    assert!(!pool.reuse().follow_event_dependencies);
    free(&dev, &pool, y, b);
    dev.complete_all();
    teardown(dev, pool);
    (seen, reused)
}

/// (g) The list of busy streams that the slow path's passes visit instead
/// of every stream. Before the threads start, stream S has a free in its
/// cache (so it is listed) and a second live block. Thread 1 frees that
/// block on S; thread 2 trims, whose pass flushes S's cache, records an
/// event and sees it complete: S is idle by the end of the pass and leaves
/// the list, unless thread 1's free came in between. Afterwards a trim
/// must release the page: S's second free must have been flushed, so S
/// must still be listed if its cache holds it. Catches a pass that decides
/// "idle" under S's lock and clears S's `listed` flag after letting go of
/// the lock (a free in between sees S listed, does not list it again, and
/// its block is never flushed).
pub fn busy_list_free_vs_pass() {
    let (dev, pool) = setup(4096);
    let s = dev.create_stream().unwrap();
    let x = alloc(&dev, &pool, 1000, s);
    let y = alloc(&dev, &pool, 1000, s);
    free(&dev, &pool, x, s);
    let t1 = {
        let (dev, pool) = (dev.clone(), pool.clone());
        thread::spawn(move || free(&dev, &pool, y, s))
    };
    let t2 = {
        let pool = pool.clone();
        thread::spawn(move || {
            pool.trim_to(0).unwrap();
        })
    };
    t1.join().unwrap();
    t2.join().unwrap();
    pool.trim_to(0).unwrap();
    let st = pool.stats();
    assert_eq!(
        st.reserved_current, 0,
        "a cached free was never flushed into the arena: {st:?}"
    );
    teardown(dev, pool);
}

/// (h) The ledger's list of streams holding headroom. Stream A allocated
/// x and y and freed x (A holds 1000 bytes of headroom and is listed).
/// Thread 1 frees y on A; thread 2 allocates 1000 bytes on B, which has no
/// headroom and collects the listed streams'. Then B allocates 1000 bytes
/// more. The live set never passed 2000 bytes, so `used_high` must be
/// 2000 in every interleaving: the headroom y's free gave A must be found
/// by the second collection. Catches a collection that takes a stream's
/// headroom under its lock and clears its `donor` flag only after letting
/// go of it (a free in between adds headroom, sees the flag set, does not
/// list A again, and the headroom is stranded: the peak reads 3000).
pub fn headroom_donors() {
    let (dev, pool) = setup(0);
    let a = dev.create_stream().unwrap();
    let b = dev.create_stream().unwrap();
    let x = alloc(&dev, &pool, 1000, a);
    let y = alloc(&dev, &pool, 1000, a);
    free(&dev, &pool, x, a);
    let t1 = {
        let (dev, pool) = (dev.clone(), pool.clone());
        thread::spawn(move || free(&dev, &pool, y, a))
    };
    let t2 = {
        let (dev, pool) = (dev.clone(), pool.clone());
        thread::spawn(move || alloc(&dev, &pool, 1000, b))
    };
    t1.join().unwrap();
    let z = t2.join().unwrap();
    let w = alloc(&dev, &pool, 1000, b);
    let st = pool.stats();
    assert_eq!((st.used_current, st.used_high), (2000, 2000), "{st:?}");
    free(&dev, &pool, z, b);
    free(&dev, &pool, w, b);
    dev.complete_all();
    teardown(dev, pool);
}

/// (i) The capture gate of announced mode: one relaxed counter of
/// announced captures. Threads 1 and 2 each put their own stream in capture
/// (a raw call: only the capture query sees it) and announce it; then the
/// main thread ends thread 1's capture and allocates on thread 2's stream,
/// still capturing: that must take the capture route (graph memory, never
/// the pool's own) in every interleaving, so the
/// count must be 1, not 0, after two announcements and one end. Catches an
/// announcement made as a load and a store instead of one read-modify-write
/// (two racing announcements count once). Thread 2 also allocates on a
/// third, never-captured stream right after its announcement: served, with
/// the query asked or not.
pub fn announced_capture_gate() {
    let dev = Arc::new(ModelDevice::new(CAPACITY_PAGES));
    let mut c = config(1024);
    c.check_capture = true;
    let pool = MemPool::new(dev.clone(), c).expect("pool");
    pool.set_announced_captures(true);
    let (s1, s2, plain) = (
        dev.create_stream().unwrap(),
        dev.create_stream().unwrap(),
        dev.create_stream().unwrap(),
    );
    let t1 = {
        let (dev, pool) = (dev.clone(), pool.clone());
        thread::spawn(move || {
            dev.set_capturing(s1, true);
            pool.begin_announced_capture(s1);
        })
    };
    let t2 = {
        let (dev, pool) = (dev.clone(), pool.clone());
        thread::spawn(move || {
            dev.set_capturing(s2, true);
            pool.begin_announced_capture(s2);
            let x = alloc(&dev, &pool, 1000, plain);
            free(&dev, &pool, x, plain);
        })
    };
    t1.join().unwrap();
    t2.join().unwrap();
    dev.set_capturing(s1, false);
    pool.end_announced_capture(s1);
    assert_eq!(pool.announced_captures(), 1);
    // Seen as capturing: the pool asks for graph memory (which the model
    // device does not have) instead of handing out its own.
    assert!(matches!(
        pool.alloc_async(1000, s2),
        Err(PoolError::Device(tidepool_sys::SysError::Unsupported {
            op: tidepool_sys::Op::GraphAlloc,
            ..
        }))
    ));
    dev.set_capturing(s2, false);
    pool.end_announced_capture(s2);
    assert_eq!(pool.announced_captures(), 0);
    dev.complete_all();
    teardown(dev, pool);
}

/// (j) The per-stream lock alone ([`tidepool_sys::sync::LeanMutex`]: one
/// compare-and-swap to take, one store to release): two threads each
/// take it twice and increment the plain (non-atomic) value behind it
/// (read, then write, with a yield point in between). Under loom the value
/// sits in loom's cell, which fails the model if two threads ever touch it
/// without the lock ordering them; the end checks no increment was lost.
/// Returns whether the second thread got the lock first at least once
/// (both orders must be explored).
pub fn lean_lock_excludes() -> bool {
    use tidepool_sys::sync::LeanMutex;
    let m = Arc::new(LeanMutex::new(0u32));
    let m2 = m.clone();
    let t = thread::spawn(move || {
        let mut first = false;
        for _ in 0..2 {
            let mut g = m2.lock();
            first |= *g == 0;
            let v = *g;
            thread::yield_now();
            *g = v + 1;
        }
        first
    });
    for _ in 0..2 {
        let mut g = m.lock();
        let v = *g;
        thread::yield_now();
        *g = v + 1;
    }
    let second_first = t.join().expect("thread");
    let g = m.lock();
    assert_eq!(*g, 4, "an increment under the lock was lost");
    second_first
}

/// (k) Forgetting a retired stream while another thread reads the
/// statistics. Stream S allocated and freed 1000 bytes. Thread 1 retires
/// S (an event covers its free), lets the device finish, and trims, which
/// observes the event and drops S from the stream table, its counts moving
/// to the pool's ledger. Thread 2 allocates and frees on stream T, then
/// reads the statistics twice. No reading may lose S's counts: `allocs`
/// never goes backwards and `used_current` never shows bytes nobody holds.
/// Catches a forget that takes a stream's counts out of the table and puts
/// them in the ledger in two steps (a reader in between sees them in
/// neither place). At the end S must be forgotten: even recording an event
/// on it is refused (a retired stream still in the table would take it).
pub fn forget_retired_vs_stats() {
    let (dev, pool) = setup(1024);
    let s = dev.create_stream().unwrap();
    let t = dev.create_stream().unwrap();
    let x = alloc(&dev, &pool, 1000, s);
    free(&dev, &pool, x, s);
    let t1 = {
        let (dev, pool) = (dev.clone(), pool.clone());
        thread::spawn(move || {
            pool.retire_stream(s).unwrap();
            dev.complete_all();
            pool.trim_to(u64::MAX).unwrap();
        })
    };
    let t2 = {
        let (dev, pool) = (dev.clone(), pool.clone());
        thread::spawn(move || {
            let y = alloc(&dev, &pool, 1000, t);
            free(&dev, &pool, y, t);
            let first = pool.stats();
            let second = pool.stats();
            for st in [first, second] {
                assert!(st.allocs >= 2, "S's allocation lost: {st:?}");
                assert_eq!(st.used_current, 0, "{st:?}");
            }
            assert!(second.allocs >= first.allocs);
        })
    };
    t1.join().unwrap();
    t2.join().unwrap();
    let st = pool.stats();
    assert_eq!((st.allocs, st.frees, st.used_current), (2, 2, 0), "{st:?}");
    // A thread that never used S (so S's entry is not among its recent
    // entries) finds it only in the table.
    let gone = {
        let pool = pool.clone();
        thread::spawn(move || matches!(pool.record_event(s), Err(PoolError::StreamRetired { .. })))
            .join()
            .unwrap()
    };
    assert!(gone, "S was not forgotten");
    dev.complete_all();
    teardown(dev, pool);
}

/// (l) The watch list that slow allocations poll instead of every stream.
/// Producer P allocated x (one page) and consumer C, ordered after P
/// through a pool event, uses it (busy: its work completes only when the
/// thread says so). C has never allocated, so its free goes straight to
/// the arena and C is watched. Thread 1 frees x on C, then lets C's work
/// complete; thread 2 allocates a page on P meanwhile, which polls the
/// watched streams. The device checks that P never gets x while C's work
/// on it may still run (a poll that took C's epoch as complete without
/// asking, or asked before the free, is caught there). Afterwards P
/// allocates again: x's free is known complete by then, so the pool never
/// needs a third page. Returns whether thread 2's allocation reused x.
pub fn watch_free_vs_poll() -> bool {
    let (dev, pool) = setup(1 << 20);
    let p = dev.create_stream().unwrap();
    let c = dev.create_stream().unwrap();
    let x = alloc(&dev, &pool, GRANULARITY, p);
    let x_ptr = x.ptr();
    let ev = pool.record_event(p).unwrap();
    pool.wait_event(c, &ev).unwrap();
    drop(ev);
    dev.set_busy(c, true);
    let t1 = {
        let (dev, pool) = (dev.clone(), pool.clone());
        thread::spawn(move || {
            dev.unclaim(x.ptr(), p);
            dev.claim(x.ptr(), x.size(), c);
            dev.launch(c); // the consumer's kernel that reads x
            free(&dev, &pool, x, c);
            dev.set_busy(c, false);
        })
    };
    let t2 = {
        let (dev, pool) = (dev.clone(), pool.clone());
        thread::spawn(move || alloc(&dev, &pool, GRANULARITY, p))
    };
    t1.join().unwrap();
    let y = t2.join().unwrap();
    let reused = y.ptr() == x_ptr;
    let z = alloc(&dev, &pool, GRANULARITY, p);
    assert!(
        pool.stats().growths <= 2,
        "x's completed free was not reused: {:?}",
        pool.stats()
    );
    free(&dev, &pool, y, p);
    free(&dev, &pool, z, p);
    dev.complete_all();
    teardown(dev, pool);
    reused
}

/// (m) A consumer's free joins the watch list (its stream never
/// allocated: the free goes to the arena) while the producer's slow
/// allocation polls it; the watch list's one-word summary, read with no
/// lock, must not lose the consumer: the producer's next slow allocation,
/// once both are done, asks the consumer's stream whether its work is
/// done. Returns whether the allocation during the free saw the list with
/// the consumer in it.
pub fn watch_hint_free_vs_poll() -> bool {
    let (dev, pool) = setup(1 << 20);
    let p = dev.create_stream().unwrap();
    let c = dev.create_stream().unwrap();
    let x = alloc(&dev, &pool, 1024, p);
    // A block of another length in the producer's cache: its next
    // allocations miss the cache and fit in what is mapped.
    let w = alloc(&dev, &pool, 2048, p);
    free(&dev, &pool, w, p);
    let ev = pool.record_event(p).unwrap();
    pool.wait_event(c, &ev).unwrap();
    drop(ev);
    dev.set_busy(c, true);
    let t1 = {
        let (dev, pool) = (dev.clone(), pool.clone());
        thread::spawn(move || {
            dev.unclaim(x.ptr(), p);
            dev.claim(x.ptr(), x.size(), c);
            dev.launch(c);
            free(&dev, &pool, x, c);
        })
    };
    let t2 = {
        let (dev, pool) = (dev.clone(), pool.clone());
        thread::spawn(move || {
            let asked = dev.stream_queries(c);
            let y = alloc(&dev, &pool, 1536, p);
            (y, dev.stream_queries(c) > asked)
        })
    };
    t1.join().unwrap();
    let (y, saw) = t2.join().unwrap();
    let asked = dev.stream_queries(c);
    let z = alloc(&dev, &pool, 512, p);
    assert!(
        dev.stream_queries(c) > asked,
        "the watched consumer was not polled by the next slow allocation"
    );
    dev.set_busy(c, false);
    free(&dev, &pool, y, p);
    free(&dev, &pool, z, p);
    dev.complete_all();
    teardown(dev, pool);
    saw
}
