//! The reuse policy: where an allocation looks for memory, in order.
//!
//! This file is the one place that decides. The order goes from the
//! cheapest and surest source of memory to the costliest:
//! 1. the allocating stream's own frees (no event, no query);
//! 2. frees the stream is already ordered after, through waits made via the
//!    pool (vector clocks) or a host synchronisation;
//! 3. frees observed complete (event query; opportunistic);
//! 4. stitching: completed, wholly free pages are unmapped from where they
//!    sit and mapped into a contiguous virtual range;
//! 5. growth: new physical pages, mapped in place;
//! 6. on growth failure, other pools of the device release their cached
//!    memory, then growth again;
//! 7. internal dependency: the stream waits for the pending frees (of one
//!    stream or several) in a run of adjacent free ranges, and takes it;
//! 8. last resort: wait on the host, bounded, with no lock held, for
//!    pending frees (the allocating stream's own too: joining them into one
//!    range remaps their pages), then steps 1–5 and 7 again;
//! 9. out-of-memory.
//!
//! Map, unmap and release act immediately, not in stream order, so steps 4,
//! 5 and trimming only ever touch memory whose frees are known complete.

use crate::arena::{Arena, FreeRange, Guard};
use crate::config::ReusePolicy;
use crate::error::{OomReport, PoolError};
use crate::order::{BuildIntHasher, EventRecord, VectorClock};
use crate::pool::{PoolInner, StreamEntry};
use crate::stats::Counters;
use crate::sync::{lock, Arc, MutexGuard};
use std::collections::HashMap;
use std::time::Instant;
use tidepool_sys::{Device, PhysicalOptions, Stream, SysError};

/// The arena and what the pool has learnt about completion, under one lock.
#[derive(Debug)]
pub(crate) struct ArenaState {
    pub arena: Arena,
    /// Per stream: highest epoch whose frees were observed complete by an
    /// event query.
    pub completed: HashMap<u64, u64, BuildIntHasher>,
    /// Per stream: highest epoch the host synchronised with (everything
    /// issued afterwards, on any stream, is ordered after it).
    pub synced: HashMap<u64, u64, BuildIntHasher>,
    /// Scratch space of `pick_victims` (no allocation per call).
    victim_runs: Vec<(usize, usize)>,
}

impl ArenaState {
    pub fn new(arena: Arena) -> Self {
        ArenaState {
            arena,
            completed: HashMap::default(),
            synced: HashMap::default(),
            victim_runs: Vec::new(),
        }
    }

    /// Where in the address space a request of `len` bytes is placed: one
    /// zone per size class (a quarter of the address space each). Small
    /// blocks apart from large ones, so that short-lived large blocks do
    /// not leave pages pinned by small long-lived ones; big and huge
    /// blocks apart from medium ones and from each other, so that each
    /// class finds its own ranges, and their ghost mappings, again at the
    /// next step of a training loop instead of the ranges of another class.
    pub fn zone(&self, len: usize) -> std::ops::Range<usize> {
        let va = self.arena.va_size();
        let page = self.arena.page;
        let quarter = |n: usize| (va / 4 * n) / page * page;
        if len < SMALL_LIMIT {
            0..quarter(1)
        } else if len < BIG_LIMIT {
            quarter(1)..quarter(2)
        } else if len < HUGE_LIMIT {
            quarter(2)..quarter(3)
        } else {
            quarter(3)..va
        }
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
            self.arena.page
        } else {
            1
        }
    }

    fn known(map: &HashMap<u64, u64, BuildIntHasher>, stream: u64) -> u64 {
        map.get(&stream).copied().unwrap_or(0)
    }

    /// Whether the device work before a free is known to be done (the only
    /// condition under which its memory may be unmapped or released).
    pub fn is_complete(&self, guard: Guard) -> bool {
        match guard {
            Guard::Complete => true,
            Guard::After { stream, epoch } => {
                Self::known(&self.completed, stream) >= epoch
                    || Self::known(&self.synced, stream) >= epoch
            }
        }
    }

    /// Whether every free byte of page `p` is known complete, so the page
    /// may be unmapped, moved or released.
    pub fn page_complete(&self, p: usize) -> bool {
        self.arena.page_guards_all(p, |g| self.is_complete(g))
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
            Guard::After { stream, epoch } if Self::known(&self.synced, stream) >= epoch => Some(1),
            // ...or by event waits made through the pool (transitively).
            Guard::After { stream, epoch }
                if reuse.follow_event_dependencies && clock.get(stream) >= epoch =>
            {
                Some(1)
            }
            // 3. Observed complete, no dependency added.
            Guard::After { stream, epoch }
                if reuse.opportunistic && Self::known(&self.completed, stream) >= epoch =>
            {
                Some(2)
            }
            Guard::After { .. } => None,
        }
    }
}

/// Why mapping memory for a request failed.
enum MapFailure {
    /// No virtual window is large enough.
    NoWindow,
    /// The pool's maximum size stops growth.
    Capped,
    /// The device is out of memory.
    DeviceOom(SysError),
    /// Another device error.
    Device(SysError),
}

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

type State<'a> = MutexGuard<'a, ArenaState>;

impl<D: Device> PoolInner<D> {
    /// Find `len` bytes for `stream` (its private cache already missed).
    /// Returns the offset of the block in the arena.
    pub(crate) fn acquire(
        &self,
        len: usize,
        stream: Stream,
        entry: &Arc<StreamEntry>,
    ) -> Result<usize, PoolError> {
        let me = stream.id();
        let reuse = self.reuse();
        let clock = lock(&entry.state).clock.clone();
        let mut st = lock(&self.arena);

        // Steps 1–3 on what the pool already knows.
        // The stream's own cached frees join the arena first: placement by
        // address (first_fit) must see the address space as the stream left
        // it, or the layout drifts from one step of a loop to the next
        // (gpt2 warm pass remaps, fixed / varlen: 842 / 406 without this,
        // 327 / 440 with it; pass 3: 668 / 388 and 306 / 327).
        self.flush_own_cache(&mut st, me, entry);
        if let Some(off) = fit(&mut st, len, me, &clock, reuse) {
            return Ok(off);
        }
        // Step 3 after asking the device which frees completed, and after
        // the streams' private caches join the arena (so that neither
        // stitching nor growth happens while a fitting free range exists).
        self.flush_caches(&mut st);
        self.observe_completions(&mut st);
        if let Some(off) = fit(&mut st, len, me, &clock, reuse) {
            return Ok(off);
        }
        // Steps 4–5: stitch completed free pages, grow.
        let mut cause = None;
        match self.map_any(&mut st, len, me, &clock, reuse) {
            Ok(off) => return Ok(off),
            Err(MapFailure::DeviceOom(e)) => {
                // Step 6: other pools of the device give back their cache.
                drop(st);
                let freed = crate::registry::release_other_pools(self);
                tracing::debug!(pool = self.id, freed, "released other pools' cached memory");
                st = lock(&self.arena);
                match self.map_any(&mut st, len, me, &clock, reuse) {
                    Ok(off) => return Ok(off),
                    Err(MapFailure::DeviceOom(e2)) => cause = Some(e2),
                    Err(MapFailure::Device(e)) => return Err(e.into()),
                    Err(_) => cause = Some(e),
                }
            }
            Err(MapFailure::Device(e)) => return Err(e.into()),
            Err(MapFailure::Capped) | Err(MapFailure::NoWindow) => {}
        }
        // Step 7: internal dependency on a pending free.
        if reuse.internal_dependencies {
            if let Some(off) = self.take_with_dependency(&mut st, len, stream, entry)? {
                return Ok(off);
            }
        }
        // Step 8: bounded host wait for pending frees (every stream's, the
        // allocating stream's own included: stream order makes those safe
        // for it, but joining their pages into one range remaps them, and
        // remapping acts at once). The wait holds no lock; afterwards the
        // pool tries again whatever the wait saw, since completions may
        // also have been observed meanwhile by this thread or another.
        if reuse.wait_for_pending_frees {
            // An unrepresentable deadline (Duration::MAX) means no deadline.
            let deadline = Instant::now().checked_add(self.config.last_resort_wait);
            loop {
                self.observe_completions(&mut st);
                let pending = self.pending_records();
                drop(st);
                // Returns as soon as some free completes: the request is
                // tried again then, rather than after every pending free
                // (some may wait for work the caller issues only later).
                let (done, more) = self.wait_records(&pending, deadline);
                st = lock(&self.arena);
                for rec in done {
                    let e = st.synced.entry(rec.stream.id()).or_insert(0);
                    *e = (*e).max(rec.epoch);
                }
                self.flush_caches(&mut st);
                self.observe_completions(&mut st);
                let clock = lock(&entry.state).clock.clone();
                if let Some(off) = fit(&mut st, len, me, &clock, reuse) {
                    return Ok(off);
                }
                match self.map_any(&mut st, len, me, &clock, reuse) {
                    Ok(off) => return Ok(off),
                    Err(MapFailure::DeviceOom(e)) => cause = Some(e),
                    Err(MapFailure::Device(e)) => return Err(e.into()),
                    Err(_) => {}
                }
                if reuse.internal_dependencies {
                    if let Some(off) = self.take_with_dependency(&mut st, len, stream, entry)? {
                        return Ok(off);
                    }
                }
                if !more {
                    break;
                }
            }
        }
        // Step 9.
        Err(self.oom(&st, len, cause))
    }

    fn oom(&self, st: &ArenaState, len: usize, cause: Option<SysError>) -> PoolError {
        PoolError::OutOfMemory(Box::new(OomReport {
            requested: len,
            reserved: st.arena.reserved,
            used: self.used_current(),
            largest_free_range: st.arena.largest_free() as u64,
            device_free: self.device.mem_info().ok().map(|m| m.free as u64),
            max_size: self.config.max_size,
            cause,
        }))
    }

    /// Record events lazily on streams with uncovered frees, query the
    /// recorded events, and upgrade guards that are now known complete.
    pub(crate) fn observe_completions(&self, st: &mut State<'_>) {
        let opportunistic = self.reuse().opportunistic;
        for (id, entry) in self.all_streams() {
            let mut s = lock(&entry.state);
            if s.frees_in_epoch && !s.retired && !self.device.is_capturing(s.stream).unwrap_or(true)
            {
                if let Ok(ev) = self.events.acquire() {
                    if self.device.record_event(ev, s.stream).is_ok() {
                        s.close_epoch(ev, self.events.clone());
                    } else {
                        use crate::order::EventSink;
                        self.events.release(ev);
                    }
                }
            }
            while let Some(front) = s.recorded.front() {
                match self.device.query_event(front.event) {
                    Ok(true) => {
                        let done = front.epoch;
                        s.recorded.pop_front();
                        let e = st.completed.entry(id).or_insert(0);
                        *e = (*e).max(done);
                    }
                    _ => break,
                }
            }
        }
        let ArenaState {
            arena,
            completed,
            synced,
            ..
        } = &mut **st;
        arena.settle(|g| match g {
            Guard::After { stream, epoch }
                if synced.get(&stream).is_some_and(|&e| e >= epoch)
                    || (opportunistic && completed.get(&stream).is_some_and(|&e| e >= epoch)) =>
            {
                Some(Guard::Complete)
            }
            _ => None,
        });
    }

    /// Move the stream `me`'s privately cached frees into the arena (all
    /// size classes: flushing only the request's class was measured worse,
    /// gpt2-fixed warm remaps 327 -> 5658, for 10 % more cache hits).
    /// The blocks go straight from the cache into the arena, under the
    /// stream's lock (taken after the arena's, as everywhere).
    fn flush_own_cache(&self, st: &mut State<'_>, me: u64, entry: &Arc<StreamEntry>) {
        let arena = &mut st.arena;
        lock(&entry.state).drain_cache_with(|len, b| {
            arena.give_back(
                b.offset,
                len,
                Guard::After {
                    stream: me,
                    epoch: b.epoch,
                },
            )
        });
    }

    /// Move every stream's privately cached frees into the arena.
    pub(crate) fn flush_caches(&self, st: &mut State<'_>) -> usize {
        let mut moved = 0;
        let arena = &mut st.arena;
        for (id, entry) in self.all_streams() {
            moved += lock(&entry.state).drain_cache_with(|len, b| {
                arena.give_back(
                    b.offset,
                    len,
                    Guard::After {
                        stream: id,
                        epoch: b.epoch,
                    },
                )
            });
        }
        moved
    }

    /// Steps 4 and 5 in the request's own zone, aligned; where that finds
    /// no window or runs into a limit, anywhere and unaligned.
    fn map_any(
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
        match self.map_window(st, len, me, clock, reuse, true) {
            Err(MapFailure::NoWindow) => Err(first),
            other => other,
        }
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
        let page = st.arena.page;
        let best = if relaxed {
            best_window(st, len, 1, &(0..st.arena.va_size()), me, clock, reuse)
        } else if st.first_fit(len) {
            let s: &ArenaState = st;
            s.arena
                .first_window(len, s.align(len), &s.zone(len), |g| {
                    s.classify(g, me, clock, reuse).is_some()
                })
                .map(|start| {
                    let need = (start / page..=(start + len - 1) / page)
                        .filter(|&p| !s.arena.is_active(p))
                        .count();
                    (0, need, start)
                })
        } else if st.align(len) > 1 {
            best_window(st, len, st.align(len), &st.zone(len), me, clock, reuse)
        } else {
            // Small requests: the windows around one hole.
            hole_window(st, len, &st.zone(len), me, clock, reuse)
        };
        let (_, need, start) = best.ok_or(MapFailure::NoWindow)?;
        let end = start + len;
        let block_pages = start / page..=(end - 1) / page;
        let targets: Vec<usize> = block_pages
            .clone()
            .filter(|&p| !st.arena.is_active(p))
            .collect();
        debug_assert_eq!(targets.len(), need);

        // First, targets whose ghost mapping's physical page is free to come
        // back: no driver call at all.
        let mut rest = Vec::new();
        for &p in &targets {
            match st.arena.mapping_at(p) {
                Some(phys) if ghost_available(st, p) && phys_movable(st, phys, &block_pages) => {
                    if let Some(owner) = st.arena.phys[phys].owner {
                        st.arena.deactivate(owner);
                    } else {
                        st.arena.spare.retain(|&i| i != phys);
                    }
                    st.arena.activate(p, phys);
                    st.arena.rebinds += 1;
                }
                _ => rest.push(p),
            }
        }
        // The others need a physical page mapped by the driver: a spare one,
        // a completed idle one moved from elsewhere (stitching), or a new
        // one (growth).
        let spare_used = st.arena.spare.len().min(rest.len());
        let victims = if spare_used < rest.len() {
            let mut runs = std::mem::take(&mut st.victim_runs);
            let v = pick_victims(st, &block_pages, rest.len() - spare_used, &mut runs);
            st.victim_runs = runs;
            v
        } else {
            Vec::new()
        };
        let missing = rest.len() - spare_used - victims.len();
        if let Some(max) = self.config.max_size {
            // Fail before touching anything: a request the cap cannot hold
            // must not grow the pool on its way to failing.
            if st.arena.reserved + (missing * page) as u64 > max {
                return Err(MapFailure::Capped);
            }
        }
        let mut got: Vec<usize> = Vec::with_capacity(rest.len());
        // Pages created by this call: given back to the device if the
        // device runs out before the request is covered (a failed request
        // must not grow the pool).
        let mut created: Vec<usize> = Vec::new();
        for _ in 0..spare_used {
            got.extend(st.arena.spare.pop());
        }
        for p in victims {
            got.push(st.arena.deactivate(p));
        }
        while got.len() < rest.len() {
            if let Some(max) = self.config.max_size {
                if st.arena.reserved + page as u64 > max {
                    st.arena.spare.extend(got);
                    return Err(MapFailure::Capped);
                }
            }
            let opts = PhysicalOptions {
                exportable: self.config.exportable,
            };
            match self.device.create_physical(page, opts) {
                Ok(handle) => {
                    let i = st.arena.phys.insert(crate::arena::PhysPage {
                        handle,
                        owner: None,
                        mappings: Vec::new(),
                    });
                    st.arena.reserved += page as u64;
                    st.arena.reserved_high = st.arena.reserved_high.max(st.arena.reserved);
                    st.arena.growths += 1;
                    got.push(i);
                    created.push(i);
                }
                Err(e) => {
                    for i in got {
                        if !created.contains(&i) {
                            st.arena.spare.push(i);
                        } else if let Err(e2) = self.release_phys(st, i) {
                            tracing::warn!(error = %e2, "releasing a page of a failed request failed");
                            st.arena.spare.push(i);
                        }
                    }
                    return Err(if e.is_out_of_memory() {
                        MapFailure::DeviceOom(e)
                    } else {
                        MapFailure::Device(e)
                    });
                }
            }
        }
        if !rest.is_empty() {
            tracing::debug!(
                pool = self.id,
                pages = rest.len(),
                len,
                "mapping pages for a request"
            );
        }
        for p in rest {
            let i = got.pop().expect("one physical page per target");
            if let Err(e) = self.bind(st, p, i) {
                got.push(i);
                st.arena.spare.extend(got);
                return Err(MapFailure::Device(e));
            }
            st.arena.remaps += 1;
        }
        st.arena.take(start, len);
        Ok(start)
    }

    /// Map physical page `i` at page `p` (a hole) and make it active there.
    /// A ghost mapping of another page at `p` is unmapped first; a physical
    /// page with many ghosts loses its oldest one, which bounds the number
    /// of mappings.
    fn bind(&self, st: &mut State<'_>, p: usize, i: usize) -> Result<(), SysError> {
        let page = st.arena.page;
        if st.arena.mapping_at(p).is_some() {
            self.device.unmap(self.page_ptr(st, p), page)?;
            st.arena.forget_mapping(p);
        }
        while st.arena.phys[i].mappings.len() >= MAX_GHOSTS {
            let oldest = st.arena.phys[i].mappings[0];
            self.device.unmap(self.page_ptr(st, oldest), page)?;
            st.arena.forget_mapping(oldest);
        }
        let ptr = self.page_ptr(st, p);
        let handle = st.arena.phys[i].handle;
        self.device.map(ptr, page, handle, 0)?;
        if let Err(e) = self.device.set_access(ptr, page, &self.share.access_list()) {
            if let Err(e2) = self.device.unmap(ptr, page) {
                tracing::warn!(error = %e2, "unmap after failed set_access failed");
            }
            return Err(e);
        }
        st.arena.record_mapping(p, i);
        st.arena.activate(p, i);
        Ok(())
    }

    fn page_ptr(&self, st: &State<'_>, p: usize) -> u64 {
        self.base + (p * st.arena.page) as u64
    }

    /// Unmap every mapping of physical page `i` (active nowhere) and
    /// release it to the device.
    fn release_phys(&self, st: &mut State<'_>, i: usize) -> Result<(), SysError> {
        let page = st.arena.page;
        while let Some(&p) = st.arena.phys[i].mappings.last() {
            self.device.unmap(self.page_ptr(st, p), page)?;
            st.arena.forget_mapping(p);
        }
        self.device.release_physical(st.arena.phys[i].handle)?;
        st.arena.phys.remove(i);
        st.arena.reserved -= page as u64;
        st.arena.releases += 1;
        Ok(())
    }

    /// Step 7: take a window of `len` bytes over adjacent free ranges (no
    /// remapping: free ranges lie on mapped pages) after making `stream`
    /// wait for every pending free in it, of however many streams. Windows
    /// that need the fewest streams waited for come first, then the
    /// tightest run of free ranges, then the lowest address.
    fn take_with_dependency(
        &self,
        st: &mut State<'_>,
        len: usize,
        stream: Stream,
        entry: &Arc<StreamEntry>,
    ) -> Result<Option<usize>, PoolError> {
        let me = stream.id();
        let clock = lock(&entry.state).clock.clone();
        let reuse = self.reuse();
        let align = st.align(len);
        // Runs of address-adjacent free ranges long enough for the request.
        let mut runs: Vec<Vec<(usize, FreeRange)>> = Vec::new();
        let mut current: Vec<(usize, FreeRange)> = Vec::new();
        let mut flush = |run: &mut Vec<(usize, FreeRange)>| {
            let total: usize = run.iter().map(|(_, r)| r.len).sum();
            if total >= len {
                runs.push(std::mem::take(run));
            } else {
                run.clear();
            }
        };
        for (o, r) in st.arena.free_ranges() {
            if current.last().is_some_and(|(lo, lr)| lo + lr.len != o) {
                flush(&mut current);
            }
            current.push((o, r));
        }
        flush(&mut current);
        // Candidate windows: (streams to wait for, run length, start, run).
        let mut candidates: Vec<(usize, usize, usize, usize)> = Vec::new();
        for (k, run) in runs.iter().enumerate() {
            let (lo, hi) = (run[0].0, run.last().map_or(0, |(o, r)| o + r.len));
            let mut starts: Vec<usize> = Vec::with_capacity(2 * run.len());
            for &(o, r) in run {
                starts.push(o.next_multiple_of(align));
                if let Some(s) = (o + r.len).checked_sub(len) {
                    if s >= lo {
                        starts.push(s / align * align);
                    }
                }
            }
            starts.sort_unstable();
            starts.dedup();
            for s in starts {
                if s < lo || s + len > hi {
                    continue;
                }
                let donors = window_donors(st, run, s, len, me, &clock, reuse);
                candidates.push((donors.len(), hi - lo, s, k));
            }
        }
        candidates.sort_unstable();
        let streams = self
            .streams
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        'windows: for (_, _, off, k) in candidates {
            let donors = window_donors(st, &runs[k], off, len, me, &clock, reuse);
            let mut records = Vec::with_capacity(donors.len());
            for (donor, epoch) in donors {
                let Some(donor_entry) = streams.get(&donor) else {
                    continue 'windows;
                };
                let mut d = lock(&donor_entry.state);
                let record = match d.event_covering(epoch) {
                    Some(r) => r,
                    None if d.epoch == epoch
                        && !d.retired
                        && !self.device.is_capturing(d.stream).unwrap_or(true) =>
                    {
                        let ev = self.events.acquire()?;
                        match self.device.record_event(ev, d.stream) {
                            Ok(()) => d.close_epoch(ev, self.events.clone()),
                            Err(_) => {
                                use crate::order::EventSink;
                                self.events.release(ev);
                                continue 'windows;
                            }
                        }
                    }
                    None => continue 'windows,
                };
                records.push(record);
            }
            for record in &records {
                self.device.wait_event(stream, record.event)?;
                lock(&entry.state).clock.merge(&record.clock);
                Counters::bump(&self.counters.internal_dependencies);
                tracing::debug!(
                    pool = self.id,
                    stream = me,
                    donor = record.stream.id(),
                    len,
                    "inserted an internal dependency"
                );
            }
            st.arena.take(off, len);
            return Ok(Some(off));
        }
        Ok(None)
    }

    /// The events recorded on every stream and not yet observed complete.
    fn pending_records(&self) -> Vec<Arc<EventRecord>> {
        let mut out = Vec::new();
        for (_, entry) in self.all_streams() {
            out.extend(lock(&entry.state).recorded.iter().cloned());
        }
        out
    }

    /// Step 8: wait on the host, until `deadline` at most (none: no
    /// bound), for the work before some of the records to complete, polling
    /// them all in turn. Called with no lock held. Returns the records seen
    /// complete (after the first completion, one pass more collects the
    /// others already done), and whether waiting longer may help (some
    /// completed, others are still pending, and time is left).
    fn wait_records(
        &self,
        pending: &[Arc<EventRecord>],
        deadline: Option<Instant>,
    ) -> (Vec<Arc<EventRecord>>, bool) {
        let mut done = Vec::new();
        let mut nap = std::time::Duration::from_micros(20);
        let mut left: Vec<&Arc<EventRecord>> = pending.iter().collect();
        while !left.is_empty() {
            let mut still = Vec::with_capacity(left.len());
            for rec in left {
                match self.device.query_event(rec.event) {
                    Ok(true) => done.push(rec.clone()),
                    Ok(false) => still.push(rec),
                    // A failed query: this record cannot be waited for.
                    Err(_) => {}
                }
            }
            left = still;
            if !done.is_empty() || deadline.is_some_and(|d| Instant::now() >= d) {
                break;
            }
            if !left.is_empty() {
                std::thread::sleep(nap);
                nap = (nap * 2).min(std::time::Duration::from_millis(1));
            }
        }
        if !done.is_empty() {
            tracing::debug!(
                pool = self.id,
                completed = done.len(),
                "host wait let pending frees complete"
            );
        }
        let more =
            !done.is_empty() && !left.is_empty() && deadline.is_none_or(|d| Instant::now() < d);
        (done, more)
    }

    /// Host-synchronised up to `epoch` on stream `id`.
    pub(crate) fn mark_synced(&self, id: u64, epoch: u64) {
        let mut st = lock(&self.arena);
        let e = st.synced.entry(id).or_insert(0);
        *e = (*e).max(epoch);
    }

    /// Release physical memory until at most `target` bytes are held.
    pub(crate) fn trim_to(&self, target: u64) -> Result<u64, PoolError> {
        let mut st = lock(&self.arena);
        self.flush_caches(&mut st);
        self.observe_completions(&mut st);
        let page = st.arena.page;
        let mut released = 0u64;
        while st.arena.reserved > target {
            let i = match st.arena.spare.pop() {
                Some(i) => i,
                None => {
                    let victim = st.arena.idle_pages().find(|&p| st.page_complete(p));
                    let Some(p) = victim else { break };
                    st.arena.deactivate(p)
                }
            };
            if let Err(e) = self.release_phys(&mut st, i) {
                // Keep the bookkeeping true: the page is still ours.
                st.arena.spare.push(i);
                return Err(e.into());
            }
            released += page as u64;
        }
        if released > 0 {
            tracing::debug!(pool = self.id, released, target, "trimmed");
        }
        Ok(released)
    }
}

/// Most mappings one physical page keeps (one active, the rest ghosts).
const MAX_GHOSTS: usize = 4;

/// The window of `len` bytes in `zone`, starting on a multiple of `align`,
/// that needs the fewest driver binds: it may span any run of holes and
/// free ranges usable by `me` (no block in use inside it). A hole page
/// costs a bind unless its ghost mapping can come back. Returns (binds,
/// pages to activate, start); ties go to fewer pages to activate, then to
/// the lowest address, so that a training loop finds the same window again.
fn best_window(
    st: &State<'_>,
    len: usize,
    align: usize,
    zone: &std::ops::Range<usize>,
    me: u64,
    clock: &VectorClock,
    reuse: ReusePolicy,
) -> Option<(usize, usize, usize)> {
    let page = st.arena.page;
    let mut best: Option<(usize, usize, usize)> = None;
    // Maximal spans [l, r) of usable free ranges and holes.
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
    // Per page of a span, prefix sums of binds and of activations.
    let mut binds: Vec<usize> = Vec::new();
    let mut acts: Vec<usize> = Vec::new();
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
        binds.push(0);
        acts.push(0);
        for p in p0..=p1 {
            let hole = !st.arena.is_active(p);
            let bind = hole && !ghost_available(st, p);
            binds.push(binds[binds.len() - 1] + bind as usize);
            acts.push(acts[acts.len() - 1] + hole as usize);
        }
        let mut consider = |s: usize| {
            if s < l || s + len > r || s % align != 0 {
                return;
            }
            let (a, b) = (s / page - p0, (s + len - 1) / page - p0 + 1);
            let cand = (binds[b] - binds[a], acts[b] - acts[a], s);
            if best.is_none_or(|b| cand < b) {
                best = Some(cand);
            }
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
    best
}

/// The window of `len` bytes in `zone` around one hole, extended by the
/// usable free ranges on either side, that needs the fewest driver binds;
/// ties go to fewer pages to activate, then to the tightest span. Returns
/// (binds, pages to activate, start).
fn hole_window(
    st: &State<'_>,
    len: usize,
    zone: &std::ops::Range<usize>,
    me: u64,
    clock: &VectorClock,
    reuse: ReusePolicy,
) -> Option<(usize, usize, usize)> {
    let page = st.arena.page;
    // (pages needing driver calls, pages to activate, window length, start)
    let mut best: Option<(usize, usize, usize, usize)> = None;
    for (ho, hl) in st.arena.holes() {
        if ho + hl <= zone.start || ho >= zone.end {
            continue;
        }
        let usable = |g: Guard| st.classify(g, me, clock, reuse).is_some();
        let mut left = ho;
        if let Some((fo, fr)) = st.arena.free_ending_at(ho) {
            if usable(fr.guard) {
                left = fo;
            }
        }
        let mut right = ho + hl;
        if let Some(fr) = st.arena.free_at(ho + hl) {
            if usable(fr.guard) {
                right = ho + hl + fr.len;
            }
        }
        let (left, right) = (left.max(zone.start), right.min(zone.end));
        if right < left + len {
            continue;
        }
        for start in [left, right - len] {
            let lo = start.max(ho);
            let hi = (start + len).min(ho + hl);
            let (mut need, mut driver) = (0, 0);
            if hi > lo {
                for p in lo / page..=(hi - 1) / page {
                    need += 1;
                    if !ghost_available(st, p) {
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
fn ghost_available(st: &State<'_>, p: usize) -> bool {
    let Some(phys) = st.arena.mapping_at(p) else {
        return false;
    };
    match st.arena.phys[phys].owner {
        None => true,
        Some(q) => st.arena.users(q) == 0 && st.page_complete(q),
    }
}

/// Whether physical page `phys` may be taken from where it is active
/// without disturbing the block being placed.
fn phys_movable(st: &State<'_>, phys: usize, block: &std::ops::RangeInclusive<usize>) -> bool {
    st.arena.phys[phys]
        .owner
        .is_none_or(|q| !block.contains(&q))
}

/// Completed idle pages to move, taken from the shortest runs of idle
/// pages first: a long run is a large free range that a large request will
/// want again, and breaking it up would only move the cost to that request.
/// Completion is checked only for the pages about to be taken (an idle
/// page whose frees are pending still counts in its run's length).
/// `runs` is scratch space (kept by the caller between calls).
fn pick_victims(
    st: &ArenaState,
    exclude: &std::ops::RangeInclusive<usize>,
    want: usize,
    runs: &mut Vec<(usize, usize)>,
) -> Vec<usize> {
    // idle_pages() is highest first: runs are descending sequences of
    // consecutive pages, (highest page, length).
    runs.clear();
    for p in st.arena.idle_pages().filter(|p| !exclude.contains(p)) {
        match runs.last_mut() {
            Some((top, l)) if *top + 1 - *l == p + 1 => *l += 1,
            _ => runs.push((p, 1)),
        }
    }
    // The highest pages are distinct: the order is total.
    runs.sort_unstable_by_key(|&(top, l)| (l, std::cmp::Reverse(top)));
    let mut out = Vec::with_capacity(want);
    for &(top, l) in runs.iter() {
        for p in (top + 1 - l..=top).rev() {
            if out.len() == want {
                return out;
            }
            if st.page_complete(p) {
                out.push(p);
            }
        }
    }
    out
}

/// Steps 1–3: best fit among free ranges usable now; for first-fit
/// requests, their window if all its pages are mapped there.
fn fit(
    st: &mut State<'_>,
    len: usize,
    me: u64,
    clock: &VectorClock,
    reuse: ReusePolicy,
) -> Option<usize> {
    let zone = st.zone(len);
    if st.first_fit(len) {
        let off = {
            let s: &ArenaState = st;
            s.arena.first_window(len, s.align(len), &zone, |g| {
                s.classify(g, me, clock, reuse).is_some()
            })?
        };
        let page = st.arena.page;
        if !(off / page..=(off + len - 1) / page).all(|p| st.arena.is_active(p)) {
            return None;
        }
        st.arena.take(off, len);
        return Some(off);
    }
    let (off, _) = {
        let s: &ArenaState = st;
        s.arena.find_fit(len, s.align(len), &zone, |g| {
            s.classify(g, me, clock, reuse)
        })?
    };
    st.arena.take(off, len);
    Some(off)
}

/// The streams whose pending frees lie in `[s, s+len)` of `run` (free
/// ranges in address order), each with the latest epoch to wait for; the
/// ranges usable by `me` now need no wait.
fn window_donors(
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
