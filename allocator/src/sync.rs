//! The one place the pool gets its concurrency primitives from.
//!
//! Under `cfg(loom)` these are loom's model-checked versions, so the loom
//! models in `tidepool-loom-tests` explore every interleaving of the real pool
//! code; otherwise they are std's. Nothing concurrent in this crate may
//! bypass this module: thread-locals too come from here
//! ([`thread_local`](crate::sync::thread_local)), so the fast path that runs on a thread's
//! own cache of stream entries is the same code under loom.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU64, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::{Arc, Mutex, MutexGuard, RwLock};
#[cfg(loom)]
pub(crate) use loom::thread_local;

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::{Arc, Mutex, MutexGuard, RwLock};
#[cfg(not(loom))]
pub(crate) use std::thread_local;

/// Lock a mutex, recovering the data if another thread panicked while
/// holding it: the pool's invariants are restored before any code that can
/// panic, and a poisoned pool that refuses all work helps nobody.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}
