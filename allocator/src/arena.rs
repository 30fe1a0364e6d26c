//! The arena: one large virtual reservation, physical pages mapped into it,
//! and the free ranges between live blocks.
//!
//! Every byte of the reservation is in exactly one of three states: inside a
//! block handed out (always on mapped pages), inside a *free range* (mapped,
//! reusable under its [`Guard`]), or inside a *hole* (not mapped; holes are
//! whole pages). Physical pages are all the same size, so any page that is
//! wholly free and whose frees are complete can be unmapped from where it
//! sits and mapped where a request needs it: that is the defragmentation.
//! This module is bookkeeping only; the device calls are made by the policy.

use slab::Slab;
use std::collections::{BTreeMap, BTreeSet};
use tidepool_sys::Physical;

/// When a free range may be reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Guard {
    /// No pending device work touches it (fresh, or completion observed).
    Complete,
    /// Safe once the stream's work up to `epoch` is done (or is ordered
    /// before the user).
    After { stream: u64, epoch: u64 },
}

impl Guard {
    /// The guard of two adjacent ranges merged into one, if one guard can
    /// say it: the merge is conservative (it waits for both).
    pub fn merge(self, other: Guard) -> Option<Guard> {
        match (self, other) {
            (Guard::Complete, g) | (g, Guard::Complete) => Some(g),
            (
                Guard::After { stream: a, epoch: x },
                Guard::After { stream: b, epoch: y },
            ) if a == b => Some(Guard::After {
                stream: a,
                epoch: x.max(y),
            }),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct FreeRange {
    pub len: usize,
    pub guard: Guard,
}

#[derive(Debug, Clone, Copy, Default)]
struct PageSlot {
    phys: Option<usize>,
    /// Blocks handed out (or held in a stream cache) that overlap the page.
    users: u32,
}

#[derive(Debug)]
pub(crate) struct PhysPage {
    pub handle: Physical,
    pub at: Option<usize>,
}

/// Bookkeeping of one virtual reservation.
#[derive(Debug)]
pub(crate) struct Arena {
    pub page: usize,
    pages: Vec<PageSlot>,
    pub phys: Slab<PhysPage>,
    /// Physical pages created and not mapped anywhere.
    pub spare: Vec<usize>,
    free: BTreeMap<usize, FreeRange>,
    by_size: BTreeSet<(usize, usize)>,
    holes: BTreeMap<usize, usize>,
    /// Mapped pages that no block overlaps.
    idle: BTreeSet<usize>,
    pub reserved: u64,
    pub reserved_high: u64,
    pub growths: u64,
    pub releases: u64,
    pub remaps: u64,
}

impl Arena {
    pub fn new(va_size: usize, page: usize) -> Self {
        assert!(page > 0 && va_size % page == 0 && va_size > 0);
        let mut holes = BTreeMap::new();
        holes.insert(0, va_size);
        Arena {
            page,
            pages: vec![PageSlot::default(); va_size / page],
            phys: Slab::new(),
            spare: Vec::new(),
            free: BTreeMap::new(),
            by_size: BTreeSet::new(),
            holes,
            idle: BTreeSet::new(),
            reserved: 0,
            reserved_high: 0,
            growths: 0,
            releases: 0,
            remaps: 0,
        }
    }

    // ----- free ranges -----

    fn insert_raw(&mut self, off: usize, range: FreeRange) {
        debug_assert!(range.len > 0);
        self.free.insert(off, range);
        self.by_size.insert((range.len, off));
    }

    fn remove_raw(&mut self, off: usize) -> FreeRange {
        let r = self.free.remove(&off).expect("free range exists");
        self.by_size.remove(&(r.len, off));
        r
    }

    /// Add a free range, merging with neighbours whose guards allow it.
    fn insert_free(&mut self, mut off: usize, mut len: usize, mut guard: Guard) {
        if let Some((&lo, &l)) = self.free.range(..off).next_back() {
            if lo + l.len == off {
                if let Some(g) = l.guard.merge(guard) {
                    self.remove_raw(lo);
                    off = lo;
                    len += l.len;
                    guard = g;
                }
            }
        }
        if let Some(&r) = self.free.get(&(off + len)) {
            if let Some(g) = r.guard.merge(guard) {
                self.remove_raw(off + len);
                len += r.len;
                guard = g;
            }
        }
        self.insert_raw(off, FreeRange { len, guard });
    }

    fn page_span(&self, off: usize, len: usize) -> std::ops::RangeInclusive<usize> {
        off / self.page..=(off + len - 1) / self.page
    }

    fn add_users(&mut self, off: usize, len: usize) {
        for p in self.page_span(off, len) {
            debug_assert!(self.pages[p].phys.is_some(), "block on unmapped page");
            if self.pages[p].users == 0 {
                self.idle.remove(&p);
            }
            self.pages[p].users += 1;
        }
    }

    fn drop_users(&mut self, off: usize, len: usize) {
        for p in self.page_span(off, len) {
            self.pages[p].users -= 1;
            if self.pages[p].users == 0 {
                self.idle.insert(p);
            }
        }
    }

    /// Hand out `[off, off+len)`, which must be covered by free ranges
    /// (several adjacent ones when their guards could not merge).
    pub fn take(&mut self, off: usize, len: usize) {
        let end = off + len;
        let start = self
            .free
            .range(..=off)
            .next_back()
            .map_or(off, |(&o, _)| o);
        let overlapping: Vec<usize> = self
            .free
            .range(start..end)
            .filter(|(&o, r)| o + r.len > off)
            .map(|(&o, _)| o)
            .collect();
        let mut cursor = off;
        for o in overlapping {
            let r = self.remove_raw(o);
            assert!(o <= cursor, "taken bytes are not all free");
            cursor = cursor.max(o + r.len);
            if o < off {
                self.insert_raw(
                    o,
                    FreeRange {
                        len: off - o,
                        guard: r.guard,
                    },
                );
            }
            if o + r.len > end {
                self.insert_raw(
                    end,
                    FreeRange {
                        len: o + r.len - end,
                        guard: r.guard,
                    },
                );
            }
        }
        assert!(cursor >= end, "taken bytes are not all free");
        self.add_users(off, len);
    }

    /// Return a block to the free ranges under `guard`.
    pub fn give_back(&mut self, off: usize, len: usize, guard: Guard) {
        self.drop_users(off, len);
        self.insert_free(off, len, guard);
    }

    /// Best-fit search: the smallest free range of at least `len` bytes,
    /// preferring lower `class(guard)` (0 is best; `None` = not usable).
    /// Stops at the first range of class 0.
    pub fn find_fit(
        &self,
        len: usize,
        mut class: impl FnMut(Guard) -> Option<u8>,
    ) -> Option<(usize, u8)> {
        let mut best: Option<(usize, u8)> = None;
        for &(_, off) in self.by_size.range((len, 0)..) {
            let guard = self.free[&off].guard;
            if let Some(c) = class(guard) {
                if c == 0 {
                    return Some((off, 0));
                }
                if best.is_none_or(|(_, bc)| c < bc) {
                    best = Some((off, c));
                }
            }
        }
        best
    }

    /// Length of the largest free range.
    pub fn largest_free(&self) -> usize {
        self.by_size.iter().next_back().map_or(0, |&(l, _)| l)
    }

    /// The free range starting at `off`.
    pub fn free_at(&self, off: usize) -> Option<FreeRange> {
        self.free.get(&off).copied()
    }

    /// The free range ending exactly at `end`.
    pub fn free_ending_at(&self, end: usize) -> Option<(usize, FreeRange)> {
        self.free
            .range(..end)
            .next_back()
            .filter(|(o, r)| *o + r.len == end)
            .map(|(o, r)| (*o, *r))
    }

    /// Rewrite guards in place (e.g. to `Complete` once completion is known)
    /// and merge the neighbours that then can be merged.
    pub fn settle(&mut self, mut upgrade: impl FnMut(Guard) -> Option<Guard>) {
        let changed: Vec<(usize, FreeRange, Guard)> = self
            .free
            .iter()
            .filter_map(|(&o, &r)| upgrade(r.guard).map(|g| (o, r, g)))
            .collect();
        for (o, r, g) in changed {
            if self.free.get(&o).is_some_and(|cur| cur.len == r.len) {
                self.remove_raw(o);
                self.insert_free(o, r.len, g);
            }
        }
        // A second pass merges neighbours that had different streams'
        // guards and are now both complete.
        let offs: Vec<usize> = self.free.keys().copied().collect();
        for o in offs {
            if let Some(r) = self.free.get(&o).copied() {
                self.remove_raw(o);
                self.insert_free(o, r.len, r.guard);
            }
        }
    }

    /// Every free range, for a pass over all of them.
    pub fn free_ranges(&self) -> impl Iterator<Item = (usize, FreeRange)> + '_ {
        self.free.iter().map(|(&o, &r)| (o, r))
    }

    // ----- pages -----

    pub fn is_mapped(&self, p: usize) -> bool {
        self.pages[p].phys.is_some()
    }

    pub fn holes(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.holes.iter().map(|(&o, &l)| (o, l))
    }

    /// Mapped pages that no block overlaps, highest first.
    pub fn idle_pages(&self) -> impl Iterator<Item = usize> + '_ {
        self.idle.iter().rev().copied()
    }

    /// Guards of the free bytes of an idle page.
    pub fn page_guards(&self, p: usize) -> Vec<Guard> {
        let (ps, pe) = (p * self.page, (p + 1) * self.page);
        let mut out = Vec::new();
        let start = self
            .free
            .range(..=ps)
            .next_back()
            .map_or(ps, |(&o, _)| o);
        for (&o, r) in self.free.range(start..pe) {
            if o + r.len > ps {
                out.push(r.guard);
            }
        }
        out
    }

    /// A physical page now sits at page `p`, which was a hole: its bytes
    /// become a free range with nothing pending.
    pub fn mapped(&mut self, p: usize, phys: usize) {
        let (ps, pe) = (p * self.page, (p + 1) * self.page);
        let (&ho, &hl) = self
            .holes
            .range(..=ps)
            .next_back()
            .expect("mapped page lies in a hole");
        assert!(ho + hl >= pe, "mapped page lies in a hole");
        self.holes.remove(&ho);
        if ps > ho {
            self.holes.insert(ho, ps - ho);
        }
        if ho + hl > pe {
            self.holes.insert(pe, ho + hl - pe);
        }
        self.pages[p].phys = Some(phys);
        self.phys[phys].at = Some(p);
        self.idle.insert(p);
        self.insert_free(ps, self.page, Guard::Complete);
    }

    /// Page `p` (idle) is unmapped: its bytes leave the free ranges and
    /// become a hole. Returns the physical page.
    pub fn unmapped(&mut self, p: usize) -> usize {
        assert_eq!(self.pages[p].users, 0, "unmapping a page in use");
        let (ps, pe) = (p * self.page, (p + 1) * self.page);
        let start = self
            .free
            .range(..=ps)
            .next_back()
            .map_or(ps, |(&o, _)| o);
        let overlapping: Vec<usize> = self
            .free
            .range(start..pe)
            .filter(|(&o, r)| o + r.len > ps)
            .map(|(&o, _)| o)
            .collect();
        for o in overlapping {
            let r = self.remove_raw(o);
            if o < ps {
                self.insert_raw(
                    o,
                    FreeRange {
                        len: ps - o,
                        guard: r.guard,
                    },
                );
            }
            if o + r.len > pe {
                self.insert_raw(
                    pe,
                    FreeRange {
                        len: o + r.len - pe,
                        guard: r.guard,
                    },
                );
            }
        }
        // Add the hole, merging with neighbouring holes.
        let (mut ho, mut hl) = (ps, self.page);
        if let Some((&lo, &ll)) = self.holes.range(..ps).next_back() {
            if lo + ll == ps {
                self.holes.remove(&lo);
                ho = lo;
                hl += ll;
            }
        }
        if let Some(rl) = self.holes.remove(&pe) {
            hl += rl;
        }
        self.holes.insert(ho, hl);
        self.idle.remove(&p);
        let phys = self.pages[p].phys.take().expect("page was mapped");
        self.phys[phys].at = None;
        phys
    }

    /// Check every invariant (tests only; linear time).
    #[cfg(test)]
    pub fn check(&self) {
        let mut cursor = 0usize;
        let mut items: Vec<(usize, usize, bool)> = self
            .free
            .iter()
            .map(|(&o, r)| (o, r.len, true))
            .chain(self.holes.iter().map(|(&o, &l)| (o, l, false)))
            .collect();
        items.sort();
        for (o, l, is_free) in &items {
            assert!(*o >= cursor, "ranges overlap at {o}");
            cursor = o + l;
            if *is_free {
                for p in self.page_span(*o, *l) {
                    assert!(self.pages[p].phys.is_some(), "free range on unmapped page");
                }
            } else {
                assert!(o % self.page == 0 && l % self.page == 0);
                for p in self.page_span(*o, *l) {
                    assert!(self.pages[p].phys.is_none(), "hole over mapped page");
                }
            }
        }
        assert_eq!(self.free.len(), self.by_size.len());
        for (p, slot) in self.pages.iter().enumerate() {
            let idle = slot.phys.is_some() && slot.users == 0;
            assert_eq!(self.idle.contains(&p), idle, "idle set wrong at page {p}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: usize = 1 << 21;

    fn arena_with_pages(n: usize) -> Arena {
        let mut a = Arena::new(64 * PAGE, PAGE);
        for p in 0..n {
            let idx = a.phys.insert(PhysPage {
                handle: Physical(p as u64),
                at: None,
            });
            a.mapped(p, idx);
        }
        a.check();
        a
    }

    #[test]
    fn fresh_pages_coalesce_into_one_free_range() {
        let a = arena_with_pages(3);
        assert_eq!(a.largest_free(), 3 * PAGE);
    }

    #[test]
    fn take_and_give_back_restore_one_range() {
        let mut a = arena_with_pages(2);
        a.take(512, 4096);
        a.check();
        assert_eq!(a.largest_free(), 2 * PAGE - 4096 - 512);
        a.give_back(512, 4096, Guard::After { stream: 1, epoch: 1 });
        a.check();
        assert_eq!(a.largest_free(), 2 * PAGE);
    }

    #[test]
    fn different_streams_do_not_merge() {
        let mut a = arena_with_pages(1);
        a.take(0, 1024);
        a.take(1024, 1024);
        a.give_back(0, 1024, Guard::After { stream: 1, epoch: 1 });
        a.give_back(1024, 1024, Guard::After { stream: 2, epoch: 1 });
        a.check();
        let fit = a.find_fit(2048, |g| match g {
            Guard::After { stream: 1, .. } => Some(0),
            _ => None,
        });
        assert_eq!(fit, None, "stream 2's free must not be reachable through stream 1's");
        a.settle(|_| Some(Guard::Complete));
        a.check();
        assert_eq!(a.largest_free(), PAGE);
    }

    #[test]
    fn unmapping_an_idle_page_splits_free_ranges_and_makes_a_hole() {
        let mut a = arena_with_pages(3);
        a.take(0, 100);
        a.check();
        let phys = a.unmapped(1);
        a.check();
        assert!(!a.is_mapped(1));
        assert_eq!(a.largest_free(), PAGE);
        a.mapped(1, phys);
        a.check();
        assert_eq!(a.largest_free(), 3 * PAGE - 100);
    }

    #[test]
    fn best_fit_prefers_class_zero_then_smallest() {
        let mut a = arena_with_pages(1);
        a.take(0, PAGE);
        a.give_back(0, 4096, Guard::After { stream: 2, epoch: 1 });
        a.give_back(8192, 8192, Guard::After { stream: 1, epoch: 1 });
        a.give_back(32768, 4096, Guard::After { stream: 1, epoch: 2 });
        a.check();
        let class = |g| match g {
            Guard::After { stream: 1, .. } => Some(0),
            Guard::After { .. } => Some(1),
            Guard::Complete => Some(0),
        };
        assert_eq!(a.find_fit(4096, class), Some((32768, 0)));
        assert_eq!(a.find_fit(8192, class), Some((8192, 0)));
    }
}
