//! The error type of the tag kernels.

use std::fmt;
use tidepool_sys::{DevicePtr, SysError};

/// A failure of the tag kernels. Each message says what to do about it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KernelError {
    /// The NVRTC library could not be loaded (or lacks a symbol this build
    /// of cudarc needs).
    NvrtcUnavailable { reason: String },
    /// NVRTC rejected `tag_kernels.cu`.
    Compile {
        /// The `--gpu-architecture` it compiled for.
        arch: String,
        /// Every option passed to NVRTC.
        options: Vec<String>,
        /// What NVRTC said (the program log, or the failing call).
        log: String,
    },
    /// A call into the device backend failed.
    Device {
        /// What the kernel set was doing.
        during: &'static str,
        source: SysError,
    },
    /// The device is too old for the kernels (they need compute capability
    /// 7.0 for `nanosleep`).
    UnsupportedDevice { major: i32, minor: i32 },
    /// `len` is not a multiple of 4 bytes.
    UnalignedLength { len: usize },
    /// `ptr` is not 4-byte aligned.
    UnalignedPointer { ptr: DevicePtr },
    /// `ptr + len` does not fit in 64 bits.
    RangeOverflow { ptr: DevicePtr, len: usize },
}

impl fmt::Display for KernelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KernelError::NvrtcUnavailable { reason } => write!(
                f,
                "NVRTC (libnvrtc) is not available, so the CUDA tag kernels cannot be compiled: \
                 {reason}; install the CUDA toolkit's NVRTC (CUDA 13) and put its directory on \
                 LD_LIBRARY_PATH"
            ),
            KernelError::Compile { arch, options, log } => write!(
                f,
                "NVRTC failed to compile kernels/src/tag_kernels.cu for {arch} (options {options:?}); \
                 fix the source or the options. NVRTC said:\n{log}"
            ),
            KernelError::Device { during, source } => write!(f, "{during}: {source}"),
            KernelError::UnsupportedDevice { major, minor } => write!(
                f,
                "the tag kernels need compute capability 7.0 or newer (nanosleep); this device \
                 has {major}.{minor}"
            ),
            KernelError::UnalignedLength { len } => write!(
                f,
                "length {len} is not a multiple of 4 bytes: the tag kernels work on 32-bit words; \
                 round the range to whole words"
            ),
            KernelError::UnalignedPointer { ptr } => write!(
                f,
                "pointer {ptr:#x} is not 4-byte aligned: the tag kernels work on 32-bit words"
            ),
            KernelError::RangeOverflow { ptr, len } => write!(
                f,
                "range {ptr:#x} + {len} bytes wraps around the 64-bit address space"
            ),
        }
    }
}

impl std::error::Error for KernelError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            KernelError::Device { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// Wraps a device error with what the kernel set was doing.
pub(crate) fn device(during: &'static str) -> impl FnOnce(SysError) -> KernelError {
    move |source| KernelError::Device { during, source }
}
