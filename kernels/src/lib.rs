//! tidepool-kernels: tag kernels that run on a stream, on both backends.
//!
//! The stream-order stress suite writes a *tag* into every allocation it
//! hands to a stream ([`TagKernels::fill_tag`]), checks it later on another
//! (or the same) stream ([`TagKernels::verify_tag`]), and stretches races
//! open with [`TagKernels::spin`]. Memory handed out twice to overlapping
//! work shows up as mismatching words in [`TagKernels::mismatches`].
//!
//! Two implementations behind the one trait:
//! - [`host::HostKernels`]: host tasks on the host backend's streams, which
//!   touch the memory through the backend's checked word view (a task that
//!   reaches unmapped or inaccessible memory is counted, not a crash);
//! - [`cuda::CudaKernels`]: CUDA C (`src/tag_kernels.cu`) compiled at run
//!   time by NVRTC for the device's compute capability and launched through
//!   the CUDA backend of `tidepool-sys`.
//!
//! The pattern: the 32-bit word at byte address `a` holds
//! `tag ^ mix(a / 4)` ([`tag_word`]). Since it depends on the absolute
//! address, any sub-range of a filled range verifies, and two different tags
//! differ in every word.
//!
//! [`stress::run_stress`] is the one stress harness over both (used by the
//! tests in `tests/stress_ci.rs` and `tests/scenarios.rs` and by the
//! `tidepool-soak` binary).
//!
//! This crate holds no `unsafe` (house rule: unsafe only in pool-sys).
#![forbid(unsafe_code)]

pub mod cuda;
mod error;
pub mod host;
pub mod stress;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

pub use error::KernelError;
pub use tidepool_sys::{DevicePtr, Stream};

/// The CUDA C source of the kernels (compiled by NVRTC at run time).
pub const TAG_KERNELS_CU: &str = include_str!("tag_kernels.cu");

/// Tag kernels on a stream. One stress harness drives every backend through
/// this trait (`Arc<dyn TagKernels>`).
///
/// Ranges: `len` is a multiple of 4 and `ptr` is 4-aligned, else
/// [`KernelError::UnalignedLength`] / [`KernelError::UnalignedPointer`]
/// (checked before anything is enqueued). `len == 0` enqueues nothing.
pub trait TagKernels: Send + Sync {
    /// Fill `len` bytes at `ptr` with the tag's words ([`tag_word`]), on `stream`.
    fn fill_tag(
        &self,
        stream: Stream,
        ptr: DevicePtr,
        len: usize,
        tag: u32,
    ) -> Result<(), KernelError>;
    /// Check those bytes on `stream`; count mismatching words into this kernel
    /// set's mismatch counter.
    fn verify_tag(
        &self,
        stream: Stream,
        ptr: DevicePtr,
        len: usize,
        tag: u32,
    ) -> Result<(), KernelError>;
    /// Keep `stream` busy for about `ns` nanoseconds (stretches races wide open).
    fn spin(&self, stream: Stream, ns: u64) -> Result<(), KernelError>;
    /// Total mismatches counted so far. Waits for every verify enqueued before
    /// the call (host: all of them; CUDA: synchronises every stream a verify
    /// was enqueued on) before it reads the counter.
    fn mismatches(&self) -> Result<u64, KernelError>;
    /// Host backend: how many fill/verify tasks found their range unmapped or
    /// inaccessible (waits like [`TagKernels::mismatches`]). CUDA: always 0,
    /// because a kernel touching unmapped memory is a sticky device error,
    /// which the next call that synchronises returns as
    /// [`KernelError::Device`].
    fn access_faults(&self) -> Result<u64, KernelError> {
        Ok(0)
    }
    /// Wait like [`TagKernels::mismatches`], then set the mismatch (and access
    /// fault) counters back to zero.
    fn reset_counters(&self) -> Result<(), KernelError>;
    /// "host" or "cuda".
    fn backend_name(&self) -> &'static str;
}

/// The 32-bit word the tag kernels write at byte address `addr` (4-aligned)
/// for `tag`: `tag ^ mix(addr / 4)`. The host twin of `tp_mix` in
/// `tag_kernels.cu`; the two must stay identical.
#[inline]
pub fn tag_word(tag: u32, addr: DevicePtr) -> u32 {
    let w = addr >> 2;
    let mut x = (w as u32) ^ ((w >> 32) as u32).wrapping_mul(0x9E37_79B9) ^ 0x6A09_E667;
    x ^= x >> 16;
    x = x.wrapping_mul(0x7FEB_352D);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846C_A68B);
    x ^= x >> 16;
    tag ^ x
}

/// Checks a range for the tag kernels and returns its length in words.
pub fn check_range(ptr: DevicePtr, len: usize) -> Result<u64, KernelError> {
    if len % 4 != 0 {
        return Err(KernelError::UnalignedLength { len });
    }
    if ptr % 4 != 0 {
        return Err(KernelError::UnalignedPointer { ptr });
    }
    if ptr.checked_add(len as u64).is_none() {
        return Err(KernelError::RangeOverflow { ptr, len });
    }
    Ok((len / 4) as u64)
}

/// Host tag kernels for a host device, as a trait object.
pub fn kernels_for_host(dev: Arc<tidepool_sys::host::HostDevice>) -> Arc<dyn TagKernels> {
    Arc::new(host::HostKernels::new(dev))
}

/// CUDA tag kernels for a CUDA device (compiles the kernels with NVRTC on
/// first use), as a trait object.
pub fn kernels_for_cuda(
    dev: Arc<tidepool_sys::cuda::CudaDevice>,
) -> Result<Arc<dyn TagKernels>, KernelError> {
    Ok(Arc::new(cuda::CudaKernels::new(dev)?))
}

/// Devices that have tag kernels, so a harness generic over the device can
/// get the right kernel set: `fn stress<D: Device + WithTagKernels>(dev: Arc<D>)`.
pub trait WithTagKernels {
    /// This device's tag kernels.
    fn tag_kernels(self: Arc<Self>) -> Result<Arc<dyn TagKernels>, KernelError>;
}

impl WithTagKernels for tidepool_sys::host::HostDevice {
    fn tag_kernels(self: Arc<Self>) -> Result<Arc<dyn TagKernels>, KernelError> {
        Ok(kernels_for_host(self))
    }
}

impl WithTagKernels for tidepool_sys::cuda::CudaDevice {
    fn tag_kernels(self: Arc<Self>) -> Result<Arc<dyn TagKernels>, KernelError> {
        kernels_for_cuda(self)
    }
}

/// The streams some kernel was enqueued on (so they can be synchronised
/// before a counter is read).
#[derive(Debug, Default)]
pub(crate) struct StreamSet {
    streams: Mutex<HashSet<Stream>>,
}

impl StreamSet {
    pub(crate) fn insert(&self, stream: Stream) {
        let mut s = self.streams.lock().unwrap_or_else(|e| e.into_inner());
        s.insert(stream);
    }

    /// Synchronise every stream with `sync`. A stream that no longer exists
    /// (destroyed since) is forgotten with a warning: its queued work still
    /// runs, but can no longer be waited for through it.
    pub(crate) fn synchronize_all(
        &self,
        mut sync: impl FnMut(Stream) -> tidepool_sys::SysResult<()>,
    ) -> Result<(), KernelError> {
        let streams: Vec<Stream> = {
            let s = self.streams.lock().unwrap_or_else(|e| e.into_inner());
            s.iter().copied().collect()
        };
        for stream in streams {
            match sync(stream) {
                Ok(()) => {}
                Err(tidepool_sys::SysError::InvalidHandle { .. }) => {
                    tracing::warn!(
                        %stream,
                        "tag kernels: a stream that ran a verify was destroyed before the \
                         counter was read; its verifies may not be counted yet"
                    );
                    self.streams
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&stream);
                }
                Err(source) => {
                    return Err(KernelError::Device {
                        during: "synchronising a stream before reading the mismatch counter",
                        source,
                    })
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tag_words_differ_between_tags_and_addresses() {
        for addr in (0..4096u64).step_by(4) {
            assert_ne!(tag_word(1, addr), tag_word(2, addr));
            assert_eq!(tag_word(1, addr) ^ tag_word(2, addr), 3);
        }
        let words: HashSet<u32> = (0..4096u64).step_by(4).map(|a| tag_word(0, a)).collect();
        assert_eq!(
            words.len(),
            1024,
            "mix is a bijection of the low word index"
        );
        // High address bits matter too.
        assert_ne!(tag_word(7, 0x1000), tag_word(7, 0x1000 + (1 << 34)));
    }

    #[test]
    fn range_checks() {
        assert_eq!(check_range(0x1000, 16).unwrap(), 4);
        assert_eq!(check_range(0x1000, 0).unwrap(), 0);
        assert!(matches!(
            check_range(0x1000, 6),
            Err(KernelError::UnalignedLength { len: 6 })
        ));
        assert!(matches!(
            check_range(0x1002, 8),
            Err(KernelError::UnalignedPointer { ptr: 0x1002 })
        ));
        assert!(matches!(
            check_range(u64::MAX - 3, 8),
            Err(KernelError::RangeOverflow { .. })
        ));
    }
}
