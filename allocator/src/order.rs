//! Stream-order bookkeeping: what the pool knows about each stream.
//!
//! Every free on a stream gets the stream's current *epoch*. Recording an
//! event on the stream closes the epoch: once that event completes, every
//! free of that epoch and earlier is done on the device. A stream's vector
//! clock says, for each other stream, up to which epoch it has waited (through
//! the pool) — transitively, because waiting on an event merges the clock the
//! recording stream had. "Follow event dependencies" is then a comparison.

use crate::sync::Arc;
use std::collections::{HashMap, VecDeque};
use tidepool_sys::{Event, Stream};

/// For each stream id, the highest epoch known to be ordered before.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct VectorClock {
    entries: Vec<(u64, u64)>,
}

impl VectorClock {
    pub fn get(&self, stream: u64) -> u64 {
        self.entries
            .iter()
            .find(|(s, _)| *s == stream)
            .map_or(0, |(_, e)| *e)
    }

    pub fn raise(&mut self, stream: u64, epoch: u64) {
        match self.entries.iter_mut().find(|(s, _)| *s == stream) {
            Some((_, e)) => *e = (*e).max(epoch),
            None => self.entries.push((stream, epoch)),
        }
    }

    pub fn merge(&mut self, other: &VectorClock) {
        for &(s, e) in &other.entries {
            self.raise(s, e);
        }
    }
}

/// Where an event goes when nobody needs it any more (recycled or destroyed
/// by the pool that owns the device).
pub(crate) trait EventSink: Send + Sync {
    fn release(&self, event: Event);
}

/// An event the pool recorded on a stream, closing `epoch` on it.
pub(crate) struct EventRecord {
    pub event: Event,
    pub stream: Stream,
    pub epoch: u64,
    /// The recording stream's clock at the record, including itself at `epoch`.
    pub clock: VectorClock,
    pub sink: Arc<dyn EventSink>,
}

/// `Arc<S>` as `Arc<dyn EventSink>`. loom's `Arc` cannot unsize, so under
/// `cfg(loom)` the loom `Arc` is wrapped in a std `Arc` and handed to loom's
/// `Arc::from_std` (one extra allocation per recorded event, models only).
#[cfg(not(loom))]
fn dyn_sink<S: EventSink + 'static>(sink: Arc<S>) -> Arc<dyn EventSink> {
    sink
}

#[cfg(loom)]
fn dyn_sink<S: EventSink + 'static>(sink: Arc<S>) -> Arc<dyn EventSink> {
    Arc::from_std(std::sync::Arc::new(sink))
}

#[cfg(loom)]
impl<S: EventSink> EventSink for Arc<S> {
    fn release(&self, event: Event) {
        (**self).release(event)
    }
}

impl Drop for EventRecord {
    fn drop(&mut self) {
        self.sink.release(self.event);
    }
}

impl std::fmt::Debug for EventRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventRecord")
            .field("event", &self.event)
            .field("stream", &self.stream)
            .field("epoch", &self.epoch)
            .finish()
    }
}

/// Hashes the pool's own integer keys: block lengths (multiples of 512)
/// for the stream caches, stream ids for the completion maps. SipHash
/// (std's default) was a measurable share of the alloc+free fast path and
/// of observing completions, and these keys come from the pool, not from an
/// adversary. A multiply, then the high bits folded into the low ones that
/// pick the bucket.
#[derive(Default)]
pub(crate) struct IntHasher(u64);

impl std::hash::Hasher for IntHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    fn write_u64(&mut self, n: u64) {
        let h = (self.0 ^ n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        self.0 = h ^ (h >> 29);
    }
    fn write_usize(&mut self, n: usize) {
        self.write_u64(n as u64);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

pub(crate) type BuildIntHasher = std::hash::BuildHasherDefault<IntHasher>;

/// A block freed on a stream and kept in that stream's private cache.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CachedBlock {
    pub offset: usize,
    pub epoch: u64,
}

/// Per-stream state, behind the stream's own lock (never the arena's).
#[derive(Debug)]
pub(crate) struct StreamState {
    pub stream: Stream,
    pub retired: bool,
    /// Frees made now belong to this epoch.
    pub epoch: u64,
    /// Whether a free happened in the current epoch (an event must be
    /// recorded to learn when it completes).
    pub frees_in_epoch: bool,
    /// What this stream has waited on through the pool.
    pub clock: VectorClock,
    /// Events recorded on this stream, not yet observed complete, oldest first.
    pub recorded: VecDeque<Arc<EventRecord>>,
    /// Same-stream frees kept for reuse by this stream, by block length.
    pub cache: HashMap<usize, Vec<CachedBlock>, BuildIntHasher>,
    pub cached_bytes: usize,
    /// This stream's share of the pool's counters.
    pub counters: crate::stats::StreamCounters,
    /// The last epoch closed with no event because the driver stream was
    /// already destroyed: its frees complete only by a device-wide wait.
    pub orphaned: Option<u64>,
}

impl StreamState {
    pub fn new(stream: Stream) -> Self {
        StreamState {
            stream,
            retired: false,
            epoch: 1,
            frees_in_epoch: false,
            clock: VectorClock::default(),
            recorded: VecDeque::new(),
            cache: HashMap::default(),
            cached_bytes: 0,
            counters: Default::default(),
            orphaned: None,
        }
    }

    /// Close the current epoch with a freshly recorded event.
    pub fn close_epoch<S: EventSink + 'static>(
        &mut self,
        event: Event,
        sink: Arc<S>,
    ) -> Arc<EventRecord> {
        let sink = dyn_sink(sink);
        let epoch = self.epoch;
        let mut clock = self.clock.clone();
        clock.raise(self.stream.id(), epoch);
        let record = Arc::new(EventRecord {
            event,
            stream: self.stream,
            epoch,
            clock,
            sink,
        });
        self.recorded.push_back(record.clone());
        self.epoch += 1;
        self.frees_in_epoch = false;
        record
    }

    /// Close the current epoch because the host is about to synchronise
    /// the stream: every free of the returned epoch and earlier will be done
    /// when the synchronisation returns.
    pub fn close_epoch_synced(&mut self) -> u64 {
        let epoch = self.epoch;
        self.epoch += 1;
        self.frees_in_epoch = false;
        epoch
    }

    /// Close the current epoch of a stream whose driver stream is gone (no
    /// event can be recorded on it any more): the epoch's frees wait for a
    /// device-wide synchronisation.
    pub fn close_epoch_orphaned(&mut self) {
        if self.frees_in_epoch {
            let epoch = self.close_epoch_synced();
            self.orphaned = Some(epoch);
        }
    }

    /// The first recorded, not-yet-complete event that covers `epoch`.
    pub fn event_covering(&self, epoch: u64) -> Option<Arc<EventRecord>> {
        self.recorded.iter().find(|r| r.epoch >= epoch).cloned()
    }

    /// Take every cached block out (for the arena).
    pub fn drain_cache(&mut self) -> Vec<(usize, CachedBlock)> {
        let mut out = Vec::new();
        self.drain_cache_with(|len, b| out.push((len, b)));
        out
    }

    /// Take every cached block out, handing each to `f` (length, block) in
    /// the order [`StreamState::drain_cache`] returns them, with no list
    /// built in between. Returns how many there were.
    pub fn drain_cache_with(&mut self, mut f: impl FnMut(usize, CachedBlock)) -> usize {
        let mut n = 0;
        for (len, blocks) in self.cache.drain() {
            n += blocks.len();
            for b in blocks {
                f(len, b);
            }
        }
        self.cached_bytes = 0;
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vector_clock_merge_takes_maximum_per_stream() {
        let mut a = VectorClock::default();
        a.raise(1, 5);
        a.raise(2, 1);
        let mut b = VectorClock::default();
        b.raise(2, 7);
        b.raise(3, 2);
        a.merge(&b);
        assert_eq!((a.get(1), a.get(2), a.get(3), a.get(4)), (5, 7, 2, 0));
        a.raise(1, 3);
        assert_eq!(a.get(1), 5, "raise never lowers");
    }
}
