//! CI gate of the replay memory target: both GPT-2 traces replayed
//! through tidepool on the host backend (gpt2-fixed over four passes,
//! gpt2-varlen over three) must reach peak reserved / peak live <= 1.02 on
//! every pass with no out-of-memory.
//!
//! The trace is located at run time from `CARGO_MANIFEST_DIR` (the GPU
//! machine runs staged binaries with it set), falling back to the value
//! compiled in.

use std::path::PathBuf;
use std::sync::Arc;
use tidepool::PoolConfig;
use tidepool_benches::replay::tidepool_alloc::TidepoolAlloc;
use tidepool_benches::replay::{PassOptions, Replayer, Trace};
use tidepool_sys::host::HostDevice;

const MAX_RATIO: f64 = 1.02;

/// Most page binds (driver map calls) a warm pass of gpt2-varlen may make.
const MAX_WARM_BINDS: u64 = 50;

/// Most page binds gpt2-fixed's first warm pass may make: 476 measured on
/// the host backend (deterministic there, as on the GPU). That pass still
/// binds the windows its first steps' huge blocks keep from then on
/// (`best_window`'s `keep_ghosts`).
const MAX_FIXED_SECOND_PASS_BINDS: u64 = 520;

/// Most page binds each later warm pass of gpt2-fixed may make: 78
/// measured (with huge windows weighing no ghost, 1089 and 624 on passes
/// 3 and 4).
const MAX_FIXED_LATER_PASS_BINDS: u64 = 100;

fn trace_path(name: &str) -> PathBuf {
    let dir = std::env::var("CARGO_MANIFEST_DIR")
        .unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").to_string());
    PathBuf::from(dir).join("traces").join(name)
}

/// Replay `passes` passes of trace `name`; `warm_binds[k]` is the most
/// page binds pass `k + 2` may make (passes past the slice's end are not
/// gated).
fn check(name: &str, passes: u32, warm_binds: &[u64]) {
    check_with(name, passes, warm_binds, PoolConfig::default());
}

/// [`check`] with the pool configured by `config`.
fn check_with(name: &str, passes: u32, warm_binds: &[u64], config: PoolConfig) {
    let trace = Trace::load(&trace_path(name), None).unwrap_or_else(|e| panic!("{e}"));
    let device = Arc::new(HostDevice::new());
    let alloc = TidepoolAlloc::with_config(device, trace.streams.len(), config)
        .unwrap_or_else(|e| panic!("{e}"));
    let mut replayer = Replayer::new(alloc, &trace);
    for _ in 0..passes {
        let r = replayer
            .pass(PassOptions::default(), |_| {})
            .unwrap_or_else(|e| panic!("{e}"));
        eprintln!(
            "{name} pass {}: {} ops, peak live {} B, peak reserved {} B, ratio {:.4}, {} OOMs, \
             {:.0} ops/s, {:.3} s",
            r.pass,
            r.ops,
            r.peak_live_bytes,
            r.peak_reserved_bytes,
            r.ratio(),
            r.ooms,
            r.ops_per_sec(),
            r.wall.as_secs_f64()
        );
        assert_eq!(
            r.ooms, 0,
            "{name} pass {}: out-of-memory during replay",
            r.pass
        );
        assert!(
            r.ratio() <= MAX_RATIO,
            "{name} pass {}: peak reserved / peak live = {:.4} > {MAX_RATIO}",
            r.pass,
            r.ratio()
        );
        let binds = r
            .counters
            .iter()
            .find(|(k, _)| *k == "remaps")
            .map(|&(_, v)| v)
            .expect("the tidepool replayer reports its page binds");
        eprintln!("{name} pass {}: {binds} page binds", r.pass);
        let limit = (r.pass as usize)
            .checked_sub(2)
            .and_then(|k| warm_binds.get(k));
        if let Some(&max) = limit {
            assert!(
                binds <= max,
                "{name} pass {}: {binds} page binds in a warm pass > {max}",
                r.pass
            );
        }
    }
}

/// The whole trace (about 1 s a pass in a debug build), fresh and three
/// warm passes: a pass starts from the layout the previous one left, so
/// the later warm passes meet other placements than the first.
///
/// Warm binds are gated above the 50 of gpt2-varlen: 476 / 78 / 78 on
/// passes 2-4. Each pass replays the trace's first steps, after which the
/// medium and big zones' first-fit layout takes about 12 steps to settle;
/// the last 785 MiB block of each step is placed at the pool's peak, where
/// it takes every idle page, so every page by which the set of pages in
/// use then differs from the last time its window served costs a bind
/// (see docs/benchmarks.md, "Warm-pass binds of gpt2-fixed"). The steps
/// that differ most keep windows of their own from the second pass on;
/// the 78 are the steps that differ by fewer pages.
#[test]
fn gpt2_fixed_on_host_within_target() {
    check(
        "gpt2-fixed.csv.gz",
        4,
        &[
            MAX_FIXED_SECOND_PASS_BINDS,
            MAX_FIXED_LATER_PASS_BINDS,
            MAX_FIXED_LATER_PASS_BINDS,
        ],
    );
}

/// The fragmentation case, fresh pass.
#[test]
fn gpt2_varlen_fresh_on_host_within_target() {
    check("gpt2-varlen.csv.gz", 1, &[]);
}

/// Warm passes of the fragmentation case (1.0123 of peak live measured),
/// and at most 50 page binds in each warm pass (the pages a loop needs
/// stay mapped where it needs them).
#[test]
fn gpt2_varlen_warm_on_host_within_target() {
    check("gpt2-varlen.csv.gz", 3, &[MAX_WARM_BINDS, MAX_WARM_BINDS]);
}

/// Most page binds a warm pass of gpt2-fixed may make with units of up to
/// 16 MiB: 261 / 232 measured on passes 2 / 3 (host backend). Weighing
/// the ghosts a huge block would unmap, as for blocks of single pages,
/// made them 540 / 511.
const MAX_WARM_BINDS_WITH_UNITS: u64 = 300;

/// Warm passes of gpt2-fixed with units of several pages for its blocks
/// of 256 MiB and up: within the memory target, and its huge windows
/// chosen by binds alone.
#[test]
fn gpt2_fixed_warm_with_units_within_target() {
    check_with(
        "gpt2-fixed.csv.gz",
        3,
        &[MAX_WARM_BINDS_WITH_UNITS, MAX_WARM_BINDS_WITH_UNITS],
        PoolConfig::default().with_max_unit_size(16 << 20),
    );
}

/// Most physical handles the fresh pass of gpt2-fixed may create with
/// units of up to 16 MiB for its blocks of 256 MiB and up: 2441 measured
/// on the host backend (deterministic there), with 6 % slack. One handle
/// a page needs 3914.
const MAX_FRESH_HANDLES_WITH_UNITS: u64 = 2600;

/// With units of several pages, the fresh pass of gpt2-fixed creates
/// far fewer physical handles, still within the memory target.
#[test]
fn gpt2_fixed_fresh_pass_with_units_creates_few_handles() {
    let name = "gpt2-fixed.csv.gz";
    let trace = Trace::load(&trace_path(name), None).unwrap_or_else(|e| panic!("{e}"));
    let device = Arc::new(HostDevice::new());
    let config = PoolConfig::default().with_max_unit_size(16 << 20);
    let alloc = TidepoolAlloc::with_config(device, trace.streams.len(), config)
        .unwrap_or_else(|e| panic!("{e}"));
    let mut replayer = Replayer::new(alloc, &trace);
    let r = replayer
        .pass(PassOptions::default(), |_| {})
        .unwrap_or_else(|e| panic!("{e}"));
    let counter = |name: &str| {
        r.counters
            .iter()
            .find(|(k, _)| *k == name)
            .map(|&(_, v)| v)
            .unwrap_or_else(|| panic!("the tidepool replayer reports {name}"))
    };
    let handles = counter("growths");
    eprintln!(
        "{name} fresh pass with units: {handles} handles, {} binds, ratio {:.4}",
        counter("remaps"),
        r.ratio()
    );
    assert_eq!(r.ooms, 0, "{name}: out-of-memory during replay");
    assert!(
        r.ratio() <= MAX_RATIO,
        "{name} fresh pass with units: peak reserved / peak live = {:.4} > {MAX_RATIO}",
        r.ratio()
    );
    assert!(
        handles <= MAX_FRESH_HANDLES_WITH_UNITS,
        "{name} fresh pass with units: {handles} physical handles created > \
         {MAX_FRESH_HANDLES_WITH_UNITS}"
    );
}
