//! The tag stress harness (`tidepool_kernels::stress`) on a pool with
//! physical units of several pages: several threads and streams, frees on
//! other streams after event chains, declared uses, spins that hold
//! streams busy, trims, synchronisations with a release threshold, and
//! every reuse switch flipped by phases, in a pool capped at 48 MiB so
//! that units are moved, trimmed whole and pinned. Every fill and verify
//! runs in stream order on the host; the run must end with no mismatch
//! and no access fault (a unit unmapped or moved under work still
//! pending, or a block handed out too early). Bounded by operation counts.

use std::sync::Arc;
use tidepool::{MemPool, PoolConfig};
use tidepool_kernels::host::HostKernels;
use tidepool_kernels::stress::{run_stress, StressConfig};
use tidepool_sys::host::{HostConfig, HostDevice};
use tidepool_sys::{Device, Stream};

const MIB: usize = 1 << 20;

fn stress(max_unit: usize, unit_min: usize, seed: u64) {
    let dev = Arc::new(HostDevice::with_config(HostConfig {
        capacity: 256 * MIB,
        ..Default::default()
    }));
    let pool = MemPool::new(
        dev.clone(),
        PoolConfig::default()
            .with_va_size(1 << 30)
            .with_max_size(48 * MIB as u64)
            .with_stream_cache_bytes(4 * MIB)
            .with_max_unit_size(max_unit)
            .with_unit_min_block(unit_min),
    )
    .expect("pool");
    let kernels = HostKernels::new(dev.clone());
    let streams: Vec<Stream> = (0..5).map(|_| dev.create_stream().unwrap()).collect();
    let cfg = StressConfig {
        seed,
        threads: 3,
        ops: 1000,
        min_size: 4096,
        max_size: 8 * MIB,
        max_live_per_thread: 4,
        max_spin_ns: 100_000,
        trim_every: 60,
        sync_every: 160,
        release_threshold: Some(16 * MIB as u64),
        ..StressConfig::host_ci()
    };
    let report = run_stress(&pool, &kernels, &streams, &cfg).expect("stress harness");
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "{report}");
    assert!(report.passed(), "{report}");
    assert!(report.allocs > 200, "the run allocated: {report}");
    pool.synchronize().unwrap();
    let st = pool.stats();
    assert_eq!(st.used_current, 0);
    pool.trim_to(0).unwrap();
    assert_eq!(pool.stats().reserved_current, 0);
    drop(pool);
    assert_eq!((dev.live_handles(), dev.live_mappings()), (0, 0));
}

#[test]
fn stress_with_units_of_8_mib_from_2_mib_blocks() {
    stress(8 * MIB, 2 * MIB, 0x00A7_7AC3);
}

#[test]
fn stress_with_units_of_64_mib_from_4_mib_blocks() {
    stress(64 * MIB, 4 * MIB, 0x00A7_7AC4);
}
