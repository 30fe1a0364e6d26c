//! Device failures in the middle of a request that moved pages whose
//! frees were pending on the allocating stream (pool-sys's
//! fault-injecting device over the host backend): each `create`, `map`,
//! and `set_access` call of the request fails in turn. After the
//! failure:
//! - nothing is unmapped under the held stream's kernel (it finds the
//!   place it writes mapped, and no held mapping was unmapped);
//! - the freeing stream can still allocate there (the same block, or the
//!   one it failed to get), with no false out-of-memory;
//! - another stream gets nothing its kernel's data could lose to the held
//!   kernel;
//! - once everything ran and was freed, `trim_to(0)` leaves nothing
//!   reserved and the device no handle; the dropped pool no mapping.
//!
//! Work is bounded by operation counts; the stream is held with a gate.

mod common;

use common::{overlaps, write_kernel, Blocker};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use tidepool::{MemPool, ReusePolicy};
use tidepool_sys::{Device, FaultInjector, Op, SysError};

const MIB: usize = 1 << 20;
const PAGE: usize = 2 * MIB;

/// One run: A (three pages) freed on held stream `s` behind a kernel
/// writing it, C (a page) in use on `t` past it, the cap at six pages;
/// `s` asks for five pages (two grown, A's three moved) while the `n`-th
/// call of `op` fails. Returns whether the fault hit the request.
fn run(op: Op, n: u64) -> bool {
    let what = format!("{op:?} #{n}");
    let dev = Arc::new(FaultInjector::new(common::host_with_capacity(64 * MIB)));
    let pool = MemPool::new(
        dev.clone(),
        common::config()
            .with_max_size(6 * PAGE as u64)
            .with_stream_cache_bytes(0)
            .with_reuse(ReusePolicy {
                follow_event_dependencies: true,
                opportunistic: true,
                internal_dependencies: false,
                wait_for_pending_frees: false,
            }),
    )
    .expect("pool");
    let host = dev.inner();
    let s = dev.create_stream().unwrap();
    let t = dev.create_stream().unwrap();
    let mut hold = Blocker::on(host, s);

    let a = pool.alloc_async(6 * MIB, s).unwrap();
    let c = pool.alloc_async(PAGE, t).unwrap();
    let (a_ptr, a_len) = (a.ptr(), a.size());
    let wa = common::pattern(61, a_len / 4);
    let ka = write_kernel(host, s, a_ptr, wa);
    pool.free_async(a, s).unwrap();

    dev.fail_nth(op, n, SysError::Injected { op, call: n });
    let got = pool.alloc_async(9 * MIB, s);
    dev.clear();
    let hit = got.is_err();
    let (moves, bad) = pool.pending_move_counts();
    assert_eq!(bad, 0, "{what}: a held mapping was unmapped");
    assert!(moves >= 3, "{what}: A's pages did not move ({moves})");
    let mut live_s = Vec::new();
    match got {
        Ok(b) => live_s.push(b),
        Err(e) => {
            assert!(
                format!("{e:?}").contains("Injected"),
                "{what}: failed without the fault: {e}"
            );
            assert!(
                host.read_words(a_ptr, 1).is_ok(),
                "{what}: A's old place was unmapped by the failed request"
            );
            // The freeing stream tries again, then takes A's size too:
            // no false out-of-memory (A's pages are still its own).
            let b = pool
                .alloc_async(9 * MIB, s)
                .unwrap_or_else(|e| panic!("{what}: s's request again: {e}"));
            live_s.push(b);
        }
    }
    assert!(!hold.done());
    // Another stream: whatever it gets must not lose its data to s's
    // kernel, and lie off A's old place.
    let mut t_blocks = Vec::new();
    pool.free_async(c, t).unwrap();
    pool.synchronize_stream(t).unwrap();
    for (i, len) in [PAGE, MIB, 6 * MIB].into_iter().enumerate() {
        if let Ok(d) = pool.alloc_async(len, t) {
            assert!(
                !overlaps(d.ptr(), d.size(), a_ptr, a_len),
                "{what}: t got {:#x} over A's old place",
                d.ptr()
            );
            let wd = common::pattern(70 + i as u32, d.size() / 4);
            assert!(write_kernel(host, t, d.ptr(), wd.clone()).recv().unwrap());
            t_blocks.push((d, wd));
        }
    }
    let ws: Vec<Vec<u32>> = live_s
        .iter()
        .enumerate()
        .map(|(i, b)| common::pattern(80 + i as u32, b.size() / 4))
        .collect();
    let ks: Vec<Receiver<bool>> = live_s
        .iter()
        .zip(&ws)
        .map(|(b, w)| write_kernel(host, s, b.ptr(), w.clone()))
        .collect();
    hold.release();
    assert!(ka.recv().unwrap(), "{what}: A's old place was unmapped");
    for k in ks {
        assert!(k.recv().unwrap(), "{what}: s's new block was unmapped");
    }
    pool.synchronize().unwrap();
    for (d, wd) in &t_blocks {
        assert_eq!(
            &host.read_words(d.ptr(), wd.len()).unwrap(),
            wd,
            "{what}: t's block lost its data to s's kernel"
        );
    }
    for (b, w) in live_s.iter().zip(&ws) {
        assert_eq!(&host.read_words(b.ptr(), w.len()).unwrap(), w, "{what}");
    }
    for (d, _) in t_blocks {
        pool.free_async(d, t).unwrap();
    }
    for b in live_s {
        pool.free_async(b, s).unwrap();
    }
    pool.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    assert_eq!(
        pool.stats().reserved_current,
        0,
        "{what}: reserved after trim"
    );
    assert_eq!(host.live_handles(), 0, "{what}: a physical page leaked");
    assert_eq!(pool.pending_move_counts().1, 0, "{what}");
    drop(pool);
    assert_eq!(host.live_mappings(), 0, "{what}: a mapping leaked");
    hit
}

/// Caught: pages of a failed request sent to the spare pages instead of
/// back to where they were (`put_back` ignoring the moves: t got a spare
/// page s's kernel then wrote), and put back with nothing pending (t got
/// A's old place at once).
#[test]
fn a_request_that_moved_pending_pages_fails_at_every_device_call() {
    let mut hits = 0;
    for op in [Op::CreatePhysical, Op::Map, Op::SetAccess] {
        for n in 1..=6 {
            hits += usize::from(run(op, n));
        }
    }
    // Two creates, five maps and five set_access calls at least: most
    // of the faults hit the request.
    assert!(hits >= 10, "only {hits} faults hit the request");
}
