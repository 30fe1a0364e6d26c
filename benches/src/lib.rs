//! tidepool-benches: trace replay (`tidepool-replay`) and benchmarks.
//!
//! [`replay`] holds everything the replay binary, its tests and the
//! benchmarks share: trace parsing, the allocator abstraction and replay
//! loop, the allocators themselves, reports and plots. [`benchutil`] holds
//! the criterion benches' shared helpers (quick mode, summary file, device
//! setup and skipping, the allocators under test).

pub mod benchutil;
pub mod replay;
