//! Sharing a pool's memory: access for peer devices, and export of live
//! allocations to other processes (and import of theirs).
//!
//! ## Peer access
//! [`MemPool::set_access`] gives another device access to every page the
//! pool has mapped, and to every page it maps later (growth, stitching,
//! reactivated ghost mappings all go through the one bind, which applies
//! the list kept here). [`MemPool::access`] reads the access back from the
//! driver, page by page.
//!
//! ## Export and import
//! A pool created with [`crate::PoolConfig::exportable`] can export a live
//! allocation ([`MemPool::export`]): a descriptor (plain bytes) plus file
//! descriptors: first a *lease* (a page of shared 64-bit words, see below), then
//! one per physical page behind the allocation, in address order. Another
//! process (or this one) imports it into its own pool ([`MemPool::import`]):
//! the pages are mapped into a fresh reservation of the importer's device,
//! with the importer pool's access list, and an [`ImportedAllocation`]
//! comes back. A page is shared whole: the importer can reach the bytes of
//! other allocations that share the exported allocation's first or last
//! page (allocations of a page or more start on a page boundary).
//!
//! The lease orders the hand-over. Word 0 counts live imports and carries a
//! `CLOSED` bit; word 1 counts the *seals* that follow. A seal is a hash of
//! the descriptor bytes (which hold a random tag drawn at the allocation's
//! first export) and of the identity (device and inode) of every page's
//! file descriptor, in order. Every export of one allocation shares a lease
//! and adds its seal there (a new lease only when one is full), so repeated
//! exports cost no descriptors. The importer recomputes the seal from what
//! it received and looks for it, so a descriptor that was corrupted, truncated or
//! combined with another export's (or any other) file descriptors is
//! refused before anything is mapped. An import adds one unless the lease is closed (then
//! [`PoolError::ExportClosed`]); a release subtracts one after unmapping.
//! The exporter's [`MemPool::free_async`] closes every lease of the
//! allocation when no import is live (marking them `CLOSING` first, so that
//! a free refused because of one lease never shows another closed), and refuses the free with
//! [`PoolError::ExportInUse`] (handing the allocation back) while one is.
//! So the exporter can never reuse, move or release the pages while another
//! process maps them: a live allocation's pages are never remapped (only
//! pages with no block in use are stitched or trimmed), and the free that
//! would end that is refused. The check is made in every build. An importer
//! that dies without releasing keeps the allocation live in the exporter
//! until the pool is dropped.

use crate::error::PoolError;
use crate::placement::ArenaState;
use crate::pool::{Allocation, MemPool};
use crate::share_state::*;
use crate::sync::{lock, Arc};
use std::collections::HashMap;
use std::fmt;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::Ordering;
use tidepool_sys::ipc::SharedWords;
use tidepool_sys::{Access, AccessDesc, Device, DevicePtr, Physical};

/// A live allocation exported by [`MemPool::export`]: send the descriptor
/// and the file descriptors to the importing process
/// ([`ExportedAllocation::send`], or any way of your own that keeps the
/// descriptors in order).
pub struct ExportedAllocation {
    /// The descriptor: plain bytes, meaningful only with `fds`.
    pub descriptor: Vec<u8>,
    /// The lease, then one descriptor per physical page, in address order.
    pub fds: Vec<OwnedFd>,
}

impl fmt::Debug for ExportedAllocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExportedAllocation")
            .field("descriptor_bytes", &self.descriptor.len())
            .field("fds", &self.fds.len())
            .finish()
    }
}

impl ExportedAllocation {
    /// Send it as one message over a connected Unix stream socket
    /// (`SCM_RIGHTS`; see [`tidepool_sys::ipc::send_message`]).
    pub fn send(&self, socket: impl AsFd) -> Result<(), PoolError> {
        let fds: Vec<BorrowedFd<'_>> = self.fds.iter().map(|f| f.as_fd()).collect();
        tidepool_sys::ipc::send_message(socket, &self.descriptor, &fds)?;
        Ok(())
    }

    /// Receive one sent by [`ExportedAllocation::send`].
    pub fn recv(socket: impl AsFd) -> Result<ExportedAllocation, PoolError> {
        let (descriptor, fds) = tidepool_sys::ipc::recv_message(socket)?;
        Ok(ExportedAllocation { descriptor, fds })
    }

    /// Bytes of the allocation (from the descriptor), if it parses.
    pub fn size(&self) -> Option<usize> {
        Descriptor::parse(&self.descriptor)
            .ok()
            .map(|d| d.size as usize)
    }
}

/// Memory of another pool (usually of another process) mapped into this
/// pool's device by [`MemPool::import`]. Release it with
/// [`MemPool::release_import`] when every use of it is done (synchronise
/// the streams that used it first: the unmap acts at once), and before the
/// exporter frees the allocation (its free is refused until then).
#[must_use = "an import that is never released keeps the exporter from freeing the allocation"]
#[derive(Debug)]
pub struct ImportedAllocation {
    ptr: DevicePtr,
    size: usize,
    pool: u64,
}

impl ImportedAllocation {
    /// Address in this process (valid for the importing pool's device and
    /// the devices of its access list).
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }
    /// Bytes of the allocation.
    pub fn size(&self) -> usize {
        self.size
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Descriptor {
    backend: u32,
    ordinal: i32,
    pid: u32,
    pool: u64,
    tag: u64,
    offset: u64,
    size: u64,
    page: u64,
    pages: u32,
}

fn backend_code(name: &str) -> u32 {
    match name {
        "cuda" => 1,
        "host" => 2,
        _ => 3,
    }
}

impl Descriptor {
    fn bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(DESCRIPTOR_BYTES);
        b.extend_from_slice(&MAGIC.to_le_bytes());
        b.extend_from_slice(&self.backend.to_le_bytes());
        b.extend_from_slice(&self.ordinal.to_le_bytes());
        b.extend_from_slice(&self.pid.to_le_bytes());
        for v in [self.pool, self.tag, self.offset, self.size, self.page] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&self.pages.to_le_bytes());
        b.resize(DESCRIPTOR_BYTES, 0);
        b
    }

    fn parse(b: &[u8]) -> Result<Descriptor, PoolError> {
        let bad = |reason: &str| PoolError::BadDescriptor {
            reason: reason.to_string(),
        };
        if b.len() != DESCRIPTOR_BYTES {
            return Err(bad(
                "wrong length: not a descriptor made by MemPool::export",
            ));
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        if u32_at(0) != MAGIC {
            return Err(bad("bad magic: not a descriptor made by MemPool::export"));
        }
        Ok(Descriptor {
            backend: u32_at(4),
            ordinal: u32_at(8) as i32,
            pid: u32_at(12),
            pool: u64_at(16),
            tag: u64_at(24),
            offset: u64_at(32),
            size: u64_at(40),
            page: u64_at(48),
            pages: u32_at(56),
        })
    }
}

/// A tag that ties a lease to its descriptor: unique per export in practice
/// (process id, time, a counter, mixed).
fn fresh_tag() -> u64 {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut x = t ^ (u64::from(std::process::id()) << 40) ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x | 1
}

impl<D: Device> MemPool<D> {
    /// Give `device` access to the pool's memory: every page mapped now and
    /// every page mapped later. [`Access::None`] revokes it. The pool's own
    /// device always keeps read-write access
    /// ([`PoolError::InvalidAccess`] otherwise); a device that does not
    /// exist or cannot access this one is [`PoolError::NoPeerAccess`].
    ///
    /// Like the driver's call, it acts at once, not in stream order: make
    /// sure no work of a device whose access is reduced still runs. Costs
    /// one set-access call per mapping the pool holds.
    pub fn set_access(&self, device: i32, access: Access) -> Result<(), PoolError> {
        let inner = &*self.inner;
        let own = inner.device.ordinal();
        if device == own {
            if access == Access::ReadWrite {
                return Ok(());
            }
            return Err(PoolError::InvalidAccess {
                device,
                reason: "the pool's own device always has read-write access".into(),
            });
        }
        check_peer(&*inner.device, device)?;
        // The arena lock keeps binds out while the list and the pages change
        // together (binds read the list under it).
        // Imports are held too (an import applies the list under that
        // lock), so that they follow the list as well.
        let st = lock(&inner.arena);
        let imports = lock(&inner.share.imports);
        let ptrs = mapped_pages(&st, inner.base, &imports);
        let mut list = lock(&inner.share.access);
        let before = list
            .iter()
            .find(|a| a.device == device)
            .map_or(Access::None, |a| a.access);
        let desc = [AccessDesc { device, access }];
        for (k, &(ptr, size)) in ptrs.iter().enumerate() {
            if let Err(e) = inner.device.set_access(ptr, size, &desc) {
                // Put back what was changed, so that every page agrees again.
                let undo = [AccessDesc {
                    device,
                    access: before,
                }];
                for &(q, qsize) in &ptrs[..k] {
                    if let Err(e2) = inner.device.set_access(q, qsize, &undo) {
                        tracing::warn!(error = %e2, "restoring peer access failed");
                    }
                }
                return Err(e.into());
            }
        }
        list.retain(|a| a.device != device);
        if access != Access::None {
            list.push(AccessDesc { device, access });
        }
        drop(list);
        drop(imports);
        drop(st);
        tracing::debug!(
            pool = inner.id,
            device,
            ?access,
            pages = ptrs.len(),
            "peer access set"
        );
        Ok(())
    }

    /// The access `device` has to the pool's memory, read back from the
    /// driver (`cuMemGetAccess`) on every page the pool has mapped, its
    /// imports' pages included; when the pool has no page mapped, the
    /// access it will give new pages.
    /// Pages that disagree are [`PoolError::AccessMismatch`] (a bug); a
    /// device that does not exist is [`PoolError::NoPeerAccess`].
    pub fn access(&self, device: i32) -> Result<Access, PoolError> {
        let inner = &*self.inner;
        if device != inner.device.ordinal() {
            check_exists(&*inner.device, device)?;
        }
        let st = lock(&inner.arena);
        let expected = if device == inner.device.ordinal() {
            Access::ReadWrite
        } else {
            lock(&inner.share.access)
                .iter()
                .find(|a| a.device == device)
                .map_or(Access::None, |a| a.access)
        };
        let imports = lock(&inner.share.imports);
        for (ptr, _) in mapped_pages(&st, inner.base, &imports) {
            let found = inner.device.get_access(ptr, device)?;
            if found != expected {
                return Err(PoolError::AccessMismatch {
                    device,
                    ptr,
                    expected,
                    found,
                });
            }
        }
        Ok(expected)
    }

    /// Export a live allocation to another process (or another pool of
    /// this one): see the [module documentation](crate::share). Needs a
    /// pool created with [`crate::PoolConfig::exportable`]. Every export of
    /// one allocation shares its lease (one file descriptor kept here per
    /// exported allocation, until its free); the free is refused while an
    /// import of any export is live.
    pub fn export(&self, allocation: &Allocation) -> Result<ExportedAllocation, PoolError> {
        let inner = &*self.inner;
        if allocation.pool != inner.id {
            return Err(PoolError::WrongPool {
                ptr: allocation.ptr,
            });
        }
        if !inner.config.exportable {
            return Err(PoolError::NotExportable {
                reason: "the pool was created without PoolConfig::exportable".into(),
            });
        }
        if allocation.size == 0 {
            return Err(PoolError::NotExportable {
                reason: "a zero-size allocation has no memory to export".into(),
            });
        }
        if allocation.is_graph_memory() {
            return Err(PoolError::NotExportable {
                reason: "graph memory (allocated during a capture) belongs to the driver's graph \
                         memory pool, not to this pool; allocate outside the capture to export"
                    .into(),
            });
        }
        let mut fds = Vec::new();
        let st = lock(&inner.arena);
        let page = st.arena.page();
        let offset = (allocation.ptr - inner.base) as usize;
        let (first, last) = (offset / page, (offset + allocation.len() - 1) / page);
        for p in first..=last {
            let phys = match st.arena.mapping_at(p) {
                Some(i) if st.arena.is_active(p) => i,
                _ => {
                    return Err(PoolError::NotExportable {
                        reason: format!(
                            "page {p} of the allocation at {:#x} is not active (not a live allocation?)",
                            allocation.ptr
                        ),
                    })
                }
            };
            fds.push(inner.device.export_fd(st.arena.handle(phys))?);
        }
        drop(st);
        let (page_fds, identities) = identify(fds)?;
        // The exports lock is held from here on, so that a free (which
        // closes the leases under it) cannot slip in between.
        let mut exports = lock(&inner.share.exports);
        exports.entry(allocation.ptr).or_insert_with(|| Exported {
            tag: fresh_tag(),
            leases: Vec::new(),
        });
        // Counted before anything can fail: a count above the map's size
        // only sends frees to the lock; one below it would skip a close.
        inner.share.note_exports(exports.len());
        let entry = exports.get_mut(&allocation.ptr).expect("inserted above");
        let tag = entry.tag;
        let desc = Descriptor {
            backend: backend_code(inner.device.backend_name()),
            ordinal: inner.device.ordinal(),
            pid: std::process::id(),
            pool: inner.id,
            tag,
            offset: (offset % page) as u64,
            size: allocation.size as u64,
            page: page as u64,
            pages: (last - first + 1) as u32,
        };
        let descriptor = desc.bytes();
        let sealed = seal(&descriptor, &identities);
        // Every export of the allocation shares a lease whose seal slots
        // hold the seals of its exports (on the host backend they are all
        // the same: the descriptor and the page files do not change), so
        // exporting again and again costs no descriptor or mapping here.
        let known = entry.leases.iter().find(|l| has_seal(l, sealed)).cloned();
        let lease = match known {
            Some(l) => l,
            None => {
                let room = entry.leases.last().filter(|l| {
                    (l.word(1).load(Ordering::Acquire) as usize) < LEASE_WORDS - SEALS_AT
                });
                let lease = match room {
                    Some(l) => Arc::clone(l),
                    None => {
                        let l = Arc::new(SharedWords::create(LEASE_WORDS)?);
                        entry.leases.push(Arc::clone(&l));
                        l
                    }
                };
                let n = lease.word(1).load(Ordering::Acquire);
                lease
                    .word(SEALS_AT + n as usize)
                    .store(sealed, Ordering::Release);
                lease.word(1).store(n + 1, Ordering::Release);
                lease
            }
        };
        let mut fds = vec![lease.share()?];
        drop(exports);
        fds.extend(page_fds);
        tracing::debug!(
            pool = inner.id,
            ptr = allocation.ptr,
            pages = desc.pages,
            "exported"
        );
        Ok(ExportedAllocation { descriptor, fds })
    }

    /// Live imports of `allocation` (over all its exports), as the leases
    /// say now.
    pub fn outstanding_imports(&self, allocation: &Allocation) -> u64 {
        lock(&self.inner.share.exports)
            .get(&allocation.ptr)
            .map_or(0, |e| {
                e.leases
                    .iter()
                    .map(|l| l.word(0).load(Ordering::Acquire) & !FLAGS)
                    .sum()
            })
    }

    /// Map an exported allocation into this pool's device: a fresh
    /// reservation, the pages mapped in order, the pool's access list
    /// applied. Fails with [`PoolError::ExportClosed`] when the exporter
    /// has already freed the allocation, [`PoolError::BadDescriptor`] when
    /// the descriptor or its file descriptors do not fit together or come
    /// from another backend, or were corrupted or mixed up on the way (the
    /// lease's seal covers the descriptor and the page file descriptors).
    /// On failure nothing stays mapped or reserved. The import is the
    /// exporter's memory: it counts neither in this pool's statistics nor
    /// against its `max_size`.
    pub fn import(&self, exported: ExportedAllocation) -> Result<ImportedAllocation, PoolError> {
        let inner = &*self.inner;
        let dev = &*inner.device;
        let d = Descriptor::parse(&exported.descriptor)?;
        let bad = |reason: String| PoolError::BadDescriptor { reason };
        if d.backend != backend_code(dev.backend_name()) {
            return Err(bad(format!(
                "the allocation was exported by another backend than {}",
                dev.backend_name()
            )));
        }
        let page = d.page as usize;
        let pages = d.pages as usize;
        if exported.fds.len() != pages + 1 {
            return Err(bad(format!(
                "{} file descriptors for {pages} pages (expected the lease and one per page)",
                exported.fds.len()
            )));
        }
        let extent = page.checked_mul(pages).map(|b| b as u64);
        let end = d.offset.checked_add(d.size);
        if page == 0
            || page % dev.granularity() != 0
            || !matches!((end, extent), (Some(end), Some(extent)) if end <= extent && d.offset < d.page)
        {
            return Err(bad(format!(
                "page size {page} or extent is not usable with granularity {}",
                dev.granularity()
            )));
        }
        let mut fds = exported.fds;
        let (page_fds, identities) = identify(fds.split_off(1))?;
        let lease = SharedWords::open(fds.pop().expect("checked length"), LEASE_WORDS)
            .map_err(|e| bad(format!("the lease cannot be opened: {e}")))?;
        if !has_seal(&lease, seal(&exported.descriptor, &identities)) {
            return Err(bad(
                "the descriptor, its lease and its page file descriptors do not belong together \
                 (corrupted, or mixed with another export's)"
                    .into(),
            ));
        }
        // Take a place on the lease, unless the exporter has freed.
        let word = lease.word(0);
        let mut cur = word.load(Ordering::Acquire);
        let mut polls = 0u32;
        loop {
            if cur & CLOSING != 0 && polls < CLOSING_POLLS {
                // The exporter's free is deciding: wait for it.
                polls += 1;
                if polls < 64 {
                    std::thread::yield_now();
                } else {
                    std::thread::sleep(std::time::Duration::from_micros(10));
                }
                cur = word.load(Ordering::Acquire);
                continue;
            }
            if cur & FLAGS != 0 {
                return Err(PoolError::ExportClosed {
                    exporter_pid: d.pid,
                    pool: d.pool,
                });
            }
            match word.compare_exchange(cur, cur + 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => break,
                Err(v) => cur = v,
            }
        }
        let lease = Arc::new(lease);
        let mapped = self.map_import(page_fds, page).and_then(|(va, handles)| {
            // The access list is read and applied under the imports lock,
            // which `set_access` also holds while it changes the list and
            // the live imports: an import made meanwhile gets the new list.
            let imports = lock(&inner.share.imports);
            match dev.set_access(va, page * pages, &inner.share.access_list()) {
                Ok(()) => Ok((va, handles, imports)),
                Err(e) => {
                    drop(imports);
                    undo_import(dev, va, page, pages, &handles, page * pages);
                    Err(e.into())
                }
            }
        });
        match mapped {
            Ok((va, handles, mut imports)) => {
                let ptr = va + d.offset;
                imports.insert(
                    ptr,
                    ImportRecord {
                        va,
                        page,
                        handles,
                        lease,
                    },
                );
                tracing::debug!(pool = inner.id, ptr, pages, exporter = d.pid, "imported");
                Ok(ImportedAllocation {
                    ptr,
                    size: d.size as usize,
                    pool: inner.id,
                })
            }
            Err(e) => {
                lease.word(0).fetch_sub(1, Ordering::AcqRel);
                Err(e)
            }
        }
    }

    /// Reserve, import and map the pages; undo everything on failure.
    fn map_import(
        &self,
        fds: Vec<OwnedFd>,
        page: usize,
    ) -> Result<(DevicePtr, Vec<Physical>), PoolError> {
        let dev = &*self.inner.device;
        let total = page * fds.len();
        let va = dev.reserve_va(total, page)?;
        let mut handles = Vec::with_capacity(fds.len());
        let mut mapped = 0usize;
        let result = (|| -> Result<(), tidepool_sys::SysError> {
            for fd in fds {
                handles.push(dev.import_fd(fd, page)?);
            }
            for (i, &h) in handles.iter().enumerate() {
                dev.map(va + (i * page) as u64, page, h, 0)?;
                mapped += 1;
            }
            Ok(())
        })();
        match result {
            Ok(()) => Ok((va, handles)),
            Err(e) => {
                undo_import(dev, va, page, mapped, &handles, total);
                Err(e.into())
            }
        }
    }

    /// Unmap an import and give its place on the lease back. The unmap acts
    /// at once: every use of the memory must be complete.
    pub fn release_import(&self, imported: ImportedAllocation) -> Result<(), PoolError> {
        if imported.pool != self.inner.id {
            return Err(PoolError::WrongPool { ptr: imported.ptr });
        }
        self.release_import_ptr(imported.ptr)
    }

    /// [`MemPool::release_import`] by address (for callers that keep raw
    /// pointers): an address that is not a live import of this pool, for
    /// example one released already, is [`PoolError::NotImported`].
    pub fn release_import_ptr(&self, ptr: DevicePtr) -> Result<(), PoolError> {
        let inner = &*self.inner;
        let rec = lock(&inner.share.imports)
            .remove(&ptr)
            .ok_or(PoolError::NotImported { ptr })?;
        let dev = &*inner.device;
        let n = rec.handles.len();
        unmap_release(dev, rec.va, rec.page, n, &rec.handles);
        if let Err(e) = dev.free_va(rec.va, rec.page * n) {
            tracing::warn!(error = %e, "freeing an import's reservation failed");
        }
        // Only now may the exporter free: nothing of ours maps the pages.
        rec.lease.word(0).fetch_sub(1, Ordering::AcqRel);
        tracing::debug!(pool = inner.id, ptr, "import released");
        Ok(())
    }

    /// Number of imports mapped into this pool and not yet released.
    pub fn live_imports(&self) -> usize {
        lock(&self.inner.share.imports).len()
    }
}

/// Every page the pool maps, as (address, bytes): its own mappings (active
/// and ghost), then every page of its imports.
fn mapped_pages(
    st: &ArenaState,
    base: DevicePtr,
    imports: &HashMap<DevicePtr, ImportRecord>,
) -> Vec<(DevicePtr, usize)> {
    let page = st.arena.page();
    // Each mapping of a unit covers the whole unit.
    let own = st.arena.phys_pages().flat_map(move |(i, _, mappings)| {
        let bytes = st.arena.unit_bytes(i);
        mappings
            .iter()
            .map(move |&p| (base + (p * page) as u64, bytes))
    });
    let imported = imports
        .values()
        .flat_map(|r| (0..r.handles.len()).map(move |i| (r.va + (i * r.page) as u64, r.page)));
    own.chain(imported).collect()
}

/// Unmap the first `mapped` pages of an import, release its handles and
/// its reservation (`total` bytes).
fn undo_import<D: Device>(
    dev: &D,
    va: DevicePtr,
    page: usize,
    mapped: usize,
    handles: &[Physical],
    total: usize,
) {
    unmap_release(dev, va, page, mapped, handles);
    if let Err(e) = dev.free_va(va, total) {
        tracing::warn!(error = %e, "freeing an import's reservation failed");
    }
}

/// Whether `sealed` is among the seals of `lease`.
fn has_seal(lease: &SharedWords, sealed: u64) -> bool {
    let n = (lease.word(1).load(Ordering::Acquire) as usize).min(LEASE_WORDS - SEALS_AT);
    (0..n).any(|i| lease.word(SEALS_AT + i).load(Ordering::Acquire) == sealed)
}

/// A file's identity: (device, inode).
type FileId = (u64, u64);

/// The identity (device, inode) of each file descriptor, which every
/// process holding the same file sees alike. Gives the descriptors back.
fn identify(fds: Vec<OwnedFd>) -> Result<(Vec<OwnedFd>, Vec<FileId>), PoolError> {
    let mut out = Vec::with_capacity(fds.len());
    let mut ids = Vec::with_capacity(fds.len());
    for fd in fds {
        let file = std::fs::File::from(fd);
        let meta = file.metadata().map_err(|e| PoolError::BadDescriptor {
            reason: format!("a page's file descriptor cannot be examined: {e}"),
        })?;
        ids.push((meta.dev(), meta.ino()));
        out.push(OwnedFd::from(file));
    }
    Ok((out, ids))
}

/// The lease's seal: FNV-1a over the descriptor bytes and the identities
/// of the page file descriptors, finished with a mixer. Not a defence
/// against a forger (who holds the file descriptors anyway), but any
/// corruption or mix-up changes it.
fn seal(descriptor: &[u8], identities: &[FileId]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |b: u8| {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    };
    for &b in descriptor {
        eat(b);
    }
    for &(dev, ino) in identities {
        for b in dev.to_le_bytes().into_iter().chain(ino.to_le_bytes()) {
            eat(b);
        }
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h
}
