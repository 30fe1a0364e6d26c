//! Compiles the C test program (and the C++ shim check) against
//! `include/tidepool.h`, links it with the library cargo built for this
//! package (shared and static), and runs it on the host backend.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

fn manifest_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The directory holding a fresh `libtidepool.so` / `libtidepool.a`.
/// `cargo test` does not build a library that has no Rust crate type for
/// the tests to link, so build it here (same cargo, profile and target
/// directory), once per test process. A machine without cargo (binaries
/// staged for a GPU machine) names a directory holding both libraries,
/// built from the same commit, in `TIDEPOOL_CAPI_LIB_DIR`.
fn lib_dir() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            if let Some(dir) = std::env::var_os("TIDEPOOL_CAPI_LIB_DIR") {
                let dir = PathBuf::from(dir);
                for lib in ["libtidepool.so", "libtidepool.a"] {
                    assert!(
                        dir.join(lib).exists(),
                        "TIDEPOOL_CAPI_LIB_DIR={} holds no {lib}",
                        dir.display()
                    );
                }
                return dir;
            }
            let exe = std::env::current_exe().expect("test executable path");
            // target/<profile>/deps/<test> -> target/<profile>
            let profile_dir = exe
                .parent()
                .and_then(Path::parent)
                .expect("target/<profile> directory")
                .to_path_buf();
            let target_dir = profile_dir.parent().expect("target directory");
            let mut cmd = Command::new(env!("CARGO"));
            cmd.args(["build", "-p", "tidepool-capi", "--lib"])
                .env("CARGO_TARGET_DIR", target_dir)
                .current_dir(manifest_dir());
            if profile_dir.file_name().is_some_and(|n| n == "release") {
                cmd.arg("--release");
            }
            let status = cmd.status().expect("run cargo build");
            assert!(status.success(), "{cmd:?} failed");
            assert!(profile_dir.join("libtidepool.so").exists());
            profile_dir
        })
        .clone()
}

fn out_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tidepool-capi-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create output dir");
    dir
}

fn compile(compiler: &str, source: &Path, output: &Path, link: &[String]) {
    let include = manifest_dir().join("include");
    let mut cmd = Command::new(compiler);
    cmd.arg("-Wall")
        .arg("-Wextra")
        .arg("-Werror")
        .arg("-I")
        .arg(&include)
        .arg(source)
        .arg("-o")
        .arg(output)
        .args(link);
    let result = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {compiler}: {e}"));
    assert!(
        result.status.success(),
        "{cmd:?} failed:\n{}{}",
        String::from_utf8_lossy(&result.stdout),
        String::from_utf8_lossy(&result.stderr)
    );
}

fn run(program: &Path, expect: &str) {
    let result = Command::new(program)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", program.display()));
    let stdout = String::from_utf8_lossy(&result.stdout);
    let stderr = String::from_utf8_lossy(&result.stderr);
    assert!(
        result.status.success() && stdout.contains(expect),
        "{} failed ({}):\nstdout:\n{stdout}\nstderr:\n{stderr}",
        program.display(),
        result.status
    );
}

fn shared_link() -> Vec<String> {
    let lib = lib_dir();
    vec![
        format!("-L{}", lib.display()),
        "-ltidepool".into(),
        format!("-Wl,-rpath,{}", lib.display()),
    ]
}

fn static_link() -> Vec<String> {
    vec![
        lib_dir().join("libtidepool.a").display().to_string(),
        "-lstdc++".into(),
        "-lpthread".into(),
        "-ldl".into(),
        "-lm".into(),
    ]
}

#[test]
fn c_program_against_the_shared_library() {
    let out = out_dir("shared");
    let exe = out.join("test_capi");
    let mut link = vec!["-std=c11".to_string()];
    link.extend(shared_link());
    compile(
        "cc",
        &manifest_dir().join("tests/c/test_capi.c"),
        &exe,
        &link,
    );
    run(&exe, "all C API checks passed");
}

#[test]
fn c_program_against_the_static_library() {
    let out = out_dir("static");
    let exe = out.join("test_capi");
    let mut link = vec!["-std=c11".to_string()];
    link.extend(static_link());
    compile(
        "cc",
        &manifest_dir().join("tests/c/test_capi.c"),
        &exe,
        &link,
    );
    run(&exe, "all C API checks passed");
}

#[test]
fn cpp_shim_throws_instead_of_returning_null() {
    let out = out_dir("shim");
    let exe = out.join("test_shim");
    let mut link = vec!["-std=c++17".to_string()];
    link.extend(shared_link());
    compile(
        "c++",
        &manifest_dir().join("tests/c/test_shim.cpp"),
        &exe,
        &link,
    );
    run(&exe, "shim checks passed");
}

/// Misuse from C (NULL and foreign handles, impossible sizes, retired and
/// unknown streams, maxima below usage, several threads at once, the
/// default-pool functions without a driver): documented statuses, no crash,
/// live data intact.
#[test]
fn c_misuse_gets_documented_errors_and_corrupts_nothing() {
    let out = out_dir("attack");
    let exe = out.join("test_attack");
    let mut link = vec!["-std=c11".to_string(), "-pthread".to_string()];
    link.extend(shared_link());
    compile(
        "cc",
        &manifest_dir().join("tests/c/test_attack.c"),
        &exe,
        &link,
    );
    run(&exe, "all attack checks passed");
}

/// The Python package where PyTorch cannot be imported (hidden by the
/// script even where it is installed): clear errors from the package
/// itself, bad options refused, library-only functions working.
#[test]
fn python_package_without_torch() {
    use std::io::Write;
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    if Command::new(&python).arg("--version").output().is_err() {
        let _ = writeln!(
            std::io::stderr().lock(),
            "SKIP python_package_without_torch: {python} cannot be run here"
        );
        return;
    }
    let script = manifest_dir().join("../python/tests/check_without_torch.py");
    let result = Command::new(&python)
        .arg(&script)
        .env("TIDEPOOL_LIB", lib_dir().join("libtidepool.so"))
        .output()
        .unwrap_or_else(|e| panic!("running {python}: {e}"));
    let stdout = String::from_utf8_lossy(&result.stdout);
    assert!(
        result.status.success() && stdout.contains("python checks passed"),
        "{} failed ({}):\nstdout:\n{stdout}\nstderr:\n{}",
        script.display(),
        result.status,
        String::from_utf8_lossy(&result.stderr)
    );
}

/// A former defect of the pool itself, reached through the C API: see
/// tests/c/test_core_defects.c.
#[test]
fn c_free_after_the_use_stream_was_retired() {
    let out = out_dir("core-defects");
    let exe = out.join("test_core_defects");
    let mut link = vec!["-std=c11".to_string()];
    link.extend(shared_link());
    compile(
        "cc",
        &manifest_dir().join("tests/c/test_core_defects.c"),
        &exe,
        &link,
    );
    run(&exe, "core defect checks passed");
}
