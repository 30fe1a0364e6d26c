//! The one place the pool gets its concurrency primitives from.
//!
//! Under `cfg(loom)` these are loom's model-checked versions, so the loom
//! models in `tidepool-loom-tests` explore every interleaving of the real pool
//! code; otherwise they are std's. Nothing concurrent in this crate may
//! bypass this module: thread-locals too come from here
//! ([`thread_local`](crate::sync::thread_local)), so the fast path that runs on a thread's
//! own cache of stream entries is the same code under loom.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
#[cfg(loom)]
pub(crate) use loom::sync::{Arc, Mutex, MutexGuard, RwLock};
#[cfg(loom)]
pub(crate) use loom::thread_local;

#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::{Arc, Mutex, MutexGuard, RwLock};
#[cfg(not(loom))]
pub(crate) use std::thread_local;

/// The per-stream lock: one compare-and-swap to take, one store to
/// release (see [`tidepool_sys::sync::LeanMutex`]; its atomics and cell
/// are loom's under `cfg(loom)` too).
pub(crate) use tidepool_sys::sync::LeanMutex;

/// A fixed table of slots, each set at most once and read with no lock
/// and no write (std: a [`std::sync::OnceLock`] per slot, one acquire load
/// to read). Under `cfg(loom)` each slot is loom's mutex over an
/// `Option` (a read clones the value out, so no slot lock is held while
/// the caller uses it) and there are only
/// [`OnceSlots::LEN`] = 4 of them, so that
/// models with a handful of streams meet both a slot and a collision.
pub(crate) struct OnceSlots<T> {
    #[cfg(not(loom))]
    slots: [std::sync::OnceLock<T>; 256],
    #[cfg(loom)]
    slots: Vec<Mutex<Option<T>>>,
}

impl<T: Clone> OnceSlots<T> {
    #[cfg(not(loom))]
    pub const LEN: usize = 256;
    #[cfg(loom)]
    pub const LEN: usize = 4;

    #[cfg(not(loom))]
    pub fn new() -> Self {
        OnceSlots {
            slots: std::array::from_fn(|_| std::sync::OnceLock::new()),
        }
    }

    #[cfg(loom)]
    pub fn new() -> Self {
        OnceSlots {
            slots: (0..Self::LEN).map(|_| Mutex::new(None)).collect(),
        }
    }

    /// The value of slot `key % LEN`, if it is set (std: a reference;
    /// loom: a clone, read under the slot's lock). Either way
    /// [`slot_ref`] gives an `Option<&T>`.
    #[cfg(not(loom))]
    #[inline(always)]
    pub fn get(&self, key: u64) -> Option<SlotRef<'_, T>> {
        self.slots[key as usize % Self::LEN].get()
    }

    #[cfg(loom)]
    pub fn get(&self, key: u64) -> Option<SlotRef<'_, T>> {
        let v = lock(&self.slots[key as usize % Self::LEN]).clone();
        v.map(|v| Owned(v, std::marker::PhantomData))
    }

    /// Set slot `key % LEN` to `value` unless it is set already.
    #[cfg(not(loom))]
    pub fn set(&self, key: u64, value: T) {
        let _ = self.slots[key as usize % Self::LEN].set(value);
    }

    #[cfg(loom)]
    pub fn set(&self, key: u64, value: T) {
        lock(&self.slots[key as usize % Self::LEN]).get_or_insert(value);
    }
}

/// A slot's value as [`OnceSlots::get`] gives it: a reference (std), a
/// clone (loom); [`slot_ref`] gives an `Option<&T>` of either.
#[cfg(not(loom))]
pub(crate) type SlotRef<'a, T> = &'a T;
#[cfg(loom)]
pub(crate) type SlotRef<'a, T> = Owned<'a, T>;

/// What [`OnceSlots::get`] gave, as an `Option<&T>`.
#[cfg(not(loom))]
#[inline(always)]
pub(crate) fn slot_ref<'a, T>(r: &Option<&'a T>) -> Option<&'a T> {
    *r
}

#[cfg(loom)]
pub(crate) fn slot_ref<'a, T>(r: &'a Option<Owned<'_, T>>) -> Option<&'a T> {
    r.as_deref()
}

/// A slot's value read under loom (see [`OnceSlots::get`]).
#[cfg(loom)]
pub(crate) struct Owned<'a, T>(T, std::marker::PhantomData<&'a ()>);

#[cfg(loom)]
impl<T> std::ops::Deref for Owned<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

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
