//! The tag kernels on the CUDA backend. Skipped (with the reason printed)
//! where no CUDA driver is usable, unless TIDEPOOL_REQUIRE_GPU=1, which
//! turns the skip into a failure (set it on the GPU machine).
#![forbid(unsafe_code)]

mod common;

use std::sync::{Arc, Mutex, MutexGuard};

use tidepool_kernels::cuda::CudaKernels;
use tidepool_kernels::{kernels_for_cuda, TagKernels, WithTagKernels};
use tidepool_sys::cuda::CudaDevice;

/// The device 0 with its kernels, holding the GPU lock.
struct Gpu {
    dev: Arc<CudaDevice>,
    k: Arc<CudaKernels>,
    // Declared last: released after the kernels and the device are dropped.
    _lock: MutexGuard<'static, ()>,
}

/// The tests of this binary take turns on the GPU. On the H200 (driver
/// 580), when they ran in parallel, driver work of other tests (device and
/// kernel-set setup and teardown: module loads, VMM calls, copies) made
/// `spin_orders_later_work`'s stream B wait out stream A's 400 ms spin in
/// 6 of 9 runs; alone it always passed. The timing tests need a quiet context.
static GPU: Mutex<()> = Mutex::new(());

/// `Some(Gpu)`, or `None` (printing why) when there is no usable driver.
fn setup(test: &str) -> Option<Gpu> {
    if !tidepool_sys::cuda::driver_available() {
        let reason = tidepool_sys::cuda::driver_unavailable_reason().unwrap_or_default();
        if std::env::var("TIDEPOOL_REQUIRE_GPU").as_deref() == Ok("1") {
            panic!("{test}: TIDEPOOL_REQUIRE_GPU=1 but no CUDA driver is usable: {reason}");
        }
        // Outside libtest's capture, so that the skip shows in every run.
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr().lock(),
            "SKIP {test}: no CUDA driver is usable here: {reason}"
        );
        return None;
    }
    let lock = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let dev = Arc::new(CudaDevice::new(0).expect("CudaDevice::new(0)"));
    let k = CudaKernels::new(dev.clone()).unwrap_or_else(|e| panic!("CudaKernels::new: {e}"));
    eprintln!("{test}: kernels compiled for {}", k.arch());
    Some(Gpu {
        dev,
        k: Arc::new(k),
        _lock: lock,
    })
}

#[test]
fn fill_then_verify() {
    let Some(gpu) = setup("fill_then_verify") else {
        return;
    };
    let dev = &*gpu.dev;
    // The trait-object constructor gives a second, independent kernel set.
    let k = kernels_for_cuda(gpu.dev.clone()).unwrap();
    assert_eq!(k.backend_name(), "cuda");
    common::fill_verify_roundtrip(dev, &*k);
}

#[test]
fn rejects_unaligned() {
    let Some(gpu) = setup("rejects_unaligned") else {
        return;
    };
    let (dev, k) = (&*gpu.dev, &*gpu.k);
    common::rejects_unaligned(dev, k);
}

#[test]
fn spin_orders_later_work() {
    let Some(gpu) = setup("spin_orders_later_work") else {
        return;
    };
    let (dev, k) = (&*gpu.dev, &*gpu.k);
    common::spin_orders_later_work(dev, k);
}

#[test]
fn streams_do_not_wait_for_each_other() {
    let Some(gpu) = setup("streams_do_not_wait_for_each_other") else {
        return;
    };
    let (dev, k) = (&*gpu.dev, &*gpu.k);
    common::streams_do_not_wait_for_each_other(dev, k);
}

#[test]
fn spin_takes_its_time() {
    let Some(gpu) = setup("spin_takes_its_time") else {
        return;
    };
    let (dev, k) = (&*gpu.dev, &*gpu.k);
    common::spin_takes_its_time(dev, k);
}

#[test]
fn fill_matches_tag_word() {
    let Some(gpu) = setup("fill_matches_tag_word") else {
        return;
    };
    let (dev, k) = (&*gpu.dev, &*gpu.k);
    common::fill_matches_tag_word(dev, k, &|ptr, n| {
        let mut bytes = vec![0u8; n * 4];
        dev.copy_dtoh(&mut bytes, ptr).unwrap();
        bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    });
}

#[test]
fn threads_on_streams() {
    let Some(gpu) = setup("threads_on_streams") else {
        return;
    };
    let dev = &*gpu.dev;
    let k = gpu.dev.clone().tag_kernels().unwrap();
    common::threads_on_streams(dev, &*k);
}

/// Two kernel sets on one device compile once and count apart.
#[test]
fn kernel_sets_count_apart() {
    let Some(gpu) = setup("kernel_sets_count_apart") else {
        return;
    };
    let (dev, k1) = (&*gpu.dev, &*gpu.k);
    let k2 = CudaKernels::new(gpu.dev.clone()).unwrap();
    let m = common::Mapping::new(dev, 1, 1, true);
    let s = tidepool_sys::Device::create_stream(dev).unwrap();
    k1.fill_tag(s, m.ptr, 4096, 9).unwrap();
    k1.verify_tag(s, m.ptr, 4096, 8).unwrap();
    k2.verify_tag(s, m.ptr, 4096, 9).unwrap();
    assert_eq!(k1.mismatches().unwrap(), 1024);
    assert_eq!(k2.mismatches().unwrap(), 0);
    k1.reset_counters().unwrap();
    assert_eq!(k1.mismatches().unwrap(), 0);
    tidepool_sys::Device::destroy_stream(dev, s).unwrap();
}

/// A request for the whole cap after same-stream frees succeeds on CUDA:
/// 20 MiB and 12 MiB written by kernels on stream s, both freed on s,
/// then 32 MiB on s (it failed with "largest free range 20.0 MiB": the
/// frees' pages must be remapped to be joined, which needs their work
/// complete, and the last-resort host wait missed an event that completed
/// on its way there). Once right after the kernels, once with the stream
/// still busy (a spin) when the request comes.
#[test]
fn whole_cap_request_after_same_stream_frees() {
    let Some(gpu) = setup("whole_cap_request_after_same_stream_frees") else {
        return;
    };
    let (dev, k) = (&gpu.dev, &*gpu.k);
    const MIB: usize = 1 << 20;
    for spin_ns in [0u64, 20_000_000] {
        let pool = tidepool::MemPool::new(
            dev.clone(),
            tidepool::PoolConfig::default()
                .with_va_size(1 << 30)
                .with_max_size(32 * MIB as u64)
                .with_last_resort_wait(std::time::Duration::from_secs(120)),
        )
        .unwrap();
        let s = tidepool_sys::Device::create_stream(&**dev).unwrap();
        k.reset_counters().unwrap();
        let x = pool.alloc_async(20 * MIB, s).unwrap();
        let y = pool.alloc_async(12 * MIB, s).unwrap();
        k.fill_tag(s, x.ptr(), 20 * MIB, 1).unwrap();
        k.fill_tag(s, y.ptr(), 12 * MIB, 2).unwrap();
        if spin_ns > 0 {
            k.spin(s, spin_ns).unwrap();
        }
        pool.free_async(x, s).unwrap();
        pool.free_async(y, s).unwrap();
        let z = pool
            .alloc_async(32 * MIB, s)
            .unwrap_or_else(|e| panic!("spin {spin_ns} ns: false out-of-memory: {e}"));
        k.fill_tag(s, z.ptr(), 32 * MIB, 3).unwrap();
        k.verify_tag(s, z.ptr(), 32 * MIB, 3).unwrap();
        pool.free_async(z, s).unwrap();
        pool.synchronize().unwrap();
        assert_eq!(k.mismatches().unwrap(), 0);
        assert_eq!(k.access_faults().unwrap(), 0);
        assert_eq!(pool.stats().reserved_current, 32 * MIB as u64);
        drop(pool);
        tidepool_sys::Device::destroy_stream(&**dev, s).unwrap();
    }
}

/// Another `CudaDevice` object's stream is refused by the pool with a
/// typed error (with and without the capture check), not taken for the
/// stream of the same number on this object.
#[test]
fn pool_refuses_a_stream_of_another_device_object() {
    let Some(gpu) = setup("pool_refuses_a_stream_of_another_device_object") else {
        return;
    };
    let other = CudaDevice::new(0).unwrap();
    let foreign = tidepool_sys::Device::create_stream(&other).unwrap();
    for check in [true, false] {
        let pool = tidepool::MemPool::new(
            gpu.dev.clone(),
            tidepool::PoolConfig::default()
                .with_va_size(1 << 30)
                .with_check_capture(check),
        )
        .unwrap();
        let err = pool.alloc_async(4096, foreign).unwrap_err();
        assert!(
            matches!(
                err,
                tidepool::PoolError::Device(tidepool_sys::SysError::ForeignHandle { .. })
            ),
            "check_capture {check}: {err:?}"
        );
    }
    tidepool_sys::Device::destroy_stream(&other, foreign).unwrap();
}

/// A graph that allocates through graph memory nodes, fills and verifies
/// tags and frees, captured once and launched 100 times, the mismatch
/// count read back after each launch, with eager work on another stream.
#[test]
fn captured_graph_replays_100_times() {
    let Some(gpu) = setup("captured_graph_replays_100_times") else {
        return;
    };
    common::captured_graph_replays(&*gpu.dev, &*gpu.k, 100, &|| 0);
}
