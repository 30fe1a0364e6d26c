//! Argument checks both backends make the same way, with the same errors.

use crate::error::{Op, SysError, SysResult};
use std::collections::HashMap;
use std::sync::{Arc, RwLock};

/// An invalid-argument error of `op`.
pub(crate) fn invalid(op: Op, reason: impl Into<String>) -> SysError {
    SysError::InvalidArgument {
        op,
        reason: reason.into(),
    }
}

/// `value` (a size, address or offset named `what`) is a multiple of
/// `granularity`.
pub(crate) fn check_granular(op: Op, what: &str, value: u64, granularity: usize) -> SysResult<()> {
    if value % granularity as u64 != 0 {
        return Err(invalid(
            op,
            format!("{what} {value:#x} is not a multiple of the granularity {granularity:#x}"),
        ));
    }
    Ok(())
}

/// `size` is non-zero and a multiple of `granularity`.
pub(crate) fn check_size(op: Op, size: usize, granularity: usize) -> SysResult<()> {
    if size == 0 {
        return Err(invalid(op, "size is zero"));
    }
    check_granular(op, "size", size as u64, granularity)
}

/// A map covers one whole physical handle: offset 0 and the handle's full
/// size. The driver refuses anything else with "not supported" (checked on
/// an H200: a part of a handle, or a non-zero offset, cannot be mapped),
/// so the host backend refuses it too and a design that maps parts of
/// handles fails on the CPU as it would on the GPU. Called after the
/// bounds check (`offset + size` within the handle).
pub(crate) fn check_whole_handle(
    op: Op,
    offset: usize,
    size: usize,
    handle_size: usize,
) -> SysResult<()> {
    if offset != 0 || size != handle_size {
        return Err(SysError::Unsupported {
            op,
            reason: format!(
                "a physical handle maps only whole: offset 0 and its size {handle_size:#x}, \
                 not offset {offset:#x} and size {size:#x}"
            ),
        });
    }
    Ok(())
}

/// Bits of a stream id that count streams within one device instance; the
/// bits above name the instance, so that a stream of another instance is
/// told apart from a destroyed one.
const STREAM_LOCAL_BITS: u32 = 40;

/// The id of the `local`-th stream of device instance `owner` (owners
/// count from 1, so no stream id of a device is ever below 2^40).
pub(crate) fn stream_id(owner: u64, local: u64) -> u64 {
    debug_assert!(local < 1 << STREAM_LOCAL_BITS);
    (owner << STREAM_LOCAL_BITS) | (local & ((1 << STREAM_LOCAL_BITS) - 1))
}

/// The error for stream `id`, which the table of instance `owner` lacks:
/// another instance's stream, or one destroyed (or never issued).
pub(crate) fn missing_stream(op: Op, owner: u64, id: u64) -> SysError {
    let issuer = id >> STREAM_LOCAL_BITS;
    if issuer != owner && crate::recent::is_issued_owner(issuer) {
        SysError::ForeignHandle {
            op,
            what: "stream",
            id,
        }
    } else {
        SysError::InvalidHandle {
            op,
            what: "stream",
            id,
        }
    }
}

/// The object `id` of a handle table, or an invalid-handle error naming
/// `what`.
pub(crate) fn lookup<T>(
    table: &RwLock<HashMap<u64, Arc<T>>>,
    op: Op,
    what: &'static str,
    id: u64,
) -> SysResult<Arc<T>> {
    table
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(&id)
        .cloned()
        .ok_or(SysError::InvalidHandle { op, what, id })
}

/// Take the object `id` out of a handle table, or an invalid-handle error
/// naming `what`.
pub(crate) fn remove<T>(
    table: &RwLock<HashMap<u64, Arc<T>>>,
    op: Op,
    what: &'static str,
    id: u64,
) -> SysResult<Arc<T>> {
    table
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&id)
        .ok_or(SysError::InvalidHandle { op, what, id })
}
