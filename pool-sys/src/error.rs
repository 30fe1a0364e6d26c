//! The one error type of the device boundary: every failure names the
//! operation that failed and what the driver or the OS said.

use std::fmt;

/// The operation of the device trait that failed. Fault injection targets
/// operations by this name too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Op {
    /// Loading the driver and opening the device.
    Init,
    /// Asking for the mapping granularity.
    Granularity,
    /// [`Device::reserve_va`](crate::Device::reserve_va).
    ReserveVa,
    /// [`Device::free_va`](crate::Device::free_va).
    FreeVa,
    /// [`Device::create_physical`](crate::Device::create_physical).
    CreatePhysical,
    /// [`Device::release_physical`](crate::Device::release_physical).
    ReleasePhysical,
    /// [`Device::map`](crate::Device::map).
    Map,
    /// [`Device::unmap`](crate::Device::unmap).
    Unmap,
    /// [`Device::set_access`](crate::Device::set_access).
    SetAccess,
    /// [`Device::export_fd`](crate::Device::export_fd).
    ExportHandle,
    /// [`Device::import_fd`](crate::Device::import_fd).
    ImportHandle,
    /// [`Device::mem_info`](crate::Device::mem_info).
    MemInfo,
    /// [`Device::create_stream`](crate::Device::create_stream).
    CreateStream,
    /// [`Device::destroy_stream`](crate::Device::destroy_stream).
    DestroyStream,
    /// [`Device::adopt_stream`](crate::Device::adopt_stream).
    AdoptStream,
    /// [`Device::synchronize_stream`](crate::Device::synchronize_stream).
    SynchronizeStream,
    /// [`Device::synchronize_device`](crate::Device::synchronize_device).
    SynchronizeDevice,
    /// [`Device::query_stream`](crate::Device::query_stream).
    QueryStream,
    /// [`Device::is_capturing`](crate::Device::is_capturing).
    IsCapturing,
    /// [`Device::check_stream`](crate::Device::check_stream).
    CheckStream,
    /// [`Device::create_event`](crate::Device::create_event) (and interprocess events).
    CreateEvent,
    /// [`Device::record_event`](crate::Device::record_event).
    RecordEvent,
    /// [`Device::query_event`](crate::Device::query_event).
    QueryEvent,
    /// [`Device::synchronize_event`](crate::Device::synchronize_event).
    SynchronizeEvent,
    /// [`Device::destroy_event`](crate::Device::destroy_event).
    DestroyEvent,
    /// [`Device::wait_event`](crate::Device::wait_event).
    WaitEvent,
    /// [`Device::launch_host`](crate::Device::launch_host).
    LaunchHost,
    /// [`Device::get_access`](crate::Device::get_access).
    GetAccess,
    /// [`Device::device_count`](crate::Device::device_count) and
    /// [`Device::can_access_peer`](crate::Device::can_access_peer).
    PeerAccess,
    /// Interprocess events ([`Device::create_ipc_event`](crate::Device::create_ipc_event)
    /// and the calls on them) and the messages of [`crate::ipc`].
    Ipc,
    /// [`Device::capture_status`](crate::Device::capture_status).
    CaptureStatus,
    /// [`Device::graph_alloc`](crate::Device::graph_alloc).
    GraphAlloc,
    /// [`Device::graph_free`](crate::Device::graph_free).
    GraphFree,
    /// Capture control: [`Device::begin_capture`](crate::Device::begin_capture),
    /// [`Device::end_capture`](crate::Device::end_capture),
    /// [`Device::instantiate_graph`](crate::Device::instantiate_graph),
    /// [`Device::launch_graph`](crate::Device::launch_graph) and the destroys.
    Graph,
}

impl Op {
    /// Every operation, for tests and fault-injection sweeps.
    pub const ALL: &'static [Op] = &[
        Op::Init,
        Op::Granularity,
        Op::ReserveVa,
        Op::FreeVa,
        Op::CreatePhysical,
        Op::ReleasePhysical,
        Op::Map,
        Op::Unmap,
        Op::SetAccess,
        Op::ExportHandle,
        Op::ImportHandle,
        Op::MemInfo,
        Op::CreateStream,
        Op::DestroyStream,
        Op::AdoptStream,
        Op::SynchronizeStream,
        Op::SynchronizeDevice,
        Op::QueryStream,
        Op::IsCapturing,
        Op::CheckStream,
        Op::CreateEvent,
        Op::RecordEvent,
        Op::QueryEvent,
        Op::SynchronizeEvent,
        Op::DestroyEvent,
        Op::WaitEvent,
        Op::LaunchHost,
        Op::GetAccess,
        Op::PeerAccess,
        Op::Ipc,
        Op::CaptureStatus,
        Op::GraphAlloc,
        Op::GraphFree,
        Op::Graph,
    ];

    /// A short, stable name ("map", "create_physical", ...).
    pub fn name(self) -> &'static str {
        match self {
            Op::Init => "init",
            Op::Granularity => "granularity",
            Op::ReserveVa => "reserve_va",
            Op::FreeVa => "free_va",
            Op::CreatePhysical => "create_physical",
            Op::ReleasePhysical => "release_physical",
            Op::Map => "map",
            Op::Unmap => "unmap",
            Op::SetAccess => "set_access",
            Op::ExportHandle => "export_handle",
            Op::ImportHandle => "import_handle",
            Op::MemInfo => "mem_info",
            Op::CreateStream => "create_stream",
            Op::DestroyStream => "destroy_stream",
            Op::AdoptStream => "adopt_stream",
            Op::SynchronizeStream => "synchronize_stream",
            Op::SynchronizeDevice => "synchronize_device",
            Op::QueryStream => "query_stream",
            Op::IsCapturing => "is_capturing",
            Op::CheckStream => "check_stream",
            Op::CreateEvent => "create_event",
            Op::RecordEvent => "record_event",
            Op::QueryEvent => "query_event",
            Op::SynchronizeEvent => "synchronize_event",
            Op::DestroyEvent => "destroy_event",
            Op::WaitEvent => "wait_event",
            Op::LaunchHost => "launch_host",
            Op::GetAccess => "get_access",
            Op::PeerAccess => "peer_access",
            Op::Ipc => "ipc",
            Op::CaptureStatus => "capture_status",
            Op::GraphAlloc => "graph_alloc",
            Op::GraphFree => "graph_free",
            Op::Graph => "graph",
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A failed call at the device boundary.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SysError {
    /// The CUDA driver library could not be loaded (no GPU driver on this
    /// machine); the host backend works without it.
    DriverUnavailable {
        /// What the loader said.
        reason: String,
    },
    /// The CUDA driver returned an error code.
    Driver {
        /// The failed operation.
        op: Op,
        /// The `CUresult` code.
        code: u32,
        /// The code's name (`CUDA_ERROR_...`).
        name: String,
    },
    /// An operating-system call failed.
    Os {
        /// The failed operation.
        op: Op,
        /// The `errno` value.
        errno: i32,
        /// The OS's description of it.
        message: String,
    },
    /// Not enough device (or host-backend capacity) memory.
    OutOfMemory {
        /// The failed operation.
        op: Op,
        /// Bytes asked for.
        requested: usize,
        /// Bytes the device (or host-backend capacity) had left.
        available: usize,
    },
    /// The arguments break a rule of the API (alignment, range, size).
    InvalidArgument {
        /// The failed operation.
        op: Op,
        /// Which rule the arguments break.
        reason: String,
    },
    /// A handle that was never created, or was already destroyed/released.
    InvalidHandle {
        /// The failed operation.
        op: Op,
        /// The kind of handle ("stream", "event", ...).
        what: &'static str,
        /// The handle's id.
        id: u64,
    },
    /// A handle issued by another device instance (another `HostDevice`
    /// or `CudaDevice` object): it names nothing on this one.
    ForeignHandle {
        /// The failed operation.
        op: Op,
        /// The kind of handle ("stream", "event", ...).
        what: &'static str,
        /// The handle's id.
        id: u64,
    },
    /// The backend cannot do this at all.
    Unsupported {
        /// The operation the backend cannot do.
        op: Op,
        /// Why, and what to use instead.
        reason: String,
    },
    /// The call is not permitted while a stream is being captured into a
    /// graph (the driver refuses it too): it would wait for, or ask about,
    /// work that does not run until the graph is launched.
    CaptureViolation {
        /// The refused operation.
        op: Op,
        /// Which capture rule it breaks.
        reason: String,
    },
    /// A failure made on purpose by [`crate::FaultInjector`].
    Injected {
        /// The operation made to fail.
        op: Op,
        /// Which call of that operation failed, counted from 1 since the
        /// injector was made.
        call: u64,
    },
}

impl SysError {
    /// The operation that failed, where there is one.
    pub fn op(&self) -> Option<Op> {
        match self {
            SysError::DriverUnavailable { .. } => None,
            SysError::Driver { op, .. }
            | SysError::Os { op, .. }
            | SysError::OutOfMemory { op, .. }
            | SysError::InvalidArgument { op, .. }
            | SysError::InvalidHandle { op, .. }
            | SysError::ForeignHandle { op, .. }
            | SysError::Unsupported { op, .. }
            | SysError::CaptureViolation { op, .. }
            | SysError::Injected { op, .. } => Some(*op),
        }
    }

    /// True when the failure means "no memory left" (the pool may then try
    /// releasing cached memory and growing again).
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, SysError::OutOfMemory { .. })
    }
}

impl fmt::Display for SysError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SysError::DriverUnavailable { reason } => {
                write!(f, "the CUDA driver could not be loaded: {reason}")
            }
            SysError::Driver { op, code, name } => {
                write!(f, "{op}: CUDA driver error {name} ({code})")
            }
            SysError::Os { op, errno, message } => {
                write!(f, "{op}: OS error {errno}: {message}")
            }
            SysError::OutOfMemory {
                op,
                requested,
                available,
            } => write!(
                f,
                "{op}: out of memory: {requested} bytes requested, {available} bytes available"
            ),
            SysError::InvalidArgument { op, reason } => {
                write!(f, "{op}: invalid argument: {reason}")
            }
            SysError::InvalidHandle { op, what, id } => {
                write!(
                    f,
                    "{op}: {what} {id} does not exist (never created, or already destroyed)"
                )
            }
            SysError::ForeignHandle { op, what, id } => write!(
                f,
                "{op}: {what} {id} belongs to another device instance; use the {what}s of the device this call was made on"
            ),
            SysError::Unsupported { op, reason } => write!(f, "{op}: not supported: {reason}"),
            SysError::CaptureViolation { op, reason } => write!(
                f,
                "{op}: not permitted during stream capture: {reason}; end the capture first, \
                 or issue the call from outside it"
            ),
            SysError::Injected { op, call } => {
                write!(f, "{op}: failure injected on call {call}")
            }
        }
    }
}

impl std::error::Error for SysError {}

/// Result of a device-boundary call.
pub type SysResult<T> = Result<T, SysError>;
