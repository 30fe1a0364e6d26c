//! Synthetic allocation traces of shapes other than a training loop on one
//! stream, written by `tidepool-tracegen` into `traces/`.
//!
//! Both shapes repeat a step many times with random variation (sizes,
//! counts, lifetimes), so that every step resembles the others without
//! repeating them, and a warm replay pass meets a pool shaped by the same
//! kind of work. Everything is drawn from one seeded generator
//! ([`SplitMix64`]): the same shape, seed and step count give the same
//! text, byte for byte, on every machine.
//!
//! - [`Shape::Pipeline`]: a producer stream hands input blocks to consumer
//!   streams in turn; each consumer frees the input it received (on its
//!   own stream, after a wait on the producer), allocates activations, and
//!   hands an output block back to the producer, which frees it a few
//!   microbatches later (after a wait on that consumer). Two microbatches'
//!   activations are live at once on different streams.
//! - [`Shape::RandomLongLived`]: one stream, sizes drawn at random over
//!   six orders of magnitude, most blocks short-lived, some living to the
//!   end of their step, and some living for several steps, so that
//!   long-lived blocks sit between the holes the others leave.

use std::fmt::{self, Write};

/// A small, fast, seeded generator (SplitMix64): enough for drawing trace
/// shapes, and stable, unlike a library's generator whose output may change
/// with its version. A dependency would buy nothing here.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        debug_assert!(lo <= hi);
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Log-uniform in `lo..=hi` (each power of two equally likely).
    pub fn log_uniform(&mut self, lo: u64, hi: u64) -> u64 {
        let (l, h) = ((lo as f64).ln(), (hi as f64).ln());
        ((l + (h - l) * self.unit()).exp() as u64).clamp(lo, hi)
    }
}

/// Which synthetic workload to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// Producer/consumer pipeline across streams.
    Pipeline,
    /// Random sizes on one stream, with long-lived blocks.
    RandomLongLived,
}

impl Shape {
    pub const ALL: [Shape; 2] = [Shape::Pipeline, Shape::RandomLongLived];

    /// The name on the command line and of the trace file.
    pub fn name(self) -> &'static str {
        match self {
            Shape::Pipeline => "pipeline",
            Shape::RandomLongLived => "random-longlived",
        }
    }

    /// The steps of the shipped trace (`traces/<name>.csv.gz`).
    pub fn shipped_steps(self) -> u32 {
        match self {
            Shape::Pipeline => 60,
            Shape::RandomLongLived => 60,
        }
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Shape {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Shape::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| format!("unknown shape `{s}` (known: pipeline, random-longlived)"))
    }
}

/// The seed of the shipped traces.
pub const SHIPPED_SEED: u64 = 1;

/// Consumer streams of the pipeline (stream 0 is the producer).
pub const PIPELINE_CONSUMERS: u64 = 3;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// Sizes as a caching allocator asks for them: multiples of 512 bytes.
fn round512(n: u64) -> u64 {
    n.div_ceil(512).max(1) * 512
}

/// Writes trace lines and hands out ids.
struct Out {
    text: String,
    next_id: u64,
}

impl Out {
    fn new(shape: Shape, seed: u64, steps: u32) -> Self {
        let mut text = String::new();
        let _ = writeln!(
            text,
            "# synthetic trace `{shape}`: tidepool-tracegen --shape {shape} --seed {seed} --steps {steps}"
        );
        text.push_str("op,id,size,stream\n");
        Out { text, next_id: 0 }
    }

    fn alloc(&mut self, size: u64, stream: u64) -> (u64, u64) {
        let id = self.next_id;
        self.next_id += 1;
        let _ = writeln!(self.text, "a,{id},{size},{stream}");
        (id, size)
    }

    fn free(&mut self, (id, size): (u64, u64), stream: u64) {
        let _ = writeln!(self.text, "f,{id},{size},{stream}");
    }

    /// `stream` waits for the work issued on `from` so far.
    fn wait(&mut self, from: u64, stream: u64) {
        let _ = writeln!(self.text, "w,{from},0,{stream}");
    }
}

/// The trace of `shape` with `steps` steps from `seed`, as CSV text (a
/// comment naming the command, the header, one operation a line).
pub fn generate(shape: Shape, seed: u64, steps: u32) -> String {
    let mut rng = SplitMix64::new(seed ^ (shape as u64).wrapping_mul(0x5851_F42D_4C95_7F2D));
    let mut out = Out::new(shape, seed, steps);
    match shape {
        Shape::Pipeline => pipeline(&mut rng, &mut out, steps),
        Shape::RandomLongLived => random_longlived(&mut rng, &mut out, steps),
    }
    out.text
}

/// One consumer's work on one microbatch, split in the two halves that are
/// issued at different times.
struct Microbatch {
    consumer: u64,
    input: (u64, u64),
    /// Activations kept until the backward half.
    kept: Vec<(u64, u64)>,
    tokens: u64,
}

fn pipeline(rng: &mut SplitMix64, out: &mut Out, steps: u32) {
    const PRODUCER: u64 = 0;
    // Weights and optimizer state of the model the consumers run: live for
    // the whole trace, allocated on the producer before any hand-over.
    for _ in 0..rng.range(24, 40) {
        let size = round512(rng.log_uniform(64 * KIB, 24 * MIB));
        out.alloc(size, PRODUCER);
    }
    let mut next_consumer = 0u64;
    // Outputs handed back, freed by the producer `DEPTH` microbatches later.
    const DEPTH: usize = 2;
    let mut outputs: std::collections::VecDeque<(u64, (u64, u64))> = Default::default();
    for _ in 0..steps {
        // The step's shape: how many microbatches and how long each one's
        // sequences are (as in training on text of varied length).
        let microbatches = rng.range(6, 10);
        let base_tokens = 64 * rng.range(4, 48);
        // A per-step accumulator on the producer (gradients, metrics).
        let acc = out.alloc(round512(base_tokens * 96 * KIB / 64), PRODUCER);
        let mut pending: Option<Microbatch> = None;
        for _ in 0..microbatches {
            let tokens = (base_tokens as f64 * (0.75 + 0.5 * rng.unit())) as u64;
            let consumer = 1 + next_consumer;
            next_consumer = (next_consumer + 1) % PIPELINE_CONSUMERS;
            // Producer: a staging buffer (freed at once on its own stream)
            // and the input block handed to the consumer.
            let staging = out.alloc(round512(tokens * 8 * KIB), PRODUCER);
            let input = out.alloc(round512(tokens * 24 * KIB), PRODUCER);
            let mask = out.alloc(round512(tokens * 4 + rng.range(0, 4096)), PRODUCER);
            out.free(staging, PRODUCER);
            out.wait(PRODUCER, consumer);
            out.free(mask, consumer);
            // Consumer, forward half: activations, some freed at once.
            let mut kept = Vec::new();
            for layer in 0..rng.range(4, 7) {
                let wide = out.alloc(round512(tokens * 64 * KIB), consumer);
                let narrow = out.alloc(round512(tokens * 16 * KIB), consumer);
                let small = out.alloc(round512(rng.log_uniform(512, 256 * KIB)), consumer);
                out.free(small, consumer);
                kept.push(narrow);
                if layer % 2 == 0 {
                    kept.push(wide);
                } else {
                    out.free(wide, consumer);
                }
            }
            // The previous microbatch's backward half, on its own consumer
            // stream, issued after this one's forward half: two
            // microbatches' activations are live on two streams.
            if let Some(prev) = pending.take() {
                backward(rng, out, prev, &mut outputs);
            }
            pending = Some(Microbatch {
                consumer,
                input,
                kept,
                tokens,
            });
            // The producer collects outputs DEPTH microbatches old.
            while outputs.len() > DEPTH {
                let (from, o) = outputs.pop_front().expect("non-empty");
                out.wait(from, PRODUCER);
                out.free(o, PRODUCER);
            }
        }
        if let Some(prev) = pending.take() {
            backward(rng, out, prev, &mut outputs);
        }
        // End of step: the producer waits for every consumer, collects the
        // outputs and frees the accumulator.
        for c in 1..=PIPELINE_CONSUMERS {
            out.wait(c, PRODUCER);
        }
        for (_, o) in outputs.drain(..) {
            out.free(o, PRODUCER);
        }
        out.free(acc, PRODUCER);
    }
}

/// The backward half of a microbatch: gradients allocated and freed, the
/// kept activations and the input freed (on the consumer's stream), and an
/// output block handed back to the producer.
fn backward(
    rng: &mut SplitMix64,
    out: &mut Out,
    mb: Microbatch,
    outputs: &mut std::collections::VecDeque<(u64, (u64, u64))>,
) {
    let c = mb.consumer;
    let output = out.alloc(round512(mb.tokens * 4 * KIB), c);
    for a in mb.kept.into_iter().rev() {
        let grad = out.alloc(a.1, c);
        let tmp = out.alloc(round512(rng.log_uniform(4 * KIB, 4 * MIB)), c);
        out.free(tmp, c);
        out.free(a, c);
        out.free(grad, c);
    }
    // Legal: the consumer waited on the producer after the input's
    // allocation, and the producer never touches it again.
    out.free(mb.input, c);
    outputs.push_back((c, output));
}

fn random_longlived(rng: &mut SplitMix64, out: &mut Out, steps: u32) {
    const S: u64 = 0;
    // A few blocks live for the whole trace.
    for _ in 0..rng.range(8, 16) {
        out.alloc(round512(rng.log_uniform(MIB, 64 * MIB)), S);
    }
    // Blocks living across steps: (step at which they are freed, block).
    let mut long: Vec<(u32, (u64, u64))> = Vec::new();
    for step in 0..steps {
        let mut step_blocks: Vec<(u64, u64)> = Vec::new();
        // Short-lived blocks: freed after a few more allocations.
        let mut short: Vec<(u64, (u64, u64))> = Vec::new();
        let n = rng.range(250, 400);
        for i in 0..n {
            let size = if rng.unit() < 0.04 {
                rng.log_uniform(64 * MIB, 256 * MIB)
            } else {
                rng.log_uniform(256, 64 * MIB)
            };
            let b = out.alloc(round512(size), S);
            let class = rng.unit();
            if class < 0.65 {
                short.push((i + rng.range(1, 24), b));
            } else if class < 0.93 {
                step_blocks.push(b);
            } else {
                long.push((step + rng.range(1, 12) as u32, b));
            }
            // Free the short-lived blocks whose time has come, in the order
            // they were due.
            short.sort_by_key(|&(due, b)| (due, b.0));
            while short.first().is_some_and(|&(due, _)| due <= i) {
                let (_, b) = short.remove(0);
                out.free(b, S);
            }
        }
        for (_, b) in short.drain(..) {
            out.free(b, S);
        }
        // The step's blocks go in a random order.
        while !step_blocks.is_empty() {
            let k = rng.range(0, step_blocks.len() as u64 - 1) as usize;
            out.free(step_blocks.swap_remove(k), S);
        }
        // Long-lived blocks due at the end of this step.
        let mut k = 0;
        while k < long.len() {
            if long[k].0 <= step {
                out.free(long.swap_remove(k).1, S);
            } else {
                k += 1;
            }
        }
    }
    for (_, b) in long {
        out.free(b, S);
    }
}
