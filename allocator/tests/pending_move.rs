//! Pages whose frees are pending on the allocating stream may move to
//! where that stream's new block needs them, when the pool would grow
//! otherwise: the new block's work is ordered after those frees on the
//! same stream. The place a page moved from stays mapped, held, until the
//! frees complete: work queued before them may still touch the page
//! there. Attacked through `MemPool` on the host backend (real memory,
//! worker-thread streams; an access to an unmapped address is reported by
//! the "kernel"):
//! - a held stream's queued kernel writes a pattern into a block freed
//!   after it on that stream; a same-stream allocation the pool's cap
//!   leaves no room to grow for gets that block's pages, at once; while
//!   the stream is still held, another stream's allocation aimed at the
//!   old address, trimming, the release threshold all run; then the
//!   kernel runs: no fault, the pattern is at the old address, and after
//!   completion everything is released;
//! - the bytes of a moved page the new block does not use keep the old
//!   frees' guard: another stream gets them only once those complete.
//!
//! Work is bounded by operation counts.

mod common;

use common::{overlaps, write_kernel, Blocker, PAGE};
use std::sync::Arc;
use tidepool::{MemPool, PoolConfig, ReusePolicy};
use tidepool_sys::{Device, HostDevice};

const MIB: usize = 1 << 20;

/// A pool capped at `pages` pages, whose streams never wait for one
/// another (a block handed out must be usable at once) and keep no
/// private cache (frees go straight to the pool's books).
fn capped_pool(dev: &Arc<HostDevice>, pages: usize) -> MemPool<HostDevice> {
    let cfg: PoolConfig = common::config()
        .with_max_size((pages * PAGE) as u64)
        .with_stream_cache_bytes(0)
        .with_reuse(ReusePolicy {
            follow_event_dependencies: true,
            opportunistic: true,
            internal_dependencies: false,
            wait_for_pending_frees: false,
        });
    common::pool(dev, cfg)
}

/// The first scenario: a block of three pages freed on a held stream
/// behind a kernel that writes it; the stream's next block needs five
/// pages under a cap of six with four held: three of them move. Every
/// path that could unmap the old place runs while the stream is held.
#[test]
fn a_page_pending_on_the_stream_moves_and_its_old_place_stays_mapped() {
    let dev = Arc::new(common::host_with_capacity(64 * MIB));
    let pool = capped_pool(&dev, 6);
    let s = dev.create_stream().unwrap();
    let t = dev.create_stream().unwrap();
    let mut hold = Blocker::on(&*dev, s);

    // A: three pages on s, then a page on t right after it (in use).
    let a = pool.alloc_async(6 * MIB, s).unwrap();
    let c = pool.alloc_async(2 * MIB, t).unwrap();
    let (a_ptr, a_len) = (a.ptr(), a.size());
    let words = common::pattern(7, a_len / 4);
    let wrote = write_kernel(&dev, s, a_ptr, words.clone());
    pool.free_async(a, s).unwrap();
    assert_eq!(pool.stats().reserved_current, 4 * PAGE as u64);

    // B on s: five pages past C; the cap leaves room for two new ones.
    let b = pool
        .alloc_async(9 * MIB, s)
        .expect("a same-stream block over pages pending on the stream");
    assert!(!hold.done(), "the stream ran before the move");
    let (moves, bad) = pool.pending_move_counts();
    assert_eq!(moves, 3, "A's three pages moved");
    assert_eq!(bad, 0);
    assert_eq!(pool.stats().reserved_current, 6 * PAGE as u64);
    assert!(!overlaps(b.ptr(), b.size(), a_ptr, a_len));

    // Another stream, aimed at A's old place (the lowest window of the
    // zone): C's page, idle and complete, must not be bound there.
    pool.free_async(c, t).unwrap();
    pool.synchronize_stream(t).unwrap();
    let d = pool.alloc_async(2 * MIB, t).expect("C's page, in place");
    assert!(
        !overlaps(d.ptr(), d.size(), a_ptr, a_len),
        "t got {:#x} over the place A's pages moved from",
        d.ptr()
    );
    // Nothing more fits over A's old place either.
    if let Ok(e) = pool.alloc_async(6 * MIB, t) {
        assert!(!overlaps(e.ptr(), e.size(), a_ptr, a_len));
        pool.free_async(e, t).unwrap();
    }

    // B freed on t (whose work is done): B's pages are idle and complete
    // where they are now, but the moved ones are still mapped at A's old
    // place under s's pending frees. Trimming, directly and through the
    // release threshold, may release only the two pages B grew.
    pool.free_async(b, t).unwrap();
    pool.set_release_threshold(0);
    pool.synchronize_stream(t).unwrap();
    pool.trim_to(0).unwrap();
    assert!(
        pool.stats().reserved_current >= 3 * PAGE as u64,
        "a page mapped where s's pending work may write was released"
    );
    assert!(!hold.done());
    assert_eq!(pool.pending_move_counts().1, 0);
    pool.set_release_threshold(u64::MAX);

    // The stream runs: its kernel finds A's old place mapped and writes it.
    hold.release();
    assert!(
        wrote.recv().unwrap(),
        "the kernel found A's old place unmapped"
    );
    pool.synchronize_stream(s).unwrap();
    assert_eq!(
        dev.read_words(a_ptr, words.len())
            .expect("A's old place is mapped"),
        words,
        "the pattern is not where the kernel wrote it"
    );

    // Everything done: nothing is held any more, everything goes back.
    pool.free_async(d, t).unwrap();
    pool.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    assert_eq!(pool.stats().reserved_current, 0);
    assert_eq!(dev.live_handles(), 0, "a physical page leaked");
    assert_eq!(dev.live_mappings(), 0, "a mapping leaked");
    assert_eq!(pool.pending_move_counts().1, 0);
}

/// The bytes of a moved page that the new block leaves free keep the old
/// frees' guard: another stream, which could take them in place at no
/// cost, does not get them while those frees are pending, and does once
/// they completed.
#[test]
fn a_moved_pages_leftover_bytes_wait_for_the_old_frees() {
    let dev = Arc::new(common::host_with_capacity(64 * MIB));
    let pool = capped_pool(&dev, 6);
    let s = dev.create_stream().unwrap();
    let t = dev.create_stream().unwrap();
    let mut hold = Blocker::on(&*dev, s);

    let a = pool.alloc_async(6 * MIB, s).unwrap();
    let c = pool.alloc_async(2 * MIB, t).unwrap();
    let (a_ptr, a_len) = (a.ptr(), a.size());
    let wrote = write_kernel(&dev, s, a_ptr, common::pattern(3, a_len / 4));
    pool.free_async(a, s).unwrap();
    // B: four pages and a half; its last page is one A's moved to (moved
    // pages fill a block's highest pages), half of it left free.
    let b = pool.alloc_async(9 * MIB, s).unwrap();
    assert_eq!(pool.pending_move_counts().0, 3);
    let leftover = (b.ptr() + b.size() as u64, PAGE / 2);
    assert_eq!(leftover.0 % PAGE as u64, (PAGE / 2) as u64);

    // t: a block the leftover holds exactly. The pool is at its cap and
    // the only other free bytes are A's old place (held).
    match pool.alloc_async(MIB, t) {
        Ok(e) => {
            assert!(
                !overlaps(e.ptr(), e.size(), leftover.0, leftover.1),
                "t got {:#x}, bytes of a page s's pending frees may still touch",
                e.ptr()
            );
            pool.free_async(e, t).unwrap();
        }
        Err(e) => assert!(
            e.to_string().contains("out of memory"),
            "unexpected error: {e}"
        ),
    }
    assert!(!hold.done());

    hold.release();
    assert!(
        wrote.recv().unwrap(),
        "the kernel found A's old place unmapped"
    );
    pool.synchronize_stream(s).unwrap();
    // Complete now: t takes the leftover (the cap leaves nothing else).
    let e = pool
        .alloc_async(MIB, t)
        .expect("the leftover, once complete");
    assert!(overlaps(e.ptr(), e.size(), leftover.0, leftover.1));
    assert_eq!(pool.stats().reserved_current, 6 * PAGE as u64);
    for (x, on) in [(b, s), (c, t), (e, t)] {
        pool.free_async(x, on).unwrap();
    }
    pool.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    assert_eq!(dev.live_handles(), 0);
    assert_eq!(dev.live_mappings(), 0);
    assert_eq!(pool.pending_move_counts().1, 0);
}

/// A stream ordered after another's pending frees (here by the internal
/// dependency the pool inserts when nothing else fits) may have their
/// pages moved to it: a checkerboard of pages freed on a held stream is
/// stitched for another stream at once, and the held stream's kernels
/// still find their memory where they wrote it.
#[test]
fn pages_move_to_a_stream_that_waits_for_their_frees() {
    let dev = Arc::new(common::host());
    let pool = common::pool(
        &dev,
        common::config()
            .with_max_size(8 * PAGE as u64)
            .with_reuse(ReusePolicy {
                wait_for_pending_frees: false,
                ..ReusePolicy::default()
            }),
    );
    let (a, b) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    let mut busy = Blocker::on(&*dev, a);
    let blocks: Vec<_> = (0..8).map(|_| pool.alloc_async(PAGE, a).unwrap()).collect();
    let (mut kernels, mut live) = (Vec::new(), Vec::new());
    for (i, x) in blocks.into_iter().enumerate() {
        if i % 2 == 0 {
            let words = common::pattern(i as u32, PAGE / 4);
            kernels.push((
                x.ptr(),
                words.clone(),
                write_kernel(&dev, a, x.ptr(), words),
            ));
            pool.free_async(x, a).unwrap();
        } else {
            live.push(x);
        }
    }
    let big = pool
        .alloc_async(2 * PAGE, b)
        .expect("two pages moved to a stream ordered after their frees");
    assert!(!busy.done());
    assert_eq!(pool.pending_move_counts(), (2, 0));
    assert!(pool.stats().internal_dependencies > 0);
    busy.release();
    for (ptr, words, k) in kernels {
        assert!(k.recv().unwrap(), "a pending free's old place was unmapped");
        assert!(
            dev.read_words(ptr, words.len()).unwrap() == words,
            "the pattern is not where the kernel wrote it"
        );
    }
    pool.free_async(big, b).unwrap();
    for x in live {
        pool.free_async(x, a).unwrap();
    }
    pool.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    assert_eq!(dev.live_handles(), 0);
    assert_eq!(dev.live_mappings(), 0);
}

/// A held place comes back, with no driver call, to the stream its frees
/// are ordered before: the block that moved there is freed on the same
/// held stream, and the stream's next block of the first one's shape gets
/// the first place again; the place it leaves is held in turn (its frees
/// are pending too), so another stream's request aimed at it neither
/// binds over it nor gets its bytes. Both kernels find their memory.
#[test]
fn a_held_place_comes_back_to_the_stream_and_the_place_left_is_held() {
    let dev = Arc::new(common::host_with_capacity(64 * MIB));
    let pool = capped_pool(&dev, 7);
    let s = dev.create_stream().unwrap();
    let t = dev.create_stream().unwrap();
    let mut hold = Blocker::on(&*dev, s);

    // Pages of the medium zone: A 0-2 (s), C 3 (t), B 4-8 (s; its pages
    // 6-8 are A's, moved), D 9 (t).
    let a = pool.alloc_async(6 * MIB, s).unwrap();
    let c = pool.alloc_async(2 * MIB, t).unwrap();
    let (a_ptr, a_len) = (a.ptr(), a.size());
    let first = write_kernel(&dev, s, a_ptr, common::pattern(1, a_len / 4));
    pool.free_async(a, s).unwrap();
    let b = pool.alloc_async(9 * MIB, s).unwrap();
    assert_eq!(pool.pending_move_counts().0, 3);
    let (b_ptr, b_len) = (b.ptr(), b.size());
    let d = pool.alloc_async(2 * MIB, t).unwrap();
    assert!(d.ptr() > b_ptr + b_len as u64);
    let second = write_kernel(&dev, s, b_ptr, common::pattern(2, b_len / 4));
    pool.free_async(b, s).unwrap();

    // s again, A's shape: A's place, its three pages back with no bind.
    let remaps = pool.stats().remaps;
    let a2 = pool.alloc_async(6 * MIB, s).unwrap();
    assert_eq!(a2.ptr(), a_ptr, "A's place came back");
    assert_eq!(pool.stats().remaps, remaps, "a page was bound");
    assert_eq!(pool.pending_move_counts(), (6, 0), "B's pages left held");

    // t frees D (its page idle, complete) and asks for a page: the lowest
    // window it may take is over B's pages 6-8, whose mappings s's second
    // kernel is yet to write through; D's page must not be bound there.
    pool.free_async(d, t).unwrap();
    pool.synchronize_stream(t).unwrap();
    for len in [2 * MIB, 4 * MIB] {
        if let Ok(e) = pool.alloc_async(len, t) {
            assert!(
                !overlaps(e.ptr(), e.size(), b_ptr, b_len),
                "t got {:#x}+{len:#x} over B's place, pending on s",
                e.ptr()
            );
            pool.free_async(e, t).unwrap();
            pool.synchronize_stream(t).unwrap();
        }
    }
    assert!(!hold.done());
    pool.trim_to(0).unwrap();
    assert_eq!(pool.pending_move_counts().1, 0);

    hold.release();
    assert!(
        first.recv().unwrap(),
        "the first kernel found A's place unmapped"
    );
    assert!(
        second.recv().unwrap(),
        "the second kernel found B's place unmapped"
    );
    pool.free_async(a2, s).unwrap();
    pool.free_async(c, t).unwrap();
    pool.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    assert_eq!(pool.stats().reserved_current, 0);
    assert_eq!(dev.live_handles(), 0);
    assert_eq!(dev.live_mappings(), 0);
}

/// A request that moved pages pending on its stream and then failed (the
/// device ran out while growing the rest) puts them back where they were,
/// free under their frees' guard: another stream's next block is not
/// handed one of them (as a spare page) while the work before those frees
/// may still write it through the old place.
#[test]
fn pages_moved_for_a_failed_request_go_back_under_their_guard() {
    let dev = Arc::new(common::host_with_capacity(5 * PAGE));
    let cfg: PoolConfig = common::config()
        .with_stream_cache_bytes(0)
        .with_reuse(ReusePolicy {
            follow_event_dependencies: true,
            opportunistic: true,
            internal_dependencies: false,
            wait_for_pending_frees: false,
        });
    let pool = common::pool(&dev, cfg);
    let s = dev.create_stream().unwrap();
    let t = dev.create_stream().unwrap();
    let mut hold = Blocker::on(&*dev, s);

    let a = pool.alloc_async(6 * MIB, s).unwrap();
    let c = pool.alloc_async(2 * MIB, t).unwrap();
    let (a_ptr, a_len) = (a.ptr(), a.size());
    let words = common::pattern(5, a_len / 4);
    let wrote = write_kernel(&dev, s, a_ptr, words.clone());
    pool.free_async(a, s).unwrap();
    // Five pages: A's three and two new ones, of which the device has one.
    let err = pool.alloc_async(9 * MIB, s).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    assert!(pool.pending_move_counts().0 > 0, "A's pages never moved");

    // t: one page, written at once (as its kernel would on an idle t).
    let d = pool
        .alloc_async(2 * MIB, t)
        .expect("the device's last page");
    let mine = common::pattern(9, d.size() / 4);
    dev.write_words(d.ptr(), &mine).unwrap();
    assert!(!hold.done());

    hold.release();
    assert!(wrote.recv().unwrap(), "the kernel found A's place unmapped");
    pool.synchronize_stream(s).unwrap();
    assert!(
        dev.read_words(d.ptr(), mine.len()).unwrap() == mine,
        "s's kernel wrote into t's block"
    );
    assert!(
        dev.read_words(a_ptr, words.len()).unwrap() == words,
        "the pattern is not where the kernel wrote it"
    );
    assert_eq!(pool.pending_move_counts().1, 0);
    pool.free_async(c, t).unwrap();
    pool.free_async(d, t).unwrap();
    pool.synchronize().unwrap();
    pool.trim_to(0).unwrap();
    assert_eq!(dev.live_handles(), 0);
    assert_eq!(dev.live_mappings(), 0);
}
