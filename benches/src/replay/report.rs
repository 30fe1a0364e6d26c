//! Formatting of replay results: one JSON object a line, or a table.

use super::run::PassResult;
use std::fmt::Write;

/// One reported row: a pass of one allocator over one trace.
#[derive(Debug, Clone)]
pub struct Record {
    pub trace: String,
    pub backend: String,
    pub allocator: String,
    pub result: PassResult,
    /// Why the ratio is what it is, when it holds by construction.
    pub note: Option<String>,
}

/// Escape a string for a JSON string literal.
fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A finite float as JSON (non-finite values become `null`).
fn json_f64(x: f64) -> String {
    if x.is_finite() {
        format!("{x}")
    } else {
        "null".into()
    }
}

impl Record {
    /// The record as one line of JSON (no trailing newline).
    pub fn to_json(&self) -> String {
        let r = &self.result;
        let mut s = String::from("{");
        let _ = write!(
            s,
            "\"trace\":{},\"backend\":{},\"allocator\":{},\"pass\":{},\"warm\":{},\"ops\":{},\
             \"peak_live_bytes\":{},\"peak_reserved_bytes\":{},\"ratio\":{},\"ooms\":{},\
             \"ops_per_sec\":{},\"wall_s\":{}",
            json_str(&self.trace),
            json_str(&self.backend),
            json_str(&self.allocator),
            r.pass,
            r.pass > 1,
            r.ops,
            r.peak_live_bytes,
            r.peak_reserved_bytes,
            json_f64(r.ratio()),
            r.ooms,
            json_f64(r.ops_per_sec()),
            json_f64(r.wall.as_secs_f64()),
        );
        for (name, value) in &r.counters {
            let _ = write!(s, ",{}:{value}", json_str(name));
        }
        if let Some(note) = &self.note {
            let _ = write!(s, ",\"note\":{}", json_str(note));
        }
        s.push('}');
        s
    }
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
                format!("{:.4}", r.ratio()),
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
    out
}
