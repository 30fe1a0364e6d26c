//! Many live allocations: allocate 10,000 × 64 KiB on one stream, then free
//! them all; the alloc phase and the free phase are timed separately and
//! reported per operation. The driver pool with threshold 0 synchronises
//! the stream after the free phase (timed with it).

use criterion::{criterion_group, criterion_main, Criterion};
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};
mod benchutil;
use benchutil::{self as bu, BenchAlloc, BenchStreams, Meas};
use tidepool_sys::Device;

const COUNT: usize = 10_000;
const SIZE: usize = 64 << 10;

fn many<A: BenchAlloc>(g: &mut bu::Group<'_>, dev: Arc<dyn Device>, make: impl FnOnce() -> A) {
    let streams = BenchStreams::new(dev, 1);
    let st = streams.streams[0];
    let a = make();
    let mut live: Vec<A::Handle> = Vec::with_capacity(COUNT);
    // One untimed round so the pool holds the memory.
    for _ in 0..COUNT {
        live.push(a.alloc(SIZE, st));
    }
    for h in live.drain(..) {
        a.free(h, st);
    }
    a.sync(st);
    for phase in ["alloc", "free"] {
        let m = Meas {
            bench: "many_live",
            backend: a.backend(),
            allocator: a.name(),
            param: format!("{phase}/10000x64KiB"),
            ops_per_iter: COUNT as u64,
        };
        bu::bench(g, &m, |iters| {
            let mut timed = Duration::ZERO;
            for _ in 0..iters {
                let t = Instant::now();
                for _ in 0..COUNT {
                    live.push(a.alloc(black_box(SIZE), st));
                }
                if phase == "alloc" {
                    timed += t.elapsed();
                }
                let t = Instant::now();
                for h in live.drain(..) {
                    a.free(h, st);
                }
                if a.sync_each_pair() {
                    a.sync(st);
                }
                if phase == "free" {
                    timed += t.elapsed();
                }
            }
            timed
        });
    }
    a.sync(st);
}

fn benches(c: &mut Criterion) {
    bu::Summary::meta("many_live");
    let mut g = bu::group(c, "many_live", true);
    let host = bu::host_device();
    many(&mut g, host.clone(), || bu::Tidepool::new(host.clone()));
    if let Some(dev) = bu::cuda_or_skip("many_live (cuda)") {
        many(&mut g, dev.clone(), || bu::Tidepool::new(dev.clone()));
        many(&mut g, dev.clone(), || bu::Driver::new(dev.clone()));
        many(&mut g, dev.clone(), || {
            bu::Driver::threshold_zero(dev.clone())
        });
        many(&mut g, dev.clone(), || bu::CuMem { dev: dev.clone() });
    }
    g.finish();
}

criterion_group! {
    name = group;
    config = bu::criterion();
    targets = benches
}
criterion_main!(group);
