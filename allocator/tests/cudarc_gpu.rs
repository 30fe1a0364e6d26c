//! The cudarc adapter on a GPU, with cudarc's event tracking on (its
//! default): results equal plain cudarc's, drops are safe across streams,
//! clones stay in the pool, a million alloc/drop cycles leave nothing
//! used, a recycled stream handle is a new stream, non-primary contexts
//! are refused. Each test skips (printing why) where no CUDA driver loads.
#![cfg(feature = "cudarc")]

mod cudarc_support;

use cudarc::cublas::{sys::cublasOperation_t, CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{CudaContext, DeviceSlice, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::compile_ptx;
use cudarc_support::{context, Tags};
use std::io::Write;
use tidepool::cudarc::{cuda_device, CudarcError, PoolStream};
use tidepool::{MemPool, PoolConfig};

fn fresh_pool(ctx: &std::sync::Arc<CudaContext>) -> MemPool<tidepool_sys::cuda::CudaDevice> {
    let device = cuda_device(ctx).expect("cuda_device");
    MemPool::new(device, PoolConfig::default().with_va_size(8 << 30)).expect("pool")
}

const AXPY: &str = r#"
extern "C" __global__ void axpy(float a, const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { y[i] = a * x[i] + y[i]; }
}
"#;

/// The same program (upload, a kernel, a device copy, an sgemm, download)
/// on `CudaSlice`s and on `PoolBuffer`s of one stream: identical results.
#[test]
fn launch_memcpy_and_gemm_match_plain_cudarc() {
    let Some(ctx) = context("launch_memcpy_and_gemm_match_plain_cudarc") else {
        return;
    };
    let plain = ctx.new_stream().expect("stream");
    let pooled = PoolStream::with_pool(plain.clone(), &fresh_pool(&ctx)).expect("PoolStream");
    let module = ctx
        .load_module(compile_ptx(AXPY).expect("nvrtc"))
        .expect("module");
    let axpy = module.load_function("axpy").expect("axpy");
    let blas = CudaBlas::new(pooled.clone()).expect("cublas");

    let n = 300_001usize;
    let x_host: Vec<f32> = (0..n).map(|i| ((i * 7919) % 1013) as f32 * 0.37).collect();
    let y_host: Vec<f32> = (0..n)
        .map(|i| ((i * 104_729) % 997) as f32 * -0.11)
        .collect();
    let (m, k, nn) = (192usize, 96usize, 80usize);
    let a_host: Vec<f32> = (0..m * k)
        .map(|i| ((i % 17) as f32) * 0.125 - 1.0)
        .collect();
    let b_host: Vec<f32> = (0..k * nn).map(|i| ((i % 11) as f32) * 0.5 - 2.5).collect();
    let cfg = GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_N,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: m as i32,
        n: nn as i32,
        k: k as i32,
        alpha: 1.5f32,
        lda: m as i32,
        ldb: k as i32,
        beta: 0.0f32,
        ldc: m as i32,
    };
    let (a, n_i32) = (3.25f32, n as i32);

    macro_rules! program {
        ($s:expr) => {{
            let s = $s;
            let x = s.clone_htod(&x_host).expect("htod");
            let mut y = s.clone_htod(&y_host).expect("htod");
            let mut launch = s.launch_builder(&axpy);
            launch.arg(&a).arg(&x).arg(&mut y).arg(&n_i32);
            // SAFETY: axpy reads n floats of x, writes n floats of y.
            unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }.expect("launch");
            let mut y2 = s.alloc_zeros::<f32>(n).expect("alloc_zeros");
            s.memcpy_dtod(&y, &mut y2).expect("dtod");
            let y3 = s.clone_dtod(&y2).expect("clone_dtod");
            let a_dev = s.clone_htod(&a_host).expect("htod");
            let b_dev = s.clone_htod(&b_host).expect("htod");
            let mut c_dev = s.alloc_zeros::<f32>(m * nn).expect("alloc_zeros");
            // SAFETY: the matrices have the configured sizes.
            unsafe { blas.gemm(cfg, &a_dev, &b_dev, &mut c_dev) }.expect("sgemm");
            let mut c_host = vec![0f32; m * nn];
            s.memcpy_dtoh(&c_dev, &mut c_host).expect("dtoh");
            (s.clone_dtoh(&y3).expect("dtoh"), c_host)
        }};
    }
    let (y_plain, c_plain) = program!(&plain);
    let (y_pool, c_pool) = program!(&pooled);
    assert_eq!(y_plain.len(), n);
    assert!(y_plain.iter().any(|&v| v != 0.0), "the kernel ran");
    assert!(c_plain.iter().any(|&v| v != 0.0), "the sgemm ran");
    let y_diff = y_plain
        .iter()
        .zip(&y_pool)
        .filter(|(p, q)| p.to_bits() != q.to_bits())
        .count();
    let c_diff = c_plain
        .iter()
        .zip(&c_pool)
        .filter(|(p, q)| p.to_bits() != q.to_bits())
        .count();
    assert_eq!(
        y_diff, 0,
        "axpy/memcpy results differ in {y_diff} of {n} elements"
    );
    assert_eq!(
        c_diff,
        0,
        "sgemm results differ in {c_diff} of {} elements",
        m * nn
    );
    // Everything the program allocated went back to the pool.
    pooled.synchronize().expect("sync");
    assert_eq!(pooled.pool().stats().used_current, 0);
}

/// A buffer dropped on stream A while a slow kernel on stream B still reads
/// it: the drop makes A wait for B's read (cudarc tracks it), so the next
/// allocation on A — the same block — is overwritten only after B's check.
#[test]
fn drop_waits_for_tracked_reads_on_another_stream() {
    let Some(ctx) = context("drop_waits_for_tracked_reads_on_another_stream") else {
        return;
    };
    let pool = fresh_pool(&ctx);
    let a = PoolStream::with_pool(ctx.new_stream().expect("stream"), &pool).expect("A");
    let b = ctx.new_stream().expect("stream");
    assert!(ctx.is_managing_stream_synchronization(), "tracking is on");
    let tags = Tags::new(&ctx);
    let words = (8 << 20) / 4;
    let mut b_errors = b.alloc_zeros::<u64>(1).expect("errors");
    let mut a_errors = b.alloc_zeros::<u64>(1).expect("errors");

    // SAFETY: filled before it is read.
    let mut buf = unsafe { a.alloc::<u32>(words) }.expect("alloc");
    tags.fill(&a, &mut buf, 0x1111_1111);
    tags.spin(&b, 300);
    // B reads the buffer after the spin (waiting for A's fill: tracked).
    tags.verify(&b, &buf, 0x1111_1111, &mut b_errors);
    let addr = buf.ptr();
    drop(buf);

    // One word shorter: the same block (the pool rounds sizes up), but not
    // the dropped buffer's own slice, whose events the adapter would reuse
    // (which orders after B's read by itself); so only the drop's ordering
    // protects B here.
    // SAFETY: filled before it is read.
    let mut next = unsafe { a.alloc::<u32>(words - 1) }.expect("alloc");
    assert_eq!(next.ptr(), addr, "the same block comes back on A");
    tags.fill(&a, &mut next, 0x2222_2222);
    tags.verify(&a, &next, 0x2222_2222, &mut a_errors);
    a.synchronize().expect("sync A");
    b.synchronize().expect("sync B");
    let seen_by_b = b.clone_dtoh(&b_errors).expect("dtoh")[0];
    let seen_by_a = b.clone_dtoh(&a_errors).expect("dtoh")[0];
    assert_eq!(seen_by_a, 0, "A's own fill was checked");
    assert_eq!(
        seen_by_b, 0,
        "B read {seen_by_b} of {words} words overwritten by A's next allocation"
    );
    drop(next);
}

/// `Clone` allocates from the pool (cudarc's would use the driver).
#[test]
fn clone_stays_in_the_pool() {
    let Some(ctx) = context("clone_stays_in_the_pool") else {
        return;
    };
    let pool = fresh_pool(&ctx);
    let s = PoolStream::with_pool(ctx.new_stream().expect("stream"), &pool).expect("stream");
    let data: Vec<u32> = (0..100_000).collect();
    let buf = s.clone_htod(&data).expect("htod");
    let before = pool.stats();
    let copy = buf.clone();
    let after = pool.stats();
    assert_eq!(after.allocs, before.allocs + 1, "one pool allocation");
    assert!(pool.contains(copy.ptr()), "the copy lies in the pool");
    assert_ne!(copy.ptr(), buf.ptr());
    assert_eq!(copy.len(), data.len());
    assert_eq!(s.clone_dtoh(&copy).expect("dtoh"), data);
    drop((buf, copy));
    s.synchronize().expect("sync");
    assert_eq!(pool.stats().used_current, 0);
}

/// A million alloc/drop cycles leave `used_current` at 0 and the pool small.
#[test]
fn million_alloc_drop_cycles_leave_nothing_used() {
    let Some(ctx) = context("million_alloc_drop_cycles_leave_nothing_used") else {
        return;
    };
    let pool = fresh_pool(&ctx);
    let s = PoolStream::with_pool(ctx.new_stream().expect("stream"), &pool).expect("stream");
    let cycles = 1_000_000u64;
    for i in 0..cycles {
        let len = if i % 2 == 0 { 16 << 10 } else { 1 << 10 };
        // SAFETY: never read.
        let buf = unsafe { s.alloc::<f32>(len) }.expect("alloc");
        drop(buf);
    }
    pool.synchronize().expect("sync");
    let stats = pool.stats();
    assert_eq!(stats.used_current, 0, "{stats:?}");
    assert!(stats.allocs >= cycles, "{stats:?}");
    assert_eq!(stats.frees, stats.allocs, "{stats:?}");
    // 64 GB went through the pool; a leak of even one block per thousand
    // cycles would hold far more than this.
    assert!(
        stats.reserved_high <= 64 << 20,
        "the pool stayed small: {stats:?}"
    );
}

/// The last `PoolStream` of a stream retires it from the pool; a driver
/// handle recycled afterwards is a new stream to the pool.
#[test]
fn retired_stream_handle_recycled_is_a_new_stream() {
    let Some(ctx) = context("retired_stream_handle_recycled_is_a_new_stream") else {
        return;
    };
    let pool = fresh_pool(&ctx);
    let first = PoolStream::with_pool(ctx.new_stream().expect("stream"), &pool).expect("stream");
    let raw = first.cu_stream() as usize;
    let id = first.pool_stream();
    let again = PoolStream::with_pool(first.cuda_stream().clone(), &pool).expect("again");
    assert_eq!(again.pool_stream(), id, "one registration per stream");
    let buf = first.alloc_zeros::<u8>(1 << 20).expect("alloc");
    drop((first, again));
    // The live buffer still holds the registration.
    assert!(pool
        .alloc_async(1, id)
        .is_ok_and(|a| pool.free_async(a, id).is_ok()));
    drop(buf);
    assert!(
        pool.alloc_async(1, id).is_err(),
        "the last handle retired the stream from the pool"
    );
    let mut kept = Vec::new();
    let mut recycled = None;
    for _ in 0..64 {
        let s = ctx.new_stream().expect("stream");
        if s.cu_stream() as usize == raw {
            recycled = Some(s);
            break;
        }
        kept.push(s);
    }
    match recycled {
        Some(s) => {
            let second = PoolStream::with_pool(s, &pool).expect("stream");
            assert_ne!(
                second.pool_stream(),
                id,
                "a recycled handle is a new stream"
            );
            let buf = second
                .alloc_zeros::<u8>(1 << 20)
                .expect("alloc on the new stream");
            assert_eq!(second.clone_dtoh(&buf).expect("dtoh"), vec![0u8; 1 << 20]);
        }
        None => {
            let _ = writeln!(
                std::io::stderr().lock(),
                "NOTE retired_stream_handle_recycled_is_a_new_stream: the driver did not \
                 recycle the handle in 64 stream creations; the retirement was checked"
            );
        }
    }
}

/// A context that is not the device's primary context is refused.
#[test]
fn non_primary_context_is_refused() {
    let Some(_ctx) = context("non_primary_context_is_refused") else {
        return;
    };
    let other = CudaContext::new_non_primary(0, 0).expect("non-primary context");
    match PoolStream::new(other.default_stream()) {
        Err(CudarcError::NonPrimaryContext { ordinal: 0 }) => {}
        other => panic!("expected NonPrimaryContext, got {other:?}"),
    }
}
