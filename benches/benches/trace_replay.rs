//! Trace replay, warm pass: the GPT-2 traces of `traces/` (found at run
//! time through `CARGO_MANIFEST_DIR`) replayed through tidepool and through
//! a fresh driver pool with the replay library; the first (fresh) pass is
//! untimed by criterion and written to the summary as `trace_fresh`, every
//! criterion iteration is one warm pass of the same trace on the same
//! allocator. Throughput: trace operations per second.

use criterion::{criterion_group, criterion_main, Criterion};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
mod benchutil;
use benchutil::{self as bu, Meas};
use tidepool_benches::replay::allocators::DriverPoolAlloc;
use tidepool_benches::replay::tidepool_alloc::TidepoolAlloc;
use tidepool_benches::replay::{PassOptions, ReplayAllocator, Replayer, Trace};

fn traces() -> Vec<Trace> {
    let dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."))
        .join("traces");
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e} (set CARGO_MANIFEST_DIR)", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().ends_with(".csv.gz"))
        .collect();
    paths.sort();
    paths
        .iter()
        .map(|p| Trace::load(p, None).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
        .collect()
}

fn replay<A: ReplayAllocator>(g: &mut bu::Group<'_>, backend: &str, trace: &Trace, alloc: A) {
    let name = alloc.name();
    let mut r = Replayer::new(alloc, trace);
    let fresh = r.pass(PassOptions::default(), |_| {}).expect("fresh pass");
    let ns = fresh.wall.as_nanos() as f64 / fresh.ops.max(1) as f64;
    let ratio = [("reserved_over_live", format!("{:.4}", fresh.ratio()))];
    bu::Summary::measurement("trace_fresh", backend, name, &trace.name, ns, 1, 1, &ratio);
    let m = Meas {
        bench: "trace_replay",
        backend,
        allocator: name,
        param: trace.name.clone(),
        ops_per_iter: trace.ops.len() as u64,
    };
    let mut ratio = 0.0;
    bu::bench(g, &m, |iters| {
        let mut wall = Duration::ZERO;
        for _ in 0..iters {
            let p = r.pass(PassOptions::default(), |_| {}).expect("warm pass");
            assert_eq!(p.ooms, 0, "{name}: out of memory in a warm pass");
            ratio = p.ratio();
            wall += p.wall;
        }
        wall
    });
    bu::Summary::append_line(
        &serde_json::json!({
            "note": "trace_reserved_over_live",
            "backend": backend,
            "allocator": name,
            "param": trace.name,
            "warm_ratio": (ratio * 1e4).round() / 1e4,
        })
        .to_string(),
    );
}

fn benches(c: &mut Criterion) {
    bu::Summary::meta("trace_replay");
    let traces = traces();
    let mut g = bu::group(c, "trace_replay", true);
    let cuda = bu::cuda_or_skip("trace_replay (cuda)");
    for t in &traces {
        let n = t.streams.len();
        let host = TidepoolAlloc::new(bu::host_device(), n).expect("tidepool (host)");
        replay(&mut g, "host", t, host);
        if let Some(dev) = &cuda {
            let tp = TidepoolAlloc::new(Arc::clone(dev), n).expect("tidepool (cuda)");
            replay(&mut g, "cuda", t, tp);
            let dp = DriverPoolAlloc::new(dev, n).expect("driver pool");
            replay(&mut g, "cuda", t, dp);
        }
    }
    g.finish();
}

criterion_group! {
    name = group;
    config = bu::criterion();
    targets = benches
}
criterion_main!(group);
