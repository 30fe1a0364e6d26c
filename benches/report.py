#!/usr/bin/env python3
"""Turn a bench summary file (TIDEPOOL_BENCH_SUMMARY, JSON lines) into the
markdown tables of docs/benchmarks.md and a thread-scaling SVG.

    python3 benches/report.py SUMMARY.jsonl [--svg docs/threads.svg] [--backend cuda|host]

Python 3 standard library only; the SVG is written by hand. Prints markdown
on stdout: per bench a table of every allocator's figure and tidepool's ratio
against each baseline, then the project's H200 targets with met / missed.
"""
import argparse
import json
import sys
from collections import OrderedDict

TIDEPOOL = "tidepool"
BASELINES = ["driver-pool", "driver-pool-t0-sync", "cuMemAlloc"]


def load(path):
    rows, meta, notes = [], [], []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if "meta" in d:
                meta.append(d)
            elif "note" in d:
                notes.append(d)
            elif "bench" in d:
                rows.append(d)
    # A later measurement of the same key replaces an earlier one.
    last = OrderedDict()
    for r in rows:
        last[(r["bench"], r["backend"], r["allocator"], r["param"])] = r
    return list(last.values()), meta, notes


def fmt_ns(ns):
    if ns >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.2f} µs"
    return f"{ns:.1f} ns"


def fmt_rate(x):
    if x >= 1e6:
        return f"{x / 1e6:.2f} M/s"
    if x >= 1e3:
        return f"{x / 1e3:.1f} k/s"
    return f"{x:.1f} /s"


# How each bench is read: "time" (lower is better, ns_per_op) or "rate"
# (higher is better, ops_per_sec), and what an op is.
BENCHES = OrderedDict([
    ("pair", ("time", "alloc+free pair, same stream")),
    ("many_live", ("time", "per op, 10,000 live 64 KiB")),
    ("cross_stream", ("time", "per round: alloc+free on A, event A→B, alloc on B, event B→A, free on A")),
    ("producer_consumer", ("time", "per round: alloc on the producer, event, a consumer (round robin) waits, free on the consumer; param = streams in all")),
    ("threads", ("rate", "aggregate 64 KiB pairs per second, N threads on N streams")),
    ("trace_replay", ("rate", "trace operations per second, warm pass")),
    ("trace_fresh", ("rate", "trace operations per second, fresh pass (one pass)")),
    ("overlap", ("time", "short-iteration latency next to a 50 ms low-priority kernel")),
])


def params_in_order(rows):
    seen = OrderedDict()
    for r in rows:
        seen.setdefault(r["param"], None)
    return list(seen)


def table(rows, bench, backend):
    kind, what = BENCHES.get(bench, ("time", bench))
    rs = [r for r in rows if r["bench"] == bench and r["backend"] == backend]
    if not rs:
        return ""
    allocs = list(OrderedDict((r["allocator"], None) for r in rs))
    by = {(r["allocator"], r["param"]): r for r in rs}
    ratio_cols = [b for b in BASELINES if b in allocs] if TIDEPOOL in allocs else []
    head = ["param"] + allocs + [f"tidepool / {b}" for b in ratio_cols]
    if kind == "time":
        title = (f"**{bench}** ({backend}): {what}; time per op, lower is better; "
                 "ratio = tidepool's time / baseline's time")
    else:
        title = (f"**{bench}** ({backend}): {what}; higher is better; "
                 "ratio = tidepool's rate / baseline's rate")
    out = [title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in params_in_order(rs):
        cells = [p]
        for a in allocs:
            r = by.get((a, p))
            cells.append("—" if r is None else
                         (fmt_ns(r["ns_per_op"]) if kind == "time" else fmt_rate(r["ops_per_sec"])))
        t = by.get((TIDEPOOL, p))
        for b in ratio_cols:
            r = by.get((b, p))
            if t is None or r is None:
                cells.append("—")
            elif kind == "time":
                cells.append(f"{t['ns_per_op'] / r['ns_per_op']:.3f} (1/{r['ns_per_op'] / t['ns_per_op']:.1f})")
            else:
                cells.append(f"{t['ops_per_sec'] / r['ops_per_sec']:.2f}×")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def targets(rows):
    """The project's three targets, on the cuda backend."""
    def get(bench, alloc, param):
        for r in rows:
            if (r["bench"], r["backend"], r["allocator"], r["param"]) == (bench, "cuda", alloc, param):
                return r
        return None

    lines = ["| target | measured | met |", "|---|---|---|"]

    def pair_target(alloc, label, need):
        # Same-stream pair <= 1/need of the driver pool's, at every size.
        worst = None
        for p in params_in_order([r for r in rows if r["bench"] == "pair"]):
            t, d = get("pair", alloc, p), get("pair", "driver-pool", p)
            if t and d:
                f = d["ns_per_op"] / t["ns_per_op"]
                if worst is None or f < worst[0]:
                    worst = (f, p, t["ns_per_op"], d["ns_per_op"])
        if worst:
            lines.append(f"| {label} ≤ 1/{need} of the driver pool's | worst size {worst[1]}: "
                         f"{fmt_ns(worst[2])} vs {fmt_ns(worst[3])} = 1/{worst[0]:.1f} | "
                         f"{'yes' if worst[0] >= need else 'no'} |")
        else:
            lines.append(f"| {label} ≤ 1/{need} of the driver pool's | not measured | — |")

    pair_target(TIDEPOOL, "same-stream pair, strict capture check", 10)
    pair_target("tidepool-nocheck", "same-stream pair, announced mode", 15)
    t, d, one = get("threads", TIDEPOOL, "16"), get("threads", "driver-pool", "16"), get("threads", TIDEPOOL, "1")
    if t and d and one:
        f, own = t["ops_per_sec"] / d["ops_per_sec"], t["ops_per_sec"] / one["ops_per_sec"]
        lines.append(f"| 16 threads ≥ 150× the driver pool's and ≥ 12× tidepool's one thread | "
                     f"{fmt_rate(t['ops_per_sec'])} vs {fmt_rate(d['ops_per_sec'])} = {f:.1f}×; "
                     f"{own:.1f}× own | {'yes' if f >= 150 and own >= 12 else 'no'} |")
    else:
        lines.append("| 16 threads ≥ 150× the driver pool's and ≥ 12× own | not measured | — |")
    two, many = get("producer_consumer", TIDEPOOL, "2streams"), get("producer_consumer", TIDEPOOL, "64streams")
    if two and many:
        f = many["ns_per_op"] / two["ns_per_op"]
        lines.append(f"| producer/consumer, 64 streams within 1.2× of 2 | {fmt_ns(many['ns_per_op'])} vs "
                     f"{fmt_ns(two['ns_per_op'])} = {f:.2f}× | {'yes' if f <= 1.2 else 'no'} |")
    for p in params_in_order([r for r in rows if r["bench"] == "trace_replay"]):
        t, d = get("trace_replay", TIDEPOOL, p), get("trace_replay", "driver-pool", p)
        if t and d:
            f = t["ops_per_sec"] / d["ops_per_sec"]
            lines.append(f"| trace replay {p}, warm, ≥ 5× the driver pool's ops/s | "
                         f"{fmt_rate(t['ops_per_sec'])} vs {fmt_rate(d['ops_per_sec'])} = {f:.1f}× | "
                         f"{'yes' if f >= 5 else 'no'} |")
    return "\n".join(lines) + "\n"


def svg(rows, path):
    series = OrderedDict()
    for r in rows:
        if r["bench"] != "threads":
            continue
        series.setdefault(f"{r['allocator']} ({r['backend']})", []).append(
            (int(r["param"]), r["ops_per_sec"]))
    if not series:
        return False
    W, H, L, R, T, B = 720, 440, 80, 200, 30, 50
    xs = sorted({x for s in series.values() for x, _ in s})
    ymax = max(y for s in series.values() for _, y in s) * 1.1
    import math
    # log2 x axis, linear y axis from 0.
    lx = [math.log2(x) for x in xs]
    x0, x1 = min(lx), max(lx) if max(lx) > min(lx) else min(lx) + 1

    def px(x):
        return L + (math.log2(x) - x0) / (x1 - x0) * (W - L - R)

    def py(y):
        return H - B - y / ymax * (H - T - B)

    colors = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"]
    o = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
         f'font-family="sans-serif" font-size="12">',
         f'<rect width="{W}" height="{H}" fill="white"/>',
         f'<text x="{W / 2 - 60}" y="18" font-size="14">64 KiB alloc+free pairs, N threads on N streams</text>',
         f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="black"/>',
         f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="black"/>',
         f'<text x="{(L + W - R) / 2 - 20}" y="{H - 12}">threads</text>',
         f'<text x="14" y="{(T + H - B) / 2}" transform="rotate(-90 14 {(T + H - B) / 2})">aggregate pairs/s</text>']
    for x in xs:
        o.append(f'<line x1="{px(x):.1f}" y1="{H - B}" x2="{px(x):.1f}" y2="{H - B + 5}" stroke="black"/>')
        o.append(f'<text x="{px(x) - 4:.1f}" y="{H - B + 18}">{x}</text>')
    for i in range(6):
        y = ymax * i / 5
        o.append(f'<line x1="{L - 5}" y1="{py(y):.1f}" x2="{W - R}" y2="{py(y):.1f}" stroke="#ddd"/>')
        o.append(f'<text x="{L - 8}" y="{py(y) + 4:.1f}" text-anchor="end">{fmt_rate(y).replace(" /s", "").replace("/s", "")}</text>')
    for i, (name, pts) in enumerate(series.items()):
        c = colors[i % len(colors)]
        pts = sorted(pts)
        d = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        o.append(f'<polyline points="{d}" fill="none" stroke="{c}" stroke-width="2"/>')
        for x, y in pts:
            o.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{c}"/>')
        o.append(f'<rect x="{W - R + 12}" y="{T + 20 * i}" width="12" height="12" fill="{c}"/>')
        o.append(f'<text x="{W - R + 30}" y="{T + 20 * i + 11}">{name}</text>')
    o.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(o) + "\n")
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("summary")
    ap.add_argument("--svg", help="write the thread-scaling plot here")
    ap.add_argument("--backend", action="append", help="only these backends (default: all)")
    a = ap.parse_args()
    rows, meta, notes = load(a.summary)
    backends = a.backend or list(OrderedDict((r["backend"], None) for r in rows))
    out = []
    if any(r["backend"] == "cuda" for r in rows):
        out.append("### Targets (cuda backend)\n")
        out.append(targets(rows))
    for backend in backends:
        out.append(f"### {backend} backend\n")
        for bench in BENCHES:
            t = table(rows, bench, backend)
            if t:
                out.append(t)
        for n in notes:
            if n.get("backend") != backend:
                continue
            if n["note"] == "cross_stream_reuse":
                out.append(f"- cross_stream {n['allocator']}: {n['reused'] * 100:.1f} % of allocations "
                           "got the address the other stream had just freed")
            elif n["note"] == "producer_consumer_reuse":
                out.append(f"- producer_consumer {n['param']} {n['allocator']}: {n['reused'] * 100:.1f} % of the "
                           "producer's allocations got the block a consumer freed in the round before; "
                           f"peak reserved {n['peak_reserved_bytes'] / 2**20:.1f} MiB over {n['rounds']} rounds")
            elif n["note"] == "trace_reserved_over_live":
                out.append(f"- trace {n['param']} {n['allocator']}: warm-pass peak reserved / peak live "
                           f"= {n['warm_ratio']:.3f}")
        out.append("")
    if meta:
        m = meta[0]
        out.append(f"_run: quick={m.get('quick')}, cpus={m.get('cpus')}, "
                   f"compute capability {m.get('compute_capability', '—')}, "
                   f"unix time {m.get('unix_time')}_\n")
    if a.svg:
        if svg(rows, a.svg):
            out.append(f"![thread scaling]({a.svg.split('/')[-1]})\n")
        else:
            print("no threads measurements: no SVG written", file=sys.stderr)
    print("\n".join(out))


if __name__ == "__main__":
    main()
