//! The CUDA tag kernels: `tag_kernels.cu` compiled at run time by NVRTC and
//! launched through the CUDA backend of `tidepool-sys`.
//!
//! PTX is compiled once per architecture and process (see
//! [`compile_tag_kernels`]); each [`CudaKernels`] loads it into its device
//! as a module. The mismatch counter is 8 bytes at the start of one granule
//! of the device's own VMM memory (reserve_va + create_physical + map +
//! set_access through the [`Device`](tidepool_sys::Device) trait), so it
//! needs nothing beyond the device trait and works on any device the pool
//! can map.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions};

use crate::KernelError;

/// The names of the three kernels in `tag_kernels.cu`.
pub const KERNEL_NAMES: [&str; 3] = ["fill_tag", "verify_tag", "spin"];

/// `--gpu-architecture` for PTX that a device of compute capability
/// `major.minor` can JIT: `compute_XY`.
pub fn arch_for(major: i32, minor: i32) -> String {
    format!("compute_{major}{minor}")
}

/// Whether NVRTC can be loaded here: `Ok(())`, or why not. Checked once per
/// process and cached.
///
/// cudarc's NVRTC binding panics when the library (or a symbol) is missing,
/// and its presence check is `unsafe`, which this crate may not call. So the
/// check is: a safe look for a `libnvrtc` file where the dynamic loader looks
/// (`LD_LIBRARY_PATH`, `/etc/ld.so.cache`, the default directories), then,
/// when one is there, a trivial compile with the panic caught. Set
/// `TIDEPOOL_NVRTC_PROBE=load` to skip the file look (a library reachable
/// only through an executable's RUNPATH).
pub fn nvrtc_status() -> Result<(), String> {
    static STATUS: OnceLock<Result<(), String>> = OnceLock::new();
    STATUS
        .get_or_init(|| {
            if std::env::var("TIDEPOOL_NVRTC_PROBE").as_deref() != Ok("load") {
                find_nvrtc_file()?;
            }
            let probe = "extern \"C\" __global__ void tidepool_probe() {}";
            match std::panic::catch_unwind(|| {
                compile_ptx_with_opts(probe, CompileOptions::default())
            }) {
                Ok(Ok(_)) => Ok(()),
                Ok(Err(e)) => Err(format!("NVRTC loaded but failed a trivial compile: {e}")),
                Err(panic) => Err(format!("loading NVRTC failed: {}", panic_message(&*panic))),
            }
        })
        .clone()
}

/// Whether NVRTC can be loaded here (see [`nvrtc_status`]).
pub fn nvrtc_available() -> bool {
    nvrtc_status().is_ok()
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "(panic without a message)".to_string()
    }
}

fn find_nvrtc_file() -> Result<(), String> {
    let names = cudarc::get_lib_name_candidates("nvrtc");
    let mut dirs: Vec<String> = std::env::var("LD_LIBRARY_PATH")
        .unwrap_or_default()
        .split(':')
        .filter(|d| !d.is_empty())
        .map(str::to_string)
        .collect();
    dirs.extend(
        [
            "/lib",
            "/usr/lib",
            "/lib64",
            "/usr/lib64",
            "/lib/x86_64-linux-gnu",
            "/usr/lib/x86_64-linux-gnu",
            "/lib/aarch64-linux-gnu",
            "/usr/lib/aarch64-linux-gnu",
        ]
        .map(str::to_string),
    );
    for dir in &dirs {
        for name in &names {
            if Path::new(dir).join(name).exists() {
                return Ok(());
            }
        }
    }
    if let Ok(cache) = std::fs::read("/etc/ld.so.cache") {
        for name in &names {
            let mut needle = name.as_bytes().to_vec();
            needle.push(0);
            if cache.windows(needle.len()).any(|w| w == needle.as_slice()) {
                return Ok(());
            }
        }
    }
    Err(format!(
        "no libnvrtc shared library found (looked for {} in LD_LIBRARY_PATH, /etc/ld.so.cache \
         and the default library directories; set TIDEPOOL_NVRTC_PROBE=load to try loading anyway)",
        names.first().map(String::as_str).unwrap_or("libnvrtc.so")
    ))
}

/// Compiles `tag_kernels.cu` to PTX for `arch` (e.g. `compute_90`), once per
/// architecture and process; later calls return the cached PTX.
pub fn compile_tag_kernels(arch: &str) -> Result<Arc<str>, KernelError> {
    static CACHE: OnceLock<Mutex<HashMap<String, Arc<str>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    // Held across the compile, so concurrent callers compile once.
    let mut cache = cache.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(ptx) = cache.get(arch) {
        return Ok(ptx.clone());
    }
    nvrtc_status().map_err(|reason| KernelError::NvrtcUnavailable { reason })?;
    let options = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
    ];
    let opts = CompileOptions {
        options: options.clone(),
        name: Some("tag_kernels.cu".to_string()),
        ..Default::default()
    };
    let started = std::time::Instant::now();
    let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
        compile_ptx_with_opts(crate::TAG_KERNELS_CU, opts)
    }));
    let ptx = match result {
        Ok(Ok(ptx)) => ptx,
        Ok(Err(e)) => {
            let log = match e {
                CompileError::CompileError { nvrtc, log, .. } => {
                    format!("{nvrtc:?}\n{}", log.to_string_lossy())
                }
                other => format!("{other:?}"),
            };
            return Err(KernelError::Compile {
                arch: arch.to_string(),
                options,
                log,
            });
        }
        Err(panic) => {
            return Err(KernelError::NvrtcUnavailable {
                reason: panic_message(&*panic),
            })
        }
    };
    let ptx: Arc<str> = ptx.to_src().into();
    tracing::debug!(arch, bytes = ptx.len(), elapsed = ?started.elapsed(), "compiled tag_kernels.cu with NVRTC");
    cache.insert(arch.to_string(), ptx.clone());
    Ok(ptx)
}

pub use kernels::CudaKernels;

mod kernels {
    use std::sync::Arc;

    use tidepool_sys::cuda::{CudaDevice, CudaFunction, CudaModule, KernelArg};
    use tidepool_sys::{Access, AccessDesc, Device, DevicePtr, PhysicalOptions, Stream};

    use super::{arch_for, compile_tag_kernels};
    use crate::error::device;
    use crate::{check_range, KernelError, StreamSet, TagKernels};

    /// Threads per block of fill/verify.
    const BLOCK: u32 = 256;
    /// Most blocks of fill/verify (grid-stride loops do the rest).
    const MAX_GRID: u64 = 4096;

    /// The tag kernels on a CUDA device.
    pub struct CudaKernels {
        // Declared before `module`: functions are dropped before their module.
        fill: CudaFunction,
        verify: CudaFunction,
        spin: CudaFunction,
        module: CudaModule,
        counter: Counter,
        verify_streams: StreamSet,
        arch: String,
        dev: Arc<CudaDevice>,
    }

    /// The 8-byte error counter: one granule of VMM memory.
    struct Counter {
        ptr: DevicePtr,
        size: usize,
    }

    impl CudaKernels {
        /// Compiles the kernels for `dev`'s compute capability (cached per
        /// architecture), loads them and allocates the mismatch counter.
        pub fn new(dev: Arc<CudaDevice>) -> Result<Self, KernelError> {
            let (major, minor) = dev
                .compute_capability()
                .map_err(device("querying the compute capability"))?;
            if major < 7 {
                return Err(KernelError::UnsupportedDevice { major, minor });
            }
            let arch = arch_for(major, minor);
            let ptx = match compile_tag_kernels(&arch) {
                Ok(ptx) => ptx,
                // An NVRTC older than the device: PTX for sm_90 JITs forward.
                Err(KernelError::Compile { .. }) if (major, minor) > (9, 0) => {
                    tracing::warn!(%arch, "NVRTC cannot compile for this device's architecture; using compute_90 PTX");
                    compile_tag_kernels("compute_90")?
                }
                Err(e) => return Err(e),
            };
            let module = dev
                .load_module(&ptx)
                .map_err(device("loading the tag kernels' PTX"))?;
            let function = |name: &str| {
                module
                    .function(name)
                    .map_err(device("looking up a tag kernel in its module"))
            };
            let fill = function("fill_tag")?;
            let verify = function("verify_tag")?;
            let spin = function("spin")?;
            let counter = Counter::new(&dev)?;
            preload(&dev, [&fill, &verify, &spin], counter.ptr).map_err(|source| {
                counter.free(&dev);
                KernelError::Device {
                    during: "preloading the tag kernels (an empty launch of each)",
                    source,
                }
            })?;
            tracing::debug!(%arch, counter = counter.ptr, "CUDA tag kernels ready");
            Ok(CudaKernels {
                fill,
                verify,
                spin,
                module,
                counter,
                verify_streams: StreamSet::default(),
                arch,
                dev,
            })
        }

        /// The device these kernels run on.
        pub fn device(&self) -> &Arc<CudaDevice> {
            &self.dev
        }

        /// The architecture the PTX was compiled for (`compute_XY`).
        pub fn arch(&self) -> &str {
            &self.arch
        }

        /// The loaded module (for callers that want more of its functions).
        pub fn module(&self) -> &CudaModule {
            &self.module
        }

        fn grid(nwords: u64) -> (u32, u32, u32) {
            let blocks = nwords.div_ceil(u64::from(BLOCK)).clamp(1, MAX_GRID);
            (blocks as u32, 1, 1)
        }

        fn sync_verify_streams(&self) -> Result<(), KernelError> {
            self.verify_streams
                .synchronize_all(|s| self.dev.synchronize_stream(s))
        }
    }

    /// Launches each kernel once with no work, on the legacy default stream,
    /// and waits. With lazy module loading (the default since CUDA 12.2) a
    /// kernel's code is loaded at its first launch, and NVIDIA documents that
    /// such a load may synchronise the context; loading here, at
    /// construction, keeps that out of the stress runs (a first `verify_tag`
    /// issued behind a long `spin` would otherwise risk waiting it out).
    fn preload(
        dev: &CudaDevice,
        [fill, verify, spin]: [&CudaFunction; 3],
        counter: DevicePtr,
    ) -> tidepool_sys::SysResult<()> {
        let s = dev.default_stream();
        let one = (1, 1, 1);
        dev.launch(
            s,
            fill,
            one,
            one,
            &[
                KernelArg::Ptr(counter),
                KernelArg::U64(0),
                KernelArg::U32(0),
            ],
        )?;
        dev.launch(
            s,
            verify,
            one,
            one,
            &[
                KernelArg::Ptr(counter),
                KernelArg::U64(0),
                KernelArg::U32(0),
                KernelArg::Ptr(counter),
            ],
        )?;
        dev.launch(s, spin, one, one, &[KernelArg::U64(0)])?;
        dev.synchronize_stream(s)
    }

    impl Counter {
        fn new(dev: &CudaDevice) -> Result<Self, KernelError> {
            let size = dev.granularity();
            let ptr = dev
                .reserve_va(size, size)
                .map_err(device("reserving address space for the mismatch counter"))?;
            let counter = Counter { ptr, size };
            let mapped = map_counter(dev, ptr, size);
            match mapped {
                Ok(()) => Ok(counter),
                Err(source) => {
                    counter.free(dev);
                    Err(KernelError::Device {
                        during: "allocating the mismatch counter",
                        source,
                    })
                }
            }
        }

        fn read(&self, dev: &CudaDevice) -> Result<u64, KernelError> {
            let mut bytes = [0u8; 8];
            dev.copy_dtoh(&mut bytes, self.ptr)
                .map_err(device("reading the mismatch counter"))?;
            Ok(u64::from_le_bytes(bytes))
        }

        /// Unmaps (when mapped) and gives the address range back, logging failures.
        fn free(&self, dev: &CudaDevice) {
            // Unmapping a range that was never mapped fails harmlessly.
            let _ = dev.unmap(self.ptr, self.size);
            if let Err(e) = dev.free_va(self.ptr, self.size) {
                tracing::warn!(error = %e, "freeing the tag kernels' counter address range");
            }
        }
    }

    /// Backs the counter's range with one granule, gives this device
    /// read-write access and zeroes the counter.
    fn map_counter(dev: &CudaDevice, ptr: DevicePtr, size: usize) -> tidepool_sys::SysResult<()> {
        let phys = dev.create_physical(size, PhysicalOptions::default())?;
        let map = dev.map(ptr, size, phys, 0);
        // Mapped memory lives on after its handle is released.
        let release = dev.release_physical(phys);
        map?;
        release?;
        dev.set_access(
            ptr,
            size,
            &[AccessDesc {
                device: dev.ordinal(),
                access: Access::ReadWrite,
            }],
        )?;
        dev.copy_htod(ptr, &[0u8; 8])
    }

    impl TagKernels for CudaKernels {
        fn fill_tag(
            &self,
            stream: Stream,
            ptr: DevicePtr,
            len: usize,
            tag: u32,
        ) -> Result<(), KernelError> {
            let nwords = check_range(ptr, len)?;
            if nwords == 0 {
                return Ok(());
            }
            self.dev
                .launch(
                    stream,
                    &self.fill,
                    Self::grid(nwords),
                    (BLOCK, 1, 1),
                    &[
                        KernelArg::Ptr(ptr),
                        KernelArg::U64(nwords),
                        KernelArg::U32(tag),
                    ],
                )
                .map_err(device("launching fill_tag"))
        }

        fn verify_tag(
            &self,
            stream: Stream,
            ptr: DevicePtr,
            len: usize,
            tag: u32,
        ) -> Result<(), KernelError> {
            let nwords = check_range(ptr, len)?;
            if nwords == 0 {
                return Ok(());
            }
            self.verify_streams.insert(stream);
            self.dev
                .launch(
                    stream,
                    &self.verify,
                    Self::grid(nwords),
                    (BLOCK, 1, 1),
                    &[
                        KernelArg::Ptr(ptr),
                        KernelArg::U64(nwords),
                        KernelArg::U32(tag),
                        KernelArg::Ptr(self.counter.ptr),
                    ],
                )
                .map_err(device("launching verify_tag"))
        }

        fn spin(&self, stream: Stream, ns: u64) -> Result<(), KernelError> {
            self.dev
                .launch(
                    stream,
                    &self.spin,
                    (1, 1, 1),
                    (1, 1, 1),
                    &[KernelArg::U64(ns)],
                )
                .map_err(device("launching spin"))
        }

        fn mismatches(&self) -> Result<u64, KernelError> {
            self.sync_verify_streams()?;
            self.counter.read(&self.dev)
        }

        fn reset_counters(&self) -> Result<(), KernelError> {
            self.sync_verify_streams()?;
            self.dev
                .copy_htod(self.counter.ptr, &[0u8; 8])
                .map_err(device("resetting the mismatch counter"))
        }

        fn backend_name(&self) -> &'static str {
            "cuda"
        }
    }

    impl Drop for CudaKernels {
        fn drop(&mut self) {
            // Verifies still in flight write the counter: wait for them first.
            if let Err(e) = self.sync_verify_streams() {
                tracing::warn!(error = %e, "dropping CUDA tag kernels");
            }
            self.counter.free(&self.dev);
        }
    }
}
