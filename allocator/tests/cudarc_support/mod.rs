//! Helpers of the cudarc adapter's GPU tests: a context (or a visible skip)
//! and the tag kernels (fill, verify, spin) launched through cudarc.
#![allow(dead_code)]

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DeviceSlice, LaunchConfig,
    PushKernelArg,
};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use std::io::Write;
use std::sync::Arc;
use tidepool::cudarc::PoolBuffer;

/// The tag kernels' CUDA C (the kernels crate's source).
const TAG_KERNELS_CU: &str = include_str!("../../../kernels/src/tag_kernels.cu");

/// Device 0's primary context, or `None` with a printed skip line when no
/// CUDA driver is loadable; with `TIDEPOOL_REQUIRE_GPU=1` that is a failure.
pub fn context(test: &str) -> Option<Arc<CudaContext>> {
    if !tidepool_sys::cuda::driver_available() {
        let reason = tidepool_sys::cuda::driver_unavailable_reason().unwrap_or_default();
        if std::env::var("TIDEPOOL_REQUIRE_GPU").as_deref() == Ok("1") {
            panic!("{test}: TIDEPOOL_REQUIRE_GPU=1 but no CUDA driver: {reason}");
        }
        let _ = writeln!(std::io::stderr().lock(), "SKIP {test}: {reason}");
        return None;
    }
    Some(CudaContext::new(0).expect("CudaContext::new(0)"))
}

/// `fill_tag`, `verify_tag` and `spin`, compiled by NVRTC for the device.
pub struct Tags {
    _module: Arc<CudaModule>,
    fill: CudaFunction,
    verify: CudaFunction,
    spin: CudaFunction,
}

const GRID: LaunchConfig = LaunchConfig {
    grid_dim: (264, 1, 1),
    block_dim: (256, 1, 1),
    shared_mem_bytes: 0,
};

impl Tags {
    pub fn new(ctx: &Arc<CudaContext>) -> Tags {
        let (major, minor) = ctx.compute_capability().expect("compute capability");
        let opts = CompileOptions {
            options: vec![
                format!("--gpu-architecture=compute_{major}{minor}"),
                "--std=c++17".to_string(),
            ],
            ..Default::default()
        };
        let ptx = compile_ptx_with_opts(TAG_KERNELS_CU, opts).expect("NVRTC compile");
        let module = ctx.load_module(ptx).expect("load module");
        Tags {
            fill: module.load_function("fill_tag").expect("fill_tag"),
            verify: module.load_function("verify_tag").expect("verify_tag"),
            spin: module.load_function("spin").expect("spin"),
            _module: module,
        }
    }

    /// Fill every word of `buf` with `tag`'s pattern, on `stream`.
    pub fn fill(&self, stream: &Arc<CudaStream>, buf: &mut PoolBuffer<u32>, tag: u32) {
        let words = buf.len() as u64;
        let mut launch = stream.launch_builder(&self.fill);
        launch.arg(buf).arg(&words).arg(&tag);
        // SAFETY: fill_tag writes `words` u32 words of `buf`.
        unsafe { launch.launch(GRID) }.expect("fill_tag launch");
    }

    /// Count the words of `buf` that do not hold `tag`'s pattern into
    /// `errors[0]`, on `stream`.
    pub fn verify(
        &self,
        stream: &Arc<CudaStream>,
        buf: &PoolBuffer<u32>,
        tag: u32,
        errors: &mut CudaSlice<u64>,
    ) {
        let words = buf.len() as u64;
        let mut launch = stream.launch_builder(&self.verify);
        launch.arg(buf).arg(&words).arg(&tag).arg(errors);
        // SAFETY: verify_tag reads `words` words of `buf`, adds to errors[0].
        unsafe { launch.launch(GRID) }.expect("verify_tag launch");
    }

    /// Keep `stream` busy for about `ms` milliseconds.
    pub fn spin(&self, stream: &Arc<CudaStream>, ms: u64) {
        let ns = ms * 1_000_000;
        let mut launch = stream.launch_builder(&self.spin);
        launch.arg(&ns);
        // SAFETY: spin touches no memory.
        unsafe { launch.launch(LaunchConfig::for_num_elems(1)) }.expect("spin launch");
    }
}
