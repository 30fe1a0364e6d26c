//! The allocators a trace can be replayed through, as [`ReplayAllocator`]s:
//! the CUDA driver's baselines ([`DriverPoolAlloc`], [`CuMemAlloc`]) and
//! the reference [`IdealAllocator`].
//!
//! Each device-backed allocator creates one stream on its device per
//! distinct stream of the trace, and destroys them when dropped.

use super::run::{AllocError, ReplayAllocator, ReplayError};
use std::sync::Arc;
use tidepool_sys::cuda::baseline::{self, DriverPool};
use tidepool_sys::cuda::CudaDevice;
use tidepool_sys::{Device, DevicePtr, Event, Stream, SysError};

pub use super::run::IdealAllocator;

/// A device error as a replay error, naming what was being done.
pub(crate) fn sys_err(what: &str) -> impl Fn(SysError) -> ReplayError + '_ {
    move |e| ReplayError(format!("{what}: {e}"))
}

/// Streams created on a device, one per trace stream; destroyed on drop
/// (after their work is done).
pub struct Streams<D: Device> {
    pub device: Arc<D>,
    pub streams: Vec<Stream>,
}

impl<D: Device> Streams<D> {
    pub fn new(device: Arc<D>, count: usize) -> Result<Self, ReplayError> {
        let mut s = Streams {
            device,
            streams: Vec::with_capacity(count.max(1)),
        };
        for _ in 0..count.max(1) {
            let st = s
                .device
                .create_stream()
                .map_err(sys_err("creating a stream"))?;
            s.streams.push(st);
        }
        Ok(s)
    }

    pub fn synchronize(&self) -> Result<(), ReplayError> {
        for &st in &self.streams {
            self.device
                .synchronize_stream(st)
                .map_err(sys_err("synchronizing a stream"))?;
        }
        Ok(())
    }
}

impl<D: Device> Drop for Streams<D> {
    fn drop(&mut self) {
        for &st in &self.streams {
            let _ = self.device.synchronize_stream(st);
            let _ = self.device.destroy_stream(st);
        }
    }
}

fn alloc_err(e: SysError) -> AllocError {
    if e.is_out_of_memory() {
        AllocError::OutOfMemory
    } else {
        AllocError::Failed(e.to_string())
    }
}

/// A fresh explicit driver pool (`cuMemPoolCreate`), release threshold
/// max, its reserved-high attribute as peak reserved.
pub struct DriverPoolAlloc {
    // Field order: the pool is destroyed before the streams.
    pool: DriverPool,
    streams: Streams<CudaDevice>,
    /// The event of the trace's waits, recorded again for each: a
    /// `cuStreamWaitEvent` waits for the record made before it, so a later
    /// record does not change what an earlier wait waits for.
    event: Event,
}

impl DriverPoolAlloc {
    pub fn new(device: &CudaDevice, trace_streams: usize) -> Result<Self, ReplayError> {
        let pool = DriverPool::new(device, u64::MAX).map_err(sys_err("creating a driver pool"))?;
        let streams = Streams::new(Arc::new(device.clone()), trace_streams)?;
        let event = device
            .create_event()
            .map_err(sys_err("creating an event"))?;
        Ok(DriverPoolAlloc {
            pool,
            streams,
            event,
        })
    }
}

impl Drop for DriverPoolAlloc {
    fn drop(&mut self) {
        let _ = self.streams.synchronize();
        let _ = self.streams.device.destroy_event(self.event);
    }
}

impl ReplayAllocator for DriverPoolAlloc {
    type Handle = DevicePtr;

    fn name(&self) -> &'static str {
        "driver-pool"
    }

    #[inline]
    fn alloc(&mut self, size: usize, stream: usize) -> Result<DevicePtr, AllocError> {
        self.pool
            .alloc_async(size, self.streams.streams[stream])
            .map_err(alloc_err)
    }

    #[inline]
    fn free(&mut self, ptr: DevicePtr, stream: usize) -> Result<(), ReplayError> {
        self.pool
            .free_async(ptr, self.streams.streams[stream])
            .map_err(sys_err("cuMemFreeAsync"))
    }

    /// `cuEventRecord` on `from`, `cuStreamWaitEvent` on `stream`: the
    /// driver's pool follows event dependencies by itself.
    #[inline]
    fn wait(&mut self, from: usize, stream: usize) -> Result<(), ReplayError> {
        let dev = &self.streams.device;
        dev.record_event(self.event, self.streams.streams[from])
            .map_err(sys_err("cuEventRecord"))?;
        dev.wait_event(self.streams.streams[stream], self.event)
            .map_err(sys_err("cuStreamWaitEvent"))
    }

    fn reserved_high(&self) -> Result<u64, ReplayError> {
        self.pool
            .reserved_high()
            .map_err(sys_err("reading the driver pool's reserved-high attribute"))
    }

    fn reserved_now(&self) -> Result<u64, ReplayError> {
        self.pool
            .reserved_current()
            .map_err(sys_err("reading the driver pool's reserved attribute"))
    }

    fn reset_high(&mut self) -> Result<(), ReplayError> {
        self.pool
            .reset_highs()
            .map_err(sys_err("resetting the driver pool's high-water marks"))
    }

    fn synchronize(&mut self) -> Result<(), ReplayError> {
        self.streams.synchronize()
    }
}

/// `cuMemAlloc`/`cuMemFree`: no pool, no streams in the calls (the trace's
/// stream order is kept by issue order). Reserved is the sum of live
/// allocations, so its ratio is 1.0 by construction.
pub struct CuMemAlloc {
    device: CudaDevice,
    live: u64,
    high: u64,
}

impl CuMemAlloc {
    pub fn new(device: &CudaDevice) -> Self {
        CuMemAlloc {
            device: device.clone(),
            live: 0,
            high: 0,
        }
    }
}

impl ReplayAllocator for CuMemAlloc {
    /// Pointer and size.
    type Handle = (DevicePtr, usize);

    fn name(&self) -> &'static str {
        "cuMemAlloc"
    }

    #[inline]
    fn alloc(&mut self, size: usize, _stream: usize) -> Result<(DevicePtr, usize), AllocError> {
        let ptr = baseline::mem_alloc(&self.device, size).map_err(alloc_err)?;
        self.live += size as u64;
        self.high = self.high.max(self.live);
        Ok((ptr, size))
    }

    #[inline]
    fn free(&mut self, (ptr, size): (DevicePtr, usize), _stream: usize) -> Result<(), ReplayError> {
        baseline::mem_free(&self.device, ptr).map_err(sys_err("cuMemFree"))?;
        self.live -= size as u64;
        Ok(())
    }

    /// Nothing to do: `cuMemAlloc`/`cuMemFree` take no stream and
    /// `cuMemFree` synchronises, so every operation is already ordered
    /// after all earlier work.
    fn wait(&mut self, _from: usize, _stream: usize) -> Result<(), ReplayError> {
        Ok(())
    }

    fn reserved_high(&self) -> Result<u64, ReplayError> {
        Ok(self.high)
    }

    fn reserved_now(&self) -> Result<u64, ReplayError> {
        Ok(self.live)
    }

    fn reset_high(&mut self) -> Result<(), ReplayError> {
        self.high = self.live;
        Ok(())
    }

    fn synchronize(&mut self) -> Result<(), ReplayError> {
        Ok(())
    }
}

/// Open CUDA device 0.
pub fn cuda_device() -> Result<CudaDevice, ReplayError> {
    CudaDevice::new(0).map_err(sys_err("opening CUDA device 0"))
}

/// Whether a CUDA driver can be used on this machine.
pub fn cuda_available() -> bool {
    tidepool_sys::cuda::driver_available()
}
