//! A cudarc program on a tidepool pool: an NVRTC kernel, memcpy both ways,
//! a cuBLAS sgemm, and work forked onto a second stream and joined. It is
//! the plain cudarc program with three lines changed (marked `tidepool:`);
//! `docs/cudarc.md` shows the diff.
//!
//! Run: `cargo run --release -p tidepool --example cudarc_port`. Without a
//! CUDA driver it says so and exits successfully.

use cudarc::cublas::{sys::cublasOperation_t, CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::compile_ptx;
use tidepool::cudarc::PoolStream; // tidepool: added

const AXPY: &str = r#"
extern "C" __global__ void axpy(float a, const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) { y[i] = a * x[i] + y[i]; }
}
"#;

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let ctx = CudaContext::new(0)?;
    let stream = PoolStream::new(ctx.default_stream())?; // tidepool: was ctx.default_stream()
    let module = ctx.load_module(compile_ptx(AXPY)?)?;
    let axpy = module.load_function("axpy")?;

    // memcpy host -> device, a kernel, memcpy device -> host.
    let n = 1 << 20;
    let x_host: Vec<f32> = (0..n).map(|i| (i % 1000) as f32).collect();
    let y_host: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    let x = stream.clone_htod(&x_host)?;
    let mut y = stream.clone_htod(&y_host)?;
    let (a, n_i32) = (2.0f32, n as i32);
    let mut launch = stream.launch_builder(&axpy);
    launch.arg(&a).arg(&x).arg(&mut y).arg(&n_i32);
    // SAFETY: axpy reads n floats of x and writes n floats of y.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }?;

    // Work forked onto a second stream: z = 1 * y + 0, reading y there.
    let side = PoolStream::new(stream.fork()?)?; // tidepool: was stream.fork()?
    let mut z = side.alloc_zeros::<f32>(n)?;
    let one = 1.0f32;
    let mut launch = side.launch_builder(&axpy);
    launch.arg(&one).arg(&y).arg(&mut z).arg(&n_i32);
    // SAFETY: as above, on z.
    unsafe { launch.launch(LaunchConfig::for_num_elems(n as u32)) }?;
    stream.join(&side)?;

    // cuBLAS sgemm: C (m x n) = A (m x k) * B (k x n), column-major.
    let (m, k, nn) = (256usize, 128usize, 64usize);
    let a_host: Vec<f32> = (0..m * k).map(|i| ((i % 13) as f32) * 0.25).collect();
    let b_host: Vec<f32> = (0..k * nn).map(|i| ((i % 5) as f32) - 2.0).collect();
    let a_dev = stream.clone_htod(&a_host)?;
    let b_dev = stream.clone_htod(&b_host)?;
    let mut c_dev = stream.alloc_zeros::<f32>(m * nn)?;
    let blas = CudaBlas::new(stream.clone())?;
    let cfg = GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_N,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: m as i32,
        n: nn as i32,
        k: k as i32,
        alpha: 1.0f32,
        lda: m as i32,
        ldb: k as i32,
        beta: 0.0f32,
        ldc: m as i32,
    };
    // SAFETY: the matrices have the sizes the configuration says.
    unsafe { blas.gemm(cfg, &a_dev, &b_dev, &mut c_dev) }?;

    let y_back = stream.clone_dtoh(&y)?;
    let z_back = stream.clone_dtoh(&z)?;
    let c_back = stream.clone_dtoh(&c_dev)?;

    // Check against the host.
    let mut bad = 0usize;
    for i in 0..n {
        let want = a * x_host[i] + y_host[i];
        bad += usize::from(y_back[i] != want || z_back[i] != want);
    }
    for col in 0..nn {
        for row in 0..m {
            let want: f32 = (0..k)
                .map(|l| a_host[row + l * m] * b_host[l + col * k])
                .sum();
            let got = c_back[row + col * m];
            bad += usize::from((got - want).abs() > 1e-3 * want.abs().max(1.0));
        }
    }
    println!(
        "axpy over {n} floats, fork/join and a {m}x{k} * {k}x{nn} sgemm: {bad} mismatches; \
         y[12345] = {}, c[0] = {}",
        y_back[12345], c_back[0]
    );
    if bad != 0 {
        return Err(format!("{bad} results differ from the host's").into());
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    if !tidepool_sys::cuda::driver_available() {
        println!(
            "cudarc_port: no CUDA driver here ({}); nothing to run",
            tidepool_sys::cuda::driver_unavailable_reason().unwrap_or_default()
        );
        return std::process::ExitCode::SUCCESS;
    }
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cudarc_port: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
