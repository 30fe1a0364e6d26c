//! Once every stream that freed memory is synchronised, every byte the pool
//! holds is usable by any stream: a capped pool full of frees of many
//! streams and epochs (merged and unmerged, cached and not) must then serve
//! one request of its whole capacity on a stream that never waited for
//! anything, with internal dependencies and host waits off. Completion is
//! learnt per stream and per epoch, so a free whose completion the pool
//! fails to note shows up here as an out-of-memory error.

mod common;

use common::*;
use std::sync::Arc;
use tidepool::ReusePolicy;
use tidepool_sys::Device;

const PAGES: usize = 10;

fn round(seed: u64, cache: usize, per_stream_sync: bool) {
    let cap = PAGES * PAGE;
    let dev = Arc::new(host_with_capacity(cap));
    // Opportunistic reuse off too: only what the synchronisation taught
    // the pool makes the frees usable by a stream that waited for nothing.
    let strict = ReusePolicy {
        internal_dependencies: false,
        wait_for_pending_frees: false,
        opportunistic: !per_stream_sync,
        ..ReusePolicy::default()
    };
    let pool = pool(
        &dev,
        config()
            .with_max_size(cap as u64)
            .with_stream_cache_bytes(cache)
            .with_reuse(strict),
    );
    let ss = streams(&*dev, 5);
    let fresh = dev.create_stream().unwrap();
    let mut rng = Rng(seed | 1);
    for r in 0..4 {
        // Fill the pool with blocks on streams 0..5.
        let mut live = Vec::new();
        loop {
            let size = match rng.range(0, 3) {
                0 => rng.range(1, 200) as usize * 512,
                1 => PAGE,
                _ => rng.log_range(4096, 3 << 20) as usize,
            };
            let s = ss[rng.range(0, 4) as usize];
            match pool.alloc_async(size, s) {
                Ok(a) => live.push(a),
                Err(_) => break,
            }
            if live.len() > 400 {
                break;
            }
        }
        // Free them in a random order, on their own stream or on another
        // one ordered after it through the pool; events in between close
        // epochs, so one stream's frees carry several epochs.
        while !live.is_empty() {
            let k = rng.range(0, live.len() as u64 - 1) as usize;
            let a = live.swap_remove(k);
            let own = a.stream();
            let on = if rng.range(0, 3) == 0 {
                let other = ss[rng.range(0, 4) as usize];
                let ev = pool.record_event(own).unwrap();
                pool.wait_event(other, &ev).unwrap();
                other
            } else {
                own
            };
            pool.free_async(a, on).unwrap();
            if rng.range(0, 7) == 0 {
                let _ = pool.record_event(ss[rng.range(0, 4) as usize]).unwrap();
            }
        }
        if per_stream_sync {
            for &s in &ss {
                pool.synchronize_stream(s).unwrap();
            }
        } else {
            pool.synchronize().unwrap();
        }
        assert_eq!(pool.stats().used_current, 0);
        let reserved = pool.stats().reserved_current;
        let all = pool.alloc_async(cap, fresh).unwrap_or_else(|e| {
            panic!(
                "seed {seed} round {r} (cache {cache}, per-stream sync {per_stream_sync}): \
                 every free is complete, yet {cap} B fail: {e}"
            )
        });
        assert!(pool.stats().reserved_current <= cap as u64);
        assert!(reserved <= cap as u64);
        pool.free_async(all, fresh).unwrap();
        pool.synchronize_stream(fresh).unwrap();
    }
    pool.trim_to(0).unwrap();
    assert_eq!(pool.stats().reserved_current, 0);
}

#[test]
fn after_synchronisation_the_whole_pool_serves_any_stream() {
    for seed in 1..=8 {
        for cache in [0, 64 << 20] {
            for per_stream in [false, true] {
                round(seed, cache, per_stream);
            }
        }
    }
}
