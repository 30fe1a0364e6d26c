//! The pending-free index, the stream caches' flush, the watch list's
//! one-word summary, the idle set counted a word at a time and the huge
//! zone's windows that keep their ghosts, attacked from outside through
//! `MemPool` on the host backend (real memory, checked mappings).
//!
//! Contracts checked:
//! - a free on a stream held busy is never handed to another stream that
//!   has no dependency on it, whatever the epochs, trims and retired
//!   streams around it; a kernel queued before the free still finds its
//!   memory mapped; once the stream completes, its frees are reused with
//!   no growth;
//! - after everything is freed and known complete, the caches of several
//!   streams join the arena before the pool grows: a request that fits in
//!   that memory never grows the pool, and `trim_to(0)` leaves nothing;
//! - a producer and consumers on threads (the consumers free what the
//!   producer allocated, on streams that come and go) keep the pool's
//!   footprint bounded and every pattern intact;
//! - a trim never releases a page a live block uses (the live blocks'
//!   patterns are read back) and releases every idle complete page;
//! - huge blocks of alternating sizes under a cap: an allocation that fits
//!   in the cap beside the live blocks never fails, and live blocks keep
//!   their data across the remaps.
//!
//! Work is bounded by operation counts only.

mod common;

use common::{host_with_capacity, streams, tag_kernel, Blocker, Rng, PAGE};
use std::collections::BTreeSet;
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;
use tidepool::{Allocation, MemPool, PoolConfig};
use tidepool_sys::{Device, HostDevice};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// Sizes on both sides of the cache's small/large split (256 KiB), of
/// the medium zone and of the big zone.
const SIZES: [usize; 10] = [
    512,
    4 * KIB,
    100 * KIB,
    256 * KIB - 4,
    256 * KIB,
    256 * KIB + 512,
    300 * KIB,
    MIB + 4,
    3 * MIB + 512,
    17 * MIB + 4,
];

/// The words of a block sampled by [`fill`] and [`verify`]: its first and
/// last, one in the middle and the first of every page it touches.
fn sample(a: &Allocation) -> Vec<u64> {
    let (ptr, size) = (a.ptr(), a.size() as u64);
    let end = ptr + size;
    let mut at: BTreeSet<u64> = [ptr, ptr + (size / 2) / 4 * 4, ptr + (size - 4) / 4 * 4]
        .into_iter()
        .collect();
    let mut p = ptr.next_multiple_of(PAGE as u64);
    while p + 4 <= end {
        at.insert(p);
        p += PAGE as u64;
    }
    at.into_iter().collect()
}

fn word(seed: u32, at: u64) -> u32 {
    seed.wrapping_mul(0x9E37_79B9) ^ (at as u32).rotate_left(7) ^ (at >> 32) as u32
}

fn fill(dev: &HostDevice, a: &Allocation, seed: u32) {
    for at in sample(a) {
        dev.write_words(at, &[word(seed, at)])
            .unwrap_or_else(|e| panic!("write into live block at {at:#x}: {e}"));
    }
}

fn verify(dev: &HostDevice, a: &Allocation, seed: u32, what: &str) {
    for at in sample(a) {
        let got = dev.read_words(at, 1).unwrap_or_else(|e| {
            panic!("{what}: live block {:#x} unmapped at {at:#x}: {e}", a.ptr())
        });
        assert_eq!(
            got[0],
            word(seed, at),
            "{what}: live block {:#x}+{} corrupted at {at:#x}",
            a.ptr(),
            a.size()
        );
    }
}

/// The arena length of a block (blocks are laid out in 512-byte steps).
fn span(a: &Allocation) -> (u64, u64) {
    (a.ptr(), a.ptr() + a.size().next_multiple_of(512) as u64)
}

fn overlaps(x: (u64, u64), y: (u64, u64)) -> bool {
    x.0 < y.1 && y.0 < x.1
}

/// Pages touched by the blocks.
fn live_pages<'a>(blocks: impl IntoIterator<Item = &'a Allocation>) -> u64 {
    let mut pages = BTreeSet::new();
    for a in blocks {
        let (lo, hi) = span(a);
        pages.extend(lo / PAGE as u64..=(hi - 1) / PAGE as u64);
    }
    pages.len() as u64
}

fn empty_after_trim(pool: &MemPool<HostDevice>, what: &str) {
    pool.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    let st = pool.stats();
    assert_eq!(st.used_current, 0, "{what}: {st}");
    assert_eq!(st.reserved_current, 0, "{what}: nothing lost: {st}");
}

/// Frees of a busy stream, under many epochs (an event recorded between
/// frees), of streams retired while busy, with trims in between: another
/// stream with no dependency never gets them (no overlap, and the busy
/// stream's kernels, queued before the frees, find their memory mapped and
/// do not write into the other stream's blocks). A stream that waits on an
/// event recorded after the frees may reuse them, and its kernels run
/// after the frees' work. Once everything completed, the same requests are
/// served with no growth.
#[test]
fn busy_frees_reach_another_stream_only_through_a_dependency() {
    let dev = Arc::new(host_with_capacity(1 << 30));
    let pool = MemPool::new(dev.clone(), PoolConfig::default().with_va_size(4 << 30)).unwrap();
    let ss = streams(&*dev, 2);
    let (a, b) = (ss[0], ss[1]);
    let mut rng = Rng(0x7a7a_0001);
    let mut seed = 1u32;
    for round in 0..10 {
        let waits = round % 3 == 2;
        // A first epoch of `a`, behind a first blocker released below:
        // once the pool knows it complete it may settle it, and only it.
        let mut first = Blocker::on(&*dev, a);
        let mut done = Vec::new();
        for &size in &SIZES[3..8] {
            done.push(pool.alloc_async(size, a).unwrap());
        }
        for x in done {
            pool.free_async(x, a).unwrap();
        }
        let ev0 = pool.record_event(a).unwrap();
        let mut blocker = Blocker::on(&*dev, a);
        // Pending: (span, kernel queued before the free).
        let mut pending: Vec<((u64, u64), Receiver<bool>)> = Vec::new();
        let mut sizes_of_a = Vec::new();
        let mut retired_blockers = Vec::new();
        for k in 0..24 {
            let size = SIZES[rng.range(0, SIZES.len() as u64 - 1) as usize];
            let x = pool.alloc_async(size, a).unwrap();
            sizes_of_a.push(size);
            let rx = tag_kernel(&dev, a, x.ptr(), (size / 4).min(64), 0xA000_0000 | k);
            pending.push((span(&x), rx));
            pool.free_async(x, a).unwrap();
            if k % 3 == 0 {
                // A new epoch: the frees after it are guarded by it.
                drop(pool.record_event(a).unwrap());
            }
            if k % 8 == 7 {
                pool.trim_to(0).unwrap();
            }
        }
        let of_a = pending.len();
        // Every other round, a stream retired while busy: its cached
        // frees go to the arena, still pending (in the other rounds only
        // `a` has frees pending).
        let r = (round % 2 == 1).then(|| dev.create_stream().unwrap());
        if let Some(r) = r {
            retired_blockers.push(Blocker::on(&*dev, r));
            for k in 0..6 {
                let size = SIZES[(round + k) % SIZES.len()];
                let x = pool.alloc_async(size, r).unwrap();
                let rx = tag_kernel(&dev, r, x.ptr(), (size / 4).min(64), 0xB000_0000 | k as u32);
                pending.push((span(&x), rx));
                pool.free_async(x, r).unwrap();
            }
            pool.retire_stream(r).unwrap();
        }
        pool.trim_to(0).unwrap();
        first.release();
        pool.synchronize_event(&ev0).unwrap();
        let ev = if waits {
            let ev = pool.record_event(a).unwrap();
            pool.wait_event(b, &ev).unwrap();
            Some(ev)
        } else {
            None
        };
        // The other stream allocates the same mix, and more.
        let mut mine: Vec<(Allocation, u32, Option<Receiver<bool>>)> = Vec::new();
        let growths = pool.stats().growths;
        // After the wait, first the largest size `a` freed (`a` took its
        // own frees back as it went, so only its last blocks are there at
        // once): it is there for `b` to take, with no growth.
        let largest = sizes_of_a.iter().copied().max().unwrap();
        for n in 0..30 {
            let size = if waits && n == 0 {
                largest
            } else {
                SIZES[rng.range(0, SIZES.len() as u64 - 1) as usize]
            };
            if waits && n == 1 {
                assert_eq!(
                    pool.stats().growths,
                    growths,
                    "round {round}: b waited on a's frees and still grew for {largest}"
                );
            }
            let y = pool.alloc_async(size, b).unwrap();
            seed += 1;
            if waits {
                // Ordered after `a`'s work by the wait: written by a
                // kernel of `b`, which must run after `a`'s kernels.
                let rx = tag_kernel(&dev, b, y.ptr(), (size / 4).min(64), seed);
                mine.push((y, seed, Some(rx)));
            } else {
                for (s, _) in &pending[..of_a] {
                    assert!(
                        !overlaps(span(&y), *s),
                        "round {round}: {:#x}+{size} on b overlaps a free pending on busy a {s:x?}",
                        y.ptr()
                    );
                }
                fill(&dev, &y, seed);
                mine.push((y, seed, None));
            }
            for (s, _) in &pending[of_a..] {
                assert!(
                    !overlaps(span(&mine.last().unwrap().0), *s),
                    "round {round}: a block on b overlaps a free pending on a retired busy stream"
                );
            }
        }
        blocker.release();
        retired_blockers.clear();
        for (s, rx) in pending {
            assert!(
                rx.recv().unwrap(),
                "round {round}: a kernel queued before its free found {s:x?} unmapped"
            );
        }
        if let Some(r) = r {
            dev.synchronize_stream(r).unwrap();
            dev.destroy_stream(r).unwrap();
        }
        for (y, seed, rx) in &mine {
            match rx {
                None => verify(&dev, y, *seed, &format!("round {round}")),
                Some(rx) => {
                    assert!(
                        rx.recv().unwrap(),
                        "round {round}: b's kernel found its block unmapped"
                    );
                    let got = dev.read_words(y.ptr(), (y.size() / 4).min(64)).unwrap();
                    assert!(
                        got.iter().all(|&w| w == *seed),
                        "round {round}: b's kernel ran before a's work on the same memory"
                    );
                }
            }
        }
        drop(ev);
        for (y, _, _) in mine {
            pool.free_async(y, b).unwrap();
        }
        pool.synchronize().unwrap();
    }
    // Everything complete: requests on either stream whose pages fit in
    // what the pool holds reuse it (each block touches at most its
    // length in pages plus one).
    let before = pool.stats();
    for s in [a, b] {
        let mut held = Vec::new();
        let mut rng = Rng(0x7a7a_0002);
        let mut room = before.reserved_current as usize;
        for _ in 0..24 {
            let size = SIZES[rng.range(0, SIZES.len() as u64 - 1) as usize];
            let pages = size.next_multiple_of(PAGE) + PAGE;
            if pages > room {
                continue;
            }
            room -= pages;
            held.push(pool.alloc_async(size, s).unwrap());
        }
        assert!(held.len() >= 8, "{} blocks fit in {before}", held.len());
        for x in held {
            pool.free_async(x, s).unwrap();
        }
        pool.synchronize().unwrap();
    }
    let after = pool.stats();
    assert_eq!(
        after.growths, before.growths,
        "complete frees reused: {after}"
    );
    empty_after_trim(&pool, "the end");
}

/// The caches of several streams, holding blocks of many sizes (small and
/// large), all complete: a request on another stream that fits in what
/// the pool holds never grows it, under a cap of exactly that much too.
#[test]
fn cached_memory_of_several_streams_joins_before_growth() {
    for capped in [false, true] {
        let dev = Arc::new(host_with_capacity(1 << 30));
        // The caches here hold 4 x (SIZES summed) ~ 92 MiB, all pages.
        let mut cfg = PoolConfig::default().with_va_size(4 << 30);
        let ss = streams(&*dev, 5);
        let mut rng = Rng(0x7a7a_0003);
        // A first pass to learn the footprint, a second under a cap of it.
        let probe = MemPool::new(dev.clone(), cfg.clone()).unwrap();
        let fill_caches = |pool: &MemPool<HostDevice>, rng: &mut Rng| {
            // All live at once, then freed each on its stream in an odd
            // order: every stream's cache holds every size.
            let mut held = Vec::new();
            for &s in &ss[..4] {
                for &size in &SIZES {
                    held.push((pool.alloc_async(size, s).unwrap(), s));
                }
            }
            while !held.is_empty() {
                let i = rng.range(0, held.len() as u64 - 1) as usize;
                let (x, s) = held.swap_remove(i);
                pool.free_async(x, s).unwrap();
            }
            pool.synchronize().unwrap();
        };
        fill_caches(&probe, &mut rng);
        let held = probe.stats().reserved_current;
        drop(probe);
        if capped {
            cfg = cfg.with_max_size(held);
        }
        let pool = MemPool::new(dev.clone(), cfg).unwrap();
        let mut rng = Rng(0x7a7a_0003);
        fill_caches(&pool, &mut rng);
        let before = pool.stats();
        assert_eq!(before.reserved_current, held);
        assert_eq!(before.used_current, 0);
        // Requests of sizes the caches never saw, on a fifth stream.
        let other = ss[4];
        for size in [
            held as usize,
            held as usize - PAGE - 513,
            5 * MIB + 4,
            700 * KIB,
        ] {
            let x = pool
                .alloc_async(size, other)
                .unwrap_or_else(|e| panic!("capped {capped}: {size} fits in {held}: {e}"));
            fill(&dev, &x, 7);
            verify(&dev, &x, 7, "fresh block");
            pool.free_async(x, other).unwrap();
            pool.synchronize_stream(other).unwrap();
            let st = pool.stats();
            assert_eq!(
                st.growths, before.growths,
                "capped {capped}: a request of {size} that fits in {held} cached grew the pool: {st}"
            );
        }
        // The streams' caches again, then one request of everything.
        fill_caches(&pool, &mut rng);
        let x = pool.alloc_async(held as usize, other).unwrap();
        pool.free_async(x, other).unwrap();
        assert_eq!(pool.stats().growths, before.growths);
        empty_after_trim(&pool, "caches");
        assert_eq!(pool.stats().ooms, 0);
    }
}

/// A producer thread allocates and tags blocks, consumers on another
/// thread wait on the producer's event, check the tags with a kernel of
/// their own stream and free there; the consumer's stream changes every
/// few blocks (the old one retired), and a third thread allocates and
/// records events on its own stream. The consumers never allocate: the
/// producer learns their frees completed only by polling the watched
/// streams. Footprint bounded, every tag intact.
#[test]
fn producer_consumer_threads_keep_a_bounded_footprint() {
    const BLOCKS: usize = 400;
    const SIZES_PC: [usize; 5] = [4 * KIB, 200 * KIB, 300 * KIB, MIB + 512, 2 * MIB];
    let dev = Arc::new(host_with_capacity(1 << 30));
    let pool =
        Arc::new(MemPool::new(dev.clone(), PoolConfig::default().with_va_size(4 << 30)).unwrap());
    let (tx, rx) = sync_channel::<(Allocation, tidepool::PoolEvent, u32)>(4);
    let producer = {
        let (dev, pool) = (dev.clone(), pool.clone());
        std::thread::spawn(move || {
            let p = dev.create_stream().unwrap();
            for i in 0..BLOCKS {
                let size = SIZES_PC[i % SIZES_PC.len()];
                let x = pool.alloc_async(size, p).unwrap();
                let tag = 0x5000_0000 | i as u32;
                let ok = tag_kernel(&dev, p, x.ptr(), 16, tag);
                let ev = pool.record_event(p).unwrap();
                tx.send((x, ev, tag)).unwrap();
                // Ran or not, its verdict arrives.
                assert!(ok.recv().unwrap(), "producer's kernel on unmapped memory");
            }
            pool.synchronize_stream(p).unwrap();
        })
    };
    let selfish = {
        let (dev, pool) = (dev.clone(), pool.clone());
        std::thread::spawn(move || {
            let s = dev.create_stream().unwrap();
            let mut held = Vec::new();
            for i in 0..BLOCKS {
                held.push(pool.alloc_async(SIZES_PC[(i * 7) % 5] + 512, s).unwrap());
                if held.len() > 3 {
                    pool.free_async(held.remove(0), s).unwrap();
                }
                if i % 5 == 0 {
                    drop(pool.record_event(s).unwrap());
                }
            }
            for x in held {
                pool.free_async(x, s).unwrap();
            }
            pool.synchronize_stream(s).unwrap();
        })
    };
    let mut c = dev.create_stream().unwrap();
    let mut checks = Vec::new();
    for i in 0..BLOCKS {
        if i % 25 == 24 {
            let old = c;
            c = dev.create_stream().unwrap();
            pool.retire_stream(old).unwrap();
        }
        let (x, ev, tag) = rx.recv().unwrap();
        pool.wait_event(c, &ev).unwrap();
        let (ctx, crx) = std::sync::mpsc::channel();
        dev.launch_on_words(c, x.ptr(), 64, move |r| {
            let _ = ctx.send(r.map(|w| {
                w.iter()
                    .all(|v| v.load(std::sync::atomic::Ordering::Relaxed) == tag)
            }));
        })
        .unwrap();
        checks.push((i, crx));
        // At most 4 checks outstanding: the work queued on the consumer
        // (and so what the producer cannot reuse yet) stays bounded
        // however the threads are scheduled.
        if checks.len() > 4 {
            let (j, oldest) = checks.remove(0);
            assert_eq!(
                oldest.recv().unwrap(),
                Ok(true),
                "block {j}: consumer saw the producer's tag"
            );
        }
        if i % 4 == 0 {
            // The consumer records events of its own too.
            drop(pool.record_event(c).unwrap());
        }
        pool.free_async(x, c).unwrap();
    }
    producer.join().unwrap();
    selfish.join().unwrap();
    for (i, crx) in checks {
        assert_eq!(
            crx.recv().unwrap(),
            Ok(true),
            "block {i}: consumer saw the producer's tag"
        );
    }
    pool.synchronize().unwrap();
    let st = pool.stats();
    // In flight at once: the channel's 4, one being produced, one on the
    // consumer, 4 on the third thread, each at most 2.5 MiB in its own
    // pages, plus the streams' caches of at most a few of each size.
    assert!(
        st.reserved_high <= 96 * MIB as u64,
        "{BLOCKS} blocks freed as they were used grew the pool to {st}"
    );
    pool.retire_stream(c).unwrap();
    empty_after_trim(&pool, "producer/consumer");
}

/// Blocks spanning many pages, and blocks sharing edge pages, freed in odd
/// orders; trims to various targets: every live block keeps its data and
/// its pages mapped; a trim to 0 leaves exactly the pages the live blocks
/// touch.
#[test]
fn trims_release_idle_pages_and_never_a_live_one() {
    trims_case(PoolConfig::default().with_va_size(4 << 30), 0);
}

/// The same with units of 16 MiB for blocks of 16 MiB and up: a unit
/// goes back whole, so a trim may keep up to 7 idle pages of each partly
/// used unit at either end of each live block.
#[test]
fn trims_with_units_of_16_mib() {
    trims_case(
        PoolConfig::default()
            .with_va_size(4 << 30)
            .with_max_unit_size(16 << 20)
            .with_unit_min_block(16 << 20),
        14,
    );
}

/// `slack`: idle pages per live block a trim may have to keep.
fn trims_case(cfg: PoolConfig, slack: u64) {
    const TRIM_SIZES: [usize; 8] = [
        600 * KIB,
        700 * KIB + 512,
        MIB + 4,
        3 * MIB + 512,
        16 * MIB,
        16 * MIB + 4,
        33 * MIB + 512,
        130 * MIB + 4,
    ];
    let dev = Arc::new(host_with_capacity(1 << 30));
    let pool = MemPool::new(dev.clone(), cfg).unwrap();
    let ss = streams(&*dev, 2);
    let mut rng = Rng(0x7a7a_0004);
    let mut live: Vec<(Allocation, u32)> = Vec::new();
    let mut seed = 100u32;
    for round in 0..12 {
        while live.len() < 28 {
            let size = TRIM_SIZES[rng.range(0, TRIM_SIZES.len() as u64 - 1) as usize];
            // Big ones rarer: the footprint stays small.
            let size = if size > 32 * MIB && rng.range(0, 3) != 0 {
                5 * MIB + 4
            } else {
                size
            };
            let s = ss[rng.range(0, 1) as usize];
            let x = pool.alloc_async(size, s).unwrap();
            seed += 1;
            fill(&dev, &x, seed);
            live.push((x, seed));
        }
        // Free about half, in an odd order, on either stream.
        for _ in 0..14 {
            let i = rng.range(0, live.len() as u64 - 1) as usize;
            let (x, _) = live.swap_remove(i);
            pool.free_async(x, ss[rng.range(0, 1) as usize]).unwrap();
        }
        pool.synchronize().unwrap();
        let need = live_pages(live.iter().map(|(x, _)| x)) * PAGE as u64;
        let kept = need + slack * live.len() as u64 * PAGE as u64;
        let reserved = pool.stats().reserved_current;
        for target in [reserved - reserved / 3, need + 3 * PAGE as u64, need / 2, 0] {
            pool.trim_to(target).unwrap();
            let st = pool.stats();
            assert!(
                st.reserved_current <= target.max(kept),
                "round {round}: trim to {target} kept {} with {need} in live pages: {st}",
                st.reserved_current
            );
            assert!(
                st.reserved_current >= need,
                "round {round}: a live page went: {st}"
            );
            for (x, seed) in &live {
                verify(&dev, x, *seed, &format!("round {round}, trim to {target}"));
            }
        }
        let st = pool.stats();
        assert!(
            st.reserved_current <= kept,
            "round {round}: idle pages kept after trim_to(0), {need} in live pages: {st}"
        );
        if slack == 0 {
            assert_eq!(
                st.reserved_current, need,
                "round {round}: all idle pages released"
            );
        }
    }
    for (x, _) in live {
        pool.free_async(x, ss[0]).unwrap();
    }
    empty_after_trim(&pool, "trims");
}

/// Huge blocks (256 MiB and up) of alternating sizes, some kept live
/// across steps, under a cap: every allocation whose pages fit in the cap
/// beside the live blocks' succeeds, and the live blocks keep their data
/// (one word a page) across the remaps and the ghosts' evictions.
#[test]
fn huge_blocks_under_a_cap_never_fail_falsely_and_keep_their_data() {
    huge_case(PoolConfig::default().with_va_size(16 << 30), 0, true);
}

/// The same in an address space of 3 GiB: few huge windows, each
/// remembering several patterns (many mappings a page).
#[test]
fn huge_blocks_in_a_small_address_space() {
    huge_case(PoolConfig::default().with_va_size(3 << 30), 0, true);
}

/// The same with units of 16 MiB for huge blocks: a unit partly used
/// keeps its idle pages where they are, so each live block may strand up
/// to two partial units (15 pages each) besides its own pages.
#[test]
fn huge_blocks_in_units_of_16_mib() {
    huge_case(
        PoolConfig::default()
            .with_va_size(16 << 30)
            .with_max_unit_size(16 << 20),
        30,
        true,
    );
}

/// The same with the streams synchronised on the device only: the pool
/// is never told that the frees completed, and must find out (or wait)
/// rather than fail.
#[test]
fn huge_blocks_with_completions_untold() {
    huge_case(PoolConfig::default().with_va_size(16 << 30), 0, false);
}

/// `slack`: pages per live block an allocation may need beyond the
/// blocks' own. `told`: synchronise through the pool, else only the
/// device.
fn huge_case(cfg: PoolConfig, slack: u64, told: bool) {
    huge_case_on(cfg, slack, told, true);
}

/// The same on a device of 1 GiB with no cap on the pool: a full device
/// must not fail an allocation that fits in the idle pages either.
#[test]
fn huge_blocks_on_a_full_device() {
    huge_case_on(PoolConfig::default().with_va_size(16 << 30), 0, true, false);
}

/// `capped`: the pool's cap is 1 GiB on a device of 2 GiB; else the
/// device has 1 GiB and the pool no cap.
fn huge_case_on(cfg: PoolConfig, slack: u64, told: bool, capped: bool) {
    const HUGE: [usize; 5] = [
        256 * MIB,
        256 * MIB + 4,
        300 * MIB + 512,
        384 * MIB,
        290 * MIB + 2 * MIB + 4,
    ];
    let cap = 1024 * MIB as u64;
    let (dev, cfg) = if capped {
        (host_with_capacity(2 << 30), cfg.with_max_size(cap))
    } else {
        (host_with_capacity(cap as usize), cfg)
    };
    let dev = Arc::new(dev);
    let pool = MemPool::new(dev.clone(), cfg).unwrap();
    let ss = streams(&*dev, 2);
    let mut rng = Rng(0x7a7a_0005);
    let mut live: Vec<(Allocation, u32)> = Vec::new();
    let mut seed = 1000u32;
    let pages = |size: usize| size.div_ceil(PAGE) as u64;
    for step in 0..40 {
        // Small blocks now and then: their pages sit among the huge ones'.
        let small = if step % 4 == 1 {
            Some(pool.alloc_async(3 * MIB + 512, ss[1]).unwrap())
        } else {
            None
        };
        let size = HUGE[(step + rng.range(0, 1) as usize) % HUGE.len()];
        let used: u64 = live_pages(live.iter().map(|(x, _)| x).chain(small.as_ref()));
        let stranded = slack * (live.len() + small.is_some() as usize) as u64;
        let fits = (used + stranded + pages(size)) * PAGE as u64 <= cap;
        match pool.alloc_async(size, ss[step % 2]) {
            Ok(x) => {
                seed += 1;
                fill(&dev, &x, seed);
                live.push((x, seed));
            }
            Err(e) => assert!(
                !fits,
                "step {step}: {size} fails though {used} live pages leave room under the cap: {e}; {}",
                pool.stats()
            ),
        }
        for (x, seed) in &live {
            verify(&dev, x, *seed, &format!("step {step}"));
        }
        // Keep one or two live; free the others oldest or newest first.
        while live.len() > 1 + step % 2 {
            let i = if step % 3 == 0 { 0 } else { live.len() - 1 };
            let (x, _) = live.remove(i);
            pool.free_async(x, ss[(step + 1) % 2]).unwrap();
        }
        if let Some(x) = small {
            pool.free_async(x, ss[1]).unwrap();
        }
        if told {
            pool.synchronize().unwrap();
        } else {
            for &s in &ss {
                dev.synchronize_stream(s).unwrap();
            }
        }
        if step % 10 == 9 {
            pool.trim_to(512 * MIB as u64).unwrap();
        }
    }
    for (x, _) in live {
        pool.free_async(x, ss[0]).unwrap();
    }
    empty_after_trim(&pool, "huge");
}

/// A consumer stream that never allocates frees what a producer
/// allocated; the user orders the two by host synchronisation, with no
/// event through the pool, so the consumer is the only stream watched.
/// The producer's next allocation must learn that those frees completed
/// (it polls the watched consumer) and reuse them: no growth per block.
#[test]
fn a_producer_polls_a_consumer_that_is_the_only_stream_watched() {
    let dev = Arc::new(host_with_capacity(1 << 30));
    let pool = MemPool::new(dev.clone(), PoolConfig::default().with_va_size(4 << 30)).unwrap();
    let ss = streams(&*dev, 3);
    let (p, consumers) = (ss[0], &ss[1..]);
    let mut warm = None;
    for i in 0..120 {
        let size = [MIB + 512, 300 * KIB, 4 * MIB][i % 3];
        let x = pool.alloc_async(size, p).unwrap();
        fill(&dev, &x, i as u32);
        dev.synchronize_stream(p).unwrap();
        let c = consumers[(i / 10) % 2];
        verify(&dev, &x, i as u32, "handed to the consumer");
        pool.free_async(x, c).unwrap();
        // Complete, but the pool is not told.
        dev.synchronize_stream(c).unwrap();
        if i == 5 {
            warm = Some(pool.stats().growths);
        }
    }
    let st = pool.stats();
    assert_eq!(
        Some(st.growths),
        warm,
        "the producer reuses the consumer's complete frees: {st}"
    );
    empty_after_trim(&pool, "polled consumer");
}

/// A stream caching blocks of many more large lengths than the cache keeps
/// lists for, flushed by other streams' allocations between rounds of
/// frees and allocations of old and new lengths: no block is ever handed
/// out twice (live blocks never overlap), the live blocks keep their data,
/// and nothing is lost at the end.
#[test]
fn many_large_lengths_flushed_and_freed_again_are_never_handed_twice() {
    let dev = Arc::new(host_with_capacity(1 << 30));
    let pool = MemPool::new(dev.clone(), PoolConfig::default().with_va_size(4 << 30)).unwrap();
    let ss = streams(&*dev, 3);
    let (s, o) = (ss[0], ss[1]);
    let mut rng = Rng(0x7a7a_0006);
    let mut live: Vec<(Allocation, u32)> = Vec::new();
    let mut seed = 5000u32;
    let no_overlap = |live: &[(Allocation, u32)], what: &str| {
        let mut spans: Vec<(u64, u64)> = live.iter().map(|(x, _)| span(x)).collect();
        spans.sort_unstable();
        for w in spans.windows(2) {
            assert!(w[0].1 <= w[1].0, "{what}: live blocks {w:x?} overlap");
        }
    };
    for round in 0..8u64 {
        // 90 lengths above the small slots, a third of them new each round.
        for k in 0..90u64 {
            let len = 256 * KIB + 512 * (1 + k + 30 * round) as usize;
            let x = pool.alloc_async(len, s).unwrap();
            seed += 1;
            fill(&dev, &x, seed);
            live.push((x, seed));
        }
        no_overlap(&live, &format!("round {round}, after s"));
        // Free most, in an odd order, on s (its cache) or on a third stream.
        for _ in 0..80 {
            let i = rng.range(0, live.len() as u64 - 1) as usize;
            let (x, _) = live.swap_remove(i);
            let on = if rng.range(0, 3) == 0 { ss[2] } else { s };
            pool.free_async(x, on).unwrap();
        }
        if round % 2 == 0 {
            pool.synchronize_stream(s).unwrap();
        }
        // Another stream's requests flush the caches.
        for &size in &[3 * MIB + 512, 17 * MIB, 300 * KIB] {
            let y = pool.alloc_async(size, o).unwrap();
            seed += 1;
            fill(&dev, &y, seed);
            live.push((y, seed));
        }
        no_overlap(&live, &format!("round {round}, after o"));
        for (x, seed) in &live {
            verify(&dev, x, *seed, &format!("round {round}"));
        }
        if round % 3 == 2 {
            pool.trim_to(0).unwrap();
        }
    }
    for (x, _) in live {
        pool.free_async(x, s).unwrap();
    }
    empty_after_trim(&pool, "many lengths");
}

/// Under a cap of 1 GiB, 640 MiB freed on a busy stream `a`, then
/// `request` bytes asked on stream `b`: the request gets the pending free
/// through an inserted dependency (plus growth where it is larger), not an
/// out-of-memory, and the kernels of `a`, queued before its free, run
/// before those of `b`, whose tags are the ones left.
fn capped_huge_request_over_a_busy_huge_free(request: usize, tags: (u32, u32), what: &str) {
    let dev = Arc::new(host_with_capacity(2 << 30));
    let cfg = PoolConfig::default()
        .with_va_size(16 << 30)
        .with_max_size(1 << 30);
    let pool = MemPool::new(dev.clone(), cfg).unwrap();
    let ss = streams(&*dev, 2);
    let (a, b) = (ss[0], ss[1]);
    let per_page = |x: &Allocation, s, tag| -> Vec<Receiver<bool>> {
        (0..x.size() / PAGE)
            .map(|k| tag_kernel(&dev, s, x.ptr() + (k * PAGE) as u64, 16, tag))
            .collect()
    };
    let mut blocker = Blocker::on(&*dev, a);
    let x = pool.alloc_async(640 * MIB, a).unwrap();
    let mut ran = per_page(&x, a, tags.0);
    pool.free_async(x, a).unwrap();
    let y = pool
        .alloc_async(request, b)
        .unwrap_or_else(|e| panic!("{what}: {e}; {}", pool.stats()));
    assert!(pool.stats().internal_dependencies >= 1, "{}", pool.stats());
    assert!(pool.stats().reserved_current <= 1 << 30, "{}", pool.stats());
    ran.extend(per_page(&y, b, tags.1));
    blocker.release();
    for r in ran {
        assert!(r.recv().unwrap(), "a kernel found its pages unmapped");
    }
    for k in 0..y.size() / PAGE {
        let got = dev.read_words(y.ptr() + (k * PAGE) as u64, 16).unwrap();
        assert!(
            got.iter().all(|&w| w == tags.1),
            "page {k} of b's block: a's kernel ran after b's"
        );
    }
    pool.free_async(y, b).unwrap();
    empty_after_trim(&pool, what);
}

/// 600 MiB fit only in the pending free (the cap leaves 384 MiB to grow).
#[test]
fn a_capped_huge_request_waits_for_a_busy_huge_free() {
    capped_huge_request_over_a_busy_huge_free(
        600 * MIB,
        (0xAAAA_0001, 0xBBBB_0002),
        "a pending free covers it",
    );
}

/// 768 MiB fit only in the pending free plus 128 MiB of growth beside it.
#[test]
fn a_capped_huge_request_grows_next_to_a_busy_huge_free() {
    capped_huge_request_over_a_busy_huge_free(
        768 * MIB,
        (0xAAAA_0003, 0xBBBB_0004),
        "the pending free plus growth covers it",
    );
}
