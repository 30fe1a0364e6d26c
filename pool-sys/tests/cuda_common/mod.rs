//! Shared helpers of the CUDA backend's tests (not a test target itself).

#![allow(dead_code)]

use tidepool_sys::cuda::{driver_available, driver_unavailable_reason, CudaDevice};
use tidepool_sys::Device;

/// The device to test on, or `None` (after saying why) when this machine has
/// no CUDA driver. With `TIDEPOOL_REQUIRE_GPU=1` a missing driver fails the
/// test instead.
pub fn device_or_skip() -> Option<CudaDevice> {
    if !driver_available() {
        let reason = driver_unavailable_reason().unwrap_or_default();
        if std::env::var("TIDEPOOL_REQUIRE_GPU").as_deref() == Ok("1") {
            panic!("TIDEPOOL_REQUIRE_GPU=1 but no CUDA driver: {reason}");
        }
        // Outside libtest's capture, so that the skip shows in every run;
        // libtest names each test's thread after the test.
        use std::io::Write;
        let thread = std::thread::current();
        let test = thread.name().unwrap_or("a CUDA test");
        let _ = writeln!(
            std::io::stderr().lock(),
            "SKIP {test}: no CUDA driver ({reason})"
        );
        return None;
    }
    Some(CudaDevice::new(0).expect("CudaDevice::new(0) with a driver present"))
}

/// Read-write access for the device itself.
pub fn rw(dev: &CudaDevice) -> [tidepool_sys::AccessDesc; 1] {
    [tidepool_sys::AccessDesc {
        device: dev.ordinal(),
        access: tidepool_sys::Access::ReadWrite,
    }]
}

/// A recognisable byte pattern.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}
