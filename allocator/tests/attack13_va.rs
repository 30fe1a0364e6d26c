//! Address-space exhaustion: a pool whose virtual range is small (64 MiB,
//! four zones of 16 MiB) and whose device holds exactly that much, on one
//! stream (every free usable at once, every page movable once the stream's
//! frees are known complete). Requests of every size class, some larger
//! than their zone. The model is the list of live blocks: a request must
//! succeed whenever some window of the whole range is free of live blocks
//! (physical pages can always be found: the device holds the whole range),
//! wherever its zone would put it.

mod common;

use common::{Rng, PAGE};
use std::collections::BTreeMap;
use std::sync::Arc;
use tidepool::{MemPool, PoolConfig};
use tidepool_sys::{Device, HostConfig, HostDevice};

const VA: usize = 64 << 20;

fn span(size: usize) -> usize {
    size.next_multiple_of(512)
}

/// Whether `[lo, hi)` has `len` bytes free of live blocks, contiguous.
fn has_window(live: &BTreeMap<u64, usize>, lo: u64, hi: u64, len: usize) -> Option<u64> {
    let mut at = lo;
    for (&p, &l) in live.iter() {
        if p >= at + len as u64 {
            break;
        }
        at = at.max(p + l as u64);
    }
    (at + len as u64 <= hi).then_some(at)
}

fn run(seed: u64, sync_every_free: bool) -> (usize, usize) {
    let dev = Arc::new(HostDevice::with_config(HostConfig {
        capacity: VA,
        granularity: PAGE,
    }));
    let pool = MemPool::new(
        dev.clone(),
        PoolConfig::default()
            .with_va_size(VA)
            .with_stream_cache_bytes(0),
    )
    .unwrap();
    let s = dev.create_stream().unwrap();
    // The small zone starts the range: the first small block of an empty
    // pool is its base.
    let first = pool.alloc_async(512, s).unwrap();
    let base = first.ptr();
    let end = base + VA as u64;
    let mut live: BTreeMap<u64, usize> = BTreeMap::new();
    let mut blocks: BTreeMap<u64, tidepool::Allocation> = BTreeMap::new();
    live.insert(base, 512);
    blocks.insert(base, first);
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let (mut ok, mut full) = (0, 0);
    for step in 0..1500 {
        if rng.range(0, 9) < 4 && !blocks.is_empty() {
            let k = rng.range(0, blocks.len() as u64 - 1) as usize;
            let key = *blocks.keys().nth(k).unwrap();
            live.remove(&key);
            pool.free_async(blocks.remove(&key).unwrap(), s).unwrap();
            if sync_every_free {
                pool.synchronize_stream(s).unwrap();
            }
            continue;
        }
        let size = match rng.range(0, 4) {
            0 => rng.log_range(512, 1 << 20) as usize,
            1 => rng.log_range(1 << 20, 16 << 20) as usize,
            2 => rng.log_range(16 << 20, 40 << 20) as usize,
            _ => PAGE * rng.range(1, 4) as usize,
        };
        match pool.alloc_async(size, s) {
            Ok(a) => {
                ok += 1;
                let (p, l) = (a.ptr(), span(size));
                assert!(
                    p >= base && p + l as u64 <= end,
                    "step {step}: outside the range"
                );
                if let Some((&q, &ql)) = live.range(..p + l as u64).next_back() {
                    assert!(q + ql as u64 <= p, "step {step}: overlaps a live block");
                }
                live.insert(p, l);
                blocks.insert(p, a);
            }
            Err(e) => {
                full += 1;
                if let Some(w) = has_window(&live, base, end, span(size)) {
                    panic!(
                        "seed {seed} step {step} (sync {sync_every_free}): false \
                         out-of-memory: {size} B fit at range+{:#x} ({} live blocks, \
                         {} B live): {e}",
                        w - base,
                        live.len(),
                        live.values().sum::<usize>()
                    );
                }
            }
        }
    }
    for (_, a) in std::mem::take(&mut blocks) {
        pool.free_async(a, s).unwrap();
    }
    pool.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    assert_eq!(pool.stats().reserved_current, 0);
    (ok, full)
}

#[test]
fn any_free_window_of_the_range_serves_a_request() {
    use std::io::Write;
    for seed in 1..=6 {
        for sync in [true, false] {
            let (ok, full) = run(seed, sync);
            let _ = writeln!(
                std::io::stderr().lock(),
                "seed {seed} sync {sync}: {ok} served, {full} out-of-memory (no window)"
            );
        }
    }
}
