//! A block freed on stream A and still in A's private cache is reusable on
//! stream B once B waited, through the pool, on an event recorded on A
//! after the free — and only the blocks that event covers. A's work is kept
//! pending (a blocked host task) throughout, so no block can come to B by
//! completion instead.

use std::sync::{mpsc, Arc};
use tidepool::{MemPool, PoolConfig, ReusePolicy};
use tidepool_sys::{Device, HostConfig, HostDevice, Stream};

const SIZE: usize = 4096;

fn setup() -> (Arc<HostDevice>, MemPool<HostDevice>, Stream, Stream) {
    let dev = Arc::new(HostDevice::with_config(HostConfig {
        capacity: 16 << 20,
        granularity: 2 << 20,
    }));
    let pool = MemPool::new(dev.clone(), PoolConfig::default().with_va_size(64 << 20)).unwrap();
    let (a, b) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    (dev, pool, a, b)
}

/// Block `stream` until the returned sender is dropped or sent to.
fn block(dev: &HostDevice, stream: Stream) -> mpsc::Sender<()> {
    let (tx, rx) = mpsc::channel::<()>();
    dev.launch_host(
        stream,
        Box::new(move || {
            let _ = rx.recv();
        }),
    )
    .unwrap();
    tx
}

#[test]
fn a_wait_gives_b_the_blocks_a_freed_before_the_event_and_no_later_one() {
    let (dev, pool, a, b) = setup();
    let x = pool.alloc_async(SIZE, a).unwrap();
    let y = pool.alloc_async(SIZE, a).unwrap();
    let (x_ptr, y_ptr) = (x.ptr(), y.ptr());
    let release = block(&dev, a);
    pool.free_async(x, a).unwrap();
    let ev = pool.record_event(a).unwrap();
    pool.wait_event(b, &ev).unwrap();
    // Freed after the event: B is not ordered after this free's work.
    pool.free_async(y, a).unwrap();
    let first = pool.alloc_async(SIZE, b).unwrap();
    assert_eq!(first.ptr(), x_ptr, "B takes the block the event covers");
    let second = pool.alloc_async(SIZE, b).unwrap();
    assert_ne!(
        second.ptr(),
        y_ptr,
        "B must not get a block freed after the event"
    );
    assert!(!dev.query_stream(a).unwrap(), "A's work is still pending");
    drop(release);
    for (alloc, s) in [(first, b), (second, b)] {
        pool.free_async(alloc, s).unwrap();
    }
    pool.synchronize().unwrap();
    assert_eq!(pool.stats().used_current, 0);
}

#[test]
fn no_wait_or_no_follow_switch_no_block() {
    for follow in [true, false] {
        let (dev, pool, a, b) = setup();
        pool.set_reuse(ReusePolicy {
            follow_event_dependencies: follow,
            ..pool.reuse()
        });
        let x = pool.alloc_async(SIZE, a).unwrap();
        let x_ptr = x.ptr();
        let release = block(&dev, a);
        pool.free_async(x, a).unwrap();
        let ev = pool.record_event(a).unwrap();
        if !follow {
            // Waited, but the pool may not follow the dependency.
            pool.wait_event(b, &ev).unwrap();
        }
        let y = pool.alloc_async(SIZE, b).unwrap();
        assert_ne!(y.ptr(), x_ptr, "follow={follow}");
        drop(release);
        pool.free_async(y, b).unwrap();
        pool.synchronize().unwrap();
    }
}
