//! The `tidepool-replay` binary: output formats and clear errors with exit
//! code 2 (never a panic) for bad input.

use std::path::PathBuf;
use std::process::{Command, Output};

/// The package directory at run time (the GPU runner sets the variable).
fn manifest_dir() -> PathBuf {
    std::env::var("CARGO_MANIFEST_DIR")
        .unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").into())
        .into()
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
