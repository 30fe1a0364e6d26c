//! Allocation traces: parsing (plain or gzip CSV `op,id,size,stream`) into a
//! compact in-memory form that the replay loop walks with nothing but a `Vec`
//! index per operation.
//!
//! Validation happens here, at parse time, so the timed loop never has to
//! check anything: a free of an id that is not live and an allocation of an
//! id that is already live are errors naming the line. An id may be
//! allocated again after its free (it then names a new allocation).
//!
//! Besides allocations (`a`) and frees (`f`), a trace may order one stream
//! after another (`w,FROM,0,STREAM`: STREAM waits for the work issued on
//! FROM so far, an event recorded on FROM and waited on by STREAM). That is
//! what makes a free on another stream than the allocation's legal: see
//! [`Trace::unordered_frees`].

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::io::{self, BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// One operation of a parsed trace. `slot` indexes the replay's handle
/// table (dense, assigned at parse time); `stream` indexes
/// [`Trace::streams`] (dense as well).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceOp {
    Alloc {
        slot: u32,
        size: usize,
        stream: u32,
    },
    Free {
        slot: u32,
        stream: u32,
    },
    /// `stream` waits for the work issued on `from` so far (an event
    /// recorded on `from`, waited on by `stream`). Both index
    /// [`Trace::streams`] and differ.
    Wait {
        from: u32,
        stream: u32,
    },
}

/// A parsed trace, ready to replay.
#[derive(Debug, Clone)]
pub struct Trace {
    /// Display name (file name without `.csv`/`.csv.gz`).
    pub name: String,
    /// The operations, in trace order.
    pub ops: Vec<TraceOp>,
    /// Size of the handle table the replay needs (distinct live slots).
    pub slots: usize,
    /// The trace's own stream numbers; `TraceOp::*::stream` indexes this.
    pub streams: Vec<u64>,
    /// Peak of the sum of sizes of live allocations, over the trace.
    pub peak_live_bytes: u64,
    /// Bytes still live after the last operation (never freed in the trace).
    pub live_at_end_bytes: u64,
    /// Allocations still live after the last operation.
    pub live_at_end: usize,
    /// Number of allocations.
    pub allocs: usize,
    /// Number of distinct allocation sizes.
    pub distinct_sizes: usize,
    /// Number of waits (`w` lines).
    pub waits: usize,
    /// How long parsing took (reading, decompressing and validating).
    pub parse_time: Duration,
}

/// Why a trace could not be loaded.
#[derive(Debug)]
pub enum TraceError {
    /// The file could not be opened or read.
    Io { path: PathBuf, source: io::Error },
    /// The file holds no operation (empty, or a header and comments only).
    Empty { path: PathBuf },
    /// Every allocation (of the operations kept) is of 0 bytes, so the
    /// trace never holds a byte and a ratio to its peak means nothing.
    NoLiveBytes { path: PathBuf },
    /// A line is malformed or breaks the trace's rules.
    Parse {
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The line's content, as read.
        content: String,
        reason: String,
    },
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TraceError::Io { path, source } => {
                write!(f, "{}: cannot read trace: {source}", path.display())
            }
            TraceError::Empty { path } => write!(
                f,
                "{}: the trace holds no operation (empty file, or a header only); a trace has \
                 one line `a,ID,SIZE,STREAM`, `f,ID,SIZE,STREAM` or `w,FROM,0,STREAM` per \
                 operation (see benches/traces/README.md)",
                path.display()
            ),
            TraceError::NoLiveBytes { path } => write!(
                f,
                "{}: the trace never holds a byte (every allocation replayed is of 0 bytes), so \
                 there is no peak to compare the allocators' memory with; replay a trace (or \
                 a --max-ops prefix) that allocates memory",
                path.display()
            ),
            TraceError::Parse {
                path,
                line,
                content,
                reason,
            } => write!(f, "{}:{line}: {reason}: {content:?}", path.display()),
        }
    }
}

impl std::error::Error for TraceError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TraceError::Io { source, .. } => Some(source),
            TraceError::Parse { .. }
            | TraceError::Empty { .. }
            | TraceError::NoLiveBytes { .. } => None,
        }
    }
}

impl TraceError {
    /// The 1-based line number of a parse error.
    pub fn line(&self) -> Option<usize> {
        match self {
            TraceError::Parse { line, .. } => Some(*line),
            TraceError::Io { .. } | TraceError::Empty { .. } | TraceError::NoLiveBytes { .. } => {
                None
            }
        }
    }
}

/// The display name of a trace file: its file name without `.gz` and `.csv`.
pub fn trace_name(path: &Path) -> String {
    let file = path
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string());
    let file = file.strip_suffix(".gz").unwrap_or(&file);
    let file = file.strip_suffix(".csv").unwrap_or(file);
    file.to_string()
}

impl Trace {
    /// Load a trace file, plain CSV or gzip (detected by its magic bytes,
    /// not its name). `max_ops` keeps only a prefix of the operations. A
    /// file with no operation is an error ([`TraceError::Empty`]), and so is
    /// `max_ops == Some(0)`; so is one that never holds a byte
    /// ([`TraceError::NoLiveBytes`]).
    pub fn load(path: &Path, max_ops: Option<usize>) -> Result<Trace, TraceError> {
        let start = Instant::now();
        let io_err = |source| TraceError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut file = BufReader::new(File::open(path).map_err(io_err)?);
        let gz = {
            let head = file.fill_buf().map_err(io_err)?;
            head.len() >= 2 && head[0] == 0x1f && head[1] == 0x8b
        };
        let reader: Box<dyn BufRead> = if gz {
            Box::new(BufReader::new(flate2::bufread::MultiGzDecoder::new(file)))
        } else {
            Box::new(file)
        };
        let mut trace = Trace::parse(reader, path, max_ops)?;
        if trace.ops.is_empty() {
            return Err(TraceError::Empty {
                path: path.to_path_buf(),
            });
        }
        if trace.peak_live_bytes == 0 {
            return Err(TraceError::NoLiveBytes {
                path: path.to_path_buf(),
            });
        }
        trace.name = trace_name(path);
        trace.parse_time = start.elapsed();
        Ok(trace)
    }

    /// Parse a trace from a reader; `path` only names it in errors.
    pub fn parse<R: Read>(
        reader: R,
        path: &Path,
        max_ops: Option<usize>,
    ) -> Result<Trace, TraceError> {
        let start = Instant::now();
        let mut reader = BufReader::new(reader);
        let mut ops = Vec::new();
        // id -> slot of the allocation now live under that id.
        let mut live_ids: HashMap<u64, (u32, usize)> = HashMap::new();
        let mut free_slots: Vec<u32> = Vec::new();
        let mut slots = 0u32;
        let mut stream_index: HashMap<u64, u32> = HashMap::new();
        let mut streams = Vec::new();
        let mut sizes: HashMap<usize, ()> = HashMap::new();
        let mut live = 0u64;
        let mut peak = 0u64;
        let mut allocs = 0usize;
        let mut waits = 0usize;
        let limit = max_ops.unwrap_or(usize::MAX);

        let mut buf = String::new();
        let mut lineno = 0usize;
        let mut seen_content = false;
        loop {
            if ops.len() >= limit {
                break;
            }
            buf.clear();
            let n = reader
                .read_line(&mut buf)
                .map_err(|source| TraceError::Io {
                    path: path.to_path_buf(),
                    source,
                })?;
            if n == 0 {
                break;
            }
            lineno += 1;
            let line = buf.trim_end_matches(['\n', '\r']);
            // A UTF-8 byte order mark (spreadsheets write one) is not content.
            let line = if lineno == 1 {
                line.strip_prefix('\u{feff}').unwrap_or(line)
            } else {
                line
            };
            let bad = |reason: String| TraceError::Parse {
                path: path.to_path_buf(),
                line: lineno,
                content: line.to_string(),
                reason,
            };
            let trimmed = line.trim();
            if trimmed.is_empty() || trimmed.starts_with('#') {
                continue;
            }
            // The header, if any, is the first line with content (comments
            // and blank lines may come before it).
            let first_content = !seen_content;
            seen_content = true;
            if first_content && trimmed.starts_with("op") {
                let header: Vec<&str> = trimmed.split(',').map(str::trim).collect();
                if header != ["op", "id", "size", "stream"] {
                    return Err(bad("header must be `op,id,size,stream`".into()));
                }
                continue;
            }
            let fields: Vec<&str> = trimmed.split(',').map(str::trim).collect();
            if fields.len() != 4 {
                return Err(bad(format!(
                    "expected 4 fields `op,id,size,stream`, found {}",
                    fields.len()
                )));
            }
            let num = |i: usize, what: &str| -> Result<u64, TraceError> {
                fields[i].parse::<u64>().map_err(|_| {
                    bad(format!(
                        "{what} `{}` is not a non-negative integer",
                        fields[i]
                    ))
                })
            };
            let id = num(1, "id")?;
            let size = num(2, "size")?;
            let stream_no = num(3, "stream")?;
            let mut stream_of = |no: u64| match stream_index.get(&no) {
                Some(&s) => s,
                None => {
                    let s = streams.len() as u32;
                    streams.push(no);
                    stream_index.insert(no, s);
                    s
                }
            };
            if fields[0] == "w" {
                // Checked before the streams are numbered, so that a bad
                // line adds no stream.
                if id == stream_no {
                    return Err(bad(format!(
                        "wait of stream {stream_no} on itself (a stream is always ordered \
                         after its own work; `w,FROM,0,STREAM` needs two streams)"
                    )));
                }
                if size != 0 {
                    return Err(bad(format!(
                        "wait with size {size}: the size field of `w,FROM,0,STREAM` must be 0"
                    )));
                }
                let from = stream_of(id);
                let stream = stream_of(stream_no);
                waits += 1;
                ops.push(TraceOp::Wait { from, stream });
                continue;
            }
            let stream = stream_of(stream_no);
            match fields[0] {
                "a" => {
                    let size = usize::try_from(size)
                        .map_err(|_| bad(format!("size {size} does not fit this machine")))?;
                    if live_ids.contains_key(&id) {
                        return Err(bad(format!("id {id} allocated again while still live")));
                    }
                    let slot = match free_slots.pop() {
                        Some(s) => s,
                        None => {
                            slots += 1;
                            slots - 1
                        }
                    };
                    live_ids.insert(id, (slot, size));
                    sizes.insert(size, ());
                    live = live.checked_add(size as u64).ok_or_else(|| {
                        bad(format!(
                            "the live bytes ({live} before this allocation of {size}) overflow a \
                             64-bit count; the sizes cannot be those of a real program"
                        ))
                    })?;
                    allocs += 1;
                    peak = peak.max(live);
                    ops.push(TraceOp::Alloc { slot, size, stream });
                }
                "f" => {
                    let Some((slot, size)) = live_ids.remove(&id) else {
                        return Err(bad(format!(
                            "free of id {id}, which is not live (never allocated, or already freed)"
                        )));
                    };
                    free_slots.push(slot);
                    live -= size as u64;
                    ops.push(TraceOp::Free { slot, stream });
                }
                other => {
                    return Err(bad(format!(
                        "unknown op `{other}` (expected `a`, `f` or `w`)"
                    )))
                }
            }
        }
        Ok(Trace {
            name: trace_name(path),
            ops,
            slots: slots as usize,
            streams,
            peak_live_bytes: peak,
            live_at_end_bytes: live,
            live_at_end: live_ids.len(),
            allocs,
            distinct_sizes: sizes.len(),
            waits,
            parse_time: start.elapsed(),
        })
    }

    /// The envelope of live bytes over `buckets` equal runs of operations:
    /// for each run, the lowest and the highest live byte count reached in
    /// it and the count at its end, as `(operations done, live bytes)`
    /// points in time order (coinciding points once). The first point is `(0, 0)`; the highest
    /// point of all is the trace's peak live bytes, however short the peak.
    pub fn live_envelope(&self, buckets: usize) -> Vec<(usize, u64)> {
        let n = self.ops.len();
        let per = n.div_ceil(buckets.max(1)).max(1);
        let mut sizes = vec![0u64; self.slots];
        let mut live = 0u64;
        let mut out = vec![(0usize, 0u64)];
        for (b, chunk) in self.ops.chunks(per).enumerate() {
            // (ops done, live) at the bucket's lowest and highest points.
            let mut lo = (usize::MAX, u64::MAX);
            let mut hi = (0usize, 0u64);
            for (i, op) in chunk.iter().enumerate() {
                match *op {
                    TraceOp::Alloc { slot, size, .. } => {
                        sizes[slot as usize] = size as u64;
                        live += size as u64;
                    }
                    TraceOp::Free { slot, .. } => live -= sizes[slot as usize],
                    TraceOp::Wait { .. } => {}
                }
                let done = b * per + i + 1;
                if live < lo.1 {
                    lo = (done, live);
                }
                if live > hi.1 || hi.0 == 0 {
                    hi = (done, live);
                }
            }
            let (first, second) = if lo.0 <= hi.0 { (lo, hi) } else { (hi, lo) };
            let last = (b * per + chunk.len(), live);
            for p in [first, second, last] {
                if out.last() != Some(&p) {
                    out.push(p);
                }
            }
        }
        out
    }

    /// The frees that are not ordered after their allocation: a free on
    /// stream B of a block allocated on stream A is ordered when B waited,
    /// directly or through a chain of waits (`w` lines), on A's work issued
    /// at or after the allocation; a free on the allocation's own stream
    /// always is. Returns the indices (into [`Trace::ops`]) of the frees
    /// that are not. Such a free would hand memory back while the
    /// allocating stream may still use it; a trace meant to run on a real
    /// program's streams should have none.
    ///
    /// Vector clocks over the trace's streams: each stream counts the
    /// operations issued on it, and a wait merges the waited stream's clock
    /// into the waiting one's.
    pub fn unordered_frees(&self) -> Vec<usize> {
        let n = self.streams.len();
        let mut clocks = vec![vec![0u64; n]; n];
        // slot -> (allocating stream, its own clock at the allocation)
        let mut born = vec![(0usize, 0u64); self.slots];
        let mut out = Vec::new();
        for (i, op) in self.ops.iter().enumerate() {
            match *op {
                TraceOp::Alloc { slot, stream, .. } => {
                    let s = stream as usize;
                    clocks[s][s] += 1;
                    born[slot as usize] = (s, clocks[s][s]);
                }
                TraceOp::Free { slot, stream } => {
                    let s = stream as usize;
                    clocks[s][s] += 1;
                    let (a, t) = born[slot as usize];
                    if clocks[s][a] < t {
                        out.push(i);
                    }
                }
                TraceOp::Wait { from, stream } => {
                    let (f, s) = (from as usize, stream as usize);
                    clocks[f][f] += 1;
                    let seen = clocks[f].clone();
                    for (mine, theirs) in clocks[s].iter_mut().zip(seen) {
                        *mine = (*mine).max(theirs);
                    }
                }
            }
        }
        out
    }

    /// Live bytes after each of the given operation counts (sorted,
    /// ascending): `out[k]` is the sum of sizes live after the first
    /// `counts[k]` operations, as the trace asks (no out-of-memory skips).
    pub fn live_after(&self, counts: &[usize]) -> Vec<u64> {
        let mut sizes = vec![0u64; self.slots];
        let mut live = 0u64;
        let mut out = Vec::with_capacity(counts.len());
        let mut next = 0;
        for (i, op) in self.ops.iter().enumerate() {
            while next < counts.len() && counts[next] <= i {
                out.push(live);
                next += 1;
            }
            match *op {
                TraceOp::Alloc { slot, size, .. } => {
                    sizes[slot as usize] = size as u64;
                    live += size as u64;
                }
                TraceOp::Free { slot, .. } => live -= sizes[slot as usize],
                TraceOp::Wait { .. } => {}
            }
        }
        while next < counts.len() {
            out.push(live);
            next += 1;
        }
        out
    }
}
