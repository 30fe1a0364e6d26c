//! Best fit in the small zone, seen through the public API, with the
//! number of free runs stepped from 1 to 200 (across any threshold at
//! which the arena changes how it finds the best run): one stream, no
//! stream cache, every free complete, 4 KiB blocks laid side by side and
//! freed in groups of 1 to 3 (holes of equal lengths: ties). Each request
//! must land in the smallest hole that holds it, the lowest one among
//! equals; then requests are kept, filling the holes, until none is left
//! (the run count falls back past every threshold), each placed as a
//! model of the holes says.
//!
//! Caught: the best-fit index skipping its first candidate (the smallest,
//! lowest run), run keys ordered by descending start, and the walk over
//! few runs letting a later run of the best length win (`rlen <= bl`:
//! both tests, on the way down). Not caught: ties reversed in the sorted
//! fallback of `runs_by_size` (these requests do not reach it).

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use tidepool::{Allocation, PoolConfig};
use tidepool_sys::Device;

const BLOCK: usize = 4096;

#[test]
fn smallest_then_lowest_hole_at_every_run_count() {
    run(false);
}

/// The same with the stream held busy throughout: every free stays
/// pending on the stream that asks again (reusable in stream order), so
/// best fit weighs the ranges' guards.
#[test]
fn smallest_then_lowest_hole_with_frees_pending() {
    run(true);
}

fn run(pending: bool) {
    let dev = Arc::new(common::host_with_capacity(64 << 20));
    let pool = common::pool(
        &dev,
        PoolConfig::default()
            .with_va_size(4 << 30)
            .with_stream_cache_bytes(0),
    );
    let s = dev.create_stream().unwrap();
    let mut gate = pending.then(|| common::Blocker::on(&*dev, s));
    let settle = || {
        if !pending {
            pool.synchronize().unwrap();
        }
    };
    let mut rng = common::Rng(0x5DEE_CE66_D1CE_4E5B);
    // 1000 blocks side by side (the first page's start is whatever the
    // pool gives; the blocks must follow each other).
    let blocks: Vec<Allocation> = (0..1000)
        .map(|_| pool.alloc_async(BLOCK, s).unwrap())
        .collect();
    let base = blocks[0].ptr();
    for (i, b) in blocks.iter().enumerate() {
        assert_eq!(b.ptr(), base + (i * BLOCK) as u64, "blocks side by side");
    }
    let mut blocks: Vec<Option<Allocation>> = blocks.into_iter().map(Some).collect();
    // Holes at slots 4k+1 .. 4k+1+len (len 1..=3), kept apart by live
    // blocks: hole start slot -> length in blocks.
    let mut holes: BTreeMap<usize, usize> = BTreeMap::new();
    let mut order: Vec<usize> = (0..200).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.range(0, i as u64) as usize);
    }
    let mut checked = 0;
    for (n, &k) in order.iter().enumerate() {
        let len = rng.range(1, 3) as usize;
        let at = 5 * k + 1;
        for b in &mut blocks[at..at + len] {
            pool.free_async(b.take().unwrap(), s).unwrap();
        }
        holes.insert(at, len);
        settle();
        // Requests of 1..=3 blocks, each freed again before the next.
        for want in 1..=3usize {
            let a = pool.alloc_async(want * BLOCK, s).unwrap();
            let slot = ((a.ptr() - base) / BLOCK as u64) as usize;
            let expect = holes
                .iter()
                .filter(|&(_, &l)| l >= want)
                .min_by_key(|&(&st, &l)| (l, st))
                .map(|(&st, _)| st);
            match expect {
                Some(st) => {
                    let l = holes[&st];
                    assert!(
                        (st..st + l).contains(&slot) && slot + want <= st + l,
                        "{} holes: {want} blocks placed at slot {slot}, best fit is the \
                         {l}-block hole at slot {st}",
                        n + 1
                    );
                    checked += 1;
                }
                None => assert!(
                    a.ptr() < base || slot >= 1000,
                    "{} holes: {want} blocks at slot {slot}, no hole holds them",
                    n + 1
                ),
            }
            pool.free_async(a, s).unwrap();
            settle();
        }
    }
    assert!(checked > 500, "only {checked} placements checked");
    // Back down: requests kept, each filling part or all of its hole,
    // until no hole is left (the run count falls past every threshold).
    let mut kept = Vec::new();
    let up = checked;
    while !holes.is_empty() {
        let want = rng.range(1, 3) as usize;
        let a = pool.alloc_async(want * BLOCK, s).unwrap();
        let slot = ((a.ptr() - base) / BLOCK as u64) as usize;
        let expect = holes
            .iter()
            .filter(|&(_, &l)| l >= want)
            .min_by_key(|&(&st, &l)| (l, st))
            .map(|(&st, &l)| (st, l));
        if let Some((st, l)) = expect {
            assert!(
                (st..st + l).contains(&slot) && slot + want <= st + l,
                "{} holes left: {want} blocks placed at slot {slot}, best fit is the \
                 {l}-block hole at slot {st}",
                holes.len()
            );
            holes.remove(&st);
            if slot > st {
                holes.insert(st, slot - st);
            }
            if slot + want < st + l {
                holes.insert(slot + want, st + l - slot - want);
            }
            checked += 1;
        }
        kept.push(a);
    }
    assert!(
        checked > up + 100,
        "only {} placements checked on the way down",
        checked - up
    );
    for a in kept {
        pool.free_async(a, s).unwrap();
    }
    if let Some(g) = gate.as_mut() {
        g.release();
    }
    for b in blocks.into_iter().flatten() {
        pool.free_async(b, s).unwrap();
    }
    pool.synchronize().unwrap();
}
