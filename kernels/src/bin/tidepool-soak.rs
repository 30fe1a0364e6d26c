//! tidepool-soak: the stream-order stress harness as a long run, on the host
//! backend or on a CUDA GPU.
//!
//! Prints one line of JSON (the [`StressReport`]) to stdout, and to
//! `--out FILE` when given. Exit status: 0 when the run found no mismatch
//! and no access fault, 1 when it found any, 2 when it could not run
//! (bad arguments, no device, a failing pool or kernel call).
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

use tidepool::{MemPool, PoolConfig, ReusePolicy};
use tidepool_kernels::stress::{
    all_on, policy_name, run_stress, standard_phases, StressConfig, StressReport,
};
use tidepool_kernels::{TagKernels, WithTagKernels};
use tidepool_sys::{Device, Stream};

const USAGE: &str = "\
tidepool-soak: stream-order stress of the tidepool pool, verified by tag kernels

USAGE: tidepool-soak [OPTIONS]

  --backend host|cuda      device backend (default host)
  --device N               CUDA device ordinal (default 0)
  --ops N                  operations over all threads (default 100000)
  --threads N              host threads (default 4)
  --streams N              streams (default 8)
  --min-size BYTES         smallest allocation (default 256)
  --max-size BYTES         largest allocation (default 64M on cuda, 4M on host)
  --max-live N             live allocations per thread (default 16)
  --seed N                 seed (default 0x7D1E9001)
  --trim-every N           trim every N operations, 0 = never (default 5000)
  --sync-every N           synchronise every N operations, 0 = never (default 20000)
  --release-threshold B    release threshold during the run (default 1G; 'keep' = pool's)
  --max-pool BYTES         cap of the pool's physical memory (forces remapping,
                           internal dependencies and out-of-memory retries)
  --page-size BYTES        pool page size (default: device granularity)
  --va-size BYTES          address space to reserve (default 64G cuda, 16G host)
  --stream-cache BYTES     per-stream cache (default 256M)
  --max-spin-us N          longest spin before a free (default 200)
  --phases LIST            'standard' (all on, then each switch off; default),
                           'all-on', or comma-separated names among all-on,
                           no-follow, no-opportunistic, no-internal, no-wait-pending
  --time-limit-s N         stop gracefully after N seconds
  --host-capacity BYTES    host backend: device memory (default 8G)
  --out FILE               also write the JSON line to FILE
  --quiet                  no human-readable summary on stderr

Sizes accept K, M, G suffixes (powers of 1024). Exit status: 0 clean,
1 mismatches or access faults, 2 could not run.";

/// The options that take a value.
const KNOWN: &[&str] = &[
    "--backend",
    "--device",
    "--ops",
    "--threads",
    "--streams",
    "--min-size",
    "--max-size",
    "--max-live",
    "--seed",
    "--trim-every",
    "--sync-every",
    "--release-threshold",
    "--max-pool",
    "--page-size",
    "--va-size",
    "--stream-cache",
    "--max-spin-us",
    "--phases",
    "--time-limit-s",
    "--host-capacity",
    "--out",
];

#[derive(Debug)]
struct Args {
    backend: String,
    device: i32,
    cfg: StressConfig,
    max_size_set: bool,
    streams: usize,
    max_pool: Option<u64>,
    page_size: usize,
    va_size: Option<usize>,
    stream_cache: usize,
    host_capacity: usize,
    out: Option<String>,
    quiet: bool,
}

fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let (num, mul) = match s.chars().last() {
        Some('k' | 'K') => (&s[..s.len() - 1], 1u64 << 10),
        Some('m' | 'M') => (&s[..s.len() - 1], 1 << 20),
        Some('g' | 'G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    let n = parse_u64(num)?;
    n.checked_mul(mul)
        .ok_or_else(|| format!("size {s} overflows"))
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

fn parse_args(argv: Vec<String>) -> Result<Option<Args>, String> {
    let mut a = Args {
        backend: "host".into(),
        device: 0,
        cfg: StressConfig {
            ops: 100_000,
            threads: 4,
            ..StressConfig::default()
        },
        max_size_set: false,
        streams: 8,
        max_pool: None,
        page_size: 0,
        va_size: None,
        stream_cache: 256 << 20,
        host_capacity: 8 << 30,
        out: None,
        quiet: false,
    };
    let mut it = argv.into_iter();
    while let Some(flag) = it.next() {
        if flag == "-h" || flag == "--help" {
            return Ok(None);
        }
        if flag == "--quiet" {
            a.quiet = true;
            continue;
        }
        let (flag, inline) = match flag.split_once('=') {
            Some((f, v)) => (f.to_string(), Some(v.to_string())),
            None => (flag, None),
        };
        if !KNOWN.contains(&flag.as_str()) {
            return Err(format!("unknown option {flag}"));
        }
        let value = match inline {
            Some(v) => v,
            None => it.next().ok_or_else(|| format!("{flag} needs a value"))?,
        };
        let v = value.as_str();
        match flag.as_str() {
            "--backend" => a.backend = v.to_string(),
            "--device" => a.device = parse_u64(v)? as i32,
            "--ops" => a.cfg.ops = parse_u64(v)?,
            "--threads" => a.cfg.threads = parse_u64(v)? as usize,
            "--streams" => a.streams = parse_u64(v)? as usize,
            "--min-size" => a.cfg.min_size = parse_size(v)? as usize,
            "--max-size" => {
                a.cfg.max_size = parse_size(v)? as usize;
                a.max_size_set = true;
            }
            "--max-live" => a.cfg.max_live_per_thread = parse_u64(v)? as usize,
            "--seed" => a.cfg.seed = parse_u64(v)?,
            "--trim-every" => a.cfg.trim_every = parse_u64(v)?,
            "--sync-every" => a.cfg.sync_every = parse_u64(v)?,
            "--release-threshold" => {
                a.cfg.release_threshold = if v == "keep" {
                    None
                } else {
                    Some(parse_size(v)?)
                }
            }
            "--max-pool" => a.max_pool = Some(parse_size(v)?),
            "--page-size" => a.page_size = parse_size(v)? as usize,
            "--va-size" => a.va_size = Some(parse_size(v)? as usize),
            "--stream-cache" => a.stream_cache = parse_size(v)? as usize,
            "--max-spin-us" => a.cfg.max_spin_ns = parse_u64(v)?.saturating_mul(1000),
            "--phases" => {
                a.cfg.phases = match v {
                    "standard" => standard_phases(),
                    list => list
                        .split(',')
                        .map(parse_policy)
                        .collect::<Result<_, _>>()?,
                }
            }
            "--time-limit-s" => a.cfg.time_limit = Some(Duration::from_secs(parse_u64(v)?)),
            "--host-capacity" => a.host_capacity = parse_size(v)? as usize,
            "--out" => a.out = Some(v.to_string()),
            other => return Err(format!("unknown option {other}")),
        }
    }
    if !a.max_size_set && a.backend == "host" {
        a.cfg.max_size = 4 << 20;
    }
    if a.streams == 0 {
        return Err("--streams must be at least 1".into());
    }
    if let Some(cap) = a.max_pool {
        if cap < a.cfg.max_size as u64 * 2 {
            eprintln!(
                "warning: --max-pool {cap} is less than twice --max-size {}: many allocations \
                 will end in out-of-memory (counted, then retried)",
                a.cfg.max_size
            );
        }
    }
    Ok(Some(a))
}

fn run_on<D: Device + WithTagKernels>(dev: Arc<D>, args: &Args) -> Result<StressReport, String> {
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
        .with_va_size(args.va_size.unwrap_or(default_va))
        .with_page_size(args.page_size)
        .with_stream_cache_bytes(args.stream_cache);
    if let Some(cap) = args.max_pool {
        config = config.with_max_size(cap);
    }
    let pool = MemPool::new(dev.clone(), config).map_err(|e| format!("creating the pool: {e}"))?;
    let streams: Vec<Stream> = (0..args.streams)
        .map(|_| dev.create_stream())
        .collect::<Result<_, _>>()
        .map_err(|e| format!("creating streams: {e}"))?;
    if !args.quiet {
        eprintln!(
            "tidepool-soak: {} ops on {} ({} threads x {} streams, sizes {}..{} B, pool cap {}, \
             phases {})",
            args.cfg.ops,
            dev.backend_name(),
            args.cfg.threads,
            args.streams,
            args.cfg.min_size,
            args.cfg.max_size,
            args.max_pool
                .map_or_else(|| "none".to_string(), |c| format!("{c} B")),
            args.cfg
                .phases
                .iter()
                .map(policy_name)
                .collect::<Vec<_>>()
                .join(",")
        );
    }
    let report = run_stress(&pool, &*kernels, &streams, &args.cfg).map_err(|e| e.to_string());
    drop(pool);
    for s in streams {
        if let Err(e) = dev.destroy_stream(s) {
            eprintln!("warning: destroying {s}: {e}");
        }
    }
    report
}

fn main() -> ExitCode {
    let args = match parse_args(std::env::args().skip(1).collect()) {
        Ok(Some(a)) => a,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("tidepool-soak: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let report = match args.backend.as_str() {
        "host" => {
            let dev = Arc::new(tidepool_sys::host::HostDevice::with_config(
                tidepool_sys::host::HostConfig {
                    capacity: args.host_capacity,
                    ..Default::default()
                },
            ));
            run_on(dev, &args)
        }
        "cuda" => {
            if !tidepool_sys::cuda::driver_available() {
                let why = tidepool_sys::cuda::driver_unavailable_reason().unwrap_or_default();
                eprintln!("tidepool-soak: no usable CUDA driver: {why}");
                return ExitCode::from(2);
            }
            match tidepool_sys::cuda::CudaDevice::new(args.device) {
                Ok(dev) => run_on(Arc::new(dev), &args),
                Err(e) => Err(format!("opening CUDA device {}: {e}", args.device)),
            }
        }
        other => Err(format!("unknown backend '{other}' (host or cuda)")),
    };
    let report = match report {
        Ok(r) => r,
        Err(e) => {
            eprintln!("tidepool-soak: {e}");
            return ExitCode::from(2);
        }
    };
    let json = report.to_json();
    println!("{json}");
    if let Some(path) = &args.out {
        if let Err(e) = std::fs::write(path, format!("{json}\n")) {
            eprintln!("tidepool-soak: writing {path}: {e}");
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
