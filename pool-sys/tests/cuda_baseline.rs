//! Tests of the driver baselines (`DriverPool`, `mem_alloc`/`mem_free`) and
//! of the kernel-launch facility. Each test skips without a driver.

mod cuda_common;

use cuda_common::{device_or_skip, pattern};
use tidepool_sys::cuda::{mem_alloc, mem_free, DriverPool, KernelArg};
use tidepool_sys::{Device, SysError};

/// `fill_u32(ptr, value, n)`: `ptr[i] = value` for `i < n`. Hand-written PTX
/// for sm_70 and later (JIT-compiled by the driver; no NVRTC needed).
const FILL_PTX: &str = r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry fill_u32(
    .param .u64 p_ptr,
    .param .u32 p_val,
    .param .u64 p_n
)
{
    .reg .pred %p<2>;
    .reg .b32 %r<6>;
    .reg .b64 %rd<7>;

    ld.param.u64 %rd1, [p_ptr];
    ld.param.u32 %r1, [p_val];
    ld.param.u64 %rd2, [p_n];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mad.lo.s32 %r5, %r2, %r3, %r4;
    cvt.u64.u32 %rd3, %r5;
    setp.ge.u64 %p1, %rd3, %rd2;
    @%p1 bra DONE;
    cvta.to.global.u64 %rd4, %rd1;
    shl.b64 %rd5, %rd3, 2;
    add.s64 %rd6, %rd4, %rd5;
    st.global.u32 [%rd6], %r1;
DONE:
    ret;
}
"#;

fn words(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_ne_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
fn driver_pool_alloc_free_and_attributes() {
    let Some(dev) = device_or_skip() else { return };
    let pool = DriverPool::new(&dev, u64::MAX).unwrap();
    let s = dev.create_stream().unwrap();
    assert_eq!(pool.used_current().unwrap(), 0);

    let mut ptrs = Vec::new();
    for i in 0..64 {
        let p = pool.alloc_async(64 << 10, s).unwrap();
        assert_ne!(p, 0);
        if i == 0 {
            dev.memset_d32_async(s, p, 0xdead_beef, (64 << 10) / 4)
                .unwrap();
        }
        ptrs.push(p);
    }
    dev.synchronize_stream(s).unwrap();
    assert!(pool.used_current().unwrap() >= 64 * (64 << 10));
    assert!(pool.reserved_current().unwrap() >= pool.used_current().unwrap());
    let mut back = vec![0u8; 64 << 10];
    dev.copy_dtoh(&mut back, ptrs[0]).unwrap();
    assert!(words(&back).iter().all(|&w| w == 0xdead_beef));

    for p in ptrs {
        pool.free_async(p, s).unwrap();
    }
    dev.synchronize_stream(s).unwrap();
    assert_eq!(pool.used_current().unwrap(), 0);
    let high = pool.reserved_high().unwrap();
    assert!(high > 0);
    assert!(pool.used_high().unwrap() >= 64 * (64 << 10));
    // Threshold max: the memory stays reserved after a sync.
    assert!(pool.reserved_current().unwrap() > 0);

    // Reuse on the same stream: no growth.
    let p = pool.alloc_async(64 << 10, s).unwrap();
    pool.free_async(p, s).unwrap();
    dev.synchronize_stream(s).unwrap();
    assert_eq!(pool.reserved_high().unwrap(), high);

    pool.trim_to(0).unwrap();
    assert_eq!(pool.reserved_current().unwrap(), 0);
    pool.reset_highs().unwrap();
    assert_eq!(pool.used_high().unwrap(), 0);

    // The default stream works too; unknown streams are errors.
    let p = pool.alloc_async(1 << 20, dev.default_stream()).unwrap();
    pool.free_async(p, dev.default_stream()).unwrap();
    dev.destroy_stream(s).unwrap();
    assert!(matches!(
        pool.alloc_async(256, s),
        Err(SysError::InvalidHandle { .. })
    ));
    dev.synchronize_stream(dev.default_stream()).unwrap();
}

#[test]
fn driver_pool_absurd_alloc_is_out_of_memory() {
    let Some(dev) = device_or_skip() else { return };
    let pool = DriverPool::new(&dev, 0).unwrap();
    let total = dev.mem_info().unwrap().total;
    let err = pool
        .alloc_async(total * 4, dev.default_stream())
        .unwrap_err();
    assert!(err.is_out_of_memory(), "got {err}");
}

#[test]
fn mem_alloc_and_mem_free() {
    let Some(dev) = device_or_skip() else { return };
    let p = mem_alloc(&dev, 1 << 20).unwrap();
    assert_ne!(p, 0);
    let data = pattern(1 << 20, 5);
    dev.copy_htod(p, &data).unwrap();
    let mut back = vec![0u8; 1 << 20];
    dev.copy_dtoh(&mut back, p).unwrap();
    assert_eq!(back, data);
    mem_free(&dev, p).unwrap();
    let total = dev.mem_info().unwrap().total;
    assert!(mem_alloc(&dev, total * 4).unwrap_err().is_out_of_memory());
}

#[test]
fn load_ptx_and_launch_a_kernel() {
    let Some(dev) = device_or_skip() else { return };
    let (major, _minor) = dev.compute_capability().unwrap();
    assert!(major >= 7);
    let module = dev.load_module(FILL_PTX).unwrap();
    let fill = module.function("fill_u32").unwrap();
    assert_eq!(fill.name(), "fill_u32");
    assert!(module.function("no_such_kernel").is_err());
    assert!(dev.load_module("this is not PTX").is_err());

    let n = 100_000usize;
    let p = mem_alloc(&dev, n * 4).unwrap();
    let s = dev.create_stream().unwrap();
    dev.memset_d32_async(s, p, 0, n).unwrap();
    let blocks = n.div_ceil(256) as u32;
    // Fill all but the last 10 words.
    dev.launch(
        s,
        &fill,
        (blocks, 1, 1),
        (256, 1, 1),
        &[
            KernelArg::Ptr(p),
            KernelArg::U32(0x1234_5678),
            KernelArg::U64((n - 10) as u64),
        ],
    )
    .unwrap();
    dev.synchronize_stream(s).unwrap();
    let mut back = vec![0u8; n * 4];
    dev.copy_dtoh(&mut back, p).unwrap();
    let w = words(&back);
    assert!(w[..n - 10].iter().all(|&x| x == 0x1234_5678));
    assert!(w[n - 10..].iter().all(|&x| x == 0));

    // The function outlives its module handle.
    drop(module);
    dev.launch(
        dev.default_stream(),
        &fill,
        (1, 1, 1),
        (32, 1, 1),
        &[KernelArg::Ptr(p), KernelArg::U32(7), KernelArg::U64(32)],
    )
    .unwrap();
    let mut first = vec![0u8; 128];
    dev.copy_dtoh(&mut first, p).unwrap();
    assert!(words(&first).iter().all(|&x| x == 7));
    dev.destroy_stream(s).unwrap();
    mem_free(&dev, p).unwrap();
}

/// Cost of the wrapper's hot path against raw FFI (run with `--ignored`,
/// in release, on a GPU): prints ns per alloc+free pair for both.
#[test]
#[ignore = "timing; run by hand on a GPU"]
fn driver_pool_pair_cost() {
    use cudarc::driver::sys;
    let Some(dev) = device_or_skip() else { return };
    let pool = DriverPool::new(&dev, u64::MAX).unwrap();
    let s = dev.create_stream().unwrap();
    let n = 200_000;
    for _ in 0..1000 {
        let p = pool.alloc_async(64 << 10, s).unwrap();
        pool.free_async(p, s).unwrap();
    }
    let t = std::time::Instant::now();
    for _ in 0..n {
        let p = pool.alloc_async(64 << 10, s).unwrap();
        pool.free_async(p, s).unwrap();
    }
    let wrapped = t.elapsed().as_nanos() as f64 / n as f64;
    let raw_pool = pool.raw() as sys::CUmemoryPool;
    let raw_stream = dev.raw_stream(s).unwrap() as sys::CUstream;
    let t = std::time::Instant::now();
    for _ in 0..n {
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: live pool and stream; valid out pointer.
        unsafe {
            assert_eq!(
                sys::cuMemAllocFromPoolAsync(&mut p, 64 << 10, raw_pool, raw_stream),
                sys::CUresult::CUDA_SUCCESS
            );
            assert_eq!(
                sys::cuMemFreeAsync(p, raw_stream),
                sys::CUresult::CUDA_SUCCESS
            );
        }
    }
    let raw = t.elapsed().as_nanos() as f64 / n as f64;
    dev.synchronize_stream(s).unwrap();
    println!("64 KiB pair: wrapper {wrapped:.0} ns, raw FFI {raw:.0} ns");
    dev.destroy_stream(s).unwrap();
}
