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
mod attack17_support;
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

/// Units of several pages (a block of 4 MiB or more gets a unit of its
/// own): stitching and rebinding over units and single pages.
#[test]
fn pages_units() {
    let mut s = setup("pages-units", 32, 6, false);
    s.cfg = s
        .cfg
        .with_max_unit_size(8 * MIB)
        .with_unit_min_block(4 * MIB);
    s.spare_check = false;
    sweep(s, 31..=33);
}

/// Internal dependencies and a stream cache of 1 MiB, follow only.
#[test]
fn pages_internal_deps_cache() {
    let mut s = setup("pages-internal", 16, 4, true);
    s.cfg = capped(VA, 16, MIB, reuse(true, false, true));
    sweep(s, 41..=43);
}

/// An address space a few pages wider than the cap: addresses are
/// reused, blocks reach the zones' bounds. No spare check: the pages
/// left untouched need not be one stretch of addresses.
#[test]
fn pages_tight_va() {
    let mut s = setup("pages-tight-va", 16, 4, false);
    s.cfg = capped((20 * PAGE) as u64, 16, 0, reuse(true, true, false));
    s.spare_check = false;
    sweep(s, 51..=53);
}
