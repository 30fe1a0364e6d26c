//! The random driver shared by the attack17 test files: a model of the
//! live blocks, tag-writing kernels, held and retired streams, and the
//! checks made after every step, at each phase's end and at the end (see
//! each file's header for what it varies).
#![allow(dead_code)]

use crate::common::{self, Rng};
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use tidepool::{Allocation, MemPool, PoolConfig, ReusePolicy};
use tidepool_sys::{Device, HostDevice, Stream};

pub const KIB: usize = 1 << 10;
pub const MIB: usize = 1 << 20;
pub const PAGE: usize = 2 * MIB;

pub struct Live {
    pub a: Allocation,
    pub tag: u32,
    /// A stream ordered after every write to the block so far.
    pub stream: Stream,
}

pub fn stride(size: usize) -> u64 {
    if size < MIB {
        512
    } else {
        32 * 1024
    }
}

/// The words block `l` carries: (index in the block, value).
pub fn words_of(l: &Live) -> Vec<(usize, u32)> {
    common::strided_words(l.a.ptr(), l.a.size(), l.tag, stride(l.a.size()), 12, true)
}

/// A write of block `l`'s words on `stream` (none for an empty block).
pub fn write_kernel(dev: &HostDevice, stream: Stream, l: &Live) -> Option<Receiver<bool>> {
    (l.a.size() >= 4)
        .then(|| common::write_words_at(dev, stream, l.a.ptr(), l.a.size() / 4 * 4, words_of(l)))
}

pub fn check_kernel(dev: &HostDevice, stream: Stream, l: &Live) -> Option<(usize, u32)> {
    if l.a.size() < 4 {
        return None;
    }
    common::check_words_at(dev, stream, l.a.ptr(), l.a.size() / 4 * 4, words_of(l))
        .recv()
        .unwrap()
}

#[derive(Clone, Copy)]
pub enum Sizes {
    /// Zero-size blocks, small and medium ones (below 4 MiB).
    SmallAndZero,
    /// Every class up to `max`, zero included.
    Every(usize),
}

pub struct Setup {
    pub label: &'static str,
    pub cfg: PoolConfig,
    pub cap_pages: usize,
    pub streams: usize,
    pub sizes: Sizes,
    /// Whether a request of one page less than the untouched pages must
    /// succeed after a synchronize (not with units of several pages).
    pub spare_check: bool,
    /// Whether a stream is retired (its live blocks handed to a new one
    /// after an event) in the middle of a phase.
    pub retire: bool,
}

pub fn len_of(rng: &mut Rng, sizes: Sizes) -> usize {
    match sizes {
        Sizes::SmallAndZero => match rng.range(0, 9) {
            0 => 0,
            1..=6 => rng.log_range(1, 600 * KIB as u64) as usize,
            _ => rng.log_range(600 * KIB as u64, 4 * MIB as u64) as usize,
        },
        Sizes::Every(max) => match rng.range(0, 11) {
            0 => 0,
            1..=4 => rng.log_range(1, 1000 * KIB as u64) as usize,
            5..=7 => rng.log_range(MIB as u64, 15 * MIB as u64) as usize,
            _ => rng.log_range(16 * MIB as u64, max as u64) as usize,
        },
    }
}

pub fn touched(live: &[Live]) -> usize {
    let mut t: Vec<u64> = live
        .iter()
        .filter(|l| l.a.size() > 0)
        .flat_map(|l| common::pages_of(l.a.ptr(), l.a.size()))
        .collect();
    t.sort_unstable();
    t.dedup();
    t.len()
}

/// `used_current` is the sum of the live sizes; nothing reserved past the
/// cap.
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

/// The end of a phase, every hold released: all work done, each write
/// kernel found its memory mapped, every live block's words are intact,
/// and the statistics agree with the live blocks.
pub fn end_phase(
    pool: &MemPool<HostDevice>,
    dev: &HostDevice,
    kernels: &mut Vec<(String, Receiver<bool>)>,
    live: &[Live],
    cap: usize,
    what: &str,
) {
    pool.synchronize().unwrap();
    common::expect_kernels_mapped(kernels);
    for l in live {
        let bad = check_kernel(dev, l.stream, l);
        assert!(
            bad.is_none(),
            "{what}: block {} ({} B at {:#x}) lost its words: {bad:?}",
            l.tag,
            l.a.size(),
            l.a.ptr()
        );
    }
    check_model(pool, live, cap, what);
}

/// Hand the live blocks of stream `i` to a new stream ordered after it,
/// retire the old one and put the new one in its place.
pub fn retire(
    dev: &HostDevice,
    pool: &MemPool<HostDevice>,
    streams: &mut [Stream],
    live: &mut [Live],
    i: usize,
) {
    let old = streams[i];
    let new = dev.create_stream().unwrap();
    let ev = pool.record_event(old).unwrap();
    pool.wait_event(new, &ev).unwrap();
    for l in live.iter_mut().filter(|l| l.stream == old) {
        l.stream = new;
    }
    pool.retire_stream(old).unwrap();
    streams[i] = new;
}

/// One seed; returns the number of out-of-memory answers met mid-phase.
pub fn run(s: &Setup, seed: u64) -> u64 {
    let label = s.label;
    let base_reuse = s.cfg.reuse;
    let dev = Arc::new(common::host_with_capacity(s.cap_pages * PAGE + 64 * MIB));
    let pool = MemPool::new(dev.clone(), s.cfg.clone()).expect("pool");
    let mut streams = common::streams(&*dev, s.streams);
    let mut retired = Vec::new();
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut live: Vec<Live> = Vec::new();
    let mut kernels: Vec<(String, Receiver<bool>)> = Vec::new();
    let (mut tag, mut ooms) = (0u32, 0u64);
    let n = s.streams as u64;
    for phase in 0..6 {
        let mut gates = common::gate_some(&*dev, &streams, &mut rng);
        for step in 0..120 {
            let pick = |rng: &mut Rng| streams[rng.range(0, n - 1) as usize];
            let what = format!("{label} seed {seed} phase {phase} step {step}");
            let r = rng.range(0, 99);
            if r < 34 && !live.is_empty() {
                let i = rng.range(0, live.len() as u64 - 1) as usize;
                let l = live.swap_remove(i);
                let on = if rng.range(0, 1) == 0 {
                    l.stream
                } else {
                    // Another stream, ordered after the block's.
                    let other = pick(&mut rng);
                    let ev = pool.record_event(l.stream).unwrap();
                    pool.wait_event(other, &ev).unwrap();
                    other
                };
                pool.free_async(l.a, on)
                    .unwrap_or_else(|e| panic!("{what}: free: {e}"));
            } else if r < 44 && !live.is_empty() {
                // A use on another stream ordered after the block's
                // writes, which then orders the block.
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
            } else if r < 50 {
                let (a, b) = (pick(&mut rng), pick(&mut rng));
                if a != b {
                    let ev = pool.record_event(a).unwrap();
                    pool.wait_event(b, &ev).unwrap();
                }
            } else if r < 54 {
                let keep = rng.range(0, s.cap_pages as u64) * PAGE as u64;
                pool.trim_to(keep)
                    .unwrap_or_else(|e| panic!("{what}: trim: {e}"));
            } else if r < 56 {
                pool.set_reuse(ReusePolicy {
                    follow_event_dependencies: rng.range(0, 1) == 0,
                    opportunistic: rng.range(0, 1) == 0,
                    ..base_reuse
                });
            } else if r < 58 && !gates.is_empty() {
                let g = rng.range(0, gates.len() as u64 - 1) as usize;
                drop(gates.swap_remove(g));
            } else if r < 59 && s.retire {
                let i = rng.range(0, n - 1) as usize;
                retired.push(streams[i]);
                retire(&dev, &pool, &mut streams, &mut live, i);
            } else {
                let len = len_of(&mut rng, s.sizes);
                let st = pick(&mut rng);
                match pool.alloc_async(len, st) {
                    Ok(a) => {
                        for l in &live {
                            assert!(
                                !common::overlaps(a.ptr(), a.size(), l.a.ptr(), l.a.size()),
                                "{what}: {len} B at {:#x} overlaps block {} ({} B at {:#x})",
                                a.ptr(),
                                l.tag,
                                l.a.size(),
                                l.a.ptr()
                            );
                        }
                        tag += 1;
                        let l = Live { a, tag, stream: st };
                        if let Some(k) = write_kernel(&dev, st, &l) {
                            kernels.push((format!("{what}: alloc {len} B"), k));
                        }
                        live.push(l);
                    }
                    Err(e) => {
                        assert!(e.is_out_of_memory(), "{what}: {len} B: {e}");
                        ooms += 1;
                    }
                }
            }
            check_model(&pool, &live, s.cap_pages, &what);
        }
        drop(gates);
        let what = format!("{label} seed {seed} phase {phase} end");
        end_phase(&pool, &dev, &mut kernels, &live, s.cap_pages, &what);
        // All work done and every free complete: the rule checked is that
        // a request of one page less than the pages no live block touches
        // succeeds (any complete free page, cached or not, may be taken).
        if s.spare_check {
            let spare = s.cap_pages - touched(&live);
            if spare >= 2 {
                let len = (spare - 1) * PAGE;
                let st = streams[rng.range(0, n - 1) as usize];
                match pool.alloc_async(len, st) {
                    Ok(a) => pool.free_async(a, st).unwrap(),
                    Err(e) => panic!(
                        "{what}: {len} B with {spare} pages untouched, all complete: {e} ({:?})",
                        pool.stats()
                    ),
                }
                pool.synchronize().unwrap();
            }
        }
    }
    for l in live.drain(..) {
        pool.free_async(l.a, l.stream).unwrap();
    }
    pool.synchronize().unwrap();
    // Everything free and complete: the whole cap in one request.
    let all = pool
        .alloc_async(s.cap_pages * PAGE, streams[0])
        .unwrap_or_else(|e| {
            panic!(
                "{label} seed {seed}: the whole cap, all free: {e} ({:?})",
                pool.stats()
            )
        });
    assert_eq!(pool.stats().used_current, (s.cap_pages * PAGE) as u64);
    pool.free_async(all, streams[0]).unwrap();
    pool.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    assert_eq!(pool.stats().reserved_current, 0, "{label} seed {seed}");
    let fp = pool.stream_footprint();
    assert!(
        fp.pending_streams == 0 && fp.lingering == 0,
        "{label} seed {seed}: ranges still pending at the end: {fp:?}"
    );
    assert_eq!(dev.live_handles(), 0, "{label} seed {seed}");
    drop(pool);
    assert_eq!(dev.live_mappings(), 0, "{label} seed {seed}");
    for st in retired {
        dev.destroy_stream(st).unwrap();
    }
    ooms
}

pub fn reuse(follow: bool, opportunistic: bool, internal: bool) -> ReusePolicy {
    ReusePolicy {
        follow_event_dependencies: follow,
        opportunistic,
        internal_dependencies: internal,
        wait_for_pending_frees: false,
    }
}

pub fn capped(va: u64, pages: usize, cache: usize, r: ReusePolicy) -> PoolConfig {
    PoolConfig::default()
        .with_va_size(va as usize)
        .with_max_size((pages * PAGE) as u64)
        .with_stream_cache_bytes(cache)
        .with_reuse(r)
}

pub fn sweep(s: Setup, seeds: std::ops::RangeInclusive<u64>) {
    let mut ooms = 0;
    for seed in seeds {
        ooms += run(&s, seed);
    }
    // The caps sit near the peak live bytes: some requests must be refused.
    assert!(ooms > 0, "{}: the cap was never reached", s.label);
}
