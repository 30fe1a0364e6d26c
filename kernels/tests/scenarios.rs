//! Scenarios that have broken real stream-ordered allocators, each its own
//! test, each run on the host backend and on CUDA (skipped, with the reason
//! printed, where no CUDA driver is usable; a failure instead when
//! `TIDEPOOL_REQUIRE_GPU=1`).
//!
//! Each scenario keeps a stream busy (a spin) around memory it fills with a
//! tag, frees that memory in stream order, and lets another stream allocate
//! and fill its own tag with no dependency of its own. A pool that hands the
//! memory out too early lets the two fills overlap, and one of the verifies
//! sees the other's tag. The variants with a one-page cap force the pool to
//! reuse exactly the busy memory (through an internal dependency or a host
//! wait) or to report out-of-memory; nothing else is allowed.
//!
//! 1. `stolen_block`: a block stolen by a second stream while the first still writes it.
//! 2. `merged_donors`: pending frees of two streams, adjacent, merged and taken
//!    by a third stream (whatever guards the merged memory must cover both donors).
//! 3. `destroyed_stream`: a stream destroyed while its frees are pending, then
//!    a new stream (on CUDA the driver may give it the same handle).
//! 4. `foreign_free`: a free on a stream that never touched the memory,
//!    ordered after the use through the pool (also with a declared slow
//!    reader on a third stream).
#![forbid(unsafe_code)]

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tidepool::{MemPool, PoolConfig, PoolError, ReusePolicy};
use tidepool_kernels::stress::{all_on, policy_name, standard_phases};
use tidepool_kernels::{TagKernels, WithTagKernels};
use tidepool_sys::cuda::CudaDevice;
use tidepool_sys::host::{HostConfig, HostDevice};
use tidepool_sys::{Device, Stream};

/// How long the donor streams stay busy.
const LONG: Duration = Duration::from_millis(250);
const SHORT: Duration = Duration::from_millis(60);

fn ns(d: Duration) -> u64 {
    d.as_nanos() as u64
}

// ---------------------------------------------------------------------------
// backends

/// What a scenario needs beyond the device trait.
trait Backend: Device + WithTagKernels + Sized {
    /// The driver's handle of a stream, where there is one (CUDA).
    fn raw_handle(&self, stream: Stream) -> Option<usize>;
}

impl Backend for HostDevice {
    fn raw_handle(&self, _: Stream) -> Option<usize> {
        None
    }
}

impl Backend for CudaDevice {
    fn raw_handle(&self, stream: Stream) -> Option<usize> {
        self.raw_stream(stream).ok()
    }
}

fn on_host(name: &str, scenario: fn(&Arc<HostDevice>, &dyn TagKernels)) {
    let dev = Arc::new(HostDevice::with_config(HostConfig {
        capacity: 1 << 30,
        ..Default::default()
    }));
    let k = dev.clone().tag_kernels().expect("host kernels");
    eprintln!("{name} on host");
    scenario(&dev, &*k);
}

/// The CUDA tests of this binary take turns on the GPU (the scenarios are
/// timing-sensitive in what they can detect).
static GPU: Mutex<()> = Mutex::new(());

fn on_cuda(name: &str, scenario: fn(&Arc<CudaDevice>, &dyn TagKernels)) {
    if !tidepool_sys::cuda::driver_available() {
        let reason = tidepool_sys::cuda::driver_unavailable_reason().unwrap_or_default();
        if std::env::var("TIDEPOOL_REQUIRE_GPU").as_deref() == Ok("1") {
            panic!("{name}: TIDEPOOL_REQUIRE_GPU=1 but no CUDA driver is usable: {reason}");
        }
        // Outside libtest's capture, so that the skip shows in every run.
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr().lock(),
            "SKIP {name} on cuda: no CUDA driver is usable here: {reason}"
        );
        return;
    }
    let _gpu: MutexGuard<'_, ()> = GPU.lock().unwrap_or_else(|e| e.into_inner());
    let dev = Arc::new(CudaDevice::new(0).expect("CudaDevice::new(0)"));
    let k = dev
        .clone()
        .tag_kernels()
        .unwrap_or_else(|e| panic!("{name}: CUDA tag kernels: {e}"));
    eprintln!("{name} on cuda");
    scenario(&dev, &*k);
}

macro_rules! scenario_tests {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[test]
            fn host() {
                super::on_host(stringify!($name), super::$name::<tidepool_sys::host::HostDevice>);
            }
            #[test]
            fn cuda() {
                super::on_cuda(stringify!($name), super::$name::<tidepool_sys::cuda::CudaDevice>);
            }
        }
    )*};
}

scenario_tests!(stolen_block, merged_donors, destroyed_stream, foreign_free);

macro_rules! liveness_tests {
    ($($name:ident: $why:literal),* $(,)?) => {$(
        #[doc = $why]
        mod $name {
            #[test]
            fn host() {
                super::on_host(stringify!($name), super::$name::<tidepool_sys::host::HostDevice>);
            }
            #[test]
            fn cuda() {
                super::on_cuda(stringify!($name), super::$name::<tidepool_sys::cuda::CudaDevice>);
            }
        }
    )*};
}

// Liveness, not safety: bugs where the pool stayed safe but failed to hand
// out memory it could (fixed; see docs/reliability.md, "Pool bugs found").
// `$why` names the bug each test guards against.
liveness_tests!(
    liveness_retired_stream_frees_are_reused:
        "pool bug: retire_stream closes no epoch, so a retired stream's frees never complete",
    liveness_cached_frees_merge_after_completion:
        "pool bug: acquire() flushes stream caches after observe_completions, so flushed \
         frees known complete are neither upgraded nor merged",
    liveness_fragmented_pool_has_no_false_oom:
        "no false out-of-memory: free pages whose sum covers a request that no free range \
         fits are stitched into one range, and live blocks keep their contents",
    pending_pages_serve_their_own_stream:
        "pages freed on a stream whose work still writes them serve that stream's next \
         request, and neither a trim nor another stream's request unmaps or takes what \
         that work still writes",
);

// ---------------------------------------------------------------------------
// helpers

/// A pool on `dev`: 1 GiB of address space, capped at `cap` bytes when
/// given, with or without the per-stream cache, under `policy`.
fn make_pool<D: Device>(
    dev: &Arc<D>,
    cap: Option<u64>,
    cache: bool,
    policy: ReusePolicy,
) -> MemPool<D> {
    let mut c = PoolConfig::default()
        .with_va_size(1 << 30)
        .with_reuse(policy)
        .with_stream_cache_bytes(if cache { 64 << 20 } else { 0 });
    if let Some(cap) = cap {
        c = c.with_max_size(cap);
    }
    // The last-resort host wait returns as soon as the pending frees
    // complete; its default bound (1 s) is shorter than the donors' busy
    // work takes on a loaded 2-core machine, where it turned an allowed wait
    // into a false out-of-memory. A generous bound keeps the scenarios
    // independent of machine speed and costs nothing on a fast one.
    c.last_resort_wait = Duration::from_secs(60);
    MemPool::new(dev.clone(), c).expect("pool")
}

fn streams<D: Device>(dev: &D, n: usize) -> Vec<Stream> {
    (0..n)
        .map(|_| dev.create_stream().expect("create_stream"))
        .collect()
}

fn destroy<D: Device>(dev: &D, streams: &[Stream]) {
    for &s in streams {
        dev.destroy_stream(s).expect("destroy_stream");
    }
}

/// Mismatches and access faults since the last call are both zero.
fn assert_clean(k: &dyn TagKernels, what: &str) {
    let m = k.mismatches().expect("mismatch counter");
    let f = k.access_faults().expect("access-fault counter");
    k.reset_counters().expect("reset counters");
    assert!(
        m == 0 && f == 0,
        "{what}: {m} mismatching words and {f} access faults: the pool handed out memory \
         that earlier work was still using"
    );
}

/// The busy owner: fill, spin, fill again (a late writer), verify — all on
/// `stream`.
fn busy_owner(k: &dyn TagKernels, stream: Stream, ptr: u64, len: usize, tag: u32, busy: Duration) {
    k.fill_tag(stream, ptr, len, tag).expect("fill");
    k.spin(stream, ns(busy)).expect("spin");
    k.fill_tag(stream, ptr, len, tag).expect("late fill");
    k.verify_tag(stream, ptr, len, tag).expect("verify");
}

/// The newcomer: fill its own tag, stay busy, verify it.
fn newcomer(k: &dyn TagKernels, stream: Stream, ptr: u64, len: usize, tag: u32, busy: Duration) {
    k.fill_tag(stream, ptr, len, tag).expect("fill");
    k.spin(stream, ns(busy)).expect("spin");
    k.verify_tag(stream, ptr, len, tag).expect("verify");
}

/// May the pool answer out-of-memory under a one-page cap with `policy`?
/// Only when it may neither make the stream wait nor wait on the host.
fn oom_allowed(policy: &ReusePolicy) -> bool {
    !policy.internal_dependencies && !policy.wait_for_pending_frees
}

/// The variants most scenarios run: uncapped with every switch on; capped
/// to one page under every standard policy, and with every switch off.
fn variants(page: u64) -> Vec<(Option<u64>, ReusePolicy)> {
    let mut v = vec![(None, all_on())];
    for p in standard_phases() {
        v.push((Some(page), p));
    }
    v.push((
        Some(page),
        ReusePolicy {
            follow_event_dependencies: false,
            opportunistic: false,
            internal_dependencies: false,
            wait_for_pending_frees: false,
        },
    ));
    v
}

fn label(cap: Option<u64>, policy: &ReusePolicy) -> String {
    format!(
        "{} {}",
        if cap.is_some() { "capped" } else { "uncapped" },
        policy_name(policy)
    )
}

/// Allocate, accepting out-of-memory only where `oom_ok`.
fn alloc_or_oom<D: Device>(
    pool: &MemPool<D>,
    size: usize,
    stream: Stream,
    oom_ok: bool,
    what: &str,
) -> Option<tidepool::Allocation> {
    match pool.alloc_async(size, stream) {
        Ok(a) => Some(a),
        Err(PoolError::OutOfMemory(r)) if oom_ok => {
            eprintln!(
                "  {what}: out of memory, as allowed ({} bytes)",
                r.requested
            );
            None
        }
        Err(e) => panic!("{what}: allocation failed: {e}"),
    }
}

// ---------------------------------------------------------------------------
// 1. a block stolen by a second stream while the first still writes it

fn stolen_block<D: Backend>(dev: &Arc<D>, k: &dyn TagKernels) {
    let page = dev.granularity();
    for (cap, policy) in variants(page as u64) {
        let what = format!("stolen_block ({})", label(cap, &policy));
        let pool = make_pool(dev, cap, true, policy);
        let s = streams(&**dev, 2);
        let (a, b) = (s[0], s[1]);
        let x = pool.alloc_async(page, a).expect("first allocation");
        let xp = x.ptr();
        busy_owner(k, a, xp, page, 0xA11C_E001, LONG);
        pool.free_async(x, a).expect("free on a");
        // b allocates with no dependency on a, while a still spins.
        let oom_ok = cap.is_some() && oom_allowed(&policy);
        if let Some(y) = alloc_or_oom(&pool, page, b, oom_ok, &what) {
            let yp = y.ptr();
            newcomer(k, b, yp, page, 0xB0B0_0002, LONG * 2);
            pool.free_async(y, b).expect("free on b");
            let st = pool.stats();
            eprintln!(
                "  {what}: b got {} block; internal deps {}",
                if yp == xp { "a's" } else { "another" },
                st.internal_dependencies
            );
            if cap.is_some() {
                assert_eq!(yp, xp, "{what}: under a one-page cap only a's block exists");
            }
        }
        assert_clean(k, &what);
        pool.synchronize().expect("synchronize");
        drop(pool);
        destroy(&**dev, &s);
    }
}

// ---------------------------------------------------------------------------
// 2. pending frees of two streams merged and taken by a third

fn merged_donors<D: Backend>(dev: &Arc<D>, k: &dyn TagKernels) {
    let page = dev.granularity();
    let half = page / 2;
    // (a busy, b busy, host pause before c allocates): whichever donor is
    // still busy when c allocates must be covered.
    let timings = [
        (LONG * 2, LONG, Duration::ZERO),
        (LONG, LONG * 2, Duration::ZERO),
        (SHORT, LONG * 2, SHORT * 2),
        (LONG * 2, SHORT, SHORT * 2),
    ];
    for cache in [false, true] {
        for &(busy_a, busy_b, pause) in &timings {
            for policy in [all_on(), {
                let mut p = all_on();
                p.wait_for_pending_frees = false;
                p
            }] {
                let what = format!(
                    "merged_donors (a {:?}, b {:?}, pause {:?}, stream cache {}, {})",
                    busy_a,
                    busy_b,
                    pause,
                    if cache { "on" } else { "off" },
                    policy_name(&policy)
                );
                let pool = make_pool(dev, Some(page as u64), cache, policy);
                let s = streams(&**dev, 3);
                let (a, b, c) = (s[0], s[1], s[2]);
                let x = pool.alloc_async(half, a).expect("a's half");
                let y = pool.alloc_async(half, b).expect("b's half");
                let (xp, yp) = (x.ptr(), y.ptr());
                assert_eq!(
                    xp.min(yp) + half as u64,
                    xp.max(yp),
                    "{what}: under a one-page cap the halves are adjacent"
                );
                busy_owner(k, a, xp, half, 0xD0D0_000A, busy_a);
                busy_owner(k, b, yp, half, 0xD0D0_000B, busy_b);
                pool.free_async(x, a).expect("free on a");
                pool.free_async(y, b).expect("free on b");
                std::thread::sleep(pause);
                if !pause.is_zero() {
                    // "After the pause one donor is done": make it so on a
                    // loaded machine too, through the device (the pool
                    // learns of it only by its own event queries).
                    let shorter = if busy_a < busy_b { a } else { b };
                    dev.synchronize_stream(shorter)
                        .expect("synchronize the shorter donor");
                }
                let deps = pool.stats().internal_dependencies;
                // c needs both halves: only after both donors' work.
                // With both donors busy no single free range fits, so only
                // the host wait can serve c. After the pause one donor is
                // done and the merged range could be taken with a
                // dependency, but with the stream cache on the pool does not
                // merge it yet (liveness_cached_frees_merge_after_completion).
                let oom_ok = !policy.wait_for_pending_frees && (pause.is_zero() || cache);
                if let Some(z) = alloc_or_oom(&pool, page, c, oom_ok, &what) {
                    assert_eq!(z.ptr(), xp.min(yp), "{what}: c gets the merged page");
                    // Busy long enough that a donor's late fill, had it
                    // overlapped, lands before c's verify.
                    newcomer(k, c, z.ptr(), page, 0xC0C0_000C, LONG * 2);
                    pool.free_async(z, c).expect("free on c");
                    eprintln!(
                        "  {what}: c took the merged page with {} internal dependencies",
                        pool.stats().internal_dependencies - deps
                    );
                }
                assert_clean(k, &what);
                pool.synchronize().expect("synchronize");
                drop(pool);
                destroy(&**dev, &s);
            }
        }
    }
}

// ---------------------------------------------------------------------------
// 3. a stream destroyed while its frees are pending, then a new stream

fn destroyed_stream<D: Backend>(dev: &Arc<D>, k: &dyn TagKernels) {
    let page = dev.granularity();
    for retire in [true, false] {
        for cap in [None, Some(page as u64)] {
            let what = format!(
                "destroyed_stream ({}, {})",
                if retire {
                    "retired then destroyed"
                } else {
                    "destroyed without retire"
                },
                if cap.is_some() { "capped" } else { "uncapped" }
            );
            let pool = make_pool(dev, cap, true, all_on());
            let a = dev.create_stream().expect("create_stream");
            let raw_a = dev.raw_handle(a);
            let x = pool.alloc_async(page, a).expect("allocation on a");
            let xp = x.ptr();
            busy_owner(k, a, xp, page, 0xDEAD_000A, LONG);
            pool.free_async(x, a).expect("free on a");
            if retire {
                pool.retire_stream(a).expect("retire_stream");
            }
            dev.destroy_stream(a).expect("destroy a");
            // The driver may hand the next stream a's handle: create a few.
            let fresh = streams(&**dev, 3);
            let mut reused = None;
            for &s in &fresh {
                assert_ne!(s, a, "{what}: stream ids are never reused");
                if raw_a.is_some() && dev.raw_handle(s) == raw_a {
                    reused = Some(s);
                }
            }
            let b = reused.unwrap_or(fresh[0]);
            eprintln!(
                "  {what}: the new stream {} a's driver handle",
                match (raw_a, reused) {
                    (None, _) => "has no driver handle to compare with",
                    (Some(_), Some(_)) => "REUSES",
                    (Some(_), None) => "does not reuse",
                }
            );
            // Under the cap, the only memory is a's block: the pool must
            // wait for a's work (or say out-of-memory), never treat b as a.
            // (That it should not say out-of-memory after a retire is
            // `liveness_retired_stream_frees_are_reused`.)
            let oom_ok = cap.is_some();
            if let Some(y) = alloc_or_oom(&pool, page, b, oom_ok, &what) {
                newcomer(k, b, y.ptr(), page, 0xDEAD_000B, LONG * 2);
                pool.free_async(y, b).expect("free on b");
            }
            if !retire {
                // The contract asks for a retire before the destroy; a late
                // retire finds the driver stream gone, so the pool can only
                // learn that a's frees completed by a device-wide wait.
                pool.retire_stream(a).expect("retire_stream after destroy");
            }
            pool.synchronize().expect("synchronize");
            // Dropping the pool unmaps everything: a's queued work (when b
            // had nothing to wait for) must not find its memory gone. The
            // counters are read after the drop so that they see it.
            drop(pool);
            dev.synchronize_device()
                .unwrap_or_else(|e| panic!("{what}: device-wide wait after the pool's drop: {e}"));
            assert_clean(k, &what);
            destroy(&**dev, &fresh);
        }
    }
}

// ---------------------------------------------------------------------------
// 4. a free on a stream that never touched the memory

fn foreign_free<D: Backend>(dev: &Arc<D>, k: &dyn TagKernels) {
    let page = dev.granularity();
    for (cap, policy) in variants(page as u64) {
        let oom_ok = cap.is_some() && oom_allowed(&policy);
        let s = streams(&**dev, 4);
        let (a, b, c, u) = (s[0], s[1], s[2], s[3]);

        // 4a. a uses it; b, ordered after a through the pool, frees it;
        // c allocates with no dependency.
        let what = format!("foreign_free ({})", label(cap, &policy));
        let pool = make_pool(dev, cap, true, policy);
        let x = pool.alloc_async(page, a).expect("allocation on a");
        let xp = x.ptr();
        busy_owner(k, a, xp, page, 0xF0F0_000A, LONG);
        let ev = pool.record_event(a).expect("record on a");
        pool.wait_event(b, &ev).expect("b waits on a");
        pool.free_async(x, b).expect("free on b");
        if let Some(z) = alloc_or_oom(&pool, page, c, oom_ok, &what) {
            newcomer(k, c, z.ptr(), page, 0xF0F0_000C, LONG * 2);
            pool.free_async(z, c).expect("free on c");
        }
        // b itself may take the block back at once: b is ordered after a.
        let y = pool.alloc_async(page, b).expect("allocation on b");
        newcomer(k, b, y.ptr(), page, 0xF0F0_000B, SHORT);
        pool.free_async(y, b).expect("free on b");
        assert_clean(k, &what);
        pool.synchronize().expect("synchronize");
        drop(pool);

        // 4b. as 4a, plus a slow reader on u declared with record_use; b
        // never touches the memory and does not wait on u itself.
        let what = format!(
            "foreign_free with a declared reader ({})",
            label(cap, &policy)
        );
        let pool = make_pool(dev, cap, true, policy);
        let mut x = pool.alloc_async(page, a).expect("allocation on a");
        let xp = x.ptr();
        k.fill_tag(a, xp, page, 0xF1F1_000A).expect("fill");
        let ev = pool.record_event(a).expect("record on a");
        pool.wait_event(u, &ev).expect("u waits on a");
        k.spin(u, ns(LONG)).expect("spin u");
        k.verify_tag(u, xp, page, 0xF1F1_000A).expect("verify on u");
        pool.record_use(&mut x, u);
        let ev = pool.record_event(a).expect("record on a");
        pool.wait_event(b, &ev).expect("b waits on a");
        pool.free_async(x, b).expect("free on b");
        if let Some(z) = alloc_or_oom(&pool, page, c, oom_ok, &what) {
            newcomer(k, c, z.ptr(), page, 0xF1F1_000C, LONG * 2);
            pool.free_async(z, c).expect("free on c");
        }
        assert_clean(k, &what);
        pool.synchronize().expect("synchronize");
        drop(pool);

        // 4c. follow-event reuse: c waits (through the pool) on an event of
        // b recorded after b's free; c may then reuse at once.
        let what = format!(
            "foreign_free then a followed wait ({})",
            label(cap, &policy)
        );
        let pool = make_pool(dev, cap, true, policy);
        let x = pool.alloc_async(page, a).expect("allocation on a");
        let xp = x.ptr();
        busy_owner(k, a, xp, page, 0xF2F2_000A, LONG);
        let ev = pool.record_event(a).expect("record on a");
        pool.wait_event(b, &ev).expect("b waits on a");
        pool.free_async(x, b).expect("free on b");
        let ev = pool.record_event(b).expect("record on b");
        pool.wait_event(c, &ev).expect("c waits on b");
        // c is ordered after the free: with following on the pool may hand
        // it the block at once; with following off only a wait makes it safe.
        let followable = policy.follow_event_dependencies;
        if let Some(z) = alloc_or_oom(&pool, page, c, oom_ok && !followable, &what) {
            if cap.is_some() && followable {
                assert_eq!(z.ptr(), xp, "{what}: c reuses b's free");
            }
            newcomer(k, c, z.ptr(), page, 0xF2F2_000C, SHORT);
            pool.free_async(z, c).expect("free on c");
        }
        assert_clean(k, &what);
        pool.synchronize().expect("synchronize");
        drop(pool);
        destroy(&**dev, &s);
    }
}

// ---------------------------------------------------------------------------
// liveness

/// A stream retired (as the contract asks) while its free is pending, then
/// destroyed: once its work is done, the memory must be reusable. Today
/// `retire_stream` drains the cache under the stream's open epoch and
/// records no event, so nothing ever observes that epoch complete (not even
/// `synchronize`, which skips retired streams): the memory is lost to the
/// pool for good.
fn liveness_retired_stream_frees_are_reused<D: Backend>(dev: &Arc<D>, k: &dyn TagKernels) {
    let page = dev.granularity();
    let pool = make_pool(dev, Some(page as u64), true, all_on());
    let a = dev.create_stream().expect("create_stream");
    let x = pool.alloc_async(page, a).expect("allocation on a");
    busy_owner(k, a, x.ptr(), page, 0x11FE_000A, SHORT);
    pool.free_async(x, a).expect("free on a");
    pool.retire_stream(a).expect("retire_stream");
    dev.destroy_stream(a).expect("destroy a");
    let b = dev.create_stream().expect("create_stream");
    std::thread::sleep(SHORT * 3);
    pool.synchronize().expect("synchronize");
    let y = pool
        .alloc_async(page, b)
        .expect("a's work is long done and the host synchronised: its block must be reusable");
    newcomer(k, b, y.ptr(), page, 0x11FE_000B, SHORT);
    pool.free_async(y, b).expect("free on b");
    assert_clean(k, "liveness_retired_stream_frees_are_reused");
    pool.synchronize().expect("synchronize");
    drop(pool);
    destroy(&**dev, &[b]);
}

/// Two adjacent halves of the only page, freed on a (done) and b (busy)
/// into their stream caches; c needs the whole page and may not wait on the
/// host. The merged range is guarded by b alone, so c can take it with one
/// internal dependency — as it does when the stream cache is off. With the
/// cache on, `acquire` runs `observe_completions` (which settles and merges
/// guards) before `flush_caches`, so a's flushed half stays `After{a}`,
/// unmerged, and c gets out-of-memory.
fn liveness_cached_frees_merge_after_completion<D: Backend>(dev: &Arc<D>, k: &dyn TagKernels) {
    let page = dev.granularity();
    let half = page / 2;
    let policy = ReusePolicy {
        wait_for_pending_frees: false,
        ..all_on()
    };
    let pool = make_pool(dev, Some(page as u64), true, policy);
    let s = streams(&**dev, 3);
    let (a, b, c) = (s[0], s[1], s[2]);
    let x = pool.alloc_async(half, a).expect("a's half");
    let y = pool.alloc_async(half, b).expect("b's half");
    busy_owner(k, a, x.ptr(), half, 0x11FE_100A, SHORT);
    busy_owner(k, b, y.ptr(), half, 0x11FE_100B, LONG * 2);
    pool.free_async(x, a).expect("free on a");
    pool.free_async(y, b).expect("free on b");
    std::thread::sleep(SHORT * 2);
    let z = pool
        .alloc_async(page, c)
        .expect("a is done, b is pending: the merged page can be taken with a dependency on b");
    newcomer(k, c, z.ptr(), page, 0x11FE_100C, SHORT);
    pool.free_async(z, c).expect("free on c");
    assert_clean(k, "liveness_cached_frees_merge_after_completion");
    pool.synchronize().expect("synchronize");
    drop(pool);
    destroy(&**dev, &s);
}

/// A pool capped at 8 pages with every switch on and no stream cache, two
/// streams, and 16 half-page blocks allocated on the first: the pool is
/// full.
fn eight_full_pages<D: Backend>(
    dev: &Arc<D>,
) -> (MemPool<D>, Vec<Stream>, Vec<tidepool::Allocation>) {
    let page = dev.granularity();
    let pool = make_pool(dev, Some(8 * page as u64), false, all_on());
    let s = streams(&**dev, 2);
    let blocks: Vec<_> = (0..16)
        .map(|_| pool.alloc_async(page / 2, s[0]).expect("half-page block"))
        .collect();
    assert_eq!(pool.stats().reserved_current, 8 * page as u64);
    (pool, s, blocks)
}

/// A pool capped at 8 pages, full of half-page blocks; every other page's
/// blocks are freed (and complete), so 4 pages are free but no free range
/// holds 2. A 2-page request on the freeing stream and on a second stream
/// must be served by stitching (no growth, no out-of-memory), while the
/// live blocks, tagged before, verify after.
fn liveness_fragmented_pool_has_no_false_oom<D: Backend>(dev: &Arc<D>, k: &dyn TagKernels) {
    let page = dev.granularity();
    let (pool, s, blocks) = eight_full_pages(dev);
    let page_of = move |p: u64| p / page as u64;
    let mut live = Vec::new();
    for (i, a) in blocks.iter().enumerate() {
        if page_of(a.ptr()) % 2 == 1 {
            k.fill_tag(s[0], a.ptr(), a.size(), 0xF7A6_0000 + i as u32)
                .expect("fill");
        }
    }
    for (i, a) in blocks.into_iter().enumerate() {
        if page_of(a.ptr()) % 2 == 1 {
            live.push((a, 0xF7A6_0000 + i as u32));
        } else {
            pool.free_async(a, s[0]).expect("free");
        }
    }
    assert_eq!(live.len(), 8, "half-page blocks did not pack two per page");
    dev.synchronize_stream(s[0]).expect("sync");
    for (n, &st) in s.iter().enumerate() {
        let before = pool.stats();
        let big = pool
            .alloc_async(2 * page, st)
            .unwrap_or_else(|e| panic!("false out-of-memory on stream {n}: {e}"));
        let after = pool.stats();
        assert_eq!(after.growths, before.growths, "the pool grew past its cap");
        assert!(after.reserved_current <= 8 * page as u64);
        if n == 0 {
            // The second request may find the first one's stitched range.
            assert!(
                after.remaps + after.rebinds > before.remaps + before.rebinds,
                "served without stitching? {after:?}"
            );
        }
        newcomer(k, st, big.ptr(), 2 * page, 0xF7A6_0B00 + n as u32, SHORT);
        for (a, tag) in &live {
            k.verify_tag(st, a.ptr(), a.size(), *tag).expect("verify");
        }
        pool.free_async(big, st).expect("free");
        dev.synchronize_stream(st).expect("sync");
    }
    assert_clean(k, "liveness_fragmented_pool_has_no_false_oom");
    for (a, _) in live {
        pool.free_async(a, s[0]).expect("free");
    }
    pool.synchronize().expect("synchronize");
    drop(pool);
    destroy(&**dev, &s);
}

/// A pool capped at 8 pages, full of half-page blocks. Every other page's
/// blocks are freed on s0 behind a late writer (fill, spin, fill again,
/// verify), so 4 pages are free but pending on s0, and no free range holds
/// 2 of them. A 2-page request on s0 must be served without growing: from
/// those pages (the work that still writes them is ordered before the
/// request's on s0, but their old addresses must stay mapped until that
/// work is done) or after waiting for them. While the writer still runs, a
/// trim may give nothing back that it writes, and a 2-page request on s1
/// must not get memory the writer or s0's new block uses. Every tag
/// verifies, the late writer's included; when all is done a trim gives
/// back every page.
fn pending_pages_serve_their_own_stream<D: Backend>(dev: &Arc<D>, k: &dyn TagKernels) {
    let page = dev.granularity();
    let (pool, s, blocks) = eight_full_pages(dev);
    let page_of = move |p: u64| p / page as u64;
    let tag = |i: usize| 0x9E4D_0000 + i as u32;
    let (mut live, mut freed) = (Vec::new(), Vec::new());
    for (i, a) in blocks.into_iter().enumerate() {
        k.fill_tag(s[0], a.ptr(), a.size(), tag(i)).expect("fill");
        if page_of(a.ptr()) % 2 == 1 {
            live.push((a, tag(i)));
        } else {
            freed.push((a, tag(i)));
        }
    }
    assert_eq!(live.len(), 8, "half-page blocks did not pack two per page");
    // The late writer of the blocks about to be freed.
    k.spin(s[0], ns(LONG)).expect("spin");
    for (a, t) in &freed {
        k.fill_tag(s[0], a.ptr(), a.size(), *t).expect("late fill");
        k.verify_tag(s[0], a.ptr(), a.size(), *t).expect("verify");
    }
    for (a, _) in freed {
        pool.free_async(a, s[0]).expect("free");
    }
    let before = pool.stats();
    let own = pool
        .alloc_async(2 * page, s[0])
        .unwrap_or_else(|e| panic!("false out-of-memory on the freeing stream: {e}"));
    assert_eq!(
        pool.stats().growths,
        before.growths,
        "the pool grew past its cap"
    );
    newcomer(k, s[0], own.ptr(), 2 * page, 0x9E4D_0A00, SHORT);
    // Nothing written by pending work may go back to the device.
    pool.trim_to(0).expect("trim while the writer runs");
    let other = pool
        .alloc_async(2 * page, s[1])
        .unwrap_or_else(|e| panic!("false out-of-memory on the second stream: {e}"));
    assert!(pool.stats().reserved_current <= 8 * page as u64);
    newcomer(k, s[1], other.ptr(), 2 * page, 0x9E4D_0B00, SHORT);
    for (a, t) in &live {
        k.verify_tag(s[1], a.ptr(), a.size(), *t).expect("verify");
    }
    k.verify_tag(s[0], own.ptr(), 2 * page, 0x9E4D_0A00)
        .expect("verify");
    for &st in &s {
        dev.synchronize_stream(st).expect("sync");
    }
    assert_clean(k, "pending_pages_serve_their_own_stream");
    pool.free_async(own, s[0]).expect("free");
    pool.free_async(other, s[1]).expect("free");
    for (a, _) in live {
        pool.free_async(a, s[0]).expect("free");
    }
    pool.synchronize().expect("synchronize");
    pool.trim_to(0).expect("trim");
    assert_eq!(
        pool.stats().reserved_current,
        0,
        "pages kept after a full trim"
    );
    drop(pool);
    destroy(&**dev, &s);
}
