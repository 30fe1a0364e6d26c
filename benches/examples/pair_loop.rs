//! A bare loop of same-stream alloc+free pairs on the host backend, for
//! counting instructions per pair with callgrind or `perf stat` (no
//! criterion, no timing): `pair_loop [strict|announced] [pairs] [size]`.
//! Run it twice with different pair counts and divide the difference in
//! instructions by the difference in pairs: what is left is one pair.

use std::hint::black_box;
use std::sync::Arc;
use tidepool::{MemPool, PoolConfig};
use tidepool_sys::{Device, HostConfig, HostDevice};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let mode = args.get(1).map_or("strict", String::as_str);
    let pairs: u64 = args
        .get(2)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    let size: usize = args.get(3).and_then(|a| a.parse().ok()).unwrap_or(256);
    // Room for the largest size the pair bench measures (1 GiB); the host
    // backend touches no page of it.
    let device = Arc::new(HostDevice::with_config(HostConfig {
        capacity: 2 << 30,
        ..Default::default()
    }));
    let config = PoolConfig::default().with_va_size(2 << 30);
    let pool = MemPool::new(device.clone(), config).expect("pool");
    match mode {
        "strict" => {}
        "announced" => pool.set_announced_captures(true),
        other => panic!("mode {other:?}: strict or announced"),
    }
    let s = device.create_stream().expect("stream");
    // Prime: the stream's cache holds a block of the size.
    let a = pool.alloc_async(size, s).expect("alloc");
    pool.free_async(a, s).expect("free");
    for _ in 0..pairs {
        let a = pool.alloc_async(black_box(size), s).expect("alloc");
        black_box(a.ptr());
        pool.free_async(a, s).expect("free");
    }
    let stats = pool.stats();
    assert_eq!(stats.allocs, pairs + 1);
    assert_eq!(stats.cache_hits, pairs);
    pool.synchronize().expect("sync");
}
