//! Overlap: a long kernel (`spin`, 50 ms) runs on a
//! low-priority stream while a high-priority stream runs short iterations:
//! allocate 64 KiB, fill it (a memset-like kernel), compute (`spin` 10 µs),
//! free, and wait for the high stream. A new long kernel is launched
//! (untimed) whenever the previous one has finished, so every short
//! iteration meets a running long kernel. One op = one short iteration;
//! `ns_per_op` is its latency. `cuMemFree` synchronises the device, so with
//! `cuMemAlloc`/`cuMemFree` a short iteration waits for the long kernel; a
//! stream-ordered pool should not.

use criterion::{criterion_group, criterion_main, Criterion};
use std::sync::Arc;
use std::time::{Duration, Instant};
mod benchutil;
use benchutil::{self as bu, BenchAlloc, Meas};
use tidepool_kernels::TagKernels;
use tidepool_sys::{Device, Stream};

const LONG_NS: u64 = 50_000_000;
const SHORT_NS: u64 = 10_000;
const SIZE: usize = 64 << 10;

struct Setup {
    device: Arc<dyn Device>,
    kernels: Arc<dyn TagKernels>,
    low: Stream,
    high: Stream,
}

impl Drop for Setup {
    fn drop(&mut self) {
        for s in [self.low, self.high] {
            let _ = self.device.synchronize_stream(s);
            let _ = self.device.destroy_stream(s);
        }
    }
}

fn overlap<A: BenchAlloc>(g: &mut bu::Group<'_>, s: &Setup, a: A) {
    let (low, high, k) = (s.low, s.high, &s.kernels);
    let short = |tag: u32| {
        let h = a.alloc(SIZE, high);
        k.fill_tag(high, A::ptr(&h), SIZE, tag).expect("fill_tag");
        k.spin(high, SHORT_NS).expect("spin");
        a.free(h, high);
        s.device.synchronize_stream(high).expect("sync high");
    };
    short(0);
    let m = Meas {
        bench: "overlap",
        backend: a.backend(),
        allocator: a.name(),
        param: "50ms+64KiB".into(),
        ops_per_iter: 1,
    };
    let mut tag = 1u32;
    bu::bench(g, &m, |iters| {
        let mut timed = Duration::ZERO;
        for _ in 0..iters {
            if s.device.query_stream(low).expect("query low") {
                k.spin(low, LONG_NS).expect("long spin");
            }
            let t = Instant::now();
            short(tag);
            timed += t.elapsed();
            tag = tag.wrapping_add(1);
        }
        timed
    });
    s.device.synchronize_stream(low).expect("sync low");
}

fn benches(c: &mut Criterion) {
    bu::Summary::meta("overlap");
    let mut g = bu::group(c, "overlap", true);
    let host = bu::host_device();
    let setup = Setup {
        device: host.clone(),
        kernels: tidepool_kernels::kernels_for_host(host.clone()),
        low: host.create_stream().expect("stream"),
        high: host.create_stream().expect("stream"),
    };
    overlap(&mut g, &setup, bu::Tidepool::new(host.clone()));
    drop(setup);
    if let Some(dev) = bu::cuda_or_skip("overlap (cuda)") {
        match tidepool_kernels::kernels_for_cuda(dev.clone()) {
            Err(e) => println!("overlap (cuda): skipped: no CUDA kernels ({e})"),
            Ok(kernels) => {
                let (least, greatest) = dev.stream_priority_range().expect("priority range");
                let setup = Setup {
                    device: dev.clone(),
                    kernels,
                    low: dev.create_stream_with_priority(least).expect("low stream"),
                    high: dev
                        .create_stream_with_priority(greatest)
                        .expect("high stream"),
                };
                overlap(&mut g, &setup, bu::Tidepool::new(dev.clone()));
                overlap(&mut g, &setup, bu::Driver::new(dev.clone()));
                overlap(&mut g, &setup, bu::CuMem { dev: dev.clone() });
            }
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
