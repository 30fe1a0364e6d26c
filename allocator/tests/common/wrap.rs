//! Test devices that wrap another device and change a few of its calls.
//!
//! A wrapper implements [`Hooks`]: every device call forwards to
//! [`Hooks::inner`] unless the wrapper overrides it, and
//! `wrapped_device!(Type)` writes the `Device` impl that routes each call
//! through the hooks. The list of calls lives once, in `device_calls!`, so a
//! call added to the device trait is forwarded by every wrapper alike.
//!
//! Write `impl common::wrap::Hooks for Type` and never `use` the trait: its
//! methods have the device's names, and with both traits in scope every
//! call on the wrapper would be ambiguous. The calls with a default body in
//! the device trait that are not listed here (`check_stream`, peers,
//! interprocess events) keep that default unless passed as extra items:
//! `wrapped_device!(Type, { fn device_count(&self) -> ... })`.

// Every test binary includes this module; most use none of its macros.
#![allow(unused_macros, unused_imports)]

use tidepool_sys::Device;

/// Hands `$callback` the signature of every forwarded device call (after
/// the tokens in parentheses, passed through).
macro_rules! device_calls {
    ($callback:ident ($($pass:tt)*)) => {
        $crate::common::wrap::$callback! { ($($pass)*)
            fn backend_name() -> &'static str;
            fn ordinal() -> i32;
            fn granularity() -> usize;
            fn reserve_va(size: usize, alignment: usize) -> tidepool_sys::SysResult<tidepool_sys::DevicePtr>;
            fn free_va(ptr: tidepool_sys::DevicePtr, size: usize) -> tidepool_sys::SysResult<()>;
            fn create_physical(size: usize, options: tidepool_sys::PhysicalOptions) -> tidepool_sys::SysResult<tidepool_sys::Physical>;
            fn release_physical(handle: tidepool_sys::Physical) -> tidepool_sys::SysResult<()>;
            fn map(ptr: tidepool_sys::DevicePtr, size: usize, handle: tidepool_sys::Physical, offset: usize) -> tidepool_sys::SysResult<()>;
            fn unmap(ptr: tidepool_sys::DevicePtr, size: usize) -> tidepool_sys::SysResult<()>;
            fn set_access(ptr: tidepool_sys::DevicePtr, size: usize, access: &[tidepool_sys::AccessDesc]) -> tidepool_sys::SysResult<()>;
            fn export_fd(handle: tidepool_sys::Physical) -> tidepool_sys::SysResult<std::os::fd::OwnedFd>;
            fn import_fd(fd: std::os::fd::OwnedFd, size: usize) -> tidepool_sys::SysResult<tidepool_sys::Physical>;
            fn mem_info() -> tidepool_sys::SysResult<tidepool_sys::MemInfo>;
            fn create_stream() -> tidepool_sys::SysResult<tidepool_sys::Stream>;
            fn destroy_stream(stream: tidepool_sys::Stream) -> tidepool_sys::SysResult<()>;
            fn default_stream() -> tidepool_sys::Stream;
            fn adopt_stream(raw: usize) -> tidepool_sys::SysResult<tidepool_sys::Stream>;
            fn synchronize_stream(stream: tidepool_sys::Stream) -> tidepool_sys::SysResult<()>;
            fn synchronize_device() -> tidepool_sys::SysResult<()>;
            fn query_stream(stream: tidepool_sys::Stream) -> tidepool_sys::SysResult<bool>;
            fn is_capturing(stream: tidepool_sys::Stream) -> tidepool_sys::SysResult<bool>;
            fn stream_probe(stream: tidepool_sys::Stream) -> tidepool_sys::SysResult<Option<std::sync::Arc<dyn tidepool_sys::StreamProbe>>>;
            fn create_event() -> tidepool_sys::SysResult<tidepool_sys::Event>;
            fn record_event(event: tidepool_sys::Event, stream: tidepool_sys::Stream) -> tidepool_sys::SysResult<()>;
            fn query_event(event: tidepool_sys::Event) -> tidepool_sys::SysResult<bool>;
            fn synchronize_event(event: tidepool_sys::Event) -> tidepool_sys::SysResult<()>;
            fn destroy_event(event: tidepool_sys::Event) -> tidepool_sys::SysResult<()>;
            fn wait_event(stream: tidepool_sys::Stream, event: tidepool_sys::Event) -> tidepool_sys::SysResult<()>;
            fn launch_host(stream: tidepool_sys::Stream, task: tidepool_sys::HostTask) -> tidepool_sys::SysResult<()>;
            fn capture_status(stream: tidepool_sys::Stream) -> tidepool_sys::SysResult<tidepool_sys::CaptureStatus>;
            fn graph_alloc(stream: tidepool_sys::Stream, size: usize) -> tidepool_sys::SysResult<tidepool_sys::DevicePtr>;
            fn graph_free(stream: tidepool_sys::Stream, ptr: tidepool_sys::DevicePtr) -> tidepool_sys::SysResult<()>;
            fn begin_capture(stream: tidepool_sys::Stream, mode: tidepool_sys::CaptureMode) -> tidepool_sys::SysResult<()>;
            fn end_capture(stream: tidepool_sys::Stream) -> tidepool_sys::SysResult<tidepool_sys::Graph>;
            fn instantiate_graph(graph: tidepool_sys::Graph, options: tidepool_sys::GraphOptions) -> tidepool_sys::SysResult<tidepool_sys::GraphExec>;
            fn launch_graph(exec: tidepool_sys::GraphExec, stream: tidepool_sys::Stream) -> tidepool_sys::SysResult<()>;
            fn destroy_graph(graph: tidepool_sys::Graph) -> tidepool_sys::SysResult<()>;
            fn destroy_graph_exec(exec: tidepool_sys::GraphExec) -> tidepool_sys::SysResult<()>;
        }
    };
}
pub(crate) use device_calls;

/// The hooks trait: each call's default forwards to the inner device.
macro_rules! hooks_trait {
    (() $(fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty;)*) => {
        /// A wrapper's calls; each forwards to [`Hooks::inner`] by default.
        pub trait Hooks: Send + Sync + 'static {
            /// The wrapped device.
            type Inner: Device;
            fn inner(&self) -> &Self::Inner;
            $(
                fn $name(&self, $($arg: $ty),*) -> $ret {
                    self.inner().$name($($arg),*)
                }
            )*
        }
    };
}
pub(crate) use hooks_trait;

device_calls!(hooks_trait());

/// The `Device` impl of one wrapper, every listed call through its hooks.
macro_rules! device_impl {
    (($ty:ty, {$($extra:item)*}) $(fn $name:ident($($arg:ident: $argty:ty),*) -> $ret:ty;)*) => {
        impl tidepool_sys::Device for $ty {
            $(
                fn $name(&self, $($arg: $argty),*) -> $ret {
                    <$ty as $crate::common::wrap::Hooks>::$name(self, $($arg),*)
                }
            )*
            $($extra)*
        }
    };
}
pub(crate) use device_impl;

/// `wrapped_device!(Type)` or `wrapped_device!(Type, { extra items })`:
/// implements `Device` for a [`Hooks`] wrapper.
macro_rules! wrapped_device {
    ($ty:ty) => {
        $crate::common::wrap::device_calls!(device_impl($ty, {}));
    };
    ($ty:ty, {$($extra:item)*}) => {
        $crate::common::wrap::device_calls!(device_impl($ty, {$($extra)*}));
    };
}
pub(crate) use wrapped_device;
