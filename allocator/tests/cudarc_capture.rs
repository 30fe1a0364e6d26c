//! `PoolBuffer`s on a cudarc stream that is being captured into a CUDA
//! graph, with cudarc's event tracking off (as graph users run it: a
//! process of its own, since the switch is per context). A buffer made
//! inside the capture is graph memory: the graph allocates, fills, copies
//! out and frees it at every launch. Eager work of the same pool on another
//! stream goes on during the capture and between launches; a buffer made
//! before the capture and dropped inside it is refused by the pool and
//! stays allocated, and the capture stays valid. Skips (printing why) where
//! no CUDA driver loads.
#![cfg(feature = "cudarc")]

mod cudarc_support;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc_support::{context, Tags};
use tidepool::cudarc::{cuda_device, PoolStream};
use tidepool::{MemPool, PoolConfig};

const LAUNCHES: u32 = 100;

#[test]
fn captured_pool_buffers_replay_100_times_beside_eager_work() {
    let Some(ctx) = context("captured_pool_buffers_replay_100_times_beside_eager_work") else {
        return;
    };
    // SAFETY: every cross-stream use below is ordered by the test itself
    // (synchronisation between the phases), as cudarc asks when tracking
    // is off.
    unsafe { ctx.disable_event_tracking() };
    let device = cuda_device(&ctx).expect("cuda_device");
    let pool = MemPool::new(device, PoolConfig::default().with_va_size(4 << 30)).expect("pool");
    let a = PoolStream::with_pool(ctx.new_stream().expect("stream"), &pool).expect("A");
    let b = PoolStream::with_pool(ctx.new_stream().expect("stream"), &pool).expect("B");
    let tags = Tags::new(&ctx);
    let words = (4 << 20) / 4;
    const GRAPH_TAG: u32 = 0x6a6a_0001;

    // Made before the capture: the graph copies into `out`; `errors`
    // counts the words of the graph's buffer that missed their tag, as
    // checked inside the graph at every launch.
    let mut out = a.alloc_zeros::<u32>(words).expect("out");
    let mut errors = a.cuda_stream().alloc_zeros::<u64>(1).expect("errors");
    let doomed = a.alloc_zeros::<u32>(1024).expect("doomed");
    a.synchronize().expect("sync");
    let used_before = pool.stats().used_current;

    a.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .expect("begin capture");
    // Graph memory: allocated, filled, copied out and freed by the graph.
    // SAFETY: filled before it is read.
    let mut tmp = unsafe { a.alloc::<u32>(words) }.expect("alloc inside the capture");
    let tmp_addr = tmp.ptr();
    assert!(
        !pool.contains(tmp.ptr()),
        "a buffer made inside a capture is graph memory, not a pool block"
    );
    tags.fill(&a, &mut tmp, GRAPH_TAG);
    tags.verify(&a, &tmp, GRAPH_TAG, &mut errors);
    a.memcpy_dtod(&tmp, &mut out).expect("copy out");
    drop(tmp);
    // Eager work of the same pool on another stream meanwhile: served by
    // the pool, filled and checked at once.
    let mut eager = b
        .alloc_zeros::<u32>(words)
        .expect("eager alloc during the capture");
    assert!(
        pool.contains(eager.ptr()),
        "B is not captured: a pool block"
    );
    tags.fill(&b, &mut eager, 0x0b0b_0b0b);
    // A buffer made before the capture, dropped inside it: the pool
    // refuses the free (it would have to happen at every launch); the
    // block stays allocated and the capture stays valid.
    drop(doomed);
    let graph = a
        .end_capture(CUgraphInstantiate_flags(0))
        .expect("end capture (still valid)")
        .expect("a graph");
    b.synchronize().expect("sync B");
    assert!(
        pool.stats().used_current >= used_before + (words * 4) as u64,
        "the eager block and the refused free's block are both still counted"
    );

    // The tag pattern depends on the address: `out` must hold the words
    // of the graph's buffer at its address.
    let expected: Vec<u32> = (0..words)
        .map(|i| tidepool_kernels::tag_word(GRAPH_TAG, tmp_addr + 4 * i as u64))
        .collect();
    let mut wrong_out = 0usize;
    let mut b_errors = b.cuda_stream().alloc_zeros::<u64>(1).expect("errors");
    for launch in 0..LAUNCHES {
        // `out` is cleared, then the graph must write it again.
        a.memset_zeros(&mut out).expect("clear out");
        graph.launch().expect("launch");
        let copied = a.clone_dtoh(&out).expect("dtoh out");
        wrong_out += copied.iter().zip(&expected).filter(|(x, y)| x != y).count();
        // Eager churn on B between launches: fresh blocks, checked.
        let mut churn = b
            .alloc_zeros::<u32>(words / 2 + launch as usize)
            .expect("churn");
        let tag = 0x1000_0000 + launch;
        tags.fill(&b, &mut churn, tag);
        tags.verify(&b, &churn, tag, &mut b_errors);
        drop(churn);
    }
    tags.verify(&b, &eager, 0x0b0b_0b0b, &mut b_errors);
    a.synchronize().expect("sync A");
    b.synchronize().expect("sync B");
    let bad = a.clone_dtoh(&errors).expect("dtoh")[0];
    let bad_b = b.clone_dtoh(&b_errors).expect("dtoh")[0];
    assert_eq!(
        bad, 0,
        "{bad} words of the graph's buffer missed their tag over {LAUNCHES} launches"
    );
    assert_eq!(
        wrong_out, 0,
        "{wrong_out} words copied out of the graph were wrong over {LAUNCHES} launches"
    );
    assert_eq!(bad_b, 0, "{bad_b} words of eager blocks were overwritten");
    ctx.check_err().expect("no driver error recorded by cudarc");
    drop(graph);
    drop(eager);
    drop(out);
    a.synchronize().expect("sync A");
}
