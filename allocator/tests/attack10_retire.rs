//! A stream whose pages moved while its frees were pending is retired,
//! or destroyed without retirement, while it is still held: its kernels
//! still find every place they write mapped (the held places and the
//! moved block), another stream gets none of them meanwhile, and once
//! the stream's work ran a synchronisation settles its frees: the holds
//! go, `trim_to(0)` leaves nothing reserved, the device no handle, the
//! dropped pool no mapping.
//!
//! Host backend; work is bounded by operation counts, the stream held by
//! a gate. Caught: holds forgotten at the next request whether or not
//! their frees completed (t got A's old place).

mod common;

use common::{overlaps, write_kernel, Blocker, PAGE};
use std::sync::Arc;
use tidepool::ReusePolicy;
use tidepool_sys::Device;

const MIB: usize = 1 << 20;

fn retire_or_destroy_while_held(retire: bool) {
    let dev = Arc::new(common::host_with_capacity(64 * MIB));
    let pool = common::pool(
        &dev,
        common::config()
            .with_max_size(6 * PAGE as u64)
            .with_stream_cache_bytes(0)
            .with_reuse(ReusePolicy {
                follow_event_dependencies: true,
                opportunistic: true,
                internal_dependencies: false,
                wait_for_pending_frees: false,
            }),
    );
    let s = dev.create_stream().unwrap();
    let t = dev.create_stream().unwrap();
    let mut hold = Blocker::on(&*dev, s);

    let a = pool.alloc_async(6 * MIB, s).unwrap();
    let c = pool.alloc_async(PAGE, t).unwrap();
    let (a_ptr, a_len) = (a.ptr(), a.size());
    let ka = write_kernel(&dev, s, a_ptr, common::pattern(91, a_len / 4));
    pool.free_async(a, s).unwrap();
    let b = pool.alloc_async(9 * MIB, s).unwrap();
    assert_eq!(pool.pending_move_counts(), (3, 0), "A's pages moved");
    let (b_ptr, b_len) = (b.ptr(), b.size());
    let kb = write_kernel(&dev, s, b_ptr, common::pattern(92, b_len / 4));
    pool.free_async(b, s).unwrap();
    if retire {
        pool.retire_stream(s).unwrap();
    }
    dev.destroy_stream(s).unwrap();

    // t, with a complete page of its own: never over A's or B's place.
    pool.free_async(c, t).unwrap();
    pool.synchronize_stream(t).unwrap();
    for len in [PAGE, MIB, 4 * MIB, 6 * MIB] {
        if let Ok(d) = pool.alloc_async(len, t) {
            for (p, n) in [(a_ptr, a_len), (b_ptr, b_len)] {
                assert!(
                    !overlaps(d.ptr(), d.size(), p, n),
                    "t got {len} B at {:#x} over {p:#x}, which s's work writes",
                    d.ptr()
                );
            }
            pool.free_async(d, t).unwrap();
            pool.synchronize_stream(t).unwrap();
        }
    }
    assert_eq!(pool.pending_move_counts().1, 0);
    assert!(!hold.done());
    hold.release();
    assert!(ka.recv().unwrap(), "A's old place was unmapped");
    assert!(kb.recv().unwrap(), "B's place was unmapped");
    pool.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    assert_eq!(pool.stats().reserved_current, 0, "held pages stayed");
    assert_eq!(dev.live_handles(), 0);
    assert_eq!(pool.pending_move_counts().1, 0);
    drop(pool);
    assert_eq!(dev.live_mappings(), 0);
}

#[test]
fn a_retired_stream_whose_pages_moved_while_pending() {
    retire_or_destroy_while_held(true);
}

#[test]
fn a_destroyed_stream_whose_pages_moved_while_pending() {
    retire_or_destroy_while_held(false);
}
