//! The host backend's simulation of CUDA graph capture.
//!
//! While a stream captures, work issued to it is recorded instead of run:
//! replayable host tasks ([`HostDevice::launch_on_words_repeatable`], and
//! so the host tag kernels) become task nodes, [`Device::graph_alloc`] and
//! [`Device::graph_free`] become memory nodes. [`Device::launch_graph`]
//! enqueues one task on the launch stream that runs the nodes in recorded
//! order. One-shot tasks ([`Device::launch_host`]) cannot be replayed and
//! are refused, as on the CUDA backend.
//!
//! Graph memory follows the driver's model: the address of each allocation
//! node is fixed at capture time (a VA reservation made then) and is the
//! same in every launch; the physical memory is created when the graph is
//! instantiated; the allocation node maps it (read-write) when a replay
//! reaches it, and the free node unmaps it. So work that touches the memory
//! after the free node, or between launches, finds it unmapped and faults
//! (the host kernels count it), where on the GPU it would be undefined.
//!
//! Rules enforced as the driver does: synchronising or querying a capturing
//! stream, and issuing a one-shot task to it, invalidate the capture and
//! fail; a capturing stream may not wait on an event recorded outside the
//! capture; querying or synchronising an event recorded into a capture fails and
//! invalidates that capture; device-wide synchronisation is refused in
//! global and thread-local mode from any thread; the capture ends on
//! the stream it began on, from the same thread unless it is relaxed; a
//! graph with memory nodes has one executable graph at a time; launching
//! while an allocation of the previous launch is still live fails unless
//! the graph was instantiated with auto-free-on-launch.
//!
//! Not simulated: forking other streams into a capture (waiting on a
//! captured event from a stream outside the capture is
//! [`SysError::Unsupported`] here, where the driver would join that stream
//! into the capture), and launching a graph inside a capture.

use super::{lock, next_id, os_err, write, HostDevice, PhysMem, StreamState, Vm};
use crate::device::{
    Access, CaptureMode, CaptureStatus, Device, DevicePtr, Graph, GraphExec, GraphOptions, Stream,
};
use crate::error::{Op, SysError, SysResult};
use crate::validate::invalid;
use rustix::mm::{MapFlags, ProtFlags};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::ThreadId;

/// A replayable host task.
pub(crate) type RepeatTask = Arc<dyn Fn() + Send + Sync + 'static>;

/// Work handed to a stream: run once, or replayable (capturable).
pub(crate) enum Task {
    Once(crate::device::HostTask),
    Repeat(RepeatTask),
}

/// One recorded step of a graph.
#[derive(Clone)]
pub(crate) enum Node {
    Task(RepeatTask),
    /// Map the graph allocation with this index.
    Alloc(usize),
    /// Unmap it.
    Free(usize),
}

/// One graph allocation: a fixed address range and, while an executable
/// graph exists, the physical memory that backs it during a launch.
pub(crate) struct GraphMem {
    pub(crate) va: DevicePtr,
    pub(crate) size: usize,
    vm: Arc<RwLock<Vm>>,
    phys: Mutex<Option<Arc<PhysMem>>>,
    /// Mapped by an allocation whose free has not been issued yet (set and
    /// cleared when work is issued, not when it runs).
    live: AtomicBool,
}

impl GraphMem {
    /// Map the backing read-write (the allocation node).
    fn map(&self) -> Result<(), String> {
        let Some(phys) = lock(&self.phys).clone() else {
            return Err(format!(
                "graph allocation at {:#x} has no physical memory (its executable graph is gone)",
                self.va
            ));
        };
        let mut vm = write(&self.vm);
        if vm.reservation_containing(self.va, self.size).is_none() {
            return Err(format!(
                "graph allocation at {:#x} lost its reservation",
                self.va
            ));
        }
        if vm.any_mapping_overlaps(self.va, self.size) {
            return Err(format!(
                "graph allocation at {:#x} is still mapped (allocated twice without a free)",
                self.va
            ));
        }
        // SAFETY: `[va, va+size)` is this allocation's own reservation and
        // holds no mapping (both checked above under the write lock), so
        // MAP_FIXED replaces only our PROT_NONE placeholder pages, which no
        // Rust code refers to; the memfd holds `size` bytes (made so at
        // instantiation), so the mapping cannot SIGBUS.
        unsafe {
            rustix::mm::mmap(
                self.va as usize as *mut std::ffi::c_void,
                self.size,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED | MapFlags::FIXED,
                &phys.fd,
                0,
            )
        }
        .map_err(|e| os_err(Op::GraphAlloc, e).to_string())?;
        vm.mappings.insert(
            self.va,
            super::Mapping {
                size: self.size,
                phys,
                access: Access::ReadWrite,
            },
        );
        Ok(())
    }

    /// Unmap the backing (the free node).
    fn unmap(&self) -> Result<(), String> {
        let mut vm = write(&self.vm);
        match vm.mappings.get(&self.va) {
            Some(m) if m.size == self.size => {}
            _ => {
                return Err(format!(
                    "graph allocation at {:#x} is not mapped (freed twice?)",
                    self.va
                ))
            }
        }
        HostDevice::overlay_none(self.va, self.size)
            .map_err(|e| os_err(Op::GraphFree, e).to_string())?;
        vm.mappings.remove(&self.va);
        Ok(())
    }
}

impl Drop for GraphMem {
    fn drop(&mut self) {
        let mut vm = write(&self.vm);
        if vm
            .mappings
            .get(&self.va)
            .is_some_and(|m| m.size == self.size)
        {
            if let Err(e) = HostDevice::overlay_none(self.va, self.size) {
                tracing::warn!(va = self.va, error = %e, "host backend: unmapping graph memory failed");
            }
            vm.mappings.remove(&self.va);
        }
        // Only while the reservation is still ours: the device's drop may
        // have freed it already (the address may then belong to others).
        if vm.reservations.get(&self.va) == Some(&self.size) {
            let start = self.va as usize as *mut std::ffi::c_void;
            // SAFETY: `[va, va+size)` is exactly this allocation's
            // reservation, still in the table, and holds no mapping (removed
            // just above); no Rust code refers to it.
            let freed = unsafe { rustix::mm::munmap(start, self.size) };
            if let Err(e) = freed {
                tracing::warn!(va = self.va, error = %e, "host backend: freeing graph memory's reservation failed");
            }
            vm.reservations.remove(&self.va);
        }
    }
}

/// A capture in progress.
pub(crate) struct Recording {
    pub(crate) id: u64,
    mode: CaptureMode,
    thread: ThreadId,
    nodes: Mutex<Vec<Node>>,
    /// Allocations made in this capture, and whether the capture freed each.
    mems: Mutex<Vec<(Arc<GraphMem>, bool)>>,
}

/// What the device knows of a stream's capture.
#[derive(Clone)]
pub(crate) struct CaptureEntry {
    pub(crate) mode: CaptureMode,
    /// `None` for the [`HostDevice::set_capturing`] test aid (work still runs).
    pub(crate) recording: Option<Arc<Recording>>,
}

/// A graph made by `end_capture`.
pub(crate) struct HostGraph {
    nodes: Arc<[Node]>,
    mems: Arc<[Arc<GraphMem>]>,
    freed_inside: Arc<[bool]>,
    /// A graph with memory nodes may have one executable graph at a time.
    has_exec: AtomicBool,
}

/// An executable graph.
pub(crate) struct HostExec {
    graph: Arc<HostGraph>,
    auto_free: bool,
    /// Serialises launches of this executable graph (the live checks and
    /// the enqueue are one step).
    launching: Mutex<()>,
}

impl Drop for HostExec {
    fn drop(&mut self) {
        // The physical memory goes with the executable graph; a mapping
        // still live keeps its memfd until it is unmapped.
        for m in self.graph.mems.iter() {
            lock(&m.phys).take();
        }
        self.graph.has_exec.store(false, Ordering::Release);
    }
}

fn violation(op: Op, reason: impl Into<String>) -> SysError {
    SysError::CaptureViolation {
        op,
        reason: reason.into(),
    }
}

impl StreamState {
    /// Record `task` into this stream's capture, or run it: the one entry
    /// point of work issued to a host stream.
    pub(crate) fn submit(&self, op: Op, task: Task) -> SysResult<()> {
        if self.capture_id.load(Ordering::Acquire) != 0 {
            let rec = lock(&self.recording).clone();
            if let Some(rec) = rec {
                self.check_valid(op)?;
                return match task {
                    Task::Repeat(f) => {
                        lock(&rec.nodes).push(Node::Task(f));
                        Ok(())
                    }
                    Task::Once(_) => {
                        self.invalidate();
                        Err(violation(
                            op,
                            "a one-shot host task cannot be captured into a graph (use a \
                             replayable task)",
                        ))
                    }
                };
            }
        }
        match task {
            Task::Once(t) => self.enqueue(op, t),
            Task::Repeat(f) => self.enqueue(op, Box::new(move || f())),
        }
    }

    /// The capture this stream records into (`None`: work runs).
    pub(crate) fn recording(&self) -> Option<Arc<Recording>> {
        if self.capture_id.load(Ordering::Acquire) == 0 {
            return None;
        }
        lock(&self.recording).clone()
    }

    pub(crate) fn invalidate(&self) {
        self.capture_invalid.store(true, Ordering::Release);
    }

    fn check_valid(&self, op: Op) -> SysResult<()> {
        if self.capture_invalid.load(Ordering::Acquire) {
            return Err(violation(
                op,
                "the capture was invalidated by an earlier refused call; end it",
            ));
        }
        Ok(())
    }

    /// Refuse a call that would wait for, or ask about, a capturing stream
    /// (and invalidate the capture, as the driver does).
    pub(crate) fn refuse_if_recording(&self, op: Op) -> SysResult<()> {
        if self.recording().is_some() {
            self.invalidate();
            return Err(violation(
                op,
                "the stream is being captured: its work runs only when the graph is launched",
            ));
        }
        Ok(())
    }

    pub(crate) fn capture_status(&self) -> CaptureStatus {
        match self.capture_id.load(Ordering::Acquire) {
            0 => CaptureStatus::None,
            id if self.capture_invalid.load(Ordering::Acquire) => CaptureStatus::Invalidated { id },
            id => CaptureStatus::Active { id },
        }
    }
}

impl HostDevice {
    /// Enqueue on `stream` a replayable task that hands `f` the memory
    /// `[ptr, ptr+len)` as 32-bit words, checked like
    /// [`HostDevice::launch_on_words`]. Unlike that one-shot form, it can be
    /// captured into a graph: each launch of the graph runs `f` again.
    pub fn launch_on_words_repeatable(
        &self,
        stream: Stream,
        ptr: DevicePtr,
        len: usize,
        f: impl Fn(Result<&[std::sync::atomic::AtomicU32], SysError>) + Send + Sync + 'static,
    ) -> SysResult<()> {
        let vm = Arc::clone(&self.vm);
        let task: RepeatTask = Arc::new(move || {
            super::with_words(&vm, Op::LaunchHost, ptr, len, Access::ReadWrite, &f)
        });
        self.stream(Op::LaunchHost, stream)?
            .submit(Op::LaunchHost, Task::Repeat(task))
    }

    /// Enqueue a replayable host task on `stream`: like
    /// [`Device::launch_host`], but it can be captured into a graph (each
    /// launch runs it again).
    pub fn launch_host_repeatable(
        &self,
        stream: Stream,
        task: Arc<dyn Fn() + Send + Sync + 'static>,
    ) -> SysResult<()> {
        self.stream(Op::LaunchHost, stream)?
            .submit(Op::LaunchHost, Task::Repeat(task))
    }

    /// Replay failures of graph memory nodes so far (an allocation node
    /// whose memory was still mapped, a free node whose memory was not):
    /// each is also logged. A test aid; 0 in a correct program.
    pub fn graph_faults(&self) -> u64 {
        self.graph_faults.load(Ordering::Acquire)
    }

    /// Graph allocations currently live outside a launch (allocated
    /// eagerly, or left unfreed by a graph), not yet freed.
    pub fn live_graph_allocations(&self) -> usize {
        lock(&self.graph_live).len()
    }

    /// Run one memory node now (on a stream's worker), counting failures.
    fn run_mem_node(faults: &AtomicU64, mem: &GraphMem, alloc: bool) {
        let r = if alloc { mem.map() } else { mem.unmap() };
        if let Err(reason) = r {
            faults.fetch_add(1, Ordering::AcqRel);
            tracing::error!(va = mem.va, %reason, "host backend: graph memory node failed");
        }
    }

    pub(super) fn capture_status_impl(&self, stream: Stream) -> SysResult<CaptureStatus> {
        Ok(self.resolve(Op::CaptureStatus, stream)?.capture_status())
    }

    pub(super) fn graph_alloc_impl(&self, stream: Stream, size: usize) -> SysResult<DevicePtr> {
        let op = Op::GraphAlloc;
        if size == 0 {
            return Err(invalid(op, "size 0"));
        }
        let s = self.stream(op, stream)?;
        let size = size.next_multiple_of(self.config.granularity);
        let rec = s.recording();
        if rec.is_some() {
            s.check_valid(op)?;
        }
        let va = self.reserve_va(size, 0).map_err(|e| match e {
            SysError::OutOfMemory { available, .. } => SysError::OutOfMemory {
                op,
                requested: size,
                available,
            },
            e => e,
        })?;
        let mem = Arc::new(GraphMem {
            va,
            size,
            vm: Arc::clone(&self.vm),
            phys: Mutex::new(None),
            live: AtomicBool::new(false),
        });
        match rec {
            Some(rec) => {
                let mut mems = lock(&rec.mems);
                let slot = mems.len();
                mems.push((mem, false));
                lock(&rec.nodes).push(Node::Alloc(slot));
            }
            None => {
                // An ordinary stream-ordered allocation: memory now, mapped
                // when the stream reaches it.
                let phys = self.new_phys(op, size, false)?;
                *lock(&mem.phys) = Some(phys);
                mem.live.store(true, Ordering::Release);
                lock(&self.graph_live).insert(va, Arc::clone(&mem));
                let faults = Arc::clone(&self.graph_faults);
                s.enqueue(
                    op,
                    Box::new(move || Self::run_mem_node(&faults, &mem, true)),
                )
                .inspect_err(|_| {
                    lock(&self.graph_live).remove(&va);
                })?;
            }
        }
        Ok(va)
    }

    pub(super) fn graph_free_impl(&self, stream: Stream, ptr: DevicePtr) -> SysResult<()> {
        let op = Op::GraphFree;
        let s = self.stream(op, stream)?;
        if let Some(rec) = s.recording() {
            s.check_valid(op)?;
            let mut mems = lock(&rec.mems);
            let Some(slot) = mems.iter().position(|(m, _)| m.va == ptr) else {
                return Err(SysError::Unsupported {
                    op,
                    reason: format!(
                        "{ptr:#x} was not allocated in this capture: the host backend frees \
                         inside a capture only memory allocated in the same capture"
                    ),
                });
            };
            if mems[slot].1 {
                return Err(invalid(
                    op,
                    format!("{ptr:#x} is freed twice in this capture"),
                ));
            }
            mems[slot].1 = true;
            lock(&rec.nodes).push(Node::Free(slot));
            return Ok(());
        }
        let mem = lock(&self.graph_live).remove(&ptr).ok_or_else(|| {
            invalid(
                op,
                format!("{ptr:#x} is not a live graph or stream-ordered allocation"),
            )
        })?;
        mem.live.store(false, Ordering::Release);
        let faults = Arc::clone(&self.graph_faults);
        let task_mem = Arc::clone(&mem);
        s.enqueue(
            op,
            Box::new(move || Self::run_mem_node(&faults, &task_mem, false)),
        )
        .inspect_err(|_| {
            mem.live.store(true, Ordering::Release);
            lock(&self.graph_live).insert(ptr, Arc::clone(&mem));
        })
    }

    pub(super) fn begin_capture_impl(&self, stream: Stream, mode: CaptureMode) -> SysResult<()> {
        let op = Op::Graph;
        if stream == self.default_stream {
            return Err(invalid(op, "the legacy default stream cannot be captured"));
        }
        let s = self.stream(op, stream)?;
        let mut captures = lock(&self.captures);
        if captures.contains_key(&stream.0) {
            return Err(violation(op, "the stream is already capturing"));
        }
        let id = next_id();
        let rec = Arc::new(Recording {
            id,
            mode,
            thread: std::thread::current().id(),
            nodes: Mutex::new(Vec::new()),
            mems: Mutex::new(Vec::new()),
        });
        captures.insert(
            stream.0,
            CaptureEntry {
                mode,
                recording: Some(Arc::clone(&rec)),
            },
        );
        *lock(&s.recording) = Some(rec);
        s.capture_invalid.store(false, Ordering::Release);
        s.capture_id.store(id, Ordering::Release);
        Ok(())
    }

    pub(super) fn end_capture_impl(&self, stream: Stream) -> SysResult<Graph> {
        let op = Op::Graph;
        let s = self.stream(op, stream)?;
        let mut captures = lock(&self.captures);
        let Some(entry) = captures.get(&stream.0) else {
            return Err(violation(op, "the stream is not capturing"));
        };
        let Some(rec) = entry.recording.clone() else {
            return Err(violation(
                op,
                "the stream's capture is simulated with set_capturing; clear it there",
            ));
        };
        if rec.mode != CaptureMode::Relaxed && rec.thread != std::thread::current().id() {
            return Err(violation(
                op,
                "a capture not begun in relaxed mode must end on the thread that began it",
            ));
        }
        captures.remove(&stream.0);
        drop(captures);
        lock(&s.recording).take();
        s.capture_id.store(0, Ordering::Release);
        let invalid_capture = s.capture_invalid.swap(false, Ordering::AcqRel);
        let nodes: Vec<Node> = std::mem::take(&mut *lock(&rec.nodes));
        let mems: Vec<(Arc<GraphMem>, bool)> = std::mem::take(&mut *lock(&rec.mems));
        if invalid_capture {
            return Err(violation(
                op,
                "the capture was invalidated by a refused call; no graph was made",
            ));
        }
        let (mems, freed): (Vec<_>, Vec<_>) = mems.into_iter().unzip();
        let graph = Arc::new(HostGraph {
            nodes: nodes.into(),
            mems: mems.into(),
            freed_inside: freed.into(),
            has_exec: AtomicBool::new(false),
        });
        let id = next_id();
        lock(&self.graphs).insert(id, graph);
        Ok(Graph(id))
    }

    pub(super) fn instantiate_graph_impl(
        &self,
        graph: Graph,
        options: GraphOptions,
    ) -> SysResult<GraphExec> {
        let op = Op::Graph;
        let g = lock(&self.graphs)
            .get(&graph.0)
            .cloned()
            .ok_or(SysError::InvalidHandle {
                op,
                what: "graph",
                id: graph.0,
            })?;
        if !g.mems.is_empty() && g.has_exec.swap(true, Ordering::AcqRel) {
            return Err(invalid(
                op,
                "a graph with memory nodes may have only one executable graph at a time; \
                 destroy the other first",
            ));
        }
        // The physical memory behind each allocation node, for this
        // executable graph's lifetime.
        for (i, m) in g.mems.iter().enumerate() {
            match self.new_phys(op, m.size, false) {
                Ok(p) => *lock(&m.phys) = Some(p),
                Err(e) => {
                    for m in &g.mems[..i] {
                        lock(&m.phys).take();
                    }
                    g.has_exec.store(false, Ordering::Release);
                    return Err(e);
                }
            }
        }
        let id = next_id();
        lock(&self.execs).insert(
            id,
            Arc::new(HostExec {
                graph: g,
                auto_free: options.auto_free_on_launch,
                launching: Mutex::new(()),
            }),
        );
        Ok(GraphExec(id))
    }

    pub(super) fn launch_graph_impl(&self, exec: GraphExec, stream: Stream) -> SysResult<()> {
        let op = Op::Graph;
        let e = lock(&self.execs)
            .get(&exec.0)
            .cloned()
            .ok_or(SysError::InvalidHandle {
                op,
                what: "executable graph",
                id: exec.0,
            })?;
        let s = self.stream(op, stream)?;
        if s.recording().is_some() {
            return Err(SysError::Unsupported {
                op,
                reason: "the host backend cannot capture a graph launch into another graph".into(),
            });
        }
        let _launching = lock(&e.launching);
        let g = &e.graph;
        // Allocations the previous launch left live.
        let mut auto_free = Vec::new();
        for (m, &freed) in g.mems.iter().zip(g.freed_inside.iter()) {
            if !freed && m.live.load(Ordering::Acquire) {
                if !e.auto_free {
                    return Err(invalid(
                        op,
                        format!(
                            "the graph allocation at {:#x} from the previous launch is still \
                             live: free it with graph_free before launching again, or \
                             instantiate with auto_free_on_launch",
                            m.va
                        ),
                    ));
                }
                auto_free.push(Arc::clone(m));
            }
        }
        for m in &auto_free {
            lock(&self.graph_live).remove(&m.va);
            m.live.store(false, Ordering::Release);
        }
        let nodes = Arc::clone(&g.nodes);
        let mems = Arc::clone(&g.mems);
        let faults = Arc::clone(&self.graph_faults);
        s.enqueue(
            op,
            Box::new(move || {
                for m in &auto_free {
                    Self::run_mem_node(&faults, m, false);
                }
                for node in nodes.iter() {
                    match node {
                        Node::Task(f) => f(),
                        Node::Alloc(i) => Self::run_mem_node(&faults, &mems[*i], true),
                        Node::Free(i) => Self::run_mem_node(&faults, &mems[*i], false),
                    }
                }
            }),
        )?;
        let mut live = lock(&self.graph_live);
        for (m, &freed) in g.mems.iter().zip(g.freed_inside.iter()) {
            if !freed {
                m.live.store(true, Ordering::Release);
                live.insert(m.va, Arc::clone(m));
            }
        }
        Ok(())
    }

    pub(super) fn destroy_graph_impl(&self, graph: Graph) -> SysResult<()> {
        lock(&self.graphs)
            .remove(&graph.0)
            .map(drop)
            .ok_or(SysError::InvalidHandle {
                op: Op::Graph,
                what: "graph",
                id: graph.0,
            })
    }

    pub(super) fn destroy_graph_exec_impl(&self, exec: GraphExec) -> SysResult<()> {
        lock(&self.execs)
            .remove(&exec.0)
            .map(drop)
            .ok_or(SysError::InvalidHandle {
                op: Op::Graph,
                what: "executable graph",
                id: exec.0,
            })
    }

    /// Refuse a device-wide call that a capture in progress forbids
    /// (global and thread-local mode: from any thread, since the call would
    /// wait for the capturing stream; relaxed: never), invalidating that
    /// capture.
    pub(super) fn refuse_unsafe_call(&self, op: Op) -> SysResult<()> {
        let captures = lock(&self.captures);
        for (&sid, entry) in captures.iter() {
            let refused = match entry.mode {
                // The driver refuses a device-wide synchronisation during a
                // thread-local capture from every thread, not only the
                // capturing one (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED).
                CaptureMode::Global | CaptureMode::ThreadLocal => true,
                CaptureMode::Relaxed => false,
            };
            if refused {
                if entry.recording.is_some() {
                    if let Some(s) = lock(&self.streams).get(&sid) {
                        s.invalidate();
                    }
                }
                return Err(violation(
                    op,
                    format!("stream {sid} is being captured ({:?} mode)", entry.mode),
                ));
            }
        }
        Ok(())
    }
}
