//! Host backend: virtual memory, physical memory and the checked access path
//! are as strict as the CUDA driver's VMM API.

use std::sync::mpsc;
use tidepool_sys::host::{HostConfig, HostDevice};
use tidepool_sys::{Access, AccessDesc, Device, Op, PhysicalOptions, SysError};

const MIB: usize = 1 << 20;
const GRAN: usize = 2 * MIB;

fn device(capacity: usize) -> HostDevice {
    HostDevice::with_config(HostConfig {
        capacity,
        granularity: GRAN,
    })
}

fn rw() -> [AccessDesc; 1] {
    [AccessDesc {
        device: 0,
        access: Access::ReadWrite,
    }]
}

fn is_invalid(r: Result<impl std::fmt::Debug, SysError>, op: Op) -> bool {
    matches!(r, Err(SysError::InvalidArgument { op: o, .. }) if o == op)
}

#[test]
fn defaults_are_documented_values() {
    // The default device (64 GiB) is not built here: every test keeps to
    // <= 1 GiB of capacity.
    let c = HostConfig::default();
    assert_eq!((c.capacity, c.granularity), (64 << 30, 2 * MIB));
    let d = device(1 << 30);
    assert_eq!(d.granularity(), 2 * MIB);
    assert_eq!(d.config().capacity, 1 << 30);
    assert_eq!(d.backend_name(), "host");
    assert_eq!(d.ordinal(), 0);
    let info = d.mem_info().unwrap();
    assert_eq!((info.free, info.total), (1 << 30, 1 << 30));
}

#[test]
fn two_virtual_ranges_on_one_physical_handle_see_each_others_writes() {
    let d = device(1 << 30);
    let a = d.reserve_va(GRAN, 0).unwrap();
    let b = d.reserve_va(GRAN, 0).unwrap();
    assert_ne!(a, b);
    let h = d.create_physical(GRAN, PhysicalOptions::default()).unwrap();
    d.map(a, GRAN, h, 0).unwrap();
    d.map(b, GRAN, h, 0).unwrap();
    d.set_access(a, GRAN, &rw()).unwrap();
    d.set_access(b, GRAN, &rw()).unwrap();

    // Through the immediate helpers.
    d.write_words(a + 4096, &[0xdead_beef, 7]).unwrap();
    assert_eq!(d.read_words(b + 4096, 2).unwrap(), vec![0xdead_beef, 7]);

    // Through a stream-ordered "kernel".
    let s = d.default_stream();
    d.launch_on_words(s, b, 16, |w| {
        let w = w.expect("range is mapped read-write");
        for (i, x) in w.iter().enumerate() {
            x.store(100 + i as u32, std::sync::atomic::Ordering::Relaxed);
        }
    })
    .unwrap();
    d.synchronize_stream(s).unwrap();
    assert_eq!(d.read_words(a, 4).unwrap(), vec![100, 101, 102, 103]);

    d.unmap(a, GRAN).unwrap();
    d.unmap(b, GRAN).unwrap();
    d.release_physical(h).unwrap();
    d.free_va(a, GRAN).unwrap();
    d.free_va(b, GRAN).unwrap();
}

/// A handle maps only whole, as on the driver: a part of it, at offset 0
/// or not, is refused as unsupported and maps nothing.
#[test]
fn a_handle_maps_only_whole() {
    let d = device(1 << 30);
    let va = d.reserve_va(4 * GRAN, 0).unwrap();
    let h = d
        .create_physical(2 * GRAN, PhysicalOptions::default())
        .unwrap();
    for (size, offset) in [(GRAN, GRAN), (GRAN, 0)] {
        assert!(matches!(
            d.map(va, size, h, offset),
            Err(SysError::Unsupported { op: Op::Map, .. })
        ));
    }
    assert_eq!(d.live_mappings(), 0);
    d.map(va + 2 * GRAN as u64, 2 * GRAN, h, 0).unwrap();
    d.set_access(va + 2 * GRAN as u64, 2 * GRAN, &rw()).unwrap();
    d.write_words(va + 3 * GRAN as u64, &[42]).unwrap();
    assert_eq!(d.read_words(va + 3 * GRAN as u64, 1).unwrap(), vec![42]);
    d.unmap(va + 2 * GRAN as u64, 2 * GRAN).unwrap();
    d.release_physical(h).unwrap();
}

#[test]
fn unmapped_and_not_yet_accessible_memory_is_not_reachable() {
    let d = device(1 << 30);
    let va = d.reserve_va(2 * GRAN, 0).unwrap();
    // Reserved but not mapped.
    assert!(is_invalid(d.read_words(va, 1), Op::LaunchHost));
    let h = d.create_physical(GRAN, PhysicalOptions::default()).unwrap();
    d.map(va, GRAN, h, 0).unwrap();
    // Mapped but no access yet: like the driver, a fresh mapping is unusable.
    assert!(is_invalid(d.write_words(va, &[1]), Op::LaunchHost));
    assert!(is_invalid(d.read_words(va, 1), Op::LaunchHost));
    let (tx, rx) = mpsc::channel();
    d.launch_on_words(d.default_stream(), va, 4, move |w| {
        tx.send(w.is_err()).unwrap();
    })
    .unwrap();
    assert!(rx.recv().unwrap(), "launch before set_access must see Err");

    d.set_access(va, GRAN, &rw()).unwrap();
    d.write_words(va, &[5]).unwrap();
    // A range running past the mapping into unmapped VA is refused.
    assert!(is_invalid(
        d.read_words(va + GRAN as u64 - 4, 2),
        Op::LaunchHost
    ));
    // Misaligned word access is refused.
    assert!(is_invalid(d.read_words(va + 2, 1), Op::LaunchHost));

    d.unmap(va, GRAN).unwrap();
    assert!(is_invalid(d.read_words(va, 1), Op::LaunchHost));
    let (tx, rx) = mpsc::channel();
    d.launch_on_words(d.default_stream(), va, 4, move |w| {
        tx.send(w.is_err()).unwrap();
    })
    .unwrap();
    assert!(rx.recv().unwrap(), "launch after unmap must see Err");

    // A fresh mapping of the same handle starts again without access, and
    // still holds the data (physical memory outlives the mapping).
    d.map(va, GRAN, h, 0).unwrap();
    assert!(d.read_words(va, 1).is_err());
    d.set_access(
        va,
        GRAN,
        &[AccessDesc {
            device: 0,
            access: Access::Read,
        }],
    )
    .unwrap();
    assert_eq!(d.read_words(va, 1).unwrap(), vec![5]);
    // Read-only: reads work, writes and launches are refused.
    assert!(is_invalid(d.write_words(va, &[6]), Op::LaunchHost));
    // Access back to None.
    d.set_access(
        va,
        GRAN,
        &[AccessDesc {
            device: 0,
            access: Access::None,
        }],
    )
    .unwrap();
    assert!(d.read_words(va, 1).is_err());
}

#[test]
fn capacity_exhaustion_is_out_of_memory_and_nothing_leaks() {
    let cap = 64 * MIB;
    let d = device(cap);
    let mut handles = Vec::new();
    for _ in 0..cap / GRAN {
        handles.push(d.create_physical(GRAN, PhysicalOptions::default()).unwrap());
    }
    assert_eq!(d.mem_info().unwrap().free, 0);
    match d.create_physical(GRAN, PhysicalOptions::default()) {
        Err(SysError::OutOfMemory {
            op: Op::CreatePhysical,
            requested,
            available,
        }) => assert_eq!((requested, available), (GRAN, 0)),
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    // Free half, then a request bigger than what is left names both sizes.
    for h in handles.drain(..16) {
        d.release_physical(h).unwrap();
    }
    assert_eq!(d.mem_info().unwrap().free, 32 * MIB);
    match d.create_physical(34 * MIB, PhysicalOptions::default()) {
        Err(SysError::OutOfMemory {
            requested,
            available,
            ..
        }) => assert_eq!((requested, available), (34 * MIB, 32 * MIB)),
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    let big = d
        .create_physical(32 * MIB, PhysicalOptions::default())
        .unwrap();
    d.release_physical(big).unwrap();
    for h in handles {
        d.release_physical(h).unwrap();
    }
    let info = d.mem_info().unwrap();
    assert_eq!((info.free, info.total), (cap, cap));
    assert_eq!(d.live_handles(), 0);
}

#[test]
fn released_handle_lives_on_while_mapped() {
    let d = device(16 * MIB);
    let va = d.reserve_va(GRAN, 0).unwrap();
    let h = d.create_physical(GRAN, PhysicalOptions::default()).unwrap();
    d.map(va, GRAN, h, 0).unwrap();
    d.set_access(va, GRAN, &rw()).unwrap();
    d.write_words(va, &[9]).unwrap();
    d.release_physical(h).unwrap();
    // Like cuMemRelease: the handle is gone, the memory is not.
    assert_eq!(d.read_words(va, 1).unwrap(), vec![9]);
    assert_eq!(d.mem_info().unwrap().free, 16 * MIB - GRAN);
    assert!(matches!(
        d.map(va, GRAN, h, 0),
        Err(SysError::InvalidHandle { op: Op::Map, .. })
    ));
    d.unmap(va, GRAN).unwrap();
    assert_eq!(d.mem_info().unwrap().free, 16 * MIB);
    d.free_va(va, GRAN).unwrap();
}

#[test]
fn bad_vm_calls_return_errors() {
    let d = device(1 << 30);
    let g = GRAN as u64;
    let va = d.reserve_va(4 * GRAN, 0).unwrap();
    let h = d
        .create_physical(2 * GRAN, PhysicalOptions::default())
        .unwrap();

    // Unmapping a range that was never mapped.
    assert!(is_invalid(d.unmap(va, GRAN), Op::Unmap));
    // Misaligned pointer, size, offset; zero size.
    assert!(is_invalid(d.map(va + 4096, GRAN, h, 0), Op::Map));
    assert!(is_invalid(d.map(va, GRAN + 4096, h, 0), Op::Map));
    assert!(is_invalid(d.map(va, GRAN, h, 4096), Op::Map));
    assert!(is_invalid(d.map(va, 0, h, 0), Op::Map));
    // Offset + size beyond the handle.
    assert!(is_invalid(d.map(va, 2 * GRAN, h, GRAN), Op::Map));
    // Outside any reservation, and straddling the reservation's end.
    assert!(is_invalid(d.map(va + 4 * g, 2 * GRAN, h, 0), Op::Map));
    assert!(is_invalid(d.map(va + 3 * g, 2 * GRAN, h, 0), Op::Map));
    assert!(is_invalid(d.map(g, 2 * GRAN, h, 0), Op::Map));
    // An unknown handle.
    assert!(matches!(
        d.map(va, GRAN, tidepool_sys::Physical(u64::MAX), 0),
        Err(SysError::InvalidHandle { op: Op::Map, .. })
    ));

    d.map(va, 2 * GRAN, h, 0).unwrap();
    // Mapping onto mapped pages.
    assert!(is_invalid(d.map(va + g, 2 * GRAN, h, 0), Op::Map));
    assert!(is_invalid(d.map(va, 2 * GRAN, h, 0), Op::Map));
    // Unmapping part of a mapping, or more than it.
    assert!(is_invalid(d.unmap(va, GRAN), Op::Unmap));
    assert!(is_invalid(d.unmap(va + g, GRAN), Op::Unmap));
    assert!(is_invalid(d.unmap(va, 3 * GRAN), Op::Unmap));
    // set_access on part of a mapping, on unmapped pages, for another device,
    // with no descriptor.
    assert!(is_invalid(d.set_access(va, GRAN, &rw()), Op::SetAccess));
    assert!(is_invalid(d.set_access(va, 3 * GRAN, &rw()), Op::SetAccess));
    assert!(is_invalid(
        d.set_access(
            va,
            2 * GRAN,
            &[AccessDesc {
                device: 1,
                access: Access::ReadWrite
            }]
        ),
        Op::SetAccess
    ));
    assert!(is_invalid(d.set_access(va, 2 * GRAN, &[]), Op::SetAccess));
    // free_va of a reservation that still holds mappings, or of a wrong size.
    assert!(is_invalid(d.free_va(va, 4 * GRAN), Op::FreeVa));
    assert!(is_invalid(d.free_va(va, 2 * GRAN), Op::FreeVa));
    // The failed calls changed nothing: the mapping is still there, whole.
    assert_eq!(d.live_mappings(), 1);
    d.set_access(va, 2 * GRAN, &rw()).unwrap();
    d.unmap(va, 2 * GRAN).unwrap();
    // Unmapping twice.
    assert!(is_invalid(d.unmap(va, 2 * GRAN), Op::Unmap));

    // Releasing twice, and an unknown handle.
    d.release_physical(h).unwrap();
    assert!(matches!(
        d.release_physical(h),
        Err(SysError::InvalidHandle {
            op: Op::ReleasePhysical,
            ..
        })
    ));
    d.free_va(va, 4 * GRAN).unwrap();
    // Freed VA is no longer a reservation.
    assert!(is_invalid(d.free_va(va, 4 * GRAN), Op::FreeVa));
    let h2 = d.create_physical(GRAN, PhysicalOptions::default()).unwrap();
    assert!(is_invalid(d.map(va, GRAN, h2, 0), Op::Map));
    // Bad reservations.
    assert!(is_invalid(d.reserve_va(GRAN + 1, 0), Op::ReserveVa));
    assert!(is_invalid(d.reserve_va(0, 0), Op::ReserveVa));
    assert!(is_invalid(d.reserve_va(GRAN, 3 * GRAN), Op::ReserveVa));
    // Bad physical sizes.
    assert!(is_invalid(
        d.create_physical(4096, PhysicalOptions::default()),
        Op::CreatePhysical
    ));
}

#[test]
fn set_access_spans_several_whole_mappings() {
    let d = device(1 << 30);
    let va = d.reserve_va(3 * GRAN, 0).unwrap();
    for i in 0..3u64 {
        let h = d.create_physical(GRAN, PhysicalOptions::default()).unwrap();
        d.map(va + i * GRAN as u64, GRAN, h, 0).unwrap();
    }
    d.set_access(va, 3 * GRAN, &rw()).unwrap();
    // A word range that crosses mapping boundaries is reachable.
    let at = va + GRAN as u64 - 4;
    d.write_words(at, &[1, 2]).unwrap();
    assert_eq!(d.read_words(at, 2).unwrap(), vec![1, 2]);
    // Unmap must still go mapping by mapping.
    assert!(d.unmap(va, 3 * GRAN).is_err());
    for i in 0..3u64 {
        d.unmap(va + i * GRAN as u64, GRAN).unwrap();
    }
}

#[test]
fn reservations_honour_alignment() {
    let d = device(1 << 30);
    let align = 64 * MIB;
    let mut vas = Vec::new();
    for _ in 0..4 {
        let va = d.reserve_va(GRAN, align).unwrap();
        assert_eq!(va % align as u64, 0);
        vas.push(va);
    }
    assert_eq!(d.live_reservations(), 4);
    for va in vas {
        d.free_va(va, GRAN).unwrap();
    }
    assert_eq!(d.live_reservations(), 0);
}

#[test]
fn export_and_import_share_memory() {
    let d = device(1 << 30);
    let plain = d.create_physical(GRAN, PhysicalOptions::default()).unwrap();
    assert!(is_invalid(d.export_fd(plain), Op::ExportHandle));
    let h = d
        .create_physical(GRAN, PhysicalOptions { exportable: true })
        .unwrap();
    let fd = d.export_fd(h).unwrap();
    let too_big = d.export_fd(h).unwrap();
    assert!(is_invalid(d.import_fd(too_big, 2 * GRAN), Op::ImportHandle));
    let imported = d.import_fd(fd, GRAN).unwrap();
    assert_ne!(imported, h);

    let va = d.reserve_va(2 * GRAN, 0).unwrap();
    d.map(va, GRAN, h, 0).unwrap();
    d.map(va + GRAN as u64, GRAN, imported, 0).unwrap();
    d.set_access(va, 2 * GRAN, &rw()).unwrap();
    d.write_words(va + 8, &[77]).unwrap();
    assert_eq!(d.read_words(va + GRAN as u64 + 8, 1).unwrap(), vec![77]);
    // Imported memory does not count against this device's capacity.
    assert_eq!(d.mem_info().unwrap().free, (1 << 30) - 2 * GRAN);
}

#[test]
fn creation_touches_no_pages() {
    // 512 MiB of "device memory" created and mapped costs no RAM until used:
    // the default 64 GiB capacity relies on this.
    let d = device(1 << 30);
    let before = rss_kib();
    let va = d.reserve_va(512 * MIB, 0).unwrap();
    let h = d
        .create_physical(512 * MIB, PhysicalOptions::default())
        .unwrap();
    d.map(va, 512 * MIB, h, 0).unwrap();
    d.set_access(va, 512 * MIB, &rw()).unwrap();
    let after = rss_kib();
    assert!(
        after.saturating_sub(before) < 64 * 1024,
        "rss grew from {before} KiB to {after} KiB"
    );
}

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

#[test]
fn many_handles_and_drop_cleans_up() {
    // More handles than the default fd soft limit of 1,024: the device raises
    // it at construction (when the hard limit allows).
    let hard = rustix::process::getrlimit(rustix::process::Resource::Nofile).maximum;
    let n = if hard.is_none_or(|h| h >= 8192) {
        3000
    } else {
        200
    };
    let g = 64 * 1024;
    let d2 = HostDevice::with_config(HostConfig {
        capacity: n * g,
        granularity: g,
    });
    let va = d2.reserve_va(n * g, 0).unwrap();
    for i in 0..n {
        let h = d2.create_physical(g, PhysicalOptions::default()).unwrap();
        d2.map(va + (i * g) as u64, g, h, 0).unwrap();
        if i % 2 == 0 {
            d2.release_physical(h).unwrap();
        }
    }
    assert_eq!(d2.mem_info().unwrap().free, 0);
    assert_eq!(d2.live_mappings(), n);
    drop(d2); // unmaps, frees the VA, closes every memfd; must not panic
}
