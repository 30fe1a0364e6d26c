//! Cross-stream reuse: allocate and free on stream A, record an event on A,
//! make B wait on it, allocate on B (the reuse being measured), then order
//! A after B (event) and free B's block on A, so B never holds a free of its
//! own and every B allocation must come from A's free. One op = one such
//! round (2 allocs, 2 frees, 2 events, 2 waits). tidepool goes through
//! `pool.record_event`/`pool.wait_event`; the driver pool through raw events
//! of the device (the driver follows event dependencies itself). The
//! summary's `cross_stream_reuse` note gives the fraction of B allocations
//! that got the address A had just freed.

use criterion::{criterion_group, criterion_main, Criterion};
use std::sync::Arc;
use tidepool::MemPool;
mod benchutil;
use benchutil::{self as bu, BenchAlloc, BenchStreams, Meas};
use tidepool_sys::{Device, DevicePtr, Stream};

const SIZE: usize = 64 << 10;

/// One round; returns (address freed on A, address allocated on B).
trait Round {
    fn round(&self, a: Stream, b: Stream) -> (DevicePtr, DevicePtr);
}

struct PoolRound<'a, D: Device>(&'a MemPool<D>);

impl<D: Device> Round for PoolRound<'_, D> {
    #[inline]
    fn round(&self, a: Stream, b: Stream) -> (DevicePtr, DevicePtr) {
        let p = self.0;
        let x = p.alloc_async(SIZE, a).expect("alloc_async");
        let freed = x.ptr();
        p.free_async(x, a).expect("free_async");
        let ev = p.record_event(a).expect("record_event");
        p.wait_event(b, &ev).expect("wait_event");
        let y = p.alloc_async(SIZE, b).expect("alloc_async");
        let got = y.ptr();
        let ev = p.record_event(b).expect("record_event");
        p.wait_event(a, &ev).expect("wait_event");
        p.free_async(y, a).expect("free_async");
        (freed, got)
    }
}

struct RawRound<'a> {
    pool: &'a bu::Driver,
    events: [tidepool_sys::Event; 2],
}

impl Round for RawRound<'_> {
    #[inline]
    fn round(&self, a: Stream, b: Stream) -> (DevicePtr, DevicePtr) {
        let dev = &self.pool.dev;
        let x = self.pool.alloc(SIZE, a);
        self.pool.free(x, a);
        dev.record_event(self.events[0], a).expect("cuEventRecord");
        dev.wait_event(b, self.events[0])
            .expect("cuStreamWaitEvent");
        let y = self.pool.alloc(SIZE, b);
        dev.record_event(self.events[1], b).expect("cuEventRecord");
        dev.wait_event(a, self.events[1])
            .expect("cuStreamWaitEvent");
        self.pool.free(y, a);
        (x, y)
    }
}

fn run(g: &mut bu::Group<'_>, backend: &str, name: &str, streams: &BenchStreams, h: &impl Round) {
    let (a, b) = (streams.streams[0], streams.streams[1]);
    let mut reused = 0u64;
    let mut total = 0u64;
    h.round(a, b);
    let m = Meas {
        bench: "cross_stream",
        backend,
        allocator: name,
        param: "64KiB".into(),
        ops_per_iter: 1,
    };
    bu::bench(g, &m, |iters| {
        bu::time_loop(iters, || {
            let (freed, got) = h.round(a, b);
            reused += u64::from(freed == got);
            total += 1;
        })
    });
    let frac = reused as f64 / total.max(1) as f64;
    eprintln!(
        "cross_stream {backend}/{name}: {frac:.3} of B's allocations got A's just-freed block"
    );
    bu::Summary::append_line(
        &serde_json::json!({
            "note": "cross_stream_reuse",
            "backend": backend,
            "allocator": name,
            "reused": (frac * 1e4).round() / 1e4,
        })
        .to_string(),
    );
    streams.device.synchronize_stream(a).expect("sync");
    streams.device.synchronize_stream(b).expect("sync");
}

fn tidepool<D: Device>(g: &mut bu::Group<'_>, dev: Arc<D>) {
    let streams = BenchStreams::new(dev.clone(), 2);
    let t = bu::Tidepool::new(dev);
    run(g, t.backend(), t.name(), &streams, &PoolRound(&t.pool));
}

fn benches(c: &mut Criterion) {
    bu::Summary::meta("cross_stream");
    let mut g = bu::group(c, "cross_stream", false);
    tidepool(&mut g, bu::host_device());
    if let Some(dev) = bu::cuda_or_skip("cross_stream (cuda)") {
        tidepool(&mut g, dev.clone());
        let streams = BenchStreams::new(dev.clone(), 2);
        let pool = bu::Driver::new(dev.clone());
        let events = [
            dev.create_event().expect("create event"),
            dev.create_event().expect("create event"),
        ];
        let h = RawRound {
            pool: &pool,
            events,
        };
        run(&mut g, "cuda", pool.name(), &streams, &h);
        for e in events {
            let _ = dev.destroy_event(e);
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
