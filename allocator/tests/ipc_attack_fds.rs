//! No file descriptor and no mapping outlives export, send, receive,
//! import, release, refused imports and interprocess events. One test in
//! its own binary, so that no other test's thread (whose stack is a
//! mapping) or descriptor comes and goes meanwhile.

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use tidepool::{ExportedAllocation, MemPool, PoolConfig, PoolError};
use tidepool_sys::{Device, HostConfig, HostDevice};

const PAGE: usize = 2 << 20;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .count()
}

fn mappings() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .expect("/proc/self/maps")
        .lines()
        .count()
}

fn host() -> Arc<HostDevice> {
    Arc::new(HostDevice::with_config(HostConfig {
        capacity: 64 << 20,
        granularity: PAGE,
    }))
}

/// Everything once, in two pools of two devices that are dropped at the end.
fn cycle() {
    let (exp_dev, imp_dev) = (host(), host());
    let cfg = PoolConfig::default()
        .with_va_size(1 << 30)
        .with_exportable(true);
    let exporter = MemPool::new(exp_dev.clone(), cfg.clone()).unwrap();
    let importer = MemPool::new(imp_dev.clone(), cfg).unwrap();
    let s = exp_dev.create_stream().unwrap();
    let a = exporter.alloc_async(3 * PAGE, s).unwrap();
    let (tx, rx) = UnixStream::pair().unwrap();
    for _ in 0..3 {
        exporter.export(&a).unwrap().send(&tx).unwrap();
    }
    let good = ExportedAllocation::recv(&rx).unwrap();
    let imp = importer.import(good).unwrap();
    // Refused imports: a corrupted descriptor, fds of the wrong number.
    let mut bad = ExportedAllocation::recv(&rx).unwrap();
    bad.descriptor[40] ^= 1;
    assert!(matches!(
        importer.import(bad),
        Err(PoolError::BadDescriptor { .. })
    ));
    let mut bad = ExportedAllocation::recv(&rx).unwrap();
    bad.fds.pop();
    assert!(importer.import(bad).is_err());
    // A refused free, then the release and the free.
    let a = exporter.free_async(a, s).expect_err("imported").allocation;
    importer.release_import(imp).unwrap();
    exporter.free_async(a, s).unwrap();
    // An interprocess event sent over the socket and opened.
    let (ev, handle) = exp_dev.create_ipc_event().unwrap();
    let fds: Vec<_> = handle.fd.iter().map(|f| f.as_fd()).collect();
    tidepool_sys::ipc::send_message(&tx, &handle.bytes, &fds).unwrap();
    let (bytes, mut fds) = tidepool_sys::ipc::recv_message(&rx).unwrap();
    let opened = imp_dev
        .open_ipc_event(tidepool_sys::IpcEventHandle {
            bytes,
            fd: fds.pop(),
        })
        .unwrap();
    exp_dev.record_ipc_event(ev, s).unwrap();
    imp_dev.synchronize_ipc_event(opened).unwrap();
    imp_dev.destroy_ipc_event(opened).unwrap();
    exp_dev.destroy_ipc_event(ev).unwrap();
    exp_dev.synchronize_stream(s).unwrap();
    exp_dev.destroy_stream(s).unwrap();
}

#[test]
fn nothing_leaks_descriptors_or_mappings() {
    every_step_once_leaks_nothing();
    repeated_exports_of_one_allocation_do_not_pile_up();
}

fn every_step_once_leaks_nothing() {
    cycle(); // warm-up: lazily made statics, allocator arenas
    let (fds, maps) = (open_fds(), mappings());
    for _ in 0..5 {
        cycle();
    }
    assert_eq!(open_fds(), fds, "file descriptors leaked");
    // A little slack for a stream thread whose stack the kernel has not
    // yet unmapped; a leak per round would be five or more.
    assert!(
        mappings() <= maps + 4,
        "mappings leaked: {} after five rounds, {maps} before",
        mappings()
    );
}

/// Exporting one live allocation again and again (say, once per training
/// step to every rank) must not pile up a descriptor and a mapping per
/// export in the exporting process until the allocation is freed.
fn repeated_exports_of_one_allocation_do_not_pile_up() {
    let dev = host();
    let pool = MemPool::new(
        dev.clone(),
        PoolConfig::default()
            .with_va_size(1 << 30)
            .with_exportable(true),
    )
    .unwrap();
    let imp_dev = host();
    let importer =
        MemPool::new(imp_dev.clone(), PoolConfig::default().with_va_size(1 << 30)).unwrap();
    let s = dev.create_stream().unwrap();
    let a = pool.alloc_async(2 * PAGE, s).unwrap();
    // Warm-up: the first export and import make what is made once.
    let imp = importer.import(pool.export(&a).unwrap()).unwrap();
    importer.release_import(imp).unwrap();
    let (fds, maps) = (open_fds(), mappings());
    for i in 0..2000 {
        let e = pool.export(&a).unwrap();
        if i % 100 == 0 {
            let imp = importer.import(e).unwrap();
            importer.release_import(imp).unwrap();
        }
    }
    assert!(
        open_fds() <= fds + 2,
        "{} descriptors open after 2000 exports, {fds} before",
        open_fds()
    );
    // A little slack for the allocator's own arenas; a mapping per export
    // would be 2000 more.
    assert!(
        mappings() <= maps + 16,
        "{} mappings after 2000 exports, {maps} before",
        mappings()
    );
    pool.free_async(a, s).unwrap();
}
