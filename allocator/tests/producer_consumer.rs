//! Producer/consumer across streams: a block allocated on one stream and
//! freed on another (after an event the pool recorded and the consumer
//! waited on) comes back to the producer once the free is known complete,
//! and what an allocation costs in device queries does not grow with the
//! number of consumer streams.

use std::sync::Arc;
use tidepool::{MemPool, PoolConfig};
use tidepool_sys::{Device, FaultInjector, HostConfig, HostDevice, Op, Stream};

type Dev = FaultInjector<HostDevice>;

const SIZE: usize = 64 << 10;

fn setup(streams: usize) -> (Arc<Dev>, MemPool<Dev>, Vec<Stream>) {
    let dev = Arc::new(FaultInjector::new(HostDevice::with_config(HostConfig {
        capacity: 64 << 20,
        granularity: 2 << 20,
    })));
    let pool = MemPool::new(dev.clone(), PoolConfig::default().with_va_size(1 << 30)).unwrap();
    let s = (0..streams).map(|_| dev.create_stream().unwrap()).collect();
    (dev, pool, s)
}

/// One round: allocate on the producer, record an event there, the
/// consumer waits on it and frees the block. Returns the block's address.
fn round(pool: &MemPool<Dev>, producer: Stream, consumer: Stream) -> u64 {
    let x = pool.alloc_async(SIZE, producer).unwrap();
    let ptr = x.ptr();
    let ev = pool.record_event(producer).unwrap();
    pool.wait_event(consumer, &ev).unwrap();
    pool.free_async(x, consumer).unwrap();
    ptr
}

/// Device calls a round may cost on top of the round's own record, wait
/// and capture checks: learning what completed.
fn learning_calls(dev: &Dev) -> u64 {
    dev.calls(Op::QueryStream) + dev.calls(Op::QueryEvent) + dev.calls(Op::RecordEvent)
}

#[test]
fn the_producer_gets_back_the_block_a_consumer_freed_once_it_completed() {
    let (dev, pool, s) = setup(3);
    let producer = s[0];
    let mut last = round(&pool, producer, s[1]);
    for k in 0..40 {
        let consumer = s[1 + k % 2];
        // The consumer's work is done; the pool is not told (no
        // synchronisation through it): it has to find out by itself.
        for &c in &s[1..] {
            dev.synchronize_stream(c).unwrap();
        }
        let got = round(&pool, producer, consumer);
        assert_eq!(got, last, "round {k}: the block freed in the round before");
        last = got;
    }
    let stats = pool.stats();
    assert_eq!(
        stats.internal_dependencies, 0,
        "reused without a dependency"
    );
    assert_eq!(stats.growths, 1, "one page for a live set of one block");
    for &c in &s {
        dev.synchronize_stream(c).unwrap();
    }
}

#[test]
fn learning_what_completed_costs_the_same_with_2_and_64_streams() {
    let per_round = |n: usize| {
        let (dev, pool, s) = setup(n);
        let rounds = 4 * 63;
        // Warm up: every consumer once.
        for k in 0..n - 1 {
            round(&pool, s[0], s[1 + k]);
        }
        let before = learning_calls(&dev);
        let created = dev.calls(Op::CreateEvent);
        for k in 0..rounds {
            round(&pool, s[0], s[1 + k % (n - 1)]);
        }
        let calls = learning_calls(&dev) - before;
        // The producer's own events are drained as they complete, so the
        // recycler hands the same few events out again.
        let new_events = dev.calls(Op::CreateEvent) - created;
        assert!(new_events <= 16, "{n} streams: {new_events} events created");
        for &c in &s {
            dev.synchronize_stream(c).unwrap();
        }
        calls as f64 / rounds as f64
    };
    let (two, many) = (per_round(2), per_round(64));
    // Each round records one event itself; learning adds a few queries of
    // the streams that freed since the last allocation, not one per stream.
    assert!(two <= 4.0, "2 streams: {two} calls per round");
    assert!(
        many <= two + 1.0,
        "64 streams: {many} calls per round against {two} with 2"
    );
}
