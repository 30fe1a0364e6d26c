//! # libtidepool: the C ABI of the tidepool pool
//!
//! A shared (`libtidepool.so`) and static (`libtidepool.a`) library with the
//! header `include/tidepool.h`, for C and C++ programs, and the entry points
//! PyTorch's pluggable-allocator interface calls (see [`torch`]).
//!
//! Conventions of every function:
//! - It returns a [`tidepool_status`]; `TIDEPOOL_OK` (0) is success. On any
//!   other status, [`tidepool_last_error`] gives a message for this thread
//!   that says what went wrong and what to do.
//! - A Rust panic never crosses the C boundary: each entry point catches it
//!   and returns `TIDEPOOL_ERROR_PANIC`.
//! - Results come back through out-pointers, which may not be NULL.
//!
//! Pools are opaque (`tidepool_pool *`). Streams are `tidepool_stream`
//! values: ids the pool never reuses, unlike driver stream handles. A raw
//! `cudaStream_t`/`CUstream` is turned into one by [`tidepool_stream_from_raw`]
//! (cached per pool), or used directly by the `*_raw` functions.

#![allow(non_camel_case_types)]
// The entry points are called from C, where Rust's `unsafe` marker means
// nothing; their pointer contracts are stated in their documentation (and
// so in the header), and each dereference carries a SAFETY comment.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

mod error;
mod pool;
mod streams;
pub mod torch;

pub use error::{tidepool_last_error, tidepool_status, tidepool_status_string};
pub use pool::*;
