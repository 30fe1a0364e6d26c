//! The traces replayed in a pool capped just above what the memory target
//! says it needs: if peak reserved / peak live <= 1.02 holds, a cap of
//! 1.02 x peak live (rounded down to whole pages) leaves room, so the
//! replay must see no out-of-memory at all, fresh or warm. The cap is set
//! two ways: the pool's maximum size on a roomy device, and a device whose
//! capacity is the cap (growth then fails inside the driver, and the pool
//! must fall back to stitching instead of failing).

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use tidepool::PoolConfig;
use tidepool_benches::replay::tidepool_alloc::TidepoolAlloc;
use tidepool_benches::replay::{PassOptions, Replayer, Trace};
use tidepool_sys::host::{HostConfig, HostDevice};

const PAGE: u64 = 2 << 20;
const TARGET: f64 = 1.02;

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

fn capped(name: &str, passes: u32, device_cap: bool) {
    let t = trace(name);
    let live = peak_live(&t);
    let cap = ((live as f64 * TARGET) as u64) / PAGE * PAGE;
    let (device, config) = if device_cap {
        let dev = HostDevice::with_config(HostConfig {
            capacity: cap as usize,
            granularity: PAGE as usize,
        });
        (dev, PoolConfig::default())
    } else {
        (HostDevice::new(), PoolConfig::default().with_max_size(cap))
    };
    let alloc = TidepoolAlloc::with_config(Arc::new(device), t.streams.len(), config).unwrap();
    let mut r = Replayer::new(alloc, &t);
    for _ in 0..passes {
        let p = r.pass(PassOptions::default(), |_| {}).unwrap();
        assert_eq!(
            p.peak_live_bytes, live,
            "the envelope's peak is the replay's"
        );
        let _ = writeln!(
            std::io::stderr().lock(),
            "{name} ({}, cap {cap} B = {:.4} x peak live {live} B) pass {}: {} OOMs, \
             peak reserved / peak live {:.4}",
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
            "{name} pass {}: out-of-memory under a cap of {:.4} x peak live",
            p.pass,
            cap as f64 / live as f64
        );
    }
}

#[test]
fn gpt2_fixed_capped_at_the_target() {
    capped("gpt2-fixed.csv.gz", 2, false);
}

#[test]
fn gpt2_varlen_capped_at_the_target() {
    capped("gpt2-varlen.csv.gz", 2, false);
}

#[test]
fn pipeline_capped_at_the_target() {
    capped("pipeline.csv.gz", 1, false);
}

#[test]
fn random_longlived_capped_at_the_target() {
    capped("random-longlived.csv.gz", 1, false);
}

#[test]
fn random_longlived_on_a_device_of_the_target_size() {
    capped("random-longlived.csv.gz", 2, true);
}
