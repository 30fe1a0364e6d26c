//! The cudarc adapter used the ways a cudarc program might use it that the
//! other tests do not: buffers dropped on other threads, many streams with
//! buffers crossing them, buffers outliving their `PoolStream`, their
//! stream's registration and the user's pool handle, new streams made while
//! an old stream's buffer lives, `clone_dtod` across streams, zero-length
//! buffers, requests too large for the pool, capped pools and thousands of
//! live buffers. Every test checks data written and read back, or exact
//! pool statistics. Each test skips (printing why) where no CUDA driver
//! loads.
#![cfg(feature = "cudarc")]

mod cudarc_support;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceSlice, DriverError};
use cudarc_support::{context, Tags};
use std::sync::Arc;
use tidepool::cudarc::{cuda_device, CudarcError, PoolBuffer, PoolStream};
use tidepool::{MemPool, PoolConfig};
use tidepool_sys::cuda::CudaDevice;

fn pool_with(ctx: &Arc<CudaContext>, config: PoolConfig) -> MemPool<CudaDevice> {
    MemPool::new(cuda_device(ctx).expect("cuda_device"), config).expect("pool")
}

fn fresh_pool(ctx: &Arc<CudaContext>) -> MemPool<CudaDevice> {
    pool_with(ctx, PoolConfig::default().with_va_size(8 << 30))
}

fn stream_of(ctx: &Arc<CudaContext>, pool: &MemPool<CudaDevice>) -> PoolStream {
    PoolStream::with_pool(ctx.new_stream().expect("stream"), pool).expect("PoolStream")
}

/// One error counter (a plain cudarc slice) per check.
fn counter(s: &Arc<CudaStream>) -> CudaSlice<u64> {
    s.alloc_zeros::<u64>(1).expect("error counter")
}

fn read_counter(s: &Arc<CudaStream>, c: &CudaSlice<u64>) -> u64 {
    s.clone_dtoh(c).expect("dtoh")[0]
}

/// cudarc's per-thread default stream names a different stream on each
/// thread; a `PoolStream` and its buffers are `Send`, so a buffer allocated
/// on thread 1's per-thread stream and dropped on thread 2 would be freed in
/// thread 2's stream order. The adapter refuses the stream outright, both as
/// a buffer's stream and as a declared user.
#[test]
fn per_thread_stream_is_refused() {
    let Some(ctx) = context("per_thread_stream_is_refused") else {
        return;
    };
    let pool = fresh_pool(&ctx);
    match PoolStream::new(ctx.per_thread_stream()) {
        Err(CudarcError::PerThreadStream { ordinal: 0 }) => {}
        other => panic!("PoolStream::new: expected PerThreadStream, got {other:?}"),
    }
    match PoolStream::with_pool(ctx.per_thread_stream(), &pool) {
        Err(e @ CudarcError::PerThreadStream { .. }) => {
            assert!(e.to_string().contains("new_stream"), "{e}");
            let code = DriverError::from(e).0;
            assert_eq!(
                code,
                cudarc::driver::sys::CUresult::CUDA_ERROR_INVALID_HANDLE
            );
        }
        other => panic!("PoolStream::with_pool: expected PerThreadStream, got {other:?}"),
    }
    let s = stream_of(&ctx, &pool);
    let buf = s.clone_htod(&[7u32; 64]).expect("htod");
    match buf.record_stream(&ctx.per_thread_stream()) {
        Err(CudarcError::PerThreadStream { .. }) => {}
        other => panic!("record_stream: expected PerThreadStream, got {other:?}"),
    }
    assert_eq!(s.clone_dtoh(&buf).expect("dtoh"), vec![7u32; 64]);
    drop(buf);
    s.synchronize().expect("sync");
    assert_eq!(pool.stats().used_current, 0);
}

/// A buffer read by a slow kernel on stream B and dropped on a thread that
/// never touched CUDA: the drop must still make A wait for B's tracked read
/// before the block (handed out again on A) is overwritten.
#[test]
fn drop_on_another_thread_waits_for_tracked_reads() {
    let Some(ctx) = context("drop_on_another_thread_waits_for_tracked_reads") else {
        return;
    };
    let pool = fresh_pool(&ctx);
    let a = stream_of(&ctx, &pool);
    let b = ctx.new_stream().expect("stream");
    assert!(ctx.is_managing_stream_synchronization(), "tracking is on");
    let tags = Tags::new(&ctx);
    let words = (8 << 20) / 4;
    let mut b_errors = counter(&b);
    let mut a_errors = counter(&b);
    for round in 0..3u32 {
        let tag = 0x1000_0000 + round;
        // SAFETY: filled before it is read.
        let mut buf = unsafe { a.alloc::<u32>(words) }.expect("alloc");
        tags.fill(&a, &mut buf, tag);
        tags.spin(&b, 200);
        tags.verify(&b, &buf, tag, &mut b_errors);
        let addr = buf.ptr();
        std::thread::spawn(move || drop(buf))
            .join()
            .expect("the drop on another thread did not panic");
        // One word shorter: the same block, not the parked slice.
        // SAFETY: filled before it is read.
        let mut next = unsafe { a.alloc::<u32>(words - 1) }.expect("alloc");
        assert_eq!(next.ptr(), addr, "the same block comes back on A");
        tags.fill(&a, &mut next, !tag);
        tags.verify(&a, &next, !tag, &mut a_errors);
        drop(next);
    }
    a.synchronize().expect("sync A");
    b.synchronize().expect("sync B");
    assert_eq!(read_counter(&b, &a_errors), 0, "A's own fills were checked");
    let seen = read_counter(&b, &b_errors);
    assert_eq!(
        seen, 0,
        "B read {seen} words overwritten after a drop on another thread"
    );
    pool.synchronize().expect("sync");
    assert_eq!(pool.stats().used_current, 0);
}

/// Eight pool streams; each round every stream fills a buffer, the next
/// stream reads it (tracked) behind a spin, the buffer is dropped (half of
/// them on other threads) and every stream at once allocates and
/// overwrites blocks of the same size, which may be the dropped ones, from
/// its own or another stream. No read may see an overwritten word.
#[test]
fn many_streams_with_buffers_crossing_them() {
    let Some(ctx) = context("many_streams_with_buffers_crossing_them") else {
        return;
    };
    let pool = fresh_pool(&ctx);
    const N: usize = 8;
    let streams: Vec<PoolStream> = (0..N).map(|_| stream_of(&ctx, &pool)).collect();
    let tags = Tags::new(&ctx);
    let words = (1 << 20) / 4;
    // Each counter is used on one stream only, so that the counters add no
    // ordering between streams that could hide a missing wait.
    let mut errors: Vec<CudaSlice<u64>> = Vec::new();
    let mut own_errors: Vec<CudaSlice<u64>> = streams.iter().map(|s| counter(s)).collect();
    for round in 0..4u32 {
        let mut bufs: Vec<PoolBuffer<u32>> = Vec::new();
        for (i, s) in streams.iter().enumerate() {
            // SAFETY: filled before it is read.
            let mut buf = unsafe { s.alloc::<u32>(words) }.expect("alloc");
            tags.fill(s, &mut buf, (round << 8) | i as u32);
            bufs.push(buf);
        }
        for (i, buf) in bufs.iter().enumerate() {
            let reader = &streams[(i + 1) % N];
            let mut e = counter(reader);
            tags.spin(reader, 20);
            tags.verify(reader, buf, (round << 8) | i as u32, &mut e);
            errors.push(e);
        }
        let mut threads = Vec::new();
        for (i, buf) in bufs.into_iter().enumerate() {
            if i % 2 == 0 {
                drop(buf);
            } else {
                threads.push(std::thread::spawn(move || drop(buf)));
            }
        }
        for t in threads {
            t.join().expect("drop thread");
        }
        let mut nexts = Vec::new();
        for (i, s) in streams.iter().enumerate() {
            for k in 0..2u32 {
                // SAFETY: filled before it is read.
                let mut next = unsafe { s.alloc::<u32>(words - 1 - k as usize) }.expect("alloc");
                let tag = 0xdead_0000 | (round << 8) | ((i as u32) << 1) | k;
                tags.fill(s, &mut next, tag);
                tags.verify(s, &next, tag, &mut own_errors[i]);
                nexts.push(next);
            }
        }
        drop(nexts);
    }
    for s in &streams {
        s.synchronize().expect("sync");
    }
    let s0 = streams[0].cuda_stream();
    for e in &own_errors {
        assert_eq!(read_counter(s0, e), 0, "own fills were checked");
    }
    let bad: Vec<(usize, u64)> = errors
        .iter()
        .map(|e| read_counter(s0, e))
        .enumerate()
        .filter(|&(_, n)| n != 0)
        .collect();
    assert!(
        bad.is_empty(),
        "(read, overwritten words) of cross-stream reads: {bad:?}"
    );
    pool.synchronize().expect("sync");
    let stats = pool.stats();
    assert_eq!(stats.used_current, 0, "{stats:?}");
    assert_eq!(stats.allocs, stats.frees, "{stats:?}");
}

/// A buffer kept after its `PoolStream`, the user's `Arc<CudaStream>` and
/// the user's pool handle are gone: it still reads back, it keeps the
/// stream registered (the pool still knows its stream id), and dropping it
/// returns every byte and retires the stream.
#[test]
fn buffer_outlives_its_pool_stream_stream_and_pool_handle() {
    let Some(ctx) = context("buffer_outlives_its_pool_stream_stream_and_pool_handle") else {
        return;
    };
    let pool = fresh_pool(&ctx);
    let raw_stream = ctx.new_stream().expect("stream");
    let s = PoolStream::with_pool(raw_stream.clone(), &pool).expect("PoolStream");
    let id = s.pool_stream();
    let data: Vec<u32> = (0..250_000u32)
        .map(|i| i.wrapping_mul(2_654_435_761))
        .collect();
    let buf = s.clone_htod(&data).expect("htod");
    drop(s);
    drop(raw_stream);
    let kept = buf.pool().clone();
    drop(pool);
    assert_eq!(buf.pool_stream(), id);
    assert_eq!(kept.stats().used_current, (data.len() * 4) as u64);
    // The registration lives with the buffer.
    let probe = kept
        .alloc_async(1, id)
        .expect("the stream is still registered");
    kept.free_async(probe, id).expect("free");
    assert_eq!(buf.stream().clone_dtoh(&buf).expect("dtoh"), data);
    // Another stream reads it too (tracked), into a pool copy.
    let other = stream_of(&ctx, &kept);
    let copy = buf.clone_on(&other).expect("clone_on");
    drop(buf);
    assert_eq!(other.clone_dtoh(&copy).expect("dtoh"), data);
    assert!(
        kept.alloc_async(1, id).is_err(),
        "the last buffer retired its stream"
    );
    drop(copy);
    drop(other);
    kept.synchronize().expect("sync");
    let stats = kept.stats();
    assert_eq!(stats.used_current, 0, "{stats:?}");
    assert_eq!(stats.allocs, stats.frees, "{stats:?}");
}

/// While a buffer of a stream whose `PoolStream` and user handle are gone
/// still lives, new streams never get its driver handle (the registration
/// holds it) and are new pool streams; after the buffer goes, a recycled
/// handle is a new stream. The old buffer's data stays intact throughout.
#[test]
fn new_streams_while_an_old_streams_buffer_lives() {
    let Some(ctx) = context("new_streams_while_an_old_streams_buffer_lives") else {
        return;
    };
    let pool = fresh_pool(&ctx);
    let old = stream_of(&ctx, &pool);
    let (old_raw, old_id) = (old.cu_stream() as usize, old.pool_stream());
    let data: Vec<u64> = (0..100_000u64).map(|i| i * i + 17).collect();
    let buf = old.clone_htod(&data).expect("htod");
    drop(old);
    let mut fresh = Vec::new();
    for _ in 0..32 {
        let s = stream_of(&ctx, &pool);
        assert_ne!(
            s.cu_stream() as usize,
            old_raw,
            "a live buffer's stream handle was recycled"
        );
        assert_ne!(s.pool_stream(), old_id);
        // Each new stream allocates and overwrites its own memory.
        let filler = s.alloc_zeros::<u64>(data.len()).expect("alloc_zeros");
        assert_eq!(s.clone_dtoh(&filler).expect("dtoh"), vec![0u64; data.len()]);
        fresh.push((s, filler));
    }
    let copy = fresh[7].0.clone_dtod(&buf).expect("clone_dtod");
    assert_eq!(fresh[7].0.clone_dtoh(&copy).expect("dtoh"), data);
    assert_eq!(buf.stream().clone_dtoh(&buf).expect("dtoh"), data);
    drop(buf);
    drop(fresh);
    let mut recycled = 0;
    for _ in 0..32 {
        let s = stream_of(&ctx, &pool);
        if s.cu_stream() as usize == old_raw {
            recycled += 1;
            assert_ne!(s.pool_stream(), old_id, "a recycled handle is a new stream");
        }
        let b = s.clone_htod(&data).expect("htod");
        assert_eq!(s.clone_dtoh(&b).expect("dtoh"), data);
    }
    let _ = std::io::Write::write_fmt(
        &mut std::io::stderr().lock(),
        format_args!(
            "NOTE new_streams_while_an_old_streams_buffer_lives: old handle recycled {recycled} \
             times after the buffer went\n"
        ),
    );
    drop(copy);
    pool.synchronize().expect("sync");
    assert_eq!(pool.stats().used_current, 0);
}

/// `clone_dtod` onto another stream, without a join: cudarc's tracking
/// makes the copy wait for the source's write on its own stream (which is
/// held back by a spin), through the forwarded `DevicePtr` impl. The copies,
/// read back to the host, hold the filled words, never the zeros the source
/// held before the write. (The tag pattern depends on the absolute address,
/// so the copies are compared with the source's pattern on the host, not
/// verified in place.)
#[test]
fn clone_dtod_across_streams_waits_for_the_write() {
    let Some(ctx) = context("clone_dtod_across_streams_waits_for_the_write") else {
        return;
    };
    let pool = fresh_pool(&ctx);
    let a = stream_of(&ctx, &pool);
    let b = stream_of(&ctx, &pool);
    let tags = Tags::new(&ctx);
    let words = (4 << 20) / 4;
    let mut stale = 0usize;
    for round in 0..3u32 {
        let tag = 0x5a5a_0000 + round;
        let mut src = a.alloc_zeros::<u32>(words).expect("alloc_zeros");
        let expect: Vec<u32> = (0..words as u64)
            .map(|i| tidepool_kernels::tag_word(tag, src.ptr() + 4 * i))
            .collect();
        tags.spin(&a, 100);
        tags.fill(&a, &mut src, tag);
        let copy = b.clone_dtod(&src).expect("clone_dtod");
        let copy2 = src.clone_on(&b).expect("clone_on");
        assert_eq!(copy.pool_stream(), b.pool_stream());
        assert!(pool.contains(copy.ptr()) && pool.contains(copy2.ptr()));
        for c in [&copy, &copy2] {
            let host = b.clone_dtoh(c).expect("clone_dtoh");
            stale += host.iter().zip(&expect).filter(|(g, e)| g != e).count();
        }
        drop((src, copy, copy2));
    }
    assert_eq!(stale, 0, "{stale} words of the copies were stale");
    pool.synchronize().expect("sync");
    assert_eq!(pool.stats().used_current, 0);
}

/// Zero-length buffers behave as cudarc's own (the same calls succeed or
/// fail alike), take no pool memory, and are counted as allocs and frees.
#[test]
fn zero_length_buffers() {
    let Some(ctx) = context("zero_length_buffers") else {
        return;
    };
    let pool = fresh_pool(&ctx);
    let plain = ctx.new_stream().expect("stream");
    let s = PoolStream::with_pool(plain.clone(), &pool).expect("PoolStream");
    let keep = s.clone_htod(&[1.5f32; 1000]).expect("htod");
    let before = pool.stats();
    let mut live = Vec::new();
    for i in 0..100 {
        let b: PoolBuffer<f32> = match i % 4 {
            0 => s.null().expect("null"),
            1 => s.alloc_zeros(0).expect("alloc_zeros(0)"),
            2 => s.clone_htod(&[] as &[f32]).expect("htod of nothing"),
            // SAFETY: never read beyond its zero elements.
            _ => unsafe { s.alloc(0) }.expect("alloc(0)"),
        };
        assert_eq!(b.len(), 0);
        assert!(b.is_empty());
        live.push(b);
    }
    let mid = pool.stats();
    assert_eq!(mid.used_current, before.used_current, "{mid:?}");
    assert_eq!(mid.reserved_current, before.reserved_current, "{mid:?}");
    assert_eq!(mid.allocs, before.allocs + 100, "{mid:?}");
    // Reading an empty buffer back gives nothing, and copies of it are
    // empty pool buffers.
    assert_eq!(
        s.clone_dtoh(&live[0]).expect("dtoh of nothing"),
        Vec::<f32>::new()
    );
    let copy = s.clone_dtod(&live[1]).expect("clone_dtod of nothing");
    assert_eq!(copy.len(), 0);
    let cloned = live[2].clone();
    assert_eq!(cloned.len(), 0);
    drop((copy, cloned));
    // What plain cudarc does with the same requests, for the record (its
    // `null` asks the driver for 0 bytes).
    let plain_null = plain.null::<f32>().map(|n| n.len());
    let _ = std::io::Write::write_fmt(
        &mut std::io::stderr().lock(),
        format_args!("NOTE zero_length_buffers: plain cudarc null() gives {plain_null:?}\n"),
    );
    drop(live);
    assert_eq!(s.clone_dtoh(&keep).expect("dtoh"), vec![1.5f32; 1000]);
    drop(keep);
    s.synchronize().expect("sync");
    let after = pool.stats();
    assert_eq!(after.used_current, 0, "{after:?}");
    assert_eq!(after.allocs, after.frees, "{after:?}");
    // 1 kept buffer, 100 empty ones, an empty copy and an empty clone.
    assert_eq!(after.allocs, before.allocs + 102, "{after:?}");
}

/// Requests the pool cannot serve come back as typed errors (never a
/// panic), convert to the driver's codes, leave the statistics as they
/// were, and the stream keeps working.
#[test]
fn huge_requests_are_typed_errors() {
    let Some(ctx) = context("huge_requests_are_typed_errors") else {
        return;
    };
    let pool = fresh_pool(&ctx);
    let s = stream_of(&ctx, &pool);
    let keep = s.clone_htod(&[3u16; 4096]).expect("htod");
    let before = pool.stats();
    // More elements than the address space holds.
    match s.alloc_zeros::<u64>(usize::MAX / 4) {
        Err(e @ CudarcError::SizeOverflow { .. }) => {
            let code = DriverError::from(e).0;
            assert_eq!(
                code,
                cudarc::driver::sys::CUresult::CUDA_ERROR_INVALID_VALUE
            );
        }
        other => panic!("expected SizeOverflow, got {other:?}"),
    }
    // Larger than the pool's whole address range (8 GiB).
    for bytes in [1usize << 50, (8 << 30) + 1] {
        match s.alloc_zeros::<u8>(bytes) {
            Err(e @ CudarcError::Pool(_)) => {
                let code = DriverError::from(e).0;
                assert_eq!(
                    code,
                    cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY
                );
            }
            other => panic!("{bytes} bytes: expected a pool error, got {other:?}"),
        }
    }
    // Larger than the device (the H200 has ~141 GB) but inside a pool with
    // a larger address range: out of memory.
    let wide = pool_with(&ctx, PoolConfig::default().with_va_size(256 << 30));
    let w = stream_of(&ctx, &wide);
    // SAFETY: never read (it fails).
    match unsafe { w.alloc::<u8>(200 << 30) } {
        Err(CudarcError::Pool(p)) => assert!(p.is_out_of_memory(), "{p}"),
        other => panic!("200 GiB: expected out of memory, got {other:?}"),
    }
    let wide_stats = wide.stats();
    assert_eq!(wide_stats.used_current, 0, "{wide_stats:?}");
    assert!(wide_stats.ooms >= 1, "{wide_stats:?}");
    let after = pool.stats();
    assert_eq!(after.used_current, before.used_current, "{after:?}");
    assert_eq!(after.allocs, before.allocs, "{after:?}");
    // The streams still work.
    let more = w.clone_htod(&[9u8; 1 << 20]).expect("htod after OOM");
    assert_eq!(w.clone_dtoh(&more).expect("dtoh"), vec![9u8; 1 << 20]);
    assert_eq!(s.clone_dtoh(&keep).expect("dtoh"), vec![3u16; 4096]);
}

/// A pool capped with `max_size`, used through `with_pool`: allocations
/// succeed up to the cap and then fail with an out-of-memory error (no
/// panic); the reserve never passes the cap; a dropped buffer makes room
/// again; every surviving buffer keeps its data.
#[test]
fn capped_pool_through_with_pool() {
    let Some(ctx) = context("capped_pool_through_with_pool") else {
        return;
    };
    let cap: u64 = 64 << 20;
    let pool = pool_with(
        &ctx,
        PoolConfig::default()
            .with_va_size(1 << 30)
            .with_max_size(cap)
            .with_last_resort_wait(std::time::Duration::ZERO),
    );
    let s = stream_of(&ctx, &pool);
    let words = (1 << 20) / 4;
    let mut live: Vec<PoolBuffer<u32>> = Vec::new();
    let err = loop {
        let i = live.len() as u32;
        match s.clone_htod(&vec![i; words]) {
            Ok(b) => live.push(b),
            Err(e) => break e,
        }
        assert!(live.len() <= 64, "more than the cap was handed out");
    };
    match &err {
        CudarcError::Pool(p) => assert!(p.is_out_of_memory(), "{p}"),
        other => panic!("expected out of memory, got {other:?}"),
    }
    assert!(
        live.len() >= 32,
        "only {} MiB of a 64 MiB cap were usable",
        live.len()
    );
    let stats = pool.stats();
    assert!(stats.reserved_current <= cap, "{stats:?}");
    assert_eq!(
        stats.used_current,
        (live.len() * words * 4) as u64,
        "{stats:?}"
    );
    // Make room and allocate again.
    let gone = live.remove(5);
    drop(gone);
    let again = s
        .clone_htod(&vec![0xabcd_u32; words])
        .expect("room after a drop");
    assert_eq!(s.clone_dtoh(&again).expect("dtoh"), vec![0xabcd_u32; words]);
    for (k, b) in live.iter().enumerate() {
        let i = if k < 5 { k } else { k + 1 } as u32;
        let back = s.clone_dtoh(b).expect("dtoh");
        assert!(back.iter().all(|&w| w == i), "buffer {i} lost its data");
    }
    drop((live, again));
    s.synchronize().expect("sync");
    let stats = pool.stats();
    assert_eq!(stats.used_current, 0, "{stats:?}");
    assert!(stats.reserved_high <= cap, "{stats:?}");
}

/// Thousands of live buffers on two streams, each with its own contents,
/// with half of them dropped and replaced in between: all read back
/// exactly, the pool's `used_current` is exact at each step.
#[test]
fn thousands_of_live_buffers() {
    let Some(ctx) = context("thousands_of_live_buffers") else {
        return;
    };
    let pool = fresh_pool(&ctx);
    let streams = [stream_of(&ctx, &pool), stream_of(&ctx, &pool)];
    const COUNT: usize = 4096;
    const WORDS: usize = 64; // 256 bytes each
    let contents = |i: usize, gen: u32| -> Vec<u32> {
        (0..WORDS as u32)
            .map(|w| (i as u32).wrapping_mul(0x9e37_79b9) ^ (w << 20) ^ gen)
            .collect()
    };
    let mut live: Vec<PoolBuffer<u32>> = (0..COUNT)
        .map(|i| streams[i % 2].clone_htod(&contents(i, 0)).expect("htod"))
        .collect();
    assert_eq!(pool.stats().used_current, (COUNT * WORDS * 4) as u64);
    // Replace the even ones, half of them from the other stream.
    for i in (0..COUNT).step_by(2) {
        let fresh = streams[(i / 2) % 2]
            .clone_htod(&contents(i, 0x8000_0000))
            .expect("htod");
        let old = std::mem::replace(&mut live[i], fresh);
        drop(old);
    }
    assert_eq!(pool.stats().used_current, (COUNT * WORDS * 4) as u64);
    for (i, b) in live.iter().enumerate() {
        let gen = if i % 2 == 0 { 0x8000_0000 } else { 0 };
        assert_eq!(
            b.stream().clone_dtoh(b).expect("dtoh"),
            contents(i, gen),
            "buffer {i}"
        );
    }
    let addresses: std::collections::HashSet<u64> = live.iter().map(|b| b.ptr()).collect();
    assert_eq!(addresses.len(), COUNT, "live buffers share an address");
    drop(live);
    pool.synchronize().expect("sync");
    let stats = pool.stats();
    assert_eq!(stats.used_current, 0, "{stats:?}");
    assert_eq!(stats.allocs, stats.frees, "{stats:?}");
    assert_eq!(stats.allocs, (COUNT + COUNT / 2) as u64, "{stats:?}");
}

/// A `PoolStream` moved to other threads allocates there; buffers made on
/// one thread are read and dropped on others; the data is intact and the
/// pool's counts balance.
#[test]
fn pool_stream_and_buffers_cross_threads() {
    let Some(ctx) = context("pool_stream_and_buffers_cross_threads") else {
        return;
    };
    let pool = fresh_pool(&ctx);
    let s = Arc::new(stream_of(&ctx, &pool));
    let handles: Vec<_> = (0..4u64)
        .map(|t| {
            let s = s.clone();
            std::thread::spawn(move || {
                let data: Vec<u64> = (0..10_000u64).map(|i| i * 31 + t).collect();
                let buf = s.clone_htod(&data).expect("htod on a worker thread");
                (buf, data)
            })
        })
        .collect();
    let made: Vec<_> = handles
        .into_iter()
        .map(|h| h.join().expect("worker"))
        .collect();
    let readers: Vec<_> = made
        .into_iter()
        .map(|(buf, data)| {
            let s = s.clone();
            std::thread::spawn(move || {
                let back = s.clone_dtoh(&buf).expect("dtoh on another thread");
                drop(buf);
                back == data
            })
        })
        .collect();
    for r in readers {
        assert!(r.join().expect("reader"), "data changed across threads");
    }
    s.synchronize().expect("sync");
    let stats = pool.stats();
    assert_eq!(stats.used_current, 0, "{stats:?}");
    assert_eq!(stats.allocs, 4, "{stats:?}");
    assert_eq!(stats.frees, 4, "{stats:?}");
}
