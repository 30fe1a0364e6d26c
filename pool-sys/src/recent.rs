//! A per-thread cache of recently resolved stream objects, shared by the
//! backends. Both keep their streams in a table behind a lock that every
//! thread would otherwise touch on the hot path (`is_capturing` runs on
//! every allocation and free); this cache resolves a (backend instance,
//! stream id) pair with no shared write. It holds `Weak` references, so it
//! never keeps a destroyed stream alive, and a backend marks an object
//! [`Retirable::retired`] before forgetting it, so a stream that another
//! thread still holds is not resolved either.

use std::any::Any;
use std::cell::RefCell;
use std::sync::{Arc, Weak};

/// An object the cache may hand out until it is retired.
pub(crate) trait Retirable: Any + Send + Sync {
    fn retired(&self) -> bool;
}

const SLOTS: usize = 8;

type Slot = (u64, u64, Weak<dyn Any + Send + Sync>);

thread_local! {
    static RECENT: RefCell<Vec<Slot>> = const { RefCell::new(Vec::new()) };
}

/// The object cached for (`owner`, `id`) on this thread, if still live.
pub(crate) fn get<T: Retirable>(owner: u64, id: u64) -> Option<Arc<T>> {
    RECENT
        .try_with(|r| {
            let r = r.try_borrow().ok()?;
            let (_, _, weak) = r.iter().find(|(o, i, _)| *o == owner && *i == id)?;
            let obj = weak.upgrade()?.downcast::<T>().ok()?;
            (!obj.retired()).then_some(obj)
        })
        .ok()
        .flatten()
}

/// Remember `obj` as (`owner`, `id`) on this thread.
pub(crate) fn put<T: Retirable>(owner: u64, id: u64, obj: &Arc<T>) {
    let _ = RECENT.try_with(|r| {
        let Ok(mut r) = r.try_borrow_mut() else {
            return;
        };
        r.retain(|(_, _, w)| w.strong_count() > 0);
        if r.len() >= SLOTS {
            r.remove(0);
        }
        let any: Arc<dyn Any + Send + Sync> = obj.clone();
        r.push((owner, id, Arc::downgrade(&any)));
    });
}

/// A process-unique owner id for a backend instance (stream ids are only
/// unique per instance in the CUDA backend).
pub(crate) fn new_owner() -> u64 {
    NEXT_OWNER.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Whether `owner` was issued by [`new_owner`].
pub(crate) fn is_issued_owner(owner: u64) -> bool {
    owner != 0 && owner < NEXT_OWNER.load(std::sync::atomic::Ordering::Relaxed)
}

static NEXT_OWNER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
