//! Peer access on the host backend: validation of `peer_devices` at pool
//! creation, typed errors, reading access back, and — through a wrapper
//! that simulates a second device — that the access list reaches every
//! page mapped now and later (growth, stitching, trim), and revocation.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tidepool::{MemPool, PoolConfig, PoolError};
use tidepool_sys::{
    Access, AccessDesc, Device, DevicePtr, HostConfig, HostDevice, Op, Physical, Stream, SysError,
    SysResult,
};

const PAGE: usize = 2 << 20;

fn host(capacity: usize) -> HostDevice {
    HostDevice::with_config(HostConfig {
        capacity,
        granularity: PAGE,
    })
}

#[test]
fn peer_that_does_not_exist_fails_creation_and_reserves_nothing() {
    let dev = Arc::new(host(64 << 20));
    let before = dev.live_reservations();
    let err = MemPool::new(
        dev.clone(),
        PoolConfig::default()
            .with_va_size(1 << 30)
            .with_peer_devices(vec![7]),
    )
    .expect_err("device 7 does not exist");
    assert!(
        matches!(err, PoolError::NoPeerAccess { device: 7, .. }),
        "{err:?}"
    );
    assert_eq!(dev.live_reservations(), before, "nothing reserved");
    // Its own ordinal in the list is harmless.
    MemPool::new(
        dev.clone(),
        PoolConfig::default()
            .with_va_size(1 << 30)
            .with_peer_devices(vec![0]),
    )
    .expect("own device as a peer");
}

#[test]
fn own_access_reads_back_and_cannot_be_lowered() {
    let dev = Arc::new(host(64 << 20));
    let pool = MemPool::new(dev.clone(), PoolConfig::default().with_va_size(1 << 30)).unwrap();
    let s = dev.create_stream().unwrap();
    let a = pool.alloc_async(3 * PAGE, s).unwrap();
    assert_eq!(pool.access(0).unwrap(), Access::ReadWrite);
    let err = pool.set_access(0, Access::Read).expect_err("own device");
    assert!(
        matches!(err, PoolError::InvalidAccess { device: 0, .. }),
        "{err:?}"
    );
    let err = pool
        .set_access(1, Access::ReadWrite)
        .expect_err("no device 1 here");
    assert!(
        matches!(err, PoolError::NoPeerAccess { device: 1, .. }),
        "{err:?}"
    );
    assert_eq!(pool.access(0).unwrap(), Access::ReadWrite);
    pool.free_async(a, s).unwrap();
}

/// A host device that claims a second device (ordinal 1) with peer
/// access: set-access entries for device 1 are kept per mapping here (and
/// forgotten on unmap, like the driver's), everything else goes to the
/// host device.
struct TwoDevices {
    inner: HostDevice,
    /// mapping start -> (size, access of device 1)
    peer: Mutex<HashMap<u64, (usize, Access)>>,
}

impl TwoDevices {
    fn new(capacity: usize) -> Self {
        TwoDevices {
            inner: host(capacity),
            peer: Mutex::new(HashMap::new()),
        }
    }
}

impl common::wrap::Hooks for TwoDevices {
    type Inner = HostDevice;
    fn inner(&self) -> &HostDevice {
        &self.inner
    }
    fn backend_name(&self) -> &'static str {
        "host"
    }
    fn ordinal(&self) -> i32 {
        0
    }
    fn map(&self, ptr: DevicePtr, size: usize, handle: Physical, offset: usize) -> SysResult<()> {
        self.inner.map(ptr, size, handle, offset)?;
        // A fresh mapping: no access for anyone.
        self.peer.lock().unwrap().insert(ptr, (size, Access::None));
        Ok(())
    }
    fn unmap(&self, ptr: DevicePtr, size: usize) -> SysResult<()> {
        self.inner.unmap(ptr, size)?;
        self.peer.lock().unwrap().remove(&ptr);
        Ok(())
    }
    fn set_access(&self, ptr: DevicePtr, size: usize, access: &[AccessDesc]) -> SysResult<()> {
        let own: Vec<AccessDesc> = access.iter().copied().filter(|a| a.device == 0).collect();
        if !own.is_empty() {
            self.inner.set_access(ptr, size, &own)?;
        }
        if let Some(p) = access.iter().rev().find(|a| a.device == 1) {
            let mut peer = self.peer.lock().unwrap();
            let end = ptr + size as u64;
            let starts: Vec<u64> = peer
                .iter()
                .filter(|(&s, &(len, _))| s >= ptr && s + len as u64 <= end)
                .map(|(&s, _)| s)
                .collect();
            let covered: usize = starts.iter().map(|s| peer[s].0).sum();
            if covered != size {
                return Err(SysError::InvalidArgument {
                    op: Op::SetAccess,
                    reason: format!("[{ptr:#x}, +{size:#x}) is not entirely mapped"),
                });
            }
            for s in starts {
                peer.get_mut(&s).unwrap().1 = p.access;
            }
        }
        Ok(())
    }
}

common::wrap::wrapped_device!(TwoDevices, {
    fn device_count(&self) -> SysResult<i32> {
        Ok(2)
    }
    fn can_access_peer(&self, peer: i32) -> SysResult<bool> {
        match peer {
            0 | 1 => Ok(true),
            // Device 2 exists but has no peer path (as on a machine where
            // two GPUs are not connected).
            2 => Ok(false),
            _ => Err(SysError::InvalidArgument {
                op: Op::PeerAccess,
                reason: format!("device {peer} does not exist"),
            }),
        }
    }
    fn get_access(&self, ptr: DevicePtr, device: i32) -> SysResult<Access> {
        if device != 1 {
            return self.inner.get_access(ptr, device);
        }
        let peer = self.peer.lock().unwrap();
        peer.iter()
            .find(|(&s, &(len, _))| ptr >= s && ptr < s + len as u64)
            .map(|(_, &(_, a))| a)
            .ok_or(SysError::InvalidArgument {
                op: Op::GetAccess,
                reason: format!("{ptr:#x} is not mapped"),
            })
    }
});

/// Fill the pool with page-sized blocks, free every other one (completed),
/// then ask for a block that only stitching can place without growing.
fn stitch<D: Device>(pool: &MemPool<D>, s: Stream, dev: &D) {
    let blocks: Vec<_> = (0..8).map(|_| pool.alloc_async(PAGE, s).unwrap()).collect();
    let mut keep = Vec::new();
    for (i, b) in blocks.into_iter().enumerate() {
        if i % 2 == 0 {
            pool.free_async(b, s).unwrap();
        } else {
            keep.push(b);
        }
    }
    dev.synchronize_stream(s).unwrap();
    pool.synchronize().unwrap();
    let before = pool.stats();
    let big = pool.alloc_async(4 * PAGE, s).unwrap();
    let after = pool.stats();
    assert!(
        after.remaps > before.remaps,
        "the big block needed remapping"
    );
    pool.free_async(big, s).unwrap();
    for b in keep {
        pool.free_async(b, s).unwrap();
    }
}

#[test]
fn peer_access_reaches_pages_mapped_now_and_later() {
    // Capacity for 10 pages: the big block must be stitched, not grown.
    let dev = Arc::new(TwoDevices::new(10 * PAGE));
    let pool = MemPool::new(
        dev.clone(),
        PoolConfig::default()
            .with_va_size(1 << 30)
            .with_max_size(10 * PAGE as u64),
    )
    .unwrap();
    let s = dev.create_stream().unwrap();
    // Pages mapped before access is given.
    let a = pool.alloc_async(2 * PAGE, s).unwrap();
    assert_eq!(pool.access(1).unwrap(), Access::None);
    pool.set_access(1, Access::ReadWrite).unwrap();
    assert_eq!(pool.access(1).unwrap(), Access::ReadWrite);
    pool.free_async(a, s).unwrap();
    // Growth, stitching and reactivated ghost mappings.
    stitch(&pool, s, &*dev);
    assert_eq!(
        pool.access(1).unwrap(),
        Access::ReadWrite,
        "after growth and stitching"
    );
    assert!(pool.stats().growths >= 8);
    // Trim, then growth again.
    pool.synchronize().unwrap();
    let released = pool.trim_to(2 * PAGE as u64).unwrap();
    assert!(released > 0);
    assert_eq!(pool.access(1).unwrap(), Access::ReadWrite, "after trim");
    let b = pool.alloc_async(6 * PAGE, s).unwrap();
    assert_eq!(pool.access(1).unwrap(), Access::ReadWrite, "after regrowth");
    // Revoke: every page, now and later.
    pool.set_access(1, Access::None).unwrap();
    assert_eq!(pool.access(1).unwrap(), Access::None);
    pool.free_async(b, s).unwrap();
    stitch(&pool, s, &*dev);
    assert_eq!(
        pool.access(1).unwrap(),
        Access::None,
        "revoked, after stitching"
    );
    // Read-only, then back to read-write.
    pool.set_access(1, Access::Read).unwrap();
    assert_eq!(pool.access(1).unwrap(), Access::Read);
    pool.set_access(1, Access::ReadWrite).unwrap();
    assert_eq!(pool.access(1).unwrap(), Access::ReadWrite);
    // The pool's own access never changed.
    assert_eq!(pool.access(0).unwrap(), Access::ReadWrite);
}

#[test]
fn configured_peers_are_applied_from_the_first_page() {
    let dev = Arc::new(TwoDevices::new(16 * PAGE));
    let pool = MemPool::new(
        dev.clone(),
        PoolConfig::default()
            .with_va_size(1 << 30)
            .with_peer_devices(vec![1]),
    )
    .unwrap();
    let s = dev.create_stream().unwrap();
    let a = pool.alloc_async(3 * PAGE, s).unwrap();
    assert_eq!(pool.access(1).unwrap(), Access::ReadWrite);
    pool.free_async(a, s).unwrap();
}

#[test]
fn peer_without_capability_is_a_typed_error() {
    let dev = Arc::new(TwoDevices::new(16 * PAGE));
    let err = MemPool::new(
        dev.clone(),
        PoolConfig::default()
            .with_va_size(1 << 30)
            .with_peer_devices(vec![2]),
    )
    .expect_err("device 2 has no peer path");
    assert!(
        matches!(err, PoolError::NoPeerAccess { device: 2, .. }),
        "{err:?}"
    );
    assert_eq!(dev.inner.live_reservations(), 0, "nothing reserved");
    let pool = MemPool::new(dev.clone(), PoolConfig::default().with_va_size(1 << 30)).unwrap();
    let s = dev.create_stream().unwrap();
    let a = pool.alloc_async(PAGE, s).unwrap();
    let err = pool
        .set_access(2, Access::ReadWrite)
        .expect_err("no peer path");
    assert!(
        matches!(err, PoolError::NoPeerAccess { device: 2, .. }),
        "{err:?}"
    );
    pool.free_async(a, s).unwrap();
}

/// Imports are pages the pool maps too: the access list reaches those
/// mapped before and after `set_access`, and `access` reads them back.
#[test]
fn peer_access_reaches_imports() {
    let exp_dev = Arc::new(host(16 * PAGE));
    let exporter = MemPool::new(
        exp_dev.clone(),
        PoolConfig::default()
            .with_va_size(1 << 30)
            .with_exportable(true),
    )
    .unwrap();
    let es = exp_dev.create_stream().unwrap();
    let a = exporter.alloc_async(2 * PAGE, es).unwrap();
    let dev = Arc::new(TwoDevices::new(16 * PAGE));
    let pool = MemPool::new(dev.clone(), PoolConfig::default().with_va_size(1 << 30)).unwrap();
    let before = pool.import(exporter.export(&a).unwrap()).unwrap();
    assert_eq!(dev.get_access(before.ptr(), 1).unwrap(), Access::None);
    pool.set_access(1, Access::ReadWrite).unwrap();
    let after = pool.import(exporter.export(&a).unwrap()).unwrap();
    for (what, imp) in [("imported before", &before), ("imported after", &after)] {
        for p in 0..2 {
            let ptr = imp.ptr() + (p * PAGE) as u64;
            assert_eq!(
                dev.get_access(ptr, 1).unwrap(),
                Access::ReadWrite,
                "{what}, page {p}"
            );
        }
    }
    assert_eq!(pool.access(1).unwrap(), Access::ReadWrite);
    // Revoke: the imports too; and an import that disagrees is seen.
    pool.set_access(1, Access::None).unwrap();
    assert_eq!(dev.get_access(after.ptr(), 1).unwrap(), Access::None);
    assert_eq!(pool.access(1).unwrap(), Access::None);
    dev.set_access(
        before.ptr(),
        PAGE,
        &[AccessDesc {
            device: 1,
            access: Access::Read,
        }],
    )
    .unwrap();
    assert!(
        matches!(pool.access(1), Err(PoolError::AccessMismatch { .. })),
        "an import's page that disagrees"
    );
    pool.release_import(before).unwrap();
    pool.release_import(after).unwrap();
    exporter.free_async(a, es).unwrap();
}

/// A device that does not exist is the same typed error whether or not the
/// pool has pages mapped, for `access` as for `set_access`.
#[test]
fn access_of_a_device_that_does_not_exist_is_a_typed_error() {
    let dev = Arc::new(TwoDevices::new(16 * PAGE));
    let pool = MemPool::new(dev.clone(), PoolConfig::default().with_va_size(1 << 30)).unwrap();
    let s = dev.create_stream().unwrap();
    for bad in [7, -1, i32::MAX, i32::MIN] {
        for (what, a) in [
            ("set_access", pool.set_access(bad, Access::ReadWrite).err()),
            ("access, no page mapped", pool.access(bad).err()),
        ] {
            assert!(
                matches!(a, Some(PoolError::NoPeerAccess { device, .. }) if device == bad),
                "{what} of device {bad}: {a:?}"
            );
        }
    }
    let a = pool.alloc_async(2 * PAGE, s).unwrap();
    for bad in [7, -1] {
        let r = pool.access(bad);
        assert!(
            matches!(r, Err(PoolError::NoPeerAccess { device, .. }) if device == bad),
            "access of device {bad}, pages mapped: {r:?}"
        );
    }
    pool.free_async(a, s).unwrap();
}

/// Units of several pages (one handle each): peer access is set on each
/// whole mapping, before and after growth, and reads back per mapping.
#[test]
fn peer_access_reaches_units_of_several_pages() {
    let dev = Arc::new(TwoDevices::new(32 * PAGE));
    let pool = MemPool::new(
        dev.clone(),
        PoolConfig::default()
            .with_va_size(1 << 30)
            .with_max_unit_size(4 * PAGE)
            .with_unit_min_block(2 * PAGE),
    )
    .unwrap();
    let s = dev.create_stream().unwrap();
    // One unit of four pages, mapped before access is given.
    let a = pool.alloc_async(4 * PAGE, s).unwrap();
    assert_eq!(dev.inner.live_handles(), 1, "one unit");
    pool.set_access(1, Access::ReadWrite).unwrap();
    assert_eq!(pool.access(1).unwrap(), Access::ReadWrite);
    // Units mapped after: two of four pages.
    let b = pool.alloc_async(8 * PAGE, s).unwrap();
    assert_eq!(dev.inner.live_handles(), 3, "two more units");
    assert_eq!(pool.access(1).unwrap(), Access::ReadWrite, "after growth");
    pool.set_access(1, Access::Read).unwrap();
    assert_eq!(pool.access(1).unwrap(), Access::Read);
    pool.free_async(a, s).unwrap();
    pool.free_async(b, s).unwrap();
    pool.synchronize().unwrap();
    assert_eq!(pool.trim_to(0).unwrap(), 12 * PAGE as u64);
    assert_eq!(dev.inner.live_mappings(), 0);
}
