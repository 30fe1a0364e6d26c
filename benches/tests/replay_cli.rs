//! The `tidepool-replay` binary: output formats and clear errors with exit
//! code 2 (never a panic) for bad input.

use std::path::PathBuf;
use std::process::{Command, Output};

/// The package directory, found at run time: `CARGO_MANIFEST_DIR` (cargo
/// and the GPU staging runner set it when they run a test), else the
/// current directory (both run tests from the package directory).
fn manifest_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."))
}

fn trace(name: &str) -> PathBuf {
    manifest_dir().join("traces").join(name)
}

/// The binary, found at run time: `TIDEPOOL_REPLAY_BIN` if set, else the
/// path cargo compiled in when it exists (a `cargo test` run), else the copy
/// staged by `stage-gpu.sh` in `.gpu/bin/` of the checkout (a GPU machine,
/// where the compile-time path is the CPU machine's).
fn replay_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("TIDEPOOL_REPLAY_BIN") {
        return p.into();
    }
    let built = PathBuf::from(env!("CARGO_BIN_EXE_tidepool-replay"));
    if built.exists() {
        return built;
    }
    let staged = manifest_dir().join("../.gpu/bin/tidepool-replay");
    assert!(
        staged.exists(),
        "tidepool-replay not found at {} nor {}; set TIDEPOOL_REPLAY_BIN",
        built.display(),
        staged.display()
    );
    staged
}

fn run(args: &[&str]) -> Output {
    Command::new(replay_bin())
        .args(args)
        .output()
        .expect("run tidepool-replay")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn assert_clean_failure(o: &Output, code: i32, needle: &str) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(code), "stderr: {err}");
    assert!(err.contains(needle), "expected {needle:?} in: {err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn json_lines_have_the_documented_fields() {
    let t = trace("gpt2-fixed.csv.gz");
    let o = run(&[
        "--backend",
        "host",
        "--allocator",
        "ideal",
        "--json",
        "--passes",
        "2",
        "--max-ops",
        "2000",
        t.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8(o.stdout).unwrap();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    for (i, l) in lines.iter().enumerate() {
        assert!(l.starts_with('{') && l.ends_with('}'), "{l}");
        for field in [
            "\"trace\":\"gpt2-fixed\"",
            "\"backend\":\"host\"",
            "\"allocator\":\"ideal\"",
            "\"ops\":2000",
            "\"peak_live_bytes\":",
            "\"peak_reserved_bytes\":",
            "\"ratio\":1",
            "\"ooms\":0",
            "\"ops_per_sec\":",
            "\"wall_s\":",
        ] {
            assert!(l.contains(field), "{field} missing in {l}");
        }
        assert!(l.contains(&format!("\"pass\":{}", i + 1)), "{l}");
    }
}

#[test]
fn table_and_plot() {
    let t = trace("gpt2-varlen.csv.gz");
    let svg = std::env::temp_dir().join(format!("tidepool-replay-cli-{}.svg", std::process::id()));
    let o = run(&[
        "--backend",
        "host",
        "--allocator",
        "ideal",
        "--max-ops",
        "3000",
        "--plot",
        svg.to_str().unwrap(),
        t.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8(o.stdout).unwrap();
    assert!(
        out.contains("peak reserved MiB") && out.contains("gpt2-varlen"),
        "{out}"
    );
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(
        plot.starts_with("<svg") && plot.contains("ideal reserved"),
        "{}",
        &plot[..200.min(plot.len())]
    );
    let _ = std::fs::remove_file(svg);
}

#[test]
fn missing_file_exits_2() {
    let o = run(&["--backend", "host", "/nonexistent/x.csv"]);
    assert_clean_failure(&o, 2, "/nonexistent/x.csv");
}

#[test]
fn malformed_line_exits_2_with_line_and_content() {
    let p = std::env::temp_dir().join(format!("tidepool-replay-bad-{}.csv", std::process::id()));
    std::fs::write(&p, "op,id,size,stream\na,0,10,0\nf,0,10\n").unwrap();
    let o = run(&["--backend", "host", p.to_str().unwrap()]);
    assert_clean_failure(&o, 2, ":3: ");
    assert!(stderr(&o).contains("f,0,10"), "{}", stderr(&o));
    let _ = std::fs::remove_file(p);
}

#[test]
fn unknown_allocator_and_backend_exit_2() {
    let t = trace("gpt2-fixed.csv.gz");
    let o = run(&["--allocator", "jemalloc", t.to_str().unwrap()]);
    assert_clean_failure(&o, 2, "unknown allocator `jemalloc`");
    let o = run(&["--backend", "tpu", t.to_str().unwrap()]);
    assert_clean_failure(&o, 2, "tpu");
}

#[test]
fn baselines_need_the_cuda_backend() {
    let t = trace("gpt2-fixed.csv.gz");
    let o = run(&["--backend", "host", "--compare", t.to_str().unwrap()]);
    assert_clean_failure(&o, 2, "--compare");
    let o = run(&[
        "--backend",
        "host",
        "--allocator",
        "driver-pool",
        t.to_str().unwrap(),
    ]);
    assert_clean_failure(&o, 2, "needs the cuda backend");
}

/// A temporary file with `content`, named `tidepool-replay-<tag>-<pid><ext>`.
fn temp_file(tag: &str, ext: &str, content: &[u8]) -> PathBuf {
    let p = std::env::temp_dir().join(format!("tidepool-replay-{tag}-{}{ext}", std::process::id()));
    std::fs::write(&p, content).unwrap();
    p
}

fn gzip(data: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

#[test]
fn empty_and_header_only_traces_exit_2() {
    let cases: [(&str, &str, Vec<u8>); 4] = [
        ("empty", ".csv", Vec::new()),
        ("empty-gz-name", ".csv.gz", Vec::new()),
        ("header", ".csv", b"op,id,size,stream\n".to_vec()),
        (
            "header-gz",
            ".csv.gz",
            gzip(b"op,id,size,stream\n# nothing else\n"),
        ),
    ];
    for (tag, ext, content) in cases {
        let p = temp_file(tag, ext, &content);
        let o = run(&[
            "--backend",
            "host",
            "--allocator",
            "ideal",
            p.to_str().unwrap(),
        ]);
        assert_clean_failure(&o, 2, "holds no operation");
        assert!(o.stdout.is_empty(), "{tag}: a table was printed");
        let _ = std::fs::remove_file(p);
    }
}

#[test]
fn max_ops_zero_exits_2() {
    let t = trace("gpt2-fixed.csv.gz");
    let o = run(&["--backend", "host", "--max-ops", "0", t.to_str().unwrap()]);
    assert_clean_failure(&o, 2, "--max-ops");
}

#[test]
fn capacity_zero_exits_2() {
    let t = trace("gpt2-fixed.csv.gz");
    let o = run(&["--backend", "host", "--capacity", "0", t.to_str().unwrap()]);
    assert_clean_failure(&o, 2, "more than 0 bytes");
}

#[test]
fn capacity_below_the_peak_exits_2_before_replaying() {
    // Peak live 6 MiB; a 5 MiB host device cannot hold it.
    let p = temp_file(
        "cap",
        ".csv",
        b"a,0,3145728,0\na,1,3145728,0\nf,0,0,0\nf,1,0,0\n",
    );
    let o = run(&["--backend", "host", "--capacity", "5M", p.to_str().unwrap()]);
    assert_clean_failure(&o, 2, "below the peak live bytes");
    assert!(stderr(&o).contains("--allow-oom"), "{}", stderr(&o));
    assert!(o.stdout.is_empty(), "nothing may be replayed");
    let _ = std::fs::remove_file(p);
}

#[test]
fn out_of_memory_during_the_replay_exits_3_unless_allowed() {
    // Peak live 6 MiB + 2 bytes fits a 7 MiB device, but each allocation
    // takes two 2 MiB pages of the host device: the second one fails.
    let p = temp_file(
        "oom",
        ".csv",
        b"a,0,3145729,0\na,1,3145729,0\nf,0,0,0\nf,1,0,0\n",
    );
    let path = p.to_str().unwrap();
    let o = run(&["--backend", "host", "--capacity", "7M", path]);
    assert_clean_failure(&o, 3, "out-of-memory");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        out.contains("INVALID"),
        "the table must mark the pass: {out}"
    );

    let o = run(&["--backend", "host", "--capacity", "7M", "--allow-oom", path]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("warning"), "{}", stderr(&o));
    let o = run(&[
        "--backend",
        "host",
        "--capacity",
        "7M",
        "--allow-oom",
        "--json",
        path,
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let line = String::from_utf8(o.stdout).unwrap();
    let v: serde_json::Value = serde_json::from_str(line.trim()).unwrap();
    assert_eq!(v["valid"], false, "{line}");
    assert!(v["ooms"].as_u64().unwrap() >= 1, "{line}");
    let _ = std::fs::remove_file(p);
}

#[test]
fn plot_paths_are_checked_before_replaying() {
    let t = trace("gpt2-fixed.csv.gz");
    let t = t.to_str().unwrap();
    let missing = std::env::temp_dir()
        .join(format!("tidepool-no-such-dir-{}", std::process::id()))
        .join("x.svg");
    let o = run(&["--backend", "host", "--plot", missing.to_str().unwrap(), t]);
    assert_clean_failure(&o, 2, "does not exist");
    assert!(o.stdout.is_empty(), "nothing may be replayed");
    // The directory's name appears once, not in a doubled message.
    assert_eq!(stderr(&o).matches("tidepool-replay: error").count(), 1);

    let png = std::env::temp_dir().join(format!("tidepool-{}.png", std::process::id()));
    let o = run(&["--backend", "host", "--plot", png.to_str().unwrap(), t]);
    assert_clean_failure(&o, 2, "SVG only");
    assert!(!png.exists(), "no file may be written under a .png name");
}

#[test]
fn rust_log_shows_the_pools_events() {
    let p = temp_file("log", ".csv", b"a,0,4096,0\nf,0,0,0\n");
    let o = Command::new(replay_bin())
        .args(["--backend", "host", "--allocator", "tidepool"])
        .arg(&p)
        .env("RUST_LOG", "tidepool=debug")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("pool created"), "{}", stderr(&o));
    // Without RUST_LOG only warnings and errors are printed.
    let o = Command::new(replay_bin())
        .args(["--backend", "host", "--allocator", "tidepool"])
        .arg(&p)
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stderr(&o).contains("pool created"), "{}", stderr(&o));
    let _ = std::fs::remove_file(p);
}

#[test]
fn help_explains_columns_trace_format_and_exit_codes() {
    let o = run(&["--help"]);
    assert!(o.status.success());
    let help = String::from_utf8(o.stdout).unwrap();
    for needle in [
        "TRACE FORMAT",
        "a,ID,SIZE,STREAM",
        "peak reserved MiB",
        "ratio",
        "EXIT STATUS",
        "--allow-oom",
    ] {
        assert!(help.contains(needle), "{needle} missing from --help");
    }
}

#[test]
fn live_bytes_that_overflow_are_a_parse_error() {
    // Two allocations whose sizes add up past u64::MAX: the trace cannot
    // describe a real program, and its peak live bytes cannot be counted.
    let p = temp_file(
        "overflow",
        ".csv",
        b"a,0,18446744073709551615,0\na,1,1,0\nf,0,0,0\nf,1,0,0\n",
    );
    let o = run(&["--backend", "host", p.to_str().unwrap()]);
    assert_clean_failure(&o, 2, ":2:");
    assert!(stderr(&o).contains("live bytes"), "{}", stderr(&o));
    assert!(o.stdout.is_empty(), "nothing may be replayed");
    let _ = std::fs::remove_file(p);
}

#[test]
fn a_trace_that_never_holds_a_byte_exits_2() {
    // Every allocation is of 0 bytes: peak live is 0, so the ratio
    // (peak reserved / peak live) means nothing.
    let p = temp_file(
        "zero-bytes",
        ".csv",
        b"a,0,0,0\na,1,0,0\nf,0,0,0\nf,1,0,0\n",
    );
    let o = run(&["--backend", "host", p.to_str().unwrap()]);
    assert_clean_failure(&o, 2, "never holds a byte");
    assert!(o.stdout.is_empty(), "a table was printed");
    // The same through --max-ops: a prefix of zero-byte allocations.
    let q = temp_file(
        "zero-prefix",
        ".csv",
        b"a,0,0,0\na,1,4096,0\nf,0,0,0\nf,1,0,0\n",
    );
    let o = run(&["--backend", "host", "--max-ops", "1", q.to_str().unwrap()]);
    assert_clean_failure(&o, 2, "never holds a byte");
    let _ = std::fs::remove_file(p);
    let _ = std::fs::remove_file(q);
}

#[cfg(target_os = "linux")]
#[test]
fn plot_path_that_cannot_be_created_exits_2_before_replaying() {
    // /proc exists but nothing can be created in it (even by root).
    let t = trace("gpt2-fixed.csv.gz");
    let o = run(&[
        "--backend",
        "host",
        "--plot",
        "/proc/tidepool-timeline.svg",
        "--max-ops",
        "100",
        t.to_str().unwrap(),
    ]);
    assert_clean_failure(&o, 2, "cannot be written");
    assert!(o.stdout.is_empty(), "nothing may be replayed");

    // A writable path is checked without leaving a file behind when the
    // run then fails on its input.
    let svg = std::env::temp_dir().join(format!("tidepool-probe-{}.svg", std::process::id()));
    let o = run(&[
        "--backend",
        "host",
        "--plot",
        svg.to_str().unwrap(),
        "/nonexistent.csv",
    ]);
    assert_clean_failure(&o, 2, "cannot read trace");
    assert!(
        !svg.exists(),
        "the path check left {} behind",
        svg.display()
    );
}

#[test]
fn an_allocation_beyond_the_pools_address_space_is_out_of_memory() {
    // 1 TiB in one allocation: more than the pool's address space. The
    // driver's pool answers such a request with out-of-memory, so the
    // replayer counts it as one (exit 3), not as a device failure (exit 1).
    let p = temp_file(
        "huge",
        ".csv",
        b"a,0,1099511627776,0\nf,0,0,0\na,1,4096,0\nf,1,0,0\n",
    );
    let path = p.to_str().unwrap();
    let o = run(&["--backend", "host", "--allocator", "tidepool", path]);
    assert_clean_failure(&o, 3, "out-of-memory");
    let o = run(&["--backend", "host", "--allow-oom", "--json", path]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let line = String::from_utf8(o.stdout).unwrap();
    let v: serde_json::Value = serde_json::from_str(line.trim()).unwrap();
    assert_eq!(v["ooms"], 1, "{line}");
    assert_eq!(v["valid"], false, "{line}");
    let _ = std::fs::remove_file(p);
}

#[test]
fn a_header_after_a_byte_order_mark_is_accepted() {
    // Spreadsheet programs and some editors on Windows start a UTF-8 CSV
    // with a byte order mark.
    let p = temp_file(
        "bom",
        ".csv",
        b"\xef\xbb\xbfop,id,size,stream\na,0,4096,0\nf,0,0,0\n",
    );
    let o = run(&[
        "--backend",
        "host",
        "--allocator",
        "ideal",
        "--json",
        p.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let line = String::from_utf8(o.stdout).unwrap();
    let v: serde_json::Value = serde_json::from_str(line.trim()).unwrap();
    assert_eq!(v["ops"], 2, "{line}");
    let _ = std::fs::remove_file(p);
}

#[test]
fn an_unusable_rust_log_is_reported() {
    let p = temp_file("badlog", ".csv", b"a,0,4096,0\nf,0,0,0\n");
    let o = Command::new(replay_bin())
        .args([
            "--backend",
            "host",
            "--allocator",
            "ideal",
            p.to_str().unwrap(),
        ])
        .env("RUST_LOG", "tidepool=loud")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("RUST_LOG"),
        "an invalid filter was silently ignored: {}",
        stderr(&o)
    );
    let _ = std::fs::remove_file(p);
}

#[test]
fn a_reader_that_stops_early_ends_the_run_quietly() {
    // `tidepool-replay --json ... | head -1`: many more JSON lines than a
    // pipe holds (each ~400 bytes, 20,000 of them), read one, close the pipe.
    let t = trace("gpt2-fixed.csv.gz");
    let mut child = Command::new(replay_bin())
        .args([
            "--backend",
            "host",
            "--allocator",
            "ideal",
            "--json",
            "--passes",
            "20000",
            "--max-ops",
            "1",
            t.to_str().unwrap(),
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    let mut first = [0u8; 64];
    use std::io::Read;
    out.read_exact(&mut first).unwrap();
    assert!(first.starts_with(b"{\"trace\""), "{first:?}");
    drop(out);
    let o = child.wait_with_output().unwrap();
    let err = stderr(&o);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(o.status.code(), Some(0), "{err}");
}

#[cfg(target_os = "linux")]
#[test]
fn an_output_that_cannot_be_written_is_an_error_not_a_panic() {
    let t = trace("gpt2-fixed.csv.gz");
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    let o = Command::new(replay_bin())
        .args([
            "--backend",
            "host",
            "--allocator",
            "ideal",
            "--max-ops",
            "10",
        ])
        .arg(&t)
        .stdout(full)
        .output()
        .unwrap();
    assert_clean_failure(&o, 1, "cannot write the results");
}

#[test]
fn rows_can_be_told_apart() {
    // The same allocator twice is replayed once.
    let t = trace("gpt2-fixed.csv.gz");
    let o = run(&[
        "--backend",
        "host",
        "--allocator",
        "ideal",
        "--allocator",
        "ideal",
        "--json",
        "--max-ops",
        "100",
        t.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = String::from_utf8(o.stdout).unwrap();
    assert_eq!(out.lines().count(), 1, "{out}");

    // Two traces with the same file name in different directories are
    // named by their paths.
    let base = std::env::temp_dir().join(format!("tidepool-same-name-{}", std::process::id()));
    let (a, b) = (base.join("a"), base.join("b"));
    std::fs::create_dir_all(&a).unwrap();
    std::fs::create_dir_all(&b).unwrap();
    let (pa, pb) = (a.join("x.csv"), b.join("x.csv.gz"));
    std::fs::write(&pa, b"a,0,4096,0\nf,0,0,0\n").unwrap();
    std::fs::write(&pb, gzip(b"a,0,8192,0\nf,0,0,0\n")).unwrap();
    let o = run(&[
        "--backend",
        "host",
        "--allocator",
        "ideal",
        "--json",
        pa.to_str().unwrap(),
        pb.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = String::from_utf8(o.stdout).unwrap();
    let names: Vec<String> = out
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["trace"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(names.len(), 2, "{out}");
    assert_ne!(names[0], names[1], "{out}");
    let _ = std::fs::remove_dir_all(base);
}

#[test]
fn a_header_after_comments_is_accepted() {
    let p = temp_file(
        "comment-header",
        ".csv",
        b"# captured by hand\n\nop,id,size,stream\na,0,4096,0\nf,0,0,0\n",
    );
    let o = run(&[
        "--backend",
        "host",
        "--allocator",
        "ideal",
        "--json",
        p.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let line = String::from_utf8(o.stdout).unwrap();
    let v: serde_json::Value = serde_json::from_str(line.trim()).unwrap();
    assert_eq!(v["ops"], 2, "{line}");
    let _ = std::fs::remove_file(p);
}

#[test]
fn a_capacity_too_large_says_so() {
    let t = trace("gpt2-fixed.csv.gz");
    for cap in ["99999999999T", "99999999999999999999999"] {
        let o = run(&["--backend", "host", "--capacity", cap, t.to_str().unwrap()]);
        assert_clean_failure(&o, 2, "more bytes than this machine can address");
    }
}

#[test]
fn cuda_backend_without_a_driver_exits_2_before_reading_traces() {
    if tidepool_benches::replay::session::cuda_available() {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr().lock(),
            "SKIP cuda_backend_without_a_driver_exits_2_before_reading_traces: a CUDA driver is present"
        );
        return;
    }
    // The trace does not exist: the driver check must come first.
    let o = run(&["--backend", "cuda", "/nonexistent/trace.csv"]);
    assert_clean_failure(&o, 2, "no usable CUDA driver");
    assert!(!stderr(&o).contains("cannot read trace"), "{}", stderr(&o));
}

/// `--lag` reaches tidepool's device: the pipeline trace's counters with
/// `--lag 0` are those of a run without the option, and differ with a lag.
#[test]
fn lag_reaches_the_pool() {
    let t = trace("pipeline.csv.gz");
    let decided = |extra: &[&str]| {
        let mut args = vec![
            "--backend",
            "host",
            "--allocator",
            "tidepool",
            "--json",
            "--max-ops",
            "12000",
        ];
        args.extend_from_slice(extra);
        args.push(t.to_str().unwrap());
        let o = run(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        let out = String::from_utf8(o.stdout).unwrap();
        // What placement decided, without the timings.
        [
            "peak_reserved_bytes",
            "growths",
            "remaps",
            "rebinds",
            "cache_hits",
        ]
        .map(|k| {
            let at = out
                .find(&format!("\"{k}\":"))
                .unwrap_or_else(|| panic!("{k}: {out}"));
            out[at..].split([',', '}']).next().unwrap().to_string()
        })
    };
    let plain = decided(&[]);
    assert_eq!(plain, decided(&["--lag", "0"]));
    assert_ne!(plain, decided(&["--lag", "64"]));
}

#[test]
fn the_json_names_the_lag_a_pass_ran_under() {
    let t = trace("pipeline.csv.gz");
    let json = |extra: &[&str]| {
        let mut args = vec!["--backend", "host", "--allocator", "tidepool", "--json"];
        args.extend_from_slice(&["--max-ops", "2000"]);
        args.extend_from_slice(extra);
        args.push(t.to_str().unwrap());
        let o = run(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        String::from_utf8(o.stdout).unwrap()
    };
    assert!(!json(&[]).contains("\"lag\""), "no lag, no field");
    assert!(
        !json(&[]).contains("announced_capture"),
        "strict mode, no field"
    );
    let announced = json(&["--announced-capture"]);
    assert!(
        announced.contains("\"announced_capture\":true,"),
        "{announced}"
    );
    let lagged = json(&["--lag", "7"]);
    assert!(lagged.contains("\"lag\":7,"), "{lagged}");
}

/// `--interleave` runs the allocators' passes in turns (JSON lines in the
/// order they ran: tidepool 1, ideal 1, tidepool 2, ideal 2), and each
/// allocator's passes decide exactly what they decide when it runs alone;
/// the table still lists each allocator's passes together.
#[test]
fn interleaved_allocators_take_turns_and_decide_the_same() {
    let t = trace("pipeline.csv.gz");
    let lines = |extra: &[&str]| {
        let mut args = vec![
            "--backend",
            "host",
            "--passes",
            "2",
            "--max-ops",
            "12000",
            "--allocator",
            "tidepool",
            "--allocator",
            "ideal",
        ];
        args.extend_from_slice(extra);
        args.push(t.to_str().unwrap());
        let o = run(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        String::from_utf8(o.stdout).unwrap()
    };
    // The allocator and pass of each JSON line, and the decisions of
    // tidepool's passes (no timings).
    let order_and_decisions = |out: &str| {
        let field = |line: &str, k: &str| {
            let at = line
                .find(&format!("\"{k}\":"))
                .unwrap_or_else(|| panic!("{k}: {line}"));
            line[at + k.len() + 3..]
                .split([',', '}'])
                .next()
                .unwrap()
                .to_string()
        };
        let mut order = Vec::new();
        let mut decided = Vec::new();
        for line in out.lines().filter(|l| l.starts_with('{')) {
            order.push((field(line, "allocator"), field(line, "pass")));
            if field(line, "allocator") == "\"tidepool\"" {
                decided.push(
                    [
                        "peak_reserved_bytes",
                        "growths",
                        "remaps",
                        "rebinds",
                        "cache_hits",
                    ]
                    .map(|k| field(line, k)),
                );
            }
        }
        (order, decided)
    };
    let (order, decided) = order_and_decisions(&lines(&["--json", "--interleave"]));
    let named = |a: &str, p: &str| (format!("\"{a}\""), p.to_string());
    assert_eq!(
        order,
        [
            named("tidepool", "1"),
            named("ideal", "1"),
            named("tidepool", "2"),
            named("ideal", "2")
        ]
    );
    let (alone_order, alone) = order_and_decisions(&lines(&["--json"]));
    assert_eq!(
        alone_order,
        [
            named("tidepool", "1"),
            named("tidepool", "2"),
            named("ideal", "1"),
            named("ideal", "2")
        ]
    );
    assert_eq!(decided, alone, "interleaving changed what tidepool decided");
    // The table groups each allocator's passes.
    let table = lines(&["--interleave"]);
    let rows: Vec<&str> = table
        .lines()
        .filter(|l| l.starts_with("pipeline"))
        .map(|l| l.split_whitespace().nth(2).unwrap())
        .collect();
    assert_eq!(rows, ["tidepool", "tidepool", "ideal*", "ideal*"]);
}
