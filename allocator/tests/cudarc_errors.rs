//! The cudarc adapter's errors (no GPU needed): each says what to do, and
//! `?` into cudarc's `DriverError` keeps the kind of failure.
#![cfg(feature = "cudarc")]

use tidepool::cudarc::driver::{sys::CUresult, DriverError};
use tidepool::cudarc::CudarcError;
use tidepool::{OomReport, PoolError};

#[test]
fn errors_say_what_to_do() {
    let e = CudarcError::NonPrimaryContext { ordinal: 3 };
    assert!(e.to_string().contains("CudaContext::new(3)"), "{e}");
    let e = CudarcError::WrongDevice {
        pool_ordinal: 0,
        stream_ordinal: 1,
    };
    assert!(e.to_string().contains("device 1"), "{e}");
}

#[test]
fn driver_error_keeps_the_kind() {
    let oom = CudarcError::Pool(PoolError::OutOfMemory(Box::new(OomReport {
        requested: 1 << 30,
        reserved: 0,
        used: 0,
        largest_free_range: 0,
        device_free: None,
        max_size: None,
        cause: None,
    })));
    assert_eq!(
        DriverError::from(oom),
        DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY)
    );
    assert_eq!(
        DriverError::from(CudarcError::NonPrimaryContext { ordinal: 0 }),
        DriverError(CUresult::CUDA_ERROR_INVALID_CONTEXT)
    );
    let inner = DriverError(CUresult::CUDA_ERROR_LAUNCH_FAILED);
    assert_eq!(DriverError::from(CudarcError::Driver(inner)), inner);
}
