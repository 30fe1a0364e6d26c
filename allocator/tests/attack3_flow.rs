//! Stream order across producers and consumers, seen from outside: a
//! block allocated on a producer, used and freed on a consumer (a stream
//! that never allocates), must not be handed to any stream that is not
//! ordered after the consumer's free until that free has completed.
//!
//! Consumers are held busy by host tasks at chosen points, so their frees
//! stay pending for as long as the test wants. With internal dependencies
//! and the last-resort host wait off, the pool has no way to order a
//! producer after a held consumer, so a producer's block that overlaps a
//! held consumer's pending block is a violation by itself; with every
//! reuse switch on, the host tag kernels (fill on the producer, verify on
//! the consumer before its free) catch any block handed out too early.
//! Every test ends with `used_current` 0, no tag mismatch, no access fault,
//! and `trim_to(0)` leaving nothing reserved.

mod common;

use common::*;
use std::collections::HashMap;
use std::sync::Arc;
use tidepool::{Allocation, MemPool, PoolConfig, PoolError, ReusePolicy};
use tidepool_kernels::kernels_for_host;
use tidepool_kernels::stress::XorShift64;
use tidepool_sys::{Device, HostDevice, Stream};

/// Reuse with no way to order a stream after a held one: no internal
/// dependency, no host wait.
fn no_waits() -> ReusePolicy {
    ReusePolicy {
        internal_dependencies: false,
        wait_for_pending_frees: false,
        ..ReusePolicy::default()
    }
}

fn overlaps(a: (u64, usize), b: (u64, usize)) -> bool {
    a.0 < b.0 + b.1 as u64 && b.0 < a.0 + a.1 as u64
}

struct Bench {
    dev: Arc<HostDevice>,
    pool: MemPool<HostDevice>,
    k: Arc<dyn tidepool_kernels::TagKernels>,
}

impl Bench {
    fn new(cfg: PoolConfig) -> Bench {
        let dev = Arc::new(host());
        let pool = MemPool::new(dev.clone(), cfg).expect("pool");
        let k = kernels_for_host(dev.clone());
        Bench { dev, pool, k }
    }

    /// Allocate on `p`, fill the first and last 256 bytes with `tag`.
    fn produce(&self, p: Stream, size: usize, tag: u32) -> Result<Allocation, PoolError> {
        let a = self.pool.alloc_async(size, p)?;
        for (at, n) in ends(&a) {
            self.k.fill_tag(p, at, n, tag).unwrap();
        }
        Ok(a)
    }

    /// Order `c` after `p` through the pool, verify on `c`, free on `c`.
    fn consume(&self, a: Allocation, p: Stream, c: Stream, tag: u32) {
        let ev = self.pool.record_event(p).unwrap();
        self.pool.wait_event(c, &ev).unwrap();
        for (at, n) in ends(&a) {
            self.k.verify_tag(c, at, n, tag).unwrap();
        }
        self.pool.free_async(a, c).unwrap();
    }

    fn finish(self) {
        self.pool.synchronize().unwrap();
        assert_eq!(
            self.k.access_faults().unwrap(),
            0,
            "a kernel met unmapped memory"
        );
        assert_eq!(
            self.k.mismatches().unwrap(),
            0,
            "a block was handed out too early"
        );
        let st = self.pool.stats();
        assert_eq!(st.used_current, 0, "used after freeing everything");
        assert_eq!(st.allocs, st.frees, "allocations and frees");
        self.pool.trim_to(0).unwrap();
        assert_eq!(self.pool.stats().reserved_current, 0);
        assert_eq!(self.dev.live_handles(), 0);
    }
}

fn ends(a: &Allocation) -> Vec<(u64, usize)> {
    let n = a.size().min(256) / 4 * 4;
    let mut v = vec![(a.ptr(), n)];
    let last = (a.ptr() + a.size() as u64 - n as u64) / 4 * 4;
    if last > a.ptr() + n as u64 {
        v.push((last, n));
    }
    v
}

/// Many producers and consumers; consumers are held at random points.
/// `strict`: no waits, so overlap with a held consumer's pending block is
/// checked directly.
fn producer_consumer(producers: usize, consumers: usize, ops: usize, strict: bool, seed: u64) {
    let reuse = if strict {
        no_waits()
    } else {
        ReusePolicy::default()
    };
    let b = Bench::new(
        PoolConfig::default()
            .with_va_size(4 << 30)
            .with_reuse(reuse)
            .with_last_resort_wait(std::time::Duration::from_millis(1)),
    );
    let ps = streams(&*b.dev, producers);
    let cs = streams(&*b.dev, consumers);
    let mut rng = XorShift64::new(seed);
    // Held consumers, and the blocks freed on each while it is held.
    let mut held: HashMap<usize, (Blocker, Vec<(u64, usize)>)> = HashMap::new();
    let mut tag = 7u32;
    let sizes = [512usize, 4096, 60_000, 300_000, 1 << 20, 3 << 20];
    for op in 0..ops {
        if rng.percent(6) {
            let c = rng.index(consumers);
            if let Some((mut bl, _)) = held.remove(&c) {
                bl.release();
            } else if held.len() < consumers / 2 {
                held.insert(c, (Blocker::on(&*b.dev, cs[c]), Vec::new()));
            }
            continue;
        }
        if strict && rng.percent(3) {
            // Trims and producer synchronisations while consumers' frees
            // are watched and pending (a producer never waits on a
            // consumer here, so this never waits on a held stream).
            if rng.percent(50) {
                b.pool.trim_to(0).unwrap();
            } else {
                b.pool.synchronize_stream(ps[rng.index(producers)]).unwrap();
            }
            continue;
        }
        let pi = rng.index(producers);
        let p = ps[pi];
        let size = sizes[rng.index(sizes.len())];
        tag = tag.wrapping_add(0x1357);
        let a = match b.produce(p, size, tag) {
            Ok(a) => a,
            Err(e) => panic!("op {op}: {e}"),
        };
        if strict {
            for (c, (_, pend)) in &held {
                for &blk in pend {
                    assert!(
                        !overlaps((a.ptr(), a.size()), blk),
                        "op {op}: producer {pi} got [{:#x}+{}], overlapping a block freed on \
                         consumer {c} whose free is still pending (the consumer is held)",
                        a.ptr(),
                        a.size()
                    );
                }
            }
        }
        let c = rng.index(consumers);
        if let Some((_, pend)) = held.get_mut(&c) {
            pend.push((a.ptr(), a.size()));
        }
        b.consume(a, p, cs[c], tag);
    }
    for (_, (mut bl, _)) in held.drain() {
        bl.release();
    }
    b.finish();
}

#[test]
fn producer_consumer_strict_4_producers_16_consumers() {
    producer_consumer(4, 16, 3000, true, 1);
}

#[test]
fn producer_consumer_all_reuse_on_2_producers_8_consumers() {
    producer_consumer(2, 8, 3000, false, 2);
}

#[test]
fn producer_consumer_strict_one_producer_hundreds_of_consumers() {
    producer_consumer(1, 300, 3000, true, 3);
}

/// A consumer frees a block while held, then is retired (and destroyed,
/// or destroyed without being retired) while its free is still pending:
/// the producer must not get the block until the consumer's work has run,
/// and the block must come back to use once it has.
fn gone_consumer(retire: bool, destroy: bool) {
    let b = Bench::new(
        PoolConfig::default()
            .with_va_size(4 << 30)
            .with_reuse(no_waits()),
    );
    let p = b.dev.create_stream().unwrap();
    let c = b.dev.create_stream().unwrap();
    let size = 1 << 20;
    let mut bl = Blocker::on(&*b.dev, c);
    let a = b.produce(p, size, 11).unwrap();
    let pending = (a.ptr(), a.size());
    b.consume(a, p, c, 11);
    if retire {
        b.pool.retire_stream(c).unwrap();
        // A retired stream refuses work, whatever path it takes.
        for _ in 0..3 {
            match b.pool.alloc_async(512, c) {
                Err(PoolError::StreamRetired { .. }) => {}
                Err(e) => panic!("retired stream: another error: {e}"),
                Ok(_) => panic!("a retired stream got an allocation"),
            }
        }
    }
    if destroy {
        b.dev.destroy_stream(c).unwrap();
    }
    // Trims and synchronisations of the producer meanwhile must leave the
    // pending block mapped (the held verify runs after them).
    b.pool.trim_to(0).unwrap();
    b.pool.synchronize_stream(p).unwrap();
    let mut got = Vec::new();
    for i in 0..40 {
        let x = b.produce(p, size, 100 + i).unwrap();
        assert!(
            !overlaps((x.ptr(), x.size()), pending),
            "allocation {i} on the producer overlaps the gone consumer's pending block"
        );
        got.push((x, 100 + i));
        if i % 8 == 7 {
            b.pool.trim_to(0).unwrap();
        }
    }
    bl.release();
    for (x, t) in got {
        for (at, n) in ends(&x) {
            b.k.verify_tag(p, at, n, t).unwrap();
        }
        b.pool.free_async(x, p).unwrap();
    }
    b.finish();
}

#[test]
fn a_retired_and_destroyed_consumer_keeps_its_pending_block() {
    gone_consumer(true, true);
}

#[test]
fn a_destroyed_consumer_that_was_never_retired_keeps_its_pending_block() {
    gone_consumer(false, true);
}

#[test]
fn a_retired_consumer_keeps_its_pending_block() {
    gone_consumer(true, false);
}

/// Hundreds of producers, each allocating a few times, and a hundred
/// consumers: the pool's passes over watched streams meet many streams
/// with little traffic each.
#[test]
fn hundreds_of_producers_with_few_allocations_each() {
    producer_consumer(300, 100, 1500, true, 4);
}

/// Producers and consumers on threads of their own: each producer thread
/// allocates on its stream, fills the block's ends with a tag, records an
/// event and hands block, event and tag to a consumer thread, which makes
/// its stream wait, verifies and frees there (consumer streams never
/// allocate). Each consumer holds its stream busy over some stretches of
/// blocks, so its frees stay pending while the producers' slow paths poll
/// the watched consumers. Every reuse switch is on; a block handed out
/// before its consumer's verify ran shows up as a mismatch.
#[test]
fn threaded_producers_and_consumers_with_held_consumers() {
    threaded(false);
}

/// The same, and every 50 blocks each consumer retires its stream (and
/// destroys every other one, with its frees still pending behind a held
/// task or not), and goes on with a fresh stream, while the producers'
/// slow paths poll the watched consumers.
#[test]
fn threaded_consumers_retiring_their_streams_under_traffic() {
    threaded(true);
}

fn threaded(churn: bool) {
    use std::sync::mpsc::{sync_channel, SyncSender};
    let b = Arc::new(Bench::new(PoolConfig::default().with_va_size(4 << 30)));
    let producers = 3;
    let consumers = 4;
    let per_producer = 1200u32;
    let ps = streams(&*b.dev, producers);
    let cs = streams(&*b.dev, consumers);
    type Item = (Allocation, tidepool::PoolEvent, u32);
    let mut txs: Vec<SyncSender<Item>> = Vec::new();
    let mut handles = Vec::new();
    for (ci, &c) in cs.iter().enumerate() {
        let (tx, rx) = sync_channel::<Item>(4);
        txs.push(tx);
        let b = b.clone();
        handles.push(std::thread::spawn(move || {
            let mut c = c;
            let mut n = 0u64;
            let mut hold: Option<Blocker> = None;
            while let Ok((a, ev, tag)) = rx.recv() {
                if churn && n % 50 == 49 {
                    let old = c;
                    b.pool.retire_stream(old).unwrap();
                    if n % 100 == 99 {
                        // Destroyed with its held task (if any) still queued.
                        b.dev.destroy_stream(old).unwrap();
                    }
                    c = b.dev.create_stream().unwrap();
                    // A task held on the old stream stays held until its
                    // stretch ends; the new stream starts free.
                }
                // Hold for 6 blocks out of every 16 (counts, not time).
                match n % 16 {
                    3 => hold = Some(Blocker::on(&*b.dev, c)),
                    9 => drop(hold.take()),
                    _ => {}
                }
                b.pool.wait_event(c, &ev).unwrap();
                for (at, len) in ends(&a) {
                    b.k.verify_tag(c, at, len, tag).unwrap();
                }
                b.pool.free_async(a, c).unwrap();
                n += 1;
            }
            drop(hold);
            let _ = ci;
        }));
    }
    let sizes = [512usize, 4096, 60_000, 300_000, 1 << 20];
    let mut prod = Vec::new();
    for (pi, &p) in ps.iter().enumerate() {
        let b = b.clone();
        let txs = txs.clone();
        prod.push(std::thread::spawn(move || {
            let mut rng = XorShift64::new(100 + pi as u64);
            for i in 0..per_producer {
                let tag = (pi as u32) << 24 | i;
                let a = b
                    .produce(p, sizes[rng.index(sizes.len())], tag)
                    .unwrap_or_else(|e| panic!("producer {pi} block {i}: {e}"));
                let ev = b.pool.record_event(p).unwrap();
                txs[rng.index(txs.len())].send((a, ev, tag)).unwrap();
            }
        }));
    }
    drop(txs);
    for h in prod {
        h.join().unwrap();
    }
    for h in handles {
        h.join().unwrap();
    }
    let b = Arc::try_unwrap(b).ok().expect("sole owner");
    assert_eq!(
        b.pool.stats().allocs,
        producers as u64 * per_producer as u64
    );
    b.finish();
}

/// Event order around a consumer's free (the consumer never allocates, so
/// its free goes straight to the arena): a producer that waited only on an
/// event recorded on the consumer *before* the free, or on a chain that
/// left the consumer before the free, is not ordered after it and must not
/// get the block while the consumer is held; a producer that waited on an
/// event recorded after the free may, and its fill then runs after the
/// consumer's verify.
#[test]
fn only_events_recorded_after_a_consumers_free_order_a_producer_after_it() {
    let b = Bench::new(
        PoolConfig::default()
            .with_va_size(4 << 30)
            .with_reuse(no_waits()),
    );
    let ss = streams(&*b.dev, 4);
    let (p, c, d, q) = (ss[0], ss[1], ss[2], ss[3]);
    let size = 64 << 10;
    // Warm the producers so the block's size class exists.
    for s in [p, q] {
        let w = b.produce(s, size, 1).unwrap();
        for (at, n) in ends(&w) {
            b.k.verify_tag(s, at, n, 1).unwrap();
        }
        b.pool.free_async(w, s).unwrap();
    }
    b.pool.synchronize().unwrap();
    let mut hold = Blocker::on(&*b.dev, c);
    // The block, made on p, used and freed on c (held).
    let x = b.produce(p, size, 2).unwrap();
    let pending = (x.ptr(), x.size());
    let ev_p = b.pool.record_event(p).unwrap();
    b.pool.wait_event(c, &ev_p).unwrap();
    let before = b.pool.record_event(c).unwrap();
    // d leaves c before the free: a chain that does not cover it.
    b.pool.wait_event(d, &before).unwrap();
    let via_d = b.pool.record_event(d).unwrap();
    for (at, n) in ends(&x) {
        b.k.verify_tag(c, at, n, 2).unwrap();
    }
    b.pool.free_async(x, c).unwrap();
    b.pool.wait_event(p, &before).unwrap();
    b.pool.wait_event(q, &via_d).unwrap();
    let mut got = Vec::new();
    for i in 0..20u32 {
        for (name, s) in [("p", p), ("q", q)] {
            let y = b.produce(s, size, 10 + i).unwrap();
            assert!(
                !overlaps((y.ptr(), y.size()), pending),
                "{name} (waited only on events from before the free) got the consumer's \
                 pending block"
            );
            got.push((y, s, 10 + i));
        }
    }
    // After an event recorded after the free, reuse is legal (and the
    // fill is ordered after the held verify).
    let after = b.pool.record_event(c).unwrap();
    b.pool.wait_event(p, &after).unwrap();
    for i in 0..4u32 {
        let y = b.produce(p, size, 50 + i).unwrap();
        got.push((y, p, 50 + i));
    }
    hold.release();
    for (y, s, t) in got {
        for (at, n) in ends(&y) {
            b.k.verify_tag(s, at, n, t).unwrap();
        }
        b.pool.free_async(y, s).unwrap();
    }
    b.finish();
}
