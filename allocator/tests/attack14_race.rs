//! Streams churned by some threads (create, allocate, write, free,
//! retire, destroy with their work still queued: the pool forgets them
//! from retire, synchronize and slow paths) while other threads allocate,
//! write and check blocks on long-lived streams under a capped pool, so
//! that the churned streams' freed bytes are reused all the time. Every
//! write of a churned stream is queued before its free and may still run
//! after the stream was destroyed: it must never land in a block live
//! elsewhere. At the end: exact counts, nothing used, a trim to 0 leaves
//! nothing reserved, and what is kept per stream is bounded.
//!
//! Host backend; work bounded by operation counts.

mod common;

use common::Rng;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use tidepool::ReusePolicy;
use tidepool_sys::{Device, DevicePtr, HostDevice, Stream};

const MIB: usize = 1 << 20;
const PAGE: usize = common::PAGE;

/// Enqueue on `stream` a check that the `words` at `ptr` hold `want`
/// (false on a mismatch or when unmapped).
fn check_kernel(
    dev: &HostDevice,
    stream: Stream,
    ptr: DevicePtr,
    want: Vec<u32>,
) -> Receiver<bool> {
    let (tx, rx) = std::sync::mpsc::channel();
    dev.launch_on_words(stream, ptr, want.len() * 4, move |r| {
        let ok = match r {
            Ok(w) => w
                .iter()
                .zip(&want)
                .all(|(x, &v)| x.load(Ordering::Relaxed) == v),
            Err(_) => false,
        };
        let _ = tx.send(ok);
    })
    .expect("launch check");
    rx
}

fn race(reuse: ReusePolicy, rounds: u64) {
    let dev = Arc::new(common::host_with_capacity(256 * MIB));
    let pool = common::pool(
        &dev,
        common::config()
            .with_max_size(6 * PAGE as u64)
            .with_stream_cache_bytes(256 << 10)
            .with_reuse(reuse),
    );
    let allocs = AtomicU64::new(0);
    let stop_churn = AtomicBool::new(false);
    let long = common::streams(&*dev, 2);
    std::thread::scope(|sc| {
        // Churners: a fresh stream per round, its writes queued before
        // its free and left running when it is retired and destroyed.
        let churners: Vec<_> = (0..2u64)
            .map(|k| {
                let (pool, dev, allocs) = (&pool, &dev, &allocs);
                sc.spawn(move || {
                    let mut rng = Rng(0x9e37 + k);
                    for i in 0..rounds {
                        let s = dev.create_stream().unwrap();
                        let size = rng.log_range(4096, PAGE as u64) as usize & !3;
                        let a = match pool.alloc_async(size, s) {
                            Ok(a) => a,
                            Err(e) => {
                                assert!(e.is_out_of_memory(), "{e}");
                                pool.retire_stream(s).unwrap();
                                dev.destroy_stream(s).unwrap();
                                continue;
                            }
                        };
                        allocs.fetch_add(1, Ordering::Relaxed);
                        // Late writers: the whole block, twice.
                        let w = size / 4;
                        let tag = common::pattern(0xdead_0000 | (k << 12 | i) as u32, w);
                        let r1 = common::write_kernel(dev, s, a.ptr(), tag.clone());
                        let r2 = common::write_kernel(dev, s, a.ptr(), tag);
                        pool.free_async(a, s).unwrap();
                        if i % 4 == 0 {
                            // Sometimes an event of it outlives it.
                            let ev = pool.record_event(s).unwrap();
                            pool.retire_stream(s).unwrap();
                            dev.destroy_stream(s).unwrap();
                            pool.synchronize_event(&ev).unwrap();
                        } else {
                            pool.retire_stream(s).unwrap();
                            dev.destroy_stream(s).unwrap();
                        }
                        drop((r1, r2));
                    }
                })
            })
            .collect();
        // Checkers on the long-lived streams.
        let checkers: Vec<_> = long
            .iter()
            .enumerate()
            .map(|(k, &l)| {
                let (pool, dev, allocs, stop) = (&pool, &dev, &allocs, &stop_churn);
                sc.spawn(move || {
                    let mut rng = Rng(0x51ed + k as u64);
                    let mut bad = 0u64;
                    let mut i = 0u64;
                    while !stop.load(Ordering::Relaxed) || i < rounds {
                        i += 1;
                        let size = rng.log_range(4096, PAGE as u64) as usize & !3;
                        let a = match pool.alloc_async(size, l) {
                            Ok(a) => a,
                            Err(e) => {
                                assert!(e.is_out_of_memory(), "{e}");
                                pool.synchronize_stream(l).unwrap();
                                continue;
                            }
                        };
                        allocs.fetch_add(1, Ordering::Relaxed);
                        let want = common::pattern((k as u32) << 24 | i as u32, size / 4);
                        let w = common::write_kernel(dev, l, a.ptr(), want.clone());
                        // Give late writers a chance to land in between.
                        for _ in 0..3 {
                            std::thread::yield_now();
                        }
                        let c = check_kernel(dev, l, a.ptr(), want);
                        pool.free_async(a, l).unwrap();
                        assert!(w.recv().unwrap(), "write on an unmapped block");
                        if !c.recv().unwrap() {
                            bad += 1;
                        }
                        if i > 4 * rounds {
                            break;
                        }
                    }
                    bad
                })
            })
            .collect();
        for c in churners {
            c.join().unwrap();
        }
        stop_churn.store(true, Ordering::Relaxed);
        let bad: u64 = checkers.into_iter().map(|c| c.join().unwrap()).sum();
        assert_eq!(bad, 0, "live blocks overwritten by a churned stream's work");
    });
    pool.synchronize().unwrap();
    let st = pool.stats();
    let n = allocs.load(Ordering::Relaxed);
    eprintln!("{reuse:?}: {st:?}");
    assert_eq!((st.allocs, st.frees, st.used_current), (n, n, 0), "{st:?}");
    for s in long {
        pool.retire_stream(s).unwrap();
        dev.destroy_stream(s).unwrap();
    }
    pool.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    let st = pool.stats();
    assert_eq!(st.reserved_current, 0, "{st:?}");
    let f = pool.stream_footprint();
    assert_eq!(
        (f.table, f.busy, f.watched, f.retired_waiting),
        (0, 0, 0, 0),
        "{f:?}"
    );
    assert_eq!(
        (f.lingering, f.clock_entries, f.pending_streams),
        (0, 0, 0),
        "{f:?}"
    );
}

#[test]
fn churned_streams_late_writes_never_land_in_live_blocks_default_policy() {
    race(ReusePolicy::default(), 300);
}

#[test]
fn churned_streams_late_writes_never_land_in_live_blocks_without_opportunistic_reuse() {
    race(
        ReusePolicy {
            opportunistic: false,
            ..ReusePolicy::default()
        },
        300,
    );
}

#[test]
fn churned_streams_late_writes_never_land_in_live_blocks_no_dependencies() {
    race(
        ReusePolicy {
            follow_event_dependencies: false,
            opportunistic: true,
            internal_dependencies: false,
            wait_for_pending_frees: true,
        },
        300,
    );
}
