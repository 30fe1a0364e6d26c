//! Physical units of several pages (`PoolConfig::max_unit_size`): one
//! handle, created, mapped, moved, trimmed and released whole. The host
//! backend refuses an unmap that does not cover exactly one mapping, and
//! its reads and writes fail on unmapped pages, so a unit mapped or
//! unmapped in parts shows up as an error or as a mapping left behind.

use std::sync::Arc;
use tidepool::{MemPool, PoolConfig};
use tidepool_sys::{Device, HostDevice, Stream};

const MIB: usize = 1 << 20;
/// The host backend's granularity: the pool's page.
const PAGE: usize = 2 * MIB;

/// A pool whose blocks of 4 MiB and up get units of up to 8 MiB (four
/// pages), with an optional cap.
fn pool(max_size: Option<u64>) -> (Arc<HostDevice>, MemPool<HostDevice>, Stream) {
    let dev = Arc::new(HostDevice::new());
    let mut config = PoolConfig::default()
        .with_va_size(1 << 30)
        .with_stream_cache_bytes(0)
        .with_max_unit_size(8 * MIB)
        .with_unit_min_block(4 * MIB);
    if let Some(max) = max_size {
        config = config.with_max_size(max);
    }
    let pool = MemPool::new(dev.clone(), config).expect("pool");
    let s = dev.create_stream().expect("stream");
    (dev, pool, s)
}

/// Write a distinct word at the start and the end of every page of
/// `[ptr, ptr+len)` and read them back (fails where a page is unmapped).
fn touch_every_page(dev: &HostDevice, ptr: u64, len: usize, tag: u32) {
    for k in 0..len.div_ceil(PAGE) {
        let first = ptr + (k * PAGE) as u64;
        let last = (ptr + (((k + 1) * PAGE).min(len) - 4) as u64).max(first);
        for (i, at) in [first, last].into_iter().enumerate() {
            let word = tag ^ ((k as u32) << 4) ^ i as u32;
            dev.write_words(at, &[word])
                .unwrap_or_else(|e| panic!("page {k} of the block is not usable: {e}"));
            assert_eq!(dev.read_words(at, 1).unwrap(), vec![word]);
        }
    }
}

#[test]
fn a_large_block_grows_by_one_unit_and_trim_releases_it_whole_only() {
    let (dev, pool, s) = pool(None);
    let a = pool.alloc_async(8 * MIB, s).unwrap();
    touch_every_page(&dev, a.ptr(), 8 * MIB, 1);
    let st = pool.stats();
    assert_eq!(st.growths, 1, "four pages, one handle");
    assert_eq!(st.reserved_current, 8 * MIB as u64);
    assert_eq!((dev.live_handles(), dev.live_mappings()), (1, 1));
    pool.free_async(a, s).unwrap();
    pool.synchronize().unwrap();

    // A smaller block on the unit's second page (the first page idle
    // again): the unit is partly used and stays whole, so trim releases
    // nothing and says so.
    let first = pool.alloc_async(PAGE, s).unwrap();
    let b = pool.alloc_async(MIB, s).unwrap();
    assert_eq!(b.ptr(), first.ptr() + PAGE as u64, "on the second page");
    pool.free_async(first, s).unwrap();
    pool.synchronize().unwrap();
    assert_eq!(pool.stats().growths, 1, "the small blocks reuse the unit");
    assert_eq!(pool.trim_to(0).unwrap(), 0, "a partly used unit stays");
    assert_eq!(pool.stats().reserved_current, 8 * MIB as u64);
    assert_eq!((dev.live_handles(), dev.live_mappings()), (1, 1));
    touch_every_page(&dev, b.ptr(), MIB, 2);

    // Once free, the whole unit goes, even when less was asked for: trim
    // reports the bytes it actually released.
    pool.free_async(b, s).unwrap();
    pool.synchronize().unwrap();
    assert_eq!(pool.trim_to(6 * MIB as u64).unwrap(), 8 * MIB as u64);
    let st = pool.stats();
    assert_eq!((st.reserved_current, st.releases), (0, 1));
    assert_eq!((dev.live_handles(), dev.live_mappings()), (0, 0));
}

#[test]
fn single_pages_when_units_are_off() {
    let dev = Arc::new(HostDevice::new());
    let pool = MemPool::new(
        dev.clone(),
        PoolConfig::default()
            .with_va_size(1 << 30)
            .with_unit_min_block(4 * MIB),
    )
    .unwrap();
    let s = dev.create_stream().unwrap();
    let a = pool.alloc_async(8 * MIB, s).unwrap();
    assert_eq!(pool.stats().growths, 4, "the default: one handle a page");
    assert_eq!(dev.live_handles(), 4);
    pool.free_async(a, s).unwrap();
}

#[test]
fn a_free_unit_moves_whole_into_a_larger_block() {
    // Room for 16 MiB: the 16 MiB block must take the free 8 MiB unit
    // (stitching) and grow by 8 MiB more.
    let (dev, pool, s) = pool(Some(16 * MIB as u64));
    let a = pool.alloc_async(8 * MIB, s).unwrap();
    let a_ptr = a.ptr();
    pool.free_async(a, s).unwrap();
    pool.synchronize().unwrap();
    let b = pool.alloc_async(16 * MIB, s).unwrap();
    assert_ne!(b.ptr(), a_ptr, "the big block lies in another zone");
    let st = pool.stats();
    assert_eq!(st.growths, 2, "the moved unit and one new unit");
    assert_eq!(st.releases, 0, "the unit moved rather than being released");
    assert_eq!(st.reserved_current, 16 * MIB as u64);
    // One bind for each unit at its first place, one for the move.
    assert_eq!(st.remaps, 3);
    touch_every_page(&dev, b.ptr(), 16 * MIB, 3);
    pool.free_async(b, s).unwrap();
    pool.synchronize().unwrap();
    assert_eq!(pool.trim_to(0).unwrap(), 16 * MIB as u64);
    assert_eq!((dev.live_handles(), dev.live_mappings()), (0, 0));
}

#[test]
fn a_partly_used_unit_does_not_move() {
    // Room for 24 MiB: the unit holding a live block stays where it is
    // and the 16 MiB block grows by its own 16 MiB.
    let (dev, pool, s) = pool(Some(24 * MIB as u64));
    let a = pool.alloc_async(8 * MIB, s).unwrap();
    pool.free_async(a, s).unwrap();
    pool.synchronize().unwrap();
    // A block on the unit's second page only.
    let first = pool.alloc_async(PAGE, s).unwrap();
    let small = pool.alloc_async(MIB, s).unwrap();
    assert_eq!(small.ptr(), first.ptr() + PAGE as u64, "on the second page");
    pool.free_async(first, s).unwrap();
    pool.synchronize().unwrap();
    dev.write_words(small.ptr(), &[0xfeed]).unwrap();
    let b = pool.alloc_async(16 * MIB, s).unwrap();
    let st = pool.stats();
    assert_eq!(st.growths, 3, "two new units for the big block");
    assert_eq!(st.remaps, 3, "the first unit was not moved");
    assert_eq!(dev.read_words(small.ptr(), 1).unwrap(), vec![0xfeed]);
    touch_every_page(&dev, b.ptr(), 16 * MIB, 4);
    touch_every_page(&dev, small.ptr(), MIB, 5);
    pool.free_async(b, s).unwrap();
    pool.free_async(small, s).unwrap();
}

#[test]
fn dropping_the_pool_unmaps_and_releases_every_unit_whole() {
    let (dev, pool, s) = pool(None);
    let a = pool.alloc_async(8 * MIB, s).unwrap();
    let b = pool.alloc_async(20 * MIB, s).unwrap();
    // 10 pages: units of four, four and two pages.
    assert_eq!((dev.live_handles(), dev.live_mappings()), (4, 4));
    pool.free_async(a, s).unwrap();
    pool.synchronize().unwrap();
    // Back on the first unit: no growth, one mapping per unit.
    let c = pool.alloc_async(8 * MIB, s).unwrap();
    assert_eq!(pool.stats().growths, 4);
    touch_every_page(&dev, b.ptr(), 20 * MIB, 6);
    touch_every_page(&dev, c.ptr(), 8 * MIB, 7);
    pool.free_async(b, s).unwrap();
    pool.free_async(c, s).unwrap();
    drop(pool);
    assert_eq!(dev.live_mappings(), 0, "every mapping unmapped whole");
    assert_eq!(dev.live_handles(), 0, "every unit released");
}

#[test]
fn a_unit_comes_back_to_its_ghost_only_when_wholly_free() {
    // Room for 24 MiB. A 16 MiB block grows two units of 8 MiB; an 8 MiB
    // block in another zone then takes one of them (it moves, its old
    // mapping stays as a ghost); a block on its second page keeps it
    // there. The 16 MiB block again must not take the unit back through
    // its ghost: it grows a new unit instead.
    let (dev, pool, s) = pool(Some(24 * MIB as u64));
    let big = pool.alloc_async(16 * MIB, s).unwrap();
    let big_ptr = big.ptr();
    pool.free_async(big, s).unwrap();
    pool.synchronize().unwrap();
    let mid = pool.alloc_async(8 * MIB, s).unwrap();
    assert_eq!(pool.stats().growths, 2, "the 8 MiB block took a moved unit");
    pool.free_async(mid, s).unwrap();
    pool.synchronize().unwrap();
    let first = pool.alloc_async(PAGE, s).unwrap();
    let small = pool.alloc_async(MIB, s).unwrap();
    assert_eq!(small.ptr(), first.ptr() + PAGE as u64, "on the second page");
    pool.free_async(first, s).unwrap();
    pool.synchronize().unwrap();
    dev.write_words(small.ptr(), &[0xbeef]).unwrap();
    let again = pool.alloc_async(16 * MIB, s).unwrap();
    assert_eq!(again.ptr(), big_ptr, "first fit: the same place");
    assert_eq!(pool.stats().growths, 3, "a new unit, not the busy one");
    assert_eq!(dev.read_words(small.ptr(), 1).unwrap(), vec![0xbeef]);
    touch_every_page(&dev, again.ptr(), 16 * MIB, 8);
    touch_every_page(&dev, small.ptr(), MIB, 9);
    pool.free_async(again, s).unwrap();
    pool.free_async(small, s).unwrap();
}

#[test]
fn an_exportable_pool_uses_single_pages() {
    // An importer maps one handle per page of the exported allocation.
    let dev = Arc::new(HostDevice::new());
    let pool = MemPool::new(
        dev.clone(),
        PoolConfig::default()
            .with_va_size(1 << 30)
            .with_exportable(true)
            .with_max_unit_size(8 * MIB)
            .with_unit_min_block(4 * MIB),
    )
    .unwrap();
    let s = dev.create_stream().unwrap();
    let a = pool.alloc_async(8 * MIB, s).unwrap();
    assert_eq!(pool.stats().growths, 4, "single pages");
    let exported = pool.export(&a).expect("export");
    drop(exported);
    pool.free_async(a, s).unwrap();
}
