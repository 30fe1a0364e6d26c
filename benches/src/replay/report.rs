//! Formatting of replay results: one JSON object a line, or a table.

use super::run::PassResult;
use super::timed::{DriverOp, DriverStat};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write;

/// One reported row: a pass of one allocator over one trace.
#[derive(Debug, Clone)]
pub struct Record {
    pub trace: String,
    pub backend: String,
    pub allocator: String,
    pub result: PassResult,
    /// The completion lag the pass ran under, in trace operations, when it
    /// ran under one (see `--lag`).
    pub lag: Option<u64>,
    /// Whether the pool ran in announced capture mode (no per-allocation
    /// capture query).
    pub announced_capture: bool,
    /// Why the ratio is what it is, when it holds by construction.
    pub note: Option<String>,
}

/// The JSON form of a [`Record`]: field order as documented in the
/// replayer's `--help`; the allocator's own counters follow `wall_s`.
#[derive(Serialize)]
struct JsonRecord<'a> {
    trace: &'a str,
    backend: &'a str,
    allocator: &'a str,
    pass: u32,
    warm: bool,
    ops: usize,
    peak_live_bytes: u64,
    peak_reserved_bytes: u64,
    /// Non-finite values are written as `null` by serde_json.
    ratio: f64,
    ooms: u64,
    valid: bool,
    ops_per_sec: f64,
    wall_s: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    lag: Option<u64>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    announced_capture: bool,
    #[serde(flatten)]
    counters: BTreeMap<&'static str, u64>,
    /// Driver calls of the pass per kind (see [`crate::replay::timed`]):
    /// the kinds a pool calls per page always, the others where called.
    #[serde(skip_serializing_if = "Option::is_none")]
    driver_calls: Option<BTreeMap<&'static str, u64>>,
    /// Milliseconds spent in those calls, per kind.
    #[serde(skip_serializing_if = "Option::is_none")]
    driver_ms: Option<BTreeMap<&'static str, f64>>,
    /// The sum of `driver_ms`.
    #[serde(skip_serializing_if = "Option::is_none")]
    driver_ms_total: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    note: Option<&'a str>,
}

impl Record {
    /// Whether the pass replayed the whole trace: no allocation failed for
    /// lack of memory. A pass with out-of-memory failures skipped those
    /// allocations, so its peak reserved bytes and ratio do not describe
    /// the trace.
    pub fn is_valid(&self) -> bool {
        self.result.ooms == 0
    }

    /// The record as one line of JSON (no trailing newline).
    pub fn to_json(&self) -> String {
        let r = &self.result;
        let rec = JsonRecord {
            trace: &self.trace,
            backend: &self.backend,
            allocator: &self.allocator,
            pass: r.pass,
            warm: r.pass > 1,
            ops: r.ops,
            peak_live_bytes: r.peak_live_bytes,
            peak_reserved_bytes: r.peak_reserved_bytes,
            ratio: r.ratio(),
            ooms: r.ooms,
            valid: self.is_valid(),
            ops_per_sec: r.ops_per_sec(),
            wall_s: r.wall.as_secs_f64(),
            lag: self.lag,
            announced_capture: self.announced_capture,
            counters: r.counters.iter().copied().collect(),
            driver_calls: (!r.driver.is_empty())
                .then(|| reported(r).map(|(n, s)| (n, s.calls)).collect()),
            driver_ms: (!r.driver.is_empty())
                .then(|| reported(r).map(|(n, s)| (n, ms(s.nanos))).collect()),
            driver_ms_total: (!r.driver.is_empty()).then(|| ms(r.driver_wall().as_nanos() as u64)),
            note: self.note.as_deref(),
        };
        // Serialising plain numbers, strings and a string-keyed map cannot fail.
        serde_json::to_string(&rec).unwrap_or_default()
    }
}

/// The driver kinds a record reports: those a pool calls per page, and
/// any other that was called during the pass.
fn reported(r: &PassResult) -> impl Iterator<Item = (&'static str, DriverStat)> + '_ {
    r.driver
        .iter()
        .filter(|(name, s)| s.calls > 0 || is_per_page(name))
        .copied()
}

fn is_per_page(name: &str) -> bool {
    DriverOp::ALL
        .iter()
        .any(|op| op.name() == name && op.per_page())
}

fn ms(nanos: u64) -> f64 {
    nanos as f64 / 1e6
}

/// Bytes as MiB with one decimal.
pub fn mib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / (1u64 << 20) as f64)
}

/// Operations per second, human-sized (`1.23 M`, `45.6 k`).
pub fn rate(x: f64) -> String {
    if !x.is_finite() {
        "inf".into()
    } else if x >= 1e6 {
        format!("{:.2} M", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.1} k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}

/// The records as a readable table (with a trailing newline), followed by
/// the notes of any row that has one.
pub fn table(records: &[Record]) -> String {
    let header = [
        "trace",
        "backend",
        "allocator",
        "pass",
        "ops",
        "peak live MiB",
        "peak reserved MiB",
        "ratio",
        "OOMs",
        "ops/s",
        "wall s",
    ];
    let rows: Vec<[String; 11]> = records
        .iter()
        .map(|rec| {
            let r = &rec.result;
            [
                rec.trace.clone(),
                rec.backend.clone(),
                if rec.note.is_some() {
                    format!("{}*", rec.allocator)
                } else {
                    rec.allocator.clone()
                },
                format!("{}{}", r.pass, if r.pass == 1 { " fresh" } else { " warm" }),
                r.ops.to_string(),
                mib(r.peak_live_bytes),
                mib(r.peak_reserved_bytes),
                if rec.is_valid() {
                    format!("{:.4}", r.ratio())
                } else {
                    format!("({:.4})", r.ratio())
                },
                r.ooms.to_string(),
                rate(r.ops_per_sec()),
                format!("{:.4}", r.wall.as_secs_f64()),
            ]
        })
        .collect();
    let mut widths = header.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let line = |out: &mut String, cells: &[&str]| {
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            // Text left-aligned, numbers right-aligned.
            if i < 4 {
                let _ = write!(out, "{cell:<w$}");
            } else {
                let _ = write!(out, "{cell:>w$}");
            }
            out.push_str(if i + 1 < cells.len() { "  " } else { "\n" });
        }
    };
    line(&mut out, &header);
    let rule: Vec<String> = widths.iter().map(|&w| "-".repeat(w)).collect();
    line(
        &mut out,
        &rule.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    for row in &rows {
        line(
            &mut out,
            &row.iter().map(String::as_str).collect::<Vec<_>>(),
        );
    }
    let mut notes: Vec<(&str, &str)> = records
        .iter()
        .filter_map(|r| r.note.as_deref().map(|n| (r.allocator.as_str(), n)))
        .collect();
    notes.dedup();
    for (alloc, note) in notes {
        let _ = writeln!(out, "* {alloc}: {note}");
    }
    let timed: Vec<&Record> = records
        .iter()
        .filter(|r| !r.result.driver.is_empty())
        .collect();
    if !timed.is_empty() {
        out.push_str("driver calls (calls / ms) and their share of the pass's wall time:\n");
    }
    for rec in timed {
        let r = &rec.result;
        let wall = r.wall.as_secs_f64();
        let driver = r.driver_wall().as_secs_f64();
        let kinds: Vec<String> = reported(r)
            .map(|(name, s)| format!("{name} {} / {:.2}", s.calls, ms(s.nanos)))
            .collect();
        let _ = writeln!(
            out,
            "  {} / {} pass {}: {:.2} of {:.2} ms ({:.0}%): {}",
            rec.trace,
            rec.allocator,
            r.pass,
            driver * 1e3,
            wall * 1e3,
            if wall > 0.0 {
                100.0 * driver / wall
            } else {
                0.0
            },
            kinds.join(", ")
        );
    }
    for rec in records.iter().filter(|r| !r.is_valid()) {
        let _ = writeln!(
            out,
            "INVALID: {} / {} pass {}: {} allocation(s) failed for lack of memory and were \
             skipped, so its peak reserved and ratio (in parentheses) do not describe the trace",
            rec.trace, rec.allocator, rec.result.pass, rec.result.ooms
        );
    }
    out
}
