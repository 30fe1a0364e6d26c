//! `tidepool-tracegen`: write a synthetic allocation trace (see
//! `tidepool_benches::tracegen` for the shapes), deterministic for a given
//! shape, seed and step count. The shipped ones were written with
//!
//! ```text
//! tidepool-tracegen --shape pipeline --out benches/traces/pipeline.csv.gz
//! tidepool-tracegen --shape random-longlived --out benches/traces/random-longlived.csv.gz
//! ```
//!
//! Before writing, the trace is parsed back and checked: it must parse,
//! and every free on another stream than its allocation's must be ordered
//! after the allocation by the trace's waits. A summary (operations,
//! allocations, sizes, streams, peak live bytes) goes to stderr.

use clap::Parser;
use flate2::write::GzEncoder;
use flate2::Compression;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use tidepool_benches::replay::Trace;
use tidepool_benches::tracegen::{self, Shape};

/// Write a synthetic allocation trace (CSV `op,id,size,stream`; gzip when
/// the output name ends in `.gz`).
#[derive(Debug, Parser)]
#[command(name = "tidepool-tracegen", version)]
struct Args {
    /// pipeline (producer/consumer across 4 streams) or random-longlived
    /// (random sizes with long-lived blocks, one stream).
    #[arg(long, value_parser = |s: &str| s.parse::<Shape>())]
    shape: Shape,

    /// Seed of the random draws.
    #[arg(long, default_value_t = tracegen::SHIPPED_SEED)]
    seed: u64,

    /// Steps (repetitions of the workload's step) [default: the shipped
    /// trace's: 60 for both].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    steps: Option<u32>,

    /// Output file (`-`: stdout, plain text).
    #[arg(long, default_value = "-")]
    out: PathBuf,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let steps = args.steps.unwrap_or(args.shape.shipped_steps());
    let text = tracegen::generate(args.shape, args.seed, steps);
    let trace = match Trace::parse(text.as_bytes(), &args.out, None) {
        Ok(t) => t,
        Err(e) => {
            eprintln!(
                "tidepool-tracegen: the generated trace does not parse (a generator bug): {e}"
            );
            return ExitCode::FAILURE;
        }
    };
    let unordered = trace.unordered_frees();
    if !unordered.is_empty() {
        eprintln!(
            "tidepool-tracegen: {} frees on another stream than their allocation's are not \
             ordered after it (a generator bug; first at operation {})",
            unordered.len(),
            unordered[0]
        );
        return ExitCode::FAILURE;
    }
    if let Err(e) = write(&args.out, &text) {
        eprintln!(
            "tidepool-tracegen: cannot write {}: {e}",
            args.out.display()
        );
        return ExitCode::FAILURE;
    }
    eprintln!(
        "{}: {} ops, {} allocations, {} distinct sizes, {} streams, {} waits, peak live {} B, \
         {} allocations live at the end ({} B)",
        args.out.display(),
        trace.ops.len(),
        trace.allocs,
        trace.distinct_sizes,
        trace.streams.len(),
        trace.waits,
        trace.peak_live_bytes,
        trace.live_at_end,
        trace.live_at_end_bytes
    );
    ExitCode::SUCCESS
}

fn write(path: &Path, text: &str) -> std::io::Result<()> {
    if path.as_os_str() == "-" {
        return std::io::stdout().lock().write_all(text.as_bytes());
    }
    let bytes = if path.extension().is_some_and(|e| e == "gz") {
        // No file name and a zero time in the header: the same text gives
        // the same file.
        let mut enc = GzEncoder::new(Vec::new(), Compression::best());
        enc.write_all(text.as_bytes())?;
        enc.finish()?
    } else {
        text.as_bytes().to_vec()
    };
    std::fs::write(path, bytes)
}
