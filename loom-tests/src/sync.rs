//! loom's primitives under `cfg(loom)`, std's otherwise (as the pool's own
//! `sync` shim), so one scenario body serves both.

#[cfg(loom)]
pub use loom::sync::atomic::{AtomicBool, Ordering};
#[cfg(loom)]
pub use loom::sync::{Arc, Mutex, MutexGuard};
#[cfg(loom)]
pub use loom::thread;

#[cfg(not(loom))]
pub use std::sync::atomic::{AtomicBool, Ordering};
#[cfg(not(loom))]
pub use std::sync::{Arc, Mutex, MutexGuard};
#[cfg(not(loom))]
pub use std::thread;

/// Lock, ignoring poisoning (a panicking model has already failed).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
