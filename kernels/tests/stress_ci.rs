//! The stress harness on the host backend, sized for CI (a debug build on a
//! 2-core machine: about 20 s for the whole file). The work is bounded by
//! operation counts, never by time: every planned operation runs, however
//! loaded the machine is, and no assertion depends on its speed.
//!
//! - `stress_all_phases`: every reuse switch on, then each off in turn
//!   (switched at run time, with allocations live across the switch), with
//!   trims, synchronisations and a release threshold.
//! - `stress_without_<switch>`: the same harness with one switch off for
//!   the whole run.
//! - `soak`: ignored unless `TIDEPOOL_SOAK=1` (1,000,000 operations by
//!   default) or `TIDEPOOL_SOAK_OPS=N` is set; `TIDEPOOL_SOAK_SEED`,
//!   `TIDEPOOL_SOAK_THREADS`, `TIDEPOOL_SOAK_STREAMS`,
//!   `TIDEPOOL_SOAK_MAX_SIZE` adjust it. Run it in release:
//!   `TIDEPOOL_SOAK=1 cargo test --release -p tidepool-kernels --test stress_ci soak -- --nocapture`.
#![forbid(unsafe_code)]

use std::sync::Arc;

use tidepool::{MemPool, PoolConfig, ReusePolicy};
use tidepool_kernels::host::HostKernels;
use tidepool_kernels::stress::{all_on, policy_name, run_stress, StressConfig, StressReport};
use tidepool_sys::host::{HostConfig, HostDevice};
use tidepool_sys::{Device, Stream};

/// Streams of the CI runs.
const STREAMS: usize = 6;

/// A host device, a pool on it, its kernels and `streams` streams; the
/// harness on them; the report, printed.
fn run_host(cfg: &StressConfig, streams: usize, pool_config: PoolConfig) -> StressReport {
    let dev = Arc::new(HostDevice::with_config(HostConfig {
        capacity: 2 << 30,
        ..Default::default()
    }));
    let pool = MemPool::new(dev.clone(), pool_config).expect("pool");
    let kernels = HostKernels::new(dev.clone());
    let streams: Vec<Stream> = (0..streams)
        .map(|_| dev.create_stream().expect("create_stream"))
        .collect();
    let report = run_stress(&pool, &kernels, &streams, cfg).expect("stress harness");
    eprintln!("{report}");
    eprintln!("{}", report.to_json());
    drop(pool);
    for s in streams {
        dev.destroy_stream(s).expect("destroy_stream");
    }
    report
}

/// The CI pool: 1 GiB of address space, a 16 MiB cap (so that remapping
/// and the internal dependencies are exercised), a small stream cache.
fn ci_pool() -> PoolConfig {
    PoolConfig::default()
        .with_va_size(1 << 30)
        .with_max_size(16 << 20)
        .with_stream_cache_bytes(4 << 20)
}

fn check(report: &StressReport, planned: u64) {
    assert_eq!(
        report.mismatches, 0,
        "the pool handed memory to overlapping work: {report}"
    );
    assert_eq!(
        report.access_faults, 0,
        "a kernel touched memory the pool had unmapped: {report}"
    );
    assert!(
        !report.stopped_early && report.ops == planned,
        "{} of the {planned} planned operations ran: {report}",
        report.ops
    );
    assert_eq!(report.stats.used_current, 0, "every allocation was freed");
}

fn ci_config(seed: u64, ops: u64) -> StressConfig {
    StressConfig {
        seed,
        ops,
        time_limit: None,
        ..StressConfig::host_ci()
    }
}

#[test]
fn stress_all_phases() {
    let cfg = ci_config(0x5EED_0001, 40_000);
    let r = run_host(&cfg, STREAMS, ci_pool());
    check(&r, cfg.ops);
    assert_eq!(r.phases, 5, "all five phases ran");
    assert!(r.cross_stream_frees > 0 && r.chains > 0 && r.declared_uses > 0);
    assert!(r.trims > 0 && r.syncs > 0);
}

fn one_switch_off(seed: u64, off: impl Fn(&mut ReusePolicy)) {
    let mut policy = all_on();
    off(&mut policy);
    eprintln!("policy: {}", policy_name(&policy));
    let cfg = StressConfig {
        phases: vec![policy],
        ..ci_config(seed, 12_000)
    };
    let r = run_host(&cfg, STREAMS, ci_pool());
    check(&r, cfg.ops);
}

#[test]
fn stress_without_follow_event_dependencies() {
    one_switch_off(0x5EED_0002, |p| p.follow_event_dependencies = false);
}

#[test]
fn stress_without_opportunistic() {
    one_switch_off(0x5EED_0003, |p| p.opportunistic = false);
}

#[test]
fn stress_without_internal_dependencies() {
    one_switch_off(0x5EED_0004, |p| p.internal_dependencies = false);
}

#[test]
fn stress_without_wait_for_pending_frees() {
    one_switch_off(0x5EED_0005, |p| p.wait_for_pending_frees = false);
}

fn env<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// The environment-gated soak (see the file's documentation).
#[test]
fn soak() {
    let ops: Option<u64> = env("TIDEPOOL_SOAK_OPS");
    let on = std::env::var("TIDEPOOL_SOAK").as_deref() == Ok("1");
    let Some(ops) = ops.or(on.then_some(1_000_000)) else {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr().lock(),
            "SKIP soak: set TIDEPOOL_SOAK=1 or TIDEPOOL_SOAK_OPS=N to run it"
        );
        return;
    };
    let cfg = StressConfig {
        seed: env("TIDEPOOL_SOAK_SEED").unwrap_or(0x50A4),
        ops,
        threads: env("TIDEPOOL_SOAK_THREADS").unwrap_or(4),
        max_size: env("TIDEPOOL_SOAK_MAX_SIZE").unwrap_or(4 << 20),
        ..StressConfig::host_ci()
    };
    let streams = env("TIDEPOOL_SOAK_STREAMS").unwrap_or(8);
    let pool = PoolConfig::default()
        .with_va_size(8 << 30)
        .with_max_size(512 << 20)
        .with_stream_cache_bytes(16 << 20);
    let r = run_host(&cfg, streams, pool);
    check(&r, ops);
}
