//! Placement: where a block goes. Pure decisions over the arena's
//! bookkeeping and what is known complete, under the arena's lock: the
//! zone and alignment of a request, whether a guard lets a stream reuse a
//! range (steps 1–3 of the reuse order), the best-fit and first-fit
//! searches, the windows that need the fewest driver binds, and which
//! idle pages to move. Nothing here calls the device.

use crate::arena::{Arena, FreeRange, Guard, Window, KIND_GHOST, KIND_HOLE, KIND_UNMAPPED};
use crate::config::ReusePolicy;
use crate::ordering::{Completion, VectorClock};
use crate::sync::MutexGuard;

/// The arena and what the pool has learnt about completion, under one lock.
#[derive(Debug)]
pub(crate) struct ArenaState {
    pub arena: Arena,
    /// What is known complete, per stream.
    pub done: Completion,
    /// Scratch space of `pick_victims` (no allocation per call).
    victim_runs: Vec<(bool, u64, usize)>,
    /// Scratch space of page mapping (see [`MapScratch`]), boxed so that
    /// taking it out for a call and putting it back moves a pointer (the
    /// struct is many vectors); `None` only while a call has it.
    pub map_scratch: Option<Box<MapScratch>>,
    /// Whether a held ghost mapping may come back for a stream ordered
    /// after its frees (see [`ArenaState::rebind_guard_for`]); page
    /// mapping turns it off for a second try when a window chosen that
    /// way could not be had.
    pub rebind_held: bool,
    /// The first pages of the windows the last few searches for huge
    /// blocks chose, latest first (`usize::MAX`: none): where the next
    /// search looks first (see [`paged_best_window`]).
    recent: std::cell::Cell<[usize; RECENT_WINDOWS]>,
    /// The zones' bounds in bytes: zone `z` is `bounds[z]..bounds[z + 1]`
    /// (see [`zone_bounds`]). The address space and the page size never
    /// change, so they are worked out once rather than per request.
    bounds: [usize; 5],
}

/// The bounds of the four zones of an address space of `va` bytes in pages
/// of `page` bytes: each quarter of the space rounded down to a page, the
/// last one up to the end.
pub(crate) fn zone_bounds(va: usize, page: usize) -> [usize; 5] {
    let quarter = |n: usize| (va / 4 * n) / page * page;
    [0, quarter(1), quarter(2), quarter(3), va]
}

impl ArenaState {
    pub fn new(mut arena: Arena) -> Self {
        // Best fit serves the small and huge zones only, first fit the
        // medium and big ones: each index is kept where it is used.
        let bounds = zone_bounds(arena.va_size(), arena.page());
        let [_, q1, _, q3, va] = bounds;
        if q1 < q3 {
            arena.set_best_fit_regions(vec![0..q1, q3..va]);
            // First fit serves the medium and big zones only.
            arena.set_first_fit_region(q1..q3);
        }
        ArenaState {
            arena,
            done: Completion::default(),
            victim_runs: Vec::new(),
            map_scratch: Some(Box::default()),
            rebind_held: true,
            recent: std::cell::Cell::new([usize::MAX; RECENT_WINDOWS]),
            bounds,
        }
    }

    /// The windows (first pages) the last searches for huge blocks chose.
    fn recent_windows(&self) -> impl Iterator<Item = usize> {
        self.recent.get().into_iter().filter(|&c| c != usize::MAX)
    }

    /// Window `c` (its first page) was chosen: first among the recent
    /// ones, the oldest forgotten.
    fn remember_window(&self, c: usize) {
        let mut r = self.recent.get();
        let at = r.iter().position(|&x| x == c).unwrap_or(RECENT_WINDOWS - 1);
        r.copy_within(0..at, 1);
        r[0] = c;
        self.recent.set(r);
    }

    /// Where in the address space a request of `len` bytes is placed: one
    /// zone per size class (a quarter of the address space each). Small
    /// blocks apart from large ones, so that short-lived large blocks do
    /// not leave pages pinned by small long-lived ones; big and huge
    /// blocks apart from medium ones and from each other, so that each
    /// class finds its own ranges, and their ghost mappings, again at the
    /// next step of a training loop instead of the ranges of another class.
    pub fn zone(&self, len: usize) -> std::ops::Range<usize> {
        let z = if len < SMALL_LIMIT {
            0
        } else if len < BIG_LIMIT {
            1
        } else if len < HUGE_LIMIT {
            2
        } else {
            3
        };
        self.bounds[z]..self.bounds[z + 1]
    }

    /// Which quarter of the address space (0 small, 1 medium, 2 big,
    /// 3 huge) page `p` lies in.
    pub fn zone_of(&self, p: usize) -> usize {
        // The bounds rise, so the zone is the number of them at or below.
        let off = p * self.arena.page();
        self.bounds[1..4].iter().filter(|&&b| off >= b).count()
    }

    /// Whether a request of `len` bytes is placed first-fit by address
    /// (medium and big requests): at the lowest window of its zone that
    /// holds no block in use, whether its pages are mapped there or not.
    /// Placement then depends on the address space alone, so a training
    /// loop puts each block where it was one step before, and the pages
    /// it needs there are that place's ghost mappings, reactivated with no
    /// driver call. A best fit among mapped ranges, or the window that
    /// needs the fewest binds, depends on where pages happen to be mapped,
    /// which moves every step (measured, gpt2-fixed warm pass: 6194 remaps
    /// that way, 842 first-fit). Huge requests keep the fewest-binds
    /// window (first-fit there: 24029 remaps).
    pub fn first_fit(&self, len: usize) -> bool {
        (SMALL_LIMIT..HUGE_LIMIT).contains(&len)
    }

    /// Alignment of a request of `len` bytes: big and huge blocks start on
    /// a page, so that they share no page with a neighbour and their pages
    /// fall idle, all of them, when they are freed.
    pub fn align(&self, len: usize) -> usize {
        if len >= BIG_LIMIT {
            self.arena.page()
        } else {
            1
        }
    }

    /// Whether the device work before a free is known to be done (the only
    /// condition under which its memory may be unmapped or released).
    pub fn is_complete(&self, guard: Guard) -> bool {
        self.done.is_complete(guard)
    }

    /// Whether every free byte of page `p` is known complete, so the page
    /// may be unmapped, moved or released.
    pub fn page_complete(&self, p: usize) -> bool {
        // With no free range pending anywhere, every free byte is complete.
        !self.arena.any_pending() || self.arena.page_guards_all(p, |g| self.is_complete(g))
    }

    /// Whether the ghost mapping over page `p` is held by a guard not
    /// known complete (see [`Arena::hold_mapping`]): it may be neither
    /// unmapped nor reactivated yet.
    #[inline]
    pub fn held(&self, p: usize) -> bool {
        self.arena.any_held()
            && self
                .arena
                .mapping_base(p)
                .and_then(|b| self.arena.hold(b))
                .is_some_and(|g| !self.is_complete(g))
    }

    /// Whether any page of `[start, start + len)` is [`held`](Self::held)
    /// and may not come back for `m`'s stream (see
    /// [`ArenaState::rebind_guard_for`]): a window no bind may cover.
    pub fn window_held(&self, start: usize, len: usize, m: &Mover<'_>) -> bool {
        self.arena.any_held()
            && self
                .arena
                .page_span(start, len)
                .any(|p| self.held(p) && self.rebind_guard_for(p, m).is_none())
    }

    /// Whether some mapping of physical unit `i` is held by a guard not
    /// known complete (so `i` may not be released).
    pub fn phys_held(&self, i: usize) -> bool {
        self.arena.any_held() && self.arena.mappings(i).iter().any(|&b| self.held(b))
    }

    /// Forget the holds whose guards are known complete.
    pub fn drop_complete_holds(&mut self) {
        if self.arena.any_held() {
            let done = &self.done;
            self.arena.drop_holds(|g| done.is_complete(g));
        }
    }

    /// Whether every free byte of idle page `p` is free under a guard
    /// known complete or pending on one stream only, whose frees `m`'s
    /// stream may reuse now (its own, or ones it is ordered after), some
    /// of them pending: memory that stream may use at another address,
    /// but which may not be unmapped yet. The guard covering them all, if
    /// so.
    pub fn page_pending_for(&self, p: usize, m: &Mover<'_>) -> Option<Guard> {
        let (stream, epoch) = self.page_guard_for(p, m).ok()??;
        Some(Guard::After { stream, epoch })
    }

    /// The guards of page `p`'s free bytes as `m`'s stream sees them:
    /// `Ok(None)` all complete, `Ok(Some((stream, epoch)))` some pending,
    /// all on that one stream and reusable by `m`'s stream now (the latest
    /// epoch), `Err(())` otherwise.
    fn page_guard_for(&self, p: usize, m: &Mover<'_>) -> Result<Option<(u64, u64)>, ()> {
        let mut found: Option<(u64, u64)> = None;
        let ok = self
            .arena
            .page_guards_all(p, |g| merge_for(self, &mut found, g, m));
        if ok {
            Ok(found)
        } else {
            Err(())
        }
    }

    /// Whether the ghost single page at hole `p` may come back for `m`'s
    /// stream where it may not for every stream: its page idle where it
    /// is active (or spare), every free byte there and the hold on the
    /// ghost complete or pending on one stream whose frees `m`'s stream
    /// may reuse now. The guard the page's bytes take back at `p`, and
    /// that of the place it leaves (held there), if so.
    pub fn rebind_guard_for(&self, p: usize, m: &Mover<'_>) -> Option<(Guard, Option<Guard>)> {
        let phys = self.arena.mapping_at(p)?;
        let mut found: Option<(u64, u64)> = None;
        let leave = match self.arena.owner_and_pages(phys) {
            (_, k) if k > 1 => return None,
            (Some(q), _) if self.arena.users(q) > 0 => return None,
            (Some(q), _) => self.page_guard_for(q, m).ok()?,
            (None, _) => None,
        };
        found = found.or(leave);
        let base = self.arena.mapping_base(p)?;
        if let Some(h) = self.arena.hold(base) {
            if !(self.rebind_held || self.is_complete(h)) || !merge_for(self, &mut found, h, m) {
                return None;
            }
        }
        let (stream, epoch) = found?;
        let leave = leave.map(|(stream, epoch)| Guard::After { stream, epoch });
        Some((Guard::After { stream, epoch }, leave))
    }

    /// Whether physical unit `i` is active somewhere with no block in use
    /// and every free byte on all of its pages known complete: only then
    /// may it be unmapped, moved or released (always whole).
    pub fn unit_free(&self, i: usize) -> bool {
        let Some(o) = self.arena.owner(i) else {
            return false;
        };
        self.arena.unit_idle(i) && (o..o + self.arena.unit_pages(i)).all(|q| self.page_complete(q))
    }

    /// The lowest window of `len` bytes in its zone, aligned, over holes
    /// and free ranges `me` may reuse now (first fit). When no other
    /// stream has a free pending, `me` may reuse every free range (its own
    /// by stream order, the others are complete) and the ranges inside
    /// the window are not looked at.
    pub fn first_window_for(
        &self,
        len: usize,
        me: u64,
        clock: &VectorClock,
        reuse: ReusePolicy,
    ) -> Option<usize> {
        self.first_window_at(len, me, clock, reuse).map(|w| w.0)
    }

    /// [`first_window_for`](Self::first_window_for), with where the window
    /// lies, for [`Arena::take_in_window`].
    #[inline]
    fn first_window_at(
        &self,
        len: usize,
        me: u64,
        clock: &VectorClock,
        reuse: ReusePolicy,
    ) -> Option<(usize, Window)> {
        let (align, zone) = (self.align(len), self.zone(len));
        if self.arena.pending_only_of(me) {
            return self.arena.first_window_any_at(len, align, &zone);
        }
        self.arena.first_window_at(len, align, &zone, |g| {
            self.classify(g, me, clock, reuse).is_some()
        })
    }

    /// Steps 1–3: may `me`, whose waits are `clock`, reuse memory under
    /// `guard` now? `Some(class)`, lower is preferred; `None` = not yet.
    pub fn classify(
        &self,
        guard: Guard,
        me: u64,
        clock: &VectorClock,
        reuse: ReusePolicy,
    ) -> Option<u8> {
        match guard {
            Guard::Complete => Some(0),
            // 1. Own stream: stream order alone makes it safe.
            Guard::After { stream, .. } if stream == me => Some(0),
            // 2. Ordered before us by a host synchronisation...
            Guard::After { stream, epoch } if self.done.synced(stream) >= epoch => Some(1),
            // ...or by event waits made through the pool (transitively).
            Guard::After { stream, epoch }
                if reuse.follow_event_dependencies && clock.get(stream) >= epoch =>
            {
                Some(1)
            }
            // 3. Observed complete, no dependency added.
            Guard::After { stream, epoch }
                if reuse.opportunistic && self.done.observed(stream) >= epoch =>
            {
                Some(2)
            }
            Guard::After { .. } => None,
        }
    }
}

/// How many windows chosen by the last searches for huge blocks the next
/// one weighs first: a training step of GPT-2 places three huge blocks,
/// each in a window of its own, the same ones step after step.
const RECENT_WINDOWS: usize = 4;

/// Requests below this size are placed in the small zone (measured on the
/// GPT-2 traces: keeping sub-MiB blocks apart lowered the warm-pass
/// footprint on gpt2-varlen from 1.023 to 1.020 of peak live).
const SMALL_LIMIT: usize = 1 << 20;

/// Requests from this size on are big: page-aligned, in their own zone.
/// Rounding every block of at least 16 MiB up to whole pages costs 0.1 %
/// (gpt2-fixed) and 0.3 % (gpt2-varlen) of peak live; at 4 MiB it would
/// cost 2.1 % and 2.5 %.
const BIG_LIMIT: usize = 16 << 20;

/// Requests from this size on are huge (GPT-2's logits buffers) and have a
/// zone of their own: they need the longest contiguous ranges.
const HUGE_LIMIT: usize = 256 << 20;

/// The arena's state as the arena's lock hands it out.
pub(crate) type State<'a> = MutexGuard<'a, ArenaState>;

impl ArenaState {
    /// [`pick_victims`] with the state's own scratch space.
    pub fn victims_into(
        &mut self,
        exclude: &std::ops::RangeInclusive<usize>,
        zone: usize,
        want: usize,
        out: &mut Vec<usize>,
    ) {
        let mut runs = std::mem::take(&mut self.victim_runs);
        pick_victims(self, exclude, zone, want, &mut runs, out);
        self.victim_runs = runs;
    }

    /// [`ArenaState::victims_into`] into a vector of their own.
    #[cfg(test)]
    pub fn victims(
        &mut self,
        exclude: &std::ops::RangeInclusive<usize>,
        zone: usize,
        want: usize,
    ) -> Vec<usize> {
        let mut out = Vec::new();
        self.victims_into(exclude, zone, want, &mut out);
        out
    }
}

/// The window of `len` bytes in `zone`, starting on a multiple of `align`,
/// that needs the fewest driver binds: it may span any run of holes and
/// free ranges usable by `me` (no block in use inside it). A hole page
/// costs a bind unless its ghost mapping can come back. Returns (binds,
/// pages to activate, start); ties go to fewer pages to activate, then to
/// the lowest address, so that a training loop finds the same window again.
///
/// `keep_ghosts`: a bind over a ghost mapping (one whose physical page is
/// in use elsewhere, so it cannot come back now) unmaps that ghost, and
/// with it the place where a later block of the same shape would have
/// found that page again for free; each such ghost then weighs
/// [`GHOST_WEIGHT`] binds more. A huge block whose pattern of idle pages
/// differs much from the one its usual window remembers then binds a
/// window of its own rather than overwrite that one, and both patterns
/// come back, without a bind, when a training loop meets them again (the
/// first steps of every pass, then the steps that repeat).
#[allow(clippy::too_many_arguments)]
pub(crate) fn best_window(
    st: &State<'_>,
    len: usize,
    align: usize,
    zone: &std::ops::Range<usize>,
    me: u64,
    clock: &VectorClock,
    reuse: ReusePolicy,
    keep_ghosts: bool,
) -> Option<(usize, usize, usize)> {
    if align == st.arena.page() {
        return paged_best_window(st, len, zone, me, clock, reuse, keep_ghosts);
    }
    walked_best_window(st, len, align, zone, me, clock, reuse, keep_ghosts)
}

/// [`best_window`] by weighing every window [`each_window`] offers: one
/// or two per page of every usable span.
#[allow(clippy::too_many_arguments)]
fn walked_best_window(
    st: &State<'_>,
    len: usize,
    align: usize,
    zone: &std::ops::Range<usize>,
    me: u64,
    clock: &VectorClock,
    reuse: ReusePolicy,
    keep_ghosts: bool,
) -> Option<(usize, usize, usize)> {
    let weight = if keep_ghosts { GHOST_WEIGHT } else { 0 };
    let key = |(binds, acts, start): (usize, usize, usize), lost: usize| {
        (binds + weight * lost, acts, start)
    };
    let mut best: Option<((usize, usize, usize), usize)> = None;
    each_window(st, len, align, zone, me, clock, reuse, |cand, lost| {
        if best.is_none_or(|(b, bl)| key(cand, lost) < key(b, bl)) {
            best = Some((cand, lost));
        }
    });
    best.map(|(b, _)| b)
}

/// [`best_window`] for windows that start on a page (huge blocks), with
/// the same answer as [`walked_best_window`] for a fraction of its work:
/// the windows of a span start on every page, each covers the same number
/// of pages `n`, so one pass over the span's pages slides the window by a
/// page at a time, adding the page that enters and taking off the one that
/// leaves.
///
/// Whether a ghost mapping can come back (which decides whether its page
/// costs a bind) is the dear part of a page's cost, so it is worked out
/// only where it may matter. Whether each page is active, a ghost or never
/// mapped is cheap (the arena keeps it per page, and as page sets); with
/// every ghost counted as coming back, that gives per window a lower
/// bound of its key (weighted binds at least those of its never-mapped
/// pages, activations exact, start). No window whose bound is above a key
/// already found can win: its key is at least its bound.
///
/// The key to beat comes first from the windows the last searches chose
/// (a training loop's huge blocks go back to the same windows step after
/// step); from there the spans are walked in address order, passing over
/// runs of windows whose bounds are above it, which one bound tells (see
/// [`bound_skip`]). With no such window, every window's bound is slid and
/// the lowest one's key is the one to beat ([`lowest_bound_first`]).
/// Measured on gpt2-fixed (host, `--va-size 56G`, warm pass): 90 searches
/// slid 193,509 bounds and worked out 117,301 ghosts the second way; the
/// first way counts 1,292 bounds, passes over 146,553 windows and works
/// out 35,381 ghosts.
fn paged_best_window(
    st: &State<'_>,
    len: usize,
    zone: &std::ops::Range<usize>,
    me: u64,
    clock: &VectorClock,
    reuse: ReusePolicy,
    keep_ghosts: bool,
) -> Option<(usize, usize, usize)> {
    let weight = if keep_ghosts { GHOST_WEIGHT } else { 0 };
    let page = st.arena.page();
    let n = len.div_ceil(page);
    if n.saturating_mul(1 + GHOST_WEIGHT) > FIELD_MAX {
        // Sums that could spill from one field into the next: weigh every
        // window the long way (the same answer).
        return walked_best_window(st, len, page, zone, me, clock, reuse, keep_ghosts);
    }
    // What each page cost adds to a window's sums (see [`Sums`]).
    let vals: [Sums; 16] = std::array::from_fn(|t| {
        let t = t as u8;
        let binds = ((t & BIND) >> 1) as Sums;
        let over = ((t & OVER_GHOST) >> 2) as Sums;
        ((binds + weight as Sums * over) << (2 * FIELD)) | (((t & HOLE) as Sums) << FIELD) | binds
    });
    let any_pending = st.arena.any_pending();
    let mover = Mover { me, clock, reuse };
    // Per span: its first and last window start pages, and where its
    // pages' costs begin in `terms`.
    let mut spans: Vec<(usize, usize, usize)> = Vec::new();
    let mut terms: Vec<u8> = Vec::new();
    for (l, r) in usable_spans(st, zone, me, clock, reuse) {
        if r - l < len {
            continue;
        }
        // Past the last page ever mapped every window costs all its pages,
        // and the first of them is the best: stop there.
        let fresh_from = st
            .arena
            .last_mapped_in(l / page..=(r - 1) / page)
            .map_or(l, |p| ((p + 1) * page).max(l));
        let r = r.min(fresh_from.next_multiple_of(page) + len);
        // Windows start on pages qlo..=qhi and cover pages qlo..qhi + n.
        let qlo = l.div_ceil(page);
        if qlo * page + len > r {
            continue;
        }
        let qhi = (r - len) / page;
        spans.push((qlo, qhi, terms.len()));
        // The arena keeps each page's kind in these very flags.
        terms.extend_from_slice(st.arena.page_kinds(qlo..qhi + n));
    }
    // Works out the ghosts among the costs of pages `first..` held at
    // `ts` (no longer a lower bound there: exact).
    let resolve = |ts: &mut [u8], first: usize| {
        for (t, p) in ts.iter_mut().zip(first..) {
            if *t & GHOST != 0 {
                *t = if ghost_available_for(st, p, any_pending, Some(&mover)) {
                    HOLE
                } else {
                    HOLE | BIND | OVER_GHOST
                };
            }
        }
    };
    // A window's key: (weighted binds and activations, start).
    let key = |s: Sums, start: usize| (s >> FIELD, start);
    let mask = (1 << FIELD) - 1;
    let answer = |(_, s): ((Sums, usize), Sums), start: usize| {
        st.remember_window(start / page);
        Some(((s & mask) as usize, ((s >> FIELD) & mask) as usize, start))
    };
    let span_of = |c: usize| spans.iter().find(|s| s.0 <= c && c <= s.1).copied();
    // A window's bound (its key's first part with every ghost counted as
    // coming back: unmapped pages weighed as binds, holes as pages to
    // activate), from the arena's page sets, a word of 64 pages at a time.
    let bound_at = |q: usize| {
        let (holes, unmapped) = st.arena.holes_and_unmapped(q..q + n);
        ((unmapped as Sums) << FIELD) | holes as Sums
    };
    // 1. The windows the last searches chose that are windows here, by
    // bound: a training loop places its huge blocks in the same windows
    // step after step, so the best of their keys is usually the best key
    // of all, or close, and only the windows whose bound is not above it
    // can beat it or tie.
    let mut recent = [(Sums::MAX, 0); RECENT_WINDOWS];
    for (r, c) in recent.iter_mut().zip(st.recent_windows()) {
        if span_of(c).is_some() {
            *r = (bound_at(c), c);
        }
    }
    recent.sort_unstable();
    let mut seed: Option<((Sums, usize), Sums)> = None;
    for (b, c) in recent {
        if b == Sums::MAX || seed.is_some_and(|(k, _)| b > k.0) {
            break;
        }
        let (qlo, _, at) = span_of(c).expect("a window of a span");
        let window = &mut terms[at + c - qlo..at + c - qlo + n];
        resolve(window, c);
        let s: Sums = window.iter().map(|&t| val(&vals, t)).sum();
        if seed.is_none_or(|(k, _)| key(s, c * page) < k) {
            seed = Some((key(s, c * page), s));
        }
    }
    let Some(mut best) = seed else {
        return lowest_bound_first(st, &spans, &mut terms, n, &vals, resolve)
            .and_then(|(b, start)| answer(b, start));
    };
    // 2. In address order, every window whose bound is not above the
    // best key so far: its ghosts worked out, weighed. A window whose
    // bound is above tells how many windows after it are above too (each
    // page further changes a bound by one page at most): those are
    // passed over; the bounds of a run of windows at or below are slid a
    // page at a time over the page kinds.
    let bval = |t: u8| ((((t & BIND) >> 1) as Sums) << FIELD) | (t & HOLE) as Sums;
    for &(qlo, qhi, at) in &spans {
        let kinds = st.arena.page_kinds(qlo..qhi + n);
        let (mut k, mut b) = (qlo, bound_at(qlo));
        loop {
            let limit = best.0 .0;
            if b > limit {
                let d = bound_skip(b, limit);
                if k + d > qhi {
                    break;
                }
                if d < SKIP_RECOUNT {
                    for q in k..k + d {
                        b = b + bval(kinds[q + n - qlo]) - bval(kinds[q - qlo]);
                    }
                    k += d;
                } else {
                    k += d;
                    b = bound_at(k);
                }
                continue;
            }
            // The run of windows from `k` whose bounds stay within the
            // limit; `b` ends as the bound of the window after it.
            let mut k1 = k;
            while k1 < qhi {
                b = b + bval(kinds[k1 + n - qlo]) - bval(kinds[k1 - qlo]);
                if b > limit {
                    break;
                }
                k1 += 1;
            }
            let ts = &mut terms[at + k - qlo..at + k1 - qlo + n];
            resolve(ts, k);
            slide(ts, n, &vals, |j, s| {
                let cand = key(s, (k + j) * page);
                if cand < best.0 {
                    best = (cand, s);
                }
            });
            if k1 >= qhi {
                break;
            }
            k = k1 + 1;
        }
    }
    answer(best, best.0 .1)
}

/// Windows in a row whose bounds [`bound_skip`] passes over, from which
/// the next bound is counted afresh from the page sets rather than slid
/// page by page (each costs about as much as 8 pages slid).
const SKIP_RECOUNT: usize = 8;

/// How many windows, from one whose bound `b` (see [`Sums`]: weighted
/// binds above [`FIELD`], activations below) is above `limit`, have
/// bounds above it too: a window one page further has at most one
/// unmapped page and one hole less. While its unmapped pages are more
/// than the limit's binds, a window is above; where the limit has no
/// binds, so is one whose holes are more than the limit's activations.
fn bound_skip(b: Sums, limit: Sums) -> usize {
    let mask = (1 << FIELD) - 1;
    let (u, h, lu, lh) = (b >> FIELD, b & mask, limit >> FIELD, limit & mask);
    let mut d = u.saturating_sub(lu);
    if lu == 0 {
        d = d.max(h.saturating_sub(lh));
    }
    d.max(1) as usize
}

/// [`paged_best_window`] with no window remembered to start from: every
/// window's bound, slid over the spans' page costs `terms`; the lowest
/// bound's window weighed first; then per span, the stretch from the first
/// to the last window whose bound is not above the best key, weighed.
/// Returns the best (key, sums) and start.
#[allow(clippy::type_complexity)]
fn lowest_bound_first(
    st: &State<'_>,
    spans: &[(usize, usize, usize)],
    terms: &mut [u8],
    n: usize,
    vals: &[Sums; 16],
    resolve: impl Fn(&mut [u8], usize),
) -> Option<(((Sums, usize), Sums), usize)> {
    let page = st.arena.page();
    let key = |s: Sums, start: usize| (s >> FIELD, start);
    // Every window's bound (weighted binds and activations), in address
    // order, and the lowest: windows come in address order, so the first
    // of equal bounds is the lowest window. Real bounds are far below
    // `Sums::MAX`. One per window: sized once rather than grown push by
    // push.
    let mut bounds: Vec<Sums> =
        Vec::with_capacity(spans.iter().map(|&(qlo, qhi, _)| qhi - qlo + 1).sum());
    let (mut low, mut q) = (Sums::MAX, 0);
    for &(qlo, qhi, at) in spans {
        slide(&terms[at..at + qhi - qlo + n], n, vals, |k, s| {
            let b = s >> FIELD;
            bounds.push(b);
            if b < low {
                (low, q) = (b, qlo + k);
            }
        });
    }
    if low == Sums::MAX {
        return None;
    }
    // Its key is the one to beat: (key, sums).
    let &(qlo, _, at) = spans
        .iter()
        .find(|s| s.0 <= q && q <= s.1)
        .expect("the window lies in a span");
    let window = &mut terms[at + q - qlo..at + q - qlo + n];
    resolve(window, q);
    let s: Sums = window.iter().map(|&t| val(vals, t)).sum();
    let mut best = (key(s, q * page), s);
    if s >> FIELD == low {
        // Nothing can beat it: every other window's key is at least its
        // bound, which is above, or equal for a later start.
        return Some((best, q * page));
    }
    // Per span, the stretch from the first to the last window whose bound
    // is not above the best key (equal ones are taken whatever their
    // start: a few windows more, one comparison less per window): their
    // ghosts worked out, each weighed.
    let mut rest = &bounds[..];
    for &(qlo, qhi, at) in spans {
        let (bs, later) = rest.split_at(qhi - qlo + 1);
        rest = later;
        let limit = best.0 .0;
        let Some(klo) = bs.iter().position(|&b| b <= limit) else {
            continue;
        };
        let khi = bs.iter().rposition(|&b| b <= limit).expect("one is");
        let ts = &mut terms[at..at + qhi - qlo + n];
        let ts = &mut ts[klo..khi + n];
        resolve(ts, qlo + klo);
        slide(ts, n, vals, |k, s| {
            let cand = key(s, (qlo + klo + k) * page);
            if cand < best.0 {
                best = (cand, s);
            }
        });
    }
    Some((best, best.0 .1))
}

/// A page's cost in [`paged_best_window`], in the flags of the arena's
/// page kinds (which it starts from): a hole (a page to activate)...
const HOLE: u8 = KIND_HOLE;
/// ...that costs a bind (an unmapped page, or a ghost that cannot come
/// back)...
const BIND: u8 = KIND_UNMAPPED;
/// ...over a ghost mapping that cannot come back now, lost to the bind.
const OVER_GHOST: u8 = 4;
/// A hole over a ghost mapping not yet worked out: counted as coming
/// back (no bind), which makes the window's cost a lower bound.
const GHOST: u8 = KIND_GHOST;

/// A window's sums in one number, so that a slide adds and takes off one
/// value per page: weighted binds from bit `2 * FIELD` on, activations
/// from bit `FIELD`, binds from bit 0. [`paged_best_window`] slides only
/// windows whose pages times `1 + GHOST_WEIGHT` fit in [`FIELD_MAX`], so
/// no field spills into the next, and comparing `sums >> FIELD` compares
/// (weighted binds, activations).
type Sums = u64;

/// Bits of each field of [`Sums`].
const FIELD: u32 = 21;

/// The most a field of [`Sums`] holds.
const FIELD_MAX: usize = (1 << FIELD) - 1;

/// What page cost `t` adds to a window's sums. Costs are flags below 16:
/// masking them tells the compiler so, and spares a bounds check per page
/// in the slides' inner loops.
#[inline]
fn val(vals: &[Sums; 16], t: u8) -> Sums {
    vals[(t & 15) as usize]
}

/// Calls `f(k, sums)` for each window of `n` pages over the page costs
/// `ts`, the `k`th starting at `ts[k]`; `vals` is what each cost adds.
fn slide(ts: &[u8], n: usize, vals: &[Sums; 16], mut f: impl FnMut(usize, Sums)) {
    if ts.len() < n {
        return;
    }
    let mut s: Sums = ts[..n].iter().map(|&t| val(vals, t)).sum();
    f(0, s);
    for (k, (&out, &inn)) in ts.iter().zip(&ts[n..]).enumerate() {
        s = s + val(vals, inn) - val(vals, out);
        f(k + 1, s);
    }
}

/// Maximal spans [l, r) of free ranges usable by `me` and holes in `zone`.
fn usable_spans(
    st: &State<'_>,
    zone: &std::ops::Range<usize>,
    me: u64,
    clock: &VectorClock,
    reuse: ReusePolicy,
) -> Vec<(usize, usize)> {
    let mut spans: Vec<(usize, usize)> = Vec::new();
    for (o, l, g) in st.arena.segments(zone) {
        if g.is_some_and(|g| st.classify(g, me, clock, reuse).is_none()) {
            continue;
        }
        let (lo, hi) = (o.max(zone.start), (o + l).min(zone.end));
        match spans.last_mut() {
            Some((_, r)) if *r == lo => *r = hi,
            _ => spans.push((lo, hi)),
        }
    }
    if st.arena.any_held() {
        cut_held(st, &mut spans, &Mover { me, clock, reuse });
    }
    spans
}

/// Cut out of `spans` (address order, disjoint) the pages of every held
/// ghost mapping whose guard is not known complete: no window may bind
/// over such a mapping (it would be unmapped while work may touch it).
fn cut_held(st: &ArenaState, spans: &mut Vec<(usize, usize)>, m: &Mover<'_>) {
    let page = st.arena.page();
    for (b, g) in st.arena.holds() {
        if st.is_complete(g) || st.rebind_guard_for(b, m).is_some() {
            continue;
        }
        let k = st.arena.mapping_at(b).map_or(1, |i| st.arena.unit_pages(i));
        let (hl, hr) = (b * page, (b + k) * page);
        let mut out = Vec::with_capacity(spans.len() + 1);
        for &(l, r) in spans.iter() {
            if r <= hl || l >= hr {
                out.push((l, r));
                continue;
            }
            if l < hl {
                out.push((l, hl));
            }
            if r > hr {
                out.push((hr, r));
            }
        }
        *spans = out;
    }
}

/// How many binds a ghost mapping unmapped by a bind of a huge block
/// weighs in [`best_window`], besides the bind itself. Measured on the
/// GPT-2 traces (host backend, 8 mappings a page; binds of gpt2-fixed's
/// warm passes 2 / 3 / 4 / 5, then gpt2-varlen's): 0 gives
/// 311 / 1089 / 624 / 279 and 8 / 2 / 2 / 2; 1 gives 307 / 190 / 105 / 109
/// and 230 / 56 / 51 / 113; 3 gives 472 / 263 / 258 / 258 and
/// 24 / 34 / 16 / 16; 6 and 7 give 931 / 390 / 396 / 145 and 14 / 0 / 0 / 0;
/// 8 gives 476 / 78 / 78 / 78 and 14 / 0 / 0 / 0; 9 to 12 give
/// 519 / 78 / 78 / 78 and the same; from 14 on gpt2-varlen's second pass
/// binds 514, and from 24 on gpt2-fixed's passes swing between dozens and
/// thousands of binds (more windows than the mappings a page keeps).
pub(crate) const GHOST_WEIGHT: usize = 8;

/// Every window [`best_window`] weighs, best first (distinct starts):
/// for when the best one cannot be had because growth is capped or the
/// device is full, and another window needs fewer new pages (one that
/// starts inside a page a live block shares can span a page fewer).
pub(crate) fn ranked_windows(
    st: &State<'_>,
    len: usize,
    zone: &std::ops::Range<usize>,
    me: u64,
    clock: &VectorClock,
    reuse: ReusePolicy,
) -> Vec<(usize, usize, usize)> {
    let mut all = Vec::new();
    each_window(st, len, 1, zone, me, clock, reuse, |cand, _| all.push(cand));
    all.sort_unstable();
    all.dedup_by_key(|c| c.2);
    all
}

/// Calls `found` with (binds, pages to activate, start) of each window
/// worth weighing, and how many of its binds unmap a ghost mapping: flush
/// with either end of a span of usable free ranges and holes, or with a
/// page boundary (between those the cost does not change).
#[allow(clippy::too_many_arguments)]
fn each_window(
    st: &State<'_>,
    len: usize,
    align: usize,
    zone: &std::ops::Range<usize>,
    me: u64,
    clock: &VectorClock,
    reuse: ReusePolicy,
    mut found: impl FnMut((usize, usize, usize), usize),
) {
    let page = st.arena.page();
    let spans = usable_spans(st, zone, me, clock, reuse);
    let (any_pending, mover) = (st.arena.any_pending(), Mover { me, clock, reuse });
    // Per page of a span, prefix sums of binds, of activations and of
    // binds over a ghost mapping.
    let mut binds: Vec<usize> = Vec::new();
    let mut acts: Vec<usize> = Vec::new();
    let mut lost: Vec<usize> = Vec::new();
    for (l, r) in spans {
        if r - l < len {
            continue;
        }
        // Past the last page ever mapped every window costs all its pages,
        // and the first of them is the best: stop there.
        let fresh_from = st
            .arena
            .last_mapped_in(l / page..=(r - 1) / page)
            .map_or(l, |p| ((p + 1) * page).max(l));
        let r = r.min(fresh_from.next_multiple_of(page).next_multiple_of(align) + len);
        let (p0, p1) = (l / page, (r - 1) / page);
        binds.clear();
        acts.clear();
        lost.clear();
        binds.push(0);
        acts.push(0);
        lost.push(0);
        for p in p0..=p1 {
            let hole = !st.arena.is_active(p);
            let bind = hole && !ghost_available_for(st, p, any_pending, Some(&mover));
            binds.push(binds[binds.len() - 1] + bind as usize);
            let over_ghost = bind && st.arena.mapping_at(p).is_some();
            lost.push(lost[lost.len() - 1] + over_ghost as usize);
            acts.push(acts[acts.len() - 1] + hole as usize);
        }
        let mut consider = |s: usize| {
            if s < l || s + len > r || s % align != 0 {
                return;
            }
            let (a, b) = (s / page - p0, (s + len - 1) / page - p0 + 1);
            found(
                (binds[b] - binds[a], acts[b] - acts[a], s),
                lost[b] - lost[a],
            );
        };
        // Windows flush with either end of the span or with a page
        // boundary: between those the cost does not change.
        consider(l);
        consider(r - len);
        for p in p0 + 1..=p1 {
            consider(p * page);
            if p * page >= len {
                consider(p * page - len);
            }
        }
        if align > 1 {
            consider(l.next_multiple_of(align));
        }
    }
}

/// The window of `len` bytes in `zone` around one hole, extended by the
/// runs of usable free ranges on either side, that needs the fewest driver binds;
/// ties go to fewer pages to activate, then to the tightest span. Returns
/// (binds, pages to activate, start).
pub(crate) fn hole_window(
    st: &State<'_>,
    len: usize,
    zone: &std::ops::Range<usize>,
    me: u64,
    clock: &VectorClock,
    reuse: ReusePolicy,
) -> Option<(usize, usize, usize)> {
    let page = st.arena.page();
    let (any_pending, mover) = (st.arena.any_pending(), Mover { me, clock, reuse });
    // (pages needing driver calls, pages to activate, window length, start)
    let mut best: Option<(usize, usize, usize, usize)> = None;
    for (ho, hl) in st.arena.holes() {
        if ho + hl <= zone.start || ho >= zone.end {
            continue;
        }
        let usable = |g: Guard| st.classify(g, me, clock, reuse).is_some();
        let left = st.arena.usable_from(ho, usable);
        let right = st.arena.usable_to(ho + hl, usable);
        let (left, right) = (left.max(zone.start), right.min(zone.end));
        if right < left + len {
            continue;
        }
        for start in [left, right - len] {
            if st.window_held(start, len, &mover) {
                continue;
            }
            let lo = start.max(ho);
            let hi = (start + len).min(ho + hl);
            let (mut need, mut driver) = (0, 0);
            if hi > lo {
                for p in lo / page..=(hi - 1) / page {
                    need += 1;
                    if !ghost_available_for(st, p, any_pending, Some(&mover)) {
                        driver += 1;
                    }
                }
            }
            let cand = (driver, need, right - left, start);
            if best.is_none_or(|b| (cand.0, cand.1, cand.2) < (b.0, b.1, b.2)) {
                best = Some(cand);
            }
        }
    }
    best.map(|(d, n, _, s)| (d, n, s))
}

/// Whether the ghost mapping at hole page `p` can be reactivated now: its
/// physical page is active nowhere, or active at an idle page whose frees
/// are complete.
///
/// For a unit of several pages the whole unit comes back (to every page
/// of its ghost mapping), so the whole unit must be free where it is.
pub(crate) fn ghost_available(st: &State<'_>, p: usize) -> bool {
    ghost_available_with(st, p, st.arena.any_pending())
}

/// [`ghost_available_with`], or else, for `mover`'s stream, a ghost whose
/// page may come back by stream order (see
/// [`ArenaState::rebind_guard_for`]).
///
/// Inlined for its common case, a ghost whose page is in use where it is
/// (neither way comes back): the window search asks this of thousands of
/// pages per huge block, and the call itself cost about as much as the
/// lookups (callgrind, gpt2-fixed warm pass).
#[inline]
pub(crate) fn ghost_available_for(
    st: &ArenaState,
    p: usize,
    any_pending: bool,
    mover: Option<&Mover<'_>>,
) -> bool {
    let Some(phys) = st.arena.mapping_at(p) else {
        return false;
    };
    match st.arena.owner_and_pages(phys) {
        (Some(q), 1) if st.arena.users(q) > 0 => false,
        _ => ghost_idle_available_for(st, p, phys, any_pending, mover),
    }
}

/// [`ghost_available_for`] for a ghost of physical unit `phys` that is
/// not a single page in use where it is active.
#[inline(never)]
fn ghost_idle_available_for(
    st: &ArenaState,
    p: usize,
    phys: usize,
    any_pending: bool,
    mover: Option<&Mover<'_>>,
) -> bool {
    let held = st.arena.any_held();
    let free = match st.arena.owner_and_pages(phys) {
        (None, _) => true,
        (Some(q), 1) => !any_pending || st.arena.page_guards_all(q, |g| st.is_complete(g)),
        (Some(_), _) => st.unit_free(phys),
    };
    if free && !(held && st.held(p)) {
        return true;
    }
    match mover {
        Some(m) if any_pending || held => st.rebind_guard_for(p, m).is_some(),
        _ => false,
    }
}

/// [`ghost_available`], told whether any free range is pending anywhere
/// (when none is, every free byte is complete).
fn ghost_available_with(st: &ArenaState, p: usize, any_pending: bool) -> bool {
    st.arena
        .mapping_at(p)
        .is_some_and(|phys| ghost_phys_available(st, phys, any_pending))
        && !st.held(p)
}

/// [`ghost_available_with`] for a ghost of physical unit `phys`.
fn ghost_phys_available(st: &ArenaState, phys: usize, any_pending: bool) -> bool {
    match st.arena.owner_and_pages(phys) {
        (None, _) => true,
        (Some(q), 1) => {
            st.arena.users(q) == 0
                && (!any_pending || st.arena.page_guards_all(q, |g| st.is_complete(g)))
        }
        (Some(_), _) => st.unit_free(phys),
    }
}

/// Whether physical page `phys` may be taken from where it is active
/// without disturbing the block being placed.
pub(crate) fn phys_movable(
    st: &State<'_>,
    phys: usize,
    block: &std::ops::RangeInclusive<usize>,
) -> bool {
    let k = st.arena.unit_pages(phys);
    st.arena
        .owner(phys)
        .is_none_or(|q| (q..q + k).all(|r| !block.contains(&r)))
}

/// Completed idle pages to move to the zone `zone`: first those whose
/// physical page has no mapping in that zone yet, then the pages idle the
/// longest. A physical page mapped twice in one zone is wanted at both
/// places at once sooner or later (blocks of one size class live
/// together), and each such clash costs a bind every step of a training
/// loop; a page idle the longest is the least likely to be wanted back
/// while the block being placed lives. Completion is checked only for the
/// pages about to be taken. Only single pages are picked: a unit of
/// several pages moves whole, into a run of pages long enough for it
/// ([`free_units`]). `scratch` is reused between calls; the pages picked
/// replace what `out` held.
pub(crate) fn pick_victims(
    st: &ArenaState,
    exclude: &std::ops::RangeInclusive<usize>,
    zone: usize,
    want: usize,
    scratch: &mut Vec<(bool, u64, usize)>,
    out: &mut Vec<usize>,
) {
    scratch.clear();
    out.clear();
    // The zone's pages (its bounds fall on pages).
    let page = st.arena.page();
    let zone_pages = st.bounds[zone] / page..st.bounds[zone + 1] / page;
    for p in st.arena.idle_pages().filter(|p| !exclude.contains(p)) {
        let phys = st.arena.mapping_at(p).expect("idle page is mapped");
        if st.arena.unit_pages(phys) > 1 {
            continue;
        }
        let in_zone = st
            .arena
            .mappings(phys)
            .iter()
            .any(|q| zone_pages.contains(q));
        scratch.push((in_zone, st.arena.idle_since(p), p));
    }
    // Pages are distinct: the order is total. Only the head of the order
    // is looked at, usually `want` pages or a few more (those not known
    // complete are skipped): sort it by chunks, each the smallest of
    // what is left, rather than every idle page.
    let mut done = 0;
    while out.len() < want && done < scratch.len() {
        let rest = &mut scratch[done..];
        let chunk = (2 * (want - out.len())).max(8).min(rest.len());
        if chunk < rest.len() {
            rest.select_nth_unstable(chunk);
        }
        rest[..chunk].sort_unstable();
        for &(_, _, p) in &rest[..chunk] {
            if out.len() == want {
                break;
            }
            if st.page_complete(p) {
                out.push(p);
            }
        }
        done += chunk;
    }
}

/// Folds guard `g` into `found` (one stream's latest pending epoch) for
/// `m`'s stream: true where `g` is complete, or pending on `found`'s
/// stream (or the first pending one) and reusable by `m`'s stream now.
fn merge_for(st: &ArenaState, found: &mut Option<(u64, u64)>, g: Guard, m: &Mover<'_>) -> bool {
    match g {
        _ if st.is_complete(g) => true,
        Guard::After { stream, epoch } => {
            if found.is_some_and(|(s, _)| s != stream)
                || st.classify(g, m.me, m.clock, m.reuse).is_none()
            {
                return false;
            }
            *found = Some((stream, found.map_or(epoch, |(_, e)| e.max(epoch))));
            true
        }
        Guard::Complete => true,
    }
}

/// The allocating stream, what it waited for and the reuse switches: to
/// whom pages with frees still pending may move (see
/// [`ArenaState::page_pending_for`]).
pub(crate) struct Mover<'c> {
    pub me: u64,
    pub clock: &'c VectorClock,
    pub reuse: ReusePolicy,
}

/// Idle single pages outside `exclude` whose free bytes are all complete
/// or pending on one stream whose frees `m`'s stream may reuse now, with
/// the guard covering them (see [`ArenaState::page_pending_for`]): pages
/// that stream may use at another address by stream order, taken only
/// where the pool would grow otherwise. The same order as [`pick_victims`]: pages with no
/// mapping in zone `zone` first, then those idle the longest. At most
/// `want`; they replace what `out` held.
pub(crate) fn pick_pending_victims(
    st: &ArenaState,
    exclude: &std::ops::RangeInclusive<usize>,
    zone: usize,
    want: usize,
    m: &Mover<'_>,
    out: &mut Vec<(usize, Guard)>,
) {
    out.clear();
    if want == 0 || !st.arena.any_pending() {
        return;
    }
    let page = st.arena.page();
    let zone_pages = st.bounds[zone] / page..st.bounds[zone + 1] / page;
    let mut found: Vec<(bool, u64, usize, Guard)> = Vec::new();
    for p in st.arena.idle_pages().filter(|p| !exclude.contains(p)) {
        let phys = st.arena.mapping_at(p).expect("idle page is mapped");
        if st.arena.unit_pages(phys) > 1 {
            continue;
        }
        let Some(g) = st.page_pending_for(p, m) else {
            continue;
        };
        let in_zone = st
            .arena
            .mappings(phys)
            .iter()
            .any(|q| zone_pages.contains(q));
        found.push((in_zone, st.arena.idle_since(p), p, g));
    }
    found.sort_unstable_by_key(|f| (f.0, f.1, f.2));
    out.extend(found.into_iter().take(want).map(|f| (f.2, f.3)));
}

/// Units of several pages that may move or be released now, whole:
/// active somewhere outside `exclude` with every page idle and complete,
/// or active nowhere (spare). Largest first, then by index; they replace
/// what `out` held. A pool without units (the default: single pages only)
/// has none, and no idle page is looked at.
pub(crate) fn free_units(
    st: &ArenaState,
    exclude: &std::ops::RangeInclusive<usize>,
    out: &mut Vec<usize>,
) {
    out.clear();
    if st.arena.units_of_pages() == 0 {
        return;
    }
    out.extend(st.arena.spare_units());
    for p in st.arena.idle_pages().filter(|p| !exclude.contains(p)) {
        let phys = st.arena.mapping_at(p).expect("idle page is mapped");
        let k = st.arena.unit_pages(phys);
        if k > 1
            && st.arena.owner(phys) == Some(p)
            && (p..p + k).all(|q| !exclude.contains(&q))
            && st.unit_free(phys)
        {
            out.push(phys);
        }
    }
    out.sort_unstable_by_key(|&i| (std::cmp::Reverse(st.arena.unit_pages(i)), i));
}

/// Steps 1–3: best fit among free ranges usable now; for first-fit
/// requests, their window if all its pages are mapped there.
pub(crate) fn fit(
    st: &mut State<'_>,
    len: usize,
    me: u64,
    clock: &VectorClock,
    reuse: ReusePolicy,
) -> Option<usize> {
    let zone = st.zone(len);
    if st.first_fit(len) {
        let (off, at) = st.first_window_at(len, me, clock, reuse)?;
        if !st.arena.span_active(off, len) {
            return None;
        }
        st.arena.take_in_window(off, len, at);
        return Some(off);
    }
    let s: &ArenaState = st;
    if s.arena.pending_only_of(me) {
        // Every free range is usable (see `first_window_for`).
        let (off, at) = s.arena.find_fit_any_at(len, s.align(len), &zone)?;
        st.arena.take_in_run(off, len, at);
        return Some(off);
    }
    let off = s
        .arena
        .find_fit(len, s.align(len), &zone, |g| {
            s.classify(g, me, clock, reuse)
        })?
        .0;
    st.arena.take(off, len);
    Some(off)
}

/// The streams whose pending frees lie in `[s, s+len)` of `run` (free
/// ranges in address order), each with the latest epoch to wait for; the
/// ranges usable by `me` now need no wait.
pub(crate) fn window_donors(
    st: &ArenaState,
    run: &[(usize, FreeRange)],
    s: usize,
    len: usize,
    me: u64,
    clock: &VectorClock,
    reuse: ReusePolicy,
) -> Vec<(u64, u64)> {
    let mut donors: Vec<(u64, u64)> = Vec::new();
    for &(o, r) in run {
        if o >= s + len {
            break;
        }
        if o + r.len <= s || st.classify(r.guard, me, clock, reuse).is_some() {
            continue;
        }
        let Guard::After { stream, epoch } = r.guard else {
            continue;
        };
        if st.is_complete(r.guard) {
            // Known complete (only not reused without a dependency because
            // opportunistic reuse is off): there is nothing to wait for.
            continue;
        }
        match donors.iter_mut().find(|(d, _)| *d == stream) {
            Some((_, e)) => *e = (*e).max(epoch),
            None => donors.push((stream, epoch)),
        }
    }
    donors
}

/// Vectors page mapping fills on every call, kept in the pool's state
/// between calls so that a request placed on the slow path allocates
/// nothing for its own bookkeeping once they have grown (each is cleared
/// before use; what they hold between calls means nothing).
#[derive(Debug, Default)]
pub(crate) struct MapScratch {
    /// The block's hole pages.
    pub targets: Vec<usize>,
    /// The hole pages left after ghosts came back.
    pub rest: Vec<usize>,
    /// Pages to bind: (page, unit).
    pub got: Vec<(usize, usize)>,
    /// Units created by the call.
    pub created: Vec<usize>,
    /// Single pages gathered for the block.
    pub pool: Vec<usize>,
    /// Where each moved page was active (tracing only).
    pub moved_from: Vec<(usize, usize)>,
    /// Physical pages moved while frees on them were pending (ordered
    /// before the allocating stream): (unit, page it was active at, guard).
    pub moved_pending: Vec<(usize, usize, Guard)>,
    /// See `rebind_singles` (page mapping).
    pub rebind: RebindScratch,
    pub plan: Plan,
}

/// Scratch space of `rebind_singles` (page mapping).
#[derive(Debug, Default)]
pub(crate) struct RebindScratch {
    pub moves: Vec<(usize, usize)>,
    pub owners: Vec<usize>,
    pub phys: Vec<usize>,
    /// Ghosts that come back by stream order: (page, unit, guard there,
    /// guard of the place it leaves).
    pub pending: Vec<(usize, usize, Guard, Option<Guard>)>,
    /// Per physical page, the call that last met it on a target (see
    /// `rebind_singles`): a page met again has a ghost on an earlier one.
    pub met: Vec<u32>,
    /// The current call's mark in `met` (never 0).
    pub call: u32,
}

/// Where the physical memory for a block's hole pages comes from (see
/// `Pages::plan`).
#[derive(Debug, Default)]
pub(crate) struct Plan {
    /// Free units moved whole: (first target page, unit).
    pub moves: Vec<(usize, usize)>,
    /// Spare single pages used.
    pub spare_used: usize,
    /// Completed idle single pages moved here.
    pub victims: Vec<usize>,
    /// Idle single pages with frees pending on the allocating stream
    /// moved here, where growth is the alternative: (page, guard).
    pub pending: Vec<(usize, Guard)>,
    /// The target pages of the spare and moved single pages, in order.
    pub singles: Vec<usize>,
    /// Free units released to make room for growth.
    pub release: Vec<usize>,
    /// Runs of target pages that growth fills: (first, count).
    pub missing: Vec<(usize, usize)>,
    /// Scratch: the free units found.
    pub free: Vec<usize>,
    /// Scratch: the free units that did not move, largest first.
    pub left: Vec<usize>,
}

impl Plan {
    /// Empty, keeping the vectors' room.
    pub fn clear(&mut self) {
        self.moves.clear();
        self.spare_used = 0;
        self.victims.clear();
        self.pending.clear();
        self.singles.clear();
        self.release.clear();
        self.missing.clear();
        self.free.clear();
        self.left.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arena::Arena;
    use crate::sync::{lock, Mutex};
    use tidepool_sys::Physical;

    /// A small deterministic generator (xorshift64*), so that a failure
    /// names the seed that found it.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: usize) -> usize {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) as usize % n
        }
    }

    /// Builds a random arena of 128 pages: single physical pages mapped
    /// at several places (ghosts), active at one of them or nowhere,
    /// blocks in use on some active pages, free ranges under guards that
    /// are complete, pending on another stream, or known complete.
    fn random_state(seed: u64) -> ArenaState {
        let page = 4096;
        let pages = 128;
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let mut st = ArenaState::new(Arena::new(pages * page, page));
        // Mapped pages crowd the low part of each zone, as they do in use.
        let pick_page = |rng: &mut Rng| {
            let zone = rng.below(4) * pages / 4;
            zone + rng.below(pages / 4).min(rng.below(pages / 4))
        };
        let mut units = Vec::new();
        for k in 0..rng.below(80) {
            units.push(st.arena.add_unit(Physical(k as u64), 1));
        }
        for _ in 0..rng.below(300) {
            let p = pick_page(&mut rng);
            if units.is_empty() || st.arena.mapping_at(p).is_some() {
                continue;
            }
            let phys = units[rng.below(units.len())];
            st.arena.record_mapping(p, phys);
            if st.arena.owner(phys).is_none() && rng.below(3) > 0 {
                st.arena.activate(p, phys);
            }
        }
        // Blocks in use, some of them freed again under various guards.
        for _ in 0..rng.below(60) {
            let p = pick_page(&mut rng);
            if !st.arena.is_active(p) || st.arena.users(p) > 0 {
                continue;
            }
            let off = p * page + rng.below(page / 2);
            let len = 1 + rng.below(page / 2);
            st.arena.take(off, len);
            if rng.below(2) == 0 {
                let guard = match rng.below(3) {
                    0 => Guard::Complete,
                    _ => Guard::After {
                        stream: 1 + rng.below(2) as u64,
                        epoch: 1 + rng.below(3) as u64,
                    },
                };
                st.arena.give_back(off, len, guard);
            }
        }
        st.done.mark_synced(2, 2);
        st
    }

    /// The zones worked out once at construction are the quarters the
    /// division formula gives, request by request and page by page, over
    /// address spaces of many sizes (some not a multiple of four pages)
    /// and several page sizes.
    #[test]
    fn precomputed_zones_are_the_quarters() {
        let quarter = |va: usize, page: usize, n: usize| (va / 4 * n) / page * page;
        let lens = [
            1,
            SMALL_LIMIT - 1,
            SMALL_LIMIT,
            BIG_LIMIT - 1,
            BIG_LIMIT,
            HUGE_LIMIT - 1,
            HUGE_LIMIT,
            usize::MAX,
        ];
        for page in [4096, 65536, 2 << 20] {
            for pages in 1..=70 {
                let va = pages * page;
                let st = ArenaState::new(Arena::new(va, page));
                for len in lens {
                    let want = if len < SMALL_LIMIT {
                        0..quarter(va, page, 1)
                    } else if len < BIG_LIMIT {
                        quarter(va, page, 1)..quarter(va, page, 2)
                    } else if len < HUGE_LIMIT {
                        quarter(va, page, 2)..quarter(va, page, 3)
                    } else {
                        quarter(va, page, 3)..va
                    };
                    assert_eq!(st.zone(len), want, "page {page}, pages {pages}, len {len}");
                }
                for p in 0..pages {
                    let want = (1..4)
                        .take_while(|&n| p * page >= quarter(va, page, n))
                        .count();
                    assert_eq!(st.zone_of(p), want, "page {page}, pages {pages}, p {p}");
                }
            }
        }
    }

    /// The victims picked by sorting the head of the order in chunks are
    /// the head of the full order of every idle page, skipping those not
    /// known complete, on random arenas, for every zone, several counts
    /// and excluded blocks.
    #[test]
    fn victims_are_the_head_of_the_full_order() {
        let mut picked = 0;
        for seed in 0..300 {
            let mut st = random_state(seed);
            for zone in 0..4 {
                for want in [0, 1, 2, 3, 5, 9, 17, 40, 200] {
                    for exclude in [0..=0, 10..=40, 90..=127] {
                        let mut all: Vec<(bool, u64, usize)> = st
                            .arena
                            .idle_pages()
                            .filter(|p| !exclude.contains(p))
                            .filter_map(|p| {
                                let phys = st.arena.mapping_at(p)?;
                                (st.arena.unit_pages(phys) == 1).then(|| {
                                    let in_zone = st
                                        .arena
                                        .mappings(phys)
                                        .iter()
                                        .any(|&q| st.zone_of(q) == zone);
                                    (in_zone, st.arena.idle_since(p), p)
                                })
                            })
                            .collect();
                        all.sort_unstable();
                        let want_pages: Vec<usize> = all
                            .iter()
                            .map(|&(_, _, p)| p)
                            .filter(|&p| st.page_complete(p))
                            .take(want)
                            .collect();
                        let got = st.victims(&exclude, zone, want);
                        assert_eq!(got, want_pages, "seed {seed}, zone {zone}, want {want}");
                        picked += got.len();
                    }
                }
            }
        }
        assert!(picked > 1000, "the random arenas have idle pages to pick");
    }

    /// Searches in a row on an arena that changes between them (blocks
    /// taken where a search chose, given back, pages moved away leaving
    /// ghosts), as a training loop makes them: the windows remembered
    /// from the last searches, stale or not, never change the answer the
    /// walk over every candidate start finds.
    #[test]
    fn remembered_windows_leave_the_answer_as_the_walk_finds_it() {
        let page = 4096;
        let (clock, reuse) = (VectorClock::default(), ReusePolicy::default());
        let (mut found, mut remembered) = (0, 0);
        for seed in 0..300 {
            let state = Mutex::new(random_state(seed));
            let mut st = lock(&state);
            let mut rng = Rng(seed | 1);
            let zone = st.zone(usize::MAX);
            let mut taken: Vec<(usize, usize)> = Vec::new();
            for _ in 0..40 {
                let len = [3 * page, 5 * page, 9 * page][rng.below(3)];
                let (me, keep) = (rng.below(3) as u64, rng.below(2) == 0);
                remembered += st.recent_windows().count();
                let walked = walked_best_window(&st, len, page, &zone, me, &clock, reuse, keep);
                let paged = paged_best_window(&st, len, &zone, me, &clock, reuse, keep);
                assert_eq!(
                    paged, walked,
                    "seed {seed}, len {len}, stream {me}, keep {keep}"
                );
                let Some((_, _, start)) = walked else {
                    continue;
                };
                found += 1;
                match rng.below(4) {
                    // Take a block over the window chosen, where all its
                    // pages are active.
                    0 | 1 if st.arena.span_active(start, len) => {
                        st.arena.take(start, len);
                        taken.push((start, len));
                    }
                    // Give a block back, complete or pending.
                    2 if !taken.is_empty() => {
                        let (o, l) = taken.swap_remove(rng.below(taken.len()));
                        let guard = match rng.below(2) {
                            0 => Guard::Complete,
                            _ => Guard::After {
                                stream: 1,
                                epoch: 5,
                            },
                        };
                        st.arena.give_back(o, l, guard);
                    }
                    // Move an idle page away: a ghost where it was.
                    _ => {
                        let idle: Vec<usize> = st.arena.idle_pages().collect();
                        if !idle.is_empty() {
                            let p = idle[rng.below(idle.len())];
                            let i = st.arena.mapping_at(p).expect("mapped");
                            if st.arena.owner(i) == Some(p) && st.page_complete(p) {
                                st.arena.deactivate(p);
                                st.arena.push_spare(i);
                            }
                        }
                    }
                }
            }
        }
        assert!(found > 5_000, "only {found} windows found");
        assert!(remembered > 20_000, "only {remembered} windows remembered");
    }

    /// The slide over a span's pages finds the window the walk over every
    /// candidate start finds, binds, activations and start alike, on
    /// random arenas, for windows of whole pages and of pages and a bit,
    /// weighing ghosts or not, in a zone and over the whole address space.
    #[test]
    fn the_paged_search_finds_the_walked_window() {
        let page = 4096;
        let (clock, reuse) = (VectorClock::default(), ReusePolicy::default());
        let mut found = 0;
        for seed in 0..400 {
            let state = Mutex::new(random_state(seed));
            let st = lock(&state);
            let va = st.arena.va_size();
            for zone in [st.zone(usize::MAX), 0..va, page / 2..va - 3 * page] {
                for len in [page, 3 * page, 5 * page - 100, 9 * page + 1, 40 * page] {
                    for me in 0..3 {
                        for keep in [false, true] {
                            let walked =
                                walked_best_window(&st, len, page, &zone, me, &clock, reuse, keep);
                            let paged = paged_best_window(&st, len, &zone, me, &clock, reuse, keep);
                            assert_eq!(
                                paged, walked,
                                "seed {seed}, zone {zone:?}, len {len}, stream {me}, keep {keep}"
                            );
                            found += walked.is_some() as usize;
                        }
                    }
                }
            }
        }
        // The arenas leave room for most requests: the comparison is not
        // one of two empty answers.
        assert!(found > 10_000, "only {found} windows found");
    }
}
