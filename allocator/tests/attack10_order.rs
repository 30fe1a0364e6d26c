//! Pages whose frees are pending may move to the allocating stream when
//! the pool would grow otherwise: attacked on the orderings that make
//! such a move sound, through `MemPool` on the host backend (real memory,
//! worker-thread streams, an access to an unmapped address reported by
//! the "kernel"):
//! - a stream that waited (through the pool) on an event of a held stream
//!   may get the pages freed there before the event, never those freed
//!   after it;
//! - with the pool told not to follow event waits, it gets none of them;
//! - a block used by a third, held stream (declared with `record_use`)
//!   moves with its free's ordering: the moved page is written by the
//!   new block's stream only after the third stream's work;
//! - a page moved while pending, freed again while pending and moved
//!   again: every place it was mapped at stays mapped while the stream
//!   is held, trimming releases none of them, and everything goes back
//!   once the work is done.
//!
//! Work is bounded by operation counts; streams are held with gates.

mod common;

use common::{overlaps, write_kernel, Blocker, PAGE};
use std::sync::Arc;
use tidepool::{MemPool, ReusePolicy};
use tidepool_sys::{Device, HostDevice};

const MIB: usize = 1 << 20;

/// A pool capped at `pages` pages, no stream cache, the reuse switches
/// given (internal dependencies and host waits off: a block handed out is
/// usable at once, or the request fails).
fn capped(dev: &Arc<HostDevice>, pages: usize, follow: bool) -> MemPool<HostDevice> {
    common::pool(
        dev,
        common::config()
            .with_max_size((pages * PAGE) as u64)
            .with_stream_cache_bytes(0)
            .with_reuse(ReusePolicy {
                follow_event_dependencies: follow,
                opportunistic: true,
                internal_dependencies: false,
                wait_for_pending_frees: false,
            }),
    )
}

/// Stream `b` waits (through the pool) on an event recorded on held
/// stream `a` after `a` freed X1 and before it freed X2 (each a page a
/// kernel on `a` writes first). `b`'s two-page request cannot fit in
/// place and the cap leaves no growth: X1's page may move to it, X2's
/// may not (`b` is not ordered after X2's free). Whatever `b` gets, its
/// data and X2's kernel's data must both survive once everything ran.
/// Caught: a mover that takes any page pending on a single stream
/// (`page_pending_for` without the `classify` check).
#[test]
fn a_wait_covers_only_the_frees_recorded_before_it() {
    let dev = Arc::new(common::host_with_capacity(64 * MIB));
    let pool = capped(&dev, 2, true);
    let a = dev.create_stream().unwrap();
    let b = dev.create_stream().unwrap();
    let mut hold = Blocker::on(&*dev, a);

    let x1 = pool.alloc_async(PAGE, a).unwrap();
    let x2 = pool.alloc_async(PAGE, a).unwrap();
    assert_eq!(pool.stats().reserved_current, 2 * PAGE as u64);
    let (p1, p2) = (x1.ptr(), x2.ptr());
    let w1 = common::pattern(11, PAGE / 4);
    let w2 = common::pattern(12, PAGE / 4);
    let k1 = write_kernel(&dev, a, p1, w1);
    pool.free_async(x1, a).unwrap();
    let ev = pool.record_event(a).unwrap();
    pool.wait_event(b, &ev).unwrap();
    let k2 = write_kernel(&dev, a, p2, w2.clone());
    pool.free_async(x2, a).unwrap();

    let got = pool.alloc_async(2 * PAGE, b);
    let (moves, bad) = pool.pending_move_counts();
    assert!(moves <= 1, "{moves} pages moved to b; only X1's may");
    assert_eq!(bad, 0);
    let mut written = None;
    match got {
        Ok(y) => {
            let wy = common::pattern(13, y.size() / 4);
            let ky = write_kernel(&dev, b, y.ptr(), wy.clone());
            written = Some((y, wy, ky));
        }
        Err(e) => assert!(e.is_out_of_memory(), "unexpected error: {e}"),
    }
    assert!(!hold.done());
    hold.release();
    assert!(k1.recv().unwrap(), "X1's old place was unmapped");
    assert!(k2.recv().unwrap(), "X2's old place was unmapped");
    pool.synchronize().unwrap();
    assert_eq!(
        dev.read_words(p2, PAGE / 4).expect("X2's old place mapped"),
        w2,
        "X2's kernel's data was overwritten: b got its page before its free"
    );
    if let Some((y, wy, ky)) = written {
        assert!(ky.recv().unwrap());
        assert_eq!(
            dev.read_words(y.ptr(), wy.len()).unwrap(),
            wy,
            "b's block was overwritten by a's kernel"
        );
        pool.free_async(y, b).unwrap();
    }
    // b may now take a page of its own (X1's, in place or moved).
    let z = pool
        .alloc_async(PAGE, b)
        .expect("X1's page, ordered before b");
    pool.free_async(z, b).unwrap();
    pool.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    assert_eq!(pool.stats().reserved_current, 0);
    assert_eq!(dev.live_handles(), 0);
    assert_eq!(pool.pending_move_counts().1, 0);
}

/// The same wait, the pool told not to follow event waits: `b` may not
/// take a page pending on `a` (in place or moved), whatever the device
/// orders. Caught: a mover that follows waits regardless of the switch
/// (`page_pending_for` classifying with `follow_event_dependencies` on).
#[test]
fn with_waits_not_followed_no_page_moves_to_another_stream() {
    let dev = Arc::new(common::host_with_capacity(64 * MIB));
    let pool = capped(&dev, 2, false);
    let a = dev.create_stream().unwrap();
    let b = dev.create_stream().unwrap();
    let mut hold = Blocker::on(&*dev, a);

    let x1 = pool.alloc_async(PAGE, a).unwrap();
    let x2 = pool.alloc_async(PAGE, a).unwrap();
    let k1 = write_kernel(&dev, a, x1.ptr(), common::pattern(21, PAGE / 4));
    let k2 = write_kernel(&dev, a, x2.ptr(), common::pattern(22, PAGE / 4));
    pool.free_async(x1, a).unwrap();
    pool.free_async(x2, a).unwrap();
    let ev = pool.record_event(a).unwrap();
    pool.wait_event(b, &ev).unwrap();

    for len in [PAGE, 2 * PAGE, 3 * MIB] {
        match pool.alloc_async(len, b) {
            Ok(y) => panic!(
                "b got {len} B at {:#x} from pages pending on a (moves: {:?})",
                y.ptr(),
                pool.pending_move_counts()
            ),
            Err(e) => assert!(e.is_out_of_memory(), "unexpected error: {e}"),
        }
    }
    assert_eq!(pool.pending_move_counts(), (0, 0));
    // a itself may take them (moved or in place): its own frees.
    let y = pool
        .alloc_async(2 * PAGE, a)
        .expect("a's own pending pages");
    hold.release();
    assert!(k1.recv().unwrap() && k2.recv().unwrap());
    pool.free_async(y, a).unwrap();
    pool.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    assert_eq!(pool.stats().reserved_current, 0);
    assert_eq!(dev.live_handles(), 0);
}

/// X is allocated on `s`, used by held stream `c` (declared with
/// `record_use`, a kernel on `c` writes it) and freed on `s`: `s` waits
/// for `c`, so `s`'s next block may take X's page at once, moved (a page
/// in use sits past X and the cap leaves one page of growth). `s`'s
/// kernel on the new block must run after `c`'s on the old place: once
/// all ran, the new block holds `s`'s data. Caught: a free that ignores
/// declared uses (the free's epoch not ordered after `c`).
#[test]
fn a_moved_page_waits_for_a_declared_user_stream() {
    let dev = Arc::new(common::host_with_capacity(64 * MIB));
    let pool = capped(&dev, 3, true);
    let s = dev.create_stream().unwrap();
    let c = dev.create_stream().unwrap();
    let mut hold = Blocker::on(&*dev, c);

    let mut x = pool.alloc_async(PAGE, s).unwrap();
    let z = pool.alloc_async(PAGE, s).unwrap();
    let xp = x.ptr();
    pool.record_use(&mut x, c);
    let kc = write_kernel(&dev, c, xp, common::pattern(31, PAGE / 4));
    pool.free_async(x, s).unwrap();

    let y = pool
        .alloc_async(2 * PAGE, s)
        .expect("one page of growth and X's page, pending on s");
    assert!(!overlaps(y.ptr(), y.size(), xp, PAGE));
    assert_eq!(pool.pending_move_counts(), (1, 0), "X's page moved");
    let wy = common::pattern(32, y.size() / 4);
    let ky = write_kernel(&dev, s, y.ptr(), wy.clone());
    assert!(!hold.done());
    hold.release();
    assert!(kc.recv().unwrap(), "X's old place was unmapped under c");
    assert!(ky.recv().unwrap());
    pool.synchronize().unwrap();
    assert_eq!(
        dev.read_words(y.ptr(), wy.len()).unwrap(),
        wy,
        "c's kernel wrote the moved page after s's block took it"
    );
    pool.free_async(y, s).unwrap();
    pool.free_async(z, s).unwrap();
    pool.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    assert_eq!(pool.stats().reserved_current, 0);
    assert_eq!(dev.live_handles(), 0);
    assert_eq!(dev.live_mappings(), 0);
}

/// A held place may come back for a stream ordered after the frees on
/// its page, wherever the page is now. Page P: X's place (freed on held
/// stream `s`), then moved to a small block B on `s` (X's place held),
/// B freed on `s` after an event E that stream `m` waits on through the
/// pool. `m` is ordered after X's free but not after B's: P may not come
/// back to X's place for `m` (nor move to it). A second gate on `s`
/// right after E lets `m`'s kernel run before `s`'s kernel on B: if `m`
/// got P, B's kernel then overwrites `m`'s block. Caught: a held place
/// coming back with the guards where its page is active ignored
/// (`rebind_guard_for` taking only the ghost's hold).
#[test]
fn a_held_place_comes_back_only_after_every_free_on_its_page() {
    let dev = Arc::new(common::host_with_capacity(64 * MIB));
    let pool = capped(&dev, 2, true);
    let s = dev.create_stream().unwrap();
    let t = dev.create_stream().unwrap();
    let m = dev.create_stream().unwrap();
    let mut gate1 = Blocker::on(&*dev, s);

    let x = pool.alloc_async(PAGE, s).unwrap();
    let c = pool.alloc_async(PAGE, t).unwrap();
    let xp = x.ptr();
    let kx = write_kernel(&dev, s, xp, common::pattern(71, PAGE / 4));
    pool.free_async(x, s).unwrap();
    let ev = pool.record_event(s).unwrap();
    let mut gate2 = Blocker::on(&*dev, s);
    let b = pool.alloc_async(512 << 10, s).unwrap();
    assert_eq!(pool.pending_move_counts(), (1, 0), "X's page moved to B");
    let kb = write_kernel(&dev, s, b.ptr(), common::pattern(72, b.size() / 4));
    pool.free_async(b, s).unwrap();
    pool.wait_event(m, &ev).unwrap();

    let got = pool.alloc_async(PAGE, m);
    let mut mine = None;
    match got {
        Ok(y) => {
            let wy = common::pattern(73, y.size() / 4);
            let ky = write_kernel(&dev, m, y.ptr(), wy.clone());
            mine = Some((y, wy, ky));
        }
        Err(e) => assert!(e.is_out_of_memory(), "unexpected error: {e}"),
    }
    gate1.release();
    assert!(kx.recv().unwrap(), "X's old place was unmapped");
    if let Some((_, _, ky)) = &mine {
        // m runs once s passed E; s stays at the second gate.
        assert!(ky.recv().unwrap());
    }
    assert!(!gate2.done());
    gate2.release();
    assert!(kb.recv().unwrap(), "B's place was unmapped");
    pool.synchronize().unwrap();
    if let Some((y, wy, _)) = mine {
        assert_eq!(
            dev.read_words(y.ptr(), wy.len()).unwrap(),
            wy,
            "m's block was overwritten by s's kernel on B: m got B's page"
        );
        pool.free_async(y, m).unwrap();
    }
    pool.free_async(c, t).unwrap();
    pool.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    assert_eq!(pool.stats().reserved_current, 0);
    assert_eq!(dev.live_handles(), 0);
    assert_eq!(pool.pending_move_counts().1, 0);
}
