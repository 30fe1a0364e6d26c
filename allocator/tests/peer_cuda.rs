//! Peer access with two GPUs: a kernel on GPU 1 writes memory of GPU 0's
//! pool and GPU 0 verifies; access survives growth, stitching and trim;
//! revoking works; and a peer-copy bandwidth comparison (pool memory vs
//! `cuMemAlloc` memory, same run) printed as one JSON line.
//!
//! Needs two CUDA devices with a peer path; skips with a printed reason
//! otherwise (and fails for a missing driver if `TIDEPOOL_REQUIRE_GPU=1`).

use std::io::Write;
use std::sync::Arc;
use std::time::Instant;
use tidepool::{MemPool, PoolConfig};
use tidepool_kernels::{cuda::CudaKernels, TagKernels};
use tidepool_sys::cuda::{
    driver_available, driver_unavailable_reason, mem_alloc, mem_free, CudaDevice,
};
use tidepool_sys::{Access, Device, Stream};

fn say(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

fn two_gpus(test: &str) -> Option<(Arc<CudaDevice>, Arc<CudaDevice>)> {
    if !driver_available() {
        let reason = driver_unavailable_reason().unwrap_or_default();
        if std::env::var("TIDEPOOL_REQUIRE_GPU").as_deref() == Ok("1") {
            panic!("{test}: TIDEPOOL_REQUIRE_GPU=1 but no CUDA driver: {reason}");
        }
        say(&format!("SKIP {test}: no CUDA driver: {reason}"));
        return None;
    }
    let d0 = Arc::new(CudaDevice::new(0).expect("device 0"));
    let count = d0.device_count().expect("device count");
    if count < 2 {
        say(&format!(
            "SKIP {test}: needs 2 CUDA devices, this machine has {count}"
        ));
        return None;
    }
    if !d0.can_access_peer(1).expect("peer query") {
        say(&format!(
            "SKIP {test}: device 1 cannot access device 0 (no peer path)"
        ));
        return None;
    }
    Some((d0, Arc::new(CudaDevice::new(1).expect("device 1"))))
}

/// GPU 1 fills `len` bytes at `ptr` with `tag`; GPU 0 verifies them.
fn write_on_1_verify_on_0(
    k1: &CudaKernels,
    s1: Stream,
    k0: &CudaKernels,
    s0: Stream,
    ptr: u64,
    len: usize,
    tag: u32,
) {
    k1.fill_tag(s1, ptr, len, tag).expect("fill on GPU 1");
    k1.device().synchronize_stream(s1).expect("sync GPU 1");
    k0.verify_tag(s0, ptr, len, tag).expect("verify on GPU 0");
    assert_eq!(k0.mismatches().expect("mismatches"), 0, "tag {tag:#x}");
}

#[test]
fn gpu1_writes_gpu0_pool_memory_across_growth_stitching_trim_and_revoke() {
    let Some((d0, d1)) = two_gpus("gpu1_writes_gpu0_pool_memory") else {
        return;
    };
    let page = d0.granularity();
    // A cap of 10 pages makes the big block below a stitch, not a growth.
    let pool = MemPool::new(
        d0.clone(),
        PoolConfig::default()
            .with_va_size(1 << 32)
            .with_max_size(10 * page as u64)
            .with_peer_devices(vec![1]),
    )
    .expect("pool with peer 1");
    let (s0, s1) = (d0.create_stream().unwrap(), d1.create_stream().unwrap());
    let (k0, k1) = (
        CudaKernels::new(d0.clone()).expect("kernels on GPU 0"),
        CudaKernels::new(d1.clone()).expect("kernels on GPU 1"),
    );
    let a = pool.alloc_async(3 * page, s0).unwrap();
    d0.synchronize_stream(s0).unwrap();
    assert_eq!(pool.access(1).unwrap(), Access::ReadWrite);
    write_on_1_verify_on_0(&k1, s1, &k0, s0, a.ptr(), 3 * page, 0x1111);
    pool.free_async(a, s0).unwrap();
    // Growth to 8 pages, every other one freed, then a 4-page block that
    // only stitching can place.
    let blocks: Vec<_> = (0..8)
        .map(|_| pool.alloc_async(page, s0).unwrap())
        .collect();
    let mut keep = Vec::new();
    for (i, b) in blocks.into_iter().enumerate() {
        if i % 2 == 0 {
            pool.free_async(b, s0).unwrap();
        } else {
            keep.push(b);
        }
    }
    pool.synchronize().unwrap();
    let before = pool.stats();
    let big = pool.alloc_async(4 * page, s0).unwrap();
    assert!(pool.stats().remaps > before.remaps, "stitched");
    d0.synchronize_stream(s0).unwrap();
    assert_eq!(
        pool.access(1).unwrap(),
        Access::ReadWrite,
        "after stitching"
    );
    write_on_1_verify_on_0(&k1, s1, &k0, s0, big.ptr(), 4 * page, 0x2222);
    for b in keep {
        write_on_1_verify_on_0(&k1, s1, &k0, s0, b.ptr(), page, 0x3333);
        pool.free_async(b, s0).unwrap();
    }
    pool.free_async(big, s0).unwrap();
    pool.synchronize().unwrap();
    assert!(pool.trim_to(2 * page as u64).unwrap() > 0, "trimmed");
    let c = pool.alloc_async(5 * page, s0).unwrap();
    d0.synchronize_stream(s0).unwrap();
    assert_eq!(
        pool.access(1).unwrap(),
        Access::ReadWrite,
        "after trim and regrowth"
    );
    write_on_1_verify_on_0(&k1, s1, &k0, s0, c.ptr(), 5 * page, 0x4444);
    // Revoke: the driver reports no access on every page, now and later.
    pool.set_access(1, Access::None).unwrap();
    assert_eq!(pool.access(1).unwrap(), Access::None);
    let d = pool.alloc_async(2 * page, s0).unwrap();
    assert_eq!(
        pool.access(1).unwrap(),
        Access::None,
        "new pages after revoke"
    );
    pool.set_access(1, Access::ReadWrite).unwrap();
    write_on_1_verify_on_0(&k1, s1, &k0, s0, d.ptr(), 2 * page, 0x5555);
    pool.free_async(c, s0).unwrap();
    pool.free_async(d, s0).unwrap();
    pool.synchronize().unwrap();
    d1.synchronize_stream(s1).unwrap();
}

#[test]
fn peer_copy_bandwidth_pool_vs_cumemalloc() {
    let Some((d0, d1)) = two_gpus("peer_copy_bandwidth_pool_vs_cumemalloc") else {
        return;
    };
    const BYTES: usize = 256 << 20;
    const REPS: usize = 20;
    let pool = MemPool::new(
        d0.clone(),
        PoolConfig::default()
            .with_va_size(1 << 32)
            .with_peer_devices(vec![1]),
    )
    .unwrap();
    let s0 = d0.create_stream().unwrap();
    let s1 = d1.create_stream().unwrap();
    let src_pool = pool.alloc_async(BYTES, s0).unwrap();
    let src_plain = mem_alloc(&d0, BYTES).unwrap();
    let dst = mem_alloc(&d1, BYTES).unwrap();
    // cuMemAlloc memory needs context-level peer access for a direct path.
    d1.enable_peer_context_access(&d0).unwrap();
    d0.enable_peer_context_access(&d1).unwrap();
    d0.synchronize_stream(s0).unwrap();
    let run = |src: u64| -> f64 {
        d1.copy_async(dst, src, BYTES, s1).unwrap(); // warm-up
        d1.synchronize_stream(s1).unwrap();
        let t = Instant::now();
        for _ in 0..REPS {
            d1.copy_async(dst, src, BYTES, s1).unwrap();
        }
        d1.synchronize_stream(s1).unwrap();
        (BYTES * REPS) as f64 / t.elapsed().as_secs_f64() / 1e9
    };
    // Interleaved, twice each, best of two: less noise from clocks.
    let (p1, m1, p2, m2) = (
        run(src_pool.ptr()),
        run(src_plain),
        run(src_pool.ptr()),
        run(src_plain),
    );
    let (pool_gbs, plain_gbs) = (p1.max(p2), m1.max(m2));
    say(&format!(
        "{{\"bench\":\"peer_copy\",\"direction\":\"gpu0->gpu1\",\"bytes\":{BYTES},\"reps\":{REPS},\"pool_gbs\":{pool_gbs:.2},\"cumemalloc_gbs\":{plain_gbs:.2},\"ratio\":{:.3}}}",
        pool_gbs / plain_gbs
    ));
    mem_free(&d1, dst).unwrap();
    mem_free(&d0, src_plain).unwrap();
    pool.free_async(src_pool, s0).unwrap();
    pool.synchronize().unwrap();
}
