//! IPC on the CUDA backend, across processes (the test binary itself as
//! the child): POSIX-fd handles, `CU_EVENT_INTERPROCESS` events, tags
//! verified both ways, misuse. Skips (with a printed reason) where no CUDA
//! driver is loadable; fails then if `TIDEPOOL_REQUIRE_GPU=1`.

mod share_common;

use share_common::{child, is_child, root, skip, Mem};
use std::sync::Arc;
use tidepool::{MemPool, PoolConfig, PoolError};
use tidepool_sys::cuda::{driver_available, driver_unavailable_reason, CudaDevice};
use tidepool_sys::{Device, DevicePtr, Stream};

impl Mem for CudaDevice {
    fn put(&self, ptr: DevicePtr, words: &[u32]) {
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        self.copy_htod(ptr, &bytes).expect("copy to device");
    }
    fn get(&self, ptr: DevicePtr, count: usize) -> Vec<u32> {
        let mut bytes = vec![0u8; count * 4];
        self.copy_dtoh(&mut bytes, ptr).expect("copy from device");
        bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }
    fn fill_async(&self, stream: Stream, ptr: DevicePtr, value: u32, count: usize) {
        self.memset_d32_async(stream, ptr, value, count)
            .expect("memset");
    }
}

fn gpu(test: &str) -> Option<Arc<CudaDevice>> {
    if !driver_available() {
        let reason = driver_unavailable_reason().unwrap_or_default();
        if std::env::var("TIDEPOOL_REQUIRE_GPU").as_deref() == Ok("1") {
            panic!("{test}: TIDEPOOL_REQUIRE_GPU=1 but no CUDA driver: {reason}");
        }
        skip(test, &format!("no CUDA driver: {reason}"));
        return None;
    }
    Some(Arc::new(CudaDevice::new(0).expect("CUDA device 0")))
}

#[test]
fn cuda_two_processes() {
    let Some(dev) = gpu("cuda_two_processes") else {
        return;
    };
    if is_child() {
        return child(dev);
    }
    root("cuda_two_processes", dev, 2);
}

#[test]
fn cuda_four_processes() {
    let Some(dev) = gpu("cuda_four_processes") else {
        return;
    };
    if is_child() {
        return child(dev);
    }
    root("cuda_four_processes", dev, 4);
}

/// Misuse in one process, with a second pool standing in for the
/// importing process (the driver maps its own exported handles too).
#[test]
fn cuda_misuse_is_typed_and_loses_nothing() {
    if is_child() {
        return;
    }
    let Some(dev) = gpu("cuda_misuse_is_typed_and_loses_nothing") else {
        return;
    };
    let cfg = PoolConfig::default()
        .with_va_size(1 << 30)
        .with_exportable(true);
    let exporter = MemPool::new(dev.clone(), cfg.clone()).unwrap();
    let importer = MemPool::new(dev.clone(), cfg.clone()).unwrap();
    let s = dev.create_stream().unwrap();
    let page = dev.granularity();
    // Import after the exporter freed.
    let a = exporter.alloc_async(page + 4096, s).unwrap();
    let e = exporter.export(&a).unwrap();
    exporter.free_async(a, s).unwrap();
    assert!(matches!(
        importer.import(e),
        Err(PoolError::ExportClosed { .. })
    ));
    assert_eq!(importer.live_imports(), 0);
    // Free refused while imported; tags both ways through two mappings.
    let a = exporter.alloc_async(2 * page, s).unwrap();
    dev.synchronize_stream(s).unwrap();
    dev.put(a.ptr(), &[1, 2, 3]);
    let imp = importer.import(exporter.export(&a).unwrap()).unwrap();
    assert_eq!(dev.get(imp.ptr(), 3), vec![1, 2, 3]);
    dev.put(imp.ptr() + 8, &[9]);
    assert_eq!(dev.get(a.ptr(), 3), vec![1, 2, 9]);
    let err = exporter.free_async(a, s).expect_err("imported");
    assert!(matches!(
        err.error,
        PoolError::ExportInUse { imports: 1, .. }
    ));
    let a = err.allocation;
    // Double release.
    let ptr = imp.ptr();
    importer.release_import(imp).unwrap();
    assert_eq!(
        importer.release_import_ptr(ptr),
        Err(PoolError::NotImported { ptr })
    );
    exporter.free_async(a, s).unwrap();
    // A descriptor with another export's file descriptors.
    let other = MemPool::new(dev.clone(), cfg).unwrap();
    let x = exporter.alloc_async(page, s).unwrap();
    let y = other.alloc_async(page, s).unwrap();
    let ex = exporter.export(&x).unwrap();
    let ey = other.export(&y).unwrap();
    let mixed = tidepool::ExportedAllocation {
        descriptor: ex.descriptor,
        fds: ey.fds,
    };
    assert!(matches!(
        importer.import(mixed),
        Err(PoolError::BadDescriptor { .. })
    ));
    exporter.free_async(x, s).unwrap();
    other.free_async(y, s).unwrap();
    exporter.synchronize().unwrap();
}
