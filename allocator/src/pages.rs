//! Page mapping: the only code that creates, maps, unmaps and releases
//! the pool's physical pages. Steps 4 and 5 of the reuse order (stitch
//! completed pages into a window, grow) choose their window through
//! `placement` and then make the driver calls here, reporting each to the
//! arena's books; trimming releases spare and completed idle pages; the
//! pool's drop unmaps and releases everything.
//!
//! Map, unmap and release act at once, not in stream order: every page
//! touched here is idle and known complete (the callers' guarantee, checked
//! through `placement`'s `page_complete`), or new.

use crate::config::{PoolConfig, ReusePolicy};
use crate::ordering::VectorClock;
use crate::placement::{
    best_window, ghost_available, hole_window, phys_movable, ArenaState, State,
};
use crate::share_state::ShareState;
use tidepool_sys::{Device, DevicePtr, PhysicalOptions, SysError};

/// Why mapping memory for a request failed.
pub(crate) enum MapFailure {
    /// No virtual window is large enough.
    NoWindow,
    /// The pool's maximum size stops growth.
    Capped,
    /// The device is out of memory.
    DeviceOom(SysError),
    /// Another device error.
    Device(SysError),
}

/// Most mappings one physical page keeps (one active, the rest ghosts).
const MAX_GHOSTS: usize = 4;

/// What page mapping needs of the pool: the device, where the pool's
/// address range starts, its configuration, and the access list every new
/// mapping gets.
pub(crate) struct Pages<'a, D: Device> {
    pub pool: u64,
    pub device: &'a D,
    pub base: DevicePtr,
    pub config: &'a PoolConfig,
    pub share: &'a ShareState,
}

impl<D: Device> Pages<'_, D> {
    /// Steps 4 and 5 in the request's own zone, aligned; where that finds
    /// no window or runs into a limit, anywhere and unaligned.
    pub fn map_any(
        &self,
        st: &mut State<'_>,
        len: usize,
        me: u64,
        clock: &VectorClock,
        reuse: ReusePolicy,
    ) -> Result<usize, MapFailure> {
        let first = match self.map_window(st, len, me, clock, reuse, false) {
            Ok(off) => return Ok(off),
            Err(MapFailure::Device(e)) => return Err(MapFailure::Device(e)),
            Err(e) => e,
        };
        match self.map_window(st, len, me, clock, reuse, true) {
            Err(MapFailure::NoWindow) => Err(first),
            other => other,
        }
    }

    /// Steps 4 and 5: choose a virtual window of free ranges and holes,
    /// fill its unmapped pages with spare pages, completed idle pages moved
    /// from elsewhere, or new pages, and hand out the block. `relaxed`:
    /// anywhere in the address space and unaligned (the fallback when the
    /// request's own zone has no window or would need growth past the cap).
    fn map_window(
        &self,
        st: &mut State<'_>,
        len: usize,
        me: u64,
        clock: &VectorClock,
        reuse: ReusePolicy,
        relaxed: bool,
    ) -> Result<usize, MapFailure> {
        let page = st.arena.page();
        let best = if relaxed {
            best_window(st, len, 1, &(0..st.arena.va_size()), me, clock, reuse)
        } else if st.first_fit(len) {
            let s: &ArenaState = st;
            s.arena
                .first_window(len, s.align(len), &s.zone(len), |g| {
                    s.classify(g, me, clock, reuse).is_some()
                })
                .map(|start| {
                    let need = (start / page..=(start + len - 1) / page)
                        .filter(|&p| !s.arena.is_active(p))
                        .count();
                    (0, need, start)
                })
        } else if st.align(len) > 1 {
            best_window(st, len, st.align(len), &st.zone(len), me, clock, reuse)
        } else {
            // Small requests: the windows around one hole.
            hole_window(st, len, &st.zone(len), me, clock, reuse)
        };
        let (_, need, start) = best.ok_or(MapFailure::NoWindow)?;
        let end = start + len;
        let block_pages = start / page..=(end - 1) / page;
        let targets: Vec<usize> = block_pages
            .clone()
            .filter(|&p| !st.arena.is_active(p))
            .collect();
        debug_assert_eq!(targets.len(), need);

        // First, targets whose ghost mapping's physical page is free to come
        // back: no driver call at all.
        let mut rest = Vec::new();
        for &p in &targets {
            match st.arena.mapping_at(p) {
                Some(phys) if ghost_available(st, p) && phys_movable(st, phys, &block_pages) => {
                    if let Some(owner) = st.arena.owner(phys) {
                        st.arena.deactivate(owner);
                    } else {
                        st.arena.unspare(phys);
                    }
                    st.arena.activate(p, phys);
                    st.arena.count_rebind();
                }
                _ => rest.push(p),
            }
        }
        // The others need a physical page mapped by the driver: a spare one,
        // a completed idle one moved from elsewhere (stitching), or a new
        // one (growth).
        let spare_used = st.arena.spare_len().min(rest.len());
        let victims = if spare_used < rest.len() {
            let zone = st.zone_of(start / page);
            st.victims(&block_pages, zone, rest.len() - spare_used)
        } else {
            Vec::new()
        };
        let missing = rest.len() - spare_used - victims.len();
        if let Some(max) = self.config.max_size {
            // Fail before touching anything: a request the cap cannot hold
            // must not grow the pool on its way to failing.
            if st.arena.reserved() + (missing * page) as u64 > max {
                return Err(MapFailure::Capped);
            }
        }
        let mut got: Vec<usize> = Vec::with_capacity(rest.len());
        // Pages created by this call: given back to the device if the
        // device runs out before the request is covered (a failed request
        // must not grow the pool).
        let mut created: Vec<usize> = Vec::new();
        for _ in 0..spare_used {
            got.extend(st.arena.pop_spare());
        }
        for p in victims {
            got.push(st.arena.deactivate(p));
        }
        while got.len() < rest.len() {
            if let Some(max) = self.config.max_size {
                if st.arena.reserved() + page as u64 > max {
                    for i in got {
                        st.arena.push_spare(i);
                    }
                    return Err(MapFailure::Capped);
                }
            }
            let opts = PhysicalOptions {
                exportable: self.config.exportable,
            };
            match self.device.create_physical(page, opts) {
                Ok(handle) => {
                    let i = st.arena.add_phys(handle);
                    got.push(i);
                    created.push(i);
                }
                Err(e) => {
                    for i in got {
                        if !created.contains(&i) {
                            st.arena.push_spare(i);
                        } else if let Err(e2) = self.release_phys(st, i) {
                            tracing::warn!(error = %e2, "releasing a page of a failed request failed");
                            st.arena.push_spare(i);
                        }
                    }
                    return Err(if e.is_out_of_memory() {
                        MapFailure::DeviceOom(e)
                    } else {
                        MapFailure::Device(e)
                    });
                }
            }
        }
        if !rest.is_empty() {
            tracing::debug!(
                pool = self.pool,
                pages = rest.len(),
                len,
                "mapping pages for a request"
            );
        }
        for p in rest {
            let i = got.pop().expect("one physical page per target");
            if let Err(e) = self.bind(st, p, i) {
                got.push(i);
                for i in got {
                    st.arena.push_spare(i);
                }
                return Err(MapFailure::Device(e));
            }
            st.arena.count_remap();
        }
        st.arena.take(start, len);
        Ok(start)
    }

    /// Map physical page `i` at page `p` (a hole) and make it active there.
    /// A ghost mapping of another page at `p` is unmapped first; a physical
    /// page with many ghosts loses its oldest one, which bounds the number
    /// of mappings.
    fn bind(&self, st: &mut State<'_>, p: usize, i: usize) -> Result<(), SysError> {
        let page = st.arena.page();
        if st.arena.mapping_at(p).is_some() {
            self.device.unmap(self.page_ptr(st, p), page)?;
            st.arena.forget_mapping(p);
        }
        while st.arena.mappings(i).len() >= MAX_GHOSTS {
            let oldest = st.arena.mappings(i)[0];
            self.device.unmap(self.page_ptr(st, oldest), page)?;
            st.arena.forget_mapping(oldest);
        }
        let ptr = self.page_ptr(st, p);
        let handle = st.arena.handle(i);
        self.device.map(ptr, page, handle, 0)?;
        if let Err(e) = self.device.set_access(ptr, page, &self.share.access_list()) {
            if let Err(e2) = self.device.unmap(ptr, page) {
                tracing::warn!(error = %e2, "unmap after failed set_access failed");
            }
            return Err(e);
        }
        st.arena.record_mapping(p, i);
        st.arena.activate(p, i);
        Ok(())
    }

    fn page_ptr(&self, st: &State<'_>, p: usize) -> u64 {
        self.base + (p * st.arena.page()) as u64
    }

    /// Unmap every mapping of physical page `i` (active nowhere) and
    /// release it to the device.
    pub fn release_phys(&self, st: &mut State<'_>, i: usize) -> Result<(), SysError> {
        let page = st.arena.page();
        while let Some(&p) = st.arena.mappings(i).last() {
            self.device.unmap(self.page_ptr(st, p), page)?;
            st.arena.forget_mapping(p);
        }
        self.device.release_physical(st.arena.handle(i))?;
        st.arena.remove_phys(i);
        Ok(())
    }

    /// Release physical memory until at most `target` bytes are held:
    /// spare pages first, then idle pages whose frees are known complete.
    /// Returns the bytes released.
    pub fn trim(&self, st: &mut State<'_>, target: u64) -> Result<u64, SysError> {
        let page = st.arena.page();
        let mut released = 0u64;
        while st.arena.reserved() > target {
            let i = match st.arena.pop_spare() {
                Some(i) => i,
                None => {
                    let victim = st.arena.idle_pages().find(|&p| st.page_complete(p));
                    let Some(p) = victim else { break };
                    st.arena.deactivate(p)
                }
            };
            if let Err(e) = self.release_phys(st, i) {
                // Keep the bookkeeping true: the page is still ours.
                st.arena.push_spare(i);
                return Err(e);
            }
            released += page as u64;
        }
        Ok(released)
    }

    /// The pool is going away: unmap every mapping (active and ghost) and
    /// release every physical page. The caller has waited for all pending
    /// device work first.
    pub fn unmap_all(&self, st: &mut ArenaState) {
        let page = st.arena.page();
        for (_, handle, mappings) in st.arena.phys_pages() {
            for &p in mappings {
                if let Err(e) = self.device.unmap(self.base + (p * page) as u64, page) {
                    tracing::warn!(error = %e, "unmap while dropping the pool failed");
                }
            }
            if let Err(e) = self.device.release_physical(handle) {
                tracing::warn!(error = %e, "release while dropping the pool failed");
            }
        }
        st.arena.clear_phys();
    }
}
