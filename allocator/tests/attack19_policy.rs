//! Reuse switches flipped between allocations on several streams, with
//! some streams held busy through each phase so that their frees stay
//! pending. The rule checked on every allocation: a stream never ordered
//! after a held stream (by the test's own waits) gets a block over another
//! stream's pending free only when the switches in force (the last
//! `set_reuse`) allow an internal dependency, or follow events after an
//! internal dependency was allowed earlier in the phase (the pool's own
//! waits order the stream); opportunistic reuse needs the free complete,
//! which it cannot be. Also: streams retired (held ones too)
//! and refused afterwards, sizes 0, 1, va_size and va_size + 1, announced captures
//! toggled, `trim_to` and whole-pool synchronizations (holds released) between steps;
//! no overlap of live blocks, used bytes equal to the live bytes, reserved
//! bytes under the cap, and the blocks' words intact at each phase's end.

mod attack17_support;
mod common;

use attack17_support::{capped, check_model, end_phase, reuse, write_kernel, Live, KIB, PAGE};
use common::Rng;
use std::collections::HashSet;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use tidepool::{MemPool, PoolConfig, ReusePolicy};
use tidepool_sys::{Device, DevicePtr, Stream};

/// A free made on a held stream (or one ordered after it) after the hold
/// began: certainly pending until the phase ends.
struct Pending {
    ptr: DevicePtr,
    len: usize,
    stream: Stream,
    step: String,
}

struct Setup {
    label: &'static str,
    cfg: PoolConfig,
    cap_pages: usize,
    streams: usize,
    phases: usize,
    steps: usize,
}

fn draw_policy(rng: &mut Rng) -> ReusePolicy {
    reuse(
        rng.range(0, 1) == 0,
        rng.range(0, 1) == 0,
        rng.range(0, 2) == 0,
    )
}

fn len_of(rng: &mut Rng, va: usize) -> usize {
    match rng.range(0, 19) {
        0 => 0,
        1 => 1,
        2 => va,
        3 => va + 1,
        4 => PAGE * rng.range(1, 3) as usize + rng.range(0, 1) as usize,
        5..=9 => rng.range(1, 64) as usize * 512,
        _ => rng.log_range(1, 300 * KIB as u64) as usize,
    }
}

fn run(s: &Setup, seed: u64) -> (u64, u64) {
    let label = s.label;
    let va = s.cfg.va_size;
    let dev = Arc::new(common::host_with_capacity(s.cap_pages * PAGE + (64 << 20)));
    let pool = MemPool::new(dev.clone(), s.cfg.clone()).expect("pool");
    let mut policy = s.cfg.reuse;
    let mut streams = common::streams(&*dev, s.streams);
    let mut retired: Vec<Stream> = Vec::new();
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut live: Vec<Live> = Vec::new();
    let mut kernels: Vec<(String, Receiver<bool>)> = Vec::new();
    let (mut tag, mut taken_internal, mut ooms) = (0u32, 0u64, 0u64);
    let n = s.streams as u64;
    let mut announced = 0u32;
    for phase in 0..s.phases {
        let mut gates = Vec::new();
        // Streams whose work from now on cannot complete before the end of
        // the phase: the held ones and any ordered after one of them.
        let mut blocked: HashSet<Stream> = HashSet::new();
        for &st in &streams {
            if rng.range(0, 2) > 0 {
                gates.push(common::Blocker::on(&*dev, st));
                blocked.insert(st);
            }
        }
        let mut pending: Vec<Pending> = Vec::new();
        // Whether an internal dependency may have been made this phase: a
        // stream that waited on a held stream's free through one follows
        // that stream's earlier frees afterwards.
        let mut internal_seen = policy.internal_dependencies;
        for step in 0..s.steps {
            let what = format!("{label} seed {seed} phase {phase} step {step}");
            let r = rng.range(0, 99);
            if r < 30 && !live.is_empty() {
                let i = rng.range(0, live.len() as u64 - 1) as usize;
                let l = live.swap_remove(i);
                let (ptr, len, st) = (l.a.ptr(), l.a.size(), l.stream);
                pool.free_async(l.a, st)
                    .unwrap_or_else(|e| panic!("{what}: free: {e}"));
                if blocked.contains(&st) && len > 0 {
                    pending.push(Pending {
                        ptr,
                        len,
                        stream: st,
                        step: what.clone(),
                    });
                }
            } else if r < 40 {
                policy = draw_policy(&mut rng);
                pool.set_reuse(policy);
                internal_seen |= policy.internal_dependencies;
                assert_eq!(pool.reuse(), policy, "{what}: reuse read back");
            } else if r < 44 {
                // An event between two streams; a stream ordered after a
                // blocked one is blocked too.
                let (a, b) = (
                    streams[rng.range(0, n - 1) as usize],
                    streams[rng.range(0, n - 1) as usize],
                );
                if a != b {
                    let ev = pool.record_event(a).unwrap();
                    pool.wait_event(b, &ev).unwrap();
                    if blocked.contains(&a) {
                        blocked.insert(b);
                    }
                }
            } else if r < 47 {
                let keep = rng.range(0, s.cap_pages as u64) * PAGE as u64;
                pool.trim_to(keep)
                    .unwrap_or_else(|e| panic!("{what}: trim: {e}"));
            } else if r < 50 {
                // A whole-pool synchronization mid-phase: held streams are
                // released first, and the next phase's holds begin anew.
                if rng.range(0, 3) == 0 {
                    gates.clear();
                    pool.synchronize()
                        .unwrap_or_else(|e| panic!("{what}: sync: {e}"));
                    blocked.clear();
                    pending.clear();
                    internal_seen = policy.internal_dependencies;
                }
            } else if r < 52 {
                // Retire a stream (held or not); its blocks move to a new
                // stream ordered after it.
                let i = rng.range(0, n - 1) as usize;
                let old = streams[i];
                let new = dev.create_stream().unwrap();
                let ev = pool.record_event(old).unwrap();
                pool.wait_event(new, &ev).unwrap();
                for l in live.iter_mut().filter(|l| l.stream == old) {
                    l.stream = new;
                }
                pool.retire_stream(old)
                    .unwrap_or_else(|e| panic!("{what}: retire: {e}"));
                if blocked.contains(&old) {
                    blocked.insert(new);
                }
                retired.push(old);
                for len in [1, 4 * KIB] {
                    assert!(
                        pool.alloc_async(len, old).is_err(),
                        "{what}: {len} B on a retired stream"
                    );
                }
                streams[i] = new;
            } else if r < 54 {
                if announced > 0 && rng.range(0, 1) == 0 {
                    assert!(pool.end_announced_capture(streams[0]), "{what}: end");
                    announced -= 1;
                } else if rng.range(0, 1) == 0 {
                    pool.begin_announced_capture(streams[rng.range(0, n - 1) as usize]);
                    announced += 1;
                } else {
                    pool.set_announced_captures(rng.range(0, 1) == 0);
                }
            } else {
                let len = len_of(&mut rng, va);
                let st = streams[rng.range(0, n - 1) as usize];
                match pool.alloc_async(len, st) {
                    Ok(a) => {
                        assert!(len <= va, "{what}: {len} B granted over va_size {va}");
                        assert_eq!(a.size(), len, "{what}: size");
                        for l in &live {
                            assert!(
                                !common::overlaps(a.ptr(), a.size(), l.a.ptr(), l.a.size()),
                                "{what}: {len} B at {:#x} on {st:?} overlaps block {} ({} B at {:#x})",
                                a.ptr(),
                                l.tag,
                                l.a.size(),
                                l.a.ptr()
                            );
                        }
                        let mut over_other = false;
                        pending.retain(|p| {
                            if !common::overlaps(a.ptr(), a.size(), p.ptr, p.len) {
                                return true;
                            }
                            if p.stream != st {
                                over_other = true;
                                assert!(
                                    blocked.contains(&st)
                                        || policy.internal_dependencies
                                        || (policy.follow_event_dependencies && internal_seen),
                                    "{what}: {len} B at {:#x} on {st:?} over the pending free \
                                     of {} B at {:#x} on {:?} ({}) with {policy:?}",
                                    a.ptr(),
                                    p.len,
                                    p.ptr,
                                    p.stream,
                                    p.step
                                );
                            }
                            false
                        });
                        if over_other {
                            taken_internal += 1;
                            blocked.insert(st);
                        }
                        tag += 1;
                        let l = Live { a, tag, stream: st };
                        if let Some(k) = write_kernel(&dev, st, &l) {
                            kernels.push((format!("{what}: alloc {len} B"), k));
                        }
                        live.push(l);
                    }
                    Err(e) => {
                        if len <= va {
                            assert!(e.is_out_of_memory(), "{what}: {len} B: {e}");
                        }
                        ooms += 1;
                    }
                }
            }
            check_model(&pool, &live, s.cap_pages, &what);
        }
        drop(gates);
        let what = format!("{label} seed {seed} phase {phase} end");
        end_phase(&pool, &dev, &mut kernels, &live, s.cap_pages, &what);
    }
    while announced > 0 {
        assert!(pool.end_announced_capture(streams[0]));
        announced -= 1;
    }
    for l in live.drain(..) {
        pool.free_async(l.a, l.stream).unwrap();
    }
    pool.synchronize().unwrap();
    let all = pool
        .alloc_async(s.cap_pages * PAGE, streams[0])
        .unwrap_or_else(|e| panic!("{label} seed {seed}: the whole cap, all free: {e}"));
    pool.free_async(all, streams[0]).unwrap();
    pool.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    assert_eq!(pool.stats().reserved_current, 0, "{label} seed {seed}");
    drop(pool);
    assert_eq!(dev.live_mappings(), 0, "{label} seed {seed}");
    for st in retired {
        dev.destroy_stream(st).unwrap();
    }
    (taken_internal, ooms)
}

fn sweep(s: Setup, seeds: std::ops::RangeInclusive<u64>) {
    let (mut internal, mut ooms) = (0, 0);
    for seed in seeds {
        let (i, o) = run(&s, seed);
        internal += i;
        ooms += o;
    }
    // Pending frees of held streams were handed out through internal
    // dependencies, and the cap was met.
    assert!(internal > 0, "{}: no internal dependency taken", s.label);
    assert!(ooms > 0, "{}: the cap was never reached", s.label);
}

#[test]
fn flipped_switches_no_cache() {
    sweep(
        Setup {
            label: "no cache",
            cfg: capped(64 << 20, 10, 0, reuse(false, false, false)),
            cap_pages: 10,
            streams: 4,
            phases: 5,
            steps: 150,
        },
        1..=16,
    );
}

#[test]
fn flipped_switches_cached_six_streams() {
    sweep(
        Setup {
            label: "cached",
            cfg: capped(48 << 20, 8, 256 * KIB, reuse(true, true, true)),
            cap_pages: 8,
            streams: 6,
            phases: 5,
            steps: 150,
        },
        1..=16,
    );
}

#[test]
fn flipped_switches_three_streams_strict_capture() {
    let mut cfg = capped(32 << 20, 6, 64 * KIB, reuse(false, true, false));
    cfg.check_capture = true;
    sweep(
        Setup {
            label: "three",
            cfg,
            cap_pages: 6,
            streams: 3,
            phases: 6,
            steps: 120,
        },
        1..=16,
    );
}
