//! The fast path asks the stream's probe (kept in the pool's entry for the
//! stream) instead of the device: the rules must hold there exactly as on
//! the device path. Each test first makes a pair on the stream, so that
//! the later calls find the entry in this thread's recent entries and take
//! the fast path.

use std::sync::Arc;
use tidepool::{MemPool, PoolConfig, PoolError};
use tidepool_sys::{CaptureMode, Device, HostConfig, HostDevice, SysError};

fn setup() -> (Arc<HostDevice>, MemPool<HostDevice>) {
    let dev = Arc::new(HostDevice::with_config(HostConfig {
        capacity: 16 << 20,
        granularity: 2 << 20,
    }));
    let pool = MemPool::new(dev.clone(), PoolConfig::default().with_va_size(64 << 20)).unwrap();
    (dev, pool)
}

fn invalid_handle(e: &PoolError) -> bool {
    matches!(
        e,
        PoolError::Device(SysError::InvalidHandle { what: "stream", .. })
    )
}

/// Rule: a destroyed stream is refused with a typed error, in announced
/// mode (where the fast path asks the device nothing) as in strict mode,
/// for an allocation and for a free; the refused free hands the
/// allocation back.
#[test]
fn a_destroyed_stream_is_refused_on_the_fast_path_in_both_modes() {
    for announced in [true, false] {
        let (dev, pool) = setup();
        pool.set_announced_captures(announced);
        let (s, other) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
        let a = pool.alloc_async(4096, s).unwrap();
        pool.free_async(a, s).unwrap();
        let kept = pool.alloc_async(4096, s).unwrap();
        pool.synchronize_stream(s).unwrap();
        dev.destroy_stream(s).unwrap();
        let err = pool.alloc_async(4096, s).unwrap_err();
        assert!(
            invalid_handle(&err),
            "announced={announced}: alloc gave {err:?}"
        );
        let failed = pool.free_async(kept, s).unwrap_err();
        assert!(
            invalid_handle(&failed.error),
            "announced={announced}: free gave {:?}",
            failed.error
        );
        // The allocation came back and frees on a live stream.
        pool.free_async(failed.allocation, other).unwrap();
        assert_eq!(pool.stats().used_current, 0);
    }
}

/// Rule: in strict mode the fast path sees a capture begun with the raw
/// device call: an allocation on the capturing stream is graph memory,
/// and a pool block freed inside the capture is refused (and comes back).
#[test]
fn strict_mode_sees_a_raw_capture_on_the_fast_path() {
    let (dev, pool) = setup();
    let s = dev.create_stream().unwrap();
    let a = pool.alloc_async(4096, s).unwrap();
    pool.free_async(a, s).unwrap();
    let eager = pool.alloc_async(4096, s).unwrap();
    dev.begin_capture(s, CaptureMode::Relaxed).unwrap();
    let g = pool.alloc_async(4096, s).unwrap();
    assert!(g.is_graph_memory(), "served with graph memory");
    let failed = pool.free_async(eager, s).unwrap_err();
    assert!(
        matches!(failed.error, PoolError::EagerFreeInCapture { .. }),
        "{:?}",
        failed.error
    );
    pool.free_async(g, s).unwrap();
    let _ = dev.end_capture(s);
    pool.free_async(failed.allocation, s).unwrap();
    assert_eq!(pool.stats().used_current, 0);
}

/// Rule: another device's stream is refused with a typed error (it never
/// gets an entry, so it never reaches the fast path).
#[test]
fn a_foreign_stream_is_refused() {
    let (_dev, pool) = setup();
    let other = Arc::new(HostDevice::new());
    let s = other.create_stream().unwrap();
    for announced in [true, false] {
        pool.set_announced_captures(announced);
        let err = pool.alloc_async(4096, s).unwrap_err();
        assert!(
            matches!(err, PoolError::Device(SysError::ForeignHandle { .. })),
            "{err:?}"
        );
    }
}
