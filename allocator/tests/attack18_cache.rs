//! The stream caches under many distinct lengths: more small lengths
//! than a stream usually holds, and more long lengths (above 64 KiB) than
//! the lists a drain keeps, so that drains clear the long lengths' lists
//! and later frees build them again; batches of same-stream frees with
//! new epochs between them, reallocations of the same lengths, frees on
//! other streams, caches drained by requests the free ranges cannot
//! serve under a cap, and by synchronizations.
//!
//! Checked after every operation against a model of the live blocks: no
//! two live blocks overlap; `used_current` is the sum of the live sizes;
//! reserved bytes never below used nor past the cap. Words of a block are
//! checked before many of its frees, and of every live block at each
//! phase's end. After each phase's synchronize, a request of one page
//! less than the untouched pages succeeds; at the end the whole cap.
//!
//! Work is bounded by operation counts; seeds are fixed.
mod attack17_support;
mod attack18_support;
mod common;

use attack18_support::*;

const VA: u64 = 256 << 20;

fn setup(label: &'static str, cache: usize, follow: bool, opp: bool, gates: bool) -> Setup {
    Setup {
        label,
        cfg: capped(VA, 10, cache, reuse(follow, opp, false)),
        cap_pages: 10,
        streams: 4,
        sizes: Sizes::CacheLens,
        phases: 6,
        steps: 300,
        gates,
        spare_check: true,
    }
}

#[test]
fn cache_many_lengths_default_cache() {
    sweep(setup("cache-default", 256 * MIB, true, true, false), 1..=3);
}

#[test]
fn cache_many_lengths_small_cache() {
    sweep(setup("cache-small", 256 * KIB, true, false, false), 11..=13);
}

#[test]
fn cache_many_lengths_gated() {
    sweep(setup("cache-gated", 4 * MIB, false, true, true), 21..=23);
}
