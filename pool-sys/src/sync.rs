//! [`LeanMutex`]: a lock that costs one atomic read-modify-write per
//! critical section, for short critical sections that are almost never
//! contended (the allocator's per-stream state: each stream is mostly used
//! by one thread).
//!
//! Taking it is one compare-and-swap; releasing it is one plain store
//! (std's mutex pays a second read-modify-write on release, to learn
//! whether to wake a sleeper, and reads the panic count twice for
//! poisoning). A thread that finds it taken spins briefly, then yields
//! its time slice until the lock is free: nothing sleeps on it, so a
//! release never has to wake anyone. Hence: hold it only for short,
//! non-blocking work. There is no poisoning: the guard's drop releases
//! the lock during a panic too, and the data is whatever the panicking
//! code left.
//!
//! Under `cfg(loom)` the flag and the cell are loom's, so loom models see
//! every interleaving of the lock and check that no two threads touch the
//! data at once.

#[cfg(loom)]
use loom::{
    cell::UnsafeCell,
    sync::atomic::{AtomicBool, Ordering},
};
#[cfg(not(loom))]
use std::{
    cell::UnsafeCell,
    sync::atomic::{AtomicBool, Ordering},
};

/// A mutual-exclusion lock taken with one compare-and-swap and released
/// with one store (see the module documentation for when it fits).
///
/// ```
/// use tidepool_sys::sync::LeanMutex;
///
/// let m = LeanMutex::new(vec![1]);
/// m.lock().push(2);
/// assert_eq!(*m.lock(), [1, 2]);
/// ```
pub struct LeanMutex<T> {
    locked: AtomicBool,
    data: UnsafeCell<T>,
}

// SAFETY: the lock hands the data to one thread at a time, so it may be
// sent and shared as a `std::sync::Mutex<T>` may.
unsafe impl<T: Send> Send for LeanMutex<T> {}
// SAFETY: as above: `&LeanMutex<T>` gives `&mut T` only under the lock.
unsafe impl<T: Send> Sync for LeanMutex<T> {}

impl<T: Default> Default for LeanMutex<T> {
    fn default() -> Self {
        LeanMutex::new(T::default())
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for LeanMutex<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeanMutex").finish_non_exhaustive()
    }
}

impl<T> LeanMutex<T> {
    /// A lock, free, over `value`.
    pub fn new(value: T) -> Self {
        LeanMutex {
            locked: AtomicBool::new(false),
            data: UnsafeCell::new(value),
        }
    }

    /// Take the lock: one compare-and-swap when it is free.
    #[inline]
    pub fn lock(&self) -> LeanGuard<'_, T> {
        if self
            .locked
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            self.lock_contended();
        }
        self.guard()
    }

    /// Take the lock if it is free now.
    #[inline]
    pub fn try_lock(&self) -> Option<LeanGuard<'_, T>> {
        self.locked
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| self.guard())
    }

    /// Wait for the lock: spin on a plain load (no write while it is
    /// taken), then yield the time slice between tries.
    #[cold]
    #[inline(never)]
    fn lock_contended(&self) {
        let mut spins = 0u32;
        loop {
            while self.locked.load(Ordering::Relaxed) {
                if spins < 100 {
                    spins += 1;
                    spin_pause();
                } else {
                    yield_now();
                }
            }
            if self
                .locked
                .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                return;
            }
        }
    }

    #[cfg(not(loom))]
    #[inline]
    fn guard(&self) -> LeanGuard<'_, T> {
        LeanGuard {
            lock: self,
            data: self.data.get(),
        }
    }

    #[cfg(loom)]
    fn guard(&self) -> LeanGuard<'_, T> {
        LeanGuard {
            lock: self,
            data: Some(self.data.get_mut()),
        }
    }
}

#[cfg(not(loom))]
#[inline]
fn spin_pause() {
    std::hint::spin_loop();
}

#[cfg(not(loom))]
fn yield_now() {
    std::thread::yield_now();
}

#[cfg(loom)]
fn spin_pause() {
    loom::thread::yield_now();
}

#[cfg(loom)]
fn yield_now() {
    loom::thread::yield_now();
}

/// The lock of a [`LeanMutex`], held until dropped (one store).
pub struct LeanGuard<'a, T> {
    lock: &'a LeanMutex<T>,
    #[cfg(not(loom))]
    data: *mut T,
    /// Taken out (ending loom's record of the access) before the release.
    #[cfg(loom)]
    data: Option<loom::cell::MutPtr<T>>,
}

impl<T> std::ops::Deref for LeanGuard<'_, T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: the guard holds the lock, so no other thread has access
        // to the data; the cell lives as long as the lock it borrows.
        #[cfg(not(loom))]
        unsafe {
            &*self.data
        }
        // SAFETY: as above (loom checks the claim while this runs).
        #[cfg(loom)]
        unsafe {
            self.data.as_ref().expect("held until drop").deref()
        }
    }
}

impl<T> std::ops::DerefMut for LeanGuard<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as for `deref`; `&mut self` makes this the only borrow
        // through the guard.
        #[cfg(not(loom))]
        unsafe {
            &mut *self.data
        }
        // SAFETY: as above.
        #[cfg(loom)]
        unsafe {
            self.data.as_ref().expect("held until drop").deref()
        }
    }
}

impl<T> Drop for LeanGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        #[cfg(loom)]
        drop(self.data.take());
        self.lock.locked.store(false, Ordering::Release);
    }
}
