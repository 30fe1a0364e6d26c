//! A stream retired by one thread while another allocates and frees on
//! it (holding its entry: in its slot, among the thread's recent ones):
//! an allocation started after the retirement returned is refused
//! (`StreamRetired`), one in flight is not lost, a block whose free on the
//! retired stream is refused is freed on another stream, and the stream is
//! forgotten once its work is done. Counts exact at the end.
//!
//! Host backend; work bounded by operation counts.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use tidepool::{PoolError, ReusePolicy};
use tidepool_sys::Device;

const MIB: usize = 1 << 20;

fn hold(reuse: ReusePolicy) {
    let dev = Arc::new(common::host_with_capacity(256 * MIB));
    let pool = common::pool(&dev, common::config().with_reuse(reuse));
    let l = dev.create_stream().unwrap();
    let allocs = AtomicU64::new(0);
    for round in 0..40u64 {
        let s = dev.create_stream().unwrap();
        let ops = AtomicU64::new(0);
        let retired = AtomicBool::new(false);
        std::thread::scope(|sc| {
            sc.spawn(|| {
                let mut live = Vec::new();
                let mut k = 0u64;
                loop {
                    k += 1;
                    let after = retired.load(Ordering::SeqCst);
                    match pool.alloc_async(4096 << (k % 6), s) {
                        Ok(a) => {
                            assert!(!after, "allocated on s after its retirement returned");
                            allocs.fetch_add(1, Ordering::Relaxed);
                            live.push(a);
                        }
                        Err(PoolError::StreamRetired { .. }) => break,
                        Err(e) => panic!("{e}"),
                    }
                    // Every third step, and whenever 32 blocks are live,
                    // the oldest is freed: however long the retiring thread
                    // waits to be scheduled, this one never holds more than
                    // 32 blocks of at most 128 KiB (4 MiB of the 256).
                    if k % 3 == 0 || live.len() >= 32 {
                        let a = live.swap_remove(0);
                        if let Err(e) = pool.free_async(a, s) {
                            assert!(matches!(e.error, PoolError::StreamRetired { .. }), "{e}");
                            pool.free_async(e.allocation, l).unwrap();
                        }
                    }
                    ops.fetch_add(1, Ordering::SeqCst);
                    if k > 1000 {
                        // The retiring thread has not run yet: give it the
                        // processor rather than spin.
                        std::thread::yield_now();
                    }
                    assert!(k < 1_000_000, "never refused");
                }
                for a in live {
                    pool.free_async(a, l).unwrap();
                }
            });
            // Retire once the other thread has done some work (a count,
            // whatever the speed).
            while ops.load(Ordering::SeqCst) < 5 + round % 7 {
                std::thread::yield_now();
            }
            pool.retire_stream(s).unwrap();
            retired.store(true, Ordering::SeqCst);
        });
        dev.synchronize_stream(s).unwrap();
        dev.destroy_stream(s).unwrap();
        pool.synchronize().unwrap();
        // s is done and forgotten (by `synchronize`, or by the trim's
        // query of the events left).
        pool.trim_to(u64::MAX).unwrap();
        let f = pool.stream_footprint();
        assert_eq!((f.table, f.retired_waiting), (1, 0), "round {round}: {f:?}");
    }
    pool.synchronize().unwrap();
    let st = pool.stats();
    let n = allocs.load(Ordering::Relaxed);
    assert_eq!((st.allocs, st.frees, st.used_current), (n, n, 0), "{st:?}");
    pool.retire_stream(l).unwrap();
    dev.destroy_stream(l).unwrap();
    pool.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    let st = pool.stats();
    assert_eq!(st.reserved_current, 0, "{st:?}");
    let f = pool.stream_footprint();
    assert_eq!((f.table, f.clock_entries), (0, 0), "{f:?}");
    // Whatever the policy: after `synchronize` a forgotten stream's frees
    // are synchronised, so nothing of it lingers.
    assert_eq!(f.lingering, 0, "{f:?}");
}

#[test]
fn a_stream_retired_while_another_thread_allocates_on_it() {
    hold(ReusePolicy::default());
}

#[test]
fn a_stream_retired_while_another_thread_allocates_on_it_no_opportunistic_reuse() {
    hold(ReusePolicy {
        opportunistic: false,
        internal_dependencies: false,
        ..ReusePolicy::default()
    });
}
