//! Status codes, the thread-local last error, and the guard every entry
//! point runs its body in (no panic may unwind across `extern "C"`).

use std::cell::RefCell;
use std::ffi::{c_char, c_int, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use tidepool_core::PoolError;
use tidepool_sys::SysError;

/// Result of every libtidepool call. 0 is success; on any other value
/// `tidepool_last_error()` describes the failure.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum tidepool_status {
    /// Success.
    TIDEPOOL_OK = 0,
    /// An argument is unusable (NULL out-pointer, bad configuration value).
    TIDEPOOL_ERROR_INVALID_ARGUMENT = 1,
    /// No memory could be found or created for the request (or the pool's
    /// maximum size would be passed).
    TIDEPOOL_ERROR_OUT_OF_MEMORY = 2,
    /// The pointer was already freed and not handed out since.
    TIDEPOOL_ERROR_DOUBLE_FREE = 3,
    /// The pointer was never handed out by this pool, or points inside an
    /// allocation rather than at its start.
    TIDEPOOL_ERROR_INVALID_POINTER = 4,
    /// The pointer belongs to another pool.
    TIDEPOOL_ERROR_WRONG_POOL = 5,
    /// The stream is unknown to the pool or was retired.
    TIDEPOOL_ERROR_INVALID_STREAM = 6,
    /// The stream is being captured into a CUDA graph; allocating or
    /// freeing on it is not supported.
    TIDEPOOL_ERROR_STREAM_CAPTURING = 7,
    /// No CUDA driver could be loaded (or no device exists).
    TIDEPOOL_ERROR_DRIVER_UNAVAILABLE = 8,
    /// A driver call failed.
    TIDEPOOL_ERROR_DEVICE = 9,
    /// The operation is not available on this pool's backend.
    TIDEPOOL_ERROR_UNSUPPORTED = 10,
    /// The request is larger than the pool's address space.
    TIDEPOOL_ERROR_TOO_LARGE = 11,
    /// The call was made in a state that does not allow it (for example,
    /// configuring default pools after one was created).
    TIDEPOOL_ERROR_INVALID_STATE = 12,
    /// A bug in libtidepool: it panicked. The message says where.
    TIDEPOOL_ERROR_PANIC = 13,
}

use tidepool_status::*;

/// A failure: its status and the message `tidepool_last_error` will give.
#[derive(Debug)]
pub(crate) struct Failure {
    pub status: tidepool_status,
    pub message: String,
}

impl Failure {
    pub fn new(status: tidepool_status, message: impl Into<String>) -> Self {
        Failure {
            status,
            message: message.into(),
        }
    }
    pub fn null(what: &str) -> Self {
        Failure::new(
            TIDEPOOL_ERROR_INVALID_ARGUMENT,
            format!("{what} is NULL; pass a valid pointer"),
        )
    }
}

fn sys_status(e: &SysError) -> tidepool_status {
    match e {
        SysError::DriverUnavailable { .. } => TIDEPOOL_ERROR_DRIVER_UNAVAILABLE,
        SysError::InvalidHandle { what: "stream", .. }
        | SysError::ForeignHandle { what: "stream", .. } => TIDEPOOL_ERROR_INVALID_STREAM,
        SysError::Unsupported { .. } => TIDEPOOL_ERROR_UNSUPPORTED,
        e if e.is_out_of_memory() => TIDEPOOL_ERROR_OUT_OF_MEMORY,
        _ => TIDEPOOL_ERROR_DEVICE,
    }
}

impl From<PoolError> for Failure {
    fn from(e: PoolError) -> Self {
        let status = match &e {
            PoolError::OutOfMemory(_) => TIDEPOOL_ERROR_OUT_OF_MEMORY,
            PoolError::Device(s) => sys_status(s),
            PoolError::StreamCapturing { .. }
            | PoolError::EagerFreeInCapture { .. }
            | PoolError::CapturedUse { .. } => TIDEPOOL_ERROR_STREAM_CAPTURING,
            PoolError::StreamRetired { .. } => TIDEPOOL_ERROR_INVALID_STREAM,
            PoolError::WrongPool { .. } | PoolError::ForeignPointer { .. } => {
                TIDEPOOL_ERROR_WRONG_POOL
            }
            PoolError::DoubleFree { .. } => TIDEPOOL_ERROR_DOUBLE_FREE,
            PoolError::InteriorPointer { .. } | PoolError::UnknownPointer { .. } => {
                TIDEPOOL_ERROR_INVALID_POINTER
            }
            PoolError::TooLarge { .. } => TIDEPOOL_ERROR_TOO_LARGE,
            PoolError::InvalidConfig { .. } => TIDEPOOL_ERROR_INVALID_ARGUMENT,
            _ => TIDEPOOL_ERROR_DEVICE,
        };
        Failure::new(status, e.to_string())
    }
}

impl From<SysError> for Failure {
    fn from(e: SysError) -> Self {
        Failure::new(sys_status(&e), e.to_string())
    }
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

pub(crate) fn set_last_error(message: &str) {
    // Interior NULs cannot appear in a C string: replace them.
    let c = CString::new(message.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic payload".into())
}

/// Run an entry point's body: a panic becomes `TIDEPOOL_ERROR_PANIC`, a
/// failure sets the thread's last error and returns its status.
pub(crate) fn guard(name: &str, body: impl FnOnce() -> Result<(), Failure>) -> tidepool_status {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => TIDEPOOL_OK,
        Ok(Err(f)) => {
            set_last_error(&format!("{name}: {}", f.message));
            f.status
        }
        Err(p) => {
            let msg = format!(
                "{name}: internal error (panic: {}); please report it",
                panic_message(&*p)
            );
            tracing::error!("{msg}");
            set_last_error(&msg);
            TIDEPOOL_ERROR_PANIC
        }
    }
}

/// The message of the last failed call on this thread (empty if none).
/// The string stays valid until the next libtidepool call on this thread.
#[no_mangle]
pub extern "C" fn tidepool_last_error() -> *const c_char {
    // `with` cannot panic here except during thread teardown; guard anyway.
    catch_unwind(|| LAST_ERROR.with(|e| e.borrow().as_ptr())).unwrap_or(c"".as_ptr())
}

/// A constant name for a status code ("TIDEPOOL_ERROR_OUT_OF_MEMORY"...);
/// "TIDEPOOL_UNKNOWN_STATUS" for a value that is not one.
#[no_mangle]
pub extern "C" fn tidepool_status_string(status: c_int) -> *const c_char {
    // The parameter is an int, not the enum: C may pass any int value, and
    // a Rust enum holding a value outside its variants is undefined
    // behaviour (a status from a newer library, a file, a stray cast).
    catch_unwind(|| status_name(status).as_ptr()).unwrap_or(c"".as_ptr())
}

fn status_name(status: c_int) -> &'static std::ffi::CStr {
    const ALL: [tidepool_status; 14] = [
        TIDEPOOL_OK,
        TIDEPOOL_ERROR_INVALID_ARGUMENT,
        TIDEPOOL_ERROR_OUT_OF_MEMORY,
        TIDEPOOL_ERROR_DOUBLE_FREE,
        TIDEPOOL_ERROR_INVALID_POINTER,
        TIDEPOOL_ERROR_WRONG_POOL,
        TIDEPOOL_ERROR_INVALID_STREAM,
        TIDEPOOL_ERROR_STREAM_CAPTURING,
        TIDEPOOL_ERROR_DRIVER_UNAVAILABLE,
        TIDEPOOL_ERROR_DEVICE,
        TIDEPOOL_ERROR_UNSUPPORTED,
        TIDEPOOL_ERROR_TOO_LARGE,
        TIDEPOOL_ERROR_INVALID_STATE,
        TIDEPOOL_ERROR_PANIC,
    ];
    match ALL.into_iter().find(|s| *s as c_int == status) {
        Some(s) => known_status_name(s),
        None => c"TIDEPOOL_UNKNOWN_STATUS",
    }
}

fn known_status_name(status: tidepool_status) -> &'static std::ffi::CStr {
    match status {
        TIDEPOOL_OK => c"TIDEPOOL_OK",
        TIDEPOOL_ERROR_INVALID_ARGUMENT => c"TIDEPOOL_ERROR_INVALID_ARGUMENT",
        TIDEPOOL_ERROR_OUT_OF_MEMORY => c"TIDEPOOL_ERROR_OUT_OF_MEMORY",
        TIDEPOOL_ERROR_DOUBLE_FREE => c"TIDEPOOL_ERROR_DOUBLE_FREE",
        TIDEPOOL_ERROR_INVALID_POINTER => c"TIDEPOOL_ERROR_INVALID_POINTER",
        TIDEPOOL_ERROR_WRONG_POOL => c"TIDEPOOL_ERROR_WRONG_POOL",
        TIDEPOOL_ERROR_INVALID_STREAM => c"TIDEPOOL_ERROR_INVALID_STREAM",
        TIDEPOOL_ERROR_STREAM_CAPTURING => c"TIDEPOOL_ERROR_STREAM_CAPTURING",
        TIDEPOOL_ERROR_DRIVER_UNAVAILABLE => c"TIDEPOOL_ERROR_DRIVER_UNAVAILABLE",
        TIDEPOOL_ERROR_DEVICE => c"TIDEPOOL_ERROR_DEVICE",
        TIDEPOOL_ERROR_UNSUPPORTED => c"TIDEPOOL_ERROR_UNSUPPORTED",
        TIDEPOOL_ERROR_TOO_LARGE => c"TIDEPOOL_ERROR_TOO_LARGE",
        TIDEPOOL_ERROR_INVALID_STATE => c"TIDEPOOL_ERROR_INVALID_STATE",
        TIDEPOOL_ERROR_PANIC => c"TIDEPOOL_ERROR_PANIC",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    fn last() -> String {
        // SAFETY: tidepool_last_error returns a valid NUL-terminated string.
        unsafe { CStr::from_ptr(tidepool_last_error()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn a_panic_becomes_a_status_and_a_message() {
        let status = guard("tidepool_test", || panic!("boom"));
        assert_eq!(status, TIDEPOOL_ERROR_PANIC);
        assert!(last().contains("boom"), "{}", last());
    }

    #[test]
    fn a_failure_sets_the_thread_last_error() {
        let status = guard("tidepool_test", || {
            Err(PoolError::DoubleFree { ptr: 0x1000 }.into())
        });
        assert_eq!(status, TIDEPOOL_ERROR_DOUBLE_FREE);
        assert!(
            last().starts_with("tidepool_test: double free"),
            "{}",
            last()
        );
        let other = std::thread::spawn(last).join().unwrap();
        assert_eq!(other, "", "the last error is per thread");
    }
}
