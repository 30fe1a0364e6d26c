//! Ids of forgotten streams: kept as runs of consecutive ids, met in any
//! order, with events made between the streams (a backend counts stream
//! ids apart from event ids, so the events split no run) and streams the
//! pool never met between them (which do). A forgotten stream is
//! refused ([`PoolError::StreamRetired`]) wherever the pool meets it
//! again; a stream the pool never met, even one whose id lies between two
//! forgotten ones, is not.
//!
//! The only test of its binary: its ids are then consecutive, no other
//! test making streams meanwhile.

mod common;

use std::sync::Arc;
use tidepool::PoolError;
use tidepool_sys::{Device, Stream};

const MIB: usize = 1 << 20;

#[test]
fn forgotten_ids_are_refused_and_ids_between_them_are_not() {
    let dev = Arc::new(common::host_with_capacity(64 * MIB));
    let pool = common::pool(&dev, common::config());
    // Streams, each third one followed by an event (which takes no stream
    // id).
    let mut s: Vec<Stream> = Vec::new();
    for i in 0..9 {
        s.push(dev.create_stream().unwrap());
        if i % 3 == 2 {
            let ev = dev.create_event().unwrap();
            dev.destroy_event(ev).unwrap();
        }
    }
    assert!(
        s.windows(2).all(|w| w[1].id() == w[0].id() + 1),
        "stream ids consecutive, events between them or not: {:?}",
        s.iter().map(|x| x.id()).collect::<Vec<_>>()
    );
    // Met, used, retired and forgotten out of id order; 1, 4 and 7 never met.
    let gone = [5usize, 0, 8, 2, 3, 6];
    let mut live = Vec::new();
    for &i in &gone {
        let a = pool.alloc_async(4096, s[i]).unwrap();
        pool.free_async(pool.alloc_async(8192, s[i]).unwrap(), s[i])
            .unwrap();
        live.push(a);
        pool.retire_stream(s[i]).unwrap();
        dev.synchronize_stream(s[i]).unwrap();
        pool.trim_to(u64::MAX).unwrap();
    }
    let f = pool.stream_footprint();
    assert_eq!((f.table, f.retired_waiting), (0, 0), "all forgotten: {f:?}");
    // 0 | 2 [event] 3 | 5 [event] 6 | 8, split by the never-met 1, 4, 7.
    assert_eq!(f.forgotten, 4, "runs of ids: {f:?}");
    // A thread that never used them: they are refused by id.
    std::thread::scope(|sc| {
        sc.spawn(|| {
            for &i in &gone {
                match pool.alloc_async(4096, s[i]) {
                    Err(PoolError::StreamRetired { stream }) => assert_eq!(stream, s[i]),
                    Err(e) => panic!("stream {i}: {e}"),
                    Ok(_) => panic!("forgotten stream {i} ({:?}) met anew", s[i]),
                }
                assert!(matches!(
                    pool.record_event(s[i]),
                    Err(PoolError::StreamRetired { .. })
                ));
                // Retiring again is not an error.
                pool.retire_stream(s[i]).unwrap();
            }
            for i in [1usize, 4, 7] {
                let x = pool
                    .alloc_async(4096, s[i])
                    .unwrap_or_else(|e| panic!("stream {i} never met, refused: {e}"));
                pool.free_async(x, s[i]).unwrap();
            }
        });
    });
    // This thread too (it may still hold their entries).
    for &i in &gone {
        assert!(matches!(
            pool.alloc_async(4096, s[i]),
            Err(PoolError::StreamRetired { .. })
        ));
    }
    // A block of a forgotten stream: refused on it, freed on another.
    for (k, a) in live.into_iter().enumerate() {
        let e = pool.free_async(a, s[gone[k]]).unwrap_err();
        assert!(matches!(e.error, PoolError::StreamRetired { .. }), "{e}");
        pool.free_async(e.allocation, s[1]).unwrap();
    }
    pool.synchronize().unwrap();
    let st = pool.stats();
    assert_eq!(st.used_current, 0, "{st:?}");
    // 2 per forgotten stream, 1 per never-met one.
    assert_eq!((st.allocs, st.frees), (15, 15), "{st:?}");
    for x in s {
        pool.retire_stream(x).unwrap();
        dev.destroy_stream(x).unwrap();
    }
    pool.synchronize().unwrap();
    let f = pool.stream_footprint();
    // One run: the never-met streams were met and forgotten too.
    assert_eq!((f.table, f.forgotten), (0, 1), "runs at the end: {f:?}");
}
