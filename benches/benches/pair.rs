//! Same-stream alloc+free pair, 256 B … 1 GiB: tidepool (CUDA backend, and
//! with the capture check off), the driver pool (threshold max; threshold
//! 0 with a stream sync per pair), `cuMemAlloc`/`cuMemFree`, and tidepool on
//! the host backend (runs anywhere).

use criterion::{criterion_group, criterion_main, Criterion};
use std::hint::black_box;
use std::sync::Arc;
mod benchutil;
use benchutil::{self as bu, BenchAlloc, BenchStreams, Meas};
use tidepool_sys::Device;

const SIZES: [usize; 6] = [256, 64 << 10, 2 << 20, 16 << 20, 256 << 20, 1 << 30];

fn pair<A: BenchAlloc>(g: &mut bu::Group<'_>, dev: Arc<dyn Device>, make: impl FnOnce() -> A) {
    let streams = BenchStreams::new(dev, 1);
    let st = streams.streams[0];
    let a = make();
    for size in SIZES {
        // Prime: the pool holds memory of this size before timing starts.
        let h = a.alloc(size, st);
        a.free(h, st);
        a.sync(st);
        let m = Meas {
            bench: "pair",
            backend: a.backend(),
            allocator: a.name(),
            param: bu::size_label(size),
            ops_per_iter: 1,
        };
        let sync = a.sync_each_pair();
        bu::bench(g, &m, |iters| {
            bu::time_loop(iters, || {
                let h = a.alloc(black_box(size), st);
                black_box(A::ptr(&h));
                a.free(h, st);
                if sync {
                    a.sync(st);
                }
            })
        });
        a.sync(st);
    }
}

fn benches(c: &mut Criterion) {
    bu::Summary::meta("pair");
    let mut g = bu::group(c, "pair", false);
    let host = bu::host_device();
    pair(&mut g, host.clone(), || bu::Tidepool::new(host.clone()));
    pair(&mut g, host.clone(), || bu::Tidepool::nocheck(host.clone()));
    if let Some(dev) = bu::cuda_or_skip("pair (cuda)") {
        pair(&mut g, dev.clone(), || bu::Tidepool::new(dev.clone()));
        pair(&mut g, dev.clone(), || bu::Tidepool::nocheck(dev.clone()));
        pair(&mut g, dev.clone(), || bu::Driver::new(dev.clone()));
        pair(&mut g, dev.clone(), || {
            bu::Driver::threshold_zero(dev.clone())
        });
        pair(&mut g, dev.clone(), || bu::CuMem { dev: dev.clone() });
    }
    g.finish();
}

criterion_group! {
    name = group;
    config = bu::criterion();
    targets = benches
}
criterion_main!(group);
