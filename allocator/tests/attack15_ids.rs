//! Stream ids across device instances: streams of two host devices made
//! in turns (A0 B0 A1 B1 ...) still get consecutive ids per device, so a
//! pool's runs of forgotten ids are not split by the other device's
//! streams; a stream never met between forgotten ones is served; a
//! stream of the other device, even one with the same local number as a
//! forgotten one, is refused as foreign (not as retired) and leaves the
//! pool's stream table as it was; a stream forgotten by one pool is
//! served by another pool of the same device.
//!
//! Caught: host streams numbered from the process-wide id counter again
//! (ids not consecutive per device, runs split), and a run of forgotten
//! ids taken to cover the id just after it (a never-met stream refused).

mod common;

use std::sync::Arc;
use tidepool::{MemPool, PoolError};
use tidepool_sys::{Device, HostDevice, Stream, SysError};

const MIB: usize = 1 << 20;

/// Meet `s` (an allocation and a free), retire it, and let the pool
/// forget it.
fn forget(pool: &MemPool<HostDevice>, dev: &HostDevice, s: Stream) {
    let a = pool.alloc_async(4096, s).unwrap();
    pool.free_async(a, s).unwrap();
    pool.retire_stream(s).unwrap();
    dev.synchronize_stream(s).unwrap();
    pool.trim_to(u64::MAX).unwrap();
}

fn served(pool: &MemPool<HostDevice>, s: Stream, what: &str) {
    let a = pool
        .alloc_async(4096, s)
        .unwrap_or_else(|e| panic!("{what}: refused: {e}"));
    pool.free_async(a, s).unwrap();
}

fn is_foreign(e: &PoolError) -> bool {
    matches!(e, PoolError::Device(SysError::ForeignHandle { .. }))
}

#[test]
fn two_devices_interleaved_streams() {
    let da = Arc::new(common::host_with_capacity(64 * MIB));
    let db = Arc::new(common::host_with_capacity(64 * MIB));
    let pa = common::pool(&da, common::config());
    let pb = common::pool(&db, common::config());
    let (mut a, mut b): (Vec<Stream>, Vec<Stream>) = (vec![], vec![]);
    for _ in 0..8 {
        a.push(da.create_stream().unwrap());
        // Another device's handles of every kind between them.
        b.push(db.create_stream().unwrap());
        let ev = db.create_event().unwrap();
        db.destroy_event(ev).unwrap();
        let ev = da.create_event().unwrap();
        da.destroy_event(ev).unwrap();
    }
    for v in [&a, &b] {
        assert!(
            v.windows(2).all(|w| w[1].id() == w[0].id() + 1),
            "one device's streams get consecutive ids: {:?}",
            v.iter().map(|x| x.id()).collect::<Vec<_>>()
        );
    }
    // Pool A forgets A's even streams, out of order; pool B B's odd ones.
    for i in [6usize, 0, 4, 2] {
        forget(&pa, &da, a[i]);
    }
    for i in [7usize, 1, 5, 3] {
        forget(&pb, &db, b[i]);
    }
    // Pool A meets B's streams: refused as foreign, the table unchanged,
    // whether their local number is that of a forgotten A stream or not.
    let before = pa.stream_footprint();
    for &s in &b {
        let e = pa.alloc_async(4096, s).unwrap_err();
        assert!(is_foreign(&e), "B's {s:?} on pool A: {e}");
        let e = pa.record_event(s).unwrap_err();
        assert!(is_foreign(&e), "B's {s:?} on pool A: {e}");
    }
    let after = pa.stream_footprint();
    assert_eq!(
        (before.table, before.forgotten),
        (after.table, after.forgotten),
        "foreign streams leave no trace"
    );
    // 0 | 2 | 4 | 6: split by the never-met odd ones, which are served.
    assert_eq!(
        pa.stream_footprint().forgotten,
        4,
        "{:?}",
        pa.stream_footprint()
    );
    for i in [1usize, 3, 5] {
        served(
            &pa,
            a[i],
            &format!("A{i}, never met, between forgotten ones"),
        );
    }
    for i in [0usize, 2, 4, 6] {
        assert!(
            matches!(
                pa.alloc_async(4096, a[i]),
                Err(PoolError::StreamRetired { .. })
            ),
            "forgotten A{i} refused"
        );
        served(&pb, b[i], &format!("B{i} on pool B, never retired there"));
    }
    for i in [1usize, 3, 5, 7] {
        assert!(
            matches!(
                pb.alloc_async(4096, b[i]),
                Err(PoolError::StreamRetired { .. })
            ),
            "forgotten B{i} refused"
        );
    }
    // A's odd streams forgotten too: A0..A6 make one run, untouched by
    // B's streams and every event made in between.
    for i in [3usize, 1, 5] {
        pa.retire_stream(a[i]).unwrap();
        da.synchronize_stream(a[i]).unwrap();
    }
    pa.synchronize().unwrap();
    pa.trim_to(u64::MAX).unwrap();
    assert_eq!(
        pa.stream_footprint().forgotten,
        1,
        "{:?}",
        pa.stream_footprint()
    );
    served(&pa, a[7], "A7, never met, just after the run");
    assert!(pa.alloc_async(4096, a[3]).is_err(), "A3 forgotten");
    pa.synchronize().unwrap();
    pb.synchronize().unwrap();
}

/// Two pools of one device: a stream one pool forgot is served by the
/// other, and the other's forgetting does not leak back.
#[test]
fn two_pools_one_device() {
    let dev = Arc::new(common::host_with_capacity(64 * MIB));
    let p1 = common::pool(&dev, common::config());
    let p2 = common::pool(&dev, common::config());
    let s = common::streams(&*dev, 5);
    for i in [0usize, 2, 4] {
        forget(&p1, &dev, s[i]);
    }
    forget(&p2, &dev, s[1]);
    for i in [0usize, 2, 4] {
        served(
            &p2,
            s[i],
            &format!("s{i} on the pool that never retired it"),
        );
        assert!(
            matches!(
                p1.alloc_async(4096, s[i]),
                Err(PoolError::StreamRetired { .. })
            ),
            "s{i} forgotten by pool 1"
        );
    }
    served(&p1, s[1], "s1 on pool 1 (forgotten by pool 2 only)");
    served(&p1, s[3], "s3, never met, between forgotten ones");
    assert!(matches!(
        p2.alloc_async(4096, s[1]),
        Err(PoolError::StreamRetired { .. })
    ));
    p1.synchronize().unwrap();
    p2.synchronize().unwrap();
}
