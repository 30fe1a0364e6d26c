//! The pool never waits on the host while holding its arena lock: the
//! device work being waited for may itself need the pool (a host callback,
//! or another thread the work depends on), and would then never finish.

mod common;

use common::*;
use std::sync::mpsc::channel;
use std::sync::Arc;
use std::time::Duration;
use tidepool::ReusePolicy;
use tidepool_sys::{Device, FaultInjector, Op};

/// Rule: the last-resort host wait for pending frees (step 8) holds no
/// lock. The work on stream A that the waiting allocation needs to finish
/// calls `pool.stats()`, which takes the arena lock: were the lock held
/// through the wait, that work could not finish before the wait's bound
/// and the allocation would fail with out-of-memory.
#[test]
fn host_wait_for_pending_frees_holds_no_lock() {
    let dev = Arc::new(FaultInjector::new(host()));
    // The bound only matters when the rule is broken (the wait then runs
    // out); a correct pool returns as soon as the work completes.
    let cfg = config()
        .with_max_size(PAGE as u64)
        .with_stream_cache_bytes(0)
        .with_last_resort_wait(Duration::from_secs(30));
    let pool = pool(&dev, cfg);
    pool.set_reuse(ReusePolicy {
        internal_dependencies: false,
        wait_for_pending_frees: true,
        ..pool.reuse()
    });
    let s = streams(&*dev, 2);
    let (a, b) = (s[0], s[1]);
    let x = pool.alloc_async(PAGE, a).unwrap();
    // Work on A: waits for `go`, then uses the pool.
    let (go, wait) = channel::<()>();
    let user = pool.clone();
    dev.launch_host(
        a,
        Box::new(move || {
            let _ = wait.recv();
            let _ = user.stats();
        }),
    )
    .unwrap();
    // The whole cap is now a free pending behind that work.
    pool.free_async(x, a).unwrap();
    let before = dev.calls(Op::QueryEvent);
    let waiter = {
        let pool = pool.clone();
        std::thread::spawn(move || pool.alloc_async(PAGE, b))
    };
    // Steps 1-8 query A's event once each pass before waiting; several
    // more queries mean the waiter is polling in step 8's wait.
    while dev.calls(Op::QueryEvent) < before + 4 && !waiter.is_finished() {
        std::thread::yield_now();
    }
    go.send(()).unwrap();
    let y = waiter.join().unwrap().expect(
        "the waiting allocation gets the free once A's work, which uses the pool, completes",
    );
    assert_eq!(
        pool.stats().growths,
        1,
        "served by the freed page, not growth"
    );
    pool.free_async(y, b).unwrap();
}
