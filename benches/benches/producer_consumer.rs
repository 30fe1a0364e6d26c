//! Producer/consumer across streams: one producer stream allocates a block,
//! records an event, the next consumer stream (round robin over the other
//! streams) waits on it and frees the block. One op = one such round
//! (1 alloc, 1 event record, 1 stream wait, 1 free), measured with 2, 8
//! and 64 streams in all (1 producer and 1, 7 or 63 consumers), so that a
//! cost growing with the number of streams shows up as the ratio between
//! the rows.
//!
//! One producer feeding consumers in turn (rather than independent pairs)
//! is the shape of a data loader or a pipeline stage: every consumer's free
//! is memory the producer wants back, and the only order between them is
//! the producer → consumer event, so the producer can get the block back
//! only once the consumer's free is known complete (opportunistic reuse),
//! never by following an event.
//!
//! tidepool goes through `pool.record_event`/`pool.wait_event`; the driver
//! pool (cuda only) through `cuMemAllocFromPoolAsync`, `cuEventRecord`,
//! `cuStreamWaitEvent` and `cuMemFreeAsync`. After each measurement a
//! `producer_consumer_reuse` note gives the fraction of the producer's
//! allocations that got the block a consumer had freed in the round before,
//! and the allocator's peak reserved bytes over the measurement (the
//! footprint of a workload whose live set is one block).

use criterion::{criterion_group, criterion_main, Criterion};
use std::sync::Arc;
use tidepool::MemPool;
mod benchutil;
use benchutil::{self as bu, BenchAlloc, BenchStreams, Meas};
use tidepool_sys::{Device, DevicePtr, Event, Stream};

const SIZE: usize = 64 << 10;
const STREAMS: [usize; 3] = [2, 8, 64];

/// One round; returns the address allocated on the producer.
trait Round {
    fn round(&self, producer: Stream, consumer: Stream) -> DevicePtr;
    /// Peak reserved bytes since the last call (and restart the mark).
    fn take_reserved_high(&self) -> u64;
}

struct PoolRound<'a, D: Device>(&'a MemPool<D>);

impl<D: Device> Round for PoolRound<'_, D> {
    #[inline]
    fn round(&self, producer: Stream, consumer: Stream) -> DevicePtr {
        let p = self.0;
        let x = p.alloc_async(SIZE, producer).expect("alloc_async");
        let got = x.ptr();
        let ev = p.record_event(producer).expect("record_event");
        p.wait_event(consumer, &ev).expect("wait_event");
        p.free_async(x, consumer).expect("free_async");
        got
    }

    fn take_reserved_high(&self) -> u64 {
        let high = self.0.stats().reserved_high;
        self.0.reset_peaks();
        high
    }
}

struct DriverRound<'a> {
    pool: &'a bu::Driver,
    event: Event,
}

impl Round for DriverRound<'_> {
    #[inline]
    fn round(&self, producer: Stream, consumer: Stream) -> DevicePtr {
        let dev = &self.pool.dev;
        let x = self.pool.alloc(SIZE, producer);
        dev.record_event(self.event, producer)
            .expect("cuEventRecord");
        dev.wait_event(consumer, self.event)
            .expect("cuStreamWaitEvent");
        self.pool.free(x, consumer);
        x
    }

    fn take_reserved_high(&self) -> u64 {
        let high = self.pool.pool.reserved_high().expect("reserved-high");
        self.pool.pool.reset_highs().expect("reset highs");
        high
    }
}

fn run(g: &mut bu::Group<'_>, backend: &str, name: &str, streams: &BenchStreams, h: &impl Round) {
    let n = streams.streams.len();
    let producer = streams.streams[0];
    let consumers = &streams.streams[1..];
    let mut next = 0usize;
    // The block the previous round's consumer freed.
    let mut last = h.round(producer, consumers[0]);
    let (mut reused, mut total) = (0u64, 0u64);
    h.take_reserved_high();
    let m = Meas {
        bench: "producer_consumer",
        backend,
        allocator: name,
        param: format!("{n}streams"),
        ops_per_iter: 1,
    };
    bu::bench(g, &m, |iters| {
        bu::time_loop(iters, || {
            let got = h.round(producer, consumers[next]);
            next = (next + 1) % consumers.len();
            reused += u64::from(got == last);
            total += 1;
            last = got;
        })
    });
    let reserved_high = h.take_reserved_high();
    let frac = reused as f64 / total.max(1) as f64;
    eprintln!(
        "producer_consumer {backend}/{name} {n} streams: {frac:.3} of the producer's allocations \
         got the block freed on a consumer in the round before; peak reserved {reserved_high} B"
    );
    bu::Summary::append_line(
        &serde_json::json!({
            "note": "producer_consumer_reuse",
            "backend": backend,
            "allocator": name,
            "param": format!("{n}streams"),
            "reused": (frac * 1e4).round() / 1e4,
            "rounds": total,
            "peak_reserved_bytes": reserved_high,
        })
        .to_string(),
    );
    for &s in &streams.streams {
        streams.device.synchronize_stream(s).expect("sync");
    }
}

fn tidepool<D: Device>(g: &mut bu::Group<'_>, dev: Arc<D>) {
    for n in STREAMS {
        // A fresh pool per stream count, so that no row inherits the
        // previous row's streams.
        let streams = BenchStreams::new(dev.clone(), n);
        let t = bu::Tidepool::new(dev.clone());
        run(g, t.backend(), t.name(), &streams, &PoolRound(&t.pool));
    }
}

fn benches(c: &mut Criterion) {
    bu::Summary::meta("producer_consumer");
    let mut g = bu::group(c, "producer_consumer", false);
    tidepool(&mut g, bu::host_device());
    if let Some(dev) = bu::cuda_or_skip("producer_consumer (cuda)") {
        tidepool(&mut g, dev.clone());
        for n in STREAMS {
            let streams = BenchStreams::new(dev.clone(), n);
            let pool = bu::Driver::new(dev.clone());
            let event = dev.create_event().expect("create event");
            let h = DriverRound { pool: &pool, event };
            run(&mut g, "cuda", pool.name(), &streams, &h);
            let _ = dev.destroy_event(event);
        }
    }
    g.finish();
}

criterion_group! {
    name = group;
    config = bu::criterion();
    targets = benches
}
criterion_main!(group);
