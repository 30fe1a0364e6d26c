//! `tidepool-replay`: replay allocation traces through tidepool (and, with
//! `--compare`, the CUDA driver's pool and cuMemAlloc), and report peak
//! live and reserved bytes, their ratio, out-of-memory count, ops/s and
//! wall time. See `benches/traces/README.md` for the trace format.

use clap::Parser;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use tidepool_benches::replay::plot;
use tidepool_benches::replay::report::{self, Record};
use tidepool_benches::replay::session::{self, AllocatorKind, Backend, SessionOptions};
use tidepool_benches::replay::Trace;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum BackendArg {
    Host,
    Cuda,
}

/// Replay allocation traces (CSV `op,id,size,stream`, plain or .gz) through
/// a stream-ordered allocator.
#[derive(Debug, Parser)]
#[command(name = "tidepool-replay", version)]
struct Args {
    /// Trace files (CSV `op,id,size,stream`, plain or gzip).
    #[arg(required = true)]
    traces: Vec<PathBuf>,

    /// Device backend [default: cuda when a CUDA driver is present, else host].
    #[arg(long, value_enum)]
    backend: Option<BackendArg>,

    /// Allocator(s) to replay through: tidepool, driver-pool, cuMemAlloc,
    /// ideal (a reference that allocates nothing). Repeatable.
    #[arg(long = "allocator", value_name = "NAME", value_parser = parse_allocator)]
    allocators: Vec<AllocatorKind>,

    /// Also replay through a fresh driver pool and through
    /// cuMemAlloc/cuMemFree (cuda backend only).
    #[arg(long)]
    compare: bool,

    /// Passes per allocator: pass 1 is fresh, later passes reuse (warm) it.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    passes: u32,

    /// Host backend capacity in bytes; suffixes K/M/G/T (powers of 1024).
    #[arg(long, value_name = "BYTES", value_parser = session::parse_bytes)]
    capacity: Option<usize>,

    /// Write an SVG timeline of live and reserved bytes, one panel a trace.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,

    /// One JSON object a line, per trace, allocator and pass.
    #[arg(long)]
    json: bool,

    /// Replay only the first N operations of each trace.
    #[arg(long, value_name = "N")]
    max_ops: Option<usize>,
}

fn parse_allocator(s: &str) -> Result<AllocatorKind, String> {
    s.parse()
}

/// Exit code of usage errors and bad input (as clap uses for bad arguments).
const EXIT_USAGE: u8 = 2;
/// Exit code of a failure while replaying (a device error).
const EXIT_FAILURE: u8 = 1;

fn main() -> ExitCode {
    let args = Args::parse();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err((code, msg)) => {
            eprintln!("tidepool-replay: error: {msg}");
            ExitCode::from(code)
        }
    }
}

fn default_backend() -> Backend {
    if session::cuda_available() {
        Backend::Cuda
    } else {
        Backend::Host
    }
}

fn run(args: Args) -> Result<(), (u8, String)> {
    let backend = match args.backend {
        Some(BackendArg::Host) => Backend::Host,
        Some(BackendArg::Cuda) => Backend::Cuda,
        None => default_backend(),
    };
    let mut kinds = args.allocators.clone();
    if kinds.is_empty() {
        kinds.push(AllocatorKind::Tidepool);
    }
    if args.compare {
        if backend != Backend::Cuda {
            return Err((
                EXIT_USAGE,
                format!(
                    "--compare replays through the CUDA driver pool and cuMemAlloc, which need \
                     the cuda backend; this run uses the {backend} backend{}",
                    if args.backend.is_none() {
                        " (no CUDA driver found)"
                    } else {
                        ""
                    }
                ),
            ));
        }
        for k in [AllocatorKind::DriverPool, AllocatorKind::CuMemAlloc] {
            if !kinds.contains(&k) {
                kinds.push(k);
            }
        }
    }
    if let Some(k) = kinds.iter().find(|k| !k.available_on(backend)) {
        return Err((
            EXIT_USAGE,
            format!("allocator {k} needs the cuda backend; this run uses the {backend} backend"),
        ));
    }
    if args.capacity.is_some() && backend != Backend::Host {
        return Err((
            EXIT_USAGE,
            "--capacity sets the host backend's capacity; it has no meaning with --backend cuda"
                .into(),
        ));
    }

    // Parse every trace before any timing.
    let mut traces = Vec::new();
    for path in &args.traces {
        let t = Trace::load(path, args.max_ops).map_err(|e| (EXIT_USAGE, e.to_string()))?;
        if !args.json {
            eprintln!(
                "{}: {} ops ({} allocations, {} distinct sizes, {} stream(s)), peak live {} MiB, \
                 parsed in {:.3} s",
                t.name,
                t.ops.len(),
                t.allocs,
                t.distinct_sizes,
                t.streams.len(),
                report::mib(t.peak_live_bytes),
                t.parse_time.as_secs_f64()
            );
        }
        traces.push(t);
    }

    let opts = SessionOptions {
        backend,
        passes: args.passes,
        host_capacity: args.capacity,
        samples_per_pass: if args.plot.is_some() { 4000 } else { 0 },
        progress_every: 0,
    };
    let bar = if std::io::stderr().is_terminal() {
        let total: usize =
            traces.iter().map(|t| t.ops.len()).sum::<usize>() * kinds.len() * args.passes as usize;
        let bar = indicatif::ProgressBar::new(total as u64);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{msg:32} [{bar:40}] {pos}/{len} ops ({elapsed})",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        Some(bar)
    } else {
        None
    };
    let opts = SessionOptions {
        progress_every: if bar.is_some() { 4096 } else { 0 },
        ..opts
    };

    let mut all: Vec<Record> = Vec::new();
    let mut panels = Vec::new();
    let json = args.json;
    for trace in &traces {
        let mut trace_records = Vec::new();
        for &kind in &kinds {
            let mut base = bar.as_ref().map_or(0, |b| b.position());
            let mut last = 0usize;
            if let Some(b) = &bar {
                b.set_message(format!("{} / {kind}", trace.name));
            }
            let mut on_record = |rec: &Record| {
                if json {
                    let line = rec.to_json();
                    if let Some(b) = &bar {
                        b.suspend(|| println!("{line}"));
                    } else {
                        println!("{line}");
                    }
                }
            };
            let mut progress = |done: usize| {
                if let Some(b) = &bar {
                    if done < last {
                        base += last as u64;
                    }
                    last = done;
                    b.set_position(base + done as u64);
                }
            };
            let recs = session::replay(trace, kind, &opts, &mut on_record, &mut progress)
                .map_err(|e| (EXIT_FAILURE, format!("{}: {e}", trace.name)))?;
            trace_records.extend(recs);
        }
        if args.plot.is_some() {
            panels.push(session::panel(trace, &trace_records));
        }
        all.extend(trace_records);
    }
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    if !json {
        print!("{}", report::table(&all));
    }
    if let Some(path) = &args.plot {
        plot::draw_svg(path, &panels).map_err(|e| (EXIT_FAILURE, e))?;
        if !json {
            eprintln!("plot written to {}", path.display());
        }
    }
    Ok(())
}
