//! Device failures while the pool creates, maps, moves, trims and releases
//! physical units of several pages (`PoolConfig::max_unit_size`). One
//! workload (units created by growth, a free unit moved into a larger
//! block, a partly used unit kept by trim, whole units trimmed, a unit
//! reactivated at its ghost) is run once clean, to count each device call,
//! then once for every k-th call of `create_physical`, `map`,
//! `set_access`, `unmap` and `release_physical` made to fail. Every run
//! checks that
//! - the failing call returns a typed error that carries the injected
//!   failure (no panic, no out-of-memory in its place), and the same call
//!   asked again succeeds (the failure lost nothing under the cap);
//! - no two live blocks overlap and words written into every page of
//!   every live block survive;
//! - after everything is freed: used bytes 0, `trim_to(0)` leaves nothing
//!   reserved and the device holds no handle; the dropped pool leaves no
//!   mapping behind.

mod common;

use std::sync::Arc;
use tidepool::{Allocation, MemPool, PoolConfig, PoolError};
use tidepool_sys::{Device, FaultInjector, HostConfig, HostDevice, Op, Stream, SysError};

const MIB: usize = 1 << 20;
const PAGE: usize = 2 * MIB;
type Dev = FaultInjector<HostDevice>;

fn is_injected(e: &PoolError) -> bool {
    format!("{e:?}").contains("Injected")
}

struct Run {
    dev: Arc<Dev>,
    pool: MemPool<Dev>,
    s: Stream,
    live: Vec<(Allocation, u32)>,
    tag: u32,
    injected: usize,
}

impl Run {
    fn new() -> Run {
        let dev = Arc::new(FaultInjector::new(HostDevice::with_config(HostConfig {
            capacity: 64 * MIB,
            granularity: PAGE,
        })));
        let pool = MemPool::new(
            dev.clone(),
            PoolConfig::default()
                .with_va_size(1 << 30)
                .with_max_unit_size(8 * MIB)
                .with_unit_min_block(4 * MIB)
                .with_max_size(48 * MIB as u64)
                .with_stream_cache_bytes(0),
        )
        .expect("pool");
        let s = dev.create_stream().expect("stream");
        Run {
            dev,
            pool,
            s,
            live: Vec::new(),
            tag: 0,
            injected: 0,
        }
    }

    fn retry<T>(&mut self, what: &str, mut f: impl FnMut(&Self) -> Result<T, PoolError>) -> T {
        match f(self) {
            Ok(v) => v,
            Err(e) => {
                assert!(is_injected(&e), "{what}: failed without a fault: {e}");
                self.injected += 1;
                f(self).unwrap_or_else(|e| panic!("{what}: the retry after a fault failed: {e}"))
            }
        }
    }

    fn alloc(&mut self, size: usize, what: &str) -> u64 {
        let s = self.s;
        let a = self.retry(what, |r| r.pool.alloc_async(size, s));
        for (b, _) in &self.live {
            assert!(
                a.ptr() + a.size() as u64 <= b.ptr() || b.ptr() + b.size() as u64 <= a.ptr(),
                "{what}: overlaps a live block"
            );
        }
        self.tag += 1;
        let inner = self.dev.inner();
        for (j, w) in common::page_end_words(&a).into_iter().enumerate() {
            inner
                .write_words(w, &[self.tag << 16 | j as u32])
                .unwrap_or_else(|e| panic!("{what}: page of the new block not usable: {e}"));
        }
        let ptr = a.ptr();
        self.live.push((a, self.tag));
        ptr
    }

    fn check_all(&self, what: &str) {
        let inner = self.dev.inner();
        for (a, tag) in &self.live {
            for (j, w) in common::page_end_words(a).into_iter().enumerate() {
                let got = inner
                    .read_words(w, 1)
                    .unwrap_or_else(|e| panic!("{what}: a live block's page was unmapped: {e}"));
                assert_eq!(
                    got,
                    vec![tag << 16 | j as u32],
                    "{what}: a live block's data changed"
                );
            }
        }
    }

    fn free(&mut self, ptr: u64, what: &str) {
        self.check_all(what);
        let i = self
            .live
            .iter()
            .position(|(a, _)| a.ptr() == ptr)
            .expect("live");
        let (a, _) = self.live.remove(i);
        // A free is bookkeeping only: it must not fail on a device fault.
        self.pool.free_async(a, self.s).expect(what);
        self.retry(what, |r| r.pool.synchronize());
        self.check_all(what);
    }

    fn trim(&mut self, to: u64, what: &str) {
        self.retry(what, |r| r.pool.trim_to(to));
        self.check_all(what);
    }

    fn workload(&mut self) {
        let a = self.alloc(8 * MIB, "a unit of four pages");
        let b = self.alloc(20 * MIB, "units of four, four and two pages");
        self.alloc(MIB, "a small block");
        self.free(a, "free the first unit");
        // The free unit moves whole into a larger block.
        let d = self.alloc(16 * MIB, "a larger block takes the free unit");
        self.free(b, "free the 20 MiB block");
        // Blocks on some of the freed units: partly used units.
        self.alloc(3 * MIB, "a block on freed units");
        self.alloc(5 * MIB, "another block on freed units");
        self.trim(8 * MIB as u64, "trim with partly used units");
        self.free(d, "free the 16 MiB block");
        self.alloc(12 * MIB, "a block after the trim");
        self.trim(0, "trim to nothing");
        // Back at an earlier place: units come back to their ghosts.
        self.alloc(16 * MIB, "a block at the freed place");
        while let Some(ptr) = self.live.last().map(|(a, _)| a.ptr()) {
            self.free(ptr, "free what is left");
        }
    }

    fn finish(self, what: &str) {
        let st = self.pool.stats();
        assert_eq!(st.used_current, 0, "{what}: used after freeing everything");
        self.dev.clear();
        self.pool.trim_to(0).unwrap();
        assert_eq!(self.pool.stats().reserved_current, 0, "{what}: reserved");
        assert_eq!(self.dev.inner().live_handles(), 0, "{what}: handles left");
        let dev = self.dev.clone();
        drop(self.pool);
        assert_eq!(dev.inner().live_mappings(), 0, "{what}: mappings left");
    }
}

#[test]
fn every_unit_call_failing_once_loses_nothing() {
    let ops = [
        Op::CreatePhysical,
        Op::Map,
        Op::SetAccess,
        Op::Unmap,
        Op::ReleasePhysical,
    ];
    // The clean run: how many calls of each op the workload makes.
    let mut clean = Run::new();
    let before: Vec<u64> = ops.iter().map(|&op| clean.dev.calls(op)).collect();
    clean.workload();
    let counts: Vec<u64> = ops
        .iter()
        .zip(&before)
        .map(|(&op, b)| clean.dev.calls(op) - b)
        .collect();
    assert!(clean.pool.stats().growths >= 4, "units were created");
    assert_eq!(clean.injected, 0);
    clean.finish("clean run");
    let mut total = 0;
    let mut reached = Vec::new();
    for (&op, &n) in ops.iter().zip(&counts) {
        let mut hits = 0;
        assert!(n > 0, "the workload makes no {op:?} call");
        for k in 1..=n {
            let mut r = Run::new();
            r.dev.fail_nth(op, k, SysError::Injected { op, call: k });
            r.workload();
            total += r.injected;
            hits += r.injected;
            r.finish(&format!("{op:?} call {k} of {n}"));
        }
        reached.push((op, n, hits));
    }
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr().lock(),
        "calls and faults seen by the user: {reached:?}"
    );
    assert!(total > 0, "no fault reached the pool");
}

#[test]
fn device_out_of_memory_while_creating_a_unit_is_reported_and_lost_nothing() {
    // The k-th creation fails with the device's own out-of-memory: the
    // request reports out-of-memory (not a device error) and the pool
    // holds no more than before the request.
    for k in 1..=6u64 {
        let mut r = Run::new();
        let a = r.alloc(8 * MIB, "a unit");
        r.free(a, "free it");
        let held = r.pool.stats().reserved_current;
        r.dev.fail_nth(
            Op::CreatePhysical,
            k,
            SysError::OutOfMemory {
                op: Op::CreatePhysical,
                requested: 8 * MIB,
                available: 0,
            },
        );
        let got = r.pool.alloc_async(30 * MIB, r.s);
        match got {
            Ok(a) => {
                // The fault came after this request: fine.
                r.pool.free_async(a, r.s).unwrap();
            }
            Err(e @ PoolError::OutOfMemory(_)) => {
                assert!(
                    r.pool.stats().reserved_current <= held,
                    "k {k}: a failed request grew the pool: {} > {held}",
                    r.pool.stats().reserved_current
                );
                assert!(e.to_string().contains("out of memory"), "{e}");
            }
            Err(e) => panic!("k {k}: not an out-of-memory: {e}"),
        }
        r.pool.synchronize().unwrap();
        r.finish(&format!("k {k}"));
    }
}

/// Persistent failures: from the k-th call on, every call of the op fails
/// until the next step of the workload is over; calls that fail must fail
/// with a typed error carrying the fault (never a panic, never another
/// error), and once the device answers again the pool ends as clean as
/// ever: no block lost, nothing in use, everything released.
#[test]
fn persistent_failures_of_each_unit_call_leave_the_pool_usable() {
    let ops = [
        Op::CreatePhysical,
        Op::Map,
        Op::SetAccess,
        Op::Unmap,
        Op::ReleasePhysical,
    ];
    for op in ops {
        for k in 1..=4u64 {
            let r = Run::new();
            let s = r.s;
            let mut live: Vec<Allocation> = Vec::new();
            let steps: [(usize, bool); 8] = [
                (8 * MIB, false),
                (20 * MIB, false),
                (0, true),
                (16 * MIB, false),
                (3 * MIB, false),
                (0, true),
                (12 * MIB, false),
                (0, true),
            ];
            r.dev.fail_from(op, k, SysError::Injected { op, call: k });
            for (i, &(size, trim)) in steps.iter().enumerate() {
                let res = if trim {
                    if let Some(a) = live.pop() {
                        r.pool
                            .free_async(a, s)
                            .expect("a free never fails on a fault");
                    }
                    r.pool
                        .synchronize()
                        .and_then(|_| r.pool.trim_to(0))
                        .map(|_| ())
                } else {
                    r.pool.alloc_async(size, s).map(|a| live.push(a))
                };
                if let Err(e) = res {
                    assert!(
                        is_injected(&e),
                        "{op:?} from call {k}, step {i}: an error other than the fault: {e}"
                    );
                }
            }
            r.dev.clear();
            for a in live.drain(..) {
                r.pool.free_async(a, s).unwrap();
            }
            r.pool.synchronize().unwrap();
            r.finish(&format!("{op:?} failing from call {k}"));
        }
    }
}
