//! A property-based model of the pool's contract on the host backend.
//!
//! proptest generates sequences of operations over three streams: allocate,
//! free on the allocation's stream or (ordered after it) on another,
//! declared uses, event record/wait through the pool, host tasks that hold
//! a stream busy until the test releases them, synchronisations, trims and
//! reuse-switch changes. Nothing depends on timing: a busy stream stays
//! busy until the sequence says so.
//!
//! Checked against a shadow:
//! - **What may be reused when.** The device under the pool is wrapped by a
//!   tracker that keeps the true happens-before order of the device work: a
//!   vector clock per stream, advanced by every task, snapshot by every
//!   event record and merged by every event wait (the pool's own internal
//!   waits included); and what the pool has observed complete (an event
//!   query that answered done, a synchronisation that returned). Every
//!   access to an allocation (its tag fill on the allocating stream, the
//!   tag checks on declared-use streams and on the freeing stream) is
//!   remembered with its stream position. When the pool hands out memory
//!   that overlaps an earlier allocation, every access of that earlier
//!   allocation must be ordered before the new allocation's stream, or
//!   observed complete by the pool before the allocation returned. This
//!   check does not depend on timing: it judges the pool's decision from
//!   what the pool knew.
//! - **The memory itself.** Each allocation gets a unique tag, written in
//!   stream order on its stream and checked in stream order before its free
//!   and on every declared-use stream; a mismatch, or an access to memory
//!   the pool unmapped, is a failure. Live allocations never overlap.
//! - **The statistics.** After every step: used bytes equal the live
//!   bytes, allocation and free counts match, reserved bytes equal the
//!   pages the pool holds and stay under the cap, highs are at least the
//!   currents; a failed allocation is out-of-memory (only possible under a
//!   cap) and changes nothing but the out-of-memory count.
//!
//! CI runs 256 cases; `PROPTEST_CASES=N` runs more. A failure is shrunk to a
//! minimal sequence, printed as a list of steps.

mod common;

use common::PAGE;
use proptest::prelude::*;
use proptest::test_runner::{Config as PtConfig, TestCaseError, TestRunner};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tidepool::{Allocation, MemPool, PoolConfig, PoolError, ReusePolicy};
use tidepool_sys::{Device, DevicePtr, Event, HostConfig, HostDevice, HostTask, Stream, SysResult};

// ---------------------------------------------------------------------------
// The tracker: true happens-before of the device work.

/// For each stream id, how many tasks of it are ordered before.
type Clock = BTreeMap<u64, u64>;

fn merge(into: &mut Clock, from: &Clock) {
    for (&s, &n) in from {
        let e = into.entry(s).or_insert(0);
        *e = (*e).max(n);
    }
}

#[derive(Default)]
struct Order {
    streams: HashMap<u64, Clock>,
    events: HashMap<u64, Clock>,
    /// Work the pool has observed complete (an event query that said
    /// done, a synchronisation that returned): per stream, up to which task.
    done: Clock,
}

struct Tracker {
    inner: HostDevice,
    order: Mutex<Order>,
}

impl Tracker {
    /// Count one task on `stream`; returns its position and clock.
    fn task(&self, stream: Stream) -> (u64, Clock) {
        let mut o = self.order.lock().unwrap();
        let c = o.streams.entry(stream.id()).or_default();
        let n = c.entry(stream.id()).or_insert(0);
        *n += 1;
        (*n, c.clone())
    }

    fn clock(&self, stream: Stream) -> Clock {
        let o = self.order.lock().unwrap();
        o.streams.get(&stream.id()).cloned().unwrap_or_default()
    }

    fn done(&self) -> Clock {
        self.order.lock().unwrap().done.clone()
    }

    /// Note that everything before `clock` has completed.
    fn observed(&self, clock: &Clock) {
        merge(&mut self.order.lock().unwrap().done, clock);
    }

    fn event_clock(&self, event: Event) -> Clock {
        let o = self.order.lock().unwrap();
        o.events.get(&event.id()).cloned().unwrap_or_default()
    }
}

impl common::wrap::Hooks for Tracker {
    type Inner = HostDevice;
    fn inner(&self) -> &HostDevice {
        &self.inner
    }
    fn synchronize_stream(&self, stream: Stream) -> SysResult<()> {
        let c = self.clock(stream);
        self.inner.synchronize_stream(stream)?;
        self.observed(&c);
        Ok(())
    }
    fn synchronize_device(&self) -> SysResult<()> {
        let all: Vec<Clock> = self
            .order
            .lock()
            .unwrap()
            .streams
            .values()
            .cloned()
            .collect();
        self.inner.synchronize_device()?;
        for c in &all {
            self.observed(c);
        }
        Ok(())
    }
    fn query_stream(&self, stream: Stream) -> SysResult<bool> {
        let c = self.clock(stream);
        let done = self.inner.query_stream(stream)?;
        if done {
            self.observed(&c);
        }
        Ok(done)
    }
    fn record_event(&self, event: Event, stream: Stream) -> SysResult<()> {
        // The lock spans the device call, so the snapshot and the record
        // happen at the same point of the stream's work.
        let mut o = self.order.lock().unwrap();
        self.inner.record_event(event, stream)?;
        let c = o.streams.get(&stream.id()).cloned().unwrap_or_default();
        o.events.insert(event.id(), c);
        Ok(())
    }
    fn query_event(&self, event: Event) -> SysResult<bool> {
        let c = self.event_clock(event);
        let done = self.inner.query_event(event)?;
        if done {
            self.observed(&c);
        }
        Ok(done)
    }
    fn synchronize_event(&self, event: Event) -> SysResult<()> {
        let c = self.event_clock(event);
        self.inner.synchronize_event(event)?;
        self.observed(&c);
        Ok(())
    }
    fn wait_event(&self, stream: Stream, event: Event) -> SysResult<()> {
        let mut o = self.order.lock().unwrap();
        self.inner.wait_event(stream, event)?;
        if let Some(c) = o.events.get(&event.id()).cloned() {
            merge(o.streams.entry(stream.id()).or_default(), &c);
        }
        Ok(())
    }
    fn launch_host(&self, stream: Stream, task: HostTask) -> SysResult<()> {
        let mut o = self.order.lock().unwrap();
        self.inner.launch_host(stream, task)?;
        let c = o.streams.entry(stream.id()).or_default();
        *c.entry(stream.id()).or_insert(0) += 1;
        Ok(())
    }
}

common::wrap::wrapped_device!(Tracker);

// ---------------------------------------------------------------------------
// Generated operations.

const STREAMS: usize = 3;
/// Sizes to pick from: small ones share pages, large ones span several.
const SIZES: [usize; 6] = [512, 4096, 100_000, 700_000, PAGE, 5 << 20];

#[derive(Debug, Clone, Copy)]
enum Step {
    /// Allocate `SIZES[size]` bytes on `stream`.
    Alloc { stream: usize, size: usize },
    /// Free the live allocation number `pick % live` on its own stream, or
    /// on `other` after ordering `other` after the allocating stream.
    Free { pick: usize, other: Option<usize> },
    /// Declare (and make) a use of a live allocation on `stream`.
    Use { pick: usize, stream: usize },
    /// Record an event on `from` through the pool and make `to` wait for it.
    Order { from: usize, to: usize },
    /// Hold `stream` busy with a host task until released.
    Hold { stream: usize },
    /// Release the oldest task held on `stream`.
    Release { stream: usize },
    /// Release every held task, then synchronise `stream` through the pool.
    SyncStream { stream: usize },
    /// Release every held task, then synchronise the whole pool.
    SyncAll,
    /// Trim the pool to `pages` pages.
    Trim { pages: u64 },
    /// Set the reuse switches (the host wait of the last resort stays off:
    /// it would wait for held tasks on a clock).
    SetReuse {
        follow: bool,
        opportunistic: bool,
        internal: bool,
    },
}

fn step() -> impl Strategy<Value = Step> {
    let s = || 0..STREAMS;
    prop_oneof![
        6 => (s(), 0..SIZES.len()).prop_map(|(stream, size)| Step::Alloc { stream, size }),
        5 => (0usize..8, proptest::option::of(s()))
            .prop_map(|(pick, other)| Step::Free { pick, other }),
        1 => (0usize..8, s()).prop_map(|(pick, stream)| Step::Use { pick, stream }),
        2 => (s(), s()).prop_map(|(from, to)| Step::Order { from, to }),
        2 => s().prop_map(|stream| Step::Hold { stream }),
        2 => s().prop_map(|stream| Step::Release { stream }),
        1 => s().prop_map(|stream| Step::SyncStream { stream }),
        1 => Just(Step::SyncAll),
        1 => (0u64..4).prop_map(|pages| Step::Trim { pages }),
        1 => (any::<bool>(), any::<bool>(), any::<bool>()).prop_map(
            |(follow, opportunistic, internal)| Step::SetReuse {
                follow,
                opportunistic,
                internal
            }
        ),
    ]
}

#[derive(Debug, Clone)]
struct Case {
    /// Per-stream cache size.
    cache: usize,
    /// Pool maximum, in pages.
    cap_pages: Option<u64>,
    steps: Vec<Step>,
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop_oneof![Just(0usize), Just(1 << 20), Just(256 << 20)],
        proptest::option::of(4u64..12),
        proptest::collection::vec(step(), 1..60),
    )
        .prop_map(|(cache, cap_pages, steps)| Case {
            cache,
            cap_pages,
            steps,
        })
}

// ---------------------------------------------------------------------------
// Running a case against the shadow.

/// One access to an allocation: the stream, the task's position there and
/// the task's clock (what is ordered before it).
#[derive(Debug, Clone)]
struct Access {
    stream: u64,
    pos: u64,
    clock: Clock,
}

struct Live {
    alloc: Allocation,
    tag: u32,
    accesses: Vec<Access>,
}

/// A freed allocation whose accesses may not have completed yet.
struct Freed {
    ptr: DevicePtr,
    end: DevicePtr,
    accesses: Vec<Access>,
    what: String,
}

/// A task held on a stream, at a position.
struct Held {
    stream: u64,
    pos: u64,
    _blocker: common::Blocker,
}

/// Failures of tag checks and of accesses to unmapped memory, found by the
/// device tasks themselves.
#[derive(Default)]
struct Faults {
    mismatches: AtomicU64,
    unmapped: AtomicU64,
    first: Mutex<Option<String>>,
}

impl Faults {
    fn note(&self, counter: &AtomicU64, what: String) {
        counter.fetch_add(1, Ordering::SeqCst);
        let mut f = self.first.lock().unwrap();
        if f.is_none() {
            *f = Some(what);
        }
    }
}

struct Run {
    dev: Arc<Tracker>,
    streams: Vec<Stream>,
    live: Vec<Live>,
    freed: Vec<Freed>,
    live_bytes: u64,
    allocs: u64,
    frees: u64,
    ooms: u64,
    next_tag: u32,
    cap: Option<u64>,
    faults: Arc<Faults>,
    // Declared last: dropped first, so a failing case releases every held
    // task before the pool (whose drop waits for pending frees).
    held: Vec<Held>,
}

macro_rules! check {
    ($cond:expr, $($fmt:tt)*) => {
        if !$cond {
            return Err(TestCaseError::fail(format!($($fmt)*)));
        }
    };
}

impl Run {
    fn held_in_past(&self, a: &Access) -> bool {
        self.held_before(&a.clock)
    }

    fn held_before(&self, clock: &Clock) -> bool {
        self.held
            .iter()
            .any(|h| clock.get(&h.stream).copied().unwrap_or(0) >= h.pos)
    }

    /// Wait (directly on the device, unseen by the tracker's record of what
    /// the pool observed) until every stream's work that no held task
    /// precedes has finished. Done before each step and after each task
    /// launch, it makes the device's state a function of the steps alone:
    /// an event the pool records or queries is complete exactly when no
    /// held task precedes it. So a case replays the same way every time,
    /// and shrinking is reliable.
    fn quiesce(&self) {
        for &s in &self.streams {
            if !self.held_before(&self.dev.clock(s)) {
                self.dev.inner.synchronize_stream(s).expect("quiesce");
            }
        }
    }

    /// Launch a task on `stream` that writes (or checks) the tag in the
    /// first and last word of the allocation.
    fn touch(&self, stream: Stream, ptr: DevicePtr, size: usize, tag: u32, write: bool) -> Access {
        let len = (size / 4 * 4).max(4);
        let faults = self.faults.clone();
        let last = len / 4 - 1;
        let (pos, clock) = {
            // Same lock order as the tracker's own launch: the position is
            // the task's.
            let r =
                self.dev
                    .inner
                    .launch_on_words(stream, ptr, len, move |r| match r {
                        Ok(words) => {
                            for i in [0, last] {
                                if write {
                                    words[i].store(tag, Ordering::Relaxed);
                                } else {
                                    let got = words[i].load(Ordering::Relaxed);
                                    if got != tag {
                                        faults.note(
                                    &faults.mismatches,
                                    format!("{ptr:#x} word {i}: tag {got:#x}, expected {tag:#x}"),
                                );
                                    }
                                }
                            }
                        }
                        Err(e) => faults.note(&faults.unmapped, format!("{ptr:#x}+{len}: {e}")),
                    });
            r.expect("launch a tag task");
            self.dev.task(stream)
        };
        self.quiesce();
        Access {
            stream: stream.id(),
            pos,
            clock,
        }
    }

    fn pool_check(&self, pool: &MemPool<Tracker>, at: &str) -> Result<(), TestCaseError> {
        let st = pool.stats();
        check!(
            st.used_current == self.live_bytes,
            "{at}: used_current {} != live bytes {}",
            st.used_current,
            self.live_bytes
        );
        check!(
            st.allocs == self.allocs,
            "{at}: allocs {} != {}",
            st.allocs,
            self.allocs
        );
        check!(
            st.frees == self.frees,
            "{at}: frees {} != {}",
            st.frees,
            self.frees
        );
        check!(
            st.ooms == self.ooms,
            "{at}: ooms {} != {}",
            st.ooms,
            self.ooms
        );
        check!(
            st.reserved_current == (st.growths - st.releases) * PAGE as u64,
            "{at}: reserved {} is not the pages held",
            st.reserved_current
        );
        check!(
            st.reserved_current == (self.dev.inner.live_handles() * PAGE) as u64,
            "{at}: reserved {} but the device holds {} pages",
            st.reserved_current,
            self.dev.inner.live_handles()
        );
        if let Some(cap) = self.cap {
            check!(
                st.reserved_current <= cap,
                "{at}: reserved {} over the cap {cap}",
                st.reserved_current
            );
        }
        check!(
            st.used_current <= st.reserved_current,
            "{at}: used > reserved"
        );
        check!(
            st.used_high >= st.used_current,
            "{at}: used_high < used_current"
        );
        check!(
            st.reserved_high >= st.reserved_current,
            "{at}: reserved_high < reserved_current"
        );
        let first = self.faults.first.lock().unwrap().clone();
        check!(
            first.is_none(),
            "{at}: a device task saw {}",
            first.unwrap_or_default()
        );
        Ok(())
    }

    fn release_all(&mut self) {
        self.held.clear();
    }

    fn step(&mut self, pool: &MemPool<Tracker>, i: usize, step: Step) -> Result<(), TestCaseError> {
        let at = format!("step {i} ({step:?})");
        let s = self.streams.clone();
        self.quiesce();
        match step {
            Step::Alloc { stream, size } => {
                let size = SIZES[size];
                let before = pool.stats();
                let a = match pool.alloc_async(size, s[stream]) {
                    Ok(a) => a,
                    Err(PoolError::OutOfMemory(r)) => {
                        check!(self.cap.is_some(), "{at}: out of memory with no cap: {r:?}");
                        // No false out-of-memory: with nothing held (all work
                        // done and the pool free to observe it) and enough
                        // pages untouched by live allocations, the pool must
                        // find or stitch the memory.
                        let touched: std::collections::BTreeSet<u64> = self
                            .live
                            .iter()
                            .flat_map(|l| {
                                let p = l.alloc.ptr();
                                p / PAGE as u64..=(p + l.alloc.size() as u64 - 1) / PAGE as u64
                            })
                            .collect();
                        let cap_pages = self.cap.unwrap() / PAGE as u64;
                        let free_pages = cap_pages.saturating_sub(touched.len() as u64);
                        let need = (size as u64).div_ceil(PAGE as u64) + 1;
                        check!(
                            !(self.held.is_empty() && pool.reuse().opportunistic && free_pages >= need),
                            "{at}: false out of memory: nothing held, {free_pages} of {cap_pages} pages untouched by live allocations, {need} needed: {r:?}"
                        );
                        self.ooms += 1;
                        let after = pool.stats();
                        check!(
                            after.reserved_current <= before.reserved_current,
                            "{at}: a failed allocation grew the pool"
                        );
                        return Ok(());
                    }
                    Err(e) => return Err(TestCaseError::fail(format!("{at}: {e}"))),
                };
                let (ptr, end) = (a.ptr(), a.ptr() + size as u64);
                // Live allocations never overlap.
                for l in &self.live {
                    let (p, e) = (l.alloc.ptr(), l.alloc.ptr() + l.alloc.size() as u64);
                    check!(
                        end <= p || e <= ptr,
                        "{at}: {ptr:#x}+{size} overlaps live {p:#x}..{e:#x}"
                    );
                }
                // Reuse: every access of an overlapped earlier allocation is
                // ordered before this stream (through waits the device saw),
                // or the pool observed it complete (an event query or a
                // synchronisation that returned before this allocation).
                let mine = self.dev.clock(s[stream]);
                let done = self.dev.done();
                let name = |id: u64| s.iter().position(|x| x.id() == id).unwrap_or(usize::MAX);
                for f in &self.freed {
                    if end <= f.ptr || f.end <= ptr {
                        continue;
                    }
                    for acc in &f.accesses {
                        let ordered = mine.get(&acc.stream).copied().unwrap_or(0) >= acc.pos;
                        let complete = done.get(&acc.stream).copied().unwrap_or(0) >= acc.pos;
                        check!(
                            ordered || complete,
                            "{at}: got {ptr:#x}+{size} on stream {stream}, overlapping {}, whose access on stream {} is neither ordered before stream {stream} nor observed complete{}",
                            f.what,
                            name(acc.stream),
                            if self.held_in_past(acc) { " (and a held task precedes it)" } else { "" }
                        );
                    }
                }
                self.next_tag = self.next_tag.wrapping_add(0x9E37_79B9) | 1;
                let tag = self.next_tag;
                let acc = self.touch(s[stream], ptr, size, tag, true);
                self.live.push(Live {
                    alloc: a,
                    tag,
                    accesses: vec![acc],
                });
                self.live_bytes += size as u64;
                self.allocs += 1;
            }
            Step::Free { pick, other } => {
                if self.live.is_empty() {
                    return Ok(());
                }
                let mut l = self.live.swap_remove(pick % self.live.len());
                let own = l.alloc.stream();
                let on = other.map_or(own, |o| s[o]);
                if on != own {
                    // The contract: a free on another stream is ordered after
                    // every use on the allocating stream.
                    let ev = pool
                        .record_event(own)
                        .map_err(|e| TestCaseError::fail(format!("{at}: {e}")))?;
                    pool.wait_event(on, &ev)
                        .map_err(|e| TestCaseError::fail(format!("{at}: {e}")))?;
                }
                let (ptr, size) = (l.alloc.ptr(), l.alloc.size());
                let acc = self.touch(on, ptr, size, l.tag, false);
                l.accesses.push(acc);
                let what = format!(
                    "{ptr:#x}+{size} (allocated on stream {}, freed on stream {})",
                    s.iter().position(|&x| x == own).unwrap(),
                    s.iter().position(|&x| x == on).unwrap()
                );
                pool.free_async(l.alloc, on)
                    .map_err(|e| TestCaseError::fail(format!("{at}: {e}")))?;
                self.freed.push(Freed {
                    ptr,
                    end: ptr + size as u64,
                    accesses: l.accesses,
                    what,
                });
                self.live_bytes -= size as u64;
                self.frees += 1;
            }
            Step::Use { pick, stream } => {
                if self.live.is_empty() {
                    return Ok(());
                }
                let n = pick % self.live.len();
                let own = self.live[n].alloc.stream();
                if own != s[stream] {
                    // The use reads the tag, so it must come after the fill.
                    let ev = pool
                        .record_event(own)
                        .map_err(|e| TestCaseError::fail(format!("{at}: {e}")))?;
                    pool.wait_event(s[stream], &ev)
                        .map_err(|e| TestCaseError::fail(format!("{at}: {e}")))?;
                }
                let (ptr, size, tag) = (
                    self.live[n].alloc.ptr(),
                    self.live[n].alloc.size(),
                    self.live[n].tag,
                );
                let acc = self.touch(s[stream], ptr, size, tag, false);
                let l = &mut self.live[n];
                pool.record_use(&mut l.alloc, s[stream]);
                l.accesses.push(acc);
            }
            Step::Order { from, to } => {
                let ev = pool
                    .record_event(s[from])
                    .map_err(|e| TestCaseError::fail(format!("{at}: {e}")))?;
                pool.wait_event(s[to], &ev)
                    .map_err(|e| TestCaseError::fail(format!("{at}: {e}")))?;
            }
            Step::Hold { stream } => {
                let b = common::Blocker::on(&*self.dev, s[stream]);
                let pos = self
                    .dev
                    .clock(s[stream])
                    .get(&s[stream].id())
                    .copied()
                    .unwrap_or(0);
                self.held.push(Held {
                    stream: s[stream].id(),
                    pos,
                    _blocker: b,
                });
            }
            Step::Release { stream } => {
                if let Some(n) = self.held.iter().position(|h| h.stream == s[stream].id()) {
                    self.held.remove(n);
                }
            }
            Step::SyncStream { stream } => {
                self.release_all();
                pool.synchronize_stream(s[stream])
                    .map_err(|e| TestCaseError::fail(format!("{at}: {e}")))?;
            }
            Step::SyncAll => {
                self.release_all();
                pool.synchronize()
                    .map_err(|e| TestCaseError::fail(format!("{at}: {e}")))?;
            }
            Step::Trim { pages } => {
                pool.trim_to(pages * PAGE as u64)
                    .map_err(|e| TestCaseError::fail(format!("{at}: {e}")))?;
            }
            Step::SetReuse {
                follow,
                opportunistic,
                internal,
            } => pool.set_reuse(ReusePolicy {
                follow_event_dependencies: follow,
                opportunistic,
                internal_dependencies: internal,
                wait_for_pending_frees: false,
            }),
        }
        // Forget accesses observed complete: any stream may reuse their
        // memory from now on.
        let done = self.dev.done();
        self.freed.retain_mut(|f| {
            f.accesses
                .retain(|a| done.get(&a.stream).copied().unwrap_or(0) < a.pos);
            !f.accesses.is_empty()
        });
        self.pool_check(pool, &at)
    }
}

fn run_case(c: &Case) -> Result<(), TestCaseError> {
    let dev = Arc::new(Tracker {
        inner: HostDevice::with_config(HostConfig {
            capacity: 256 << 20,
            granularity: PAGE,
        }),
        order: Mutex::new(Order::default()),
    });
    let streams: Vec<Stream> = (0..STREAMS).map(|_| dev.create_stream().unwrap()).collect();
    let cap = c.cap_pages.map(|p| p * PAGE as u64);
    let mut config = PoolConfig::default()
        .with_va_size(1 << 30)
        .with_stream_cache_bytes(c.cache)
        .with_reuse(ReusePolicy {
            wait_for_pending_frees: false,
            ..ReusePolicy::default()
        });
    if let Some(cap) = cap {
        config = config.with_max_size(cap);
    }
    let pool = MemPool::new(dev.clone(), config).expect("pool");
    let mut run = Run {
        dev: dev.clone(),
        streams: streams.clone(),
        live: Vec::new(),
        freed: Vec::new(),
        live_bytes: 0,
        allocs: 0,
        frees: 0,
        ooms: 0,
        next_tag: 1,
        cap,
        faults: Arc::new(Faults::default()),
        held: Vec::new(),
    };
    let mut result = Ok(());
    for (i, &s) in c.steps.iter().enumerate() {
        result = run.step(&pool, i, s);
        if result.is_err() {
            break;
        }
    }
    // The end: release everything, free what is live, synchronise; every
    // tag check must have passed and the statistics must read zero used.
    run.release_all();
    if result.is_ok() {
        let live = std::mem::take(&mut run.live);
        for l in live {
            let (ptr, size, tag, own) = (l.alloc.ptr(), l.alloc.size(), l.tag, l.alloc.stream());
            run.touch(own, ptr, size, tag, false);
            pool.free_async(l.alloc, own).expect("final free");
            run.live_bytes -= size as u64;
            run.frees += 1;
        }
        pool.synchronize().expect("final synchronize");
        result = run.pool_check(&pool, "end");
        if result.is_ok() {
            pool.trim_to(0).expect("final trim");
            if pool.stats().reserved_current != 0 {
                result = Err(TestCaseError::fail(
                    "end: trim_to(0) after synchronize kept memory",
                ));
            }
        }
    } else {
        // Let the pool's drop wait for the device work it knows of.
        for l in std::mem::take(&mut run.live) {
            let own = l.alloc.stream();
            let _ = pool.free_async(l.alloc, own);
        }
    }
    drop(pool);
    for s in streams {
        dev.destroy_stream(s).unwrap();
    }
    result
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
}

#[test]
fn pool_follows_the_contract_model() {
    let mut runner = TestRunner::new(PtConfig {
        cases: cases(),
        // No regression files in the source tree; a failure prints its
        // minimal case, which belongs in a named test.
        failure_persistence: None,
        max_shrink_iters: 4096,
        ..PtConfig::default()
    });
    let result = runner.run(&case(), |c| run_case(&c));
    if let Err(e) = result {
        panic!("{e}");
    }
}
