//! loom model checks of tidepool's concurrency.
//!
//! - [`device::ModelDevice`]: a [`tidepool_sys::Device`] made of counters
//!   (no syscalls, no threads) whose state sits behind the [`sync`] shim's
//!   mutex, so loom sees every device call as a synchronisation point. It
//!   also checks the pool: every byte the pool hands out must be mapped,
//!   never overlap a live allocation, and be reused only by work ordered
//!   after the free (device-level vector clocks); every unmap must miss
//!   live and pending memory.
//! - [`scenarios`]: the models (two threads, a handful of operations each).
//!   `tests/models.rs` runs each under `loom::model` (`--cfg loom`); the unit
//!   tests below run each once on std threads, so `cargo test --workspace`
//!   exercises the model device too.
//!
//! See `docs/loom.md`.

pub mod device;
pub mod scenarios;
pub mod sync;

#[cfg(all(test, not(loom)))]
mod tests {
    use crate::scenarios;

    // The same scenarios, on std threads, a few times each (one sampled
    // interleaving per run; loom explores them all).
    #[test]
    fn watch_hint_free_vs_poll_std() {
        for _ in 0..20 {
            scenarios::watch_hint_free_vs_poll();
        }
    }

    #[test]
    fn shard_alloc_free_std() {
        for _ in 0..20 {
            scenarios::shard_alloc_free();
        }
    }

    #[test]
    fn cross_stream_event_std() {
        for _ in 0..20 {
            scenarios::cross_stream_event();
        }
    }

    #[test]
    fn trim_vs_pending_std() {
        for _ in 0..20 {
            scenarios::trim_vs_pending();
        }
    }

    #[test]
    fn raw_double_free_std() {
        for _ in 0..20 {
            scenarios::raw_double_free();
        }
    }

    #[test]
    fn stats_live_set_std() {
        for _ in 0..20 {
            scenarios::stats_live_set();
        }
    }

    #[test]
    fn reuse_switch_publication_std() {
        for _ in 0..20 {
            scenarios::reuse_switch_publication();
        }
    }

    #[test]
    fn busy_list_free_vs_pass_std() {
        for _ in 0..20 {
            scenarios::busy_list_free_vs_pass();
        }
    }

    #[test]
    fn headroom_donors_std() {
        for _ in 0..20 {
            scenarios::headroom_donors();
        }
    }

    #[test]
    fn watch_free_vs_poll_std() {
        for _ in 0..20 {
            scenarios::watch_free_vs_poll();
        }
    }

    #[test]
    fn announced_capture_gate_std() {
        for _ in 0..20 {
            scenarios::announced_capture_gate();
        }
    }

    #[test]
    fn lean_lock_excludes_std() {
        for _ in 0..20 {
            scenarios::lean_lock_excludes();
        }
    }

    #[test]
    fn forget_retired_vs_stats_std() {
        for _ in 0..20 {
            scenarios::forget_retired_vs_stats();
        }
    }
}
