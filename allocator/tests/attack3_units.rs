//! Physical units of several pages (`PoolConfig::max_unit_size`) under a
//! random workload in a capped pool, seen from outside as a user would:
//! several streams, one of them held busy by a host task while it frees,
//! cross-stream frees ordered through the pool's events, trims and
//! synchronisations, and the release threshold.
//!
//! Every run checks that
//! - no two live blocks overlap;
//! - tags written (in stream order, by the host tag kernels) at both ends
//!   of every page of every block are intact when the block is freed, and
//!   no fill or verify ever found its range unmapped: nothing in use, and
//!   no free whose work is pending, is unmapped or moved;
//! - `trim_to` returns exactly the drop of `reserved_current`;
//! - after everything is freed: `used_current` 0, `trim_to(0)` leaves
//!   nothing reserved, and the device holds no handle and no mapping.
//!
//! Each run also counts false out-of-memory results: a request that fails
//! after every stream that is not held busy was synchronised, and then
//! succeeds after `trim_to(0)` (trim releases only idle memory whose frees
//! are complete, which the request could have used itself; it keeps a unit
//! that is partly in use, so the documented cost of units, pinned idle
//! pages, is not counted). None is left over the sweeps below; the
//! smallest cases found along the way are ordinary tests. The oracle waits,
//! before its retry, for the held stream to reach its hold, so that what
//! the pool can learn of the work queued there before the hold does not
//! change between the failed request and the trim.

mod common;

use common::*;
use std::sync::Arc;
use tidepool::{Allocation, MemPool, PoolConfig, PoolError, ReusePolicy};
use tidepool_kernels::kernels_for_host;
use tidepool_kernels::stress::XorShift64;
use tidepool_sys::{Device, HostDevice, Stream};

const MIB: usize = 1 << 20;
/// Bytes tagged at each end of each page a block covers.
const SPOT: usize = 256;

struct Live {
    a: Allocation,
    stream: Stream,
    tag: u32,
}

/// The tagged spots of a block: both ends of its part of every page.
fn spots(a: &Allocation) -> Vec<(u64, usize)> {
    let (start, end) = (a.ptr(), a.ptr() + a.size() as u64);
    let page = PAGE as u64;
    let mut out = Vec::new();
    let mut p = start / page * page;
    while p < end {
        let (lo, hi) = (start.max(p), end.min(p + page));
        let lo = lo.next_multiple_of(4);
        let hi = hi / 4 * 4;
        if hi > lo {
            let n = (SPOT as u64).min(hi - lo);
            out.push((lo, n as usize));
            if hi - n > lo + n {
                out.push((hi - n, n as usize));
            }
        }
        p += page;
    }
    out
}

struct Cfg {
    max_unit: usize,
    unit_min: usize,
    capacity: usize,
    max_size: Option<u64>,
    threshold: u64,
    seed: u64,
    ops: usize,
}

#[derive(Default)]
struct Outcome {
    false_ooms: Vec<String>,
    ooms: usize,
    unit_handles: bool,
}

fn run(cfg: &Cfg) -> Outcome {
    let dev = Arc::new(host_with_capacity(cfg.capacity));
    let reuse = ReusePolicy {
        // A wait made for the request on the held stream would block the
        // synchronisations of the oracle; a host wait would only wait.
        internal_dependencies: false,
        wait_for_pending_frees: false,
        ..ReusePolicy::default()
    };
    let mut pc = PoolConfig::default()
        .with_va_size(1 << 30)
        .with_max_unit_size(cfg.max_unit)
        .with_unit_min_block(cfg.unit_min)
        .with_release_threshold(cfg.threshold)
        .with_reuse(reuse);
    if let Some(m) = cfg.max_size {
        pc = pc.with_max_size(m);
    }
    let pool = MemPool::new(dev.clone(), pc).expect("pool");
    let k = kernels_for_host(dev.clone());
    let ss = streams(&*dev, 3);
    // ss[2] is held busy at times; frees on it stay pending meanwhile.
    let mut blocker: Option<Blocker> = None;
    // Says when ss[2] has reached its hold: its work from before the hold
    // is then done, events recorded on it before the hold included.
    let mut reached: Option<std::sync::mpsc::Receiver<()>> = None;
    let mut rng = XorShift64::new(cfg.seed);
    let mut live: Vec<Live> = Vec::new();
    let mut out = Outcome::default();
    let mut tag = 1u32;
    let mut units_seen = false;

    let sync_free = |pool: &MemPool<HostDevice>, blocked: bool| {
        for (i, &s) in ss.iter().enumerate() {
            if !(blocked && i == 2) {
                pool.synchronize_stream(s).unwrap();
            }
        }
    };

    for op in 0..cfg.ops {
        let r = rng.below(100);
        if r < 45 && live.len() < 10 {
            let size = match rng.below(10) {
                0..=2 => rng.log_uniform(4 << 10, MIB),
                3..=5 => rng.log_uniform(MIB, 6 * MIB),
                _ => rng.log_uniform(4 * MIB, 20 * MIB),
            };
            let s = ss[rng.index(3)];
            let a = match pool.alloc_async(size, s) {
                Ok(a) => a,
                Err(PoolError::OutOfMemory(_)) => {
                    out.ooms += 1;
                    sync_free(&pool, blocker.is_some());
                    // The held stream's work from before its hold is done
                    // too, so that what the pool can learn of it does not
                    // change between the request and the trim below.
                    if let Some(rx) = reached.take() {
                        rx.recv().expect("the held stream reaches its hold");
                    }
                    match pool.alloc_async(size, s) {
                        Ok(a) => a,
                        Err(PoolError::OutOfMemory(_)) => {
                            let before = pool.stats();
                            let released = pool.trim_to(0).unwrap();
                            let after = pool.stats();
                            assert_eq!(
                                released,
                                before.reserved_current - after.reserved_current,
                                "trim_to returns what it released"
                            );
                            match pool.alloc_async(size, s) {
                                Ok(a) => {
                                    if std::env::var("ATTACK3_DUMP").is_ok() {
                                        let mut v: Vec<_> = live
                                            .iter()
                                            .map(|l| (l.a.ptr(), l.a.size(), l.stream.id()))
                                            .collect();
                                        v.sort();
                                        let base = v.iter().map(|x| x.0).min().unwrap_or(0);
                                        use std::io::Write;
                                        let mut e = std::io::stderr().lock();
                                        let _ = writeln!(
                                            e,
                                            "blocked {} got {:#x} before {before:?}",
                                            blocker.is_some(),
                                            a.ptr()
                                        );
                                        for (p, n, st) in v {
                                            let _ = writeln!(e, "  live {:#x} (+{:.3} MiB from lowest) {n} B = {:.3} MiB stream {st}", p, (p - base) as f64 / MIB as f64, n as f64 / MIB as f64);
                                        }
                                    }
                                    out.false_ooms.push(format!(
                                        "op {op}: {size} B on stream {} failed with \
                                         reserved {} used {}, then succeeded after trim_to(0) \
                                         released {released}",
                                        s.id(),
                                        before.reserved_current,
                                        before.used_current
                                    ));
                                    a
                                }
                                Err(PoolError::OutOfMemory(_)) => continue,
                                Err(e) => panic!("op {op}: {e}"),
                            }
                        }
                        Err(e) => panic!("op {op}: {e}"),
                    }
                }
                Err(e) => panic!("op {op}: alloc {size}: {e}"),
            };
            for l in &live {
                let (x, y) = (l.a.ptr(), l.a.ptr() + l.a.size() as u64);
                assert!(
                    a.ptr() + a.size() as u64 <= x || y <= a.ptr(),
                    "op {op}: a new block [{:#x}+{}] overlaps a live one [{x:#x}+{}]",
                    a.ptr(),
                    a.size(),
                    l.a.size()
                );
            }
            tag = tag.wrapping_add(0x9E37);
            for (p, n) in spots(&a) {
                k.fill_tag(s, p, n, tag).unwrap();
            }
            live.push(Live { a, stream: s, tag });
        } else if r < 85 && !live.is_empty() {
            let l = live.swap_remove(rng.index(live.len()));
            let fs = if rng.percent(35) {
                let other = ss[rng.index(3)];
                // A stream that waits on the held one would be held too,
                // and the oracle's synchronisations would never return.
                let held = blocker.is_some() && l.stream == ss[2];
                if other != l.stream && !held {
                    let ev = pool.record_event(l.stream).unwrap();
                    pool.wait_event(other, &ev).unwrap();
                }
                if other != l.stream && held {
                    l.stream
                } else {
                    other
                }
            } else {
                l.stream
            };
            for (p, n) in spots(&l.a) {
                k.verify_tag(fs, p, n, l.tag).unwrap();
            }
            pool.free_async(l.a, fs).unwrap();
        } else if r < 90 {
            match blocker.take() {
                Some(mut b) => {
                    b.release();
                    reached = None;
                }
                None => {
                    let (tx, rx) = std::sync::mpsc::channel();
                    dev.launch_host(
                        ss[2],
                        Box::new(move || {
                            let _ = tx.send(());
                        }),
                    )
                    .unwrap();
                    reached = Some(rx);
                    blocker = Some(Blocker::on(&*dev, ss[2]));
                }
            }
        } else if r < 95 {
            let target = (rng.below(5) * 8 * MIB as u64).min(40 * MIB as u64);
            let before = pool.stats().reserved_current;
            let released = pool.trim_to(target).unwrap();
            let after = pool.stats().reserved_current;
            assert_eq!(released, before - after, "op {op}: trim_to's result");
        } else {
            sync_free(&pool, blocker.is_some());
            if blocker.is_none() {
                pool.synchronize().unwrap();
            }
        }
        // Units were really created: fewer handles than pages held.
        let pages = (pool.stats().reserved_current / PAGE as u64) as usize;
        if dev.live_handles() < pages {
            units_seen = true;
        }
        let used: u64 = live.iter().map(|l| l.a.size() as u64).sum();
        assert!(pool.stats().used_current >= used, "op {op}: used_current");
    }
    if let Some(mut b) = blocker.take() {
        b.release();
    }
    for l in live.drain(..) {
        for (p, n) in spots(&l.a) {
            k.verify_tag(l.stream, p, n, l.tag).unwrap();
        }
        pool.free_async(l.a, l.stream).unwrap();
    }
    pool.synchronize().unwrap();
    assert_eq!(
        k.access_faults().unwrap(),
        0,
        "a tag kernel met unmapped memory"
    );
    assert_eq!(k.mismatches().unwrap(), 0, "a block's data was overwritten");
    let st = pool.stats();
    assert_eq!(st.used_current, 0, "used after freeing everything");
    // Nothing in use and nothing pending after the synchronisation: the
    // release threshold holds (units go whole, so it may be undershot).
    assert!(
        st.reserved_current <= cfg.threshold,
        "{} B held after a synchronisation with nothing in use, threshold {}",
        st.reserved_current,
        cfg.threshold
    );
    let released = pool.trim_to(0).unwrap();
    assert_eq!(
        released, st.reserved_current,
        "trim_to(0) releases everything"
    );
    assert_eq!(pool.stats().reserved_current, 0);
    assert_eq!(dev.live_handles(), 0, "handles after trim_to(0)");
    out.unit_handles = units_seen;
    drop(pool);
    assert_eq!(dev.live_mappings(), 0, "mappings after the pool's drop");
    out
}

/// Run a workload: its safety checks fail inside `run`; here, that units
/// of several pages were really created.
fn check(cfg: Cfg) -> Outcome {
    let o = run(&cfg);
    if cfg.max_unit > PAGE {
        assert!(
            o.unit_handles,
            "the workload never created a unit of several pages"
        );
    }
    o
}

fn cfg_u4_mib() -> Cfg {
    Cfg {
        max_unit: 4 * MIB,
        unit_min: 2 * MIB,
        capacity: 48 * MIB,
        max_size: None,
        threshold: u64::MAX,
        seed: 11,
        ops: 1500,
    }
}

fn cfg_u8_mib() -> Cfg {
    Cfg {
        max_unit: 8 * MIB,
        unit_min: 4 * MIB,
        capacity: 64 * MIB,
        max_size: Some(40 * MIB as u64),
        threshold: u64::MAX,
        seed: 12,
        ops: 1500,
    }
}

fn cfg_u16_mib() -> Cfg {
    Cfg {
        max_unit: 16 * MIB,
        unit_min: 6 * MIB,
        capacity: 48 * MIB,
        max_size: None,
        threshold: 16 * MIB as u64,
        seed: 13,
        ops: 1500,
    }
}

fn cfg_u64_mib() -> Cfg {
    Cfg {
        max_unit: 64 * MIB,
        unit_min: 8 * MIB,
        capacity: 44 * MIB,
        max_size: Some(44 * MIB as u64),
        threshold: 0,
        seed: 14,
        ops: 1500,
    }
}

fn cfg_u6_mib() -> Cfg {
    Cfg {
        max_unit: 6 * MIB,
        unit_min: 0,
        capacity: 64 * MIB,
        max_size: None,
        threshold: 4 * MIB as u64,
        seed: 15,
        ops: 1500,
    }
}

fn cfg_single() -> Cfg {
    Cfg {
        max_unit: 0,
        unit_min: 4 * MIB,
        capacity: 64 * MIB,
        max_size: Some(40 * MIB as u64),
        threshold: u64::MAX,
        seed: 12,
        ops: 1500,
    }
}

/// The false out-of-memory oracle over every random workload above: a
/// request that fails after the streams not held busy were synchronised
/// must still fail after `trim_to(0)`. Failed, before the pool tried other
/// windows when the fewest-binds one needed growth it could not have: the
/// units workloads of 4 and 8 MiB met it (see the two tests below for the smallest case), and so
/// does the single-page one (`attack3_window_oom.rs`, an old defect; the
/// sweep below finds it as often on single pages as with units). The last
/// ones came from free units across the edge of a window and from the
/// order in which units came back to their ghosts (see
/// `a_free_unit_across_the_windows_edge_is_released_for_growth`).
#[test]
fn random_workloads_meet_no_false_out_of_memory() {
    let mut bad = Vec::new();
    for cfg in [
        cfg_u4_mib(),
        cfg_u8_mib(),
        cfg_u16_mib(),
        cfg_u64_mib(),
        cfg_u6_mib(),
        cfg_single(),
    ] {
        let o = run(&cfg);
        if !o.false_ooms.is_empty() {
            bad.push(format!(
                "max_unit {} MiB, unit_min {} MiB, capacity {} MiB, max_size {:?}: {} false \
                 out-of-memory of {} ({:?})",
                cfg.max_unit / MIB,
                cfg.unit_min / MIB,
                cfg.capacity / MIB,
                cfg.max_size,
                o.false_ooms.len(),
                o.ooms,
                o.false_ooms.first()
            ));
        }
    }
    assert!(bad.is_empty(), "{bad:#?}");
}

#[test]
fn units_of_4_mib_from_2_mib_blocks_in_a_device_of_48_mib() {
    check(cfg_u4_mib());
}

#[test]
fn units_of_8_mib_from_4_mib_blocks_capped_at_40_mib() {
    check(cfg_u8_mib());
}

#[test]
fn units_of_16_mib_from_6_mib_blocks_threshold_16_mib() {
    check(cfg_u16_mib());
}

#[test]
fn units_of_64_mib_from_8_mib_blocks_capped_at_44_mib() {
    check(cfg_u64_mib());
}

/// The capped workload on single pages (the contrast: what units add).
#[test]
fn single_pages_capped_at_40_mib() {
    check(cfg_single());
}

/// The smallest false out-of-memory found (shrunk from the random
/// workload above, one stream). Units of four pages, blocks of 4 MiB and
/// up, a cap of 40 MiB. At the end, 34 MiB are held: one block of 13 MiB
/// in use (8 pages), the rest of a unit under its last page (3 pages,
/// pinned: the documented cost of units), and 12 MiB wholly free and
/// complete (a unit of four pages and two single pages). A request of
/// 19.8 MiB (10 pages) fits under the cap: laid right after the live
/// block, it uses the three pinned pages and one free single page in
/// place, moves the free unit and the other single page into its holes,
/// and grows by one page (36 MiB). The pool instead picks windows that
/// need fewer binds but more growth (42 MiB) first; it used to fail the
/// cap there and report out-of-memory (after `trim_to(0)`, which releases
/// only the 12 MiB of free memory the request could have used itself, the
/// same request succeeded). It now tries the other windows before giving
/// up.
#[test]
fn a_request_under_the_cap_is_served_by_the_free_units_and_pinned_pages() {
    pinned_pages_and_free_units(64 * MIB, Some(40 * MIB as u64));
}

/// The same with no cap, in a device of 40 MiB: the device's
/// out-of-memory instead of the cap.
#[test]
fn a_request_in_a_full_device_is_served_by_the_free_units_and_pinned_pages() {
    pinned_pages_and_free_units(40 * MIB, None);
}

fn pinned_pages_and_free_units(capacity: usize, max_size: Option<u64>) {
    let dev = Arc::new(host_with_capacity(capacity));
    let mut pc = PoolConfig::default()
        .with_va_size(1 << 30)
        .with_max_unit_size(8 * MIB)
        .with_unit_min_block(4 * MIB);
    if let Some(m) = max_size {
        pc = pc.with_max_size(m);
    }
    let pool = MemPool::new(dev.clone(), pc).unwrap();
    let s = dev.create_stream().unwrap();
    let step = |a: Allocation| {
        pool.free_async(a, s).unwrap();
        pool.synchronize().unwrap();
    };
    let a = pool.alloc_async(9_854_654, s).unwrap();
    let b = pool.alloc_async(14_091_753, s).unwrap();
    step(a);
    let c = pool.alloc_async(5_749_301, s).unwrap();
    let d = pool.alloc_async(9_983_254, s).unwrap();
    step(c);
    step(b);
    step(d);
    let e = pool.alloc_async(12_024_397, s).unwrap();
    let f = pool.alloc_async(13_604_719, s).unwrap();
    step(e);
    let st = pool.stats();
    assert_eq!(
        st.reserved_current,
        34 * MIB as u64,
        "the set-up holds 34 MiB"
    );
    assert_eq!(st.used_current, 13_604_719);
    const REQ: usize = 20_781_854;
    let first = pool.alloc_async(REQ, s);
    let released = pool.trim_to(0).unwrap();
    let again = pool.alloc_async(REQ, s);
    let verdict = match (&first, &again) {
        (Err(e), Ok(_)) => Some(format!(
            "{REQ} B failed with 34 MiB held of 40 MiB ({e}), then \
             succeeded after trim_to(0) released {released} B of free memory"
        )),
        _ => None,
    };
    for x in [first, again].into_iter().flatten() {
        step(x);
    }
    step(f);
    assert_eq!(pool.stats().used_current, 0);
    if let Some(v) = verdict {
        panic!("false out-of-memory: {v}");
    }
}

/// A free unit across the edge of the only windows left (shrunk from the
/// sweep below, one stream). Units of four pages, a cap of 18 MiB (nine
/// pages), all held: a small block on a page of its own, a unit under a
/// block of 1 MiB on its first page (its other three pages pinned: the
/// documented cost of units), a hole, then a unit of four pages wholly
/// free and complete. A request of 10 MiB laid right after the small
/// block covers the pinned pages, the hole and the first page of the free
/// unit: used in place, that unit keeps its three other pages outside the
/// block, and the hole needs a page past the cap; every other window needs
/// growth too. Failed with out-of-memory, then succeeded after
/// `trim_to(0)` released the free unit. The pool now takes such a unit
/// off the window's edge (spare: it moves whole into a run of the
/// window's holes, or is released to make room for growth).
#[test]
fn a_free_unit_across_the_windows_edge_is_released_for_growth() {
    let dev = Arc::new(host_with_capacity(64 * MIB));
    let pool = MemPool::new(
        dev.clone(),
        PoolConfig::default()
            .with_va_size(1 << 30)
            .with_max_unit_size(8 * MIB)
            .with_unit_min_block(4 * MIB)
            .with_max_size(18 * MIB as u64),
    )
    .unwrap();
    let s = dev.create_stream().unwrap();
    let step = |a: Allocation| {
        pool.free_async(a, s).unwrap();
        pool.synchronize().unwrap();
    };
    // A unit, a single page above it, a unit above that.
    let a = pool.alloc_async(8 * MIB, s).unwrap();
    let b = pool.alloc_async(2 * MIB, s).unwrap();
    let c = pool.alloc_async(8 * MIB, s).unwrap();
    assert_eq!(b.ptr(), a.ptr() + 8 * MIB as u64, "the single page on top");
    assert_eq!(c.ptr(), b.ptr() + 2 * MIB as u64, "the second unit on top");
    // The single page goes back to the device: a hole between the units.
    step(b);
    assert_eq!(pool.trim_to(0).unwrap(), 2 * MIB as u64);
    let small = pool.alloc_async(64 << 10, s).unwrap();
    step(a);
    let x = pool.alloc_async(MIB, s).unwrap();
    assert_eq!(x.ptr(), c.ptr() - 10 * MIB as u64, "on the first unit");
    step(c);
    let st = pool.stats();
    assert_eq!(
        st.reserved_current,
        18 * MIB as u64,
        "the set-up holds the cap"
    );
    assert_eq!(dev.live_handles(), 3, "two units and a single page");
    const REQ: usize = 10 * MIB;
    let first = pool.alloc_async(REQ, s);
    let released = pool.trim_to(0).unwrap();
    let again = pool.alloc_async(REQ, s);
    let verdict = match (&first, &again) {
        (Err(e), Ok(_)) => Some(format!(
            "{REQ} B failed with 18 MiB held of 18 MiB ({e}), then succeeded after \
             trim_to(0) released {released} B of free memory"
        )),
        _ => None,
    };
    let ok = first.is_ok();
    for y in [first, again].into_iter().flatten() {
        step(y);
    }
    step(x);
    step(small);
    assert_eq!(pool.stats().used_current, 0);
    if let Some(v) = verdict {
        panic!("false out-of-memory: {v}");
    }
    assert!(ok, "{REQ} B under the cap with a free unit of 8 MiB held");
}

/// Two pools on one device of 48 MiB. The second pool holds free,
/// complete memory (in units, or single pages) and one small block; the
/// first pool's request of 36 MiB runs the device out of
/// memory, and the other pool must give back its wholly free units so
/// that the request succeeds (step 6 of the reuse order).
#[test]
fn another_pools_free_units_are_released_for_a_request() {
    for units in [false, true] {
        let dev = Arc::new(host_with_capacity(48 * MIB));
        let cfg = || {
            let c = PoolConfig::default().with_va_size(1 << 30);
            if units {
                c.with_max_unit_size(8 * MIB).with_unit_min_block(4 * MIB)
            } else {
                c
            }
        };
        let a_pool = MemPool::new(dev.clone(), cfg()).unwrap();
        let b_pool = MemPool::new(dev.clone(), cfg()).unwrap();
        let s = dev.create_stream().unwrap();
        let big = b_pool.alloc_async(24 * MIB, s).unwrap();
        b_pool.free_async(big, s).unwrap();
        b_pool.synchronize().unwrap();
        // A small block on the first page of the freed range.
        let small = b_pool.alloc_async(MIB, s).unwrap();
        b_pool.synchronize().unwrap();
        let held = b_pool.stats().reserved_current;
        // At least 16 MiB held with 2 MiB of pages in use: the 36 MiB fit
        // once the other pool gives back 6 MiB of its free memory.
        assert!(
            held >= 16 * MIB as u64,
            "units {units}: the set-up holds {held} B"
        );
        let got = a_pool.alloc_async(36 * MIB, s);
        let after = b_pool.stats().reserved_current;
        let ok = got.is_ok();
        if let Ok(x) = got {
            a_pool.free_async(x, s).unwrap();
        }
        b_pool.free_async(small, s).unwrap();
        assert!(
            ok,
            "units {units}: 36 MiB failed on a device of 48 MiB while the other pool held \
             {held} B of which only 1 MiB in use (it kept {after} B)"
        );
    }
}

/// Odd settings: a maximum unit of three pages (units are a power of two
/// pages: two) and units for every block, however small; release
/// threshold 4 MiB. The same checks; false out-of-memory are counted by
/// `check` too.
#[test]
fn units_of_6_mib_for_every_block_threshold_4_mib() {
    check(cfg_u6_mib());
}

/// The false out-of-memory oracle over 40 seeds x single pages and units
/// of 4, 8, 16 and 64 MiB x a device of 48 MiB and a cap of 40 MiB (800
/// calls each; 60 s in a release build). Prints, per setting, the runs
/// that met a false out-of-memory and their share of all out-of-memory
/// results, then fails if there was any. Measured at 743dab9 + main
/// 366b2d1 (two runs; host stream timing varies the counts): 14-26 of the
/// 40 runs of every setting, single pages included, 19-39 false of about
/// 1940-2580 out-of-memory results per setting. After the pool learnt to
/// try other windows when the fewest-binds one needs growth it cannot
/// have (two runs, at 24c635e and 5f05a0e): 0-3 of the 40 runs per
/// setting, 0-4 false of about 1780-2440. After free units across a
/// window's edge were taken off it when memory is short, units came back
/// to ghosts inside the window first, and the oracle waited for the held
/// stream to reach its hold (two runs): 0 false of about 2170-2860 per
/// setting.
#[test]
#[ignore = "slow (60 s in release, minutes in debug); two of its seeds run as an ordinary \
            test below; run with --ignored"]
fn sweep_of_40_seeds_meets_no_false_out_of_memory() {
    sweep(100..140);
}

/// The sweep above over two of its seeds (20 workloads of 800 calls;
/// 11 s in a debug build here), seeds that met a false out-of-memory
/// before the last fixes.
#[test]
fn sweep_of_2_seeds_meets_no_false_out_of_memory() {
    sweep(102..104);
}

/// The false out-of-memory oracle over `seeds` x single pages and units of
/// 4, 8, 16 and 64 MiB x a device of 48 MiB and a cap of 40 MiB.
fn sweep(seeds: std::ops::Range<u64>) {
    let mut report = Vec::new();
    for seed in seeds {
        for mu in [0usize, 4 * MIB, 8 * MIB, 16 * MIB, 64 * MIB] {
            for (um, cap, ms) in [
                (2 * MIB, 48 * MIB, None),
                (4 * MIB, 64 * MIB, Some(40 * MIB as u64)),
            ] {
                let o = run(&Cfg {
                    max_unit: mu,
                    unit_min: um,
                    capacity: cap,
                    max_size: ms,
                    threshold: u64::MAX,
                    seed,
                    ops: 800,
                });
                report.push((mu / MIB, ms.is_some(), o.false_ooms.len(), o.ooms));
            }
        }
    }
    use std::io::Write;
    let mut e = std::io::stderr().lock();
    let mut total = 0;
    for mu in [0usize, 4, 8, 16, 64] {
        for capped in [false, true] {
            let rs: Vec<_> = report
                .iter()
                .filter(|r| r.0 == mu && r.1 == capped)
                .collect();
            let hit = rs.iter().filter(|r| r.2 > 0).count();
            let f: usize = rs.iter().map(|r| r.2).sum();
            let o: usize = rs.iter().map(|r| r.3).sum();
            total += f;
            let _ = writeln!(
                e,
                "max_unit {mu} MiB, {}: runs with a false out-of-memory {hit}/{}, \
                 false {f} of {o} out-of-memory results",
                if capped {
                    "cap 40 MiB"
                } else {
                    "device 48 MiB"
                },
                rs.len()
            );
        }
    }
    assert_eq!(total, 0, "false out-of-memory results over the sweep");
}

/// Export of a block that lies on a unit of several pages, from a pool not
/// created exportable: a typed error (the pool cannot hand out a handle per
/// page of a unit), and the block stays usable and freeable.
#[test]
fn exporting_a_block_on_a_unit_is_a_typed_error() {
    let dev = Arc::new(host());
    let pool = MemPool::new(
        dev.clone(),
        PoolConfig::default()
            .with_va_size(1 << 30)
            .with_max_unit_size(8 * MIB)
            .with_unit_min_block(4 * MIB),
    )
    .unwrap();
    let s = dev.create_stream().unwrap();
    let a = pool.alloc_async(8 * MIB, s).unwrap();
    assert_eq!(dev.live_handles(), 1, "one unit");
    match pool.export(&a) {
        Ok(_) => panic!("a block on a unit of a non-exportable pool was exported"),
        Err(e) => assert!(
            matches!(e, PoolError::NotExportable { .. }),
            "another error than NotExportable: {e}"
        ),
    }
    dev.write_words(a.ptr(), &[7]).unwrap();
    assert_eq!(dev.read_words(a.ptr(), 1).unwrap(), vec![7]);
    pool.free_async(a, s).unwrap();
    pool.synchronize().unwrap();
    assert_eq!(pool.trim_to(0).unwrap(), 8 * MIB as u64);
}
