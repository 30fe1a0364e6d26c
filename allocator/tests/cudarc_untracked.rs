//! The cudarc adapter with cudarc's event tracking turned off (a process of
//! its own, since the switch is per context): a use on another stream is
//! declared with `record_stream`, and the drop orders the free after it.
#![cfg(feature = "cudarc")]

mod cudarc_support;

use cudarc_support::{context, Tags};
use tidepool::cudarc::{cuda_device, PoolStream};
use tidepool::{MemPool, PoolConfig};

#[test]
fn drop_waits_for_declared_use_with_tracking_off() {
    let Some(ctx) = context("drop_waits_for_declared_use_with_tracking_off") else {
        return;
    };
    // SAFETY: this test orders every cross-stream use itself (join and
    // record_stream), as cudarc asks when tracking is off.
    unsafe { ctx.disable_event_tracking() };
    let device = cuda_device(&ctx).expect("cuda_device");
    let pool = MemPool::new(device, PoolConfig::default().with_va_size(1 << 30)).expect("pool");
    let a = PoolStream::with_pool(ctx.new_stream().expect("stream"), &pool).expect("A");
    let b = PoolStream::with_pool(ctx.new_stream().expect("stream"), &pool).expect("B");
    assert!(!ctx.is_managing_stream_synchronization(), "tracking is off");
    let tags = Tags::new(&ctx);
    let words = (8 << 20) / 4;
    let mut b_errors = b.cuda_stream().alloc_zeros::<u64>(1).expect("errors");
    let mut a_errors = b.cuda_stream().alloc_zeros::<u64>(1).expect("errors");
    b.synchronize().expect("sync");

    // SAFETY: filled before it is read.
    let mut buf = unsafe { a.alloc::<u32>(words) }.expect("alloc");
    tags.fill(&a, &mut buf, 0x3333_3333);
    b.join(&a).expect("B after the fill");
    tags.spin(&b, 300);
    tags.verify(&b, &buf, 0x3333_3333, &mut b_errors);
    buf.record_stream(&b).expect("record_stream");
    let addr = buf.ptr();
    drop(buf);

    // One word shorter: the same block (the pool rounds sizes up), but not
    // the dropped buffer's own slice, whose events the adapter would reuse
    // (which orders after B's read by itself); so only the drop's ordering
    // protects B here.
    // SAFETY: filled before it is read.
    let mut next = unsafe { a.alloc::<u32>(words - 1) }.expect("alloc");
    assert_eq!(next.ptr(), addr, "the same block comes back on A");
    tags.fill(&a, &mut next, 0x4444_4444);
    tags.verify(&a, &next, 0x4444_4444, &mut a_errors);
    a.synchronize().expect("sync A");
    b.synchronize().expect("sync B");
    let seen_by_b = b.clone_dtoh(&b_errors).expect("dtoh")[0];
    let seen_by_a = b.clone_dtoh(&a_errors).expect("dtoh")[0];
    assert_eq!(seen_by_a, 0, "A's own fill was checked");
    assert_eq!(
        seen_by_b, 0,
        "B read {seen_by_b} of {words} words overwritten by A's next allocation"
    );
}
