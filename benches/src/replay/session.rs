//! A replay session: which backend, which allocators, how many passes; runs
//! them over a parsed trace and hands back one [`Record`] per pass.

use super::allocators;
use super::lag::{LagClock, Lagged};
use super::plot::{Panel, Series};
use super::report::{self, Record};
use super::run::{PassOptions, PassResult, ReplayAllocator, ReplayError, Replayer};
use super::tidepool_alloc::TidepoolAlloc;
use super::trace::Trace;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use tidepool_sys::host::{HostConfig, HostDevice};

/// Where the memory comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// `tidepool_sys::host::HostDevice` (no GPU needed).
    Host,
    /// `tidepool_sys::cuda::CudaDevice`, device 0.
    Cuda,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Host => "host",
            Backend::Cuda => "cuda",
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which allocator a trace is replayed through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllocatorKind {
    /// tidepool's `MemPool` on the backend's device.
    Tidepool,
    /// A fresh explicit driver pool (`cuMemPoolCreate`, release threshold
    /// max); CUDA only.
    DriverPool,
    /// `cuMemAlloc`/`cuMemFree`, no pool; CUDA only.
    CuMemAlloc,
    /// A reference over no memory at all: reserved is exactly live. Measures
    /// the harness's own cost per operation; any backend.
    Ideal,
}

impl AllocatorKind {
    pub const ALL: [AllocatorKind; 4] = [
        AllocatorKind::Tidepool,
        AllocatorKind::DriverPool,
        AllocatorKind::CuMemAlloc,
        AllocatorKind::Ideal,
    ];

    /// The name in reports and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            AllocatorKind::Tidepool => "tidepool",
            AllocatorKind::DriverPool => "driver-pool",
            AllocatorKind::CuMemAlloc => "cuMemAlloc",
            AllocatorKind::Ideal => "ideal",
        }
    }

    /// Whether the allocator exists on the backend.
    pub fn available_on(self, backend: Backend) -> bool {
        match self {
            AllocatorKind::Tidepool | AllocatorKind::Ideal => true,
            AllocatorKind::DriverPool | AllocatorKind::CuMemAlloc => backend == Backend::Cuda,
        }
    }

    /// A remark printed with the allocator's rows, where its ratio holds
    /// by construction.
    pub fn note(self) -> Option<&'static str> {
        match self {
            AllocatorKind::CuMemAlloc => Some(
                "cuMemAlloc has no pool: reserved is the sum of live allocations, so its ratio is 1.0 by construction",
            ),
            AllocatorKind::Ideal => Some(
                "ideal is a reference that allocates nothing: reserved = live, ratio 1.0 by construction; its ops/s is the harness's own ceiling",
            ),
            _ => None,
        }
    }
}

impl fmt::Display for AllocatorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for AllocatorKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        AllocatorKind::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                let names: Vec<_> = AllocatorKind::ALL.iter().map(|k| k.name()).collect();
                format!("unknown allocator `{s}` (known: {})", names.join(", "))
            })
    }
}

/// How to replay.
#[derive(Debug, Clone, Copy)]
pub struct SessionOptions {
    pub backend: Backend,
    /// Passes per allocator (1: fresh only; later passes are warm).
    pub passes: u32,
    /// Host backend capacity in bytes (`None`: the backend's default).
    pub host_capacity: Option<usize>,
    /// Samples of reserved bytes per pass for a plot (0: none).
    pub samples_per_pass: usize,
    /// Operations between progress callbacks (0: none).
    pub progress_every: usize,
    /// tidepool's largest physical unit in bytes
    /// ([`tidepool::PoolConfig::max_unit_size`]; `None`: the default).
    pub max_unit_size: Option<usize>,
    /// tidepool's smallest block that gets units
    /// ([`tidepool::PoolConfig::unit_min_block`]; `None`: the default).
    pub unit_min_block: Option<usize>,
    /// tidepool's virtual reservation in bytes
    /// ([`tidepool::PoolConfig::va_size`]; `None`: the default).
    pub va_size: Option<usize>,
    /// Completion lag, in trace operations, of the host backend's work
    /// under tidepool ([`super::lag::Lagged`]; 0: none).
    pub lag: u64,
    /// tidepool's strict capture check ([`tidepool::PoolConfig::check_capture`];
    /// `false`: announced mode).
    pub check_capture: bool,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            backend: Backend::Host,
            passes: 1,
            host_capacity: None,
            samples_per_pass: 0,
            progress_every: 0,
            max_unit_size: None,
            unit_min_block: None,
            va_size: None,
            check_capture: true,
            lag: 0,
        }
    }
}

/// Replay `trace` through a fresh `kind` allocator, `opts.passes` times.
/// `on_record` sees each pass's record as soon as it is done;
/// `progress` sees the operations done so far in the current pass.
pub fn replay(
    trace: &Trace,
    kind: AllocatorKind,
    opts: &SessionOptions,
    on_record: &mut dyn FnMut(&Record),
    progress: &mut dyn FnMut(usize),
) -> Result<Vec<Record>, ReplayError> {
    replay_interleaved(trace, &[kind], opts, on_record, progress)
}

/// Replay `trace` through a fresh allocator of each of `kinds`, taking
/// turns pass by pass: pass 1 of every allocator, then pass 2 of every
/// allocator, and so on. Each allocator's passes are the same as in a
/// [`replay`] of its own (its own replayer, warm from its own previous
/// pass); only the order in time differs. A machine whose speed drifts
/// during a run (clocks, other tenants) then slows the passes that are
/// compared with each other alike, where allocators replayed one after
/// the other would each meet a different part of the drift. Records come
/// in the order the passes ran.
pub fn replay_interleaved(
    trace: &Trace,
    kinds: &[AllocatorKind],
    opts: &SessionOptions,
    on_record: &mut dyn FnMut(&Record),
    progress: &mut dyn FnMut(usize),
) -> Result<Vec<Record>, ReplayError> {
    let mut runners = Vec::with_capacity(kinds.len());
    for &kind in kinds {
        runners.push((kind, start(trace, kind, opts)?));
    }
    let pass_opts = PassOptions {
        sample_every: if opts.samples_per_pass > 0 {
            trace.ops.len().div_ceil(opts.samples_per_pass).max(1)
        } else {
            0
        },
        progress_every: opts.progress_every,
    };
    let mut out = Vec::new();
    for _ in 0..opts.passes.max(1) {
        for (kind, runner) in &mut runners {
            let r = runner.next_pass(pass_opts, &mut *progress)?;
            let rec = record(trace, opts, *kind, r);
            on_record(&rec);
            out.push(rec);
        }
    }
    Ok(out)
}

/// One allocator's replayer with the allocator's type erased, so that the
/// replayers of several allocators can take turns. Each pass still runs
/// the replayer's own loop, compiled for its allocator.
trait PassRunner {
    fn next_pass(
        &mut self,
        opts: PassOptions,
        progress: &mut dyn FnMut(usize),
    ) -> Result<PassResult, ReplayError>;
}

impl<A: ReplayAllocator> PassRunner for Replayer<'_, A> {
    fn next_pass(
        &mut self,
        opts: PassOptions,
        progress: &mut dyn FnMut(usize),
    ) -> Result<PassResult, ReplayError> {
        self.pass(opts, progress)
    }
}

/// A fresh `kind` allocator on the session's backend, ready to replay
/// `trace`.
fn start<'t>(
    trace: &'t Trace,
    kind: AllocatorKind,
    opts: &SessionOptions,
) -> Result<Box<dyn PassRunner + 't>, ReplayError> {
    if !kind.available_on(opts.backend) {
        return Err(ReplayError(format!(
            "allocator {kind} needs the cuda backend (this run uses {})",
            opts.backend
        )));
    }
    fn boxed<'t, A: ReplayAllocator + 't>(alloc: A, trace: &'t Trace) -> Box<dyn PassRunner + 't> {
        Box::new(Replayer::new(alloc, trace))
    }
    let streams = trace.streams.len();
    let mut pool_config = tidepool::PoolConfig::default();
    if let Some(bytes) = opts.max_unit_size {
        pool_config = pool_config.with_max_unit_size(bytes);
    }
    if let Some(bytes) = opts.unit_min_block {
        pool_config = pool_config.with_unit_min_block(bytes);
    }
    if !opts.check_capture {
        pool_config = pool_config.with_check_capture(false);
    }
    if let Some(bytes) = opts.va_size {
        pool_config = pool_config.with_va_size(bytes);
    }
    Ok(match (kind, opts.backend) {
        (AllocatorKind::Ideal, _) => boxed(allocators::IdealAllocator::new(u64::MAX, 1), trace),
        (AllocatorKind::Tidepool, Backend::Host) => {
            let config = match opts.host_capacity {
                Some(capacity) => HostConfig {
                    capacity,
                    ..HostConfig::default()
                },
                None => HostConfig::default(),
            };
            let dev = Arc::new(HostDevice::with_config(config));
            if opts.lag > 0 {
                let clock = Arc::new(LagClock::new());
                let dev = Arc::new(Lagged::new(dev, clock.clone(), opts.lag));
                boxed(
                    TidepoolAlloc::with_lag_clock(dev, streams, pool_config, clock)?,
                    trace,
                )
            } else {
                boxed(
                    TidepoolAlloc::with_config(dev, streams, pool_config)?,
                    trace,
                )
            }
        }
        (AllocatorKind::Tidepool, Backend::Cuda) => {
            let dev = Arc::new(allocators::cuda_device()?);
            boxed(
                TidepoolAlloc::with_config(dev, streams, pool_config)?,
                trace,
            )
        }
        (AllocatorKind::DriverPool, Backend::Cuda) => {
            let dev = allocators::cuda_device()?;
            boxed(allocators::DriverPoolAlloc::new(&dev, streams)?, trace)
        }
        (AllocatorKind::CuMemAlloc, Backend::Cuda) => {
            let dev = allocators::cuda_device()?;
            boxed(allocators::CuMemAlloc::new(&dev), trace)
        }
        (AllocatorKind::DriverPool | AllocatorKind::CuMemAlloc, Backend::Host) => {
            return Err(ReplayError(format!(
                "allocator {kind} needs the cuda backend"
            )))
        }
    })
}

fn record(trace: &Trace, opts: &SessionOptions, kind: AllocatorKind, r: PassResult) -> Record {
    Record {
        trace: trace.name.clone(),
        backend: opts.backend.name().to_string(),
        allocator: kind.name().to_string(),
        result: r,
        lag: (opts.lag > 0 && kind == AllocatorKind::Tidepool).then_some(opts.lag),
        announced_capture: !opts.check_capture && kind == AllocatorKind::Tidepool,
        note: kind.note().map(str::to_string),
    }
}

/// The plot panel of one trace from the records of its replays: the live
/// bytes the trace asks for and each allocator's reserved bytes, passes one
/// after the other on the x axis.
///
/// Both lines are envelopes, so that no peak is lost between two points:
/// live bytes are the lowest and highest value of each run of operations
/// (computed from the trace, exact), reserved bytes are each sample's
/// high-water mark (the highest value since the previous sample) followed
/// by the value at the sample. The highest point of each line is therefore
/// the peak the title states.
pub fn panel(trace: &Trace, records: &[Record]) -> Panel {
    let n = trace.ops.len();
    let mut reserved = Vec::new();
    let mut live_points = Vec::new();
    let mut passes_drawn = 0;
    let mut allocators: Vec<&str> = Vec::new();
    for r in records {
        if !allocators.contains(&r.allocator.as_str()) {
            allocators.push(&r.allocator);
        }
    }
    let mut peaks = Vec::new();
    for name in allocators {
        let mut points = Vec::new();
        let mut peak = 0u64;
        for r in records.iter().filter(|r| r.allocator == name) {
            let base = (r.result.pass as usize - 1) * n;
            peak = peak.max(r.result.peak_reserved_bytes);
            let mut prev_op = 0usize;
            for (k, s) in r.result.samples.iter().enumerate() {
                if k > 0 && s.reserved_high_bytes != s.reserved_bytes {
                    // The high-water mark, midway through its interval.
                    let mid = (prev_op + s.op) as f64 / 2.0;
                    points.push((base as f64 + mid, s.reserved_high_bytes as f64));
                }
                points.push(((base + s.op) as f64, s.reserved_bytes as f64));
                prev_op = s.op;
            }
            if passes_drawn < r.result.pass as usize {
                // The live envelope of this pass, as fine as the samples.
                let buckets = r.result.samples.len().saturating_sub(1).max(1);
                live_points.extend(
                    trace
                        .live_envelope(buckets)
                        .into_iter()
                        .map(|(op, live)| ((base + op) as f64, live as f64)),
                );
                passes_drawn = r.result.pass as usize;
            }
        }
        peaks.push(format!("{name} {}", report::mib(peak)));
        reserved.push(Series {
            label: format!("{name} reserved"),
            points,
        });
    }
    Panel {
        title: format!(
            "{} ({} ops): peak live {} MiB; peak reserved MiB: {}",
            trace.name,
            n,
            report::mib(trace.peak_live_bytes),
            peaks.join(", ")
        ),
        live: Series {
            label: "live (trace)".into(),
            points: live_points,
        },
        reserved,
    }
}

/// Parse a byte count with an optional binary suffix: `17179869184`,
/// `16G`, `16GiB`, `512M`, `64k`, `1T` (K/M/G/T = powers of 1024).
pub fn parse_bytes(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let lower = t.to_ascii_lowercase();
    let stripped = lower
        .strip_suffix("ib")
        .or_else(|| lower.strip_suffix('b'))
        .unwrap_or(&lower);
    let (digits, shift) = match stripped.chars().last() {
        Some('k') => (&stripped[..stripped.len() - 1], 10),
        Some('m') => (&stripped[..stripped.len() - 1], 20),
        Some('g') => (&stripped[..stripped.len() - 1], 30),
        Some('t') => (&stripped[..stripped.len() - 1], 40),
        _ => (stripped, 0),
    };
    let bad = || format!("`{s}` is not a byte count (examples: 17179869184, 16G, 512M)");
    let n: usize = digits
        .trim()
        .parse()
        .map_err(|e: std::num::ParseIntError| {
            if *e.kind() == std::num::IntErrorKind::PosOverflow {
                format!("`{s}` is more bytes than this machine can address")
            } else {
                bad()
            }
        })?;
    n.checked_mul(1usize << shift)
        .ok_or_else(|| format!("`{s}` is more bytes than this machine can address"))
}

pub use super::allocators::cuda_available;
