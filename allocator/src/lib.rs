//! # tidepool
//!
//! A stream-ordered GPU memory pool — what `cudaMallocAsync`,
//! `cudaFreeAsync` and `cudaMemPool_t` do inside the CUDA driver — built on
//! the driver's virtual memory management API, generic over the device
//! boundary of [`tidepool_sys`] (CUDA, or the host stand-in for tests).
//!
//! ## The contract
//! - [`MemPool::alloc_async`] returns at once with memory that work ordered
//!   after it on the stream may use; out-of-memory is reported by the call.
//! - [`MemPool::free_async`] returns at once; the memory is handed out again
//!   only to work that cannot overlap with work ordered before the free.
//! - Reuse: same stream at once; across streams when the allocating stream
//!   waited (through [`MemPool::wait_event`]) on an event recorded after the
//!   free, transitively; opportunistically once the free is observed
//!   complete; or by making the allocating stream wait (internal
//!   dependency). Each is a switch in [`ReusePolicy`].
//! - The pool sees only dependencies made through its own calls: a raw
//!   `cuStreamWaitEvent` is invisible to it (opportunistic reuse and internal
//!   dependencies keep reuse safe regardless). A use on another stream than
//!   the allocation's must be declared with [`MemPool::record_use`].
//! - When no free range fits, completed free pages are remapped into a
//!   contiguous virtual range before the pool grows (defragmentation).
//!
//! ## Streams
//! The pool takes the backend's [`Stream`] ids, which are never reused, so a
//! destroyed stream's state is never confused with a new stream the driver
//! gives the same handle. A raw `CUstream` from cudarc or C is registered
//! with the device's `adopt_stream` and retired with
//! [`MemPool::retire_stream`] then the device's `destroy_stream`. The legacy
//! NULL stream (`default_stream`) is an ordinary stream to the pool (the
//! pool assumes none of its implicit synchronisation). The per-thread
//! default stream is a different stream on every thread: adopt it once per
//! thread and use each id only on its own thread. An allocation on a stream
//! that is being captured into a CUDA graph is graph memory (an allocation
//! node of the graph, freed by a free node or after the launches); what the
//! pool cannot make safe during a capture is a typed error that says what
//! to do (`docs/capture.md` has the rules). The pool never records or
//! queries an event on a capturing stream.
//!
//! ```
//! use std::sync::Arc;
//! use tidepool::{MemPool, PoolConfig};
//! use tidepool_sys::{Device, host::{HostConfig, HostDevice}};
//!
//! let device = Arc::new(HostDevice::with_config(HostConfig { capacity: 64 << 20, ..Default::default() }));
//! let pool = MemPool::new(device.clone(), PoolConfig::default().with_va_size(1 << 30))?;
//! let (a, b) = (device.create_stream()?, device.create_stream()?);
//! let page = 2 << 20;
//! let x = pool.alloc_async(page, a)?;
//! let addr = x.ptr();
//! pool.free_async(x, a)?;
//! // b waits on an event recorded on a after the free: the pool follows
//! // the dependency and hands b the same memory, without growing.
//! let ev = pool.record_event(a)?;
//! pool.wait_event(b, &ev)?;
//! let y = pool.alloc_async(page, b)?;
//! assert_eq!(y.ptr(), addr);
//! assert_eq!(pool.stats().growths, 1);
//! pool.free_async(y, b)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![deny(missing_docs)]

mod arena;
mod capture;
mod capture_api;
mod config;
#[cfg(all(feature = "cudarc", not(loom)))]
pub mod cudarc;
mod error;
mod inthash;
mod ordering;
mod ordmap;
mod pages;
mod placement;
mod policy;
mod pool;
mod raw;
mod registry;
pub mod share;
mod share_state;
mod stats;
pub(crate) mod sync;

pub use config::{PoolConfig, ReusePolicy};
pub use error::{OomReport, PoolError};
#[doc(hidden)]
pub use pool::StreamFootprint;
pub use pool::{default_pool, Allocation, FreeError, MemPool, PoolEvent, ALIGNMENT};
pub use share::{ExportedAllocation, ImportedAllocation};
pub use stats::PoolStats;
pub use tidepool_sys::{Access, Device, DevicePtr, Stream};
