//! The arena's free-range index under thousands of small free ranges (its
//! chunked map split and merged many times over), on a device capped to a
//! few pages so that every request must be served from what was freed:
//! nothing is lost (every freed byte comes back, the whole capacity is one
//! block again once everything is free), nothing is handed out twice
//! (host kernels tag each block in stream order and check it before its
//! free), and a free on a busy stream is never reused by another stream's
//! work that could overlap it. Work is bounded by operation counts.

mod common;

use common::*;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::{channel, Receiver};
use std::sync::Arc;
use tidepool::{Allocation, MemPool, PoolConfig};
use tidepool_sys::{Device, DevicePtr, HostDevice, Stream};

fn capped(pages: usize) -> (Arc<HostDevice>, MemPool<HostDevice>) {
    let dev = Arc::new(host_with_capacity(pages * PAGE));
    let pool = MemPool::new(
        dev.clone(),
        PoolConfig::default()
            .with_va_size(256 << 20)
            // Every free goes to the arena.
            .with_stream_cache_bytes(0),
    )
    .expect("pool");
    (dev, pool)
}

fn overlaps(a: DevicePtr, la: usize, b: DevicePtr, lb: usize) -> bool {
    a < b + lb as u64 && b < a + la as u64
}

/// Check `tag` over the first `words` words at `ptr`, in stream order.
fn verify(dev: &HostDevice, s: Stream, ptr: DevicePtr, words: usize, tag: u32) -> Receiver<bool> {
    let (tx, rx) = channel();
    dev.launch_on_words(s, ptr, words * 4, move |r: Result<&[AtomicU32], _>| {
        let ok = r.is_ok_and(|w| w.iter().all(|x| x.load(Ordering::Relaxed) == tag));
        let _ = tx.send(ok);
    })
    .expect("launch verify");
    rx
}

fn all_true(rxs: Vec<Receiver<bool>>, what: &str) {
    for (i, rx) in rxs.into_iter().enumerate() {
        assert!(
            rx.recv().expect("kernel ran"),
            "{what}: check {i} found the memory unmapped or its tag overwritten"
        );
    }
}

/// Everything freed: the whole capacity is one block again, then the books
/// balance and a trim gives back every page.
fn whole_again(
    dev: &Arc<HostDevice>,
    pool: &MemPool<HostDevice>,
    pages: usize,
    s: Stream,
    what: &str,
) {
    pool.synchronize().unwrap();
    let st = pool.stats();
    assert_eq!(st.used_current, 0, "{what}: bytes used after freeing all");
    assert_eq!(st.allocs, st.frees, "{what}: allocations and frees");
    let all = match pool.alloc_async(pages * PAGE, s) {
        Ok(a) => a,
        Err(e) => panic!("{what}: the whole capacity is free but cannot be had: {e}"),
    };
    let rx = tag_kernel(dev, s, all.ptr(), 16, 0xFEED);
    pool.free_async(all, s).unwrap();
    assert!(rx.recv().unwrap(), "{what}: the whole block was not mapped");
    pool.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    assert_eq!(
        pool.stats().reserved_current,
        0,
        "{what}: pages held after trim_to(0)"
    );
}

/// Two pages cut into 4096 blocks of 1 KiB; every other one freed (2048
/// free ranges that cannot merge), taken back at other sizes, freed in a
/// shuffled order so that ranges merge from both sides in every pattern.
/// The device is full all along: every request is served from free ranges.
#[test]
fn thousands_of_free_ranges_split_and_merge_without_loss() {
    const PAGES: usize = 2;
    const BLOCK: usize = 1024;
    let n = PAGES * PAGE / BLOCK;
    let (dev, pool) = capped(PAGES);
    let s = dev.create_stream().unwrap();
    let mut rng = Rng(0x0123_4567_89AB_CDEF);
    let mut checks = Vec::new();
    let mut live: BTreeMap<DevicePtr, (Allocation, u32)> = BTreeMap::new();
    for i in 0..n {
        let a = pool
            .alloc_async(BLOCK, s)
            .unwrap_or_else(|e| panic!("block {i} of {n} in a device of exactly that size: {e}"));
        checks.push(tag_kernel(&dev, s, a.ptr(), 4, i as u32));
        live.insert(a.ptr(), (a, i as u32));
    }
    // Packed: the device is full, so one more byte fails.
    assert!(
        pool.alloc_async(512, s).is_err(),
        "a full device served one more block"
    );
    for pass in 0..3u32 {
        // Free every other live block (by address).
        let keys: Vec<DevicePtr> = live.keys().copied().collect();
        let mut freed = 0usize;
        for (j, k) in keys.iter().enumerate() {
            if j % 2 == 1 {
                let (a, t) = live.remove(k).unwrap();
                checks.push(verify(&dev, s, a.ptr(), 4, t));
                freed += a.size();
                pool.free_async(a, s).unwrap();
            }
        }
        // Take the bytes back in blocks of 512 bytes and of 1.5 KiB where
        // they fit: exactly the freed bytes are usable, in holes of 1 KiB.
        let mut got = 0usize;
        let mut tag = 0x10_0000 * (pass + 1);
        while got < freed {
            let size = 512;
            let a = pool.alloc_async(size, s).unwrap_or_else(|e| {
                panic!("pass {pass}: {got} of {freed} freed bytes taken back, then: {e}")
            });
            let p = a.ptr();
            if let Some((&q, (b, _))) = live.range(..=p).next_back() {
                assert!(
                    !overlaps(q, b.size(), p, size),
                    "pass {pass}: {p:#x} overlaps {q:#x}"
                );
            }
            if let Some((&q, _)) = live.range(p..).next() {
                assert!(q >= p + size as u64, "pass {pass}: {p:#x} overlaps {q:#x}");
            }
            checks.push(tag_kernel(&dev, s, a.ptr(), 4, tag));
            live.insert(p, (a, tag));
            tag += 1;
            got += size;
        }
        assert!(
            pool.alloc_async(512, s).is_err(),
            "pass {pass}: a full device served one more block"
        );
        // Free a shuffled half, so that ranges merge left, right and both.
        let mut keys: Vec<DevicePtr> = live.keys().copied().collect();
        for _ in 0..keys.len() / 2 {
            let k = keys.swap_remove(rng.range(0, keys.len() as u64 - 1) as usize);
            let (a, t) = live.remove(&k).unwrap();
            checks.push(verify(&dev, s, a.ptr(), 4, t));
            pool.free_async(a, s).unwrap();
        }
        // And take back blocks of 1.5 KiB until the device is full.
        let mut more = 0;
        while let Ok(a) = pool.alloc_async(1536, s) {
            let p = a.ptr();
            if let Some((&q, (b, _))) = live.range(..=p).next_back() {
                assert!(
                    !overlaps(q, b.size(), p, 1536),
                    "pass {pass}: {p:#x} overlaps {q:#x}"
                );
            }
            if let Some((&q, _)) = live.range(p..).next() {
                assert!(q >= p + 1536, "pass {pass}: {p:#x} overlaps {q:#x}");
            }
            checks.push(tag_kernel(&dev, s, a.ptr(), 4, tag));
            live.insert(p, (a, tag));
            tag += 1;
            more += 1;
        }
        assert!(more > 100, "pass {pass}: only {more} blocks of 1.5 KiB fit");
        // Then the holes too small for them, so that the device is full.
        while let Ok(a) = pool.alloc_async(512, s) {
            let p = a.ptr();
            if let Some((&q, (b, _))) = live.range(..=p).next_back() {
                assert!(
                    !overlaps(q, b.size(), p, 512),
                    "pass {pass}: {p:#x} overlaps {q:#x}"
                );
            }
            if let Some((&q, _)) = live.range(p..).next() {
                assert!(q >= p + 512, "pass {pass}: {p:#x} overlaps {q:#x}");
            }
            checks.push(tag_kernel(&dev, s, a.ptr(), 4, tag));
            live.insert(p, (a, tag));
            tag += 1;
        }
        let used: usize = live
            .values()
            .map(|(a, _)| a.size().next_multiple_of(512))
            .sum();
        assert_eq!(
            used,
            PAGES * PAGE,
            "pass {pass}: the device is full, every byte in a live block"
        );
        let used: usize = live.values().map(|(a, _)| a.size()).sum();
        assert_eq!(
            pool.stats().used_current as usize,
            used,
            "pass {pass}: used bytes"
        );
    }
    let keys: Vec<DevicePtr> = live.keys().copied().collect();
    let mut keys = keys;
    while !keys.is_empty() {
        let k = keys.swap_remove(rng.range(0, keys.len() as u64 - 1) as usize);
        let (a, t) = live.remove(&k).unwrap();
        checks.push(verify(&dev, s, a.ptr(), 4, t));
        pool.free_async(a, s).unwrap();
    }
    all_true(checks, "small free ranges");
    whole_again(&dev, &pool, PAGES, s, "small free ranges");
}

/// A random capped workload on three streams, one of them often held busy:
/// its frees must not be reused by the others before its work ran. Each
/// block is tagged on its stream; its check runs on the same stream just
/// before its free, so a block handed out twice (or reused too early by
/// another stream) shows as an overwritten tag.
#[test]
fn random_capped_workload_on_streams_held_busy_keeps_every_tag() {
    const PAGES: usize = 4;
    const OPS: usize = 6000;
    let (dev, pool) = capped(PAGES);
    let ss = streams(&*dev, 3);
    let mut rng = Rng(0xA5A5_5A5A_1234_5678);
    let mut live: Vec<(Allocation, Stream, u32, usize)> = Vec::new();
    let mut checks = Vec::new();
    let mut blocker: Option<Blocker> = None;
    let mut ooms = 0;
    for op in 0..OPS {
        if op % 500 == 0 {
            // Hold stream 2 busy for the next 500 operations (or release).
            blocker = if blocker.is_none() {
                Some(Blocker::on(&*dev, ss[2]))
            } else {
                None
            };
        }
        let s = ss[rng.range(0, 2) as usize];
        if live.len() < 400 && rng.next() % 2 == 0 {
            let size = match rng.next() % 8 {
                0 => rng.range(16 << 10, 256 << 10),
                _ => rng.log_range(1, 8 << 10),
            } as usize;
            match pool.alloc_async(size, s) {
                Ok(a) => {
                    let words = (size / 4).min(8);
                    let tag = op as u32 + 1;
                    if words > 0 {
                        checks.push(tag_kernel(&dev, s, a.ptr(), words, tag));
                    }
                    live.push((a, s, tag, words));
                }
                Err(e) => {
                    assert!(e.is_out_of_memory(), "op {op}: {e}");
                    ooms += 1;
                }
            }
        } else if !live.is_empty() {
            let (a, s, tag, words) = live.swap_remove(rng.range(0, live.len() as u64 - 1) as usize);
            if words > 0 {
                checks.push(verify(&dev, s, a.ptr(), words, tag));
            }
            pool.free_async(a, s).unwrap();
        }
    }
    drop(blocker);
    for (a, s, tag, words) in live {
        if words > 0 {
            checks.push(verify(&dev, s, a.ptr(), words, tag));
        }
        pool.free_async(a, s).unwrap();
    }
    assert!(
        ooms < OPS / 4,
        "{ooms} of {OPS} operations ran out of memory"
    );
    all_true(checks, "random capped workload");
    whole_again(&dev, &pool, PAGES, ss[0], "random capped workload");
}

/// A free on a stream held busy, with device work queued on the block
/// before the free: a trim while it is pending must keep its pages mapped
/// (the queued work still writes them), and another stream given those
/// bytes on a full device must be ordered after that work (its own tag,
/// written at once on its stream, survives the queued write).
#[test]
fn a_pending_free_keeps_its_pages_through_trim_and_orders_its_reuse() {
    for cache in [0usize, 256 << 20] {
        let dev = Arc::new(host_with_capacity(PAGE));
        let pool = MemPool::new(
            dev.clone(),
            PoolConfig::default()
                .with_va_size(64 << 20)
                .with_stream_cache_bytes(cache),
        )
        .unwrap();
        let (s, t) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
        // Warm both streams.
        for st in [s, t] {
            let a = pool.alloc_async(4096, st).unwrap();
            pool.free_async(a, st).unwrap();
        }
        pool.synchronize().unwrap();
        let mut hold = Blocker::on(&*dev, s);
        let a = pool.alloc_async(PAGE, s).unwrap();
        let ptr = a.ptr();
        // Queued behind the blocker: writes the whole page.
        let late = tag_kernel(&dev, s, ptr, PAGE / 4, 0x5555);
        pool.free_async(a, s).unwrap();
        pool.trim_to(0).unwrap();
        // The device is full: t gets these bytes only ordered after s.
        let b = match pool.alloc_async(PAGE, t) {
            Ok(b) => Some(b),
            Err(e) => {
                assert!(e.is_out_of_memory(), "cache {cache}: {e}");
                None
            }
        };
        let mine = b
            .as_ref()
            .map(|b| tag_kernel(&dev, t, b.ptr(), PAGE / 4, 0x7777));
        hold.release();
        assert!(
            late.recv().unwrap(),
            "cache {cache}: work queued before a pending free found its page unmapped"
        );
        if let Some(b) = b {
            assert!(
                mine.unwrap().recv().unwrap(),
                "cache {cache}: t's block unmapped"
            );
            let check = verify(&dev, t, b.ptr(), PAGE / 4, 0x7777);
            assert!(
                check.recv().unwrap(),
                "cache {cache}: t got the bytes of a pending free without waiting for it \
                 (its tag was overwritten by the work queued before the free)"
            );
            pool.free_async(b, t).unwrap();
        }
        pool.synchronize().unwrap();
        pool.trim_to(0).unwrap();
        let st = pool.stats();
        assert_eq!(st.used_current, 0);
        assert_eq!(
            st.reserved_current, 0,
            "cache {cache}: pages held after trim"
        );
    }
}
