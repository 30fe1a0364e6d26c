#!/usr/bin/env python3
"""Differential check of placement: replay seeded synthetic traces of
shapes unlike the shipped ones through two `tidepool-replay` builds and
compare the counters that placement decides.

Usage: placement_diff.py BASE_REPLAY NEW_REPLAY [--seeds N] [--dir DIR]

Shapes (all written as `op,id,size,stream` CSV):
- huge-mix: huge blocks (256 MiB-1.2 GiB) alternating with big and medium
  ones over 3 streams with cross-stream frees and waits, so huge windows
  are searched among ghosts, pending frees and mixed holes;
- holes: thousands of small and medium blocks freed at random (many
  holes), with a few huge and big blocks between them;
- huge-only: huge blocks only, sizes not multiples of the page, freed out
  of order, the huge zone alone;
- stream-hop: blocks freed on another stream than their own and waits
  every few operations, 4 streams;
- oscillate: free runs rising past a few hundred and falling under ten;
- hover: small blocks of four sizes (ties among free runs) whose number
  of free runs drifts between about 20 and 150 many times.
Each trace is replayed with and without a tight capacity (OOMs allowed),
with and without a completion lag (frees stay pending), and under units
of several pages for big blocks.

Exit status 1 when any counter differs (each difference printed).

Caught: the huge zone's window search counting every ghost as coming
back (counters differ on huge-only, with and without lag and cap).
"""
import argparse
import json
import os
import random
import subprocess
import sys

MIB = 1 << 20
COUNTERS = [
    "remaps",
    "rebinds",
    "growths",
    "cache_hits",
    "pending_moves",
    "pending_unmaps",
    "peak_reserved_bytes",
    "ratio",
    "ooms",
]


def gen(shape, seed, steps):
    r = random.Random(f"{shape}/{seed}")
    lines = ["op,id,size,stream"]
    nid = [0]
    live = {}

    def alloc(size, s):
        nid[0] += 1
        live[nid[0]] = (size, s)
        lines.append(f"a,{nid[0]},{size},{s}")
        return nid[0]

    def free(i, s=None):
        size, own = live.pop(i)
        lines.append(f"f,{i},{size},{own if s is None else s}")

    def wait(a, b):
        if a != b:
            lines.append(f"w,{a},0,{b}")

    def huge():
        return r.randrange(256 * MIB, 1229 * MIB)

    if shape == "huge-mix":
        keep = []
        for _ in range(steps):
            step = []
            for _ in range(r.randrange(6, 14)):
                s = r.randrange(3)
                c = r.random()
                if c < 0.35:
                    size = huge()
                elif c < 0.65:
                    size = r.randrange(16 * MIB, 256 * MIB)
                else:
                    size = r.randrange(MIB, 16 * MIB)
                step.append((alloc(size, s), s))
                if r.random() < 0.3 and step:
                    i, own = step.pop(r.randrange(len(step)))
                    t = r.randrange(3)
                    if t != own:
                        wait(own, t)
                    free(i, t)
            r.shuffle(step)
            for i, own in step:
                if r.random() < 0.1:
                    keep.append(i)
                    continue
                t = own if r.random() < 0.7 else r.randrange(3)
                if t != own:
                    wait(own, t)
                free(i, t)
            while len(keep) > 4:
                free(keep.pop(r.randrange(len(keep))))
    elif shape == "holes":
        pool = []
        for _ in range(steps):
            for _ in range(r.randrange(100, 300)):
                c = r.random()
                if c < 0.7:
                    size = r.randrange(256, MIB)
                elif c < 0.95:
                    size = r.randrange(MIB, 16 * MIB)
                elif c < 0.985:
                    size = r.randrange(16 * MIB, 256 * MIB)
                else:
                    size = huge()
                pool.append(alloc(size, r.randrange(2)))
            r.shuffle(pool)
            for _ in range(len(pool) * 2 // 3):
                free(pool.pop())
        for i in pool:
            free(i)
    elif shape == "huge-only":
        held = []
        for _ in range(steps * 6):
            held.append(alloc(huge(), r.randrange(2)))
            if len(held) > r.randrange(2, 6):
                free(held.pop(r.randrange(len(held))))
        for i in held:
            free(i)
    elif shape == "stream-hop":
        held = []
        for _ in range(steps * 40):
            s = r.randrange(4)
            c = r.random()
            if c < 0.5:
                size = r.randrange(4096, 4 * MIB)
            elif c < 0.8:
                size = r.randrange(4 * MIB, 64 * MIB)
            elif c < 0.92:
                size = r.randrange(64 * MIB, 256 * MIB)
            else:
                size = huge()
            held.append(alloc(size, s))
            if r.random() < 0.2:
                wait(r.randrange(4), r.randrange(4))
            while len(held) > r.randrange(5, 25):
                i = held.pop(r.randrange(len(held)))
                t = r.randrange(4)
                if t != live[i][1] and r.random() < 0.5:
                    wait(live[i][1], t)
                free(i, t)
        for i in held:
            free(i)
    elif shape == "oscillate":
        # The number of free runs rises past a few hundred and falls back
        # under ten, again and again: small blocks between spacers freed
        # one by one (holes), then the spacers freed (holes merge).
        for _ in range(steps):
            n = r.randrange(20, 300)
            s = r.randrange(2)
            cells = [alloc(r.randrange(256, 600 * 1024), s) for _ in range(2 * n)]
            big = [alloc(r.choice([r.randrange(MIB, 16 * MIB), huge()]), s) for _ in range(r.randrange(1, 4))]
            for i in cells[::2]:
                free(i)
            refill = [alloc(r.randrange(256, 300 * 1024), 1 - s) for _ in range(n // 2)]
            for i in big:
                free(i, r.randrange(2))
            rest = cells[1::2] + refill
            r.shuffle(rest)
            for i in rest:
                free(i)
    elif shape == "hover":
        # Small blocks of four sizes (free runs of equal lengths: ties for
        # best fit) allocated and freed at random so that the number of
        # free runs drifts up past 150 and back under 20, again and again,
        # crossing any threshold in between many times; a huge or big
        # block now and then on another stream.
        cells = []
        sizes = [64 * 1024 * k for k in (1, 2, 3, 8)]
        for step in range(steps * 400):
            phase = (step // 300) % 2
            want_free = 0.35 if phase == 0 else 0.65
            if cells and r.random() < want_free:
                free(cells.pop(r.randrange(len(cells))))
            else:
                cells.append(alloc(r.choice(sizes), r.randrange(3)))
            if step % 97 == 0:
                b = alloc(r.choice([huge(), r.randrange(16 * MIB, 64 * MIB)]), 1)
                wait(0, 1)
                free(b, 1)
        for i in cells:
            free(i)
    else:
        raise ValueError(shape)
    return "\n".join(lines) + "\n"


def replay(binary, trace, extra):
    cmd = [
        binary,
        "--backend",
        "host",
        "--json",
        "--passes",
        "4",
        "--allocator",
        "tidepool",
        "--allow-oom",
        trace,
    ] + extra
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        return [f"exit {out.returncode}: {out.stderr[-500:]}"]
    rows = []
    for line in out.stdout.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        j = json.loads(line)
        rows.append({k: j.get(k, j.get("counters", {}).get(k)) for k in COUNTERS})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("new")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--dir", default="/tmp/placement-diff")
    ap.add_argument("--shapes", default="huge-mix,holes,huge-only,stream-hop,oscillate,hover")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    bad = 0
    runs = 0
    variants = [
        [],
        ["--lag", "40"],
        ["--capacity", "5G"],
        ["--capacity", "5G", "--lag", "25"],
        ["--unit-min", "16M", "--max-unit", "8M", "--lag", "10"],
    ]
    for shape in a.shapes.split(","):
        for seed in range(a.first_seed, a.first_seed + a.seeds):
            path = os.path.join(a.dir, f"{shape}-{seed}.csv")
            with open(path, "w") as f:
                f.write(f"# placement_diff.py shape {shape} seed {seed} steps {a.steps}\n")
                f.write(gen(shape, seed, a.steps))
            for extra in variants:
                runs += 1
                x = replay(a.base, path, extra)
                y = replay(a.new, path, extra)
                if x != y:
                    bad += 1
                    print(f"DIFF {path} {' '.join(extra)}\n  base {x}\n  new  {y}")
                    sys.stdout.flush()
            print(f"ok-so-far {shape} seed {seed} ({runs} replays, {bad} differ)")
            sys.stdout.flush()
    print(f"{runs} replay pairs, {bad} differ")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
