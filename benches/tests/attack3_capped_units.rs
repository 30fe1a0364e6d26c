//! The traces replayed with physical units of several pages
//! (`PoolConfig::max_unit_size`) in a pool capped just above its measured
//! footprint. The documented figures: units of at most 16 MiB for blocks of
//! 256 MiB and up keep every trace within 1.014 of peak live, so a cap of
//! 1.02 x peak live (whole pages) must see no out-of-memory; units of
//! 64 MiB for blocks of 16 MiB and up reached 1.019-1.055, so a cap of
//! 1.06 x peak live must see none either. A request that fails there
//! although the pool had held enough before is a false out-of-memory that
//! units brought in (single pages pass at 1.02, `attack13_capped.rs`).

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use tidepool::PoolConfig;
use tidepool_benches::replay::tidepool_alloc::TidepoolAlloc;
use tidepool_benches::replay::{PassOptions, Replayer, Trace};
use tidepool_sys::host::{HostConfig, HostDevice};

const PAGE: u64 = 2 << 20;
const MIB: usize = 1 << 20;

fn trace(name: &str) -> Trace {
    let dir = std::env::var("CARGO_MANIFEST_DIR")
        .unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").to_string());
    let path = PathBuf::from(dir).join("traces").join(name);
    Trace::load(&path, None).unwrap_or_else(|e| panic!("{e}"))
}

/// Peak live bytes of the trace (the highest point of its envelope).
fn peak_live(t: &Trace) -> u64 {
    t.live_envelope(1)
        .iter()
        .map(|&(_, l)| l)
        .max()
        .unwrap_or(0)
}

fn capped(
    name: &str,
    passes: u32,
    device_cap: bool,
    max_unit: usize,
    unit_min: usize,
    target: f64,
) {
    let t = trace(name);
    let live = peak_live(&t);
    let cap = ((live as f64 * target) as u64) / PAGE * PAGE;
    let units = PoolConfig::default()
        .with_max_unit_size(max_unit)
        .with_unit_min_block(unit_min);
    let (device, config) = if device_cap {
        let dev = HostDevice::with_config(HostConfig {
            capacity: cap as usize,
            granularity: PAGE as usize,
        });
        (dev, units)
    } else {
        (HostDevice::new(), units.with_max_size(cap))
    };
    let alloc = TidepoolAlloc::with_config(Arc::new(device), t.streams.len(), config).unwrap();
    let mut r = Replayer::new(alloc, &t);
    for _ in 0..passes {
        let p = r.pass(PassOptions::default(), |_| {}).unwrap();
        let _ = writeln!(
            std::io::stderr().lock(),
            "{name} (units {} MiB from {} MiB, {}, cap {cap} B = {:.4} x peak live {live} B) \
             pass {}: {} OOMs, peak reserved / peak live {:.4}",
            max_unit / MIB,
            unit_min / MIB,
            if device_cap {
                "device capacity"
            } else {
                "pool maximum"
            },
            cap as f64 / live as f64,
            p.pass,
            p.ooms,
            p.ratio()
        );
        assert_eq!(
            p.ooms,
            0,
            "{name} pass {}: out-of-memory under a cap of {:.4} x peak live with units of {} MiB",
            p.pass,
            cap as f64 / live as f64,
            max_unit / MIB
        );
    }
}

#[test]
fn gpt2_fixed_units_16_mib_capped_at_1_02() {
    capped("gpt2-fixed.csv.gz", 2, false, 16 * MIB, 256 * MIB, 1.02);
}

#[test]
fn gpt2_varlen_units_16_mib_capped_at_1_02() {
    capped("gpt2-varlen.csv.gz", 2, false, 16 * MIB, 256 * MIB, 1.02);
}

#[test]
fn random_longlived_units_16_mib_on_a_device_of_1_02() {
    capped(
        "random-longlived.csv.gz",
        2,
        true,
        16 * MIB,
        256 * MIB,
        1.02,
    );
}

#[test]
fn gpt2_fixed_units_64_mib_capped_at_1_06() {
    capped("gpt2-fixed.csv.gz", 2, false, 64 * MIB, 16 * MIB, 1.06);
}

#[test]
fn gpt2_varlen_units_64_mib_capped_at_1_06() {
    capped("gpt2-varlen.csv.gz", 2, false, 64 * MIB, 16 * MIB, 1.06);
}

#[test]
fn pipeline_units_64_mib_capped_at_1_06() {
    capped("pipeline.csv.gz", 1, false, 64 * MIB, 16 * MIB, 1.06);
}
