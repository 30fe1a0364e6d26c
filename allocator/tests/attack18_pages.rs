//! A capped pool near its limit with blocks of whole pages, one byte
//! less and one byte more, among small ones: takes of several pages over
//! free ranges of several guards, pages stitched and rebound to serve
//! them, `trim_to` and release thresholds between operations, streams
//! held busy through phases so that frees stay pending.
//!
//! Checked after every operation against a model of the live blocks: no
//! two live blocks overlap; `used_current` is the sum of the live sizes;
//! reserved bytes never below used nor past the cap. Words of a block are
//! checked before many of its frees, and of every live block at each
//! phase's end. After each phase's synchronize, a request of one page
//! less than the untouched pages succeeds; at the end the whole cap.
//!
//! Work is bounded by operation counts; seeds are fixed.
mod attack18_support;
mod common;

use attack18_support::*;

const VA: u64 = 512 << 20;

fn setup(label: &'static str, pages: usize, max: usize, gates: bool) -> Setup {
    Setup {
        label,
        cfg: capped(VA, pages, 0, reuse(true, true, false)),
        cap_pages: pages,
        streams: 5,
        sizes: Sizes::Mixed(max),
        phases: 6,
        steps: 250,
        gates,
        spare_check: true,
    }
}

#[test]
fn pages_near_cap() {
    let ooms = sweep(setup("pages-near-cap", 16, 5, false), 1..=4);
    assert!(ooms > 0, "the cap was never reached");
}

#[test]
fn pages_near_cap_gated() {
    let ooms = sweep(setup("pages-gated", 16, 5, true), 11..=14);
    assert!(ooms > 0, "the cap was never reached");
}

#[test]
fn pages_wide() {
    sweep(setup("pages-wide", 40, 12, false), 21..=23);
}
