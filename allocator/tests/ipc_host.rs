//! IPC on the host backend (memfd handles, shared-memory interprocess
//! events): two and four processes, tags verified both ways, and misuse.

mod share_common;

use share_common::{child, is_child, root, Mem};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use tidepool::{ExportedAllocation, MemPool, PoolConfig, PoolError};
use tidepool_sys::{Device, DevicePtr, HostConfig, HostDevice, Stream};

const PAGE: usize = 2 << 20;

fn host() -> Arc<HostDevice> {
    Arc::new(HostDevice::with_config(HostConfig {
        capacity: 256 << 20,
        granularity: PAGE,
    }))
}

impl Mem for HostDevice {
    fn put(&self, ptr: DevicePtr, words: &[u32]) {
        self.write_words(ptr, words).expect("write words");
    }
    fn get(&self, ptr: DevicePtr, count: usize) -> Vec<u32> {
        self.read_words(ptr, count).expect("read words")
    }
    fn fill_async(&self, stream: Stream, ptr: DevicePtr, value: u32, count: usize) {
        self.launch_on_words(stream, ptr, count * 4, move |w| {
            for x in w.expect("mapped with access") {
                x.store(value, Ordering::Relaxed);
            }
        })
        .expect("launch fill");
    }
}

#[test]
fn two_processes() {
    if is_child() {
        return child(host());
    }
    root("two_processes", host(), 2);
}

#[test]
fn four_processes() {
    if is_child() {
        return child(host());
    }
    root("four_processes", host(), 4);
}

fn exportable_pool(dev: &Arc<HostDevice>) -> MemPool<HostDevice> {
    MemPool::new(
        dev.clone(),
        PoolConfig::default()
            .with_va_size(1 << 30)
            .with_exportable(true),
    )
    .expect("pool")
}

/// What a device holds, to show a failed call lost and leaked nothing.
fn footprint(dev: &HostDevice) -> (usize, usize, usize) {
    (
        dev.live_handles(),
        dev.live_mappings(),
        dev.live_reservations(),
    )
}

#[test]
fn import_after_the_exporter_freed_is_refused() {
    if is_child() {
        return;
    }
    let (exp_dev, imp_dev) = (host(), host());
    let exporter = exportable_pool(&exp_dev);
    let importer = exportable_pool(&imp_dev);
    let s = exp_dev.create_stream().unwrap();
    let a = exporter.alloc_async(PAGE + 4096, s).unwrap();
    let exported = exporter.export(&a).unwrap();
    exporter.free_async(a, s).expect("free with no import");
    let before = footprint(&imp_dev);
    let err = importer.import(exported).expect_err("import after free");
    assert!(matches!(err, PoolError::ExportClosed { .. }), "{err:?}");
    assert_eq!(
        footprint(&imp_dev),
        before,
        "the failed import left something behind"
    );
    assert_eq!(importer.live_imports(), 0);
}

#[test]
fn double_release_is_a_typed_error() {
    if is_child() {
        return;
    }
    let (exp_dev, imp_dev) = (host(), host());
    let exporter = exportable_pool(&exp_dev);
    let importer = exportable_pool(&imp_dev);
    let s = exp_dev.create_stream().unwrap();
    let a = exporter.alloc_async(3 * PAGE, s).unwrap();
    let before = footprint(&imp_dev);
    let imp = importer.import(exporter.export(&a).unwrap()).unwrap();
    let ptr = imp.ptr();
    assert_eq!(exporter.outstanding_imports(&a), 1);
    importer.release_import_ptr(ptr).expect("first release");
    let err = importer
        .release_import_ptr(ptr)
        .expect_err("second release");
    assert_eq!(err, PoolError::NotImported { ptr });
    // The lease was given back exactly once.
    assert_eq!(exporter.outstanding_imports(&a), 0);
    assert_eq!(footprint(&imp_dev), before);
    exporter.free_async(a, s).expect("free after release");
}

#[test]
fn descriptor_of_another_export_is_refused() {
    if is_child() {
        return;
    }
    let (exp_dev, imp_dev) = (host(), host());
    let p1 = exportable_pool(&exp_dev);
    let p2 = exportable_pool(&exp_dev);
    let importer = exportable_pool(&imp_dev);
    let other = exportable_pool(&imp_dev);
    let s = exp_dev.create_stream().unwrap();
    let a = p1.alloc_async(PAGE, s).unwrap();
    let b = p2.alloc_async(PAGE, s).unwrap();
    let ea = p1.export(&a).unwrap();
    let eb = p2.export(&b).unwrap();
    let before = footprint(&imp_dev);
    // A's descriptor with B's descriptors (same shape, another pool).
    let mixed = ExportedAllocation {
        descriptor: ea.descriptor.clone(),
        fds: eb.fds,
    };
    let err = importer.import(mixed).expect_err("mixed export");
    assert!(matches!(err, PoolError::BadDescriptor { .. }), "{err:?}");
    assert_eq!(footprint(&imp_dev), before);
    assert_eq!(
        p2.outstanding_imports(&b),
        0,
        "a refused import holds no lease"
    );
    // Garbage is refused too.
    let junk = ExportedAllocation {
        descriptor: vec![7; 64],
        fds: Vec::new(),
    };
    assert!(matches!(
        importer.import(junk),
        Err(PoolError::BadDescriptor { .. })
    ));
    // Releasing through another pool than the importer: refused, and the
    // import survives to be released by its own pool.
    let imp = importer.import(ea).unwrap();
    let ptr = imp.ptr();
    let err = other.release_import(imp).expect_err("wrong pool");
    assert_eq!(err, PoolError::WrongPool { ptr });
    assert_eq!(p1.outstanding_imports(&a), 1);
    importer
        .release_import_ptr(ptr)
        .expect("release by its pool");
    p1.free_async(a, s).unwrap();
    p2.free_async(b, s).unwrap();
}

#[test]
fn free_of_an_imported_allocation_is_refused_and_loses_nothing() {
    if is_child() {
        return;
    }
    let (exp_dev, imp_dev) = (host(), host());
    let exporter = exportable_pool(&exp_dev);
    let importer = exportable_pool(&imp_dev);
    let s = exp_dev.create_stream().unwrap();
    let a = exporter.alloc_async(PAGE, s).unwrap();
    let addr = a.ptr();
    let imp = importer.import(exporter.export(&a).unwrap()).unwrap();
    imp_dev.write_words(imp.ptr(), &[0xfeed_beef]).unwrap();
    let err = exporter.free_async(a, s).expect_err("free while imported");
    assert!(
        matches!(err.error, PoolError::ExportInUse { imports: 1, .. }),
        "{:?}",
        err.error
    );
    let a = err.allocation;
    assert_eq!(a.ptr(), addr);
    // The memory is still shared and still the allocation's: a new
    // allocation does not get it.
    let b = exporter.alloc_async(PAGE, s).unwrap();
    assert_ne!(b.ptr(), addr);
    exp_dev.synchronize_stream(s).unwrap();
    assert_eq!(exp_dev.read_words(addr, 1).unwrap(), vec![0xfeed_beef]);
    importer.release_import(imp).unwrap();
    exporter.free_async(a, s).expect("free after release");
    exporter.free_async(b, s).unwrap();
}

#[test]
fn export_needs_an_exportable_pool() {
    if is_child() {
        return;
    }
    let dev = host();
    let pool = MemPool::new(dev.clone(), PoolConfig::default().with_va_size(1 << 30)).unwrap();
    let s = dev.create_stream().unwrap();
    let a = pool.alloc_async(4096, s).unwrap();
    assert!(matches!(
        pool.export(&a),
        Err(PoolError::NotExportable { .. })
    ));
    pool.free_async(a, s).unwrap();
}

#[test]
fn interprocess_event_orders_streams_in_one_process() {
    if is_child() {
        return;
    }
    let dev = host();
    let (a, b) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let (ev, handle) = dev.create_ipc_event().unwrap();
    // Never recorded: complete, and a wait is a no-op.
    assert!(dev.query_ipc_event(ev).unwrap());
    let opened = dev.open_ipc_event(handle).unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    dev.launch_host(
        a,
        Box::new(move || {
            let _ = rx.recv();
        }),
    )
    .unwrap();
    dev.record_ipc_event(ev, a).unwrap();
    assert!(
        !dev.query_ipc_event(opened).unwrap(),
        "record not reached yet"
    );
    let seen = Arc::new(AtomicU32::new(0));
    dev.wait_ipc_event(b, opened).unwrap();
    let s2 = seen.clone();
    dev.launch_host(b, Box::new(move || s2.store(1, Ordering::SeqCst)))
        .unwrap();
    // b cannot pass the wait while a is held.
    assert!(!dev.query_stream(b).unwrap());
    assert_eq!(seen.load(Ordering::SeqCst), 0);
    drop(tx);
    dev.synchronize_stream(b).unwrap();
    assert_eq!(seen.load(Ordering::SeqCst), 1);
    assert!(dev.query_ipc_event(ev).unwrap());
    dev.destroy_ipc_event(opened).unwrap();
    dev.destroy_ipc_event(ev).unwrap();
    assert!(dev.destroy_ipc_event(ev).is_err());
}

#[test]
fn dropping_the_importing_pool_releases_its_imports() {
    if is_child() {
        return;
    }
    let (exp_dev, imp_dev) = (host(), host());
    let exporter = exportable_pool(&exp_dev);
    let s = exp_dev.create_stream().unwrap();
    let a = exporter.alloc_async(2 * PAGE, s).unwrap();
    let before = footprint(&imp_dev);
    {
        let importer = exportable_pool(&imp_dev);
        let imp = importer.import(exporter.export(&a).unwrap()).unwrap();
        assert_eq!(exporter.outstanding_imports(&a), 1);
        // Never released: the pool is dropped with the import live.
        let _unreleased = imp;
    }
    assert_eq!(exporter.outstanding_imports(&a), 0);
    assert_eq!(footprint(&imp_dev), before);
    exporter
        .free_async(a, s)
        .expect("free after the importer went");
}

/// Stitching and trimming in the exporter while an import is live never
/// move the exported pages: both mappings keep seeing each other's writes.
#[test]
fn exported_pages_stay_put_under_stitching_and_trim() {
    if is_child() {
        return;
    }
    let (exp_dev, imp_dev) = (host(), host());
    let exporter = MemPool::new(
        exp_dev.clone(),
        PoolConfig::default()
            .with_va_size(1 << 30)
            .with_exportable(true)
            .with_max_size(10 * PAGE as u64),
    )
    .unwrap();
    let importer = exportable_pool(&imp_dev);
    let s = exp_dev.create_stream().unwrap();
    let a = exporter.alloc_async(2 * PAGE, s).unwrap();
    let imp = importer.import(exporter.export(&a).unwrap()).unwrap();
    // Fill the rest, free every other block, then a block only stitching
    // can place, then trim: pressure on every page that is free to move.
    let blocks: Vec<_> = (0..8)
        .map(|_| exporter.alloc_async(PAGE, s).unwrap())
        .collect();
    let mut keep = Vec::new();
    for (i, b) in blocks.into_iter().enumerate() {
        if i % 2 == 0 {
            exporter.free_async(b, s).unwrap();
        } else {
            keep.push(b);
        }
    }
    exporter.synchronize().unwrap();
    let remaps = exporter.stats().remaps;
    let big = exporter.alloc_async(4 * PAGE, s).unwrap();
    assert!(exporter.stats().remaps > remaps, "stitched");
    exporter.free_async(big, s).unwrap();
    for b in keep {
        exporter.free_async(b, s).unwrap();
    }
    exporter.synchronize().unwrap();
    assert!(exporter.trim_to(0).unwrap() > 0, "trimmed");
    let words = 2 * PAGE / 4;
    let pattern: Vec<u32> = (0..words as u32).map(|i| i ^ 0x5a5a_0000).collect();
    exp_dev.write_words(a.ptr(), &pattern).unwrap();
    assert_eq!(imp_dev.read_words(imp.ptr(), words).unwrap(), pattern);
    imp_dev.write_words(imp.ptr() + 4, &[0xabcd]).unwrap();
    assert_eq!(exp_dev.read_words(a.ptr() + 4, 1).unwrap(), vec![0xabcd]);
    importer.release_import(imp).unwrap();
    exporter.free_async(a, s).unwrap();
}
