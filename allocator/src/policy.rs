//! The reuse policy: where an allocation looks for memory, in order.
//!
//! [`acquire`] is the whole decision, as nine steps over one [`Ctx`] (the
//! request, the allocating stream and its clock, the reuse switches, and
//! the arena's lock while it is held). The order goes from the cheapest
//! and surest source of memory to the costliest:
//! 1. the allocating stream's own frees (no event, no query);
//! 2. frees the stream is already ordered after, through waits made via the
//!    pool (vector clocks) or a host synchronisation;
//! 3. frees observed complete (event query; opportunistic) — steps 1–3 are
//!    tried on what is known ([`fit_known`]), then again after every
//!    stream's cache joined the arena and the events were queried
//!    ([`fit_observed`]);
//! 4. stitching: wholly free pages are mapped into a contiguous virtual
//!    range, their old mappings kept: completed ones first, then, where
//!    growth is the alternative, ones whose frees are pending but ordered
//!    before the allocating stream (the old mapping then stays, held,
//!    until those frees complete);
//! 5. growth: new physical pages, mapped in place (4 and 5:
//!    [`stitch_or_grow`]);
//! 6. on growth failure, other pools of the device release their cached
//!    memory, then growth again ([`other_pools_release`]);
//! 7. internal dependency: the stream waits for the pending frees (of one
//!    stream or several) in a run of adjacent free ranges, and takes it;
//!    where no run is long enough on its own, it waits for every other
//!    stream's pending frees and steps 4 and 5 run again, so that a window
//!    over pending frees and new pages can be had ([`internal_dependency`]);
//! 8. last resort: wait on the host, bounded, with no lock held, for
//!    pending frees (the allocating stream's own too: joining them into one
//!    range remaps their pages), then steps 1–5 and 7 again
//!    ([`wait_for_pending`]);
//! 9. out-of-memory ([`out_of_memory`]).
//!
//! The placement searches are in `placement`, the driver calls of steps 4
//! and 5 in `pages`, events and completion in `ordering`: this module only
//! decides which to use when. Map, unmap and release act immediately, not in
//! stream order, so steps 4, 5 and trimming only ever unmap or release
//! memory whose frees are known complete.

use crate::arena::FreeRange;
use crate::config::{PoolConfig, ReusePolicy};
use crate::error::{OomReport, PoolError};
use crate::ordering::{RecordFailure, StreamEntry, StreamOrder, VectorClock};
use crate::pages::{MapFailure, Pages};
use crate::placement::{fit, window_donors, ArenaState, State};
use crate::stats::Counters;
use crate::sync::{lock, Arc, Mutex};
use std::time::Instant;
use tidepool_sys::{Device, Stream, SysError};

/// The parts of the pool the policy works with (the pool's id, device and
/// configuration are the page mapper's: built once per allocation, not
/// twice).
pub(crate) struct Parts<'a, D: Device> {
    pub order: &'a StreamOrder<D>,
    pub arena: &'a Mutex<ArenaState>,
    pub pages: Pages<'a, D>,
    pub counters: &'a Counters,
}

impl<'a, D: Device> Parts<'a, D> {
    fn id(&self) -> u64 {
        self.pages.pool
    }

    fn device(&self) -> &'a D {
        self.pages.device
    }

    fn config(&self) -> &'a PoolConfig {
        self.pages.config
    }

    /// Identifies the device among pools (for step 6).
    fn device_key(&self) -> usize {
        crate::registry::device_key(self.pages.device)
    }
}

/// One allocation's context through the steps.
pub(crate) struct Ctx<'a, D: Device> {
    pool: Parts<'a, D>,
    /// Bytes of the block (a multiple of the alignment).
    len: usize,
    stream: Stream,
    me: u64,
    entry: &'a Arc<StreamEntry>,
    /// What the stream has waited on through the pool (read again after a
    /// host wait).
    clock: VectorClock,
    reuse: ReusePolicy,
    /// The arena's lock: held through every step but while step 6 asks
    /// other pools and while step 8 waits.
    st: Option<State<'a>>,
    /// The device's out-of-memory error, if growth met one.
    cause: Option<SysError>,
}

const HELD: &str = "the arena lock is held between steps";

/// Find `len` bytes for `stream` (its private cache already missed), whose
/// waits through the pool are `clock` (read when the allocation began).
/// Returns the offset of the block in the arena. An out-of-memory report
/// leaves `used` for the caller to fill in (it needs no arena lock).
/// Inlined into its one caller, the pool's slow allocation: the parts
/// are then built in place, not copied into the context.
#[inline(always)]
pub(crate) fn acquire<'a, D: Device>(
    pool: Parts<'a, D>,
    len: usize,
    stream: Stream,
    entry: &'a Arc<StreamEntry>,
    reuse: ReusePolicy,
    clock: VectorClock,
) -> Result<usize, PoolError> {
    let mut st = lock(pool.arena);
    // Most allocations end here: no context is built for them, and the
    // lock and the clock are let go in place.
    if let Some(off) = fit_known(&pool, &mut st, len, stream.id(), entry, &clock, reuse) {
        return Ok(off);
    }
    let mut cx = Ctx {
        pool,
        len,
        stream,
        me: stream.id(),
        entry,
        clock,
        reuse,
        st: Some(st),
        cause: None,
    };
    if let Some(off) = fit_observed(&mut cx) {
        return Ok(off);
    }
    if let Some(off) = stitch_or_grow(&mut cx)? {
        return Ok(off);
    }
    if let Some(off) = internal_dependency(&mut cx)? {
        return Ok(off);
    }
    if let Some(off) = wait_for_pending(&mut cx)? {
        return Ok(off);
    }
    Err(out_of_memory(&cx))
}

/// Steps 1–3 on what the pool already knows. The stream's own cached frees
/// join the arena first: placement by address (first_fit) must see the
/// address space as the stream left it, or the layout drifts from one step
/// of a loop to the next (gpt2 warm pass remaps, fixed / varlen: 842 / 406
/// without this, 327 / 440 with it; pass 3: 668 / 388 and 306 / 327).
/// Flushing all of the stream's size classes, not only the request's, was
/// measured better (gpt2-fixed warm remaps 327 -> 5658 the other way, for
/// 10 % more cache hits). The watched streams (frees that went to the
/// arena, events not yet seen complete) are asked what completed first:
/// that costs what those few streams cost, and lets a producer take back
/// the block a consumer freed as soon as it is done.
#[inline(always)]
fn fit_known<D: Device>(
    pool: &Parts<'_, D>,
    st: &mut State<'_>,
    len: usize,
    me: u64,
    entry: &StreamEntry,
    clock: &VectorClock,
    reuse: ReusePolicy,
) -> Option<usize> {
    {
        let ArenaState { arena, done, .. } = &mut **st;
        pool.order
            .flush_own_cache(arena, done, reuse.opportunistic, me, entry);
        pool.order
            .poll_completions(arena, done, reuse.opportunistic, me, Some(entry));
    }
    fit(st, len, me, clock, reuse)
}

/// Step 3 after asking the device which frees completed, and after the
/// streams' private caches join the arena (so that neither stitching nor
/// growth happens while a fitting free range exists).
fn fit_observed<D: Device>(cx: &mut Ctx<'_, D>) -> Option<usize> {
    let st = cx.st.as_mut().expect(HELD);
    observe(cx.pool.order, st, cx.reuse);
    fit(st, cx.len, cx.me, &cx.clock, cx.reuse)
}

/// Every stream's cache into the arena, then the events queried.
fn observe<D: Device>(order: &StreamOrder<D>, st: &mut State<'_>, reuse: ReusePolicy) {
    let ArenaState { arena, done, .. } = &mut **st;
    order.flush_caches(arena, done, reuse.opportunistic);
    order.observe_completions(arena, done, reuse.opportunistic);
}

/// Steps 4 and 5: stitch completed free pages, grow; step 6 when the
/// device ran out. `Ok(None)`: no window, or the pool's cap, or the device
/// still out of memory (noted as the cause).
fn stitch_or_grow<D: Device>(cx: &mut Ctx<'_, D>) -> Result<Option<usize>, PoolError> {
    let st = cx.st.as_mut().expect(HELD);
    match cx
        .pool
        .pages
        .map_any(st, cx.len, cx.me, &cx.clock, cx.reuse)
    {
        Ok(off) => Ok(Some(off)),
        Err(MapFailure::DeviceOom(e)) => other_pools_release(cx, e),
        Err(MapFailure::Device(e)) => Err(e.into()),
        Err(MapFailure::Capped) | Err(MapFailure::NoWindow) => Ok(None),
    }
}

/// Step 6: other pools of the device give back their cache (asked with
/// this pool's lock released: they may ask us back), then growth again.
fn other_pools_release<D: Device>(
    cx: &mut Ctx<'_, D>,
    first: SysError,
) -> Result<Option<usize>, PoolError> {
    drop(cx.st.take());
    let freed = crate::registry::release_other_pools(cx.pool.device_key(), cx.pool.id());
    tracing::debug!(
        pool = cx.pool.id(),
        freed,
        "released other pools' cached memory"
    );
    let st = cx.st.insert(lock(cx.pool.arena));
    match cx
        .pool
        .pages
        .map_any(st, cx.len, cx.me, &cx.clock, cx.reuse)
    {
        Ok(off) => Ok(Some(off)),
        Err(MapFailure::DeviceOom(e2)) => {
            cx.cause = Some(e2);
            Ok(None)
        }
        Err(MapFailure::Device(e)) => Err(e.into()),
        Err(_) => {
            cx.cause = Some(first);
            Ok(None)
        }
    }
}

/// Step 7 when the switch allows it: a run of free ranges long enough on
/// its own, else pending frees joined with growth.
fn internal_dependency<D: Device>(cx: &mut Ctx<'_, D>) -> Result<Option<usize>, PoolError> {
    if !cx.reuse.internal_dependencies {
        return Ok(None);
    }
    if let Some(off) = take_with_dependency(cx)? {
        return Ok(Some(off));
    }
    grow_with_dependency(cx)
}

/// Step 7 where no run of free ranges is long enough on its own, but one
/// with holes beside it is (pending frees plus the growth the cap still
/// allows): the stream waits, on the device, for every other stream's
/// recorded frees, and steps 4 and 5 run again with the ranges those
/// waits make usable in place. Waiting for more than the window ends up
/// using only orders the stream later than it had to be, and only on the
/// way to an out-of-memory error; the host wait of step 8 would block the
/// caller for the same frees.
fn grow_with_dependency<D: Device>(cx: &mut Ctx<'_, D>) -> Result<Option<usize>, PoolError> {
    let records: Vec<_> = cx
        .pool
        .order
        .pending_records()
        .into_iter()
        .filter(|r| r.stream.id() != cx.me && cx.clock.get(r.stream.id()) < r.epoch)
        .collect();
    if records.is_empty() {
        return Ok(None);
    }
    for record in &records {
        cx.pool.device().wait_event(cx.stream, record.event)?;
        cx.pool
            .order
            .merge_clock(&mut lock(&cx.entry.state), &record.clock);
        cx.clock.merge(&record.clock);
        Counters::bump(&cx.pool.counters.internal_dependencies);
        tracing::debug!(
            pool = cx.pool.id(),
            stream = cx.me,
            donor = record.stream.id(),
            len = cx.len,
            "inserted an internal dependency to grow beside pending frees"
        );
    }
    stitch_or_grow(cx)
}

/// Step 8: bounded host wait for pending frees (every stream's, the
/// allocating stream's own included: stream order makes those safe for it,
/// but joining their pages into one range remaps them, and remapping acts
/// at once). The wait holds no lock; afterwards the pool tries again
/// whatever the wait saw, since completions may also have been observed
/// meanwhile by this thread or another.
fn wait_for_pending<D: Device>(cx: &mut Ctx<'_, D>) -> Result<Option<usize>, PoolError> {
    if !cx.reuse.wait_for_pending_frees {
        return Ok(None);
    }
    // An unrepresentable deadline (Duration::MAX) means no deadline.
    let deadline = Instant::now().checked_add(cx.pool.config().last_resort_wait);
    loop {
        let order = cx.pool.order;
        {
            let st = cx.st.as_mut().expect(HELD);
            let ArenaState { arena, done, .. } = &mut **st;
            order.observe_completions(arena, done, cx.reuse.opportunistic);
        }
        let pending = order.pending_records();
        drop(cx.st.take());
        // Returns as soon as some free completes: the request is tried
        // again then, rather than after every pending free (some may wait
        // for work the caller issues only later).
        let (done, more) = order.wait_records(&pending, deadline);
        let st = cx.st.insert(lock(cx.pool.arena));
        for rec in done {
            // Not for a stream forgotten during the wait that no guard
            // names any more.
            if order.is_known(rec.stream.id()) {
                st.done.mark_synced(rec.stream.id(), rec.epoch);
            }
        }
        observe(order, st, cx.reuse);
        cx.clock = lock(&cx.entry.state).clock.clone();
        if let Some(off) = fit(st, cx.len, cx.me, &cx.clock, cx.reuse) {
            return Ok(Some(off));
        }
        match cx
            .pool
            .pages
            .map_any(st, cx.len, cx.me, &cx.clock, cx.reuse)
        {
            Ok(off) => return Ok(Some(off)),
            Err(MapFailure::DeviceOom(e)) => cx.cause = Some(e),
            Err(MapFailure::Device(e)) => return Err(e.into()),
            Err(_) => {}
        }
        if let Some(off) = internal_dependency(cx)? {
            return Ok(Some(off));
        }
        if !more {
            return Ok(None);
        }
    }
}

/// Step 9: the report of the pool's state (`used` is the caller's).
fn out_of_memory<D: Device>(cx: &Ctx<'_, D>) -> PoolError {
    let st = cx.st.as_ref().expect(HELD);
    PoolError::OutOfMemory(Box::new(OomReport {
        requested: cx.len,
        reserved: st.arena.reserved(),
        used: 0,
        largest_free_range: st.arena.largest_free() as u64,
        device_free: cx.pool.device().mem_info().ok().map(|m| m.free as u64),
        max_size: cx.pool.config().max_size,
        cause: cx.cause.clone(),
    }))
}

/// Step 7: take a window of `len` bytes over adjacent free ranges (no
/// remapping: free ranges lie on mapped pages) after making the stream
/// wait for every pending free in it, of however many streams. Windows
/// that need the fewest streams waited for come first, then the tightest
/// run of free ranges, then the lowest address.
fn take_with_dependency<D: Device>(cx: &mut Ctx<'_, D>) -> Result<Option<usize>, PoolError> {
    let (len, stream, me, entry, reuse) = (cx.len, cx.stream, cx.me, cx.entry, cx.reuse);
    let pool = &cx.pool;
    let st = cx.st.as_mut().expect(HELD);
    let clock = lock(&entry.state).clock.clone();
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
    'windows: for (_, _, off, k) in candidates {
        let donors = window_donors(st, &runs[k], off, len, me, &clock, reuse);
        let mut records = Vec::with_capacity(donors.len());
        for (donor, epoch) in donors {
            let Some(donor_entry) = pool.order.entry_by_id(donor) else {
                continue 'windows;
            };
            let mut d = lock(&donor_entry.state);
            let record = match d.event_covering(epoch) {
                Some(r) => r,
                None if d.epoch == epoch
                    && !d.retired
                    && !pool.device().is_capturing(d.stream).unwrap_or(true) =>
                {
                    match pool.order.record_closing(&mut d) {
                        Ok(r) => r,
                        Err(RecordFailure::Acquire(e)) => return Err(e.into()),
                        Err(RecordFailure::Record(_)) => continue 'windows,
                    }
                }
                None => continue 'windows,
            };
            records.push(record);
        }
        for record in &records {
            pool.device().wait_event(stream, record.event)?;
            pool.order
                .merge_clock(&mut lock(&entry.state), &record.clock);
            Counters::bump(&pool.counters.internal_dependencies);
            tracing::debug!(
                pool = pool.id(),
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
