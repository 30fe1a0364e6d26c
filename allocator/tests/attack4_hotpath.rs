//! The same-stream hot path seen from outside: streams whose ids share a
//! slot of the pool's direct table (one slot per id residue), pools whose
//! ids share a slot of a thread's recent-entries table, a stream retired
//! while another thread still holds its entry, frees through the wrong
//! pool on warm streams, and threads hopping over more streams than the
//! per-thread tables hold while handing allocations to each other. Every
//! block handed out is tagged by a host kernel in stream order and checked
//! before it is freed; every test ends with exact statistics and a trim
//! that gives back every page. Work is bounded by operation counts.

mod common;

use common::*;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::mpsc::{channel, Receiver};
use std::sync::Arc;
use tidepool::{Allocation, MemPool, PoolConfig, PoolError};
use tidepool_sys::{Device, DevicePtr, FaultInjector, HostDevice, Op, Stream};

/// Slots of the pool's direct stream table (one per stream-id residue).
const DIRECT_SLOTS: u64 = 256;
/// Slots of a thread's recent-entries table.
const RECENT_SLOTS: u64 = 16;

fn small_pool(dev: &Arc<HostDevice>) -> MemPool<HostDevice> {
    MemPool::new(dev.clone(), PoolConfig::default().with_va_size(256 << 20)).expect("pool")
}

/// Write `tag` over the first and last words of the block, in stream order.
fn fill(dev: &HostDevice, s: Stream, ptr: DevicePtr, size: usize, tag: u32) -> Vec<Receiver<bool>> {
    spots(ptr, size)
        .into_iter()
        .map(|(p, n)| tag_kernel(dev, s, p, n / 4, tag))
        .collect()
}

/// Check `tag` over the block's first and last words, in stream order.
fn verify(
    dev: &HostDevice,
    s: Stream,
    ptr: DevicePtr,
    size: usize,
    tag: u32,
) -> Vec<Receiver<bool>> {
    spots(ptr, size)
        .into_iter()
        .map(|(p, n)| {
            let (tx, rx) = channel();
            dev.launch_on_words(s, p, n, move |r: Result<&[AtomicU32], _>| {
                let ok = r.is_ok_and(|w| w.iter().all(|x| x.load(Ordering::Relaxed) == tag));
                let _ = tx.send(ok);
            })
            .expect("launch verify");
            rx
        })
        .collect()
}

/// The tagged spots of a block: up to 8 words at its start and its end.
fn spots(ptr: DevicePtr, size: usize) -> Vec<(DevicePtr, usize)> {
    let words = size / 4;
    if words == 0 {
        return Vec::new();
    }
    let n = words.min(8) * 4;
    let tail = ptr + (words * 4 - n) as u64;
    if tail < ptr + n as u64 {
        vec![(ptr, words * 4)]
    } else {
        vec![(ptr, n), (tail, n)]
    }
}

fn all_true(rxs: Vec<Receiver<bool>>, what: &str) {
    for (i, rx) in rxs.into_iter().enumerate() {
        assert!(
            rx.recv().expect("kernel ran"),
            "{what}: kernel {i} found the memory unmapped or a tag overwritten"
        );
    }
}

/// Free everything, wait, and check the pool's books: every allocation
/// freed, nothing used, and a trim to 0 gives back every page.
fn drained<D: Device>(pool: &MemPool<D>, allocs: u64, what: &str) {
    pool.synchronize().expect("synchronize");
    let st = pool.stats();
    assert_eq!(st.allocs, allocs, "{what}: allocations counted ({st:?})");
    assert_eq!(st.frees, allocs, "{what}: frees counted");
    assert_eq!(st.used_current, 0, "{what}: bytes used after freeing all");
    pool.trim_to(0).expect("trim");
    assert_eq!(
        pool.stats().reserved_current,
        0,
        "{what}: pages still held after synchronize and trim_to(0) (a block lost)"
    );
}

/// A stream whose id has the same residue as `x`'s in the direct table
/// (the streams made on the way are destroyed at once).
fn residue_twin(dev: &HostDevice, x: Stream) -> Stream {
    for _ in 0..4 * DIRECT_SLOTS {
        let y = dev.create_stream().expect("stream");
        if y.id() % DIRECT_SLOTS == x.id() % DIRECT_SLOTS {
            return y;
        }
        dev.destroy_stream(y).expect("destroy");
    }
    panic!(
        "no stream id with the residue of {x} in {} tries",
        4 * DIRECT_SLOTS
    );
}

fn overlaps(a: DevicePtr, la: usize, b: DevicePtr, lb: usize) -> bool {
    a < b + lb as u64 && b < a + la as u64
}

/// Two streams share a slot of the direct table: the first keeps it, the
/// second goes through the recent entries. A block freed on one (its
/// stream still busy) must never be served to the other from the first's
/// cache, both ways; a made-up stream id of the same residue is refused.
#[test]
fn residue_twins_never_share_a_cache() {
    let dev = Arc::new(host());
    let pool = small_pool(&dev);
    let x = dev.create_stream().unwrap();
    let y = residue_twin(&dev, x);
    let mut allocs = 0u64;
    // x first: it takes the slot of its residue for the pool's life.
    for _ in 0..4 {
        let a = pool.alloc_async(8192, x).unwrap();
        pool.free_async(a, x).unwrap();
        allocs += 1;
    }
    for _ in 0..4 {
        let a = pool.alloc_async(8192, y).unwrap();
        pool.free_async(a, y).unwrap();
        allocs += 1;
    }
    // A stream id nobody issued, with the twins' residue: refused, on a
    // thread whose tables know both twins.
    let fake = Stream(x.id() + DIRECT_SLOTS * 1000);
    match pool.alloc_async(8192, fake) {
        Err(_) => {}
        Ok(a) => panic!("a made-up stream {fake} got a block at {:#x}", a.ptr()),
    }
    for (owner, other) in [(x, y), (y, x)] {
        let mut hold = Blocker::on(&*dev, owner);
        let a = pool.alloc_async(4096, owner).unwrap();
        allocs += 1;
        let mut rx = fill(&dev, owner, a.ptr(), a.size(), 0xA000 + owner.id() as u32);
        let (aptr, alen) = (a.ptr(), a.size());
        pool.free_async(a, owner).unwrap();
        // The free sits in `owner`'s cache, its stream still busy.
        let b = pool.alloc_async(4096, other).unwrap();
        allocs += 1;
        assert!(
            !overlaps(aptr, alen, b.ptr(), b.size()),
            "{other} got {:#x}, a block {owner} freed at {aptr:#x} while still busy (a shared cache)",
            b.ptr()
        );
        rx.extend(fill(
            &dev,
            other,
            b.ptr(),
            b.size(),
            0xB000 + other.id() as u32,
        ));
        rx.extend(verify(
            &dev,
            other,
            b.ptr(),
            b.size(),
            0xB000 + other.id() as u32,
        ));
        pool.free_async(b, other).unwrap();
        // `owner` gets its own free back from its cache.
        let hits = pool.stats().cache_hits;
        let c = pool.alloc_async(4096, owner).unwrap();
        allocs += 1;
        assert_eq!(
            c.ptr(),
            aptr,
            "{owner} did not get its own cached free back"
        );
        assert_eq!(pool.stats().cache_hits, hits + 1, "{owner}: a cache hit");
        pool.free_async(c, owner).unwrap();
        hold.release();
        all_true(rx, "residue twins");
    }
    drained(&pool, allocs, "residue twins");
}

/// Two pools on one device whose ids pick the same slot of a thread's
/// recent-entries table for every stream; a stream without a direct slot
/// in either pool (its residue taken by another stream) alternates between
/// them. Each pool must keep its own entry for it: a free into one pool's
/// cache is never served by the other, and cache hits are counted where
/// they happen.
#[test]
fn pools_sharing_recent_slots_keep_their_own_entries() {
    let dev = Arc::new(host());
    let first = small_pool(&dev);
    let mut second = None;
    for _ in 0..8 * RECENT_SLOTS {
        let p = small_pool(&dev);
        if p.id() % RECENT_SLOTS == first.id() % RECENT_SLOTS {
            second = Some(p);
            break;
        }
    }
    let second = second.expect("a pool id with the first's residue");
    let x = dev.create_stream().unwrap();
    let y = residue_twin(&dev, x);
    let pools = [&first, &second];
    let mut allocs = [0u64; 2];
    // x takes the direct slot of the residue in both pools.
    for (i, p) in pools.iter().enumerate() {
        let a = p.alloc_async(4096, x).unwrap();
        p.free_async(a, x).unwrap();
        allocs[i] += 1;
    }
    let mut rx = Vec::new();
    for round in 0..20u32 {
        let (me, them) = if round % 2 == 0 { (0, 1) } else { (1, 0) };
        let p = pools[me];
        // A free into my cache for y ...
        let a = p.alloc_async(6144, y).unwrap();
        allocs[me] += 1;
        let (aptr, asize) = (a.ptr(), a.size());
        assert!(
            p.contains(aptr),
            "round {round}: pool {me} handed out {aptr:#x}, not its own"
        );
        let tag = 0xC000 + round;
        rx.extend(fill(&dev, y, aptr, asize, tag));
        rx.extend(verify(&dev, y, aptr, asize, tag));
        p.free_async(a, y).unwrap();
        // ... is not the other pool's: its cache for y has no such block.
        let q = pools[them];
        let hits_q = q.stats().cache_hits;
        let b = q
            .alloc_async(6144 + 512 * (round as usize % 3 + 1), y)
            .unwrap();
        allocs[them] += 1;
        assert!(
            q.contains(b.ptr()),
            "round {round}: pool {them} handed out {:#x}, not its own",
            b.ptr()
        );
        assert_eq!(
            q.stats().cache_hits,
            hits_q,
            "round {round}: pool {them} counted a cache hit from a cache it never filled"
        );
        rx.extend(fill(&dev, y, b.ptr(), b.size(), tag + 0x100));
        rx.extend(verify(&dev, y, b.ptr(), b.size(), tag + 0x100));
        q.free_async(b, y).unwrap();
        // My free is still in my cache.
        let hits_p = p.stats().cache_hits;
        let c = p.alloc_async(6144, y).unwrap();
        allocs[me] += 1;
        assert_eq!(
            c.ptr(),
            aptr,
            "round {round}: pool {me} lost its cached free for {y}"
        );
        assert_eq!(
            p.stats().cache_hits,
            hits_p + 1,
            "round {round}: pool {me}'s hit"
        );
        p.free_async(c, y).unwrap();
    }
    all_true(rx, "pools sharing recent slots");
    drained(&first, allocs[0], "first pool");
    drained(&second, allocs[1], "second pool");
}

/// Frees through the wrong pool on streams warm in both pools are refused
/// with the allocation handed back, every time, and change nothing.
#[test]
fn a_free_through_the_wrong_pool_is_refused_on_warm_streams() {
    let dev = Arc::new(host());
    let a_pool = small_pool(&dev);
    let b_pool = small_pool(&dev);
    let s = dev.create_stream().unwrap();
    let t = dev.create_stream().unwrap();
    let mut allocs = 0;
    for p in [&a_pool, &b_pool] {
        for st in [s, t] {
            for _ in 0..3 {
                let x = p.alloc_async(2048, st).unwrap();
                p.free_async(x, st).unwrap();
            }
        }
    }
    let before_b = b_pool.stats();
    for i in 0..20 {
        let st = if i % 2 == 0 { s } else { t };
        let x = a_pool.alloc_async(2048, st).unwrap();
        allocs += 1;
        let ptr = x.ptr();
        let back = match b_pool.free_async(x, st) {
            Ok(()) => panic!("try {i}: pool B took a free of pool A's {ptr:#x}"),
            Err(e) => {
                assert!(
                    matches!(e.error, PoolError::WrongPool { ptr: p } if p == ptr),
                    "try {i}: {}",
                    e.error
                );
                e.allocation
            }
        };
        assert_eq!(back.ptr(), ptr);
        a_pool.free_async(back, st).unwrap();
    }
    let after_b = b_pool.stats();
    assert_eq!(
        after_b.frees, before_b.frees,
        "pool B counted frees it refused"
    );
    assert_eq!(after_b.allocs, before_b.allocs);
    drained(&a_pool, allocs + 6, "pool A");
    drained(&b_pool, 6, "pool B");
}

/// A thread holds a stream's entry in its tables (warm); the main thread
/// retires the stream while its last free is still pending behind a
/// blocked task. `synchronize` waits for that free: afterwards the task
/// has run and a trim gives back every page. The task is released only
/// once `synchronize` has begun a wait on the device (counted by a fault
/// injector that fails nothing), so a `synchronize` that returned without
/// waiting finds it still blocked, however fast or slow the machine.
#[test]
fn synchronize_waits_for_a_retired_streams_last_free() {
    let dev = Arc::new(FaultInjector::new(host()));
    let pool = Arc::new(
        MemPool::new(dev.clone(), PoolConfig::default().with_va_size(256 << 20)).expect("pool"),
    );
    let s = dev.create_stream().unwrap();
    let mut blocker = Blocker::on(&*dev, s);
    let flag = blocker.flag();
    let (to_main, from_worker) = channel::<()>();
    let (to_worker, from_main) = channel::<()>();
    let worker = {
        let pool = pool.clone();
        std::thread::spawn(move || {
            for _ in 0..50 {
                let a = pool.alloc_async(3000, s).unwrap();
                pool.free_async(a, s).unwrap();
            }
            // The last free, on a stream still busy.
            let a = pool.alloc_async(3000, s).unwrap();
            pool.free_async(a, s).unwrap();
            to_main.send(()).unwrap();
            from_main.recv().unwrap();
            match pool.alloc_async(3000, s) {
                Err(PoolError::StreamRetired { .. }) => {}
                Err(e) => panic!("another error than StreamRetired: {e}"),
                Ok(a) => panic!("a retired stream got a block at {:#x}", a.ptr()),
            }
        })
    };
    from_worker.recv().unwrap();
    pool.retire_stream(s).unwrap();
    to_worker.send(()).unwrap();
    worker.join().unwrap();
    // Release the task from elsewhere once synchronize waits on the device
    // (or has returned: then it is released only after the check below).
    const WAITS: [Op; 3] = [
        Op::SynchronizeEvent,
        Op::SynchronizeStream,
        Op::SynchronizeDevice,
    ];
    let waits = |d: &FaultInjector<HostDevice>| WAITS.iter().map(|&op| d.calls(op)).sum::<u64>();
    let before = waits(&dev);
    let returned = Arc::new(AtomicBool::new(false));
    let releaser = {
        let (dev, returned) = (dev.clone(), returned.clone());
        std::thread::spawn(move || {
            while waits(&dev) == before && !returned.load(Ordering::SeqCst) {
                std::thread::yield_now();
            }
            blocker.release();
            blocker
        })
    };
    pool.synchronize().unwrap();
    let task_ran = flag.load(Ordering::SeqCst);
    returned.store(true, Ordering::SeqCst);
    let _ = releaser.join().unwrap();
    assert!(
        task_ran,
        "synchronize returned before the retired stream's last free completed"
    );
    drained(&*pool, 51, "retired stream");
}

/// Threads hop over more streams than any per-thread table holds (300
/// streams: more than the direct table's slots, so residues collide) and
/// hand allocations to each other: the receiver checks the tag on the
/// allocating stream, then frees it there or on its own stream after an
/// event wait. No block is ever handed out twice (tags intact), and the
/// books balance exactly.
#[test]
fn threads_hopping_over_many_streams_hand_blocks_to_each_other() {
    const THREADS: usize = 3;
    const STREAMS: usize = 300;
    const OPS: usize = 600;
    let dev = Arc::new(host());
    let pool = Arc::new(small_pool(&dev));
    let streams = Arc::new(streams(&*dev, STREAMS));
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..THREADS)
        .map(|_| channel::<(Allocation, Stream, u32)>())
        .unzip();
    let txs = Arc::new(txs);
    let mut handles = Vec::new();
    for (me, inbox) in rxs.into_iter().enumerate() {
        let (pool, dev, streams, txs) = (pool.clone(), dev.clone(), streams.clone(), txs.clone());
        handles.push(std::thread::spawn(move || {
            let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (me as u64 + 1));
            let mut live: Vec<(Allocation, Stream, u32)> = Vec::new();
            let mut checks = Vec::new();
            let mut allocs = 0u64;
            let own = streams[me];
            for op in 0..OPS {
                // Take what others handed over: check, then free on the
                // allocating stream or on our own after an event wait.
                while let Ok((a, s, tag)) = inbox.try_recv() {
                    checks.extend(verify(&dev, s, a.ptr(), a.size(), tag));
                    if rng.next() % 2 == 0 {
                        pool.free_async(a, s).unwrap();
                    } else {
                        let ev = pool.record_event(s).unwrap();
                        pool.wait_event(own, &ev).unwrap();
                        checks.extend(verify(&dev, own, a.ptr(), a.size(), tag));
                        pool.free_async(a, own).unwrap();
                    }
                }
                let s = streams[rng.range(0, STREAMS as u64 - 1) as usize];
                if live.len() < 8 && rng.next() % 3 != 0 {
                    // Sizes around the small-cache limit and a few large.
                    let size = match rng.next() % 4 {
                        0 => rng.range(1, 4096),
                        1 => rng.range(60 << 10, 68 << 10),
                        2 => 512 * rng.range(1, 8),
                        _ => rng.range(100 << 10, 300 << 10),
                    } as usize;
                    let a = pool.alloc_async(size, s).unwrap();
                    allocs += 1;
                    let tag = ((me as u32) << 24) | op as u32;
                    checks.extend(fill(&dev, s, a.ptr(), a.size(), tag));
                    live.push((a, s, tag));
                } else if !live.is_empty() {
                    let (a, s, tag) =
                        live.swap_remove(rng.range(0, live.len() as u64 - 1) as usize);
                    if rng.next() % 4 == 0 {
                        let to = (me + 1 + rng.range(0, THREADS as u64 - 2) as usize) % THREADS;
                        txs[to].send((a, s, tag)).unwrap();
                    } else {
                        checks.extend(verify(&dev, s, a.ptr(), a.size(), tag));
                        pool.free_async(a, s).unwrap();
                    }
                }
            }
            for (a, s, tag) in live {
                checks.extend(verify(&dev, s, a.ptr(), a.size(), tag));
                pool.free_async(a, s).unwrap();
            }
            all_true(checks, &format!("thread {me}"));
            (allocs, inbox)
        }));
    }
    // Joined with no barrier, so that a thread's failure fails the test
    // rather than leaving the others waiting; what was handed to a thread
    // after its last look at its inbox is checked and freed here.
    let done: Vec<_> = handles
        .into_iter()
        .map(|h| h.join().expect("a thread failed"))
        .collect();
    let mut allocs = 0;
    let mut checks = Vec::new();
    for (n, inbox) in done {
        allocs += n;
        while let Ok((a, s, tag)) = inbox.try_recv() {
            checks.extend(verify(&dev, s, a.ptr(), a.size(), tag));
            pool.free_async(a, s).unwrap();
        }
    }
    all_true(checks, "handed over last");
    drained(&pool, allocs, "threads hopping");
}

/// One stream's private cache, with a model of what it may hold: blocks
/// freed on the stream, by length, not handed out since.
struct CacheRun {
    dev: Arc<HostDevice>,
    pool: MemPool<HostDevice>,
    s: Stream,
    freed: BTreeMap<usize, Vec<DevicePtr>>,
    live: BTreeMap<DevicePtr, (Allocation, u32)>,
    checks: Vec<Receiver<bool>>,
    allocs: u64,
    hits: u64,
    tag: u32,
}

impl CacheRun {
    /// Allocate `size` (block length `len`); `must_hit`: the cache surely
    /// holds a block of this length (no slow allocation since it was freed).
    fn alloc(&mut self, len: usize, size: usize, must_hit: bool, round: usize) {
        let before = self.pool.stats().cache_hits;
        let a = self.pool.alloc_async(size, self.s).unwrap();
        self.allocs += 1;
        let ptr = a.ptr();
        let hit = self.pool.stats().cache_hits - before;
        let list = self.freed.entry(len).or_default();
        let known = list.iter().position(|&p| p == ptr);
        if must_hit {
            assert_eq!(
                hit, 1,
                "round {round}: {len} bytes freed on the stream and not reused since, \
                 yet no cache hit (got {ptr:#x})"
            );
        }
        if hit == 1 {
            self.hits += 1;
            assert!(
                known.is_some(),
                "round {round}: a cache hit for {len} bytes served {ptr:#x}, \
                 not a block freed with that length"
            );
        }
        if let Some(i) = known {
            list.swap_remove(i);
        }
        if let Some((&p, (b, _))) = self.live.range(..=ptr).next_back() {
            assert!(
                !overlaps(p, b.size(), ptr, len),
                "round {round}: {ptr:#x}+{len} overlaps live {p:#x}+{}",
                b.size()
            );
        }
        if let Some((&p, _)) = self.live.range(ptr..).next() {
            assert!(
                p >= ptr + len as u64,
                "round {round}: {ptr:#x}+{len} overlaps live {p:#x}"
            );
        }
        // A block taken from the arena may cover freed blocks of any
        // length: those are gone.
        for (&fl, l) in self.freed.iter_mut() {
            l.retain(|&p| !overlaps(p, fl, ptr, len));
        }
        self.checks
            .extend(fill(&self.dev, self.s, ptr, size, self.tag));
        self.live.insert(ptr, (a, self.tag));
        self.tag += 1;
    }

    fn free(&mut self, k: DevicePtr) -> usize {
        let (a, t) = self.live.remove(&k).unwrap();
        self.checks
            .extend(verify(&self.dev, self.s, a.ptr(), a.size(), t));
        let len = a.size().next_multiple_of(512);
        for (&fl, l) in self.freed.iter_mut() {
            l.retain(|&p| !overlaps(p, fl, k, len));
        }
        self.freed.entry(len).or_default().push(k);
        self.pool.free_async(a, self.s).unwrap();
        len
    }
}

/// One stream's private cache through lengths on both sides of the small
/// cache's limit (64 KiB), more than 64 distinct large lengths (so that a
/// flush drops their lists), the last-length slot switching, and flushes
/// (by growth, by trim): a cache hit only ever serves a block freed on the
/// stream with exactly that length and not handed out since; reallocating
/// exactly the lengths just freed, in another order, hits every time; live
/// blocks never overlap; every tag survives until its free.
#[test]
fn the_size_cache_serves_only_exact_lengths_across_flushes() {
    const ROUNDS: usize = 30;
    let dev = Arc::new(host());
    let pool = MemPool::new(dev.clone(), PoolConfig::default().with_va_size(1 << 30)).unwrap();
    let s = dev.create_stream().unwrap();
    let mut lens: Vec<usize> = vec![512, 1024, 1536, 63 << 10, (64 << 10) - 512, 64 << 10];
    lens.extend((1..=72).map(|j| (64 << 10) + 512 * j));
    lens.extend((0..8).map(|j| (1 << 20) + 4096 * j));
    let mut rng = Rng(0xD1B5_4A32_D192_ED03);
    let mut run = CacheRun {
        dev: dev.clone(),
        pool,
        s,
        freed: BTreeMap::new(),
        live: BTreeMap::new(),
        checks: Vec::new(),
        allocs: 0,
        hits: 0,
        tag: 1,
    };
    for round in 0..ROUNDS {
        let picks = rng.range(4, 40);
        for _ in 0..picks {
            let len = lens[rng.range(0, lens.len() as u64 - 1) as usize];
            // Sometimes one length many times in a row (the last slot),
            // sometimes alternating around 64 KiB.
            let reps = if rng.next() % 4 == 0 { 6 } else { 1 };
            for r in 0..reps {
                let len = if reps > 1 && r % 2 == 1 && len <= 64 << 10 {
                    (len + 512).min(64 << 10)
                } else {
                    len
                };
                let size = len - rng.range(0, 511) as usize;
                run.alloc(len, size, false, round);
            }
        }
        // Free a random part, in random order; then, every other round,
        // take exactly those lengths back in another order: all hits.
        let mut keys: Vec<DevicePtr> = run.live.keys().copied().collect();
        let frees = keys.len() * rng.range(40, 100) as usize / 100;
        let mut lens_freed = Vec::new();
        for _ in 0..frees {
            let k = keys.swap_remove(rng.range(0, keys.len() as u64 - 1) as usize);
            lens_freed.push(run.free(k));
        }
        if round % 2 == 0 {
            while !lens_freed.is_empty() {
                let len =
                    lens_freed.swap_remove(rng.range(0, lens_freed.len() as u64 - 1) as usize);
                let size = len - rng.range(0, 511) as usize;
                run.alloc(len, size, true, round);
            }
        }
        if round % 6 == 5 {
            // A flush of every cache into the arena, then lengths met again.
            run.pool.synchronize().unwrap();
            run.pool.trim_to(0).unwrap();
        }
    }
    assert!(
        run.hits > 200,
        "the workload should hit the cache often (hits {} of {})",
        run.hits,
        run.allocs
    );
    for k in run.live.keys().copied().collect::<Vec<_>>() {
        run.free(k);
    }
    all_true(std::mem::take(&mut run.checks), "size cache");
    let st = run.pool.stats();
    assert_eq!(st.cache_hits, run.hits, "cache hits counted");
    drained(&run.pool, run.allocs, "size cache");
}

/// Sizes the hot path must leave alone on a warm stream whose cache holds
/// blocks of every small length, 64 KiB included (the slot an unchecked
/// length 0 would index): size 0 is a null allocation that takes nothing
/// from the cache, sizes past the address range are refused, and the
/// cache is intact afterwards.
#[test]
fn size_zero_and_too_large_leave_a_warm_cache_alone() {
    let dev = Arc::new(host());
    let pool = small_pool(&dev);
    let s = dev.create_stream().unwrap();
    let va = 256usize << 20;
    let lens: Vec<usize> = vec![512, 4096, (64 << 10) - 512, 64 << 10, (64 << 10) + 512];
    let mut allocs = 0;
    // Two blocks of each length in the cache (the second length cached
    // leaves the last-length slot to the first).
    let mut held = Vec::new();
    for &len in &lens {
        for _ in 0..2 {
            held.push(pool.alloc_async(len, s).unwrap());
            allocs += 1;
        }
    }
    let cached: Vec<(usize, DevicePtr)> = held.iter().map(|a| (a.size(), a.ptr())).collect();
    for a in held {
        pool.free_async(a, s).unwrap();
    }
    let before = pool.stats();
    for i in 0..10 {
        let z = pool.alloc_async(0, s).unwrap();
        assert_eq!(z.ptr(), 0, "try {i}: size 0 got memory");
        assert_eq!(z.size(), 0);
        pool.free_async(z, s).unwrap();
        for size in [va + 1, usize::MAX, usize::MAX - 510] {
            match pool.alloc_async(size, s) {
                Err(PoolError::TooLarge { .. }) => {}
                Err(e) => panic!("try {i}: {size} bytes: another error than TooLarge: {e}"),
                Ok(a) => panic!("try {i}: {size} bytes served at {:#x}", a.ptr()),
            }
        }
    }
    let after = pool.stats();
    assert_eq!(
        after.cache_hits, before.cache_hits,
        "size 0 or too large hit the cache"
    );
    assert_eq!(after.used_current, 0);
    // Null allocations count as allocations and their frees as frees.
    assert_eq!(after.allocs, before.allocs + 10, "allocations counted");
    assert_eq!(after.frees, before.frees + 10, "frees counted");
    allocs += 10;
    // Every cached block is still there, served to its own length.
    let mut back = Vec::new();
    for &len in &lens {
        for _ in 0..2 {
            let a = pool.alloc_async(len, s).unwrap();
            allocs += 1;
            assert!(
                cached.contains(&(len, a.ptr())),
                "{len} bytes: {:#x} is not one of the blocks cached for it",
                a.ptr()
            );
            back.push(a);
        }
    }
    assert_eq!(
        pool.stats().cache_hits,
        before.cache_hits + 2 * lens.len() as u64,
        "every cached block served from the cache"
    );
    for a in back {
        pool.free_async(a, s).unwrap();
    }
    drained(&pool, allocs, "size zero");
}

/// Threads allocate and free on shared streams while the main thread
/// retires half of them, one by one: every call on a retired stream is
/// refused (a free hands the allocation back, which is then freed on a
/// stream that is never retired after a wait for the retired one), no block
/// is handed out twice, and the books balance once the pool is synchronised.
#[test]
fn streams_retired_while_threads_use_them() {
    const THREADS: usize = 3;
    const SHARED: usize = 24;
    const OPS: usize = 500;
    let dev = Arc::new(host());
    let pool = Arc::new(small_pool(&dev));
    let shared = streams(&*dev, SHARED);
    let own = streams(&*dev, THREADS);
    let mut handles = Vec::new();
    for (me, &mine) in own.iter().enumerate() {
        let (pool, dev, shared) = (pool.clone(), dev.clone(), shared.clone());
        handles.push(std::thread::spawn(move || {
            let mut rng = Rng(0x1234_5678_9ABC_DEF1 ^ ((me as u64 + 1) << 32));
            let mut live: Vec<(Allocation, Stream, u32)> = Vec::new();
            let mut checks = Vec::new();
            let (mut allocs, mut refused) = (0u64, 0u64);
            let free_one = |a: Allocation,
                            s: Stream,
                            tag: u32,
                            checks: &mut Vec<Receiver<bool>>,
                            refused: &mut u64| {
                checks.extend(verify(&dev, s, a.ptr(), a.size(), tag));
                match pool.free_async(a, s) {
                    Ok(()) => {}
                    Err(e) => {
                        assert!(
                            matches!(e.error, PoolError::StreamRetired { .. }),
                            "free on {s}: {}",
                            e.error
                        );
                        *refused += 1;
                        // The driver stream still runs: wait for it, then
                        // free on a stream that is never retired.
                        dev.synchronize_stream(s).unwrap();
                        pool.free_async(e.allocation, mine).unwrap();
                    }
                }
            };
            for op in 0..OPS {
                let s = shared[rng.range(0, SHARED as u64 - 1) as usize];
                if live.len() < 6 && rng.next() % 2 == 0 {
                    let size = match rng.next() % 3 {
                        0 => rng.range(1, 2048),
                        1 => rng.range(60 << 10, 70 << 10),
                        _ => 4096,
                    } as usize;
                    match pool.alloc_async(size, s) {
                        Ok(a) => {
                            allocs += 1;
                            let tag = ((me as u32 + 1) << 24) | op as u32;
                            checks.extend(fill(&dev, s, a.ptr(), a.size(), tag));
                            live.push((a, s, tag));
                        }
                        Err(PoolError::StreamRetired { .. }) => refused += 1,
                        Err(e) => panic!("thread {me}, op {op}: alloc on {s}: {e}"),
                    }
                } else if !live.is_empty() {
                    let (a, s, tag) =
                        live.swap_remove(rng.range(0, live.len() as u64 - 1) as usize);
                    free_one(a, s, tag, &mut checks, &mut refused);
                }
            }
            for (a, s, tag) in std::mem::take(&mut live) {
                free_one(a, s, tag, &mut checks, &mut refused);
            }
            all_true(checks, &format!("thread {me}"));
            (allocs, refused)
        }));
    }
    // Retire every other shared stream while the threads run.
    for (i, &s) in shared.iter().enumerate() {
        if i % 2 == 0 {
            pool.retire_stream(s).unwrap();
            std::thread::yield_now();
        }
    }
    let mut allocs = 0;
    for h in handles {
        let (n, _refused) = h.join().expect("a thread failed");
        allocs += n;
    }
    // Every call on a retired stream is refused from now on.
    for (i, &s) in shared.iter().enumerate() {
        let r = pool.alloc_async(4096, s);
        match (i % 2 == 0, r) {
            (true, Err(PoolError::StreamRetired { .. })) => {}
            (true, Err(e)) => panic!("retired {s}: another error than StreamRetired: {e}"),
            (true, Ok(a)) => panic!("retired {s} got a block at {:#x}", a.ptr()),
            (false, Ok(a)) => {
                allocs += 1;
                pool.free_async(a, s).unwrap();
            }
            (false, Err(e)) => panic!("live {s}: {e}"),
        }
    }
    drained(&pool, allocs, "streams retired while used");
}

/// The smallest form of a race the test above meets: one thread
/// allocates (slow path: nothing is ever freed on the stream) while the
/// main thread retires the stream. Each allocation either is refused or
/// is counted: after everything is freed and the pool synchronised,
/// `allocs` and `frees` both equal the allocations that succeeded.
#[test]
fn an_allocation_racing_retire_stream_is_refused_or_counted() {
    const TRIALS: usize = 200;
    let dev = Arc::new(host());
    let pool = Arc::new(small_pool(&dev));
    let other = dev.create_stream().unwrap();
    let mut total = 0u64;
    for trial in 0..TRIALS {
        let s = dev.create_stream().unwrap();
        let start = Arc::new(std::sync::Barrier::new(2));
        let worker = {
            let (pool, start) = (pool.clone(), start.clone());
            std::thread::spawn(move || {
                let mut got = Vec::new();
                start.wait();
                for _ in 0..64 {
                    match pool.alloc_async(4096, s) {
                        Ok(a) => got.push(a),
                        Err(PoolError::StreamRetired { .. }) => break,
                        Err(e) => panic!("alloc: {e}"),
                    }
                }
                got
            })
        };
        start.wait();
        pool.retire_stream(s).unwrap();
        let got = worker.join().expect("worker");
        total += got.len() as u64;
        dev.synchronize_stream(s).unwrap();
        for a in got {
            pool.free_async(a, other).unwrap();
        }
        pool.synchronize().unwrap();
        let st = pool.stats();
        assert_eq!(
            (st.allocs, st.frees),
            (total, total),
            "trial {trial}: (allocs, frees) counted vs made"
        );
        dev.destroy_stream(s).unwrap();
    }
    drained(&pool, total, "allocations racing retire");
}

/// One stream used by two pools on one thread (its entries in both pools'
/// tables, direct or recent): retiring it in one pool refuses it there
/// only; the other pool keeps serving it from its cache.
#[test]
fn a_stream_retired_in_one_pool_still_serves_another() {
    let dev = Arc::new(host());
    let (a_pool, b_pool) = (small_pool(&dev), small_pool(&dev));
    // Streams of both kinds: with a direct slot, and a residue twin
    // found through the recent entries.
    let x = dev.create_stream().unwrap();
    let y = residue_twin(&dev, x);
    let spare = dev.create_stream().unwrap();
    let mut allocs = [0u64; 2];
    for s in [x, y] {
        for (i, p) in [&a_pool, &b_pool].into_iter().enumerate() {
            for _ in 0..3 {
                let a = p.alloc_async(2048, s).unwrap();
                p.free_async(a, s).unwrap();
                allocs[i] += 1;
            }
        }
    }
    for s in [x, y] {
        let kept = a_pool.alloc_async(2048, s).unwrap();
        allocs[0] += 1;
        a_pool.retire_stream(s).unwrap();
        match a_pool.alloc_async(2048, s) {
            Err(PoolError::StreamRetired { .. }) => {}
            Err(e) => panic!("{s}: another error than StreamRetired: {e}"),
            Ok(a) => panic!("{s} retired in pool A got {:#x} from it", a.ptr()),
        }
        let back = match a_pool.free_async(kept, s) {
            Ok(()) => panic!("{s}: pool A took a free on a stream it retired"),
            Err(e) => e.allocation,
        };
        dev.synchronize_stream(s).unwrap();
        a_pool.free_async(back, spare).unwrap();
        for i in 0..5 {
            let hits = b_pool.stats().cache_hits;
            let b = b_pool.alloc_async(2048, s).unwrap_or_else(|e| {
                panic!("{s}, try {i}: pool B refused a stream it never retired: {e}")
            });
            allocs[1] += 1;
            assert_eq!(
                b_pool.stats().cache_hits,
                hits + 1,
                "{s}, try {i}: pool B's cache hit"
            );
            b_pool.free_async(b, s).unwrap();
        }
    }
    drained(&a_pool, allocs[0], "pool A");
    drained(&b_pool, allocs[1], "pool B");
}
