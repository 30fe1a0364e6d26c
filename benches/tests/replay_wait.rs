//! A trace's wait reaches tidepool's pool: after `wait(A, B)` the pool
//! follows the dependency, so a block freed on A while A's work is still
//! running is reusable on B at once (with no wait, B must not get it).
//! Host backend: a host task keeps stream A busy, so A's free stays
//! pending and only the followed event can make it reusable on B.

use std::sync::mpsc;
use std::sync::Arc;
use tidepool_benches::replay::tidepool_alloc::TidepoolAlloc;
use tidepool_benches::replay::ReplayAllocator;
use tidepool_sys::host::HostDevice;
use tidepool_sys::Device;

/// One whole page of the host backend (2 MiB granularity): no other free
/// space of A's page can serve B, so B gets A's block or new memory.
const SIZE: usize = 2 << 20;

/// Allocate on A, keep A busy, free on A, optionally wait(A -> B), then
/// allocate on B; returns whether B got A's block.
fn b_gets_a_block(wait: bool) -> bool {
    let dev = Arc::new(HostDevice::new());
    let mut alloc = TidepoolAlloc::new(dev.clone(), 2).unwrap();
    let a_stream = alloc.streams()[0];
    let x = alloc.alloc(SIZE, 0).unwrap();
    let freed = x.ptr();
    let (release, blocked) = mpsc::channel::<()>();
    dev.launch_host(
        a_stream,
        Box::new(move || {
            let _ = blocked.recv();
        }),
    )
    .unwrap();
    alloc.free(x, 0).unwrap();
    if wait {
        alloc.wait(0, 1).unwrap();
    }
    let y = alloc.alloc(SIZE, 1).unwrap();
    let got = y.ptr();
    release.send(()).unwrap();
    alloc.free(y, 1).unwrap();
    alloc.synchronize().unwrap();
    got == freed
}

#[test]
fn a_wait_lets_the_waiting_stream_reuse_the_pending_free() {
    assert!(b_gets_a_block(true));
}

#[test]
fn without_the_wait_the_pending_free_stays_on_its_stream() {
    assert!(!b_gets_a_block(false));
}
