//! The allocation and free fast path seen from outside: streams destroyed
//! or retired after a thread has used them (so their entries sit in the
//! thread's recent-entries table), streams of another device, retiring a
//! stream while another thread allocates on it, switching the capture mode
//! while threads allocate, and threads cycling through more streams than
//! the recent-entries table holds. Every test bounds its work by counts and
//! ends with exact statistics (`used_current` 0, allocations = frees).

mod common;

use common::*;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::channel;
use std::sync::{Arc, Barrier};
use tidepool::{MemPool, PoolConfig, PoolError};
use tidepool_sys::{Device, HostDevice, Stream};

fn pool_on(dev: &Arc<HostDevice>) -> MemPool<HostDevice> {
    MemPool::new(dev.clone(), PoolConfig::default().with_va_size(4 << 30)).expect("pool")
}

fn exact(pool: &MemPool<HostDevice>, what: &str) {
    let st = pool.stats();
    assert_eq!(
        st.used_current, 0,
        "{what}: used_current after freeing everything"
    );
    assert_eq!(st.allocs, st.frees, "{what}: allocations and frees");
}

/// A stream destroyed without being retired, after this thread warmed its
/// fast path: allocating on it is a typed error, not a block.
#[test]
fn a_destroyed_stream_is_refused_on_the_warm_fast_path() {
    destroyed_stream(false);
}

/// The same in announced capture mode, where the fast path checks the
/// stream with one load of its destroyed flag.
#[test]
fn a_destroyed_stream_is_refused_on_the_warm_fast_path_in_announced_mode() {
    destroyed_stream(true);
}

fn destroyed_stream(announced: bool) {
    let dev = Arc::new(host());
    let pool = pool_on(&dev);
    pool.set_announced_captures(announced);
    let s = dev.create_stream().unwrap();
    let p = dev.create_stream().unwrap();
    for _ in 0..50 {
        let a = pool.alloc_async(4096, s).unwrap();
        pool.free_async(a, s).unwrap();
    }
    let kept = pool.alloc_async(4096, s).unwrap();
    dev.destroy_stream(s).unwrap();
    for i in 0..3 {
        match pool.alloc_async(4096, s) {
            Err(_) => {}
            Ok(a) => {
                let ptr = a.ptr();
                pool.free_async(a, p).ok();
                panic!("try {i}: a destroyed stream got a block at {ptr:#x}");
            }
        }
    }
    // A free on the destroyed stream is refused and hands the block back;
    // after a device-wide wait it is freed on another stream.
    let back = match pool.free_async(kept, s) {
        Ok(()) => None,
        Err(e) => Some(e.allocation),
    };
    dev.synchronize_device().unwrap();
    if let Some(a) = back {
        pool.free_async(a, p).unwrap();
    }
    pool.synchronize().unwrap();
    exact(&pool, "destroyed stream");
}

/// A stream of another device instance is refused, also after this
/// thread's fast path is warm on a stream of the same id range.
#[test]
fn a_stream_of_another_device_is_refused_every_time() {
    foreign_stream(false);
}

#[test]
fn a_stream_of_another_device_is_refused_every_time_in_announced_mode() {
    foreign_stream(true);
}

fn foreign_stream(announced: bool) {
    let dev = Arc::new(host());
    let other = host();
    let pool = pool_on(&dev);
    pool.set_announced_captures(announced);
    let s = dev.create_stream().unwrap();
    let foreign = other.create_stream().unwrap();
    for i in 0..5 {
        let a = pool.alloc_async(4096, s).unwrap();
        match pool.alloc_async(4096, foreign) {
            Err(_) => {}
            Ok(b) => panic!("try {i}: a foreign stream got a block at {:#x}", b.ptr()),
        }
        match pool.free_async(a, foreign) {
            Ok(()) => panic!("try {i}: a free on a foreign stream was taken"),
            Err(e) => pool.free_async(e.allocation, s).unwrap(),
        }
    }
    pool.synchronize().unwrap();
    exact(&pool, "foreign stream");
}

/// A thread warms its fast path on a stream; another thread retires it;
/// the first thread's next allocation and free on it are refused.
#[test]
fn a_stream_retired_by_another_thread_is_refused_on_the_warm_fast_path() {
    let dev = Arc::new(host());
    let pool = Arc::new(pool_on(&dev));
    let s = dev.create_stream().unwrap();
    let p = dev.create_stream().unwrap();
    let (to_main, from_worker) = channel::<()>();
    let (to_worker, from_main) = channel::<()>();
    let worker = {
        let pool = pool.clone();
        let dev = dev.clone();
        std::thread::spawn(move || {
            for _ in 0..100 {
                let a = pool.alloc_async(512, s).unwrap();
                pool.free_async(a, s).unwrap();
            }
            let kept = pool.alloc_async(512, s).unwrap();
            to_main.send(()).unwrap();
            from_main.recv().unwrap();
            match pool.alloc_async(512, s) {
                Err(PoolError::StreamRetired { .. }) => {}
                Err(e) => panic!("another error than StreamRetired: {e}"),
                Ok(a) => panic!("a retired stream got a block at {:#x}", a.ptr()),
            }
            let back = match pool.free_async(kept, s) {
                Ok(()) => panic!("a free on a retired stream was taken"),
                Err(e) => e.allocation,
            };
            dev.synchronize_stream(s).unwrap();
            pool.free_async(back, p).unwrap();
        })
    };
    from_worker.recv().unwrap();
    pool.retire_stream(s).unwrap();
    to_worker.send(()).unwrap();
    worker.join().unwrap();
    pool.synchronize().unwrap();
    exact(&pool, "retired by another thread");
}

/// One thread allocates and frees on a stream in a loop while another
/// retires it: every call either works or is refused with StreamRetired;
/// once refused, every later call is refused too, and no call that starts
/// after `retire_stream` returned is served. The worker stops 200 calls
/// after its first refusal.
#[test]
fn retire_while_another_thread_allocates_on_the_stream() {
    for round in 0..8u64 {
        let dev = Arc::new(host());
        let pool = Arc::new(pool_on(&dev));
        let s = dev.create_stream().unwrap();
        let p = dev.create_stream().unwrap();
        let started = Arc::new(AtomicU64::new(0));
        let retired = Arc::new(AtomicBool::new(false));
        let worker = {
            let (pool, dev, started, retired) =
                (pool.clone(), dev.clone(), started.clone(), retired.clone());
            std::thread::spawn(move || {
                let mut refused_at = None;
                let mut held = Vec::new();
                let mut i = 0u64;
                while refused_at.is_none_or(|r| i < r + 200) {
                    assert!(i < 50_000_000, "the stream was never retired");
                    started.store(i + 1, Ordering::Release);
                    let after_retire = retired.load(Ordering::Acquire);
                    match pool.alloc_async(256 << (i % 4), s) {
                        Ok(a) => {
                            assert!(refused_at.is_none(), "call {i}: served after a refusal");
                            assert!(
                                !after_retire,
                                "call {i}: served after retire_stream returned"
                            );
                            if i % 3 == 0 {
                                held.push(a);
                            } else if let Err(e) = pool.free_async(a, s) {
                                refused_at.get_or_insert(i);
                                held.push(e.allocation);
                            }
                        }
                        Err(PoolError::StreamRetired { .. }) => {
                            refused_at.get_or_insert(i);
                        }
                        Err(e) => panic!("call {i}: {e}"),
                    }
                    if held.len() > 8 {
                        let a = held.remove(0);
                        if let Err(e) = pool.free_async(a, s) {
                            refused_at.get_or_insert(i);
                            held.push(e.allocation);
                        }
                    }
                    i += 1;
                }
                dev.synchronize_stream(s).unwrap();
                for a in held {
                    pool.free_async(a, p).unwrap();
                }
            })
        };
        // Retire at a point that depends on the round, counted in the
        // worker's calls.
        let at = 50 + round * 300;
        while started.load(Ordering::Acquire) < at {
            std::thread::yield_now();
        }
        pool.retire_stream(s).unwrap();
        retired.store(true, Ordering::Release);
        worker.join().unwrap();
        pool.synchronize().unwrap();
        exact(&pool, &format!("round {round}"));
    }
}

/// Threads allocate and free on their own streams (and some cross-stream
/// frees through events) while another thread switches between strict and
/// announced capture mode and announces captures on an idle stream: no call
/// fails, and the statistics are exact afterwards.
#[test]
fn switching_capture_modes_while_threads_allocate() {
    let dev = Arc::new(host());
    let pool = Arc::new(pool_on(&dev));
    let threads = 6;
    let pairs = 3000u64;
    let ss = streams(&*dev, threads + 1);
    let idle = ss[threads];
    let stop = Arc::new(AtomicBool::new(false));
    let barrier = Arc::new(Barrier::new(threads + 1));
    let toggler = {
        let (pool, stop, barrier) = (pool.clone(), stop.clone(), barrier.clone());
        std::thread::spawn(move || {
            barrier.wait();
            let mut flips = 0u64;
            while !stop.load(Ordering::Relaxed) && flips < 200_000 {
                pool.set_announced_captures(flips % 2 == 0);
                if flips % 7 == 0 {
                    pool.begin_announced_capture(idle);
                    assert!(pool.end_announced_capture(idle));
                }
                flips += 1;
            }
            pool.set_announced_captures(false);
        })
    };
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let (pool, barrier) = (pool.clone(), barrier.clone());
            let (s, next) = (ss[t], ss[(t + 1) % threads]);
            std::thread::spawn(move || {
                barrier.wait();
                for i in 0..pairs {
                    let a = pool
                        .alloc_async(512 + (i as usize % 5) * 1000, s)
                        .unwrap_or_else(|e| panic!("thread {t} pair {i}: {e}"));
                    if i % 10 == 0 {
                        let ev = pool.record_event(s).unwrap();
                        pool.wait_event(next, &ev).unwrap();
                        pool.free_async(a, next).unwrap();
                    } else {
                        pool.free_async(a, s).unwrap();
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    toggler.join().unwrap();
    assert_eq!(pool.announced_captures(), 0);
    pool.synchronize().unwrap();
    exact(&pool, "capture-mode switches");
    assert_eq!(pool.stats().allocs, threads as u64 * pairs);
}

/// Threads each cycle through more streams than the recent-entries table
/// holds (16 slots), retiring some half-way; retired ones refuse work from
/// every thread, fresh ones work, and the statistics stay exact.
#[test]
fn threads_cycling_through_more_streams_than_the_recent_table() {
    let dev = Arc::new(host());
    let pool = Arc::new(pool_on(&dev));
    let n = 48;
    let ss: Arc<Vec<Stream>> = Arc::new(streams(&*dev, n));
    let threads = 4;
    let rounds = 60;
    let barrier = Arc::new(Barrier::new(threads));
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let (pool, ss, barrier, dev) = (pool.clone(), ss.clone(), barrier.clone(), dev.clone());
            std::thread::spawn(move || {
                let mine = dev.create_stream().unwrap();
                let mut served = 0u64;
                for r in 0..rounds {
                    if r == rounds / 2 {
                        // Every thread has used every stream: retire every
                        // sixth (each once, by the thread it falls to).
                        barrier.wait();
                        for (j, &s) in ss.iter().enumerate() {
                            if j % 6 == 0 && j / 6 % threads == t {
                                pool.retire_stream(s).unwrap();
                            }
                        }
                        barrier.wait();
                    }
                    for (j, &s) in ss.iter().enumerate() {
                        let j2 = (j + t * 7) % n;
                        let s2 = ss[j2];
                        let retired = r >= rounds / 2 && j2 % 6 == 0;
                        match pool.alloc_async(1024 * (1 + j % 3), s2) {
                            Ok(a) => {
                                assert!(
                                    !retired,
                                    "thread {t} round {r}: retired stream {j2} served"
                                );
                                pool.free_async(a, s2).unwrap();
                                served += 1;
                            }
                            Err(PoolError::StreamRetired { .. }) => {
                                assert!(retired, "thread {t} round {r}: stream {j2} refused");
                            }
                            Err(e) => panic!("thread {t} round {r} stream {j2}: {e}"),
                        }
                        let _ = s;
                        // A stream of this thread's own, between them.
                        let b = pool.alloc_async(700, mine).unwrap();
                        pool.free_async(b, mine).unwrap();
                        served += 1;
                    }
                }
                served
            })
        })
        .collect();
    let served: u64 = workers.into_iter().map(|w| w.join().unwrap()).sum();
    pool.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    exact(&pool, "cycling");
    assert_eq!(
        pool.stats().allocs,
        served,
        "allocations counted, with retired streams forgotten"
    );
}

/// A block used on another stream (declared with `record_use`), whose use
/// stream is then retired (and perhaps destroyed, and forgotten by the
/// pool after a synchronisation and a trim): the block can still be freed
/// on its own stream, and the pool ends with nothing in use.
fn free_after_the_use_stream_is_retired(destroy: bool, forget: bool) {
    let dev = Arc::new(host());
    let pool = pool_on(&dev);
    let p = dev.create_stream().unwrap();
    let u = dev.create_stream().unwrap();
    let mut a = pool.alloc_async(4096, p).unwrap();
    pool.record_use(&mut a, u);
    // Some traffic of the use stream's own, so it has an entry with frees.
    let b = pool.alloc_async(512, u).unwrap();
    pool.free_async(b, u).unwrap();
    pool.retire_stream(u).unwrap();
    if destroy {
        dev.destroy_stream(u).unwrap();
    }
    if forget {
        pool.synchronize().unwrap();
        pool.trim_to(0).unwrap();
    }
    let mut a = Some(a);
    let mut errors = Vec::new();
    for _ in 0..3 {
        match pool.free_async(a.take().unwrap(), p) {
            Ok(()) => break,
            Err(e) => {
                errors.push(e.error.to_string());
                a = Some(e.allocation);
            }
        }
    }
    let stuck = a.is_some();
    std::mem::forget(a);
    pool.synchronize().unwrap();
    assert!(
        !stuck,
        "destroy {destroy}, forget {forget}: the block can never be freed: {errors:?}"
    );
    exact(&pool, "use stream retired");
}

#[test]
fn a_block_used_on_a_retired_stream_can_be_freed() {
    free_after_the_use_stream_is_retired(false, false);
}

#[test]
fn a_block_used_on_a_retired_and_destroyed_stream_can_be_freed() {
    free_after_the_use_stream_is_retired(true, false);
}

#[test]
fn a_block_used_on_a_retired_and_forgotten_stream_can_be_freed() {
    free_after_the_use_stream_is_retired(false, true);
}

#[test]
fn a_block_used_on_a_retired_destroyed_and_forgotten_stream_can_be_freed() {
    free_after_the_use_stream_is_retired(true, true);
}

/// Pools made and dropped one after another on one thread and one stream:
/// the thread's recent entries still hold the dropped pools' stream
/// entries (with cached blocks), and a new pool must never be served from
/// them: every block lies in its own pool, and its counts start at zero.
#[test]
fn a_new_pool_is_never_served_from_a_dropped_pools_recent_entries() {
    let dev = Arc::new(host());
    let s = dev.create_stream().unwrap();
    for round in 0..40 {
        let pool = pool_on(&dev);
        for size in [512usize, 4096, 70_000] {
            let a = pool.alloc_async(size, s).unwrap();
            assert!(
                pool.contains(a.ptr()),
                "round {round}: a block outside its pool"
            );
            pool.free_async(a, s).unwrap();
            let b = pool.alloc_async(size, s).unwrap();
            assert!(
                pool.contains(b.ptr()),
                "round {round}: a cached block outside its pool"
            );
            pool.free_async(b, s).unwrap();
        }
        let st = pool.stats();
        assert_eq!(
            (st.allocs, st.frees, st.used_current),
            (6, 6, 0),
            "round {round}"
        );
        // Dropped with blocks in the stream's cache.
        drop(pool);
    }
    assert_eq!(dev.live_handles(), 0);
}

/// Two hundred threads, each on a stream of its own that it retires when
/// it is done, with a few blocks handed to the main thread (ordered by an
/// event) and freed there after the thread and its stream are gone: the
/// counts are exact and nothing stays in use.
#[test]
fn hundreds_of_threads_each_retiring_its_own_stream() {
    let dev = Arc::new(host());
    let pool = Arc::new(pool_on(&dev));
    let main = dev.create_stream().unwrap();
    let threads = 200;
    let (tx, rx) = channel::<(tidepool::Allocation, tidepool::PoolEvent)>();
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (pool, dev, tx) = (pool.clone(), dev.clone(), tx.clone());
            std::thread::spawn(move || {
                let s = dev.create_stream().unwrap();
                for i in 0..50usize {
                    let a = pool
                        .alloc_async(256 + (i * 997 + t * 31) % 20_000, s)
                        .unwrap();
                    pool.free_async(a, s).unwrap();
                }
                for i in 0..3usize {
                    let a = pool.alloc_async(1000 * (i + 1), s).unwrap();
                    let ev = pool.record_event(s).unwrap();
                    tx.send((a, ev)).unwrap();
                }
                pool.retire_stream(s).unwrap();
                match pool.alloc_async(512, s) {
                    Err(PoolError::StreamRetired { .. }) => {}
                    other => panic!("thread {t}: a retired stream: {:?}", other.map(|a| a.ptr())),
                }
                dev.destroy_stream(s).unwrap();
            })
        })
        .collect();
    drop(tx);
    for h in handles {
        h.join().unwrap();
    }
    let mut n = 0;
    for (a, ev) in rx {
        pool.wait_event(main, &ev).unwrap();
        pool.free_async(a, main).unwrap();
        n += 1;
    }
    assert_eq!(n, threads * 3);
    pool.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    exact(&pool, "hundreds of threads");
    assert_eq!(pool.stats().allocs, threads as u64 * 53);
    assert_eq!(pool.stats().reserved_current, 0);
}

/// A capture announced (and really begun) on one stream while another
/// thread switches between strict and announced mode many times: in
/// either mode the capturing stream is checked (strict: always;
/// announced: a capture is announced), so every block it gets, from a
/// warm fast path too, is graph memory; the other streams' traffic
/// meanwhile never is.
#[test]
fn an_announced_capture_is_seen_whatever_the_mode_switches() {
    use tidepool_sys::CaptureMode;
    let dev = Arc::new(host());
    let pool = Arc::new(pool_on(&dev));
    let c = dev.create_stream().unwrap();
    let s = dev.create_stream().unwrap();
    // Warm c's fast path (its cache holds a block of the size asked later).
    for _ in 0..20 {
        let a = pool.alloc_async(4096, c).unwrap();
        pool.free_async(a, c).unwrap();
    }
    pool.begin_announced_capture(c);
    dev.begin_capture(c, CaptureMode::Relaxed).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let toggler = {
        let (pool, stop) = (pool.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) && i < 1_000_000 {
                pool.set_announced_captures(i % 2 == 0);
                i += 1;
            }
        })
    };
    let other = {
        let pool = pool.clone();
        std::thread::spawn(move || {
            for i in 0..2000 {
                let a = pool.alloc_async(4096, s).unwrap();
                assert!(
                    !a.is_graph_memory(),
                    "pair {i}: a stream not captured got graph memory"
                );
                pool.free_async(a, s).unwrap();
            }
        })
    };
    for i in 0..300 {
        let g = pool.alloc_async(4096, c).unwrap();
        let graph = g.is_graph_memory();
        pool.free_async(g, c).unwrap();
        assert!(
            graph,
            "allocation {i} on the capturing stream was a pool block"
        );
    }
    other.join().unwrap();
    stop.store(true, Ordering::Relaxed);
    toggler.join().unwrap();
    let _ = dev.end_capture(c);
    assert!(pool.end_announced_capture(c));
    pool.set_announced_captures(false);
    pool.synchronize().unwrap();
    exact(&pool, "announced capture under switches");
}
