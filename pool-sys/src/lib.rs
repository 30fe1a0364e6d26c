//! tidepool-sys: the device boundary of tidepool.
//!
//! The only crate of the workspace that talks to a driver or to the OS. One
//! trait, [`Device`], and its backends:
//! - [`cuda::CudaDevice`]: the CUDA driver's VMM API, streams and events,
//!   loaded at run time (nothing CUDA is needed to build);
//! - [`host::HostDevice`]: memfd-backed memory and worker-thread streams, as
//!   strict as the driver, used by tests and on machines without a GPU;
//! - [`FaultInjector`]: wraps any backend and fails a chosen call.

#![deny(missing_docs)]

pub mod cuda;
pub mod device;
pub mod error;
pub mod fault;
pub mod host;
pub mod ipc;
mod recent;
pub mod sync;
mod validate;

pub use device::{
    Access, AccessDesc, CaptureMode, CaptureStatus, Device, DevicePtr, Event, Graph, GraphExec,
    GraphOptions, HostTask, IpcEvent, IpcEventHandle, MemInfo, Physical, PhysicalOptions, Stream,
    StreamProbe,
};
pub use error::{Op, SysError, SysResult};
pub use fault::FaultInjector;
pub use host::{HostConfig, HostDevice};
