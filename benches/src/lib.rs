//! tidepool-benches: trace replay (`tidepool-replay`) and benchmarks.
//!
//! [`tracegen`] writes the synthetic traces (`tidepool-tracegen`).
//!
//! [`replay`] holds everything the replay binary, its tests and the
//! benchmarks share: trace parsing, the allocator abstraction and replay
//! loop, the allocators themselves, reports and plots. The criterion
//! benches' own helpers live beside them (`benches/benchutil/mod.rs`), so
//! that building the replayer does not build criterion.

pub mod replay;
pub mod tracegen;
