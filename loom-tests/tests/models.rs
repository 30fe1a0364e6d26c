//! The loom models (see `docs/loom.md`). Run with
//! `RUSTFLAGS="--cfg loom" LOOM_MAX_PREEMPTIONS=2 CARGO_TARGET_DIR=target-loom
//! cargo test --release -p tidepool-loom-tests`.
#![cfg(loom)]

use std::sync::atomic::{AtomicUsize, Ordering};
use tidepool_loom_tests::scenarios;

// Counters outside loom's view (std atomics), across all explored
// executions of one model: they show a model is not vacuous.
#[derive(Default)]
struct Seen {
    runs: AtomicUsize,
    hits: AtomicUsize,
}

impl Seen {
    fn record(&self, hit: bool) {
        self.runs.fetch_add(1, Ordering::Relaxed);
        if hit {
            self.hits.fetch_add(1, Ordering::Relaxed);
        }
    }
    fn get(&self) -> (usize, usize) {
        (
            self.runs.load(Ordering::Relaxed),
            self.hits.load(Ordering::Relaxed),
        )
    }
}

#[test]
fn a_shard_alloc_free() {
    loom::model(scenarios::shard_alloc_free);
}

#[test]
fn b_cross_stream_event() {
    let seen = std::sync::Arc::new(Seen::default());
    let s = seen.clone();
    loom::model(move || s.record(scenarios::cross_stream_event()));
    let (runs, reused) = seen.get();
    eprintln!("cross_stream_event: {runs} executions, {reused} reused the block through the event");
    assert!(
        reused > 0 && reused < runs,
        "both outcomes must be explored"
    );
}

#[test]
fn c_trim_vs_pending() {
    let seen = std::sync::Arc::new(Seen::default());
    let s = seen.clone();
    loom::model(move || s.record(scenarios::trim_vs_pending() > 0));
    let (runs, released) = seen.get();
    eprintln!("trim_vs_pending: {runs} executions, {released} where the concurrent trim released the freed page");
    assert!(
        released > 0 && released < runs,
        "both outcomes must be explored"
    );
}

#[test]
fn d_raw_double_free() {
    loom::model(scenarios::raw_double_free);
}

#[test]
fn e_stats_live_set() {
    loom::model(scenarios::stats_live_set);
}

#[test]
fn f_reuse_switch_publication() {
    let seen = std::sync::Arc::new(Seen::default());
    let reused = std::sync::Arc::new(AtomicUsize::new(0));
    let (s, r) = (seen.clone(), reused.clone());
    loom::model(move || {
        let (flag, hit) = scenarios::reuse_switch_publication();
        s.record(flag);
        if hit {
            r.fetch_add(1, Ordering::Relaxed);
        }
    });
    let (runs, flagged) = seen.get();
    let reused = reused.load(Ordering::Relaxed);
    eprintln!(
        "reuse_switch_publication: {runs} executions, {flagged} saw the switch, {reused} reused"
    );
    assert!(flagged > 0 && reused > 0);
}

#[test]
fn g_busy_list_free_vs_pass() {
    loom::model(scenarios::busy_list_free_vs_pass);
}

#[test]
fn h_headroom_donors() {
    loom::model(scenarios::headroom_donors);
}

#[test]
fn i_announced_capture_gate() {
    loom::model(scenarios::announced_capture_gate);
}

#[test]
fn j_lean_lock_excludes() {
    let seen = std::sync::Arc::new(Seen::default());
    let s = seen.clone();
    loom::model(move || s.record(scenarios::lean_lock_excludes()));
    let (runs, second_first) = seen.get();
    eprintln!("lean_lock_excludes: {runs} executions, {second_first} where the spawned thread locked first");
    assert!(
        second_first > 0 && second_first < runs,
        "both orders must be explored"
    );
}

#[test]
fn k_forget_retired_vs_stats() {
    loom::model(scenarios::forget_retired_vs_stats);
}

#[test]
fn l_watch_free_vs_poll() {
    let reused = std::sync::Arc::new(AtomicUsize::new(0));
    let r = reused.clone();
    loom::model(move || {
        if scenarios::watch_free_vs_poll() {
            r.fetch_add(1, Ordering::Relaxed);
        }
    });
    // Some interleaving lets the poll see the free complete.
    assert!(reused.load(Ordering::Relaxed) > 0);
}

#[test]
fn m_watch_hint_free_vs_poll() {
    let saw = std::sync::Arc::new(AtomicUsize::new(0));
    let r = saw.clone();
    let runs = std::sync::Arc::new(AtomicUsize::new(0));
    let n = runs.clone();
    loom::model(move || {
        n.fetch_add(1, Ordering::Relaxed);
        if scenarios::watch_hint_free_vs_poll() {
            r.fetch_add(1, Ordering::Relaxed);
        }
    });
    let (saw, runs) = (saw.load(Ordering::Relaxed), runs.load(Ordering::Relaxed));
    eprintln!("watch_hint_free_vs_poll: {runs} executions, {saw} where the poll saw the free");
    // Both orders of the free's watch and the poll are explored.
    assert!(saw > 0 && saw < runs, "both orders must be explored");
}
