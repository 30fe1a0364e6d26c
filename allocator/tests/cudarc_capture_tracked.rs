//! `PoolBuffer`s made and dropped inside captures with cudarc's event
//! tracking on (its default): their slices' events are recorded into the
//! graph, so the adapter must not keep those slices for later buffers (a
//! wait on such an event outside its capture fails with
//! `CUDA_ERROR_CAPTURED_EVENT`). Two captures in a row get graph memory at
//! the same addresses; both graphs replay, and cudarc records no driver
//! error. The graph's output leaves it through a raw copy (cudarc's tracked
//! copies would record an event of an eager buffer into the graph).
//! Skips (printing why) where no CUDA driver loads.
#![cfg(feature = "cudarc")]

mod cudarc_support;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{result, DevicePtr};
use cudarc_support::{context, Tags};
use tidepool::cudarc::{cuda_device, PoolStream};
use tidepool::{MemPool, PoolConfig};

#[test]
fn buffers_made_in_captures_with_tracking_on_replay_without_driver_errors() {
    let Some(ctx) =
        context("buffers_made_in_captures_with_tracking_on_replay_without_driver_errors")
    else {
        return;
    };
    assert!(ctx.is_event_tracking(), "cudarc tracks events by default");
    let device = cuda_device(&ctx).expect("cuda_device");
    let pool = MemPool::new(device, PoolConfig::default().with_va_size(1 << 30)).expect("pool");
    let a = PoolStream::with_pool(ctx.new_stream().expect("stream"), &pool).expect("A");
    let tags = Tags::new(&ctx);
    let words = (1 << 20) / 4;
    // A plain cudarc slice (not touched by cudarc inside the captures).
    let out = a.cuda_stream().alloc_zeros::<u32>(words * 2).expect("out");
    a.synchronize().expect("sync");
    let out_ptr = {
        let (ptr, read) = out.device_ptr(a.cuda_stream());
        drop(read);
        ptr
    };

    let mut graphs = Vec::new();
    let mut addrs = Vec::new();
    for (i, tag) in [0x7a7a_0001u32, 0x7a7a_0002].into_iter().enumerate() {
        a.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .expect("begin capture");
        // SAFETY: filled before it is read.
        let mut tmp = unsafe { a.alloc::<u32>(words) }.expect("alloc inside the capture");
        addrs.push(tmp.ptr());
        tags.fill(&a, &mut tmp, tag);
        let dst = out_ptr + (i * words * 4) as u64;
        // SAFETY: both ranges are `words` u32 long and live through the
        // graph's launches (tmp inside the graph, out for the whole test);
        // the copy is captured on A after the fill.
        unsafe { result::memcpy_dtod_async(dst, tmp.ptr(), words * 4, a.cu_stream()) }
            .expect("raw copy out");
        drop(tmp);
        let graph = a
            .end_capture(CUgraphInstantiate_flags(0))
            .expect("end capture")
            .expect("a graph");
        graphs.push((graph, tag));
    }
    for _ in 0..10 {
        for (graph, _) in &graphs {
            graph.launch().expect("launch");
        }
    }
    a.synchronize().expect("sync");
    ctx.check_err().expect("no driver error recorded by cudarc");
    // Each half of `out` holds its graph's buffer, whose tag pattern
    // depends on the buffer's address.
    let mut bad = 0usize;
    for (i, (_, tag)) in graphs.iter().enumerate() {
        let half = a
            .clone_dtoh(&out.slice(i * words..(i + 1) * words))
            .expect("dtoh");
        bad += half
            .iter()
            .enumerate()
            .filter(|&(w, &x)| x != tidepool_kernels::tag_word(*tag, addrs[i] + 4 * w as u64))
            .count();
    }
    assert_eq!(bad, 0, "{bad} words written by the graphs were wrong");
    ctx.check_err().expect("no driver error recorded by cudarc");
    report_addresses(&addrs);
    // The stream's last user goes: whatever the adapter kept of the
    // buffers made inside the captures is released now, outside them.
    drop(graphs);
    drop(a);
    ctx.synchronize().expect("sync");
    ctx.check_err()
        .expect("no driver error recorded by cudarc after the stream's release");
}

/// Where the captures put their buffers (graph memory is usually reused at
/// the same address by the next capture: the case that matters here).
fn report_addresses(addrs: &[u64]) {
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr().lock(),
        "graph memory addresses of the two captures: {addrs:#x?}"
    );
}
