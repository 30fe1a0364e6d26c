//! Loading of the CUDA driver, error mapping and the primary context.
//!
//! Everything here is `pub(crate)`: the public face is [`super::CudaDevice`].

use crate::error::{Op, SysError, SysResult};
use cudarc::driver::sys;
use std::ffi::CStr;
use std::panic::catch_unwind;
use std::sync::OnceLock;

/// Every driver entry point the backend calls. `driver_available` checks
/// each one up front, because cudarc's dynamic loader panics on a missing
/// symbol the first time a function is called.
const REQUIRED_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxGetStreamPriorityRange",
    "cuGetErrorName",
    "cuMemGetAllocationGranularity",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemSetAccess",
    "cuMemExportToShareableHandle",
    "cuMemImportFromShareableHandle",
    "cuMemGetInfo_v2",
    "cuStreamCreate",
    "cuStreamCreateWithPriority",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamQuery",
    "cuStreamIsCapturing",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
    "cuLaunchHostFunc",
    "cuMemPoolCreate",
    "cuMemPoolDestroy",
    "cuMemPoolSetAttribute",
    "cuMemPoolGetAttribute",
    "cuMemPoolTrimTo",
    "cuMemAllocFromPoolAsync",
    "cuMemFreeAsync",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuModuleLoadData",
    "cuModuleUnload",
    "cuModuleGetFunction",
    "cuLaunchKernel",
    "cuMemsetD32Async",
    "cuMemcpyDtoH_v2",
    "cuMemcpyHtoD_v2",
];

/// The probe's outcome, computed once per process.
static PROBE: OnceLock<Result<(), String>> = OnceLock::new();

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_string()
    }
}

/// The driver library, opened by this crate itself under the names cudarc
/// tries, so the probe works whichever way cudarc reaches the driver
/// (loaded at run time, or linked by the user's `dynamic-linking` /
/// `static-linking` build, where cudarc has no loader to ask).
fn open_driver_library() -> Option<libloading::Library> {
    use std::env::consts::{DLL_PREFIX, DLL_SUFFIX};
    [
        format!("{DLL_PREFIX}cuda{DLL_SUFFIX}"),
        format!("{DLL_PREFIX}cuda{DLL_SUFFIX}.1"),
        format!("{DLL_PREFIX}nvcuda{DLL_SUFFIX}"),
        "nvcuda.dll".to_string(),
    ]
    .into_iter()
    .find_map(|candidate| {
        // SAFETY: loading the NVIDIA driver library runs only its own
        // initialisers, which are safe to run in any process.
        unsafe { libloading::Library::new(candidate) }.ok()
    })
}

fn probe() -> Result<(), String> {
    let Some(lib) = open_driver_library() else {
        return Err(
            "libcuda.so (the NVIDIA driver library) was not found; install the NVIDIA driver \
             or add its directory to LD_LIBRARY_PATH"
                .to_string(),
        );
    };
    for name in REQUIRED_SYMBOLS {
        // SAFETY: we only look the symbol up and never call it through this
        // pointer type.
        let found = unsafe { lib.get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_ok();
        if !found {
            return Err(format!(
                "libcuda lacks the symbol {name} (driver older than CUDA 13.0?)"
            ));
        }
    }
    // Every symbol is present, so no cudarc loader below can panic; keep the
    // guard anyway for a library that changes under us.
    catch_unwind(|| {
        // SAFETY: cuInit takes flags 0 and may be called any number of times.
        let r = unsafe { sys::cuInit(0) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuInit failed: {} ({})", error_name(r), r as u32));
        }
        let mut count: i32 = 0;
        // SAFETY: `count` is a valid out pointer.
        let r = unsafe { sys::cuDeviceGetCount(&mut count) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(format!(
                "cuDeviceGetCount failed: {} ({})",
                error_name(r),
                r as u32
            ));
        }
        if count <= 0 {
            return Err("the CUDA driver reports no device".to_string());
        }
        Ok(())
    })
    .map_err(|p| {
        format!(
            "initialising the CUDA driver panicked: {}",
            panic_message(&*p)
        )
    })?
}

/// `Ok` when the driver library loads, has every symbol the backend uses,
/// initialises, and reports at least one device; else why not. Cached.
pub(crate) fn probe_cached() -> Result<(), String> {
    PROBE.get_or_init(probe).clone()
}

/// The driver's name for an error code ("CUDA_ERROR_OUT_OF_MEMORY").
pub(crate) fn error_name(r: sys::CUresult) -> String {
    let mut ptr: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: only called after the probe found cuGetErrorName; `ptr` is a
    // valid out pointer, and the driver returns a static NUL-terminated string.
    let ok = unsafe { sys::cuGetErrorName(r, &mut ptr) } == sys::CUresult::CUDA_SUCCESS;
    if ok && !ptr.is_null() {
        // SAFETY: non-null pointer to a static C string owned by the driver.
        unsafe { CStr::from_ptr(ptr) }
            .to_string_lossy()
            .into_owned()
    } else {
        format!("{r:?}")
    }
}

/// Map a driver result to `SysError::Driver`.
#[inline]
pub(crate) fn check(op: Op, r: sys::CUresult) -> SysResult<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(driver_error(op, r))
    }
}

/// Map a driver result; out-of-memory becomes `SysError::OutOfMemory` with
/// the requested size and the device's free memory (best effort).
#[inline]
pub(crate) fn check_sized(op: Op, r: sys::CUresult, requested: usize) -> SysResult<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        Err(SysError::OutOfMemory {
            op,
            requested,
            available: free_memory().unwrap_or(0),
        })
    } else {
        Err(driver_error(op, r))
    }
}

#[cold]
pub(crate) fn driver_error(op: Op, r: sys::CUresult) -> SysError {
    if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        return SysError::OutOfMemory {
            op,
            requested: 0,
            available: free_memory().unwrap_or(0),
        };
    }
    SysError::Driver {
        op,
        code: r as u32,
        name: error_name(r),
    }
}

/// Free device memory of the current context, if it can be read.
fn free_memory() -> Option<usize> {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: valid out pointers; called only with a bound context.
    let r = unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) };
    (r == sys::CUresult::CUDA_SUCCESS).then_some(free)
}

/// The retained primary context of one device. Every RAII object of the
/// backend holds an `Arc` of it, so the context is released last.
#[derive(Debug)]
pub(crate) struct Ctx {
    pub(crate) cu_device: sys::CUdevice,
    pub(crate) cu_ctx: sys::CUcontext,
    pub(crate) ordinal: i32,
}

// SAFETY: a CUcontext is a driver handle usable from any thread; the driver
// API is thread-safe.
unsafe impl Send for Ctx {}
// SAFETY: as above; `Ctx` has no interior mutability.
unsafe impl Sync for Ctx {}

impl Ctx {
    /// Retain the primary context of `ordinal` (the probe must have passed).
    pub(crate) fn retain(ordinal: i32) -> SysResult<Ctx> {
        let mut cu_device: sys::CUdevice = 0;
        // SAFETY: valid out pointer; the driver is initialised by the probe.
        check(Op::Init, unsafe {
            sys::cuDeviceGet(&mut cu_device, ordinal)
        })?;
        let mut cu_ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: valid out pointer and a device from cuDeviceGet.
        check(Op::Init, unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut cu_ctx, cu_device)
        })?;
        Ok(Ctx {
            cu_device,
            cu_ctx,
            ordinal,
        })
    }

    /// Make the primary context current on this thread if it is not already.
    /// `cuCtxGetCurrent` is a thread-local read inside the driver; unlike a
    /// cache of our own it also sees context switches made by other code.
    #[inline]
    pub(crate) fn bind(&self, op: Op) -> SysResult<()> {
        let mut cur: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: valid out pointer.
        check(op, unsafe { sys::cuCtxGetCurrent(&mut cur) })?;
        if cur != self.cu_ctx {
            // SAFETY: `cu_ctx` is retained for as long as `self` lives.
            check(op, unsafe { sys::cuCtxSetCurrent(self.cu_ctx) })?;
        }
        Ok(())
    }

    /// Bind for use in a destructor: failures are logged, never raised.
    pub(crate) fn bind_in_drop(&self, what: &str) -> bool {
        match self.bind(Op::Init) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "tidepool cuda: cannot bind context to drop {what}");
                false
            }
        }
    }
}

impl Drop for Ctx {
    fn drop(&mut self) {
        // SAFETY: balanced with the cuDevicePrimaryCtxRetain in `retain`.
        let r = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.cu_device) };
        if r != sys::CUresult::CUDA_SUCCESS {
            tracing::warn!(
                code = r as u32,
                name = %error_name(r),
                ordinal = self.ordinal,
                "tidepool cuda: cuDevicePrimaryCtxRelease failed"
            );
        }
    }
}

/// Log a failed driver call made from a destructor.
pub(crate) fn warn_drop(what: &str, r: sys::CUresult) {
    if r != sys::CUresult::CUDA_SUCCESS {
        tracing::warn!(
            code = r as u32,
            name = %error_name(r),
            "tidepool cuda: {what} failed in drop"
        );
    }
}
