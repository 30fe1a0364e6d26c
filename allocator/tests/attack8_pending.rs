//! Pending frees whose ends move, attacked through `MemPool` on the host
//! backend. One stream (`a`) is held busy while it frees blocks, its own
//! and ones another stream allocated (so its pending ranges sit next to
//! anything), closes epochs with events, and takes blocks back from its
//! own pending frees: from their front, their middle, their end (big
//! blocks start on a page, so a take can begin inside a range), whole;
//! ranges grow downward and upward and merge across epochs. Halfway
//! through each round the frees made so far complete (synchronised),
//! those to come stay pending behind a second hold (a cache flushed then
//! holds both, side by side). Meanwhile a second stream (`b`) allocates:
//! it must never be handed a byte of a free still pending on `a`; without
//! a stream cache, while no page has moved and before the halfway point,
//! its first-fit requests (1 MiB to 256 MiB) must get exactly the lowest
//! window holding no live block and no such pending free. When `a`
//! completes (synchronised, settled by a trim), `b` gets that lowest
//! window again (while no page has moved), now counting the frees as
//! free, with no growth when it lies inside them (while no page has moved
//! out of a pending free in the round); after every free, a
//! synchronise and `trim_to(0)`, nothing is used or reserved. With a
//! stream cache, `a`'s cached frees reach the arena in batches (several
//! epochs each) by its own slow allocations and by trims.
//!
//! Two laid-out cases follow: a free pending on `a` between or beside
//! completed ranges, which must settle in place once `a` completes.
//! Work is bounded by operation counts.

mod common;

use common::{Blocker, Rng};
use std::collections::BTreeMap;
use std::sync::Arc;
use tidepool::{Allocation, MemPool, PoolConfig};
use tidepool_sys::{Device, HostConfig, HostDevice, Stream};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const PAGE: usize = 2 * MIB;
const VA: usize = 4 << 30;

fn span(size: usize) -> usize {
    size.next_multiple_of(512)
}

/// Sizes `a` and `b` ask for: small (best fit, overlap checks only),
/// medium and big (first fit, placement checked for `b`).
const SMALL: [usize; 5] = [
    4 * KIB,
    64 * KIB - 512,
    64 * KIB + 4,
    256 * KIB,
    256 * KIB + 512,
];
const MEDIUM: [usize; 6] = [
    MIB,
    MIB + 512,
    2 * MIB - 512,
    2 * MIB,
    2 * MIB + 512,
    5 * MIB,
];
const BIG: [usize; 5] = [
    16 * MIB,
    16 * MIB + 512,
    18 * MIB - 512,
    18 * MIB + 512,
    34 * MIB,
];

struct Block {
    a: Allocation,
    tag: u32,
}

/// How each kind of take by `a` met its own pending frees.
#[derive(Default, Debug)]
struct Cuts {
    front: usize,
    middle: usize,
    end: usize,
    whole: usize,
}

struct Harness {
    dev: Arc<HostDevice>,
    pool: MemPool<HostDevice>,
    a: Stream,
    b: Stream,
    base: u64,
    live: BTreeMap<u64, Block>,
    /// Bytes freed on `a` while it is held: start -> end.
    pending: BTreeMap<u64, u64>,
    /// Whether `b`'s first-fit placements are checked against the model
    /// (without a stream cache: a cached free is not in the arena).
    model: bool,
    /// Frees known complete but maybe not settled yet.
    limbo: bool,
    next_tag: u32,
    checked: usize,
    /// Placements inside ranges just completed.
    inside: usize,
    cuts: Cuts,
    what: String,
}

impl Harness {
    fn new(seed: u64, cache: usize) -> Harness {
        let dev = Arc::new(HostDevice::with_config(HostConfig {
            capacity: 1 << 30,
            granularity: PAGE,
        }));
        let pool = MemPool::new(
            dev.clone(),
            PoolConfig::default()
                .with_va_size(VA)
                .with_stream_cache_bytes(cache),
        )
        .expect("pool");
        let (a, b) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
        // The first medium block of an empty pool starts its zone, a
        // quarter of the address range in.
        let x = pool.alloc_async(MIB, b).unwrap();
        let base = x.ptr() - VA as u64 / 4;
        pool.free_async(x, b).unwrap();
        pool.synchronize().unwrap();
        pool.trim_to(0).unwrap();
        Harness {
            dev,
            pool,
            a,
            b,
            base,
            live: BTreeMap::new(),
            pending: BTreeMap::new(),
            model: cache == 0,
            limbo: false,
            next_tag: (seed as u32).wrapping_mul(0x9E37_79B9) | 1,
            checked: 0,
            inside: 0,
            cuts: Cuts::default(),
            what: format!("seed {seed}, cache {cache}"),
        }
    }

    /// The zone and alignment of a first-fit size.
    fn zone(&self, size: usize) -> Option<(u64, u64, u64)> {
        let (q, size) = (VA as u64 / 4, span(size));
        if (MIB..16 * MIB).contains(&size) {
            Some((self.base + q, self.base + 2 * q, 1))
        } else if (16 * MIB..256 * MIB).contains(&size) {
            Some((self.base + 2 * q, self.base + 3 * q, PAGE as u64))
        } else {
            None
        }
    }

    /// The lowest window of the zone `b` may take: no live block, no free
    /// pending on `a`.
    fn lowest(&self, size: usize) -> Option<u64> {
        let (lo, hi, align) = self.zone(size)?;
        let len = span(size) as u64;
        let mut taken: Vec<(u64, u64)> = self
            .live
            .iter()
            .map(|(&p, x)| (p, p + span(x.a.size()) as u64))
            .chain(self.pending.iter().map(|(&p, &e)| (p, e)))
            .collect();
        taken.sort_unstable();
        let mut at = lo.next_multiple_of(align);
        for (p, e) in taken {
            if e <= at {
                continue;
            }
            if p >= at + len {
                break;
            }
            at = e.next_multiple_of(align);
        }
        (at + len <= hi).then_some(at)
    }

    fn alloc(&mut self, size: usize, on_a: bool, step: usize) -> u64 {
        let s = if on_a { self.a } else { self.b };
        // The lowest window is the answer while no page has moved (a moved
        // page leaves a hole, and a window needing pages is chosen by its
        // driver calls first).
        let st = self.pool.stats();
        let moved = st.remaps - st.growths + st.rebinds;
        let want = (!on_a && self.model && !self.limbo && moved == 0)
            .then(|| self.lowest(size))
            .flatten();
        let x = self
            .pool
            .alloc_async(size, s)
            .unwrap_or_else(|e| panic!("{} step {step}: {size} B failed: {e}", self.what));
        let (p, e) = (x.ptr(), x.ptr() + span(size) as u64);
        for (&q, y) in self.live.range(..e).rev().take(1) {
            assert!(
                q + span(y.a.size()) as u64 <= p,
                "{} step {step}: [{p:#x}, {e:#x}) overlaps a live block at {q:#x}",
                self.what
            );
        }
        if on_a {
            // `a` may take back its own pending frees: note how.
            let hit: Vec<(u64, u64)> = self
                .pending
                .range(..e)
                .filter(|&(_, &pe)| pe > p)
                .map(|(&q, &pe)| (q, pe))
                .collect();
            for (q, pe) in hit {
                self.pending.remove(&q);
                match (q < p, pe > e) {
                    (false, true) => self.cuts.front += 1,
                    (true, true) => self.cuts.middle += 1,
                    (true, false) => self.cuts.end += 1,
                    (false, false) => self.cuts.whole += 1,
                }
                if q < p {
                    self.pending.insert(q, p);
                }
                if pe > e {
                    self.pending.insert(e, pe);
                }
            }
        } else {
            if let Some((&q, &pe)) = self.pending.range(..e).next_back() {
                assert!(
                    pe <= p,
                    "{} step {step}: stream b got [{p:#x}, {e:#x}) over [{q:#x}, {pe:#x}), \
                     freed on the held stream and still pending",
                    self.what
                );
            }
            if let Some(w) = want {
                let lo = self.zone(size).unwrap().0;
                assert_eq!(
                    p,
                    w,
                    "{} step {step}: {size} B for b at zone+{:#x}, the lowest window it may \
                     take is at zone+{:#x}",
                    self.what,
                    p.wrapping_sub(lo),
                    w - lo
                );
                self.checked += 1;
            }
        }
        let tag = self.next_tag;
        self.next_tag = self.next_tag.wrapping_add(0x9E37_79B9);
        let last = p + (size as u64 & !3) - 4;
        self.dev.write_words(p, &[tag, !tag]).unwrap();
        self.dev.write_words(last, &[tag ^ 0x5555_5555]).unwrap();
        self.live.insert(p, Block { a: x, tag });
        p
    }

    /// Free the block at `p` on `a` (held: pending) or on `b`, tags checked.
    fn free(&mut self, p: u64, on_a: bool, held: bool, step: usize) {
        let x = self.live.remove(&p).expect("live");
        let size = x.a.size();
        let last = p + (size as u64 & !3) - 4;
        let head = self.dev.read_words(p, 2).unwrap();
        let tail = self.dev.read_words(last, 1).unwrap();
        assert_eq!(
            (head[0], head[1], tail[0]),
            (x.tag, !x.tag, x.tag ^ 0x5555_5555),
            "{} step {step}: the block at {p:#x} ({size} B) lost its tags while live",
            self.what
        );
        let s = if on_a { self.a } else { self.b };
        self.pool.free_async(x.a, s).unwrap();
        if on_a && held {
            let (mut lo, mut hi) = (p, p + span(size) as u64);
            // Keep the model's intervals merged (only for neatness).
            if let Some((&q, &e)) = self.pending.range(..lo).next_back() {
                if e == lo {
                    self.pending.remove(&q);
                    lo = q;
                }
            }
            if let Some(e) = self.pending.remove(&hi) {
                hi = e;
            }
            self.pending.insert(lo, hi);
        }
    }

    fn pick(&self, rng: &mut Rng) -> u64 {
        let k = rng.range(0, self.live.len() as u64 - 1) as usize;
        *self.live.keys().nth(k).unwrap()
    }

    fn size(rng: &mut Rng) -> usize {
        match rng.range(0, 9) {
            0..=2 => SMALL[rng.range(0, SMALL.len() as u64 - 1) as usize],
            3..=7 => MEDIUM[rng.range(0, MEDIUM.len() as u64 - 1) as usize],
            _ => BIG[rng.range(0, BIG.len() as u64 - 1) as usize],
        }
    }

    /// One round: `a` held busy for `ops` operations, then released and
    /// synchronised; every byte it freed must then be `b`'s to take.
    fn round(&mut self, rng: &mut Rng, ops: usize, step: &mut usize) {
        let moves_before = self.pool.pending_move_counts().0;
        let mut hold = Blocker::on(&*self.dev, self.a);
        for i in 0..ops {
            *step += 1;
            if i == ops / 2 {
                // Halfway: the frees so far complete (and the pool knows
                // it), those to come stay pending behind a second hold.
                // A cache flushed from here on holds both kinds.
                let ev = self.pool.record_event(self.a).unwrap();
                let next = Blocker::on(&*self.dev, self.a);
                hold.release();
                self.pool.synchronize_event(&ev).unwrap();
                hold = next;
                self.pending.clear();
                // Those frees are usable by `b` through the synchronise,
                // but until the pool settles them (marks them complete) a
                // later free of `a` beside one joins it under its own,
                // pending, epoch: the lowest window `b` may take is then
                // not known from outside.
                self.limbo = true;
            }
            let r = rng.range(0, 19);
            if self.live.len() > 24 || (r < 8 && !self.live.is_empty()) {
                // Frees: mostly on `a` (pending), whoever allocated.
                let p = self.pick(rng);
                self.free(p, r % 4 != 0, true, *step);
            } else if r < 15 {
                let size = Harness::size(rng);
                self.alloc(size, r % 2 == 0, *step);
            } else if r < 17 {
                // Close `a`'s epoch (the event is dropped: the pool keeps
                // its own record).
                let _ = self.pool.record_event(self.a).unwrap();
            } else if r < 18 {
                // Flush every busy stream's cache (`a`'s: several epochs).
                self.pool.trim_to(u64::MAX).unwrap();
            } else if let Some((&q, &e)) = self.pending.iter().nth(rng.range(0, 7) as usize) {
                // `a` asks for a pending range's length, or a page-aligned
                // big length inside it (a take from its middle or end).
                let len = (e - q) as usize;
                let size = if len >= 17 * MIB && rng.range(0, 1) == 0 {
                    let start = q.next_multiple_of(PAGE as u64);
                    ((e - start) as usize / PAGE * PAGE).max(16 * MIB)
                } else {
                    len
                };
                if size < 64 * MIB {
                    self.alloc(size, true, *step);
                }
            }
        }
        assert!(!hold.done());
        hold.release();
        self.pool.synchronize().unwrap();
        // Cached frees reach the arena, completions are settled.
        self.pool.trim_to(u64::MAX).unwrap();
        self.limbo = false;
        // Every pending range, now complete, is `b`'s: the lowest window
        // of its length counts it free.
        let mut freed: Vec<(u64, u64)> = std::mem::take(&mut self.pending)
            .into_iter()
            .filter(|&(q, e)| {
                let zone = self.zone(MIB).unwrap();
                q >= zone.0 && e <= zone.1 && (MIB..16 * MIB).contains(&((e - q) as usize))
            })
            .collect();
        // Longest first. A block placed inside a range just completed
        // lies on pages that were mapped for it: the pool must not grow
        // for it, unless `a` moved pages out of its pending frees this
        // round (to grow less itself), which leaves holes in them.
        let moved = self.pool.pending_move_counts().0 != moves_before;
        freed.sort_by_key(|&(q, e)| (std::cmp::Reverse(e - q), q));
        for &(q, e) in freed.iter().take(3) {
            let growths = self.pool.stats().growths;
            let len = e - q;
            let got = self.alloc(len as usize, false, *step);
            if self.model && !moved && freed.iter().any(|&(q, e)| q <= got && got + len <= e) {
                self.inside += 1;
                assert_eq!(
                    self.pool.stats().growths,
                    growths,
                    "{} step {step}: the pool grew to place {len:#x} B inside frees just \
                     completed",
                    self.what
                );
            }
        }
    }

    fn finish(mut self) -> (usize, usize, Cuts) {
        for p in self.live.keys().copied().collect::<Vec<_>>() {
            self.free(p, p % 3 == 0, false, usize::MAX);
        }
        self.pool.synchronize().unwrap();
        self.pool.trim_to(0).unwrap();
        let s = self.pool.stats();
        assert_eq!(
            (s.used_current, s.reserved_current),
            (0, 0),
            "{}: used and reserved after every free, a synchronise and trim_to(0)",
            self.what
        );
        assert_eq!(s.allocs, s.frees, "{}", self.what);
        (self.checked, self.inside, self.cuts)
    }
}

fn moving_ends(cache: usize, seeds: std::ops::Range<u64>) {
    let mut all = Cuts::default();
    let (mut checked, mut inside) = (0, 0);
    for seed in seeds {
        let mut h = Harness::new(seed, cache);
        let mut rng = Rng(seed.wrapping_mul(0x2545_F491_4F6C_DD1D) | 1);
        let mut step = 0;
        for _ in 0..6 {
            h.round(&mut rng, 60, &mut step);
        }
        let (c, i, cuts) = h.finish();
        checked += c;
        inside += i;
        all.front += cuts.front;
        all.middle += cuts.middle;
        all.end += cuts.end;
        all.whole += cuts.whole;
    }
    // The workload did reach every shape it is about.
    assert!(
        all.front > 0 && all.middle > 0 && all.end > 0 && all.whole > 0,
        "cache {cache}: takes from pending frees: {all:?}"
    );
    if cache == 0 {
        assert!(
            checked > 100,
            "{checked} placements checked, {inside} inside, {all:?}"
        );
        assert!(
            inside > 100,
            "{inside} placements inside frees just completed"
        );
    }
}

#[test]
fn pending_frees_whose_ends_move_complete_whole_without_a_cache() {
    // Placements are checked while no page has moved; pages pending on
    // `a` move when it would grow otherwise, which ends a seed's checks
    // sooner: more seeds keep the count of checks up.
    moving_ends(0, 1..81);
}

#[test]
fn pending_frees_whose_ends_move_complete_whole_with_small_caches() {
    moving_ends(3 * MIB, 1..7);
}

#[test]
fn pending_frees_whose_ends_move_complete_whole_with_large_caches() {
    moving_ends(256 * MIB, 1..7);
}

/// A free pending on `a` between two completed free ranges of the medium
/// zone, and one just above a completed range: while `a` is held, `b`'s
/// lowest window skips them; once `a` completes (synchronised, then
/// settled by a trim), `b` gets the zone's first byte and then the three
/// blocks' length right after it, across the ranges that were pending.
#[test]
fn pending_frees_between_completed_ranges_are_reusable_once_complete() {
    for gap in [MIB, MIB + 512, 3 * MIB] {
        let mut h = Harness::new(gap as u64, 0);
        let (a, b) = (h.a, h.b);
        // x0 x1 x2 x3 x4, side by side from the zone's start (checked).
        let xs: Vec<u64> = (0..5).map(|i| h.alloc(gap, i % 2 == 0, i)).collect();
        let lo = h.zone(MIB).unwrap().0;
        for (i, &p) in xs.iter().enumerate() {
            assert_eq!(p, lo + (i * span(gap)) as u64, "gap {gap}: block {i}");
        }
        // x1 and x3 freed on b and settled complete.
        h.free(xs[1], false, false, 5);
        h.free(xs[3], false, false, 6);
        h.pool.synchronize().unwrap();
        h.pool.trim_to(u64::MAX).unwrap();
        // x0 and x2 freed on a while it is held: x0 below a completed
        // range, x2 between two.
        let mut hold = Blocker::on(&*h.dev, a);
        h.free(xs[0], true, true, 7);
        h.free(xs[2], true, true, 8);
        // b may not have them yet: the lowest window of `gap` bytes for b
        // is x1, whatever lies pending around it.
        assert_eq!(
            h.alloc(gap, false, 9),
            xs[1],
            "gap {gap}: b before a completes"
        );
        let p = xs[1];
        h.free(p, false, false, 10);
        h.pool.synchronize_stream(b).unwrap();
        h.pool.trim_to(u64::MAX).unwrap();
        hold.release();
        h.pool.synchronize().unwrap();
        h.pool.trim_to(u64::MAX).unwrap();
        h.pending.clear();
        // Everything below x4 is complete and free: b's `gap` bytes go to
        // the zone's start, its 3 * `gap` bytes right after them.
        assert_eq!(
            h.alloc(gap, false, 11),
            xs[0],
            "gap {gap}: b after a completed"
        );
        assert_eq!(
            h.alloc(3 * gap, false, 12),
            xs[1],
            "gap {gap}: b, three blocks' length"
        );
        drop(hold);
        h.finish();
    }
}

/// The same in the small zone, where best fit prefers, inside the run it
/// picks, ranges of the best class: a free pending on `a` just below a
/// completed range, once settled complete and merged with it, is where
/// `b`'s block of its length goes (the run's start); left pending (known
/// complete by the synchronise, but not settled), `b` would be sent to
/// the completed range beside it instead.
#[test]
fn a_pending_free_below_a_completed_one_settles_in_place_small() {
    for len in [4 * KIB, 64 * KIB - 512, 64 * KIB + 512, 256 * KIB] {
        let mut h = Harness::new(len as u64, 0);
        let (a, b) = (h.a, h.b);
        // y0 (a) y1 (b) y2 (b, a fence), side by side (checked).
        let ys: Vec<u64> = (0..3).map(|i| h.alloc(len, i == 0, i)).collect();
        assert_eq!(ys[1], ys[0] + span(len) as u64, "len {len}");
        assert_eq!(ys[2], ys[1] + span(len) as u64, "len {len}");
        h.free(ys[1], false, false, 3);
        h.pool.synchronize().unwrap();
        h.pool.trim_to(u64::MAX).unwrap();
        let mut hold = Blocker::on(&*h.dev, a);
        h.free(ys[0], true, true, 4);
        // Before a completes: b gets y1, the only usable part of the run.
        assert_eq!(
            h.alloc(len, false, 5),
            ys[1],
            "len {len}: b before a completes"
        );
        h.free(ys[1], false, false, 6);
        h.pool.synchronize_stream(b).unwrap();
        h.pool.trim_to(u64::MAX).unwrap();
        hold.release();
        h.pool.synchronize().unwrap();
        h.pool.trim_to(u64::MAX).unwrap();
        h.pending.clear();
        assert_eq!(
            h.alloc(len, false, 7),
            ys[0],
            "len {len}: b after a completed"
        );
        drop(hold);
        h.finish();
    }
}
