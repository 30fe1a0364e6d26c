//! A bare loop of producer/consumer rounds on the host backend, for
//! counting instructions per round with callgrind (no criterion, no
//! timing): `pc_loop [streams] [rounds]`. Each round is the
//! `producer_consumer` bench's: allocate 64 KiB on the producer, record an
//! event through the pool, make the next consumer (round robin over the
//! other streams) wait on it, free the block there. Run it twice with
//! different round counts and divide the difference in instructions by
//! the difference in rounds.

use std::sync::Arc;
use tidepool::{MemPool, PoolConfig};
use tidepool_sys::{Device, HostConfig, HostDevice};

const SIZE: usize = 64 << 10;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(2);
    let rounds: u64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(100_000);
    assert!(n >= 2, "at least a producer and a consumer");
    let device = Arc::new(HostDevice::with_config(HostConfig {
        capacity: 256 << 20,
        ..Default::default()
    }));
    // A small address range: valgrind refuses the default one's size.
    let config = PoolConfig::default().with_va_size(1 << 30);
    let pool = MemPool::new(device.clone(), config).expect("pool");
    let streams: Vec<_> = (0..n)
        .map(|_| device.create_stream().expect("stream"))
        .collect();
    let (producer, consumers) = (streams[0], &streams[1..]);
    let mut next = 0;
    // Warm up: every consumer has met the pool (its entry is made).
    for _ in 0..2 * consumers.len() + 1 {
        round(&pool, producer, consumers[next]);
        next = (next + 1) % consumers.len();
    }
    for _ in 0..rounds {
        std::hint::black_box(round(&pool, producer, consumers[next]));
        next = (next + 1) % consumers.len();
    }
    let total = rounds + 2 * consumers.len() as u64 + 1;
    let stats = pool.stats();
    assert_eq!((stats.allocs, stats.frees), (total, total));
    pool.synchronize().expect("sync");
}

fn round(
    pool: &MemPool<HostDevice>,
    producer: tidepool_sys::Stream,
    consumer: tidepool_sys::Stream,
) -> u64 {
    let x = pool.alloc_async(SIZE, producer).expect("alloc_async");
    let got = x.ptr();
    let ev = pool.record_event(producer).expect("record_event");
    pool.wait_event(consumer, &ev).expect("wait_event");
    pool.free_async(x, consumer).expect("free_async");
    got
}
