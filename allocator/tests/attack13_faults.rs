//! Device failures while the pool stitches and grows, in a capped pool with
//! a checkerboard of idle pages and a free pending on a busy stream: each
//! run fails one call (the k-th `create_physical`, `map`, `set_access` or
//! `unmap`, every k the clean run reaches) and checks that
//! - the call that met it returns a typed error carrying the injected
//!   failure (no panic, no out-of-memory in its place),
//! - the same request, asked again, succeeds: the failure lost no memory
//!   under the cap,
//! - no two live blocks overlap, tags written into every block survive,
//!   the pending free's pages are never unmapped under its work,
//! - after everything is freed, used bytes are zero, trimming gives back
//!   every byte, and the dropped pool leaves no handle or mapping behind.

mod common;

use common::*;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use tidepool::{Allocation, MemPool, PoolError};
use tidepool_sys::{Device, FaultInjector, HostDevice, Op, Stream, SysError};

type Dev = FaultInjector<HostDevice>;

const CAP_PAGES: usize = 12;

fn is_injected(e: &PoolError) -> bool {
    format!("{e:?}").contains("Injected")
}

struct Run {
    _busy: Option<Blocker>,
    dev: Arc<Dev>,
    pool: MemPool<Dev>,
    live: Vec<(Allocation, u32, Stream)>,
    checks: Vec<Receiver<bool>>,
    injected: usize,
    tag: u32,
}

impl Run {
    fn words(&self, a: &Allocation) -> usize {
        (a.size() / 4).min(1024)
    }

    fn alloc(&mut self, size: usize, s: Stream, what: &str) {
        let a = match self.pool.alloc_async(size, s) {
            Ok(a) => a,
            Err(e) => {
                assert!(is_injected(&e), "{what}: failed without a fault: {e}");
                self.injected += 1;
                self.pool
                    .alloc_async(size, s)
                    .unwrap_or_else(|e| panic!("{what}: the retry after a fault failed: {e}"))
            }
        };
        for (b, _, _) in &self.live {
            assert!(
                a.ptr() + a.size() as u64 <= b.ptr() || b.ptr() + b.size() as u64 <= a.ptr(),
                "{what}: overlaps a live block"
            );
        }
        self.tag += 1;
        let n = self.words(&a);
        self.checks
            .push(tag_kernel(self.dev.inner(), s, a.ptr(), n, self.tag));
        self.live.push((a, self.tag, s));
    }

    /// Check the tag of live block `i` in stream order on `on`, then free it there.
    fn free(&mut self, i: usize, on: Stream) {
        let (a, tag, _) = self.live.remove(i);
        let (tx, rx) = std::sync::mpsc::channel();
        let n = self.words(&a) * 4;
        self.dev
            .inner()
            .launch_on_words(on, a.ptr(), n, move |r: Result<&[AtomicU32], _>| {
                let _ =
                    tx.send(r.is_ok_and(|w| w.iter().all(|x| x.load(Ordering::Relaxed) == tag)));
            })
            .unwrap();
        self.checks.push(rx);
        self.pool.free_async(a, on).unwrap();
    }

    fn trim(&mut self, to: u64) {
        if let Err(e) = self.pool.trim_to(to) {
            assert!(is_injected(&e), "trim failed without a fault: {e}");
            self.injected += 1;
            self.pool.trim_to(to).unwrap();
        }
    }
}

/// The workload; `fault`: which call to fail. Returns the calls of each
/// swept op made by the run, and how many faults reached a caller.
fn workload(fault: Option<(Op, u64)>) -> (Vec<u64>, usize) {
    let host = host_with_capacity(CAP_PAGES * PAGE);
    let dev = Arc::new(FaultInjector::new(host));
    let pool = MemPool::new(
        dev.clone(),
        config()
            .with_max_size((CAP_PAGES * PAGE) as u64)
            .with_stream_cache_bytes(0),
    )
    .unwrap();
    let (a, b, c) = (
        dev.create_stream().unwrap(),
        dev.create_stream().unwrap(),
        dev.create_stream().unwrap(),
    );
    if let Some((op, k)) = fault {
        dev.fail_nth(op, k, SysError::Injected { op, call: k });
    }
    let mut r = Run {
        _busy: None,
        dev: dev.clone(),
        pool,
        live: Vec::new(),
        checks: Vec::new(),
        injected: 0,
        tag: 0,
    };
    // Ten pages of whole-page blocks; every other one freed and completed:
    // five idle pages scattered through the zone.
    for i in 0..10 {
        r.alloc(PAGE, a, &format!("page block {i}"));
    }
    for i in (0..5).rev() {
        r.free(2 * i, a);
    }
    r.pool.synchronize_stream(a).unwrap();
    // A block freed on a busy stream: its page must stay where it is.
    let busy = Blocker::on(&*r.dev, c);
    r._busy = Some(busy);
    r.free(0, c);
    // Stitching: four idle pages into one window for another stream.
    r.alloc(4 * PAGE, b, "stitched 8 MiB");
    // The last idle page plus growth up to the cap.
    r.alloc(3 * PAGE, b, "stitch and grow 6 MiB");
    // Small blocks on another page's worth of room.
    r.free(0, a);
    r.pool.synchronize_stream(a).unwrap();
    for i in 0..6 {
        r.alloc(300_000, a, &format!("small {i}"));
    }
    // Free the stitched block, trim, and place a big (page-aligned) one.
    let k = r
        .live
        .iter()
        .position(|(x, _, _)| x.size() == 4 * PAGE)
        .unwrap();
    r.free(k, b);
    r.pool.synchronize_stream(b).unwrap();
    r.trim(0);
    r.alloc(4 * PAGE - 4096, b, "medium after trim");
    // Everything back.
    r._busy = None;
    while !r.live.is_empty() {
        let s = r.live[0].2;
        r.free(0, s);
    }
    r.pool.synchronize().unwrap();
    for (i, rx) in r.checks.drain(..).enumerate() {
        assert!(
            rx.recv().unwrap(),
            "tag check {i}: memory overwritten or unmapped"
        );
    }
    let st = r.pool.stats();
    assert_eq!(st.used_current, 0);
    assert_eq!(st.allocs, st.frees);
    r.trim(0);
    assert_eq!(r.pool.stats().reserved_current, 0, "memory lost");
    let injected = r.injected;
    let calls = [Op::CreatePhysical, Op::Map, Op::SetAccess, Op::Unmap]
        .map(|op| dev.calls(op))
        .to_vec();
    drop(r);
    dev.clear();
    assert_eq!(dev.inner().live_handles(), 0, "physical handles leaked");
    assert_eq!(dev.inner().live_mappings(), 0, "mappings leaked");
    (calls, injected)
}

#[test]
fn every_fault_while_stitching_and_growing_is_typed_and_loses_nothing() {
    use std::io::Write;
    let (calls, _) = workload(None);
    let ops = [Op::CreatePhysical, Op::Map, Op::SetAccess, Op::Unmap];
    let mut line = String::new();
    for (i, op) in ops.iter().enumerate() {
        let n = calls[i].min(40);
        let mut reached = 0;
        for k in 1..=n {
            let (_, injected) = workload(Some((*op, k)));
            reached += injected;
        }
        line += &format!("{op:?}: {n} positions, {reached} faults reached a caller; ");
    }
    let _ = writeln!(std::io::stderr().lock(), "{line}");
    assert!(
        calls.iter().all(|&c| c > 0),
        "the workload makes every swept call: {calls:?}"
    );
}
