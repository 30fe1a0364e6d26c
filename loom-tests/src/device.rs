//! A model device: the [`Device`] trait over plain counters.
//!
//! Streams are counters of issued and completed work items. A stream that
//! is not *busy* completes its work as soon as nothing it waits on is
//! pending; a busy stream completes nothing until [`ModelDevice::set_busy`]
//! clears it (or the host synchronises with it). Events are (stream,
//! position, vector clock) records; `wait_event` adds a work item that
//! depends on the event and merges its clock, so the device knows exactly
//! which stream's work is ordered after which: the ground truth the pool's
//! own bookkeeping is checked against.
//!
//! The test declares what user work touches with [`ModelDevice::claim`]
//! (after an allocation) and [`ModelDevice::unclaim`] (before its free):
//! - a claim must lie on mapped, accessible memory, overlap no live claim,
//!   and may overlap a freed claim only if the claiming stream is ordered
//!   after the freeing stream's work (same stream, a wait, or completion);
//! - an unmap must overlap no live claim and no freed claim whose work is
//!   still pending.
//!
//! A broken rule panics (loom then prints the interleaving). All state sits
//! behind one [`Mutex`] of the crate's shim, so under loom every device call
//! is a point where another thread may run.

use crate::sync::{lock, Mutex};
use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use tidepool_sys::{
    AccessDesc, Device, DevicePtr, Event, HostTask, MemInfo, Op, Physical, PhysicalOptions, Stream,
    SysError, SysResult,
};

/// Page size (= granularity) of the model.
pub const GRANULARITY: usize = 4096;

type Clock = BTreeMap<u64, u64>;

#[derive(Debug, Default)]
struct StreamModel {
    /// Work items issued (positions 1..=issued).
    issued: u64,
    /// Work items completed (a prefix).
    done: u64,
    busy: bool,
    /// Being captured (set by the scenario: the model records no graphs,
    /// it only answers the capture query as the driver would).
    capturing: bool,
    /// Wait items: position -> (stream, position) it depends on.
    deps: BTreeMap<u64, (u64, u64)>,
    /// For each other stream, the highest position this stream's tail is
    /// ordered after.
    clock: Clock,
    /// How many times the pool asked whether the stream's work is done.
    queries: u64,
}

#[derive(Debug)]
struct EventModel {
    /// (stream, position, the stream's clock at the record).
    recorded: Option<(u64, u64, Clock)>,
}

#[derive(Debug, Clone, Copy)]
enum PinState {
    /// A live allocation, used by the given stream's work.
    Live(u64),
    /// Freed: still touched by the stream's work up to the position.
    Pending(u64, u64),
}

#[derive(Debug, Clone, Copy)]
struct Pin {
    ptr: DevicePtr,
    len: usize,
    state: PinState,
}

#[derive(Debug, Default)]
struct State {
    next_id: u64,
    va: BTreeMap<DevicePtr, usize>,
    /// Live physical handles: id -> size.
    phys: BTreeMap<u64, usize>,
    phys_created: u64,
    phys_released: u64,
    /// Mappings: ptr -> (size, handle, access set).
    maps: BTreeMap<DevicePtr, (usize, u64, bool)>,
    streams: BTreeMap<u64, StreamModel>,
    events: BTreeMap<u64, EventModel>,
    events_created: u64,
    events_destroyed: u64,
    pins: Vec<Pin>,
    next_va: DevicePtr,
}

/// What the model device counted (see [`ModelDevice::counts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counts {
    pub phys_created: u64,
    pub phys_released: u64,
    pub phys_live: usize,
    pub mappings: usize,
    pub reservations: usize,
    pub events_created: u64,
    pub events_destroyed: u64,
}

/// See the module documentation.
#[derive(Debug)]
pub struct ModelDevice {
    capacity: usize,
    st: Mutex<State>,
}

fn invalid(op: Op, reason: impl Into<String>) -> SysError {
    SysError::InvalidArgument {
        op,
        reason: reason.into(),
    }
}

fn overlaps(a: DevicePtr, al: usize, b: DevicePtr, bl: usize) -> bool {
    a < b + bl as u64 && b < a + al as u64
}

impl State {
    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    fn stream(&mut self, op: Op, s: Stream) -> SysResult<&mut StreamModel> {
        self.streams.get_mut(&s.0).ok_or(SysError::InvalidHandle {
            op,
            what: "stream",
            id: s.0,
        })
    }

    fn done(&self, s: u64) -> u64 {
        self.streams.get(&s).map_or(0, |m| m.done)
    }

    /// Complete work on every non-busy stream as far as dependencies allow.
    fn progress(&mut self) {
        loop {
            let mut changed = false;
            let ids: Vec<u64> = self.streams.keys().copied().collect();
            for id in ids {
                loop {
                    let m = &self.streams[&id];
                    if m.busy || m.done >= m.issued {
                        break;
                    }
                    let next = m.done + 1;
                    if let Some(&(x, q)) = m.deps.get(&next) {
                        if self.done(x) < q {
                            break;
                        }
                    }
                    self.streams.get_mut(&id).unwrap().done = next;
                    changed = true;
                }
            }
            if !changed {
                return;
            }
        }
    }

    /// The host waits for `s` up to position `q`: the device runs it (and
    /// what it depends on) to there, busy or not.
    fn force(&mut self, s: u64, q: u64) {
        while self.done(s) < q {
            let next = self.done(s) + 1;
            if let Some(&(x, qx)) = self.streams[&s].deps.get(&next) {
                self.force(x, qx);
            }
            self.streams.get_mut(&s).unwrap().done = next;
        }
        self.progress();
    }

    /// Is work issued on `b` from now on ordered after `a`'s work up to `q`?
    fn ordered_after(&self, b: u64, a: u64, q: u64) -> bool {
        a == b
            || self.done(a) >= q
            || self
                .streams
                .get(&b)
                .and_then(|m| m.clock.get(&a))
                .is_some_and(|&p| p >= q)
    }

    fn pending(&self, pin: &Pin) -> bool {
        match pin.state {
            PinState::Live(_) => true,
            PinState::Pending(s, q) => self.done(s) < q,
        }
    }
}

impl ModelDevice {
    /// A device with `capacity_pages` pages of [`GRANULARITY`] bytes.
    pub fn new(capacity_pages: usize) -> Self {
        let mut st = State {
            next_va: 1 << 32,
            ..State::default()
        };
        // The legacy default stream is id 0.
        st.streams.insert(0, StreamModel::default());
        ModelDevice {
            capacity: capacity_pages * GRANULARITY,
            st: Mutex::new(st),
        }
    }

    /// Mark a stream busy (its work does not complete) or idle (it
    /// completes everything it can now).
    /// Put `stream` in or out of capture, as a raw driver call would (the
    /// pool learns of it only through the capture query).
    pub fn set_capturing(&self, stream: Stream, capturing: bool) {
        let mut st = lock(&self.st);
        st.streams
            .get_mut(&stream.0)
            .expect("stream exists")
            .capturing = capturing;
    }

    pub fn set_busy(&self, stream: Stream, busy: bool) {
        let mut st = lock(&self.st);
        st.streams.get_mut(&stream.0).expect("stream exists").busy = busy;
        st.progress();
    }

    /// Every stream idle and all work completed.
    pub fn complete_all(&self) {
        let mut st = lock(&self.st);
        for m in st.streams.values_mut() {
            m.busy = false;
        }
        st.progress();
    }

    /// Issue one item of user work (a kernel) on `stream`.
    pub fn launch(&self, stream: Stream) {
        let mut st = lock(&self.st);
        st.streams.get_mut(&stream.0).expect("stream exists").issued += 1;
        st.progress();
    }

    /// User work on `stream` is about to use `[ptr, ptr+len)` (just
    /// allocated there). Panics when the pool handed out memory it must not.
    pub fn claim(&self, ptr: DevicePtr, len: usize, stream: Stream) {
        if len == 0 {
            return;
        }
        let mut st = lock(&self.st);
        // Mapped with access, byte for byte (mappings are whole pages).
        let mut cursor = ptr;
        while cursor < ptr + len as u64 {
            let m = st
                .maps
                .range(..=cursor)
                .next_back()
                .filter(|(&p, &(l, _, _))| cursor < p + l as u64);
            match m {
                Some((&p, &(l, _, acc))) => {
                    assert!(acc, "allocation {ptr:#x} lies on a mapping without access");
                    cursor = p + l as u64;
                }
                None => panic!("allocation {ptr:#x}+{len} lies on unmapped memory at {cursor:#x}"),
            }
        }
        for pin in &st.pins {
            if !overlaps(pin.ptr, pin.len, ptr, len) {
                continue;
            }
            match pin.state {
                PinState::Live(s) => panic!(
                    "allocation {ptr:#x}+{len} on {stream} overlaps live allocation {:#x}+{} of stream {s}",
                    pin.ptr, pin.len
                ),
                PinState::Pending(s, q) => assert!(
                    st.ordered_after(stream.0, s, q),
                    "allocation {ptr:#x}+{len} on {stream} reuses {:#x}+{} freed on stream {s} \
                     (work up to {q}) without being ordered after that work",
                    pin.ptr,
                    pin.len
                ),
            }
        }
        st.pins.retain(|p| !overlaps(p.ptr, p.len, ptr, len));
        st.pins.push(Pin {
            ptr,
            len,
            state: PinState::Live(stream.0),
        });
    }

    /// The allocation at `ptr` is about to be freed on `stream`: its memory
    /// stays in use until `stream`'s work issued so far completes.
    pub fn unclaim(&self, ptr: DevicePtr, stream: Stream) {
        if ptr == 0 {
            return;
        }
        let mut st = lock(&self.st);
        let q = st.streams[&stream.0].issued;
        let pin = st
            .pins
            .iter_mut()
            .find(|p| p.ptr == ptr && matches!(p.state, PinState::Live(_)))
            .expect("unclaim of a live claim");
        pin.state = PinState::Pending(stream.0, q);
    }

    /// Whether `[ptr, ptr+len)` is still mapped with access.
    pub fn is_mapped(&self, ptr: DevicePtr, len: usize) -> bool {
        let st = lock(&self.st);
        let mut cursor = ptr;
        while cursor < ptr + len as u64 {
            match st
                .maps
                .range(..=cursor)
                .next_back()
                .filter(|(&p, &(l, _, acc))| acc && cursor < p + l as u64)
            {
                Some((&p, &(l, _, _))) => cursor = p + l as u64,
                None => return false,
            }
        }
        true
    }

    /// How many times the pool asked whether `stream`'s work is done
    /// (`query_stream`).
    pub fn stream_queries(&self, stream: Stream) -> u64 {
        lock(&self.st)
            .streams
            .get(&stream.0)
            .map_or(0, |m| m.queries)
    }

    /// Counters of what was created and released.
    pub fn counts(&self) -> Counts {
        let st = lock(&self.st);
        Counts {
            phys_created: st.phys_created,
            phys_released: st.phys_released,
            phys_live: st.phys.len(),
            mappings: st.maps.len(),
            reservations: st.va.len(),
            events_created: st.events_created,
            events_destroyed: st.events_destroyed,
        }
    }

    /// After the pool is dropped: nothing leaked.
    pub fn assert_clean(&self) {
        let c = self.counts();
        assert_eq!(c.phys_live, 0, "physical memory leaked: {c:?}");
        assert_eq!(c.phys_created, c.phys_released, "{c:?}");
        assert_eq!(c.mappings, 0, "mappings leaked: {c:?}");
        assert_eq!(c.reservations, 0, "address space leaked: {c:?}");
        assert_eq!(c.events_created, c.events_destroyed, "events leaked: {c:?}");
    }
}

impl Device for ModelDevice {
    fn backend_name(&self) -> &'static str {
        "model"
    }
    fn ordinal(&self) -> i32 {
        0
    }
    fn granularity(&self) -> usize {
        GRANULARITY
    }

    fn reserve_va(&self, size: usize, alignment: usize) -> SysResult<DevicePtr> {
        if size == 0 || size % GRANULARITY != 0 || alignment % GRANULARITY != 0 {
            return Err(invalid(Op::ReserveVa, "size/alignment"));
        }
        let mut st = lock(&self.st);
        let align = alignment.max(GRANULARITY) as u64;
        let base = st.next_va.div_ceil(align) * align;
        st.next_va = base + size as u64 + GRANULARITY as u64;
        st.va.insert(base, size);
        Ok(base)
    }

    fn free_va(&self, ptr: DevicePtr, size: usize) -> SysResult<()> {
        let mut st = lock(&self.st);
        if st.va.get(&ptr) != Some(&size) {
            return Err(invalid(Op::FreeVa, "not a reservation"));
        }
        if st.maps.range(ptr..ptr + size as u64).next().is_some() {
            return Err(invalid(Op::FreeVa, "reservation still has mappings"));
        }
        st.va.remove(&ptr);
        Ok(())
    }

    fn create_physical(&self, size: usize, _options: PhysicalOptions) -> SysResult<Physical> {
        if size == 0 || size % GRANULARITY != 0 {
            return Err(invalid(Op::CreatePhysical, "size"));
        }
        let mut st = lock(&self.st);
        let used: usize = st.phys.values().sum();
        if used + size > self.capacity {
            return Err(SysError::OutOfMemory {
                op: Op::CreatePhysical,
                requested: size,
                available: self.capacity - used,
            });
        }
        let id = st.id();
        st.phys.insert(id, size);
        st.phys_created += 1;
        Ok(Physical(id))
    }

    fn release_physical(&self, handle: Physical) -> SysResult<()> {
        let mut st = lock(&self.st);
        st.phys.remove(&handle.0).ok_or(SysError::InvalidHandle {
            op: Op::ReleasePhysical,
            what: "physical",
            id: handle.0,
        })?;
        st.phys_released += 1;
        Ok(())
    }

    fn map(&self, ptr: DevicePtr, size: usize, handle: Physical, offset: usize) -> SysResult<()> {
        let mut st = lock(&self.st);
        let in_va = st
            .va
            .range(..=ptr)
            .next_back()
            .is_some_and(|(&b, &l)| ptr + size as u64 <= b + l as u64);
        let fits = st.phys.get(&handle.0).is_some_and(|&l| offset + size <= l);
        if !in_va || !fits || size % GRANULARITY != 0 || ptr % GRANULARITY as u64 != 0 {
            return Err(invalid(Op::Map, "range or handle"));
        }
        let clash = st
            .maps
            .range(..ptr + size as u64)
            .next_back()
            .is_some_and(|(&p, &(l, _, _))| overlaps(p, l, ptr, size));
        assert!(!clash, "map over an existing mapping at {ptr:#x}");
        st.maps.insert(ptr, (size, handle.0, false));
        Ok(())
    }

    fn unmap(&self, ptr: DevicePtr, size: usize) -> SysResult<()> {
        let mut st = lock(&self.st);
        if st.maps.get(&ptr).map(|m| m.0) != Some(size) {
            return Err(invalid(Op::Unmap, "not exactly a mapping"));
        }
        for pin in &st.pins {
            // (No second panic while a failed scenario unwinds and drops the pool.)
            if overlaps(pin.ptr, pin.len, ptr, size) && st.pending(pin) && !std::thread::panicking()
            {
                panic!(
                    "unmap of {ptr:#x}+{size} while {:#x}+{} is in use ({:?})",
                    pin.ptr, pin.len, pin.state
                );
            }
        }
        st.maps.remove(&ptr);
        Ok(())
    }

    fn set_access(&self, ptr: DevicePtr, size: usize, _access: &[AccessDesc]) -> SysResult<()> {
        let mut st = lock(&self.st);
        match st.maps.get_mut(&ptr) {
            Some(m) if m.0 == size => {
                m.2 = true;
                Ok(())
            }
            _ => Err(invalid(Op::SetAccess, "not a mapping")),
        }
    }

    fn export_fd(&self, _handle: Physical) -> SysResult<OwnedFd> {
        Err(SysError::Unsupported {
            op: Op::ExportHandle,
            reason: "model device".into(),
        })
    }

    fn import_fd(&self, _fd: OwnedFd, _size: usize) -> SysResult<Physical> {
        Err(SysError::Unsupported {
            op: Op::ImportHandle,
            reason: "model device".into(),
        })
    }

    fn mem_info(&self) -> SysResult<MemInfo> {
        let st = lock(&self.st);
        let used: usize = st.phys.values().sum();
        Ok(MemInfo {
            free: self.capacity - used,
            total: self.capacity,
        })
    }

    fn create_stream(&self) -> SysResult<Stream> {
        let mut st = lock(&self.st);
        let id = st.id();
        st.streams.insert(id, StreamModel::default());
        Ok(Stream(id))
    }

    fn destroy_stream(&self, stream: Stream) -> SysResult<()> {
        // Work queued still completes: keep the counters, forget nothing.
        let mut st = lock(&self.st);
        st.stream(Op::DestroyStream, stream).map(|_| ())
    }

    fn default_stream(&self) -> Stream {
        Stream(0)
    }

    fn adopt_stream(&self, _raw: usize) -> SysResult<Stream> {
        self.create_stream()
    }

    fn synchronize_stream(&self, stream: Stream) -> SysResult<()> {
        let mut st = lock(&self.st);
        let q = st.stream(Op::SynchronizeStream, stream)?.issued;
        st.force(stream.0, q);
        Ok(())
    }

    fn synchronize_device(&self) -> SysResult<()> {
        let mut st = lock(&self.st);
        let all: Vec<(u64, u64)> = st.streams.iter().map(|(&s, m)| (s, m.issued)).collect();
        for (s, q) in all {
            st.force(s, q);
        }
        Ok(())
    }

    fn query_stream(&self, stream: Stream) -> SysResult<bool> {
        let mut st = lock(&self.st);
        st.progress();
        let m = st.stream(Op::QueryStream, stream)?;
        m.queries += 1;
        Ok(m.done >= m.issued)
    }

    fn is_capturing(&self, stream: Stream) -> SysResult<bool> {
        let mut st = lock(&self.st);
        st.stream(Op::IsCapturing, stream).map(|m| m.capturing)
    }

    fn check_stream(&self, stream: Stream) -> SysResult<()> {
        // A table lookup, as the real backends do: no device progress.
        let mut st = lock(&self.st);
        st.stream(Op::CheckStream, stream).map(|_| ())
    }

    fn create_event(&self) -> SysResult<Event> {
        let mut st = lock(&self.st);
        let id = st.id();
        st.events.insert(id, EventModel { recorded: None });
        st.events_created += 1;
        Ok(Event(id))
    }

    fn record_event(&self, event: Event, stream: Stream) -> SysResult<()> {
        let mut st = lock(&self.st);
        let m = st.stream(Op::RecordEvent, stream)?;
        let mut clock = m.clock.clone();
        clock.insert(stream.0, m.issued);
        let rec = (stream.0, m.issued, clock);
        match st.events.get_mut(&event.0) {
            Some(e) => e.recorded = Some(rec),
            None => {
                return Err(SysError::InvalidHandle {
                    op: Op::RecordEvent,
                    what: "event",
                    id: event.0,
                })
            }
        }
        Ok(())
    }

    fn query_event(&self, event: Event) -> SysResult<bool> {
        let mut st = lock(&self.st);
        st.progress();
        match st.events.get(&event.0) {
            Some(EventModel { recorded: None }) => Ok(true),
            Some(EventModel {
                recorded: Some((s, q, _)),
            }) => Ok(st.done(*s) >= *q),
            None => Err(SysError::InvalidHandle {
                op: Op::QueryEvent,
                what: "event",
                id: event.0,
            }),
        }
    }

    fn synchronize_event(&self, event: Event) -> SysResult<()> {
        let mut st = lock(&self.st);
        match st.events.get(&event.0) {
            Some(EventModel { recorded }) => {
                if let Some((s, q, _)) = recorded.clone() {
                    st.force(s, q);
                }
                Ok(())
            }
            None => Err(SysError::InvalidHandle {
                op: Op::SynchronizeEvent,
                what: "event",
                id: event.0,
            }),
        }
    }

    fn destroy_event(&self, event: Event) -> SysResult<()> {
        let mut st = lock(&self.st);
        st.events.remove(&event.0).ok_or(SysError::InvalidHandle {
            op: Op::DestroyEvent,
            what: "event",
            id: event.0,
        })?;
        st.events_destroyed += 1;
        Ok(())
    }

    fn wait_event(&self, stream: Stream, event: Event) -> SysResult<()> {
        let mut st = lock(&self.st);
        st.stream(Op::WaitEvent, stream)?;
        let rec = match st.events.get(&event.0) {
            Some(e) => e.recorded.clone(),
            None => {
                return Err(SysError::InvalidHandle {
                    op: Op::WaitEvent,
                    what: "event",
                    id: event.0,
                })
            }
        };
        if let Some((s, q, clock)) = rec {
            let m = st.streams.get_mut(&stream.0).unwrap();
            m.issued += 1;
            let pos = m.issued;
            m.deps.insert(pos, (s, q));
            for (k, v) in clock {
                let e = m.clock.entry(k).or_insert(0);
                *e = (*e).max(v);
            }
            st.progress();
        }
        Ok(())
    }

    fn launch_host(&self, stream: Stream, task: HostTask) -> SysResult<()> {
        {
            let mut st = lock(&self.st);
            st.stream(Op::LaunchHost, stream)?.issued += 1;
            st.progress();
        }
        task();
        Ok(())
    }

    // The model never captures: every stream reports no capture, and the
    // graph calls are refused (no model of the pool starts a capture).

    fn capture_status(&self, stream: Stream) -> SysResult<tidepool_sys::CaptureStatus> {
        let mut st = lock(&self.st);
        st.stream(Op::CaptureStatus, stream).map(|m| {
            if m.capturing {
                tidepool_sys::CaptureStatus::Active { id: stream.0 }
            } else {
                tidepool_sys::CaptureStatus::None
            }
        })
    }

    fn graph_alloc(&self, _stream: Stream, _size: usize) -> SysResult<DevicePtr> {
        Err(no_graphs(Op::GraphAlloc))
    }

    fn graph_free(&self, _stream: Stream, _ptr: DevicePtr) -> SysResult<()> {
        Err(no_graphs(Op::GraphFree))
    }

    fn begin_capture(&self, _stream: Stream, _mode: tidepool_sys::CaptureMode) -> SysResult<()> {
        Err(no_graphs(Op::Graph))
    }

    fn end_capture(&self, _stream: Stream) -> SysResult<tidepool_sys::Graph> {
        Err(no_graphs(Op::Graph))
    }

    fn instantiate_graph(
        &self,
        _graph: tidepool_sys::Graph,
        _options: tidepool_sys::GraphOptions,
    ) -> SysResult<tidepool_sys::GraphExec> {
        Err(no_graphs(Op::Graph))
    }

    fn launch_graph(&self, _exec: tidepool_sys::GraphExec, _stream: Stream) -> SysResult<()> {
        Err(no_graphs(Op::Graph))
    }

    fn destroy_graph(&self, _graph: tidepool_sys::Graph) -> SysResult<()> {
        Err(no_graphs(Op::Graph))
    }

    fn destroy_graph_exec(&self, _exec: tidepool_sys::GraphExec) -> SysResult<()> {
        Err(no_graphs(Op::Graph))
    }
}

fn no_graphs(op: Op) -> tidepool_sys::SysError {
    tidepool_sys::SysError::Unsupported {
        op,
        reason: "the loom model device has no graphs".into(),
    }
}
