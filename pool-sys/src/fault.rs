//! A fault-injecting wrapper: forwards every call to an inner [`Device`] and
//! fails the calls a test chooses, to prove that the pool survives every
//! failure the driver can report.
//!
//! Calls are counted per [`Op`]. A rule set with [`FaultInjector::fail_nth`]
//! or [`FaultInjector::fail_from`] counts from the moment it is set: `n = 1`
//! is the next call of that op. A failed call does not reach the inner
//! device (no side effect), and returns the rule's error.
//!
//! `granularity` is counted but never fails (the trait cannot report an
//! error for it); `backend_name`, `ordinal` and `default_stream` are neither
//! counted nor failed.

use crate::device::{
    AccessDesc, CaptureMode, CaptureStatus, Device, DevicePtr, Event, Graph, GraphExec,
    GraphOptions, HostTask, MemInfo, Physical, PhysicalOptions, Stream,
};
use crate::error::{Op, SysError, SysResult};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

#[derive(Debug)]
enum Rule {
    /// Fail the call numbered `at` (absolute count of that op), once.
    Nth { op: Op, at: u64, error: SysError },
    /// Fail every call numbered `from` or later.
    From { op: Op, from: u64, error: SysError },
}

/// Wraps a [`Device`] and makes chosen calls fail. Thread-safe.
#[derive(Debug)]
pub struct FaultInjector<D: Device> {
    inner: D,
    /// Calls so far, per op (indexed like [`Op::ALL`]).
    counts: Vec<AtomicU64>,
    rules: Mutex<Vec<Rule>>,
}

fn index(op: Op) -> usize {
    Op::ALL
        .iter()
        .position(|&o| o == op)
        .expect("every Op is listed in Op::ALL")
}

impl<D: Device> FaultInjector<D> {
    /// Wrap `inner`; no call fails until a rule is set.
    pub fn new(inner: D) -> Self {
        FaultInjector {
            inner,
            counts: Op::ALL.iter().map(|_| AtomicU64::new(0)).collect(),
            rules: Mutex::new(Vec::new()),
        }
    }

    /// The wrapped device.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    /// Unwrap, giving the inner device back.
    pub fn into_inner(self) -> D {
        self.inner
    }

    /// Make the `n`-th call of `op` (1-based, counted from now) fail with
    /// `error`, exactly once. `n = 0` is treated as 1.
    pub fn fail_nth(&self, op: Op, n: u64, error: SysError) {
        let mut rules = self.lock_rules();
        let at = self.calls(op) + n.max(1);
        rules.push(Rule::Nth { op, at, error });
    }

    /// Make every call of `op` from the `n`-th on (1-based, counted from
    /// now) fail with `error`, until [`FaultInjector::clear`]. `n = 0` is
    /// treated as 1.
    pub fn fail_from(&self, op: Op, n: u64, error: SysError) {
        let mut rules = self.lock_rules();
        let from = self.calls(op) + n.max(1);
        rules.push(Rule::From { op, from, error });
    }

    /// Remove every rule (call counts keep running).
    pub fn clear(&self) {
        self.lock_rules().clear();
    }

    /// How many calls of `op` were made since this wrapper was created,
    /// failed ones included.
    pub fn calls(&self, op: Op) -> u64 {
        self.counts[index(op)].load(Ordering::Acquire)
    }

    fn lock_rules(&self) -> std::sync::MutexGuard<'_, Vec<Rule>> {
        self.rules.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Count a call of `op` and say whether a rule fails it.
    fn check(&self, op: Op) -> SysResult<()> {
        // Count under the rules lock, so a rule set concurrently sees a
        // consistent count ("from now" is well defined).
        let mut rules = self.lock_rules();
        let call = self.counts[index(op)].fetch_add(1, Ordering::AcqRel) + 1;
        let mut failure = None;
        rules.retain(|rule| match rule {
            Rule::Nth { op: o, at, error } if *o == op && *at == call => {
                failure.get_or_insert_with(|| error.clone());
                false // fires once
            }
            Rule::From { op: o, from, error } if *o == op && call >= *from => {
                failure.get_or_insert_with(|| error.clone());
                true
            }
            _ => true,
        });
        drop(rules);
        match failure {
            Some(error) => {
                tracing::debug!(%op, call, %error, "fault injector: failing a call");
                Err(error)
            }
            None => Ok(()),
        }
    }
}

impl<D: Device> Device for FaultInjector<D> {
    fn backend_name(&self) -> &'static str {
        self.inner.backend_name()
    }
    fn ordinal(&self) -> i32 {
        self.inner.ordinal()
    }
    fn granularity(&self) -> usize {
        // Counted only: the trait gives no way to fail it.
        let _ = self.check(Op::Granularity);
        self.inner.granularity()
    }
    fn reserve_va(&self, size: usize, alignment: usize) -> SysResult<DevicePtr> {
        self.check(Op::ReserveVa)?;
        self.inner.reserve_va(size, alignment)
    }
    fn free_va(&self, ptr: DevicePtr, size: usize) -> SysResult<()> {
        self.check(Op::FreeVa)?;
        self.inner.free_va(ptr, size)
    }
    fn create_physical(&self, size: usize, options: PhysicalOptions) -> SysResult<Physical> {
        self.check(Op::CreatePhysical)?;
        self.inner.create_physical(size, options)
    }
    fn release_physical(&self, handle: Physical) -> SysResult<()> {
        self.check(Op::ReleasePhysical)?;
        self.inner.release_physical(handle)
    }
    fn map(&self, ptr: DevicePtr, size: usize, handle: Physical, offset: usize) -> SysResult<()> {
        self.check(Op::Map)?;
        self.inner.map(ptr, size, handle, offset)
    }
    fn unmap(&self, ptr: DevicePtr, size: usize) -> SysResult<()> {
        self.check(Op::Unmap)?;
        self.inner.unmap(ptr, size)
    }
    fn set_access(&self, ptr: DevicePtr, size: usize, access: &[AccessDesc]) -> SysResult<()> {
        self.check(Op::SetAccess)?;
        self.inner.set_access(ptr, size, access)
    }
    fn export_fd(&self, handle: Physical) -> SysResult<OwnedFd> {
        self.check(Op::ExportHandle)?;
        self.inner.export_fd(handle)
    }
    fn import_fd(&self, fd: OwnedFd, size: usize) -> SysResult<Physical> {
        self.check(Op::ImportHandle)?;
        self.inner.import_fd(fd, size)
    }
    fn mem_info(&self) -> SysResult<MemInfo> {
        self.check(Op::MemInfo)?;
        self.inner.mem_info()
    }
    fn create_stream(&self) -> SysResult<Stream> {
        self.check(Op::CreateStream)?;
        self.inner.create_stream()
    }
    fn destroy_stream(&self, stream: Stream) -> SysResult<()> {
        self.check(Op::DestroyStream)?;
        self.inner.destroy_stream(stream)
    }
    fn default_stream(&self) -> Stream {
        self.inner.default_stream()
    }
    fn adopt_stream(&self, raw: usize) -> SysResult<Stream> {
        self.check(Op::AdoptStream)?;
        self.inner.adopt_stream(raw)
    }
    fn synchronize_stream(&self, stream: Stream) -> SysResult<()> {
        self.check(Op::SynchronizeStream)?;
        self.inner.synchronize_stream(stream)
    }
    fn synchronize_device(&self) -> SysResult<()> {
        self.check(Op::SynchronizeDevice)?;
        self.inner.synchronize_device()
    }
    fn query_stream(&self, stream: Stream) -> SysResult<bool> {
        self.check(Op::QueryStream)?;
        self.inner.query_stream(stream)
    }
    fn is_capturing(&self, stream: Stream) -> SysResult<bool> {
        self.check(Op::IsCapturing)?;
        self.inner.is_capturing(stream)
    }
    fn check_stream(&self, stream: Stream) -> SysResult<()> {
        self.check(Op::CheckStream)?;
        self.inner.check_stream(stream)
    }
    fn create_event(&self) -> SysResult<Event> {
        self.check(Op::CreateEvent)?;
        self.inner.create_event()
    }
    fn record_event(&self, event: Event, stream: Stream) -> SysResult<()> {
        self.check(Op::RecordEvent)?;
        self.inner.record_event(event, stream)
    }
    fn query_event(&self, event: Event) -> SysResult<bool> {
        self.check(Op::QueryEvent)?;
        self.inner.query_event(event)
    }
    fn synchronize_event(&self, event: Event) -> SysResult<()> {
        self.check(Op::SynchronizeEvent)?;
        self.inner.synchronize_event(event)
    }
    fn destroy_event(&self, event: Event) -> SysResult<()> {
        self.check(Op::DestroyEvent)?;
        self.inner.destroy_event(event)
    }
    fn wait_event(&self, stream: Stream, event: Event) -> SysResult<()> {
        self.check(Op::WaitEvent)?;
        self.inner.wait_event(stream, event)
    }
    fn launch_host(&self, stream: Stream, task: HostTask) -> SysResult<()> {
        self.check(Op::LaunchHost)?;
        self.inner.launch_host(stream, task)
    }

    // --- graph capture ---

    fn capture_status(&self, stream: Stream) -> SysResult<CaptureStatus> {
        self.check(Op::CaptureStatus)?;
        self.inner.capture_status(stream)
    }
    fn graph_alloc(&self, stream: Stream, size: usize) -> SysResult<DevicePtr> {
        self.check(Op::GraphAlloc)?;
        self.inner.graph_alloc(stream, size)
    }
    fn graph_free(&self, stream: Stream, ptr: DevicePtr) -> SysResult<()> {
        self.check(Op::GraphFree)?;
        self.inner.graph_free(stream, ptr)
    }
    fn begin_capture(&self, stream: Stream, mode: CaptureMode) -> SysResult<()> {
        self.check(Op::Graph)?;
        self.inner.begin_capture(stream, mode)
    }
    fn end_capture(&self, stream: Stream) -> SysResult<Graph> {
        self.check(Op::Graph)?;
        self.inner.end_capture(stream)
    }
    fn instantiate_graph(&self, graph: Graph, options: GraphOptions) -> SysResult<GraphExec> {
        self.check(Op::Graph)?;
        self.inner.instantiate_graph(graph, options)
    }
    fn launch_graph(&self, exec: GraphExec, stream: Stream) -> SysResult<()> {
        self.check(Op::Graph)?;
        self.inner.launch_graph(exec, stream)
    }
    fn destroy_graph(&self, graph: Graph) -> SysResult<()> {
        self.check(Op::Graph)?;
        self.inner.destroy_graph(graph)
    }
    fn destroy_graph_exec(&self, exec: GraphExec) -> SysResult<()> {
        self.check(Op::Graph)?;
        self.inner.destroy_graph_exec(exec)
    }

    // --- sharing: forwarded; failures through the ops they report ---

    fn device_count(&self) -> SysResult<i32> {
        self.check(Op::PeerAccess)?;
        self.inner.device_count()
    }

    fn can_access_peer(&self, peer: i32) -> SysResult<bool> {
        self.check(Op::PeerAccess)?;
        self.inner.can_access_peer(peer)
    }

    fn get_access(&self, ptr: DevicePtr, device: i32) -> SysResult<crate::Access> {
        self.check(Op::GetAccess)?;
        self.inner.get_access(ptr, device)
    }

    fn create_ipc_event(&self) -> SysResult<(crate::IpcEvent, crate::IpcEventHandle)> {
        self.check(Op::Ipc)?;
        self.inner.create_ipc_event()
    }

    fn open_ipc_event(&self, handle: crate::IpcEventHandle) -> SysResult<crate::IpcEvent> {
        self.check(Op::Ipc)?;
        self.inner.open_ipc_event(handle)
    }

    fn record_ipc_event(&self, event: crate::IpcEvent, stream: Stream) -> SysResult<()> {
        self.check(Op::RecordEvent)?;
        self.inner.record_ipc_event(event, stream)
    }

    fn query_ipc_event(&self, event: crate::IpcEvent) -> SysResult<bool> {
        self.check(Op::QueryEvent)?;
        self.inner.query_ipc_event(event)
    }

    fn synchronize_ipc_event(&self, event: crate::IpcEvent) -> SysResult<()> {
        self.check(Op::SynchronizeEvent)?;
        self.inner.synchronize_ipc_event(event)
    }

    fn wait_ipc_event(&self, stream: Stream, event: crate::IpcEvent) -> SysResult<()> {
        self.check(Op::WaitEvent)?;
        self.inner.wait_ipc_event(stream, event)
    }

    fn destroy_ipc_event(&self, event: crate::IpcEvent) -> SysResult<()> {
        self.check(Op::DestroyEvent)?;
        self.inner.destroy_ipc_event(event)
    }
}
