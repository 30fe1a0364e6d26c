//! Shared helpers of the criterion benches (`benches/benches/*.rs`): the
//! quick mode, the one-line-per-measurement summary file, device setup, the
//! skip logic when no CUDA driver is present, and the allocators under test
//! behind one small trait ([`BenchAlloc`]).
//!
//! Environment:
//! - `TIDEPOOL_BENCH_QUICK=1`: short warm-up and measurement (0.3 s / 1 s,
//!   10 samples, no plots), so the whole GPU set runs in minutes;
//! - `TIDEPOOL_BENCH_SUMMARY=FILE`: every measurement appends one JSON line
//!   to `FILE` (see [`Summary`]);
//! - `TIDEPOOL_REQUIRE_GPU=1` (set by the GPU runner): a missing CUDA driver
//!   is a failure instead of a skip.
//!
//! This module is compiled into each bench binary (`mod benchutil;`), not
//! into the `tidepool-benches` library, so that criterion and its
//! dependencies stay out of the replayer's build: `criterion` is a
//! dev-dependency only. A bench that uses only part of it would warn about
//! the rest, hence the `dead_code` allowance.
#![allow(dead_code)]

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, BenchmarkId, Criterion, SamplingMode, Throughput};
use std::cell::RefCell;
use std::io::Write;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tidepool::{Allocation, MemPool, PoolConfig};
use tidepool_sys::cuda::baseline::{self, DriverPool};
use tidepool_sys::cuda::CudaDevice;
use tidepool_sys::host::{HostConfig, HostDevice};
use tidepool_sys::{Device, DevicePtr, Stream};

// ---------------------------------------------------------------------------
// configuration

/// Whether `TIDEPOOL_BENCH_QUICK` is set (to anything but `0` or empty).
pub fn quick() -> bool {
    std::env::var("TIDEPOOL_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0")
}

/// Samples per benchmark: 10 in quick mode (criterion's minimum), else 30.
pub fn sample_size() -> usize {
    if quick() {
        10
    } else {
        30
    }
}

/// The criterion configuration of every bench binary.
pub fn criterion() -> Criterion {
    let c = Criterion::default().sample_size(sample_size());
    if quick() {
        c.warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_secs(1))
            .without_plots()
    } else {
        c.warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(3))
    }
}

/// A criterion benchmark group (wall time).
pub type Group<'a> = BenchmarkGroup<'a, WallTime>;

/// A benchmark group with this crate's sample size; `flat` for benches whose
/// one iteration is long (many live, trace replay, overlap).
pub fn group<'a>(c: &'a mut Criterion, name: &str, flat: bool) -> Group<'a> {
    let mut g = c.benchmark_group(name);
    g.sample_size(sample_size());
    if flat {
        g.sampling_mode(SamplingMode::Flat);
    }
    g
}

// ---------------------------------------------------------------------------
// summary file

/// Appends JSON lines to `$TIDEPOOL_BENCH_SUMMARY` (nothing when unset).
///
/// Each measurement line: `{"bench", "backend", "allocator", "param",
/// "ns_per_op", "ops_per_sec", "samples", "iters"}` where an *op* is what
/// the bench counts (a pair, one allocation, one trace operation, one short
/// iteration...); `ns_per_op` is the median over criterion's measurement
/// samples of time / ops, and `ops_per_sec` is `1e9 / ns_per_op`. Extra
/// fields may follow (`extra`).
pub struct Summary;

impl Summary {
    fn path() -> Option<String> {
        std::env::var("TIDEPOOL_BENCH_SUMMARY")
            .ok()
            .filter(|p| !p.is_empty())
    }

    /// Append one raw JSON line.
    pub fn append_line(line: &str) {
        let Some(path) = Self::path() else { return };
        let r = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| writeln!(f, "{line}"));
        if let Err(e) = r {
            eprintln!("tidepool bench: cannot append to summary {path}: {e}");
        }
    }

    /// A measurement line.
    #[allow(clippy::too_many_arguments)]
    pub fn measurement(
        bench: &str,
        backend: &str,
        allocator: &str,
        param: &str,
        ns_per_op: f64,
        samples: usize,
        iters: u64,
        extra: &[(&str, String)],
    ) {
        let ops_per_sec = if ns_per_op > 0.0 {
            1e9 / ns_per_op
        } else {
            0.0
        };
        let mut line = serde_json::json!({
            "bench": bench,
            "backend": backend,
            "allocator": allocator,
            "param": param,
            "ns_per_op": (ns_per_op * 1000.0).round() / 1000.0,
            "ops_per_sec": (ops_per_sec * 10.0).round() / 10.0,
            "samples": samples,
            "iters": iters,
        });
        for (k, v) in extra {
            // `extra` values are JSON texts (numbers, mostly); anything else
            // is kept as a string.
            let value = serde_json::from_str(v).unwrap_or_else(|_| v.clone().into());
            line[*k] = value;
        }
        let line = line.to_string();
        eprintln!("summary: {line}");
        Self::append_line(&line);
    }

    /// A `{"meta":...}` line describing the run (once per bench binary).
    pub fn meta(binary: &str) {
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let mut line = serde_json::json!({
            "meta": binary,
            "unix_time": secs,
            "quick": quick(),
            "cpus": std::thread::available_parallelism().map_or(0, |n| n.get()),
        });
        match cuda() {
            Some(dev) => {
                if let Ok((ma, mi)) = dev.compute_capability() {
                    line["compute_capability"] = format!("{ma}.{mi}").into();
                }
                if let Ok(m) = dev.mem_info() {
                    line["device_mem_total"] = m.total.into();
                }
            }
            None => line["cuda"] = false.into(),
        }
        Self::append_line(&line.to_string());
    }
}

/// What one benchmark measures, for the summary line.
#[derive(Debug, Clone)]
pub struct Meas<'a> {
    pub bench: &'a str,
    pub backend: &'a str,
    pub allocator: &'a str,
    pub param: String,
    /// Operations one criterion iteration counts (pairs, allocations...).
    pub ops_per_iter: u64,
}

/// Run one benchmark through `iter_custom(routine)` and write its summary
/// line. `routine(iters)` does `iters` iterations and returns the time they
/// took (it may leave out untimed set-up and tear-down).
///
/// The summary takes criterion's measurement samples (the last
/// `sample_size` calls of the routine: the earlier ones are warm-up) and
/// reports the median of time / ops. Criterion's `--test` mode (one call)
/// writes no line. Returns the summary's ns per op, if any.
pub fn bench<R>(g: &mut Group<'_>, m: &Meas<'_>, mut routine: R) -> Option<f64>
where
    R: FnMut(u64) -> Duration,
{
    let calls: RefCell<Vec<(u64, Duration)>> = RefCell::new(Vec::new());
    g.throughput(Throughput::Elements(m.ops_per_iter));
    let id = BenchmarkId::new(format!("{}/{}", m.backend, m.allocator), &m.param);
    g.bench_function(id, |b| {
        b.iter_custom(|iters| {
            let d = routine(iters);
            calls.borrow_mut().push((iters, d));
            d
        })
    });
    let calls = calls.into_inner();
    let n = sample_size();
    if calls.len() <= n {
        return None;
    }
    let samples = &calls[calls.len() - n..];
    let mut per_op: Vec<f64> = samples
        .iter()
        .map(|&(it, d)| d.as_nanos() as f64 / (it.max(1) * m.ops_per_iter.max(1)) as f64)
        .collect();
    per_op.sort_by(|a, b| a.total_cmp(b));
    let median = if n % 2 == 1 {
        per_op[n / 2]
    } else {
        (per_op[n / 2 - 1] + per_op[n / 2]) / 2.0
    };
    let iters: u64 = samples.iter().map(|s| s.0).sum();
    Summary::measurement(
        m.bench,
        m.backend,
        m.allocator,
        &m.param,
        median,
        n,
        iters,
        &[],
    );
    Some(median)
}

/// Time `iters` runs of `f`.
#[inline]
pub fn time_loop(iters: u64, mut f: impl FnMut()) -> Duration {
    let start = Instant::now();
    for _ in 0..iters {
        f();
    }
    start.elapsed()
}

/// `256B`, `64KiB`, `2MiB`, `1GiB`.
pub fn size_label(bytes: usize) -> String {
    const UNITS: [(usize, &str); 3] = [(1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    for (u, name) in UNITS {
        if bytes >= u && bytes % u == 0 {
            return format!("{}{name}", bytes / u);
        }
    }
    format!("{bytes}B")
}

// ---------------------------------------------------------------------------
// devices and skipping

/// CUDA device 0, opened once per process; `None` (with the reason printed
/// by [`cuda_or_skip`]) where no CUDA driver is usable.
pub fn cuda() -> Option<Arc<CudaDevice>> {
    static DEV: OnceLock<Result<Arc<CudaDevice>, String>> = OnceLock::new();
    DEV.get_or_init(|| {
        if !tidepool_sys::cuda::driver_available() {
            return Err(tidepool_sys::cuda::driver_unavailable_reason()
                .unwrap_or_else(|| "driver_available() is false".into()));
        }
        CudaDevice::new(0)
            .map(Arc::new)
            .map_err(|e| format!("opening CUDA device 0: {e}"))
    })
    .as_ref()
    .ok()
    .cloned()
}

fn cuda_error() -> Option<String> {
    if cuda().is_some() {
        return None;
    }
    Some(
        tidepool_sys::cuda::driver_unavailable_reason()
            .unwrap_or_else(|| "CUDA device 0 could not be opened".into()),
    )
}

/// The CUDA device for a GPU bench, or `None` after printing
/// `skipped: no CUDA driver (<reason>)`. With `TIDEPOOL_REQUIRE_GPU=1` a
/// missing driver panics instead.
pub fn cuda_or_skip(bench: &str) -> Option<Arc<CudaDevice>> {
    if let Some(dev) = cuda() {
        return Some(dev);
    }
    let reason = cuda_error().unwrap_or_default();
    if std::env::var("TIDEPOOL_REQUIRE_GPU").is_ok_and(|v| v == "1") {
        panic!("{bench}: TIDEPOOL_REQUIRE_GPU=1 but no CUDA driver ({reason})");
    }
    println!("{bench}: skipped: no CUDA driver ({reason})");
    None
}

/// A fresh host device (the host backend: memfd memory, worker-thread
/// streams) with 64 GiB of capacity and 2 MiB granularity.
pub fn host_device() -> Arc<HostDevice> {
    Arc::new(HostDevice::with_config(HostConfig::default()))
}

/// The pool configuration of every tidepool allocator of the benches (the
/// default one: capture check on, 256 MiB stream caches, threshold max).
pub fn tidepool_config() -> PoolConfig {
    PoolConfig::default()
}

// ---------------------------------------------------------------------------
// allocators

/// An allocator under test. Errors panic (a bench has no way around them).
pub trait BenchAlloc: Send + Sync {
    type Handle: Send;
    /// Backend of the device: `cuda` or `host`.
    fn backend(&self) -> &'static str;
    /// Name in reports.
    fn name(&self) -> &'static str;
    fn device(&self) -> Arc<dyn Device>;
    fn alloc(&self, size: usize, stream: Stream) -> Self::Handle;
    fn free(&self, h: Self::Handle, stream: Stream);
    /// Address of an allocation.
    fn ptr(h: &Self::Handle) -> DevicePtr;
    /// Whether the bench synchronises the stream after each pair (the
    /// driver pool with release threshold 0, the driver's default: every sync gives memory back).
    fn sync_each_pair(&self) -> bool {
        false
    }
    /// Synchronise `stream` on the device.
    fn sync(&self, stream: Stream) {
        self.device()
            .synchronize_stream(stream)
            .expect("synchronize stream");
    }
}

/// tidepool's `MemPool` on any backend.
pub struct Tidepool<D: Device> {
    pub pool: MemPool<D>,
    pub name: &'static str,
}

impl<D: Device> Tidepool<D> {
    pub fn new(device: Arc<D>) -> Self {
        Self::with_config(device, tidepool_config(), "tidepool")
    }

    /// The default configuration with the per-call capture check off
    /// (`tidepool-nocheck`): shows what `is_capturing` costs.
    pub fn nocheck(device: Arc<D>) -> Self {
        let mut config = tidepool_config();
        config.check_capture = false;
        Self::with_config(device, config, "tidepool-nocheck")
    }

    pub fn with_config(device: Arc<D>, config: PoolConfig, name: &'static str) -> Self {
        Tidepool {
            pool: MemPool::new(device, config).expect("create tidepool pool"),
            name,
        }
    }
}

impl<D: Device> BenchAlloc for Tidepool<D> {
    type Handle = Allocation;
    fn backend(&self) -> &'static str {
        self.pool.device().backend_name()
    }
    fn name(&self) -> &'static str {
        self.name
    }
    fn device(&self) -> Arc<dyn Device> {
        self.pool.device().clone()
    }
    #[inline]
    fn alloc(&self, size: usize, stream: Stream) -> Allocation {
        self.pool
            .alloc_async(size, stream)
            .expect("tidepool alloc_async")
    }
    #[inline]
    fn free(&self, h: Allocation, stream: Stream) {
        if let Err(e) = self.pool.free_async(h, stream) {
            panic!("tidepool free_async: {}", e.error);
        }
    }
    fn ptr(h: &Allocation) -> DevicePtr {
        h.ptr()
    }
}

/// A fresh explicit driver pool (`cuMemPoolCreate`).
pub struct Driver {
    pub pool: DriverPool,
    pub dev: Arc<CudaDevice>,
    /// Release threshold 0 and a stream sync after each pair.
    pub sync_each: bool,
}

impl Driver {
    /// Release threshold max (`driver-pool`).
    pub fn new(dev: Arc<CudaDevice>) -> Self {
        Driver {
            pool: DriverPool::new(&dev, u64::MAX).expect("create driver pool"),
            dev,
            sync_each: false,
        }
    }

    /// Release threshold 0, a stream sync per pair (`driver-pool-t0-sync`).
    pub fn threshold_zero(dev: Arc<CudaDevice>) -> Self {
        Driver {
            pool: DriverPool::new(&dev, 0).expect("create driver pool"),
            dev,
            sync_each: true,
        }
    }
}

impl BenchAlloc for Driver {
    type Handle = DevicePtr;
    fn backend(&self) -> &'static str {
        "cuda"
    }
    fn name(&self) -> &'static str {
        if self.sync_each {
            "driver-pool-t0-sync"
        } else {
            "driver-pool"
        }
    }
    fn device(&self) -> Arc<dyn Device> {
        self.dev.clone()
    }
    #[inline]
    fn alloc(&self, size: usize, stream: Stream) -> DevicePtr {
        self.pool
            .alloc_async(size, stream)
            .expect("cuMemAllocFromPoolAsync")
    }
    #[inline]
    fn free(&self, h: DevicePtr, stream: Stream) {
        self.pool.free_async(h, stream).expect("cuMemFreeAsync")
    }
    fn ptr(h: &DevicePtr) -> DevicePtr {
        *h
    }
    fn sync_each_pair(&self) -> bool {
        self.sync_each
    }
}

/// `cuMemAlloc`/`cuMemFree` (the stream is ignored; `cuMemFree`
/// synchronises the device).
pub struct CuMem {
    pub dev: Arc<CudaDevice>,
}

impl BenchAlloc for CuMem {
    type Handle = DevicePtr;
    fn backend(&self) -> &'static str {
        "cuda"
    }
    fn name(&self) -> &'static str {
        "cuMemAlloc"
    }
    fn device(&self) -> Arc<dyn Device> {
        self.dev.clone()
    }
    #[inline]
    fn alloc(&self, size: usize, _stream: Stream) -> DevicePtr {
        baseline::mem_alloc(&self.dev, size).expect("cuMemAlloc")
    }
    #[inline]
    fn free(&self, h: DevicePtr, _stream: Stream) {
        baseline::mem_free(&self.dev, h).expect("cuMemFree")
    }
    fn ptr(h: &DevicePtr) -> DevicePtr {
        *h
    }
}

/// Streams created for a bench, destroyed (after their work) on drop.
pub struct BenchStreams {
    pub device: Arc<dyn Device>,
    pub streams: Vec<Stream>,
}

impl BenchStreams {
    /// `n` new streams on `device`. Create them before the allocator, so
    /// that the allocator (declared later) is dropped first.
    pub fn new(device: Arc<dyn Device>, n: usize) -> Self {
        let streams = (0..n)
            .map(|_| device.create_stream().expect("create stream"))
            .collect();
        BenchStreams { device, streams }
    }
}

impl Drop for BenchStreams {
    fn drop(&mut self) {
        for &s in &self.streams {
            let _ = self.device.synchronize_stream(s);
            let _ = self.device.destroy_stream(s);
        }
    }
}
