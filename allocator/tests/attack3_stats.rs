//! `PoolStats` exact after every call of mixed traffic: producers that
//! allocate, consumers that only free (their frees go straight to the
//! arena), streams that do both, cross-stream frees ordered through the
//! pool's events, consumers retired (and forgotten by the pool) and
//! replaced by fresh streams, producers retired with blocks still live
//! (freed later on other streams), peak resets, trims and synchronisations.
//! A model keeps the bytes in use and their peak since the last reset;
//! `used_current`, `used_high`, `allocs` and `frees` must equal it after
//! every call, single-threaded (so "exact" has one meaning).

mod common;

use common::*;
use std::sync::Arc;
use tidepool::{Allocation, MemPool, PoolConfig};
use tidepool_kernels::stress::XorShift64;
use tidepool_sys::{Device, Stream};

fn run(seed: u64, stream_cache_bytes: usize) {
    let dev = Arc::new(host());
    let pool = MemPool::new(
        dev.clone(),
        PoolConfig::default()
            .with_va_size(4 << 30)
            .with_stream_cache_bytes(stream_cache_bytes),
    )
    .unwrap();
    let mut producers = streams(&*dev, 4);
    let mut retired: Vec<Stream> = Vec::new();
    let mut consumers = streams(&*dev, 6);
    let mixed = streams(&*dev, 2);
    let mut rng = XorShift64::new(seed);
    let mut live: Vec<(Allocation, Stream)> = Vec::new();
    let (mut used, mut high, mut allocs, mut frees) = (0u64, 0u64, 0u64, 0u64);
    for op in 0..3000 {
        let r = rng.below(100);
        if r < 45 && live.len() < 40 {
            let s = if rng.percent(70) {
                producers[rng.index(4)]
            } else {
                mixed[rng.index(2)]
            };
            let size = rng.log_uniform(1, 3 << 20);
            let a = pool.alloc_async(size, s).unwrap();
            used += size as u64;
            high = high.max(used);
            allocs += 1;
            live.push((a, s));
        } else if r < 88 && !live.is_empty() {
            let (a, s) = live.swap_remove(rng.index(live.len()));
            let size = a.size() as u64;
            let target = match rng.below(3) {
                0 if !retired.contains(&s) => s,
                0 => producers[rng.index(4)],
                1 => consumers[rng.index(consumers.len())],
                _ => mixed[rng.index(2)],
            };
            if target != s {
                if retired.contains(&s) {
                    // Its allocating stream is gone from the pool: order
                    // the free after its work on the host.
                    dev.synchronize_stream(s).ok();
                } else {
                    let ev = pool.record_event(s).unwrap();
                    pool.wait_event(target, &ev).unwrap();
                }
            }
            pool.free_async(a, target).unwrap();
            used -= size;
            frees += 1;
        } else if r < 92 {
            // Retire a consumer (its frees may be pending) and replace it.
            let i = rng.index(consumers.len());
            let old = consumers[i];
            pool.retire_stream(old).unwrap();
            if rng.percent(50) {
                dev.destroy_stream(old).unwrap();
            }
            consumers[i] = dev.create_stream().unwrap();
        } else if r < 93 {
            // Retire a producer with blocks still live (they are freed on
            // other streams later) and replace it.
            let i = rng.index(4);
            let old = producers[i];
            pool.retire_stream(old).unwrap();
            retired.push(old);
            producers[i] = dev.create_stream().unwrap();
        } else if r < 95 {
            pool.reset_peaks();
            high = used;
        } else if r < 98 {
            pool.trim_to(rng.below(3) << 22).unwrap();
        } else {
            pool.synchronize().unwrap();
        }
        let st = pool.stats();
        assert_eq!(
            (st.used_current, st.used_high, st.allocs, st.frees),
            (used, high, allocs, frees),
            "op {op}: (used_current, used_high, allocs, frees) against the model"
        );
    }
    for (a, s) in live.drain(..) {
        if retired.contains(&s) {
            dev.synchronize_stream(s).ok();
            pool.free_async(a, producers[0]).unwrap();
        } else {
            pool.free_async(a, s).unwrap();
        }
    }
    pool.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    let st = pool.stats();
    assert_eq!((st.used_current, st.used_high), (0, high));
    assert_eq!(st.reserved_current, 0, "everything released");
}

#[test]
fn stats_exact_after_every_call_with_stream_caches() {
    run(21, 256 << 20);
}

#[test]
fn stats_exact_after_every_call_without_stream_caches() {
    run(22, 0);
}
