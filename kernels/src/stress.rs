//! The stream-order stress harness: one generic driver for every backend.
//!
//! [`run_stress`] drives a [`MemPool`] from several threads over several
//! streams with random sizes (log-uniform), random lifetimes, frees on the
//! allocating stream and on other streams, chains of event waits, declared
//! uses on other streams ([`MemPool::record_use`]), spins that keep streams
//! busy before frees, periodic trims and synchronisations (which release
//! down to the release threshold), and reuse-policy switches that change
//! per phase.
//!
//! **How reuse-too-early is caught.** Every allocation is filled with a tag
//! unique to it ([`TagKernels::fill_tag`]) on its stream right after the
//! allocation, and checked ([`TagKernels::verify_tag`]) on the freeing
//! stream right before the free, often behind a spin. If the pool handed the
//! memory to other work that overlaps (a second stream filling its own tag
//! while the first still spins), one of the two verifies sees the other's
//! tag. On the host backend, a fill or verify of memory the pool unmapped is
//! counted as an access fault.
//!
//! **The harness obeys the contract itself**, or it would report false
//! mismatches: a verify (or free) on stream B of memory filled on stream A
//! is issued only after B waited, through the pool, on an event recorded on
//! A after the fill (directly, or through a chain of streams); a verify on a
//! third stream C is declared with [`MemPool::record_use`], which makes the
//! pool order the free after C's work. Nothing else touches an allocation.
//!
//! The random choices of each thread come from a seeded xorshift generator
//! ([`XorShift64`]), so a seed replays the same per-thread decisions (the
//! interleaving of threads and of device work is not deterministic).

use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tidepool::{Allocation, MemPool, PoolError, PoolStats, ReusePolicy};
use tidepool_sys::{Device, Stream};

use crate::{KernelError, TagKernels};

// ---------------------------------------------------------------------------
// random numbers

/// A small xorshift64* generator (seeded through splitmix64): fast,
/// deterministic, good enough to pick sizes and streams.
#[derive(Debug, Clone)]
pub struct XorShift64 {
    state: u64,
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl XorShift64 {
    /// A generator for `seed` (any value, 0 included).
    pub fn new(seed: u64) -> Self {
        let state = splitmix64(seed);
        XorShift64 {
            state: if state == 0 {
                0x2545_F491_4F6C_DD1D
            } else {
                state
            },
        }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.state;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.state = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        debug_assert!(n > 0);
        // Multiply-shift: no modulo bias worth mentioning for our ranges.
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Uniform index in `0..n` (`n > 0`).
    pub fn index(&mut self, n: usize) -> usize {
        self.below(n as u64) as usize
    }

    /// True with probability `percent / 100`.
    pub fn percent(&mut self, percent: u32) -> bool {
        self.below(100) < u64::from(percent)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Log-uniform in `lo..=hi` (`0 < lo <= hi`): every power of two between
    /// them is about equally likely.
    pub fn log_uniform(&mut self, lo: usize, hi: usize) -> usize {
        debug_assert!(lo > 0 && lo <= hi);
        let (a, b) = ((lo as f64).ln(), (hi as f64 + 1.0).ln());
        let v = (a + (b - a) * self.unit()).exp() as usize;
        v.clamp(lo, hi)
    }
}

// ---------------------------------------------------------------------------
// configuration, report, error

/// The reuse policy with every switch on.
pub fn all_on() -> ReusePolicy {
    ReusePolicy {
        follow_event_dependencies: true,
        opportunistic: true,
        internal_dependencies: true,
        wait_for_pending_frees: true,
    }
}

/// The standard phases: every switch on, then each switch off in turn.
pub fn standard_phases() -> Vec<ReusePolicy> {
    let on = all_on();
    vec![
        on,
        ReusePolicy {
            follow_event_dependencies: false,
            ..on
        },
        ReusePolicy {
            opportunistic: false,
            ..on
        },
        ReusePolicy {
            internal_dependencies: false,
            ..on
        },
        ReusePolicy {
            wait_for_pending_frees: false,
            ..on
        },
    ]
}

/// A short name of a policy: `all-on`, or the switches that are off
/// (`no-follow+no-internal`).
pub fn policy_name(p: &ReusePolicy) -> String {
    let mut off = Vec::new();
    if !p.follow_event_dependencies {
        off.push("no-follow");
    }
    if !p.opportunistic {
        off.push("no-opportunistic");
    }
    if !p.internal_dependencies {
        off.push("no-internal");
    }
    if !p.wait_for_pending_frees {
        off.push("no-wait-pending");
    }
    if off.is_empty() {
        "all-on".into()
    } else {
        off.join("+")
    }
}

/// What [`run_stress`] does. Percentages are of the operations (or of the
/// frees, for the free-stream choice). Start from [`StressConfig::default`]
/// (GPU-sized) or [`StressConfig::host_ci`].
#[derive(Debug, Clone, PartialEq)]
pub struct StressConfig {
    /// Seed of the per-thread generators.
    pub seed: u64,
    /// Host threads issuing work (each on any stream).
    pub threads: usize,
    /// Operations in all (allocations, frees, declared uses, waits), over
    /// every thread; the final frees of live allocations come on top.
    pub ops: u64,
    /// Smallest allocation in bytes.
    pub min_size: usize,
    /// Largest allocation in bytes (sizes are log-uniform in between).
    pub max_size: usize,
    /// Live allocations a thread holds at most.
    pub max_live_per_thread: usize,
    /// Percent of frees issued on another stream than the allocating one.
    pub cross_stream_free_pct: u32,
    /// Percent of cross-stream orderings made through a chain of streams
    /// (A → C₁ → … → B) instead of a direct wait.
    pub chain_pct: u32,
    /// Longest chain (intermediate streams).
    pub max_chain: usize,
    /// Percent of operations that use a live allocation on another stream
    /// (verify there) and declare it with `record_use`.
    pub use_pct: u32,
    /// Percent of operations that make one stream wait on an event of
    /// another (through the pool), unrelated to any allocation.
    pub wait_pct: u32,
    /// Percent of frees (and declared uses) preceded by a spin on the
    /// stream, before the verify.
    pub spin_pct: u32,
    /// Percent of allocations followed by a spin on their stream after the fill.
    pub fill_spin_pct: u32,
    /// Longest spin, in nanoseconds (each spin is uniform in `0..=max`).
    pub max_spin_ns: u64,
    /// Every this many operations (over all threads), trim the pool
    /// (`trim_to(0)` or to half its size). 0: never.
    pub trim_every: u64,
    /// Every this many operations, synchronise (the whole pool or one
    /// stream), which releases down to the release threshold. 0: never.
    pub sync_every: u64,
    /// Release threshold to set for the run (restored afterwards). `None`:
    /// leave the pool's.
    pub release_threshold: Option<u64>,
    /// Reuse policies, one per phase; the operations are split evenly and
    /// the policy is switched, at run time, when a phase begins. Empty:
    /// leave the pool's policy alone. The pool's policy is restored after.
    pub phases: Vec<ReusePolicy>,
    /// Stop early (gracefully, reported) after this much wall time.
    pub time_limit: Option<Duration>,
}

impl Default for StressConfig {
    /// The GPU soak shape: 8 threads, 256 B .. 64 MiB, all phases.
    fn default() -> Self {
        StressConfig {
            seed: 0x7D1E_9001,
            threads: 8,
            ops: 1_000_000,
            min_size: 256,
            max_size: 64 << 20,
            max_live_per_thread: 16,
            cross_stream_free_pct: 40,
            chain_pct: 30,
            max_chain: 3,
            use_pct: 8,
            wait_pct: 8,
            spin_pct: 30,
            fill_spin_pct: 10,
            max_spin_ns: 200_000,
            trim_every: 5_000,
            sync_every: 20_000,
            release_threshold: Some(1 << 30),
            phases: standard_phases(),
            time_limit: None,
        }
    }
}

impl StressConfig {
    /// Sized for the host backend in a debug build on a small machine:
    /// sizes up to 1 MiB, short spins.
    pub fn host_ci() -> Self {
        StressConfig {
            threads: 4,
            ops: 20_000,
            max_size: 1 << 20,
            max_live_per_thread: 12,
            max_spin_ns: 400_000,
            trim_every: 500,
            sync_every: 1_500,
            release_threshold: Some(8 << 20),
            ..Self::default()
        }
    }

    fn validate(&self, streams: usize) -> Result<(), StressError> {
        let bad = |m: String| Err(StressError::Config(m));
        if streams == 0 {
            return bad("no streams given".into());
        }
        if self.threads == 0 {
            return bad("threads must be at least 1".into());
        }
        if self.min_size == 0 || self.min_size > self.max_size {
            return bad(format!(
                "sizes must satisfy 0 < min_size ({}) <= max_size ({})",
                self.min_size, self.max_size
            ));
        }
        if self.max_live_per_thread == 0 {
            return bad("max_live_per_thread must be at least 1".into());
        }
        Ok(())
    }
}

/// What a run did and found.
#[derive(Debug, Clone, PartialEq)]
pub struct StressReport {
    /// "host" or "cuda".
    pub backend: &'static str,
    pub seed: u64,
    pub threads: usize,
    pub streams: usize,
    /// Operations done (allocations, frees, declared uses, waits).
    pub ops: u64,
    pub allocs: u64,
    /// Frees, the final ones included.
    pub frees: u64,
    /// Frees issued on another stream than the allocating one.
    pub cross_stream_frees: u64,
    /// Cross-stream orderings made through a chain of streams.
    pub chains: u64,
    /// Uses on another stream declared with `record_use`.
    pub declared_uses: u64,
    /// Event waits (through the pool) the harness issued, chains included.
    pub waits: u64,
    pub spins: u64,
    /// Words-checking kernels issued.
    pub verifies: u64,
    /// Allocations that failed with out-of-memory (then retried after freeing).
    pub ooms: u64,
    pub trims: u64,
    pub syncs: u64,
    /// Bytes requested over all allocations.
    pub bytes_allocated: u64,
    /// Largest allocation made.
    pub largest_alloc: u64,
    /// Policy switches made (phases begun).
    pub phases: u64,
    /// Words a verify found wrong: must be 0.
    pub mismatches: u64,
    /// Host backend: fills/verifies that found their memory unmapped: must be 0.
    pub access_faults: u64,
    pub wall: Duration,
    /// True when the time limit ended the run before `ops`.
    pub stopped_early: bool,
    /// The pool's statistics at the end.
    pub stats: PoolStats,
}

impl StressReport {
    /// No mismatch and no access fault.
    pub fn passed(&self) -> bool {
        self.mismatches == 0 && self.access_faults == 0
    }

    /// The report as one line of JSON.
    pub fn to_json(&self) -> String {
        let s = &self.stats;
        format!(
            concat!(
                "{{\"backend\":\"{}\",\"passed\":{},\"seed\":{},\"threads\":{},\"streams\":{},",
                "\"ops\":{},\"allocs\":{},\"frees\":{},\"cross_stream_frees\":{},\"chains\":{},",
                "\"declared_uses\":{},\"waits\":{},\"spins\":{},\"verifies\":{},\"ooms\":{},",
                "\"trims\":{},\"syncs\":{},\"bytes_allocated\":{},\"largest_alloc\":{},\"phases\":{},",
                "\"mismatches\":{},\"access_faults\":{},\"wall_s\":{:.3},\"stopped_early\":{},",
                "\"pool\":{{\"reserved_current\":{},\"reserved_high\":{},\"used_current\":{},",
                "\"used_high\":{},\"allocs\":{},\"frees\":{},\"cache_hits\":{},\"growths\":{},",
                "\"releases\":{},\"remaps\":{},\"internal_dependencies\":{},\"ooms\":{}}}}}"
            ),
            self.backend,
            self.passed(),
            self.seed,
            self.threads,
            self.streams,
            self.ops,
            self.allocs,
            self.frees,
            self.cross_stream_frees,
            self.chains,
            self.declared_uses,
            self.waits,
            self.spins,
            self.verifies,
            self.ooms,
            self.trims,
            self.syncs,
            self.bytes_allocated,
            self.largest_alloc,
            self.phases,
            self.mismatches,
            self.access_faults,
            self.wall.as_secs_f64(),
            self.stopped_early,
            s.reserved_current,
            s.reserved_high,
            s.used_current,
            s.used_high,
            s.allocs,
            s.frees,
            s.cache_hits,
            s.growths,
            s.releases,
            s.remaps,
            s.internal_dependencies,
            s.ooms,
        )
    }
}

impl fmt::Display for StressReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} stress: {} ops ({} allocs, {} frees, {} cross-stream, {} chains, {} uses, {} ooms) \
             on {} threads x {} streams in {:.1} s: {} mismatches, {} access faults; pool: \
             {} growths, {} releases, {} remaps, {} internal deps, {} cache hits{}",
            self.backend,
            self.ops,
            self.allocs,
            self.frees,
            self.cross_stream_frees,
            self.chains,
            self.declared_uses,
            self.ooms,
            self.threads,
            self.streams,
            self.wall.as_secs_f64(),
            self.mismatches,
            self.access_faults,
            self.stats.growths,
            self.stats.releases,
            self.stats.remaps,
            self.stats.internal_dependencies,
            self.stats.cache_hits,
            if self.stopped_early {
                " (stopped early by the time limit)"
            } else {
                ""
            }
        )
    }
}

/// A failure that stopped the harness (mismatches are not errors: they are
/// in the report).
#[derive(Debug)]
#[non_exhaustive]
pub enum StressError {
    /// The configuration is unusable.
    Config(String),
    /// A pool call failed (other than an allocation's out-of-memory).
    Pool {
        during: &'static str,
        source: PoolError,
    },
    /// A kernel could not be enqueued, or a counter could not be read.
    Kernel {
        during: &'static str,
        source: KernelError,
    },
    /// A harness thread panicked.
    Panicked(String),
}

impl fmt::Display for StressError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StressError::Config(m) => write!(f, "stress configuration: {m}"),
            StressError::Pool { during, source } => {
                write!(f, "pool call failed {during}: {source}")
            }
            StressError::Kernel { during, source } => {
                write!(f, "tag kernel failed {during}: {source}")
            }
            StressError::Panicked(m) => write!(f, "a stress thread panicked: {m}"),
        }
    }
}

impl std::error::Error for StressError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            StressError::Pool { source, .. } => Some(source),
            StressError::Kernel { source, .. } => Some(source),
            _ => None,
        }
    }
}

fn pool_err(during: &'static str) -> impl FnOnce(PoolError) -> StressError {
    move |source| StressError::Pool { during, source }
}

fn kernel_err(during: &'static str) -> impl FnOnce(KernelError) -> StressError {
    move |source| StressError::Kernel { during, source }
}

// ---------------------------------------------------------------------------
// the harness

#[derive(Default)]
struct Tally {
    ops: AtomicU64,
    allocs: AtomicU64,
    frees: AtomicU64,
    cross_stream_frees: AtomicU64,
    chains: AtomicU64,
    declared_uses: AtomicU64,
    waits: AtomicU64,
    spins: AtomicU64,
    verifies: AtomicU64,
    ooms: AtomicU64,
    trims: AtomicU64,
    syncs: AtomicU64,
    bytes_allocated: AtomicU64,
    largest_alloc: AtomicU64,
    phases: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

/// State shared by the harness threads of one run.
struct Shared<'a, D: Device> {
    pool: &'a MemPool<D>,
    kernels: &'a dyn TagKernels,
    streams: &'a [Stream],
    cfg: &'a StressConfig,
    next_op: AtomicU64,
    next_tag: AtomicU32,
    stop: AtomicBool,
    stopped_early: AtomicBool,
    deadline: Option<Instant>,
    error: Mutex<Option<StressError>>,
    tally: Tally,
}

/// A live allocation of a harness thread and its tag.
struct Live {
    alloc: Allocation,
    tag: u32,
    /// Bytes filled (the size rounded down to whole words).
    len: usize,
}

/// Run the stress harness on `pool` with `kernels` over `streams` (at
/// least one; two or more for cross-stream work), and report.
///
/// The streams must belong to the pool's device and live until the call
/// returns. The pool's reuse policy and release threshold are changed
/// during the run (per [`StressConfig::phases`] and
/// [`StressConfig::release_threshold`]) and restored at the end. Mismatches
/// and access faults are counted as the difference of the kernel set's
/// counters over the run. Returns an error only if a pool call (other than
/// an allocation's out-of-memory) or a kernel launch fails.
pub fn run_stress<D: Device>(
    pool: &MemPool<D>,
    kernels: &dyn TagKernels,
    streams: &[Stream],
    cfg: &StressConfig,
) -> Result<StressReport, StressError> {
    cfg.validate(streams.len())?;
    let mismatches_before = kernels
        .mismatches()
        .map_err(kernel_err("reading the mismatch counter"))?;
    let faults_before = kernels
        .access_faults()
        .map_err(kernel_err("reading the access-fault counter"))?;
    let saved_reuse = pool.reuse();
    let saved_threshold = pool.release_threshold();
    if let Some(t) = cfg.release_threshold {
        pool.set_release_threshold(t);
    }
    if let Some(&first) = cfg.phases.first() {
        pool.set_reuse(first);
    }
    let start = Instant::now();
    let shared = Shared {
        pool,
        kernels,
        streams,
        cfg,
        next_op: AtomicU64::new(0),
        // Tags from the seed, so two runs on one kernel set differ.
        next_tag: AtomicU32::new((splitmix64(cfg.seed) as u32) | 1),
        stop: AtomicBool::new(false),
        stopped_early: AtomicBool::new(false),
        deadline: cfg.time_limit.map(|t| start + t),
        error: Mutex::new(None),
        tally: Tally::default(),
    };
    if !cfg.phases.is_empty() {
        bump(&shared.tally.phases);
    }
    let panics: Vec<String> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..cfg.threads)
            .map(|t| {
                let shared = &shared;
                std::thread::Builder::new()
                    .name(format!("stress-{t}"))
                    .spawn_scoped(scope, move || worker(shared, t))
                    .expect("spawning a stress thread")
            })
            .collect();
        handles
            .into_iter()
            .filter_map(|h| h.join().err())
            .map(|p| {
                p.downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "(no message)".into())
            })
            .collect()
    });
    // Let every queued kernel finish, and release down to the threshold.
    let synced = pool.synchronize();
    pool.set_reuse(saved_reuse);
    pool.set_release_threshold(saved_threshold);
    if let Some(p) = panics.into_iter().next() {
        return Err(StressError::Panicked(p));
    }
    if let Some(e) = shared
        .error
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take()
    {
        return Err(e);
    }
    synced.map_err(pool_err("synchronising the pool at the end"))?;
    let mismatches = kernels
        .mismatches()
        .map_err(kernel_err("reading the mismatch counter"))?
        - mismatches_before;
    let access_faults = kernels
        .access_faults()
        .map_err(kernel_err("reading the access-fault counter"))?
        - faults_before;
    let wall = start.elapsed();
    let t = &shared.tally;
    let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
    Ok(StressReport {
        backend: kernels.backend_name(),
        seed: cfg.seed,
        threads: cfg.threads,
        streams: streams.len(),
        ops: get(&t.ops),
        allocs: get(&t.allocs),
        frees: get(&t.frees),
        cross_stream_frees: get(&t.cross_stream_frees),
        chains: get(&t.chains),
        declared_uses: get(&t.declared_uses),
        waits: get(&t.waits),
        spins: get(&t.spins),
        verifies: get(&t.verifies),
        ooms: get(&t.ooms),
        trims: get(&t.trims),
        syncs: get(&t.syncs),
        bytes_allocated: get(&t.bytes_allocated),
        largest_alloc: get(&t.largest_alloc),
        phases: get(&t.phases),
        mismatches,
        access_faults,
        wall,
        stopped_early: shared.stopped_early.load(Ordering::Relaxed),
        stats: pool.stats(),
    })
}

fn worker<D: Device>(sh: &Shared<'_, D>, thread: usize) {
    let mut rng = XorShift64::new(sh.cfg.seed ^ splitmix64(thread as u64 + 1));
    let mut live: Vec<Live> = Vec::new();
    let result = worker_loop(sh, &mut rng, &mut live);
    // Free what is left (also after an error, best effort), with the
    // same verify-before-free discipline.
    let mut result = result;
    while let Some(l) = live.pop() {
        let r = free_one(sh, &mut rng, l);
        if result.is_ok() {
            result = r;
        }
    }
    if let Err(e) = result {
        sh.stop.store(true, Ordering::Relaxed);
        let mut slot = sh.error.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            *slot = Some(e);
        }
    }
}

fn worker_loop<D: Device>(
    sh: &Shared<'_, D>,
    rng: &mut XorShift64,
    live: &mut Vec<Live>,
) -> Result<(), StressError> {
    let cfg = sh.cfg;
    let phases = cfg.phases.len() as u64;
    let per_phase = if phases == 0 {
        u64::MAX
    } else {
        cfg.ops.div_ceil(phases).max(1)
    };
    loop {
        if sh.stop.load(Ordering::Relaxed) {
            return Ok(());
        }
        if let Some(d) = sh.deadline {
            if Instant::now() >= d {
                sh.stopped_early.store(true, Ordering::Relaxed);
                sh.stop.store(true, Ordering::Relaxed);
                return Ok(());
            }
        }
        let op = sh.next_op.fetch_add(1, Ordering::Relaxed);
        if op >= cfg.ops {
            return Ok(());
        }
        // Phase switch: the thread whose op starts a phase flips the policy.
        if op > 0 && op % per_phase == 0 {
            let p = (op / per_phase) as usize;
            if let Some(&policy) = cfg.phases.get(p) {
                sh.pool.set_reuse(policy);
                bump(&sh.tally.phases);
                tracing::debug!(phase = p, policy = %policy_name(&policy), "stress: phase");
            }
        }
        if cfg.trim_every > 0 && op % cfg.trim_every == cfg.trim_every - 1 {
            let target = if rng.percent(50) {
                0
            } else {
                sh.pool.stats().reserved_current / 2
            };
            sh.pool
                .trim_to(target)
                .map_err(pool_err("trimming the pool"))?;
            bump(&sh.tally.trims);
        }
        if cfg.sync_every > 0 && op % cfg.sync_every == cfg.sync_every - 1 {
            if rng.percent(50) {
                sh.pool
                    .synchronize()
                    .map_err(pool_err("synchronising the pool"))?;
            } else {
                let s = sh.streams[rng.index(sh.streams.len())];
                sh.pool
                    .synchronize_stream(s)
                    .map_err(pool_err("synchronising a stream"))?;
            }
            bump(&sh.tally.syncs);
        }

        // Choose the operation by weight.
        let can_alloc = live.len() < cfg.max_live_per_thread;
        let has = !live.is_empty();
        let multi = sh.streams.len() > 1;
        let w_alloc: u64 = if can_alloc { 45 } else { 0 };
        let w_free: u64 = if has { 45 } else { 0 };
        let w_use: u64 = if has && multi {
            u64::from(cfg.use_pct)
        } else {
            0
        };
        let w_wait: u64 = if multi { u64::from(cfg.wait_pct) } else { 0 };
        let r = rng.below(w_alloc + w_free + w_use + w_wait);
        if r < w_alloc {
            alloc_one(sh, rng, live)?;
        } else if r < w_alloc + w_free {
            let l = live.swap_remove(rng.index(live.len()));
            free_one(sh, rng, l)?;
        } else if r < w_alloc + w_free + w_use {
            let i = rng.index(live.len());
            use_one(sh, rng, &mut live[i])?;
        } else {
            let from = sh.streams[rng.index(sh.streams.len())];
            let to = other_stream(sh, rng, from);
            let ev = sh
                .pool
                .record_event(from)
                .map_err(pool_err("recording an event"))?;
            sh.pool
                .wait_event(to, &ev)
                .map_err(pool_err("waiting on an event"))?;
            bump(&sh.tally.waits);
        }
        bump(&sh.tally.ops);
    }
}

/// A random stream other than `not` (there must be two or more).
fn other_stream<D: Device>(sh: &Shared<'_, D>, rng: &mut XorShift64, not: Stream) -> Stream {
    loop {
        let s = sh.streams[rng.index(sh.streams.len())];
        if s != not {
            return s;
        }
    }
}

fn spin<D: Device>(
    sh: &Shared<'_, D>,
    rng: &mut XorShift64,
    stream: Stream,
) -> Result<(), StressError> {
    let ns = rng.below(sh.cfg.max_spin_ns + 1);
    sh.kernels
        .spin(stream, ns)
        .map_err(kernel_err("spinning a stream"))?;
    bump(&sh.tally.spins);
    Ok(())
}

/// Order `to` after all work issued on `from` so far, through the pool:
/// directly, or through a chain of intermediate streams.
fn order_after<D: Device>(
    sh: &Shared<'_, D>,
    rng: &mut XorShift64,
    from: Stream,
    to: Stream,
) -> Result<(), StressError> {
    let mut prev = from;
    if sh.streams.len() > 2 && sh.cfg.max_chain > 0 && rng.percent(sh.cfg.chain_pct) {
        let hops = 1 + rng.index(sh.cfg.max_chain);
        for _ in 0..hops {
            let mid = other_stream(sh, rng, prev);
            let ev = sh
                .pool
                .record_event(prev)
                .map_err(pool_err("recording an event (chain)"))?;
            sh.pool
                .wait_event(mid, &ev)
                .map_err(pool_err("waiting on an event (chain)"))?;
            bump(&sh.tally.waits);
            prev = mid;
        }
        bump(&sh.tally.chains);
    }
    if prev != to {
        let ev = sh
            .pool
            .record_event(prev)
            .map_err(pool_err("recording an event"))?;
        sh.pool
            .wait_event(to, &ev)
            .map_err(pool_err("waiting on an event"))?;
        bump(&sh.tally.waits);
    }
    Ok(())
}

fn alloc_one<D: Device>(
    sh: &Shared<'_, D>,
    rng: &mut XorShift64,
    live: &mut Vec<Live>,
) -> Result<(), StressError> {
    let cfg = sh.cfg;
    let stream = sh.streams[rng.index(sh.streams.len())];
    let size = rng.log_uniform(cfg.min_size, cfg.max_size);
    let alloc = match sh.pool.alloc_async(size, stream) {
        Ok(a) => a,
        Err(e) if e.is_out_of_memory() => {
            // Legitimate under a pool cap: give back the oldest block and
            // go on (the next allocation retries).
            bump(&sh.tally.ooms);
            tracing::debug!(size, error = %e, "stress: out of memory");
            if !live.is_empty() {
                let l = live.remove(0);
                free_one(sh, rng, l)?;
            }
            return Ok(());
        }
        Err(e) => {
            return Err(StressError::Pool {
                during: "allocating",
                source: e,
            })
        }
    };
    bump(&sh.tally.allocs);
    sh.tally
        .bytes_allocated
        .fetch_add(size as u64, Ordering::Relaxed);
    sh.tally
        .largest_alloc
        .fetch_max(size as u64, Ordering::Relaxed);
    let tag = sh.next_tag.fetch_add(1, Ordering::Relaxed);
    let len = size & !3;
    sh.kernels
        .fill_tag(stream, alloc.ptr(), len, tag)
        .map_err(kernel_err("filling a new allocation"))?;
    if rng.percent(cfg.fill_spin_pct) {
        spin(sh, rng, stream)?;
    }
    live.push(Live { alloc, tag, len });
    Ok(())
}

/// Use a live allocation on another stream (a slow reader), declared to the
/// pool with `record_use`.
fn use_one<D: Device>(
    sh: &Shared<'_, D>,
    rng: &mut XorShift64,
    l: &mut Live,
) -> Result<(), StressError> {
    let home = l.alloc.stream();
    let user = other_stream(sh, rng, home);
    order_after(sh, rng, home, user)?;
    if rng.percent(sh.cfg.spin_pct) {
        spin(sh, rng, user)?;
    }
    sh.kernels
        .verify_tag(user, l.alloc.ptr(), l.len, l.tag)
        .map_err(kernel_err("verifying on a user stream"))?;
    bump(&sh.tally.verifies);
    sh.pool.record_use(&mut l.alloc, user);
    bump(&sh.tally.declared_uses);
    Ok(())
}

/// Verify and free: on the allocating stream, or on another one ordered
/// after it (directly or through a chain), often behind a spin.
fn free_one<D: Device>(
    sh: &Shared<'_, D>,
    rng: &mut XorShift64,
    l: Live,
) -> Result<(), StressError> {
    let home = l.alloc.stream();
    let on = if sh.streams.len() > 1 && rng.percent(sh.cfg.cross_stream_free_pct) {
        other_stream(sh, rng, home)
    } else {
        home
    };
    if on != home {
        order_after(sh, rng, home, on)?;
        bump(&sh.tally.cross_stream_frees);
    }
    if rng.percent(sh.cfg.spin_pct) {
        spin(sh, rng, on)?;
    }
    sh.kernels
        .verify_tag(on, l.alloc.ptr(), l.len, l.tag)
        .map_err(kernel_err("verifying before a free"))?;
    bump(&sh.tally.verifies);
    sh.pool
        .free_async(l.alloc, on)
        .map_err(|e| StressError::Pool {
            during: "freeing",
            source: e.error,
        })?;
    bump(&sh.tally.frees);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xorshift_is_deterministic_and_spreads() {
        let mut a = XorShift64::new(42);
        let mut b = XorShift64::new(42);
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        let mut z = XorShift64::new(0);
        assert_ne!(z.next_u64(), 0);
        let mut hits = [0u32; 10];
        for _ in 0..10_000 {
            hits[z.index(10)] += 1;
        }
        assert!(hits.iter().all(|&h| (800..1200).contains(&h)), "{hits:?}");
    }

    #[test]
    fn log_uniform_covers_the_range_evenly_by_octave() {
        let mut r = XorShift64::new(7);
        let (lo, hi) = (256usize, 64 << 20);
        let mut octaves = [0u32; 19];
        for _ in 0..19_000 {
            let v = r.log_uniform(lo, hi);
            assert!((lo..=hi).contains(&v));
            octaves[(v / lo).ilog2() as usize] += 1;
        }
        // 18 octaves from 256 B to 64 MiB: each gets about 1/18.
        for (i, &n) in octaves.iter().enumerate().take(18) {
            assert!((700..1400).contains(&n), "octave {i}: {n} of 19000");
        }
        assert_eq!(r.log_uniform(512, 512), 512);
    }

    #[test]
    fn policy_names() {
        assert_eq!(policy_name(&all_on()), "all-on");
        let names: Vec<String> = standard_phases().iter().map(policy_name).collect();
        assert_eq!(
            names,
            [
                "all-on",
                "no-follow",
                "no-opportunistic",
                "no-internal",
                "no-wait-pending"
            ]
        );
    }
}
