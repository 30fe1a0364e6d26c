//! Attacks on placement from outside the pool: checkerboards of live
//! blocks, frees pending on busy streams and completed frees side by side,
//! across several streams, in a capped pool.
//!
//! Two rules are checked after every allocation, against a shadow kept by
//! the test:
//! - **Stream order.** A block never overlaps memory whose free is still
//!   pending on another stream unless the pool made the allocating stream
//!   wait for that free (an internal dependency, counted by the stats, and
//!   checked with a probe that must run only after the busy stream's work).
//!   With internal dependencies switched off, no overlap at all. Streams are
//!   kept busy by host tasks that block until the test releases them, so
//!   "pending" is certain and nothing depends on the machine's speed.
//!   Every block also gets a tag written in stream order on its stream
//!   ("its kernel"), and the tag is checked in stream order before its
//!   free, so a reuse that races with the old owner's work, or a page
//!   unmapped under pending work (trims run between the steps), shows.
//! - **No false out-of-memory.** When an allocation fails, the pool's cap
//!   must really be short: the pages that no live block and no pending free
//!   touch (free, completed memory the pool may move) plus the room left
//!   under the cap must be fewer than the request needs (its pages plus
//!   one for a window that does not start on a page boundary).

mod common;

use common::*;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use tidepool::{Allocation, MemPool, ReusePolicy};
use tidepool_sys::{Device, DevicePtr, HostDevice, Stream};

const MIB: usize = 1 << 20;

fn overlaps(a: DevicePtr, la: usize, b: DevicePtr, lb: usize) -> bool {
    a < b + lb as u64 && b < a + la as u64
}

/// Bytes a block really covers (blocks are multiples of 512 bytes).
fn span(size: usize) -> usize {
    size.next_multiple_of(512)
}

/// Words tagged at each end of a block.
const TAG_WORDS: usize = 16;

/// The tagged spots of a block: (address, bytes), at its start and its end.
fn spots(ptr: DevicePtr, size: usize) -> Vec<(DevicePtr, usize)> {
    let n = (TAG_WORDS * 4).min(size / 4 * 4);
    if n == 0 {
        return Vec::new();
    }
    let tail = ptr + (size / 4 * 4 - n) as u64;
    if tail <= ptr + n as u64 {
        vec![(ptr, size / 4 * 4)]
    } else {
        vec![(ptr, n), (tail, n)]
    }
}

/// Write `tag` over the block's spots, in stream order on `stream`.
fn fill(
    dev: &HostDevice,
    stream: Stream,
    ptr: DevicePtr,
    size: usize,
    tag: u32,
) -> Vec<Receiver<bool>> {
    spots(ptr, size)
        .into_iter()
        .map(|(p, n)| tag_kernel(dev, stream, p, n / 4, tag))
        .collect()
}

/// Check `tag` over the block's spots, in stream order on `stream`.
fn verify(
    dev: &HostDevice,
    stream: Stream,
    ptr: DevicePtr,
    size: usize,
    tag: u32,
) -> Vec<Receiver<bool>> {
    spots(ptr, size)
        .into_iter()
        .map(|(p, n)| {
            let (tx, rx) = std::sync::mpsc::channel();
            dev.launch_on_words(stream, p, n, move |r: Result<&[AtomicU32], _>| {
                let ok = r.is_ok_and(|w| w.iter().all(|x| x.load(Ordering::Relaxed) == tag));
                let _ = tx.send(ok);
            })
            .expect("launch verify");
            rx
        })
        .collect()
}

struct Live {
    a: Allocation,
    tag: u32,
}

struct Pending {
    ptr: DevicePtr,
    len: usize,
    /// Index of the busy stream the free waits for.
    on: usize,
    /// The allocating stream was made to wait for this free already (an
    /// internal dependency on an event that covers it).
    covered: bool,
}

struct Run {
    /// Streams 0 and 1 are busy until the end; the others run freely.
    /// (First field: dropped first, so a failing assertion releases the
    /// streams before the pool waits for them.)
    blockers: Vec<Blocker>,
    dev: Arc<HostDevice>,
    pool: MemPool<HostDevice>,
    streams: Vec<Stream>,
    live: Vec<Live>,
    pending: Vec<Pending>,
    checks: Vec<(String, Receiver<bool>)>,
    /// Probes that must run only after a busy stream's work: (what, probe).
    ordered: Vec<(String, Receiver<bool>)>,
    next_tag: u32,
    cap: usize,
    strict: bool,
    /// Streams that allocate: all of them with internal dependencies off;
    /// only stream 2 with them on (a stream made to wait for a busy stream
    /// is busy itself: it is never synchronised, and its frees serve only
    /// itself).
    allocators: Vec<usize>,
    /// Stream 2 was made to wait for a busy stream.
    tainted: bool,
    /// Whether busy stream 1 is retired before the end (and is now).
    retire: bool,
    retired: bool,
    /// (allocations, out-of-memory errors, reuses of pending frees)
    seen: (usize, usize, usize),
    rng: Rng,
}

const BUSY: usize = 2;

impl Run {
    fn new(seed: u64, cap_pages: usize, strict: bool, cache: usize) -> Run {
        // Every other seed: release threshold 0 (each synchronisation
        // trims), and busy stream 1 retired with its frees pending.
        let odd = seed % 2 == 1;
        let cap = cap_pages * PAGE;
        let dev = Arc::new(host_with_capacity(cap));
        let reuse = if strict {
            ReusePolicy {
                internal_dependencies: false,
                wait_for_pending_frees: false,
                ..ReusePolicy::default()
            }
        } else {
            ReusePolicy {
                wait_for_pending_frees: false,
                ..ReusePolicy::default()
            }
        };
        let pool = pool(
            &dev,
            config()
                .with_max_size(cap as u64)
                .with_stream_cache_bytes(cache)
                .with_reuse(reuse)
                .with_release_threshold(if odd { 0 } else { u64::MAX }),
        );
        let streams = streams(&*dev, 4);
        Run {
            dev,
            pool,
            streams,
            blockers: Vec::new(),
            live: Vec::new(),
            pending: Vec::new(),
            checks: Vec::new(),
            ordered: Vec::new(),
            next_tag: 1,
            cap,
            strict,
            allocators: if strict { vec![0, 1, 2, 3] } else { vec![2] },
            tainted: false,
            retire: odd,
            retired: false,
            seen: (0, 0, 0),
            rng: Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1),
        }
    }

    fn size(&mut self) -> usize {
        match self.rng.range(0, 9) {
            0 => 512 * self.rng.range(1, 8) as usize,
            1 => MIB,
            2 => PAGE,
            3 => PAGE - 512,
            4 => PAGE + 512,
            _ => self.rng.log_range(512, 5 * MIB as u64) as usize,
        }
    }

    /// Pages (of the pool's address range) touched by live blocks and by
    /// pending frees.
    fn touched(&self) -> BTreeSet<u64> {
        let mut t = BTreeSet::new();
        for l in &self.live {
            t.extend(pages_of(l.a.ptr(), span(l.a.size())));
        }
        for p in &self.pending {
            t.extend(pages_of(p.ptr, p.len));
        }
        t
    }

    fn alloc(&mut self, step: usize) {
        let size = self.size();
        let si = self.allocators[self.rng.range(0, self.allocators.len() as u64 - 1) as usize];
        let s = self.streams[si];
        let deps_before = self.pool.stats().internal_dependencies;
        match self.pool.alloc_async(size, s) {
            Ok(a) => {
                self.seen.0 += 1;
                let (ptr, len) = (a.ptr(), span(size));
                for l in &self.live {
                    assert!(
                        !overlaps(ptr, len, l.a.ptr(), span(l.a.size())),
                        "step {step}: two live blocks overlap"
                    );
                }
                let deps = self.pool.stats().internal_dependencies - deps_before;
                // Stream 2 may be ordered after a busy stream's free through
                // a dependency made now or earlier (the pool's event may
                // cover later frees too): the probe then checks the order.
                let waited = deps > 0 || self.tainted;
                if deps > 0 {
                    assert!(
                        !self.strict,
                        "step {step}: a dependency with the switch off"
                    );
                    self.tainted = true;
                }
                for p in &mut self.pending {
                    if p.on == si || p.covered || !overlaps(ptr, len, p.ptr, p.len) {
                        continue;
                    }
                    assert!(
                        !self.strict,
                        "step {step}: stream {si} got {size} B at {ptr:#x}, over a free \
                         still pending on busy stream {} ({:#x}+{}), with internal \
                         dependencies off",
                        p.on, p.ptr, p.len
                    );
                    assert!(
                        waited,
                        "step {step}: stream {si} got {size} B at {ptr:#x}, over a free \
                         still pending on busy stream {} ({:#x}+{}), while it never waited for anything",
                        p.on, p.ptr, p.len
                    );
                    p.covered = true;
                    self.seen.2 += 1;
                    let flag = self.blockers[p.on].flag();
                    self.ordered.push((
                        format!("step {step}: stream {si} after busy stream {}", p.on),
                        probe(&*self.dev, s, flag),
                    ));
                }
                let tag = self.next_tag;
                self.next_tag += 1;
                for rx in fill(&self.dev, s, ptr, size, tag) {
                    self.checks
                        .push((format!("step {step}: fill of tag {tag}"), rx));
                }
                self.live.push(Live { a, tag });
            }
            Err(e) => {
                self.seen.1 += 1;
                assert!(
                    matches!(e, tidepool::PoolError::OutOfMemory(_)),
                    "step {step}: not an out-of-memory error: {e}"
                );
                let reserved = self.pool.stats().reserved_current as usize;
                let free_pages = (self.cap - reserved) / PAGE + reserved / PAGE
                    - self.touched().len().min(reserved / PAGE);
                let need = size.div_ceil(PAGE) + 1;
                assert!(
                    free_pages < need,
                    "step {step}: false out-of-memory: {size} B on stream {si} needs at \
                     most {need} pages, and {free_pages} pages are free and complete or \
                     never created ({e})"
                );
            }
        }
    }

    fn free(&mut self, step: usize) {
        if self.live.is_empty() {
            return;
        }
        let k = self.rng.range(0, self.live.len() as u64 - 1) as usize;
        let Live { a, tag } = self.live.swap_remove(k);
        let own = self
            .streams
            .iter()
            .position(|&s| s == a.stream())
            .expect("known stream");
        // Usually on its own stream; sometimes on a busy stream that has
        // done nothing with it (legal: there is no use to order after).
        // (Never from one busy stream to the other: that would order the
        // second after the first's pending frees, which the shadow does not
        // follow.)
        let on = if own >= BUSY && self.rng.range(0, 3) == 0 {
            // (Busy stream 1 once retired takes no more frees.)
            self.rng.range(0, BUSY as u64 - 1 - self.retired as u64) as usize
        } else {
            own
        };
        let (ptr, size) = (a.ptr(), a.size());
        if on == own {
            for rx in verify(&self.dev, self.streams[on], ptr, size, tag) {
                self.checks
                    .push((format!("step {step}: tag {tag} before its free"), rx));
            }
        } else {
            // Ordered after the fill on `own`: an event through the pool.
            let ev = self.pool.record_event(self.streams[own]).unwrap();
            self.pool.wait_event(self.streams[on], &ev).unwrap();
            for rx in verify(&self.dev, self.streams[on], ptr, size, tag) {
                self.checks
                    .push((format!("step {step}: tag {tag} before its free"), rx));
            }
        }
        self.pool.free_async(a, self.streams[on]).unwrap();
        if on < BUSY {
            self.pending.push(Pending {
                ptr,
                len: span(size),
                on,
                covered: false,
            });
        } else if on == 2 && self.tainted {
            // Serves only stream 2 itself (stream order): nothing to track.
        } else {
            // The pool learns that the free completed.
            self.pool.synchronize_stream(self.streams[on]).unwrap();
        }
    }

    fn step(&mut self, step: usize) {
        match self.rng.range(0, 9) {
            0..=4 => self.alloc(step),
            5..=7 => self.free(step),
            8 => {
                // Trimming must not touch pages of pending frees (their
                // tag writes would then fail).
                let target = self.rng.range(0, self.cap as u64 / 2);
                self.pool.trim_to(target).unwrap();
            }
            _ => {
                // With a release threshold of 0 this trims too.
                let k = BUSY + self.rng.range(0, 1) as usize;
                if !(k == 2 && self.tainted) {
                    self.pool.synchronize_stream(self.streams[k]).unwrap();
                }
            }
        }
    }

    fn go(&mut self, steps: usize) {
        // Fill the pool with blocks on every stream, then make streams 0
        // and 1 busy and free every other block by address: a checkerboard
        // of live blocks, pending frees and completed frees.
        for step in 0..200 {
            let used = self.pool.stats().used_current as usize;
            if used > self.cap * 3 / 4 {
                break;
            }
            self.alloc(step);
        }
        for &s in &self.streams[..BUSY] {
            self.blockers.push(Blocker::on(&*self.dev, s));
        }
        self.live.sort_by_key(|l| l.a.ptr());
        let mut keep = Vec::new();
        let all: Vec<Live> = std::mem::take(&mut self.live);
        for (i, l) in all.into_iter().enumerate() {
            if i % 2 == 0 {
                keep.push(l);
            } else {
                self.live.push(l);
            }
        }
        let n = self.live.len();
        for step in 0..n {
            // free() picks at random among self.live: give it the odd ones.
            self.free(1000 + step);
        }
        self.live = keep;
        for step in 0..steps {
            self.step(2000 + step);
        }
        if self.retire {
            // Retire busy stream 1 with its frees pending (its own live
            // blocks freed on it first): they stay guarded by its work.
            let mut i = 0;
            while i < self.live.len() {
                if self.live[i].a.stream() == self.streams[1] {
                    let Live { a, tag } = self.live.swap_remove(i);
                    for rx in verify(&self.dev, self.streams[1], a.ptr(), a.size(), tag) {
                        self.checks
                            .push(("tag before a free on retiring stream".into(), rx));
                    }
                    self.pending.push(Pending {
                        ptr: a.ptr(),
                        len: span(a.size()),
                        on: 1,
                        covered: false,
                    });
                    self.pool.free_async(a, self.streams[1]).unwrap();
                } else {
                    i += 1;
                }
            }
            self.pool.retire_stream(self.streams[1]).unwrap();
            self.allocators.retain(|&k| k != 1);
            self.retired = true;
            for step in 0..steps / 2 {
                self.step(5000 + step);
            }
        }
        // Release the busy streams; everything must then check out.
        for b in &mut self.blockers {
            b.release();
        }
        for (what, rx) in self.ordered.drain(..) {
            assert!(
                rx.recv().unwrap(),
                "{what}: ran before the busy stream's work"
            );
        }
        let live = std::mem::take(&mut self.live);
        for (i, l) in live.into_iter().enumerate() {
            let s = l.a.stream();
            for rx in verify(&self.dev, s, l.a.ptr(), l.a.size(), l.tag) {
                self.checks
                    .push((format!("final check {i}: tag {}", l.tag), rx));
            }
            self.pool.free_async(l.a, s).unwrap();
        }
        for (what, rx) in self.checks.drain(..) {
            assert!(rx.recv().unwrap(), "{what}: memory overwritten or unmapped");
        }
        self.pool.synchronize().unwrap();
        let st = self.pool.stats();
        assert_eq!(st.used_current, 0);
        assert_eq!(st.allocs, st.frees);
        self.pool.trim_to(0).unwrap();
        assert_eq!(self.pool.stats().reserved_current, 0, "memory lost");
    }

    /// What the run exercised (printed past the test harness's capture).
    fn report(&self, name: &str) {
        use std::io::Write;
        let st = self.pool.stats();
        let _ = writeln!(
            std::io::stderr().lock(),
            "{name}: {} allocations, {} out-of-memory, {} reuses of pending frees, \
             {} internal dependencies, {} remaps, {} pages released",
            self.seen.0,
            self.seen.1,
            self.seen.2,
            st.internal_dependencies,
            st.remaps,
            st.releases
        );
    }
}

/// Internal dependencies off: a block never overlaps another stream's
/// pending free, and no request fails while enough memory is free.
#[test]
fn checkerboard_strict_never_reuses_pending_frees_nor_fails_falsely() {
    for seed in 1..=6 {
        for cache in [0, 64 << 20] {
            let mut r = Run::new(seed, 16, true, cache);
            r.go(400);
            r.report(&format!("strict seed {seed} cache {cache}"));
        }
    }
}

/// Internal dependencies on: overlap with a pending free only with the
/// allocating stream made to wait for it.
#[test]
fn checkerboard_with_dependencies_orders_every_reuse_of_a_pending_free() {
    for seed in 1..=6 {
        for cache in [0, 64 << 20] {
            let mut r = Run::new(100 + seed, 16, false, cache);
            r.go(400);
            r.report(&format!("dependencies seed {seed} cache {cache}"));
            assert!(r.seen.0 > 0);
        }
    }
}

/// A request that fits only across two adjacent free ranges of different
/// kinds (one the allocating stream freed itself, still pending; one
/// completed) is served from them, in a pool capped at what it holds.
#[test]
fn own_pending_free_next_to_a_completed_one_serves_one_request() {
    let dev = Arc::new(host_with_capacity(4 * PAGE));
    let strict = ReusePolicy {
        internal_dependencies: false,
        wait_for_pending_frees: false,
        ..ReusePolicy::default()
    };
    let pool = pool(
        &dev,
        config()
            .with_max_size(2 * PAGE as u64)
            .with_stream_cache_bytes(0)
            .with_reuse(strict),
    );
    let (s0, s1) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let a = pool.alloc_async(MIB, s1).unwrap();
    let b = pool.alloc_async(MIB, s0).unwrap();
    let c = pool.alloc_async(2 * MIB, s0).unwrap();
    assert_eq!(pool.stats().reserved_current, 2 * PAGE as u64);
    // a is freed and completes; b is freed on s0, which stays busy.
    pool.free_async(a, s1).unwrap();
    pool.synchronize_stream(s1).unwrap();
    let _busy = Blocker::on(&*dev, s0);
    let (bp, cp) = (b.ptr(), c.ptr());
    pool.free_async(b, s0).unwrap();
    // s1 may use a's completed bytes, never b's (pending on busy s0).
    if let Ok(e) = pool.alloc_async(MIB, s1) {
        assert!(
            !overlaps(e.ptr(), MIB, bp, MIB),
            "s1 got bytes whose free is pending on busy s0"
        );
        pool.free_async(e, s1).unwrap();
        pool.synchronize_stream(s1).unwrap();
    }
    // s0 may use both (its own free is ordered before its later work).
    let d = pool
        .alloc_async(2 * MIB, s0)
        .unwrap_or_else(|e| panic!("false out-of-memory: {e}"));
    assert!(!overlaps(d.ptr(), 2 * MIB, cp, 2 * MIB));
    pool.free_async(d, s0).unwrap();
    pool.free_async(c, s0).unwrap();
}

/// A use declared on a busy stream (`record_use`) guards the freed bytes:
/// a stream that never waited for the busy one never gets them, however
/// they could be joined with completed neighbours; the freeing stream gets
/// them only if its later work runs after the use (probed).
#[test]
fn a_declared_use_on_a_busy_stream_guards_the_freed_bytes() {
    let strict = ReusePolicy {
        internal_dependencies: false,
        wait_for_pending_frees: false,
        ..ReusePolicy::default()
    };
    for cache in [0, 64 << 20] {
        let dev = Arc::new(host_with_capacity(4 * PAGE));
        let pool = pool(
            &dev,
            config()
                .with_max_size(2 * PAGE as u64)
                .with_stream_cache_bytes(cache)
                .with_reuse(strict),
        );
        let (s0, s1, s2) = (
            dev.create_stream().unwrap(),
            dev.create_stream().unwrap(),
            dev.create_stream().unwrap(),
        );
        let mut x = pool.alloc_async(MIB, s1).unwrap();
        let y = pool.alloc_async(3 * MIB, s2).unwrap();
        let (xp, xl) = (x.ptr(), MIB);
        let mut busy = Blocker::on(&*dev, s0);
        // The use on s0, ordered after x's allocation through the pool.
        let ev = pool.record_event(s1).unwrap();
        pool.wait_event(s0, &ev).unwrap();
        pool.record_use(&mut x, s0);
        let used = tag_kernel(&dev, s0, xp, 16, 7);
        pool.free_async(x, s1).unwrap();
        pool.free_async(y, s2).unwrap();
        pool.synchronize_stream(s2).unwrap();
        let mut probes = Vec::new();
        let mut served = 0;
        for (s, size) in [
            (s2, MIB),
            (s2, 2 * MIB),
            (s2, 3 * MIB),
            (s2, 4 * MIB),
            (s1, MIB),
            (s1, 4 * MIB),
        ] {
            let Ok(b) = pool.alloc_async(size, s) else {
                continue;
            };
            served += 1;
            if overlaps(b.ptr(), size, xp, xl) {
                assert!(
                    s != s2,
                    "cache {cache}: {size} B on a stream that never waited got bytes \
                     whose declared use on a busy stream is pending"
                );
                probes.push(probe(&*dev, s, busy.flag()));
            }
            pool.free_async(b, s).unwrap();
            if s == s2 {
                pool.synchronize_stream(s2).unwrap();
            }
        }
        assert!(
            served > 0,
            "cache {cache}: the completed 3 MiB served nothing"
        );
        busy.release();
        assert!(
            used.recv().unwrap(),
            "cache {cache}: the use's memory was unmapped"
        );
        for p in probes {
            assert!(
                p.recv().unwrap(),
                "cache {cache}: the freeing stream reused the bytes before the use ran"
            );
        }
        pool.synchronize().unwrap();
    }
}
