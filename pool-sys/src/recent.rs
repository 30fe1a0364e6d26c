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

/// Slots per thread. Each (backend instance, id) pair has one slot, picked
/// by its ids (consecutive ids of one instance never share a slot): a
/// lookup is one comparison, and a thread that cycles through up to this
/// many streams finds every one (a list searched in order and evicted
/// first-in first-out missed on every call once a thread cycled through
/// one stream more than it held, and cost more per stream it held).
const SLOTS: usize = 64;

type Slot = Option<(u64, u64, Weak<dyn Any + Send + Sync>)>;

thread_local! {
    static RECENT: RefCell<Vec<Slot>> = const { RefCell::new(Vec::new()) };
}

#[inline]
fn slot(owner: u64, id: u64) -> usize {
    (id ^ owner.wrapping_mul(7)) as usize % SLOTS
}

/// The object cached for (`owner`, `id`) on this thread, if still live.
pub(crate) fn get<T: Retirable>(owner: u64, id: u64) -> Option<Arc<T>> {
    RECENT
        .try_with(|r| {
            let r = r.try_borrow().ok()?;
            let (_, _, weak) = r
                .get(slot(owner, id))?
                .as_ref()
                .filter(|(o, i, _)| *o == owner && *i == id)?;
            let obj = weak.upgrade()?.downcast::<T>().ok()?;
            (!obj.retired()).then_some(obj)
        })
        .ok()
        .flatten()
}

/// Remember `obj` as (`owner`, `id`) on this thread (in its slot, in place
/// of whatever was there).
pub(crate) fn put<T: Retirable>(owner: u64, id: u64, obj: &Arc<T>) {
    let _ = RECENT.try_with(|r| {
        let Ok(mut r) = r.try_borrow_mut() else {
            return;
        };
        if r.is_empty() {
            r.resize_with(SLOTS, || None);
        }
        let any: Arc<dyn Any + Send + Sync> = obj.clone();
        r[slot(owner, id)] = Some((owner, id, Arc::downgrade(&any)));
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

#[cfg(test)]
mod tests {
    use super::*;

    struct Obj(u64);

    impl Retirable for Obj {
        fn retired(&self) -> bool {
            self.0 == u64::MAX
        }
    }

    /// A lookup finds only what was put under the same (owner, id), even
    /// in a shared slot; a later put in that slot replaces the earlier.
    #[test]
    fn a_slot_answers_only_for_its_own_ids() {
        let owner = new_owner();
        let other = new_owner();
        let a = Arc::new(Obj(1));
        put(owner, 5, &a);
        assert_eq!(get::<Obj>(owner, 5).map(|o| o.0), Some(1));
        assert!(get::<Obj>(other, 5).is_none(), "another instance's id");
        let shared = 5 + SLOTS as u64;
        assert_eq!(slot(owner, shared), slot(owner, 5));
        assert!(get::<Obj>(owner, shared).is_none(), "another id, same slot");
        let b = Arc::new(Obj(2));
        put(owner, shared, &b);
        assert_eq!(get::<Obj>(owner, shared).map(|o| o.0), Some(2));
        assert!(get::<Obj>(owner, 5).is_none(), "replaced");
        let retired = Arc::new(Obj(u64::MAX));
        put(owner, 7, &retired);
        assert!(get::<Obj>(owner, 7).is_none(), "retired");
        drop(b);
        assert!(get::<Obj>(owner, shared).is_none(), "dropped");
    }

    /// A thread that cycles through as many objects as there are slots
    /// (consecutive ids of one instance) finds every one every time.
    #[test]
    fn a_thread_cycling_through_many_streams_finds_each() {
        let owner = new_owner();
        let objs: Vec<_> = (0..SLOTS as u64).map(|i| Arc::new(Obj(i))).collect();
        for (i, o) in objs.iter().enumerate() {
            put(owner, 1000 + i as u64, o);
        }
        for _ in 0..3 {
            for i in 0..SLOTS as u64 {
                assert_eq!(get::<Obj>(owner, 1000 + i).map(|o| o.0), Some(i));
            }
        }
    }
}
