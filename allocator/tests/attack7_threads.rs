//! Stream-order safety with threads: each thread allocates on its own
//! stream, writes a tag with a kernel of that stream, checks it with
//! another kernel before freeing, and hands some blocks to the next
//! thread (an event recorded through the pool, waited on by the
//! receiver's stream, which checks the tag and frees there). Streams are
//! retired and replaced as the threads go, one thread trims now and then,
//! some blocks are freed on a stream held busy. A block handed out while a
//! kernel of an earlier owner can still write it, or unmapped under a
//! queued kernel, shows as a wrong tag or a failed kernel. Work is bounded
//! by operation counts; the footprint is bounded too.

mod common;

use common::{host_with_capacity, tag_kernel, Blocker, Rng};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use tidepool::{Allocation, MemPool, PoolConfig, PoolEvent};
use tidepool_sys::{Device, HostDevice, Stream};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const THREADS: usize = 4;
const OPS: usize = 250;

const SIZES: [usize; 8] = [
    1024,
    8 * KIB,
    200 * KIB,
    256 * KIB + 512,
    600 * KIB,
    MIB + 4,
    2 * MIB + 512,
    5 * MIB + 4,
];

/// Words each kernel writes or checks at the start of a block.
fn words(size: usize) -> usize {
    (size / 4).min(256)
}

/// A kernel on `stream` that checks the tag; its verdict comes back.
fn check_kernel(
    dev: &HostDevice,
    stream: Stream,
    x: &Allocation,
    tag: u32,
) -> Receiver<Result<bool, String>> {
    let (tx, rx) = channel();
    dev.launch_on_words(stream, x.ptr(), words(x.size()) * 4, move |r| {
        let verdict = r
            .map(|w| w.iter().all(|v| v.load(Ordering::Relaxed) == tag))
            .map_err(|e| e.to_string());
        let _ = tx.send(verdict);
    })
    .expect("launch check");
    rx
}

type Handoff = (Allocation, PoolEvent, u32);

struct Verdicts {
    writes: Vec<Receiver<bool>>,
    checks: Vec<(String, Receiver<Result<bool, String>>)>,
    /// How many of `checks` (the oldest) were already received.
    seen: usize,
}

impl Verdicts {
    /// Receive the oldest verdicts until at most `most` are outstanding:
    /// the work queued on the streams (and so what the pool cannot reuse
    /// yet) stays bounded however the threads are scheduled.
    fn settle(&mut self, most: usize) {
        while self.checks.len() - self.seen > most {
            let (what, c) = &self.checks[self.seen];
            assert_eq!(
                c.recv().unwrap(),
                Ok(true),
                "{what}: the tag was overwritten"
            );
            self.seen += 1;
        }
    }
}

fn worker(
    t: usize,
    dev: Arc<HostDevice>,
    pool: Arc<MemPool<HostDevice>>,
    to_next: SyncSender<Handoff>,
    from_prev: Receiver<Handoff>,
) -> Verdicts {
    let mut rng = Rng(0x7a7a_7000 + t as u64);
    let mut s = dev.create_stream().unwrap();
    let mut mine: Vec<(Allocation, u32)> = Vec::new();
    let mut v = Verdicts {
        writes: Vec::new(),
        checks: Vec::new(),
        seen: 0,
    };
    let free_checked = |pool: &MemPool<HostDevice>,
                        v: &mut Verdicts,
                        s: Stream,
                        x: Allocation,
                        tag: u32,
                        what: &str| {
        v.checks.push((
            format!("thread {t}: {what}"),
            check_kernel(&dev, s, &x, tag),
        ));
        pool.free_async(x, s).unwrap();
    };
    for op in 0..OPS {
        let size = SIZES[rng.range(0, SIZES.len() as u64 - 1) as usize];
        let x = pool.alloc_async(size, s).unwrap();
        let tag = ((t as u32) << 24) | op as u32;
        v.writes
            .push(tag_kernel(&dev, s, x.ptr(), words(size), tag));
        mine.push((x, tag));
        match rng.range(0, 9) {
            0..=2 => {
                // Hand the oldest to the next thread (or free it here
                // when 8 wait there already).
                let (x, tag) = mine.remove(0);
                let ev = pool.record_event(s).unwrap();
                match to_next.try_send((x, ev, tag)) {
                    Ok(()) => {}
                    Err(TrySendError::Full((x, _, tag))) => {
                        free_checked(&pool, &mut v, s, x, tag, "not handed");
                    }
                    Err(TrySendError::Disconnected(_)) => unreachable!("the receiver lives"),
                }
            }
            3 => {
                // Free one while the stream is held busy for a while.
                let mut busy = Blocker::on(&*dev, s);
                let (x, tag) = mine.swap_remove(0);
                free_checked(&pool, &mut v, s, x, tag, "freed while busy");
                if rng.range(0, 1) == 0 {
                    drop(pool.record_event(s).unwrap());
                }
                // Another allocation meanwhile (its kernel runs after).
                let y = pool.alloc_async(size, s).unwrap();
                let tag2 = tag ^ 0x0080_0000;
                v.writes
                    .push(tag_kernel(&dev, s, y.ptr(), words(size), tag2));
                mine.push((y, tag2));
                busy.release();
            }
            _ => {}
        }
        if mine.len() > 4 {
            let i = rng.range(0, mine.len() as u64 - 1) as usize;
            let (x, tag) = mine.swap_remove(i);
            free_checked(&pool, &mut v, s, x, tag, "own");
        }
        while let Ok((x, ev, tag)) = from_prev.try_recv() {
            pool.wait_event(s, &ev).unwrap();
            free_checked(&pool, &mut v, s, x, tag, "handed over");
        }
        if op % 60 == 59 {
            // A new stream: the old one's blocks are freed there first.
            for (x, tag) in mine.drain(..) {
                free_checked(&pool, &mut v, s, x, tag, "before retire");
            }
            let old = s;
            s = dev.create_stream().unwrap();
            pool.retire_stream(old).unwrap();
        }
        v.settle(16);
        if t == 0 && op % 25 == 24 {
            pool.trim_to(0).unwrap();
        }
    }
    for (x, tag) in mine.drain(..) {
        free_checked(&pool, &mut v, s, x, tag, "last");
    }
    drop(to_next);
    // What the previous thread still sends, until it is done.
    for (x, ev, tag) in from_prev.iter() {
        pool.wait_event(s, &ev).unwrap();
        free_checked(&pool, &mut v, s, x, tag, "handed over late");
    }
    pool.synchronize_stream(s).unwrap();
    v
}

#[test]
fn threads_handing_blocks_around_never_see_a_foreign_write() {
    let dev = Arc::new(host_with_capacity(1 << 30));
    let pool =
        Arc::new(MemPool::new(dev.clone(), PoolConfig::default().with_va_size(4 << 30)).unwrap());
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..THREADS).map(|_| sync_channel::<Handoff>(8)).unzip();
    let mut rxs: Vec<Option<Receiver<Handoff>>> = rxs.into_iter().map(Some).collect();
    let mut handles = Vec::new();
    for t in 0..THREADS {
        let (dev, pool) = (dev.clone(), pool.clone());
        let to_next = txs[(t + 1) % THREADS].clone();
        let from_prev = rxs[t].take().unwrap();
        handles.push(std::thread::spawn(move || {
            worker(t, dev, pool, to_next, from_prev)
        }));
    }
    drop(txs);
    let mut checked = 0;
    for h in handles {
        let mut v = h.join().unwrap();
        v.settle(0);
        checked += v.checks.len();
        for w in v.writes {
            assert!(w.recv().unwrap(), "a tag kernel found its block unmapped");
        }
    }
    // Every allocation was checked once, before its free.
    assert_eq!(checked as u64, pool.stats().allocs);
    pool.synchronize().unwrap();
    let st = pool.stats();
    // At most 14 blocks a thread live or in flight (5 of its own, 8
    // handed over, one being made), each at most 5 MiB and two pages
    // more: 504 MiB; with no reuse of frees 1094 blocks would need
    // about 1.4 GiB.
    assert!(
        st.reserved_high <= 512 * MIB as u64,
        "footprint grew to {st}"
    );
    pool.trim_to(0).unwrap();
    let st = pool.stats();
    assert_eq!((st.used_current, st.reserved_current), (0, 0), "{st}");
}

/// Allocations racing the retirement of their stream: each either fails
/// with the stream retired or is counted, so that once everything is
/// freed (on a live stream) and trimmed the pool holds nothing, counts
/// nothing in use and as many frees as allocations.
#[test]
fn allocations_racing_a_retire_are_all_counted() {
    let dev = Arc::new(host_with_capacity(1 << 30));
    let pool =
        Arc::new(MemPool::new(dev.clone(), PoolConfig::default().with_va_size(4 << 30)).unwrap());
    let keeper = dev.create_stream().unwrap();
    for round in 0..40 {
        let s = dev.create_stream().unwrap();
        // Frees of the stream, cached, so that the retire has work.
        for &size in &SIZES[..4] {
            let x = pool.alloc_async(size, s).unwrap();
            pool.free_async(x, s).unwrap();
        }
        let made = Arc::new(AtomicUsize::new(0));
        let allocator = {
            let (pool, made) = (pool.clone(), made.clone());
            std::thread::spawn(move || {
                let mut got = Vec::new();
                for i in 0..400 {
                    match pool.alloc_async(SIZES[i % 4], s) {
                        Ok(x) => got.push(x),
                        Err(tidepool::PoolError::StreamRetired { .. }) => break,
                        Err(e) => panic!("allocation {i}: {e}"),
                    }
                    made.store(i + 1, Ordering::Release);
                }
                got
            })
        };
        // Retire once the thread made a number of allocations that
        // depends on the round; it goes on allocating meanwhile.
        // (A thread that panicked ends the wait too.)
        while made.load(Ordering::Acquire) < 1 + round * 5 && !allocator.is_finished() {
            std::thread::yield_now();
        }
        pool.retire_stream(s).unwrap();
        let got = allocator.join().unwrap();
        dev.synchronize_stream(s).unwrap();
        for x in got {
            pool.free_async(x, keeper).unwrap();
        }
        pool.synchronize().unwrap();
        let st = pool.stats();
        assert_eq!(st.used_current, 0, "round {round}: {st}");
        assert_eq!(st.allocs, st.frees, "round {round}: {st}");
    }
    pool.trim_to(0).unwrap();
    let st = pool.stats();
    assert_eq!((st.used_current, st.reserved_current), (0, 0), "{st}");
}
