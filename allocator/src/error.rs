//! The pool's error type: every variant says what went wrong in terms a
//! caller can act on.

use std::fmt;
use tidepool_sys::{DevicePtr, Stream, SysError};

/// What an out-of-memory failure looked like, so a user can tell "the device
/// is full" from "the pool is fragmented" from "the pool hit its own cap".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OomReport {
    /// Bytes asked for.
    pub requested: usize,
    /// Physical bytes the pool holds.
    pub reserved: u64,
    /// Bytes in live allocations.
    pub used: u64,
    /// Largest free range the pool could hand out without mapping.
    pub largest_free_range: u64,
    /// Free device memory as the driver reported it (`None` if it could not say).
    pub device_free: Option<u64>,
    /// The pool's hard maximum size, if one is set.
    pub max_size: Option<u64>,
    /// The device error that stopped growth, if growth was tried.
    pub cause: Option<SysError>,
}

/// Errors of the pool API.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PoolError {
    /// No memory could be found or created for the request.
    OutOfMemory(Box<OomReport>),
    /// A device call failed (not out-of-memory).
    Device(SysError),
    /// The stream is being captured into a CUDA graph, and the pool cannot
    /// serve this call there: the capture was already invalidated by an
    /// earlier refused call, or the call (the raw-pointer API) does not
    /// serve captures.
    StreamCapturing {
        /// The capturing stream.
        stream: Stream,
    },
    /// A block the pool handed out before a capture was freed inside it:
    /// the free would have to take effect at every launch of the graph,
    /// which the pool cannot see. Nothing changed; the capture stays valid.
    EagerFreeInCapture {
        /// The capturing stream.
        stream: Stream,
    },
    /// A block of the pool is used by captured work (declared with
    /// `record_use` on a capturing stream, or declared on a stream that is
    /// being captured now): every launch of the graph may touch it, so
    /// the pool cannot order its free. Free it with
    /// `MemPool::free_after_graph` once the graph's launches are ordered.
    CapturedUse {
        /// The capturing stream of the use.
        stream: Stream,
    },
    /// The call is for graph memory (allocated on a capturing stream) and
    /// this allocation is a block of the pool.
    NotGraphMemory {
        /// The allocation's address.
        ptr: DevicePtr,
    },
    /// The stream was retired from this pool.
    StreamRetired {
        /// The retired stream.
        stream: Stream,
    },
    /// The allocation belongs to another pool.
    WrongPool {
        /// The allocation's address.
        ptr: DevicePtr,
    },
    /// Raw-pointer API: this address was freed and has not been handed out since.
    DoubleFree {
        /// The address freed twice.
        ptr: DevicePtr,
    },
    /// Raw-pointer API: the address lies inside a live allocation but is not its start.
    InteriorPointer {
        /// The address passed in.
        ptr: DevicePtr,
        /// The start of the live allocation that contains it: free this one.
        base: DevicePtr,
    },
    /// Raw-pointer API: the pool never handed out this address.
    UnknownPointer {
        /// The address passed in.
        ptr: DevicePtr,
    },
    /// Raw-pointer API: the address belongs to another tidepool pool.
    ForeignPointer {
        /// The address passed in.
        ptr: DevicePtr,
        /// Id of the pool that owns it ([`crate::MemPool::id`]).
        owner_pool: u64,
    },
    /// The request is larger than the pool's address space could ever hold.
    TooLarge {
        /// Bytes asked for.
        requested: usize,
        /// The largest request the pool's address space allows.
        limit: usize,
    },
    /// A configuration value is unusable.
    InvalidConfig {
        /// Which value is wrong and what would be accepted.
        reason: String,
    },
    /// A device that does not exist, or cannot access the pool's device,
    /// was named for peer access.
    NoPeerAccess {
        /// The ordinal that was named.
        device: i32,
        /// Why access cannot be given.
        reason: String,
    },
    /// The access asked for cannot be set.
    InvalidAccess {
        /// The ordinal that was named.
        device: i32,
        /// Why this access cannot be set.
        reason: String,
    },
    /// Pages of the pool disagree on a device's access (a bug: report it).
    AccessMismatch {
        /// The device whose access disagrees.
        device: i32,
        /// The address of the page that disagrees.
        ptr: DevicePtr,
        /// The access the pool set.
        expected: tidepool_sys::Access,
        /// The access the page has.
        found: tidepool_sys::Access,
    },
    /// The allocation cannot be exported.
    NotExportable {
        /// Why (e.g. the pool was not made exportable).
        reason: String,
    },
    /// Free refused: another process still maps the exported allocation.
    ExportInUse {
        /// The exported allocation's address.
        ptr: DevicePtr,
        /// Imports still open in other processes.
        imports: u64,
    },
    /// Import refused: the exporter already freed the allocation.
    ExportClosed {
        /// Process id of the exporting process.
        exporter_pid: u32,
        /// Id of the exporting pool.
        pool: u64,
    },
    /// The export descriptor and file descriptors do not make one export.
    BadDescriptor {
        /// What does not fit.
        reason: String,
    },
    /// No live import of this pool starts at this address.
    NotImported {
        /// The address passed in.
        ptr: DevicePtr,
    },
}

impl PoolError {
    /// True for [`PoolError::OutOfMemory`].
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, PoolError::OutOfMemory(_))
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

impl fmt::Display for PoolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PoolError::OutOfMemory(r) => {
                write!(
                    f,
                    "out of memory: requested {} bytes ({:.1} MiB); pool reserved {:.1} MiB, used {:.1} MiB, largest free range {:.1} MiB",
                    r.requested,
                    mib(r.requested as u64),
                    mib(r.reserved),
                    mib(r.used),
                    mib(r.largest_free_range)
                )?;
                match r.device_free {
                    Some(free) => write!(f, ", device free {:.1} MiB", mib(free))?,
                    None => write!(f, ", device free unknown")?,
                }
                if let Some(max) = r.max_size {
                    write!(f, ", pool maximum {:.1} MiB", mib(max))?;
                }
                if let Some(cause) = &r.cause {
                    write!(f, " (growth failed: {cause})")?;
                }
                Ok(())
            }
            PoolError::Device(e) => write!(f, "device error: {e}"),
            PoolError::StreamCapturing { stream } => write!(
                f,
                "{stream} is being captured into a CUDA graph and this call cannot be served there: either the capture was invalidated by an earlier refused call (end it and capture again) or the raw-pointer API was used (it does not serve captures: allocate before the capture begins, or use alloc_async/free_async inside it)"
            ),
            PoolError::EagerFreeInCapture { stream } => write!(
                f,
                "{stream} is being captured into a CUDA graph and this block was allocated before the capture: a free inside the capture would have to happen at every launch; free it before begin_capture, or after end_capture once the graph's last launch is ordered before the free (allocate inside the capture for memory the graph frees itself)"
            ),
            PoolError::NotGraphMemory { ptr } => write!(
                f,
                "{ptr:#x} is a block of the pool, not graph memory; free it with free_async"
            ),
            PoolError::CapturedUse { stream } => write!(
                f,
                "work captured on {stream} uses this block, so every launch of that graph may touch it and the pool cannot see when launches end; after end_capture, free it with free_after_graph on a stream ordered after the graph's last launch"
            ),
            PoolError::StreamRetired { stream } => {
                write!(f, "{stream} was retired from this pool; register a live stream")
            }
            PoolError::WrongPool { ptr } => write!(
                f,
                "allocation {ptr:#x} belongs to another pool; free it through the pool that made it"
            ),
            PoolError::DoubleFree { ptr } => {
                write!(f, "double free: {ptr:#x} was already freed and not allocated since")
            }
            PoolError::InteriorPointer { ptr, base } => write!(
                f,
                "{ptr:#x} points inside the allocation at {base:#x}; free the pointer the pool returned"
            ),
            PoolError::UnknownPointer { ptr } => {
                write!(f, "{ptr:#x} was not allocated by this pool")
            }
            PoolError::ForeignPointer { ptr, owner_pool } => write!(
                f,
                "{ptr:#x} belongs to tidepool pool {owner_pool}, not this one"
            ),
            PoolError::TooLarge { requested, limit } => write!(
                f,
                "request of {requested} bytes exceeds the pool's address space of {limit} bytes"
            ),
            PoolError::InvalidConfig { reason } => write!(f, "invalid pool configuration: {reason}"),
            PoolError::NoPeerAccess { device, reason } => write!(
                f,
                "device {device} cannot be given access to this pool ({reason}); name only devices that exist and report peer capability"
            ),
            PoolError::InvalidAccess { device, reason } => {
                write!(f, "cannot set the access of device {device}: {reason}")
            }
            PoolError::AccessMismatch {
                device,
                ptr,
                expected,
                found,
            } => write!(
                f,
                "page at {ptr:#x} gives device {device} {found:?} access, the pool expects {expected:?}; this is a tidepool bug, please report it"
            ),
            PoolError::NotExportable { reason } => write!(
                f,
                "cannot export: {reason}; create the pool with PoolConfig::with_exportable(true) and export live allocations"
            ),
            PoolError::ExportInUse { ptr, imports } => write!(
                f,
                "allocation {ptr:#x} is still imported {imports} time(s) by other processes; they must release their imports before it is freed"
            ),
            PoolError::ExportClosed { exporter_pid, pool } => write!(
                f,
                "the exporter (process {exporter_pid}, pool {pool}) already freed this allocation; import before the exporter frees"
            ),
            PoolError::BadDescriptor { reason } => write!(
                f,
                "bad export descriptor: {reason}; pass the descriptor and file descriptors of one MemPool::export unchanged"
            ),
            PoolError::NotImported { ptr } => write!(
                f,
                "{ptr:#x} is not a live import of this pool (released already, or imported by another pool)"
            ),
        }
    }
}

impl std::error::Error for PoolError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            PoolError::Device(e) => Some(e),
            PoolError::OutOfMemory(r) => r.cause.as_ref().map(|e| e as _),
            _ => None,
        }
    }
}

impl From<SysError> for PoolError {
    fn from(e: SysError) -> Self {
        PoolError::Device(e)
    }
}
