//! Page mapping: the only code that creates, maps, unmaps and releases
//! the pool's physical pages. Steps 4 and 5 of the reuse order (stitch
//! completed pages into a window, grow) choose their window through
//! `placement` and then make the driver calls here, reporting each to the
//! arena's books; trimming releases spare and completed idle pages; the
//! pool's drop unmaps and releases everything.
//!
//! Map, unmap and release act at once, not in stream order: every mapping
//! unmapped and every page released here is idle and known complete (the
//! callers' guarantee, checked through `placement`'s `page_complete` and
//! `held`), or new. A page whose frees are pending but ordered before the
//! allocating stream may be mapped at a new place (where growth is the
//! alternative): its old mapping stays, held by the frees' guard, and its
//! bytes there keep that guard.
//!
//! Physical memory comes as single pages or, for large blocks where the
//! configuration asks for it, as *units*: one handle over several
//! consecutive pages. A handle can only be mapped whole, so every
//! operation here maps, unmaps, moves and releases a unit whole, and only
//! when no block uses any of its pages.

use crate::arena::Guard;
use crate::config::{PoolConfig, ReusePolicy};
use crate::ordering::VectorClock;
use crate::placement::{
    best_window, free_units, ghost_available, hole_window, phys_movable, pick_pending_victims,
    ranked_windows, ArenaState, MapScratch, Mover, Plan, RebindScratch, State,
};
use crate::share_state::ShareState;
use tidepool_sys::{Device, DevicePtr, PhysicalOptions, SysError};

/// Why mapping memory for a request failed.
pub(crate) enum MapFailure {
    /// No virtual window is large enough.
    NoWindow,
    /// The pool's maximum size stops growth.
    Capped,
    /// The device is out of memory.
    DeviceOom(SysError),
    /// Another device error.
    Device(SysError),
}

/// Most mappings one physical page keeps (one active, the rest ghosts).
/// A page idle when the huge blocks of a training loop are placed has a
/// ghost in each window that remembers a pattern of idle pages (see
/// `best_window`'s `keep_ghosts`), besides its own place: with 4, the
/// oldest of those were unmapped and the windows forgot their patterns
/// (gpt2-fixed's warm passes 3 and 4 bound 3206 and 6438 pages, against
/// 78 and 78 with 8; 16 and 32 bind as 8 does).
const MAX_GHOSTS: usize = 8;

/// Most windows tried after the one with the fewest binds failed on the
/// cap or a full device (each try costs a walk over the window's pages).
const MAX_WINDOW_TRIES: usize = 256;

/// What page mapping needs of the pool: the device, where the pool's
/// address range starts, its configuration, and the access list every new
/// mapping gets.
pub(crate) struct Pages<'a, D: Device> {
    pub pool: u64,
    pub device: &'a D,
    pub base: DevicePtr,
    pub config: &'a PoolConfig,
    pub share: &'a ShareState,
}

impl<D: Device> Pages<'_, D> {
    /// Steps 4 and 5 in the request's own zone, aligned; where that finds
    /// no window or runs into a limit, anywhere and unaligned.
    pub fn map_any(
        &self,
        st: &mut State<'_>,
        len: usize,
        me: u64,
        clock: &VectorClock,
        reuse: ReusePolicy,
    ) -> Result<usize, MapFailure> {
        st.drop_complete_holds();
        st.rebind_held = true;
        match self.map_any_with(st, len, me, clock, reuse) {
            Err(MapFailure::Device(e)) => Err(MapFailure::Device(e)),
            Err(_) if st.arena.any_held() => {
                // A window chosen over held ghosts that could come back
                // may still need one bound over (its page wanted inside
                // the window too): again, with held ghosts as obstacles.
                st.rebind_held = false;
                let r = self.map_any_with(st, len, me, clock, reuse);
                st.rebind_held = true;
                r
            }
            r => r,
        }
    }

    /// [`Pages::map_any`], once.
    fn map_any_with(
        &self,
        st: &mut State<'_>,
        len: usize,
        me: u64,
        clock: &VectorClock,
        reuse: ReusePolicy,
    ) -> Result<usize, MapFailure> {
        let first = match self.map_window(st, len, me, clock, reuse, false) {
            Ok(off) => return Ok(off),
            Err(MapFailure::Device(e)) => return Err(MapFailure::Device(e)),
            Err(e) => e,
        };
        let failure = match self.map_window(st, len, me, clock, reuse, true) {
            Err(MapFailure::NoWindow) => first,
            Err(e @ (MapFailure::Capped | MapFailure::DeviceOom(_))) => e,
            other => return other,
        };
        if !matches!(failure, MapFailure::Capped | MapFailure::DeviceOom(_)) {
            return Err(failure);
        }
        // The window with the fewest binds needs growth that cannot be
        // had; another may need fewer new pages (free pages it can move in
        // rather than create): try the windows, best first (ranked anew:
        // the tries above may have brought ghosts back).
        let zone = 0..st.arena.va_size();
        let mover = Mover { me, clock, reuse };
        for (_, _, start) in ranked_windows(st, len, &zone, me, clock, reuse)
            .into_iter()
            .take(MAX_WINDOW_TRIES)
        {
            // Earlier tries may have brought ghosts back or moved pages,
            // so the ranking's count of pages to activate may be stale.
            match self.map_at(st, len, start, None, true, Some(&mover)) {
                Ok(off) => return Ok(off),
                Err(MapFailure::Device(e)) => return Err(MapFailure::Device(e)),
                Err(_) => {}
            }
        }
        Err(failure)
    }

    /// Steps 4 and 5: choose a virtual window of free ranges and holes,
    /// fill its unmapped pages with spare pages, completed idle pages moved
    /// from elsewhere, or new pages, and hand out the block. `relaxed`:
    /// anywhere in the address space and unaligned (the fallback when the
    /// request's own zone has no window or would need growth past the cap).
    fn map_window(
        &self,
        st: &mut State<'_>,
        len: usize,
        me: u64,
        clock: &VectorClock,
        reuse: ReusePolicy,
        relaxed: bool,
    ) -> Result<usize, MapFailure> {
        let page = st.arena.page();
        let best = if relaxed {
            best_window(
                st,
                len,
                1,
                &(0..st.arena.va_size()),
                me,
                clock,
                reuse,
                false,
            )
        } else if st.first_fit(len) {
            let s: &ArenaState = st;
            match s.first_window_for(len, me, clock, reuse) {
                // A window over a held ghost mapping cannot be bound: the
                // window with the fewest binds elsewhere in the zone.
                Some(start) if s.window_held(start, len, &Mover { me, clock, reuse }) => {
                    best_window(
                        st,
                        len,
                        st.align(len),
                        &st.zone(len),
                        me,
                        clock,
                        reuse,
                        false,
                    )
                }
                found => found.map(|start| {
                    let need = s
                        .arena
                        .holes_and_unmapped(start / page..(start + len - 1) / page + 1)
                        .0;
                    (0, need, start)
                }),
            }
        } else if st.align(len) > 1 {
            // Ghosts are weighed for blocks of single pages only: with
            // units of several pages (which come back whole, to one of
            // their ghosts) it bound more (gpt2-fixed with units of
            // 16 MiB: 540 / 511 / 477 binds on warm passes 2-4, not
            // weighed 261 / 232 / 232).
            let singles = len < self.config.unit_min_block || self.unit_pages(page) == 1;
            best_window(
                st,
                len,
                st.align(len),
                &st.zone(len),
                me,
                clock,
                reuse,
                singles,
            )
        } else {
            // Small requests: the windows around one hole.
            hole_window(st, len, &st.zone(len), me, clock, reuse)
        };
        let (_, need, start) = best.ok_or(MapFailure::NoWindow)?;
        self.map_at(
            st,
            len,
            start,
            Some(need),
            false,
            Some(&Mover { me, clock, reuse }),
        )
    }

    /// Map the unmapped pages of the window `[start, start + len)` (`need`
    /// of them, when known) and hand out the block; on failure nothing is
    /// created and the pages gathered stay the pool's (as spare pages).
    /// `loosen`: free units that lie across an edge of the window are taken
    /// off it too (see [`take_off_edge_units`]), for when memory is short.
    /// `mover`: the allocating stream, to which idle pages whose frees are
    /// pending but ordered before it may move where growth is the
    /// alternative (see [`Pages::plan`]).
    fn map_at(
        &self,
        st: &mut State<'_>,
        len: usize,
        start: usize,
        need: Option<usize>,
        loosen: bool,
        mover: Option<&Mover<'_>>,
    ) -> Result<usize, MapFailure> {
        let mut sc = st.map_scratch.take().unwrap_or_default();
        let r = self.map_at_with(st, len, start, need, loosen, mover, &mut sc);
        st.map_scratch = Some(sc);
        r
    }

    /// [`Pages::map_at`] with its scratch space `sc` (taken out of the
    /// state for the call).
    #[allow(clippy::too_many_arguments)]
    fn map_at_with(
        &self,
        st: &mut State<'_>,
        len: usize,
        start: usize,
        need: Option<usize>,
        loosen: bool,
        mover: Option<&Mover<'_>>,
        sc: &mut MapScratch,
    ) -> Result<usize, MapFailure> {
        let page = st.arena.page();
        let end = start + len;
        let block_pages = start / page..=(end - 1) / page;
        let targets = &mut sc.targets;
        targets.clear();
        st.arena
            .holes_into(*block_pages.start()..*block_pages.end() + 1, targets);
        debug_assert!(need.is_none_or(|n| n == targets.len()));

        // First, targets whose ghost mapping's physical memory is free to
        // come back: no driver call at all. A unit comes back whole, onto
        // every page of its ghost mapping.
        let rest = &mut sc.rest;
        rest.clear();
        // With no unit of several pages in the pool, every ghost is one.
        let singles = st.arena.units_of_pages() == 0
            || targets.iter().all(|&p| {
                st.arena
                    .mapping_at(p)
                    .is_none_or(|i| st.arena.unit_pages(i) == 1)
            });
        if singles {
            rebind_singles(st, targets, &block_pages, rest, mover, &mut sc.rebind);
        }
        // A unit may have ghosts both inside the window and across its
        // edge: it comes back to one of them only, so ghosts wholly inside
        // the window come back first (the one across the edge would serve
        // only part of its pages here, and keep the unit from the others).
        for &p in targets.iter().filter(|_| !singles) {
            if st.arena.is_active(p) || !ghost_inside(st, p, &block_pages) {
                continue;
            }
            if let Some(phys) = st.arena.mapping_at(p) {
                if ghost_available(st, p) && phys_movable(st, phys, &block_pages) {
                    rebind_unit(st, p, phys);
                }
            }
        }
        for &p in targets.iter().filter(|_| !singles) {
            if st.arena.is_active(p) {
                // Came back with its unit.
                continue;
            }
            match st.arena.mapping_at(p) {
                Some(phys) if ghost_available(st, p) && phys_movable(st, phys, &block_pages) => {
                    rebind_unit(st, p, phys);
                }
                _ => rest.push(p),
            }
        }
        if loosen {
            take_off_edge_units(st, &block_pages, rest);
        }
        rest.retain(|&p| !st.arena.is_active(p));
        if st.arena.any_held() && rest.iter().any(|&p| st.held(p)) {
            // Binding there would unmap a mapping pending work may touch
            // (what came back stays: free, under its guards).
            return Err(MapFailure::NoWindow);
        }
        let unit_max = if len >= self.config.unit_min_block {
            self.unit_pages(page)
        } else {
            1
        };
        let plan = &mut sc.plan;
        self.plan(st, rest, &block_pages, unit_max, mover, plan)?;
        let got = &mut sc.got;
        got.clear();
        // Pages created by this call: given back to the device if the
        // device runs out before the request is covered (a failed request
        // must not grow the pool).
        let created = &mut sc.created;
        created.clear();
        for &(p, i) in &plan.moves {
            // A whole unit moves (stitching): it is free where it is.
            if st.arena.owner(i).is_some() {
                let owner = st.arena.owner(i).expect("checked");
                st.arena.deactivate(owner);
            } else {
                st.arena.unspare(i);
            }
            got.push((p, i));
        }
        // Single pages: spare ones, then moved ones; the lowest target
        // page gets the last of them.
        let pool = &mut sc.pool;
        pool.clear();
        for _ in 0..plan.spare_used {
            pool.push(st.arena.pop_spare_single().expect("counted"));
        }
        // Where each moved page was active, for the trace of binds below.
        let tracing_binds = tracing::enabled!(tracing::Level::TRACE);
        let moved_from = &mut sc.moved_from;
        moved_from.clear();
        for &v in &plan.victims {
            let i = st.arena.deactivate(v);
            if tracing_binds {
                moved_from.push((i, v));
            }
            pool.push(i);
        }
        // Pages whose frees are pending on the allocating stream: their
        // old mapping stays, held until those frees complete (work before
        // them may still touch the page there); at the new place their
        // bytes keep the frees' guard (see `bind_guarded`).
        let moved_pending = &mut sc.moved_pending;
        moved_pending.clear();
        for &(v, g) in &plan.pending {
            let i = st.arena.deactivate(v);
            st.arena.hold_mapping(v, g);
            if tracing_binds {
                moved_from.push((i, v));
            }
            moved_pending.push((i, v, g));
            pool.push(i);
        }
        for &p in &plan.singles {
            got.push((p, pool.pop().expect("one page per single")));
        }
        // Free units that could not move here are released whole before
        // anything is created, so that the pool never holds more than it
        // would have by moving single pages.
        for &i in &plan.release {
            if let Some(owner) = st.arena.owner(i) {
                st.arena.deactivate(owner);
            } else {
                st.arena.unspare(i);
            }
            if let Err(e) = self.release_phys(st, i) {
                st.arena.push_spare(i);
                for &(_, i) in got.iter() {
                    put_back(st, i, moved_pending);
                }
                return Err(MapFailure::Device(e));
            }
        }
        for &(first, count) in &plan.missing {
            let (mut p, mut left) = (first, count);
            while left > 0 {
                // The largest power of two that fits what is left.
                let k = unit_max.min(1 << left.ilog2());
                let mut fail = None;
                if let Some(max) = self.config.max_size {
                    if st.arena.reserved() + (k * page) as u64 > max {
                        fail = Some(MapFailure::Capped);
                    }
                }
                if fail.is_none() {
                    let opts = PhysicalOptions {
                        exportable: self.config.exportable,
                    };
                    match self.device.create_physical(k * page, opts) {
                        Ok(handle) => {
                            let i = st.arena.add_unit(handle, k);
                            got.push((p, i));
                            created.push(i);
                        }
                        Err(e) => {
                            fail = Some(if e.is_out_of_memory() {
                                MapFailure::DeviceOom(e)
                            } else {
                                MapFailure::Device(e)
                            });
                        }
                    }
                }
                if let Some(f) = fail {
                    for &(_, i) in got.iter() {
                        if !created.contains(&i) {
                            put_back(st, i, moved_pending);
                        } else if let Err(e2) = self.release_phys(st, i) {
                            tracing::warn!(error = %e2, "releasing a page of a failed request failed");
                            st.arena.push_spare(i);
                        }
                    }
                    return Err(f);
                }
                p += k;
                left -= k;
            }
        }
        if !got.is_empty() {
            tracing::debug!(
                pool = self.pool,
                pages = rest.len(),
                handles = got.len(),
                len,
                "mapping pages for a request"
            );
        }
        // Bound in address order.
        got.sort_unstable();
        for (n, &(p, i)) in got.iter().enumerate() {
            if tracing_binds {
                self.trace_bind(st, p, i, len, moved_from, created);
            }
            let guard = moved_pending
                .iter()
                .find(|m| m.0 == i)
                .map_or(Guard::Complete, |m| m.2);
            if let Err(e) = self.bind_guarded(st, p, i, guard) {
                put_back(st, i, moved_pending);
                for &(_, i) in &got[n + 1..] {
                    put_back(st, i, moved_pending);
                }
                return Err(MapFailure::Device(e));
            }
            st.arena.count_remap();
        }
        st.arena.take(start, len);
        Ok(start)
    }

    /// Why page `p` of a block of `len` bytes costs a bind with unit `i`:
    /// whether `p` held a ghost and, if so, where that ghost's physical
    /// page is active now (in use there, so the ghost could not come
    /// back); and where `i` comes from (moved from an idle page, new, or
    /// spare). The figures that explain a workload's binds, zone by zone.
    fn trace_bind(
        &self,
        st: &State<'_>,
        p: usize,
        i: usize,
        len: usize,
        moved_from: &[(usize, usize)],
        created: &[usize],
    ) {
        let ghost_active_at = st
            .arena
            .mapping_at(p)
            .and_then(|g| st.arena.owner(g))
            .map(|q| (q, st.zone_of(q), st.arena.users(q)));
        let source = match moved_from.iter().find(|m| m.0 == i) {
            Some(&(_, q)) => format!("moved from page {q} (zone {})", st.zone_of(q)),
            None if created.contains(&i) => "new".to_string(),
            None => "spare".to_string(),
        };
        tracing::trace!(
            pool = self.pool,
            len,
            page = p,
            zone = st.zone_of(p),
            had_ghost = st.arena.mapping_at(p).is_some(),
            ghost_active_at = ?ghost_active_at,
            source = %source,
            "page bind"
        );
    }

    /// Pages of the largest unit this pool creates (a power of two; 1
    /// where the pool may be exported, since an importer maps one handle
    /// per page of the allocation).
    fn unit_pages(&self, page: usize) -> usize {
        if self.config.exportable {
            return 1;
        }
        let n = (self.config.max_unit_size / page).max(1);
        1 << n.ilog2()
    }

    /// Where the physical memory for the hole pages `rest` of a block
    /// comes from, decided before anything is touched: whole free units
    /// moved into runs of consecutive pages long enough for them, spare
    /// single pages, completed idle single pages (stitching), and the
    /// pages still missing, which growth creates (as units where the block
    /// is large). Free units that could not move are released to make room
    /// for growth. Fails with `Capped` where growth would pass the cap.
    fn plan(
        &self,
        st: &mut State<'_>,
        rest: &[usize],
        block_pages: &std::ops::RangeInclusive<usize>,
        unit_max: usize,
        mover: Option<&Mover<'_>>,
        plan: &mut Plan,
    ) -> Result<(), MapFailure> {
        let page = st.arena.page();
        plan.clear();
        // Maximal runs of consecutive pages: (first, count); what is left
        // of them at the end is what growth fills.
        let runs = &mut plan.missing;
        for &p in rest {
            match runs.last_mut() {
                Some((f, c)) if *f + *c == p => *c += 1,
                _ => runs.push((p, 1)),
            }
        }
        // Free units that did not move, once looked for.
        let mut units_known = false;
        let left = &mut plan.left;
        if runs.iter().any(|r| r.1 >= 2) {
            free_units(st, block_pages, &mut plan.free);
            for &i in &plan.free {
                let k = st.arena.unit_pages(i);
                // The tightest run that holds the unit.
                match runs
                    .iter_mut()
                    .filter(|r| r.1 >= k)
                    .min_by_key(|r| (r.1, r.0))
                {
                    Some(r) => {
                        plan.moves.push((r.0, i));
                        r.0 += k;
                        r.1 -= k;
                    }
                    None => left.push(i),
                }
            }
            units_known = true;
            runs.retain(|r| r.1 > 0);
        }
        // Single pages fill the shortest runs; growth gets the longest,
        // where it can create the largest units.
        let remaining: usize = runs.iter().map(|r| r.1).sum();
        plan.spare_used = st.arena.spare_singles().min(remaining);
        if plan.spare_used < remaining {
            let zone = st.zone_of(*block_pages.start());
            st.victims_into(
                block_pages,
                zone,
                remaining - plan.spare_used,
                &mut plan.victims,
            );
        }
        let mut singles = plan.spare_used + plan.victims.len();
        // Growth is the alternative for what is still missing: idle pages
        // whose frees are pending but ordered before the allocating stream
        // (its own, or another's it waited for) may move here: its work on
        // the block is ordered after those frees.
        if let Some(m) = mover.filter(|_| singles < remaining) {
            let zone = st.zone_of(*block_pages.start());
            pick_pending_victims(
                st,
                block_pages,
                zone,
                remaining - singles,
                m,
                &mut plan.pending,
            );
            singles += plan.pending.len();
        }
        if unit_max == 1 {
            // No units to create: single pages fill the highest pages.
            runs.sort_unstable_by_key(|r| std::cmp::Reverse(r.0));
            for r in runs.iter_mut() {
                let n = singles.min(r.1);
                plan.singles.extend(r.0 + r.1 - n..r.0 + r.1);
                r.1 -= n;
                singles -= n;
            }
        }
        runs.sort_unstable_by_key(|r| (r.1, r.0));
        for r in runs.iter_mut() {
            let n = singles.min(r.1);
            plan.singles.extend(r.0..r.0 + n);
            r.0 += n;
            r.1 -= n;
            singles -= n;
        }
        runs.retain(|r| r.1 > 0);
        runs.sort_unstable();
        plan.singles.sort_unstable();
        let missing: usize = runs.iter().map(|r| r.1).sum();
        let mut released = 0usize;
        if missing > 0 {
            if !units_known {
                free_units(st, block_pages, left);
            }
            // Smallest first: release no more than growth needs, roughly.
            for &i in left.iter().rev() {
                if released >= missing {
                    break;
                }
                released += st.arena.unit_pages(i);
                plan.release.push(i);
            }
        }
        if let Some(max) = self.config.max_size {
            // Fail before touching anything: a request the cap cannot hold
            // must not grow the pool on its way to failing.
            let after = st.arena.reserved() + (missing * page) as u64;
            if after.saturating_sub((released * page) as u64) > max {
                return Err(MapFailure::Capped);
            }
        }
        Ok(())
    }

    /// Map physical unit `i` at pages `p..p + k` (holes) and make it
    /// active there. Ghost mappings over those pages are unmapped first
    /// (each whole); a unit with many ghosts loses its oldest one, which
    /// bounds the number of mappings.
    #[cfg(test)]
    fn bind(&self, st: &mut State<'_>, p: usize, i: usize) -> Result<(), SysError> {
        self.bind_guarded(st, p, i, Guard::Complete)
    }

    /// [`Pages::bind`], the unit's bytes free under `guard` at `p` (the
    /// guard of frees still pending where it was active). A held ghost
    /// mapping of the unit is never the one evicted: the oldest that is not
    /// held goes, and where every mapping is held the unit keeps one more
    /// until their frees complete.
    fn bind_guarded(
        &self,
        st: &mut State<'_>,
        p: usize,
        i: usize,
        guard: Guard,
    ) -> Result<(), SysError> {
        let k = st.arena.unit_pages(i);
        for q in p..p + k {
            if let Some(base) = st.arena.mapping_base(q) {
                self.unmap_mapping(st, base)?;
            }
        }
        while st.arena.mappings(i).len() >= MAX_GHOSTS {
            let Some(&oldest) = st.arena.mappings(i).iter().find(|&&b| !st.held(b)) else {
                break;
            };
            self.unmap_mapping(st, oldest)?;
        }
        let bytes = st.arena.unit_bytes(i);
        let ptr = self.page_ptr(st, p);
        let handle = st.arena.handle(i);
        self.device.map(ptr, bytes, handle, 0)?;
        if let Err(e) = self
            .device
            .set_access(ptr, bytes, &self.share.access_list())
        {
            if let Err(e2) = self.device.unmap(ptr, bytes) {
                tracing::warn!(error = %e2, "unmap after failed set_access failed");
            }
            return Err(e);
        }
        st.arena.record_mapping(p, i);
        st.arena.activate_guarded(p, i, guard);
        Ok(())
    }

    /// Unmap the mapping (active nowhere) whose first page is `base`, whole.
    /// A held mapping must have its guard complete by now: every path
    /// here checks [`ArenaState::held`] first; one that did not is counted
    /// (see [`Arena::pending_unmaps`]).
    fn unmap_mapping(&self, st: &mut State<'_>, base: usize) -> Result<(), SysError> {
        if st.held(base) {
            st.arena.count_pending_unmap();
            tracing::error!(
                pool = self.pool,
                page = base,
                "unmapping a mapping whose frees are still pending"
            );
            debug_assert!(false, "unmapping a held mapping at page {base}");
        }
        let g = st.arena.mapping_at(base).expect("mapped");
        self.device
            .unmap(self.page_ptr(st, base), st.arena.unit_bytes(g))?;
        st.arena.forget_mapping(base);
        Ok(())
    }

    fn page_ptr(&self, st: &State<'_>, p: usize) -> u64 {
        self.base + (p * st.arena.page()) as u64
    }

    /// Unmap every mapping of physical unit `i` (active nowhere), each
    /// whole, and release it to the device.
    /// The callers never pass a unit with a held mapping (see
    /// [`ArenaState::phys_held`]).
    pub fn release_phys(&self, st: &mut State<'_>, i: usize) -> Result<(), SysError> {
        while let Some(&p) = st.arena.mappings(i).last() {
            self.unmap_mapping(st, p)?;
        }
        self.device.release_physical(st.arena.handle(i))?;
        st.arena.remove_phys(i);
        Ok(())
    }

    /// Release physical memory until at most `target` bytes are held:
    /// spare pages and units first, then idle ones whose frees are known
    /// complete. A unit of several pages is released only whole, when no
    /// block uses any of its pages: a unit partly in use stays, so the
    /// pool may hold more than `target` afterwards, and releasing a unit
    /// may take it below. A page with a held mapping (frees pending on it
    /// at a place it moved from) stays until they complete. Returns the
    /// bytes actually released.
    pub fn trim(&self, st: &mut State<'_>, target: u64) -> Result<u64, SysError> {
        let mut released = 0u64;
        st.drop_complete_holds();
        // Spare pages with a held mapping, kept aside and put back after.
        let mut kept: Vec<usize> = Vec::new();
        let r = self.trim_with(st, target, &mut released, &mut kept);
        for i in kept {
            st.arena.push_spare(i);
        }
        r.map(|()| released)
    }

    fn trim_with(
        &self,
        st: &mut State<'_>,
        target: u64,
        released: &mut u64,
        kept: &mut Vec<usize>,
    ) -> Result<(), SysError> {
        while st.arena.reserved() > target {
            let spare = loop {
                match st.arena.pop_spare() {
                    Some(i) if st.phys_held(i) => kept.push(i),
                    other => break other,
                }
            };
            let i = match spare {
                Some(i) => i,
                None => {
                    let victim = st.arena.idle_pages().find(|&p| {
                        let phys = st.arena.mapping_at(p).expect("idle page is mapped");
                        st.arena.owner(phys) == Some(p)
                            && if st.arena.unit_pages(phys) == 1 {
                                st.page_complete(p)
                            } else {
                                st.unit_free(phys)
                            }
                            && !st.phys_held(phys)
                    });
                    let Some(p) = victim else { break };
                    st.arena.deactivate(p)
                }
            };
            let bytes = st.arena.unit_bytes(i) as u64;
            if let Err(e) = self.release_phys(st, i) {
                // Keep the bookkeeping true: the page is still ours.
                st.arena.push_spare(i);
                return Err(e);
            }
            *released += bytes;
        }
        Ok(())
    }

    /// The pool is going away: unmap every mapping (active and ghost, each
    /// whole) and release every physical unit. The caller has waited for
    /// all pending device work first.
    pub fn unmap_all(&self, st: &mut ArenaState) {
        let page = st.arena.page();
        for (i, handle, mappings) in st.arena.phys_pages() {
            let bytes = st.arena.unit_bytes(i);
            for &p in mappings {
                if let Err(e) = self.device.unmap(self.base + (p * page) as u64, bytes) {
                    tracing::warn!(error = %e, "unmap while dropping the pool failed");
                }
            }
            if let Err(e) = self.device.release_physical(handle) {
                tracing::warn!(error = %e, "release while dropping the pool failed");
            }
        }
        st.arena.clear_phys();
    }
}

/// Physical unit `i`, gathered for a request that failed, goes back: to
/// where it was active if it moved with frees pending there (its mapping
/// there is held, so it still exists; its bytes take the frees' guard
/// again), else to the spare pages.
fn put_back(st: &mut State<'_>, i: usize, moved_pending: &[(usize, usize, Guard)]) {
    match moved_pending.iter().find(|m| m.0 == i) {
        Some(&(_, v, g)) if st.arena.owner(i).is_none() => st.arena.activate_guarded(v, i, g),
        _ => st.arena.push_spare(i),
    }
}

/// The ghost mappings of single pages among `targets` (hole pages of the
/// block `block`, in address order) that can come back, brought back as
/// one target at a time in address order would, the books updated once
/// per run of consecutive pages; the targets left go to `rest`. A physical
/// page with a ghost on an earlier target of the block either came back
/// there or cannot come back at all: in both cases it is not taken again.
#[allow(clippy::too_many_arguments)]
fn rebind_singles(
    st: &mut State<'_>,
    targets: &[usize],
    block: &std::ops::RangeInclusive<usize>,
    rest: &mut Vec<usize>,
    mover: Option<&Mover<'_>>,
    sc: &mut RebindScratch,
) {
    let RebindScratch {
        moves,
        owners,
        phys,
        pending,
        met,
        call,
    } = sc;
    moves.clear();
    owners.clear();
    pending.clear();
    *call = call.wrapping_add(1);
    if *call == 0 {
        met.fill(0);
        *call = 1;
    }
    let may_pend = mover.is_some() && (st.arena.any_pending() || st.arena.any_held());
    let any_pending = st.arena.any_pending();
    for &p in targets {
        let Some(i) = st.arena.mapping_at(p) else {
            rest.push(p);
            continue;
        };
        // The physical page's books, read once for every test below.
        let (owner, k) = st.arena.owner_and_pages(i);
        // A mapping of a single page inside the block is either active
        // there (its owner is in the block) or a hole, so a target: a
        // ghost on an earlier target is one on a page met before in this
        // loop (one mark per page, rather than a look at every mapping).
        // A page active inside the block stays (`phys_movable`).
        if i >= met.len() {
            met.resize(i + 1, 0);
        }
        let earlier = std::mem::replace(&mut met[i], *call) == *call;
        debug_assert_eq!(
            earlier || owner.is_some_and(|q| block.contains(&q)),
            st.arena
                .mappings(i)
                .iter()
                .any(|b| (*block.start()..p).contains(b))
                || owner.is_some_and(|q| block.contains(&q)),
            "a ghost on an earlier target is one met before"
        );
        // Active at `q..q + k`: inside the block where that meets it.
        if earlier || owner.is_some_and(|q| q + k > *block.start() && q <= *block.end()) {
            rest.push(p);
            continue;
        }
        // `ghost_available`, from the books read above.
        let free = match (owner, k) {
            (None, _) => true,
            (Some(q), 1) => {
                st.arena.users(q) == 0
                    && (!any_pending || st.arena.page_guards_all(q, |g| st.is_complete(g)))
            }
            (Some(_), _) => st.unit_free(i),
        };
        if free && !st.held(p) {
            moves.push((p, i));
            match owner {
                Some(q) => owners.push(q),
                None => st.arena.unspare(i),
            }
            continue;
        }
        // A page whose frees are pending but ordered before the allocating
        // stream comes back too (after the others, one at a time).
        match mover
            .filter(|_| may_pend)
            .and_then(|m| st.rebind_guard_for(p, m))
        {
            Some((back, leave)) => pending.push((p, i, back, leave)),
            None => rest.push(p),
        }
    }
    owners.sort_unstable();
    for run in owners.chunk_by(|a, b| a + 1 == *b) {
        st.arena.deactivate_singles(run[0], run.len());
    }
    for run in moves.chunk_by(|a, b| a.0 + 1 == b.0) {
        phys.clear();
        phys.extend(run.iter().map(|m| m.1));
        st.arena.activate_singles(run[0].0, phys);
        st.arena.count_rebinds(run.len() as u64);
    }
    // The place a pending page leaves stays mapped, held by the guard of
    // its frees there; at `p` its bytes take the guard of every pending
    // free they carry (there, and on the ghost's hold).
    for &(p, i, back, leave) in pending.iter() {
        match st.arena.owner(i) {
            Some(q) => {
                st.arena.deactivate(q);
                if let Some(g) = leave {
                    st.arena.hold_mapping(q, g);
                }
            }
            None => st.arena.unspare(i),
        }
        st.arena.activate_guarded(p, i, back);
        st.arena.count_rebind();
    }
}

/// Free units active across an edge of the block's pages `block` (part
/// of the unit inside, part outside) become spare, and their pages inside
/// the block join the hole pages `rest` (kept in address order). Used in
/// place, such a unit holds its pages outside the block for nothing while
/// the block may need growth past the cap or the device; spare, it can
/// move whole into a run of the block's hole pages, or be released to make
/// room for growth, and the block's pages it covered are filled like any
/// other hole.
fn take_off_edge_units(
    st: &mut State<'_>,
    block: &std::ops::RangeInclusive<usize>,
    rest: &mut Vec<usize>,
) {
    let mut units: Vec<usize> = Vec::new();
    for p in block.clone() {
        let Some(phys) = st.arena.mapping_at(p).filter(|_| st.arena.is_active(p)) else {
            continue;
        };
        let k = st.arena.unit_pages(phys);
        let Some(o) = st.arena.owner(phys) else {
            continue;
        };
        if k > 1
            && !(block.contains(&o) && block.contains(&(o + k - 1)))
            && !units.contains(&phys)
            && st.unit_free(phys)
        {
            units.push(phys);
        }
    }
    for phys in units {
        let o = st.arena.owner(phys).expect("active");
        let k = st.arena.unit_pages(phys);
        st.arena.deactivate(o);
        st.arena.push_spare(phys);
        rest.extend((o..o + k).filter(|q| block.contains(q)));
    }
    rest.sort_unstable();
}

/// Whether the ghost mapping at hole page `p` lies wholly inside the
/// block's pages `block`.
fn ghost_inside(st: &State<'_>, p: usize, block: &std::ops::RangeInclusive<usize>) -> bool {
    let (Some(base), Some(phys)) = (st.arena.mapping_base(p), st.arena.mapping_at(p)) else {
        return false;
    };
    block.contains(&base) && block.contains(&(base + st.arena.unit_pages(phys) - 1))
}

/// Bring back physical unit `phys` (free where it is, or spare) at its
/// ghost mapping over hole page `p`: all of that mapping's pages.
fn rebind_unit(st: &mut State<'_>, p: usize, phys: usize) {
    if let Some(owner) = st.arena.owner(phys) {
        st.arena.deactivate(owner);
    } else {
        st.arena.unspare(phys);
    }
    let base = st.arena.mapping_base(p).expect("a ghost has a first page");
    st.arena.activate(base, phys);
    st.arena.count_rebind();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arena::Arena;
    use crate::sync::{lock, Mutex};
    use tidepool_sys::{HostConfig, HostDevice};

    const PAGE: usize = 2 << 20;

    /// A host device of 32 pages, 64 pages of address space reserved on
    /// it, and the pool parts `Pages` borrows.
    struct Fixture {
        dev: HostDevice,
        va: usize,
        base: DevicePtr,
        config: PoolConfig,
        share: ShareState,
    }

    impl Fixture {
        fn new(config: PoolConfig) -> Self {
            let dev = HostDevice::with_config(HostConfig {
                capacity: 64 << 20,
                granularity: PAGE,
            });
            let va = 64 * PAGE;
            let base = dev.reserve_va(va, PAGE).unwrap();
            let share = ShareState::new(crate::share_state::initial_access(&dev, &[]).unwrap());
            Fixture {
                dev,
                va,
                base,
                config,
                share,
            }
        }

        fn pages(&self) -> Pages<'_, HostDevice> {
            Pages {
                pool: 0,
                device: &self.dev,
                base: self.base,
                config: &self.config,
                share: &self.share,
            }
        }
    }

    /// A unit whose ghosts lie across the start of a window and wholly
    /// inside it, free where it is active: it comes back inside the
    /// window, and the window needs three new pages, not four. Brought
    /// back across the edge (the first target page by address), it served
    /// one page of the window and could not serve the inside ghost's two
    /// pages: with the cap at the three pages, the request failed (the
    /// shape of a false out-of-memory the units sweep of
    /// `attack3_units.rs` met on a full device).
    #[test]
    fn a_unit_comes_back_to_its_ghost_inside_the_window_first() {
        let page = PAGE;
        let fx = Fixture::new(
            PoolConfig::default()
                .with_max_unit_size(2 * PAGE)
                .with_unit_min_block(2 * PAGE)
                .with_max_size(5 * PAGE as u64),
        );
        let (dev, pages) = (&fx.dev, fx.pages());
        let state = Mutex::new(ArenaState::new(Arena::new(fx.va, page)));
        let mut st = lock(&state);
        let opts = PhysicalOptions { exportable: false };
        let g = st
            .arena
            .add_unit(dev.create_physical(2 * page, opts).unwrap(), 2);
        // Mapped at pages 10-11, then 14-15, then active at 20-21 (free).
        pages.bind(&mut st, 10, g).unwrap();
        st.arena.deactivate(10);
        pages.bind(&mut st, 14, g).unwrap();
        st.arena.deactivate(14);
        pages.bind(&mut st, 20, g).unwrap();
        assert_eq!(st.arena.mappings(g), &[10, 14, 20]);
        // A block over pages 11-15: the ghost at 10 lies across its start.
        let got = pages.map_at(&mut st, 5 * page, 11 * page, None, false, None);
        assert!(got.is_ok(), "five pages under a cap of five failed");
        assert_eq!(st.arena.owner(g), Some(14), "the unit came back inside");
        assert_eq!(st.arena.reserved(), 5 * page as u64);
        assert_eq!(st.arena.rebinds(), 1);
        pages.unmap_all(&mut st);
        drop(st);
        dev.free_va(fx.base, fx.va).unwrap();
    }

    /// A page with as many mappings as it may keep, bound once more:
    /// the oldest mapping that is not held goes, never a held one (work
    /// pending there may still touch the page); with every mapping held
    /// the page keeps one more. Evicting the oldest regardless unmaps the
    /// held mapping at page 0 (counted, and a debug assertion).
    #[test]
    fn eviction_never_takes_a_held_mapping() {
        let page = PAGE;
        let fx = Fixture::new(PoolConfig::default());
        let (dev, pages) = (&fx.dev, fx.pages());
        let state = Mutex::new(ArenaState::new(Arena::new(fx.va, page)));
        let mut st = lock(&state);
        let opts = PhysicalOptions { exportable: false };
        let i = st
            .arena
            .add_unit(dev.create_physical(page, opts).unwrap(), 1);
        let pending = Guard::After {
            stream: 1,
            epoch: 5,
        };
        // Mapped at pages 0..MAX_GHOSTS, every old place held but page 3.
        for p in 0..MAX_GHOSTS {
            pages.bind(&mut st, p, i).unwrap();
            st.arena.deactivate(p);
            if p != 3 {
                st.arena.hold_mapping(p, pending);
            }
        }
        pages.bind(&mut st, 20, i).unwrap();
        let mut want: Vec<usize> = (0..MAX_GHOSTS).filter(|&p| p != 3).collect();
        want.push(20);
        assert_eq!(st.arena.mappings(i), &want[..], "page 3 went, no other");
        // Every old place held now: the page keeps them all.
        st.arena.deactivate(20);
        st.arena.hold_mapping(20, pending);
        pages.bind(&mut st, 30, i).unwrap();
        want.push(30);
        assert_eq!(st.arena.mappings(i), &want[..]);
        assert_eq!(st.arena.pending_unmaps(), 0);
        assert_eq!(dev.live_mappings(), want.len());
        // Complete: the holds no longer keep anything.
        st.done.mark_synced(1, 5);
        st.arena.deactivate(30);
        pages.bind(&mut st, 40, i).unwrap();
        assert!(st.arena.mappings(i).len() <= MAX_GHOSTS);
        assert_eq!(st.arena.pending_unmaps(), 0);
        pages.unmap_all(&mut st);
        drop(st);
        dev.free_va(fx.base, fx.va).unwrap();
    }

    /// A huge window that needs the fewest binds but would unmap ghost
    /// mappings (their pages are in use elsewhere) loses to one that needs
    /// as many binds and unmaps none: those ghosts are where a block of
    /// the same shape finds its pages again, for free, the next time the
    /// pages are idle. Weighed by binds alone, the lower window wins the
    /// tie on address and the two ghosts are gone.
    #[test]
    fn a_huge_window_keeps_ghosts_another_pattern_needs() {
        let page = PAGE;
        let fx = Fixture::new(PoolConfig::default());
        let (dev, pages) = (&fx.dev, fx.pages());
        let state = Mutex::new(ArenaState::new(Arena::new(fx.va, page)));
        let mut st = lock(&state);
        let opts = PhysicalOptions { exportable: false };
        let new_page = |st: &mut State<'_>| {
            st.arena
                .add_unit(dev.create_physical(page, opts).unwrap(), 1)
        };
        // The huge zone is pages 48-63. Pages 48 and 49 hold ghosts of two
        // pages now in use at 16 and 17 (the medium zone); 50 and 51 are
        // mapped and idle; the rest of the zone was never mapped.
        for (ghost, home) in [(48, 16), (49, 17)] {
            let i = new_page(&mut st);
            pages.bind(&mut st, ghost, i).unwrap();
            st.arena.deactivate(ghost);
            pages.bind(&mut st, home, i).unwrap();
        }
        st.arena.take(16 * page, 2 * page);
        for p in [50, 51] {
            let i = new_page(&mut st);
            pages.bind(&mut st, p, i).unwrap();
        }
        let zone = st.zone(usize::MAX);
        assert_eq!(zone, 48 * page..64 * page);
        let (clock, reuse) = (VectorClock::default(), ReusePolicy::default());
        let window =
            |st: &State<'_>, keep| best_window(st, 4 * page, page, &zone, 0, &clock, reuse, keep);
        // Pages 48-51: two binds, both over a ghost. Pages 50-53: two
        // binds over pages never mapped.
        assert_eq!(window(&st, false), Some((2, 2, 48 * page)));
        assert_eq!(window(&st, true), Some((2, 2, 50 * page)));
        pages.unmap_all(&mut st);
        drop(st);
        dev.free_va(fx.base, fx.va).unwrap();
    }
}
