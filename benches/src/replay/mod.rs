//! Replay of allocation traces through an allocator.
//!
//! - [`trace`]: parse `op,id,size,stream` CSV (plain or gzip) into memory;
//! - [`run`]: the [`ReplayAllocator`] abstraction and the timed replay loop;
//! - [`report`]: JSON lines and tables;
//! - [`plot`]: SVG timelines of live and reserved bytes;
//! - [`timed`]: a device wrapper that counts and times driver calls;
//! - [`lag`]: a device wrapper whose work completes a number of trace
//!   operations after it was issued.

/// The device-trait methods a replay wrapper ([`timed::Timed`],
/// [`lag::Lagged`]) hands to its inner device unchanged: graphs, peers and
/// interprocess events, which a replay neither times nor holds back.
/// Expands inside the wrapper's `impl Device`, whose field is `inner`.
macro_rules! forward_untouched_device_calls {
    () => {
        fn graph_alloc(
            &self,
            stream: tidepool_sys::Stream,
            size: usize,
        ) -> tidepool_sys::SysResult<tidepool_sys::DevicePtr> {
            self.inner.graph_alloc(stream, size)
        }
        fn graph_free(
            &self,
            stream: tidepool_sys::Stream,
            ptr: tidepool_sys::DevicePtr,
        ) -> tidepool_sys::SysResult<()> {
            self.inner.graph_free(stream, ptr)
        }
        fn begin_capture(
            &self,
            stream: tidepool_sys::Stream,
            mode: tidepool_sys::CaptureMode,
        ) -> tidepool_sys::SysResult<()> {
            self.inner.begin_capture(stream, mode)
        }
        fn end_capture(
            &self,
            stream: tidepool_sys::Stream,
        ) -> tidepool_sys::SysResult<tidepool_sys::Graph> {
            self.inner.end_capture(stream)
        }
        fn instantiate_graph(
            &self,
            graph: tidepool_sys::Graph,
            options: tidepool_sys::GraphOptions,
        ) -> tidepool_sys::SysResult<tidepool_sys::GraphExec> {
            self.inner.instantiate_graph(graph, options)
        }
        fn launch_graph(
            &self,
            exec: tidepool_sys::GraphExec,
            stream: tidepool_sys::Stream,
        ) -> tidepool_sys::SysResult<()> {
            self.inner.launch_graph(exec, stream)
        }
        fn destroy_graph(&self, graph: tidepool_sys::Graph) -> tidepool_sys::SysResult<()> {
            self.inner.destroy_graph(graph)
        }
        fn destroy_graph_exec(&self, exec: tidepool_sys::GraphExec) -> tidepool_sys::SysResult<()> {
            self.inner.destroy_graph_exec(exec)
        }

        fn device_count(&self) -> tidepool_sys::SysResult<i32> {
            self.inner.device_count()
        }
        fn can_access_peer(&self, peer: i32) -> tidepool_sys::SysResult<bool> {
            self.inner.can_access_peer(peer)
        }
        fn get_access(
            &self,
            ptr: tidepool_sys::DevicePtr,
            device: i32,
        ) -> tidepool_sys::SysResult<tidepool_sys::Access> {
            self.inner.get_access(ptr, device)
        }
        fn create_ipc_event(
            &self,
        ) -> tidepool_sys::SysResult<(tidepool_sys::IpcEvent, tidepool_sys::IpcEventHandle)> {
            self.inner.create_ipc_event()
        }
        fn open_ipc_event(
            &self,
            handle: tidepool_sys::IpcEventHandle,
        ) -> tidepool_sys::SysResult<tidepool_sys::IpcEvent> {
            self.inner.open_ipc_event(handle)
        }
        fn record_ipc_event(
            &self,
            event: tidepool_sys::IpcEvent,
            stream: tidepool_sys::Stream,
        ) -> tidepool_sys::SysResult<()> {
            self.inner.record_ipc_event(event, stream)
        }
        fn query_ipc_event(&self, event: tidepool_sys::IpcEvent) -> tidepool_sys::SysResult<bool> {
            self.inner.query_ipc_event(event)
        }
        fn synchronize_ipc_event(
            &self,
            event: tidepool_sys::IpcEvent,
        ) -> tidepool_sys::SysResult<()> {
            self.inner.synchronize_ipc_event(event)
        }
        fn wait_ipc_event(
            &self,
            stream: tidepool_sys::Stream,
            event: tidepool_sys::IpcEvent,
        ) -> tidepool_sys::SysResult<()> {
            self.inner.wait_ipc_event(stream, event)
        }
        fn destroy_ipc_event(&self, event: tidepool_sys::IpcEvent) -> tidepool_sys::SysResult<()> {
            self.inner.destroy_ipc_event(event)
        }
    };
}
pub(crate) use forward_untouched_device_calls;

pub mod allocators;
pub mod lag;
pub mod plot;
pub mod report;
pub mod run;
pub mod session;
pub mod tidepool_alloc;
pub mod timed;
pub mod trace;

pub use run::{
    AllocError, IdealAllocator, PassOptions, PassResult, ReplayAllocator, ReplayError, Replayer,
    Sample,
};
pub use trace::{Trace, TraceError, TraceOp};
