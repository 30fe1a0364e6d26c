//! Strict and announced capture checking, on the host backend (it
//! simulates capture: a stream put in capture with the raw device call
//! answers "capturing" to the capture query, as the driver does).
//!
//! Counting the capture queries with the fault wrapper shows what each
//! mode costs per call: strict mode asks once per allocation and free;
//! announced mode with no capture announced asks nothing.

use std::sync::Arc;
use tidepool::{MemPool, PoolConfig};
use tidepool_sys::{CaptureMode, Device, FaultInjector, HostConfig, HostDevice, Op};

type Dev = FaultInjector<HostDevice>;

fn setup() -> (Arc<Dev>, MemPool<Dev>) {
    let dev = Arc::new(FaultInjector::new(HostDevice::with_config(HostConfig {
        capacity: 16 << 20,
        granularity: 2 << 20,
    })));
    let pool = MemPool::new(dev.clone(), PoolConfig::default().with_va_size(64 << 20)).unwrap();
    (dev, pool)
}

/// `n` same-stream pairs; returns the capture queries they made.
fn pairs(dev: &Dev, pool: &MemPool<Dev>, s: tidepool_sys::Stream, n: u64) -> u64 {
    let before = dev.calls(Op::IsCapturing);
    for _ in 0..n {
        let a = pool.alloc_async(4096, s).unwrap();
        pool.free_async(a, s).unwrap();
    }
    dev.calls(Op::IsCapturing) - before
}

#[test]
fn strict_mode_asks_every_call_and_sees_a_raw_capture() {
    let (dev, pool) = setup();
    let (s, c) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    assert_eq!(
        pairs(&dev, &pool, s, 10),
        20,
        "one query per alloc and per free"
    );
    dev.begin_capture(c, CaptureMode::Relaxed).unwrap();
    let g = pool
        .alloc_async(4096, c)
        .expect("a capturing stream is served");
    assert!(
        g.is_graph_memory(),
        "served with graph memory, not the pool's"
    );
    pool.free_async(g, c).unwrap();
    let _ = dev.end_capture(c);
}

#[test]
fn announced_mode_asks_only_while_a_capture_is_announced() {
    let (dev, pool) = setup();
    let (s, c) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    pool.set_announced_captures(true);
    assert_eq!(pairs(&dev, &pool, s, 10), 0, "no capture query");
    // The caller's contract: a capture begun without an announcement is
    // not seen in announced mode (the block comes from c's own cache).
    let warm = pool.alloc_async(4096, c).unwrap();
    pool.free_async(warm, c).unwrap();
    dev.begin_capture(c, CaptureMode::Relaxed).unwrap();
    let unseen = pool
        .alloc_async(4096, c)
        .expect("unannounced capture is not seen");
    assert!(!unseen.is_graph_memory());
    // Announced: every call asks again, and the capturing stream is
    // served with graph memory.
    pool.begin_announced_capture(c);
    assert_eq!(pool.announced_captures(), 1);
    let g = pool.alloc_async(4096, c).unwrap();
    assert!(g.is_graph_memory());
    pool.free_async(g, c).unwrap();
    assert_eq!(pairs(&dev, &pool, s, 3), 6, "queries while announced");
    let _ = dev.end_capture(c);
    pool.end_announced_capture(c);
    assert_eq!(pool.announced_captures(), 0);
    pool.free_async(unseen, c).unwrap();
    assert_eq!(pairs(&dev, &pool, s, 10), 0, "no query once it ended");
    // An unmatched end is ignored: the count never wraps to "announced".
    pool.end_announced_capture(c);
    assert_eq!(pool.announced_captures(), 0);
    assert_eq!(pairs(&dev, &pool, s, 2), 0);
    // Back to strict mode.
    pool.set_announced_captures(false);
    assert_eq!(pairs(&dev, &pool, s, 2), 4);
}
