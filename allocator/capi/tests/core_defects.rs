//! Defects found through the C ABI whose cause was in the pool itself, kept
//! as regression tests at the core's own API.

use std::sync::Arc;
use tidepool_core::{Device, MemPool, PoolConfig, Stream};
use tidepool_sys::{HostConfig, HostDevice};

fn host_pool() -> (Arc<HostDevice>, MemPool<HostDevice>) {
    let dev = Arc::new(HostDevice::with_config(HostConfig {
        capacity: 16 << 20,
        ..HostConfig::default()
    }));
    let pool = MemPool::new(dev.clone(), PoolConfig::default().with_va_size(64 << 20)).unwrap();
    (dev, pool)
}

/// `record_use_raw` (and `record_use`) note any stream without asking the
/// device whether it exists. The free then records an event on that stream,
/// fails with a device error, puts the allocation back, and every later
/// free of it fails the same way: the memory can never be freed.
#[test]
fn record_use_of_an_unknown_stream_leaves_the_allocation_freeable() {
    let (dev, pool) = host_pool();
    let s = dev.default_stream();
    let ptr = pool.alloc_raw(1 << 20, s).unwrap();
    let unknown = Stream(0xdead_beef);
    // Refusing the stream or ignoring it at the free would both do; what
    // must not happen is an allocation that can no longer be freed.
    let noted = pool.record_use_raw(ptr, unknown);
    if let Err(e) = pool.free_raw(ptr, s) {
        panic!("after record_use_raw on {unknown} (which gave {noted:?}) the free fails: {e}");
    }
}

/// The same through a retired stream: retired streams are refused for
/// allocation, but a use on one is still noted.
#[test]
fn record_use_of_a_retired_stream_leaves_the_allocation_freeable() {
    let (dev, pool) = host_pool();
    let s = dev.default_stream();
    let side = dev.create_stream().unwrap();
    let ptr = pool.alloc_raw(1 << 20, s).unwrap();
    pool.retire_stream(side).unwrap();
    dev.destroy_stream(side).unwrap();
    let noted = pool.record_use_raw(ptr, side);
    if let Err(e) = pool.free_raw(ptr, s) {
        panic!("after record_use_raw on retired {side} (which gave {noted:?}) the free fails: {e}");
    }
}

/// A use recorded on a stream that is later retired (and destroyed, as the
/// C ABI's `tidepool_stream_retire` does, and as its raw-stream cache does
/// for a recycled `cudaStream_t`): the free records an event on every use
/// stream, that one no longer exists, the free fails and puts the
/// allocation back, and so every later free fails too. Through PyTorch:
/// `record_stream` on a side stream that is destroyed and whose handle the
/// driver reuses leaks the tensor's memory.
#[test]
fn a_use_on_a_stream_retired_later_does_not_block_the_free() {
    let (dev, pool) = host_pool();
    let s = dev.default_stream();
    let side = dev.create_stream().unwrap();
    let ptr = pool.alloc_raw(1 << 20, s).unwrap();
    pool.record_use_raw(ptr, side).unwrap();
    pool.retire_stream(side).unwrap();
    dev.destroy_stream(side).unwrap();
    if let Err(e) = pool.free_raw(ptr, s) {
        panic!("free after its use stream {side} was retired fails: {e}");
    }
    pool.synchronize().unwrap();
    assert_eq!(pool.stats().used_current, 0);
}

/// The host backend's `is_capturing` looks streams up in a cache shared by
/// every host device in the process, so it answers for a stream of another
/// host device instead of refusing it (its `record_event` does refuse it).
/// Allocation checks capture on every call, so a pool accepts another
/// host pool's stream for an allocation. (The C ABI now tags its stream
/// values per pool and never passes another pool's stream down.)
#[test]
fn host_is_capturing_refuses_a_stream_of_another_device() {
    let (dev_a, _pool_a) = host_pool();
    let (dev_b, _pool_b) = host_pool();
    let s_b = dev_b.create_stream().unwrap();
    assert!(dev_b.is_capturing(s_b).is_ok());
    assert!(
        dev_a
            .record_event(dev_a.create_event().unwrap(), s_b)
            .is_err(),
        "device a records on b's stream"
    );
    assert!(
        dev_a.is_capturing(s_b).is_err(),
        "device a answers is_capturing for {s_b}, a stream of device b"
    );
}
