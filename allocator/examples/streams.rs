//! A tour of the pool on whatever device this machine has: the CUDA backend
//! when a driver is loadable, the host backend otherwise.
//!
//! ```sh
//! cargo run -p tidepool --example streams
//! ```
//!
//! Same-stream reuse, a cross-stream hand-over through a pool event, a
//! declared use on another stream, statistics, trim, and the typed errors a
//! caller acts on. `RUST_LOG=debug` (or `tidepool=trace`) also prints the
//! pool's events (see docs/logging.md).

use std::sync::Arc;
use tidepool::{MemPool, PoolConfig, PoolError};
use tidepool_sys::Device;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The pool's `tracing` events on stderr, filtered by RUST_LOG
    // (default: warnings and errors only).
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    if tidepool_sys::cuda::driver_available() {
        let device = Arc::new(tidepool_sys::cuda::CudaDevice::new(0)?);
        tour(device)
    } else {
        println!(
            "no CUDA driver ({}): host backend",
            tidepool_sys::cuda::driver_unavailable_reason().unwrap_or_default()
        );
        let device = Arc::new(tidepool_sys::host::HostDevice::new());
        tour(device)
    }
}

fn tour<D: Device>(device: Arc<D>) -> Result<(), Box<dyn std::error::Error>> {
    let config = PoolConfig::default()
        // Refuse to hold more than 256 MiB of physical memory.
        .with_max_size(256 << 20)
        // Keep 64 MiB across synchronisations, give the rest back.
        .with_release_threshold(64 << 20);
    let pool = MemPool::new(device.clone(), config)?;
    let (a, b, reader) = (
        device.create_stream()?,
        device.create_stream()?,
        device.create_stream()?,
    );

    // Same stream: memory freed on `a` serves the next allocation on `a`
    // at once, with no event (work on `a` runs in order).
    let x = pool.alloc_async(1 << 20, a)?;
    let first = x.ptr();
    pool.free_async(x, a)?;
    let y = pool.alloc_async(1 << 20, a)?;
    println!(
        "same-stream reuse: {}",
        if y.ptr() == first {
            "same block"
        } else {
            "another block"
        }
    );

    // Cross-stream: `b` waits, through the pool, on an event recorded on
    // `a` after the free; the pool then knows `b` is ordered after it, so
    // a's block becomes *eligible* for `b`. Eligible is not chosen: the
    // block sits in a's per-stream cache (kept for a's next allocation, the
    // fastest path), and the rest of the page the pool already holds needs
    // no ordering at all, so `b` gets that. a's block would go to `b` before
    // the pool grew or moved memory: caches join the shared free ranges
    // whenever nothing else fits, and the event makes the block usable on
    // `b` with no query and no wait.
    pool.free_async(y, a)?;
    let done_on_a = pool.record_event(a)?;
    pool.wait_event(b, &done_on_a)?;
    let z = pool.alloc_async(1 << 20, b)?;
    if z.ptr() == first {
        println!("after the event, b got a's block");
    } else {
        println!(
            "after the event, b got another block: a's block stays in a's per-stream \
             cache while free memory that needs no ordering is at hand (see the comment)"
        );
    }

    // A use on another stream must be declared; the free then waits for it
    // in stream order (like PyTorch's record_stream).
    let mut shared = z;
    pool.record_use(&mut shared, reader);
    pool.free_async(shared, b)?;

    // Out-of-memory is reported by the call itself, with what the pool saw
    // (the pool also logs it as a warning on stderr).
    match pool.alloc_async(1 << 30, a) {
        Err(e @ PoolError::OutOfMemory(_)) => println!("1 GiB refused: {e}"),
        Err(e) => return Err(e.into()),
        Ok(_) => unreachable!("the pool is capped at 256 MiB"),
    }

    // Retire streams before destroying them: the pool closes their frees
    // with an event so it can still learn when they complete.
    pool.synchronize()?;
    println!("stats: {}", pool.stats());
    let released = pool.trim_to(0)?;
    println!(
        "trim_to(0) released {released} B; {} B still held",
        pool.stats().reserved_current
    );
    for st in [a, b, reader] {
        pool.retire_stream(st)?;
        device.destroy_stream(st)?;
    }
    Ok(())
}
