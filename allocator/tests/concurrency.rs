//! Contract test under concurrency: many threads, each on its own stream,
//! allocating and freeing at random (some frees handed to other threads and
//! made on their streams); live allocations never overlap, each keeps its
//! contents, and the pool's counters balance at the end.

mod common;

use common::*;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use tidepool::Allocation;
use tidepool_sys::Device;

const THREADS: usize = 8;
const OPS: usize = 2500;

/// Check `[p, end)` against the live map and insert it.
fn claim(live: &Mutex<BTreeMap<u64, u64>>, p: u64, end: u64) {
    let mut m = live.lock().unwrap();
    if let Some((&q, &qe)) = m.range(..=p).next_back() {
        assert!(qe <= p, "[{p:#x},{end:#x}) overlaps live [{q:#x},{qe:#x})");
    }
    if let Some((&q, &qe)) = m.range(p..).next() {
        assert!(end <= q, "[{p:#x},{end:#x}) overlaps live [{q:#x},{qe:#x})");
    }
    m.insert(p, end);
}

#[test]
fn threads_on_own_streams_never_overlap() {
    let dev = Arc::new(host());
    let pool = pool(&dev, config());
    let live = Mutex::new(BTreeMap::<u64, u64>::new());
    // Allocations handed over to be freed by another thread, on its stream
    // (a cross-stream free: there is no device work on them, so ordered).
    let handoff: Mutex<Vec<(Allocation, u32)>> = Mutex::new(Vec::new());
    std::thread::scope(|sc| {
        for t in 0..THREADS {
            let (dev, pool, live, handoff) = (&dev, &pool, &live, &handoff);
            sc.spawn(move || {
                let s = dev.create_stream().unwrap();
                let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ ((t as u64 + 1) * 0x1234_5678_9ABC));
                let mut mine: Vec<(Allocation, u32)> = Vec::new();
                let free = |(a, tag): (Allocation, u32)| {
                    let (p, n) = (a.ptr(), a.size());
                    let last = p + (n as u64 / 4 - 1) * 4;
                    assert_eq!(
                        dev.read_words(p, 1).unwrap(),
                        [tag],
                        "first word of {p:#x} clobbered"
                    );
                    assert_eq!(
                        dev.read_words(last, 1).unwrap(),
                        [tag],
                        "last word of {p:#x} clobbered"
                    );
                    live.lock().unwrap().remove(&p).expect("was live");
                    pool.free_async(a, s).unwrap();
                };
                for i in 0..OPS {
                    let r = rng.next() % 100;
                    if r < 5 {
                        if let Some(x) = handoff.lock().unwrap().pop() {
                            free(x);
                        }
                    } else if !mine.is_empty() && (mine.len() >= 16 || r < 50) {
                        let k = rng.next() as usize % mine.len();
                        let x = mine.swap_remove(k);
                        if r < 10 {
                            handoff.lock().unwrap().push(x);
                        } else {
                            free(x);
                        }
                    } else {
                        let size = rng.log_range(256, 4 << 20) as usize & !3;
                        let a = pool.alloc_async(size, s).unwrap();
                        let p = a.ptr();
                        claim(live, p, p + size as u64);
                        let tag = (t * OPS + i) as u32;
                        let last = p + (size as u64 / 4 - 1) * 4;
                        dev.write_words(p, &[tag]).unwrap();
                        dev.write_words(last, &[tag]).unwrap();
                        mine.push((a, tag));
                    }
                }
                for x in mine {
                    free(x);
                }
            });
        }
    });
    let s = dev.create_stream().unwrap();
    for (a, _) in handoff.into_inner().unwrap() {
        live.lock().unwrap().remove(&a.ptr());
        pool.free_async(a, s).unwrap();
    }
    assert!(live.lock().unwrap().is_empty());
    let st = pool.stats();
    assert_eq!(st.used_current, 0, "{st:?}");
    assert_eq!(st.allocs, st.frees);
    assert!(st.allocs > (THREADS * OPS / 4) as u64);
    assert_eq!(
        st.reserved_current,
        (st.growths - st.releases) * PAGE as u64
    );
    assert!(st.reserved_high <= 1 << 30);
    pool.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    assert_eq!(pool.stats().reserved_current, 0);
}
