//! Random sequences against a capped pool whose streams are held by
//! gates for whole phases, so that frees stay pending and pages whose
//! frees are pending move (to their own stream, or to one that waited on
//! theirs through the pool). Three streams; blocks written by a "kernel"
//! on their stream when allocated (a word every KiB, at addresses that
//! are multiples of a KiB) and again, with the same words, by every
//! stream declared with `record_use`; frees on the
//! allocating stream, or on another stream ordered after it by a wait
//! made through the pool; trims and reuse switches changed mid-phase.
//! Checked:
//! - every kernel finds the memory it writes mapped, and no held mapping
//!   is ever unmapped;
//! - no two live blocks overlap;
//! - at the end of each phase (all gates open, all work done) every live
//!   block holds exactly its words: a late writer that wrote into memory
//!   another block owns shows there;
//! - then, every free complete, a request of one page less than the
//!   pages no live block touches succeeds (single-page configurations:
//!   such pages can all be stitched into one window): no hold outlives
//!   its frees;
//! - at the end, with everything freed, `trim_to(0)` leaves nothing
//!   reserved and the device no handle; the dropped pool no mapping.
//!
//! Configurations: stream cache off and on, single pages and units of
//! several pages, internal dependencies off and on; each sweep must see
//! pages move while pending. Work is bounded by operation counts.
//!
//! Caught: a mover that takes any page pending on a single stream
//! (`page_pending_for` without the `classify` check: every
//! configuration), and a moved page's bytes activated with nothing
//! pending at the new place (two configurations), and holds that outlive
//! their frees (`held` ignoring completion and holds never dropped: a
//! false out-of-memory in every configuration).

mod common;

use common::Rng;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use tidepool::{Allocation, MemPool, PoolConfig, ReusePolicy};
use tidepool_sys::{HostDevice, Stream};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const PAGE: usize = 2 * MIB;

struct Live {
    a: Allocation,
    tag: u32,
    stream: Stream,
}

/// Bytes between two words a kernel writes: the words lie at addresses
/// that are multiples of this, so a page, wherever it is mapped, carries
/// them at the same offsets, and any two blocks sharing memory share
/// some of them.
const STRIDE: u64 = 1024;

/// The words block `l` carries: (index in the block, value).
fn words_of(l: &Live) -> Vec<(usize, u32)> {
    common::strided_words(l.a.ptr(), l.a.size(), l.tag, STRIDE, 16, false)
}

/// Enqueue on `stream` a "kernel" writing block `l`'s words; the receiver
/// says whether the memory was mapped when it ran.
fn write_kernel(dev: &HostDevice, stream: Stream, l: &Live) -> Receiver<bool> {
    common::write_words_at(dev, stream, l.a.ptr(), l.a.size() / 4 * 4, words_of(l))
}

/// One seed under `cfg`; returns the pages moved while pending.
fn run(cfg: PoolConfig, seed: u64, label: &str, cap_pages: Option<usize>) -> u64 {
    let base_reuse = cfg.reuse;
    let dev = Arc::new(common::host_with_capacity(64 * MIB));
    let pool = MemPool::new(dev.clone(), cfg).expect("pool");
    let streams = common::streams(&*dev, 3);
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut live: Vec<Live> = Vec::new();
    let mut kernels: Vec<(String, Receiver<bool>)> = Vec::new();
    let mut tag = 0u32;
    for phase in 0..5 {
        let gates = common::gate_some(&*dev, &streams, &mut rng);
        for step in 0..30 {
            let what = format!("{label} seed {seed} phase {phase} step {step}");
            let r = rng.range(0, 99);
            if r < 35 && !live.is_empty() {
                let i = rng.range(0, live.len() as u64 - 1) as usize;
                let l = live.swap_remove(i);
                let on = if rng.range(0, 3) == 0 {
                    // Another stream, ordered after the allocating one.
                    let other = streams[rng.range(0, 2) as usize];
                    if other != l.stream {
                        let ev = pool.record_event(l.stream).unwrap();
                        pool.wait_event(other, &ev).unwrap();
                    }
                    other
                } else {
                    l.stream
                };
                pool.free_async(l.a, on)
                    .unwrap_or_else(|e| panic!("{what}: free: {e}"));
            } else if r < 45 && !live.is_empty() {
                // A use on another stream, writing the block's own words.
                let i = rng.range(0, live.len() as u64 - 1) as usize;
                let u = streams[rng.range(0, 2) as usize];
                let l = &mut live[i];
                pool.record_use(&mut l.a, u);
                let k = write_kernel(&dev, u, l);
                kernels.push((format!("{what}: use"), k));
            } else if r < 55 {
                let (a, b) = (
                    streams[rng.range(0, 2) as usize],
                    streams[rng.range(0, 2) as usize],
                );
                if a != b {
                    let ev = pool.record_event(a).unwrap();
                    pool.wait_event(b, &ev).unwrap();
                }
            } else if r < 58 {
                pool.trim_to(rng.range(0, 8) * PAGE as u64)
                    .unwrap_or_else(|e| panic!("{what}: trim: {e}"));
            } else if r < 60 {
                // The reuse switches change under pending moves and holds.
                pool.set_reuse(ReusePolicy {
                    follow_event_dependencies: rng.range(0, 1) == 0,
                    opportunistic: rng.range(0, 1) == 0,
                    ..base_reuse
                });
            } else {
                let len = match rng.range(0, 3) {
                    0 => rng.log_range(4 * KIB as u64, 900 * KIB as u64) as usize,
                    1 => rng.log_range(MIB as u64, 3 * MIB as u64) as usize,
                    _ => rng.log_range(3 * MIB as u64, 9 * MIB as u64) as usize,
                };
                let s = streams[rng.range(0, 2) as usize];
                match pool.alloc_async(len, s) {
                    Ok(a) => {
                        for l in &live {
                            assert!(
                                a.ptr() + a.size() as u64 <= l.a.ptr()
                                    || l.a.ptr() + l.a.size() as u64 <= a.ptr(),
                                "{what}: {len} B overlaps a live block"
                            );
                        }
                        tag += 1;
                        let l = Live { a, tag, stream: s };
                        let k = write_kernel(&dev, s, &l);
                        kernels.push((format!("{what}: alloc"), k));
                        live.push(l);
                    }
                    Err(e) => assert!(e.is_out_of_memory(), "{what}: {len} B: {e}"),
                }
            }
            assert_eq!(
                pool.pending_move_counts().1,
                0,
                "{what}: a held mapping was unmapped"
            );
        }
        drop(gates);
        pool.synchronize().unwrap();
        common::expect_kernels_mapped(&mut kernels);
        for l in &live {
            let got = dev.read_words(l.a.ptr(), l.a.size() / 4).unwrap();
            assert!(
                words_of(l).iter().all(|&(i, v)| got[i] == v),
                "{label} seed {seed} phase {phase}: block {} ({} B at {:#x}) lost its words",
                l.tag,
                l.a.size(),
                l.a.ptr()
            );
        }
        // All work done, every free complete: pages no live block touches
        // can all be stitched into one window (single pages move freely),
        // so a request of one page less than they make never fails.
        if let Some(cap) = cap_pages {
            let mut touched: Vec<u64> = live
                .iter()
                .flat_map(|l| common::pages_of(l.a.ptr(), l.a.size()))
                .collect();
            touched.sort_unstable();
            touched.dedup();
            let spare = cap - touched.len();
            if spare >= 2 {
                let len = (spare - 1) * PAGE;
                let s = streams[rng.range(0, 2) as usize];
                match pool.alloc_async(len, s) {
                    Ok(a) => pool.free_async(a, s).unwrap(),
                    Err(e) => panic!(
                        "{label} seed {seed} phase {phase}: {len} B with {spare} pages \
                         untouched, all complete: {e} (moves {:?})",
                        pool.pending_move_counts()
                    ),
                }
            }
        }
    }
    let moved = pool.pending_move_counts().0;
    for l in live.drain(..) {
        pool.free_async(l.a, l.stream).unwrap();
    }
    pool.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    assert_eq!(pool.stats().reserved_current, 0, "{label} seed {seed}");
    assert_eq!(dev.live_handles(), 0, "{label} seed {seed}");
    assert_eq!(pool.pending_move_counts().1, 0);
    drop(pool);
    assert_eq!(dev.live_mappings(), 0, "{label} seed {seed}");
    moved
}

fn reuse(internal: bool) -> ReusePolicy {
    ReusePolicy {
        follow_event_dependencies: true,
        opportunistic: true,
        internal_dependencies: internal,
        wait_for_pending_frees: false,
    }
}

fn sweep(label: &str, cap_pages: Option<usize>, cfg: impl Fn() -> PoolConfig) {
    let mut moved = 0;
    for seed in 1..=12 {
        moved += run(cfg(), seed, label, cap_pages);
    }
    assert!(moved > 0, "{label}: no page moved while pending");
}

#[test]
fn single_pages_no_cache() {
    sweep("single/no-cache", Some(8), || {
        common::config()
            .with_max_size(8 * PAGE as u64)
            .with_stream_cache_bytes(0)
            .with_reuse(reuse(false))
    });
}

#[test]
fn single_pages_cache() {
    sweep("single/cache", Some(8), || {
        common::config()
            .with_max_size(8 * PAGE as u64)
            .with_reuse(reuse(false))
    });
}

#[test]
fn single_pages_internal_dependencies() {
    sweep("single/internal", Some(8), || {
        common::config()
            .with_max_size(8 * PAGE as u64)
            .with_stream_cache_bytes(0)
            .with_reuse(reuse(true))
    });
}

#[test]
fn units_mixed_with_single_pages() {
    sweep("units", None, || {
        common::config()
            .with_max_size(10 * PAGE as u64)
            .with_stream_cache_bytes(0)
            .with_max_unit_size(4 * MIB)
            .with_unit_min_block(4 * MIB)
            .with_reuse(reuse(false))
    });
}
