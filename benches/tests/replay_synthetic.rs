//! CI gate of the synthetic traces (`traces/pipeline.csv.gz`,
//! `traces/random-longlived.csv.gz`, written by `tidepool-tracegen`):
//! replayed through tidepool on the host backend over three passes, each
//! pass must reach peak reserved / peak live <= 1.02 with no out-of-memory,
//! as the GPT-2 traces must. Their shapes differ from a training loop on
//! one stream (a producer/consumer pipeline across four streams; random
//! sizes with long-lived blocks), so that no placement rule fitted to the
//! GPT-2 traces passes here by accident.
//!
//! The traces are located at run time from `CARGO_MANIFEST_DIR`, falling
//! back to the value compiled in.

use std::path::PathBuf;
use std::sync::Arc;
use tidepool_benches::replay::tidepool_alloc::TidepoolAlloc;
use tidepool_benches::replay::{PassOptions, Replayer, Trace};
use tidepool_sys::host::HostDevice;

const MAX_RATIO: f64 = 1.02;
const PASSES: u32 = 3;

fn trace_path(name: &str) -> PathBuf {
    let dir = std::env::var("CARGO_MANIFEST_DIR")
        .unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").to_string());
    PathBuf::from(dir).join("traces").join(name)
}

fn check(name: &str) {
    let trace = Trace::load(&trace_path(name), None).unwrap_or_else(|e| panic!("{e}"));
    let device = Arc::new(HostDevice::new());
    let alloc = TidepoolAlloc::new(device, trace.streams.len()).unwrap_or_else(|e| panic!("{e}"));
    let mut replayer = Replayer::new(alloc, &trace);
    let mut failures = Vec::new();
    for _ in 0..PASSES {
        let r = replayer
            .pass(PassOptions::default(), |_| {})
            .unwrap_or_else(|e| panic!("{e}"));
        let line = format!(
            "{name} pass {}: {} ops, peak live {} B, peak reserved {} B, ratio {:.4}, {} OOMs, \
             counters {:?}",
            r.pass,
            r.ops,
            r.peak_live_bytes,
            r.peak_reserved_bytes,
            r.ratio(),
            r.ooms,
            r.counters
        );
        eprintln!("{line}");
        if r.ooms != 0 || r.ratio() > MAX_RATIO {
            failures.push(line);
        }
    }
    assert!(
        failures.is_empty(),
        "passes over the target (ratio <= {MAX_RATIO}, no OOM):\n{}",
        failures.join("\n")
    );
}

#[test]
fn pipeline_on_host_within_target() {
    check("pipeline.csv.gz");
}

#[test]
fn random_longlived_on_host_within_target() {
    check("random-longlived.csv.gz");
}
