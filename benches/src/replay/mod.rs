//! Replay of allocation traces through an allocator.
//!
//! - [`trace`]: parse `op,id,size,stream` CSV (plain or gzip) into memory;
//! - [`run`]: the [`ReplayAllocator`] abstraction and the timed replay loop;
//! - [`report`]: JSON lines and tables;
//! - [`plot`]: SVG timelines of live and reserved bytes;
//! - [`timed`]: a device wrapper that counts and times driver calls;
//! - [`lag`]: a device wrapper whose work completes a number of trace
//!   operations after it was issued.

pub mod allocators;
pub mod lag;
pub mod plot;
pub mod report;
pub mod run;
pub mod session;
pub mod tidepool_alloc;
pub mod timed;
pub mod trace;

pub use run::{
    AllocError, IdealAllocator, PassOptions, PassResult, ReplayAllocator, ReplayError, Replayer,
    Sample,
};
pub use trace::{Trace, TraceError, TraceOp};
