//! tidepool-soak: the stream-order stress harness as a long run, on the host
//! backend or on a CUDA GPU.
//!
//! Prints one line of JSON (the [`StressReport`] and the pool's statistics)
//! to stdout, and to `--out FILE` when given. Exit status: 0 when the run
//! found no mismatch and no access fault, 1 when it found any, 2 when it
//! could not run (bad arguments, no device, a failing pool or kernel call, or
//! no allocation succeeded).
//! `RUST_LOG=debug` shows the pool's and the harness's events on stderr.
//!
//! ```text
//! tidepool-soak --backend cuda --ops 1000000 --threads 8 --streams 16
//! compute-sanitizer --tool memcheck tidepool-soak --backend cuda --ops 20000 \
//!     --threads 4 --streams 8 --max-size 8M --max-pool 64M --trim-every 200 \
//!     --sync-every 500 --release-threshold 16M
//! ```
#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use serde::Serialize;
use tidepool::{MemPool, PoolConfig, PoolStats, ReusePolicy};
use tidepool_kernels::stress::{
    all_on, policy_name, run_stress, standard_phases, StressConfig, StressReport,
};
use tidepool_kernels::{TagKernels, WithTagKernels};
use tidepool_sys::{Device, Stream};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum BackendArg {
    Host,
    Cuda,
}

const AFTER_HELP: &str = "\
Sizes accept K, M, G, T suffixes (powers of 1024); counts accept 0x hex and _.
A run in which no allocation succeeded (a pool cap or host capacity below
one page) tested nothing: it exits 2.

PHASES
  'standard' runs all reuse switches on, then each switch off in turn;
  'all-on' only that; or a comma-separated list among all-on, no-follow,
  no-opportunistic, no-internal, no-wait-pending.

EXIT STATUS
  0 clean; 1 mismatching words or access faults found; 2 could not run, or
  allocated nothing.

LOGGING
  RUST_LOG=debug (or e.g. RUST_LOG=tidepool=trace) prints events on stderr;
  see docs/logging.md.";

/// Stream-order stress of the tidepool pool, verified by tag kernels: many
/// threads allocate, fill, hand over between streams and free, and every
/// word is checked.
#[derive(Debug, Parser)]
#[command(name = "tidepool-soak", version, after_long_help = AFTER_HELP)]
struct Args {
    /// Device backend.
    #[arg(long, value_enum, default_value = "host")]
    backend: BackendArg,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: i32,
    /// Operations over all threads.
    #[arg(long, default_value = "100000", value_parser = parse_positive)]
    ops: u64,
    /// Host threads.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..))]
    threads: u64,
    /// Streams.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..))]
    streams: u64,
    /// Smallest allocation in bytes.
    #[arg(long, value_name = "BYTES", default_value = "256", value_parser = parse_positive_size)]
    min_size: u64,
    /// Largest allocation in bytes [default: 64M on cuda, 4M on host].
    #[arg(long, value_name = "BYTES", value_parser = parse_size)]
    max_size: Option<u64>,
    /// Live allocations per thread.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..))]
    max_live: u64,
    /// Seed of the pseudo-random operation sequence.
    #[arg(long, default_value = "0x7D1E9001", value_parser = parse_u64)]
    seed: u64,
    /// Trim every N operations (0: never).
    #[arg(long, value_name = "N", default_value = "5000", value_parser = parse_u64)]
    trim_every: u64,
    /// Synchronise every N operations (0: never).
    #[arg(long, value_name = "N", default_value = "20000", value_parser = parse_u64)]
    sync_every: u64,
    /// Release threshold during the run, or 'keep' for the pool's own.
    #[arg(long, value_name = "BYTES|keep", default_value = "1G", value_parser = parse_threshold)]
    release_threshold: Threshold,
    /// Cap of the pool's physical memory (forces remapping, internal
    /// dependencies and out-of-memory retries).
    #[arg(long, value_name = "BYTES", value_parser = parse_positive_size)]
    max_pool: Option<u64>,
    /// Pool page size [default: the device's granularity].
    #[arg(long, value_name = "BYTES", default_value = "0", value_parser = parse_size, hide_default_value = true)]
    page_size: u64,
    /// Address space to reserve [default: 64G on cuda, 16G on host].
    #[arg(long, value_name = "BYTES", value_parser = parse_size)]
    va_size: Option<u64>,
    /// Per-stream cache.
    #[arg(long, value_name = "BYTES", default_value = "256M", value_parser = parse_size)]
    stream_cache: u64,
    /// Longest spin before a free, in microseconds.
    #[arg(long, value_name = "US", default_value = "200", value_parser = parse_u64)]
    max_spin_us: u64,
    /// Reuse-switch phases (see PHASES below).
    #[arg(long, value_name = "LIST", default_value = "standard", value_parser = parse_phases)]
    phases: Phases,
    /// Stop gracefully after N seconds.
    #[arg(long, value_name = "N", value_parser = parse_positive)]
    time_limit_s: Option<u64>,
    /// Host backend: device memory.
    #[arg(long, value_name = "BYTES", default_value = "8G", value_parser = parse_positive_size)]
    host_capacity: u64,
    /// Also write the JSON line to FILE.
    #[arg(long, value_name = "FILE")]
    out: Option<std::path::PathBuf>,
    /// No human-readable summary on stderr.
    #[arg(long)]
    quiet: bool,
}

/// `--release-threshold`: a byte count, or the pool's own setting.
#[derive(Debug, Clone, Copy)]
struct Threshold(Option<u64>);

fn parse_threshold(s: &str) -> Result<Threshold, String> {
    if s.trim() == "keep" {
        Ok(Threshold(None))
    } else {
        parse_size(s).map(|n| Threshold(Some(n)))
    }
}

/// `--phases`: the reuse policies, one per phase.
#[derive(Debug, Clone)]
struct Phases(Vec<ReusePolicy>);

fn parse_phases(s: &str) -> Result<Phases, String> {
    match s.trim() {
        "standard" => Ok(Phases(standard_phases())),
        list => list
            .split(',')
            .map(parse_policy)
            .collect::<Result<_, _>>()
            .map(Phases),
    }
}

fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mul) = match s.chars().last() {
        Some('k' | 'K') => (&s[..s.len() - 1], 1u64 << 10),
        Some('m' | 'M') => (&s[..s.len() - 1], 1 << 20),
        Some('g' | 'G') => (&s[..s.len() - 1], 1 << 30),
        Some('t' | 'T') => (&s[..s.len() - 1], 1 << 40),
        _ => (s, 1),
    };
    let n = parse_u64(num)?;
    n.checked_mul(mul)
        .ok_or_else(|| format!("size {s} overflows"))
}

/// A count that must be at least 1 (0 would make the run test nothing).
fn parse_positive(s: &str) -> Result<u64, String> {
    match parse_u64(s)? {
        0 => Err("must be at least 1".into()),
        n => Ok(n),
    }
}

/// A size that must be at least 1 byte.
fn parse_positive_size(s: &str) -> Result<u64, String> {
    match parse_size(s)? {
        0 => Err("must be at least 1 byte".into()),
        n => Ok(n),
    }
}

/// Check, before the run, that `path` can be written: it is not a
/// directory and its directory accepts the file. An existing file is
/// opened without truncating it; a new one is removed again, so a run that
/// then fails leaves nothing behind.
fn check_out_path(path: &std::path::Path) -> Result<(), String> {
    if path.is_dir() {
        return Err(format!(
            "--out {}: is a directory; name a file",
            path.display()
        ));
    }
    let probe = if path.exists() {
        std::fs::OpenOptions::new()
            .append(true)
            .open(path)
            .map(|_| ())
    } else {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
            .and_then(|_| std::fs::remove_file(path))
    };
    probe.map_err(|e| {
        format!(
            "--out {}: cannot be written ({e}); name a file in an existing directory you can \
             write to",
            path.display()
        )
    })
}

fn parse_u64(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let r = if let Some(hex) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        u64::from_str_radix(hex, 16)
    } else {
        s.replace('_', "").parse()
    };
    r.map_err(|e| format!("'{s}' is not a number: {e}"))
}

fn parse_policy(name: &str) -> Result<ReusePolicy, String> {
    let on = all_on();
    Ok(match name.trim() {
        "all-on" => on,
        "no-follow" => ReusePolicy {
            follow_event_dependencies: false,
            ..on
        },
        "no-opportunistic" => ReusePolicy {
            opportunistic: false,
            ..on
        },
        "no-internal" => ReusePolicy {
            internal_dependencies: false,
            ..on
        },
        "no-wait-pending" => ReusePolicy {
            wait_for_pending_frees: false,
            ..on
        },
        other => return Err(format!("unknown policy '{other}'")),
    })
}

/// The run's configuration from the arguments (the backend decides the
/// default largest allocation).
fn stress_config(a: &Args) -> StressConfig {
    let max_size = a.max_size.unwrap_or(match a.backend {
        BackendArg::Cuda => 64 << 20,
        BackendArg::Host => 4 << 20,
    });
    StressConfig {
        ops: a.ops,
        threads: a.threads as usize,
        min_size: a.min_size as usize,
        max_size: max_size as usize,
        max_live_per_thread: a.max_live as usize,
        seed: a.seed,
        trim_every: a.trim_every,
        sync_every: a.sync_every,
        release_threshold: a.release_threshold.0,
        max_spin_ns: a.max_spin_us.saturating_mul(1000),
        phases: a.phases.0.clone(),
        time_limit: a.time_limit_s.map(Duration::from_secs),
        ..StressConfig::default()
    }
}

/// The JSON line: the report's counters, then the pool's statistics.
#[derive(Serialize)]
struct JsonReport<'a> {
    backend: &'a str,
    passed: bool,
    seed: u64,
    threads: usize,
    streams: usize,
    ops: u64,
    allocs: u64,
    frees: u64,
    cross_stream_frees: u64,
    chains: u64,
    declared_uses: u64,
    waits: u64,
    spins: u64,
    verifies: u64,
    ooms: u64,
    trims: u64,
    syncs: u64,
    bytes_allocated: u64,
    largest_alloc: u64,
    phases: u64,
    mismatches: u64,
    access_faults: u64,
    wall_s: f64,
    stopped_early: bool,
    pool: &'a PoolStats,
}

fn to_json(r: &StressReport) -> String {
    let j = JsonReport {
        backend: r.backend,
        passed: r.passed(),
        seed: r.seed,
        threads: r.threads,
        streams: r.streams,
        ops: r.ops,
        allocs: r.allocs,
        frees: r.frees,
        cross_stream_frees: r.cross_stream_frees,
        chains: r.chains,
        declared_uses: r.declared_uses,
        waits: r.waits,
        spins: r.spins,
        verifies: r.verifies,
        ooms: r.ooms,
        trims: r.trims,
        syncs: r.syncs,
        bytes_allocated: r.bytes_allocated,
        largest_alloc: r.largest_alloc,
        phases: r.phases,
        mismatches: r.mismatches,
        access_faults: r.access_faults,
        wall_s: r.wall.as_secs_f64(),
        stopped_early: r.stopped_early,
        pool: &r.stats,
    };
    // Plain numbers, strings and booleans: serialising cannot fail.
    serde_json::to_string(&j).unwrap_or_default()
}

/// Events on stderr, filtered by `RUST_LOG` (default: warnings and errors).
fn init_logging() {
    let filter = match std::env::var("RUST_LOG") {
        Ok(spec) if !spec.trim().is_empty() => {
            tracing_subscriber::EnvFilter::try_new(&spec).unwrap_or_else(|e| {
                eprintln!(
                    "tidepool-soak: warning: RUST_LOG={spec:?} is not a valid filter ({e}); showing \
                     warnings and errors only (examples: RUST_LOG=debug, RUST_LOG=tidepool=trace)"
                );
                tracing_subscriber::EnvFilter::new("warn")
            })
        }
        _ => tracing_subscriber::EnvFilter::new("warn"),
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

fn run_on<D: Device + WithTagKernels>(
    dev: Arc<D>,
    args: &Args,
    cfg: &StressConfig,
) -> Result<StressReport, String> {
    let kernels: Arc<dyn TagKernels> = dev
        .clone()
        .tag_kernels()
        .map_err(|e| format!("tag kernels: {e}"))?;
    let default_va = if dev.backend_name() == "cuda" {
        64usize << 30
    } else {
        16 << 30
    };
    let mut config = PoolConfig::default()
        .with_va_size(args.va_size.map_or(default_va, |v| v as usize))
        .with_page_size(args.page_size as usize)
        .with_stream_cache_bytes(args.stream_cache as usize);
    if let Some(cap) = args.max_pool {
        config = config.with_max_size(cap);
    }
    let pool = MemPool::new(dev.clone(), config).map_err(|e| format!("creating the pool: {e}"))?;
    let streams: Vec<Stream> = (0..args.streams as usize)
        .map(|_| dev.create_stream())
        .collect::<Result<_, _>>()
        .map_err(|e| format!("creating streams: {e}"))?;
    if !args.quiet {
        eprintln!(
            "tidepool-soak: {} ops on {} ({} threads x {} streams, sizes {}..{} B, pool cap {}, \
             phases {})",
            cfg.ops,
            dev.backend_name(),
            cfg.threads,
            args.streams,
            cfg.min_size,
            cfg.max_size,
            args.max_pool
                .map_or_else(|| "none".to_string(), |c| format!("{c} B")),
            cfg.phases
                .iter()
                .map(policy_name)
                .collect::<Vec<_>>()
                .join(",")
        );
    }
    let report = run_stress(&pool, &*kernels, &streams, cfg).map_err(|e| e.to_string());
    drop(pool);
    for s in streams {
        if let Err(e) = dev.destroy_stream(s) {
            eprintln!("warning: destroying {s}: {e}");
        }
    }
    report
}

fn main() -> ExitCode {
    init_logging();
    let args = Args::parse();
    let cfg = stress_config(&args);
    if let Some(path) = &args.out {
        if let Err(e) = check_out_path(path) {
            eprintln!("tidepool-soak: {e}");
            return ExitCode::from(2);
        }
    }
    if cfg.min_size > cfg.max_size {
        eprintln!(
            "tidepool-soak: --min-size {} is above the largest allocation {}; lower it or raise \
             --max-size",
            cfg.min_size, cfg.max_size
        );
        return ExitCode::from(2);
    }
    if let Some(cap) = args.max_pool {
        if cap < cfg.max_size as u64 * 2 {
            eprintln!(
                "tidepool-soak: warning: --max-pool {cap} is less than twice the largest \
                 allocation {}: many allocations will end in out-of-memory (counted, then \
                 retried)",
                cfg.max_size
            );
        }
    }
    let report = match args.backend {
        BackendArg::Host => {
            let dev = Arc::new(tidepool_sys::host::HostDevice::with_config(
                tidepool_sys::host::HostConfig {
                    capacity: args.host_capacity as usize,
                    ..Default::default()
                },
            ));
            run_on(dev, &args, &cfg)
        }
        BackendArg::Cuda => {
            if !tidepool_sys::cuda::driver_available() {
                let why = tidepool_sys::cuda::driver_unavailable_reason().unwrap_or_default();
                eprintln!("tidepool-soak: no usable CUDA driver: {why}");
                return ExitCode::from(2);
            }
            match tidepool_sys::cuda::CudaDevice::new(args.device) {
                Ok(dev) => run_on(Arc::new(dev), &args, &cfg),
                Err(e) => Err(format!("opening CUDA device {}: {e}", args.device)),
            }
        }
    };
    let report = match report {
        Ok(r) => r,
        Err(e) => {
            eprintln!("tidepool-soak: {e}");
            return ExitCode::from(2);
        }
    };
    if report.allocs == 0 {
        eprintln!(
            "tidepool-soak: the run allocated nothing ({} operations, {} out-of-memory \
             failures): it tested nothing; raise --max-pool (or --host-capacity on the host \
             backend) above one page of the device",
            report.ops, report.ooms
        );
        return ExitCode::from(2);
    }
    let json = to_json(&report);
    {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        if let Err(e) = writeln!(out, "{json}").and_then(|()| out.flush()) {
            // A reader that went away (`| head -c0`) is not this run's failure.
            if e.kind() != std::io::ErrorKind::BrokenPipe {
                eprintln!("tidepool-soak: cannot write the JSON line to stdout: {e}");
                return ExitCode::from(2);
            }
        }
    }
    if let Some(path) = &args.out {
        if let Err(e) = std::fs::write(path, format!("{json}\n")) {
            eprintln!("tidepool-soak: writing {}: {e}", path.display());
            return ExitCode::from(2);
        }
    }
    if !args.quiet {
        eprintln!("{report}");
    }
    if report.passed() {
        ExitCode::SUCCESS
    } else {
        eprintln!(
            "tidepool-soak: FAILED: {} mismatching words, {} access faults",
            report.mismatches, report.access_faults
        );
        ExitCode::from(1)
    }
}
