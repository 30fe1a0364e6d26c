//! A small kernel-launch facility: load PTX, look up a function, launch it,
//! plus a memset and synchronous copies, for tests and stress kernels.
//!
//! # Why `launch` is a safe function
//! A kernel reads and writes device memory only, never host memory, so no
//! launch can break Rust's memory safety on the host: a wrong pointer or
//! size makes the kernel fault on the device, which the driver reports as an
//! error (on this call or a later one). The caller must still pass
//! arguments that match the kernel's signature, in number, order and width
//! (`KernelArg::U32` for a 32-bit parameter, `Ptr`/`U64` for 64-bit ones),
//! or the kernel reads garbage; and a faulting kernel poisons the context
//! for every later call.
//!
//! Error ops: the device boundary's [`Op`] has no names for these calls, so
//! module loading, function lookup and `compute_capability` report
//! `Op::Init`, launches and memsets `Op::LaunchHost`, and the synchronous
//! copies `Op::SynchronizeStream`.

use super::driver::{check, warn_drop, Ctx};
use super::CudaDevice;
use crate::device::{DevicePtr, Stream};
use crate::error::{Op, SysError, SysResult};
use cudarc::driver::sys;
use std::ffi::{c_void, CString};
use std::sync::Arc;

struct ModuleInner {
    raw: sys::CUmodule,
    ctx: Arc<Ctx>,
}

// SAFETY: a CUmodule is a driver handle usable from any thread.
unsafe impl Send for ModuleInner {}
// SAFETY: as above; immutable after construction.
unsafe impl Sync for ModuleInner {}

impl Drop for ModuleInner {
    fn drop(&mut self) {
        if self.ctx.bind_in_drop("a module") {
            // SAFETY: loaded by cuModuleLoadData, unloaded once, after every
            // function of it (they hold this object) is gone.
            warn_drop("cuModuleUnload", unsafe { sys::cuModuleUnload(self.raw) });
        }
    }
}

/// A loaded module (`cuModuleLoadData`); unloaded (`cuModuleUnload`) when it
/// and every [`CudaFunction`] taken from it are dropped.
#[derive(Clone)]
pub struct CudaModule {
    inner: Arc<ModuleInner>,
}

/// A kernel of a [`CudaModule`]; keeps its module loaded.
#[derive(Clone)]
pub struct CudaFunction {
    raw: sys::CUfunction,
    name: String,
    _module: Arc<ModuleInner>,
}

// SAFETY: a CUfunction is a driver handle usable from any thread.
unsafe impl Send for CudaFunction {}
// SAFETY: as above; immutable after construction.
unsafe impl Sync for CudaFunction {}

impl std::fmt::Debug for CudaModule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaModule")
            .field("raw", &self.inner.raw)
            .finish()
    }
}

impl std::fmt::Debug for CudaFunction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaFunction")
            .field("name", &self.name)
            .finish()
    }
}

impl CudaFunction {
    /// The kernel's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// One kernel argument, passed by value. Widths: `Ptr`/`U64` 8 bytes,
/// `U32`/`I32` 4 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelArg {
    /// A device address.
    Ptr(DevicePtr),
    /// A 64-bit unsigned integer.
    U64(u64),
    /// A 32-bit unsigned integer.
    U32(u32),
    /// A 32-bit signed integer.
    I32(i32),
}

/// Storage of one argument, 8-byte aligned; the value sits in the first
/// bytes in native byte order, as the driver reads it.
#[repr(C, align(8))]
#[derive(Clone, Copy)]
struct ArgSlot([u8; 8]);

impl KernelArg {
    fn slot(self) -> ArgSlot {
        let mut b = [0u8; 8];
        match self {
            KernelArg::Ptr(v) | KernelArg::U64(v) => b.copy_from_slice(&v.to_ne_bytes()),
            KernelArg::U32(v) => b[..4].copy_from_slice(&v.to_ne_bytes()),
            KernelArg::I32(v) => b[..4].copy_from_slice(&v.to_ne_bytes()),
        }
        ArgSlot(b)
    }
}

impl CudaModule {
    /// Look up a kernel (`cuModuleGetFunction`).
    pub fn function(&self, name: &str) -> SysResult<CudaFunction> {
        let op = Op::Init;
        let cname = CString::new(name).map_err(|_| SysError::InvalidArgument {
            op,
            reason: format!("kernel name {name:?} contains a NUL byte"),
        })?;
        self.inner.ctx.bind(op)?;
        let mut raw: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: valid out pointer, a live module and a NUL-terminated name.
        check(op, unsafe {
            sys::cuModuleGetFunction(&mut raw, self.inner.raw, cname.as_ptr())
        })?;
        Ok(CudaFunction {
            raw,
            name: name.to_string(),
            _module: self.inner.clone(),
        })
    }
}

impl CudaDevice {
    /// Load a PTX (or cubin/fatbin text) module with `cuModuleLoadData`; the
    /// text is copied and NUL-terminated first.
    pub fn load_module(&self, ptx: &str) -> SysResult<CudaModule> {
        let op = Op::Init;
        let image = CString::new(ptx).map_err(|_| SysError::InvalidArgument {
            op,
            reason: "module text contains a NUL byte".to_string(),
        })?;
        self.bind(op)?;
        let mut raw: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: valid out pointer and a NUL-terminated image that outlives
        // the call (the driver copies what it needs).
        check(op, unsafe {
            sys::cuModuleLoadData(&mut raw, image.as_ptr().cast::<c_void>())
        })?;
        Ok(CudaModule {
            inner: Arc::new(ModuleInner {
                raw,
                ctx: self.inner.ctx.clone(),
            }),
        })
    }

    /// `(major, minor)` compute capability, e.g. `(9, 0)` on an H200.
    pub fn compute_capability(&self) -> SysResult<(i32, i32)> {
        let op = Op::Init;
        let dev = self.inner.ctx.cu_device;
        let (mut major, mut minor) = (0i32, 0i32);
        // SAFETY: valid out pointers and a device from cuDeviceGet.
        check(op, unsafe {
            sys::cuDeviceGetAttribute(
                &mut major,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
                dev,
            )
        })?;
        // SAFETY: as above.
        check(op, unsafe {
            sys::cuDeviceGetAttribute(
                &mut minor,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
                dev,
            )
        })?;
        Ok((major, minor))
    }

    /// Launch `f` on `stream` (`cuLaunchKernel`, no dynamic shared memory).
    /// Safe at the Rust level because kernels touch only device memory (see
    /// the module docs); `args` must match the kernel's signature.
    pub fn launch(
        &self,
        stream: Stream,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: &[KernelArg],
    ) -> SysResult<()> {
        let op = Op::LaunchHost;
        let mut slots: Vec<ArgSlot> = args.iter().map(|a| a.slot()).collect();
        let mut params: Vec<*mut c_void> = slots
            .iter_mut()
            .map(|s| (s as *mut ArgSlot).cast::<c_void>())
            .collect();
        self.bind(op)?;
        self.with_stream(op, stream, |raw| {
            // SAFETY: `params` holds one pointer per argument, each to an
            // 8-byte slot alive for the call (the driver copies the values
            // before returning); the function's module is kept loaded by `f`;
            // the stream is live while the table lock is held.
            check(op, unsafe {
                sys::cuLaunchKernel(
                    f.raw,
                    grid.0,
                    grid.1,
                    grid.2,
                    block.0,
                    block.1,
                    block.2,
                    0,
                    raw,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            })
        })
    }

    /// Set `count` 32-bit words at `ptr` to `value`, in stream order.
    pub fn memset_d32_async(
        &self,
        stream: Stream,
        ptr: DevicePtr,
        value: u32,
        count: usize,
    ) -> SysResult<()> {
        let op = Op::LaunchHost;
        self.bind(op)?;
        self.with_stream(op, stream, |raw| {
            // SAFETY: writes device memory only; the driver validates the range.
            check(op, unsafe { sys::cuMemsetD32Async(ptr, value, count, raw) })
        })
    }

    /// Copy `dst.len()` bytes from device address `src` into `dst`
    /// (synchronous `cuMemcpyDtoH`; waits for the legacy stream's work).
    pub fn copy_dtoh(&self, dst: &mut [u8], src: DevicePtr) -> SysResult<()> {
        let op = Op::SynchronizeStream;
        self.bind(op)?;
        // SAFETY: `dst` is a valid writable host buffer of `dst.len()` bytes,
        // borrowed mutably for the whole (synchronous) call.
        check(op, unsafe {
            sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast::<c_void>(), src, dst.len())
        })
    }

    /// Copy `src` to device address `dst` (synchronous `cuMemcpyHtoD`).
    pub fn copy_htod(&self, dst: DevicePtr, src: &[u8]) -> SysResult<()> {
        let op = Op::SynchronizeStream;
        self.bind(op)?;
        // SAFETY: `src` is a valid host buffer of `src.len()` bytes for the
        // whole (synchronous) call; the device side is checked by the driver.
        check(op, unsafe {
            sys::cuMemcpyHtoD_v2(dst, src.as_ptr().cast::<c_void>(), src.len())
        })
    }
}
