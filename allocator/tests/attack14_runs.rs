//! Runs of forgotten stream ids when other handles are made between
//! streams: a pool that releases memory and grows again between two
//! streams (a release threshold, a trim) makes a physical page between
//! every two churned streams. Stream ids count apart from other handles'
//! ids, so what the pool keeps of forgotten streams does not grow with the
//! number of rounds.
//!
//! The only test of its binary (no other test takes ids meanwhile).
//! Host backend; work bounded by round counts.

mod common;

use std::sync::Arc;
use tidepool_sys::Device;

const MIB: usize = 1 << 20;

#[test]
fn forgotten_runs_stay_bounded_with_pages_between_streams() {
    let dev = Arc::new(common::host_with_capacity(64 * MIB));
    let pool = common::pool(&dev, common::config());
    let rounds = 200;
    for _ in 0..rounds {
        let s = dev.create_stream().unwrap();
        pool.free_async(pool.alloc_async(common::PAGE, s).unwrap(), s)
            .unwrap();
        pool.retire_stream(s).unwrap();
        dev.synchronize_stream(s).unwrap();
        dev.destroy_stream(s).unwrap();
        // Release everything: the next round grows a new page.
        pool.trim_to(0).unwrap();
    }
    let f = pool.stream_footprint();
    assert_eq!(f.table, 0, "{f:?}");
    assert!(
        f.forgotten <= 8,
        "{} runs after {rounds} rounds: {f:?}",
        f.forgotten
    );
}
