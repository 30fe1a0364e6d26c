//! The device trait: everything the pool needs from a GPU driver (or from
//! the host stand-in), and nothing else.
//!
//! Handles are small `Copy` ids issued by the backend, never raw driver
//! pointers: the backend keeps the table from id to driver object, so a
//! destroyed handle is detected (an error, not a crash) and an id is never
//! issued twice, even when the driver reuses a destroyed stream's pointer.

use crate::error::{SysError, SysResult};
use std::os::fd::OwnedFd;
use std::sync::Arc;

/// A device virtual address.
pub type DevicePtr = u64;

macro_rules! handle {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub u64);
        impl $name {
            /// The raw id (unique for the backend's lifetime).
            pub fn id(self) -> u64 {
                self.0
            }
        }
        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "{}#{}", stringify!($name), self.0)
            }
        }
    };
}

handle!(
    /// A stream: work on it runs in issue order. Ids are never reused, and
    /// a backend counts its streams apart from its other handles: streams
    /// made one after another on one device get consecutive ids (a pool
    /// keeps the ids of streams it forgot as runs of them).
    Stream
);
handle!(
    /// An event: a point in a stream's work that can be queried or waited on.
    Event
);
handle!(
    /// A piece of physical memory (a VMM allocation handle / a memfd).
    Physical
);
handle!(
    /// An interprocess event: like [`Event`], but it can be handed to
    /// another process ([`Device::create_ipc_event`]) and opened there.
    IpcEvent
);

handle!(
    /// A graph made by [`Device::end_capture`]: the work captured on a
    /// stream, not yet runnable. Destroy it with [`Device::destroy_graph`].
    Graph
);
handle!(
    /// An executable graph made by [`Device::instantiate_graph`]: launched
    /// any number of times with [`Device::launch_graph`], destroyed with
    /// [`Device::destroy_graph_exec`].
    GraphExec
);

/// Whether a stream is being captured into a graph, and which capture.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CaptureStatus {
    /// Work on the stream runs.
    None,
    /// Work on the stream is recorded into a graph instead of run. `id`
    /// names this capture: a stream captured twice gets two ids, and
    /// streams joined into one capture share its id. Ids are unique for the
    /// backend's lifetime.
    Active {
        /// The capture's id (`cuStreamGetCaptureInfo`'s `id_out`).
        id: u64,
    },
    /// The stream was capturing and a refused call broke the capture; it
    /// must still be ended ([`Device::end_capture`] then fails) before the
    /// stream runs work again.
    Invalidated {
        /// The capture's id.
        id: u64,
    },
}

impl CaptureStatus {
    /// True for `Active` and `Invalidated`: work issued now is not run.
    pub fn is_capturing(self) -> bool {
        !matches!(self, CaptureStatus::None)
    }

    /// The capture's id, if the stream is capturing.
    pub fn id(self) -> Option<u64> {
        match self {
            CaptureStatus::None => None,
            CaptureStatus::Active { id } | CaptureStatus::Invalidated { id } => Some(id),
        }
    }
}

/// Which calls of other threads a capture refuses (`CUstreamCaptureMode`).
///
/// Calls that cannot be captured and may synchronise implicitly (device- or
/// context-wide synchronisation, legacy allocation calls) break a capture
/// when made concurrently with it: in `Global` mode from any thread that
/// has not switched itself to relaxed, in `ThreadLocal` mode only from the
/// capturing thread, in `Relaxed` mode never (the caller takes care).
/// Device-wide synchronisation waits for the capturing stream, so the
/// driver refuses it in `Global` and `ThreadLocal` mode from every thread
/// (measured on the H200), and that invalidates the capture.
/// Calls on the capturing stream itself (synchronise or query it, query or
/// synchronise an event recorded into the capture) are refused in every
/// mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum CaptureMode {
    /// Refuse unsafe calls from every thread (the driver's default).
    #[default]
    Global,
    /// Refuse unsafe calls from the thread that began the capture.
    ThreadLocal,
    /// Refuse nothing beyond the calls on the capture itself.
    Relaxed,
}

/// How an executable graph is made (`CUgraphInstantiate_flags`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct GraphOptions {
    /// Free, at the start of each launch, the graph allocations that the
    /// previous launch left unfreed (`CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH`).
    /// Without it, launching while such an allocation is still live fails.
    pub auto_free_on_launch: bool,
}

/// What another process needs to open an interprocess event: opaque bytes
/// (the CUDA backend's `CUipcEventHandle`) and, on the host backend, a file
/// descriptor of the shared counters. Send both, e.g. with
/// [`crate::ipc::send_message`].
#[derive(Debug)]
pub struct IpcEventHandle {
    /// The backend's opaque handle bytes.
    pub bytes: Vec<u8>,
    /// The host backend's shared-counter file (`None` on CUDA).
    pub fd: Option<OwnedFd>,
}

/// Free and total device memory, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemInfo {
    /// Bytes not yet taken by anyone on the device.
    pub free: usize,
    /// The device's memory size.
    pub total: usize,
}

/// What a device may do with a mapped range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Access {
    /// No access: touching the range faults.
    None,
    /// Loads only.
    Read,
    /// Loads and stores.
    ReadWrite,
}

/// One entry of a `set_access` call: which device gets which access.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AccessDesc {
    /// The ordinal of the device that gets the access.
    pub device: i32,
    /// The access it gets.
    pub access: Access,
}

/// How physical memory is created.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PhysicalOptions {
    /// Ask for the POSIX file-descriptor handle type, so the memory can be
    /// exported to another process later.
    pub exportable: bool,
}

/// A host function enqueued on a stream.
pub type HostTask = Box<dyn FnOnce() + Send + 'static>;

/// One stream of a device, held by an allocator for as long as it keeps
/// state for that stream ([`Device::stream_probe`]). Each call answers
/// what the device's call of the same name answers for that stream, with
/// no table lookup: the CUDA backend's `is_capturing` is one raw
/// `cuStreamIsCapturing` on the handle kept here, the host backend's one
/// atomic load; `check` is one atomic load on both. Once the stream is
/// destroyed both report [`SysError::InvalidHandle`]. Destroying a stream
/// while another thread is still issuing work on it is a race the caller
/// must not run (as with the driver itself): a call that overlaps the
/// destroy may still see the stream as live.
///
/// [`SysError::InvalidHandle`]: crate::SysError::InvalidHandle
pub trait StreamProbe: Send + Sync {
    /// [`Device::is_capturing`] for this stream.
    fn is_capturing(&self) -> SysResult<bool>;
    /// [`Device::check_stream`] for this stream: `Ok` until it is destroyed.
    fn check(&self) -> SysResult<()>;
    /// Whether the stream runs its work now, as a plain answer for a hot
    /// path: `true` when it is live and, with `check_capture`, not being
    /// captured; `false` when it is captured, destroyed, or the question
    /// failed (ask [`is_capturing`](Self::is_capturing) or
    /// [`check`](Self::check) which). One call, no error value to build
    /// or inspect.
    #[inline]
    fn runs(&self, check_capture: bool) -> bool {
        if check_capture {
            matches!(self.is_capturing(), Ok(false))
        } else {
            self.check().is_ok()
        }
    }
}

/// The device boundary. Implemented by the CUDA backend, the host backend
/// and the fault-injecting wrapper. All methods are thread-safe.
///
/// VMM rules every backend enforces: sizes and offsets are multiples of
/// [`Device::granularity`]; `unmap` covers exactly ranges that were mapped;
/// a fresh mapping has no access until `set_access`; map, unmap, set-access
/// and release act immediately, not in stream order.
///
/// The life of a piece of memory, on the host backend (the CUDA backend
/// behaves the same; `write_words`/`read_words` stand in for kernels):
///
/// ```
/// use tidepool_sys::{Access, AccessDesc, Device, HostDevice, PhysicalOptions};
///
/// let dev = HostDevice::new();
/// let g = dev.granularity();
/// let va = dev.reserve_va(2 * g, g)?;
/// let mem = dev.create_physical(g, PhysicalOptions::default())?;
/// // The same physical memory mapped twice: two addresses, one memory.
/// dev.map(va, g, mem, 0)?;
/// dev.map(va + g as u64, g, mem, 0)?;
/// // A fresh mapping has no access until set_access grants it.
/// assert!(dev.read_words(va, 1).is_err());
/// let rw = [AccessDesc { device: dev.ordinal(), access: Access::ReadWrite }];
/// dev.set_access(va, 2 * g, &rw)?;
/// dev.write_words(va, &[7])?;
/// assert_eq!(dev.read_words(va + g as u64, 1)?, vec![7]);
/// // Release drops the handle; the memory lives until the last unmap.
/// dev.release_physical(mem)?;
/// assert_eq!(dev.read_words(va, 1)?, vec![7]);
/// // Unmap exactly what one map call mapped: half a mapping is refused.
/// assert!(dev.unmap(va, g / 2).is_err());
/// dev.unmap(va, g)?;
/// dev.unmap(va + g as u64, g)?;
/// dev.free_va(va, 2 * g)?;
/// assert_eq!((dev.live_handles(), dev.live_mappings(), dev.live_reservations()), (0, 0, 0));
///
/// // Streams run work in order; an event orders work across streams.
/// let (a, b) = (dev.create_stream()?, dev.create_stream()?);
/// let (tx, rx) = std::sync::mpsc::channel();
/// let tx2 = tx.clone();
/// dev.launch_host(a, Box::new(move || tx.send("a").unwrap()))?;
/// let ev = dev.create_event()?;
/// dev.record_event(ev, a)?;
/// dev.wait_event(b, ev)?;
/// dev.launch_host(b, Box::new(move || tx2.send("b").unwrap()))?;
/// dev.synchronize_stream(b)?;
/// assert_eq!(rx.try_iter().collect::<Vec<_>>(), ["a", "b"]);
/// assert!(dev.query_event(ev)?);
/// dev.destroy_event(ev)?;
/// dev.destroy_stream(a)?;
/// dev.destroy_stream(b)?;
/// # Ok::<(), tidepool_sys::SysError>(())
/// ```
pub trait Device: Send + Sync + 'static {
    /// Short backend name ("cuda", "host").
    fn backend_name(&self) -> &'static str;
    /// The device ordinal this instance drives.
    fn ordinal(&self) -> i32;
    /// Minimum (= recommended) granularity of physical memory and mappings.
    fn granularity(&self) -> usize;

    // --- virtual address space ---
    /// Reserve `size` bytes of virtual address space (no memory behind it).
    fn reserve_va(&self, size: usize, alignment: usize) -> SysResult<DevicePtr>;
    /// Give a reservation back; it must hold no mappings.
    fn free_va(&self, ptr: DevicePtr, size: usize) -> SysResult<()>;

    // --- physical memory ---
    /// Create `size` bytes of physical memory; touches no pages.
    fn create_physical(&self, size: usize, options: PhysicalOptions) -> SysResult<Physical>;
    /// Release physical memory. The memory lives on while still mapped.
    fn release_physical(&self, handle: Physical) -> SysResult<()>;
    /// Map `size` bytes of `handle`, from `offset`, at `ptr` (inside a reservation).
    fn map(&self, ptr: DevicePtr, size: usize, handle: Physical, offset: usize) -> SysResult<()>;
    /// Unmap exactly a range that was mapped by one `map` call.
    fn unmap(&self, ptr: DevicePtr, size: usize) -> SysResult<()>;
    /// Set access for a mapped range, for each listed device.
    fn set_access(&self, ptr: DevicePtr, size: usize, access: &[AccessDesc]) -> SysResult<()>;
    /// Export physical memory (created exportable) as a POSIX file descriptor.
    fn export_fd(&self, handle: Physical) -> SysResult<OwnedFd>;
    /// Import physical memory exported by another process (or this one).
    fn import_fd(&self, fd: OwnedFd, size: usize) -> SysResult<Physical>;
    /// Free and total device memory.
    fn mem_info(&self) -> SysResult<MemInfo>;

    // --- streams ---
    /// Create a stream owned by this backend.
    fn create_stream(&self) -> SysResult<Stream>;
    /// Destroy a stream (or forget an adopted one). Work already queued on it
    /// still runs to completion.
    fn destroy_stream(&self, stream: Stream) -> SysResult<()>;
    /// The legacy default (NULL) stream. Always valid, never destroyed.
    fn default_stream(&self) -> Stream;
    /// Register a raw driver stream created by someone else (a `CUstream`
    /// from cudarc or a C caller). Each call issues a new id; the caller
    /// retires it with `destroy_stream`, which then does not destroy the
    /// driver stream.
    fn adopt_stream(&self, raw: usize) -> SysResult<Stream>;
    /// Block until all work queued on the stream is done.
    fn synchronize_stream(&self, stream: Stream) -> SysResult<()>;
    /// Block until all work queued on every stream of the device is done,
    /// including streams destroyed since (whose queued work still runs).
    /// The only way to wait for the work of a stream that is gone; it breaks
    /// a capture in progress on any stream, so callers check first.
    fn synchronize_device(&self) -> SysResult<()>;
    /// Whether all work queued on the stream is done.
    fn query_stream(&self, stream: Stream) -> SysResult<bool>;
    /// Whether the stream is being captured into a graph.
    fn is_capturing(&self, stream: Stream) -> SysResult<bool>;
    /// A handle on `stream` for the two questions an allocator asks on
    /// every allocation and free ([`StreamProbe`]), answered with no table
    /// lookup and no reference counting: the caller keeps the handle for
    /// the stream's life. `Ok(None)` (the default) when the backend has
    /// none; the caller then asks [`Device::is_capturing`] and
    /// [`Device::check_stream`]. A wrapper that watches or fails those two
    /// calls must keep the default (a probe would go around it); one that
    /// only forwards them forwards this too. An error for a stream that is
    /// not a live stream of this instance, as [`Device::check_stream`].
    fn stream_probe(&self, stream: Stream) -> SysResult<Option<Arc<dyn StreamProbe>>> {
        self.check_stream(stream).map(|()| None)
    }
    /// Check that `stream` names a live stream of this device instance:
    /// an error for a destroyed stream ([`SysError::InvalidHandle`]) and
    /// for a stream of another instance ([`SysError::ForeignHandle`]).
    /// Backends answer from their own tables, with no driver call; the
    /// default asks [`Device::query_stream`].
    ///
    /// [`SysError::InvalidHandle`]: crate::SysError::InvalidHandle
    /// [`SysError::ForeignHandle`]: crate::SysError::ForeignHandle
    fn check_stream(&self, stream: Stream) -> SysResult<()> {
        self.query_stream(stream).map(|_| ())
    }

    // --- events ---
    /// Create an event (never recorded yet) for ordering work across streams.
    fn create_event(&self) -> SysResult<Event>;
    /// Record the event at the current end of the stream's work.
    fn record_event(&self, event: Event, stream: Stream) -> SysResult<()>;
    /// Whether the work before the last record is done (true if never recorded).
    fn query_event(&self, event: Event) -> SysResult<bool>;
    /// Block until the work before the last record is done.
    fn synchronize_event(&self, event: Event) -> SysResult<()>;
    /// Destroy an event; its id names nothing afterwards.
    fn destroy_event(&self, event: Event) -> SysResult<()>;
    /// Make later work on `stream` wait for `event` (no-op if never recorded).
    fn wait_event(&self, stream: Stream, event: Event) -> SysResult<()>;

    /// Run `task` on the host once the stream's earlier work is done; later
    /// work on the stream waits for it.
    ///
    /// A one-shot task cannot be captured into a graph (a graph runs its
    /// work once per launch): on a capturing stream this is a
    /// [`SysError::CaptureViolation`].
    fn launch_host(&self, stream: Stream, task: HostTask) -> SysResult<()>;

    // --- graph capture ---
    //
    // No default bodies: a wrapper that forgot to forward these would
    // report "not capturing" for a capturing stream and break the user's
    // graph, so every implementation states its answer.

    /// The capture state of `stream`, with the capture's id
    /// (`cuStreamGetCaptureInfo`): one driver call, no lock on the CUDA
    /// backend, one atomic load on the host backend. Also sees captures
    /// begun by anyone else with the raw driver call.
    fn capture_status(&self, stream: Stream) -> SysResult<CaptureStatus>;

    /// Allocate `size` bytes in stream order from the driver's own pool
    /// (`cuMemAllocAsync`). On a capturing stream this records a graph
    /// memory *allocation node*: the address is fixed now and stays the
    /// same for every launch of the graph, but it is backed only for work
    /// ordered after the allocation node and before the matching free node
    /// of each launch. Outside a capture it is an ordinary stream-ordered
    /// allocation (valid for work after it on `stream`).
    ///
    /// A graph allocation that the graph does not free is live after each
    /// launch: free it with [`Device::graph_free`] (in stream order after
    /// its last use) before the next launch, or instantiate with
    /// [`GraphOptions::auto_free_on_launch`]; launching again while it is
    /// live fails, and destroying the graph does not free it.
    fn graph_alloc(&self, stream: Stream, size: usize) -> SysResult<DevicePtr>;

    /// Free, in stream order, memory from [`Device::graph_alloc`]
    /// (`cuMemFreeAsync`). On a capturing stream this records a graph
    /// memory *free node*: in each launch, work ordered after it may no
    /// longer touch the memory (the backing may be handed to other work of
    /// the graph or unmapped). Outside a capture it frees the memory once
    /// the stream's earlier work is done.
    fn graph_free(&self, stream: Stream, ptr: DevicePtr) -> SysResult<()>;

    /// Start capturing `stream` (`cuStreamBeginCapture`): work issued to it
    /// from now on is recorded into a graph, not run.
    fn begin_capture(&self, stream: Stream, mode: CaptureMode) -> SysResult<()>;

    /// Stop capturing `stream` (the stream the capture began on) and return
    /// the recorded graph (`cuStreamEndCapture`). Fails if the capture was
    /// invalidated; the stream is then out of capture all the same.
    fn end_capture(&self, stream: Stream) -> SysResult<Graph>;

    /// Make an executable graph (`cuGraphInstantiateWithFlags`). A graph
    /// with memory nodes may have one executable graph at a time.
    fn instantiate_graph(&self, graph: Graph, options: GraphOptions) -> SysResult<GraphExec>;

    /// Run the executable graph's work on `stream`, in stream order
    /// (`cuGraphLaunch`).
    fn launch_graph(&self, exec: GraphExec, stream: Stream) -> SysResult<()>;

    /// Destroy a graph (`cuGraphDestroy`). Executable graphs made from it
    /// stay usable.
    fn destroy_graph(&self, graph: Graph) -> SysResult<()>;

    /// Destroy an executable graph (`cuGraphExecDestroy`). Launches already
    /// issued still run. Graph allocations it left live stay live until
    /// freed with [`Device::graph_free`].
    fn destroy_graph_exec(&self, exec: GraphExec) -> SysResult<()>;

    // --- peers and interprocess sharing ---
    //
    // The default bodies describe one device with no peers and no
    // interprocess events, so a backend that shares nothing need not
    // implement them.

    /// Number of devices the backend can see (ordinals `0..count`).
    fn device_count(&self) -> SysResult<i32> {
        Ok(1)
    }
    /// Whether device `peer` can be given access to this device's memory
    /// (`cuDeviceCanAccessPeer`). True for this device itself; an ordinal
    /// that does not exist is [`SysError::InvalidArgument`].
    fn can_access_peer(&self, peer: i32) -> SysResult<bool> {
        if peer == self.ordinal() {
            return Ok(true);
        }
        Err(crate::validate::invalid(
            crate::error::Op::PeerAccess,
            format!(
                "device {peer} does not exist (this backend has only device {})",
                self.ordinal()
            ),
        ))
    }
    /// The access `device` has to the mapped address `ptr`, as the driver
    /// (or the backend's own table) reports it (`cuMemGetAccess`).
    fn get_access(&self, ptr: DevicePtr, device: i32) -> SysResult<Access> {
        let _ = (ptr, device);
        Err(SysError::Unsupported {
            op: crate::error::Op::GetAccess,
            reason: format!(
                "the {} backend cannot read access back",
                self.backend_name()
            ),
        })
    }
    /// Create an event that another process can open, and the handle to
    /// send it there.
    fn create_ipc_event(&self) -> SysResult<(IpcEvent, IpcEventHandle)> {
        Err(no_ipc_events(self.backend_name()))
    }
    /// Open an interprocess event created by another process.
    fn open_ipc_event(&self, handle: IpcEventHandle) -> SysResult<IpcEvent> {
        let _ = handle;
        Err(no_ipc_events(self.backend_name()))
    }
    /// Record an interprocess event at the current end of the stream's work.
    fn record_ipc_event(&self, event: IpcEvent, stream: Stream) -> SysResult<()> {
        let _ = (event, stream);
        Err(no_ipc_events(self.backend_name()))
    }
    /// Whether the work before the last record (in any process) is done.
    fn query_ipc_event(&self, event: IpcEvent) -> SysResult<bool> {
        let _ = event;
        Err(no_ipc_events(self.backend_name()))
    }
    /// Block the calling thread until the work before the last record is done.
    fn synchronize_ipc_event(&self, event: IpcEvent) -> SysResult<()> {
        let _ = event;
        Err(no_ipc_events(self.backend_name()))
    }
    /// Make later work on `stream` wait for the interprocess event's last
    /// record (a no-op if it was never recorded).
    fn wait_ipc_event(&self, stream: Stream, event: IpcEvent) -> SysResult<()> {
        let _ = (stream, event);
        Err(no_ipc_events(self.backend_name()))
    }
    /// Destroy (or close, in an importing process) an interprocess event.
    fn destroy_ipc_event(&self, event: IpcEvent) -> SysResult<()> {
        let _ = event;
        Err(no_ipc_events(self.backend_name()))
    }
}

fn no_ipc_events(backend: &str) -> SysError {
    SysError::Unsupported {
        op: crate::error::Op::Ipc,
        reason: format!("the {backend} backend has no interprocess events"),
    }
}
