//! The replay's driver-call counts (`Timed`, reported per pass as
//! `driver_calls`) agree with the pool's own books: one create per growth,
//! one map and one set-access per remap, one release per page released.
//! Host backend, the first steps of the GPT-2 traces, fresh and warm
//! passes, with single pages and with units of several pages, and a trim
//! that releases pages.

use std::path::PathBuf;
use std::sync::Arc;
use tidepool::PoolConfig;
use tidepool_benches::replay::report::{self, Record};
use tidepool_benches::replay::tidepool_alloc::TidepoolAlloc;
use tidepool_benches::replay::timed::DriverOp;
use tidepool_benches::replay::{PassOptions, PassResult, Replayer, Trace};
use tidepool_sys::host::HostDevice;

fn trace_path(name: &str) -> PathBuf {
    let dir = std::env::var("CARGO_MANIFEST_DIR")
        .unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").to_string());
    PathBuf::from(dir).join("traces").join(name)
}

fn counter(r: &PassResult, name: &str) -> u64 {
    r.counters
        .iter()
        .find(|(n, _)| *n == name)
        .map(|&(_, v)| v)
        .unwrap_or_else(|| panic!("no counter {name} in {:?}", r.counters))
}

fn calls(r: &PassResult, op: DriverOp) -> u64 {
    r.driver
        .iter()
        .find(|(n, _)| *n == op.name())
        .map(|(_, s)| s.calls)
        .unwrap_or_else(|| panic!("no driver kind {} in {:?}", op.name(), r.driver))
}

/// Replay `ops` operations of `name` three times, then trim the pool to
/// nothing; every pass's driver calls must match the pool's counters.
fn check(name: &str, ops: usize, config: PoolConfig) {
    let trace = Trace::load(&trace_path(name), Some(ops)).unwrap_or_else(|e| panic!("{e}"));
    let device = Arc::new(HostDevice::new());
    let alloc = TidepoolAlloc::with_config(device, trace.streams.len(), config)
        .unwrap_or_else(|e| panic!("{e}"));
    let mut replayer = Replayer::new(alloc, &trace);
    for _ in 0..3 {
        let r = replayer
            .pass(PassOptions::default(), |_| {})
            .unwrap_or_else(|e| panic!("{e}"));
        eprintln!(
            "{name} pass {}: counters {:?}, driver {:?}",
            r.pass, r.counters, r.driver
        );
        if r.pass == 1 {
            // Not vacuous: the fresh pass grows and binds.
            assert!(counter(&r, "growths") > 0 && counter(&r, "remaps") > 0);
        }
        assert_eq!(calls(&r, DriverOp::Create), counter(&r, "growths"));
        assert_eq!(calls(&r, DriverOp::Map), counter(&r, "remaps"));
        assert_eq!(calls(&r, DriverOp::SetAccess), counter(&r, "remaps"));
        let rec = Record {
            trace: name.into(),
            backend: "host".into(),
            allocator: "tidepool".into(),
            result: r.clone(),
            lag: None,
            announced_capture: false,
            note: None,
        };
        let json = rec.to_json();
        for needle in [
            format!("\"create\":{}", counter(&r, "growths")),
            format!("\"set_access\":{}", counter(&r, "remaps")),
            "\"driver_ms\":{".to_string(),
        ] {
            assert!(json.contains(&needle), "{needle} missing in {json}");
        }
        let table = report::table(std::slice::from_ref(&rec));
        let line = format!("create {} / ", counter(&r, "growths"));
        assert!(
            table.contains("driver calls") && table.contains(&line),
            "{line} missing in\n{table}"
        );
    }
    let alloc = &replayer.allocator;
    let (releases, release_calls) = (
        alloc.pool().stats().releases,
        alloc.device().calls(DriverOp::Release),
    );
    let trimmed = alloc.pool().trim_to(0).unwrap_or_else(|e| panic!("{e}"));
    let released = alloc.pool().stats().releases - releases;
    assert!(trimmed > 0 && released > 0, "the trim released nothing");
    assert_eq!(
        alloc.device().calls(DriverOp::Release) - release_calls,
        released
    );
}

#[test]
fn driver_calls_match_the_pools_counters_single_pages() {
    check("gpt2-fixed.csv.gz", 6000, PoolConfig::default());
}

#[test]
fn driver_calls_match_the_pools_counters_with_units() {
    check(
        "gpt2-varlen.csv.gz",
        6000,
        PoolConfig::default()
            .with_max_unit_size(16 << 20)
            .with_unit_min_block(16 << 20),
    );
}
