//! Device failures in the queries the pool makes about other streams while
//! it polls watched consumers (`query_stream`, `query_event`,
//! `is_capturing`): a consumer whose state cannot be learnt for a while
//! must neither fail the producer's allocations (they are about another
//! stream), nor have its pending blocks handed out, nor keep them pending
//! for good once the device answers again: after a synchronisation
//! nothing is in use, and `trim_to(0)` gives back every byte.

mod common;

use common::*;
use std::sync::Arc;
use tidepool::{MemPool, PoolConfig, ReusePolicy};
use tidepool_sys::{Device, FaultInjector, Op, SysError};

fn run(op: Op, announced: bool) {
    let dev = Arc::new(FaultInjector::new(host()));
    let pool = MemPool::new(
        dev.clone(),
        PoolConfig::default()
            .with_va_size(4 << 30)
            .with_reuse(ReusePolicy {
                internal_dependencies: false,
                wait_for_pending_frees: false,
                ..ReusePolicy::default()
            }),
    )
    .unwrap();
    pool.set_announced_captures(announced);
    let p = dev.create_stream().unwrap();
    let cs = streams(&*dev, 4);
    let mut hold = Blocker::on(dev.inner(), cs[0]);
    let mut pending = Vec::new();
    let mut errors = Vec::new();
    let mut failed_calls = 0;
    for i in 0..400u64 {
        if i == 100 {
            failed_calls = dev.calls(op);
            dev.fail_from(op, 1, SysError::Injected { op, call: 0 });
        }
        if i == 300 {
            failed_calls = dev.calls(op) - failed_calls;
            dev.clear();
        }
        let a = match pool.alloc_async(4096 << (i % 5), p) {
            Ok(a) => a,
            Err(e) => {
                errors.push(format!("allocation {i}: {e}"));
                continue;
            }
        };
        for &(x, n) in &pending {
            assert!(
                a.ptr() + a.size() as u64 <= x || x + n as u64 <= a.ptr(),
                "{op:?}: allocation {i} got the held consumer's pending block"
            );
        }
        let c = cs[(i % 4) as usize];
        let ev = pool.record_event(p).unwrap();
        pool.wait_event(c, &ev).unwrap();
        if c == cs[0] {
            pending.push((a.ptr(), a.size()));
        }
        pool.free_async(a, c).unwrap();
    }
    assert!(failed_calls > 0, "{op:?}: no call of it failed");
    hold.release();
    pool.synchronize().unwrap();
    let st = pool.stats();
    assert_eq!(st.used_current, 0);
    pool.trim_to(0).unwrap();
    assert_eq!(
        pool.stats().reserved_current,
        0,
        "{op:?}: memory stayed pending after the device answered again"
    );
    assert!(
        errors.is_empty(),
        "{op:?}: a failed query about another stream failed {} of the producer's \
         allocations: {:?}",
        errors.len(),
        errors.iter().take(2).collect::<Vec<_>>()
    );
}

#[test]
fn failing_stream_queries_during_polls() {
    run(Op::QueryStream, false);
}

#[test]
fn failing_event_queries_during_polls() {
    run(Op::QueryEvent, false);
}

/// In announced mode (no capture announced), so that the allocating
/// stream's own capture check, which strict mode makes on every call and
/// whose failure is rightly the allocation's, is not made.
#[test]
fn failing_capture_queries_during_polls() {
    run(Op::IsCapturing, true);
}
