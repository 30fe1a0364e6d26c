//! The pool's sharing state, below the pool: the access list every new
//! mapping gets, the leases of exported allocations, and the records of
//! imports mapped into this pool's device. The pool holds it and consults
//! it on every free and every bind; the public sharing calls (`share`) are
//! built on it.

use crate::error::PoolError;
use crate::sync::{lock, Arc, AtomicU64, Mutex};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use tidepool_sys::ipc::SharedWords;
use tidepool_sys::{Access, AccessDesc, Device, DevicePtr, Physical};

/// Bit of a lease's word 0 set once the exporter has freed the allocation.
pub(crate) const CLOSED: u64 = 1 << 63;
/// Bit of a lease's word 0 set while the exporter's free decides whether
/// every lease of the allocation can be closed: an import waits for the
/// decision rather than take a lease that may close, or report a close
/// that is taken back.
pub(crate) const CLOSING: u64 = 1 << 62;
pub(crate) const FLAGS: u64 = CLOSED | CLOSING;
/// Polls of a `CLOSING` lease before an import gives up (the exporter
/// resolves it within a few atomic operations, unless it died meanwhile).
pub(crate) const CLOSING_POLLS: u32 = 100_000;
pub(crate) const MAGIC: u32 = 0x5450_5831; // "TPX1"
pub(crate) const DESCRIPTOR_BYTES: usize = 64;
/// Words of a lease: the count, the number of seals, then the seals.
pub(crate) const LEASE_WORDS: usize = 512;
pub(crate) const SEALS_AT: usize = 2;

/// The pool's sharing state: the access list every bind applies, the
/// leases of exported allocations, and the imports mapped into this pool's
/// device.
pub(crate) struct ShareState {
    pub(crate) access: Mutex<Vec<AccessDesc>>,
    pub(crate) exports: Mutex<HashMap<DevicePtr, Exported>>,
    /// At least the number of entries of `exports` (set under its lock
    /// after every insert, exact after every removal), so that a free in a
    /// pool that exports nothing reads one atomic instead of taking a lock
    /// every thread's free would share.
    exported: AtomicU64,
    pub(crate) imports: Mutex<HashMap<DevicePtr, ImportRecord>>,
}

/// The exporter's side of an exported allocation: the tag of its
/// descriptors and its leases (usually one, shared by every export; a new
/// one when a lease's seal slots are full).
pub(crate) struct Exported {
    pub(crate) tag: u64,
    pub(crate) leases: Vec<Arc<SharedWords>>,
}

/// The leases a free closed (see [`ShareState::check_free`]).
pub(crate) struct Closed(Option<(DevicePtr, Exported)>);

pub(crate) struct ImportRecord {
    pub(crate) va: DevicePtr,
    pub(crate) page: usize,
    pub(crate) handles: Vec<Physical>,
    pub(crate) lease: Arc<SharedWords>,
}

impl ShareState {
    pub(crate) fn new(access: Vec<AccessDesc>) -> Self {
        ShareState {
            access: Mutex::new(access),
            exports: Mutex::new(HashMap::new()),
            exported: AtomicU64::new(0),
            imports: Mutex::new(HashMap::new()),
        }
    }

    /// The access list to apply to a page mapped now.
    pub(crate) fn access_list(&self) -> Vec<AccessDesc> {
        lock(&self.access).clone()
    }

    /// The pool-drop hook: unmap every import still live and give its
    /// place on the lease back, so its exporter can free. The unmap acts at
    /// once and the pool does not know which streams use an import, so it
    /// waits for all work of its device first.
    pub(crate) fn release_all_imports<D: Device>(&self, dev: &D) {
        let imports: Vec<ImportRecord> = lock(&self.imports).drain().map(|(_, r)| r).collect();
        if !imports.is_empty() {
            tracing::warn!(
                count = imports.len(),
                "pool dropped with live imports; releasing them after the device's work"
            );
            if let Err(e) = dev.synchronize_device() {
                tracing::warn!(error = %e, "synchronising before releasing imports failed");
            }
        }
        for rec in imports {
            let n = rec.handles.len();
            unmap_release(dev, rec.va, rec.page, n, &rec.handles);
            if let Err(e) = dev.free_va(rec.va, rec.page * n) {
                tracing::warn!(error = %e, "freeing an import's reservation failed");
            }
            rec.lease.word(0).fetch_sub(1, Ordering::AcqRel);
        }
    }

    /// The free hook: close the leases of an exported allocation, or refuse
    /// Whether anything may be exported now (one load): a free in a pool
    /// that exports nothing needs no [`ShareState::check_free`]. An export
    /// of an allocation happens before its free (exporting needs the
    /// allocation), so its count is seen here.
    #[inline]
    pub(crate) fn exports_any(&self) -> bool {
        self.exported.load(Ordering::Acquire) != 0
    }

    /// the free while an import of it is live. Should the free fail after
    /// all, [`ShareState::reopen`] undoes the close.
    #[inline]
    pub(crate) fn check_free(&self, ptr: DevicePtr) -> Result<Closed, PoolError> {
        // An export of this allocation happened before its free (the
        // caller's own order: exporting needs the allocation), so its
        // count is seen here.
        if self.exported.load(Ordering::Acquire) == 0 {
            return Ok(Closed(None));
        }
        self.check_free_exported(ptr)
    }

    /// [`ShareState::check_free`] while something is exported.
    #[cold]
    fn check_free_exported(&self, ptr: DevicePtr) -> Result<Closed, PoolError> {
        let mut exports = lock(&self.exports);
        let Some(Exported { leases, .. }) = exports.get(&ptr) else {
            return Ok(Closed(None));
        };
        // Two phases, so that no lease is ever seen closed unless all close:
        // mark every idle lease `CLOSING` (imports of it wait), then either
        // close them all or take the marks back.
        let mut marked = Vec::new();
        for lease in leases {
            let word = lease.word(0);
            match word.compare_exchange(0, CLOSING, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => marked.push(lease),
                Err(v) if v & CLOSED != 0 => {}
                Err(live) => {
                    for l in marked {
                        l.word(0).fetch_and(!CLOSING, Ordering::AcqRel);
                    }
                    let imports = leases
                        .iter()
                        .map(|l| l.word(0).load(Ordering::Acquire) & !FLAGS)
                        .sum::<u64>()
                        .max(live & !FLAGS);
                    tracing::warn!(
                        ptr,
                        imports,
                        "free of an allocation still imported elsewhere refused"
                    );
                    return Err(PoolError::ExportInUse { ptr, imports });
                }
            }
        }
        for l in marked {
            // CLOSING -> CLOSED: nobody else changes a marked word.
            l.word(0).store(CLOSED, Ordering::Release);
        }
        let closed = exports.remove(&ptr).map(|e| (ptr, e));
        self.note_exports(exports.len());
        Ok(Closed(closed))
    }

    /// Undo [`ShareState::check_free`] for a free that failed later: the
    /// allocation lives on, so its exports import again.
    pub(crate) fn reopen(&self, closed: Closed) {
        if let Some((ptr, exported)) = closed.0 {
            for l in &exported.leases {
                l.word(0).fetch_and(!CLOSED, Ordering::AcqRel);
            }
            let mut exports = lock(&self.exports);
            exports.insert(ptr, exported);
            self.note_exports(exports.len());
        }
    }

    /// Record how many allocations are exported; called with the exports
    /// lock held, after each change of the map.
    pub(crate) fn note_exports(&self, len: usize) {
        self.exported.store(len as u64, Ordering::Release);
    }
}

/// Validate the peer devices of a pool's configuration (before anything is
/// reserved) and build the access list of its binds.
pub(crate) fn initial_access<D: Device>(
    device: &D,
    peers: &[i32],
) -> Result<Vec<AccessDesc>, PoolError> {
    let mut access = vec![AccessDesc {
        device: device.ordinal(),
        access: Access::ReadWrite,
    }];
    for &peer in peers {
        if access.iter().any(|a| a.device == peer) {
            continue;
        }
        check_peer(device, peer)?;
        access.push(AccessDesc {
            device: peer,
            access: Access::ReadWrite,
        });
    }
    Ok(access)
}

/// A device that does not exist is [`PoolError::NoPeerAccess`], whatever
/// the pool holds (asked before any page is looked at).
pub(crate) fn check_exists<D: Device>(device: &D, peer: i32) -> Result<(), PoolError> {
    let count = device.device_count().map_err(|e| PoolError::NoPeerAccess {
        device: peer,
        reason: e.to_string(),
    })?;
    if (0..count).contains(&peer) {
        Ok(())
    } else {
        Err(PoolError::NoPeerAccess {
            device: peer,
            reason: format!("device {peer} does not exist (devices 0 to {})", count - 1),
        })
    }
}

pub(crate) fn check_peer<D: Device>(device: &D, peer: i32) -> Result<(), PoolError> {
    match device.can_access_peer(peer) {
        Ok(true) => Ok(()),
        Ok(false) => Err(PoolError::NoPeerAccess {
            device: peer,
            reason: format!(
                "the driver reports that device {peer} cannot access memory of device {}",
                device.ordinal()
            ),
        }),
        Err(e) => Err(PoolError::NoPeerAccess {
            device: peer,
            reason: e.to_string(),
        }),
    }
}

pub(crate) fn unmap_release<D: Device>(
    dev: &D,
    va: DevicePtr,
    page: usize,
    mapped: usize,
    handles: &[Physical],
) {
    for i in 0..mapped {
        if let Err(e) = dev.unmap(va + (i * page) as u64, page) {
            tracing::warn!(error = %e, "unmapping an imported page failed");
        }
    }
    for &h in handles {
        if let Err(e) = dev.release_physical(h) {
            tracing::warn!(error = %e, "releasing an imported page failed");
        }
    }
}
