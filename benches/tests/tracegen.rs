//! The synthetic traces: the shipped files are exactly what the generator
//! writes with the documented command, the generator is deterministic, and
//! its traces are legal (every free on another stream is ordered after its
//! allocation) and of the shape they claim.

use flate2::read::MultiGzDecoder;
use std::io::Read;
use std::path::{Path, PathBuf};
use tidepool_benches::replay::{Trace, TraceOp};
use tidepool_benches::tracegen::{self, Shape, SHIPPED_SEED};

fn traces_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."))
        .join("traces")
}

fn parse(text: &str) -> Trace {
    Trace::parse(text.as_bytes(), Path::new("generated.csv"), None).unwrap()
}

#[test]
fn shipped_files_are_the_generators_output() {
    for shape in Shape::ALL {
        let path = traces_dir().join(format!("{shape}.csv.gz"));
        let mut shipped = String::new();
        MultiGzDecoder::new(std::fs::File::open(&path).unwrap())
            .read_to_string(&mut shipped)
            .unwrap();
        let generated = tracegen::generate(shape, SHIPPED_SEED, shape.shipped_steps());
        assert!(
            shipped == generated,
            "{} differs from `tidepool-tracegen --shape {shape}` (regenerate it, see \
             traces/README.md)",
            path.display()
        );
    }
}

#[test]
fn same_seed_same_trace_other_seed_other_trace() {
    for shape in Shape::ALL {
        let a = tracegen::generate(shape, 7, 5);
        assert_eq!(a, tracegen::generate(shape, 7, 5), "{shape}");
        assert_ne!(a, tracegen::generate(shape, 8, 5), "{shape}");
    }
}

#[test]
fn pipeline_hands_blocks_across_streams_legally() {
    let t = parse(&tracegen::generate(Shape::Pipeline, SHIPPED_SEED, 10));
    assert_eq!(t.streams.len(), 1 + tracegen::PIPELINE_CONSUMERS as usize);
    assert!(t.waits > 0);
    assert!(t.unordered_frees().is_empty());
    // Blocks allocated on the producer are freed on consumers and the
    // other way round.
    let mut born = vec![0u32; t.slots];
    let (mut to_consumer, mut to_producer) = (0, 0);
    for op in &t.ops {
        match *op {
            TraceOp::Alloc { slot, stream, .. } => born[slot as usize] = stream,
            TraceOp::Free { slot, stream } if born[slot as usize] != stream => {
                if stream == 0 {
                    to_producer += 1;
                } else {
                    to_consumer += 1;
                }
            }
            _ => {}
        }
    }
    assert!(
        to_consumer > 0 && to_producer > 0,
        "{to_consumer} {to_producer}"
    );
}

#[test]
fn random_longlived_keeps_blocks_across_steps() {
    let t = parse(&tracegen::generate(
        Shape::RandomLongLived,
        SHIPPED_SEED,
        10,
    ));
    assert_eq!(t.streams.len(), 1);
    // Sizes over many orders of magnitude.
    let sizes: Vec<usize> = t
        .ops
        .iter()
        .filter_map(|op| match *op {
            TraceOp::Alloc { size, .. } => Some(size),
            _ => None,
        })
        .collect();
    let (min, max) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
    assert!(*min <= 4096 && *max >= 64 << 20, "{min} {max}");
    // Some blocks outlive many allocations: the longest lifetime, in
    // operations, exceeds one step's length (at least 500 operations).
    let mut born = vec![0usize; t.slots];
    let mut longest = 0;
    for (i, op) in t.ops.iter().enumerate() {
        match *op {
            TraceOp::Alloc { slot, .. } => born[slot as usize] = i,
            TraceOp::Free { slot, .. } => longest = longest.max(i - born[slot as usize]),
            TraceOp::Wait { .. } => {}
        }
    }
    assert!(longest > 2000, "{longest}");
}
