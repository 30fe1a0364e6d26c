//! The cudarc drop-in: `CudaStream::alloc` + drop (cudarc over the driver's
//! default pool: `cuMemAllocAsync` / `cuMemFreeAsync`, plus its tracking
//! events) against `PoolStream::alloc` + drop (a tidepool pool), 64 KiB and
//! 16 MiB, with cudarc's event tracking on and off, in the same run.
//!
//! The stream is made with `CudaContext::new_stream`, so the context is in
//! multi-stream mode: with tracking on, every drop makes the stream wait on
//! the slice's read and write events, on both sides. GPU only: without a
//! CUDA driver it prints why and measures nothing.

use criterion::{criterion_group, criterion_main, Criterion};
use std::hint::black_box;
use tidepool::cudarc::driver::CudaContext;
use tidepool::cudarc::{cuda_device, PoolStream};
use tidepool::MemPool;
mod benchutil;
use benchutil::{self as bu, Meas};

const SIZES: [usize; 2] = [64 << 10, 16 << 20];

fn benches(c: &mut Criterion) {
    bu::Summary::meta("cudarc");
    let mut g = bu::group(c, "cudarc", false);
    if bu::cuda_or_skip("cudarc").is_none() {
        g.finish();
        return;
    }
    let ctx = CudaContext::new(0).expect("CudaContext::new(0)");
    let plain = ctx.new_stream().expect("stream");
    let device = cuda_device(&ctx).expect("tidepool device");
    let pool = MemPool::new(device, bu::tidepool_config()).expect("pool");
    let pooled = PoolStream::with_pool(plain.clone(), &pool).expect("PoolStream");
    for tracking in [true, false] {
        // SAFETY: the benchmark never uses a slice on another stream.
        unsafe {
            if tracking {
                ctx.enable_event_tracking()
            } else {
                ctx.disable_event_tracking()
            }
        }
        let mode = if tracking {
            "tracking-on"
        } else {
            "tracking-off"
        };
        for size in SIZES {
            let param = format!("{}/{mode}", bu::size_label(size));
            // Prime both: each holds memory of this size before timing.
            // SAFETY: the memory is never read.
            let primed = unsafe { plain.alloc::<u8>(size) }.expect("cudarc alloc");
            drop(primed);
            // SAFETY: the memory is never read.
            let primed = unsafe { pooled.alloc::<u8>(size) }.expect("pool alloc");
            drop(primed);
            plain.synchronize().expect("sync");
            let m = Meas {
                bench: "cudarc",
                backend: "cuda",
                allocator: "cudarc-CudaStream",
                param: param.clone(),
                ops_per_iter: 1,
            };
            bu::bench(&mut g, &m, |iters| {
                bu::time_loop(iters, || {
                    // SAFETY: never read.
                    let s = unsafe { plain.alloc::<u8>(black_box(size)) }.expect("alloc");
                    black_box(&s);
                    drop(s);
                })
            });
            plain.synchronize().expect("sync");
            let m = Meas {
                allocator: "tidepool-PoolStream",
                ..m
            };
            bu::bench(&mut g, &m, |iters| {
                bu::time_loop(iters, || {
                    // SAFETY: never read.
                    let s = unsafe { pooled.alloc::<u8>(black_box(size)) }.expect("alloc");
                    black_box(&s);
                    drop(s);
                })
            });
            plain.synchronize().expect("sync");
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
