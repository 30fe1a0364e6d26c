//! Host twins of the tag kernels, for the host backend.
//!
//! Each kernel is a host task on the stream (so it runs in stream order,
//! after the stream's earlier work and before its later work). Fill and
//! verify reach the memory only through
//! [`HostDevice::launch_on_words`], which checks, when the task runs, that
//! the range is mapped with access; when it is not, the task is handed an
//! error instead of a view. That is exactly the bug the stress suite hunts
//! (a kernel touching memory the pool already unmapped), so it is counted:
//! one access fault per task, and for a verify also `len / 4` mismatches.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use tidepool_sys::host::HostDevice;
use tidepool_sys::{Device, DevicePtr, Stream, SysError};

use crate::error::device;
use crate::{check_range, tag_word, KernelError, TagKernels};

/// Tag kernels as host tasks on a [`HostDevice`]'s streams.
pub struct HostKernels {
    dev: Arc<HostDevice>,
    counters: Arc<Counters>,
}

#[derive(Default)]
struct Counters {
    mismatches: AtomicU64,
    access_faults: AtomicU64,
    /// Fill/verify tasks enqueued and not yet run (or dropped unrun).
    pending: Mutex<u64>,
    drained: Condvar,
}

impl Counters {
    fn wait_idle(&self) {
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        while *pending != 0 {
            pending = self
                .drained
                .wait(pending)
                .unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Counts a task as pending from its enqueue until it has run, or until the
/// backend drops it unrun (a stream torn down): never leaves a waiter hanging.
struct PendingGuard(Arc<Counters>);

impl PendingGuard {
    fn new(counters: &Arc<Counters>) -> Self {
        *counters.pending.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        PendingGuard(counters.clone())
    }
}

impl Drop for PendingGuard {
    fn drop(&mut self) {
        let mut pending = self.0.pending.lock().unwrap_or_else(|e| e.into_inner());
        *pending -= 1;
        if *pending == 0 {
            self.0.drained.notify_all();
        }
    }
}

impl HostKernels {
    /// Tag kernels for `dev`, with their own counters.
    pub fn new(dev: Arc<HostDevice>) -> Self {
        HostKernels {
            dev,
            counters: Arc::new(Counters::default()),
        }
    }

    /// The device these kernels run on.
    pub fn device(&self) -> &Arc<HostDevice> {
        &self.dev
    }

    /// Enqueue a fill/verify task. On a stream being captured into a graph
    /// the task is replayable (it runs once per launch of the graph) and is
    /// not counted as pending: read the counters after synchronising the
    /// stream the graph was launched on.
    fn launch_words(
        &self,
        stream: Stream,
        ptr: DevicePtr,
        len: usize,
        during: &'static str,
        f: impl Fn(&[AtomicU32], &Counters) + Send + Sync + 'static,
        on_fault: impl Fn(&Counters, &SysError) + Send + Sync + 'static,
    ) -> Result<(), KernelError> {
        if check_range(ptr, len)? == 0 {
            return Ok(());
        }
        let capturing = self
            .dev
            .capture_status(stream)
            .map_err(device(during))?
            .is_capturing();
        if capturing {
            let counters = Arc::clone(&self.counters);
            return self
                .dev
                .launch_on_words_repeatable(stream, ptr, len, move |words| match words {
                    Ok(words) => f(words, &counters),
                    Err(e) => {
                        counters.access_faults.fetch_add(1, Ordering::Relaxed);
                        on_fault(&counters, &e);
                    }
                })
                .map_err(device(during));
        }
        let guard = PendingGuard::new(&self.counters);
        self.dev
            .launch_on_words(stream, ptr, len, move |words| {
                let counters = &*guard.0;
                match words {
                    Ok(words) => f(words, counters),
                    Err(e) => {
                        counters.access_faults.fetch_add(1, Ordering::Relaxed);
                        on_fault(counters, &e);
                    }
                }
                drop(guard);
            })
            .map_err(device(during))
    }
}

/// Busy-waits (sleeping through most of a long wait) for `ns` nanoseconds.
fn spin_for(ns: u64) {
    let start = Instant::now();
    let total = Duration::from_nanos(ns);
    // Sleep through all but the last 200 µs, then spin for precision.
    let slack = Duration::from_micros(200);
    if total > slack {
        std::thread::sleep(total - slack);
    }
    while start.elapsed() < total {
        std::hint::spin_loop();
    }
}

impl TagKernels for HostKernels {
    fn fill_tag(
        &self,
        stream: Stream,
        ptr: DevicePtr,
        len: usize,
        tag: u32,
    ) -> Result<(), KernelError> {
        self.launch_words(
            stream,
            ptr,
            len,
            "enqueueing a host fill_tag",
            move |words, _| {
                let mut addr = ptr;
                for w in words {
                    w.store(tag_word(tag, addr), Ordering::Relaxed);
                    addr += 4;
                }
            },
            move |_, e| {
                tracing::error!(ptr, len, tag, error = %e, "host fill_tag touched memory it may not: access fault");
            },
        )
    }

    fn verify_tag(
        &self,
        stream: Stream,
        ptr: DevicePtr,
        len: usize,
        tag: u32,
    ) -> Result<(), KernelError> {
        self.launch_words(
            stream,
            ptr,
            len,
            "enqueueing a host verify_tag",
            move |words, counters| {
                let mut addr = ptr;
                let mut bad = 0u64;
                for w in words {
                    bad += u64::from(w.load(Ordering::Relaxed) != tag_word(tag, addr));
                    addr += 4;
                }
                if bad != 0 {
                    counters.mismatches.fetch_add(bad, Ordering::Relaxed);
                }
            },
            move |counters, e| {
                counters
                    .mismatches
                    .fetch_add((len / 4) as u64, Ordering::Relaxed);
                tracing::error!(ptr, len, tag, error = %e, "host verify_tag touched memory it may not: access fault");
            },
        )
    }

    fn spin(&self, stream: Stream, ns: u64) -> Result<(), KernelError> {
        // Replayable, so that a spin can be captured into a graph too.
        self.dev
            .launch_host_repeatable(stream, Arc::new(move || spin_for(ns)))
            .map_err(device("enqueueing a host spin"))
    }

    fn mismatches(&self) -> Result<u64, KernelError> {
        self.counters.wait_idle();
        Ok(self.counters.mismatches.load(Ordering::Relaxed))
    }

    fn access_faults(&self) -> Result<u64, KernelError> {
        self.counters.wait_idle();
        Ok(self.counters.access_faults.load(Ordering::Relaxed))
    }

    fn reset_counters(&self) -> Result<(), KernelError> {
        self.counters.wait_idle();
        self.counters.mismatches.store(0, Ordering::Relaxed);
        self.counters.access_faults.store(0, Ordering::Relaxed);
        Ok(())
    }

    fn backend_name(&self) -> &'static str {
        "host"
    }
}
