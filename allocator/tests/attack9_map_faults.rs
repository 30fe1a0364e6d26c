//! Device failures in the middle of the slow path's mapping (the
//! `create_physical`, `map` or `set_access` of a growth, a stitch or a
//! move), each followed not by the same request again but by the next
//! request of a random sequence, of another size: the state the failed
//! call left in the arena's reused work vectors must never leak into it.
//! Capped pools (device capacity and `max_size`), with and without units
//! of several pages, one stream whose frees stay pending behind a hold
//! for part of each phase. Every step checks that
//! - a failed request returns a typed error carrying the injected fault
//!   (or out-of-memory, under the cap) and keeps at most its own pages
//!   reserved (the pages gathered stay the pool's, as spare pages);
//! - no two live blocks overlap and the words written into every page of
//!   every live block survive;
//! - at the end, with everything freed, `trim_to(0)` leaves nothing
//!   reserved and the device holds no handle; the dropped pool no mapping.
//!
//! Work is bounded by operation counts.

mod common;

use common::{page_end_words, Blocker, Rng};
use std::sync::Arc;
use tidepool::{Allocation, MemPool, PoolConfig, PoolError, ReusePolicy};
use tidepool_sys::{Device, FaultInjector, HostConfig, HostDevice, Op, Stream, SysError};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const PAGE: usize = 2 * MIB;
type Dev = FaultInjector<HostDevice>;

fn is_injected(e: &PoolError) -> bool {
    format!("{e:?}").contains("Injected")
}

struct Live {
    a: Allocation,
    tag: u32,
    stream: Stream,
}

fn check_all(dev: &Dev, live: &[Live], what: &str) {
    for l in live {
        for (j, w) in page_end_words(&l.a).into_iter().enumerate() {
            let got = dev
                .inner()
                .read_words(w, 1)
                .unwrap_or_else(|e| panic!("{what}: a live block's page is unmapped: {e}"));
            assert_eq!(
                got[0],
                l.tag << 12 | j as u32,
                "{what}: a live block's data changed"
            );
        }
    }
}

fn run(cfg: PoolConfig, seed: u64, op: Op, period: u64) -> usize {
    let dev = Arc::new(FaultInjector::new(HostDevice::with_config(HostConfig {
        capacity: 64 * MIB,
        granularity: PAGE,
    })));
    let pool = MemPool::new(dev.clone(), cfg).expect("pool");
    let s = dev.create_stream().expect("stream");
    let h = dev.create_stream().expect("stream");
    let mut rng = Rng(seed);
    let mut live: Vec<Live> = Vec::new();
    let mut tag = 0u32;
    let mut injected = 0;
    for phase in 0..6 {
        // h's frees in this phase stay pending until the phase ends.
        let hold = Blocker::on(dev.inner(), h);
        for step in 0..40 {
            let what = format!("seed {seed} {op:?}/{period} phase {phase} step {step}");
            if !live.is_empty() && rng.range(0, 99) < 45 {
                let i = rng.range(0, live.len() as u64 - 1) as usize;
                let l = live.swap_remove(i);
                pool.free_async(l.a, l.stream).expect("a free never fails");
                check_all(&dev, &live, &what);
                continue;
            }
            let size = match rng.range(0, 3) {
                0 => rng.log_range(512, 256 * KIB as u64) as usize,
                1 => rng.log_range(MIB as u64, 6 * MIB as u64) as usize,
                _ => rng.log_range(6 * MIB as u64, 24 * MIB as u64) as usize,
            };
            let stream = if rng.range(0, 2) == 0 { h } else { s };
            let before = pool.stats().reserved_current;
            dev.fail_nth(op, period, SysError::Injected { op, call: period });
            let got = pool.alloc_async(size, stream);
            dev.clear();
            match got {
                Ok(a) => {
                    for l in &live {
                        assert!(
                            a.ptr() + a.size() as u64 <= l.a.ptr()
                                || l.a.ptr() + l.a.size() as u64 <= a.ptr(),
                            "{what}: {size} B overlaps a live block"
                        );
                    }
                    tag += 1;
                    for (j, w) in page_end_words(&a).into_iter().enumerate() {
                        dev.inner()
                            .write_words(w, &[tag << 12 | j as u32])
                            .unwrap_or_else(|e| panic!("{what}: new block not usable: {e}"));
                    }
                    live.push(Live { a, tag, stream });
                }
                Err(e) => {
                    assert!(
                        is_injected(&e) || e.is_out_of_memory(),
                        "{what}: {size} B failed without a fault: {e}"
                    );
                    injected += usize::from(is_injected(&e));
                    let after = pool.stats().reserved_current;
                    // The pages gathered for a failed request stay the
                    // pool's as spare pages (a trim gives them back), but
                    // never more than the request's own pages.
                    assert!(
                        after <= before + size.next_multiple_of(PAGE) as u64,
                        "{what}: a failed {size} B request kept memory: {before} -> {after} B"
                    );
                }
            }
            check_all(&dev, &live, &what);
        }
        drop(hold);
        pool.synchronize().expect("sync");
        check_all(&dev, &live, "after the phase");
    }
    for l in live.drain(..) {
        pool.free_async(l.a, l.stream).expect("free");
    }
    pool.synchronize().expect("sync");
    assert_eq!(pool.stats().used_current, 0);
    pool.trim_to(0).expect("trim");
    assert_eq!(
        pool.stats().reserved_current,
        0,
        "reserved after trim_to(0)"
    );
    assert_eq!(dev.inner().live_handles(), 0, "handles left");
    drop(pool);
    assert_eq!(dev.inner().live_mappings(), 0, "mappings left");
    injected
}

fn configs() -> Vec<(&'static str, PoolConfig)> {
    let base = PoolConfig::default()
        .with_va_size(1 << 30)
        .with_max_size(48 * MIB as u64)
        .with_reuse(ReusePolicy {
            wait_for_pending_frees: false,
            ..ReusePolicy::default()
        });
    vec![
        ("single pages", base.clone()),
        (
            "units",
            base.clone()
                .with_max_unit_size(8 * MIB)
                .with_unit_min_block(4 * MIB),
        ),
        (
            "small units, no cache",
            base.with_max_unit_size(4 * MIB)
                .with_unit_min_block(2 * MIB)
                .with_stream_cache_bytes(0),
        ),
    ]
}

#[test]
fn a_failed_mapping_leaves_nothing_for_the_next_request() {
    let mut injected = 0;
    for (name, cfg) in configs() {
        for op in [Op::CreatePhysical, Op::Map, Op::SetAccess] {
            for (seed, period) in [(1u64, 1u64), (2, 2), (3, 3), (4, 5)] {
                let n = run(cfg.clone(), seed * 0x9E37_79B9 + 7, op, period);
                assert!(n > 0 || period > 1, "{name} {op:?}: no fault was met");
                injected += n;
            }
        }
    }
    assert!(injected > 50, "only {injected} faults met");
}
