//! The CUDA backend's part of sharing: peer capability, reading access
//! back (`cuMemGetAccess`), and interprocess events
//! (`CU_EVENT_INTERPROCESS`, `cuIpcGetEventHandle` / `cuIpcOpenEventHandle`).
//!
//! An interprocess event lives in the same table as ordinary events, so
//! record, query, wait, synchronise and destroy are the ordinary calls; in
//! the process that opened it, destroying it closes the handle.
//!
//! Every entry point used here exists in every driver the backend's probe
//! accepts (CUDA 13.0 and later): it requires newer symbols than these.

use super::driver::check;
use super::{mem_location, poisoned, CudaDevice, EventObj};
use crate::device::{Access, Device, DevicePtr, Event, IpcEvent, IpcEventHandle, Stream};
use crate::error::{Op, SysResult};
use crate::validate::invalid;
use cudarc::driver::sys;
use std::sync::Arc;

const HANDLE_BYTES: usize = 64;

fn as_event(ev: IpcEvent) -> Event {
    Event(ev.0)
}

impl CudaDevice {
    pub(super) fn device_count_impl(&self) -> SysResult<i32> {
        let op = Op::PeerAccess;
        let mut count: std::ffi::c_int = 0;
        // SAFETY: valid out pointer; the driver was initialised by `new`.
        check(op, unsafe { sys::cuDeviceGetCount(&mut count) })?;
        Ok(count)
    }

    fn cu_device(&self, op: Op, ordinal: i32) -> SysResult<sys::CUdevice> {
        let mut dev: sys::CUdevice = 0;
        // SAFETY: valid out pointer; the ordinal was checked by the caller.
        check(op, unsafe { sys::cuDeviceGet(&mut dev, ordinal) })?;
        Ok(dev)
    }

    pub(super) fn can_access_peer_impl(&self, peer: i32) -> SysResult<bool> {
        let op = Op::PeerAccess;
        let me = self.ordinal();
        if peer == me {
            return Ok(true);
        }
        let count = self.device_count_impl()?;
        if peer < 0 || peer >= count {
            return Err(invalid(
                op,
                format!("device {peer} does not exist (the driver sees devices 0..{count})"),
            ));
        }
        let (mine, theirs) = (self.cu_device(op, me)?, self.cu_device(op, peer)?);
        let mut can: std::ffi::c_int = 0;
        // SAFETY: valid out pointer and two valid device handles. The call
        // asks whether `theirs` can access memory of `mine`.
        check(op, unsafe {
            sys::cuDeviceCanAccessPeer(&mut can, theirs, mine)
        })?;
        Ok(can != 0)
    }

    pub(super) fn get_access_impl(&self, ptr: DevicePtr, device: i32) -> SysResult<Access> {
        let op = Op::GetAccess;
        self.bind(op)?;
        let location = mem_location(device);
        let mut flags: std::ffi::c_ulonglong = 0;
        // SAFETY: valid out pointer and location; the driver checks `ptr`.
        check(op, unsafe {
            sys::cuMemGetAccess(&mut flags, &location, ptr)
        })?;
        const READ: u64 = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READ as u64;
        const READWRITE: u64 = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE as u64;
        Ok(match flags {
            READWRITE => Access::ReadWrite,
            READ => Access::Read,
            _ => Access::None,
        })
    }

    fn insert_event(&self, raw: sys::CUevent) -> IpcEvent {
        let obj = Arc::new(EventObj {
            raw,
            ctx: self.inner.ctx.clone(),
        });
        let id = self.new_id();
        self.inner
            .events
            .write()
            .unwrap_or_else(poisoned)
            .insert(id, obj);
        IpcEvent(id)
    }

    pub(super) fn create_ipc_event_impl(&self) -> SysResult<(IpcEvent, IpcEventHandle)> {
        let op = Op::Ipc;
        self.bind(op)?;
        let mut raw: sys::CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32
            | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: valid out pointer; the context is current. Interprocess
        // events must not time (the driver requires DISABLE_TIMING).
        check(op, unsafe { sys::cuEventCreate(&mut raw, flags) })?;
        // Owned by the table from here on (destroyed with it on error too).
        let ev = self.insert_event(raw);
        // SAFETY: the handle is a plain byte array; zero is a valid value.
        let mut handle: sys::CUipcEventHandle = unsafe { std::mem::zeroed() };
        // SAFETY: valid out pointer and a live interprocess event.
        if let Err(e) = check(op, unsafe { sys::cuIpcGetEventHandle(&mut handle, raw) }) {
            let _ = self.destroy_event(as_event(ev));
            return Err(e);
        }
        let bytes = handle.reserved.iter().map(|&c| c as u8).collect();
        Ok((ev, IpcEventHandle { bytes, fd: None }))
    }

    pub(super) fn open_ipc_event_impl(&self, handle: IpcEventHandle) -> SysResult<IpcEvent> {
        let op = Op::Ipc;
        if handle.bytes.len() != HANDLE_BYTES {
            return Err(invalid(
                op,
                format!(
                    "a CUDA interprocess event handle has {HANDLE_BYTES} bytes, not {} (made by another backend?)",
                    handle.bytes.len()
                ),
            ));
        }
        self.bind(op)?;
        // SAFETY: a plain byte array; zero is a valid value.
        let mut h: sys::CUipcEventHandle = unsafe { std::mem::zeroed() };
        for (dst, &src) in h.reserved.iter_mut().zip(&handle.bytes) {
            *dst = src as std::ffi::c_char;
        }
        let mut raw: sys::CUevent = std::ptr::null_mut();
        // SAFETY: valid out pointer; the handle is passed by value.
        check(op, unsafe { sys::cuIpcOpenEventHandle(&mut raw, h) })?;
        Ok(self.insert_event(raw))
    }

    pub(super) fn record_ipc_event_impl(&self, ev: IpcEvent, stream: Stream) -> SysResult<()> {
        self.record_event(as_event(ev), stream)
    }

    pub(super) fn query_ipc_event_impl(&self, ev: IpcEvent) -> SysResult<bool> {
        self.query_event(as_event(ev))
    }

    pub(super) fn synchronize_ipc_event_impl(&self, ev: IpcEvent) -> SysResult<()> {
        self.synchronize_event(as_event(ev))
    }

    pub(super) fn wait_ipc_event_impl(&self, stream: Stream, ev: IpcEvent) -> SysResult<()> {
        self.wait_event(stream, as_event(ev))
    }

    pub(super) fn destroy_ipc_event_impl(&self, ev: IpcEvent) -> SysResult<()> {
        self.destroy_event(as_event(ev))
    }
}

/// Peer helpers for tests, examples and benchmarks.
impl CudaDevice {
    /// Let this device's context reach memory that `peer` allocated with
    /// `cuMemAlloc` (`cuCtxEnablePeerAccess`). Pool memory needs no such
    /// call: its access is set per mapping. Enabling twice is not an error.
    pub fn enable_peer_context_access(&self, peer: &CudaDevice) -> SysResult<()> {
        let op = Op::PeerAccess;
        self.bind(op)?;
        // SAFETY: the peer's context is retained while `peer` lives; flags 0.
        let r = unsafe { sys::cuCtxEnablePeerAccess(peer.inner.ctx.cu_ctx, 0) };
        match r {
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
                Ok(())
            }
            r => Err(super::driver::driver_error(op, r)),
        }
    }

    /// Copy `bytes` from `src` to `dst` in stream order (`cuMemcpyAsync`;
    /// unified addressing: either side may be memory of another device).
    pub fn copy_async(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
        stream: Stream,
    ) -> SysResult<()> {
        let op = Op::LaunchHost;
        self.bind(op)?;
        self.with_stream(op, stream, |raw| {
            // SAFETY: device memory only; the driver validates both ranges.
            check(op, unsafe { sys::cuMemcpyAsync(dst, src, bytes, raw) })
        })
    }
}
