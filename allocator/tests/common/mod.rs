//! Helpers shared by the contract tests: small host devices, a stream
//! blocker (a host task that holds a stream busy until released), and
//! ordering probes.
#![allow(dead_code)]

pub mod wrap;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use tidepool::{Allocation, MemPool, PoolConfig, ReusePolicy};
use tidepool_sys::{Device, DevicePtr, HostConfig, HostDevice, Stream};

/// Granularity = the pool's page size in these tests.
pub const PAGE: usize = 2 << 20;

/// A host device of at most 1 GiB (tests run in parallel).
pub fn host() -> HostDevice {
    HostDevice::with_config(HostConfig {
        capacity: 1 << 30,
        granularity: PAGE,
    })
}

/// A host device with an explicit capacity.
pub fn host_with_capacity(capacity: usize) -> HostDevice {
    HostDevice::with_config(HostConfig {
        capacity,
        granularity: PAGE,
    })
}

pub fn config() -> PoolConfig {
    PoolConfig::default().with_va_size(4 << 30)
}

pub fn pool<D: Device>(dev: &Arc<D>, cfg: PoolConfig) -> MemPool<D> {
    MemPool::new(dev.clone(), cfg).expect("pool creation")
}

/// Room for `pages` pages, no stream cache, and neither internal
/// dependencies nor host waits: a request that cannot reuse a free under
/// the two reuse switches given fails at once.
pub fn strict_config(pages: u64, follow: bool, opportunistic: bool) -> PoolConfig {
    config()
        .with_max_size(pages * PAGE as u64)
        .with_stream_cache_bytes(0)
        .with_reuse(ReusePolicy {
            follow_event_dependencies: follow,
            opportunistic,
            internal_dependencies: false,
            wait_for_pending_frees: false,
        })
}

/// Allocate `block`-byte blocks on `stream` until the pool has no more
/// room, and check that they filled the one page left but one block.
pub fn fill_page_but_one<D: Device>(
    pool: &MemPool<D>,
    stream: Stream,
    block: usize,
) -> Vec<Allocation> {
    let mut kept = vec![];
    while let Ok(k) = pool.alloc_async(block, stream) {
        kept.push(k);
    }
    assert_eq!(kept.len(), PAGE / block - 1, "the page is full");
    kept
}

pub fn streams<D: Device>(dev: &D, n: usize) -> Vec<Stream> {
    (0..n)
        .map(|_| dev.create_stream().expect("stream"))
        .collect()
}

/// A host task that keeps a stream busy until [`Blocker::release`] (or
/// drop). Declare it *after* the pool so that a failing assertion releases
/// the stream before the pool and the device wait for it.
pub struct Blocker {
    tx: Option<Sender<()>>,
    done: Arc<AtomicBool>,
}

impl Blocker {
    pub fn on<D: Device + ?Sized>(dev: &D, stream: Stream) -> Blocker {
        let (tx, rx) = channel::<()>();
        let done = Arc::new(AtomicBool::new(false));
        let flag = done.clone();
        dev.launch_host(
            stream,
            Box::new(move || {
                let _ = rx.recv();
                flag.store(true, Ordering::SeqCst);
            }),
        )
        .expect("launch blocker");
        Blocker { tx: Some(tx), done }
    }

    pub fn release(&mut self) {
        self.tx.take();
    }

    /// Whether the blocked task has finished.
    pub fn done(&self) -> bool {
        self.done.load(Ordering::SeqCst)
    }

    pub fn flag(&self) -> Arc<AtomicBool> {
        self.done.clone()
    }
}

impl Drop for Blocker {
    fn drop(&mut self) {
        self.release();
    }
}

/// Enqueue on `stream` a task that reports whether `flag` was set when it
/// ran (the probe of "work ordered after X runs after X").
pub fn probe<D: Device + ?Sized>(dev: &D, stream: Stream, flag: Arc<AtomicBool>) -> Receiver<bool> {
    let (tx, rx) = channel();
    dev.launch_host(
        stream,
        Box::new(move || {
            let _ = tx.send(flag.load(Ordering::SeqCst));
        }),
    )
    .expect("launch probe");
    rx
}

/// Enqueue on `stream` a "kernel" that writes `tag` over the first `words`
/// words at `ptr`; the receiver says whether the memory was still mapped
/// read-write when it ran.
pub fn tag_kernel(
    dev: &HostDevice,
    stream: Stream,
    ptr: DevicePtr,
    words: usize,
    tag: u32,
) -> Receiver<bool> {
    let (tx, rx) = channel();
    dev.launch_on_words(stream, ptr, words * 4, move |r| {
        let ok = match r {
            Ok(w) => {
                for x in w {
                    x.store(tag, Ordering::Relaxed);
                }
                true
            }
            Err(_) => false,
        };
        let _ = tx.send(ok);
    })
    .expect("launch tag kernel");
    rx
}

/// A small deterministic PRNG (xorshift64*).
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
    /// Log-uniform in `lo..=hi` (both > 0).
    pub fn log_range(&mut self, lo: u64, hi: u64) -> u64 {
        let (a, b) = ((lo as f64).ln(), (hi as f64).ln());
        let u = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        ((a + (b - a) * u).exp() as u64).clamp(lo, hi)
    }
}

/// Pages (of [`PAGE`]) that `[ptr, ptr+len)` touches.
pub fn pages_of(ptr: DevicePtr, len: usize) -> std::ops::RangeInclusive<u64> {
    ptr / PAGE as u64..=(ptr + len as u64 - 1) / PAGE as u64
}

/// A fill pattern unique to (`seed`, index).
pub fn pattern(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| seed.wrapping_mul(0x9E37_79B9) ^ i)
        .collect()
}

/// Addresses of a word at both ends of every page a block touches: where
/// a page bound to the wrong place, or lost, shows first.
pub fn page_end_words(a: &Allocation) -> Vec<u64> {
    let (start, end) = (a.ptr(), a.ptr() + a.size() as u64);
    let mut out = Vec::new();
    let mut p = start / PAGE as u64 * PAGE as u64;
    while p < end {
        let lo = start.max(p).next_multiple_of(4);
        let hi = (end.min(p + PAGE as u64) / 4 * 4).saturating_sub(4);
        out.push(lo);
        if hi > lo {
            out.push(hi);
        }
        p += PAGE as u64;
    }
    out
}

/// Enqueue on `stream` a "kernel" writing `words` at `ptr`; the receiver
/// says whether the memory was mapped read-write when it ran.
pub fn write_kernel(
    dev: &HostDevice,
    stream: Stream,
    ptr: DevicePtr,
    words: Vec<u32>,
) -> Receiver<bool> {
    let (tx, rx) = channel();
    dev.launch_on_words(stream, ptr, words.len() * 4, move |r| {
        let ok = match r {
            Ok(w) => {
                for (x, &v) in w.iter().zip(&words) {
                    x.store(v, Ordering::Relaxed);
                }
                true
            }
            Err(_) => false,
        };
        let _ = tx.send(ok);
    })
    .expect("launch kernel");
    rx
}

/// Enqueue on `stream` a "kernel" writing scattered `words` (index in
/// 32-bit words from `ptr`, value) over the `len` bytes at `ptr`; the
/// receiver says whether the memory was mapped read-write when it ran.
pub fn write_words_at(
    dev: &HostDevice,
    stream: Stream,
    ptr: DevicePtr,
    len: usize,
    words: Vec<(usize, u32)>,
) -> Receiver<bool> {
    let (tx, rx) = channel();
    dev.launch_on_words(stream, ptr, len, move |r| {
        let ok = match r {
            Ok(w) => {
                for &(i, v) in &words {
                    w[i].store(v, Ordering::Relaxed);
                }
                true
            }
            Err(_) => false,
        };
        let _ = tx.send(ok);
    })
    .expect("launch kernel");
    rx
}

/// The words a stress test keeps in a live block of `size` bytes at `ptr`
/// under `tag`: (index in the block, value). One word at every multiple
/// of `stride` of the address (so two blocks sharing memory share word
/// positions), the j-th holding `tag << shift ^ j`; with `ends`, the first
/// and last words too, whatever the stride.
pub fn strided_words(
    ptr: DevicePtr,
    size: usize,
    tag: u32,
    stride: u64,
    shift: u32,
    ends: bool,
) -> Vec<(usize, u32)> {
    let size = (size / 4 * 4) as u64;
    let first = ptr.next_multiple_of(stride);
    let mut w: Vec<(usize, u32)> = (first..ptr + size)
        .step_by(stride as usize)
        .enumerate()
        .map(|(j, addr)| (((addr - ptr) / 4) as usize, tag << shift ^ j as u32))
        .collect();
    if ends && size >= 4 {
        w.push((0, tag ^ 0xA5A5_0000));
        w.push(((size / 4 - 1) as usize, tag ^ 0x5A5A_0000));
        w.sort_by_key(|x| x.0);
        w.dedup_by_key(|x| x.0);
    }
    w
}

/// Enqueue on `stream` a "kernel" checking `words` of the `len` bytes at
/// `ptr`: the first that differs as (index, found), `(usize::MAX, 0)`
/// when the memory was not mapped, or `None`.
pub fn check_words_at(
    dev: &HostDevice,
    stream: Stream,
    ptr: DevicePtr,
    len: usize,
    words: Vec<(usize, u32)>,
) -> Receiver<Option<(usize, u32)>> {
    let (tx, rx) = channel();
    dev.launch_on_words(stream, ptr, len, move |r| {
        let bad = match r {
            Ok(w) => words
                .iter()
                .find(|&&(i, v)| w[i].load(Ordering::Relaxed) != v)
                .map(|&(i, _)| (i, w[i].load(Ordering::Relaxed))),
            Err(_) => Some((usize::MAX, 0)),
        };
        let _ = tx.send(bad);
    })
    .expect("launch check");
    rx
}

/// Hold about half of `streams` busy (each with one chance in three of
/// staying free, drawn from `rng` in order), so that their frees stay
/// pending until the blockers are dropped.
pub fn gate_some<D: Device>(dev: &D, streams: &[Stream], rng: &mut Rng) -> Vec<Blocker> {
    streams
        .iter()
        .filter(|_| rng.range(0, 2) > 0)
        .map(|&s| Blocker::on(dev, s))
        .collect()
}

/// Wait for every write kernel in `kernels` (what it wrote, its
/// receiver), emptying it; each must have found its memory mapped.
pub fn expect_kernels_mapped(kernels: &mut Vec<(String, Receiver<bool>)>) {
    for (what, k) in kernels.drain(..) {
        assert!(
            k.recv().unwrap(),
            "{what}: the kernel found memory unmapped"
        );
    }
}

/// Whether `[a, a + alen)` and `[b, b + blen)` share a byte.
pub fn overlaps(a: DevicePtr, alen: usize, b: DevicePtr, blen: usize) -> bool {
    a < b + blen as u64 && b < a + alen as u64
}
