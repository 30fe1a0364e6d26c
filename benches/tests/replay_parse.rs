//! The trace parser: both encodings, clear errors with line numbers, and the
//! replay loop's handling of out-of-memory, passes and samples (over the
//! reference allocator, so no device is needed).

use flate2::write::GzEncoder;
use flate2::Compression;
use std::io::Write;
use std::path::{Path, PathBuf};
use tidepool_benches::replay::session::parse_bytes;
use tidepool_benches::replay::{
    IdealAllocator, PassOptions, ReplayAllocator, Replayer, Trace, TraceError, TraceOp,
};

fn parse(text: &str) -> Result<Trace, TraceError> {
    Trace::parse(text.as_bytes(), Path::new("test.csv"), None)
}

/// The shipped traces, found at run time: `$CARGO_MANIFEST_DIR/traces`
/// (cargo and the GPU staging runner set the variable when they run a
/// test), else `traces/` of the current directory (both run tests from the
/// package directory). No path from the build machine is compiled in.
fn traces_dir() -> PathBuf {
    let dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."))
        .join("traces");
    assert!(
        dir.join("gpt2-fixed.csv.gz").exists(),
        "the shipped traces are not in {}: run the test from the benches \
         directory or set CARGO_MANIFEST_DIR to it",
        dir.display()
    );
    dir
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tidepool-replay-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

const SMALL: &str = "op,id,size,stream\na,0,100,0\na,1,200,7\nf,0,100,0\na,2,50,0\nf,1,200,7\n";

#[test]
fn parses_ops_streams_and_peak() {
    let t = parse(SMALL).unwrap();
    assert_eq!(t.ops.len(), 5);
    assert_eq!(t.allocs, 3);
    assert_eq!(t.streams, vec![0, 7]);
    assert_eq!(t.peak_live_bytes, 300);
    assert_eq!(t.live_at_end, 1);
    assert_eq!(t.live_at_end_bytes, 50);
    assert_eq!(t.distinct_sizes, 3);
    // Slots are dense and reused after a free.
    assert_eq!(t.slots, 2);
    assert_eq!(
        t.ops[1],
        TraceOp::Alloc {
            slot: 1,
            size: 200,
            stream: 1
        }
    );
    assert_eq!(t.live_after(&[0, 2, 3, 5]), vec![0, 300, 200, 50]);
}

#[test]
fn plain_and_gzip_files_parse_the_same() {
    let plain = tmp("small.csv");
    std::fs::write(&plain, SMALL).unwrap();
    let gz = tmp("small.csv.gz");
    let mut enc = GzEncoder::new(Vec::new(), Compression::default());
    enc.write_all(SMALL.as_bytes()).unwrap();
    std::fs::write(&gz, enc.finish().unwrap()).unwrap();
    let a = Trace::load(&plain, None).unwrap();
    let b = Trace::load(&gz, None).unwrap();
    assert_eq!(a.ops, b.ops);
    assert_eq!(a.peak_live_bytes, b.peak_live_bytes);
    assert_eq!(a.name, "small");
    assert_eq!(b.name, "small");
    // A prefix.
    let c = Trace::load(&gz, Some(3)).unwrap();
    assert_eq!(c.ops, a.ops[..3]);
}

#[test]
fn the_shipped_traces_parse_with_their_documented_peaks() {
    let dir = traces_dir();
    let fixed = Trace::load(&dir.join("gpt2-fixed.csv.gz"), None).unwrap();
    assert_eq!(fixed.ops.len(), 86_400);
    assert_eq!(fixed.allocs, 43_437);
    assert_eq!(fixed.distinct_sizes, 43);
    assert_eq!(fixed.peak_live_bytes, 8_113_058_504);
    let varlen = Trace::load(&dir.join("gpt2-varlen.csv.gz"), None).unwrap();
    assert_eq!(varlen.ops.len(), 85_376);
    assert_eq!(varlen.allocs, 42_925);
    assert_eq!(varlen.distinct_sizes, 134);
    assert_eq!(varlen.peak_live_bytes, 9_689_198_280);
    assert_eq!(fixed.live_at_end, 474);
}

fn parse_err(text: &str) -> (usize, String) {
    let e = parse(text).unwrap_err();
    let line = e.line().expect("a parse error has a line");
    (line, e.to_string())
}

#[test]
fn malformed_lines_name_line_number_and_content() {
    let (line, msg) = parse_err("op,id,size,stream\na,0,100,0\na,1,abc,0\n");
    assert_eq!(line, 3);
    assert!(msg.contains("test.csv:3"), "{msg}");
    assert!(msg.contains("a,1,abc,0"), "{msg}");
    assert!(msg.contains("size"), "{msg}");

    let (line, msg) = parse_err("a,0,100,0\na,1,100\n");
    assert_eq!(line, 2);
    assert!(msg.contains("a,1,100") && msg.contains("4 fields"), "{msg}");

    let (line, msg) = parse_err("a,0,100,0\nx,1,100,0\n");
    assert_eq!(line, 2);
    assert!(msg.contains("unknown op `x`"), "{msg}");

    let (line, msg) = parse_err("a,0,-5,0\n");
    assert_eq!(line, 1);
    assert!(msg.contains("a,0,-5,0"), "{msg}");

    let (line, msg) = parse_err("op,id,bytes,stream\n");
    assert_eq!(line, 1);
    assert!(msg.contains("header"), "{msg}");
}

#[test]
fn unknown_or_double_ids_are_errors() {
    let (line, msg) = parse_err("op,id,size,stream\na,0,100,0\nf,1,100,0\n");
    assert_eq!(line, 3);
    assert!(
        msg.contains("free of id 1") && msg.contains("f,1,100,0"),
        "{msg}"
    );

    // Double free.
    let (line, msg) = parse_err("a,0,100,0\nf,0,100,0\nf,0,100,0\n");
    assert_eq!(line, 3);
    assert!(msg.contains("not live"), "{msg}");

    // Allocation of an id that is live.
    let (line, msg) = parse_err("a,0,100,0\na,0,100,0\n");
    assert_eq!(line, 2);
    assert!(msg.contains("id 0 allocated again"), "{msg}");

    // An id may name a new allocation after its free.
    assert!(parse("a,0,100,0\nf,0,100,0\na,0,64,0\n").is_ok());
}

#[test]
fn missing_file_is_an_io_error() {
    let e = Trace::load(Path::new("/nonexistent/trace.csv.gz"), None).unwrap_err();
    assert!(matches!(e, TraceError::Io { .. }));
    assert!(e.to_string().contains("/nonexistent/trace.csv.gz"), "{e}");
}

#[test]
fn byte_counts_with_suffixes() {
    assert_eq!(parse_bytes("1234").unwrap(), 1234);
    assert_eq!(parse_bytes("16G").unwrap(), 16 << 30);
    assert_eq!(parse_bytes("16GiB").unwrap(), 16 << 30);
    assert_eq!(parse_bytes("512M").unwrap(), 512 << 20);
    assert_eq!(parse_bytes("64k").unwrap(), 64 << 10);
    assert!(parse_bytes("12Q").is_err());
    assert!(parse_bytes("").is_err());
}

#[test]
fn oom_is_counted_and_its_free_skipped() {
    // Capacity 250: the 200-byte allocation on stream 7 fails while 100 live.
    let t = parse(SMALL).unwrap();
    let mut r = Replayer::new(IdealAllocator::new(250, 1), &t);
    let res = r.pass(PassOptions::default(), |_| {}).unwrap();
    assert_eq!(res.ooms, 1);
    assert_eq!(res.ops, 5);
    assert_eq!(res.peak_live_bytes, 300);
    assert_eq!(res.peak_reserved_bytes, 100);
    // 3 allocs tried; frees: id 0 in the trace, id 2 at the pass's end; the
    // failed allocation's free was skipped.
    assert_eq!(r.allocator.calls.0, 3);
    assert_eq!(r.allocator.calls.1, 2);
    assert_eq!(r.allocator.reserved_now().unwrap(), 0);
}

#[test]
fn passes_start_from_the_same_live_set_and_report_their_own_peak() {
    let t = parse(SMALL).unwrap();
    let mut r = Replayer::new(IdealAllocator::new(u64::MAX, 64), &t);
    let opts = PassOptions {
        sample_every: 2,
        progress_every: 1,
    };
    let mut progress = Vec::new();
    let a = r.pass(opts, |d| progress.push(d)).unwrap();
    assert_eq!(progress, vec![1, 2, 3, 4, 5]);
    let b = r.pass(opts, |_| {}).unwrap();
    assert_eq!((a.pass, b.pass), (1, 2));
    // Granularity 64: 128 + 256 live at peak.
    assert_eq!(a.peak_reserved_bytes, 384);
    assert_eq!(b.peak_reserved_bytes, 384);
    assert!((a.ratio() - 384.0 / 300.0).abs() < 1e-12);
    let ops: Vec<usize> = a.samples.iter().map(|s| s.op).collect();
    assert_eq!(ops, vec![0, 2, 4, 5]);
    let reserved: Vec<u64> = a.samples.iter().map(|s| s.reserved_bytes).collect();
    assert_eq!(reserved, vec![0, 384, 320, 64]);
    // Each sample's high-water mark covers the operations since the
    // previous sample: 128 + 256 after op 2, still 384 until op 4.
    let highs: Vec<u64> = a.samples.iter().map(|s| s.reserved_high_bytes).collect();
    assert_eq!(highs, vec![0, 384, 384, 320]);
    assert_eq!(a.samples, b.samples);
    // Everything freed after each pass; one synchronize per pass.
    assert_eq!(r.allocator.reserved_now().unwrap(), 0);
    assert_eq!(r.allocator.calls.2, 2);
    assert_eq!(r.allocator.max_stream, 1);
}

#[test]
fn the_plot_envelope_reaches_the_peaks_the_title_states() {
    use tidepool_benches::replay::session::{self, AllocatorKind, SessionOptions};
    // A spike that lasts one operation, far shorter than a plot bucket.
    let mut text = String::from("op,id,size,stream\n");
    for i in 0..1000u64 {
        text.push_str(&format!("a,{i},1000,0\n"));
        if i == 500 {
            text.push_str("a,9999,1000000,0\nf,9999,0,0\n");
        }
        text.push_str(&format!("f,{i},0,0\n"));
    }
    let t = parse(&text).unwrap();
    assert_eq!(t.peak_live_bytes, 1_001_000);
    let opts = SessionOptions {
        samples_per_pass: 50,
        passes: 2,
        ..SessionOptions::default()
    };
    let recs = session::replay(&t, AllocatorKind::Ideal, &opts, &mut |_| {}, &mut |_| {}).unwrap();
    let panel = session::panel(&t, &recs);
    let max = |pts: &[(f64, f64)]| pts.iter().map(|p| p.1).fold(0.0, f64::max);
    assert_eq!(max(&panel.live.points), t.peak_live_bytes as f64);
    assert_eq!(panel.reserved.len(), 1);
    assert_eq!(
        max(&panel.reserved[0].points),
        recs[0].result.peak_reserved_bytes as f64
    );
    assert_eq!(recs[0].result.peak_reserved_bytes, 1_001_000);
    // Both passes are drawn, one after the other, and every point is in
    // time order.
    let last_x = panel.live.points.last().unwrap().0;
    assert_eq!(last_x, 2.0 * t.ops.len() as f64);
    for s in std::iter::once(&panel.live).chain(&panel.reserved) {
        assert!(s.points.windows(2).all(|w| w[0].0 <= w[1].0), "{}", s.label);
    }
    assert!(panel.title.contains("peak live 1.0 MiB"), "{}", panel.title);
    assert!(panel.title.contains("ideal 1.0"), "{}", panel.title);
}

/// A producer (stream 5) hands a block to a consumer (stream 9), which
/// frees it after waiting; the wait is an operation of its own.
const HANDOVER: &str =
    "op,id,size,stream\na,0,4096,5\nw,5,0,9\nf,0,0,9\na,1,64,9\nw,9,0,5\nf,1,0,5\n";

#[test]
fn waits_parse_into_their_own_op_with_both_streams() {
    let t = parse(HANDOVER).unwrap();
    assert_eq!(t.streams, vec![5, 9]);
    assert_eq!(t.waits, 2);
    assert_eq!(t.allocs, 2);
    assert_eq!(t.ops.len(), 6);
    assert_eq!(t.ops[1], TraceOp::Wait { from: 0, stream: 1 });
    assert_eq!(t.ops[4], TraceOp::Wait { from: 1, stream: 0 });
    assert_eq!(t.peak_live_bytes, 4096);
    // Waits move no bytes.
    assert_eq!(t.live_after(&[1, 2, 3]), vec![4096, 4096, 0]);
    // Both frees on another stream are ordered after their allocation.
    assert!(t.unordered_frees().is_empty());
    // A wait may name a stream no other line names yet (it is created).
    let t = parse("a,0,100,0\nw,3,0,0\nf,0,0,0\n").unwrap();
    assert_eq!(t.streams, vec![0, 3]);
    // Old files, without waits, parse as before.
    assert_eq!(parse(SMALL).unwrap().waits, 0);
}

#[test]
fn bad_waits_are_errors_naming_the_line() {
    let (line, msg) = parse_err("a,0,100,0\nw,1,0,1\n");
    assert_eq!(line, 2);
    assert!(
        msg.contains("on itself") && msg.contains("w,1,0,1"),
        "{msg}"
    );

    let (line, msg) = parse_err("a,0,100,0\nw,0,8,1\n");
    assert_eq!(line, 2);
    assert!(
        msg.contains("must be 0") && msg.contains("w,0,8,1"),
        "{msg}"
    );

    let (line, msg) = parse_err("a,0,100,0\nw,x,0,1\n");
    assert_eq!(line, 2);
    assert!(msg.contains("id `x`"), "{msg}");

    let (line, msg) = parse_err("a,0,100,0\nw,0,0\n");
    assert_eq!(line, 2);
    assert!(msg.contains("4 fields"), "{msg}");

    let (_, msg) = parse_err("a,0,100,0\nq,0,0,1\n");
    assert!(msg.contains("`a`, `f` or `w`"), "{msg}");
}

#[test]
fn frees_on_another_stream_need_a_wait_after_the_allocation() {
    // No wait at all.
    assert_eq!(
        parse("a,0,100,0\nf,0,0,1\n").unwrap().unordered_frees(),
        vec![1]
    );
    // A wait issued before the allocation does not order the free after it.
    let t = parse("w,0,0,1\na,0,100,0\nf,0,0,1\n").unwrap();
    assert_eq!(t.unordered_frees(), vec![2]);
    // A wait in the other direction neither.
    let t = parse("a,0,100,0\nw,1,0,0\nf,0,0,1\n").unwrap();
    assert_eq!(t.unordered_frees(), vec![2]);
    // Through a chain of waits: 0 -> 2 -> 1.
    let t = parse("a,0,100,0\nw,0,0,2\nw,2,0,1\nf,0,0,1\n").unwrap();
    assert!(t.unordered_frees().is_empty());
    // The chain's second link issued before the first does not count.
    let t = parse("a,0,100,0\nw,2,0,1\nw,0,0,2\nf,0,0,1\n").unwrap();
    assert_eq!(t.unordered_frees(), vec![3]);
    // A free on the allocating stream needs no wait.
    assert!(parse(SMALL).unwrap().unordered_frees().is_empty());
}

#[test]
fn the_replay_loop_issues_waits_in_trace_order() {
    let t = parse(HANDOVER).unwrap();
    let mut r = Replayer::new(IdealAllocator::new(u64::MAX, 1), &t);
    let res = r.pass(PassOptions::default(), |_| {}).unwrap();
    assert_eq!(res.ops, 6);
    assert_eq!(r.allocator.waits, vec![(0, 1), (1, 0)]);
    assert_eq!(r.allocator.calls.0, 2);
    assert_eq!(r.allocator.calls.1, 2);
}
