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
    "cuMemAllocAsync",
    "cuStreamBeginCapture_v2",
    "cuStreamEndCapture",
    "cuGraphInstantiateWithFlags",
    "cuGraphLaunch",
    "cuGraphDestroy",
    "cuGraphExecDestroy",
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

/// `cuStreamGetCaptureInfo` in whichever form the driver exports: `_v3`
/// (CUDA 12.3 and later) or `_v2`. Looked up here rather than through
/// cudarc, whose bindings carry only one of the two depending on the CUDA
/// version feature chosen at build time. The graph and dependency outputs
/// are optional and passed as null.
type CaptureInfoV3 = unsafe extern "C" fn(
    sys::CUstream,
    *mut sys::CUstreamCaptureStatus,
    *mut u64,
    *mut sys::CUgraph,
    *mut *const sys::CUgraphNode,
    *mut *const std::ffi::c_void,
    *mut usize,
) -> sys::CUresult;
type CaptureInfoV2 = unsafe extern "C" fn(
    sys::CUstream,
    *mut sys::CUstreamCaptureStatus,
    *mut u64,
    *mut sys::CUgraph,
    *mut *const sys::CUgraphNode,
    *mut usize,
) -> sys::CUresult;

#[derive(Clone, Copy)]
enum CaptureInfoFn {
    V3(CaptureInfoV3),
    V2(CaptureInfoV2),
}

/// The library stays loaded for the process: the function pointer is only
/// valid while it is.
struct CaptureInfo {
    _lib: libloading::Library,
    f: CaptureInfoFn,
}

static CAPTURE_INFO: OnceLock<Option<CaptureInfo>> = OnceLock::new();

fn load_capture_info() -> Option<CaptureInfo> {
    let lib = open_driver_library()?;
    // SAFETY: the symbols have exactly these C signatures in cuda.h
    // (`cuStreamGetCaptureInfo_v3` since CUDA 12.3, `_v2` since 11.3); the
    // pointers are used only while `lib` (kept beside them) is loaded.
    let f = unsafe {
        if let Ok(sym) = lib.get::<CaptureInfoV3>(b"cuStreamGetCaptureInfo_v3") {
            CaptureInfoFn::V3(*sym)
        } else if let Ok(sym) = lib.get::<CaptureInfoV2>(b"cuStreamGetCaptureInfo_v2") {
            CaptureInfoFn::V2(*sym)
        } else {
            return None;
        }
    };
    Some(CaptureInfo { _lib: lib, f })
}

/// Capture status and id of a raw stream. `None` when the driver exports
/// no form of `cuStreamGetCaptureInfo`.
///
/// # Safety
/// `stream` must be a live stream of the current context (or a special
/// stream handle).
pub(crate) unsafe fn capture_info(
    stream: sys::CUstream,
) -> Option<(sys::CUresult, sys::CUstreamCaptureStatus, u64)> {
    let info = CAPTURE_INFO.get_or_init(load_capture_info).as_ref()?;
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut id = 0u64;
    // SAFETY: valid out pointers for status and id; the optional outputs
    // are null, which the driver accepts; the caller vouches for `stream`.
    let r = unsafe {
        match info.f {
            CaptureInfoFn::V3(f) => f(
                stream,
                &mut status,
                &mut id,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            ),
            CaptureInfoFn::V2(f) => f(
                stream,
                &mut status,
                &mut id,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            ),
        }
    };
    Some((r, status, id))
}

/// The capture rule a driver error code reports, if it is one.
pub(crate) fn capture_rule(r: sys::CUresult) -> Option<&'static str> {
    use sys::CUresult as R;
    Some(match r {
        R::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED => {
            "the operation is not permitted while the stream is capturing"
        }
        R::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED => {
            "the capture was invalidated by an earlier refused call"
        }
        R::CUDA_ERROR_STREAM_CAPTURE_MERGE => "two independent captures would be merged",
        R::CUDA_ERROR_STREAM_CAPTURE_UNMATCHED => "the capture was not begun on this stream",
        R::CUDA_ERROR_STREAM_CAPTURE_UNJOINED => {
            "a stream forked from the capture was not joined back into it"
        }
        R::CUDA_ERROR_STREAM_CAPTURE_ISOLATION => "a dependency would cross the capture boundary",
        R::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT => {
            "the legacy default stream would depend on a capturing stream"
        }
        R::CUDA_ERROR_CAPTURED_EVENT => "the event was last recorded in a capturing stream",
        R::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD => {
            "the capture was begun in relaxed or thread-local mode on another thread"
        }
        _ => return None,
    })
}

/// Like [`check`], but a capture rule becomes `SysError::CaptureViolation`.
pub(crate) fn check_capture(op: Op, r: sys::CUresult) -> SysResult<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    match capture_rule(r) {
        Some(rule) => Err(SysError::CaptureViolation {
            op,
            reason: format!("{rule} ({})", error_name(r)),
        }),
        None => Err(driver_error(op, r)),
    }
}
