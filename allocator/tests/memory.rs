//! Contract tests of allocation basics, the release threshold and trim,
//! statistics, defragmentation and the default pool.

mod common;

use common::*;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use tidepool::{default_pool, MemPool, ReusePolicy, ALIGNMENT};
use tidepool_sys::{Device, DevicePtr, Event, HostDevice, Stream, SysResult};

/// Rule: alloc returns at once (even on a busy stream) with a pointer
/// aligned to at least 256 (the pool promises 512); size 0 is a null
/// pointer that can be freed; live allocations never overlap.
/// Catches: misaligned offsets, overlapping hand-outs (split/coalesce
/// bugs), a size-0 path that touches the arena.
#[test]
fn alloc_is_immediate_aligned_and_never_overlaps() {
    let dev = Arc::new(host());
    let pool = pool(&dev, config());
    let s = streams(&*dev, 3);
    let _busy: Vec<Blocker> = s.iter().map(|&st| Blocker::on(&*dev, st)).collect();
    assert!(ALIGNMENT >= 256 && ALIGNMENT.is_power_of_two());

    let z = pool.alloc_async(0, s[0]).unwrap();
    assert_eq!((z.ptr(), z.size()), (0, 0));
    pool.free_async(z, s[0]).unwrap();
    assert_eq!(pool.alloc_raw(0, s[0]).unwrap(), 0);
    pool.free_raw(0, s[0]).unwrap();
    assert_eq!(
        pool.stats().reserved_current,
        0,
        "size 0 made the pool grow"
    );
    assert_eq!(pool.stats().used_current, 0);

    let mut rng = Rng(0x1234_5678);
    let mut live: BTreeMap<DevicePtr, (u64, tidepool::Allocation)> = BTreeMap::new();
    for i in 0..600 {
        let st = s[i % s.len()];
        if live.len() > 40 || (!live.is_empty() && rng.next() % 3 == 0) {
            let k = *live.keys().nth(rng.next() as usize % live.len()).unwrap();
            let (_, a) = live.remove(&k).unwrap();
            pool.free_async(a, st).unwrap();
            continue;
        }
        let size = rng.log_range(1, 3 << 20) as usize;
        let a = pool.alloc_async(size, st).unwrap();
        let p = a.ptr();
        assert_eq!(p % ALIGNMENT as u64, 0, "misaligned {p:#x} for {size}");
        assert!(pool.contains(p) && pool.contains(p + size as u64 - 1));
        let end = p + size as u64;
        if let Some((&q, &(qe, _))) = live.range(..=p).next_back() {
            assert!(qe <= p, "[{p:#x},{end:#x}) overlaps [{q:#x},{qe:#x})");
        }
        if let Some((&q, _)) = live.range(p..).next() {
            assert!(end <= q, "[{p:#x},{end:#x}) overlaps the block at {q:#x}");
        }
        live.insert(p, (end, a));
    }
    for (_, (_, a)) in live {
        let st = a.stream();
        pool.free_async(a, st).unwrap();
    }
    assert_eq!(pool.stats().used_current, 0);
}

fn three_pages(
    pool: &MemPool<tidepool_sys::HostDevice>,
    s: tidepool::Stream,
) -> Vec<tidepool::Allocation> {
    (0..3).map(|_| pool.alloc_async(PAGE, s).unwrap()).collect()
}

/// Rule: release threshold 0 — after a pool synchronisation (whole pool or
/// one stream) the pool holds only what live allocations need.
/// Catches: a synchronise that does not release, or releases live pages.
#[test]
fn release_threshold_zero_releases_on_synchronize() {
    for whole in [true, false] {
        let dev = Arc::new(host());
        let pool = pool(&dev, config().with_release_threshold(0));
        assert_eq!(pool.release_threshold(), 0);
        let s = dev.create_stream().unwrap();
        let mut v = three_pages(&pool, s);
        let keep = v.remove(1);
        let data = pattern(3, PAGE / 4);
        dev.write_words(keep.ptr(), &data).unwrap();
        for a in v {
            pool.free_async(a, s).unwrap();
        }
        assert_eq!(pool.stats().reserved_current, 3 * PAGE as u64);
        if whole {
            pool.synchronize().unwrap();
        } else {
            pool.synchronize_stream(s).unwrap();
        }
        let st = pool.stats();
        assert_eq!(st.reserved_current, PAGE as u64, "whole={whole}: {st:?}");
        assert_eq!(st.releases, 2);
        assert_eq!(dev.read_words(keep.ptr(), PAGE / 4).unwrap(), data);
        pool.free_async(keep, s).unwrap();
        pool.synchronize().unwrap();
        assert_eq!(pool.stats().reserved_current, 0);
        assert_eq!(dev.live_handles(), 0);
    }
}

/// A host device with one blocked stream whose work runs only once the
/// pool waits on the device (a stream, an event or the whole device): a
/// synchronisation that skips that stream leaves its work queued.
struct ReleasesOnWait {
    inner: HostDevice,
    blocker: Mutex<Option<Blocker>>,
}

impl ReleasesOnWait {
    fn release(&self) {
        if let Some(mut b) = self.blocker.lock().unwrap().take() {
            b.release();
        }
    }
}

impl common::wrap::Hooks for ReleasesOnWait {
    type Inner = HostDevice;
    fn inner(&self) -> &HostDevice {
        &self.inner
    }
    fn synchronize_stream(&self, stream: Stream) -> SysResult<()> {
        self.release();
        self.inner.synchronize_stream(stream)
    }
    fn synchronize_event(&self, event: Event) -> SysResult<()> {
        self.release();
        self.inner.synchronize_event(event)
    }
    fn synchronize_device(&self) -> SysResult<()> {
        self.release();
        self.inner.synchronize_device()
    }
}

common::wrap::wrapped_device!(ReleasesOnWait);

/// Rule: `synchronize` waits for every stream the pool has seen, retired
/// ones included, so that afterwards their frees are complete and
/// `trim_to(0)` gives everything back.
/// Catches: a synchronisation that skips retired streams (their last frees
/// stay pending and trim keeps their pages).
#[test]
fn synchronize_waits_for_retired_streams_too() {
    let dev = Arc::new(ReleasesOnWait {
        inner: host(),
        blocker: Mutex::new(None),
    });
    let pool = pool(&dev, config());
    let s = dev.create_stream().unwrap();
    let a = pool.alloc_async(PAGE, s).unwrap();
    let blocker = Blocker::on(&dev.inner, s);
    let ran = blocker.flag();
    *dev.blocker.lock().unwrap() = Some(blocker);
    pool.free_async(a, s).unwrap();
    pool.retire_stream(s).unwrap();
    pool.synchronize().unwrap();
    let waited = ran.load(Ordering::SeqCst);
    dev.release();
    assert!(
        waited,
        "synchronize returned while the retired stream's work was queued"
    );
    assert_eq!(pool.trim_to(0).unwrap(), PAGE as u64);
    assert_eq!(pool.stats().reserved_current, 0);
}

/// Rule: default threshold keeps everything across synchronisations; a
/// threshold set at run time applies at the next one.
#[test]
fn default_release_threshold_keeps_everything() {
    let dev = Arc::new(host());
    let pool = pool(&dev, config());
    assert_eq!(pool.release_threshold(), u64::MAX);
    let s = dev.create_stream().unwrap();
    for a in three_pages(&pool, s) {
        pool.free_async(a, s).unwrap();
    }
    pool.synchronize().unwrap();
    pool.synchronize_stream(s).unwrap();
    assert_eq!(pool.stats().reserved_current, 3 * PAGE as u64);
    assert_eq!(pool.stats().releases, 0);
    pool.set_release_threshold(PAGE as u64);
    pool.synchronize().unwrap();
    assert_eq!(pool.stats().reserved_current, PAGE as u64);
}

/// Rule: `trim_to(0)` releases idle pages but never a page backing a live
/// allocation: data survives and reserved covers every live page.
/// Catches: trim picking pages with users, or unmapping a shared page.
#[test]
fn trim_never_releases_live_memory() {
    let dev = Arc::new(host());
    let pool = pool(&dev, config());
    let s = dev.create_stream().unwrap();
    let mut rng = Rng(99);
    let mut all = Vec::new();
    for _ in 0..24 {
        let size = rng.log_range(4096, 3 << 20) as usize;
        all.push(pool.alloc_async(size, s).unwrap());
    }
    let mut live = Vec::new();
    for (i, a) in all.into_iter().enumerate() {
        if i % 3 == 0 {
            let words = a.size() / 4;
            let data = pattern(i as u32, words);
            dev.write_words(a.ptr(), &data).unwrap();
            live.push((a, data));
        } else {
            pool.free_async(a, s).unwrap();
        }
    }
    let before = pool.stats().reserved_current;
    let released = pool.trim_to(0).unwrap();
    let st = pool.stats();
    assert!(released > 0, "nothing idle was released");
    assert_eq!(st.reserved_current, before - released);
    let live_pages: BTreeSet<u64> = live
        .iter()
        .flat_map(|(a, _)| pages_of(a.ptr(), a.size()))
        .collect();
    assert!(
        st.reserved_current >= live_pages.len() as u64 * PAGE as u64,
        "reserved {} < live pages {}",
        st.reserved_current,
        live_pages.len()
    );
    for (a, data) in &live {
        assert_eq!(
            &dev.read_words(a.ptr(), data.len()).unwrap(),
            data,
            "live data lost"
        );
    }
    for (a, _) in live {
        pool.free_async(a, s).unwrap();
    }
    pool.trim_to(0).unwrap();
    assert_eq!(pool.stats().reserved_current, 0);
}

/// Rule: trim never releases a free whose stream is still busy (its work
/// may still touch the memory): the pending "kernel" still finds its memory
/// mapped, and the page goes once the work is done.
/// Catches: trim's victim filter ignoring guard completion.
#[test]
fn trim_never_releases_a_pending_free() {
    for threshold_sync in [false, true] {
        let dev = Arc::new(host());
        let cfg = if threshold_sync {
            config().with_release_threshold(0)
        } else {
            config()
        };
        let pool = pool(&dev, cfg);
        let s = streams(&*dev, 2);
        let (a, other) = (s[0], s[1]);
        let mut busy = Blocker::on(&*dev, a);
        let x = pool.alloc_async(PAGE, a).unwrap();
        let kernel = tag_kernel(&dev, a, x.ptr(), PAGE / 4, 0xDEAD_BEEF);
        pool.free_async(x, a).unwrap();
        if threshold_sync {
            // A synchronisation of another stream releases down to 0 ...
            pool.synchronize_stream(other).unwrap();
        } else {
            pool.trim_to(0).unwrap();
        }
        // ... but not the page whose free is pending.
        assert_eq!(pool.stats().reserved_current, PAGE as u64);
        busy.release();
        assert!(
            kernel.recv().unwrap(),
            "the pending free's memory was unmapped"
        );
        dev.synchronize_stream(a).unwrap();
        pool.trim_to(0).unwrap();
        assert_eq!(pool.stats().reserved_current, 0);
    }
}

/// Rule: statistics — reserved/used current and high, resettable highs,
/// alloc/free counts, cache hits, growths, releases, ooms.
#[test]
fn stats_track_reserved_used_and_counters() {
    let dev = Arc::new(host());
    let pool = pool(&dev, config().with_max_size(8 * PAGE as u64));
    let s = dev.create_stream().unwrap();
    assert_eq!(pool.stats(), tidepool::PoolStats::default());
    let a = pool.alloc_async(1000, s).unwrap();
    let b = pool.alloc_async(3000, s).unwrap();
    let st = pool.stats();
    assert_eq!((st.used_current, st.used_high), (4000, 4000));
    assert_eq!((st.allocs, st.frees), (2, 0));
    assert_eq!(st.reserved_current, st.growths * PAGE as u64);
    assert!(st.growths >= 1);
    assert_eq!(st.reserved_high, st.reserved_current);
    pool.free_async(a, s).unwrap();
    let st = pool.stats();
    assert_eq!((st.used_current, st.used_high, st.frees), (3000, 4000, 1));
    pool.reset_peaks();
    assert_eq!(pool.stats().used_high, 3000);
    // Same-stream, same-size reuse is a cache hit.
    let a = pool.alloc_async(1000, s).unwrap();
    assert_eq!(pool.stats().cache_hits, 1);
    let big = pool.alloc_async(5 * PAGE, s).unwrap();
    let st = pool.stats();
    assert_eq!(st.used_current, 4000 + 5 * PAGE as u64);
    assert_eq!(st.used_high, st.used_current);
    assert!(st.reserved_current >= 6 * PAGE as u64);
    assert_eq!(st.reserved_high, st.reserved_current);
    assert_eq!(
        st.reserved_current,
        (st.growths - st.releases) * PAGE as u64
    );
    assert!(pool
        .alloc_async(8 * PAGE, s)
        .unwrap_err()
        .is_out_of_memory());
    assert_eq!(pool.stats().ooms, 1);
    // (Whether a failed request may grow the pool is tested in errors.rs.)
    let high = pool.stats().reserved_high;
    for x in [a, b, big] {
        pool.free_async(x, s).unwrap();
    }
    pool.trim_to(0).unwrap();
    let st = pool.stats();
    assert_eq!((st.used_current, st.reserved_current), (0, 0));
    assert_eq!(st.releases, st.growths);
    assert_eq!((st.allocs, st.frees), (4, 4));
    assert_eq!(st.reserved_high, high, "reserved_high must survive a trim");
    pool.reset_peaks();
    let st = pool.stats();
    assert_eq!((st.reserved_high, st.used_high), (0, 0));
}

/// Rule: used bytes are counted exactly although each stream keeps its own
/// counters: allocations and frees on different streams and threads sum to
/// exact counts and `used_current`; `used_high` is the true peak even when
/// no `stats()` call saw it, and memory freed on one stream and allocated
/// on another is not counted twice.
/// Catches: counters lost or double-counted across streams, a missed peak,
/// a peak inflated by headroom one stream holds and another needs.
#[test]
fn stats_are_exact_across_streams_and_threads() {
    let dev = Arc::new(host());
    let pool = pool(&dev, config());
    let s = streams(&*dev, 4);
    // Allocated on one stream, freed on another (ordered by an event).
    let a = pool.alloc_async(3000, s[0]).unwrap();
    let ev = pool.record_event(s[0]).unwrap();
    pool.wait_event(s[1], &ev).unwrap();
    pool.free_async(a, s[1]).unwrap();
    let st = pool.stats();
    assert_eq!((st.used_current, st.allocs, st.frees), (0, 1, 1));
    assert_eq!(st.used_high, 3000, "the unobserved peak");
    // s[1] now holds 3000 bytes of headroom; s[2] allocates 3000: no new
    // peak, although s[2] itself freed nothing.
    let b = pool.alloc_async(3000, s[2]).unwrap();
    let st = pool.stats();
    assert_eq!((st.used_current, st.used_high), (3000, 3000));
    let c = pool.alloc_async(1000, s[3]).unwrap();
    assert_eq!(pool.stats().used_high, 4000);
    pool.free_async(b, s[2]).unwrap();
    pool.free_async(c, s[3]).unwrap();
    let threads: Vec<_> = s
        .iter()
        .map(|&stream| {
            let pool = pool.clone();
            std::thread::spawn(move || {
                for i in 0..500usize {
                    let x = pool.alloc_async(512 * (1 + i % 7), stream).unwrap();
                    pool.free_async(x, stream).unwrap();
                }
                let keep = pool.alloc_async(10_000, stream).unwrap();
                (stream, keep)
            })
        })
        .collect();
    let kept: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let st = pool.stats();
    assert_eq!(st.allocs, 3 + 4 * 501);
    assert_eq!(st.frees, 3 + 4 * 500);
    assert_eq!(st.used_current, 40_000);
    // Each thread held at most 3584 bytes before its last 10,000.
    assert!(st.used_high >= 40_000 && st.used_high <= 4 * (3584 + 10_000));
    for (stream, x) in kept {
        pool.free_async(x, stream).unwrap();
    }
    let st = pool.stats();
    assert_eq!((st.used_current, st.frees), (0, 3 + 4 * 501));
    pool.reset_peaks();
    assert_eq!(pool.stats().used_high, 0);
    let d = pool.alloc_async(512, s[0]).unwrap();
    assert_eq!(pool.stats().used_high, 512);
    pool.free_async(d, s[0]).unwrap();
}

/// Rule: defragmentation — capped at 8 pages and full; whole pages freed
/// in a checkerboard so that 4 pages are free but no free range holds 2
/// pages: a 2-page request succeeds by remapping completed free pages, and
/// every live allocation keeps its contents.
///
/// (Half-page blocks with every *other block* freed would leave a live
/// block on every page; page-granular stitching cannot move those, so the
/// checkerboard is over pages.)
/// Catches: an allocator that fails (false OOM) or grows past its cap, or
/// a stitcher that moves a page with a live block.
#[test]
fn defragmentation_avoids_false_out_of_memory() {
    let dev = Arc::new(host());
    let pool = pool(&dev, config().with_max_size(8 * PAGE as u64));
    let s = dev.create_stream().unwrap();
    let blocks: Vec<_> = (0..16)
        .map(|_| pool.alloc_async(PAGE / 2, s).unwrap())
        .collect();
    assert_eq!(pool.stats().reserved_current, 8 * PAGE as u64);
    let pages: BTreeSet<u64> = blocks.iter().map(|a| a.ptr() / PAGE as u64).collect();
    assert_eq!(pages.len(), 8, "half-page blocks did not pack two per page");
    let freed_pages: BTreeSet<u64> = pages.iter().copied().step_by(2).collect();
    let mut live = Vec::new();
    for (i, a) in blocks.into_iter().enumerate() {
        if freed_pages.contains(&(a.ptr() / PAGE as u64)) {
            pool.free_async(a, s).unwrap();
        } else {
            let data = pattern(100 + i as u32, a.size() / 4);
            dev.write_words(a.ptr(), &data).unwrap();
            live.push((a, data));
        }
    }
    assert_eq!(live.len(), 8);
    let before = pool.stats();
    let t = dev.create_stream().unwrap();
    for st in [s, t] {
        let big = pool
            .alloc_async(2 * PAGE, st)
            .unwrap_or_else(|e| panic!("false out-of-memory: {e}"));
        let after = pool.stats();
        assert!(after.remaps > before.remaps, "{after:?}");
        assert_eq!(after.growths, before.growths);
        assert!(after.reserved_current <= 8 * PAGE as u64);
        let mine = pattern(999, 2 * PAGE / 4);
        dev.write_words(big.ptr(), &mine).unwrap();
        for (a, data) in &live {
            assert_eq!(
                &dev.read_words(a.ptr(), data.len()).unwrap(),
                data,
                "live data moved"
            );
        }
        assert_eq!(dev.read_words(big.ptr(), mine.len()).unwrap(), mine);
        pool.free_async(big, st).unwrap();
        dev.synchronize_stream(st).unwrap();
    }
    for (a, _) in live {
        pool.free_async(a, s).unwrap();
    }
}

/// Rule: stitching moves pages whose frees are pending only to a stream
/// ordered after those frees: with the freeing stream busy and another
/// stream not waiting for it (no internal dependency, no host wait), the
/// same checkerboard cannot be stitched (OOM), the pending work still
/// finds its memory; once it is done the request succeeds.
/// Catches: a stitcher that takes pages with pending frees for any stream.
#[test]
fn defragmentation_never_moves_pending_frees() {
    let dev = Arc::new(host());
    let reuse = ReusePolicy {
        wait_for_pending_frees: false,
        internal_dependencies: false,
        ..ReusePolicy::default()
    };
    let pool = pool(
        &dev,
        config().with_max_size(8 * PAGE as u64).with_reuse(reuse),
    );
    let s = streams(&*dev, 2);
    let (a, b) = (s[0], s[1]);
    let mut busy = Blocker::on(&*dev, a);
    let blocks: Vec<_> = (0..8).map(|_| pool.alloc_async(PAGE, a).unwrap()).collect();
    let mut kernels = Vec::new();
    let mut live = Vec::new();
    for (i, x) in blocks.into_iter().enumerate() {
        if i % 2 == 0 {
            kernels.push(tag_kernel(&dev, a, x.ptr(), PAGE / 4, i as u32));
            pool.free_async(x, a).unwrap();
        } else {
            live.push(x);
        }
    }
    let err = pool.alloc_async(2 * PAGE, b).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    busy.release();
    for k in kernels {
        assert!(k.recv().unwrap(), "a pending free's page was moved");
    }
    dev.synchronize_stream(a).unwrap();
    let big = pool.alloc_async(2 * PAGE, b).unwrap();
    pool.free_async(big, b).unwrap();
    for x in live {
        pool.free_async(x, a).unwrap();
    }
}

/// Rule: `default_pool` gives the same pool for the same device, another
/// for another device.
#[test]
fn default_pool_is_one_per_device() {
    let dev = Arc::new(host());
    let p1 = default_pool(&dev).unwrap();
    let p2 = default_pool(&dev).unwrap();
    assert_eq!(p1.id(), p2.id());
    let other = Arc::new(host());
    let p3 = default_pool(&other).unwrap();
    assert_ne!(p1.id(), p3.id());
    let s = dev.create_stream().unwrap();
    let x = p1.alloc_async(4096, s).unwrap();
    assert!(p2.contains(x.ptr()));
    p2.free_async(x, s).unwrap();
    assert_eq!(p1.stats().used_current, 0);
}
