//! The `tidepool-soak` binary: arguments that would make a run test nothing
//! are refused before it starts (exit 2, a message that says what to do),
//! and an output file is checked before the run, not after it.
//!
//! Every run here is on the host backend with a few dozen operations.

use std::path::PathBuf;
use std::process::{Command, Output};

/// The binary, found at run time: `TIDEPOOL_SOAK_BIN` if set, else the path
/// cargo compiled in when it exists (a `cargo test` run), else the copy
/// staged in `.gpu/bin/` of the checkout (a GPU machine, where the
/// compile-time path is the build machine's).
fn soak_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("TIDEPOOL_SOAK_BIN") {
        return p.into();
    }
    let built = PathBuf::from(env!("CARGO_BIN_EXE_tidepool-soak"));
    if built.exists() {
        return built;
    }
    let dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    let staged = dir.join("../.gpu/bin/tidepool-soak");
    assert!(
        staged.exists(),
        "tidepool-soak not found at {} nor {}; set TIDEPOOL_SOAK_BIN",
        built.display(),
        staged.display()
    );
    staged
}

fn run(args: &[&str]) -> Output {
    Command::new(soak_bin())
        .args(["--backend", "host"])
        .args(args)
        .env_remove("RUST_LOG")
        .output()
        .expect("run tidepool-soak")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Exit 2 with `needle` in the message, no panic, no JSON line and no
/// sign that the run started (its banner names the operation count).
fn assert_refused(o: &Output, needle: &str) {
    let err = stderr(o);
    assert_eq!(o.status.code(), Some(2), "stderr: {err}");
    assert!(err.contains(needle), "expected {needle:?} in: {err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(o.stdout.is_empty(), "the run reported a result: {err}");
    assert!(!err.contains(" ops on host"), "the run started: {err}");
}

#[test]
fn a_small_run_passes_and_reports_json() {
    let o = run(&["--ops", "40", "--quiet"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = String::from_utf8(o.stdout).unwrap();
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["passed"], true, "{out}");
    assert!(v["allocs"].as_u64().unwrap() > 0, "{out}");
}

#[test]
fn zero_operations_are_refused() {
    assert_refused(&run(&["--ops", "0"]), "--ops");
}

#[test]
fn a_zero_time_limit_is_refused() {
    assert_refused(
        &run(&["--ops", "40", "--time-limit-s", "0"]),
        "--time-limit-s",
    );
}

#[test]
fn zero_sizes_and_counts_are_refused_before_the_run() {
    assert_refused(&run(&["--ops", "40", "--min-size", "0"]), "--min-size");
    assert_refused(&run(&["--ops", "40", "--max-live", "0"]), "--max-live");
    assert_refused(&run(&["--ops", "40", "--max-pool", "0"]), "--max-pool");
    assert_refused(
        &run(&["--ops", "40", "--host-capacity", "0"]),
        "--host-capacity",
    );
}

#[test]
fn a_run_that_allocates_nothing_does_not_pass() {
    // A 1 KiB pool cap is below one page of the host device: every
    // allocation ends in out-of-memory, so nothing is filled or verified.
    let o = run(&["--ops", "40", "--max-pool", "1K", "--quiet"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "stderr: {err}");
    assert!(err.contains("allocated nothing"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn an_output_file_that_cannot_be_written_is_refused_before_the_run() {
    let missing = std::env::temp_dir()
        .join(format!("tidepool-soak-no-such-dir-{}", std::process::id()))
        .join("soak.json");
    assert_refused(
        &run(&["--ops", "40", "--out", missing.to_str().unwrap()]),
        "--out",
    );
    let dir = std::env::temp_dir();
    assert_refused(
        &run(&["--ops", "40", "--out", dir.to_str().unwrap()]),
        "--out",
    );
}

#[test]
fn the_output_file_gets_the_json_line() {
    let out = std::env::temp_dir().join(format!("tidepool-soak-{}.json", std::process::id()));
    let o = run(&["--ops", "40", "--quiet", "--out", out.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let written = std::fs::read_to_string(&out).unwrap();
    assert_eq!(written.trim(), String::from_utf8_lossy(&o.stdout).trim());
    let _ = std::fs::remove_file(out);
}

#[test]
fn an_unusable_rust_log_is_reported() {
    let o = Command::new(soak_bin())
        .args(["--backend", "host", "--ops", "20", "--quiet"])
        .env("RUST_LOG", "tidepool=loud")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("RUST_LOG"),
        "an invalid filter was silently ignored: {}",
        stderr(&o)
    );
}

#[cfg(target_os = "linux")]
#[test]
fn an_unwritable_stdout_is_an_error_not_a_panic() {
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    let o = Command::new(soak_bin())
        .args(["--backend", "host", "--ops", "20", "--quiet"])
        .stdout(full)
        .output()
        .unwrap();
    let err = stderr(&o);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("cannot write the JSON line"), "{err}");
}
