//! Huge blocks in a capped pool with ghosts (windows whose pages were
//! trimmed or moved away) and frees pending on a held stream: a request
//! for N pages must succeed whenever at least N pages of the cap are
//! touched by no live block and by no free still pending, since the pool
//! can move free pages to any window of its address space. The choice of
//! window (ghost weight against binds) must never turn such a request
//! into an out-of-memory. Between requests: no overlap, the words of
//! every live block survive. Work is bounded by operation counts.

mod common;

use common::{Blocker, Rng};
use std::collections::BTreeSet;
use std::sync::Arc;
use tidepool::{Allocation, MemPool, PoolConfig, ReusePolicy};
use tidepool_sys::{HostConfig, HostDevice, Stream};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const PAGE: usize = 2 * MIB;
const CAP_PAGES: usize = 32;

fn pages(a: &Allocation, set: &mut BTreeSet<u64>) {
    set.extend(common::pages_of(a.ptr(), a.size()));
}

struct Live {
    a: Allocation,
    tag: u32,
    stream: Stream,
}

fn check(dev: &HostDevice, live: &[Live], what: &str) {
    for l in live {
        let n = (l.a.size() / 4).min(16);
        let got = dev.read_words(l.a.ptr(), n).expect("read");
        assert!(got.iter().all(|&w| w == l.tag), "{what}: live data changed");
        let end = (l.a.ptr() + l.a.size() as u64 - 4) / 4 * 4;
        assert_eq!(
            dev.read_words(end, 1).expect("read")[0],
            l.tag,
            "{what}: live tail"
        );
    }
}

fn fill(dev: &HostDevice, a: &Allocation, tag: u32) {
    let n = (a.size() / 4).min(16);
    dev.write_words(a.ptr(), &vec![tag; n]).expect("write");
    let end = (a.ptr() + a.size() as u64 - 4) / 4 * 4;
    dev.write_words(end, &[tag]).expect("write");
}

fn run(cfg: PoolConfig, seed: u64, units: bool) -> usize {
    let dev = Arc::new(HostDevice::with_config(HostConfig {
        capacity: CAP_PAGES * PAGE,
        granularity: PAGE,
    }));
    let pool = MemPool::new(dev.clone(), cfg).expect("pool");
    let st = common::streams(&*dev, 2);
    let (s, h) = (st[0], st[1]);
    let mut rng = Rng(seed);
    let mut live: Vec<Live> = Vec::new();
    let mut tag = 0u32;
    let mut huge_ok = 0;
    for round in 0..12 {
        let mut hold = Blocker::on(&*dev, h);
        let mut pending: BTreeSet<u64> = BTreeSet::new();
        let mut pending_blocks: Vec<(u64, usize)> = Vec::new();
        // Scatter blocks of many sizes, then free some: on h (pending
        // behind the hold) or on s (complete at once: s is idle).
        for _ in 0..rng.range(6, 14) {
            let size = if rng.range(0, 1) == 0 {
                rng.log_range(4 * KIB as u64, MIB as u64) as usize
            } else {
                rng.log_range(MIB as u64, 5 * MIB as u64) as usize
            };
            let stream = if rng.range(0, 1) == 0 { s } else { h };
            match pool.alloc_async(size, stream) {
                Ok(a) => {
                    tag += 1;
                    fill(&dev, &a, tag);
                    live.push(Live { a, tag, stream });
                }
                Err(e) => assert!(e.is_out_of_memory(), "{e}"),
            }
        }
        for _ in 0..live.len() / 2 {
            let i = rng.range(0, live.len() as u64 - 1) as usize;
            let l = live.swap_remove(i);
            if l.stream == h {
                pages(&l.a, &mut pending);
                pending_blocks.push((l.a.ptr(), l.a.size()));
            }
            pool.free_async(l.a, l.stream).expect("free");
        }
        if round % 3 == 2 {
            // Ghosts: pages trimmed away from their windows.
            pool.trim_to(pool.stats().reserved_current / 2)
                .expect("trim");
        }
        check(&dev, &live, "before the huge request");
        let mut taken = pending.clone();
        for l in &live {
            pages(&l.a, &mut taken);
        }
        let mut free_pages = CAP_PAGES - taken.len();
        if units {
            // Free pages inside a partly used unit cannot move alone: only
            // the device's room for new pages is certain.
            let room = CAP_PAGES - pool.stats().reserved_current as usize / PAGE;
            free_pages = free_pages.min(room);
        }
        // The largest request the free pages certainly hold, and a
        // smaller one.
        for n in [free_pages, free_pages / 2 + 1] {
            if n < 4 {
                continue;
            }
            let size = n * PAGE;
            let what = format!("seed {seed} round {round}: {n} pages, {free_pages} free");
            let a = pool
                .alloc_async(size, s)
                .unwrap_or_else(|e| panic!("{what}: false out-of-memory: {e}"));
            for l in &live {
                assert!(
                    a.ptr() + a.size() as u64 <= l.a.ptr()
                        || l.a.ptr() + l.a.size() as u64 <= a.ptr(),
                    "{what}: overlaps a live block"
                );
            }
            assert!(!hold.done());
            for &(p, len) in &pending_blocks {
                assert!(
                    a.ptr() + a.size() as u64 <= p || p + len as u64 <= a.ptr(),
                    "{what}: the huge block {:#x}+{:#x} took bytes of a free pending at {p:#x}+{len:#x}",
                    a.ptr(),
                    a.size()
                );
            }
            tag += 1;
            fill(&dev, &a, tag);
            check(&dev, &live, &what);
            pool.free_async(a, s).expect("free");
            huge_ok += 1;
        }
        hold.release();
        pool.synchronize().expect("sync");
        check(&dev, &live, "after the round");
    }
    for l in live.drain(..) {
        pool.free_async(l.a, l.stream).expect("free");
    }
    pool.synchronize().expect("sync");
    pool.trim_to(0).expect("trim");
    assert_eq!(pool.stats().reserved_current, 0);
    huge_ok
}

#[test]
fn huge_blocks_under_a_cap_find_the_free_pages() {
    let policy = ReusePolicy {
        // A pending free is never taken by waiting for it: the count of
        // free pages above leaves them out.
        internal_dependencies: false,
        wait_for_pending_frees: false,
        ..ReusePolicy::default()
    };
    let base = PoolConfig::default()
        .with_va_size(1 << 30)
        .with_reuse(policy);
    let mut ok = 0;
    for seed in 1..=6u64 {
        ok += run(base.clone(), seed * 0x2545_F491 + 1, false);
        ok += run(
            base.clone()
                .with_max_unit_size(8 * MIB)
                .with_unit_min_block(4 * MIB),
            seed * 0x2545_F491 + 2,
            true,
        );
        ok += run(
            base.clone().with_stream_cache_bytes(0),
            seed * 0x2545_F491 + 3,
            false,
        );
    }
    assert!(ok > 100, "only {ok} huge requests were made");
}
