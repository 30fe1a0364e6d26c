//! Thread scaling: 1, 2, 4, 8, 16 threads, each on its own stream, each
//! doing 64 KiB alloc+free pairs on one shared fresh pool. One criterion
//! iteration is one pair on every thread, so criterion's throughput and the
//! summary's `ops_per_sec` are aggregate pairs per second. Timed from the
//! release of a start barrier to the arrival of the last thread at an end
//! barrier (thread start and join are outside). On CUDA also with the
//! capture check off (`tidepool-nocheck`), to show what the driver's
//! `cuStreamIsCapturing` costs at scale.

use criterion::{criterion_group, criterion_main, Criterion};
use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::Instant;
mod benchutil;
use benchutil::{self as bu, BenchAlloc, BenchStreams, Meas};
use tidepool_sys::Device;

const THREADS: [usize; 5] = [1, 2, 4, 8, 16];
const SIZE: usize = 64 << 10;

fn scaling<A: BenchAlloc>(g: &mut bu::Group<'_>, dev: Arc<dyn Device>, make: impl FnOnce() -> A) {
    let streams = BenchStreams::new(dev, *THREADS.iter().max().unwrap_or(&1));
    let a = make();
    for &s in &streams.streams {
        let h = a.alloc(SIZE, s);
        a.free(h, s);
    }
    for n in THREADS {
        let m = Meas {
            bench: "threads",
            backend: a.backend(),
            allocator: a.name(),
            param: n.to_string(),
            ops_per_iter: n as u64,
        };
        let a = &a;
        bu::bench(g, &m, |iters| {
            let start = Barrier::new(n + 1);
            let end = Barrier::new(n + 1);
            std::thread::scope(|scope| {
                for &st in &streams.streams[..n] {
                    let (start, end) = (&start, &end);
                    scope.spawn(move || {
                        start.wait();
                        for _ in 0..iters {
                            let h = a.alloc(black_box(SIZE), st);
                            black_box(A::ptr(&h));
                            a.free(h, st);
                        }
                        end.wait();
                    });
                }
                start.wait();
                let t = Instant::now();
                end.wait();
                t.elapsed()
            })
        });
    }
}

fn benches(c: &mut Criterion) {
    bu::Summary::meta("threads");
    let mut g = bu::group(c, "threads", false);
    let host = bu::host_device();
    scaling(&mut g, host.clone(), || bu::Tidepool::new(host.clone()));
    if let Some(dev) = bu::cuda_or_skip("threads (cuda)") {
        scaling(&mut g, dev.clone(), || bu::Tidepool::new(dev.clone()));
        scaling(&mut g, dev.clone(), || bu::Tidepool::nocheck(dev.clone()));
        scaling(&mut g, dev.clone(), || bu::Driver::new(dev.clone()));
    }
    g.finish();
}

criterion_group! {
    name = group;
    config = bu::criterion();
    targets = benches
}
criterion_main!(group);
