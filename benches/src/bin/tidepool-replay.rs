//! `tidepool-replay`: replay allocation traces through tidepool (and, with
//! `--compare`, the CUDA driver's pool and cuMemAlloc), and report peak
//! live and reserved bytes, their ratio, out-of-memory count, ops/s and
//! wall time. See `benches/traces/README.md` for the trace format and
//! `--help` for the output columns and exit codes.

use clap::Parser;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use tidepool_benches::replay::plot;
use tidepool_benches::replay::report::{self, Record};
use tidepool_benches::replay::session::{self, AllocatorKind, Backend, SessionOptions};
use tidepool_benches::replay::{trace, Trace};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum BackendArg {
    Host,
    Cuda,
}

const AFTER_HELP: &str = "\
TRACE FORMAT
  CSV, plain or gzip (detected from the content): an optional header line
  `op,id,size,stream`, then one line per operation: `a,ID,SIZE,STREAM`
  allocates SIZE bytes under ID on STREAM, `f,ID,SIZE,STREAM` frees the
  allocation live under ID on STREAM, `w,FROM,0,STREAM` makes STREAM wait
  for the work issued on stream FROM so far (an event recorded on FROM,
  through the pool for tidepool). Empty lines and lines starting with `#`
  are skipped. Full description: benches/traces/README.md.

OUTPUT (one row per trace, allocator and pass)
  trace              the trace's file name without .csv/.gz
  backend            host or cuda
  allocator          tidepool, driver-pool, cuMemAlloc or ideal (* = see the
                     note under the table)
  pass               1 fresh (a new allocator); 2.. warm (the same allocator,
                     every allocation of the previous pass freed)
  ops                operations replayed
  peak live MiB      highest sum of live allocation sizes the trace asks for
  peak reserved MiB  the allocator's highest reserved memory during the pass
  ratio              peak reserved / peak live (1.0 = no memory overhead);
                     in parentheses when the pass had out-of-memory failures
  OOMs               allocations that failed for lack of memory (skipped)
  ops/s              operations per second of allocator calls
  wall s             seconds spent in allocator calls
  With --json, the same fields (and `valid`, `warm`, the allocator's own
  counters) as one JSON object per line on stdout. For tidepool, also
  `driver_calls`, `driver_ms` (calls of each kind of driver call made in
  the pass and the milliseconds spent in them) and `driver_ms_total`, and
  `lag` when the pass ran under --lag, `announced_capture` under
  --announced-capture; the table is followed by the same
  figures, one line per pass.

EXIT STATUS
  0 success (or stdout closed early by its reader, as with `| head`); 1 the
  replay failed (a device error) or its results or plot could not be
  written; 2 bad arguments, bad input or no CUDA driver for --backend cuda
  (nothing was replayed); 3 a pass had out-of-memory failures, so its
  figures do not describe the trace (use --allow-oom to accept that).

LOGGING
  RUST_LOG=debug (or e.g. RUST_LOG=tidepool=trace) prints the pool's events
  on stderr; see docs/logging.md.";

/// Replay allocation traces (CSV `op,id,size,stream`, plain or .gz) through
/// a stream-ordered allocator.
#[derive(Debug, Parser)]
#[command(name = "tidepool-replay", version, after_long_help = AFTER_HELP)]
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

    /// Replay the allocators in turns, pass by pass (pass 1 of each, then
    /// pass 2 of each, ...), instead of all passes of one allocator before
    /// the next: passes compared with each other then run close in time,
    /// so that a machine whose speed drifts during the run affects them
    /// alike. Each allocator's figures are the same kind either way.
    #[arg(long)]
    interleave: bool,

    /// Passes per allocator: pass 1 is fresh, later passes reuse (warm) it.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    passes: u32,

    /// Host backend capacity in bytes; suffixes K/M/G/T (powers of 1024).
    /// Must hold every trace's peak live bytes unless --allow-oom is given.
    #[arg(long, value_name = "BYTES", value_parser = parse_capacity)]
    capacity: Option<usize>,

    /// Accept out-of-memory failures: report such passes (marked invalid)
    /// and exit 0 instead of 3. For experiments with a tight --capacity.
    #[arg(long)]
    allow_oom: bool,

    /// Write an SVG timeline of live and reserved bytes, one panel a trace
    /// (each line an envelope: lowest and highest value of each run of
    /// operations, so no peak is lost).
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,

    /// One JSON object a line, per trace, allocator and pass.
    #[arg(long)]
    json: bool,

    /// tidepool's largest physical unit (one handle) for a large block, in
    /// bytes; suffixes K/M/G/T. The page size (2M) or less: single pages
    /// (the pool's default).
    #[arg(long, value_name = "BYTES", value_parser = session::parse_bytes)]
    max_unit: Option<usize>,

    /// tidepool's smallest block that gets units of several pages, in
    /// bytes; suffixes K/M/G/T [pool default: 256M].
    #[arg(long, value_name = "BYTES", value_parser = session::parse_bytes)]
    unit_min: Option<usize>,

    /// tidepool's virtual reservation, in bytes; suffixes K/M/G/T
    /// [pool default: twice the device's memory, at least 64 GiB]. Each
    /// size class gets a quarter of it. A smaller one lets the replay run
    /// under tools that cannot reserve 64 GiB (valgrind: 32G).
    #[arg(long, value_name = "BYTES", value_parser = session::parse_bytes)]
    va_size: Option<usize>,

    /// Completion lag of the host backend under tidepool, in trace
    /// operations: an event or stream query answers "not done" until N
    /// more operations have been issued after the event's record (the
    /// stream's last operation); a host wait completes what it waits for
    /// at once. Models kernels that keep frees pending for a while, which
    /// a replay on the host (no kernels) never does. Counted in operations,
    /// never time: runs are deterministic. 0 (the default): no lag.
    #[arg(long, value_name = "N", default_value_t = 0)]
    lag: u64,

    /// tidepool in announced capture mode (`PoolConfig::check_capture`
    /// off): an allocation does not ask the device whether its stream is
    /// being captured into a graph (a replay never captures). Measures
    /// what the default strict mode's per-allocation query costs.
    #[arg(long)]
    announced_capture: bool,

    /// Replay only the first N operations of each trace (N >= 1).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    max_ops: Option<u64>,
}

fn parse_capacity(s: &str) -> Result<usize, String> {
    match session::parse_bytes(s)? {
        0 => Err("the capacity must be more than 0 bytes".into()),
        n => Ok(n),
    }
}

fn parse_allocator(s: &str) -> Result<AllocatorKind, String> {
    s.parse()
}

/// Exit code of usage errors and bad input (as clap uses for bad arguments).
const EXIT_USAGE: u8 = 2;
/// Exit code of a failure while replaying (a device error).
const EXIT_FAILURE: u8 = 1;
/// Exit code of a run whose passes had out-of-memory failures.
const EXIT_INVALID: u8 = 3;

/// Events of the pool and the replayer on stderr, filtered by `RUST_LOG`
/// (default: warnings and errors only).
fn init_logging() {
    let filter = match std::env::var("RUST_LOG") {
        Ok(spec) if !spec.trim().is_empty() => {
            tracing_subscriber::EnvFilter::try_new(&spec).unwrap_or_else(|e| {
                eprintln!(
                    "tidepool-replay: warning: RUST_LOG={spec:?} is not a valid filter ({e}); showing \
                     warnings and errors only (examples: RUST_LOG=debug, RUST_LOG=tidepool=trace)"
                );
                tracing_subscriber::EnvFilter::new("warn")
            })
        }
        _ => tracing_subscriber::EnvFilter::new("warn"),
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

fn main() -> ExitCode {
    init_logging();
    let args = Args::parse();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        // Stdout closed by its reader: stop without a message.
        Err((0, msg)) if msg.is_empty() => ExitCode::SUCCESS,
        Err((code, msg)) => {
            eprintln!("tidepool-replay: error: {msg}");
            ExitCode::from(code)
        }
    }
}

/// Write to stdout. A reader that went away (`| head`) ends the run quietly
/// with status 0, as other command-line tools do; any other failure (a full
/// disk) is an error with exit status 1.
fn write_stdout(text: &str) -> Result<(), (u8, String)> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::BrokenPipe {
                (0, String::new())
            } else {
                (
                    EXIT_FAILURE,
                    format!("cannot write the results to stdout: {e}"),
                )
            }
        })
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
    // Each allocator once, in the order given: a repeat would only add a
    // row that cannot be told from the first.
    let mut kinds: Vec<AllocatorKind> = Vec::new();
    for &k in &args.allocators {
        if !kinds.contains(&k) {
            kinds.push(k);
        }
    }
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
    if backend == Backend::Cuda && !session::cuda_available() {
        // Before reading any trace: nothing can be replayed on this machine.
        let why = tidepool_sys::cuda::driver_unavailable_reason().unwrap_or_default();
        return Err((
            EXIT_USAGE,
            format!(
                "--backend cuda: no usable CUDA driver ({why}); run on a machine with an NVIDIA \
                 GPU and driver, or use --backend host"
            ),
        ));
    }
    if args.lag > 0 && backend != Backend::Host {
        return Err((
            EXIT_USAGE,
            "--lag holds back the host backend's completions; with --backend cuda the \
             GPU's own kernels set when work completes"
                .into(),
        ));
    }
    if args.capacity.is_some() && backend != Backend::Host {
        return Err((
            EXIT_USAGE,
            "--capacity sets the host backend's capacity; it has no meaning with --backend cuda"
                .into(),
        ));
    }

    if let Some(path) = &args.plot {
        plot::check_path(path).map_err(|e| (EXIT_USAGE, e))?;
    }

    // Parse every trace before any timing.
    let max_ops = args
        .max_ops
        .map(|n| usize::try_from(n).unwrap_or(usize::MAX));
    let mut traces = Vec::new();
    for path in &args.traces {
        let mut t = Trace::load(path, max_ops).map_err(|e| (EXIT_USAGE, e.to_string()))?;
        // Two traces of the same file name (a/x.csv, b/x.csv.gz) would give
        // rows, JSON lines and plot panels that cannot be told apart: name
        // them by their paths instead.
        let same_name = args
            .traces
            .iter()
            .filter(|p| trace::trace_name(p) == t.name)
            .count();
        if same_name > 1 {
            t.name = path.display().to_string();
        }
        if let Some(capacity) = args.capacity {
            if (capacity as u64) < t.peak_live_bytes && !args.allow_oom {
                return Err((
                    EXIT_USAGE,
                    format!(
                        "--capacity {capacity} bytes ({} MiB) is below the peak live bytes of \
                         {} ({} MiB): allocations would fail and the figures would not \
                         describe the trace; raise --capacity, or pass --allow-oom to run anyway",
                        report::mib(capacity as u64),
                        t.name,
                        report::mib(t.peak_live_bytes)
                    ),
                ));
            }
        }
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
        max_unit_size: args.max_unit,
        unit_min_block: args.unit_min,
        va_size: args.va_size,
        lag: args.lag,
        check_capture: !args.announced_capture,
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
    let mut write_failed: Option<(u8, String)> = None;
    for trace in &traces {
        let mut trace_records = Vec::new();
        // One group of allocators replayed together: each on its own, or
        // all of them in turns (--interleave).
        let groups: Vec<Vec<AllocatorKind>> = if args.interleave {
            vec![kinds.clone()]
        } else {
            kinds.iter().map(|&k| vec![k]).collect()
        };
        for group in &groups {
            let mut base = bar.as_ref().map_or(0, |b| b.position());
            let mut last = 0usize;
            if let Some(b) = &bar {
                let names: Vec<&str> = group.iter().map(|k| k.name()).collect();
                b.set_message(format!("{} / {}", trace.name, names.join(", ")));
            }
            let mut on_record = |rec: &Record| {
                if json && write_failed.is_none() {
                    let line = format!("{}\n", rec.to_json());
                    let written = match &bar {
                        Some(b) => b.suspend(|| write_stdout(&line)),
                        None => write_stdout(&line),
                    };
                    write_failed = written.err();
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
            let mut recs =
                session::replay_interleaved(trace, group, &opts, &mut on_record, &mut progress)
                    .map_err(|e| (EXIT_FAILURE, format!("{}: {e}", trace.name)))?;
            if let Some(e) = write_failed.take() {
                return Err(e);
            }
            // The table lists each allocator's passes together, in the
            // order the allocators were named, whatever order they ran in.
            recs.sort_by_key(|r| {
                let at = group.iter().position(|k| k.name() == r.allocator);
                (at, r.result.pass)
            });
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
        write_stdout(&report::table(&all))?;
    }
    if let Some(path) = &args.plot {
        plot::draw_svg(path, &panels).map_err(|e| (EXIT_FAILURE, e))?;
        if !json {
            eprintln!("plot written to {}", path.display());
        }
    }
    let invalid = all.iter().filter(|r| !r.is_valid()).count();
    if invalid > 0 {
        let ooms: u64 = all.iter().map(|r| r.result.ooms).sum();
        let msg = format!(
            "{invalid} pass(es) had out-of-memory failures ({ooms} allocations skipped): their \
             peak reserved and ratio do not describe the trace"
        );
        if args.allow_oom {
            eprintln!("tidepool-replay: warning: {msg} (accepted: --allow-oom)");
        } else {
            return Err((
                EXIT_INVALID,
                format!(
                    "{msg}; give the run more memory (--capacity on the host backend) or pass \
                     --allow-oom to accept it"
                ),
            ));
        }
    }
    Ok(())
}
