//! The first-fit index against a model. docs/design.md: medium requests
//! (from 1 MiB to below 16 MiB) go to the lowest window of their zone (a
//! quarter of the address range) that holds no block in use, whatever is
//! mapped there. On one stream every free is usable by the next request,
//! so the model is a list of live blocks: the expected address is the
//! lowest one in the zone where the request overlaps none of them.
//!
//! The pool is built to fragment: small pages (64 KiB, so the max-tree
//! over pages is deep), a small address range (so the medium zone fills
//! up and runs out), sizes that are exactly a current gap's length, a few
//! bytes more or less, and alternating frees.

mod common;

use common::Rng;
use std::collections::BTreeMap;
use std::sync::Arc;
use tidepool::{MemPool, PoolConfig};
use tidepool_sys::{Device, HostConfig, HostDevice};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

fn span(size: usize) -> usize {
    size.next_multiple_of(512)
}

/// The lowest start in `[lo, hi)` where `len` bytes overlap no live block.
fn model_first_fit(live: &BTreeMap<u64, usize>, lo: u64, hi: u64, len: usize) -> Option<u64> {
    let mut at = lo;
    for (&p, &l) in live.range(..hi) {
        let end = p + l as u64;
        if end <= at {
            continue;
        }
        if p >= at + len as u64 {
            break;
        }
        at = end;
    }
    (at + len as u64 <= hi).then_some(at)
}

/// The gaps between live blocks inside `[lo, hi)`.
fn gaps(live: &BTreeMap<u64, usize>, lo: u64, hi: u64) -> Vec<(u64, usize)> {
    let mut out = Vec::new();
    let mut at = lo;
    for (&p, &l) in live.range(lo..hi) {
        if p > at {
            out.push((at, (p - at) as usize));
        }
        at = at.max(p + l as u64);
    }
    if hi > at {
        out.push((at, (hi - at) as usize));
    }
    out
}

fn run(seed: u64, ops: usize, gran: usize, va: usize) -> (usize, usize, usize) {
    let dev = Arc::new(HostDevice::with_config(HostConfig {
        capacity: va,
        granularity: gran,
    }));
    let pool = MemPool::new(
        dev.clone(),
        PoolConfig::default()
            .with_va_size(va)
            .with_page_size(gran)
            .with_stream_cache_bytes(0),
    )
    .expect("pool");
    let s = dev.create_stream().unwrap();
    let mut rng = Rng(seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1);
    // The zone's start: where the first medium block of an empty pool goes.
    let first = pool.alloc_async(MIB, s).unwrap();
    let zone_lo = first.ptr();
    let zone_hi = zone_lo + (va / 4) as u64;
    let mut live: BTreeMap<u64, usize> = BTreeMap::new();
    let mut blocks: BTreeMap<u64, tidepool::Allocation> = BTreeMap::new();
    live.insert(first.ptr(), span(MIB));
    blocks.insert(first.ptr(), first);
    let (mut checked, mut outside, mut exact) = (0, 0, 0);
    for step in 0..ops {
        let used: usize = live.values().sum();
        let free_now = rng.range(0, 9) < 4 || used > va / 4 - 8 * MIB;
        if free_now && !blocks.is_empty() {
            // Free every other block by address now and then: a checkerboard.
            if rng.range(0, 19) == 0 {
                let keys: Vec<u64> = blocks.keys().copied().step_by(2).collect();
                for k in keys {
                    live.remove(&k);
                    pool.free_async(blocks.remove(&k).unwrap(), s).unwrap();
                }
            } else {
                let k = rng.range(0, blocks.len() as u64 - 1) as usize;
                let key = *blocks.keys().nth(k).unwrap();
                live.remove(&key);
                pool.free_async(blocks.remove(&key).unwrap(), s).unwrap();
            }
            continue;
        }
        // A size: a current gap's length exactly, or 512 bytes more or
        // less, or a random medium size.
        let g = gaps(&live, zone_lo, zone_hi);
        let medium = |n: usize| n.clamp(MIB, 16 * MIB - 512);
        let size = match rng.range(0, 5) {
            0..=2 if !g.is_empty() => {
                let (_, gl) = g[rng.range(0, g.len() as u64 - 1) as usize];
                let tweak = rng.range(0, 2) as usize;
                exact += (tweak == 0) as usize;
                medium([gl, gl + 512, gl.saturating_sub(512)][tweak])
            }
            _ => rng.log_range(MIB as u64, 6 * MIB as u64) as usize,
        };
        let want = model_first_fit(&live, zone_lo, zone_hi, span(size));
        let a = pool.alloc_async(size, s).unwrap_or_else(|e| {
            panic!("seed {seed} step {step}: {size} B failed with the device far from full: {e}")
        });
        match want {
            Some(w) => {
                assert_eq!(
                    a.ptr(),
                    w,
                    "seed {seed} step {step}: {size} B placed at zone+{:#x}, the lowest \
                     free window is at zone+{:#x}",
                    a.ptr().wrapping_sub(zone_lo),
                    w - zone_lo
                );
                checked += 1;
            }
            None => outside += 1,
        }
        for (&p, &l) in live.range(..a.ptr() + span(size) as u64) {
            assert!(
                p + l as u64 <= a.ptr(),
                "seed {seed} step {step}: overlaps a live block"
            );
        }
        live.insert(a.ptr(), span(size));
        blocks.insert(a.ptr(), a);
    }
    for (_, a) in std::mem::take(&mut blocks) {
        pool.free_async(a, s).unwrap();
    }
    pool.synchronize().unwrap();
    assert_eq!(pool.stats().used_current, 0);
    pool.trim_to(0).unwrap();
    assert_eq!(pool.stats().reserved_current, 0);
    (checked, outside, exact)
}

#[test]
fn medium_requests_go_to_the_lowest_free_window() {
    use std::io::Write;
    // 64 KiB pages: a deep tree, blocks many pages long. 2 MiB pages:
    // several spans start in one page (a page's leaf is the longest).
    for (seed, gran, va) in [
        (1, 64 * KIB, 256 * MIB),
        (2, 64 * KIB, 256 * MIB),
        (3, 2 * MIB, 256 * MIB),
        (4, 2 * MIB, 256 * MIB),
    ] {
        let (checked, outside, exact) = run(seed, 1500, gran, va);
        let _ = writeln!(
            std::io::stderr().lock(),
            "seed {seed}: {checked} placements checked against the model, {outside} with \
             no window in the zone, {exact} sized exactly to a gap"
        );
        assert!(checked > 500);
    }
}
