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

/// The per-stream lock: one compare-and-swap to take, one store to
/// release (see [`tidepool_sys::sync::LeanMutex`]; its atomics and cell
/// are loom's under `cfg(loom)` too).
pub(crate) use tidepool_sys::sync::LeanMutex;

/// What [`lock`] takes: std's (or loom's) mutex and the lean lock.
pub(crate) trait Lock {
    type Guard<'a>
    where
        Self: 'a;
    fn take(&self) -> Self::Guard<'_>;
}

impl<T> Lock for Mutex<T> {
    type Guard<'a>
        = MutexGuard<'a, T>
    where
        T: 'a;
    /// Recovering the data if another thread panicked while holding it:
    /// the pool's invariants are restored before any code that can panic,
    /// and a poisoned pool that refuses all work helps nobody.
    fn take(&self) -> MutexGuard<'_, T> {
        match self.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        }
    }
}

impl<T> Lock for LeanMutex<T> {
    type Guard<'a>
        = tidepool_sys::sync::LeanGuard<'a, T>
    where
        T: 'a;
    #[inline]
    fn take(&self) -> Self::Guard<'_> {
        self.lock()
    }
}

/// Lock a mutex (a poisoned std mutex gives its data all the same).
#[inline]
pub(crate) fn lock<L: Lock>(m: &L) -> L::Guard<'_> {
    m.take()
}

/// A std `Weak` trait object of `arc`'s value, made by `coerce` (write it
/// `|a| a`: std's `Arc` unsizes), for process-wide tables that outlive any
/// one pool. `None` under loom: loom's `Arc` can neither unsize nor hand
/// out a std one, and loom models run one pool alone, outside those tables.
#[cfg(not(loom))]
pub(crate) fn std_weak<T, U: ?Sized>(
    arc: &Arc<T>,
    coerce: impl FnOnce(std::sync::Arc<T>) -> std::sync::Arc<U>,
) -> Option<std::sync::Weak<U>> {
    Some(std::sync::Arc::downgrade(&coerce(arc.clone())))
}

#[cfg(loom)]
pub(crate) fn std_weak<T, U: ?Sized>(
    _arc: &Arc<T>,
    _coerce: impl FnOnce(std::sync::Arc<T>) -> std::sync::Arc<U>,
) -> Option<std::sync::Weak<U>> {
    None
}

/// Run a unit test's body: once, or under `loom::model` (every
/// interleaving; loom's primitives work only inside a model).
#[cfg(all(test, not(loom)))]
pub(crate) fn model(f: fn()) {
    f()
}

#[cfg(all(test, loom))]
pub(crate) fn model(f: fn()) {
    loom::model(f)
}
