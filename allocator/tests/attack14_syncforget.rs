//! `MemPool::synchronize` waits for each retired stream's last event: the
//! pool then knows the stream's work done, and the retired stream must
//! leave the stream table (no slow path, no trim needed).
//!
//! Host backend; work bounded by operation counts.

mod common;

use std::sync::Arc;
use tidepool_sys::Device;

const MIB: usize = 1 << 20;

#[test]
fn synchronize_forgets_the_retired_stream_it_waited_for() {
    let dev = Arc::new(common::host_with_capacity(64 * MIB));
    let pool = common::pool(&dev, common::config());
    let s = dev.create_stream().unwrap();
    // s stays busy until after its retirement.
    let mut hold = common::Blocker::on(&*dev, s);
    pool.free_async(pool.alloc_async(4096, s).unwrap(), s)
        .unwrap();
    pool.retire_stream(s).unwrap();
    hold.release();
    pool.synchronize().unwrap();
    let f = pool.stream_footprint();
    assert_eq!((f.table, f.retired_waiting), (0, 0), "{f:?}");
    dev.destroy_stream(s).unwrap();
}
