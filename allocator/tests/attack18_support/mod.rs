//! The driver shared by the attack18 test files: many streams freeing
//! batches of mixed-size blocks with new epochs (pool events) between
//! frees, so that the free map holds hundreds of ranges whose guards are
//! several epochs of one stream side by side; frees on other streams
//! after events; takes of several pages over runs of small free ranges;
//! `trim_to`, release thresholds and host synchronizations of single
//! streams between them. A model of the live blocks is checked after
//! every operation, the blocks' words at each phase's end.
#![allow(dead_code)]

use crate::common::{self, Rng};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use tidepool::{MemPool, PoolConfig, ReusePolicy};
use tidepool_sys::{HostDevice, Stream};

/// The pieces the attack17 driver has already: the live-block model, the
/// tag kernels, the page count and the pool configurations.
pub use crate::attack17_support::{capped, reuse, touched, words_of, write_kernel, Live};

pub const KIB: usize = 1 << 10;
pub const MIB: usize = 1 << 20;
pub const PAGE: usize = 2 * MIB;
/// The stream cache's bound between small slots and long lengths.
pub const SMALL_MAX: usize = 64 * KIB;

fn stride(size: usize) -> u64 {
    if size < 64 * KIB {
        256
    } else if size < MIB {
        4 * KIB as u64
    } else {
        64 * KIB as u64
    }
}

pub fn check_now(dev: &HostDevice, l: &Live, what: &str) {
    if l.a.size() < 4 {
        return;
    }
    let bad = common::check_words_at(dev, l.stream, l.a.ptr(), l.a.size() / 4 * 4, words_of(l))
        .recv()
        .unwrap();
    assert!(
        bad.is_none(),
        "{what}: block {} ({} B at {:#x}) lost its words: {bad:?}",
        l.tag,
        l.a.size(),
        l.a.ptr()
    );
}

/// The sizes a setup draws from.
#[derive(Clone, Copy)]
pub enum Sizes {
    /// Small blocks only (0 to 70 KiB, around the cache's 64 KiB bound,
    /// multiples of 512 and off by one): hundreds of free ranges.
    Small,
    /// Small blocks, with one in six of 1 to `max_pages` pages (exact
    /// multiples or one byte more or less).
    Mixed(usize),
    /// Many distinct lengths for the stream caches: every multiple of
    /// 512 up to 64 KiB (more than the 128 small slots' worth drawn), and
    /// some 150 lengths above it (more than the 64 long lengths' lists a
    /// drain keeps), off by one at times.
    CacheLens,
}

pub fn len_of(rng: &mut Rng, sizes: Sizes) -> usize {
    let small = |rng: &mut Rng| -> usize {
        match rng.range(0, 9) {
            0 => 0,
            1..=3 => rng.range(1, 128) as usize * 512,
            4 => (rng.range(1, 140) as usize * 512).saturating_sub(rng.range(0, 1) as usize),
            5..=7 => rng.log_range(1, 70 * KIB as u64) as usize,
            _ => rng.range(60, 70) as usize * KIB + rng.range(0, 2) as usize,
        }
    };
    match sizes {
        Sizes::Small => small(rng),
        Sizes::CacheLens => {
            let l = match rng.range(0, 3) {
                0 | 1 => rng.range(1, 128) as usize * 512,
                _ => SMALL_MAX + rng.range(1, 150) as usize * 512,
            };
            match rng.range(0, 5) {
                0 => l - 1,
                1 => l + 1,
                _ => l,
            }
        }
        Sizes::Mixed(max_pages) => {
            if rng.range(0, 5) == 0 {
                let p = rng.range(1, max_pages as u64) as usize * PAGE;
                match rng.range(0, 2) {
                    0 => p,
                    1 => p - 1,
                    _ => p + 1,
                }
            } else if rng.range(0, 6) == 0 {
                rng.log_range(70 * KIB as u64, 1900 * KIB as u64) as usize
            } else {
                small(rng)
            }
        }
    }
}

/// `used_current` is the sum of the live sizes, reserved bytes never
/// below it nor past the cap.
pub fn check_model(pool: &MemPool<HostDevice>, live: &[Live], cap: usize, what: &str) {
    let s = pool.stats();
    let used: u64 = live.iter().map(|l| l.a.size() as u64).sum();
    assert_eq!(s.used_current, used, "{what}: used bytes ({s:?})");
    assert!(
        s.reserved_current >= s.used_current,
        "{what}: reserved below used ({s:?})"
    );
    assert!(
        s.reserved_current <= (cap * PAGE) as u64 && s.reserved_high <= (cap * PAGE) as u64,
        "{what}: reserved above the cap ({s:?})"
    );
}

pub struct Setup {
    pub label: &'static str,
    pub cfg: PoolConfig,
    pub cap_pages: usize,
    pub streams: usize,
    pub sizes: Sizes,
    pub phases: usize,
    pub steps: usize,
    /// Whether streams are held busy (blockers) through each phase.
    pub gates: bool,
    /// Whether, after each phase's synchronize, a request of one page
    /// less than the untouched pages must succeed.
    pub spare_check: bool,
}

#[allow(clippy::too_many_arguments)]
fn alloc_one(
    pool: &MemPool<HostDevice>,
    dev: &HostDevice,
    live: &mut Vec<Live>,
    kernels: &mut Vec<(String, Receiver<bool>)>,
    tag: &mut u32,
    len: usize,
    st: Stream,
    what: &str,
) -> bool {
    match pool.alloc_async(len, st) {
        Ok(a) => {
            assert!(a.size() >= len, "{what}: {len} B got {} B", a.size());
            for l in live.iter() {
                assert!(
                    !common::overlaps(a.ptr(), a.size(), l.a.ptr(), l.a.size()),
                    "{what}: {len} B at {:#x} overlaps block {} ({} B at {:#x})",
                    a.ptr(),
                    l.tag,
                    l.a.size(),
                    l.a.ptr()
                );
            }
            *tag += 1;
            let l = Live {
                a,
                tag: *tag,
                stream: st,
            };
            if let Some(k) = write_kernel(dev, st, &l) {
                kernels.push((format!("{what}: alloc {len} B"), k));
            }
            live.push(l);
            true
        }
        Err(e) => {
            assert!(e.is_out_of_memory(), "{what}: {len} B: {e}");
            false
        }
    }
}

/// Free `l` on `on` (its stream, or one ordered after it through a pool
/// event), checking its words first when asked.
fn free_one(
    pool: &MemPool<HostDevice>,
    dev: &HostDevice,
    l: Live,
    on: Stream,
    check: bool,
    what: &str,
) {
    if check {
        check_now(dev, &l, what);
    }
    if on != l.stream {
        let ev = pool.record_event(l.stream).unwrap();
        pool.wait_event(on, &ev).unwrap();
    }
    pool.free_async(l.a, on)
        .unwrap_or_else(|e| panic!("{what}: free: {e}"));
}

/// One seed; returns the number of out-of-memory answers met mid-phase.
pub fn run(s: &Setup, seed: u64) -> u64 {
    let label = s.label;
    let dev = Arc::new(common::host_with_capacity(s.cap_pages * PAGE + 64 * MIB));
    let pool = MemPool::new(dev.clone(), s.cfg.clone()).expect("pool");
    let streams = common::streams(&*dev, s.streams);
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut live: Vec<Live> = Vec::new();
    let mut kernels: Vec<(String, Receiver<bool>)> = Vec::new();
    let (mut tag, mut ooms) = (0u32, 0u64);
    let n = s.streams as u64;
    let base_reuse = s.cfg.reuse;
    for phase in 0..s.phases {
        let mut gates = if s.gates {
            common::gate_some(&*dev, &streams, &mut rng)
        } else {
            Vec::new()
        };
        for step in 0..s.steps {
            let pick = |rng: &mut Rng| streams[rng.range(0, n - 1) as usize];
            let what = format!("{label} seed {seed} phase {phase} step {step}");
            let r = rng.range(0, 99);
            if r < 14 && !live.is_empty() {
                // A batch on one stream: its blocks, several epochs apart,
                // interleaved with blocks of other streams ordered first.
                let st = pick(&mut rng);
                let k = rng.range(1, 40);
                for _ in 0..k {
                    if live.is_empty() {
                        break;
                    }
                    let i = if rng.range(0, 2) == 0 {
                        live.iter()
                            .position(|l| l.stream == st)
                            .unwrap_or(rng.range(0, live.len() as u64 - 1) as usize)
                    } else {
                        rng.range(0, live.len() as u64 - 1) as usize
                    };
                    let l = live.swap_remove(i);
                    let check = gates.is_empty() && rng.range(0, 3) == 0;
                    free_one(&pool, &dev, l, st, check, &what);
                    if rng.range(0, 2) == 0 {
                        // A new epoch of the stream.
                        drop(pool.record_event(st).unwrap());
                    }
                }
            } else if r < 30 && !live.is_empty() {
                let i = rng.range(0, live.len() as u64 - 1) as usize;
                let l = live.swap_remove(i);
                let on = if rng.range(0, 1) == 0 {
                    l.stream
                } else {
                    pick(&mut rng)
                };
                let check = gates.is_empty() && rng.range(0, 1) == 0;
                free_one(&pool, &dev, l, on, check, &what);
            } else if r < 36 && !live.is_empty() {
                // A use on another stream ordered after the block's writes.
                let i = rng.range(0, live.len() as u64 - 1) as usize;
                let u = pick(&mut rng);
                let l = &mut live[i];
                if u != l.stream {
                    let ev = pool.record_event(l.stream).unwrap();
                    pool.wait_event(u, &ev).unwrap();
                }
                pool.record_use(&mut l.a, u);
                l.stream = u;
                if let Some(k) = write_kernel(&dev, u, l) {
                    kernels.push((format!("{what}: use"), k));
                }
            } else if r < 42 {
                let (a, b) = (pick(&mut rng), pick(&mut rng));
                let ev = pool.record_event(a).unwrap();
                if a != b {
                    pool.wait_event(b, &ev).unwrap();
                }
            } else if r < 45 {
                // A take of several pages (or just under / over), likely
                // over many small free ranges.
                let p = rng.range(1, (s.cap_pages as u64 / 3).max(1)) as usize;
                let len = match rng.range(0, 2) {
                    0 => p * PAGE,
                    1 => p * PAGE - 1,
                    _ => p * PAGE + 1,
                };
                let st = pick(&mut rng);
                if !alloc_one(
                    &pool,
                    &dev,
                    &mut live,
                    &mut kernels,
                    &mut tag,
                    len,
                    st,
                    &what,
                ) {
                    ooms += 1;
                }
            } else if r < 47 {
                let keep = rng.range(0, s.cap_pages as u64) * PAGE as u64;
                pool.trim_to(keep)
                    .unwrap_or_else(|e| panic!("{what}: trim: {e}"));
            } else if r < 48 {
                let t = match rng.range(0, 2) {
                    0 => 0,
                    1 => rng.range(0, s.cap_pages as u64) * PAGE as u64,
                    _ => u64::MAX,
                };
                pool.set_release_threshold(t);
            } else if r < 50 {
                pool.set_reuse(ReusePolicy {
                    follow_event_dependencies: rng.range(0, 1) == 0,
                    opportunistic: rng.range(0, 1) == 0,
                    ..base_reuse
                });
            } else if r < 52 && !gates.is_empty() {
                let g = rng.range(0, gates.len() as u64 - 1) as usize;
                drop(gates.swap_remove(g));
            } else if r < 54 {
                // Completion observed on the host for one stream (not
                // held): its pending frees become reusable by others.
                let st = pick(&mut rng);
                if gates.is_empty() {
                    pool.synchronize_stream(st)
                        .unwrap_or_else(|e| panic!("{what}: sync: {e}"));
                }
            } else {
                // A burst of small and mixed allocations on one stream.
                let st = pick(&mut rng);
                for _ in 0..rng.range(1, 6) {
                    let len = len_of(&mut rng, s.sizes);
                    if !alloc_one(
                        &pool,
                        &dev,
                        &mut live,
                        &mut kernels,
                        &mut tag,
                        len,
                        st,
                        &what,
                    ) {
                        ooms += 1;
                    }
                }
            }
            check_model(&pool, &live, s.cap_pages, &what);
        }
        drop(gates);
        pool.synchronize().unwrap();
        common::expect_kernels_mapped(&mut kernels);
        let what = format!("{label} seed {seed} phase {phase} end");
        for l in &live {
            check_now(&dev, l, &what);
        }
        check_model(&pool, &live, s.cap_pages, &what);
        if s.spare_check {
            // All work done and every free complete: one page less than
            // the pages no live block touches is owed.
            let spare = s.cap_pages - touched(&live);
            if spare >= 2 {
                let len = (spare - 1) * PAGE;
                let st = streams[rng.range(0, n - 1) as usize];
                match pool.alloc_async(len, st) {
                    Ok(a) => {
                        for l in &live {
                            assert!(
                                !common::overlaps(a.ptr(), a.size(), l.a.ptr(), l.a.size()),
                                "{what}: spare request overlaps block {}",
                                l.tag
                            );
                        }
                        pool.free_async(a, st).unwrap()
                    }
                    Err(e) => panic!(
                        "{what}: {len} B with {spare} pages untouched, all complete: {e} ({:?})",
                        pool.stats()
                    ),
                }
                pool.synchronize().unwrap();
            }
        }
        // Free about half of what is left, in address order on one stream
        // (a long batch of neighbouring spans), then synchronize.
        live.sort_by_key(|l| l.a.ptr());
        let st = streams[rng.range(0, n - 1) as usize];
        let mut kept = Vec::new();
        for (j, l) in live.drain(..).enumerate() {
            if j % 2 == phase % 2 || rng.range(0, 3) == 0 {
                free_one(&pool, &dev, l, st, false, &what);
                if rng.range(0, 3) == 0 {
                    drop(pool.record_event(st).unwrap());
                }
            } else {
                kept.push(l);
            }
        }
        live = kept;
        check_model(&pool, &live, s.cap_pages, &what);
    }
    let what = format!("{label} seed {seed} end");
    for l in live.drain(..) {
        check_now(&dev, &l, &what);
        pool.free_async(l.a, l.stream).unwrap();
    }
    pool.synchronize().unwrap();
    pool.set_release_threshold(u64::MAX);
    // Everything free and complete: the whole cap in one request.
    let all = pool
        .alloc_async(s.cap_pages * PAGE, streams[0])
        .unwrap_or_else(|e| panic!("{what}: the whole cap, all free: {e} ({:?})", pool.stats()));
    assert_eq!(pool.stats().used_current, (s.cap_pages * PAGE) as u64);
    pool.free_async(all, streams[0]).unwrap();
    pool.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    assert_eq!(pool.stats().reserved_current, 0, "{what}");
    let fp = pool.stream_footprint();
    assert!(
        fp.pending_streams == 0 && fp.lingering == 0,
        "{what}: ranges still pending at the end: {fp:?}"
    );
    assert_eq!(dev.live_handles(), 0, "{what}");
    drop(pool);
    assert_eq!(dev.live_mappings(), 0, "{what}");
    ooms
}

pub fn sweep(s: Setup, seeds: std::ops::RangeInclusive<u64>) -> u64 {
    let mut ooms = 0;
    for seed in seeds {
        ooms += run(&s, seed);
    }
    ooms
}
