//! A stream's cached frees given back to the arena together, attacked
//! through `MemPool` on the host backend: frees of one stream made in
//! different epochs (an event recorded between them closes each one),
//! cached side by side while the stream is held busy, then flushed into
//! the arena by a trim (every busy stream's cache) or by the stream's own
//! slow allocation. Blocks that touch are joined before they reach the
//! maps, under the latest of their epochs, except that blocks of an epoch
//! already known complete are kept apart: another stream must not be
//! handed any byte of a block of the later epoch before it completes
//! (the blocks of the completed epoch it may have). Checked
//! twice: with the pool's own answers (which offsets it hands out) and
//! with data, a "kernel" queued on the held stream writing a tag over the
//! blocks of the later epoch and a pattern written by the other stream
//! into whatever it got, read back once everything ran.
//!
//! A last test runs threads, each on its own stream, closing epochs
//! between frees, holding its stream busy now and then, freeing some
//! blocks on another thread's stream (made to wait for its own), while
//! one of them flushes every cache by trims: tags written and checked by
//! kernels of the streams, the footprint bounded, and after every free,
//! a synchronise and `trim_to(0)`, nothing used and nothing reserved.
//! Work is bounded by operation counts.

mod common;

use common::{tag_kernel, Blocker};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use tidepool::{Allocation, MemPool};
use tidepool_sys::{Device, HostDevice, Stream};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

/// What a block of `size` bytes takes in the arena.
fn span(size: usize) -> usize {
    size.next_multiple_of(512)
}

/// A host device of 1 GiB (the shared test helper's).
fn device() -> Arc<HostDevice> {
    Arc::new(common::host())
}

fn pool(dev: &Arc<HostDevice>, cache: usize) -> MemPool<HostDevice> {
    common::pool(dev, common::config().with_stream_cache_bytes(cache))
}

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

/// How the held stream's cache reaches the arena.
#[derive(Clone, Copy, Debug)]
enum Flush {
    /// `trim_to(u64::MAX)`: every busy stream's cache, nothing released.
    Trim,
    /// The held stream allocates a length it has not cached (a miss: its
    /// slow path moves its own cache into the arena first).
    OwnSlowAlloc,
}

/// The epoch (0 or 1) each of the row's blocks is freed in, and the order
/// of the frees inside each epoch (indexes into the row).
struct Layout {
    epochs: &'static [u8],
    order: &'static [usize],
}

const LAYOUTS: [Layout; 4] = [
    // Alternating: every join mixes the two epochs.
    Layout {
        epochs: &[0, 1, 0, 1, 0, 1],
        order: &[5, 0, 3, 2, 1, 4],
    },
    // The earlier epoch on the outside, the later one in the middle.
    Layout {
        epochs: &[0, 0, 1, 1, 0, 0],
        order: &[0, 5, 1, 4, 3, 2],
    },
    // The later epoch first in address order, freed last to first.
    Layout {
        epochs: &[1, 1, 1, 0, 0, 0],
        order: &[5, 4, 3, 2, 1, 0],
    },
    // One block of the later epoch at the end of the row.
    Layout {
        epochs: &[0, 0, 0, 0, 0, 1],
        order: &[2, 0, 4, 1, 3, 5],
    },
];

/// One run of the joined-epochs attack: a row of adjacent blocks of
/// `size` on `a`, freed on `a` in two epochs per `layout` while `a` is
/// held busy, the first epoch then known complete (synchronised), the
/// cache flushed per `flush`; stream `b` then asks for blocks of the
/// row's size and of the row's whole length and must get no byte of the
/// later epoch's blocks; at the end nothing is used or reserved.
fn joined_epochs_run(size: usize, layout: &Layout, flush: Flush) {
    let what = format!("size {size}, layout {:?}, {flush:?}", layout.epochs);
    let dev = device();
    let pool = pool(&dev, 256 * MIB);
    let (a, b) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let n = layout.epochs.len();
    let len = span(size) as u64;

    // A row of adjacent blocks on `a` (the stream allocates, so it caches
    // its frees).
    let mut row: Vec<Allocation> = (0..n).map(|_| pool.alloc_async(size, a).unwrap()).collect();
    row.sort_by_key(|x| x.ptr());
    for w in row.windows(2) {
        assert_eq!(
            w[1].ptr(),
            w[0].ptr() + len,
            "{what}: a fresh stream's blocks of one size lie side by side"
        );
    }
    let ptrs: Vec<u64> = row.iter().map(|x| x.ptr()).collect();
    let later: Vec<(u64, u64)> = (0..n)
        .filter(|&i| layout.epochs[i] == 1)
        .map(|i| (ptrs[i], ptrs[i] + len))
        .collect();
    let mut slots: Vec<Option<Allocation>> = row.into_iter().map(Some).collect();

    let words = (size / 4).min(64);
    let mut first = Blocker::on(&*dev, a);
    let mut kernels: Vec<Receiver<bool>> = Vec::new();
    // Epoch 0: kernels on its blocks, queued behind the first blocker,
    // then their frees, then an event that closes the epoch.
    for &i in layout.order.iter().filter(|&&i| layout.epochs[i] == 0) {
        kernels.push(tag_kernel(&dev, a, ptrs[i], words, 0xE0E0_0000 | i as u32));
        pool.free_async(slots[i].take().unwrap(), a).unwrap();
    }
    let ev0 = pool.record_event(a).unwrap();
    // Epoch 1: behind a second blocker, kernels that write the blocks'
    // tags once it is released, then their frees.
    let mut second = Blocker::on(&*dev, a);
    let tag1 = 0xE1E1_0000u32;
    for &i in layout.order.iter().filter(|&&i| layout.epochs[i] == 1) {
        kernels.push(tag_kernel(&dev, a, ptrs[i], words, tag1 | i as u32));
        pool.free_async(slots[i].take().unwrap(), a).unwrap();
    }
    assert!(slots.iter().all(Option::is_none));

    // The first epoch completes and the pool knows it.
    first.release();
    pool.synchronize_event(&ev0).unwrap();
    assert!(!second.done());

    // The cache reaches the arena.
    let mut own = None;
    match flush {
        Flush::Trim => {
            pool.trim_to(u64::MAX).unwrap();
        }
        Flush::OwnSlowAlloc => {
            own = Some(pool.alloc_async(size + 4 * KIB, a).unwrap());
        }
    }

    // `b` asks: the row's length, the row's block size, a little over
    // half of it, two blocks' length, the block size again.
    let mut got: Vec<(Allocation, u32)> = Vec::new();
    let asks = [n * span(size), size, size / 2 + 512, 2 * size, size];
    for (k, &ask) in asks.iter().enumerate() {
        let x = pool.alloc_async(ask, b).unwrap();
        let at = (x.ptr(), x.ptr() + span(ask) as u64);
        assert!(
            !later.iter().any(|&l| overlaps(l, at)),
            "{what}: stream b got [{:#x}, {:#x}) over a block whose free is still \
             pending on the held stream (later epoch)",
            at.0,
            at.1
        );
        let seed = 0xB0B0_0000u32 | k as u32;
        dev.write_words(x.ptr(), &vec![seed; (ask / 4).min(4096)])
            .unwrap();
        got.push((x, seed));
    }

    // The held stream runs its kernels; everything completes.
    second.release();
    pool.synchronize().unwrap();
    for k in kernels {
        assert!(k.recv().unwrap(), "{what}: a kernel ran on unmapped memory");
    }
    for (x, seed) in got {
        let ask = x.size();
        let w = dev.read_words(x.ptr(), (ask / 4).min(4096)).unwrap();
        assert!(
            w.iter().all(|&v| v == seed),
            "{what}: stream b's block at {:#x} was overwritten by the held stream's kernel",
            x.ptr()
        );
        pool.free_async(x, b).unwrap();
    }
    if let Some(x) = own {
        pool.free_async(x, a).unwrap();
    }

    pool.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    let s = pool.stats();
    assert_eq!((s.used_current, s.reserved_current), (0, 0), "{what}");
}

/// Sizes on both sides of 64 KiB and 256 KiB (small zone, best fit), of
/// 1 MiB and of 2 MiB (medium zone, first fit).
const JOIN_SIZES: [usize; 8] = [
    4 * KIB,
    64 * KIB - 512,
    64 * KIB + 512,
    256 * KIB,
    256 * KIB + 512,
    MIB + 512,
    2 * MIB - 512,
    2 * MIB + 512,
];

#[test]
fn joined_epochs_later_blocks_stay_pending_trim() {
    for &size in &JOIN_SIZES {
        for layout in &LAYOUTS {
            joined_epochs_run(size, layout, Flush::Trim);
        }
    }
}

#[test]
fn joined_epochs_later_blocks_stay_pending_own_flush() {
    for &size in &JOIN_SIZES {
        for layout in &LAYOUTS {
            joined_epochs_run(size, layout, Flush::OwnSlowAlloc);
        }
    }
}

/// Words each thread's kernels write or check at the start of a block.
fn words(size: usize) -> usize {
    (size / 4).min(128)
}

/// A kernel on `stream` that checks the tag at `ptr`; its verdict comes
/// back (`None`: the memory was not mapped read-write).
fn check_kernel(
    dev: &HostDevice,
    stream: Stream,
    ptr: u64,
    size: usize,
    tag: u32,
) -> Receiver<Option<bool>> {
    let (tx, rx) = std::sync::mpsc::channel();
    dev.launch_on_words(stream, ptr, words(size) * 4, move |r| {
        let _ = tx.send(r.ok().map(|w| {
            w.iter()
                .all(|v| v.load(std::sync::atomic::Ordering::Relaxed) == tag)
        }));
    })
    .expect("launch check");
    rx
}

const THREADS: usize = 3;
const THREAD_OPS: usize = 300;
const THREAD_SIZES: [usize; 7] = [
    4 * KIB,
    64 * KIB - 512,
    64 * KIB + 512,
    256 * KIB - 512,
    256 * KIB + 512,
    MIB + 512,
    2 * MIB + 512,
];

/// One thread on its own stream: blocks tagged by a kernel of the stream,
/// checked by a kernel before each free; frees grouped in epochs (an event
/// after every few) while the stream is now and then held busy, so that
/// its cache holds frees of several epochs when another thread's trim or
/// its own slow allocation flushes it; some blocks freed on another
/// thread's stream after making that stream wait for this one.
fn churn(t: usize, dev: Arc<HostDevice>, pool: Arc<MemPool<HostDevice>>, all: Arc<Vec<Stream>>) {
    let s = all[t];
    let mut rng = common::Rng(0xA8A8_0000 + t as u64);
    let mut mine: Vec<(Allocation, u32)> = Vec::new();
    let mut writes: Vec<Receiver<bool>> = Vec::new();
    let mut checks: Vec<(usize, Receiver<Option<bool>>)> = Vec::new();
    let mut hold: Option<Blocker> = None;
    for op in 0..THREAD_OPS {
        let size = THREAD_SIZES[rng.range(0, THREAD_SIZES.len() as u64 - 1) as usize];
        let x = pool.alloc_async(size, s).unwrap();
        let tag = ((t as u32 + 1) << 24) | op as u32;
        writes.push(tag_kernel(&dev, s, x.ptr(), words(size), tag));
        mine.push((x, tag));
        if mine.len() > 6 || rng.range(0, 2) == 0 {
            let (x, tag) = mine.swap_remove(rng.range(0, mine.len() as u64 - 1) as usize);
            checks.push((op, check_kernel(&dev, s, x.ptr(), x.size(), tag)));
            if rng.range(0, 4) == 0 {
                // Freed on another thread's stream, ordered after ours.
                let other = all[(t + 1 + rng.range(0, THREADS as u64 - 2) as usize) % THREADS];
                let ev = pool.record_event(s).unwrap();
                pool.wait_event(other, &ev).unwrap();
                pool.free_async(x, other).unwrap();
            } else {
                pool.free_async(x, s).unwrap();
            }
        }
        match rng.range(0, 9) {
            0..=2 => drop(pool.record_event(s).unwrap()),
            3 if hold.is_none() => hold = Some(Blocker::on(&*dev, s)),
            4 => {
                if let Some(mut h) = hold.take() {
                    h.release();
                }
            }
            5 if t == 0 => {
                pool.trim_to(u64::MAX).unwrap();
            }
            6 if t == 0 && op % 4 == 0 => {
                pool.trim_to(0).unwrap();
            }
            _ => {}
        }
        if hold.is_none() && checks.len() > 24 {
            // The stream runs: the verdicts so far come back.
            for (op, c) in checks.drain(..) {
                assert_eq!(
                    c.recv().unwrap(),
                    Some(true),
                    "thread {t} op {op}: the tag was overwritten (or the memory unmapped)"
                );
            }
            for w in writes.drain(..) {
                assert!(
                    w.recv().unwrap(),
                    "thread {t}: a tag kernel ran on unmapped memory"
                );
            }
        }
    }
    drop(hold);
    for (x, tag) in mine.drain(..) {
        checks.push((THREAD_OPS, check_kernel(&dev, s, x.ptr(), x.size(), tag)));
        pool.free_async(x, s).unwrap();
    }
    for (op, c) in checks {
        assert_eq!(
            c.recv().unwrap(),
            Some(true),
            "thread {t} op {op}: tag overwritten"
        );
    }
    for w in writes {
        assert!(
            w.recv().unwrap(),
            "thread {t}: a tag kernel ran on unmapped memory"
        );
    }
}

#[test]
fn threads_flushing_caches_of_several_epochs_keep_patterns_and_footprint() {
    for cache in [512 * KIB, 4 * MIB, 256 * MIB] {
        let dev = device();
        let pool = Arc::new(pool(&dev, cache));
        let all: Arc<Vec<Stream>> =
            Arc::new((0..THREADS).map(|_| dev.create_stream().unwrap()).collect());
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let (dev, pool, all) = (dev.clone(), pool.clone(), all.clone());
                std::thread::spawn(move || churn(t, dev, pool, all))
            })
            .collect();
        for h in handles {
            h.join().expect("thread");
        }
        pool.synchronize().unwrap();
        let s = pool.stats();
        // At most 7 blocks of at most 2.5 MiB live per thread, and the
        // frees of at most a few dozen operations pending on each.
        assert!(
            s.reserved_high <= 256 * MIB as u64,
            "cache {cache}: {} B reserved at the peak",
            s.reserved_high
        );
        pool.trim_to(0).unwrap();
        let s = pool.stats();
        assert_eq!(
            (s.used_current, s.reserved_current),
            (0, 0),
            "cache {cache}"
        );
        assert_eq!(s.allocs, s.frees, "cache {cache}");
    }
}
