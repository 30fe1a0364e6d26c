//! Thousands of small ranges in the free map: pages cut into 512-byte
//! blocks on three to five streams, freed every other one (thousands of
//! separate free ranges, so the map spans many chunks of 16 entries), then
//! the rest freed in orders that meet the chunk bounds (strides of 15, 16
//! and 17, from the back, pairs around multiples of 16), with takes of
//! several sizes, epochs (events) and `trim_to` between the frees. After
//! each step: no overlap of live blocks, used bytes equal to the live
//! bytes, reserved bytes under the cap; at the end of each round every
//! block's words intact and, all free and complete, the whole cap in one
//! take.

mod attack17_support;
mod common;

use attack17_support::{capped, check_kernel, reuse, write_kernel, Live, PAGE};
use common::Rng;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use tidepool::MemPool;
use tidepool_sys::HostDevice;

const BLOCK: usize = 512;

fn check_model(pool: &MemPool<HostDevice>, live: &[Option<Live>], cap: usize, what: &str) {
    let s = pool.stats();
    let used: u64 = live.iter().flatten().map(|l| l.a.size() as u64).sum();
    assert_eq!(s.used_current, used, "{what}: used bytes ({s:?})");
    assert!(
        s.reserved_current <= (cap * PAGE) as u64,
        "{what}: reserved above the cap ({s:?})"
    );
}

fn order(kind: u64, n: usize) -> Vec<usize> {
    let odd: Vec<usize> = (0..n).filter(|i| i % 2 == 1).collect();
    match kind {
        0 => odd.iter().rev().copied().collect(),
        1..=3 => {
            // Strides of 15, 16, 17 over the odd blocks, wrapping.
            let stride = 14 + kind as usize;
            let mut v = Vec::with_capacity(odd.len());
            for start in 0..stride {
                let mut i = start;
                while i < odd.len() {
                    v.push(odd[i]);
                    i += stride;
                }
            }
            v
        }
        _ => {
            // Pairs on either side of each multiple of 16 first.
            let mut v: Vec<usize> = odd
                .iter()
                .copied()
                .filter(|i| i % 32 < 2 || i % 32 > 29)
                .collect();
            v.extend(odd.iter().copied().filter(|i| !(i % 32 < 2 || i % 32 > 29)));
            v
        }
    }
}

fn round(seed: u64, kind: u64, streams_n: usize, pages: usize) {
    let what0 = format!("seed {seed} order {kind}");
    let cap = pages + 2;
    let dev = Arc::new(common::host_with_capacity(cap * PAGE + (64 << 20)));
    let pool = MemPool::new(
        dev.clone(),
        capped(64 << 20, cap, 0, reuse(true, true, false)),
    )
    .expect("pool");
    let streams = common::streams(&*dev, streams_n);
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut kernels: Vec<(String, Receiver<bool>)> = Vec::new();
    let n = pages * PAGE / BLOCK;
    let mut live: Vec<Option<Live>> = Vec::with_capacity(n);
    for i in 0..n {
        let st = streams[i / 64 % streams_n];
        let a = pool
            .alloc_async(BLOCK, st)
            .unwrap_or_else(|e| panic!("{what0}: block {i}: {e}"));
        let l = Live {
            a,
            tag: i as u32 + 1,
            stream: st,
        };
        if let Some(k) = write_kernel(&dev, st, &l) {
            kernels.push((format!("{what0}: block {i}"), k));
        }
        live.push(Some(l));
    }
    let mut extra: Vec<Live> = Vec::new();
    let mut tag = n as u32 + 1;
    let all_live = |live: &Vec<Option<Live>>, extra: &Vec<Live>| -> Vec<(u64, usize)> {
        live.iter()
            .flatten()
            .chain(extra.iter())
            .map(|l| (l.a.ptr(), l.a.size()))
            .collect()
    };
    // Every other block first: thousands of separate free ranges.
    for i in (0..n).step_by(2) {
        let l = live[i].take().unwrap();
        let st = l.stream;
        pool.free_async(l.a, st).unwrap();
    }
    check_model(&pool, &live, cap, &what0);
    let rest = order(kind, n);
    for (step, &i) in rest.iter().enumerate() {
        let what = format!("{what0} step {step}");
        let l = live[i].take().unwrap();
        // Sometimes freed on another stream ordered after the block's.
        let on = if rng.range(0, 3) == 0 {
            let other = streams[rng.range(0, streams_n as u64 - 1) as usize];
            if other != l.stream {
                let ev = pool.record_event(l.stream).unwrap();
                pool.wait_event(other, &ev).unwrap();
            }
            other
        } else {
            l.stream
        };
        pool.free_async(l.a, on).unwrap();
        if step % 7 == 0 {
            let len = match rng.range(0, 5) {
                0 => 1,
                1 => BLOCK,
                2 => 3 * BLOCK,
                3 => rng.range(1, 8) as usize * 1024,
                4 => PAGE,
                _ => rng.range(1, 64) as usize * 256 + 1,
            };
            let st = streams[rng.range(0, streams_n as u64 - 1) as usize];
            if let Ok(a) = pool.alloc_async(len, st) {
                for (p, s) in all_live(&live, &extra) {
                    assert!(
                        !common::overlaps(a.ptr(), a.size(), p, s),
                        "{what}: {len} B at {:#x} overlaps {s} B at {p:#x}",
                        a.ptr()
                    );
                }
                tag += 1;
                let l = Live { a, tag, stream: st };
                if let Some(k) = write_kernel(&dev, st, &l) {
                    kernels.push((format!("{what}: take {len} B"), k));
                }
                extra.push(l);
            }
        }
        if step % 97 == 0 {
            pool.trim_to(rng.range(0, cap as u64) * PAGE as u64)
                .unwrap();
        }
        if step % 131 == 0 && !extra.is_empty() {
            let j = rng.range(0, extra.len() as u64 - 1) as usize;
            let l = extra.swap_remove(j);
            let st = l.stream;
            pool.free_async(l.a, st).unwrap();
        }
        let used: u64 = live
            .iter()
            .flatten()
            .chain(extra.iter())
            .map(|l| l.a.size() as u64)
            .sum();
        assert_eq!(pool.stats().used_current, used, "{what}: used bytes");
        check_reserved(&pool, cap, &what);
    }
    pool.synchronize().unwrap();
    common::expect_kernels_mapped(&mut kernels);
    for l in &extra {
        let bad = check_kernel(&dev, l.stream, l);
        assert!(
            bad.is_none(),
            "{what0}: block {} lost its words: {bad:?}",
            l.tag
        );
    }
    for l in extra.drain(..) {
        let st = l.stream;
        pool.free_async(l.a, st).unwrap();
    }
    pool.synchronize().unwrap();
    let all = pool
        .alloc_async(cap * PAGE, streams[0])
        .unwrap_or_else(|e| panic!("{what0}: the whole cap, all free: {e} ({:?})", pool.stats()));
    pool.free_async(all, streams[0]).unwrap();
    pool.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    assert_eq!(pool.stats().reserved_current, 0, "{what0}");
    drop(pool);
    assert_eq!(dev.live_mappings(), 0, "{what0}");
}

fn check_reserved(pool: &MemPool<HostDevice>, cap: usize, what: &str) {
    let s = pool.stats();
    assert!(
        s.reserved_current >= s.used_current && s.reserved_current <= (cap * PAGE) as u64,
        "{what}: reserved bytes ({s:?})"
    );
}

#[test]
fn chunk_bound_orders_three_streams() {
    for kind in 0..5 {
        round(kind + 1, kind, 3, 2);
    }
}

#[test]
fn chunk_bound_orders_five_streams() {
    for kind in 0..5 {
        round(kind + 11, kind, 5, 1);
    }
}
