//! The CUDA source compiles with NVRTC (no GPU needed; skipped, with the
//! reason printed, where NVRTC cannot be loaded).
#![forbid(unsafe_code)]

use tidepool_kernels::cuda::{arch_for, compile_tag_kernels, nvrtc_status, KERNEL_NAMES};

#[test]
fn tag_kernels_compile_for_hopper() {
    if let Err(reason) = nvrtc_status() {
        if std::env::var("TIDEPOOL_REQUIRE_GPU").as_deref() == Ok("1") {
            panic!("TIDEPOOL_REQUIRE_GPU=1 but NVRTC is not loadable: {reason}");
        }
        // Outside libtest's capture, so that the skip shows in every run.
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr().lock(),
            "SKIP tag_kernels_compile_for_hopper: NVRTC is not loadable: {reason}"
        );
        return;
    }
    let arch = arch_for(9, 0);
    assert_eq!(arch, "compute_90");
    let ptx = compile_tag_kernels(&arch).unwrap_or_else(|e| panic!("{e}"));
    for name in KERNEL_NAMES {
        assert!(
            ptx.contains(&format!(".entry {name}(")),
            "PTX lacks the entry {name}:\n{ptx}"
        );
    }
    assert!(ptx.contains("globaltimer"), "spin must read %globaltimer");
    // Cached: the same PTX object comes back.
    let again = compile_tag_kernels(&arch).unwrap();
    assert!(std::sync::Arc::ptr_eq(&ptx, &again));
}

#[test]
fn bad_source_reports_the_log() {
    // The Display of a compile error carries NVRTC's log; checked without
    // NVRTC by building the error by hand.
    let e = tidepool_kernels::KernelError::Compile {
        arch: "compute_90".into(),
        options: vec!["--gpu-architecture=compute_90".into()],
        log: "tag_kernels.cu(3): error: identifier \"x\" is undefined".into(),
    };
    let msg = e.to_string();
    assert!(msg.contains("identifier \"x\" is undefined"), "{msg}");
    assert!(msg.contains("compute_90"), "{msg}");
}

#[test]
fn unavailable_nvrtc_is_reported_not_a_panic() {
    // Where NVRTC is missing, compiling is a typed error (never a panic).
    if nvrtc_status().is_ok() {
        return;
    }
    let err = compile_tag_kernels("compute_90").unwrap_err();
    assert!(
        matches!(err, tidepool_kernels::KernelError::NvrtcUnavailable { .. }),
        "{err}"
    );
    eprintln!("as expected without NVRTC: {err}");
}
