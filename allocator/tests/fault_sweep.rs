//! Fault-injection sweep: for every fallible device operation the pool
//! calls, and for every position k in a fixed workload, fail the k-th call
//! of that operation and check that
//! - the failure reaches the caller as a typed error carrying the injected
//!   device error (or is absorbed by a documented fallback, which the
//!   outcome records),
//! - the pool keeps working: the failed step, retried, succeeds, and every
//!   later step too,
//! - the statistics stay exact after every step (used bytes equal a shadow
//!   count of live bytes, allocation and free counts equal the shadow's,
//!   reserved bytes equal the bytes of the live physical handles and stay
//!   under the cap),
//! - no two live allocations overlap and a tag written into each one is
//!   intact when it is freed,
//! - after the pool is dropped, every physical handle, mapping, address
//!   reservation and event is released (counted by the host backend and
//!   by a counting wrapper under the fault injector). A failure injected
//!   into the clean-up of the drop itself may leak the one object whose
//!   release failed (a drop cannot report an error), and nothing more.
//!
//! The workload: the first 400 operations of the gpt2-fixed trace (sizes
//! divided by 64, on one stream), then a generated multi-stream phase
//! (frees on other streams after event waits, declared uses, stream and
//! event synchronisations, trims), then a clean-up that frees everything,
//! synchronises and trims to zero.
//!
//! The first workload runs a second time on a pool that creates physical
//! units of several pages for large blocks.
//!
//! A second, small workload holds two streams busy while a third needs
//! their pending frees under a cap, so the pool inserts internal
//! dependencies (and their event creation, record and wait are swept).
//!
//! CI runs a bounded subset of positions per operation (the first ones, the
//! last ones and a few in between). `TIDEPOOL_SWEEP_FULL=1` runs every
//! position of every operation; the matrix is printed either way.

mod common;

use common::{host_with_capacity, PAGE};
use std::collections::{BTreeMap, HashSet};
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use tidepool::{Allocation, MemPool, PoolConfig, PoolError};
use tidepool_sys::{
    Device, DevicePtr, Event, FaultInjector, HostDevice, Op, Physical, PhysicalOptions, Stream,
    SysError, SysResult,
};

// ---------------------------------------------------------------------------
// A device wrapper that counts the events that exist (the host backend
// counts handles, mappings and reservations itself). It sits under the
// fault injector, so it sees only the calls that reached the device.

/// The largest physical handle any workload created (the units workload
/// must create handles of several pages, or it tests nothing new).
static LARGEST_HANDLE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

#[derive(Debug)]
struct Counting {
    inner: HostDevice,
    events: Mutex<HashSet<Event>>,
    /// Bytes of each live physical handle (handles may span several
    /// pages).
    handles: Mutex<BTreeMap<Physical, usize>>,
}

impl Counting {
    fn new(inner: HostDevice) -> Self {
        Counting {
            inner,
            events: Mutex::new(HashSet::new()),
            handles: Mutex::new(BTreeMap::new()),
        }
    }
    fn live_events(&self) -> usize {
        self.events.lock().unwrap().len()
    }
    fn live_handle_bytes(&self) -> u64 {
        self.handles.lock().unwrap().values().sum::<usize>() as u64
    }
}

impl common::wrap::Hooks for Counting {
    type Inner = HostDevice;
    fn inner(&self) -> &HostDevice {
        &self.inner
    }
    fn create_physical(&self, size: usize, options: PhysicalOptions) -> SysResult<Physical> {
        let h = self.inner.create_physical(size, options)?;
        self.handles.lock().unwrap().insert(h, size);
        LARGEST_HANDLE.fetch_max(size, std::sync::atomic::Ordering::Relaxed);
        Ok(h)
    }
    fn release_physical(&self, handle: Physical) -> SysResult<()> {
        self.inner.release_physical(handle)?;
        self.handles.lock().unwrap().remove(&handle);
        Ok(())
    }
    fn create_event(&self) -> SysResult<Event> {
        let e = self.inner.create_event()?;
        self.events.lock().unwrap().insert(e);
        Ok(e)
    }
    fn destroy_event(&self, event: Event) -> SysResult<()> {
        self.inner.destroy_event(event)?;
        self.events.lock().unwrap().remove(&event);
        Ok(())
    }
}

common::wrap::wrapped_device!(Counting);

type Dev = FaultInjector<Counting>;

// ---------------------------------------------------------------------------
// The workload.

const STREAMS: usize = 3;
/// Two more streams: one retired, one destroyed without retirement.
const RETIRED: usize = STREAMS;
const DESTROYED: usize = STREAMS + 1;
/// Trace sizes are divided by this (the trace's peak of 1.2 GiB becomes
/// about 19 MiB).
const TRACE_SCALE: usize = 64;
const TRACE_OPS: usize = 400;
const CAP: u64 = 48 << 20;

#[derive(Debug, Clone, Copy)]
enum Step {
    Alloc {
        slot: usize,
        size: usize,
        stream: usize,
    },
    /// Free on `stream`; when it differs from the allocation's stream the
    /// step first orders it after the allocation's stream (record + wait,
    /// through the pool), as the contract asks.
    Free {
        slot: usize,
        stream: usize,
    },
    /// Declare a use of the allocation on `stream`.
    Use {
        slot: usize,
        stream: usize,
    },
    /// Record an event on `from`, make `to` wait for it.
    Order {
        from: usize,
        to: usize,
    },
    SyncStream(usize),
    /// Record an event on the stream and synchronise with it.
    SyncEvent(usize),
    Synchronize,
    Trim(u64),
    /// Retire the stream from the pool (it is not used afterwards).
    Retire(usize),
    /// An allocation larger than the cap: out-of-memory, with a report.
    Oom {
        size: usize,
        stream: usize,
    },
    /// Hold the stream busy with a host task (the test's own call, not
    /// faulted) until `Release` or a synchronisation.
    Hold(usize),
    /// Release the tasks held on the stream.
    Release(usize),
    /// Destroy the stream without retiring it (the test's own call, not
    /// faulted): its pending frees become orphans that only a device-wide
    /// synchronisation can settle.
    Destroy(usize),
}

fn trace_path() -> PathBuf {
    // Found at run time (the test may run from a staged copy elsewhere).
    let dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    dir.join("tests/data/gpt2-fixed-prefix.csv")
}

/// The trace prefix as steps on stream 0 (slots = trace ids, made dense).
fn trace_steps(slots: &mut usize) -> Vec<Step> {
    let text = std::fs::read_to_string(trace_path()).expect("read the trace prefix fixture");
    let mut ids = std::collections::HashMap::new();
    let mut steps = Vec::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.starts_with("op,"))
        .take(TRACE_OPS)
    {
        let f: Vec<&str> = line.split(',').collect();
        assert_eq!(f.len(), 4, "bad fixture line {line:?}");
        let id: u64 = f[1].parse().unwrap();
        match f[0] {
            "a" => {
                let size: usize = f[2].parse().unwrap();
                let slot = *slots;
                *slots += 1;
                ids.insert(id, slot);
                steps.push(Step::Alloc {
                    slot,
                    size: size.div_ceil(TRACE_SCALE),
                    stream: 0,
                });
            }
            "f" => {
                let slot = ids.remove(&id).expect("free of a live id");
                steps.push(Step::Free { slot, stream: 0 });
            }
            other => panic!("bad op {other:?} in fixture"),
        }
    }
    steps
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A generated multi-stream phase: allocations of 1 KiB to 3 MiB on three
/// streams, frees on the own stream or (ordered) on another, declared uses,
/// synchronisations and trims. Deterministic.
fn stress_steps(slots: &mut usize, start_live: &[(usize, usize)]) -> Vec<Step> {
    let mut rng = Rng(0x5EED_0016);
    let mut live: Vec<(usize, usize)> = start_live.to_vec(); // (slot, stream)
    let mut steps = Vec::new();
    for _ in 0..220 {
        match rng.below(100) {
            0..=39 => {
                let stream = rng.below(STREAMS as u64) as usize;
                let size = 1usize << (10 + rng.below(12)); // 1 KiB .. 2 MiB
                let size = size + rng.below(size as u64) as usize;
                let slot = *slots;
                *slots += 1;
                live.push((slot, stream));
                steps.push(Step::Alloc { slot, size, stream });
            }
            40..=74 if !live.is_empty() => {
                let (slot, own) = live.swap_remove(rng.below(live.len() as u64) as usize);
                let stream = if rng.below(3) == 0 {
                    rng.below(STREAMS as u64) as usize
                } else {
                    own
                };
                steps.push(Step::Free { slot, stream });
            }
            75..=82 if !live.is_empty() => {
                let (slot, _) = live[rng.below(live.len() as u64) as usize];
                steps.push(Step::Use {
                    slot,
                    stream: rng.below(STREAMS as u64) as usize,
                });
            }
            83..=88 => {
                let from = rng.below(STREAMS as u64) as usize;
                let to = (from + 1 + rng.below(STREAMS as u64 - 1) as usize) % STREAMS;
                steps.push(Step::Order { from, to });
            }
            89..=91 => steps.push(Step::SyncStream(rng.below(STREAMS as u64) as usize)),
            92..=94 => steps.push(Step::SyncEvent(rng.below(STREAMS as u64) as usize)),
            95..=96 => steps.push(Step::Synchronize),
            _ => steps.push(Step::Trim(rng.below(4) * 4 * PAGE as u64)),
        }
    }
    steps
}

/// A workload: its steps and the pool it runs on.
struct Workload {
    name: &'static str,
    steps: Vec<Step>,
    config: PoolConfig,
    cap: u64,
}

/// The trace prefix, then the multi-stream phase, on a 48 MiB pool.
fn trace_and_streams() -> Workload {
    Workload {
        name: "trace+streams",
        steps: workload(),
        config: pool_config(),
        cap: CAP,
    }
}

/// The same with physical units of up to 8 MiB for blocks of 4 MiB and up
/// (handles of several pages, mapped, moved and released whole).
fn trace_and_streams_units() -> Workload {
    Workload {
        name: "trace+streams+units",
        steps: workload(),
        config: pool_config()
            .with_max_unit_size(8 << 20)
            .with_unit_min_block(4 << 20),
        cap: CAP,
    }
}

/// Memory pressure with held streams: two streams' frees are pending
/// behind held tasks when a third stream needs their memory under the cap,
/// so the pool must insert internal dependencies (stream waits on the
/// donors' events). Stream cache off, no host wait.
fn pressure() -> Workload {
    let cap = 4 * PAGE as u64;
    let big = 2 * PAGE;
    let steps = vec![
        Step::Alloc {
            slot: 0,
            size: big,
            stream: 2,
        },
        Step::Alloc {
            slot: 1,
            size: big,
            stream: 1,
        },
        Step::Hold(2),
        Step::Hold(1),
        Step::Free { slot: 0, stream: 2 },
        Step::Free { slot: 1, stream: 1 },
        Step::Alloc {
            slot: 2,
            size: big,
            stream: 0,
        },
        Step::Alloc {
            slot: 3,
            size: big,
            stream: 0,
        },
        Step::Free { slot: 2, stream: 0 },
        Step::Free { slot: 3, stream: 0 },
        Step::Release(1),
        Step::Release(2),
        Step::Alloc {
            slot: 4,
            size: PAGE / 2,
            stream: 1,
        },
        Step::Free { slot: 4, stream: 1 },
        Step::Synchronize,
        Step::Trim(0),
    ];
    let config = PoolConfig::default()
        .with_va_size(1 << 30)
        .with_max_size(cap)
        .with_stream_cache_bytes(0)
        .with_reuse(tidepool::ReusePolicy {
            wait_for_pending_frees: false,
            ..Default::default()
        });
    Workload {
        name: "pressure",
        steps,
        config,
        cap,
    }
}

fn workload() -> Vec<Step> {
    let mut slots = 0;
    let mut steps = trace_steps(&mut slots);
    // Free most of what the trace left live (its weights stay), so that the
    // generated phase reuses freed memory.
    let mut live: Vec<usize> = {
        let mut l = std::collections::BTreeSet::new();
        for s in &steps {
            match *s {
                Step::Alloc { slot, .. } => {
                    l.insert(slot);
                }
                Step::Free { slot, .. } => {
                    l.remove(&slot);
                }
                _ => {}
            }
        }
        l.into_iter().collect()
    };
    let keep = live.split_off(live.len() * 3 / 4);
    for (i, slot) in live.into_iter().enumerate() {
        steps.push(Step::Free {
            slot,
            stream: i % STREAMS,
        });
    }
    steps.push(Step::Trim(8 * PAGE as u64));
    let start: Vec<(usize, usize)> = keep.iter().map(|&s| (s, 0)).collect();
    steps.extend(stress_steps(&mut slots, &start));
    // Requests over the cap: out-of-memory, with a report (which asks the
    // device for its free memory).
    for stream in [0, 1] {
        steps.push(Step::Oom {
            size: CAP as usize + PAGE,
            stream,
        });
    }
    // A retired stream and one destroyed with frees pending.
    for (stream, last) in [
        (RETIRED, Step::Retire(RETIRED)),
        (DESTROYED, Step::Destroy(DESTROYED)),
    ] {
        for size in [3000, 5 << 20] {
            let slot = slots;
            slots += 1;
            steps.push(Step::Alloc { slot, size, stream });
            steps.push(Step::Free { slot, stream });
        }
        steps.push(last);
    }
    steps.push(Step::Synchronize);
    steps
}

// ---------------------------------------------------------------------------
// Running the workload against a shadow.

struct Live {
    alloc: Allocation,
    tag: u32,
}

/// What happened when one (operation, k) pair ran.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    /// The workload made fewer than k calls of the operation.
    NotReached,
    /// A typed error carrying the injected failure reached the caller of
    /// this kind of step; the retried step and the rest worked.
    Error(&'static str),
    /// The failure hit a call whose error the pool handles itself (a retry,
    /// a fallback, or a warning); no error reached the caller.
    Absorbed(&'static str),
    /// The failure hit the pool's drop; what stayed unreleased.
    InDrop(String),
}

impl Outcome {
    fn class(&self) -> String {
        match self {
            Outcome::NotReached => "not reached".into(),
            Outcome::Error(s) => format!("error at {s}"),
            Outcome::Absorbed(s) => format!("absorbed in {s}"),
            Outcome::InDrop(s) => format!("in drop: {s}"),
        }
    }
}

fn step_name(s: &Step) -> &'static str {
    match s {
        Step::Alloc { .. } => "alloc",
        Step::Free { .. } => "free",
        Step::Use { .. } => "record_use",
        Step::Order { .. } => "record/wait",
        Step::SyncStream(_) => "synchronize_stream",
        Step::SyncEvent(_) => "synchronize_event",
        Step::Synchronize => "synchronize",
        Step::Trim(_) => "trim",
        Step::Retire(_) => "retire_stream",
        Step::Oom { .. } => "alloc (over the cap)",
        Step::Hold(_) => "hold",
        Step::Release(_) => "release",
        Step::Destroy(_) => "destroy_stream",
    }
}

fn carries(e: &PoolError, op: Op) -> bool {
    let inj = |s: &SysError| matches!(s, SysError::Injected { op: o, .. } if *o == op);
    match e {
        PoolError::Device(s) => inj(s),
        PoolError::OutOfMemory(r) => r.cause.as_ref().is_some_and(inj),
        _ => false,
    }
}

struct Runner<'a> {
    /// Tasks holding streams busy. Declared before the pool, so that they
    /// are released before the pool's drop waits for pending frees.
    held: Vec<(usize, common::Blocker)>,
    cap: u64,
    dev: &'a Arc<Dev>,
    pool: MemPool<Dev>,
    streams: &'a [Stream],
    live: BTreeMap<usize, Live>,
    /// start → end of live allocations (the overlap check).
    ranges: BTreeMap<DevicePtr, DevicePtr>,
    live_bytes: u64,
    allocs: u64,
    frees: u64,
    ooms: u64,
    next_tag: u32,
    ctx: String,
    /// Whether the pool may create handles of several pages.
    units: bool,
}

impl Runner<'_> {
    fn host(&self) -> &HostDevice {
        &self.dev.inner().inner
    }

    /// Run one step once; `Err` carries the pool's error.
    fn try_step(&mut self, step: Step) -> Result<(), PoolError> {
        if matches!(
            step,
            Step::SyncStream(_) | Step::SyncEvent(_) | Step::Synchronize
        ) {
            // A host wait behind a held task would never return.
            self.held.clear();
        }
        let p = &self.pool;
        let s = self.streams;
        match step {
            Step::Alloc { slot, size, stream } => {
                let a = p.alloc_async(size, s[stream])?;
                self.on_alloc(slot, a);
            }
            Step::Free { slot, stream } => {
                let l = self.live.remove(&slot).expect("workload frees live slots");
                let own = l.alloc.stream();
                if own != s[stream] {
                    let ordered = p
                        .record_event(own)
                        .and_then(|ev| p.wait_event(s[stream], &ev));
                    if let Err(e) = ordered {
                        self.live.insert(slot, l);
                        return Err(e);
                    }
                }
                let (ptr, size, tag) = (l.alloc.ptr(), l.alloc.size(), l.tag);
                self.check_tag(ptr, size, tag);
                match p.free_async(l.alloc, s[stream]) {
                    Ok(()) => {
                        self.ranges.remove(&ptr);
                        self.live_bytes -= size as u64;
                        self.frees += 1;
                    }
                    Err(fe) => {
                        let error = fe.error;
                        assert_eq!(fe.allocation.ptr(), ptr, "{}: free gave back", self.ctx);
                        self.live.insert(
                            slot,
                            Live {
                                alloc: fe.allocation,
                                tag,
                            },
                        );
                        return Err(error);
                    }
                }
            }
            Step::Use { slot, stream } => {
                let l = self.live.get_mut(&slot).expect("live slot");
                p.record_use(&mut l.alloc, s[stream]);
            }
            Step::Order { from, to } => {
                let ev = p.record_event(s[from])?;
                p.wait_event(s[to], &ev)?;
            }
            Step::SyncStream(i) => p.synchronize_stream(s[i])?,
            Step::SyncEvent(i) => {
                let ev = p.record_event(s[i])?;
                p.synchronize_event(&ev)?;
            }
            Step::Synchronize => p.synchronize()?,
            Step::Trim(n) => {
                p.trim_to(n)?;
            }
            Step::Retire(i) => p.retire_stream(s[i])?,
            Step::Oom { size, stream } => match p.alloc_async(size, s[stream]) {
                Err(PoolError::OutOfMemory(r)) => {
                    assert_eq!(r.requested, size, "{}: report", self.ctx);
                    assert_eq!(r.max_size, Some(self.cap), "{}: report", self.ctx);
                    self.ooms += 1;
                }
                Err(e) => return Err(e),
                Ok(a) => panic!("{}: {} bytes allocated over the cap", self.ctx, a.size()),
            },
            Step::Destroy(i) => self.dev.inner().destroy_stream(s[i]).unwrap(),
            Step::Hold(i) => {
                let b = common::Blocker::on(self.dev.inner(), s[i]);
                self.held.push((i, b));
            }
            Step::Release(i) => self.held.retain(|(h, _)| *h != i),
        }
        Ok(())
    }

    fn on_alloc(&mut self, slot: usize, a: Allocation) {
        let (ptr, size) = (a.ptr(), a.size() as u64);
        if let Some((&s, &e)) = self.ranges.range(..ptr + size).next_back() {
            assert!(
                e <= ptr,
                "{}: allocation {ptr:#x}+{size} overlaps live {s:#x}..{e:#x}",
                self.ctx
            );
        }
        self.ranges.insert(ptr, ptr + size);
        self.next_tag = self.next_tag.wrapping_add(0x9E37_79B9);
        let tag = self.next_tag;
        self.write_tag(ptr, size as usize, tag);
        self.live.insert(slot, Live { alloc: a, tag });
        self.live_bytes += size;
        self.allocs += 1;
    }

    /// The tag goes into the first and the last whole word.
    fn tag_spots(ptr: DevicePtr, size: usize) -> Vec<DevicePtr> {
        if size < 4 {
            return Vec::new();
        }
        let last = ptr + ((size / 4 - 1) * 4) as u64;
        if last == ptr {
            vec![ptr]
        } else {
            vec![ptr, last]
        }
    }

    fn write_tag(&self, ptr: DevicePtr, size: usize, tag: u32) {
        for at in Self::tag_spots(ptr, size) {
            self.host()
                .write_words(at, &[tag])
                .unwrap_or_else(|e| panic!("{}: live allocation not writable: {e}", self.ctx));
        }
    }

    fn check_tag(&self, ptr: DevicePtr, size: usize, tag: u32) {
        for at in Self::tag_spots(ptr, size) {
            let got = self
                .host()
                .read_words(at, 1)
                .unwrap_or_else(|e| panic!("{}: live allocation not readable: {e}", self.ctx));
            assert_eq!(got, vec![tag], "{}: tag of {ptr:#x} overwritten", self.ctx);
        }
    }

    fn check_stats(&self) {
        let st = self.pool.stats();
        let ctx = &self.ctx;
        assert_eq!(st.used_current, self.live_bytes, "{ctx}: used_current");
        assert_eq!(st.allocs, self.allocs, "{ctx}: allocs");
        assert_eq!(st.frees, self.frees, "{ctx}: frees");
        assert_eq!(st.ooms, self.ooms, "{ctx}: ooms");
        assert!(
            st.reserved_current <= self.cap,
            "{ctx}: reserved over the cap"
        );
        assert_eq!(
            st.reserved_current,
            self.dev.inner().live_handle_bytes(),
            "{ctx}: reserved bytes are not the bytes of the device's live handles"
        );
        if !self.units {
            assert_eq!(
                st.reserved_current,
                (st.growths - st.releases) * PAGE as u64,
                "{ctx}: reserved bytes are not the pages held"
            );
            assert_eq!(
                st.reserved_current,
                (self.host().live_handles() * PAGE) as u64,
                "{ctx}: reserved bytes are not the device's live handles"
            );
        }
        assert!(
            st.used_current <= st.reserved_current,
            "{ctx}: used > reserved"
        );
        assert!(st.used_high >= st.used_current, "{ctx}: used_high");
        assert!(
            st.reserved_high >= st.reserved_current,
            "{ctx}: reserved_high"
        );
    }
}

fn pool_config() -> PoolConfig {
    PoolConfig::default()
        .with_va_size(1 << 30)
        .with_max_size(CAP)
        .with_stream_cache_bytes(1 << 20)
}

/// Run the workload with the `k`-th call of `op` failing (`None`: no
/// failure). Returns the outcome and the calls of each op made.
fn run_one(w: &Workload, fault: Option<(Op, u64)>) -> (Outcome, Vec<u64>) {
    let steps = &w.steps;
    let dev: Arc<Dev> = Arc::new(FaultInjector::new(Counting::new(host_with_capacity(
        64 << 20,
    ))));
    // The test's own stream calls bypass the injector.
    let streams: Vec<Stream> = (0..STREAMS + 2)
        .map(|_| dev.inner().create_stream().unwrap())
        .collect();
    let ctx = match fault {
        Some((op, k)) => format!("{}: {op} #{k}", w.name),
        None => format!("{}: no fault", w.name),
    };
    let target = fault.map(|(op, k)| {
        let injected = SysError::Injected { op, call: k };
        dev.fail_nth(op, k, injected);
        (op, dev.calls(op) + k)
    });
    let fired = |dev: &Dev| target.is_some_and(|(op, at)| dev.calls(op) >= at);
    let mut outcome = None;

    let pool = match MemPool::new(dev.clone(), w.config.clone()) {
        Ok(p) => p,
        Err(e) => {
            let (op, _) = target.unwrap_or_else(|| panic!("{ctx}: pool creation failed: {e}"));
            assert!(carries(&e, op), "{ctx}: pool creation: untyped error {e:?}");
            outcome = Some(Outcome::Error("pool creation"));
            MemPool::new(dev.clone(), w.config.clone())
                .unwrap_or_else(|e| panic!("{ctx}: pool creation after the fault: {e}"))
        }
    };
    if outcome.is_none() && fired(&dev) {
        outcome = Some(Outcome::Absorbed("pool creation"));
    }
    let mut r = Runner {
        held: Vec::new(),
        cap: w.cap,
        dev: &dev,
        pool,
        streams: &streams,
        live: BTreeMap::new(),
        ranges: BTreeMap::new(),
        live_bytes: 0,
        allocs: 0,
        frees: 0,
        ooms: 0,
        next_tag: 1,
        ctx: ctx.clone(),
        units: w.config.max_unit_size > PAGE,
    };
    // The clean-up is part of the workload: faults may hit it too.
    let mut all = steps.to_vec();
    all.push(Step::Synchronize);
    let cleanup_at = all.len();
    for (i, &step) in all.iter().enumerate() {
        r.ctx = format!("{ctx}, step {i} ({step:?})");
        let before = fired(&dev);
        match r.try_step(step) {
            Ok(()) => {
                if !before && fired(&dev) && outcome.is_none() {
                    outcome = Some(Outcome::Absorbed(step_name(&step)));
                }
            }
            Err(e) => {
                let (op, _) = target.unwrap_or_else(|| panic!("{}: {e}", r.ctx));
                assert!(
                    !before && fired(&dev),
                    "{}: error without a new fault: {e:?}",
                    r.ctx
                );
                assert!(carries(&e, op), "{}: untyped error {e:?}", r.ctx);
                // Display must say something a user can act on.
                assert!(e.to_string().contains("injected"), "{}: {e}", r.ctx);
                outcome = Some(Outcome::Error(step_name(&step)));
                r.check_stats();
                r.try_step(step)
                    .unwrap_or_else(|e| panic!("{}: retry after the fault failed: {e}", r.ctx));
            }
        }
        r.check_stats();
    }
    // Clean-up: free everything on its own stream, synchronise, trim to 0.
    let slots: Vec<(usize, usize)> = r
        .live
        .iter()
        .map(|(&slot, l)| {
            let i = streams.iter().position(|&s| s == l.alloc.stream()).unwrap();
            (slot, i)
        })
        .collect();
    let mut tail: Vec<Step> = slots
        .into_iter()
        .map(|(slot, stream)| Step::Free { slot, stream })
        .collect();
    tail.push(Step::Synchronize);
    tail.push(Step::Trim(0));
    for (i, &step) in tail.iter().enumerate() {
        r.ctx = format!("{ctx}, clean-up step {} ({step:?})", cleanup_at + i);
        let before = fired(&dev);
        match r.try_step(step) {
            Ok(()) => {
                if !before && fired(&dev) && outcome.is_none() {
                    outcome = Some(Outcome::Absorbed(step_name(&step)));
                }
            }
            Err(e) => {
                let (op, _) = target.unwrap_or_else(|| panic!("{}: {e}", r.ctx));
                assert!(!before && fired(&dev), "{}: {e:?}", r.ctx);
                assert!(carries(&e, op), "{}: untyped error {e:?}", r.ctx);
                outcome = Some(Outcome::Error(step_name(&step)));
                r.try_step(step)
                    .unwrap_or_else(|e| panic!("{}: retry after the fault failed: {e}", r.ctx));
            }
        }
        r.check_stats();
    }
    r.ctx = format!("{ctx}, after clean-up");
    let st = r.pool.stats();
    assert_eq!(st.used_current, 0, "{}", r.ctx);
    assert_eq!(st.reserved_current, 0, "{}: trim_to(0) kept memory", r.ctx);
    assert_eq!(r.host().live_handles(), 0, "{}: handles", r.ctx);

    let fired_before_drop = fired(&dev);
    r.held.clear();
    drop(r);
    let leaks = [
        ("handles", dev.inner().inner.live_handles()),
        ("mappings", dev.inner().inner.live_mappings()),
        ("reservations", dev.inner().inner.live_reservations()),
        ("events", dev.inner().live_events()),
    ];
    let leaked: Vec<String> = leaks
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(what, n)| format!("{n} {what}"))
        .collect();
    if !fired_before_drop && fired(&dev) {
        let (op, _) = target.unwrap();
        // Only the object whose release was failed may stay.
        let allowed: &[&str] = match op {
            Op::DestroyEvent => &["events"],
            Op::FreeVa => &["reservations"],
            _ => &[],
        };
        for (what, n) in leaks {
            if allowed.contains(&what) {
                assert!(n <= 1, "{ctx}: drop leaked {n} {what}");
            } else {
                assert_eq!(n, 0, "{ctx}: drop leaked {what}");
            }
        }
        outcome = Some(Outcome::InDrop(if leaked.is_empty() {
            "nothing leaked".into()
        } else {
            format!("leaked {}", leaked.join(", "))
        }));
    } else {
        assert!(leaked.is_empty(), "{ctx}: after drop: {leaked:?}");
    }
    for (i, &s) in streams.iter().enumerate() {
        if i != DESTROYED {
            dev.inner().destroy_stream(s).unwrap();
        }
    }
    let calls = Op::ALL.iter().map(|&op| dev.calls(op)).collect();
    let outcome = match (fault, outcome) {
        (None, None) => Outcome::NotReached,
        (Some(_), None) => {
            assert!(!fired(&dev), "{ctx}: fault fired but no outcome recorded");
            Outcome::NotReached
        }
        (_, Some(o)) => o,
    };
    (outcome, calls)
}

/// Operations the sweep fails: every fallible one (granularity cannot
/// fail; the test's own stream creation and destruction bypass the
/// injector).
fn swept_ops() -> Vec<Op> {
    Op::ALL
        .iter()
        .copied()
        .filter(|&op| op != Op::Granularity)
        .collect()
}

/// Positions tried in CI: the first three, the last two, and five spread
/// between them.
fn ci_positions(total: u64) -> Vec<u64> {
    let mut p: Vec<u64> = (1..=total.min(3)).collect();
    for i in 1..=5 {
        p.push(total * i / 6);
    }
    p.push(total.saturating_sub(1));
    p.push(total);
    p.retain(|&k| k >= 1 && k <= total);
    p.sort_unstable();
    p.dedup();
    p
}

/// Sweep one workload: the census run, then each (operation, position).
/// Returns the calls of each operation in the census run.
fn sweep(w: &Workload, full: bool, report: &mut String) -> Vec<u64> {
    let (base, census) = run_one(w, None);
    assert_eq!(base, Outcome::NotReached);
    let mut runs = 0u64;
    let mut not_called = Vec::new();
    let _ = writeln!(
        report,
        "fault sweep of {} ({} steps, {}): op | calls | positions tried | outcomes",
        w.name,
        w.steps.len(),
        if full { "full" } else { "CI subset" }
    );
    for op in swept_ops() {
        let idx = Op::ALL.iter().position(|&o| o == op).unwrap();
        let total = census[idx];
        if total == 0 {
            not_called.push(op.name());
            continue;
        }
        // One position past the last call of the unfaulted run: reached
        // only when a failure sends the pool down another path (a retry).
        let positions: Vec<u64> = if full {
            (1..=total + 1).collect()
        } else {
            let mut p = ci_positions(total);
            p.push(total + 1);
            p
        };
        let mut outcomes: BTreeMap<String, u64> = BTreeMap::new();
        for &k in &positions {
            let (o, _) = run_one(w, Some((op, k)));
            runs += 1;
            *outcomes.entry(o.class()).or_default() += 1;
        }
        let list: Vec<String> = outcomes.iter().map(|(c, n)| format!("{c} ×{n}")).collect();
        let _ = writeln!(
            report,
            "{} | {} | {} | {}",
            op.name(),
            total,
            positions.len(),
            list.join("; ")
        );
    }
    let _ = writeln!(
        report,
        "not called by the pool in this workload: {}",
        not_called.join(", ")
    );
    let _ = writeln!(report, "{runs} faulted runs, all checks passed");
    census
}

#[test]
fn fault_sweep() {
    let workloads = [trace_and_streams(), pressure(), trace_and_streams_units()];
    let full = std::env::var("TIDEPOOL_SWEEP_FULL").is_ok_and(|v| v == "1");
    // `TIDEPOOL_SWEEP_ONLY=workload:op:k` (e.g. `pressure:wait_event:1`)
    // runs one triple, to debug it.
    if let Ok(only) = std::env::var("TIDEPOOL_SWEEP_ONLY") {
        let mut parts = only.split(':');
        let (Some(wname), Some(name), Some(k)) = (parts.next(), parts.next(), parts.next()) else {
            panic!("TIDEPOOL_SWEEP_ONLY=workload:op:k");
        };
        let w = workloads
            .iter()
            .find(|w| w.name == wname)
            .expect("a workload name");
        let op = *Op::ALL
            .iter()
            .find(|o| o.name() == name)
            .expect("an op name");
        let (o, _) = run_one(w, Some((op, k.parse().expect("a position"))));
        let _ = writeln!(std::io::stderr().lock(), "{only}: {}", o.class());
        return;
    }
    let mut report = String::new();
    let censuses: Vec<Vec<u64>> = workloads
        .iter()
        .map(|w| sweep(w, full, &mut report))
        .collect();
    // Outside libtest's capture, so the matrix is visible with --nocapture or not.
    let _ = write!(std::io::stderr().lock(), "{report}");
    let calls = |w: usize, op: Op| censuses[w][Op::ALL.iter().position(|&o| o == op).unwrap()];
    // The sweep must reach the operations it claims to cover.
    for op in [
        Op::ReserveVa,
        Op::CreatePhysical,
        Op::Map,
        Op::SetAccess,
        Op::Unmap,
        Op::ReleasePhysical,
        Op::CreateEvent,
        Op::RecordEvent,
        Op::QueryEvent,
        Op::WaitEvent,
        Op::SynchronizeStream,
        Op::SynchronizeEvent,
        Op::IsCapturing,
        Op::FreeVa,
        Op::SynchronizeDevice,
        Op::MemInfo,
    ] {
        assert!(calls(0, op) > 0, "the workload never calls {op}");
    }
    assert!(
        LARGEST_HANDLE.load(std::sync::atomic::Ordering::Relaxed) > PAGE,
        "the units workload created no handle of several pages"
    );
    // The pressure workload is there for its internal dependencies.
    assert!(
        calls(1, Op::WaitEvent) >= 2,
        "the pressure workload made no internal dependencies"
    );
}

/// Rule: `synchronize` either waits for every stream the pool knows, or
/// reports why it could not. A failed stream-state query (is the stream
/// being captured?) made it skip the stream silently and return `Ok` while
/// the stream still had work queued: its frees stayed pending, and a
/// `trim_to(0)` right after could keep their memory although the caller
/// had just synchronised. Found by the full sweep (is_capturing failing in
/// the clean-up's synchronize left 26 MiB reserved after `trim_to(0)`).
///
/// The stream is held busy; a helper thread synchronises and reports, the
/// moment `synchronize` returns, whether the busy work had finished. `Ok`
/// with the work unfinished is the defect. A correct pool either returns
/// the error at once or blocks until the stream is released (after two
/// seconds; a slow machine can only hide the defect, never fake it).
#[test]
fn synchronize_does_not_skip_a_stream_silently() {
    let dev: Arc<FaultInjector<HostDevice>> =
        Arc::new(FaultInjector::new(host_with_capacity(64 << 20)));
    let pool = MemPool::new(
        dev.clone(),
        PoolConfig::default()
            .with_va_size(1 << 30)
            .with_stream_cache_bytes(0),
    )
    .unwrap();
    let s = dev.inner().create_stream().unwrap();
    let x = pool.alloc_async(PAGE, s).unwrap();
    let mut busy = common::Blocker::on(dev.inner(), s);
    pool.free_async(x, s).unwrap();
    let op = Op::IsCapturing;
    dev.fail_nth(op, 1, SysError::Injected { op, call: 1 });
    let (tx, rx) = std::sync::mpsc::channel();
    let done = busy.flag();
    let p = pool.clone();
    let t = std::thread::spawn(move || {
        let r = p.synchronize();
        let _ = tx.send((r, done.load(std::sync::atomic::Ordering::SeqCst)));
    });
    let early = rx.recv_timeout(std::time::Duration::from_secs(2)).ok();
    busy.release();
    let (r, finished) = match early {
        Some(report) => report,
        None => rx.recv().unwrap(),
    };
    t.join().unwrap();
    match r {
        Err(e) => assert!(carries(&e, op), "{e:?}"),
        Ok(()) => assert!(
            finished,
            "synchronize returned Ok while the stream's work was still queued"
        ),
    }
    drop(pool);
    dev.inner().destroy_stream(s).unwrap();
}

/// Rule: retiring a stream either closes its frees so that the pool can
/// still learn when they complete, or reports why it could not (and leaves
/// the stream registered, so the retire can be retried). A failed
/// stream-state query made `retire_stream` return `Ok` with the stream's
/// frees guarded by an epoch no event would ever close: that memory stayed
/// pending until the pool was dropped, through any synchronize and trim.
/// Found by the full sweep (is_capturing failing in a retire).
#[test]
fn retire_does_not_strand_frees() {
    let dev: Arc<FaultInjector<HostDevice>> =
        Arc::new(FaultInjector::new(host_with_capacity(64 << 20)));
    let pool = MemPool::new(dev.clone(), PoolConfig::default().with_va_size(1 << 30)).unwrap();
    let s = dev.inner().create_stream().unwrap();
    let x = pool.alloc_async(PAGE, s).unwrap();
    pool.free_async(x, s).unwrap();
    let op = Op::IsCapturing;
    dev.fail_nth(op, 1, SysError::Injected { op, call: 1 });
    if let Err(e) = pool.retire_stream(s) {
        assert!(carries(&e, op), "{e:?}");
        pool.retire_stream(s).unwrap();
    }
    pool.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    assert_eq!(
        pool.stats().reserved_current,
        0,
        "the retired stream's free stayed pending after synchronize"
    );
    drop(pool);
    dev.inner().destroy_stream(s).unwrap();
}

/// Rule: after `synchronize` returns `Ok`, the frees of a stream destroyed
/// without retirement are known complete (the pool waits for them
/// device-wide). A failed stream-state query while the pool checked that no
/// stream is being captured made it skip that wait and still return `Ok`:
/// the destroyed stream's frees stayed pending through the trim that
/// followed. The sweep saw this as a fault absorbed by `synchronize`.
#[test]
fn synchronize_settles_orphaned_frees_or_says_why_not() {
    let dev: Arc<FaultInjector<HostDevice>> =
        Arc::new(FaultInjector::new(host_with_capacity(64 << 20)));
    let pool = MemPool::new(
        dev.clone(),
        PoolConfig::default()
            .with_va_size(1 << 30)
            .with_stream_cache_bytes(0),
    )
    .unwrap();
    let d = dev.inner().create_stream().unwrap();
    let x = pool.alloc_async(PAGE, d).unwrap();
    pool.free_async(x, d).unwrap();
    dev.inner().destroy_stream(d).unwrap();
    let op = Op::IsCapturing;
    // Call 1: the synchronize loop finds the stream gone; call 2: the check
    // for captures before the device-wide wait.
    dev.fail_nth(op, 2, SysError::Injected { op, call: 2 });
    if let Err(e) = pool.synchronize() {
        assert!(carries(&e, op), "{e:?}");
        pool.synchronize().unwrap();
    }
    assert!(dev.calls(op) >= 2, "the injected failure was not reached");
    pool.trim_to(0).unwrap();
    assert_eq!(
        pool.stats().reserved_current,
        0,
        "synchronize returned Ok but the destroyed stream's free stayed pending"
    );
}
