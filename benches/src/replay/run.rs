//! The replay loop and the allocator abstraction it drives.

use super::timed::DriverStat;
use super::trace::{Trace, TraceOp};
use std::fmt;
use std::time::{Duration, Instant};

/// Why an allocation failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AllocError {
    /// Out of memory: counted, the operation (and its later free) skipped.
    OutOfMemory,
    /// Anything else: the replay stops with this message.
    Failed(String),
}

/// A failure that stops a replay (a device error, not an out-of-memory).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayError(pub String);

impl fmt::Display for ReplayError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ReplayError {}

impl From<String> for ReplayError {
    fn from(s: String) -> Self {
        ReplayError(s)
    }
}

/// An allocator a trace can be replayed through. `stream` is the trace's
/// dense stream index (`0..trace.streams.len()`); each implementation maps
/// it to a stream it created on its device, one per distinct trace stream.
pub trait ReplayAllocator {
    /// What the allocator holds for one live allocation.
    type Handle;
    /// Name in reports: `tidepool`, `driver-pool`, `cuMemAlloc`, ...
    fn name(&self) -> &'static str;
    fn alloc(&mut self, size: usize, stream: usize) -> Result<Self::Handle, AllocError>;
    fn free(&mut self, handle: Self::Handle, stream: usize) -> Result<(), ReplayError>;
    /// Order `stream` after the work issued on `from` so far (a trace's `w`
    /// line): record an event on `from` and make `stream` wait on it, in
    /// the way the allocator learns of the dependency (through a pool's
    /// own record/wait calls where it has them).
    fn wait(&mut self, from: usize, stream: usize) -> Result<(), ReplayError>;
    /// Highest reserved bytes since creation or the last [`Self::reset_high`].
    fn reserved_high(&self) -> Result<u64, ReplayError>;
    /// Reserved bytes now.
    fn reserved_now(&self) -> Result<u64, ReplayError>;
    /// Restart the high-water mark of reserved bytes at the current value.
    fn reset_high(&mut self) -> Result<(), ReplayError>;
    /// Wait until all work issued on the allocator's streams is done.
    fn synchronize(&mut self) -> Result<(), ReplayError>;
    /// Cumulative counters of the allocator's own (name, value), reported
    /// per pass as the difference over the pass. None by default.
    fn counters(&self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }
    /// Cumulative driver calls and the time spent in them, per kind
    /// (name, stat), reported per pass as the difference over the pass.
    /// None by default; tidepool reports its device's through
    /// [`super::timed::Timed`].
    fn driver_stats(&self) -> Vec<(&'static str, DriverStat)> {
        Vec::new()
    }
}

/// One sample of a replay timeline (taken between timed chunks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// Operations of this pass done when the sample was taken.
    pub op: usize,
    /// Reserved bytes when the sample was taken.
    pub reserved_bytes: u64,
    /// Highest reserved bytes since the previous sample (the allocator's
    /// high-water mark, restarted at each sample), so that a plot of the
    /// samples shows every peak, however short, and the highest of them is
    /// the pass's peak reserved.
    pub reserved_high_bytes: u64,
}

/// How to run one pass.
#[derive(Debug, Clone, Copy, Default)]
pub struct PassOptions {
    /// Operations between two samples of reserved bytes (0: none).
    pub sample_every: usize,
    /// Operations between two progress callbacks (0: none).
    pub progress_every: usize,
}

/// What one pass measured.
#[derive(Debug, Clone, PartialEq)]
pub struct PassResult {
    /// 1-based pass number (1: fresh allocator, later: warm).
    pub pass: u32,
    pub ops: usize,
    /// Peak of the live bytes the trace asks for.
    pub peak_live_bytes: u64,
    /// The allocator's reserved-high statistic over this pass.
    pub peak_reserved_bytes: u64,
    pub ooms: u64,
    /// Time in the allocator calls (the timed loop only).
    pub wall: Duration,
    /// Reserved bytes sampled during the pass (empty unless asked for).
    pub samples: Vec<Sample>,
    /// The allocator's own counters over this pass (name, increase), e.g.
    /// tidepool's page remaps and rebinds.
    pub counters: Vec<(&'static str, u64)>,
    /// The allocator's driver calls over this pass (name, calls and
    /// nanoseconds spent in them), where it reports them. Counted over the
    /// timed loop only, like `counters`.
    pub driver: Vec<(&'static str, DriverStat)>,
}

impl PassResult {
    /// Peak reserved / peak live (0 when the trace allocates nothing).
    pub fn ratio(&self) -> f64 {
        if self.peak_live_bytes == 0 {
            0.0
        } else {
            self.peak_reserved_bytes as f64 / self.peak_live_bytes as f64
        }
    }

    /// Wall time of the pass spent in driver calls (zero where the
    /// allocator reports none).
    pub fn driver_wall(&self) -> Duration {
        Duration::from_nanos(self.driver.iter().map(|(_, s)| s.nanos).sum())
    }

    pub fn ops_per_sec(&self) -> f64 {
        let s = self.wall.as_secs_f64();
        if s > 0.0 {
            self.ops as f64 / s
        } else {
            f64::INFINITY
        }
    }
}

/// A replayer: one allocator, one trace, any number of passes. Keeps the
/// handle table between passes (emptied at the end of each).
pub struct Replayer<'t, A: ReplayAllocator> {
    pub allocator: A,
    trace: &'t Trace,
    slots: Vec<Option<A::Handle>>,
    passes: u32,
}

impl<'t, A: ReplayAllocator> Replayer<'t, A> {
    pub fn new(allocator: A, trace: &'t Trace) -> Self {
        let slots = (0..trace.slots).map(|_| None).collect();
        Replayer {
            allocator,
            trace,
            slots,
            passes: 0,
        }
    }

    /// Replay the whole trace once. The high-water mark is reset first, so
    /// a warm pass reports its own peak; every allocation still live at the
    /// end is freed (untimed), so the next pass starts from the same live
    /// set. `progress` is called between timed chunks with the number of
    /// operations done in this pass.
    pub fn pass(
        &mut self,
        opts: PassOptions,
        mut progress: impl FnMut(usize),
    ) -> Result<PassResult, ReplayError> {
        self.passes += 1;
        self.allocator.reset_high()?;
        let ops = &self.trace.ops;
        let every = [opts.sample_every, opts.progress_every]
            .into_iter()
            .filter(|&n| n > 0)
            .min()
            .unwrap_or(ops.len().max(1));
        let mut samples = Vec::new();
        // With sampling, the high-water mark restarts at every sample; the
        // pass's peak is then the highest of the samples' marks.
        let mut peak_reserved_bytes = 0u64;
        if opts.sample_every > 0 {
            let now = self.allocator.reserved_now()?;
            peak_reserved_bytes = now;
            samples.push(Sample {
                op: 0,
                reserved_bytes: now,
                reserved_high_bytes: now,
            });
        }
        let counters_before = self.allocator.counters();
        let driver_before = self.allocator.driver_stats();
        let mut wall = Duration::ZERO;
        let mut ooms = 0u64;
        let mut done = 0usize;
        let mut next_sample = opts.sample_every;
        let mut next_progress = opts.progress_every;
        let slots = &mut self.slots;
        let allocator = &mut self.allocator;
        for chunk in ops.chunks(every) {
            let start = Instant::now();
            // The timed loop: allocator calls and a Vec index, nothing else.
            for op in chunk {
                match *op {
                    TraceOp::Alloc { slot, size, stream } => {
                        match allocator.alloc(size, stream as usize) {
                            Ok(h) => slots[slot as usize] = Some(h),
                            Err(AllocError::OutOfMemory) => ooms += 1,
                            Err(AllocError::Failed(msg)) => {
                                return Err(ReplayError(format!(
                                    "{}: allocation of {size} bytes failed: {msg}",
                                    allocator.name()
                                )))
                            }
                        }
                    }
                    TraceOp::Free { slot, stream } => {
                        if let Some(h) = slots[slot as usize].take() {
                            allocator.free(h, stream as usize)?;
                        }
                    }
                    TraceOp::Wait { from, stream } => {
                        allocator.wait(from as usize, stream as usize)?;
                    }
                }
            }
            wall += start.elapsed();
            done += chunk.len();
            if opts.sample_every > 0 && (done >= next_sample || done == ops.len()) {
                let high = allocator.reserved_high()?;
                peak_reserved_bytes = peak_reserved_bytes.max(high);
                samples.push(Sample {
                    op: done,
                    reserved_bytes: allocator.reserved_now()?,
                    reserved_high_bytes: high,
                });
                allocator.reset_high()?;
                next_sample = done + opts.sample_every;
            }
            if opts.progress_every > 0 && (done >= next_progress || done == ops.len()) {
                progress(done);
                next_progress = done + opts.progress_every;
            }
        }
        let peak_reserved_bytes = peak_reserved_bytes.max(allocator.reserved_high()?);
        let counters = allocator
            .counters()
            .into_iter()
            .map(|(name, now)| {
                let before = counters_before
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map_or(0, |&(_, v)| v);
                (name, now.saturating_sub(before))
            })
            .collect();
        let driver = allocator
            .driver_stats()
            .into_iter()
            .map(|(name, now)| {
                let before = driver_before
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map_or(DriverStat::default(), |&(_, v)| v);
                let stat = DriverStat {
                    calls: now.calls.saturating_sub(before.calls),
                    nanos: now.nanos.saturating_sub(before.nanos),
                };
                (name, stat)
            })
            .collect();
        self.free_all()?;
        self.allocator.synchronize()?;
        Ok(PassResult {
            pass: self.passes,
            ops: ops.len(),
            peak_live_bytes: self.trace.peak_live_bytes,
            peak_reserved_bytes,
            ooms,
            wall,
            samples,
            counters,
            driver,
        })
    }

    /// Free every allocation still live (on stream 0 of the trace).
    pub fn free_all(&mut self) -> Result<(), ReplayError> {
        for slot in self.slots.iter_mut() {
            if let Some(h) = slot.take() {
                self.allocator.free(h, 0)?;
            }
        }
        Ok(())
    }
}

/// A reference allocator over nothing: every allocation gets its own range
/// of a 64-bit counter, reserved bytes are live bytes rounded up to
/// `granularity` per allocation, and allocations past `capacity` fail with
/// out-of-memory. For tests of the replay machinery.
#[derive(Debug, Clone)]
pub struct IdealAllocator {
    pub capacity: u64,
    pub granularity: u64,
    next: u64,
    reserved: u64,
    high: u64,
    /// Calls seen, for tests: (allocs, frees, synchronizes).
    pub calls: (u64, u64, u64),
    /// Waits seen, for tests: (from, stream) of each.
    pub waits: Vec<(usize, usize)>,
    /// Streams seen by alloc and free.
    pub max_stream: usize,
}

impl IdealAllocator {
    pub fn new(capacity: u64, granularity: u64) -> Self {
        IdealAllocator {
            capacity,
            granularity: granularity.max(1),
            next: 0,
            reserved: 0,
            high: 0,
            calls: (0, 0, 0),
            waits: Vec::new(),
            max_stream: 0,
        }
    }

    fn rounded(&self, size: u64) -> u64 {
        size.div_ceil(self.granularity) * self.granularity
    }
}

impl ReplayAllocator for IdealAllocator {
    type Handle = (u64, u64);

    fn name(&self) -> &'static str {
        "ideal"
    }

    fn alloc(&mut self, size: usize, stream: usize) -> Result<(u64, u64), AllocError> {
        self.calls.0 += 1;
        self.max_stream = self.max_stream.max(stream);
        let r = self.rounded(size as u64);
        if self.reserved + r > self.capacity {
            return Err(AllocError::OutOfMemory);
        }
        self.reserved += r;
        self.high = self.high.max(self.reserved);
        let ptr = self.next;
        self.next += r;
        Ok((ptr, r))
    }

    fn free(&mut self, handle: (u64, u64), stream: usize) -> Result<(), ReplayError> {
        self.calls.1 += 1;
        self.max_stream = self.max_stream.max(stream);
        self.reserved -= handle.1;
        Ok(())
    }

    fn wait(&mut self, from: usize, stream: usize) -> Result<(), ReplayError> {
        self.max_stream = self.max_stream.max(from).max(stream);
        self.waits.push((from, stream));
        Ok(())
    }

    fn reserved_high(&self) -> Result<u64, ReplayError> {
        Ok(self.high)
    }

    fn reserved_now(&self) -> Result<u64, ReplayError> {
        Ok(self.reserved)
    }

    fn reset_high(&mut self) -> Result<(), ReplayError> {
        self.high = self.reserved;
        Ok(())
    }

    fn synchronize(&mut self) -> Result<(), ReplayError> {
        self.calls.2 += 1;
        Ok(())
    }
}
